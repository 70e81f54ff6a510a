"""Reference bit packing: the LSB-first int32 bitstream and the GPTQ / auto-round tensor layout.

Pure torch, CPU-friendly and bit-exact; every faster backend is tested against these functions.

Bitstream (`pack` / `unpack`)
-----------------------------
Values are laid one after another into a stream of bits, least significant bit first, along the
last axis; the stream is cut into int32 words (stored two's complement, bit 31 is the sign bit).
Value `j` occupies stream bits `[j*b, (j+1)*b)`, i.e. word `(j*b) // 32` from bit `(j*b) % 32`::

    b = 4 (also 2 and 8: 32/b values per word, none straddles a word)
        word 0: bit 31 ........................................ bit 0
                | v7 | v6 | v5 | v4 | v3 | v2 | v1 | v0 |
        word 1: | v15| v14| v13| v12| v11| v10| v9 | v8 |

    b = 3 (32 values fill exactly 3 words; v10 and v21 straddle a word boundary)
        word 0: | v10[1:0] | v9 | v8 | ... | v1 | v0 |           v0 at bits 0-2, v10 low 2 bits at 30-31
        word 1: | v21[0] | v20 | ... | v12 | v11 | v10[2] |       v10 high bit at bit 0, v11 at bits 1-3
        word 2: | v31 | v30 | ... | v23 | v22 | v21[2:1] |       v21 high 2 bits at bits 0-1, v22 at 2-4

This is AutoGPTQ's / auto-round's layout for 2, 3, 4 and 8 bits (auto-round's hand-written 3-bit
routine `qlinear_torch.pack_3bits` and its generic `auto_round.utils.bit_packing.pack_bitstream`
produce the same words; `tests/kernels/test_packing.py` checks both). `n * b` must be a multiple of 32.

GPTQ layout (`gptq_pack` / `gptq_unpack`), for `nn.Linear(in=K, out=N)`
------------------------------------------------------------------------
    qweight int32 (K*b/32, N)          codes packed along K: column n is the bitstream of codes[n, :]
    qzeros  int32 (n_groups, N*b/32)   zero points packed along N: row g is the bitstream of zeros[:, g]
                                        v1 (AutoGPTQ, auto-round `auto_round:auto_gptq`): stores
                                        (zero - 1) & (2^b - 1); v2 (`auto_round`, GPTQModel): real zero
    scales  fp16  (n_groups, N)         may be negative (auto-round full-range sym)
    g_idx   int32 (K,)                  k // group (no act-order permutation)

    W[n, k] = scales[g_idx[k], n] * (code(k, n) - zero(g_idx[k], n))

v1 cannot represent a zero point of 0: it is stored as 2^b - 1 and GPTQ kernels read back 2^b
(`gptq_unpack` here wraps it back to 0, so the round trip is exact, but a kernel would be off by one
level). Symmetric weights always have zero 2^(b-1), so v1 is only used for them by the exporter.
"""

from __future__ import annotations

import math

import torch

from compress.qweight import QuantizedWeight

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)
_U32 = 0xFFFFFFFF


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def _block(bits: int) -> tuple[int, int]:
    """(values, words) of the smallest whole-word block: 32/gcd(b,32) values fill b/gcd(b,32) words."""
    g = math.gcd(bits, 32)
    return 32 // g, bits // g


def _positions(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Word index and bit offset of each value inside one block."""
    pos = torch.arange(_block(bits)[0], dtype=torch.int64) * bits
    return pos // 32, pos % 32


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integers `(..., n)` in `[0, 2^bits)` into int32 words `(..., n*bits/32)`, LSB first."""
    _check_bits(bits)
    n = values.shape[-1]
    if (n * bits) % 32:
        raise ValueError(f"cannot pack {n} values of {bits} bits into whole int32 words: n*bits must be a multiple "
                         f"of 32 (n a multiple of {_block(bits)[0]}); pad the axis or keep it unpacked")
    if values.is_floating_point() or values.is_complex():
        raise ValueError(f"pack expects an integer tensor, got {values.dtype}")
    per, words = _block(bits)
    v = values.to(torch.int64).reshape(*values.shape[:-1], n // per, per)
    if v.numel() and (v.min() < 0 or v.max() >= 2**bits):
        raise ValueError(f"values must lie in [0, {2**bits - 1}] for {bits} bits")
    word, off = (t.to(v.device) for t in _positions(bits))
    out = torch.zeros(*v.shape[:-1], words, dtype=torch.int64, device=v.device)
    out.index_add_(-1, word, (v << off) & _U32)  # bit ranges are disjoint, so add == or
    spill = off + bits > 32
    if spill.any():
        out.index_add_(-1, word[spill] + 1, v[..., spill] >> (32 - off[spill]))
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.reshape(*values.shape[:-1], n * bits // 32)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack`: int32 words `(..., n*bits/32)` -> uint8 values `(..., n)`."""
    _check_bits(bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack expects int32 words, got {packed.dtype}")
    if n * bits != packed.shape[-1] * 32:
        raise ValueError(f"{packed.shape[-1]} int32 words do not hold exactly {n} values of {bits} bits")
    per, words = _block(bits)
    w = packed.to(torch.int64).reshape(*packed.shape[:-1], n // per, words) & _U32
    word, off = (t.to(w.device) for t in _positions(bits))
    v = w[..., word] >> off
    spill = off + bits > 32
    if spill.any():
        v[..., spill] |= w[..., word[spill] + 1] << (32 - off[spill])
    return (v & (2**bits - 1)).to(torch.uint8).reshape(*packed.shape[:-1], n)


def packable(qw: QuantizedWeight) -> bool:
    """Whether the GPTQ layout can hold `qw`: K*b (qweight) and N*b (qzeros) are multiples of 32."""
    return (qw.in_features * qw.bits) % 32 == 0 and (qw.out_features * qw.bits) % 32 == 0


def gptq_pack(qw: QuantizedWeight, v1: bool) -> dict[str, torch.Tensor]:
    """QuantizedWeight -> {"qweight", "qzeros", "scales", "g_idx"} in the GPTQ layout (module docstring)."""
    if not packable(qw):
        raise ValueError(f"a {qw.out_features}x{qw.in_features} weight at {qw.bits} bits does not fit the GPTQ "
                         "layout: in_features*bits and out_features*bits must be multiples of 32")
    scales = qw.scales.to(torch.float32)
    if not torch.equal(scales.half().float(), scales):
        raise ValueError("scales are not fp16-representable; round them with .half() when quantizing")
    mask = 2**qw.bits - 1
    zeros = qw.zeros.to(torch.int64).T
    if v1:
        zeros = (zeros - 1) & mask
    return {
        "qweight": pack(qw.codes, qw.bits).T.contiguous(),
        "qzeros": pack(zeros, qw.bits).contiguous(),
        "scales": scales.T.half().contiguous(),
        "g_idx": qw.group_index().to(device=qw.codes.device, dtype=torch.int32),
    }


def gptq_unpack(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool, v1: bool) -> QuantizedWeight:
    """Exact inverse of `gptq_pack`. `g_idx` is optional; an act-order (permuted) one is refused."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    K, N = qweight.shape[0] * 32 // bits, qweight.shape[1]
    codes = unpack(qweight.T.contiguous(), bits, K)
    zeros = unpack(qzeros, bits, N).T
    if v1:
        zeros = ((zeros.to(torch.int64) + 1) & (2**bits - 1)).to(torch.uint8)
    qw = QuantizedWeight(codes=codes, scales=scales.to(torch.float32).T.contiguous(), zeros=zeros.contiguous(),
                         bits=bits, group_size=group_size, sym=sym)
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.cpu().to(torch.int64), qw.group_index()):
        raise ValueError("g_idx is not k // group_size (act-order checkpoint); QuantizedWeight cannot hold it")
    return qw


AWQ_BITS = (4, 8)


def awq_order(bits: int) -> torch.Tensor:
    """AWQ's value order inside one int32 word: the even output columns of the word's 32/b, then the odd ones
    ([0, 2, 4, 6, 1, 3, 5, 7] for 4 bits; [0, 2, 1, 3] for 8), slot i holding column order[i]."""
    per = 32 // bits
    return torch.cat([torch.arange(0, per, 2), torch.arange(1, per, 2)])


def _awq_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, N) values -> (R, N*b/32) int32 words packed along N in AWQ's order."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)[..., awq_order(bits).to(values.device)]
    return pack(v.reshape(values.shape[0], -1), bits)


def _awq_values(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 32 // bits
    v = unpack(words, bits, n).reshape(words.shape[0], -1, per)
    return v[..., torch.argsort(awq_order(bits)).to(words.device)].reshape(words.shape[0], n)


def awq_pack(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """QuantizedWeight -> {"qweight", "qzeros", "scales"} in AutoAWQ's GEMM layout (auto-round `auto_round:auto_awq`):
    qweight int32 (K, N*b/32) codes packed along N, qzeros int32 (n_groups, N*b/32) real zero points packed the same
    way, scales fp16 (n_groups, N); inside each word the values follow `awq_order`. 4 and 8 bits only."""
    if qw.bits not in AWQ_BITS:
        raise ValueError(f"the AWQ layout holds {AWQ_BITS} bits, not {qw.bits}")
    if qw.out_features % (32 // qw.bits):
        raise ValueError(f"out_features {qw.out_features} is not a multiple of {32 // qw.bits}: no AWQ layout")
    scales = qw.scales.to(torch.float32)
    if not torch.equal(scales.half().float(), scales):
        raise ValueError("scales are not fp16-representable; round them with .half() when quantizing")
    return {"qweight": _awq_words(qw.codes.T, qw.bits).contiguous(),
            "qzeros": _awq_words(qw.zeros.T, qw.bits).contiguous(),
            "scales": scales.T.half().contiguous()}


def awq_unpack(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool) -> QuantizedWeight:
    """Exact inverse of `awq_pack`."""
    if bits not in AWQ_BITS:
        raise ValueError(f"the AWQ layout holds {AWQ_BITS} bits, not {bits}")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    n = qweight.shape[1] * 32 // bits
    return QuantizedWeight(codes=_awq_values(qweight, bits, n).T.contiguous(),
                           scales=scales.to(torch.float32).T.contiguous(),
                           zeros=_awq_values(qzeros, bits, n).T.contiguous(), bits=bits, group_size=group_size,
                           sym=sym)


# -- mixed precision: columns grouped by bit width ------------------------------------------------------
"""Mixed layout (`mixed_pack` / `mixed_unpack`), for a mixed-precision QuantizedWeight (per-chunk bits)
---------------------------------------------------------------------------------------------------------
    perm      int32 (K,)          input columns in storage order: the 2-bit chunks, then 3-bit, ..., then the
                                  fp16 chunks; within one width, column order is kept (so the last, possibly
                                  short, chunk stays last and every group stays whole)
    w{b}.codes  int32 (N, Kb'*b/32)  bitstream (`pack`) of each row's codes of the Kb columns of width b,
                                  zero padded to Kb' = a multiple of 32 columns
    w{b}.zeros  int32 (N, Gb'*b/32)  bitstream of each row's zero points of those columns' Gb groups (padded)
    w{b}.scales fp16  (N, Gb)
    kept      fp16  (N, Kk)       the fp16 chunks' values
    y = sum_b x[:, cols_b] @ W_b.T + x[:, cols_kept] @ kept.T   (`split_mixed`: one matmul per width slice)
"""


def split_mixed(qw: QuantizedWeight) -> list[tuple[int, torch.Tensor, object]]:
    """[(bits, input columns (int64), part)] by increasing width: part is the uniform QuantizedWeight of
    those columns, or for bits 16 the fp16 values (N, n) of the kept columns."""
    from compress.qweight import KEEP_BITS

    col_bits, g = qw.column_bits(), qw.group
    out = []
    for b in sorted(set(qw.chunk_bits)):
        cols = torch.nonzero(col_bits == b).view(-1)
        if b == KEEP_BITS:
            out.append((b, cols, qw.kept))
            continue
        groups = torch.unique(cols // g)
        out.append((b, cols, QuantizedWeight(codes=qw.codes[:, cols], scales=qw.scales[:, groups],
                                             zeros=qw.zeros[:, groups], bits=b, group_size=qw.group_size,
                                             sym=qw.sym)))
    return out


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    n = values.shape[1]
    pad = (-n) % 32
    return pack(torch.nn.functional.pad(values.to(torch.int64), (0, pad)), bits)


def mixed_pack(qw: QuantizedWeight) -> tuple[dict[str, torch.Tensor], dict]:
    """Mixed QuantizedWeight -> (tensors, meta) in the mixed layout above; exact inverse: `mixed_unpack`."""
    if not qw.mixed:
        raise ValueError("mixed_pack needs a mixed-precision QuantizedWeight (chunk_size > 0)")
    tensors, perm = {}, []
    for b, cols, part in split_mixed(qw):
        perm.append(cols)
        if b == 16:
            tensors["kept"] = part.half().contiguous()
            continue
        tensors[f"w{b}.codes"] = _pack_rows(part.codes, b)
        tensors[f"w{b}.zeros"] = _pack_rows(part.zeros, b)
        tensors[f"w{b}.scales"] = part.scales.half().contiguous()
    tensors["perm"] = torch.cat(perm).to(torch.int32)
    meta = {"shape": list(qw.codes.shape), "group_size": qw.group_size, "sym": qw.sym,
            "chunk_size": qw.chunk_size, "chunk_bits": list(qw.chunk_bits), "map_bits": qw.map_bits}
    return tensors, meta


def mixed_unpack(tensors: dict[str, torch.Tensor], meta: dict) -> QuantizedWeight:
    """Exact inverse of `mixed_pack`."""
    from compress.primitives import assemble_mixed

    N, K = meta["shape"]
    c, g, chunk_bits = meta["chunk_size"], meta["group_size"], meta["chunk_bits"]
    parts, pos = [], {}
    for j, b in enumerate(chunk_bits):
        w = min(c, K - j * c)
        if b == 16:
            parts.append(None)
            continue
        a = pos.get(b, 0)
        n_cols = sum(min(c, K - i * c) for i, bb in enumerate(chunk_bits) if bb == b)
        codes = unpack(tensors[f"w{b}.codes"], b, tensors[f"w{b}.codes"].shape[1] * 32 // b)[:, a:a + w]
        n_groups = tensors[f"w{b}.scales"].shape[1]
        zeros = unpack(tensors[f"w{b}.zeros"], b, tensors[f"w{b}.zeros"].shape[1] * 32 // b)[:, :n_groups]
        ga, gb = a // g, math.ceil((a + w) / g)
        assert n_cols >= a + w
        parts.append(QuantizedWeight(codes=codes, scales=tensors[f"w{b}.scales"][:, ga:gb].float(),
                                     zeros=zeros[:, ga:gb], bits=b, group_size=g, sym=meta["sym"]))
        pos[b] = a + w
    W = torch.zeros(N, K)
    if "kept" in tensors:
        kept_cols = torch.tensor([k for j, b in enumerate(chunk_bits) if b == 16
                                  for k in range(j * c, min((j + 1) * c, K))], dtype=torch.int64)
        W[:, kept_cols] = tensors["kept"].float()
    return assemble_mixed(W, parts, c, g, meta["sym"], meta["map_bits"])
