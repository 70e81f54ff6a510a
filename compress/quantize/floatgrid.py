"""Rounding onto a float grid: FP8 E4M3 weights (`scheme: fp8`, docs/formats.md#fp8).

A weight on a float grid keeps the `QuantizedWeight` layout with `fp` naming the element format: `codes` are the
elements' bit patterns (E4M3: one byte, `torch.float8_e4m3fn` viewed as uint8), `scales` one per group
(fp16-representable, positive), `zeros` 0 and never read, and

    W_hat[o, i] = scales[o, i // g] * E4M3(codes[o, i])

The scale is compressed-tensors' symmetric float observer, `max |w| / 448` over the group (448: E4M3's largest
finite value, the half range its `calculate_range` gives), rounded to fp16 as the export stores it; an element is
`clamp(w / s, -448, 448)` cast to E4M3 (round to nearest even, torch's cast, as compressed-tensors casts), so a
layer RTN rounds is bit for bit the weight llm-compressor's `FP8_DYNAMIC` writes from the same `W`.
GPTQ rounds column by column on the same grid (`FloatGroups`, `gptq._Groups`' interface) with error propagation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.primitives import SCALE_EPS, group_view, resolve_group
from compress.qweight import FLOAT_ELEMENTS, QuantizedWeight


@dataclass(frozen=True)
class FloatFormat:
    name: str
    dtype: torch.dtype
    max: float  # the largest finite value
    bits: int


FORMATS = {"e4m3": FloatFormat("e4m3", FLOAT_ELEMENTS["e4m3"], 448.0, 8)}


def fmt_of(name: str) -> FloatFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown float element format `{name}` (known: {', '.join(FORMATS)})") from None


def scales(W: torch.Tensor, group_size: int, fmt: str) -> torch.Tensor:
    """Per-group scales (d_out, n_groups): max |w| / max of the format, fp16-rounded, at least SCALE_EPS."""
    f = fmt_of(fmt)
    Wg = group_view(W.float(), resolve_group(W.shape[1], group_size))
    return (Wg.abs().amax(-1) / f.max).half().float().clamp(min=SCALE_EPS)


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Bit patterns (uint8) of `x` (already divided by its scale) rounded to the format, saturating at its max."""
    f = fmt_of(fmt)
    return x.float().clamp(-f.max, f.max).to(f.dtype).view(torch.uint8)


def decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """The fp32 values of bit patterns `codes`."""
    return codes.view(fmt_of(fmt).dtype).float()


def _per_column(s: torch.Tensor, d_in: int, g: int) -> torch.Tensor:
    return s.repeat_interleave(g, dim=1)[:, :d_in]


def rtn(W: torch.Tensor, group_size: int, fmt: str) -> QuantizedWeight:
    """Round to nearest on the float grid (module docstring)."""
    d_out, d_in = W.shape
    s = scales(W, group_size, fmt)
    codes = encode(W.float() / _per_column(s, d_in, resolve_group(d_in, group_size)), fmt)
    return QuantizedWeight(codes=codes, scales=s, zeros=torch.zeros_like(s, dtype=torch.uint8),
                           bits=fmt_of(fmt).bits, group_size=group_size, sym=True, fp=fmt)


class FloatGroups:
    """GPTQ's per-group state (`gptq._Groups`' interface) on a float grid: each group's scale from the error-updated
    weights at its first column (all up front with `static`, as act_order and per-channel groups have)."""

    def __init__(self, W: torch.Tensor, group_size: int, fmt: str, static: bool):
        self.fmt, self.group_size = fmt, group_size
        self.g = resolve_group(W.shape[1], group_size)
        self.static = static or group_size == -1
        self.S = scales(W, group_size, fmt)

    def aligned_block(self, block_size: int) -> int:
        return block_size if self.static else max(1, block_size // self.g) * self.g

    def refresh(self, j: int, W_rest: torch.Tensor) -> None:
        if not self.static and j % self.g == 0:
            k = j // self.g
            self.S[:, k:k + 1] = scales(W_rest[:, :self.g], -1, self.fmt)

    def quantize(self, w: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.S[:, j // self.g]
        c = encode(w / s, self.fmt)
        return c, decode(c, self.fmt) * s

    def quantized_weight(self, codes: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(codes=codes, scales=self.S, zeros=torch.zeros_like(self.S, dtype=torch.uint8),
                               bits=fmt_of(self.fmt).bits, group_size=self.group_size, sym=True, fp=self.fmt)
