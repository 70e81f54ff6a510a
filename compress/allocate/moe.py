"""`allocate method: moe`: expert-level bit widths for MoE models (GEMQ; docs/moe.md).

Statistics (compress/models/moe.py) on the first `samples` calibration sequences cut to `seqlen` tokens: the LM
loss gradient at every decoder layer's output, streamed block by block, and per (layer, expert, width) the
Fisher-weighted change of the MoE block output when only that expert is rounded. Then one width per routed
expert under a budget in bits per expert parameter (scales and zero points included, never exceeded),
solved by `solve`: `global` (the exact 0-1 program over every expert, compress/allocate/experts.py),
`local` (the same program per layer, each at the budget: the published per-layer baseline), `greedy` (the
error-per-bit knapsack of `allocate greedy`, at expert granularity, without the per-layer rule) or
`uniform` (the widest single width that fits).

The plan (one unit per expert linear, `Plan.per_layer`) goes to the next `quantize` stage, which rounds each
expert at its width with its own method (rtn, gptq or autoround); attention, shared experts and dense layers
keep the quantize stage's `bits` and `overrides`; routers are never rounded. `statistics.json` in the
stage's directory keeps the coefficients, the tokens routed to each expert and which experts were force-routed.
"""

from __future__ import annotations

import logging
import time
from typing import Literal, Optional

import numpy as np
from pydantic import Field, field_validator, model_validator

from compress import registry
from compress.allocate.experts import (
    ExpertProblem,
    greedy,
    nearest_uniform,
    solve_global,
    solve_local,
)
from compress.allocate.figures import write_experts
from compress.allocate.plan import Plan
from compress.allocate.problem import Option, budget_bits
from compress.allocate.report import ALLOCATION
from compress.config import StrictModel
from compress.errors import BadInput
from compress.models import moe
from compress.models.moe import expert_names, moe_blocks
from compress.quantize.spine import SIGN
from compress.qweight import unit_storage_bits
from compress.registry import register

log = logging.getLogger(__name__)
STATS_FILE, FIGURE_FILE = "statistics.json", "experts.png"


class MoEConfig(StrictModel):
    stage: Literal["allocate"] = "allocate"
    method: Literal["moe"] = "moe"
    budget: float = Field(..., gt=0, description="bits per routed-expert parameter (fp16 scales and zero points "
                                                 "included); never exceeded")
    bits: list[int] = Field([2, 3, 4], min_length=1, description="candidate widths of an expert, 1..8 (1: the "
                                                                 "published sign rule, with rtn or gptq)")
    solve: Literal["global", "local", "greedy", "uniform"] = Field(
        "global", description="global: one exact program over every expert; local: per layer at the budget "
                              "(published baseline); greedy: error-per-bit knapsack; uniform: one width")
    top_widths: int = Field(2, ge=0, description="global/local: every layer keeps at least one expert at each of "
                                                 "the top this-many widths (published: 2)")
    samples: int = Field(32, ge=1, description="calibration sequences of the statistics")
    seqlen: int = Field(256, ge=2, description="tokens per statistics sequence")
    batch_size: int = Field(4, ge=1)
    min_tokens: int = Field(16, ge=1, description="an expert routed fewer calibration tokens gets the ones its "
                                                  "router scores highest (forced routing) for its statistics")
    rounds: list[float] = Field([], description="progressive: budgets of earlier rounds, decreasing, above `budget`; "
                                                "each next round's statistics are measured with the experts rounded "
                                                "(RTN) to the previous round's plan")
    group_size: Optional[int] = Field(None, description="default and requirement: the next quantize stage's")
    sym: Optional[bool] = Field(None, description="default and requirement: the next quantize stage's")

    @field_validator("bits")
    @classmethod
    def _bits(cls, v):
        if any(not 1 <= b <= 8 for b in v) or len(set(v)) != len(v):
            raise ValueError(f"bits must be distinct widths in 1..8, got {v}")
        return sorted(v)

    @model_validator(mode="after")
    def _top(self):
        budgets = [*self.rounds, self.budget]
        if any(a <= b for a, b in zip(budgets, budgets[1:])):
            raise ValueError(f"rounds {self.rounds} must decrease and stay above budget {self.budget}")
        if self.top_widths > len(self.bits):
            raise ValueError(f"top_widths {self.top_widths} is more than the {len(self.bits)} candidate widths")
        return self

    def widths(self) -> set[int]:
        return set(self.bits)


def expert_layers(adapter, names) -> list[tuple[int, int, dict]]:
    """(block, expert, {linear name: linear}) of every routed expert the quantize stage rounds."""
    out = []
    for i in moe_blocks(adapter):
        linears = adapter.block_linears(i)
        for e, group in enumerate(expert_names(adapter, i)):
            if all(n in names for n in group):
                out.append((i, e, {n: linears[n] for n in group}))
    return out


def _cost(linears: dict, bits: list[int], group: int, sym: bool) -> list[int]:
    return [sum(unit_storage_bits(lin.out_features, lin.in_features, group if group != -1 else lin.in_features, b,
                                  sym) for lin in linears.values()) for b in bits]


def check(adapter, cfg: MoEConfig, facts):
    if facts.rounding is None:
        raise BadInput(f"stage {facts.index} (`allocate moe`) needs a `quantize` stage after it to apply the plan")
    if facts.grid is not None:
        raise BadInput(f"stage {facts.index} (`allocate moe`) plans expert bit widths, but the next quantize stage "
                       f"rounds on llama.cpp's {facts.grid} blocks, where a layer's experts are one tensor of one type: "
                       "plan llama.cpp types with `greedy`, `lagrangian`, `rl` or `uniform` "
                       "(docs/gguf.md#mixed-precision-plans)")
    _, group, sym = facts.rounding
    if 1 in cfg.bits and SIGN not in facts.capabilities:
        signs = " or ".join(f"`{m}`" for m in registry.having("quantize", SIGN))
        raise BadInput(f"allocate moe `bits: {cfg.bits}`: 1-bit (sign) experts are rounded by {signs}; the "
                       f"next quantize stage is `{facts.consumer}`, which tunes rounding on the integer grid of "
                       "2 bits and more; drop 1 from `bits` or quantize with gptq")
    given = (cfg.group_size if cfg.group_size is not None else group, cfg.sym if cfg.sym is not None else sym)
    if given != (group, sym):
        raise BadInput(f"allocate (group_size {given[0]}, sym {given[1]}) and the next quantize stage "
                       f"(group_size {group}, sym {sym}) must agree")
    units = expert_layers(adapter, facts.layers)
    if not units:
        raise BadInput(f"`allocate method: moe` needs a model with routed experts that the next quantize stage "
                       f"rounds; `{adapter.model_type}` has none here")
    cfg = cfg.model_copy(update={"group_size": group, "sym": sym})
    cost = np.array([_cost(lins, cfg.bits, group, sym) for _, _, lins in units])
    params = sum(lin.weight.numel() for _, _, lins in units for lin in lins.values())
    blocks = np.array([i for i, _, _ in units])
    p = ExpertProblem(tuple(cfg.bits), blocks, cost, np.zeros_like(cost, dtype=float), np.zeros(len(units)),
                      budget_bits(cfg.budget, params), cfg.top_widths if cfg.solve in ("global", "local") else 0)
    least = _least(p)
    if least > p.budget:
        raise BadInput(f"allocate moe budget {cfg.budget} is below the cheapest plan ({least / params:.4f} bits per "
                       f"expert parameter: every expert at {cfg.bits[0]} bits"
                       + (f", one per layer at each of the top {p.top_widths} widths" if p.top_widths else "")
                       + ", scales and zero points included); raise `budget`, lower `top_widths` or add a narrower "
                         "width")
    return cfg


def _least(p: ExpertProblem) -> int:
    total = 0
    for ell in np.unique(p.layer):
        c = p.cost[p.layer == ell]
        need = p.required()[:len(c)]
        total += int(c[:, 0].sum()) + sum(int(c[j, k] - c[j, 0]) for j, k in enumerate(need))
    return total


def _statistics(ctx, cfg: MoEConfig, units, tokens) -> tuple[dict, dict, dict]:
    """(coefficients, tokens routed, force-routed experts) per MoE block, on the model as it is now."""
    adapter = ctx.adapter
    coef, loads, forced = {}, {}, {}
    blocks = {i for i, _, _ in units}
    bar = ctx.progress(total=len(blocks), desc=f"{ctx.key} expert statistics", unit="layer")

    def at_block(i, inputs_i, grads_i, kw):  # the backward pass reached block i: its coefficients now
        if i in blocks:
            r = moe.routing(adapter, i, inputs_i, kw)
            coef[i], forced[i] = moe.coefficients(adapter, i, r, grads_i, tuple(cfg.bits), cfg.group_size, cfg.sym,
                                                  cfg.min_tokens)
            loads[i] = r.loads()
            bar.update(1)

    moe.layer_output_grads(adapter, tokens, cfg.batch_size, at_block)
    bar.close()
    return dict(sorted(coef.items())), dict(sorted(loads.items())), dict(sorted(forced.items()))


def _solve(cfg: MoEConfig, units, coef: dict, budget: float) -> tuple[ExpertProblem, np.ndarray]:
    cost = np.array([_cost(lins, cfg.bits, cfg.group_size, cfg.sym) for _, _, lins in units])
    err = np.array([coef[i][e].numpy() for i, e, _ in units])
    params = np.array([sum(lin.weight.numel() for lin in lins.values()) for _, _, lins in units])
    p = ExpertProblem(tuple(cfg.bits), np.array([i for i, _, _ in units]), cost, err, params,
                      budget_bits(budget, int(params.sum())), cfg.top_widths if cfg.solve in ("global", "local") else 0)
    solve = {"global": solve_global, "local": lambda q: solve_local(q, budget), "greedy": greedy,
             "uniform": nearest_uniform}[cfg.solve]
    return p, solve(p)


def _round_to(units, choice, cfg: MoEConfig) -> None:
    """Every expert's linears rounded (RTN) to its width in `choice`, in place."""
    from compress.primitives import rtn

    for (_, _, lins), k in zip(units, choice):
        for lin in lins.values():
            qw = rtn(lin.weight.data, cfg.bits[int(k)], cfg.group_size, cfg.sym)
            lin.weight.data = qw.dequantize(lin.weight.dtype)


def apply(ctx, cfg: MoEConfig) -> dict:
    t0 = time.time()
    units = expert_layers(ctx.adapter, ctx.facts.layers)
    tokens = ctx.calibration_tokens()[:cfg.samples, :cfg.seqlen]
    saved = {n: lin.weight.data.clone() for _, _, lins in units for n, lin in lins.items()} if cfg.rounds else {}
    rounds = []
    try:
        for budget in cfg.rounds:  # progressive: each round's statistics on the model rounded to the previous plan
            coef, _, _ = _statistics(ctx, cfg, units, tokens)
            p, choice = _solve(cfg, units, coef, budget)
            rounds.append({"budget": budget, "bits_per_param": p.bits_per_param(choice)})
            for _, _, lins in units:
                for n, lin in lins.items():
                    lin.weight.data = saved[n].clone()
            _round_to(units, choice, cfg)
        coef, loads, forced = _statistics(ctx, cfg, units, tokens)
    finally:
        for _, _, lins in units:  # the quantize stage rounds the full-precision experts
            for n, lin in lins.items():
                if n in saved:
                    lin.weight.data = saved[n]
    stats_s = time.time() - t0
    t1 = time.time()
    p, choice = _solve(cfg, units, coef, cfg.budget)
    solve_s = time.time() - t1
    layers, shapes, expert_bits = {}, {}, {}
    for (i, e, lins), k in zip(units, choice):
        expert_bits.setdefault(str(i), {})[str(e)] = cfg.bits[int(k)]
        for name, lin in lins.items():
            layers[name], shapes[name] = [int(k)], tuple(lin.weight.shape)
    info = {"expert_bits": expert_bits, "objective": p.err_of(choice), "solve": cfg.solve, "rounds": rounds,
            "statistics_seconds": round(stats_s, 3), "solve_seconds": round(solve_s, 3), "experts": len(units),
            "loads": {str(i): v for i, v in loads.items()},
            "forced": {str(i): [e for e, f in enumerate(v) if f] for i, v in forced.items()}}
    plan = Plan([Option(b, "minmax") for b in cfg.bits], 0, cfg.group_size, cfg.sym, cfg.budget, layers, shapes,
                cfg.method, None, info)
    assert plan.total_bits() == p.bits_of(choice) <= p.budget  # the two accountings agree, the budget holds
    ctx.emit(plan)
    where = f"stages/{ctx.key}"
    ctx.workspace.path(where).mkdir(parents=True, exist_ok=True)
    write_experts(expert_bits, info["loads"], ctx.workspace.path(f"{where}/{FIGURE_FILE}"),
                  f"moe ({cfg.solve}): {plan.effective_bits():.4f} bits per expert parameter (budget {cfg.budget})")
    ctx.workspace.write_json(f"stages/{ctx.key}/{STATS_FILE}", {
        "bits": cfg.bits, "coefficients": {str(i): c.tolist() for i, c in coef.items()},
        "loads": info["loads"], "forced": info["forced"], "tokens": list(tokens.shape)})
    log.info("allocate moe (%s): %.4f bits per expert parameter (budget %s), %d experts, statistics %.1f s, solve "
             "%.2f s", cfg.solve, plan.effective_bits(), cfg.budget, len(units), stats_s, solve_s)
    return {"effective_bits": plan.effective_bits(), "budget": cfg.budget, "experts": len(units),
            "expert_bits": expert_bits, "loads": info["loads"], "forced": info["forced"],
            "seconds": round(time.time() - t0, 3),
            "allocation": {"method": cfg.method, "solve": cfg.solve, "budget": cfg.budget,
                           "effective_bits": round(plan.effective_bits(), 6), "units": len(units),
                           "plan": f"{where}/plan.json", "statistics": f"{where}/{STATS_FILE}",
                           "figure": f"{where}/{FIGURE_FILE}", "expert_bits": expert_bits, "loads": info["loads"],
                           "forced": info["forced"]}}


register("allocate", MoEConfig.model_fields["method"].default, MoEConfig,
         "expert-level widths for MoE models from Fisher-weighted statistics (GEMQ)", check=check, produces=(Plan,), per_layer=True, report=(ALLOCATION,))(apply)
