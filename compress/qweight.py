"""The one middle representation: `QuantizedWeight`.

Every method produces one per quantized linear layer; exporters and kernels read only this.

Layout (paper notation, `W` is `nn.Linear.weight`, shape `(d_out, d_in)`):

    codes  uint8  (d_out, d_in)      unsigned codes in [0, 2^bits)
    scales fp32   (d_out, n_groups)  fp16-representable; may be negative (auto-round full-range sym)
    zeros  uint8  (d_out, n_groups)  zero points in [0, 2^bits); 2^(bits-1) for symmetric
    W_hat[o, i] = scales[o, i // g] * (codes[o, i] - zeros[o, i // g])

One width breaks that grid: `bits == 1` is the binary (sign) rule of MC-MoE / GEMQ,
`W_hat[o, i] = scales[o, i // g] * (2 * codes[o, i] - 1)` with the scale `mean |w|` of the group (zero point 1/2 on
the grid above, which a uint8 cannot hold): `zeros` are stored as 1 and never read, and no zero point is counted.
Only uniform weights take it; no packed export format holds it (docs/formats.md), so exports write such a layer
dense.

Group policy: groups run along `d_in`. `group_size == -1` means per-channel (one group of `d_in`).
When `group_size` does not divide `d_in`, the last group of each row is shorter
(`n_groups = ceil(d_in / g)`), as auto-round does by zero padding: its scale and zero point are
computed over the real columns only.

Mixed precision (`allocate` stage; docs/quantize.md#allocation-plans-mixed-precision): with
`chunk_size > 0` the input columns are cut into chunks `[j*c, (j+1)*c)` (the last one may be shorter;
`c` is a multiple of the group, so every group lies in one chunk) and `chunk_bits[j]` is chunk j's bit width: 2..8, or 16 for a chunk kept
in fp16. `bits` is then the widest quantized chunk (the container width); each code lies in
`[0, 2^chunk_bits)` of its chunk, so the same `codes/scales/zeros` tensors hold every chunk. A kept
chunk has codes 0, scale 1, zero 0, and its fp16 values in `kept` (d_out, kept columns, in column
order). `map_bits` is the plan's own storage per chunk (the option index), counted by
`storage_bits`. A uniform weight (`chunk_size == 0`) behaves exactly as before.

llama.cpp's block grids (`grid`, docs/gguf.md#rounding-on-llamacpps-grids): a weight a quantize stage rounded for a
GGUF type (`gguf: Q4_K_M`) carries the blocks' parameters as the file stores them (`kernels.ggml.GGMLParams`: fp16
`d`, `dmin`/`m`, integer sub-block scales and mins). `group_size` is then the sub-block (16 or 32 columns), `codes`
ggml's codes made unsigned (Q8_0 q+128, Q3_K q+4, Q6_K q+32) with the type's fixed `zeros` (128, 8, 16, 4, 32 or
0), `scales` the fp32 product `d*sc` (not fp16-representable for the K types), and the types with a float minimum
(Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) subtract a per-group `offsets()` (`dmin*mn`, or `-m`) after scaling:
`W_hat = scales * (codes - zeros) - offsets`, the same fp32 operations as ggml's `dequantize_row_*`, so the
evaluation sees exactly what the file holds. Only the gguf export stores such a weight packed; the other exports
write it dense (`export/hf.dense_reason`).

Float grids (`fp`, compress/quantize/floatgrid.py; `scheme: fp8`, `nvfp4a16`): `codes` are the codes of a float
element format (E4M3 bit patterns; E2M1 sign bit 8 | the index of the magnitude in `E2M1`), `zeros` 0 and never
read, `W_hat = scales * element(codes)` per group (NVFP4: `scales` are the E4M3 group scales divided by the fp32
`global_scale`; MXFP4 (`fp: mxfp4`, E2M1 codes): powers of two, E8M0; `fp: e4m3-block` (`scheme: fp8-block`): E4M3
with one scale per block of 128 rows by `group_size` columns, repeated over the block's rows in `scales`); only the
compressed-tensors export stores such a weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SCALE_BITS = 16  # scales are stored as fp16
KEEP_BITS = 16  # a mixed-precision chunk kept in fp16
# float element formats `fp` names with a torch dtype (their codes'); "e4m3-block": E4M3 with one scale per block of
# FLOAT_BLOCK_ROWS rows by `group_size` columns (`scheme: fp8-block`, DeepSeek-V3's 128x128), held per row in `scales`
FLOAT_ELEMENTS = {"e4m3": torch.float8_e4m3fn, "e4m3-block": torch.float8_e4m3fn}
FLOAT_BLOCK_ROWS = {"e4m3-block": 128}  # rows sharing each scale (the others: 1)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of FP4 E2M1 by index (codes: sign bit 8 | index)
# a stored group scale: fp16, NVFP4's E4M3, MXFP4's E8M0
FLOAT_SCALE_BITS = {"e4m3": 16, "e4m3-block": 16, "e2m1": 8, "mxfp4": 8}
GLOBAL_SCALE_BITS = 32  # NVFP4's fp32 scale per tensor


def decode_float(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """The fp32 values of float element codes (`fp`: "e4m3" bit patterns, "e2m1" / "mxfp4" sign | index)."""
    if fmt in ("e2m1", "mxfp4"):
        mag = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)[(codes & 7).long()]
        return torch.where(codes & 8 > 0, -mag, mag)
    return codes.view(FLOAT_ELEMENTS[fmt]).float()


def unit_storage_bits(d_out: int, width: int, group: int, bits: int, sym: bool, map_bits: int = 0) -> int:
    """Exact storage of `width` input columns of a (d_out, .) weight at `bits` (16 = kept in fp16) with groups
    of `group` columns: codes + fp16 scales + zero points (asym) + the plan's `map_bits`
    (docs/quantize.md#effective-bits)."""
    if bits == KEEP_BITS:
        return d_out * width * KEEP_BITS + map_bits
    n_groups = math.ceil(width / group)
    return d_out * width * bits + d_out * n_groups * (SCALE_BITS + zero_bits(bits, sym)) + map_bits


def zero_bits(bits: int, sym: bool) -> int:
    """Bits of a stored zero point per group: none for symmetric or 1-bit (sign) weights."""
    return 0 if sym or bits == 1 else bits


CHUNK_ELEMENTS = 1 << 22  # a 16 MB fp32 temporary


def row_chunks(d_out: int, d_in: int) -> list[slice]:
    """Row slices of at most CHUNK_ELEMENTS elements (one row at least)."""
    rows = max(1, CHUNK_ELEMENTS // max(d_in, 1))
    return [slice(a, min(a + rows, d_out)) for a in range(0, d_out, rows)]


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    sym: bool
    chunk_size: int = 0  # > 0: mixed precision, one bit width per chunk of input columns
    chunk_bits: tuple[int, ...] = ()  # bits of each chunk (2..8, or 16 = kept in fp16)
    kept: torch.Tensor | None = None  # fp16-representable values of the kept chunks, (d_out, kept columns)
    map_bits: int = 0  # plan metadata per chunk, counted in storage_bits
    grid: Any = None  # kernels.ggml.GGMLParams: llama.cpp blocks of that type (module docstring)
    fp: str | None = None  # a float grid ("e4m3", "e4m3-block", "e2m1" = NVFP4, "mxfp4"): its codes (module docstring)
    global_scale: float | None = None  # NVFP4 (e2m1): the fp32 per-tensor scale; `scales` already divided by it

    def __post_init__(self):
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {self.bits}")
        if self.bits == 1 and self.chunk_size:
            raise ValueError("1-bit (sign) weights are uniform: a mixed-precision container is 2..8 bits")
        if self.chunk_size:
            self._check_mixed()
        d_out, d_in = self.codes.shape
        if self.scales.shape != (d_out, self.n_groups) or self.zeros.shape != (d_out, self.n_groups):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} / zeros {tuple(self.zeros.shape)} do not match "
                f"codes {tuple(self.codes.shape)} with group size {self.group_size}"
            )
        if self.fp is not None and (self.mixed or self.grid is not None or not self.sym):
            raise ValueError(f"a weight on the {self.fp} float grid is uniform and symmetric")
        if self.grid is not None:
            from compress.kernels import ggml

            if self.mixed or tuple(self.grid.shape) != (d_out, d_in) or self.group_size != ggml.sub_block(self.grid.type):
                raise ValueError(f"{self.grid.type.name} blocks of shape {self.grid.shape} do not match codes "
                                 f"{(d_out, d_in)} with group size {self.group_size}")

    def offsets(self) -> torch.Tensor | None:
        """Per group fp32 value subtracted after scaling (module docstring): llama.cpp's float minimums (`dmin*mn`
        for Q2_K / Q4_K / Q5_K, `-m` for Q4_1 / Q5_1), None for every other weight."""
        if self.grid is None or (self.grid.dmin is None and self.grid.m is None):
            return None
        from compress.kernels import ggml

        _, off = ggml.scale_offset(self.grid.type, self.grid, slice(0, self.in_features, self.group_size))
        return torch.from_numpy(off)

    def _check_mixed(self) -> None:
        d_out, d_in = self.codes.shape
        if self.chunk_size % self.group or self.group_size == -1:
            raise ValueError(f"chunk size {self.chunk_size} must be a multiple of the group size {self.group_size}")
        if len(self.chunk_bits) != math.ceil(d_in / self.chunk_size):
            raise ValueError(f"{len(self.chunk_bits)} chunk bit widths for {d_in} columns in chunks of "
                             f"{self.chunk_size}")
        if any(not (2 <= b <= 8 or b == KEEP_BITS) for b in self.chunk_bits):
            raise ValueError(f"chunk bits must be in 2..8 or {KEEP_BITS}, got {self.chunk_bits}")
        quantized = [b for b in self.chunk_bits if b != KEEP_BITS]
        if self.bits != max(quantized, default=8):
            raise ValueError(f"bits {self.bits} must be the widest quantized chunk ({max(quantized, default=8)})")
        n_kept = int((self.column_bits() == KEEP_BITS).sum())
        shape = None if self.kept is None else tuple(self.kept.shape)
        if (n_kept or shape is not None) and shape != (d_out, n_kept):
            raise ValueError(f"kept values {shape} do not match {n_kept} kept columns")

    @property
    def mixed(self) -> bool:
        return self.chunk_size > 0

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """[start, end) input columns of each chunk (mixed weights)."""
        c, d_in = self.chunk_size, self.in_features
        return [(j * c, min((j + 1) * c, d_in)) for j in range(len(self.chunk_bits))]

    def column_bits(self) -> torch.Tensor:
        """Bit width of every input column, shape (d_in,): `bits` everywhere for a uniform weight."""
        if not self.mixed:
            return torch.full((self.in_features,), self.bits, dtype=torch.int64, device=self.codes.device)
        return torch.tensor([b for (s, e), b in zip(self.chunk_bounds(), self.chunk_bits) for _ in range(s, e)],
                            dtype=torch.int64, device=self.codes.device)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def group(self) -> int:
        """Group length along d_in (d_in for per-channel)."""
        return self.in_features if self.group_size == -1 else self.group_size

    @property
    def n_groups(self) -> int:
        return math.ceil(self.in_features / self.group)

    def group_index(self) -> torch.Tensor:
        """`g_idx`: the group of each input column, shape (d_in,)."""
        return torch.arange(self.in_features, device=self.codes.device) // self.group

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weights (d_out, d_in) in `dtype`, or written into `out` (a linear's weight: no copy of its size).
        Computed in fp32, rows in chunks: one temporary of at most `CHUNK_ELEMENTS` (docs/scale.md)."""
        d_out, d_in, g = self.out_features, self.in_features, self.group
        if out is None:
            out = torch.empty(d_out, d_in, dtype=dtype, device=self.codes.device)
        if self.fp is not None:  # the elements' values times their group's scale
            s = self.scales.to(torch.float32).repeat_interleave(g, dim=1)[:, :d_in]
            for r in row_chunks(d_out, d_in):
                out[r] = decode_float(self.codes[r], self.fp).mul_(s[r])
            return out
        s, z = self.scales.to(torch.float32), self.zeros.to(torch.float32)
        if self.bits == 1:
            z = torch.zeros_like(s)
        g_idx = self.group_index() if d_in % g else None
        kept = self.column_bits() == KEEP_BITS if self.kept is not None and self.kept.numel() else None
        off = self.offsets()
        for r in row_chunks(d_out, d_in):
            W = self.codes[r].to(torch.float32)
            if self.bits == 1:  # the sign rule (module docstring): 2q - 1, then the scale (z is 0 here)
                W.mul_(2).sub_(1)
            if g_idx is not None:
                W.sub_(z[r][:, g_idx]).mul_(s[r][:, g_idx])
            else:
                Wg = W.view(-1, d_in // g, g)
                Wg.sub_(z[r, :, None]).mul_(s[r, :, None])
                if off is not None:  # llama.cpp's float minimum: d1 * q - m1, one more rounding, as ggml
                    Wg.sub_(off[r, :, None])
            if kept is not None:
                W[:, kept] = self.kept[r].to(torch.float32)
            out[r] = W
        return out

    def storage_bits(self) -> int:
        """Bits this weight takes in a packed export: codes, fp16 scales, zero points if asymmetric
        (mixed: per chunk at its own width, kept chunks at 16 bits, plus `map_bits` per chunk; llama.cpp blocks:
        their bytes)."""
        if self.grid is not None:
            from compress.kernels import ggml

            return self.out_features * ggml.bytes_per_row(self.grid.type, self.in_features) * 8
        if self.fp is not None:
            rows = math.ceil(self.out_features / FLOAT_BLOCK_ROWS.get(self.fp, 1))  # a block's rows share a scale
            return (self.codes.numel() * self.bits + rows * self.n_groups * FLOAT_SCALE_BITS[self.fp]
                    + (GLOBAL_SCALE_BITS if self.global_scale is not None else 0))
        if self.mixed:
            return sum(unit_storage_bits(self.out_features, e - s, self.group, b, self.sym, self.map_bits)
                       for (s, e), b in zip(self.chunk_bounds(), self.chunk_bits))
        n = self.out_features * self.n_groups
        return self.codes.numel() * self.bits + n * (SCALE_BITS + zero_bits(self.bits, self.sym))

    def effective_bits(self) -> float:
        """docs/quantize.md#effective-bits: b + (b_scale + b_zero) / g, computed exactly from the stored tensors."""
        return self.storage_bits() / self.codes.numel()


# -- serialization (block checkpoints, QuantizedWeights hand-offs) ---------------------------------------
GRID_FIELDS = ("d", "m", "dmin", "scales", "mins")  # kernels.ggml.GGMLParams' arrays


def qweights_to_tensors(qweights: dict[str, QuantizedWeight]) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = {}, {}
    for name, qw in qweights.items():
        tensors[f"{name}.codes"] = qw.codes.contiguous()
        tensors[f"{name}.scales"] = qw.scales.contiguous()
        tensors[f"{name}.zeros"] = qw.zeros.contiguous()
        meta[name] = {"bits": qw.bits, "group_size": qw.group_size, "sym": qw.sym}
        if qw.mixed:
            meta[name].update(chunk_size=qw.chunk_size, chunk_bits=list(qw.chunk_bits), map_bits=qw.map_bits)
            if qw.kept is not None:
                tensors[f"{name}.kept"] = qw.kept.contiguous()
        if qw.fp is not None:
            meta[name]["fp"] = qw.fp
            if qw.global_scale is not None:
                meta[name]["global_scale"] = qw.global_scale
        if qw.grid is not None:
            meta[name]["ggml"] = qw.grid.type.name
            for f in GRID_FIELDS:
                if getattr(qw.grid, f) is not None:
                    tensors[f"{name}.ggml.{f}"] = torch.from_numpy(getattr(qw.grid, f).copy())
    return tensors, meta


def tensors_to_qweights(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, QuantizedWeight]:
    out = {}
    for name, m in meta.items():
        m = dict(m)
        if "chunk_bits" in m:
            m["chunk_bits"] = tuple(m["chunk_bits"])
        if "ggml" in m:
            from compress.kernels import ggml

            m["grid"] = ggml.GGMLParams(type=m.pop("ggml"), **{f: tensors[f"{name}.ggml.{f}"].numpy() for f in
                                                                 GRID_FIELDS if f"{name}.ggml.{f}" in tensors})
        out[name] = QuantizedWeight(codes=tensors[f"{name}.codes"], scales=tensors[f"{name}.scales"],
                                    zeros=tensors[f"{name}.zeros"], kept=tensors.get(f"{name}.kept"), **m)
    return out
