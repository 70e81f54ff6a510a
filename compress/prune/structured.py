"""`stage: prune`, methods `ffn`, `heads`, `depth`: structured pruning (docs/prune.md).

- `ffn`: remove `ratio` of the FFN channels of every dense MLP (SwiGLU rows of gate/up, columns of down), by
  `importance` (`calibrated`: activation energy x down-column norm; `magnitude`: weights only), per layer
  (`scope: layer`, the same width everywhere) or with one threshold over all layers (`scope: global`, widths
  differ per layer: onnx/openvino only). Kept widths are rounded to `multiple` (default: the next quantize
  stage's group size, so groups stay whole; 1 without one). Where that keeps every channel, the default
  multiple follows the group the quantize stage will use on the narrower down_proj (`fit_group`, asked through
  the bind step's `Facts.group_of`): the next power of two down, to 32, and the plan says so; where nothing
  works, or an explicit `multiple` keeps every channel, the plan refuses with the nearest ratio that prunes.
- `heads`: remove `ratio` of the KV heads of every block, each with the query heads that read it (GQA-aware:
  whole groups), the same number in every block (one KV-cache layout), by `importance` as above.
- `depth`: remove `blocks` whole decoder blocks by `importance` `cosine` (block influence), `loss` (loss
  increase when skipped) or `last` (the last blocks; the baseline).

Scores are measured on the first `samples` calibration sequences cut to `seqlen` tokens. The stage produces a
`ModelSpec` (the kept channels, heads and blocks in source indices) that `--resume` replays and the exports
read; at plan time it says the new shapes so every later stage and export plans on them.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

from pydantic import Field

from compress.config import StrictModel
from compress.errors import BadInput, RunFailure
from compress.handoff import ModelSpec
from compress.prune import scores
from compress.prune.prunepath import PathRouters
from compress.prune.report import PRUNED
from compress.registry import register

log = logging.getLogger(__name__)

IMPORTANCE = {"ffn": ("calibrated", "magnitude"), "heads": ("calibrated", "magnitude"),
              "depth": ("cosine", "loss", "last")}


class _PruneConfig(StrictModel):
    stage: Literal["prune"] = "prune"
    samples: int = Field(32, ge=1, description="calibration sequences the scores are measured on")
    seqlen: int = Field(256, ge=2)
    batch_size: int = Field(8, ge=1)


class FFNPruneConfig(_PruneConfig):
    method: Literal["ffn"] = "ffn"
    ratio: float = Field(..., gt=0, lt=1, description="share of FFN channels removed")
    importance: Literal["calibrated", "magnitude"] = "calibrated"
    scope: Literal["layer", "global"] = "layer"
    multiple: int | None = Field(None, ge=1, description="kept widths are multiples of this (default: the next "
                                                          "quantize stage's group size, else 1)")


class HeadsPruneConfig(_PruneConfig):
    method: Literal["heads"] = "heads"
    ratio: float = Field(..., gt=0, lt=1, description="share of KV heads (with their query heads) removed")
    importance: Literal["calibrated", "magnitude"] = "calibrated"


class DepthPruneConfig(_PruneConfig):
    method: Literal["depth"] = "depth"
    blocks: int = Field(..., ge=1, description="decoder blocks removed")
    importance: Literal["cosine", "loss", "last"] = "cosine"


def _dense(spec: ModelSpec) -> list[int]:
    return [p for p, b in enumerate(spec.blocks) if b.ffn is not None]


def check(adapter, cfg, facts):
    adapter.refuse("prune", f"`prune: {cfg.method}`")
    if adapter.kind != "causal":
        raise BadInput(f"`prune` works on decoder (causal) models; `{adapter.model_type}` is an encoder")
    if facts.after_quantize:
        raise BadInput(f"stage {facts.index} (`prune`/{cfg.method}) comes after a `quantize` stage; prune before "
                       "quantizing (the rounded layers would no longer match the model's shapes)")
    if PathRouters in facts.produced:
        raise BadInput(f"stage {facts.index} (`prune`/{cfg.method}) comes after `prune: prunepath`; prune first, then "
                       "split the FFNs (the routers are trained on the experts as they are)")
    spec = facts.spec
    if cfg.method == "ffn":
        if not _dense(spec):
            raise BadInput(f"`prune: ffn` needs dense MLPs; `{adapter.model_type}` has none (MoE experts are "
                           "allocated, not pruned)")
        if cfg.scope == "global" and any(f in ("hf", "fake") for f in facts.exports):
            raise BadInput("`prune: ffn, scope: global` gives every layer its own FFN width, which the hf export "
                           "cannot hold (a transformers config has one `intermediate_size`); use `scope: layer` "
                           "or export onnx/openvino only")
        narrow = min(spec.blocks[p].ffn for p in _dense(spec))
        if cfg.multiple is not None and cfg.multiple > narrow:
            raise BadInput(f"`multiple: {cfg.multiple}` exceeds the narrowest FFN ({narrow} channels)")
        cfg = cfg.model_copy(update={"multiple": _multiple(adapter, cfg, facts)})
    elif cfg.method == "heads":
        kv = {b.kv_heads for b in spec.blocks}
        if len(kv) != 1:
            raise BadInput("`prune: heads` needs the same number of KV heads in every block")
        n = kv.pop()
        if n - round(cfg.ratio * n) < 1:
            raise BadInput(f"`ratio: {cfg.ratio}` of {n} KV heads removes them all; each block keeps at least one")
        if round(cfg.ratio * n) == 0:
            raise BadInput(f"`ratio: {cfg.ratio}` of {n} KV heads removes none (whole KV heads are removed)")
    elif cfg.blocks >= len(spec.blocks):
        raise BadInput(f"`blocks: {cfg.blocks}` removes every one of the model's {len(spec.blocks)} blocks")
    return cfg


def _multiple(adapter, cfg, facts) -> int:
    """The multiple kept FFN widths are rounded to (docs/prune.md#kept-widths): the recipe's `multiple`, else the
    next quantize stage's group (1 without one); where that keeps every channel of a layer, the default follows
    the group the quantize stage will use on the narrower down_proj: the next power of two down, to 32, the first
    at which every layer loses channels and its down_proj keeps whole groups (`Facts.group_of`, i.e. fit_group).
    The adaptation goes into `facts.notes`; a ratio that removes nothing at any allowed multiple is refused."""
    spec = facts.spec
    down = {p: _down_name(adapter, p) for p in _dense(spec)}
    widths = {p: spec.blocks[p].ffn for p in down}
    group_of = facts.group_of or (lambda name, d_in: None)
    if cfg.multiple is not None:
        candidates, source = [cfg.multiple], f"`multiple: {cfg.multiple}`"
    elif facts.group_of is None:
        candidates, source = [1], "no quantize stage after it (multiple 1)"
    else:
        asked = facts.rounding[1] if facts.rounding[1] > 0 else scores.ALIGN
        candidates = [asked] + [m for m in scores.powers_below(asked) if m >= scores.ALIGN]
        source = f"the quantize stage's group_size {facts.rounding[1]}"
    for m in candidates:
        kept = {p: scores.kept_count(w, cfg.ratio, m) for p, w in widths.items()}
        if all(kept[p] < widths[p] and _whole(group_of, down[p], kept[p]) for p in widths):
            if m != candidates[0]:
                p = next(iter(widths))
                facts.notes.append(
                    f"multiple {candidates[0]} ({source}) keeps all {widths[p]} FFN channels (ratio {cfg.ratio}: "
                    f"{widths[p] * (1 - cfg.ratio):g} rounds to {scores.kept_count(widths[p], cfg.ratio, candidates[0])}); "
                    f"the multiple follows the group the quantize stage will use on the narrower down_proj: {m}, "
                    f"ffn {widths[p]} -> {kept[p]} (down_proj group {group_of(down[p], kept[p])}, fit_group)")
            return m
    w = min(widths.values())
    m = candidates[-1]
    fix = (f"use `ratio: {math.ceil(m / w * 100) / 100}` or more (keeps {scores.kept_count(w, math.ceil(m / w * 100) / 100, m)} of {w})"
           if m < w else f"the FFN ({w} channels) is not wider than one multiple ({m})")
    raise BadInput(f"stage {facts.index} (`prune`/ffn) would remove nothing: ratio {cfg.ratio} of {w} FFN channels "
                   f"keeps {w * (1 - cfg.ratio):g}, which rounds to all {w} at "
                   + (f"every multiple from {candidates[0]} down to {m} (the groups the quantize stage can use)"
                      if len(candidates) > 1 else f"multiple {m} ({source})")
                   + f"; {fix}" + (", or set a smaller `multiple`" if cfg.multiple is not None else ""))


def _down_name(adapter, p: int) -> str:
    down = adapter.role(p, "mlp_down")
    return next((n for n, m in adapter.block_linears(p).items() if m is down), f"{adapter.block_name(p)}.mlp_down")


def _whole(group_of, name: str, kept: int) -> bool:
    """Whether down_proj at `kept` input columns keeps whole groups in the quantize stage (None: not quantized)."""
    try:
        g = group_of(name, kept)
    except BadInput:  # `strict_groups: true` refuses that width
        return False
    return g is None or g == -1 or kept % g == 0


def reshape(spec: ModelSpec, cfg) -> ModelSpec:
    """The shapes after the stage (plan time: which channels, heads or blocks go is measured later, so the
    first ones stand in for them; with `scope: global` the layer widths are only known after measuring)."""
    if cfg.method == "ffn":
        return spec.keeping(ffn={p: range(scores.kept_count(spec.blocks[p].ffn, cfg.ratio, cfg.multiple))
                                 for p in _dense(spec)})
    if cfg.method == "heads":
        kv = spec.blocks[0].kv_heads
        return spec.keeping(kv_heads={p: range(kv - round(cfg.ratio * kv)) for p in range(len(spec.blocks))})
    return spec.keeping(blocks=range(len(spec.blocks) - cfg.blocks))


def apply(ctx, cfg) -> dict:
    adapter = ctx.adapter
    before = ctx.inputs.get(ModelSpec) or ModelSpec.of(adapter)
    calibrated = cfg.importance not in ("magnitude", "last")
    tokens = ctx.calibration_tokens()[:cfg.samples, :cfg.seqlen] if calibrated else None
    if cfg.method == "ffn":
        s = scores.ffn_scores(adapter, tokens, cfg.batch_size)
        counts = (scores.global_counts(s, cfg.ratio, cfg.multiple) if cfg.scope == "global" else
                  {i: scores.kept_count(v.numel(), cfg.ratio, cfg.multiple) for i, v in s.items()})
        after = before.keeping(ffn={i: scores.top(s[i], counts[i]) for i in s})
        what = {"ffn": {str(b.source): b.ffn for b in after.blocks}}
    elif cfg.method == "heads":
        s = scores.head_scores(adapter, tokens, cfg.batch_size)
        kv = before.blocks[0].kv_heads
        after = before.keeping(kv_heads={i: scores.top(v, kv - round(cfg.ratio * kv)) for i, v in s.items()})
        what = {"kv_heads_kept": {str(b.source): list(after.head_sources(b)) for b in after.blocks}}
    else:
        gone, rounds = scores.blocks_to_remove(adapter, tokens, cfg.importance, cfg.blocks, cfg.batch_size)
        after = before.keeping(blocks=[p for p in range(len(before.blocks)) if p not in gone])
        what = {"blocks_removed": [before.blocks[p].source for p in gone],
                "block_scores": [{str(b.source): round(float(s[p]), 6) for p, b in enumerate(before.blocks)
                                  if s[p] != float("inf")} for s in rounds]}
    if not after.differences(before):
        raise RunFailure(f"prune {cfg.method} removed nothing (ratio {getattr(cfg, 'ratio', None)}); a stage that "
                         "changes nothing is an error: raise the ratio")
    params = sum(p.numel() for p in adapter.model.parameters())
    after.restore(adapter, before)
    ctx.emit(after)
    left = sum(p.numel() for p in adapter.model.parameters())
    log.info("prune %s (%s): %s; parameters %d -> %d", cfg.method, cfg.importance,
             "; ".join(after.differences(before)[:4]) or "nothing removed", params, left)
    return {"structure": {"stage": "prune", "method": cfg.method, "importance": cfg.importance,
                          "parameters_before": params, "parameters_after": left,
                          "changes": after.differences(before) + list(ctx.facts.notes), **what}}


DESCRIPTIONS = {"ffn": "remove FFN channels by calibrated or magnitude importance",
                "heads": "remove KV heads (with their query heads) by calibrated or magnitude importance",
                "depth": "remove decoder blocks by block influence, loss increase or position"}
for _method, _config in (("ffn", FFNPruneConfig), ("heads", HeadsPruneConfig), ("depth", DepthPruneConfig)):
    register("prune", _method, _config, DESCRIPTIONS[_method], check=check, uses=(ModelSpec,), produces=(ModelSpec,),
             reshape=reshape, report=(PRUNED,))(apply)
