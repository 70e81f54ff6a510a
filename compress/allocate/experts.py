"""Expert-level bit allocation for MoE models (GEMQ; docs/moe.md#allocation): the problem and its solvers.

Pure functions over arrays (no model). A *unit* is one routed expert of one MoE layer (all of its linears
share one width); a *choice* gives every unit an index into the candidate widths `bits` (ascending).

    cost(u, b) = exact storage bits of the expert's linears at b bits (codes, fp16 scales, zero points)
    err(u, b)  = its Fisher-weighted change of the MoE block output (compress/models/moe.py)

Global program (a multiple-choice knapsack with the published per-layer constraints), solved exactly
with scipy's HiGHS `milp`:

    min sum err(u, b) x(u, b)   s.t.  sum_b x(u, b) = 1 for every u,  sum cost(u, b) x(u, b) <= budget,
                                      sum_{u in layer l} x(u, b_k) >= 1 for the top `top_widths` widths b_k

`budget = floor(B * expert parameters)` in integer bits, so the plan's bits per expert parameter never
exceed B. `greedy` is the error-per-bit knapsack without the per-layer rule; `local` is the per-layer
baseline: each layer gets `floor(B * its expert parameters)` and is solved alone by the same program (the same
total, up to that rounding). `brute_force` enumerates every
choice (tests' oracle on tiny instances).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from compress.errors import BadInput


@dataclass
class ExpertProblem:
    bits: tuple[int, ...]  # candidate widths, ascending
    layer: np.ndarray  # (U,) MoE layer index of each unit
    cost: np.ndarray  # (U, B) int64 storage bits
    err: np.ndarray  # (U, B) float64
    params: np.ndarray  # (U,) int64 parameters of each unit
    budget: int  # bits
    top_widths: int = 2  # per layer: at least one unit at each of the top this-many widths (published c2c3)

    @property
    def n_units(self) -> int:
        return self.cost.shape[0]

    def bits_of(self, choice: np.ndarray) -> int:
        return int(self.cost[np.arange(self.n_units), choice].sum())

    def err_of(self, choice: np.ndarray) -> float:
        return float(self.err[np.arange(self.n_units), choice].sum())

    def bits_per_param(self, choice: np.ndarray) -> float:
        return self.bits_of(choice) / int(self.params.sum())

    def required(self) -> list[int]:
        """The width indices each layer must use at least once (only where a layer has that many units)."""
        return list(range(len(self.bits) - 1, len(self.bits) - 1 - self.top_widths, -1)) if self.top_widths else []

    def feasible(self, choice: np.ndarray) -> bool:
        if self.bits_of(choice) > self.budget:
            return False
        for ell in np.unique(self.layer):
            units = choice[self.layer == ell]
            need = self.required()[:len(units)]
            if any(not (units == k).any() for k in need):
                return False
        return True

    def sub(self, mask: np.ndarray, budget: int) -> "ExpertProblem":
        return ExpertProblem(self.bits, self.layer[mask], self.cost[mask], self.err[mask], self.params[mask], budget,
                             self.top_widths)


def solve_global(p: ExpertProblem) -> np.ndarray:
    """The exact optimum of the program above (HiGHS branch and bound); BadInput when it is infeasible."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    U, B = p.cost.shape
    n = U * B
    one = np.zeros((U, n))
    for u in range(U):
        one[u, u * B:(u + 1) * B] = 1
    rows, lo, hi = [one], [np.ones(U)], [np.ones(U)]
    need = []
    for ell in np.unique(p.layer):
        units = np.flatnonzero(p.layer == ell)
        for k in p.required()[:len(units)]:
            r = np.zeros(n)
            r[units * B + k] = 1
            need.append(r)
    if need:
        rows.append(np.array(need))
        lo.append(np.ones(len(need)))
        hi.append(np.full(len(need), np.inf))
    cost = p.cost.reshape(-1).astype(np.float64)
    err = p.err.reshape(-1).astype(np.float64)
    scale = float(np.abs(err).max()) or 1.0  # HiGHS's tolerances are absolute: work on errors of order 1
    budget = p.budget
    for _ in range(8):  # the budget row in floats: tighten by any excess the solver's tolerance let through
        cons = [LinearConstraint(np.vstack(rows), np.concatenate(lo), np.concatenate(hi)),
                LinearConstraint(cost[None], -np.inf, budget)]
        res = milp(err / scale, constraints=cons, integrality=np.ones(n), bounds=Bounds(0, 1),
                   options={"mip_rel_gap": 0.0})
        if res.x is None:
            raise BadInput(f"no expert allocation fits {p.budget} bits with at least one expert per layer at each "
                           f"of the top {p.top_widths} widths {p.bits[-p.top_widths:]}; raise the budget or lower "
                           "`top_widths`")
        choice = np.round(res.x).reshape(U, B).argmax(1)
        excess = p.bits_of(choice) - p.budget
        if excess <= 0:
            assert p.feasible(choice)
            return choice
        budget -= excess
    raise RuntimeError("the solver kept exceeding the budget")  # pragma: no cover - tolerance loop


def solve_local(p: ExpertProblem, bits_per_param: float) -> np.ndarray:
    """Each layer alone at `floor(bits_per_param * its parameters)` bits, by the same exact program."""
    from compress.allocate.problem import budget_bits

    choice = np.zeros(p.n_units, dtype=np.int64)
    for ell in np.unique(p.layer):
        mask = p.layer == ell
        choice[mask] = solve_global(p.sub(mask, budget_bits(bits_per_param, int(p.params[mask].sum()))))
    return choice


def knapsack(p: ExpertProblem):
    """The same units as allocate's chunk-level `Problem` (one unit per expert, the widths as options), for its
    solvers."""
    import torch

    from compress.allocate.problem import Option, Problem

    layers = sorted({int(v) for v in p.layer})
    return Problem([Option(b, "minmax") for b in p.bits], [str(v) for v in layers],
                   torch.tensor([layers.index(int(v)) for v in p.layer]), torch.zeros(p.n_units, dtype=torch.int64),
                   torch.as_tensor(p.params, dtype=torch.int64), torch.as_tensor(p.cost, dtype=torch.int64),
                   torch.as_tensor(p.err, dtype=torch.float64), torch.zeros(p.n_units, 0), p.budget)


def greedy(p: ExpertProblem) -> np.ndarray:
    """allocate's `greedy` at expert granularity (`allocation.greedy`: every unit at its narrowest width, then the
    upgrades with the largest error decrease per extra bit that fit); no per-layer rule."""
    from compress.allocate.problem import greedy as fill_greedy

    if p.bits_of(np.zeros(p.n_units, dtype=np.int64)) > p.budget:
        raise BadInput(f"even {p.bits[0]} bits everywhere exceeds the budget")
    return fill_greedy(knapsack(p)).numpy()


def nearest_uniform(p: ExpertProblem) -> np.ndarray:
    """Every unit at the widest single width that fits the budget (`allocation.nearest_uniform`; the uniform
    baseline, no per-layer rule)."""
    from compress.allocate.problem import nearest_uniform as widest

    k = widest(knapsack(p))
    if k is None:
        raise BadInput(f"even {p.bits[0]} bits everywhere exceeds the budget")
    return np.full(p.n_units, k)


def brute_force(p: ExpertProblem) -> np.ndarray | None:
    """The optimum by enumeration (B^U choices: tests only)."""
    best, best_err = None, np.inf
    for c in itertools.product(range(len(p.bits)), repeat=p.n_units):
        choice = np.array(c)
        if p.feasible(choice) and (e := p.err_of(choice)) < best_err:
            best, best_err = choice, e
    return best
