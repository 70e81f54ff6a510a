"""rotate/infoquant (InfoQuant's PSOT): exact in float64 (the learned matrices are orthogonal and absorbed like the
fused Walsh rotation), the Cayley step stays on the manifold and lowers the cost, the adaptive outlier-token rule,
and what it is for: a lower int4 per-token error of the rotated activations than the Walsh-Hadamard start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compress import registry
from compress.models.adapters import ModelAdapter
from compress.rotation.infoquant import (
    InfoQuantConfig,
    cayley_step,
    outlier_tokens,
    peak_cost,
    signed_hadamard,
)
from tests.rotating import exact_rmsnorm, ids, rel
from tests.tiny import tiny_causal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _ctx(model, tokens, tmp_path=None):
    return SimpleNamespace(adapter=ModelAdapter(model), calibration_tokens=lambda: tokens, seed=0, key="00-rotate",
                           workspace=None, progress=lambda **_: SimpleNamespace(update=lambda n=1: None,
                                                                                close=lambda: None))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_learned_rotations_leave_the_model_unchanged_in_float64(model_type):
    model = exact_rmsnorm(tiny_causal(model_type, dtype=torch.float64))
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    x = ids(128)
    with torch.no_grad():
        before = model(x).logits
        metrics = registry.get("rotate", "infoquant").apply(_ctx(model, tokens), InfoQuantConfig(
            steps=5, head_steps=5, batch_tokens=32))
        after = model(x).logits
    assert rel(after, before) < 1e-10
    assert metrics["calibration_tokens"] == 128 and len(metrics["cost_first_last"]) == 2


def test_cayley_steps_stay_orthogonal_and_lower_the_peak_cost():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    x[:, 3] *= 20  # an outlier channel: the Hadamard start spreads it, learning spreads it further
    w = torch.ones(512)
    Q = signed_hadamard(64, g)
    first = float(peak_cost(x @ Q, w, 2.0))
    for t in range(40):
        Qp = Q.clone().requires_grad_(True)
        peak_cost(x @ Qp, w, 2.0).backward()
        Q = cayley_step(Q, Qp.grad, 2.0 * (1 - 0.99 * t / 40))
    assert torch.dist(Q @ Q.T, torch.eye(64)) < 1e-4
    assert float(peak_cost(x @ Q, w, 2.0)) < 0.97 * first
    batched = torch.stack([signed_hadamard(8, g), torch.eye(8)])  # a step per matrix, each with its own size
    G = torch.randn(2, 8, 8, generator=g)
    out = cayley_step(batched, G, 2.0)
    assert torch.dist(out @ out.transpose(-1, -2), torch.eye(8).expand(2, 8, 8)) < 1e-5
    assert torch.allclose(out[1], cayley_step(batched[1], G[1], 2.0), atol=1e-6)


def test_outlier_tokens_flag_the_massive_activations():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(12, 64, 32, generator=g)
    a[:, 0, 5] = 60  # the first token of every window: a massive activation (as BOS tokens have)
    a[3, 17, 9] = -40
    flagged = outlier_tokens(a)
    assert flagged[:, 0].all() and flagged[3, 17]
    assert flagged.float().mean() < 0.05


def test_recipe_runs_and_resume_reuses_the_learned_rotations(tmp_path):
    from conftest import MODELS, invoke

    r = tmp_path / "r.yaml"
    r.write_text(f"""
version: 1
model: {{path: {MODELS / 'stories-llama-1m'}, dtype: float32}}
calibration: {{sources: [bundled:botchan-calibration], nsamples: 8, seqlen: 64}}
stages:
  - {{stage: rotate, method: infoquant, steps: 30, head_steps: 30, batch_tokens: 128}}
  - {{stage: quantize, method: rtn, scheme: w4a4}}
eval: {{data: [bundled:botchan-eval], max_tokens: 1024, generation: {{prompts: 0}}}}
export: {{formats: [{{format: compressed-tensors, dtype: float32}}]}}
""")
    out = tmp_path / "out"
    rc, stdout, err = invoke("run", r, "-o", out, "--json")
    assert rc == 0, err
    import json

    report = json.loads(stdout)
    errs = json.loads((out / "manifest.json").read_text())["stages"]["00-rotate-infoquant"]["metrics"]["a4_error"]
    assert errs["learned"] < errs["hadamard"] < errs["none"], errs
    assert (out / "00-rotate-infoquant" / "rotations.safetensors").is_file()
    (out / "report.json").unlink()
    rc, stdout2, err = invoke("run", r, "-o", out, "--resume", "--json")
    assert rc == 0, err
    assert json.loads(stdout2)["eval"] == report["eval"]
