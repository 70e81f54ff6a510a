"""The BBT-spectral energy scale (docs/walsh.md#no-rotation-scaling): `s = (1 + n rho) ** alpha` per scaling group,
with `alpha: auto` picked by the next quantize stage's rounding error; shared by the deployable modes (walsh.py)
and the research modes (research.py).
"""

from __future__ import annotations

import torch

from compress.primitives import fake_quantize


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, n - x.shape[-1])) if n > x.shape[-1] else x


def pad_pow2(x: torch.Tensor) -> torch.Tensor:
    return pad_to(x, pow2(x.shape[-1]))


def scales(energy: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = (1 + n rho)^alpha with rho = e / sum(e) over the n coordinates; uniform energy -> 2^alpha."""
    rho = energy / energy.sum()
    return ((1 + energy.numel() * rho) ** alpha).clamp(min=1e-2)


class Scaler:
    """The energy scale of one scaling group: `scales(e, alpha)` for a fixed alpha, or with `alpha: auto`
    the candidate alpha whose round-to-nearest error on the group's quantized readers is least.

    The error of a reader `W` (columns in the basis of `e`) scaled by `s` is
    `sum_k a_k / s_k^2 ||W[:, k] s_k - Q(W s)[:, k]||^2`: the diagonal part of the rounded weight's output
    error on the calibration data, with `a` the energy of the input the reader sees before scaling and `Q`
    the next quantize stage's RTN at its bits, group size and symmetry (AWQ's search over its exponent,
    applied to the BBT scale)."""

    def __init__(self, alpha, grid=(), rounding: tuple[int, int, bool] | None = None):
        self.alpha, self.grid, self.rounding = alpha, tuple(grid), rounding
        self.picked: list[float] = []

    def __call__(self, e: torch.Tensor, readers=(), actual: torch.Tensor | None = None, spread=None) -> torch.Tensor:
        """e: energy in the basis of the scale; readers: weights (d_out, n) whose columns get `spread(s)`;
        actual: the energy of those n columns' input (default e)."""
        spread = spread or (lambda s: s)
        if self.alpha != "auto":
            return scales(e, self.alpha)
        a = (e if actual is None else actual).double()
        bits, group, sym = self.rounding
        best = None
        for alpha in self.grid:
            s = scales(e, alpha)
            cols = spread(s)
            err = 0.0
            for W in readers:
                Ws = W.detach().double() * cols
                Wq = fake_quantize(Ws.float(), bits, group, sym).double()
                err += float((((Ws - Wq) / cols) ** 2 * a).sum())
            if best is None or err < best[0]:
                best = (err, alpha, s)
        self.picked.append(best[1])
        return best[2]

    def summary(self) -> dict:
        if self.alpha != "auto":
            return {}
        return {"alpha_picked": {str(a): self.picked.count(a) for a in self.grid}}
