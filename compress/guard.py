"""FlipGuard: a data-free defence against quantization-conditioned backdoors, applied to a weight before it
is rounded (docs/guard.md).

A quantization-conditioned backdoor (Egashira et al., NeurIPS 2024) is a full-precision model that behaves
well, built so that rounding it with a known zero-shot scheme restores a malicious model: every weight is
kept inside the cell of the grid that rounds to the malicious code. The repair that hides the behaviour in
full precision pushes many weights to the edges of their cells, next to a rounding decision boundary.
FlipGuard moves a share of the weights that sit close to a boundary across it, by `eps` of a cell: each
moved weight rounds to the neighbouring code, the code pattern the backdoor needs is broken, and the
full-precision change per weight is below one quantization step. The group extremes that set the scale and
zero point are never moved, so every other code keeps its grid.

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


def flipguard(W: torch.Tensor, bits: int, group_size: int, sym: bool, *, d_max: float = 0.15, rho: float = 0.5,
              eps: float = 0.1) -> tuple[torch.Tensor, int]:
    """(W perturbed, number of weights moved). Deterministic and data-free."""
    d_out, d_in = W.shape
    group = d_in if group_size == -1 else group_size
    t, d, s, z = boundary_distance(W, bits, group_size, sym)
    Wg = group_view(W.float(), group)
    n_groups = Wg.shape[1]
    real = torch.arange(n_groups * group).reshape(n_groups, group) < d_in  # the zero padding of a short group
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
        lin.weight.data, n = flipguard(lin.weight.data, spec.bits, spec.group_size, spec.sym, d_max=self.cfg.d_max,
                                       rho=self.cfg.rho, eps=self.cfg.eps)
        self.moved += n
