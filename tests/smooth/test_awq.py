"""smooth/awq: the scaling is exact in full precision on every family whose adapter names the norm-to-linear pairs
(float64), refused on the others at plan time; it lowers the rounding error it searches against; it composes with
rtn, gptq, autoround and the Walsh rotation in recipes, and a finished or interrupted run resumes bit-identically."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compress import registry
from compress.driver import LayerSpec
from compress.errors import BadInput
from compress.models.adapters import ModelAdapter
from compress.primitives import fake_quantize
from compress.smooth.awq import AWQConfig
from compress.smooth.fold import available
from tests.rotating import exact_rmsnorm, ids
from tests.tiny import tiny_causal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SMOOTHED = ["llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "mixtral", "qwen3_moe", "gemma2", "gemma3_text",
            "granite", "phi3", "deepseek_v3"]


class _Bar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def smooth(model, vocab=128, bits=3, group=16, sym=False, **cfg):
    """Apply smooth/awq through its registration with the next quantize stage's rounding given as facts."""
    adapter = ModelAdapter(model)
    tokens = torch.randint(0, vocab, (8, 32), generator=torch.Generator().manual_seed(1))
    layers = {n: LayerSpec(bits, group, sym) for i in range(len(adapter.blocks))
              for n in adapter.block_linears(i)}
    facts = SimpleNamespace(rounding=(bits, group, sym), layers=layers, grid=None, notes=[])
    cfg = AWQConfig(**cfg)
    registry.get("smooth", "awq").check(adapter, cfg, facts)
    ctx = SimpleNamespace(adapter=adapter, calibration_tokens=lambda: tokens, facts=facts, key="00-smooth-awq",
                          progress=lambda **kw: _Bar(), workspace=None)
    return registry.get("smooth", "awq").apply(ctx, cfg), facts


def _exact_gemma_norms(model):
    """Gemma's RMSNorm in the input dtype (transformers computes it in float32): a float64 test can demand 1e-10."""
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and "Gemma" in type(m).__name__:
            m.forward = (lambda mod: lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps)
                         * (1.0 + mod.weight))(m)
    return model


@pytest.mark.parametrize("model_type", SMOOTHED)
def test_scaling_is_exact_in_float64(model_type):
    model = _exact_gemma_norms(exact_rmsnorm(tiny_causal(model_type, dtype=torch.float64)))
    ModelAdapter(model)  # per-expert linears before the reference (fused experts refuse float64)
    x = ids(128)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(x).logits
        metrics, _ = smooth(model, clip=False)
        after = model(x).logits
    # DeepSeek's router scores in float32 whatever the model's dtype: its scaled columns round there (~1e-8)
    tol = 1e-7 if model_type == "deepseek_v3" else 1e-10
    assert ((after - before).norm() / before.norm()).item() < tol
    assert metrics["fold_error"] < tol
    assert sum(metrics["scaled"].values()) > 0  # it did something
    assert any(not torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_gemma_norms_fold_through_one_plus_weight():
    """Gemma scales by 1 + w: dividing w alone by s would change the model."""
    model = _exact_gemma_norms(tiny_causal("gemma3_text", dtype=torch.float64))
    x = ids(128)
    with torch.no_grad():
        before = model(x).logits
        smooth(model, clip=False, groups=["attn_in"])
        after = model(x).logits
    assert ((after - before).norm() / before.norm()).item() < 1e-10


@pytest.mark.parametrize("model_type", ["olmo2"])
def test_architectures_without_pre_norms_are_refused(model_type):
    model = tiny_causal(model_type)
    with pytest.raises(BadInput, match="names none"):
        smooth(model)


@pytest.mark.parametrize("consumer, clip", [("rtn", True), ("gptq", False), ("autoround", False)])
def test_clip_auto_follows_the_quantizer(consumer, clip):
    facts = SimpleNamespace(consumer=consumer, rounding=(4, 32, True), grid=None, notes=[])
    cfg = registry.get("smooth", "awq").check(ModelAdapter(tiny_causal("llama")), AWQConfig(), facts)
    assert cfg.clip is clip and f"clip: auto -> {str(clip).lower()}" in facts.notes[-1]


def test_fused_projections_are_said_at_plan_time():
    """phi3 fuses q/k/v and gate/up: only the norm groups exist, and the plan says so."""
    model = tiny_causal("phi3")
    assert available(ModelAdapter(model)) == {"attn_in", "mlp_in"}
    metrics, facts = smooth(model)
    assert any("phi3" in n and "up_down" in n for n in facts.notes)
    assert set(metrics["scaled"]) <= {"attn_in", "mlp_in"}


def layer_errors(model, x, error) -> float:
    """`error(linear, input, output)` summed over every block linear on the model's own activations."""
    err, hooks = [0.0], []
    for m in model.model.layers.modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_hook(lambda mod, args, out: err.__setitem__(
                0, err[0] + error(mod, args[0], out))))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return err[0]


def _rounding_error(model, x, bits, group, sym):
    """Output error of round-to-nearest of every block linear, summed."""
    return layer_errors(model, x, lambda mod, inp, _out: float(
        ((inp @ (mod.weight - fake_quantize(mod.weight, bits, group, sym)).T) ** 2).sum()))


def test_scales_lower_the_error_they_search_against():
    """On a model with outlier input channels (what AWQ is for), RTN's output error drops after smoothing, more with
    the clipping search; the scaling itself leaves the full-precision logits unchanged (float32 round-off)."""
    model = tiny_causal("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    with torch.no_grad():  # a few loud channels in the residual stream, as real LLMs have
        model.model.embed_tokens.weight[:, :4] *= 30
    x = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    base = _rounding_error(model, x, 3, 32, False)
    with torch.no_grad():
        ref = model(ids(128)).logits
    smoothed = tiny_causal("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    smoothed.load_state_dict(model.state_dict())
    metrics, _ = smooth(smoothed, bits=3, group=32, clip=False)
    with torch.no_grad():
        assert ((smoothed(ids(128)).logits - ref).norm() / ref.norm()).item() < 1e-5
    scaled = _rounding_error(smoothed, x, 3, 32, False)
    assert metrics["fold_error"] < 1e-5
    assert scaled < 0.9 * base
    clipped = tiny_causal("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    clipped.load_state_dict(model.state_dict())
    metrics, _ = smooth(clipped, bits=3, group=32, clip=True)
    assert metrics["clipped_layers"] == 2 * 5  # v, o, gate, up, down per block; q/k are not clipped
    assert metrics["clip_ratio_mean"] < 1.0
