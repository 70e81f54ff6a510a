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

# Modules that register stages, imported by name.
METHOD_MODULES = (
    "compress.methods.rtn",
    "compress.methods.gptq",
    "compress.methods.autoround",
    "compress.methods.allocate",
    "compress.methods.router",
    "compress.methods.prune",
    "compress.methods.heal",
    "compress.methods.prunepath",
    "compress.methods.select",
    "compress.rotation.walsh",
    "compress.rotation.autoround_hadamard",
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


_REGISTRY: dict[tuple[str, str], Entry] = {}


def register(stage: str, method: str, config: type[BaseModel], description: str = "", check: Callable | None = None,
             **declared):
    """Register `fn(ctx, cfg) -> metrics` as `stage`/`method`; `declared`: the Entry fields above."""
    def deco(fn):
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
