"""The quantize spine: one `quantize` stage for every quantizer (docs/quantize.md, docs/stages.md).

A quantizer is a config class plus a class registered by it (`@quantizer(RTNConfig, ...)`): it declares
the statistics it needs (`needs_hessian`, `needs_fp_targets`, `needs_data`, `batch_size`) and a pure
`quantize_block(BlockData) -> {name: QuantizedWeight}`. The spine owns the rest, the same for every method:
the layer plan (computed once by the bind step), an allocation `Plan` when one is handed in, the
final-block objective (`final_block`: the last block tuned through the frozen LM head), FlipGuard,
the block-wise driver with its checkpoints, and the `lm_head` option. It emits `QuantizedWeights`.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch
from torch import nn

from compress import registry
from compress.allocate.plan import Plan
from compress.config import FLOAT_SCHEMES, QuantizeConfig
from compress.driver import LayerSpec, run_blockwise, set_weight
from compress.errors import BadInput
from compress.eval.report import table
from compress.handoff import QuantizedWeights
from compress.models.head import LogitHead
from compress.models.moe import Coverage
from compress.primitives import rtn
from compress.quantize.guard import Guarded
from compress.quantize.lfq import resolve_final_block, uses_head
from compress.quantize.signround import AutoRoundConfig, signround_block

log = logging.getLogger(__name__)
QUANTIZERS: dict[type, type] = {}  # config class -> quantizer class
# capabilities a quantizer declares (registry.Entry.capabilities), which the stages before it ask for
CHUNK_PLAN = "chunk_plan"  # fits a per-chunk allocation plan (column chunks of several widths in one layer)
SIGN = "sign"  # rounds 1-bit (sign) weights: a 1-bit width of a per-layer plan (`allocate: moe`)
FLOAT = "float"  # rounds onto a float element grid (`scheme: fp8`: compress/quantize/floatgrid.py)


class Quantizer:
    """Base of the registered quantizers: what the driver collects for `quantize_block` (defaults: nothing;
    a method sets what it needs) and the method's config."""

    needs_hessian = False  # Hessians of each block linear's inputs (GPTQ)
    needs_fp_targets = False  # the full-precision block's outputs (AutoRound)
    needs_data = False  # calibration tokens at all (RTN needs none)
    batch_size = 1
    capabilities: frozenset[str] = frozenset()  # CHUNK_PLAN, SIGN

    def __init__(self, cfg: QuantizeConfig):
        self.cfg = cfg

    def quantize_block(self, data) -> dict:
        raise NotImplementedError


def quantizer(config: type[QuantizeConfig], description: str):
    """Register a quantizer class by its config class as the `quantize` stage method the config names."""
    def deco(cls):
        QUANTIZERS[config] = cls
        registry.register("quantize", config.model_fields["method"].default, config, description, check=check,
                          uses=(Plan,), produces=(QuantizedWeights,), capabilities=cls.capabilities,
                          report=(ADAPTED_GROUPS,), module=cls.__module__, on_device=on_device)(apply)
        return cls

    return deco


def _adapted_markdown(adapted: dict) -> str:
    return ("\n## Group sizes adapted\n\nLayers the recipe's `group_size` does not fit, with the group each got "
            "(-1: per-channel; docs/quantize.md#group-size-adaptation):\n\n"
            + table([{"layer": n, "group_size": a, "used": g} for n, (a, g) in adapted.items()],
                    ["layer", "group_size", "used"]))


# report.md: the layers whose group was adapted, after the size tables (every quantize stage's, merged)
ADAPTED_GROUPS = registry.Section("adapted_groups", _adapted_markdown, collect="merge", place="size")


def check(adapter, cfg: QuantizeConfig, facts=None) -> QuantizeConfig:
    """Plan time: the config as it will run on this model (`final_block: auto` resolved); a float scheme refused
    for a method that rounds only onto integer grids."""
    fp = FLOAT_SCHEMES.get(cfg.scheme)
    if fp is not None and FLOAT not in QUANTIZERS[type(cfg)].capabilities:
        able = sorted(c.model_fields["method"].default for c, q in QUANTIZERS.items() if FLOAT in q.capabilities)
        raise BadInput(f"`method: {cfg.method}` rounds onto integer grids only; `scheme: {cfg.scheme}` puts the "
                       f"weights on the {fp.upper()} float grid: use {', '.join(able)}")
    return resolve_final_block(cfg, adapter)


class FinalBlock:
    """The spine's final-block objective around any quantizer: blocks before the last get the method's own
    rounding; the last one, when `final_block` is not `same`, is tuned by AutoRound through the frozen head
    (an autoround stage keeps its own settings; others get `final_iters` steps, 200 by default)."""

    def __init__(self, inner, cfg: QuantizeConfig):
        self.inner, self.cfg = inner, cfg
        self.needs_head = uses_head(cfg)
        self.needs_hessian = inner.needs_hessian
        self.needs_fp_targets = inner.needs_fp_targets or self.needs_head
        self.needs_data = inner.needs_data or self.needs_head
        self.batch_size = inner.batch_size

    def quantize_block(self, data):
        if data.head is None:
            return self.inner.quantize_block(data)
        c = self.cfg
        if isinstance(c, AutoRoundConfig):
            ar = c if c.final_iters is None else c.model_copy(update={"iters": c.final_iters})
        else:
            ar = AutoRoundConfig(bits=c.bits, group_size=c.group_size, sym=c.sym, iters=c.final_iters or 200,
                                 batch_size=self.batch_size, final_block=c.final_block)
        with torch.enable_grad():
            return signround_block(data, ar)


LOADER_ALIGN = 32  # the packed loaders' unit along in_features (auto-round's torch backends, int32 words)


def fit_group(d_in: int, group_size: int) -> tuple[int, str | None]:
    """The group a layer of `d_in` input columns gets for the recipe's `group_size`, and why it differs (None when
    it does not); docs/quantize.md#group-size-adaptation:

    - the group divides d_in (or is -1): kept;
    - d_in is smaller than the group: per-channel (-1), one group per row, as auto-round quantizes such a layer;
    - otherwise the valid group nearest to it (ties: the smaller, finer one): a power of two >= 32 (what the CPU
      kernels and MatMulNBits take) or per-channel, and when d_in is a multiple of 32 one that divides it, so no row
      ends in a short group (auto-round's CPU loaders, and so our hf export, cannot hold one packed). A d_in that is
      not a multiple of 32 is never packed by hf whatever its group; there a short last group is fine.
    """
    if group_size == -1 or d_in % group_size == 0:
        return group_size, None
    if d_in < group_size:
        return -1, f"in_features {d_in} < group_size {group_size}: one group per row (per-channel)"
    aligned = d_in % LOADER_ALIGN == 0
    powers = [p for p in (2 ** k for k in range(5, d_in.bit_length())) if not aligned or d_in % p == 0]
    best = min([*powers, d_in], key=lambda p: (abs(p - group_size), p))
    if best == group_size:
        return group_size, None  # a power of two with a short last group, on a width no loader reads packed
    got = -1 if best == d_in else best
    return got, (f"group_size {group_size} " + ("does not divide" if aligned else "is not a kernel group for")
                 + f" in_features {d_in}: {got}, the nearest group that " + ("divides it" if aligned else "is"))


def layer_spec(name: str, linear: nn.Linear, cfg: QuantizeConfig) -> LayerSpec | None:
    """The recipe's settings for one layer: defaults, then every matching override in order, then the group fitted
    to the layer's width (`fit_group`; `strict_groups: true` refuses instead)."""
    return spec_at(name, linear.in_features, cfg)


def group_for(cfg: QuantizeConfig, name: str, d_in: int) -> int | None:
    """The group this stage would give layer `name` at `d_in` input columns (`fit_group` after the overrides; -1
    per-channel), None for a layer it skips; BadInput where `strict_groups` refuses that width. What an earlier
    stage that sets widths (`prune: ffn`) asks through the bind step (docs/prune.md#plan-time)."""
    spec = spec_at(name, d_in, cfg)
    return None if spec is None else spec.group_size


def spec_at(name: str, d_in: int, cfg: QuantizeConfig) -> LayerSpec | None:
    """`layer_spec` for a layer of `name` with `d_in` input columns (no module needed)."""
    bits, group_size, sym, skip = cfg.bits, cfg.group_size, cfg.sym, False
    for o in cfg.overrides:
        if re.search(o.pattern, name):
            bits = o.bits if o.bits is not None else bits
            group_size = o.group_size if o.group_size is not None else group_size
            sym = o.sym if o.sym is not None else sym
            skip = o.skip
    if skip:
        return None
    fp = FLOAT_SCHEMES.get(cfg.scheme)
    if fp is not None and group_size != -1 and d_in % group_size:
        raise WholeGroups(f"layer `{name}`: `scheme: {cfg.scheme}` scales groups of {group_size} columns, which do "
                          f"not divide its {d_in} (compressed-tensors needs whole groups): skip it with an override "
                          f"(`{{pattern: '{name}$', skip: true}}`)", name, d_in, group_size)
    return fitted(name, d_in, LayerSpec(bits, group_size, sym, fp=fp), cfg.strict_groups)


def fitted(name: str, d_in: int, spec: LayerSpec, strict: bool) -> LayerSpec:
    """`spec` with its group fitted to a layer of `d_in` input columns (`fit_group`)."""
    group, why = fit_group(d_in, spec.group_size)
    if why is None:
        if spec.group_size != -1 and d_in % spec.group_size:
            log.info("%s: in_features %d not divisible by group_size %d; the last group has %d columns",
                     name, d_in, spec.group_size, d_in % spec.group_size)
        return spec
    if strict:
        raise BadInput(f"layer `{name}`: {why}; `strict_groups: true` refuses to adapt it: use a group_size that "
                       "divides it, an override for this layer, or drop strict_groups")
    return dataclasses.replace(spec, group_size=group, asked=spec.group_size)


def adapted_groups(layers: dict[str, LayerSpec]) -> dict[str, list[int]]:
    """{layer: [the recipe's group_size, the group it got]} for the layers the plan adapted."""
    return {n: [s.asked, s.group_size] for n, s in sorted(layers.items()) if s.asked is not None}


def _spec(layers: dict, name: str, linear: nn.Linear, cfg: QuantizeConfig) -> LayerSpec | None:
    """The bound layer plan's entry; a layer a rotation put under a new name (evaluation-only `spectral`
    wraps each linear) is resolved from the recipe's settings here."""
    if name in layers:
        return layers[name]
    return layer_spec(name, linear, cfg) if name.endswith(".1") and name[:-2] in layers else None


def planned_spec(plan, name: str, spec: LayerSpec | None) -> LayerSpec | None:
    """`spec` with the allocation plan's width for this layer, when a plan covers it: a per-layer plan (`moe`) sets
    the bits and keeps the group fitted to the layer; a per-chunk plan uses its own group on every layer; a plan of
    llama.cpp types sets the layer's type (docs/gguf.md#mixed-precision-plans)."""
    if spec is None or plan is None or name not in plan.layers:
        return spec
    if plan.per_layer and not plan.gguf:
        return dataclasses.replace(spec, bits=plan.layer_spec(name).bits)
    return plan.layer_spec(name)


def check_overrides(cfg: QuantizeConfig, names: list[str]) -> None:
    for o in cfg.overrides:
        try:
            rx = re.compile(o.pattern)
        except re.error as e:
            raise BadInput(f"override pattern `{o.pattern}` is not a valid regex: {e}") from e
        if not any(rx.search(n) for n in names):
            log.warning("override pattern `%s` matches no layer", o.pattern)


class WholeGroups(BadInput):
    """A float scheme's group does not divide a layer's width (compressed-tensors stores whole groups only)."""

    def __init__(self, message: str, name: str, d_in: int, group: int):
        super().__init__(message)
        self.name, self.d_in, self.group = name, d_in, group


def planned_layers(adapter, cfg: QuantizeConfig) -> dict[str, LayerSpec]:
    """Every layer this stage will quantize with its settings (validates shapes; loads no data). The layers a float
    scheme's group does not fit are refused together, with one override that skips them all."""
    out, unfit = {}, []
    for i in range(len(adapter.blocks)):
        for name, lin in adapter.block_linears(i).items():
            try:
                spec = layer_spec(name, lin, cfg)
            except WholeGroups as e:
                unfit.append(e)
                continue
            if spec is not None:
                out[name] = spec
    if unfit:
        widths = ", ".join(str(w) for w in sorted({e.d_in for e in unfit}))
        pattern = "(" + "|".join(sorted({e.name.rsplit(".", 1)[-1] for e in unfit})) + ")$"
        raise BadInput(f"`scheme: {cfg.scheme}` scales groups of {unfit[0].group} columns, which do not divide the "
                       f"in_features ({widths}) of {len(unfit)} layers, e.g. `{unfit[0].name}` (compressed-tensors "
                       f"needs whole groups): skip them with an override (`{{pattern: '{pattern}', skip: true}}`: "
                       "they stay in full precision), or choose a scheme whose groups divide them")
    check_overrides(cfg, list(out))
    if not cfg.gguf and any(o.gguf for o in cfg.overrides):
        raise BadInput("an override sets a `gguf` type, but the stage has no `gguf` file type: add `gguf: TYPE` to "
                       "the stage (its layers then round on llama.cpp's blocks)")
    head = lm_head_target(adapter, cfg)
    if head:
        name, lin = head
        out[name] = fitted(name, lin.in_features, LayerSpec(cfg.bits, cfg.group_size, cfg.sym), cfg.strict_groups)
    return grid_layers(adapter, cfg, out) if cfg.gguf else out


def grid_layers(adapter, cfg: QuantizeConfig, layers: dict[str, LayerSpec]) -> dict[str, LayerSpec]:
    """`gguf: TYPE`: each layer on the llama.cpp type the GGUF file gives it (compress/quantize/ggml_grid.py), the
    token embeddings and the output too (the file stores them quantized, so the run evaluates them so); a layer the
    file keeps in floating point (a width no block divides) is left unquantized, as llama.cpp leaves it."""
    from compress.export.gguf import layer_types
    from compress.export.gguf.types import FLOAT, fallback
    from compress.quantize import ggml_grid

    fixed = sorted(cfg.model_fields_set & {"bits", "group_size", "sym", "strict_groups"})
    if fixed or any(o.bits is not None or o.group_size is not None or o.sym is not None or o.skip
                    for o in cfg.overrides):
        what = ", ".join(f"`{f}`" for f in fixed) or "an override's bits / group_size / sym / skip"
        raise BadInput(f"`gguf: {cfg.gguf}` gives every layer llama.cpp's type for it (the file stores every one of "
                       f"them quantized), so {what} does not apply: remove it (an override may set a layer's own "
                       "`gguf` type), or drop `gguf` to choose the grid yourself")
    types = layer_types(adapter.model, cfg.gguf)  # BadInput for a family the gguf export does not write
    out, kept = {}, []
    for name in [*layers, *(n for n in outside_blocks(adapter) if n not in layers)]:
        t = types.get(name)
        for o in cfg.overrides:
            if o.gguf is not None and t is not None and re.search(o.pattern, name):
                width = adapter.model.get_submodule(name).weight.shape[-1]
                t = fallback(o.gguf, width)
                if t != o.gguf:
                    log.info("%s: %s does not divide its %d columns; %s, as llama.cpp falls back", name, o.gguf,
                             width, t)
        if t is None or t in FLOAT:
            kept.append(name)
            continue
        out[name] = ggml_grid.layer_spec(t)
    if kept:
        log.info("gguf %s: %d layers stay in floating point in the file (no block divides their width), "
                 "e.g. `%s`; they are not quantized", cfg.gguf, len(kept), kept[0])
    return out


def outside_blocks(adapter) -> list[str]:
    """The weights a GGUF file quantizes outside the decoder blocks: the token embeddings and an untied LM head."""
    emb = adapter.embeddings()
    names = [n for n, m in adapter.model.named_modules() if m is emb and getattr(m, "weight", None) is not None]
    name, head = adapter.lm_head()
    tied = getattr(adapter.model.config, "tie_word_embeddings", False) or (emb is not None and head is not None
                                                                         and head.weight is emb.weight)
    if head is not None and not tied:
        names.append(name)
    return names


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


def _coverage(adapter):
    """MoE blocks: forced routing for the experts too few calibration rows reach (compress/models/moe.py)."""
    return lambda i: Coverage(adapter, i) if adapter.experts(i) is not None else None


def on_device(cfg: QuantizeConfig) -> str | None:
    """Why this quantize stage stays on the CPU with an accelerator named (None: its blocks run there)."""
    return f"`gguf: {cfg.gguf}`: llama.cpp's grid search runs in numpy" if cfg.gguf else None


def stage_devices(ctx, cfg: QuantizeConfig) -> list:
    return [torch.device("cpu")] if on_device(cfg) else ctx.devices


def apply(ctx, cfg: QuantizeConfig) -> dict:
    """The `quantize` stage of every registered quantizer."""
    adapter, layers, plan = ctx.adapter, ctx.facts.layers, ctx.inputs.get(Plan)
    q = FinalBlock(QUANTIZERS[type(cfg)](cfg), cfg)
    head = None
    if q.needs_head:
        head = LogitHead.of(adapter)
        log.info("last block: `final_block: %s`, tuned through the frozen final norm and LM head", cfg.final_block)
    tokens = ctx.calibration_tokens() if q.needs_data else None
    if cfg.guard is not None:
        q = Guarded(q, cfg.guard)
    adapted = adapted_groups(layers)
    if adapted:
        name, (asked, got) = next(iter(adapted.items()))
        log.info("group_size %d does not fit %d layers; each gets the nearest group that does (e.g. `%s`: %s); "
                 "report.md lists them", asked, len(adapted), name, got)
    bar = ctx.progress(total=len(adapter.blocks), desc=f"{ctx.key} blocks", unit="block")
    qweights = run_blockwise(
        model=adapter.model, blocks=adapter.blocks, block_linears=adapter.block_linears,
        specs=lambda name, lin: planned_spec(plan, name, _spec(layers, name, lin, cfg)), quantizer=q, tokens=tokens,
        load_block=lambda i: ctx.workspace.load_block(ctx.key, i),
        save_block=lambda i, done: ctx.workspace.save_block(ctx.key, i, done),
        seed=ctx.seed, progress=lambda done, total: bar.update(1),
        materialize=ctx.streamer.materialize if ctx.streamer else None,
        release=ctx.streamer.release if ctx.streamer else None, head=head, cover=_coverage(adapter),
        devices=stage_devices(ctx, cfg),
    )
    bar.close()
    block_layers = sorted(qweights)
    # after the blocks (a final-block objective through the head assumes it is FP): the `lm_head` option's head, and
    # with `gguf` the embeddings and output as the file stores them; RTN (llama.cpp's fit on a grid)
    for name in [n for n in outside_blocks(adapter) if n in layers and n not in qweights]:
        module, spec = adapter.model.get_submodule(name), layers[name]
        if cfg.guard is not None:
            q.guard(name, module, spec)
        if spec.ggml is not None:
            from compress.quantize import ggml_grid

            qw = ggml_grid.rtn(module.weight.data, spec.ggml)
        else:
            qw = rtn(module.weight.data, spec.bits, spec.group_size, spec.sym)
        set_weight(module, qw)
        qweights[name] = qw
    ctx.emit(QuantizedWeights(qweights, ctx.key, len(adapter.blocks), block_layers))
    out = {"layers": len(qweights), "calibration_tokens": 0 if tokens is None else tokens.numel()}
    if adapted:
        out["adapted_groups"] = adapted
    if cfg.guard is not None:
        out["guard_moved"] = q.moved  # blocks loaded from checkpoints on resume are not counted again
        log.info("flipguard (rule %s) moved %d weights before rounding", cfg.guard.rule, q.moved)
    return out
