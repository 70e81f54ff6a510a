"""PrunePath: a dense SwiGLU FFN split into experts, routed per token by cumulative probability (docs/prune.md).

1. Experts (MoEfication): each FFN's neurons are clustered into `n / expert_size` experts of `expert_size`
   neurons by balanced k-means on the L2-normalised `[W_gate[j], W_up[j]]` rows (every cluster exactly
   `expert_size`: each assignment step is an exact balanced assignment, scipy's `linear_sum_assignment` against
   the centres repeated `expert_size` times). The neurons are then permuted so each expert is contiguous (rows of
   gate/up, columns of down): the dense output does not change, and with `expert_size` a multiple of the
   quantization group an expert is whole groups.
2. Router per layer: `r(x) = W_r x` (hidden -> experts, no bias) on the MLP's input, trained on calibration
   tokens toward each expert's share of the FFN output, `q_e(x) = ||FFN_e(x)|| / sum_j ||FFN_j(x)||`, with
   KL(q || softmax(r(x))) (AdamW). Its rows start at the experts' mean normalised gate rows.
3. Selection (the run-time knob `tau`): `p = softmax(r(x))`, experts sorted by p, the smallest prefix whose
   mass reaches `tau` is active (the expert that crosses `tau` included; at least `k_min`), and the FFN output
   is the plain sum of the active experts' outputs (no weighting by p, so `tau = 1` is the dense FFN exactly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def balanced_clusters(rows: torch.Tensor, size: int, iters: int = 20, seed: int = 0) -> list[list[int]]:
    """Rows (n, d) into n / size clusters of exactly `size` by balanced spherical k-means."""
    from scipy.optimize import linear_sum_assignment

    n = rows.shape[0]
    if n % size:
        raise ValueError(f"{n} neurons do not split into experts of {size}")
    k = n // size
    x = F.normalize(rows.detach().double(), dim=1)
    gen = torch.Generator().manual_seed(seed)
    centres = x[torch.randperm(n, generator=gen)[:k]]
    assign = None
    for _ in range(iters):
        cost = -(x @ centres.T)  # (n, k): negative cosine
        _, cols = linear_sum_assignment(cost.repeat_interleave(size, dim=1).numpy())
        new = torch.as_tensor(cols // size)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        centres = F.normalize(torch.stack([x[assign == c].mean(0) for c in range(k)]), dim=1)
    return [sorted(torch.nonzero(assign == c).flatten().tolist()) for c in range(k)]


def top_p_mask(probs: torch.Tensor, tau: float, k_min: int = 1) -> torch.Tensor:
    """Boolean mask (..., E) of the active experts: the smallest prefix of the experts sorted by probability
    whose mass reaches `tau` (the crossing expert included), at least `k_min`; `tau >= 1`: every expert."""
    if tau >= 1:
        return torch.ones_like(probs, dtype=torch.bool)
    p, order = probs.sort(-1, descending=True)
    before = p.cumsum(-1) - p  # mass of the experts ranked above each one
    keep = before < tau
    keep[..., :k_min] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


class PathRouter(nn.Module):
    """The router of one PrunePath FFN (not an nn.Linear, so no quantizer or linear hook treats it as a layer)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


class PrunePathMLP(nn.Module):
    """A gated MLP (`gate_proj`, `up_proj`, `down_proj`, `act_fn`, kept under their names) whose neurons are
    contiguous experts of `expert_size`, with a router and the run-time mass threshold `tau`. `last_active`
    holds the fraction of experts the last forward used (mean over tokens)."""

    def __init__(self, mlp: nn.Module, router: PathRouter, expert_size: int, tau: float = 1.0, k_min: int = 1):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.router, self.expert_size, self.tau, self.k_min = router, expert_size, tau, k_min
        self.last_active = 1.0
        self.active = [0.0, 0]  # sum of active fractions over tokens, tokens seen (`mean_active`)
        self.parts: nn.ModuleList | None = None  # packed models: per-expert (gate, up, down) slices (gather)

    @property
    def experts(self) -> int:
        return self.router.weight.shape[0]

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        return top_p_mask(torch.softmax(self.router(x).float(), -1), self.tau, self.k_min)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tau < 1 and x[..., 0].numel() == 1 and (self.parts is not None or isinstance(self.down_proj,
                                                                                           nn.Linear)):
            return self.gather(x)  # decode: compute only the active experts
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        if self.tau < 1:
            m = self.mask(x)
            self._count(float(m.float().mean()), h[..., 0].numel())
            h = h * m.to(h.dtype).repeat_interleave(self.expert_size, -1)
        else:
            self._count(1.0, h[..., 0].numel())
        return self.down_proj(h)

    def _count(self, fraction: float, tokens: int) -> None:
        self.last_active = fraction
        self.active[0] += fraction * tokens
        self.active[1] += tokens


    def runs(self, x: torch.Tensor) -> list[tuple[int, int]]:
        """The active experts of the one token `x`, merged into runs [a, b) of consecutive experts."""
        active = torch.nonzero(self.mask(x).reshape(-1)).flatten().tolist()
        out: list[list[int]] = []
        for e in active:
            if out and out[-1][1] == e:
                out[-1][1] = e + 1
            else:
                out.append([e, e + 1])
        return [(a, b) for a, b in out]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN of one token from its active experts only: per run of consecutive experts, the rows of
        gate/up and the columns of down (views of the dense weights), or, for a packed model, each active
        expert's own packed slices (`prepare_gather`). Equal to the masked path up to float rounding."""
        runs = self.runs(x)
        self._count(sum(b - a for a, b in runs) / self.experts, 1)
        y = None
        if self.parts is not None:  # packed: one (gate, up, down) per expert
            for a, b in runs:
                for e in range(a, b):
                    g, u, d = self.parts[e]
                    part = d(self.act_fn(g(x)) * u(x))
                    y = part if y is None else y + part
        else:
            s = self.expert_size
            wg, wu, wd = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
            for a, b in runs:
                r = slice(a * s, b * s)
                h = self.act_fn(F.linear(x, wg[r], None if self.gate_proj.bias is None else self.gate_proj.bias[r]))
                h = h * F.linear(x, wu[r], None if self.up_proj.bias is None else self.up_proj.bias[r])
                part = F.linear(h, wd[:, r])
                y = part if y is None else y + part
        bias = getattr(self.down_proj, "bias", None)
        return y + bias.to(y.dtype) if bias is not None else y


def expert_norms(mlp: nn.Module, x: torch.Tensor, expert_size: int) -> torch.Tensor:
    """||FFN_e(x)|| per token and expert (tokens, E), for contiguous experts of `expert_size`."""
    h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)  # (T, n)
    t, n = h.shape
    w = mlp.down_proj.weight.view(-1, n // expert_size, expert_size)  # (hidden, E, s)
    out = torch.einsum("tes,hes->teh", h.view(t, -1, expert_size), w)
    return out.norm(dim=-1)


def train_router(x: torch.Tensor, shares: torch.Tensor, init: torch.Tensor, *, epochs: int, lr: float,
                 batch: int = 512, seed: int = 0) -> tuple[torch.Tensor, float, float]:
    """Router weights (E, hidden) fitted by KL(shares || softmax(W x)); also the loss before and after."""
    w = nn.Parameter(init.clone().float())
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    logq = torch.log(shares.clamp_min(1e-12))

    def loss_on(idx) -> torch.Tensor:
        return F.kl_div(F.log_softmax(x[idx] @ w.T, -1), logq[idx], log_target=True, reduction="batchmean")

    everything = torch.arange(x.shape[0])
    with torch.no_grad():
        before = float(loss_on(everything))
    for _ in range(epochs):
        for idx in torch.randperm(x.shape[0], generator=gen).split(batch):
            opt.zero_grad()
            loss_on(idx).backward()
            opt.step()
    with torch.no_grad():
        after = float(loss_on(everything))
    return w.detach(), before, after


def active_fraction(probs: list[torch.Tensor], tau: float, k_min: int = 1) -> float:
    """Mean fraction of experts active over every token of every layer at `tau`."""
    return float(torch.cat([top_p_mask(p, tau, k_min).float().mean(-1) for p in probs]).mean())


def tau_for(probs: list[torch.Tensor], target: float, k_min: int = 1, steps: int = 30) -> float:
    """The smallest `tau` whose active fraction reaches `target`, by bisection (the fraction grows with tau)."""
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        if active_fraction(probs, mid, k_min) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def mlps(model: nn.Module) -> list[PrunePathMLP]:
    """Every PrunePath FFN of `model`."""
    return [m for m in model.modules() if isinstance(m, PrunePathMLP)]


def wrap(adapter, i: int, router: torch.Tensor, expert_size: int, tau: float, k_min: int) -> PrunePathMLP:
    blk = adapter.blocks[i]
    mlp = PrunePathMLP(blk.mlp, PathRouter(router), expert_size, tau, k_min)
    blk.mlp = mlp
    return mlp


class dense:
    """Context: every PrunePath FFN of `model` runs dense (tau = 1), e.g. while a later stage calibrates."""

    def __init__(self, model: nn.Module, active: bool = True):
        self.mlps = mlps(model) if active else []

    def __enter__(self):
        self.saved = [m.tau for m in self.mlps]
        for m in self.mlps:
            m.tau = 1.0
        return self

    def __exit__(self, *exc):
        for m, t in zip(self.mlps, self.saved):
            m.tau = t


def mean_active(model: nn.Module) -> float | None:
    """Mean fraction of experts active over every token every PrunePath FFN has seen (None: there are none)."""
    seen = [m for m in mlps(model) if m.active[1]]
    return sum(m.active[0] for m in seen) / sum(m.active[1] for m in seen) if seen else None


def set_tau(model: nn.Module, tau: float) -> int:
    """Set the mass threshold of every PrunePath FFN; returns how many there are."""
    found = mlps(model)
    for m in found:
        m.tau = tau
    return len(found)


def describe(model: nn.Module, expert_size: int, k_min: int, tau: float, blocks: list[int]) -> None:
    """Record the PrunePath FFNs in the model's config (`prunepath`: what `attach` rebuilds from a checkpoint;
    plain transformers ignores the field and the router tensors, and runs the FFNs dense)."""
    model.config.prunepath = {"expert_size": expert_size, "k_min": k_min, "tau": tau, "blocks": list(blocks),
                              "router": "model.layers.{i}.mlp.router.weight"}


def attach(model: nn.Module, tensors: dict | None = None) -> int:
    """Wrap the FFNs the config's `prunepath` names, with routers from `tensors` (a checkpoint's, by name) or
    zeros (to be filled by `load_state_dict`); returns how many. Nothing happens without the field."""
    from compress.models.adapters import ModelAdapter

    info = getattr(model.config, "prunepath", None)
    if not info:
        return 0
    a = ModelAdapter(model)
    for i in info["blocks"]:
        if tensors is not None:
            w = tensors[info["router"].format(i=i)].float()
        else:  # a model built from its config (plain nn.Linear layers): the routers' shapes from the FFN
            up = a.blocks[i].mlp.up_proj
            w = torch.zeros(up.out_features // info["expert_size"], up.in_features)
        wrap(a, i, w, info["expert_size"], info["tau"], info["k_min"])
    return len(info["blocks"])


def expert_slices(qw, rows: slice | None = None, cols: slice | None = None):
    """The QuantizedWeight of output rows `rows` or input columns `cols` (whole groups) of `qw`, or None."""
    from compress.qweight import QuantizedWeight

    if qw.mixed or qw.kept is not None:
        return None
    if rows is not None:
        return QuantizedWeight(qw.codes[rows], qw.scales[rows], qw.zeros[rows], qw.bits, qw.group_size, qw.sym)
    g = qw.group_size
    if g == -1 or cols.start % g or (cols.stop % g and cols.stop != qw.in_features):
        return None
    groups = slice(cols.start // g, -(-cols.stop // g))
    return QuantizedWeight(qw.codes[:, cols], qw.scales[:, groups], qw.zeros[:, groups], qw.bits, g, qw.sym)


def prepare_gather(model: nn.Module, qweights: dict, backend: str = "auto") -> int:
    """Give every PrunePath FFN of a packed model its per-expert packed slices (rows of gate/up, the columns
    of down: each expert must be whole groups of down's input); returns how many FFNs got them (the others
    keep the masked path at decode)."""
    from compress.kernels.backends import QuantLinear

    done = 0
    for name, mlp in model.named_modules():
        if not isinstance(mlp, PrunePathMLP):
            continue
        q = {r: qweights.get(f"{name}.{r}") for r in ("gate_proj", "up_proj", "down_proj")}
        if any(v is None for v in q.values()):
            continue
        s, parts = mlp.expert_size, []
        for e in range(mlp.experts):
            r = slice(e * s, (e + 1) * s)
            sl = (expert_slices(q["gate_proj"], rows=r), expert_slices(q["up_proj"], rows=r),
                  expert_slices(q["down_proj"], cols=r))
            if any(v is None for v in sl):
                break
            parts.append(nn.ModuleList([QuantLinear(v, None, backend) for v in sl]))
        else:
            mlp.parts = nn.ModuleList(parts)
            done += 1
    return done
