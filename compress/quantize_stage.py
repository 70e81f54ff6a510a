"""Glue shared by every `quantize` method: which layers, with which settings, through the driver."""

from __future__ import annotations

import logging
import re

from torch import nn

from compress.config import QuantizeConfig
from compress.driver import BlockQuantizer, LayerSpec, run_blockwise, set_weight
from compress.errors import BadInput
from compress.primitives import rtn

log = logging.getLogger(__name__)


def layer_spec(name: str, linear: nn.Linear, cfg: QuantizeConfig) -> LayerSpec | None:
    """The recipe's settings for one layer: defaults, then every matching override in order."""
    bits, group_size, sym, skip = cfg.bits, cfg.group_size, cfg.sym, False
    for o in cfg.overrides:
        if re.search(o.pattern, name):
            bits = o.bits if o.bits is not None else bits
            group_size = o.group_size if o.group_size is not None else group_size
            sym = o.sym if o.sym is not None else sym
            skip = o.skip
    if skip:
        return None
    if group_size != -1 and group_size > linear.in_features:
        raise BadInput(
            f"group_size {group_size} is larger than layer `{name}` (in_features {linear.in_features}); "
            "use a smaller group_size, -1 (per-channel), or an override for this layer"
        )
    if group_size != -1 and linear.in_features % group_size:
        log.info("%s: in_features %d not divisible by group_size %d; the last group has %d columns",
                 name, linear.in_features, group_size, linear.in_features % group_size)
    return LayerSpec(bits, group_size, sym)


def planned_spec(plan, name: str, spec: LayerSpec | None) -> LayerSpec | None:
    """`spec` with the allocation plan's per-chunk options for this layer, when a plan covers it."""
    if spec is None or plan is None or name not in plan.layers:
        return spec
    return plan.layer_spec(name)


def check_overrides(cfg: QuantizeConfig, names: list[str]) -> None:
    for o in cfg.overrides:
        try:
            rx = re.compile(o.pattern)
        except re.error as e:
            raise BadInput(f"override pattern `{o.pattern}` is not a valid regex: {e}") from e
        if not any(rx.search(n) for n in names):
            log.warning("override pattern `%s` matches no layer", o.pattern)


def planned_layers(adapter, cfg: QuantizeConfig) -> dict[str, LayerSpec]:
    """Every layer this stage will quantize with its settings (validates shapes; loads no data)."""
    out = {}
    for i in range(len(adapter.blocks)):
        for name, lin in adapter.block_linears(i).items():
            spec = layer_spec(name, lin, cfg)
            if spec is not None:
                out[name] = spec
    check_overrides(cfg, list(out))
    head = lm_head_target(adapter, cfg)
    if head:
        out[head[0]] = LayerSpec(cfg.bits, cfg.group_size, cfg.sym)
    return out


def lm_head_target(adapter, cfg: QuantizeConfig):
    if not cfg.lm_head:
        return None
    name, head = adapter.lm_head()
    if head is None:
        raise BadInput(f"`lm_head: true` but `{adapter.model_type}` has no LM head")
    emb = adapter.embeddings()
    if getattr(emb, "weight", None) is not None and head.weight.data_ptr() == emb.weight.data_ptr():
        raise BadInput("lm_head is tied to the input embeddings, which are never quantized; set `lm_head: false`")
    return name, head


def quantize_stage(ctx, cfg: QuantizeConfig, quantizer: BlockQuantizer) -> dict:
    adapter = ctx.adapter
    planned_layers(adapter, cfg)
    head = None
    if quantizer.needs_head:
        from compress.methods.lfq import LogitHead

        head = LogitHead.of(adapter)
        log.info("last block: `final_block: %s`, tuned through the frozen final norm and LM head", cfg.final_block)
    tokens = ctx.calibration_tokens() if quantizer.needs_data else None
    if cfg.guard is not None:
        from compress.guard import Guarded

        quantizer = Guarded(quantizer, cfg.guard)
    bar = ctx.progress(total=len(adapter.blocks), desc=f"{ctx.key} blocks", unit="block")
    qweights = run_blockwise(
        model=adapter.model, blocks=adapter.blocks, block_linears=adapter.block_linears,
        specs=lambda name, lin: planned_spec(ctx.plan, name, layer_spec(name, lin, cfg)), quantizer=quantizer,
        tokens=tokens,
        load_block=lambda i: ctx.workspace.load_block(ctx.key, i),
        save_block=lambda i, q: ctx.workspace.save_block(ctx.key, i, q),
        seed=ctx.seed, progress=lambda done, total: bar.update(1),
        materialize=ctx.streamer.materialize if ctx.streamer else None,
        release=ctx.streamer.release if ctx.streamer else None, head=head,
    )
    ctx.block_stage = ctx.key
    bar.close()
    target = lm_head_target(adapter, cfg)
    if target:  # after the blocks: a final-block objective through the head assumes it is FP
        name, lin = target
        if cfg.guard is not None:
            quantizer.guard(name, lin, LayerSpec(cfg.bits, cfg.group_size, cfg.sym))
        qw = rtn(lin.weight.data, cfg.bits, cfg.group_size, cfg.sym)
        set_weight(lin, qw)
        qweights[name] = qw
    ctx.qweights.update(qweights)
    ctx.plan = None  # consumed: a later quantize stage uses its own settings
    out = {"layers": len(qweights), "calibration_tokens": 0 if tokens is None else tokens.numel()}
    if cfg.guard is not None:
        out["guard_moved"] = quantizer.moved  # blocks loaded from checkpoints on resume are not counted again
        log.info("flipguard moved %d weights across a rounding boundary before rounding", quantizer.moved)
    return out
