"""bench/gpu_check.py's quickstart step (docs/accelerators.md), run here on the CPU twice: the harness a GPU session
runs with `--quickstart MODEL` (cuda beside cpu) parses both reports and compares them."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO.parent / "shared" / "data" / "models" / "stories-llama-1m"

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
              pytest.mark.e2e]  # four whole runs (80 s on 2 cores): the end-to-end tier


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of an absent CUDA device")
def test_quickstart_pair_on_two_cpu_spellings():
    sys.path.insert(0, str(REPO))
    from bench.gpu_check import quickstart_pair

    light = ["--set", "stages.0.iters=2", "--set", "calibration.nsamples=4", "--set", "eval.max_tokens=512",
             "--set", "eval.generation.prompts=0"]
    out = quickstart_pair(str(MODEL), devices=("cpu", "auto"), extra=light)
    a, b = out["runs"]
    assert "error" not in a and "error" not in b, out
    assert a["kl"] == b["kl"] and out["kl_rel_diff"] == 0 and a["device_peak_mb"] is None
    bad = quickstart_pair(str(MODEL), devices=("cuda:3", "cpu"), extra=light)
    assert "is asked for" in bad["runs"][0]["error"] and "kl_rel_diff" not in bad
