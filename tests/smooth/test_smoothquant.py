"""smooth/smoothquant: the smoothing is exact in full precision (float64) on the families whose adapter names the
norm-to-linear pairs; on a model with outlier channels it lowers the served W8A8 arithmetic's error it searches
against; it is refused before a weight-only quantize stage; in a recipe it runs before GPTQ's w8a8-int8 weights and
a finished run resumes bit-identically without calibrating again."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import tensor_hashes

from compress import registry
from compress.driver import LayerSpec
from compress.errors import BadInput
from compress.models.adapters import ModelAdapter
from compress.quantize.activations import SCHEME_ACTIVATIONS, fake_quant
from compress.smooth.fold import rounded
from compress.smooth.smoothquant import SmoothQuantConfig
from tests.conftest import MODELS, invoke
from tests.rotating import exact_rmsnorm, ids
from tests.smooth.test_awq import _Bar, _exact_gemma_norms, layer_errors
from tests.tiny import tiny_causal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

W8 = LayerSpec(8, -1, True)


def smooth(model, vocab=128, scheme="w8a8-int8", **cfg):
    adapter = ModelAdapter(model)
    tokens = torch.randint(0, vocab, (8, 32), generator=torch.Generator().manual_seed(1))
    layers = {n: W8 for i in range(len(adapter.blocks)) for n in adapter.block_linears(i)}
    facts = SimpleNamespace(rounding=(8, -1, True), layers=layers, grid=None, scheme=scheme, notes=[])
    cfg = SmoothQuantConfig(**cfg)
    registry.get("smooth", "smoothquant").check(adapter, cfg, facts)
    ctx = SimpleNamespace(adapter=adapter, calibration_tokens=lambda: tokens, facts=facts,
                          key="00-smooth-smoothquant", progress=lambda **kw: _Bar(), workspace=None)
    return registry.get("smooth", "smoothquant").apply(ctx, cfg), facts


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma3_text", "phi3"])
def test_smoothing_is_exact_in_float64(model_type):
    model = _exact_gemma_norms(exact_rmsnorm(tiny_causal(model_type, dtype=torch.float64)))
    ModelAdapter(model)
    x = ids(128)
    with torch.no_grad():
        before = model(x).logits
        metrics, _ = smooth(model, alpha=0.5, groups=["attn_in", "mlp_in", "up_down", "v_o"])
        after = model(x).logits
    assert ((after - before).norm() / before.norm()).item() < 1e-10
    assert metrics["fold_error"] < 1e-10 and metrics["scaled"].get("attn_in", 0) > 0
    assert metrics["alphas"] == {"0.5": sum(metrics["alphas"].values())}


def _served_error(model, x):
    """Relative output error of W8A8 (per-token int8 inputs, per-channel int8 weights) of every block linear."""
    act = SCHEME_ACTIVATIONS["w8a8-int8"]

    def error(mod, inp, out):
        y = fake_quant(inp, act) @ rounded(mod.weight.float(), W8).T
        return float((y - out).pow(2).sum() / out.pow(2).sum())
    return layer_errors(model, x, error)


def test_searched_smoothing_lowers_the_served_error():
    """A few loud residual channels (what SmoothQuant is for) make per-token int8 inputs lose the quiet ones; the
    searched scales lower W8A8's error on held-out tokens, and the full-precision logits stay (float32 round-off)."""
    model = tiny_causal("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, :4] *= 50
    held_out = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(7))
    base = _served_error(model, held_out)
    with torch.no_grad():
        ref = model(ids(128)).logits
    metrics, _ = smooth(model)
    with torch.no_grad():
        assert ((model(ids(128)).logits - ref).norm() / ref.norm()).item() < 1e-5
    assert metrics["error"] < 0.7 * metrics["error_identity"]
    assert "identity" not in metrics["alphas"] or metrics["alphas"]["identity"] < 4
    assert _served_error(model, held_out) < 0.8 * base


def test_refused_without_an_activation_scheme():
    with pytest.raises(BadInput, match="use `smooth/awq` for weight-only"):
        smooth(tiny_causal("llama"), scheme=None)
    with pytest.raises(ValueError, match="alpha must be"):
        SmoothQuantConfig(alpha=1.5)


MODEL = MODELS / "stories-llama-1m"


def _recipe(tmp_path, stages):
    p = tmp_path / "r.yaml"
    p.write_text(f"""
version: 1
model: {{path: {MODEL}, dtype: float32}}
calibration: {{sources: [bundled:botchan-calibration], nsamples: 8, seqlen: 64}}
stages: [{', '.join(stages)}]
eval: {{data: [bundled:botchan-eval], max_tokens: 1024, generation: {{prompts: 0}}}}
export: {{formats: [{{format: compressed-tensors, dtype: float32}}]}}
""")
    return p


@pytest.mark.parametrize("scheme", ["w8a8-int8", "fp8"])
def test_smoothquant_then_gptq_w8a8_resumes_bit_identically(tmp_path, scheme):
    """SmoothQuant's search against the scheme's arithmetic (int8 or E4M3 activations and weights) never raises its
    error, and a resumed run writes the same checkpoint."""
    pytest.importorskip("compressed_tensors", reason="the `export` extra (CI installs it)")
    r = _recipe(tmp_path, ["{stage: smooth, method: smoothquant}",
                           f"{{stage: quantize, method: gptq, scheme: {scheme}}}"])
    rc, out, err = invoke("run", r, "--output", tmp_path / "o", "--json")
    assert rc == 0, err
    first = tensor_hashes(tmp_path / "o", "compressed-tensors")
    metrics = json.loads((tmp_path / "o" / "manifest.json").read_text())["stages"]["00-smooth-smoothquant"]["metrics"]
    assert metrics["fold_error"] < 1e-5 and metrics["error"] <= metrics["error_identity"]
    rc, out, err = invoke("run", r, "--output", tmp_path / "o", "--json", "--resume")
    assert rc == 0, err
    assert [s["resumed"] for s in json.loads(out)["stages"] if "resumed" in s] == [True, True]
    assert tensor_hashes(tmp_path / "o", "compressed-tensors") == first
    bad = _recipe(tmp_path, ["{stage: smooth, method: smoothquant}", "{stage: quantize, method: rtn, bits: 8}"])
    rc, _, err = invoke("run", bad, "--output", tmp_path / "b", "--dry-run")
    assert rc == 1 and "set `scheme: w8a8-int8` or `fp8` there" in err, err
