"""Quantization primitives: pure functions, no modules, no devices (CONVENTIONS 1).

Formulas follow auto-round's `int_asym` and full-range `int_sym` (ALGORITHMS.md 0.2), so that RTN,
GPTQ and AutoRound produce codes in one convention:

    asym: wmin = min(min(w), 0) * alpha, wmax = max(max(w), 0) * beta
          s = (wmax - wmin) / (2^b - 1) (fp16, >= 1e-5), z = round(-wmin / s)
    sym:  m = 2^(b-1); v = the group extreme of larger magnitude, signed so it maps to level -m
          s = v / m (fp16, may be negative), z = m
    codes = clamp(round(w / s) + z, 0, 2^b - 1)
"""

from __future__ import annotations

import math

import torch

from compress.qweight import QuantizedWeight

SCALE_EPS = 1e-5


def group_view(W: torch.Tensor, group: int) -> torch.Tensor:
    """(d_out, d_in) -> (d_out, n_groups, group), the last group zero-padded."""
    d_out, d_in = W.shape
    n_groups = math.ceil(d_in / group)
    pad = n_groups * group - d_in
    if pad:
        W = torch.nn.functional.pad(W, (0, pad))
    return W.reshape(d_out, n_groups, group)


def resolve_group(d_in: int, group_size: int) -> int:
    return d_in if group_size == -1 else group_size


def choose_qparams(
    W: torch.Tensor, bits: int, group_size: int, sym: bool, min_scale=1.0, max_scale=1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points, each (d_out, n_groups). `min_scale`/`max_scale` are auto-round's alpha/beta."""
    Wg = group_view(W.float(), resolve_group(W.shape[1], group_size))
    wmin = Wg.amin(-1).clamp(max=0) * min_scale
    wmax = Wg.amax(-1).clamp(min=0) * max_scale
    if sym:
        m = 2 ** (bits - 1)
        wmin_abs, wmax_abs = -wmin, wmax
        v = torch.where(wmax_abs < wmin_abs, torch.maximum(wmax_abs, wmin_abs), -torch.maximum(wmax_abs, wmin_abs))
        s = (v / m).half().float()
        s = torch.where(s < 0, s.clamp(max=-SCALE_EPS), s.clamp(min=SCALE_EPS))
        z = torch.full_like(s, m)
        return s, z
    s = ((wmax - wmin) / (2**bits - 1)).half().float().clamp(min=SCALE_EPS)
    z = torch.round(-wmin / s).clamp(0, 2**bits - 1)
    return s, z


def quantize_codes(
    W: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """Codes (d_out, d_in) uint8 for given per-group scales and zero points."""
    d_in = W.shape[1]
    g_idx = torch.arange(d_in, device=W.device) // resolve_group(d_in, group_size)
    q = torch.round(W.float() / scales[:, g_idx]) + zeros[:, g_idx]
    return q.clamp(0, 2**bits - 1).to(torch.uint8)


def rtn(W: torch.Tensor, bits: int, group_size: int, sym: bool, min_scale=1.0, max_scale=1.0) -> QuantizedWeight:
    """Round-to-nearest: qparams from the group's range, then nearest code."""
    s, z = choose_qparams(W, bits, group_size, sym, min_scale, max_scale)
    codes = quantize_codes(W, s, z, bits, group_size)
    return QuantizedWeight(codes=codes, scales=s, zeros=z.to(torch.uint8), bits=bits, group_size=group_size, sym=sym)


def fake_quantize(W: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    return rtn(W, bits, group_size, sym).dequantize(W.dtype)
