"""GPTQ (Frantar et al., arXiv 2210.17323): Hessian-aware rounding with error propagation.

The heart is the pure function `gptq(W, H, ...)`, written in the paper's notation and following
IST-DASLab `gptq.py` (docs/quantize.md#gptq). Codes use the same convention as RTN
(`compress.primitives`, docs/quantize.md#integer-grid), so GPTQ with `H = I` is exactly RTN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from scipy.linalg import lapack

from compress.config import QuantizeConfig
from compress.errors import RunFailure
from compress.primitives import choose_qparams, quantize_codes, resolve_group
from compress.qweight import QuantizedWeight
from compress.quantize_stage import Quantizer, quantizer

CHOLESKY_TRIES = 4  # damp, then 10x, 100x, 1000x damp


def gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    sym: bool,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    overwrite_h: bool = False,
) -> tuple[QuantizedWeight, float]:
    """Quantize `W` (d_out, d_in) column by column, pushing each rounding error onto later columns.

    `H` (d_in, d_in) is the input Hessian `2 X^T X / n` of the layer `y = x W^T`, accumulated by
    the caller. Inputs are not modified (`overwrite_h`: H may be, which saves a copy of it). Dead inputs (`H[i,i] == 0`) get `H[i,i] = 1`, `W[:,i] = 0`;
    then `damp * mean(diag H)` is added to the diagonal (10x more per retry if Cholesky fails).

    Groups: qparams come from `choose_qparams` on the error-updated weights at each group's first
    column (block boundaries are rounded to whole groups so those weights are current). With
    `act_order` columns go by decreasing `diag(H)` and groups are static: all qparams computed up
    front from `W` in original column order, so `g_idx = i // g` holds and no permutation is stored.

    Returns `(QuantizedWeight, error)`, `error = sum_j ||W[:,j] - Q[:,j]||^2 / (2 Hinv[j,j]^2)` (the
    paper's Losses; `Hinv` is the upper Cholesky factor of `H^-1`). Since `W - Q = E Hinv` with `E`
    the scaled errors and `Hinv H Hinv^T = I`, this is exactly `tr((W - Q) H (W - Q)^T) / 2` for the
    damped `H` (at the damping that succeeded) and `W` after dead-column zeroing, i.e. the output
    error `||X W^T - X Q^T||_F^2 / n` plus the dampening term. Not normalised by d_out.
    """
    d_out, d_in = W.shape
    if H.shape != (d_in, d_in):
        raise RunFailure(f"GPTQ: Hessian shape {tuple(H.shape)} does not match weight {tuple(W.shape)}")
    if not _finite(H):
        raise RunFailure("GPTQ: the Hessian has NaN/inf entries; check the calibration activations")
    H = H.detach().float()
    H = H.contiguous() if overwrite_h else H.clone(memory_format=torch.contiguous_format)
    dead = _dead_inputs(H)
    perm = torch.arange(d_in, device=H.device)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        H = H[perm][:, perm]
    Hinv = _inverse_cholesky(H, damp)  # in H's storage: one (d_in, d_in) matrix (on the CPU)
    W = W.detach().float().clone()
    W[:, dead] = 0
    groups = _Groups.create(W, bits, group_size, sym, static=act_order)
    if act_order:
        W = W[:, perm]
    codes = torch.zeros(d_out, d_in, dtype=torch.uint8, device=W.device)
    B = groups.aligned_block(block_size)
    error = torch.zeros((), device=W.device)
    for i1 in range(0, d_in, B):
        i2 = min(i1 + B, d_in)
        Err1 = _quantize_block(W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2], perm[i1:i2], groups, codes)
        W[:, i2:].addmm_(Err1, Hinv[i1:i2, i2:], alpha=-1)  # lazy batch update of all later columns, in place
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
        return c[:, 0], (s * (c.float() - z))[:, 0]

    def quantized_weight(self, codes: torch.Tensor) -> QuantizedWeight:
        Z, g = self.Z.to(torch.uint8), self.group_size
        return QuantizedWeight(codes=codes, scales=self.S, zeros=Z, bits=self.bits, group_size=g, sym=self.sym)


def _finite(A: torch.Tensor) -> bool:
    """No NaN/inf in A, from its min and max (NaN propagates): no (d_in, d_in) mask."""
    return bool(torch.isfinite(torch.stack(torch.aminmax(A))).all())


def _dead_inputs(H: torch.Tensor) -> torch.Tensor:
    """Inputs never seen in calibration (`H[i,i] == 0`) get `H[i,i] = 1`; returns their mask (their weights are
    zeroed)."""
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    return dead


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """`Hinv`: upper Cholesky factor of `(H + lam I)^-1`, `lam = damp * mean(diag H)`, 10x per retry.

    H (gptq's own copy, or the caller's with `overwrite_h`) is consumed: Hinv is formed in its storage.
    Every step (factor, inverse from the factor, factor of the inverse) reads and writes only the upper
    triangle, so the strictly lower triangle keeps H; should a step fail (fp32 round-off on an ill-conditioned
    H), H's upper triangle is restored from it and the next, larger damping starts over. On the CPU the steps are
    LAPACK's `potrf`/`potri` in place: one (d_in, d_in) matrix, whatever fails (docs/scale.md#gptq-memory)."""
    steps = _InPlaceLapack if H.device.type == "cpu" else _TorchSteps
    diag = torch.diag(H).clone()
    mean_diag = diag.mean()
    for t in range(CHOLESKY_TRIES):
        if t:
            _upper_from_lower(H)
        H.diagonal().copy_(diag + damp * 10**t * mean_diag)
        if steps.factor(H) and steps.inverse(H) and steps.factor(H) and _finite(H):
            return H.triu_()
    raise RunFailure(
        f"GPTQ: Cholesky of the damped Hessian failed even at damp={damp * 10 ** (CHOLESKY_TRIES - 1):g} "
        "(non-finite or degenerate calibration statistics?); check the calibration data or raise `damp`"
    )


def _upper_from_lower(A: torch.Tensor, rows: int = 256) -> None:
    """Mirror A's strictly lower triangle onto its upper one, in place, `rows` rows at a time (the diagonal
    is left to the caller)."""
    n = A.shape[0]
    for a in range(0, n, rows):
        b = min(a + rows, n)
        A[a:b, b:] = A[b:, a:b].mT
        blk = A[a:b, a:b]
        blk.copy_(blk.tril() + blk.tril(-1).mT)


class _InPlaceLapack:
    """LAPACK on the storage of a C-contiguous fp32 CPU tensor `A`: Fortran sees `A^T`, so its lower triangle is
    A's upper one. `factor`: A's upper triangle becomes U with `sym(A) = U^T U` (torch's `upper=True`);
    `inverse`: from that U, A's upper triangle becomes `(U^T U)^-1`. False when LAPACK reports failure."""

    @staticmethod
    def _run(routine, A: torch.Tensor, **kw) -> bool:
        if not (A.is_contiguous() and A.dtype == torch.float32):
            raise ValueError("in-place LAPACK needs a contiguous float32 matrix")
        M = A.numpy().T  # Fortran-ordered view of the same memory
        out, info = routine(M, lower=1, **kw)
        if not np.shares_memory(out, M):  # f2py copies silently when the layout does not fit
            raise RuntimeError(f"LAPACK {routine.__name__} did not work in place")
        return info == 0

    @classmethod
    def factor(cls, A: torch.Tensor) -> bool:
        return cls._run(lapack.spotrf, A, clean=0, overwrite_a=1)

    @classmethod
    def inverse(cls, A: torch.Tensor) -> bool:
        return cls._run(lapack.spotri, A, overwrite_c=1)


class _TorchSteps:
    """The same steps with torch.linalg, for tensors on an accelerator (not in place: temporaries of A's size)."""

    @staticmethod
    def _write_upper(A: torch.Tensor, B: torch.Tensor) -> None:
        A.copy_(torch.where(torch.ones_like(A, dtype=torch.bool).triu_(), B, A))

    @classmethod
    def factor(cls, A: torch.Tensor) -> bool:
        U, info = torch.linalg.cholesky_ex(A.triu() + A.triu(1).mT, upper=True)
        cls._write_upper(A, U)
        return info == 0

    @classmethod
    def inverse(cls, A: torch.Tensor) -> bool:
        B = torch.cholesky_inverse(A.triu(), upper=True)
        cls._write_upper(A, B)
        return _finite(B)


class GPTQConfig(QuantizeConfig):
    method: Literal["gptq"] = "gptq"
    damp: float = Field(0.01, gt=0, description="dampening, fraction of mean(diag H)")
    block_size: int = Field(128, gt=0, description="columns per lazy-update block")
    act_order: bool = Field(False, description="quantize columns by decreasing diag(H) (static groups)")


@quantizer(GPTQConfig, "GPTQ: Hessian-aware error propagation (our implementation)")
class GPTQ(Quantizer):
    """Hessians of each block's linears from the quantized-model inputs, then `gptq`."""

    needs_hessian = needs_data = True
    batch_size = 2  # windows per forward pass: the block's intermediate activations stay small (docs/scale.md)

    def quantize_block(self, data) -> dict[str, QuantizedWeight]:
        c = self.cfg
        out = {}
        for name, lin in data.linears.items():  # each Hessian is consumed: freed once its last layer is done
            s = data.specs[name]
            # q/k/v, gate/up share one tensor (collect_hessians): only its last user may consume it; the popped
            # Hessian is then gptq's only reference, freed as soon as it is factored
            shared = sum(h is data.hessians[name] for h in data.hessians.values()) > 1
            out[name] = gptq(lin.weight.data, data.hessians.pop(name), bits=s.bits, group_size=s.group_size,
                             sym=s.sym, damp=c.damp, block_size=c.block_size, act_order=c.act_order,
                             overwrite_h=not shared)[0]
        return out
