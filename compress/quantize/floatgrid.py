"""Rounding onto a float grid: FP8 E4M3 weights (`scheme: fp8`, `fp8-block`, docs/formats.md#fp8) and NVFP4 E2M1
weights (`scheme: nvfp4a16`, docs/formats.md#nvfp4).

A weight on a float grid keeps the `QuantizedWeight` layout with `fp` naming the element format: `codes` are the
elements' bit patterns (E4M3: one byte, `torch.float8_e4m3fn` viewed as uint8; E2M1: four bits, sign then the index
of the magnitude in 0, 0.5, 1, 1.5, 2, 3, 4, 6), `scales` one per group, `zeros` 0 and never read, and

    W_hat[o, i] = scales[o, i // g] * element(codes[o, i])

The scales are compressed-tensors' symmetric float observer's, so a layer RTN rounds is bit for bit the weight
llm-compressor writes from the same `W`:

- E4M3 (`fp8`): `s = max |w| / 448` per output channel (448: E4M3's largest finite value, the half range its
  `calculate_range` gives), rounded to fp16 as the export stores it; an element is `clamp(w / s, -448, 448)` cast to
  E4M3 (round to nearest even, torch's cast, as compressed-tensors casts).
- E4M3 in 128 x 128 blocks (`fp8-block`, fp `e4m3-block`, llm-compressor's FP8_BLOCK): the same with `s = max |w| /
  448` over a block of 128 output rows by 128 input columns (a short last block of rows: over its rows), held on each
  of the block's rows in `scales`.
- NVFP4 (`nvfp4a16`): a global fp32 scale per tensor `G = 448 * 6 / max |W|` (the layers vLLM fuses, q/k/v and
  gate/up, share the smallest of theirs, as llm-compressor makes them: `global_scales`), a scale per 16 columns
  `s8 = E4M3(G max |w| / 6)` (a zero becomes 0.125, compressed-tensors' eps), the effective scale `s = s8 / G` (fp32)
  held in `scales` and `G` in `global_scale`; an element is `clamp(w / s, -6, 6)` rounded to the nearest E2M1 value
  with compressed-tensors' `cast_to_fp4` ties (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
  5 -> 4).

GPTQ rounds column by column on the same grids (`FloatGroups`, `gptq._Groups`' interface) with error propagation, the
global scale fixed from `W` before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.primitives import SCALE_EPS, group_view, resolve_group
from compress.qweight import FLOAT_BLOCK_ROWS, FLOAT_ELEMENTS, QuantizedWeight, decode_float

# |x| above each bound moves to the next index (`>` for the bounds a tie stays below, `>=` for those it moves above)
E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
FP8_MAX = 448.0
FP8_EPS = 0.125  # compressed-tensors' replacement for an E4M3 scale that rounded to 0


@dataclass(frozen=True)
class FloatFormat:
    name: str
    max: float  # the largest finite value
    bits: int
    group: int  # the group its scheme scales (-1: per output channel)
    scale_bits: int  # a stored group scale's bits (fp16; NVFP4: E4M3)
    rows: int = 1  # the output rows sharing each scale (`fp8-block`: 128, a 128 x 128 block)


FORMATS = {"e4m3": FloatFormat("e4m3", FP8_MAX, 8, -1, 16),
           "e4m3-block": FloatFormat("e4m3-block", FP8_MAX, 8, 128, 16, FLOAT_BLOCK_ROWS["e4m3-block"]),
           "e2m1": FloatFormat("e2m1", 6.0, 4, 16, 8), "mxfp4": FloatFormat("mxfp4", 6.0, 4, 32, 8)}
E2M1_ELEMENTS = ("e2m1", "mxfp4")  # the grids of E2M1 elements (NVFP4, MXFP4)


def fmt_of(name: str) -> FloatFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown float element format `{name}` (known: {', '.join(FORMATS)})") from None


def global_scale(W: torch.Tensor) -> float:
    """NVFP4's per-tensor scale `448 * 6 / max |W|` (compressed-tensors' `generate_gparam`), fp32."""
    top = W.detach().abs().amax().float().clamp(min=torch.finfo(torch.float32).tiny)
    g = torch.nan_to_num(FP8_MAX * 6.0 / top, nan=1.0, posinf=1.0, neginf=1.0)
    return float(g)


def global_scales(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """{layer: global scale} of E2M1 layers, the layers vLLM fuses into one (q/k/v, gate/up) sharing the smallest
    (one scale for the fused weight, as llm-compressor's `update_fused_layer_weight_global_scales` sets them)."""
    from compress.export.layouts import fused_group

    own = {n: global_scale(w) for n, w in weights.items()}
    shared: dict[str, float] = {}
    for n, g in own.items():
        key = fused_group(n)
        shared[key] = min(g, shared.get(key, g))
    return {n: shared[fused_group(n)] for n in own}


def block_global_scales(data) -> dict[str, float]:
    """`global_scales` of a block's E2M1 layers (a driver BlockData: its linears and their specs)."""
    return global_scales({n: lin.weight.data for n, lin in data.linears.items()
                          if getattr(data.specs[n], "fp", None) == "e2m1"})


def scales(W: torch.Tensor, group_size: int, fmt: str, gscale: float | None = None) -> torch.Tensor:
    """Per-group effective scales (d_out, n_groups), fp32 (module docstring): E4M3 max |w| / 448 fp16-rounded (a
    block format's: the max over the block's rows, repeated on each); E2M1 E4M3(G max |w| / 6) / G with `gscale` G."""
    f = fmt_of(fmt)
    top = group_view(W.float(), resolve_group(W.shape[1], group_size)).abs().amax(-1)
    if f.rows > 1:
        top = block_max(top, f.rows)
    if fmt == "mxfp4":
        return mx_scales(top)
    if fmt == "e2m1":
        if gscale is None:
            raise ValueError("E2M1 (NVFP4) scales need the tensor's global scale")
        g = torch.tensor(gscale, dtype=torch.float32)
        s8 = (g * (top / f.max)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        return torch.where(s8 == 0, torch.tensor(FP8_EPS), s8) / g
    return (top / f.max).half().float().clamp(min=SCALE_EPS)


def block_max(top: torch.Tensor, rows: int) -> torch.Tensor:
    """`top` (d_out, n) with each run of `rows` rows (the last may be shorter) replaced by its column-wise max: a
    block's scale held on every row of it (compressed-tensors pads a short block with zeros, which leave a max
    unchanged)."""
    d_out = top.shape[0]
    pad = -d_out % rows
    full = torch.cat([top, top.new_zeros(pad, top.shape[1])]) if pad else top
    return full.reshape(-1, rows, top.shape[1]).amax(1).repeat_interleave(rows, 0)[:d_out]


def mx_scales(top: torch.Tensor) -> torch.Tensor:
    """MXFP4's power-of-two scales of groups whose max |w| is `top` (compressed-tensors' `generate_mx_scales`): the
    max rounded to a power of two (up from 1.5 times one: E2M1's one mantissa bit), its exponent less 2 (E2M1's max
    is 6 < 2^3), as a biased E8M0 exponent clamped to [0, 255]."""
    bits = top.float().contiguous().view(torch.int32)
    p2 = ((bits + (1 << 21)) & ~((1 << 23) - 1)).view(torch.float32)  # fp32: 23 mantissa bits, E2M1's 1 kept
    e = (127 + torch.floor(torch.log2(p2)) - 2).clamp(0, 255)
    return torch.exp2(e - 127)


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes (uint8) of `x` (already divided by its scale) rounded to the format, saturating at its max."""
    f = fmt_of(fmt)
    x = x.float().clamp(-f.max, f.max)
    if fmt in E2M1_ELEMENTS:
        a = x.abs()
        idx = torch.zeros_like(a, dtype=torch.uint8)
        for bound, inclusive in E2M1_UP:
            idx += (a >= bound if inclusive else a > bound).to(torch.uint8)
        return idx | ((x < 0).to(torch.uint8) << 3)
    return x.to(FLOAT_ELEMENTS[fmt]).view(torch.uint8)


decode = decode_float  # the fp32 values of codes (compress/qweight.py owns the rule)


def round_ste(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` (divided by its scale) rounded to the format's values, clamped to its range, with a straight-through
    gradient (AutoRound's rounding): E2M1 in steps of 0.5 below 2, 1 below 4, 2 above (torch's half-to-even ties,
    `encode`'s), E4M3 by torch's cast."""
    f = fmt_of(fmt)
    x = x.clamp(-f.max, f.max)
    if fmt in E2M1_ELEMENTS:
        a = x.abs()
        step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
        q = torch.sign(x) * torch.round(a / step) * step
    else:
        q = x.to(FLOAT_ELEMENTS[fmt]).float()
    return x + (q - x).detach()


def per_column(s: torch.Tensor, d_in: int, g: int) -> torch.Tensor:
    """Group scales (rows, n_groups) spread over the `d_in` columns their groups of `g` cover."""
    return s.repeat_interleave(g, dim=1)[:, :d_in]


def rtn(W: torch.Tensor, group_size: int, fmt: str, gscale: float | None = None) -> QuantizedWeight:
    """Round to nearest on the float grid (module docstring); `gscale`: an E2M1 layer's global scale (default: its
    own)."""
    d_out, d_in = W.shape
    if fmt == "e2m1" and gscale is None:
        gscale = global_scale(W)
    s = scales(W, group_size, fmt, gscale)
    codes = encode(W.float() / per_column(s, d_in, resolve_group(d_in, group_size)), fmt)
    return weight(codes, s, group_size, fmt, gscale)


def weight(codes, s, group_size, fmt, gscale) -> QuantizedWeight:
    """The QuantizedWeight of float-grid codes with their group scales (and NVFP4 global scale)."""
    return QuantizedWeight(codes=codes, scales=s, zeros=torch.zeros_like(s, dtype=torch.uint8),
                           bits=fmt_of(fmt).bits, group_size=group_size, sym=True, fp=fmt,
                           global_scale=gscale if fmt == "e2m1" else None)


class FloatGroups:
    """GPTQ's per-group state (`gptq._Groups`' interface) on a float grid: each group's scale from the error-updated
    weights at its first column (all up front with `static`, as act_order and per-channel groups have); an E2M1
    layer's global scale fixed from `W` (or given: a fused group's)."""

    def __init__(self, W: torch.Tensor, group_size: int, fmt: str, static: bool, gscale: float | None = None):
        self.fmt, self.group_size = fmt, group_size
        self.gscale = (gscale if gscale is not None else global_scale(W)) if fmt == "e2m1" else None
        self.g = resolve_group(W.shape[1], group_size)
        self.static = static or group_size == -1
        self.S = scales(W, group_size, fmt, self.gscale)

    def aligned_block(self, block_size: int) -> int:
        return block_size if self.static else max(1, block_size // self.g) * self.g

    def refresh(self, j: int, W_rest: torch.Tensor) -> None:
        if not self.static and j % self.g == 0:
            k = j // self.g
            self.S[:, k:k + 1] = scales(W_rest[:, :self.g], -1, self.fmt, self.gscale)

    def quantize(self, w: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.S[:, j // self.g]
        c = encode(w / s, self.fmt)
        return c, decode(c, self.fmt) * s

    def quantized_weight(self, codes: torch.Tensor) -> QuantizedWeight:
        return weight(codes, self.S, self.group_size, self.fmt, self.gscale)
