import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CI=true (set by CI systems, and by .ci/run) turns on CI mode in every `compress run`; the tests that check CI mode
# set it themselves, the others check the interactive output
os.environ.pop("CI", None)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# two threads per process; under pytest-xdist (`-n 2`, the default addopts) the cores are shared between workers
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
if not torch.cuda.is_available():  # the Triton kernel's tests run in its CPU interpreter, chosen before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MODELS = DATA / "models"
TEXT = DATA / "text"
STORIES260K = MODELS / "stories260K"
CAL = TEXT / "tinystories" / "tinystories_val.txt"


@pytest.fixture(scope="session")
def data_dir():
    if not DATA.exists():
        pytest.fail(f"shared data not found at {DATA}; the repository must sit beside shared/")
    return DATA


def invoke(*args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `compress ARGS` run in this process from the repository root
    (recipes name their data relative to it)."""
    from compress import cli

    return in_process(cli.main, args)


def in_process(main, args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a command line's `main(argv)` run in this process from the repository root;
    the root logger, which the command reconfigures, is restored afterwards."""
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level, cwd = list(root.handlers), root.level, os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([str(a) for a in args])
    finally:
        os.chdir(cwd)
        root.handlers[:] = handlers
        root.setLevel(level)
    return rc, out.getvalue(), err.getvalue()


def recipe(tmp: Path, *, method="rtn", cal: Path = CAL, formats=("hf",), eval_data=(), extra_stages=()) -> Path:
    """A new small recipe file in `tmp`: stories260K, `method` at W4 g32, 8 x 64 calibration tokens, absolute
    paths (runs from any directory), no greedy-continuation evaluation."""
    stages = [{"stage": "quantize", "method": method, "bits": 4, "group_size": 32}, *extra_stages]
    doc = {"version": 1, "model": {"path": str(STORIES260K)},
           "calibration": {"sources": [str(cal)], "nsamples": 8, "seqlen": 64},
           "stages": stages, "eval": {"data": [str(p) for p in eval_data], "max_tokens": 512,
                                      "generation": {"prompts": 0}},
           "export": {"formats": list(formats)}}
    path = tmp / f"recipe-{len(list(tmp.glob('recipe-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run(*args) -> tuple[int, str]:
    """(exit code, stderr) of `compress run ARGS --quiet`, in this process."""
    rc, _, err = invoke("run", *args, "--quiet")
    return rc, err


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def held_lock(path: Path):
    """Another process holding an exclusive flock on `path` with its pid written in it, as a live run or
    kernel build does; yields that pid and kills the process on exit (which releases the lock)."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def plan_path(out: Path) -> Path:
    """The allocation plan of a run: in its allocate stage's directory."""
    return next((Path(out) / "stages").glob("*-allocate-*/plan.json"))
