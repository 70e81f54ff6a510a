"""The evaluation-only research modes of rotate/walsh (`mode: spectral`, compress/rotation/research.py) and
auto-round's Hadamard baseline: exact in full precision, evaluated in memory, refused with an export."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from compress.errors import BadInput as BadInputErr
from compress.models.adapters import ModelAdapter
from compress.rotation import walsh
from compress.rotation.walsh import WalshConfig
from tests.conftest import MODELS
from tests.rotating import CONFIGS, exact_rmsnorm, ids, rel, rotate
from tests.tiny import tiny_causal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("pad", ["pow2", "none"])
def test_spectral_padding_grows_the_rounded_weight_unless_pad_none(pad):
    """stories260K's down_proj reads 172 columns: pow2 rounds 256 of them (+84 per row), pad: none a
    Williamson H_172, both exact in float64."""
    model = exact_rmsnorm(AutoModelForCausalLM.from_pretrained(MODELS / "stories260K", dtype=torch.float64).eval())
    x = ids(model.config.vocab_size, 64)
    with torch.no_grad():
        before = model(x).logits
        metrics = rotate(model, model.config.vocab_size, fused=False, mode="spectral", pad=pad)
        after = model(x).logits
    assert rel(after, before) < 1e-10
    down = model.model.layers[0].mlp.down_proj[-1]
    assert down.in_features == {"pow2": 256, "none": 172}[pad]
    assert metrics["padded_weights"] == {"pow2": 5 * 64 * (256 - 172), "none": 0}[pad]


def test_pad_none_refuses_sizes_without_a_hadamard_matrix():
    model = tiny_causal("llama")
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(100, 64, bias=False)  # 100 = 25 * 4: no H_25
    with pytest.raises(BadInputErr, match=r"pad: none.*layers\.0\.mlp\.down_proj.*size 100"):
        walsh.check(ModelAdapter(model), WalshConfig(fused=False, mode="spectral", pad="none"))
    walsh.check(ModelAdapter(model), WalshConfig(fused=False, mode="spectral"))
    with pytest.raises(ValidationError, match="pad applies"):
        WalshConfig(pad="none")


@pytest.mark.e2e  # moved out of the default tier (its time budget); CI runs -m e2e
def test_spectral_mode_runs_in_memory_and_refuses_export(tmp_path):
    """Mode spectral quantizes the transformed linears (d_pad inputs) and evaluates in memory; with an
    export format the plan refuses it before loading the model."""
    import json

    from tests.conftest import REPO, invoke

    args = ["run", REPO / "recipes" / "w2-walsh-autoround.yaml", "--model", MODELS / "stories260K", "--json",
            "--set", "stages.0.mode=spectral", "--set", "calibration.nsamples=4", "--set", "calibration.seqlen=64",
            "--set", "stages.1.iters=2", "--set", "stages.1.group_size=32", "--set", "eval.max_tokens=256"]
    rc, _, err = invoke(*args, "--output", tmp_path / "a")
    assert rc != 0 and "`mode: spectral`, a run-time input transform" in err and "no exporter writes" in err
    rc, stdout, err = invoke(*args, "--output", tmp_path / "b", "--set", "export.formats=[]")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["size"]["quantized_layers"] == 5 * 7
    ev = next(iter(report["eval"].values()))
    assert ev["tokens"] == 256 and 1.0 < ev["ppl_ratio"] < float("inf")


def test_spectral_mode_is_exact_on_the_minilm_encoder(tmp_path_factory):
    """mode spectral touches no norm, so it also runs on the post-LayerNorm MiniLM encoder (float64);
    the norm-absorbing modes refuse it with a pointer to spectral."""
    from transformers import AutoModel

    from compress.errors import BadInput
    from compress.models.loading import cache_dir
    from compress.models.minilm import ensure_minilm

    model = AutoModel.from_pretrained(ensure_minilm(cache_dir()), dtype=torch.float64).eval()
    x = ids(model.config.vocab_size, 32)
    with torch.no_grad():
        before = model(input_ids=x).last_hidden_state
        metrics = rotate(model, model.config.vocab_size, **CONFIGS["spectral"])
        after = model(input_ids=x).last_hidden_state
    assert metrics["spectral_linears"] == 6 * 6 and rel(after, before) < 1e-10
    with pytest.raises(BadInput, match="mode: spectral"):
        walsh.check(ModelAdapter(model), WalshConfig(fused=False))


@pytest.mark.e2e  # moved out of the default tier (its time budget); CI runs -m e2e
def test_autoround_hadamard_baseline_is_exact_in_fp_and_refuses_export(tmp_path):
    """rotate/autoround_hadamard (auto-round's QuaRot inplace rotation, online hooks kept): an 8-bit RTN
    after it stays at the FP perplexity, so the rotation (hooks included) is an exact re-parametrisation;
    with an export format the plan refuses it before loading the model."""
    import json

    from tests.conftest import REPO, invoke

    base = ["run", REPO / "recipes" / "w2-walsh-autoround.yaml", "--model", MODELS / "stories-llama-1m",
            "--set", "stages.0={stage: rotate, method: autoround_hadamard}", "--set", "calibration.nsamples=4",
            "--set", "calibration.seqlen=32", "--set", "eval.max_tokens=1024", "--set", "eval.generation.prompts=0"]
    rc, stdout, err = invoke(*base, "--output", tmp_path / "a", "--json", "--set", "export.formats=[]",
                             "--set", "stages.1={stage: quantize, method: rtn, bits: 8, group_size: 64}")
    assert rc == 0, err
    report = json.loads(stdout)
    ev = next(iter(report["eval"].values()))
    assert abs(ev["ppl_ratio"] - 1) < 0.01 and ev["top1"] > 0.97
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["stages"]["00-rotate-autoround_hadamard"]["metrics"]["online_hooks"] > 0
    rc, _, err = invoke(*base, "--output", tmp_path / "b", "--dry-run")
    assert rc != 0 and "no exporter writes" in err
