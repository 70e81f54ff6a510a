"""`allocate` stage: mixed precision over column chunks under an effective-bit budget (docs/allocate.md).

Methods: `rl` (PPO controller, compress/ppo.py), `greedy` (error-per-bit knapsack), `lagrangian`
(multiple-choice knapsack by Lagrangian relaxation), `uniform` (one option everywhere: the nearest
feasible uniform width, the benchmark's baseline) and `file` (a `plan.json` from an earlier run; no search).
Every method writes `plan.json` and `plan_heatmap.png` to the run directory and hands the plan to the
next `quantize` stage (which must follow, with the same `group_size` and `sym`, method `rtn` or
`autoround`), where each unit is fitted with its option.

Statistics: the layers are the next quantize stage's block linears. `a_k = E[x_k^2]` per input column is
collected in one forward pass of the model as it is when the stage runs, i.e. on the **full-precision
trajectory** (allocation runs before any quantization; after a `rotate` stage, the rotated FP model).
The proxy error of every unit and option is computed from those statistics (`allocation.layer_units`).

Terminal reward of the RL controller (`terminal`): `ppl` = -kappa * (log ppl_Q - log ppl_FP) and
`kl` = -kappa * mean KL(p_FP || p_Q) of the next-token distributions (the same scale as the log-ppl
increase, without the variance of the sampled labels), `hidden_mse` = -kappa * relative MSE of the final
hidden states, all on the first `reward_samples` calibration sequences cut to `reward_seqlen` tokens,
with every planned linear replaced by its plan's fake-quantized weight; `none` = proxy reward only. The
terminal reward keeps every option's fake-quantized copy of every planned layer in memory (|options| x the
planned weights in fp32): meant for small and mid-size models; use `terminal: none` (or `greedy` /
`lagrangian`) where that does not fit.

Real-model calibration of the RL controller (all on calibration tokens; the evaluation text is never seen).
With a terminal reward, a second, larger *selection slice* (the first `select_samples` calibration
sequences cut to `select_seqlen` tokens; it contains the training slice) serves two purposes:
- `sensitivity: layer` (default): per layer l, the terminal loss increase dL_l when layer l alone is at its
  cheapest option (every other layer full precision) over its proxy error at that option gives a weight
  w_l = dL_l / e_l (floored at 1% of the largest); the controller's problem has err(u, o) scaled by the
  weight of u's layer (`allocation.reweight`), so the dense reward, the bit-price shaping and the state
  (plus the log weight as a feature) see an estimate of the loss increase instead of per-layer output
  errors on incomparable scales. Costs one forward per planned layer. `unit`: the same per unit (one
  forward per unit; on stories-llama-1m @ 3.0 it was no better than `layer`); `none`: the plain proxy.
- the final plan is picked among the controller's candidates (compress/ppo.py) by the terminal score on the
  selection slice, not by the small training slice it was trained on. (Taking the selection slice from the
  calibration sequences the training slice does not use was tried and was not better.)
`warm_start` > 0: PPO starts from a policy behaviour-cloned toward the greedy knapsack plan of the
controller's (sensitivity-weighted, if on) problem, and that plan is one of the final candidates: the RL
plan is never worse than it by the selection score. The non-RL `greedy` and `lagrangian` methods use the
unweighted proxy by default; `sensitivity: layer|unit` gives them the same measured weights (the benchmark's
`greedy-sens` row: the baseline with the RL controller's statistics).

`refine: N` (every method with a selection slice: `rl`, `greedy`, `lagrangian`; default 0): after the search,
N random pair moves on the plan (one unit one option up, another one option down, `allocation.refine`), each
kept when the plan stays within the budget and the selection slice's loss falls. One forward per feasible move.
It searches the real model's loss directly, where every solver above optimises its proxy (the mixed-precision
benchmark's `greedy-sens+refine` and `rl+refine` rows). A move keeps the plan's bits at or above the lower of
the start plan's and the budget less 0.005 bits per weight.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
from pydantic import Field, field_validator, model_validator

from compress.allocation import (Option, Problem, build_problem, greedy, lagrangian, map_bits, nearest_uniform,
                                 refine, reweight, uniform)
from compress.config import StrictModel, check_group_size
from compress.driver import LayerSpec, MixedSpec, collect_energy
from compress.errors import BadInput
from compress.qweight import KEEP_BITS, unit_storage_bits
from compress.recipe import next_stage
from compress.registry import register

log = logging.getLogger(__name__)

PLAN_FORMAT, PLAN_VERSION = "compress-plan", 1
PLAN_FILE, HEATMAP_FILE, CURVE_FILE = "plan.json", "plan_heatmap.png", "rl_curve.png"
TREATMENT_NAMES = ("minmax", "clip", "keep")


class OptionSpec(StrictModel):
    bits: int = Field(..., description="2..8, or 16 = keep the chunk in fp16")
    treatment: Literal["minmax", "clip", "keep"] = Field("minmax", description="minmax RTN, activation-weighted "
                                                                                "clipping search, or keep (16 bits)")

    @model_validator(mode="after")
    def _pair(self):
        if (self.bits == KEEP_BITS) != (self.treatment == "keep"):
            raise ValueError("bits 16 goes with treatment `keep` and only with it")
        if self.bits != KEEP_BITS and not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be 2..8 or 16, got {self.bits}")
        return self


def default_options() -> list[OptionSpec]:
    return [OptionSpec(bits=b, treatment=t) for b in (2, 3, 4, 8) for t in ("minmax", "clip")] + [
        OptionSpec(bits=16, treatment="keep")]


class AllocateConfig(StrictModel):
    stage: Literal["allocate"] = "allocate"
    method: str
    budget: float = Field(..., gt=0, description="global effective bits per weight (scales, zeros, plan metadata "
                                                 "included); never exceeded")
    group_size: int = Field(64, description="group length (must equal the next quantize stage's)")
    chunk_size: int = Field(64, gt=0, description="unit width in input columns, a multiple of group_size")
    sym: bool = Field(False, description="symmetric quantization (must equal the next quantize stage's)")
    options: list[OptionSpec] = Field(default_factory=default_options, min_length=1,
                                      description="(bits, treatment) options per unit")

    _gs = field_validator("group_size")(lambda cls, v: check_group_size(v))

    @model_validator(mode="after")
    def _chunks(self):
        if self.group_size == -1:
            raise ValueError("group_size -1 (per-channel) cannot be cut into chunks; use a group size")
        if self.chunk_size % self.group_size:
            raise ValueError(f"chunk_size {self.chunk_size} is not a multiple of group_size {self.group_size}")
        labels = [(o.bits, o.treatment) for o in self.options]
        if len(set(labels)) != len(labels):
            raise ValueError("options are listed more than once")
        return self

    def option_list(self) -> list[Option]:
        return [Option(o.bits, o.treatment) for o in self.options]


class SelectionSlice(StrictModel):
    """The calibration slice that measures layer sensitivities, picks the RL controller's final plan and
    scores the `refine` moves."""
    select_samples: int = Field(32, ge=1, description="calibration sequences of the selection slice (final-plan "
                                                      "pick, layer sensitivities, refine)")
    select_seqlen: int = Field(256, ge=2, description="tokens per selection-slice sequence")
    refine: int = Field(0, ge=0, description="after the search, this many random pair moves (one unit one option "
                                             "up, another one down), each kept when it lowers the selection slice's "
                                             "loss (rl: its terminal's kind; else perplexity) within the budget; "
                                             "0 = off")


class KnapsackConfig(AllocateConfig, SelectionSlice):
    sensitivity: Literal["layer", "unit", "none"] = Field(
        "none", description="weight each layer's (or unit's) proxy errors by its measured perplexity sensitivity "
                            "on the selection slice, as the rl controller does by default")


class GreedyConfig(KnapsackConfig):
    method: Literal["greedy"] = "greedy"


class LagrangianConfig(KnapsackConfig):
    method: Literal["lagrangian"] = "lagrangian"


class UniformConfig(AllocateConfig):
    method: Literal["uniform"] = "uniform"


class RLConfig(AllocateConfig, SelectionSlice):
    method: Literal["rl"] = "rl"
    updates: int = Field(50, ge=1, description="PPO updates")
    episodes: int = Field(8, ge=1, description="episodes per update")
    epochs: int = Field(4, ge=1)
    minibatch: int = Field(256, ge=1, description="steps per PPO minibatch")
    lr: float = Field(3e-4, gt=0)
    entropy: float = Field(0.01, ge=0)
    hidden: int = Field(256, ge=8)
    terminal: Literal["ppl", "kl", "hidden_mse", "none"] = Field("ppl", description="terminal reward from the real "
                                                                                   "model")
    kappa: float = Field(10.0, ge=0, description="terminal reward scale")
    reward_samples: int = Field(8, ge=1, description="calibration sequences for the terminal reward")
    reward_seqlen: int = Field(128, ge=2, description="tokens per terminal-reward sequence")
    sensitivity: Literal["layer", "unit", "none"] = Field(
        "layer", description="weight each layer's (or unit's) proxy errors by its measured loss sensitivity (needs "
                             "a terminal reward)")
    warm_start: int = Field(100, ge=0, description="behaviour-cloning steps toward the greedy plan before PPO "
                                                   "(0 = none); that plan is also a final candidate")
    keep_best: int = Field(8, ge=1, description="best training episodes kept as final candidates")
    steps: Literal["unit", "layer"] = Field("unit", description="PPO steps: one per unit, or one per layer with "
                                                                "factorised per-chunk actions")
    seed: Optional[int] = Field(None, ge=0, description="PPO seed (default: calibration.seed)")


class FileConfig(StrictModel):
    stage: Literal["allocate"] = "allocate"
    method: Literal["file"] = "file"
    path: str = Field(..., min_length=1, description="plan.json of an earlier run")


# -- the plan -------------------------------------------------------------------------------------
@dataclass
class Plan:
    """unit -> option, per layer: `layers[name][j]` is the option index of chunk j."""

    options: list[Option]
    chunk_size: int
    group_size: int
    sym: bool
    budget: float
    layers: dict[str, list[int]]
    shapes: dict[str, tuple[int, int]]
    method: str
    energy: dict[str, torch.Tensor] | None = None
    info: dict | None = None

    @property
    def map_bits(self) -> int:
        return map_bits(self.options)

    def layer_spec(self, name: str) -> LayerSpec:
        opts = tuple((self.options[i].bits, self.options[i].treatment) for i in self.layers[name])
        quantized = [b for b, _ in opts if b != KEEP_BITS]
        mixed = MixedSpec(self.chunk_size, opts, self.map_bits, None if self.energy is None else self.energy[name])
        return LayerSpec(max(quantized, default=8), self.group_size, self.sym, mixed)

    def layer_bits(self, name: str) -> int:
        d_out, d_in = self.shapes[name]
        c = self.chunk_size
        return sum(unit_storage_bits(d_out, min(c, d_in - j * c), self.group_size, self.options[i].bits, self.sym,
                                     self.map_bits) for j, i in enumerate(self.layers[name]))

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
            "map_bits": self.map_bits, "options": [{"bits": o.bits, "treatment": o.treatment} for o in self.options],
            "effective_bits": self.effective_bits(), "total_bits": self.total_bits(),
            "total_weights": self.total_weights(),
            "layers": {n: {"shape": list(self.shapes[n]), "options": self.layers[n],
                           "bits": [self.options[i].bits for i in self.layers[n]],
                           "effective_bits": self.layer_bits(n) / (self.shapes[n][0] * self.shapes[n][1])}
                       for n in self.layers},
            "info": self.info or {},
        }

    @classmethod
    def from_json(cls, data: dict, where: str) -> "Plan":
        if data.get("format") != PLAN_FORMAT or data.get("version") != PLAN_VERSION:
            raise BadInput(f"{where} is not a {PLAN_FORMAT} version {PLAN_VERSION} file "
                           f"(format {data.get('format')!r}, version {data.get('version')!r})")
        options = [Option(o["bits"], o["treatment"]) for o in data["options"]]
        plan = cls(options, data["chunk_size"], data["group_size"], data["sym"], data["budget"],
                   {n: list(v["options"]) for n, v in data["layers"].items()},
                   {n: tuple(v["shape"]) for n, v in data["layers"].items()}, data["method"], info=data.get("info"))
        for n, v in data["layers"].items():
            want = math.ceil(v["shape"][1] / plan.chunk_size)
            if len(v["options"]) != want or any(not 0 <= i < len(options) for i in v["options"]):
                raise BadInput(f"{where}: layer {n} needs {want} option indices in [0, {len(options)})")
        if plan.total_bits() != data["total_bits"]:
            raise BadInput(f"{where}: recorded total_bits {data['total_bits']} does not match the plan "
                           f"({plan.total_bits()}); the file was edited or is corrupt")
        return plan


def plan_from_choice(p: Problem, choice: torch.Tensor, shapes: dict, cfg: AllocateConfig, method: str,
                     energy: dict, info: dict) -> Plan:
    layers = {n: [] for n in p.layers}
    for u in range(p.n_units):
        layers[p.layers[int(p.unit_layer[u])]].append(int(choice[u]))
    plan = Plan(p.options, cfg.chunk_size, cfg.group_size, cfg.sym, cfg.budget, layers, shapes, method, energy, info)
    assert plan.total_bits() == p.bits_of(choice) <= p.budget  # the two accountings agree, budget holds
    return plan


# -- plan-time checks -------------------------------------------------------------------------------
def _next_quantize(recipe, cfg):
    i = next(k for k, c in enumerate(recipe.stage_configs) if c is cfg)
    q = next_stage(recipe, cfg, "quantize")
    if q is None:
        raise BadInput(f"stage {i} (`allocate`) needs a `quantize` stage after it to apply the plan")
    if next_stage(recipe, cfg, "quantize", "allocate") is not q:
        raise BadInput(f"stage {i} (`allocate`) is followed by another `allocate` before any `quantize`")
    if q.method not in ("rtn", "autoround"):
        raise BadInput(f"the `quantize` stage after `allocate` uses method `{q.method}`; mixed-precision plans are "
                       "fitted by `rtn` (plain fitting) or `autoround`")
    return q


def _planned(adapter, q) -> dict:
    """{name: (linear, block index)} of the block linears the next quantize stage rounds."""
    from compress.quantize_stage import layer_spec

    out = {}
    for i in range(len(adapter.blocks)):
        for name, lin in adapter.block_linears(i).items():
            if layer_spec(name, lin, q) is not None:
                out[name] = (lin, i)
    return out


def check(adapter, cfg, recipe) -> None:
    q = _next_quantize(recipe, cfg)
    layers = _planned(adapter, q)
    if cfg.method == "file":
        _check_plan_file(_read_plan(cfg.path), layers, q, cfg.path)
        return
    if (q.group_size, q.sym) != (cfg.group_size, cfg.sym):
        raise BadInput(f"allocate (group_size {cfg.group_size}, sym {cfg.sym}) and the next quantize stage "
                       f"(group_size {q.group_size}, sym {q.sym}) must agree")
    total = least = 0
    mbits = map_bits(cfg.options)
    for name, (lin, _) in layers.items():
        d_out, d_in = lin.weight.shape
        if cfg.group_size > d_in:
            raise BadInput(f"group_size {cfg.group_size} is larger than layer `{name}` (in_features {d_in})")
        for s in range(0, d_in, cfg.chunk_size):
            w = min(cfg.chunk_size, d_in - s)
            least += min(unit_storage_bits(d_out, w, cfg.group_size, o.bits, cfg.sym, mbits) for o in cfg.options)
            total += d_out * w
    if least > cfg.budget * total:
        raise BadInput(f"allocate budget {cfg.budget} is below the cheapest plan ({least / total:.4f} effective "
                       "bits with every unit at its cheapest option, scales, zero points and plan metadata "
                       "included); raise `budget`, use a larger `group_size`, or add a cheaper option")


def _read_plan(path: str) -> Plan:
    p = Path(path).expanduser()
    if not p.is_file():
        raise BadInput(f"plan file `{path}` does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"plan file `{path}` is not JSON: {e}") from e
    return Plan.from_json(data, path)


def _check_plan_file(plan: Plan, layers: dict, q, where: str) -> None:
    if (q.group_size, q.sym) != (plan.group_size, plan.sym):
        raise BadInput(f"plan `{where}` (group_size {plan.group_size}, sym {plan.sym}) and the next quantize stage "
                       f"(group_size {q.group_size}, sym {q.sym}) must agree")
    missing = sorted(set(layers) ^ set(plan.layers))
    if missing:
        raise BadInput(f"plan `{where}` does not cover the same layers as this recipe (e.g. `{missing[0]}`)")
    for name, (lin, _) in layers.items():
        if tuple(lin.weight.shape) != tuple(plan.shapes[name]):
            raise BadInput(f"plan `{where}`: layer {name} is {tuple(plan.shapes[name])} in the plan, "
                           f"{tuple(lin.weight.shape)} in the model")


# -- running ----------------------------------------------------------------------------------------
def collect_stats(ctx, layers: dict) -> dict[str, torch.Tensor]:
    """a_k = E[x_k^2] per input column of every planned linear, FP trajectory, one pass of the model."""
    taps = {name: (lin, "input") for name, (lin, _) in layers.items()}
    return {n: e.float() for n, e in collect_energy(ctx.model, ctx.calibration_tokens(), taps).items()}


class Terminal:
    """The real-model terminal reward: plan -> -kappa * (log ppl_Q - log ppl_FP) (or KL, or relative hidden MSE)."""

    def __init__(self, model, layers: dict, hats: dict, p: Problem, tokens: torch.Tensor, kind: str, kappa: float,
                 chunk_size: int):
        self.model, self.p, self.kind, self.kappa = model, p, kind, kappa
        self.lins = {n: lin for n, (lin, _) in layers.items()}
        self.hats, self.tokens, self.c = hats, tokens, chunk_size
        self.fp = {n: lin.weight.detach().clone() for n, lin in self.lins.items()}
        self.ref = self._measure()

    @torch.no_grad()
    def _measure(self):
        out = self.model(input_ids=self.tokens, use_cache=False, output_hidden_states=self.kind == "hidden_mse")
        if self.kind == "hidden_mse":
            return out.hidden_states[-1].float()
        if self.kind == "kl":
            return torch.log_softmax(out.logits.float(), -1)
        logits = out.logits[:, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       self.tokens[:, 1:].reshape(-1)))

    @torch.no_grad()
    def apply(self, choice: torch.Tensor, only: int | None = None) -> None:
        """Every planned layer (or layer index `only`) takes its plan's fake-quantized weight."""
        start = 0
        for li, name in enumerate(self.p.layers):
            hat = self.hats[name]
            n = int((self.p.unit_layer == li).sum())
            cols = choice[start:start + n].repeat_interleave(self.c)[: hat.shape[2]]
            start += n
            if only is not None and li != only:
                continue
            idx = cols.view(1, 1, -1).expand(1, hat.shape[1], -1)
            self.lins[name].weight.copy_(hat.gather(0, idx)[0])

    @torch.no_grad()
    def restore(self) -> None:
        for n, lin in self.lins.items():
            lin.weight.copy_(self.fp[n])

    def loss(self, choice: torch.Tensor, only: int | None = None) -> float:
        """Increase of the loss (log ppl, or relative hidden MSE) over the FP model under the plan."""
        self.apply(choice, only)
        try:
            q = self._measure()
        finally:
            self.restore()
        return self._delta(q)

    def unit_loss(self, u: int, option: int) -> float:
        """Loss increase with unit u alone at `option` (every other weight full precision)."""
        name = self.p.layers[int(self.p.unit_layer[u])]
        j = int(self.p.unit_chunk[u])
        with torch.no_grad():
            cols = slice(j * self.c, (j + 1) * self.c)
            self.lins[name].weight[:, cols] = self.hats[name][option, :, cols]
        try:
            return self._delta(self._measure())
        finally:
            self.restore()

    def _delta(self, q) -> float:
        if self.kind == "hidden_mse":
            return float(((q - self.ref) ** 2).mean() / (self.ref ** 2).mean())
        if self.kind == "kl":
            return float((self.ref.exp() * (self.ref - q)).sum(-1).mean())
        return q - self.ref

    def __call__(self, choice: torch.Tensor) -> float:
        return -self.kappa * self.loss(choice)


def sensitivity(term: Terminal, p: Problem, level: str) -> torch.Tensor:
    """Loss increase per unit of proxy error of every layer (`layer`: (L,)) or unit (`unit`: (U,)) alone at its
    cheapest option, floored at 1% of the largest (one whose measured increase is noise-level still costs
    something)."""
    cheap = p.cheapest()
    e = p.err.gather(1, cheap.view(-1, 1))[:, 0]
    if level == "layer":
        e = torch.zeros(len(p.layers), dtype=torch.float64).index_add_(0, p.unit_layer, e)
        dl = [term.loss(cheap, only=li) for li in range(len(p.layers))]
    else:
        dl = [term.unit_loss(u, int(cheap[u])) for u in range(p.n_units)]
    w = torch.tensor(dl, dtype=torch.float64).clamp_min(0) / e.clamp_min(1e-30)
    return w.clamp_min(0.01 * float(w.max())) if float(w.max()) > 0 else torch.ones_like(w)


def _apply(ctx, cfg) -> dict:
    q = _next_quantize(ctx.loaded.recipe, cfg)
    layers = _planned(ctx.adapter, q)
    shapes = {n: tuple(lin.weight.shape) for n, (lin, _) in layers.items()}
    t0 = time.time()
    energy = collect_stats(ctx, layers)
    resumed = _resumed_plan(ctx)
    if cfg.method == "file" or resumed is not None:
        plan = resumed or _read_plan(cfg.path)
        _check_plan_file(plan, layers, q, getattr(cfg, "path", PLAN_FILE))
        plan.energy = energy
        return _finish(ctx, plan, None, time.time() - t0)
    data = {n: (lin.weight.data, energy[n], i) for n, (lin, i) in layers.items()}
    needs_hats = ((cfg.method == "rl" and cfg.terminal != "none") or getattr(cfg, "sensitivity", "none") != "none"
                  or getattr(cfg, "refine", 0) > 0)
    p, hats = build_problem(data, len(ctx.adapter.blocks), cfg.option_list(), cfg.chunk_size, cfg.group_size,
                            cfg.sym, cfg.budget, keep_hats=needs_hats)
    stats_s = time.time() - t0
    curve, info, select = None, {}, None
    if cfg.method == "rl":
        choice, curve, info, select = _search_rl(ctx, cfg, layers, hats, p)
    elif cfg.method in ("greedy", "lagrangian"):
        if cfg.sensitivity != "none" or cfg.refine:
            select = _ppl_terminal(ctx, cfg, layers, hats, p)
        if cfg.sensitivity != "none":
            p, info = _weighted(select, p, cfg.sensitivity)
        choice = greedy(p) if cfg.method == "greedy" else lagrangian(p)
    else:
        o = nearest_uniform(p)
        if o is None:
            raise BadInput(f"no single option fits the budget {cfg.budget} uniformly")
        choice = uniform(p, o)
    if getattr(cfg, "refine", 0):
        select = select or _ppl_terminal(ctx, cfg, layers, hats, p)
        seed = cfg.seed if getattr(cfg, "seed", None) is not None else ctx.seed
        bar = ctx.progress(total=cfg.refine, desc=f"{ctx.key} refine", unit="move")
        choice, info["refine"] = refine(p, choice, select.loss, cfg.refine, seed, lambda: bar.update(1))
        bar.close()
    info.update(proxy_error=p.err_of(choice), statistics_seconds=round(stats_s, 3),
                search_seconds=round(time.time() - t0 - stats_s, 3), units=p.n_units)
    plan = plan_from_choice(p, choice, shapes, cfg, cfg.method, energy, info)
    return _finish(ctx, plan, curve, time.time() - t0)


def _search_rl(ctx, cfg: RLConfig, layers, hats, p: Problem):
    from compress.ppo import PPOSettings, train

    terminal = select = None
    info = {}
    if cfg.terminal != "none":
        terminal = Terminal(ctx.model, layers, hats, p, _slice(ctx, cfg.reward_samples, cfg.reward_seqlen),
                            cfg.terminal, cfg.kappa, cfg.chunk_size)
        select = Terminal(ctx.model, layers, hats, p, _slice(ctx, cfg.select_samples, cfg.select_seqlen),
                          cfg.terminal, cfg.kappa, cfg.chunk_size)
        if cfg.sensitivity != "none":
            p, info = _weighted(select, p, cfg.sensitivity)
    s = PPOSettings(updates=cfg.updates, episodes=cfg.episodes, epochs=cfg.epochs, minibatch=cfg.minibatch,
                    lr=cfg.lr, entropy=cfg.entropy, hidden=cfg.hidden, keep_best=cfg.keep_best,
                    warm_start=cfg.warm_start, steps=cfg.steps, seed=cfg.seed if cfg.seed is not None else ctx.seed)
    reference = greedy(p) if cfg.warm_start else None
    bar = ctx.progress(total=cfg.updates, desc=f"{ctx.key} PPO", unit="update")
    res = train(p, terminal, s, lambda i, row: bar.update(1), reference=reference, select=select)
    bar.close()
    info.update(picked=res.picked, final_terminal=terminal(res.choice) if terminal else None,
                final_select=select(res.choice) if select else None)
    return res.choice, res.curve, info, select


def _ppl_terminal(ctx, cfg, layers, hats, p: Problem) -> Terminal:
    """Perplexity on the selection slice: the layer sensitivities of the knapsack solvers, and `refine`."""
    return Terminal(ctx.model, layers, hats, p, _slice(ctx, cfg.select_samples, cfg.select_seqlen), "ppl", 1.0,
                    cfg.chunk_size)


def _slice(ctx, samples: int, seqlen: int) -> torch.Tensor:
    return ctx.calibration_tokens()[:samples, :seqlen]


def _weighted(select: "Terminal", p: Problem, level: str) -> tuple[Problem, dict]:
    """The problem with each layer's (`layer`) or unit's (`unit`) errors scaled by its measured sensitivity,
    and the sensitivities for the plan's info."""
    w = sensitivity(select, p, level)
    if level == "layer":
        return reweight(p, w), {"layer_sensitivity": {n: float(v) for n, v in zip(p.layers, w)}}
    return reweight(p, w, per_unit=True), {"unit_sensitivity": [float(v) for v in w]}


def _resumed_plan(ctx) -> Plan | None:
    st = ctx.workspace.manifest["stages"].get(ctx.key, {})
    path = ctx.workspace.verified(PLAN_FILE) if st.get("status") == "done" else None
    return Plan.from_json(json.loads(path.read_text()), str(path)) if path else None


def _finish(ctx, plan: Plan, curve, seconds: float) -> dict:
    ctx.plan = plan
    ws = ctx.workspace
    ws.write_json(PLAN_FILE, plan.to_json())
    write_heatmap(plan, ws.path(HEATMAP_FILE))
    files = {"plan": PLAN_FILE, "heatmap": HEATMAP_FILE}
    if curve:
        ws.write_json("rl_curve.json", curve)
        write_curve(curve, ws.path(CURVE_FILE))
        files["curve"] = CURVE_FILE
    ctx.allocation = {"method": plan.method, "budget": plan.budget, "effective_bits": round(plan.effective_bits(), 6),
                      "units": sum(len(v) for v in plan.layers.values()), **files}
    log.info("allocation %s: %.4f effective bits (budget %s) over %d layers", plan.method, plan.effective_bits(),
             plan.budget, len(plan.layers))
    return {"effective_bits": plan.effective_bits(), "budget": plan.budget, "layers": len(plan.layers),
            "seconds": round(seconds, 3), **(plan.info or {})}


# -- pictures ---------------------------------------------------------------------------------------
def write_heatmap(plan: Plan, path: Path) -> None:
    """Bits per layer (rows) and chunk (columns); missing chunks (narrow layers) blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(plan.layers)
    width = max(len(v) for v in plan.layers.values())
    grid = np.full((len(names), width), np.nan)
    for r, n in enumerate(names):
        grid[r, : len(plan.layers[n])] = [plan.options[i].bits for i in plan.layers[n]]
    fig, ax = plt.subplots(figsize=(max(4, 0.35 * width + 3), max(3, 0.18 * len(names) + 1.5)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=2, vmax=16, interpolation="nearest")
    ax.set_yticks(range(len(names)), [n.removeprefix("model.") for n in names], fontsize=5)
    ax.set_xlabel(f"chunk ({plan.chunk_size} input columns)")
    ax.set_title(f"{plan.method}: {plan.effective_bits():.4f} effective bits (budget {plan.budget})", fontsize=8)
    fig.colorbar(im, ax=ax, label="bits")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def write_curve(curves, path: Path, labels=None) -> None:
    """RL learning curve(s): mean episode return per PPO update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if curves and isinstance(curves[0], dict):
        curves, labels = [curves], labels or ["return"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for c, lab in zip(curves, labels or [None] * len(curves)):
        ax.plot([r["update"] for r in c], [r["return"] for r in c], label=lab)
    ax.set_xlabel("PPO update")
    ax.set_ylabel("mean episode return")
    if labels:
        ax.legend(fontsize=6)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


for _cls, _name, _desc in ((RLConfig, "rl", "PPO allocation of bits/treatments to column chunks (WINDQuant)"),
                           (GreedyConfig, "greedy", "greedy error-per-bit knapsack over column chunks"),
                           (LagrangianConfig, "lagrangian", "Lagrangian multiple-choice knapsack over column chunks"),
                           (UniformConfig, "uniform", "one option for every chunk (nearest feasible uniform width)"),
                           (FileConfig, "file", "a plan.json from an earlier run (no search)")):
    register("allocate", _name, _cls, _desc, check=check)(_apply)
