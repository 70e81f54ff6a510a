"""The `cpu-rows` and `cpu-tiles` packed layouts and their C++ kernel (AVX2/FMA with a scalar fallback), compiled on first use.

Layout, for a QuantizedWeight of shape (N, K) with b bits (b in 1, 2, 4, 8; P = 8/b codes per byte)
-------------------------------------------------------------------------------------------------
K is zero padded to `kpad` (a multiple of 128, of a chunk pair and of the group). Each row is a run of
chunks; a chunk is 8 int32 words (one AVX2 register) = 32 bytes holding 32*P codes. Byte t (0..3)
of word i (0..7) holds in its field s (bits s*b .. s*b+b-1) the chunk's column `k = 32*s + 4*i + t`::

    b = 4: one chunk = 64 columns; each byte = | field 1 (bits 7..4) | field 0 (bits 3..0) |
              byte 3       byte 2       byte 1       byte 0
      word 0: | k35 | k3 | | k34 | k2 | | k33 | k1 | | k32 | k0 |
      word 1: | k39 | k7 | | k38 | k6 | | k37 | k5 | | k36 | k4 |
      ...
      word 7: | k63 | k31| | k62 | k30| | k61 | k29| | k60 | k28|

so `(chunk >> b*s) & 0x0F0F..` is columns 32s..32s+31 as 32 bytes in order, ready for one u8 x s8
dot product with int8 activations (`matmul(..., act="int8")`), and `(chunk >> b*(t*P+s)) & 0xF` is 8
columns (32s+t, 32s+4+t, ...) as int32 lanes for the fp32 path (one shift, and, convert, FMA per 8
weights, no shuffles; x is permuted once per call to match, `permute_x`). b = 2 packs 4 fields per
byte (128 columns per chunk), b = 8 one (32 columns), b = 1 eight (256 columns). 3-bit weights are two
planes (`Packed3`): their low 2 bits and their high bit, so they still read 3 bits per weight.

Per (row, group): `scales` fp16 (as every export format stores them) and `zeros` uint8; padded groups
are zero. The kernel computes `y = sum_g scale_g * dot(q_g, x_g) - sum_g (scale_g * zero_g) * sum(x_g)`:
with fp32 activations the reference's `x @ (scales * (codes - zeros)).T` (scales rounded to fp16) up to
float rounding; with int8 activations
(symmetric, one scale per min(group, 128) columns of each row of x, like onnxruntime's
accuracy_level 4 and OpenVINO's dynamic quantization) exactly that of the rounded activations.
Groups must be powers of two >= 32 columns (or per-channel); other weights use the reference backend.

The `cpu-tiles` layout (`PackedTiles`, 2-bit weights, int8 activations only) stores 16 rows side by side, so
each row's dot product stays in its own 16-bit lane and no group needs a horizontal sum. On AVX2 without VNNI,
where int2 is bound by its vector instructions rather than by memory, that saves about a quarter of them; on
the AVX-512 VNNI machine measured it also streams int2 from memory faster than the AVX-512 cpu-rows path.
`layout_for` picks it for the `cpu-a8` backend wherever the AVX2 code is built (`prefers_tiles`).

The kernel is compiled for this CPU (`-march=native`, with the AVX-512 VNNI path where the CPU has it).
`COMPRESS_CPU_ISA=avx2` in the environment (read once per process) builds it for an AVX2/FMA/F16C CPU
instead (`-march=haswell`), so an AVX-512 machine runs exactly the code an AVX2-only one would
(`compress bench kernels --isa avx2`). Each build has its own cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from compress import locking
from compress.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
KERNEL_BITS = (2, 3, 4, 8)  # 3 bits run as two planes (Packed3); the C++ kernel itself runs 1, 2, 4, 8
A8_BITS = (1, 2, 3, 4)  # int8 activations: u8 x s8 products of 8-bit weights could saturate without VNNI
PER_CHANNEL_SHIFT = 60  # group of a 32-column block = block >> shift: always 0
XBLOCK = 128  # int8 activations: at most this many columns per activation scale
FP16_MAX = 65504.0
_EXT: dict[str, object] = {}


@dataclass(frozen=True)
class PackedCPU:
    words: torch.Tensor  # int32 (N, Kpad*bits/32)
    scales: torch.Tensor  # fp16 (N, Gp)
    zeros: torch.Tensor  # uint8 (N, Gp)
    bits: int
    in_features: int
    kpad: int
    gshift: int

    @property
    def out_features(self) -> int:
        return self.words.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.zeros))


@dataclass(frozen=True)
class Packed3:
    """A 3-bit weight as two planes: `lo` = codes & 3 (2 bits, the weight's scales and zero points; cpu-rows,
    or cpu-tiles for int8 activations where `layout_for` says so) and `hi` = codes >> 2 (1 bit, cpu-rows,
    scales * 4, zero 0); y = x @ lo.T + x @ hi.T, 3 bits read per weight. (3-bit fields do not tile a byte,
    which the single-plane layout needs.)"""
    lo: "PackedCPU | PackedTiles"
    hi: PackedCPU
    bits = 3

    @property
    def in_features(self) -> int:
        return self.lo.in_features

    @property
    def out_features(self) -> int:
        return self.lo.out_features

    @property
    def kpad(self) -> int:
        return self.lo.kpad

    @property
    def gshift(self) -> int:
        return self.lo.gshift

    def nbytes(self) -> int:
        return self.lo.nbytes() + self.hi.nbytes()


@dataclass(frozen=True)
class PackedTiles:
    """2-bit codes in the `cpu-tiles` layout, for int8 activations only (cpu_kernel.cpp: matmul_a8_tiles).
    Rows in tiles of 16 (the last padded with zero codes); per tile, one 32-byte vector per 8 columns:
    byte 2r + j, field f (bits 2f, 2f+1) holds row r, column 8o + 2f + j. Each row's partial dot product
    then stays in its own 16-bit lane (no horizontal sums per group). `scales` fp16 / `zeros` uint8 are
    (tiles, Gp, 16): the tile's 16 rows side by side."""
    words: torch.Tensor  # int32 (T, Kpad): 8 words per vector of 8 columns
    scales: torch.Tensor  # fp16 (T, Gp, 16)
    zeros: torch.Tensor  # uint8 (T, Gp, 16)
    in_features: int
    out_features: int
    kpad: int
    gshift: int
    bits = 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.zeros))


def supports(qw: QuantizedWeight) -> str | None:
    """None if the kernel can run `qw`, else the reason it cannot."""
    if qw.bits not in KERNEL_BITS:
        return f"{qw.bits}-bit weights (kernel bits: {KERNEL_BITS})"
    g = qw.group_size
    if g != -1 and (g < 32 or g & (g - 1)):
        return f"group size {g} (kernel groups: powers of two >= 32, or per-channel)"
    if qw.scales.numel() and qw.scales.abs().max().item() * (4 if qw.bits == 3 else 1) > FP16_MAX:
        return "scales beyond the fp16 range (the kernel stores scales in fp16)"
    return None


def layout_for(qw: QuantizedWeight, act: str) -> str:
    """The layout `pack` should build for `act`: `tiles` for 2-bit weights (and the 2-bit plane of 3-bit ones)
    with int8 activations where the build prefers it (wherever its AVX2 code runs: `prefers_tiles` in cpu_kernel.cpp),
    else `rows`."""
    ext = extension()
    return "tiles" if act == "int8" and qw.bits in (2, 3) and ext is not None and ext.prefers_tiles() else "rows"


def pack(qw: QuantizedWeight, layout: str = "rows") -> PackedCPU | Packed3 | PackedTiles:
    """QuantizedWeight -> cpu-rows layout (module docstring; 3 bits -> a 2-bit and a 1-bit plane), or with
    `layout="tiles"` a 2-bit weight (or the 2-bit plane of a 3-bit one) in cpu-tiles (int8 activations only)."""
    if layout not in ("rows", "tiles"):
        raise ValueError(f"unknown cpu layout {layout!r} (known: rows, tiles)")
    if layout == "tiles" and qw.bits != 3:
        return pack_tiles(qw)
    reason = supports(qw)
    if reason:
        raise ValueError(f"the cpu kernel cannot hold {reason}")
    codes, scales, zeros = qw.codes.cpu(), qw.scales.cpu().float(), qw.zeros.cpu().float()
    if qw.bits == 3:  # W = s (lo + 4 hi - z) = s (lo - z) + 4s (hi - 0)
        lo = (tiles_plane(codes & 3, scales, zeros, qw.group_size) if layout == "tiles"
              else pack_plane(codes & 3, scales, zeros, 2, qw.group_size, align=512))  # same kpad as hi
        return Packed3(lo, pack_plane(codes >> 2, 4 * scales, torch.zeros_like(zeros), 1, qw.group_size))
    return pack_plane(codes, scales, zeros, qw.bits, qw.group_size)


def pack_plane(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
               align: int = 128) -> PackedCPU:
    """Codes (N, K) in [0, 2^bits) with per-group scales (stored fp16) and zero points (N, n_groups) -> cpu-rows,
    K padded to a multiple of `align`, of whole groups, of whole chunk pairs (the AVX-512 path) and of XBLOCKs."""
    N, K = codes.shape
    P, kpad = 8 // bits, padded_k(K, bits, group_size, align)
    padded = torch.zeros(N, kpad, dtype=torch.int64)
    padded[:, :K] = codes
    # codes[n, chunk, s, i, t] -> bits 8t + b*s of word i
    fields = padded.view(N, kpad // (32 * P), P, 8, 4)
    shift = (8 * torch.arange(4).view(1, 1, 1, 1, 4) + bits * torch.arange(P).view(1, 1, P, 1, 1))
    words = (fields << shift).sum((2, 4))  # disjoint bit ranges: sum == or
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(N, -1).contiguous()
    s, z, gshift = group_meta(scales, zeros, group_size, kpad)
    return PackedCPU(words, s, z, bits, K, kpad, gshift)


def padded_k(k: int, bits: int, group_size: int, align: int = 128) -> int:
    """K padded to a multiple of `align`, of whole groups, of whole chunk pairs and of XBLOCKs (`pack_plane`)."""
    step = max(align, 128, 64 * (8 // bits), group_size)
    return math.ceil(k / step) * step


def group_meta(scales: torch.Tensor, zeros: torch.Tensor, group_size: int, kpad: int):
    """(scales fp16, zeros uint8, gshift) per (row, group) over `kpad` columns, padded groups zero."""
    N, n_groups = scales.shape
    if group_size == -1:
        gp, gshift = 1, PER_CHANNEL_SHIFT
    else:
        gp, gshift = kpad // group_size, int(math.log2(group_size // 32))
    s, z = torch.zeros(N, gp, dtype=torch.float16), torch.zeros(N, gp, dtype=torch.uint8)
    s[:, :n_groups] = scales.half()
    z[:, :n_groups] = zeros.round().to(torch.uint8)
    return s, z, gshift


def pack_tiles(qw: QuantizedWeight) -> PackedTiles:
    """A 2-bit QuantizedWeight -> cpu-tiles (PackedTiles)."""
    reason = supports(qw)
    if reason or qw.bits != 2:
        raise ValueError(f"the cpu-tiles layout cannot hold {reason or f'{qw.bits}-bit weights (2 bits only)'}")
    return tiles_plane(qw.codes.cpu(), qw.scales.cpu().float(), qw.zeros.cpu().float(), qw.group_size)


def tiles_plane(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> PackedTiles:
    """2-bit codes (N, K) with per-group scales and zero points -> cpu-tiles, K padded as `pack_plane` pads it."""
    (N, K), T = codes.shape, -(-codes.shape[0] // 16)
    kpad = padded_k(K, 2, group_size)
    s, z, gshift = group_meta(scales, zeros, group_size, kpad)
    padded = torch.zeros(T * 16, kpad, dtype=torch.int32)
    padded[:N, :K] = codes.int()
    # codes[t, r, o, f, j] -> field f of byte (t, o, 2r + j)
    fields = padded.view(T, 16, kpad // 8, 4, 2).permute(0, 2, 1, 4, 3)  # (T, o, r, j, f)
    byte = (fields << (2 * torch.arange(4, dtype=torch.int32))).sum(-1).to(torch.uint8)  # disjoint bits: sum == or
    words = byte.reshape(T, kpad // 8, 32).view(torch.int32).reshape(T, kpad).contiguous()

    def tiled(t: torch.Tensor) -> torch.Tensor:  # (N, Gp) -> (T, Gp, 16), padded rows zero
        out = torch.zeros(T * 16, t.shape[1], dtype=t.dtype)
        out[:N] = t
        return out.view(T, 16, -1).transpose(1, 2).contiguous()

    return PackedTiles(words, tiled(s), tiled(z), K, N, kpad, gshift)


def permute_x(x: torch.Tensor, bits: int) -> torch.Tensor:
    """(B, kpad) natural order -> the fp32 path's order: per chunk, field j = t*P + s, lane i."""
    P = 8 // bits
    B, kpad = x.shape
    return x.view(B, kpad // (32 * P), P, 8, 4).permute(0, 1, 4, 2, 3).reshape(B, kpad).contiguous()


def quantize_x(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per `block` columns: (xq int8 (B, kpad), scales fp32 (B, kpad/block)). The kernel
    rounds activations this way itself (cpu_kernel.cpp: quantize_act); this is its oracle in the tests."""
    B, kpad = x.shape
    xb = x.view(B, kpad // block, block)
    sx = (xb.abs().amax(-1) / 127).clamp_min(1e-30)
    xq = torch.round(xb / sx.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return xq.view(B, kpad).contiguous(), sx.contiguous()


def xblock(p: PackedCPU | PackedTiles) -> int:
    return XBLOCK if p.gshift == PER_CHANNEL_SHIFT else min(XBLOCK, 32 << p.gshift)


def matmul(x: torch.Tensor, p: PackedCPU | Packed3 | PackedTiles, act: str = "fp32", scalar: bool = False,
           avx512: bool = True, prefill: int | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) fp32 through the compiled kernel (`extension()` must not be None).
    act="fp32": exact up to float rounding; act="int8": activations rounded per block (module docstring),
    in the kernel (as `quantize_x`). `scalar` / `avx512=False` force the scalar / AVX2 code (tests).
    Inputs of at least `prefill` rows (default `prefill_rows`: the measured cut-over) take the prefill path
    (`matmul_dequant`: the weight dequantized slice by slice, then BLAS) instead of the batch-1 kernel."""
    rows = x.numel() // max(1, x.shape[-1])
    if act not in ("fp32", "int8"):
        raise ValueError(f"act must be fp32 or int8, got {act}")
    if not scalar and rows >= (prefill_rows(p, act) if prefill is None else prefill):
        return matmul_dequant(x, p, act)
    if isinstance(p, Packed3):  # both planes round x alike: same blocks (group or 128 columns)
        return (matmul(x, p.lo, act, scalar, avx512, prefill=rows + 1)
                + matmul(x, p.hi, act, scalar, avx512, prefill=rows + 1))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    if isinstance(p, PackedTiles):
        if act != "int8":
            raise ValueError("the cpu-tiles layout runs int8 activations only")
        y = extension().matmul_a8_tiles(x2, p.words, p.scales, p.zeros, p.out_features, p.gshift,
                                        int(math.log2(xblock(p) // 32)), scalar)
    elif act == "int8" and p.bits in A8_BITS:
        y = extension().matmul_a8(x2, p.words, p.scales, p.zeros, p.bits, p.gshift,
                                  int(math.log2(xblock(p) // 32)), scalar, avx512)
    else:
        if p.kpad != p.in_features:
            x2 = torch.nn.functional.pad(x2, (0, p.kpad - p.in_features))
        xsum = x2.view(x2.shape[0], p.scales.shape[1], -1).sum(-1).contiguous()
        y = extension().matmul_f32(permute_x(x2, p.bits), xsum, p.words, p.scales, p.zeros, p.bits, p.gshift, scalar)
    return y.reshape(*lead, p.out_features)


# Prefill: rows of x from which dequantizing the weight and calling BLAS beats the batch-1 kernel, per kernel ISA
# (`kernel_isa`), activations and weight bits. Measured by `compress bench kernels` (its `prefill` section, the
# cut-over of every pair), see docs/kernels.md#prefill; 0 never takes the prefill path.
PREFILL_ROWS = {  # bench/kernels-prefill{,-avx2}.md, 2026-12-05: at 32 rows int2/int4 fp32 are a tie (within 10%)
    ("avx512", "fp32", 2): 32, ("avx512", "fp32", 3): 16, ("avx512", "fp32", 4): 32, ("avx512", "fp32", 8): 32,
    ("avx512", "int8", 2): 0, ("avx512", "int8", 3): 0, ("avx512", "int8", 4): 0, ("avx512", "int8", 8): 32,
    ("avx2", "fp32", 2): 32, ("avx2", "fp32", 3): 16, ("avx2", "fp32", 4): 32, ("avx2", "fp32", 8): 32,
    ("avx2", "int8", 2): 0, ("avx2", "int8", 3): 0, ("avx2", "int8", 4): 0, ("avx2", "int8", 8): 32,
}
SLICE_ELEMENTS = 2**21  # the prefill path dequantizes at most this many weights (8 MiB fp32) per BLAS call
_SLICE: dict[str, torch.Tensor] = {}  # the one reused dequantization buffer


def kernel_isa() -> str:
    """The code the compiled kernel runs: avx512 (AVX-512 VNNI build), avx2, or scalar (no vector build)."""
    if "isa" not in _EXT:
        ext = extension()
        _EXT["isa"] = ("avx512" if ext is not None and ext.has_avx512() else
                       "avx2" if ext is not None and ext.has_avx2() else "scalar")
    return _EXT["isa"]


def prefill_rows(p: PackedCPU | Packed3 | PackedTiles, act: str) -> int:
    """Rows of x from which `matmul` dequantizes and calls BLAS (`PREFILL_ROWS`; the scalar build: 2)."""
    isa = kernel_isa()
    if isa == "scalar":
        return 2
    rows = PREFILL_ROWS.get((isa, act, p.bits))
    return rows if rows else 2**62


def matmul_dequant(x: torch.Tensor, p: PackedCPU | Packed3 | PackedTiles, act: str = "fp32") -> torch.Tensor:
    """The prefill path: x (..., K) -> (..., N) fp32 as x @ W_hat.T with W_hat dequantized (`dequantize`) into
    one reused buffer, at most SLICE_ELEMENTS weights (a slice of rows) at a time, each slice one BLAS call.
    With act="int8" (and weights the int8 path takes: `A8_BITS`, or cpu-tiles) x is first rounded as the kernel
    rounds it (`quantize_x`, per `xblock`), so both paths compute the same sums up to float rounding."""
    lead, K, N = x.shape[:-1], p.in_features, p.out_features
    x2 = x.reshape(-1, K).float()
    if act == "int8" and (isinstance(p, PackedTiles) or p.bits in A8_BITS):
        x2 = round_x(x2, p)
    per = max(1, min(N, SLICE_ELEMENTS // K))
    buf = _SLICE.get("buf")
    if buf is None or buf.numel() < per * K:
        buf = _SLICE["buf"] = torch.empty(max(per * K, SLICE_ELEMENTS))
    y = torch.empty(x2.shape[0], N)
    for n0 in range(0, N, per):
        w = buf[: min(per, N - n0) * K].view(-1, K)
        dequantize_into(p, n0, w)
        torch.mm(x2, w.T, out=y[:, n0 : n0 + w.shape[0]])
    return y.reshape(*lead, N)


def round_x(x2: torch.Tensor, p: PackedCPU | Packed3 | PackedTiles) -> torch.Tensor:
    """x (B, K) rounded to int8 as the kernel's int8 path rounds it (per `xblock` columns), back in fp32."""
    block = xblock(p.lo if isinstance(p, Packed3) else p)
    B, K = x2.shape
    xp = torch.nn.functional.pad(x2, (0, p.kpad - K)) if p.kpad != K else x2.contiguous()
    xq, sx = quantize_x(xp, block)
    return (xq.view(B, -1, block).float() * sx.unsqueeze(-1)).view(B, p.kpad)[:, :K]


def dequantize_into(p: PackedCPU | Packed3 | PackedTiles, n0: int, out: torch.Tensor) -> torch.Tensor:
    """Rows n0 .. n0 + len(out) of the packed weight, dequantized (scale * (code - zero)) into `out` (rows, K)."""
    ext = extension()
    if isinstance(p, Packed3):
        dequantize_into(p.lo, n0, out)
        ext.dequant_rows(p.hi.words, p.hi.scales, p.hi.zeros, 1, p.hi.gshift, n0, out, True)
    elif isinstance(p, PackedTiles):
        ext.dequant_tiles(p.words, p.scales, p.zeros, p.gshift, n0, out)
    else:
        ext.dequant_rows(p.words, p.scales, p.zeros, p.bits, p.gshift, n0, out, False)
    return out


def dequantize(p: PackedCPU | Packed3 | PackedTiles) -> torch.Tensor:
    """The whole packed weight as fp32 (N, K) (tests; `matmul_dequant` works slice by slice)."""
    return dequantize_into(p, 0, torch.empty(p.out_features, p.in_features))


def _cpu_flags() -> bytes:
    """The CPU's feature flags: the build uses -march=native, so a cached build is only for this CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor().encode()
    return next((ln for ln in text.splitlines() if ln.startswith("flags")), "").encode()


ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=haswell", "-mtune=native"]}


def build_isa() -> str:
    """The instruction set the kernel is built for: `COMPRESS_CPU_ISA` (native or avx2), default native."""
    isa = os.environ.get("COMPRESS_CPU_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"COMPRESS_CPU_ISA={isa!r}: known values are {', '.join(ISA_FLAGS)}")
    return isa


def _build_dir() -> Path:
    flags = " ".join(ISA_FLAGS[build_isa()]).encode()
    # the torch installation too: two environments with the same torch version link against different files
    install = str(Path(torch.__file__).resolve().parent).encode()
    # and the source's path: torch's build file names it, so two checkouts sharing a directory rebuild in turn
    key = hashlib.sha256(SOURCE.read_bytes() + str(SOURCE.resolve()).encode() + torch.__version__.encode() + install
                         + _cpu_flags() + flags).hexdigest()[:12]
    root = Path(os.environ.get("COMPRESS_CACHE", Path.home() / ".cache" / "compress"))
    d = root / "kernels" / f"cpu-{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def extension():
    """The compiled kernel module, or None (logged once) when it cannot be built or is disabled
    with COMPRESS_CPU_KERNEL=0."""
    if "mod" in _EXT:
        return _EXT["mod"]
    mod = None
    if os.environ.get("COMPRESS_CPU_KERNEL", "1") == "0":
        logger.warning("COMPRESS_CPU_KERNEL=0: packed layers use the reference path (dequantize, then matmul)")
    elif shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("no C++ compiler found: packed layers use the reference path (dequantize, then matmul)")
    else:
        mod = _compile()
    _EXT["mod"] = mod
    return mod


def _compile():
    from torch.utils.cpp_extension import load

    try:
        isa = build_isa()
        if isa != "native":
            logger.info("cpu kernel built for %s (COMPRESS_CPU_ISA): %s", isa, " ".join(ISA_FLAGS[isa]))
        build = _build_dir()
        with _build_lock(build):
            if not any(build.glob("*.so")):
                logger.warning("building the CPU kernel (first use in this environment, about a minute) in %s", build)
            return load(name="compress_cpu_kernel", sources=[str(SOURCE)], build_directory=str(build),
                        extra_cflags=["-O3", *ISA_FLAGS[isa], "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except (OSError, RuntimeError, ImportError, TimeoutError) as e:  # compiler present but the build failed
        logger.warning("building the cpu kernel failed, packed layers use the reference path: %s", e)
        return None


BUILD_WAIT_S = 900


@contextlib.contextmanager
def _build_lock(build: Path, wait_s: float = BUILD_WAIT_S):
    """Hold an flock on BUILD/compress.lock (pid inside) while torch builds or loads the kernel there.

    torch's own lock (BUILD/lock, a file that exists while a build runs) stays behind when a build is
    killed, and every later build then waits for it forever. Ours dies with its process: holding it, no
    other compress process is building here, so a leftover torch lock is stale and removed. A wait for a
    live build is announced, with the builder's pid, and gives up after `wait_s`."""
    def announce(pid):
        logger.warning("waiting for another process (pid %s) that is building the CPU kernel in %s", pid or "?", build)

    try:
        fd = locking.acquire(build / "compress.lock", wait_s=wait_s, on_busy=announce)
    except locking.Busy:
        raise TimeoutError(f"the CPU kernel build in {build} did not finish within {wait_s:.0f} s") from None
    try:
        stale = build / "lock"
        if stale.exists():
            logger.warning("removing a stale CPU kernel build lock left by a killed build: %s", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        locking.release(fd)
