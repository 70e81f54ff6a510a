"""Registry of `(stage, method) -> (Config, apply)`: the pipeline finds a stage by name, never by its class.

A method module registers itself with a decorator; modules are imported by name in `load_all`,
nothing is discovered by scanning.

    @register("quantize", "rtn", RTNConfig)
    def apply(ctx: StageContext, cfg: RTNConfig) -> dict: ...
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
    # check(adapter, cfg, recipe) at plan time, on the weightless skeleton: raises BadInput, or returns None or the
    # config as it will run on this model (model-dependent defaults resolved, e.g. `final_block: auto`)
    check: Callable | None = None


_REGISTRY: dict[tuple[str, str], Entry] = {}


def register(stage: str, method: str, config: type[BaseModel], description: str = "", check: Callable | None = None):
    def deco(fn):
        _REGISTRY[(stage, method)] = Entry(stage, method, config, fn, description or (fn.__doc__ or "").strip(),
                                           check)
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
