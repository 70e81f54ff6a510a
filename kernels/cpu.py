"""The `cpu-rows` packed layout and its C++ kernel (AVX2/FMA with a scalar fallback), compiled on first use.

Layout, for a QuantizedWeight of shape (N, K) with b bits (b in 2, 4, 8; F = 32/b fields per int32 word)
---------------------------------------------------------------------------------------------------------
K is zero padded to `Kpad`, a multiple of the chunk `8*F` and of the group. Each row is a run of chunks;
a chunk is 8 int32 words (one AVX2 register) holding 8*F codes, and field j of word i holds column
`k = chunk*8*F + 8*j + i`::

    b = 4, one chunk = 64 columns = 8 words
              bits 31..28  27..24  ...  7..4   3..0
      word 0: | k=56 | k=48 | ... | k=8  | k=0  |
      word 1: | k=57 | k=49 | ... | k=9  | k=1  |
      ...
      word 7: | k=63 | k=55 | ... | k=15 | k=7  |

so `(chunk >> 4*j) & 0xF` is the 8 consecutive columns 8j..8j+7 in 8 int32 lanes: one shift, one
and, one int->float convert and one FMA per 8 weights, no shuffles. b = 2 is the same with 16 fields
of 2 bits (128 columns per chunk), b = 8 with 4 fields of 8 bits (32 columns).

Per (row, group): `scales` fp32 and `sz = scales * zeros` fp32, padded groups are zero. The kernel
computes `y = sum_g scale_g * dot(q_g, x_g) - sum_g sz_g * sum(x_g)`, the reference's
`x @ (scales * (codes - zeros)).T` up to float rounding. Groups must be a power of two >= 32 columns
(or per-channel); other QuantizedWeights are served by the reference backend.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
KERNEL_BITS = (2, 4, 8)
PER_CHANNEL_SHIFT = 60  # group index = (k // 8) >> shift: always 0
_EXT: dict[str, object] = {}


@dataclass(frozen=True)
class PackedCPU:
    words: torch.Tensor  # int32 (N, Kpad*bits/32)
    scales: torch.Tensor  # fp32 (N, Gp)
    sz: torch.Tensor  # fp32 (N, Gp)
    bits: int
    in_features: int
    kpad: int
    gshift: int

    @property
    def out_features(self) -> int:
        return self.words.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.sz))


def supports(qw: QuantizedWeight) -> str | None:
    """None if the kernel can run `qw`, else the reason it cannot."""
    if qw.bits not in KERNEL_BITS:
        return f"{qw.bits}-bit weights (kernel bits: {KERNEL_BITS})"
    g = qw.group_size
    if g != -1 and (g < 32 or g & (g - 1)):
        return f"group size {g} (kernel groups: powers of two >= 32, or per-channel)"
    return None


def pack(qw: QuantizedWeight) -> PackedCPU:
    """QuantizedWeight -> cpu-rows layout (module docstring)."""
    reason = supports(qw)
    if reason:
        raise ValueError(f"the cpu kernel cannot hold {reason}")
    bits, (N, K) = qw.bits, qw.codes.shape
    F = 32 // bits
    step = 8 * F if qw.group_size == -1 else max(8 * F, qw.group_size)
    kpad = math.ceil(K / step) * step
    codes = torch.zeros(N, kpad, dtype=torch.int64)
    codes[:, :K] = qw.codes.cpu()
    fields = codes.view(N, kpad // (8 * F), F, 8) << (torch.arange(F) * bits).view(1, 1, F, 1)
    words = fields.sum(2)  # disjoint bit ranges: sum == or
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(N, -1).contiguous()
    if qw.group_size == -1:
        gp, gshift = 1, PER_CHANNEL_SHIFT
    else:
        gp, gshift = kpad // qw.group_size, int(math.log2(qw.group_size // 8))
    scales = torch.zeros(N, gp)
    scales[:, : qw.n_groups] = qw.scales.cpu().float()
    sz = torch.zeros(N, gp)
    sz[:, : qw.n_groups] = qw.scales.cpu().float() * qw.zeros.cpu().float()
    return PackedCPU(words, scales.contiguous(), sz.contiguous(), bits, K, kpad, gshift)


def matmul(x: torch.Tensor, p: PackedCPU, scalar: bool = False) -> torch.Tensor:
    """x (..., K) -> (..., N) in fp32 through the compiled kernel (`extension()` must not be None)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    if p.kpad != p.in_features:
        x2 = torch.nn.functional.pad(x2, (0, p.kpad - p.in_features))
    y = extension().matmul(x2.contiguous(), p.words, p.scales, p.sz, p.bits, p.gshift, scalar)
    return y.reshape(*lead, p.out_features)


def _build_dir() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
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
        return load(name="compress_cpu_kernel", sources=[str(SOURCE)], build_directory=str(_build_dir()),
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except (OSError, RuntimeError, ImportError) as e:  # compiler present but the build failed
        logger.warning("building the cpu kernel failed, packed layers use the reference path: %s", e)
        return None
