import contextlib
import io
import logging
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(2, os.cpu_count() or 1))
if not torch.cuda.is_available():  # the Triton kernel's tests run in its CPU interpreter, chosen before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MODELS = DATA / "models"
TEXT = DATA / "text"


@pytest.fixture(scope="session")
def data_dir():
    if not DATA.exists():
        pytest.fail(f"shared data not found at {DATA}; the repository must sit beside shared/")
    return DATA


def invoke(*args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `compress ARGS` run in this process from the repository root
    (recipes name their data relative to it); the root logger, which `cli` reconfigures per command,
    is restored afterwards."""
    import cli

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level, cwd = list(root.handlers), root.level, os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main([str(a) for a in args])
    finally:
        os.chdir(cwd)
        root.handlers[:] = handlers
        root.setLevel(level)
    return rc, out.getvalue(), err.getvalue()
