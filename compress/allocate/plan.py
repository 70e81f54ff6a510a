"""The allocation `Plan`: the `allocate` stage's hand-off to the next `quantize` stage (docs/allocate.md).

Saved in the stage's directory as `plan.json` (unit -> option per layer, the format `method: file` reads
back) and `energy.safetensors` (the per-column input energy the clip search weights by), so a resumed run
loads it without a calibration pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from compress.allocate.problem import Option, Problem, ggml_type_at, gguf_option, map_bits, option_bits
from compress.driver import LayerSpec, MixedSpec
from compress.errors import BadInput
from compress.handoff import Handoff
from compress.qweight import KEEP_BITS

PLAN_FORMAT, PLAN_VERSION = "compress-plan", 1
PLAN_FILE, ENERGY_FILE = "plan.json", "energy.safetensors"


@dataclass
class Plan(Handoff):
    """unit -> option, per layer: `layers[name][j]` is the option index of chunk j. `chunk_size` 0: one unit
    per layer (`layers[name] == [i]`), rounded at that width by the quantizer itself (any method: the
    expert-level plans of `allocate method: moe`, and the llama.cpp types of a plan for a quantize stage on llama.cpp's
    grids), with no per-unit metadata stored."""

    options: list[Option]
    chunk_size: int
    group_size: int | None  # None: llama.cpp types (`gguf`), each with its own blocks
    sym: bool | None
    budget: float
    layers: dict[str, list[int]]
    shapes: dict[str, tuple[int, int]]
    method: str
    energy: dict[str, torch.Tensor] | None = None
    info: dict | None = None

    must_be_consumed: ClassVar[bool] = True

    @property
    def per_layer(self) -> bool:
        return self.chunk_size == 0

    @property
    def gguf(self) -> bool:
        """The options are llama.cpp types (docs/gguf.md#mixed-precision-plans)."""
        return any(o.ggml for o in self.options)

    @property
    def map_bits(self) -> int:
        return 0 if self.per_layer else map_bits(self.options)

    def layer_type(self, name: str) -> str:
        """A llama.cpp-type plan: the type layer `name` is stored in (llama.cpp's fallback where the planned type's
        block does not divide its width)."""
        return ggml_type_at(self.options[self.layers[name][0]].ggml, self.shapes[name][1])

    def layer_spec(self, name: str) -> LayerSpec:
        if self.gguf:
            from compress.quantize import ggml_grid

            return ggml_grid.layer_spec(self.layer_type(name))
        if self.per_layer:
            return LayerSpec(self.options[self.layers[name][0]].bits, self.group_size, self.sym)
        opts = tuple((self.options[i].bits, self.options[i].treatment) for i in self.layers[name])
        quantized = [b for b, _ in opts if b != KEEP_BITS]
        mixed = MixedSpec(self.chunk_size, opts, self.map_bits, None if self.energy is None else self.energy[name])
        return LayerSpec(max(quantized, default=8), self.group_size, self.sym, mixed)

    def layer_bits(self, name: str) -> int:
        d_out, d_in = self.shapes[name]
        c = self.chunk_size or d_in
        return sum(option_bits(d_out, min(c, d_in - j * c), self.group_size, self.options[i], self.sym, self.map_bits)
                   for j, i in enumerate(self.layers[name]))

    def total_bits(self) -> int:
        return sum(self.layer_bits(n) for n in self.layers)

    def total_weights(self) -> int:
        return sum(o * i for o, i in self.shapes.values())

    def effective_bits(self) -> float:
        return self.total_bits() / self.total_weights()

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION, "method": self.method, "budget": self.budget,
            "chunk_size": self.chunk_size, "group_size": self.group_size, "sym": self.sym,
            "map_bits": self.map_bits,
            "options": [{"gguf": o.ggml} if o.ggml else {"bits": o.bits, "treatment": o.treatment}
                        for o in self.options],
            "effective_bits": self.effective_bits(), "total_bits": self.total_bits(),
            "total_weights": self.total_weights(),
            "layers": {n: {"shape": list(self.shapes[n]), "options": self.layers[n],
                           "bits": [self.options[i].bits for i in self.layers[n]],
                           **({"type": self.layer_type(n)} if self.gguf else {}),
                           "effective_bits": self.layer_bits(n) / (self.shapes[n][0] * self.shapes[n][1])}
                       for n in self.layers},
            "info": self.info or {},
        }

    @classmethod
    def from_json(cls, data: dict, where: str) -> "Plan":
        if data.get("format") != PLAN_FORMAT or data.get("version") != PLAN_VERSION:
            raise BadInput(f"{where} is not a {PLAN_FORMAT} version {PLAN_VERSION} file "
                           f"(format {data.get('format')!r}, version {data.get('version')!r})")
        options = [gguf_option(o["gguf"]) if o.get("gguf") else Option(o["bits"], o["treatment"])
                   for o in data["options"]]
        plan = cls(options, data["chunk_size"], data["group_size"], data["sym"], data["budget"],
                   {n: list(v["options"]) for n, v in data["layers"].items()},
                   {n: tuple(v["shape"]) for n, v in data["layers"].items()}, data["method"], info=data.get("info"))
        for n, v in data["layers"].items():
            want = 1 if plan.per_layer else math.ceil(v["shape"][1] / plan.chunk_size)
            if len(v["options"]) != want or any(not 0 <= i < len(options) for i in v["options"]):
                raise BadInput(f"{where}: layer {n} needs {want} option indices in [0, {len(options)})")
        if plan.total_bits() != data["total_bits"]:
            raise BadInput(f"{where}: recorded total_bits {data['total_bits']} does not match the plan "
                           f"({plan.total_bits()}); the file was edited or is corrupt")
        return plan

    def save(self, ws, key: str) -> None:
        from safetensors.torch import save

        ws.write_json(f"stages/{key}/{PLAN_FILE}", self.to_json())
        if self.energy is not None:
            ws.write_bytes(f"stages/{key}/{ENERGY_FILE}", save({n: e.contiguous() for n, e in self.energy.items()}))

    @classmethod
    def load(cls, ctx, key: str) -> "Plan":
        from safetensors.torch import load_file

        path = cls.artifact(ctx, key, PLAN_FILE)
        plan = cls.from_json(json.loads(path.read_text()), str(path))
        if not plan.per_layer:  # per-layer plans are fitted by the quantizer itself: no energy
            plan.energy = load_file(str(cls.artifact(ctx, key, ENERGY_FILE)))
        return plan


def plan_from_choice(p: Problem, choice: torch.Tensor, shapes: dict, cfg, method: str,
                     energy: dict, info: dict) -> Plan:
    layers = {n: [] for n in p.layers}
    for u in range(p.n_units):
        layers[p.layers[int(p.unit_layer[u])]].append(int(choice[u]))
    per_layer = any(o.ggml for o in p.options)  # llama.cpp types: one per tensor
    plan = Plan(p.options, 0 if per_layer else cfg.chunk_size, cfg.group_size, cfg.sym, cfg.budget, layers, shapes,
                method, energy, info)
    assert plan.total_bits() == p.bits_of(choice) <= p.budget  # the two accountings agree, budget holds
    return plan


def read_plan(path: str) -> Plan:
    p = Path(path).expanduser()
    if not p.is_file():
        raise BadInput(f"plan file `{path}` does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"plan file `{path}` is not JSON: {e}") from e
    return Plan.from_json(data, path)


def check_plan_file(plan: Plan, layers: dict, group_size: int | None, sym: bool | None, where: str,
                    gguf: bool = False) -> None:
    """`layers`: {name: (linear, block index)} of the quantize stage the plan is for, with its group and sym (`gguf`:
    that stage rounds on llama.cpp's grids, and the plan must hold llama.cpp types)."""
    if gguf != plan.gguf:
        raise BadInput(f"plan `{where}` holds " + ("llama.cpp types" if plan.gguf else "bit widths") + ", but the next "
                       "quantize stage " + ("rounds on llama.cpp's grids (`gguf`)" if gguf else
                                            "does not round on llama.cpp's grids (no `gguf`)"))
    if not gguf and (group_size, sym) != (plan.group_size, plan.sym):
        raise BadInput(f"plan `{where}` (group_size {plan.group_size}, sym {plan.sym}) and the next quantize stage "
                       f"(group_size {group_size}, sym {sym}) must agree")
    missing = sorted(set(layers) ^ set(plan.layers))
    if missing:
        raise BadInput(f"plan `{where}` does not cover the same layers as this recipe (e.g. `{missing[0]}`)")
    for name, (lin, _) in layers.items():
        if tuple(lin.weight.shape) != tuple(plan.shapes[name]):
            raise BadInput(f"plan `{where}`: layer {name} is {tuple(plan.shapes[name])} in the plan, "
                           f"{tuple(lin.weight.shape)} in the model")
