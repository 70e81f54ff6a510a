"""Helpers of the rotation tests (tests/rotation/test_rotate.py, tests/rotation/test_rotate_research.py): the configs every
invariance test runs, an exact float64 RMSNorm, `rotate` through the registered stage, `bind` recipes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from compress import registry
from compress.models.adapters import ModelAdapter
from compress.rotation.walsh import WalshConfig

CONFIGS = {
    "fused": dict(fused=True),
    "fused-rotation-only": dict(fused=True, mode="none"),
    "no_rotation-wht": dict(fused=False),
    "no_rotation-channel": dict(fused=False, influence_basis="channel"),
    "spectral": dict(fused=False, mode="spectral"),
    "pair_pca": dict(fused=False, pair_pca=True),
    "fused-pair_pca": dict(fused=True, pair_pca=True),
    "head_pca": dict(fused=False, head_pca=True),
    "fused-auto": dict(fused=True, alpha="auto"),
    "no_rotation-wht-auto": dict(fused=False, alpha="auto"),
    "spectral-auto": dict(fused=False, mode="spectral", alpha="auto"),
    "spectral-unpadded": dict(fused=False, mode="spectral", pad="none"),
}


def exact_rmsnorm(model):
    """transformers' RMSNorm normalises in float32 even for float64 models (rel. error ~1e-7 after a
    rotation); this computes it in the input dtype so a float64 test can demand 1e-10."""
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = (lambda mod: lambda x: mod.weight * x * torch.rsqrt(
                x.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon))(m)
    return model


def plain_rmsnorm(model):
    for m in model.modules():
        m.__dict__.pop("forward", None)
    return model


def rotate(model, vocab, **cfg):
    tokens = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(1))
    cfg = WalshConfig(**cfg)
    facts = SimpleNamespace(rounding=(2, 16, False))  # the next quantize stage's, what alpha: auto rounds with
    ctx = SimpleNamespace(adapter=ModelAdapter(model), calibration_tokens=lambda: tokens, facts=facts)
    return registry.get("rotate", "walsh").apply(ctx, cfg)


def recipe_of(stages, formats=()):
    """A recipe with these stage configs and export formats (the model section is not read by `bind`)."""
    from compress.recipe import ExportSpec

    return SimpleNamespace(stage_configs=stages, export=ExportSpec(formats=list(formats)),
                           model=SimpleNamespace(stream=False))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def ids(vocab, n=24):
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(0))


