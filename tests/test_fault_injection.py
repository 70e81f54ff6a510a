"""Fault injection (slow tier): SIGKILL a small run at 20 seeded random moments; each resume must give the same
bytes as an uninterrupted run, leave no staging file behind, and pass `compress verify`. The killed runs are
processes of their own; the resumes and verifications run in this process (as `compress` would, without paying
a fresh interpreter's imports each time: 20 trials took 630 s that way on 2 cores, 2026-12-07).

`tests/test_resume.py` kills at one chosen moment (mid-stage) in the default tier; this covers the others:
while loading, between blocks, while writing a checkpoint or the manifest, during each export.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, invoke, recipe

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")]

TRIALS = int(os.environ.get("COMPRESS_FAULT_TRIALS", 20))


def _command() -> list[str]:
    exe = shutil.which("compress")
    return [exe] if exe else [sys.executable, "-c", "from compress import cli; cli.entry()"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1"}


def _run(r: Path, out: Path, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(_command() + ["run", str(r), "--output", str(out), "--quiet", *flags], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=600)


def _artifacts(out: Path) -> dict[str, bytes]:
    return {rel: (out / rel).read_bytes() for rel in ("hf/model.safetensors", "onnx/model.onnx")}


def test_sigkill_anywhere_then_resume_is_bit_identical_and_clean(tmp_path):
    r = recipe(tmp_path, method="gptq", formats=("hf", "onnx"))
    clean = tmp_path / "clean"
    t0 = time.time()
    done = _run(r, clean)
    assert done.returncode == 0, done.stderr
    duration = time.time() - t0
    expected = _artifacts(clean)
    rng = random.Random(0)
    moments = set()
    for trial in range(TRIALS):
        out = tmp_path / f"trial-{trial}"
        proc = subprocess.Popen(_command() + ["run", str(r), "--output", str(out), "--quiet"], cwd=REPO, env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, duration))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        moment = _moment(out)
        moments.add(moment)
        if moment == "finished":  # the machine got faster than during the clean run: draw earlier kills
            duration = max(1.0, 0.7 * duration)
        rc, _, err = invoke("run", r, "--output", out, "--quiet", "--resume")
        assert rc == 0, (trial, err)
        assert _artifacts(out) == expected, trial
        stray = [p for p in out.rglob("*") if p.name.endswith((".tmp", ".old")) or p.name == ".compress.lock"]
        assert not stray, (trial, stray)
        rc, _, err = invoke("verify", out)
        assert rc == 0, (trial, err)
        shutil.rmtree(out)
    assert len(moments) >= 3, moments  # the kills landed at different points of the run


def _moment(out: Path) -> str:
    """Where a killed run was: before the workspace, quantizing, after quantizing, or finished."""
    manifest = out / "manifest.json"
    if not manifest.is_file():
        return "starting"
    if (out / "report.json").is_file():
        return "finished"
    stages = json.loads(manifest.read_text()).get("stages", {})
    return "exporting" if stages and all(s.get("status") == "done" for s in stages.values()) else "quantizing"
