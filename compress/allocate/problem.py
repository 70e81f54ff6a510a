"""Mixed-precision allocation over column chunks (WINDQuant; docs/allocate.md#the-problem): the problem and the
non-RL solvers.

Pure functions over tensors (no model, no hooks). A *unit* is chunk `j` of a quantized linear: input
columns `[j*c, (j+1)*c)` (the last chunk may be shorter). An *option* is a bit width and a treatment
(`minmax` RTN, `clip` = activation-weighted clipping search, or 16-bit `keep`), or a llama.cpp type for a whole
tensor (`ggml`; the unit is then the whole layer, fitted as llama.cpp fits it with `a` as its importance matrix, and
its cost the type's block bytes: docs/gguf.md#mixed-precision-plans). For every unit and option:

    cost(u, o) = exact storage bits (codes + fp16 scales + zero points + map_bits), qweight.unit_storage_bits
    err(u, o)  = sum_{k in u} a_k * ||W[:, k] - Q_o(W)[:, k]||^2,   a_k = E[x_k^2] over calibration tokens

The budget is `sum_u cost(u, o_u) <= floor(B * sum_u d_out * width_u)` in integer bits, i.e. the plan's
effective bits (scales, zero points and the plan's own per-unit option index included) never exceed
`B`. Solvers: `greedy` (start every unit at its cheapest option, then repeatedly take the upgrade with
the best error decrease per extra bit that still fits), `lagrangian` (per unit argmin err + lambda*cost,
lambda bisected to the smallest value that fits, then the same greedy fill), `uniform` (one option
everywhere), and `fill` (the greedy upgrade loop from any feasible plan, never above the budget).

`reweight` scales every layer's (or unit's) proxy errors by a weight (the RL controller's real-model
sensitivity, compress/allocate/terminal.py: the loss increase per unit of proxy error when that layer or
unit alone is at its cheapest option) and appends the log weight to the state features; the proxy then estimates the
model's loss increase rather than a sum of per-layer output errors on incomparable scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

import torch

from compress.errors import BadInput
from compress.primitives import fit, group_view
from compress.qweight import KEEP_BITS, unit_storage_bits

LAYER_TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Option:
    bits: int  # 2..8, or 16 = keep in fp16; a llama.cpp type: its code bits
    treatment: str  # minmax | clip | keep | gguf
    ggml: str | None = None  # a llama.cpp type (treatment `gguf`): the whole tensor on that type's blocks

    @property
    def label(self) -> str:
        return self.ggml or f"{self.bits}-{self.treatment}"


def gguf_option(t: str) -> Option:
    from compress.quantize import ggml_grid

    return Option(ggml_grid.code_bits(t), "gguf", t)


def ggml_type_at(t: str, width: int) -> str:
    """The type a tensor of `width` columns asked to be `t` is stored in: llama.cpp's fallback where `t`'s block does
    not divide the width (`export/gguf/types.fallback`; F16 where no block does)."""
    from compress.export.gguf.types import fallback

    return fallback(t, width)


def option_bits(d_out: int, width: int, group: int, o: Option, sym: bool, mbits: int) -> int:
    """Exact storage bits of a unit at option `o`: `qweight.unit_storage_bits`, or a llama.cpp type's block bytes
    (the type the tensor falls back to; the file names each tensor's type in its header, no plan metadata)."""
    if o.ggml is None:
        return unit_storage_bits(d_out, width, group, o.bits, sym, mbits)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type_at(o.ggml, width)]]
    return d_out * width // block * size * 8


def map_bits(options) -> int:
    """Bits to store one unit's option index: ceil(log2 |O|)."""
    return max(1, math.ceil(math.log2(len(options))))


def budget_bits(budget: float, n_weights: int) -> int:
    """floor(B * n) computed exactly from the decimal budget."""
    return math.floor(Fraction(str(budget)) * n_weights)


@dataclass
class Problem:
    """Units in visiting order (layer by layer, chunk by chunk); every tensor is indexed by unit first."""

    options: list[Option]
    layers: list[str]  # layer names, in order
    unit_layer: torch.Tensor  # (U,) index into layers
    unit_chunk: torch.Tensor  # (U,) chunk index inside its layer
    weights: torch.Tensor  # (U,) int64, d_out * width
    cost: torch.Tensor  # (U, O) int64 bits
    err: torch.Tensor  # (U, O) float64 proxy error
    features: torch.Tensor  # (U, F) float32 static state features
    budget: int  # bits
    chunk: int = 0  # unit width in input columns (a layer's last unit may be narrower)

    @property
    def n_units(self) -> int:
        return self.cost.shape[0]

    def total_weights(self) -> int:
        return int(self.weights.sum())

    def cheapest(self) -> torch.Tensor:
        """Per unit, the option of least cost, ties broken by least error."""
        key = self.cost.double() * 1e6 + self.err / (self.err.max() + 1e-30)
        return key.argmin(1)

    def bits_of(self, choice: torch.Tensor) -> int:
        return int(self.cost.gather(1, choice.view(-1, 1)).sum())

    def err_of(self, choice: torch.Tensor) -> float:
        return float(self.err.gather(1, choice.view(-1, 1)).sum())

    def b_eff(self, choice: torch.Tensor) -> float:
        return self.bits_of(choice) / self.total_weights()

    def check_feasible(self) -> None:
        least = int(self.cost.min(1).values.sum())
        if least > self.budget:
            raise BadInput(f"effective-bit budget {self.budget / self.total_weights():.4f} is below the cheapest "
                           f"plan ({least / self.total_weights():.4f} bits: every unit at its cheapest option, "
                           "scales, zero points and plan metadata included); raise `budget`, use a larger "
                           "`group_size`, or add a cheaper option")


# -- statistics -------------------------------------------------------------------------------------
def layer_units(W: torch.Tensor, energy: torch.Tensor, options: list[Option], chunk_size: int, group_size: int,
                sym: bool, mbits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cost (n_chunks, O) int64, err (n_chunks, O) float64, W_hat (O, d_out, d_in)) of one layer.

    Each option is fitted on the whole layer: every group lies in one chunk and fitting is per group,
    so this equals fitting each chunk alone (what the quantize stage does)."""
    d_out, d_in = W.shape
    widths = [min(chunk_size, d_in - s) for s in range(0, d_in, chunk_size)]
    W = W.detach().float()
    hats, costs, errs = [], [], []
    for o in options:
        W_hat = W.half().float() if o.bits == KEEP_BITS else _fit(W, o, group_size, sym, energy)
        W_hat = W_hat if isinstance(W_hat, torch.Tensor) else W_hat.dequantize()
        col = (((W - W_hat) ** 2).double() * energy.double().view(1, -1)).sum(0)
        errs.append(group_view(col.view(1, -1), chunk_size)[0].sum(-1))
        costs.append(torch.tensor([option_bits(d_out, w, group_size, o, sym, mbits) for w in widths]))
        hats.append(W_hat)
    return torch.stack(costs, 1), torch.stack(errs, 1), torch.stack(hats)


def _fit(W: torch.Tensor, o: Option, group_size: int, sym: bool, energy: torch.Tensor):
    """Option `o`'s rounding of a whole layer: compress's grid (`primitives.fit`), or llama.cpp's fit of type
    `o.ggml` weighted by the input energy (the importance matrix llama.cpp's quantize takes) and ggml's rounding."""
    if o.ggml is None:
        return fit(W, o.bits, o.treatment, group_size, sym, energy)
    from compress.quantize import ggml_grid

    t = ggml_type_at(o.ggml, W.shape[1])
    return W.half().float() if t in ("F16", "BF16", "F32") else ggml_grid.rtn(W, t, energy)


def unit_features(W: torch.Tensor, energy: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Per chunk: log energy mean and max, weight std, max|w| and kurtosis (docs/allocate.md#state), (n_chunks, 5)."""
    W = W.detach().float()
    out = []
    for s in range(0, W.shape[1], chunk_size):
        w, a = W[:, s:s + chunk_size], energy[s:s + chunk_size].float()
        std = w.std().clamp_min(1e-12)
        kurt = (((w - w.mean()) / std) ** 4).mean()
        out.append(torch.stack([torch.log(a.mean() + 1e-12), torch.log(a.max() + 1e-12), torch.log(std),
                                torch.log(w.abs().max() + 1e-12), torch.log(kurt + 1e-12)]))
    return torch.stack(out)


def layer_type(name: str) -> int:
    leaf = name.rsplit(".", 1)[-1]
    return LAYER_TYPES.index(leaf) if leaf in LAYER_TYPES else len(LAYER_TYPES)


def build_problem(layers: dict[str, tuple[torch.Tensor, torch.Tensor, int]], n_blocks: int, options: list[Option],
                  chunk_size: int, group_size: int, sym: bool, budget: float, keep_hats: bool = True):
    """Problem and {layer: W_hat stack (O, d_out, d_in)} from {name: (W, energy, block index)}; the stacks
    (|O| fake-quantized copies of every layer, for a real-model reward) only with `keep_hats`, else {}."""
    mbits = map_bits(options)
    names, ul, uc, wts, costs, errs, feats, hats = [], [], [], [], [], [], [], {}
    for li, (name, (W, energy, block)) in enumerate(layers.items()):
        cost, err, hat = layer_units(W, energy, options, chunk_size, group_size, sym, mbits)
        if keep_hats:
            hats[name] = hat
        n = cost.shape[0]
        names.append(name)
        ul += [li] * n
        uc += list(range(n))
        wts += [W.shape[0] * min(chunk_size, W.shape[1] - s) for s in range(0, W.shape[1], chunk_size)]
        loge = torch.log(err + 1e-12)
        cheap = cost.double().argmin(1)
        rel = loge - loge.gather(1, cheap.view(-1, 1)).mean()
        rel[:, [i for i, o in enumerate(options) if o.bits == KEEP_BITS]] = -10.0  # keep: e = 0
        onehot = torch.zeros(n, len(LAYER_TYPES) + 1)
        onehot[:, layer_type(name)] = 1
        static = torch.cat([torch.full((n, 1), block / max(n_blocks - 1, 1)), onehot,
                            (torch.arange(n) / max(n - 1, 1)).view(-1, 1), unit_features(W, energy, chunk_size),
                            rel.float().clamp(-10, 10)], 1)
        costs.append(cost)
        errs.append(err)
        feats.append(static)
    weights = torch.tensor(wts, dtype=torch.int64)
    feats = torch.cat(feats)
    feats = (feats - feats.mean(0)) / feats.std(0).clamp_min(1e-6)  # standardised per feature
    p = Problem(options, names, torch.tensor(ul), torch.tensor(uc), weights, torch.cat(costs), torch.cat(errs),
                feats.float(), budget_bits(budget, int(weights.sum())), chunk_size)
    p.check_feasible()
    return p, hats


def reweight(p: Problem, weight: torch.Tensor, per_unit: bool = False) -> Problem:
    """The problem with err(u, o) scaled by weight[layer of u] (or weight[u] with `per_unit`; > 0) and the
    standardised log weight appended to the features (a constant column, i.e. zeros, when all weights are equal)."""
    w = weight.double().clamp_min(1e-30)
    w = w if per_unit else w[p.unit_layer]
    logw = torch.log(w).float().view(-1, 1)
    logw = (logw - logw.mean()) / logw.std().clamp_min(1e-6) if p.n_units > 1 else logw * 0
    return replace(p, err=p.err * w.view(-1, 1), features=torch.cat([p.features, logw], 1))


# -- solvers ----------------------------------------------------------------------------------------
def fill(p: Problem, choice: torch.Tensor) -> torch.Tensor:
    """Greedy upgrades by best error decrease per extra bit, each one only if the total stays within budget."""
    choice = choice.clone()
    used = p.bits_of(choice)
    if used > p.budget:
        raise ValueError(f"plan uses {used} bits, above the budget of {p.budget}")
    idx = torch.arange(p.n_units)
    while True:
        cur_c, cur_e = p.cost[idx, choice], p.err[idx, choice]
        dc = (p.cost - cur_c.view(-1, 1)).double()
        de = cur_e.view(-1, 1) - p.err
        ok = (dc > 0) & (de > 0) & (dc <= p.budget - used)
        if not ok.any():
            return choice
        ratio = torch.where(ok, de / dc.clamp_min(1), torch.tensor(-1.0, dtype=torch.float64))
        u, o = divmod(int(ratio.argmax()), p.cost.shape[1])
        used += int(dc[u, o])
        choice[u] = o


def greedy(p: Problem) -> torch.Tensor:
    return fill(p, p.cheapest())


def lagrangian(p: Problem) -> torch.Tensor:
    """Multiple-choice knapsack by Lagrangian relaxation: min sum err + lambda * cost, bisect lambda, then fill."""
    return fill(p, _relaxed(p, bit_price(p)))


def _relaxed(p: Problem, lam: float) -> torch.Tensor:
    return (p.err + lam * p.cost.double()).argmin(1)


def bit_price(p: Problem, iters: int = 60) -> float:
    """The smallest Lagrange multiplier lambda (error per bit) whose relaxed plan fits the budget."""
    scale = float(p.err.max()) / max(float(p.cost.min()), 1.0)
    lo, hi = 0.0, max(scale, 1e-30)
    while p.bits_of(_relaxed(p, hi)) > p.budget:
        hi *= 4
    if p.bits_of(_relaxed(p, lo)) <= p.budget:
        return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if p.bits_of(_relaxed(p, mid)) <= p.budget else (mid, hi)
    return hi


def _neighbour(p: Problem, u: int, cur: int, up: bool) -> int | None:
    """Unit u's next option up (the least costly of those that cost more and have a smaller proxy error) or
    down (the costliest of those that cost less, least error on ties); None when there is none."""
    c, e = p.cost[u], p.err[u]
    if up:
        ok = [o for o in range(len(c)) if c[o] > c[cur] and e[o] < e[cur]]
        return min(ok, key=lambda o: (int(c[o]), float(e[o]))) if ok else None
    ok = [o for o in range(len(c)) if c[o] < c[cur]]
    return max(ok, key=lambda o: (int(c[o]), -float(e[o]))) if ok else None


def refine(p: Problem, choice: torch.Tensor, loss, tries: int, seed: int, step=None) -> tuple[torch.Tensor, dict]:
    """Local search on a real-model loss (our design, docs/allocate.md#refine):
    `tries` random pair moves, one unit one option up and another one option down (`_neighbour`), each kept
    when `loss(plan)` decreases and the plan's bits stay within [floor, budget], floor = the lower of the start
    plan's bits and the budget less 0.005 bits per weight (a move may not spend the budget on nothing).
    Deterministic for `seed`; never above the budget and never a larger loss than the plan it starts from.
    `step()` is called once per try (progress)."""
    g = torch.Generator().manual_seed(seed)
    choice = choice.clone()
    if p.bits_of(choice) > p.budget:
        raise ValueError("refine: the starting plan is above the budget")
    used = p.bits_of(choice)
    floor = min(used, p.budget - int(0.005 * p.total_weights()))
    best = start = loss(choice)
    evaluated = accepted = 0
    for _ in range(tries):
        v, u = torch.randint(p.n_units, (2,), generator=g).tolist()
        if step is not None:
            step()
        if u == v:
            continue
        cv, cu = int(choice[v]), int(choice[u])
        up, down = _neighbour(p, v, cv, True), _neighbour(p, u, cu, False)
        if up is None or down is None:
            continue
        bits = used + int(p.cost[v, up] - p.cost[v, cv] + p.cost[u, down] - p.cost[u, cu])
        if not floor <= bits <= p.budget:
            continue
        new = choice.clone()
        new[v], new[u] = up, down
        evaluated += 1
        value = loss(new)
        if value < best:
            best, choice, used, accepted = value, new, bits, accepted + 1
    return choice, {"tries": tries, "evaluated": evaluated, "accepted": accepted, "loss_start": start,
                    "loss_end": best}


def uniform(p: Problem, option: int) -> torch.Tensor:
    return torch.full((p.n_units,), option, dtype=torch.int64)


def nearest_uniform(p: Problem) -> int | None:
    """The option whose uniform plan has the largest cost within the budget (least error on ties), or None."""
    best = None
    for o in range(len(p.options)):
        c = p.bits_of(uniform(p, o))
        if c <= p.budget:
            key = (c, -p.err_of(uniform(p, o)))
            if best is None or key > best[0]:
                best = (key, o)
    return None if best is None else best[1]


def suffix_min(p: Problem) -> torch.Tensor:
    """(U+1,) least cost of units u.. end (0 at U): the masking term of docs/allocate.md#action-masking."""
    least = p.cost.min(1).values
    return torch.cat([least.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.int64)])


def action_mask(p: Problem, u: int, used: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """(E, O) options allowed at unit `u` for episodes that used `used` (E,) bits: the episode stays
    feasible when every later unit takes its cheapest option."""
    return used.view(-1, 1) + p.cost[u].view(1, -1) + tail[u + 1] <= p.budget
