"""smooth/awq in recipes: before rtn, gptq and autoround, after the Walsh rotation, on llama.cpp grids; a finished run
resumes bit-identically without calibrating again, an interrupted one continues from its last saved block; the plan
refuses what cannot be smoothed."""

from __future__ import annotations

import json

import pytest
from helpers import tensor_hashes

from compress.smooth import awq
from tests.conftest import MODELS, REPO, invoke

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

MODEL = MODELS / "stories-llama-1m"  # 4 blocks, hidden 128
SMALL = ["--set", "calibration.nsamples=8", "--set", "calibration.seqlen=64", "--set", "eval.enabled=false"]
AWQ = "{stage: smooth, method: awq}"
QUANT = {"rtn": "{stage: quantize, method: rtn, bits: 3, group_size: 32, sym: false}",
         "gptq": "{stage: quantize, method: gptq, bits: 3, group_size: 32, sym: false}",
         "autoround": "{stage: quantize, method: autoround, bits: 3, group_size: 32, sym: false, iters: 2, "
                      "batch_size: 4}"}


def run(out, *stages, extra=()):
    sets = ["--set", f"stages=[{', '.join(stages)}]"]
    rc, stdout, err = invoke("run", REPO / "recipes" / "w4-gptq.yaml", "--model", MODEL, "--output", out, "--json",
                             *SMALL, *sets, *extra)
    return rc, (json.loads(stdout) if rc == 0 else None), err


@pytest.mark.parametrize("method", [m if m == "rtn" else pytest.param(m, marks=pytest.mark.e2e) for m in sorted(QUANT)])
def test_awq_composes_with_each_quantizer(method, tmp_path):
    rc, rep, err = run(tmp_path / "a", AWQ, QUANT[method])
    assert rc == 0, err
    assert [s["name"] for s in rep["stages"] if "resumed" in s] == ["smooth", "quantize"]
    rc, _, err = run(tmp_path / "b", QUANT[method])
    assert rc == 0, err
    assert tensor_hashes(tmp_path / "a") != tensor_hashes(tmp_path / "b")  # the smoothing reached the export
    metrics = json.loads((tmp_path / "a" / "manifest.json").read_text())["stages"]["00-smooth-awq"]["metrics"]
    # clip: auto clips before rtn only (GPTQ and AutoRound fit what they are given: bench/awq-ref-llama-7m.md)
    assert metrics["fold_error"] < 1e-5 and metrics["clipped_layers"] == (4 * 5 if method == "rtn" else 0)


@pytest.mark.e2e
def test_rotation_then_awq_then_gptq_resumes_bit_identically(tmp_path):
    stages = ("{stage: rotate, method: walsh}", AWQ, QUANT["gptq"])
    rc, _, err = run(tmp_path / "o", *stages)
    assert rc == 0, err
    first = tensor_hashes(tmp_path / "o")
    rc, rep, err = run(tmp_path / "o", *stages, extra=["--resume"])
    assert rc == 0, err
    assert [s["resumed"] for s in rep["stages"] if "resumed" in s] == [True, True, True]
    assert tensor_hashes(tmp_path / "o") == first
    log = (tmp_path / "o" / "run.log").read_text()
    assert "smooth/awq: the scales and clipping bounds of 4 of 4 blocks are loaded" in log


@pytest.mark.e2e
def test_interrupted_awq_continues_from_its_last_block(tmp_path, monkeypatch):
    stages = (AWQ, QUANT["rtn"])
    rc, _, err = run(tmp_path / "whole", *stages)
    assert rc == 0, err
    save, calls = awq._save, []

    def failing_save(ctx, i, scales, clips):
        save(ctx, i, scales, clips)
        calls.append(i)
        if i == 1:
            raise RuntimeError("simulated crash after block 1")

    monkeypatch.setattr(awq, "_save", failing_save)
    rc, _, err = run(tmp_path / "o", *stages)
    assert rc != 0 and "simulated crash" in err
    monkeypatch.setattr(awq, "_save", save)
    rc, _, err = run(tmp_path / "o", *stages, extra=["--resume"])
    assert rc == 0, err
    metrics = json.loads((tmp_path / "o" / "manifest.json").read_text())["stages"]["00-smooth-awq"]["metrics"]
    assert metrics["resumed_blocks"] == 2
    assert tensor_hashes(tmp_path / "o") == tensor_hashes(tmp_path / "whole")


@pytest.mark.e2e
def test_awq_on_llama_cpp_grids(tmp_path):
    """Before `gguf: Q4_0` the scales are searched against llama.cpp's own fit; no clipping, and the plan says so."""
    q = "{stage: quantize, method: rtn, gguf: Q4_0}"
    rc, stdout, err = invoke("run", REPO / "recipes" / "w4-gptq.yaml", "--model", MODEL, "--output", tmp_path / "o",
                             *SMALL, "--set", f"stages=[{AWQ}, {q}]", "--set", "export.formats=[gguf]", "--dry-run")
    assert rc == 0, err
    assert "no clipping search on llama.cpp's grids" in stdout + err
    rc, _, err = run(tmp_path / "o", AWQ, q, extra=["--set", "export.formats=[gguf]"])
    assert rc == 0, err
    metrics = json.loads((tmp_path / "o" / "manifest.json").read_text())["stages"]["00-smooth-awq"]["metrics"]
    assert metrics["clipped_layers"] == 0 and sum(metrics["scaled"].values()) > 0


@pytest.mark.parametrize("stages, why", [
    ((AWQ,), "add one after it"),
    ((QUANT["rtn"], AWQ), "smoothing must run before quantization"),
    ((AWQ, "{stage: rotate, method: walsh}", QUANT["rtn"]), "rotate first"),
])
def test_plan_refuses(stages, why, tmp_path):
    rc, _, err = run(tmp_path / "o", *stages, extra=["--dry-run"])
    assert rc != 0 and why in err
