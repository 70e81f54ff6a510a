"""FlipGuard: a data-free defence against quantization-conditioned backdoors, applied to a weight before it
is rounded (docs/guard.md).

A quantization-conditioned backdoor (Egashira et al., NeurIPS 2024) is a full-precision model that behaves
well, built so that rounding it with a known zero-shot scheme restores a malicious model: every weight is
kept inside the cell of the grid that rounds to the malicious code, the group extremes that set that grid are
frozen. Two rules break the pattern, both data- and trigger-free and deterministic:

`clip` (the default) pulls each group's outermost weights in by `shrink` steps of its range, split between the
two ends in proportion to each end's extent (RTN's range [min(w, 0), max(w, 0)] scaled by
f = 1 - shrink / (2^bits - 1)):

    W' = clamp(W, f * min(w_g, 0), f * max(w_g, 0))

Only the one or two outermost weights of a group move (by under `shrink` steps), but the group's scale shrinks by
the factor f and every rounding boundary moves with it, by up to shrink / 2 steps at the ends of the range, so the
cells the attack confined the weights to no longer map to its codes. It is RTN with auto-round's min/max scale
factors set to f: the codes equal `rtn(W, min_scale=f, max_scale=f)`.

`flip` moves a share of the weights nearest a rounding boundary across it (each rounds to the neighbouring code);
the scales stay:

    t    = W / s + z                       (position on the integer grid of the quantizer that will round W)
    d    = 0.5 - |t - round(t)|            (distance to the nearest decision boundary, in cells)
    move = d < d_max, the rho share with the smallest d (ties: lowest index); never a group extreme, and
           never to a value outside the group's [min, max] or a code outside the range
    W'   = (round(t) + sign(t - round(t)) * (0.5 + eps) - z) * s
"""

from __future__ import annotations

import logging

import torch

from compress.errors import BadInput
from compress.primitives import choose_qparams, group_view

log = logging.getLogger(__name__)


def boundary_distance(W: torch.Tensor, bits: int, group_size: int, sym: bool) -> tuple[torch.Tensor, ...]:
    """(t, d, s, z) on the group view (d_out, n_groups, group): grid position, distance to the nearest
    rounding boundary in cells, and the scales / zero points RTN derives from W."""
    s, z = choose_qparams(W, bits, group_size, sym)
    group = W.shape[1] if group_size == -1 else group_size
    t = group_view(W.float(), group) / s[..., None] + z[..., None]
    return t, 0.5 - (t - torch.round(t)).abs(), s, z


def flipguard(W: torch.Tensor, bits: int, group_size: int, sym: bool, *, rule: str = "clip", shrink: float = 1.0,
              d_max: float = 0.15, rho: float = 0.5, eps: float = 0.1) -> tuple[torch.Tensor, int]:
    """(W perturbed, number of weights moved). Deterministic and data-free."""
    if rule == "clip":
        return clip(W, bits, group_size, sym, shrink)
    if rule != "flip":
        raise ValueError(f"flipguard rule `{rule}`: clip or flip")
    return flip(W, bits, group_size, sym, d_max=d_max, rho=rho, eps=eps)


def clip(W: torch.Tensor, bits: int, group_size: int, sym: bool, shrink: float = 1.0) -> tuple[torch.Tensor, int]:
    """Rule `clip`: each group's range (as RTN takes it) shrunk by `shrink` steps; (W', weights moved)."""
    d_out, d_in = W.shape
    group = d_in if group_size == -1 else group_size
    Wg = group_view(W.float(), group)
    f = 1 - shrink / (2**bits - 1)
    lo, hi = Wg.amin(-1, keepdim=True).clamp(max=0), Wg.amax(-1, keepdim=True).clamp(min=0)
    out = torch.minimum(torch.maximum(Wg, f * lo), f * hi).reshape(d_out, -1)[:, :d_in]
    moved = int((out != W.float()).sum())
    return out.to(W.dtype), moved


def flip(W: torch.Tensor, bits: int, group_size: int, sym: bool, *, d_max: float = 0.15, rho: float = 0.5,
         eps: float = 0.1) -> tuple[torch.Tensor, int]:
    """Rule `flip`: the weights nearest a rounding boundary moved across it; (W', weights moved)."""
    d_out, d_in = W.shape
    group = d_in if group_size == -1 else group_size
    t, d, s, z = boundary_distance(W, bits, group_size, sym)
    Wg = group_view(W.float(), group)
    n_groups = Wg.shape[1]
    real = torch.arange(n_groups * group, device=W.device).reshape(n_groups, group) < d_in  # the zero padding of a short group
    wmin, wmax = Wg.amin(-1, keepdim=True), Wg.amax(-1, keepdim=True)
    r = torch.round(t)
    step = torch.sign(t - r)
    target = r + step
    moved = (r + step * (0.5 + eps) - z[..., None]) * s[..., None]
    inside = (moved > wmin) & (moved < wmax)  # the group's extremes, hence its scale and zero point, stay
    candidate = ((d < d_max) & (Wg > wmin) & (Wg < wmax) & inside & real & (step != 0)
                 & (target >= 0) & (target <= 2**bits - 1))
    flat_d = torch.where(candidate, d, torch.full_like(d, float("inf"))).reshape(-1)
    n_move = int(candidate.sum().item() * rho)
    if n_move == 0:
        return W.clone(), 0
    order = torch.argsort(flat_d, stable=True)[:n_move]
    chosen = torch.zeros_like(flat_d, dtype=torch.bool)
    chosen[order] = True
    chosen = chosen.reshape(d.shape)
    out = torch.where(chosen, moved, Wg).reshape(d_out, n_groups * group)[:, :d_in]
    return out.to(W.dtype), n_move


class Guarded:
    """A block quantizer that applies FlipGuard to each layer's weight, with the layer's own bits, group and
    symmetry, before the wrapped quantizer (rtn, gptq, autoround) rounds it. `moved` counts the weights moved."""

    def __init__(self, inner, cfg):
        self.inner, self.cfg, self.moved = inner, cfg, 0

    def __getattr__(self, name):  # needs_hessian, needs_data, batch_size, ... of the wrapped quantizer
        return getattr(self.inner, name)

    def quantize_block(self, data):
        for name, lin in data.linears.items():
            self.guard(name, lin, data.specs[name])
        return self.inner.quantize_block(data)

    def guard(self, name: str, lin, spec) -> None:
        if spec.mixed is not None:
            raise BadInput(f"`guard: flipguard` needs one bit width per layer; `{name}` has a mixed-precision plan "
                           "(drop the `allocate` stage or the guard)")
        lin.weight.data, n = flipguard(lin.weight.data, spec.bits, spec.group_size, spec.sym, rule=self.cfg.rule,
                                       shrink=self.cfg.shrink, d_max=self.cfg.d_max, rho=self.cfg.rho, eps=self.cfg.eps)
        self.moved += n
