"""The bind step: every cross-stage dependency of a recipe, resolved once at plan time (docs/stages.md).

It walks the stages in order on the weightless skeleton and
- checks ordering rules (rotations before quantization, what a streamed model allows),
- checks the typed hand-offs: each consumed one has an earlier producer, a Plan is applied by the next
  quantize stage and not overwritten before,
- computes each quantize stage's layer plan once (`Facts.layers`),
- hands each stage what it needs from its neighbours (`Facts`): the rounding of the quantize stage after a
  rotation or an allocation, the layers that stage rounds, the plan's producer, the shapes before it,
- resolves model-dependent defaults through each registration's `check`,
- checks the exports: evaluation-only stages, device rules, shapes the format cannot hold.

No stage reads another stage's config: what it needs from one arrives in its `Facts`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from pydantic import BaseModel

from compress import registry
from compress.config import WEIGHT_ONLY_SCHEMES
from compress.errors import BadInput
from compress.handoff import ModelSpec, name
from compress.quantize.spine import adapted_groups, group_for, planned_layers


@dataclass
class Facts:
    """What the bind step resolved for one stage from the rest of the recipe."""

    index: int
    key: str
    exports: list[str] = field(default_factory=list)  # the recipe's export formats
    rounding: tuple[int, int, bool] | None = None  # (bits, group_size, sym) of the next quantize stage
    consumer: str | None = None  # method of the next quantize stage (the one an allocation plan is for)
    grid: str | None = None  # the next quantize stage's `gguf` type (it rounds on llama.cpp's grids), else None
    scheme: str | None = None  # the next quantize stage's weight-and-activation `scheme` (w8a8-int8), else None
    activations: str = "dynamic"  # and its `activations` (dynamic | static)
    capabilities: frozenset = frozenset()  # what that method can do (registry.Entry.capabilities)
    layers: dict = field(default_factory=dict)  # quantize: {name: LayerSpec} it rounds; allocate: its consumer's
    plan_from: str | None = None  # quantize: the key of the allocate stage whose Plan it applies
    spec: ModelSpec | None = None  # shapes before this stage
    # exports: (index, method, (bits, group_size, sym), {name: LayerSpec}) of every quantize stage
    quantized: list = field(default_factory=list)
    mixed: bool = False  # exports: an allocation plan assigns per-chunk widths
    widths: set = field(default_factory=set)  # exports: every bit width a layer may end up with
    stream: bool = False  # the model is streamed block by block
    after_quantize: bool = False  # a quantize stage runs before this one
    produced: set = field(default_factory=set)  # the hand-off types the stages before this one produce
    adapted: dict = field(default_factory=dict)  # quantize: {layer: [group_size asked, group it gets]} (`fit_group`)
    notes: list = field(default_factory=list)  # what the plan tells the user before calibration (adaptations)
    # the group the next quantize stage gives layer `name` at `d_in` input columns (`quantize.spine.group_for`; a
    # per-chunk allocation in between: its one group), None without a quantize stage after this one
    group_of: Callable[[str, int], int | None] | None = None
    changes: list = field(default_factory=list)  # the shapes this stage changes, in words (`ModelSpec.differences`)


@dataclass
class Bound:
    index: int
    key: str
    cfg: BaseModel  # as it will run on this model
    entry: registry.Entry
    facts: Facts


@dataclass
class Binding:
    stages: list[Bound]
    exports: list[Bound]
    base: ModelSpec  # the source model's shapes
    spec: ModelSpec  # the shapes after every stage
    serving: dict = field(default_factory=dict)  # {engine: [rules.Problem]} of the checkpoint the plan writes


def stage_key(i: int, cfg) -> str:
    return f"{i:02d}-{cfg.stage}-{cfg.method}"


def bind(recipe, adapter) -> Binding:
    cfgs, formats = recipe.stage_configs, recipe.export.names()
    entries = [registry.get(c.stage, c.method) for c in cfgs]
    _check_order(cfgs, recipe)
    base = spec = ModelSpec.of(adapter)
    produced: dict[type, int] = {}
    pending: dict[type, int] = {}  # must-be-consumed hand-offs not yet consumed
    layers: dict[int, dict] = {}
    bound = []
    for i, (cfg, entry) in enumerate(zip(cfgs, entries)):
        facts = Facts(i, stage_key(i, cfg), exports=formats, spec=spec, stream=recipe.model.stream,
                      after_quantize=any(c.stage == "quantize" for c in cfgs[:i]), produced=set(produced))
        q = _next(cfgs, i, "quantize")
        if q is not None:
            facts.rounding, facts.consumer = (cfgs[q].bits, cfgs[q].group_size, cfgs[q].sym), cfgs[q].method
            facts.grid, facts.scheme, facts.activations = cfgs[q].gguf, cfgs[q].scheme, cfgs[q].activations
            facts.capabilities = entries[q].capabilities
            facts.group_of = _group_of(cfgs, entries, i, q)
            layers.setdefault(q, planned_layers(adapter, cfgs[q]))
            if cfg.stage == "smooth":  # it searches against the layers' rounding (nominal widths under a plan)
                facts.layers = layers[q]
            if cfg.stage == "allocate":
                if not (entry.per_layer or cfgs[q].gguf):  # a per-chunk plan rounds every layer with one group
                    layers[q] = {n: dataclasses.replace(s, group_size=cfgs[q].group_size, asked=None)
                                 for n, s in layers[q].items()}
                facts.layers = layers[q]
        for kind in entry.consumes:
            if kind not in produced:
                makers = [f"{e.stage}/{e.method}" for e in _all() if kind in e.produces]
                raise BadInput(f"stage {i} (`{cfg.stage}`/{cfg.method}) consumes a {name(kind)}, which no earlier "
                               f"stage produces; add one before it ({', '.join(makers) or 'none registered'})")
        for kind in entry.consumes + entry.uses:
            if kind in pending:
                if cfg.stage == "quantize":
                    facts.plan_from = stage_key(pending[kind], cfgs[pending[kind]])
                del pending[kind]
        if cfg.stage == "quantize":
            facts.layers = layers.setdefault(i, planned_layers(adapter, cfg))
            facts.adapted = adapted_groups(facts.layers)
        if entry.check is not None:
            cfg = entry.check(adapter, cfg, facts) or cfg
        for kind in entry.produces:
            if kind in pending:
                raise BadInput(f"stage {pending[kind]} (`{cfgs[pending[kind]].stage}`) is followed by another "
                               f"`{cfg.stage}` (stage {i}) before any stage consumes its {name(kind)}")
            produced[kind] = i
            if kind.must_be_consumed:
                pending[kind] = i
        if ModelSpec in entry.produces and entry.reshape is not None:
            shaped = entry.reshape(spec, cfg)
            shaped.restore(adapter, spec)  # the weightless skeleton takes the new shapes (later stages plan on them)
            facts.changes = shaped.differences(spec)
            spec = shaped
            layers.clear()
        bound.append(Bound(i, facts.key, cfg, entry, facts))
    for kind, i in pending.items():
        users = sorted({e.stage for e in _all() if kind in e.consumes + e.uses})
        raise BadInput(f"stage {i} (`{cfgs[i].stage}`) needs a `{'`/`'.join(users)}` stage after it to apply its "
                       f"{name(kind)}")
    exports = _bind_exports(recipe, adapter, bound, base, spec)
    return Binding(bound, exports, base, spec, _serving(recipe, adapter, exports))


def _serving(recipe, adapter, exports: list[Bound]) -> dict:
    """The servability table of the planned checkpoint (compress/serve/rules.py); refuses a plan an engine of
    `export.serve` cannot serve. No export: no table."""
    from compress.serve.plan import check, planned

    if not exports:
        if recipe.export.serve:
            raise BadInput("export.serve names engines, but the recipe has no `export.formats`")
        return {}
    f = exports[0].facts
    scheme = next((s.scheme for s in recipe.stages if getattr(s, "scheme", None)), None)
    kv = next(((s.kv_cache, s.kv_scales) for s in recipe.stages if getattr(s, "kv_cache", None)), None)
    return check(planned(adapter, recipe.export, f.quantized, f.widths, f.mixed, scheme, kv), recipe.export.serve)


def _bind_exports(recipe, adapter, stages: list[Bound], base: ModelSpec, spec: ModelSpec) -> list[Bound]:
    why = [(b, reason) for b in stages if b.entry.evaluation_only and (reason := b.entry.evaluation_only(b.cfg))]
    formats = recipe.export.names()
    if why and formats:
        b, reason = why[0]
        raise BadInput(f"stage {b.index} (`{b.cfg.stage}`/{b.cfg.method}) {reason}, which no exporter writes; remove "
                       "`export.formats` (evaluation only) or use a deployable configuration")
    quantized = [(b.index, b.cfg.method, (b.cfg.bits, b.cfg.group_size, b.cfg.sym, b.cfg.gguf), b.facts.layers)
                 for b in stages if b.cfg.stage == "quantize"]
    _check_grids(stages, formats)
    _check_schemes(stages, formats, recipe.model.stream, adapter)
    mixed = any(b.cfg.stage == "allocate" and not (b.entry.per_layer or b.facts.grid) for b in stages)  # chunks
    widths = {spec.bits for *_, layers in quantized for spec in layers.values()}
    for b in stages:
        if b.cfg.stage == "allocate":
            widths |= b.cfg.widths()
    out = []
    for fmt in formats:
        entry = registry.get("export", fmt)
        cfg = recipe.export.config(fmt)
        facts = Facts(-1, f"export-{fmt}", exports=formats, spec=spec, quantized=quantized, mixed=mixed,
                      stream=recipe.model.stream, widths=widths)
        problems = holds(fmt, spec, base)
        if problems:
            raise BadInput(f"export {fmt} cannot hold the shapes the stages produce: {'; '.join(problems)}")
        if entry.check is not None:
            cfg = entry.check(adapter, cfg, facts) or cfg
        out.append(Bound(-1, facts.key, cfg, entry, facts))
    return out


def _check_schemes(stages: list[Bound], formats: list[str], stream: bool = False, adapter=None) -> None:
    """A quantize stage with an activation `scheme` writes only the exports that carry activation quantization
    (registry capability "activations"), and those exports write only such stages' layers; a `kv_cache` needs an
    attention whose keys and values it can hook."""
    quantize = [b for b in stages if b.cfg.stage == "quantize"]
    schemed = [b for b in quantize if getattr(b.cfg, "scheme", None)]
    carry = [f for f in formats if "activations" in registry.get("export", f).capabilities]
    if schemed:
        b = schemed[0]
        other = [f for f in formats if f not in carry]
        if other:
            what = ("quantizes activations too" if b.cfg.scheme not in WEIGHT_ONLY_SCHEMES else
                    "rounds onto the NVFP4 float grid")
            raise BadInput(f"stage {b.index} {what} (`scheme: {b.cfg.scheme}`), which "
                           f"{', '.join(other)} cannot carry: export `{', '.join(carry) or 'compressed-tensors'}`"
                           " instead, or drop `scheme` for an integer weight-only checkpoint")
        if len({(c.cfg.scheme, c.cfg.activations, c.cfg.kv_cache, c.cfg.kv_scales) for c in schemed}) > 1 or \
                len(schemed) != len(quantize):
            raise BadInput("every quantize stage of a run with an activation `scheme` needs the same scheme, "
                           "`activations` and `kv_cache`")
        if b.cfg.kv_cache is not None and adapter is not None:
            from compress.quantize.kvcache import attention_modules

            try:
                attention_modules(adapter)
            except ValueError as e:
                raise BadInput(f"stage {b.index}: {e}") from None

        if b.cfg.activations == "static" and stream:
            raise BadInput(f"stage {b.index}: `activations: static` calibrates its scales with the whole model in "
                           "memory after quantization; `model.stream` keeps one block at a time: use `activations: "
                           "dynamic` (scales computed at run time) or load the model whole")
    elif carry and quantize:
        raise BadInput(f"export {carry[0]} writes checkpoints with activation quantization: give the quantize stage "
                       "`scheme: w8a8-int8` (or `fp8`, `nvfp4a16`), or export integer weight-only checkpoints with "
                       "`hf`")


def _check_grids(stages: list[Bound], formats: list[str]) -> None:
    """A quantize stage on llama.cpp's grids (`gguf`) writes only GGUF: no other format holds the K-quants' two-level
    scales and float minimums (docs/gguf.md#rounding-on-llamacpps-grids)."""
    grid = next((b for b in stages if b.cfg.stage == "quantize" and b.cfg.gguf), None)
    if grid is None:
        return
    other = [f for f in formats if f != "gguf"]
    if other:
        raise BadInput(f"stage {grid.index} rounds on llama.cpp's {grid.cfg.gguf} blocks (`gguf: {grid.cfg.gguf}`), "
                       f"which only the gguf export stores; drop {', '.join(other)} from export.formats, or drop "
                       "`gguf` and choose bits / group_size / sym for those formats")


def holds(fmt: str, spec: ModelSpec, base: ModelSpec) -> list[str]:
    """Why `fmt` cannot hold `spec` (empty when it can). A transformers config has one FFN width and one head
    count for every layer; the traced graphs (onnx, openvino) bake each layer's FFN width in but keep one
    KV-cache layout, so their heads must stay uniform."""
    out = []
    if fmt in ("hf", "fake", "gguf") and not spec.uniform("ffn"):
        out.append("per-layer FFN widths (a transformers config, and the GGUF the export writes, has one "
                   "`intermediate_size`)")
    if not (spec.uniform("heads") and spec.uniform("kv_heads")):
        out.append("per-layer head counts (one KV-cache layout for every layer)")
    if any(b.experts and len(set(b.experts)) > 1 for b in spec.blocks):
        out.append("experts of different widths")
    return out


# stages that rewrite the full-precision weights the quantizer rounds, and why they must come first
BEFORE_QUANTIZE = {
    "rotate": "rotations must run before quantization (they rewrite the weights the quantizer rounds)",
    "smooth": "smoothing must run before quantization (it rescales the weights the quantizer rounds)",
}


def _check_order(cfgs, recipe) -> None:
    for i, cfg in enumerate(cfgs):
        if cfg.stage in BEFORE_QUANTIZE and any(c.stage == "quantize" for c in cfgs[:i]):
            raise BadInput(f"stage {i} (`{cfg.stage}`) comes after a `quantize` stage; {BEFORE_QUANTIZE[cfg.stage]}")
        if cfg.stage == "rotate" and any(c.stage == "smooth" for c in cfgs[:i]):
            raise BadInput(f"stage {i} (`rotate`) comes after a `smooth` stage; rotate first (a rotation of the "
                           "residual stream would mix the per-channel scales the smoothing chose)")
    if recipe.model.stream:
        if len(cfgs) != 1 or cfgs[0].stage != "quantize":
            raise BadInput("model.stream supports exactly one `quantize` stage")
        if [f for f in recipe.export.names() if f != "hf"]:
            raise BadInput("model.stream exports only the `hf` format")


def _group_of(cfgs, entries, i: int, q: int):
    """`Facts.group_of` for stage i, whose next quantize stage is q."""
    if any(c.stage == "allocate" and not e.per_layer for c, e in zip(cfgs[i + 1:q], entries[i + 1:q])):
        return lambda name, d_in: cfgs[q].group_size  # a per-chunk plan rounds every layer with one group
    return lambda name, d_in: group_for(cfgs[q], name, d_in)


def _next(cfgs, i: int, stage: str) -> int | None:
    return next((k for k in range(i + 1, len(cfgs)) if cfgs[k].stage == stage), None)


def _all() -> list[registry.Entry]:
    registry.load_all()
    return list(registry._REGISTRY.values())
