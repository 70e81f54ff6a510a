"""Quantization primitives: pure functions, no modules, no devices (the bottom layer:
methods build on them, only the pipeline touches models and devices).

Formulas follow auto-round's `int_asym` and full-range `int_sym` (docs/quantize.md#integer-grid), so that RTN,
GPTQ and AutoRound produce codes in one convention:

    asym: wmin = min(min(w), 0) * alpha, wmax = max(max(w), 0) * beta
          s = (wmax - wmin) / (2^b - 1) (fp16, >= 1e-5), z = round(-wmin / s)
    sym:  m = 2^(b-1); v = the group extreme of larger magnitude, signed so it maps to level -m
          s = v / m (fp16, may be negative), z = m
    codes = clamp(round(w / s) + z, 0, 2^b - 1)
    1 bit (the sign rule of MC-MoE / GEMQ; compress/qweight.py): s = mean |w| of the group (fp16, >= 1e-5),
          z = 1 (not read), codes = [w >= 0], W_hat = s (2 codes - 1)
"""

from __future__ import annotations

import math

import torch

from compress.qweight import QuantizedWeight, row_chunks

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
    if bits == 1:  # mean |w| over the real columns (a short last group is zero-padded)
        n = torch.full((Wg.shape[1],), Wg.shape[2], dtype=torch.float32, device=Wg.device)
        n[-1] -= Wg.shape[1] * Wg.shape[2] - W.shape[1]
        s = (Wg.abs().sum(-1) / n).half().float().clamp(min=SCALE_EPS)
        return s, torch.ones_like(s)
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
    """Codes (d_out, d_in) uint8 for given per-group scales and zero points. Rows go in chunks with one fp32
    temporary of at most `CHUNK_ELEMENTS`: the qparams broadcast over each group, the rest in place
    (docs/scale.md)."""
    d_out, d_in = W.shape
    g = resolve_group(d_in, group_size)
    if bits == 1:
        return (W >= 0).to(torch.uint8)
    codes = torch.empty(d_out, d_in, dtype=torch.uint8, device=W.device)
    g_idx = torch.arange(d_in, device=W.device) // g if d_in % g else None
    for r in row_chunks(d_out, d_in):
        if g_idx is not None:
            q = W[r].float() / scales[r][:, g_idx]
            q.round_().add_(zeros[r][:, g_idx])
        else:
            q = W[r].float().reshape(-1, d_in // g, g) / scales[r, :, None]
            q.round_().add_(zeros[r, :, None])
        codes[r] = q.clamp_(0, 2**bits - 1).reshape(-1, d_in)
    return codes


def rtn(W: torch.Tensor, bits: int, group_size: int, sym: bool, min_scale=1.0, max_scale=1.0) -> QuantizedWeight:
    """Round-to-nearest: qparams from the group's range, then nearest code."""
    s, z = choose_qparams(W, bits, group_size, sym, min_scale, max_scale)
    codes = quantize_codes(W, s, z, bits, group_size)
    return QuantizedWeight(codes=codes, scales=s, zeros=z.to(torch.uint8), bits=bits, group_size=group_size, sym=sym)


def fake_quantize(W: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    return rtn(W, bits, group_size, sym).dequantize(W.dtype)


# -- per-unit fitting for mixed precision (docs/quantize.md#allocation-plans-mixed-precision) -----------
CLIP_RATIOS = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0, 0.95, ..., 0.5
TREATMENTS = ("minmax", "clip")


def weighted_group_error(W: torch.Tensor, W_hat: torch.Tensor, energy: torch.Tensor | None, group: int) -> torch.Tensor:
    """sum_k a_k (W - W_hat)[:, k]^2 per (row, group), shape (d_out, n_groups); a_k = 1 without `energy`."""
    d2 = (W.float() - W_hat.float()) ** 2
    if energy is not None:
        d2 = d2 * energy.float().reshape(1, -1)
    return group_view(d2, group).sum(-1)


def clip_search(W: torch.Tensor, bits: int, group_size: int, sym: bool, energy: torch.Tensor | None = None,
                ratios=CLIP_RATIOS) -> QuantizedWeight:
    """Per group, the clipping ratio p (range scaled by p, AWQ / auto-round `search_scales` style) whose RTN
    minimises the activation-weighted error sum_k a_k (w_k - w_hat_k)^2; ratio 1.0 is plain RTN. Each
    candidate is exactly `rtn(W, bits, group_size, sym, p, p)` on its group."""
    d_in = W.shape[1]
    group = resolve_group(d_in, group_size)
    Wg = group_view(W.float(), group)
    a = torch.ones_like(Wg[:1]) if energy is None else group_view(energy.float().view(1, -1), group)
    best_s = best_z = best_err = None
    for p in ratios:
        s, z, Wq = group_round(Wg, bits, sym, p)
        err = ((Wg - Wq) ** 2 * a).sum(-1)
        if best_err is None:
            best_s, best_z, best_err = s, z, err
            continue
        better = err < best_err
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
        best_err = torch.minimum(err, best_err)
    codes = quantize_codes(W, best_s, best_z, bits, group_size)
    return QuantizedWeight(codes=codes, scales=best_s, zeros=best_z.to(torch.uint8), bits=bits,
                           group_size=group_size, sym=sym)


def group_round(Wg: torch.Tensor, bits: int, sym: bool, ratio: float = 1.0):
    """RTN of an already grouped (d_out, n_groups, g) weight: its scales, zero points and the dequantized groups."""
    s, z = _group_qparams(Wg, bits, sym, ratio)
    q = torch.clamp(torch.round(Wg / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, 2**bits - 1)
    return s, z, s.unsqueeze(-1) * (q - z.unsqueeze(-1))


def _group_qparams(Wg: torch.Tensor, bits: int, sym: bool, ratio: float):
    """choose_qparams on an already grouped (d_out, n_groups, g) weight with min_scale = max_scale = ratio."""
    wmin = Wg.amin(-1).clamp(max=0) * ratio
    wmax = Wg.amax(-1).clamp(min=0) * ratio
    if sym:
        m = 2 ** (bits - 1)
        v = torch.where(wmax < -wmin, torch.maximum(wmax, -wmin), -torch.maximum(wmax, -wmin))
        s = (v / m).half().float()
        s = torch.where(s < 0, s.clamp(max=-SCALE_EPS), s.clamp(min=SCALE_EPS))
        return s, torch.full_like(s, m)
    s = ((wmax - wmin) / (2**bits - 1)).half().float().clamp(min=SCALE_EPS)
    return s, torch.round(-wmin / s).clamp(0, 2**bits - 1)


def fit(W: torch.Tensor, bits: int, treatment: str, group_size: int, sym: bool,
        energy: torch.Tensor | None = None) -> QuantizedWeight:
    """One option's quantizer fitting: `minmax` (plain RTN) or `clip` (clip_search)."""
    if treatment == "minmax":
        return rtn(W, bits, group_size, sym)
    if treatment == "clip":
        return clip_search(W, bits, group_size, sym, energy)
    raise ValueError(f"unknown treatment {treatment!r} (known: {TREATMENTS})")


def assemble_mixed(W: torch.Tensor, parts: list, chunk_size: int, group_size: int, sym: bool,
                   map_bits: int) -> QuantizedWeight:
    """One mixed-precision QuantizedWeight from per-chunk results, in chunk order: each part is the chunk's
    QuantizedWeight (same group size and sym), or None for a chunk kept in fp16 (taken from `W`)."""
    from compress.qweight import KEEP_BITS

    d_out, d_in = W.shape
    codes, scales, zeros, kept, bits = [], [], [], [], []
    for j, part in enumerate(parts):
        s, e = j * chunk_size, min((j + 1) * chunk_size, d_in)
        n_groups = math.ceil((e - s) / group_size)
        if part is None:
            codes.append(torch.zeros(d_out, e - s, dtype=torch.uint8, device=W.device))
            scales.append(torch.ones(d_out, n_groups, device=W.device))
            zeros.append(torch.zeros(d_out, n_groups, dtype=torch.uint8, device=W.device))
            kept.append(W[:, s:e].detach().float().half().float())
            bits.append(KEEP_BITS)
        else:
            codes.append(part.codes)
            scales.append(part.scales.float())
            zeros.append(part.zeros)
            bits.append(part.bits)
    quantized = [b for b in bits if b != KEEP_BITS]
    return QuantizedWeight(codes=torch.cat(codes, 1), scales=torch.cat(scales, 1), zeros=torch.cat(zeros, 1),
                           bits=max(quantized, default=8), group_size=group_size, sym=sym, chunk_size=chunk_size,
                           chunk_bits=tuple(bits), kept=torch.cat(kept, 1) if kept else None, map_bits=map_bits)


def fit_mixed(W: torch.Tensor, options: list[tuple[int, str]], chunk_size: int, group_size: int, sym: bool,
              energy: torch.Tensor | None, map_bits: int) -> QuantizedWeight:
    """Fit every chunk with its option (bits, treatment); bits 16 keeps the chunk in fp16."""
    parts = []
    for j, (bits, treatment) in enumerate(options):
        s, e = j * chunk_size, min((j + 1) * chunk_size, W.shape[1])
        a = None if energy is None else energy[s:e]
        parts.append(None if bits == 16 else fit(W[:, s:e], bits, treatment, group_size, sym, a))
    return assemble_mixed(W, parts, chunk_size, group_size, sym, map_bits)
