"""`smooth` stage, `method: smoothquant`: SmoothQuant's per-input-channel scales (Xiao et al., ICML 2023), which move
activation outliers into the weights before a weight-and-activation scheme (`scheme: w8a8-int8` on the next quantize
stage), folded into the operation before each group of linears so the full-precision network is unchanged
(docs/formats.md#smoothquant).

Per-token int8 activations lose the small channels of a token whose few outlier channels set its scale; dividing
those channels by s (and multiplying the readers' weight columns by s) narrows the activation range at the cost of a
wider weight range. Block by block, the inputs of block i being the outputs of block i - 1 after its smoothing:

1. one pass of the calibration activations through the block collects, at each group's input (fold.py: `attn_in`
   input_norm -> q/k/v, `mlp_in` post_attn_norm -> gate/up, and on request `up_down`, `v_o`), the max |x| per
   channel and a seeded sample of `rows` rows;
2. per group, `s = max|x|^a / max|W|^(1-a)` (max |W| over the readers' rows per input column; clamped at 1e-5),
   the paper's migration strength a. `alpha: search` (the default) tries s = 1 and a = 0, 1/grid, ..., 1 and keeps
   the one of least output error of the group's quantized readers on the sampled rows, with the arithmetic the
   server runs: `sum_readers ||Qa(X / s) Qw(W diag(s))^T - X W^T||^2`, Qa the scheme's activation quantizer, Qw the
   next quantize stage's round-to-nearest of each layer. s = 1 is a candidate, so that error never grows. A fixed
   `alpha` (llm-compressor's `smoothing_strength`, default 0.5 there; the paper: 0.5, 0.75-0.85 for some models)
   skips the search. The readers of one group share the tap's rows (routed experts are scored on every row).
3. the fold is checked per block on the first calibration batch (`fold_error` in the stage's metrics).

Each block's scales are written to the stage directory (`smoothquant_block_NNNN.safetensors`) as soon as they are
found: an interrupted stage continues from its last block, and `--resume` of a finished one re-applies them
bit-identically without calibrating again.
"""

from __future__ import annotations

import logging
from typing import Literal, Union

import torch
from pydantic import Field

from compress.config import StrictModel
from compress.driver import advance, capture_block0_inputs
from compress.errors import BadInput
from compress.quantize.activations import SCHEME_ACTIVATIONS, fake_quant, spec_of
from compress.registry import register
from compress.smooth import fold

log = logging.getLogger(__name__)
FOLD = "smoothquant_block_{:04d}.safetensors"


class SmoothQuantConfig(StrictModel):
    stage: Literal["smooth"] = "smooth"
    method: Literal["smoothquant"] = "smoothquant"
    alpha: Union[Literal["search"], float] = Field(
        "search", description="migration strength a of s = max|x|^a / max|W|^(1-a), 0..1; search: the a (or none) "
                              "of least W8A8 output error per group on the calibration rows")
    grid: int = Field(20, ge=1, le=200, description="alpha: search tries a = 0, 1/grid, ..., 1 and no smoothing")
    groups: list[Literal["attn_in", "mlp_in", "up_down", "v_o"]] = Field(
        ["attn_in", "mlp_in"], min_length=1,
        description="which groups to smooth: attn_in (input norm -> q/k/v), mlp_in (MLP norm -> gate/up; "
                    "llm-compressor's two default mappings), up_down (up -> down), v_o (v -> o)")
    rows: int = Field(2048, ge=16, description="calibration rows sampled per group for the search")
    seed: int = Field(0, description="the row sample's seed")
    batch_size: int = Field(8, ge=1, description="calibration windows per forward pass")

    def model_post_init(self, _ctx) -> None:
        if self.alpha != "search" and not 0.0 <= float(self.alpha) <= 1.0:
            raise ValueError(f"alpha must be `search` or in [0, 1]; got {self.alpha}")


def check(adapter, cfg: SmoothQuantConfig, facts=None) -> SmoothQuantConfig:
    """Refuse at plan time a model it cannot fold into, or a run with no activation quantization to smooth for."""
    have = fold.check_foldable(adapter, "smoothquant")
    if facts is not None:
        if facts.rounding is None:
            raise BadInput("smooth/smoothquant searches its scales against the next `quantize` stage; add one after it")
        if facts.scheme not in SCHEME_ACTIVATIONS:
            raise BadInput("smooth/smoothquant moves activation outliers into the weights for a scheme that quantizes "
                           "activations; the next quantize stage has no `scheme` (set `scheme: w8a8-int8` or `fp8` "
                           "there) and quantizes weights only: use `smooth/awq` for weight-only quantization")
        skipped = [g for g in cfg.groups if g not in have]
        if skipped:
            facts.notes.append(f"smooth/smoothquant: `{adapter.model_type}` has no {', '.join(skipped)} pair (fused or "
                               f"absent projections); it smooths {', '.join(g for g in cfg.groups if g in have)}")
    return cfg


class _Rows:
    """Max |x| per channel and a seeded sample of the rows seen at one tap."""

    def __init__(self, keep: float, generator: torch.Generator):
        self.amax, self.sample, self.keep, self.gen = None, [], keep, generator

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if not x.shape[0]:
            return
        a = x.abs().amax(0)
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        k = min(x.shape[0], max(1, round(self.keep * x.shape[0])))
        self.sample.append(x[torch.randperm(x.shape[0], generator=self.gen)[:k]])

    def rows(self) -> torch.Tensor:
        return torch.cat(self.sample)


def _collect(adapter, i: int, groups: list[fold.Group], acts, kwargs, cfg: SmoothQuantConfig) -> dict:
    total = sum(x.shape[0] * x.shape[1] for x in acts)
    gen = torch.Generator().manual_seed(cfg.seed * 100003 + i)
    stats = {g.key: _Rows(min(1.0, cfg.rows / max(total, 1)), gen) for g in groups}
    fold.watch(adapter, i, [(*g.tap, stats[g.key].add) for g in groups], acts, kwargs)
    return stats


def _error(X: torch.Tensor, readers: list, cols: torch.Tensor, act) -> float:
    """sum over readers of ||Qa(X / s) Qw(W diag(s))^T - X W^T||^2 / ||X W^T||^2 (the served arithmetic's error)."""
    xq = fake_quant(X / cols, act)
    err = 0.0
    for W, spec, ref in readers:
        y = xq @ fold.rounded(W * cols, spec).T
        err += float((y - ref).pow(2).sum() / ref.pow(2).sum().clamp(min=1e-30))
    return err


def _search(g: fold.Group, st: _Rows, readers: list, weights: list, cfg: SmoothQuantConfig, act):
    """(scale float64 or None for s = 1, the chosen alpha or None, error at s = 1, error chosen)."""
    x = st.amax.double()
    w = torch.stack([W.abs().amax(0) for W in weights]).amax(0).double()
    x, w = fold.tied(x, g.tie), fold.tied(w, g.tie)
    X = st.rows()
    ones = torch.ones(X.shape[1])
    identity = _error(X, readers, ones, act)
    alphas = [k / cfg.grid for k in range(cfg.grid + 1)] if cfg.alpha == "search" else [float(cfg.alpha)]
    best = (identity, None, None) if cfg.alpha == "search" else None
    for a in alphas:
        s = (x.pow(a) / w.pow(1 - a)).clamp(min=1e-5)
        if not torch.isfinite(s).all():
            continue
        err = _error(X, readers, fold.spread(s, g.tie).float(), act)
        if best is None or err < best[0]:
            best = (err, a, s)
    if best is None:
        raise BadInput(f"smooth/smoothquant: alpha {cfg.alpha} gives non-finite scales on {g.key} (a zero channel)")
    return best[2], best[1], identity, best[0]


def _block(adapter, i, cfg, groups, linears, specs, act, acts, kwargs, metrics) -> dict:
    name_of = {id(m): nm for nm, m in linears.items()}
    stats = _collect(adapter, i, groups, acts, kwargs, cfg)
    scales = {}
    for g in groups:
        st = stats[g.key]
        if g.kind not in cfg.groups or st.amax is None:
            continue
        X = st.rows()
        quantized = [(m.weight.detach().float(), specs[name_of[id(m)]]) for m in g.readers
                     if specs.get(name_of.get(id(m))) is not None]
        if not quantized:
            continue
        readers = [(W, spec, X @ W.T) for W, spec in quantized]
        s, a, identity, err = _search(g, st, readers, [m.weight.detach().float() for m in g.readers], cfg, act)
        key = "identity" if a is None else f"{a:g}"
        metrics["alphas"][key] = metrics["alphas"].get(key, 0) + 1
        metrics["error_identity"] += identity
        metrics["error"] += err
        if s is not None:
            scales[g.key] = s
    metrics["fold_error"] = max(metrics["fold_error"], fold.apply_checked(adapter, i, groups, scales, acts[0], kwargs[0]))
    return scales


@register("smooth", "smoothquant", SmoothQuantConfig, "SmoothQuant: per-channel scales that move activation outliers "
          "into the weights for a weight-and-activation scheme, searched on its served arithmetic and folded into the "
          "preceding norm or linear", check=check, replay=True)
def apply(ctx, cfg: SmoothQuantConfig) -> dict:
    adapter = ctx.adapter
    facts = getattr(ctx, "facts", None)
    check(adapter, cfg, facts)
    specs = dict(getattr(facts, "layers", None) or {})
    act = spec_of(facts.scheme, getattr(facts, "activations", "dynamic"))  # static: the sample's own range
    n = len(adapter.blocks)
    saved = [fold.load_block(ctx, FOLD.format(i)) for i in range(n)]
    acts = kwargs = None
    resumed = sum(s is not None for s in saved)
    if resumed:
        log.info("smooth/smoothquant: the scales of %d of %d blocks are loaded from the stage directory", resumed, n)
    if resumed < n:
        acts, kwargs = capture_block0_inputs(adapter.model, adapter.blocks[0], ctx.calibration_tokens(), cfg.batch_size)
    metrics = {"scaled": {}, "alphas": {}, "error_identity": 0.0, "error": 0.0, "fold_error": 0.0,
               "resumed_blocks": resumed}
    bar = ctx.progress(total=n, desc=f"{ctx.key} SmoothQuant search", unit="block")
    try:
        for i in range(n):
            groups = fold.groups(adapter, i)
            if saved[i] is not None:
                scales = saved[i]
                fold.apply_scales(adapter, groups, scales)
            else:
                scales = _block(adapter, i, cfg, groups, adapter.block_linears(i), specs, act, acts, kwargs, metrics)
                fold.save_block(ctx, FOLD.format(i), scales)
            for k in scales:
                kind = k.split(".")[0]
                metrics["scaled"][kind] = metrics["scaled"].get(kind, 0) + 1
            if acts is not None and any(s is None for s in saved[i + 1:]):
                advance(adapter.blocks[i], acts, kwargs)
            bar.update(1)
    finally:
        bar.close()
    for k in ("error_identity", "error"):
        metrics[k] = round(metrics[k], 6)
    if acts is not None:
        metrics["calibration_tokens"] = int(sum(x.shape[0] * x.shape[1] for x in acts))
    return metrics
