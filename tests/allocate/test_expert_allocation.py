"""The expert-level allocation program (compress/allocate/experts.py, docs/moe.md#allocation)."""

import numpy as np
import pytest

from compress.allocate.experts import (
    ExpertProblem,
    brute_force,
    greedy,
    nearest_uniform,
    solve_global,
    solve_local,
)
from compress.errors import BadInput
from compress.qweight import unit_storage_bits

BITS = (2, 3, 4)


def problem(seed, layers=2, experts=4, budget=3.3, top_widths=2, shapes=((32, 64), (32, 64), (64, 32))):
    rng = np.random.default_rng(seed)
    U = layers * experts
    cost = np.array([[sum(unit_storage_bits(o, i, 32, b, False) for o, i in shapes) for b in BITS]] * U)
    params = np.full(U, sum(o * i for o, i in shapes))
    # errors fall with the width (4^-b, as rounding noise), times a per-expert sensitivity spread over decades
    err = 10.0 ** rng.uniform(-3, 1, (U, 1)) * 4.0 ** -np.array(BITS)[None] * rng.uniform(0.8, 1.2, (U, 3))
    layer = np.repeat(np.arange(layers), experts)
    from compress.allocate.problem import budget_bits
    return ExpertProblem(BITS, layer, cost, err, params, budget_bits(budget, int(params.sum())), top_widths)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [2.9, 3.3, 3.9])  # g32 asym: 2.56, 3.59, 4.63 bits per parameter
def test_the_program_finds_the_brute_force_optimum(seed, budget):
    p = problem(seed, budget=budget)
    exact = brute_force(p)
    if exact is None:
        with pytest.raises(BadInput):
            solve_global(p)
        return
    choice = solve_global(p)
    assert p.feasible(choice) and p.bits_of(choice) <= p.budget
    assert p.err_of(choice) == pytest.approx(p.err_of(exact), rel=1e-9)


def test_constraints_hold_and_bind():
    """Without the per-layer rule the optimum starves one layer; with it, each layer has a 4- and a 3-bit expert."""
    p = problem(1, budget=3.5, top_widths=0)
    p.err[:4] *= 1e-6  # layer 0 barely matters
    free = solve_global(p)
    assert not (free[:4] == 2).any()
    p.top_widths = 2
    tied = solve_global(p)
    for ell in (0, 1):
        units = tied[p.layer == ell]
        assert (units == 2).any() and (units == 1).any()
    assert p.err_of(tied) >= p.err_of(free)


def test_local_and_greedy_fit_the_budget_and_never_beat_global():
    for seed in range(5):
        p = problem(seed, layers=3, budget=3.5)
        g, loc = solve_global(p), solve_local(p, 3.5)
        assert p.bits_of(loc) <= p.budget and p.bits_of(g) <= p.budget
        assert p.err_of(g) <= p.err_of(loc) + 1e-12
        p.top_widths = 0  # greedy has no per-layer rule: compare with the exact optimum without it
        gr = greedy(p)
        assert p.bits_of(gr) <= p.budget and p.err_of(solve_global(p)) <= p.err_of(gr) + 1e-12


def test_uniform_and_infeasible_budgets():
    p = problem(0, budget=3.7)
    assert (nearest_uniform(p) == 1).all()
    with pytest.raises(BadInput, match="top 2 widths"):
        solve_global(problem(0, budget=2.7))
