"""Registry of `(stage, method) -> Entry`: the pipeline finds a stage by name, never by its class.

A stage module registers itself with a decorator; modules are imported by name in `load_all`,
nothing is discovered by scanning. The registration says what the stage consumes and produces (typed
hand-offs, compress/handoff.py), whether a finished stage must replay on `--resume`, and whether the
result can be exported (docs/stages.md):

    @register("measure", "occupancy", OccupancyConfig, consumes=(QuantizedWeights,), produces=(ModelSpec,))
    def apply(ctx: StageContext, cfg: OccupancyConfig) -> dict:
        spec = ...  # from ctx.inputs[QuantizedWeights]
        ctx.emit(spec)
        return {"metric": ...}
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel

from compress.errors import BadInput

# Modules that register stages, imported by name; report.md renders the stages' sections in this order.
METHOD_MODULES = (
    "compress.quantize.rtn",
    "compress.quantize.gptq",
    "compress.quantize.autoround",
    "compress.allocate.stage",
    "compress.allocate.moe",
    "compress.finetune.router",
    "compress.select.stage",
    "compress.prune.structured",
    "compress.prune.heal",
    "compress.prune.prunepath",
    "compress.rotation.walsh",
    "compress.rotation.infoquant",
    "compress.rotation.autoround_hadamard",
    "compress.smooth.awq",
    "compress.smooth.smoothquant",
    "compress.export.stage",
)


@dataclass(frozen=True)
class Entry:
    stage: str
    method: str
    config: type[BaseModel]
    apply: Callable
    description: str = ""
    # check(adapter, cfg, facts) at plan time, on the weightless skeleton, with what the bind step resolved for
    # this stage from its neighbours (compress/bind.py `Facts`): raises BadInput, or returns None or the config
    # as it will run on this model (model-dependent defaults resolved, e.g. `final_block: auto`)
    check: Callable | None = None
    consumes: tuple[type, ...] = ()  # hand-offs an earlier stage must produce
    uses: tuple[type, ...] = ()  # hand-offs consumed when an earlier stage produced them
    produces: tuple[type, ...] = ()  # hand-offs this stage emits (saved in its directory, loaded on --resume)
    replay: bool = False  # a finished stage is applied again on --resume (rotations rewrite weights in place)
    # evaluation_only(cfg) -> None, or why this configuration cannot be exported (a run-time operator)
    evaluation_only: Callable | None = None
    # reshape(spec, cfg) -> ModelSpec at plan time: the shapes after this stage, for stages producing a ModelSpec
    reshape: Callable | None = None
    # routed: the stage runs PrunePath FFNs at their threshold (heal trains the routed model); other stages see
    # them dense (calibration statistics of every neuron)
    routed: bool = False
    # modules the stage imports beyond the core dependencies (compress/extras.py maps each to its extra): a recipe
    # naming the stage is refused at load time, with the install command, when one is missing
    requires: tuple[str, ...] = ()
    # what the method can do, for the stages around it to ask (the bind step hands a quantize stage's to the stages
    # before it in `Facts.capabilities`): e.g. a quantizer's "chunk_plan" (fits a per-chunk allocation plan) and
    # "sign" (rounds 1-bit weights); see compress/quantize/spine.py `Quantizer.capabilities`
    capabilities: frozenset[str] = frozenset()
    # per_layer: an allocation whose Plan gives each layer one width (the quantize stage keeps fitting each layer's
    # group); otherwise a Plan assigns widths per column chunk, all with the quantize stage's one group
    per_layer: bool = False
    # on_device(cfg) -> None when the stage's block work runs on the recipe's `device` (compress/driver.py), or why
    # this configuration stays on the CPU; stages without it run on the CPU. The plan says which stages stay on the
    # CPU when the recipe names an accelerator
    on_device: Callable | None = None
    # report: the stage's own sections of report.json / report.md (`Section`); the pipeline and eval/report.py
    # render every registered section the same way and know none by name
    report: tuple[Section, ...] = ()
    # reference: the stage reads the full-precision model (`ctx.reference()`: loaded once per run, shared with the
    # other stages and the evaluation, released after the last of them)
    reference: bool = False
    module: str = ""  # the registering module (set by `register`)


@dataclass(frozen=True)
class Section:
    """A stage's section of the run's report: `metrics[key]` of each stage registering it goes to report.json's
    `key`, and `render` turns it into report.md text.

    collect: "last" (the last such stage's value), "merge" (every stage's dicts merged, in order) or "each" (a list
    of every stage's value, in order; `render` then renders one stage's value, as a line below the `title`
    heading, and each value is rendered by the section of the registration that produced it: a value names its
    `stage` and `method`). place: "stages" (report.md after the calibration, before the evaluation) or "size" (after
    the size tables)."""

    key: str
    render: Callable
    collect: str = "last"
    place: str = "stages"
    title: str = ""

    def __post_init__(self):
        if self.collect not in ("last", "merge", "each") or self.place not in ("stages", "size"):
            raise ValueError(f"section `{self.key}`: collect {self.collect!r}, place {self.place!r}")
        if self.collect == "each" and not self.title:
            raise ValueError(f"section `{self.key}` collects each stage's value: give it a title")


_REGISTRY: dict[tuple[str, str], Entry] = {}


def register(stage: str, method: str, config: type[BaseModel], description: str = "", check: Callable | None = None,
             **declared):
    """Register `fn(ctx, cfg) -> metrics` as `stage`/`method`; `declared`: the Entry fields above."""
    def deco(fn):
        declared.setdefault("module", fn.__module__)
        _REGISTRY[(stage, method)] = Entry(stage, method, config, fn, description or (fn.__doc__ or "").strip(),
                                           check, **declared)
        return fn

    return deco


def load_all() -> None:
    for name in METHOD_MODULES:
        importlib.import_module(name)


def stages() -> list[str]:
    load_all()
    return sorted({s for s, _ in _REGISTRY})


def methods(stage: str) -> list[str]:
    load_all()
    return sorted(m for s, m in _REGISTRY if s == stage)


def sections() -> dict[str, Section]:
    """Every registered report section by key, in the order of `METHOD_MODULES` (registrations from elsewhere, e.g.
    a test's, after them); registrations sharing a key share one section, except "each" sections, whose values
    are rendered by their own registration's (`section_of`)."""
    out: dict[str, Section] = {}
    for e in _ordered():
        for s in e.report:
            out.setdefault(s.key, s)
    return out


def section_of(stage: str, method: str, key: str) -> Section | None:
    """The section `key` of the registration `stage`/`method` (what renders one value of an "each" section)."""
    load_all()
    e = _REGISTRY.get((stage, method))
    return next((s for s in e.report if s.key == key), None) if e is not None else None


def having(stage: str, capability: str) -> list[str]:
    """The methods of `stage` whose registration declares `capability`, in the order of `METHOD_MODULES`."""
    return [e.method for e in _ordered() if e.stage == stage and capability in e.capabilities]


def _ordered() -> list[Entry]:
    """Every registration in the order of `METHOD_MODULES` (a quantizer: of its class's module), whatever order the
    modules were imported in; registrations from elsewhere (a test's) after them."""
    load_all()
    rank = {m: k for k, m in enumerate(METHOD_MODULES)}
    return sorted(_REGISTRY.values(), key=lambda e: rank.get(e.module, len(rank)))


def suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f", did you mean `{close[0]}`?" if close else ""


def get(stage: str, method: str) -> Entry:
    load_all()
    if stage not in stages():
        raise BadInput(f"unknown stage `{stage}`{suggest(stage, stages())} (known: {', '.join(stages())})")
    if (stage, method) not in _REGISTRY:
        known = methods(stage)
        raise BadInput(
            f"unknown method `{method}` for stage `{stage}`{suggest(method, known)} (known: {', '.join(known)})"
        )
    return _REGISTRY[(stage, method)]
