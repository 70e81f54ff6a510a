"""`compress run --resume`: a run killed with SIGKILL mid-stage resumes to the same bytes as an
uninterrupted run, without recomputing finished blocks; runs are deterministic for a seed.

The killed run is a subprocess (console script); the others run in-process through `cli.main`
with the same number of torch threads, so every run computes with the same kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import MODELS, REPO, invoke
from helpers import tensor_hashes

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
              pytest.mark.e2e]  # whole runs killed and resumed: the end-to-end tier (CI runs -m e2e)

W2 = REPO / "recipes" / "w2-autoround.yaml"
MODEL = MODELS / "stories-llama-1m"  # 4 blocks
KEY = "00-quantize-autoround"
SMALL = ["--set", "calibration.nsamples=8", "--set", "calibration.seqlen=64", "--set", "eval.enabled=false"]
SLOW_BLOCKS = [*SMALL, "--set", "stages.0.iters=100"]  # ~1.5 s per block on an idle 2-core machine


def run_ok(out: Path, *extra) -> dict:
    rc, stdout, err = invoke("run", W2, "--model", MODEL, "--output", out, "--json", *extra)
    assert rc == 0, err
    return json.loads(stdout)


def block_files(out: Path) -> dict[str, tuple[int, int]]:
    """block file name -> (inode, mtime_ns): a rewritten checkpoint gets a new inode (atomic rename)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted((out / "stages" / KEY).glob("block_*.safetensors"))}


def compress_command() -> list[str]:
    exe = shutil.which("compress")
    return [exe] if exe else [sys.executable, "-c", "from compress import cli; cli.entry()"]


# -- kill, then resume ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run SIGKILLed right after block 1's checkpoint appeared: (output dir, block files at the kill)."""
    out = tmp_path_factory.mktemp("resume") / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1"}
    log = out.parent / "killed.stderr"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            compress_command() + ["run", str(W2), "--model", str(MODEL), "--output", str(out), "--quiet",
                                  *SLOW_BLOCKS],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
        target = out / "stages" / KEY / "block_0001.safetensors"
        deadline = time.time() + 300
        try:
            while not target.exists():
                if proc.poll() is not None:
                    pytest.fail(f"run exited ({proc.returncode}) before block 1 finished:\n{log.read_text()}")
                if time.time() > deadline:
                    pytest.fail("block 1 did not finish within 300 s")
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return out, block_files(out)


@pytest.fixture(scope="module")
def resumed(killed):
    out, _ = killed
    report = run_ok(out, "--resume", *SLOW_BLOCKS)
    return out, report


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "uninterrupted"
    t0 = time.time()
    report = run_ok(out, *SLOW_BLOCKS)
    return out, report, time.time() - t0


def test_kill_leaves_only_whole_files(killed):
    from compress.workspace import Workspace

    out, blocks = killed
    assert {"block_0000.safetensors", "block_0001.safetensors"} <= set(blocks)
    assert "block_0003.safetensors" not in blocks, "the run was not interrupted mid-stage"
    visible_tmp = [p for p in out.rglob("*") if ".tmp" in p.name and not p.name.startswith(".")]
    assert not visible_tmp
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"][KEY]["status"] == "running"
    assert not (out / "report.json").exists() and not (out / "hf").exists()
    with Workspace(out, resume=True) as ws:
        for i in range(len(blocks)):
            qweights = ws.load_block(KEY, i)  # every visible checkpoint is complete and readable
            assert len(qweights) == 7 and all(q.bits == 2 and q.group_size == 64 and not q.sym
                                              for q in qweights.values())


def test_resume_matches_an_uninterrupted_run(killed, resumed, uninterrupted):
    out, blocks_at_kill = killed
    _, report = resumed
    after = block_files(out)
    assert sorted(after) == [f"block_{i:04d}.safetensors" for i in range(4)]
    for name, stat in blocks_at_kill.items():  # finished blocks were loaded, not recomputed
        assert after[name] == stat, name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"][KEY]["status"] == "done"
    assert report["recipe_sha256"] == uninterrupted[1]["recipe_sha256"]
    assert tensor_hashes(out) == tensor_hashes(uninterrupted[0])


def test_resume_of_a_finished_run_recomputes_nothing(uninterrupted):
    out, first, first_seconds = uninterrupted
    hashes, blocks = tensor_hashes(out), block_files(out)
    stage_seconds = json.loads((out / "manifest.json").read_text())["stages"][KEY]["seconds"]
    t0 = time.time()
    report = run_ok(out, "--resume", *SLOW_BLOCKS)
    elapsed = time.time() - t0
    q = next(s for s in report["stages"] if s["name"] == "quantize")
    assert q["resumed"] is True and q["seconds"] == stage_seconds
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"][KEY]["status"] == "done"
    assert "finished earlier: its hand-offs are loaded" in (out / "run.log").read_text()
    assert block_files(out) == blocks
    assert tensor_hashes(out) == hashes
    assert elapsed < first_seconds and elapsed < stage_seconds, (elapsed, first_seconds, stage_seconds)


# -- determinism ---------------------------------------------------------------------------------------
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    fast = [*SMALL, "--set", "stages.0.iters=5"]
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        report = run_ok(tmp_path / name, *fast, "--seed", seed)
        runs[name] = tensor_hashes(tmp_path / name)
        assert json.loads((tmp_path / name / "manifest.json").read_text())["recipe"]["calibration"]["seed"] == seed
        assert report["size"]["effective_bits"] is not None
    assert runs["a"] == runs["b"]
    quantized = [k for k in runs["a"] if k.endswith(".qweight")]
    # a block whose best loss is its starting point keeps plain rounding whatever the data, so only
    # some layers need differ
    assert quantized and any(runs["a"][k] != runs["c"][k] for k in quantized)
    unchanged = [k for k in runs["a"] if k.endswith("norm.weight") or "embed" in k]
    assert unchanged and all(runs["a"][k] == runs["c"][k] for k in unchanged)
