"""GPTQ (Frantar et al., arXiv 2210.17323): Hessian-aware rounding with error propagation.

The heart is the pure function `gptq(W, H, ...)`, written in the paper's notation and following
IST-DASLab `gptq.py` (docs/quantize.md#gptq). Codes use the same convention as RTN
(`compress.primitives`, docs/quantize.md#integer-grid), so GPTQ with `H = I` is exactly RTN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from compress.config import QuantizeConfig
from compress.errors import RunFailure
from compress.hessian import as_store
from compress.primitives import choose_qparams, quantize_codes, resolve_group
from compress.quantize.floatgrid import FloatGroups, block_global_scales
from compress.quantize.ggml_grid import GridGroups
from compress.quantize.spine import FLOAT, SIGN, Quantizer, quantizer
from compress.qweight import QuantizedWeight

CHOLESKY_TRIES = 4  # damp, then 10x, 100x, 1000x damp


def gptq(
    W: torch.Tensor,
    H,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    overwrite_h: bool = False,
    overwrite_w: bool = False,
    ggml: str | None = None,
    fp: str | None = None,
    gscale: float | None = None,
) -> tuple[QuantizedWeight, float]:
    """Quantize `W` (d_out, d_in) column by column, pushing each rounding error onto later columns.

    `H` (d_in, d_in) is the input Hessian `2 X^T X / n` of the layer `y = x W^T`, accumulated by the caller:
    a symmetric tensor or a `compress.hessian` store. Inputs are not modified (`overwrite_h`: a store may be,
    `overwrite_w`: an fp32 W may be, left holding the error-updated weights; each saves a copy). Dead inputs
    (`H[i,i] == 0`) get `H[i,i] = 1`, `W[:,i] = 0`;
    then `damp * mean(diag H)` is added to the diagonal (10x more per retry if Cholesky fails).

    Groups: qparams come from `choose_qparams` on the error-updated weights at each group's first
    column (block boundaries are rounded to whole groups so those weights are current). With
    `act_order` columns go by decreasing `diag(H)` and groups are static: all qparams computed up
    front from `W` in original column order, so `g_idx = i // g` holds and no permutation is stored.
    `ggml` (a GGML type name): the groups are that type's llama.cpp blocks instead (`ggml_grid.GridGroups`), each
    fitted by llama.cpp's search weighted by the importance `diag(H) / 2` (the mean squared input, what llama.cpp's
    imatrix holds); `bits`, `group_size` and `sym` are then the type's. `fp` (a float element format, "e4m3"): the
    columns are rounded onto that float grid (`floatgrid.FloatGroups`; E2M1: `gscale`, the tensor's global scale,
    default its own).

    Returns `(QuantizedWeight, error)`, `error = sum_j ||W[:,j] - Q[:,j]||^2 / (2 Hinv[j,j]^2)` (the
    paper's Losses; `Hinv` is the upper Cholesky factor of `H^-1`). Since `W - Q = E Hinv` with `E`
    the scaled errors and `Hinv H Hinv^T = I`, this is exactly `tr((W - Q) H (W - Q)^T) / 2` for the
    damped `H` (at the damping that succeeded) and `W` after dead-column zeroing, i.e. the output
    error `||X W^T - X Q^T||_F^2 / n` plus the dampening term. Not normalised by d_out.
    """
    d_out, d_in = W.shape
    if tuple(H.shape) != (d_in, d_in):
        raise RunFailure(f"GPTQ: Hessian shape {tuple(H.shape)} does not match weight {tuple(W.shape)}")
    H = as_store(H, copy=not overwrite_h)
    if not H.finite():
        raise RunFailure("GPTQ: the Hessian has NaN/inf entries; check the calibration activations")
    diag = H.diag()
    dead = diag == 0  # inputs never seen in calibration: H[i,i] = 1, their weights zeroed
    if dead.any():
        H.set_diag_(torch.where(dead, torch.ones_like(diag), diag))
    perm = torch.arange(d_in, device=W.device)
    if act_order:  # a dense permuted copy for the moment (act_order is off by default)
        perm = torch.argsort(H.diag(), descending=True, stable=True).to(W.device)
        p = perm.to(H.device)
        H = as_store(H.to_dense()[p][:, p], copy=False)
    Hinv = _inverse_cholesky(H, damp)  # in H's storage (on the CPU: packed, half a dense matrix)
    W = W.detach() if overwrite_w and W.dtype == torch.float32 else W.detach().float().clone()
    W[:, dead.to(W.device)] = 0
    if fp is not None:
        groups = FloatGroups(W, group_size, fp, static=act_order, gscale=gscale)
    elif ggml is not None:
        groups = GridGroups(W, ggml, torch.where(dead, torch.zeros_like(diag), diag).cpu() / 2, static=act_order)
    else:
        groups = _Groups.create(W, bits, group_size, sym, static=act_order)
    if act_order:
        W = W[:, perm]
    codes = torch.zeros(d_out, d_in, dtype=torch.uint8, device=W.device)
    B = groups.aligned_block(block_size)
    error = torch.zeros((), device=W.device)
    for i1 in range(0, d_in, B):
        i2 = min(i1 + B, d_in)
        rows = Hinv.upper_rows(i1, i2).to(W.device)  # Hinv[i1:i2, i1:]
        Err1 = _quantize_block(W[:, i1:i2].clone(), rows[:, : i2 - i1], perm[i1:i2], groups, codes)
        W[:, i2:].addmm_(Err1, rows[:, i2 - i1 :], alpha=-1)  # lazy batch update of all later columns, in place
        error += Err1.square().sum() / 2
    return groups.quantized_weight(codes), float(error)


def _quantize_block(W1, Hinv1, cols, groups: _Groups, codes) -> torch.Tensor:
    """Quantize block `W1` (d_out, B) in place, writing `codes[:, cols]`; `cols` are original columns.

    Returns the scaled errors `Err1 = (W1 - Q1) / diag(Hinv1)` (d_out, B) for the lazy update.
    """
    Err1 = torch.zeros_like(W1)
    for i, j in enumerate(cols.tolist()):
        groups.refresh(j, W1[:, i:])
        c, q = groups.quantize(W1[:, i], j)
        codes[:, j] = c
        Err1[:, i] = (W1[:, i] - q) / Hinv1[i, i]
        W1[:, i:] -= Err1[:, i : i + 1] @ Hinv1[i : i + 1, i:]
    return Err1


@dataclass
class _Groups:
    """Per-group scales `S` and zero points `Z`, each (d_out, n_groups), in the RTN convention."""

    S: torch.Tensor
    Z: torch.Tensor
    bits: int
    group_size: int
    sym: bool
    g: int
    static: bool

    @classmethod
    def create(cls, W, bits, group_size, sym, static) -> _Groups:
        g = resolve_group(W.shape[1], group_size)
        static = static or group_size == -1  # per-channel: the only group starts at column 0
        S, Z = choose_qparams(W, bits, group_size, sym)  # final when static, else overwritten per group
        return cls(S, Z, bits, group_size, sym, g, static)

    def aligned_block(self, block_size: int) -> int:
        """Dynamic groups must not straddle blocks: round the block to a whole number of groups."""
        return block_size if self.static else max(1, block_size // self.g) * self.g

    def refresh(self, j: int, W_rest: torch.Tensor) -> None:
        """At a group's first column `j`, recompute its qparams from the current weights `W_rest[:, :g]`."""
        if not self.static and j % self.g == 0:
            k = j // self.g
            self.S[:, k : k + 1], self.Z[:, k : k + 1] = choose_qparams(W_rest[:, : self.g], self.bits, -1, self.sym)

    def quantize(self, w: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (uint8) and dequantized values of column `w` (d_out,), original column `j`."""
        s, z = self.S[:, j // self.g, None], self.Z[:, j // self.g, None]
        c = quantize_codes(w[:, None], s, z, self.bits, -1)
        if self.bits == 1:  # the sign rule (compress/qweight.py)
            return c[:, 0], (s * (2 * c.float() - 1))[:, 0]
        return c[:, 0], (s * (c.float() - z))[:, 0]

    def quantized_weight(self, codes: torch.Tensor) -> QuantizedWeight:
        Z, g = self.Z.to(torch.uint8), self.group_size
        return QuantizedWeight(codes=codes, scales=self.S, zeros=Z, bits=self.bits, group_size=g, sym=self.sym)


def _inverse_cholesky(H, damp: float):
    """`Hinv`: upper Cholesky factor of `(H + lam I)^-1`, `lam = damp * mean(diag H)`, 10x per retry.

    H (a `compress.hessian` store: gptq's own copy, or the caller's with `overwrite_h`) is consumed: Hinv is
    formed in its storage (factor, inverse from the factor, factor of the inverse). A failed step (fp32
    round-off on an ill-conditioned H) has overwritten it, so H is spilled first (a temporary file) and
    restored for the next, larger damping (docs/quantize.md#gptq)."""
    diag = H.diag()
    mean_diag = diag.mean()
    saved = H.spill()
    try:
        for t in range(CHOLESKY_TRIES):
            if t:
                H.restore(saved)
            H.set_diag_(diag + damp * 10**t * mean_diag)
            if H.factor_() and H.inverse_() and H.factor_() and H.finite():
                return H
    finally:
        if hasattr(saved, "close"):
            saved.close()
    raise RunFailure(
        f"GPTQ: Cholesky of the damped Hessian failed even at damp={damp * 10 ** (CHOLESKY_TRIES - 1):g} "
        "(non-finite or degenerate calibration statistics?); check the calibration data or raise `damp`"
    )


class GPTQConfig(QuantizeConfig):
    method: Literal["gptq"] = "gptq"
    damp: float = Field(0.01, gt=0, description="dampening, fraction of mean(diag H)")
    block_size: int = Field(128, gt=0, description="columns per lazy-update block")
    act_order: bool = Field(False, description="quantize columns by decreasing diag(H) (static groups)")


@quantizer(GPTQConfig, "GPTQ: Hessian-aware error propagation (our implementation)")
class GPTQ(Quantizer):
    """Hessians of each block's linears from the quantized-model inputs, then `gptq`."""

    needs_hessian = needs_data = True
    capabilities = frozenset({SIGN, FLOAT})
    batch_size = 2  # windows per forward pass: the block's intermediate activations stay small (docs/scale.md)

    def quantize_block(self, data) -> dict[str, QuantizedWeight]:
        c = self.cfg
        out = {}
        gs = block_global_scales(data)  # NVFP4: q/k/v and gate/up share one
        for name, lin in data.linears.items():  # each Hessian is consumed: freed once its last layer is done
            s = data.specs[name]
            # q/k/v, gate/up share one tensor (collect_hessians): only its last user may consume it; the popped
            # Hessian is then gptq's only reference, freed as soon as it is factored
            shared = sum(h is data.hessians[name] for h in data.hessians.values()) > 1
            out[name] = gptq(lin.weight.data, data.hessians.pop(name), bits=s.bits, group_size=s.group_size,
                             sym=s.sym, damp=c.damp, block_size=c.block_size, act_order=c.act_order,
                             overwrite_h=not shared, overwrite_w=True, ggml=s.ggml,
                             fp=s.fp, gscale=gs.get(name))[0]  # the driver sets the weight next
        return out
