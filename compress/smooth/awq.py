"""`smooth` stage, `method: awq`: activation-aware weight quantization's per-input-channel scales (AWQ, Lin et al.,
MLSys 2024), folded into the operation before each group of linears so the full-precision network is unchanged, and
AWQ's weight-clipping search. The quantize stage after it (rtn, gptq, autoround; integer grids or llama.cpp's with
`gguf: TYPE`) rounds the scaled, clipped weights (docs/quantize.md#awq).

Block by block, the inputs of block i being the outputs of block i - 1 after its smoothing and clipping:

1. one pass of the calibration activations through the block collects, at each group's input, the mean |x| per
   channel and the Gram matrix H = mean x x^T of the rows reaching each quantized reader (an expert: its routed rows);
2. per group, a scale s per input channel of its readers:
     attn_in   input_norm -> q/k/v (q_a, kv_a, qkv): the norm's weight / s (Gemma's `1 + w` norms:
               1 + w' = (1 + w) / s),
               the readers' columns * s
     mlp_in    post_attn_norm -> gate/up (every expert, the router, shared experts and their gate): the same
     up_down   up's rows (and bias) / s, down's columns * s, for every gated MLP (every expert)
     v_o       v's rows / s_kv, o's columns * s, s tied across the query heads of one KV group (exact under GQA)
   Candidates: s = 1, and for r = 0, 1/n, ..., (n-1)/n (n = `grid`): `x^r / (w^(1-r) + 1e-4)` (`duo_scaling`; `x^r`
   without), clamped at 1e-4 and divided by sqrt(max s * min s), x = mean |x| per channel, w = the mean over the
   readers' rows of |W| / the max |W| of its quantization group (AutoAWQ's and llm-compressor's search). The chosen s
   minimises the paper's objective, the output error of the group's quantized readers on the calibration rows,
   `sum tr(dW H dW^T)` with `dW = W - Q(W diag(s)) diag(s)^-1` and Q the next quantize stage's round-to-nearest at each
   layer's bits, group and symmetry (llama.cpp's own fit on its grids). s = 1 is a candidate, so the proxy error
   never grows. Row scalings commute with per-row group rounding, so the four groups are searched independently.
3. `clip: true` (AWQ's clipping; q/k are skipped as AutoAWQ skips them; `auto`, the default: before `rtn` only): per
   row and quantization group, the ratio p
   of 1.0, 0.95, ..., 0.5 whose `Q(clamp(W, -p max|W|, p max|W|))` has the least output error on the group's own
   columns (`d^T H_gg d`), and W is clamped there. Clipping changes the full-precision weights (by design: the
   outliers the grid would pay for); the scaling alone does not (checked per block on the first calibration batch:
   `fold_error` in the stage's metrics). Not on llama.cpp grids, whose fit searches its own scales.

Each block's scales and clipping bounds are written to the stage directory (`awq_block_NNNN.safetensors`) as soon as
they are found: an interrupted stage continues from its last block, and `--resume` of a finished one re-applies the
saved fold (the stage replays: it rewrites weights in place) bit-identically without calibrating again.
"""

from __future__ import annotations

import logging
from typing import Literal, Union

import torch
from pydantic import Field

from compress.config import StrictModel
from compress.driver import advance, capture_block0_inputs
from compress.errors import BadInput
from compress.primitives import CLIP_RATIOS, group_round, group_view, resolve_group
from compress.registry import register
from compress.smooth import fold
from compress.smooth.fold import GROUPS

log = logging.getLogger(__name__)
NO_CLIP = ("q", "k", "qkv", "q_a", "kv_a")  # attention scores: AutoAWQ does not clip them either
FOLD = "awq_block_{:04d}.safetensors"  # a block's scales and clipping bounds, in the stage directory


class AWQConfig(StrictModel):
    stage: Literal["smooth"] = "smooth"
    method: Literal["awq"] = "awq"
    grid: int = Field(20, ge=1, le=200, description="ratios searched per group: r = 0, 1/grid, ..., (grid-1)/grid "
                                                    "(AutoAWQ: 20)")
    duo_scaling: bool = Field(True, description="candidates x^r / w^(1-r) (activation and weight magnitudes, AutoAWQ's "
                                                "default); false: x^r (the paper's)")
    clip: Union[bool, Literal["auto"]] = Field(
        "auto", description="AWQ's weight clipping search after the scaling (not q/k); auto: before `rtn` only (GPTQ "
                            "and AutoRound fit the weights they are given: clipping them first moves their target)")
    groups: list[Literal["attn_in", "mlp_in", "up_down", "v_o"]] = Field(
        list(GROUPS), min_length=1, description="which groups to scale: attn_in (input norm -> q/k/v), mlp_in (MLP "
                                                "norm -> gate/up), up_down (up -> down), v_o (v -> o)")
    batch_size: int = Field(8, ge=1, description="calibration windows per forward pass")


def check(adapter, cfg: AWQConfig, facts=None) -> AWQConfig:
    """Refuse at plan time what AWQ cannot do exactly on this model, say which groups it will scale, and resolve
    `clip: auto` from the next quantize stage's method."""
    have = fold.check_foldable(adapter, "awq")
    if facts is not None and facts.rounding is None:
        raise BadInput("smooth/awq searches its scales against the rounding of the next `quantize` stage; add one "
                       "after it")
    skipped = [g for g in cfg.groups if g not in have]
    if cfg.clip == "auto":
        consumer = getattr(facts, "consumer", None) if facts is not None else None
        cfg = cfg.model_copy(update={"clip": consumer == "rtn"})
        if facts is not None:
            facts.notes.append(f"smooth/awq: clip: auto -> {str(cfg.clip).lower()} (before `{consumer}`)")
    if facts is not None:
        if skipped:
            facts.notes.append(f"smooth/awq: `{adapter.model_type}` has no {', '.join(skipped)} pair (fused or absent "
                               f"projections); it scales {', '.join(g for g in cfg.groups if g in have)}")
        if facts.grid and cfg.clip is True:
            facts.notes.append("smooth/awq: no clipping search on llama.cpp's grids (`gguf`): their fit searches its "
                               "own scales; the scaling is searched against that fit")
    return cfg


# -- statistics --------------------------------------------------------------------------------------------------
class _Stat:
    """Gram matrix (fp32) and sum of |x| (fp64) of the rows seen at one tap."""

    def __init__(self):
        self.gram = self.abs = None
        self.rows = 0
        self.mean = False  # gram holds the mean (H) once H() was asked for

    def add(self, x: torch.Tensor, gram: bool, absolute: bool) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if not x.shape[0]:
            return
        if gram:
            self.gram = x.T @ x if self.gram is None else self.gram.addmm_(x.T, x)
        if absolute:
            a = x.abs().sum(0, dtype=torch.float64)
            self.abs = a if self.abs is None else self.abs + a
        self.rows += x.shape[0]

    def H(self) -> torch.Tensor | None:
        """The mean Gram matrix, divided in place once (the readers of one tap share it)."""
        if self.gram is not None and not self.mean:
            self.gram.div_(self.rows)
            self.mean = True
        return self.gram

    def mean_abs(self) -> torch.Tensor | None:
        return None if self.abs is None else self.abs / self.rows


def _collect(adapter, i: int, groups: list[fold.Group], acts, kwargs) -> tuple[dict, dict]:
    """One pass of the block: {group key: _Stat at its tap} and {id(reader): _Stat of its own rows} for the
    readers whose rows are not the tap's (routed experts)."""
    at_tap = {g.key: _Stat() for g in groups}
    own: dict[int, _Stat] = {}
    taps = [(*g.tap, lambda x, st=at_tap[g.key]: st.add(x, True, True)) for g in groups]
    for e in adapter.experts(i) or ():  # an expert's gate/up read the rows routed to it
        st = _Stat()
        own[id(e.gate_proj)] = own[id(e.up_proj)] = st
        taps.append((e.gate_proj, "input", lambda x, st=st: st.add(x, True, False)))
    fold.watch(adapter, i, taps, acts, kwargs)
    return at_tap, own


# -- search --------------------------------------------------------------------------------------------------------
def _output_error(W: torch.Tensor, cols: torch.Tensor, H: torch.Tensor, spec) -> float:
    """tr(dW H dW^T), dW = W - Q(W diag(cols)) diag(cols)^-1: the reader's output error on the calibration rows."""
    dW = W - fold.rounded(W * cols, spec) / cols
    return float(((dW @ H) * dW).sum())


def _weight_magnitude(quantized: list, d: int) -> torch.Tensor:
    """Mean over the readers' rows of |W| / the max |W| of its quantization group, per input channel."""
    total, rows = torch.zeros(d, dtype=torch.float64), 0
    for W, spec, _ in quantized:
        Wg = group_view(W.abs(), resolve_group(W.shape[1], spec.group_size))
        Wg = Wg / (Wg.amax(-1, keepdim=True) + 1e-6)
        total += Wg.reshape(W.shape[0], -1)[:, :d].sum(0, dtype=torch.float64)
        rows += W.shape[0]
    return total / rows


def _search(g: fold.Group, x: torch.Tensor, quantized: list, cfg: AWQConfig) -> tuple[torch.Tensor, float | None]:
    """The scale (float64; tied over query heads for v_o) of least output error, and its ratio (None: s = 1)."""
    w = _weight_magnitude(quantized, x.numel())
    if g.tie is not None:
        x, w = fold.tied(x, g.tie), fold.tied(w, g.tie)
    best = None
    for r in [None] + [k / cfg.grid for k in range(cfg.grid)]:
        if r is None:
            s = torch.ones_like(x)
        else:
            s = x.pow(r) / (w.pow(1 - r) + 1e-4) if cfg.duo_scaling else x.pow(r)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
        if not torch.isfinite(s).all():
            continue
        cols = fold.spread(s, g.tie).float()
        err = sum(_output_error(W, cols, H, spec) for W, spec, H in quantized)
        if best is None or err < best[0]:
            best = (err, r, s)
    return best[2], best[1]


def _clip_bounds(W: torch.Tensor, H: torch.Tensor, spec) -> torch.Tensor:
    """Per (row, group), `p * max|W|` for the p of CLIP_RATIOS of least `d^T H_gg d`, d = W - Q(clamp(W)) on the
    group's columns (AWQ's `auto_clip`, with the Gram matrix of the calibration rows instead of a token sample)."""
    d_out, d_in = W.shape
    g = resolve_group(d_in, spec.group_size)
    Wg = group_view(W, g)
    n = Wg.shape[1]
    Hp = torch.nn.functional.pad(H, (0, n * g - d_in, 0, n * g - d_in))
    Hb = Hp.reshape(n, g, n, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (n, g, g) diagonal blocks
    top = Wg.abs().amax(-1)
    best_err = best = None
    for p in CLIP_RATIOS:
        m = (top * p).unsqueeze(-1)
        Wc = torch.maximum(torch.minimum(Wg, m), -m)
        d = Wg - group_round(Wc, spec.bits, spec.sym)[2]
        err = torch.einsum("rgi,gij,rgj->rg", d, Hb, d)
        if best is None:
            best_err, best = err, top * p
            continue
        better = err < best_err
        best, best_err = torch.where(better, top * p, best), torch.minimum(err, best_err)
    return best


# -- the fold: applied the same way when found and when replayed ----------------------------------------------------
def _apply_clips(linears: dict, specs: dict, clips: dict) -> None:
    for name, bound in clips.items():
        lin = linears[name]
        g = resolve_group(lin.in_features, specs[name].group_size)
        m = bound.repeat_interleave(g, dim=1)[:, :lin.in_features].to(lin.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.maximum(torch.minimum(lin.weight, m), -m))


def _save(ctx, i: int, scales: dict, clips: dict) -> None:
    tensors = {f"scale.{k}": v for k, v in scales.items()}
    tensors.update({f"clip.{k}": v for k, v in clips.items()})
    fold.save_block(ctx, FOLD.format(i), tensors)


def _load(ctx, i: int) -> tuple[dict, dict] | None:
    t = fold.load_block(ctx, FOLD.format(i))
    if t is None:
        return None
    return ({k[len("scale."):]: v for k, v in t.items() if k.startswith("scale.")},
            {k[len("clip."):]: v for k, v in t.items() if k.startswith("clip.")})


# -- the stage -------------------------------------------------------------------------------------------------------
@register("smooth", "awq", AWQConfig, "AWQ: activation-aware per-channel scales folded into the preceding norm or "
          "linear, and AWQ's clipping search, against the next quantize stage's rounding", check=check, replay=True)
def apply(ctx, cfg: AWQConfig) -> dict:
    adapter = ctx.adapter
    cfg = check(adapter, cfg, getattr(ctx, "facts", None)) if cfg.clip == "auto" else check(adapter, cfg)
    specs = dict(getattr(ctx.facts, "layers", None) or {})
    n = len(adapter.blocks)
    saved = [_load(ctx, i) for i in range(n)]
    acts = kwargs = None
    if any(s is not None for s in saved):
        log.info("smooth/awq: the scales and clipping bounds of %d of %d blocks are loaded from the stage directory",
                 sum(s is not None for s in saved), n)
    if any(s is None for s in saved):
        tokens = ctx.calibration_tokens()
        acts, kwargs = capture_block0_inputs(adapter.model, adapter.blocks[0], tokens, cfg.batch_size)
    metrics = {"scaled": {}, "identity": 0, "ratios": {}, "clipped_layers": 0, "clip_ratio_mean": None,
               "fold_error": 0.0, "resumed_blocks": sum(s is not None for s in saved)}
    clip_fracs = []
    bar = ctx.progress(total=n, desc=f"{ctx.key} AWQ search", unit="block")
    try:
        for i in range(n):
            groups = fold.groups(adapter, i)
            linears = adapter.block_linears(i)
            if saved[i] is not None:
                scales, clips = saved[i]
                fold.apply_scales(adapter, groups, scales)
                _apply_clips(linears, specs, clips)
            else:
                scales, clips = _block(adapter, i, cfg, groups, linears, specs, acts, kwargs, metrics, clip_fracs)
                _save(ctx, i, scales, clips)
            for k in scales:
                kind = k.split(".")[0]
                metrics["scaled"][kind] = metrics["scaled"].get(kind, 0) + 1
            metrics["clipped_layers"] += len(clips)
            if acts is not None and any(s is None for s in saved[i + 1:]):
                advance(adapter.blocks[i], acts, kwargs)
            bar.update(1)
    finally:
        bar.close()
    if clip_fracs:
        metrics["clip_ratio_mean"] = round(sum(clip_fracs) / len(clip_fracs), 4)
    if acts is not None:
        metrics["calibration_tokens"] = int(sum(x.shape[0] * x.shape[1] for x in acts))
    return metrics


def _block(adapter, i, cfg, groups, linears, specs, acts, kwargs, metrics, clip_fracs) -> tuple[dict, dict]:
    """Search block i's scales, fold them (checking the block's output is unchanged), search and apply its clipping."""
    name_of = {id(m): nm for nm, m in linears.items()}
    at_tap, own = _collect(adapter, i, groups, acts, kwargs)
    scales, col_scale = {}, {}
    for g in groups:
        st = at_tap[g.key]
        if g.kind not in cfg.groups or st.rows == 0:  # not asked, or an expert no row reached
            continue
        quantized = []
        for m in g.readers:
            spec = specs.get(name_of.get(id(m)))
            H = (own[id(m)] if id(m) in own else st).H()
            if spec is not None and H is not None:
                quantized.append((m.weight.detach().float(), spec, H))
        if not quantized:
            continue
        s, r = _search(g, st.mean_abs(), quantized, cfg)
        key = "identity" if r is None else f"{r:g}"
        metrics["ratios"][key] = metrics["ratios"].get(key, 0) + 1
        metrics["identity"] += r is None
        if r is None:
            continue
        scales[g.key] = s
        cols = fold.spread(s, g.tie)
        for m in g.readers:
            col_scale[id(m)] = cols
    metrics["fold_error"] = max(metrics["fold_error"], fold.apply_checked(adapter, i, groups, scales, acts[0], kwargs[0]))
    clips = {}
    if cfg.clip is True:
        skip = {id(adapter.role(i, r)) for r in NO_CLIP if r in adapter.arch.roles}
        hess = {}
        for g in groups:
            for m in g.readers:
                st = own.get(id(m), at_tap[g.key])
                hess[id(m)] = st.H()
        for nm, lin in linears.items():
            spec = specs.get(nm)
            H = hess.get(id(lin))
            if spec is None or spec.ggml or spec.bits < 2 or id(lin) in skip or H is None:
                continue
            c = col_scale.get(id(lin))
            if c is not None:  # the reader now sees x / s
                c = c.float()
                H = H / c.unsqueeze(0) / c.unsqueeze(1)
            W = lin.weight.detach().float()
            bound = _clip_bounds(W, H, spec)
            clips[nm] = bound
            top = group_view(W.abs(), resolve_group(W.shape[1], spec.group_size)).amax(-1)
            clip_fracs.append(float((bound / top.clamp(min=1e-30)).mean()))
        _apply_clips(linears, specs, clips)
    return scales, clips
