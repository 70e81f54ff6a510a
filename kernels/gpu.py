"""The Triton GEMM for packed weights (GPU), tested on CPU through Triton's interpreter.

Layout (`gpu-kmajor`): the GPTQ `qweight` of `kernels/packing.py`, codes packed along K
-----------------------------------------------------------------------------------------
For a QuantizedWeight of shape (N, K) with b bits, K is zero padded to `kpad` (a multiple of 32)
and `words = packing.pack(codes, b).T`: int32 (kpad*b/32, N), column n is the LSB-first bitstream
of row n's codes, so word row r of column n holds codes k = r*32/b .. (r+1)*32/b - 1 of that row
(b = 2, 4, 8: field s of word r is k = r*(32/b) + s; b = 3: 32 codes fill 3 word rows and two
codes per 3 rows straddle a word boundary, as drawn in `packing.py`). It is the tensor an
auto-round / GPTQ checkpoint stores (`qweight`), so a checkpoint goes to the GPU without repacking.
`scales` fp16 (G, N) and `zeros` uint8 (G, N) are the QuantizedWeight's, transposed so one group
row is contiguous along N.

Kernel: y[m, n] = sum_k x[m, k] * (q[k, n] - z[g(k), n]) * s[g(k), n], fp32 accumulation.
A program owns a (BLOCK_M, BLOCK_N) tile of y and a 1/SPLIT_K slice of K (partial sums are added
atomically into a zeroed fp32 output when SPLIT_K > 1, which gives small-batch GEMV enough programs
to fill a GPU). Per K step it loads each packed word once, a (BLOCK_K*b/32, BLOCK_N) tile, and
unpacks field s (shift, mask) in registers into the codes of rows k = word*(32/b) + s, dequantizes
them with the fused zero point and scale, and multiplies with the matching (strided) columns of x:
`tl.dot` when BLOCK_M >= 16 (tensor cores), a broadcast multiply and reduction below that (GEMV).
3-bit codes are gathered per row from their one or two words (64-bit funnel shift).
When the K block lies in one group (BLOCK_K divides the group size) its scales and zero points are
one row each; otherwise they are gathered per code row.

`TRITON_INTERPRET=1`, or no CUDA device, runs the same kernel in Triton's interpreter on CPU
tensors (slow; for tests on small shapes).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from compress.kernels.packing import pack as pack_bits
from compress.qweight import QuantizedWeight

tl = None  # triton.language, imported by `_triton()`: the interpreter looks for it in the kernel's module globals

GPU_BITS = (2, 3, 4, 8)
_KERNELS: dict[bool, object] = {}


@dataclass(frozen=True)
class PackedGPU:
    words: torch.Tensor  # int32 (kpad*bits/32, N)
    scales: torch.Tensor  # fp16 (G, N)
    zeros: torch.Tensor  # uint8 (G, N)
    bits: int
    in_features: int
    group: int  # columns per group (in_features for per-channel)

    @property
    def out_features(self) -> int:
        return self.words.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.zeros))


def available() -> str | None:
    """None if Triton can run here (on a CUDA device, or in its interpreter), else why not."""
    try:
        _triton()
    except (ImportError, RuntimeError) as e:
        return str(e)
    return None


def interpret() -> bool:
    """Run in Triton's interpreter: asked for with TRITON_INTERPRET=1, or forced when there is no GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available()


def _triton():
    """Import triton. Its interpreter must be chosen before triton.language is first imported (its own
    helpers such as `tl.zeros` are jit functions decorated at import), so without a GPU this sets
    TRITON_INTERPRET=1 first; an earlier import in compiled mode cannot be interpreted and raises."""
    global tl
    if interpret() and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        import triton.language as lang
    except ImportError as e:
        raise ImportError(f"triton is not installed (pip install 'compress-llm[gpu]'): {e}") from e
    if interpret():
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(lang.zeros, InterpretedFunction):
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its CPU interpreter cannot "
                               "run; set TRITON_INTERPRET=1 in the environment (there is no CUDA device)")
    tl = lang
    return triton


def supports(qw: QuantizedWeight) -> str | None:
    if qw.bits not in GPU_BITS:
        return f"{qw.bits}-bit weights (triton bits: {GPU_BITS})"
    return None


def device() -> torch.device:
    return torch.device("cpu" if interpret() else "cuda")


def pack(qw: QuantizedWeight, dev: torch.device | None = None) -> PackedGPU:
    """QuantizedWeight -> gpu-kmajor layout (module docstring), on `dev` (default: `device()`)."""
    reason = supports(qw)
    if reason:
        raise ValueError(f"the triton kernel cannot hold {reason}")
    dev = dev or device()
    N, K = qw.codes.shape
    kpad = math.ceil(K / 32) * 32
    codes = torch.zeros(N, kpad, dtype=torch.uint8)
    codes[:, :K] = qw.codes.cpu()
    words = pack_bits(codes, qw.bits).T.contiguous()
    return PackedGPU(words.to(dev), qw.scales.T.half().contiguous().to(dev), qw.zeros.T.contiguous().to(dev),
                     qw.bits, K, qw.group)


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4


def pick_config(p: PackedGPU, m: int, n_sm: int = 132) -> Config:
    """A launch configuration: BLOCK_K whole words and, for the per-group fast path, inside one group;
    for small batches split K until there are about 2 programs per SM (H200: 132 SMs)."""
    per = 32 // p.bits if 32 % p.bits == 0 else 1  # codes per word (3 bits: codes are gathered one by one)
    block_m = max(1, min(32, 1 << (m - 1).bit_length()))
    block_n = 64 if block_m >= 16 else 128
    min_k = 16 * per if block_m >= 16 else per  # tl.dot needs at least 16 rows
    block_k = max(min_k, 256 if p.bits <= 4 else 128)
    align = p.group & -p.group  # largest power of two dividing the group
    if align >= min_k:  # one group per K step
        block_k = min(block_k, align)
    tiles = math.ceil(m / block_m) * math.ceil(p.out_features / block_n)
    k_steps = math.ceil(p.words.shape[0] * 32 / p.bits / block_k)
    split_k = max(1, min(k_steps, (2 * n_sm) // max(1, tiles))) if m <= 16 else 1
    return Config(block_m, block_n, block_k, split_k)


def matmul(x: torch.Tensor, p: PackedGPU, config: Config | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) fp32 through the Triton kernel; x is moved to the weight's device."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(p.words.device)
    if not x2.is_floating_point():
        raise ValueError(f"x must be floating point, got {x2.dtype}")
    x2 = x2.contiguous()
    m, n = x2.shape[0], p.out_features
    cfg = config or pick_config(p, m)
    kpad = p.words.shape[0] * 32 // p.bits
    y = (torch.zeros if cfg.split_k > 1 else torch.empty)((m, n), dtype=torch.float32, device=x2.device)
    k_split = math.ceil(math.ceil(kpad / cfg.block_k) / cfg.split_k) * cfg.block_k
    grid = (math.ceil(m / cfg.block_m), math.ceil(n / cfg.block_n), cfg.split_k)
    one_group = p.group % cfg.block_k == 0
    _kernel()[grid](x2, p.words, p.scales, p.zeros, y, m, n, p.in_features, kpad, k_split, x2.stride(0), p.group,
                    BITS=p.bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    ATOMIC=cfg.split_k > 1, ONE_GROUP=one_group, USE_DOT=cfg.block_m >= 16,
                    FP32_DOT=x2.dtype == torch.float32, num_warps=cfg.num_warps)
    return y.reshape(*lead, n)


def _kernel():
    """The kernel, jit-compiled for the GPU or wrapped for the interpreter (chosen per process state)."""
    mode = interpret()
    if mode not in _KERNELS:
        triton = _triton()
        if mode:
            from triton.runtime.interpreter import InterpretedFunction

            _KERNELS[mode] = InterpretedFunction(packed_gemm)
        else:
            _KERNELS[mode] = triton.jit(packed_gemm)
    return _KERNELS[mode]


def packed_gemm(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, KPAD, K_SPLIT, stride_xm, GROUP,
                BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                ATOMIC: tl.constexpr, ONE_GROUP: tl.constexpr, USE_DOT: tl.constexpr,
                FP32_DOT: tl.constexpr):
    MASK: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 32 // BITS  # codes per word (2, 4, 8 bits: no code straddles a word)
    WHOLE: tl.constexpr = 32 % BITS == 0
    KW: tl.constexpr = BLOCK_K // PER if WHOLE else BLOCK_K  # word rows (or code rows) per step
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, KPAD)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if ONE_GROUP:
            g = k0 // GROUP
            g_ok = n_ok & (offs_n * 0 + k0 < K)
            s_row = tl.load(s_ptr + g * N + offs_n, mask=g_ok, other=0.0).to(tl.float32)
            z_row = tl.load(z_ptr + g * N + offs_n, mask=g_ok, other=0).to(tl.float32)
        if WHOLE:
            rows = k0 // PER + tl.arange(0, KW)
            words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :],
                            mask=(rows < KPAD // PER)[:, None] & n_ok[None, :], other=0)
            words = words.to(tl.uint32, bitcast=True)
        for s in tl.static_range(PER if WHOLE else 1):
            if WHOLE:
                k = k0 + tl.arange(0, KW) * PER + s  # code rows of field s
                q = (words >> (s * BITS)) & MASK
            else:  # 3 bits: code k at stream bit 3k, in word 3k // 32 and maybe the next one
                k = k0 + tl.arange(0, KW)
                bit = k * BITS
                lo_ptr = w_ptr + (bit // 32)[:, None] * N + offs_n[None, :]
                k_ok = (k < KPAD)[:, None] & n_ok[None, :]
                lo = tl.load(lo_ptr, mask=k_ok, other=0).to(tl.uint32, bitcast=True)
                spill = (bit % 32 + BITS > 32)[:, None] & k_ok
                hi = tl.load(lo_ptr + N, mask=spill, other=0).to(tl.uint32, bitcast=True)
                both = lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)
                q = ((both >> (bit % 32).to(tl.uint64)[:, None]) & MASK).to(tl.uint32)
            if ONE_GROUP:
                w = (q.to(tl.float32) - z_row[None, :]) * s_row[None, :]
            else:
                gk = (k // GROUP)[:, None] * N + offs_n[None, :]
                s_t = tl.load(s_ptr + gk, mask=n_ok[None, :] & (k < K)[:, None], other=0.0).to(tl.float32)
                z_t = tl.load(z_ptr + gk, mask=n_ok[None, :] & (k < K)[:, None], other=0).to(tl.float32)
                w = (q.to(tl.float32) - z_t) * s_t
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :],
                        other=0.0)
            if USE_DOT:
                if FP32_DOT:
                    acc = tl.dot(x, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w.to(x.dtype), acc)
            else:
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    out = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=ok)
    else:
        tl.store(out, acc, mask=ok)
