"""llama.cpp's GGUF quantization blocks, exactly: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

The ground truth for every GGUF writer and every quantizer that optimises llama.cpp's grid. Pure numpy, vectorised
over rows and blocks; ported from ggml/src/ggml-quants.c and ggml-common.h (llama.cpp as vendored by
llama-cpp-python 0.3.36). A weight `W` is `(rows, n)` with `n` a multiple of the block size (32, or QK_K = 256 for
the K types), every row quantized on its own (ggml's `n_per_row`); GGUF stores `nn.Linear(in=K, out=N)` as N rows
of K, so the columns are the input features and the importance matrix (`imatrix`) has one weight per column.

Representation (`GGMLParams`, `GGMLBlocks`)
-------------------------------------------
Integer codes per weight, exactly the integers ggml's `dequantize_row_*` multiply, and the block parameters::

    type  block sub  codes q        per block (fp16)  per sub-block (integers)    x (fp32, ggml's order)
    Q8_0    32   32  -128..127      d                 -                           q*d
    Q4_0    32   32  0..15          d                 -                           (q-8)*d
    Q4_1    32   32  0..15          d, m              -                           q*d + m
    Q5_0    32   32  0..31          d                 -                           (q-16)*d
    Q5_1    32   32  0..31          d, m              -                           q*d + m
    Q2_K   256   16  0..3           d, dmin           scales 0..15, mins 0..15    (d*sc)*q - dmin*mn
    Q3_K   256   16  -4..3          d                 scales -32..31 (int8)       (d*sc)*q
    Q4_K   256   32  0..15          d, dmin           scales 0..63, mins 0..63    (d*sc)*q - dmin*mn
    Q5_K   256   32  0..31          d, dmin           scales 0..63, mins 0..63    (d*sc)*q - dmin*mn
    Q6_K   256   16  -32..31        d                 scales -128..127 (int8)     (d*sc)*q

`codes` is int8 `(rows, n)`; `d`, `m`, `dmin` are float16 `(rows, n/block)`; `scales`, `mins` are `(rows,
n/block, block/sub)` (uint8, or int8 for Q3_K and Q6_K). Q3_K's scale is the stored 6-bit value minus 32, its
code the 2 low bits minus 4 where the high bit (hmask) is clear. Every bit of a block is one field's, so
`unpack` then `pack` gives back any byte string, and `pack` then `unpack` any in-range representation.

Byte layout of one block (little endian; `L` = the code made unsigned: Q3_K q+4, Q6_K q+32, else q)::

    Q8_0  34 B  d:f16 | qs[32]:int8 = q
    Q4_0  18 B  d:f16 | qs[16]: qs[j] = L[j] | L[j+16] << 4
    Q4_1  20 B  d:f16 | m:f16 | qs[16] as Q4_0
    Q5_0  22 B  d:f16 | qh:u32, bit j = L[j] >> 4 | qs[16] = (L[j] & 15) | (L[j+16] & 15) << 4
    Q5_1  24 B  d:f16 | m:f16 | qh | qs as Q5_0
    Q2_K  84 B  scales[16] = sc | mn << 4 | qs[64] | d:f16 | dmin:f16
                qs: per half h of 128 weights, qs[32h+l] = L[128h+l] | L[128h+32+l] << 2 | ..+64.. << 4 | ..+96.. << 6
    Q3_K 110 B  hmask[32]: bit k of hmask[l] = L[32k+l] >> 2 | qs[64] of L & 3, as Q2_K | scales[12] | d:f16
                scales (s = sc+32, 6 bits): byte j<8 = (s[j] & 15) | (s[j+8] & 15) << 4,
                byte 8+i = (s[i] >> 4) | (s[i+4] >> 4) << 2 | (s[i+8] >> 4) << 4 | (s[i+12] >> 4) << 6
    Q4_K 144 B  d:f16 | dmin:f16 | scales[12] (below) | qs[128]: qs[32c+l] = L[64c+l] | L[64c+32+l] << 4
    Q5_K 176 B  d:f16 | dmin:f16 | scales[12] | qh[32]: bit k of qh[l] = L[32k+l] >> 4 | qs[128] of L & 15, as Q4_K
    Q6_K 210 B  ql[128] | qh[64] | scales[16]:int8 | d:f16; per half h of 128 weights and l < 32:
                ql[64h+l] = (L[128h+l] & 15) | (L[128h+64+l] & 15) << 4, ql[64h+32+l] = the same for +32, +96,
                qh[32h+l] = L[128h+l] >> 4 | L[128h+32+l] >> 4 << 2 | L[128h+64+l] >> 4 << 4 | L[128h+96+l] >> 4 << 6

    Q4_K/Q5_K scales[12] (get_scale_min_k4), 8 six-bit scales sc and mins mn:
        byte j   (j<4) = sc[j] | (sc[j+4] >> 4) << 6        byte j+4 (j<4) = mn[j] | (mn[j+4] >> 4) << 6
        byte j+8 (j<4) = (sc[j+4] & 15) | (mn[j+4] & 15) << 4

Quantizers
----------
`quantize_ref(type, W, imatrix=None)` is llama.cpp's `quantize_<type>` (what `llama-quantize` and
`ggml_quantize_chunk` call): `quantize_row_<type>_ref` without an importance matrix, `quantize_row_<type>_impl`
with one (Q8_0 has none). Each private function below names the C function it mirrors and keeps its structure:
the same float32 operations in the same order (sums are sequential, as C's loops; no fused multiply-add, as
ggml-base is built for baseline x86-64, which has none), `nearest_int`'s bit trick, `(int8_t)(x + 8.5f)`
truncation, uint8/int8 wrap-around where C stores an int into a byte, ggml's own fp32 -> fp16 routine.

`fit(type, W, imatrix)` returns the parameters of `quantize_ref` (sub-block scales quantized as stored);
`round_codes(type, W, params)` the codes for fixed parameters, with ggml's rounding rule for the type:

    Q8_0                roundf(x * id), id = 1/d                               (quantize_row_q8_0_ref)
    Q4_0 / Q5_0         (int)(x * id + 8.5 | 16.5), clamped to the code range  (quantize_row_q4_0_ref, q5_0)
    Q4_1 / Q5_1         (int)((x - m) * id + 0.5), clamped                     (quantize_row_q4_1_ref, q5_1)
    K types             nearest_int((x + offset) / scale), clamped; 0 where scale == 0 (the requantization
                        loop every quantize_row_*_K ends with: scale = d*sc, offset = dmin*mn or 0)

How quantize_ref's codes relate to `round_codes(type, W, fit(type, W, imatrix))`:

* K types: identical wherever a sub-block's scale d*sc is non-zero (llama.cpp requantizes those with the stored
  parameters); where it is zero llama.cpp leaves the codes of its scale search, which dequantize to the same
  values (the code is multiplied by 0).
* Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the codes come out of the search itself, rounded with the fp32 scale before it is
  stored as fp16 (`_ref`), or chosen by make_qx_quants / make_qkx3_quants with their own trial scale (`_impl`).
  `round_codes` uses the stored fp16 parameters, the grid a GGUF file actually holds; the two differ on a few
  weights that sit near a rounding boundary.

`scale_offset(type, params)` gives per weight the fp32 `scale`, `offset` with x = scale*q - offset equal to
`dequantize` for finite d, only the sign of a zero may differ (q*d - 8*d is exact: d has 11 significant bits), for a
loss over the grid.

Fitting a column slice gives the same parameters as fitting the whole row for the K types (their statistics are
per super-block) and for the legacy types without imatrix; the legacy `_impl` paths (Q4_0/Q4_1/Q5_0/Q5_1 with an
imatrix) weight by the whole row's mean square (`sigma2`), so pass whole rows to `fit` there.

Inputs must be finite (ValueError otherwise). `dequantize` is ggml's `dequantize_row_*`, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
_F = np.float32
_MAGIC = _F(12582912.0)  # 1.5 * 2^23: nearest_int's shift


# ----------------------------------------------------------------------------------------------- types and shapes

class _Spec(NamedTuple):
    block: int          # weights per block (QK4_0 = 32, QK_K = 256)
    sub: int            # weights per sub-block sharing one integer scale (= block for the legacy types)
    lo: int             # code range
    hi: int
    m: bool             # fp16 `m` per block (Q4_1, Q5_1)
    dmin: bool          # fp16 `dmin` per block and integer `mins` per sub-block (Q2_K, Q4_K, Q5_K)
    scales: type | None  # dtype of the integer sub-block scales (K types)


_T = GGMLQuantizationType
_SPECS: dict[GGMLQuantizationType, _Spec] = {
    _T.Q8_0: _Spec(32, 32, -128, 127, False, False, None),
    _T.Q4_0: _Spec(32, 32, 0, 15, False, False, None),
    _T.Q4_1: _Spec(32, 32, 0, 15, True, False, None),
    _T.Q5_0: _Spec(32, 32, 0, 31, False, False, None),
    _T.Q5_1: _Spec(32, 32, 0, 31, True, False, None),
    _T.Q2_K: _Spec(256, 16, 0, 3, False, True, np.uint8),
    _T.Q3_K: _Spec(256, 16, -4, 3, False, False, np.int8),
    _T.Q4_K: _Spec(256, 32, 0, 15, False, True, np.uint8),
    _T.Q5_K: _Spec(256, 32, 0, 31, False, True, np.uint8),
    _T.Q6_K: _Spec(256, 16, -32, 31, False, False, np.int8),
}
TYPES = tuple(_SPECS)
# the range of the integer sub-block scales and mins as stored
_SCALE_RANGE = {_T.Q2_K: (0, 15), _T.Q3_K: (-32, 31), _T.Q4_K: (0, 63), _T.Q5_K: (0, 63), _T.Q6_K: (-128, 127)}


def ggml_type(t: GGMLQuantizationType | str | int) -> GGMLQuantizationType:
    """The GGMLQuantizationType for a type, its name ("Q4_K", case-insensitive) or its number; ValueError if this
    module does not handle it."""
    try:
        gt = GGMLQuantizationType[t.upper()] if isinstance(t, str) else GGMLQuantizationType(t)
    except (KeyError, ValueError):
        gt = None
    if gt not in _SPECS:
        raise ValueError(f"unsupported GGML quantization type {t!r}; supported: {', '.join(x.name for x in TYPES)}")
    return gt


def block_size(t) -> int:
    """Weights per block: 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or 256 (K types)."""
    return GGML_QUANT_SIZES[ggml_type(t)][0]


def sub_block(t) -> int:
    """Weights sharing one scale: the block (legacy types) or the sub-block (K types: 16 or 32)."""
    return _SPECS[ggml_type(t)].sub


def code_range(t) -> tuple[int, int]:
    """(lo, hi): the codes of the module's convention (Q8_0 -128..127, Q3_K -4..3, Q6_K -32..31, else 0..2^b-1)."""
    spec = _SPECS[ggml_type(t)]
    return spec.lo, spec.hi


def bytes_per_row(t, n: int) -> int:
    """Bytes of one quantized row of `n` weights (n a multiple of the block size)."""
    bs, ts = GGML_QUANT_SIZES[ggml_type(t)]
    _check_columns(t, n)
    return n // bs * ts


def bits_per_weight(t) -> float:
    """Storage bits per weight, parameters included (Q4_K: 4.5, Q6_K: 6.5625, Q8_0: 8.5)."""
    bs, ts = GGML_QUANT_SIZES[ggml_type(t)]
    return ts * 8 / bs


_FALLBACK = {_T.Q2_K: _T.Q4_0, _T.Q3_K: _T.Q4_0, _T.Q4_K: _T.Q5_0, _T.Q5_K: _T.Q5_1, _T.Q6_K: _T.Q8_0}


def fallback_type(t, n: int) -> GGMLQuantizationType | None:
    """The type llama-quantize stores a tensor of `n` columns in when `t` asks for it (tensor_type_fallback in
    llama-quant.cpp): `t` itself if n is a multiple of its block, else Q4_0 for Q2_K / Q3_K, Q5_0 for Q4_K, Q5_1
    for Q5_K, Q8_0 for Q6_K; None where that does not fit either (llama.cpp then writes F16)."""
    t = ggml_type(t)
    for c in (t, _FALLBACK.get(t)):
        if c is not None and n > 0 and n % GGML_QUANT_SIZES[c][0] == 0:
            return c
    return None


def _check_columns(t, n: int) -> None:
    bs = GGML_QUANT_SIZES[ggml_type(t)][0]
    if n <= 0 or n % bs:
        raise ValueError(f"{ggml_type(t).name} quantizes rows in blocks of {bs} weights, but a row has {n}: the "
                         f"number of columns must be a positive multiple of {bs} (`fallback_type` gives the type "
                         "llama.cpp stores such a tensor in)")


# ----------------------------------------------------------------------------------------------- representation

@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class GGMLParams:
    """Block parameters of a `(rows, n)` weight, as ggml stores them (module docstring, table)."""

    type: GGMLQuantizationType
    d: np.ndarray                       # float16 (rows, n/block)
    m: np.ndarray | None = None         # float16 (rows, n/block): Q4_1 / Q5_1, x = q*d + m
    dmin: np.ndarray | None = None      # float16 (rows, n/block): Q2_K / Q4_K / Q5_K
    scales: np.ndarray | None = None    # (rows, n/block, block/sub) integers: K types
    mins: np.ndarray | None = None      # (rows, n/block, block/sub) integers: Q2_K / Q4_K / Q5_K

    def __post_init__(self):
        object.__setattr__(self, "type", ggml_type(self.type))
        spec = _SPECS[self.type]
        if not isinstance(self.d, np.ndarray) or self.d.dtype != np.float16 or self.d.ndim != 2:
            raise ValueError(f"{self.type.name}: d must be a float16 array (rows, n_blocks)")
        wanted = {"m": spec.m, "dmin": spec.dmin, "scales": spec.scales is not None, "mins": spec.dmin}
        for name, needed in wanted.items():
            value = getattr(self, name)
            if needed != (value is not None):
                raise ValueError(f"{self.type.name}: `{name}` must be {'given' if needed else 'None'}")
        for name in ("m", "dmin"):
            value = getattr(self, name)
            if value is not None and (value.dtype != np.float16 or value.shape != self.d.shape):
                raise ValueError(f"{self.type.name}: {name} must be float16 of shape {self.d.shape}")
        sub_shape = (*self.d.shape, spec.block // spec.sub)
        for name in ("scales", "mins"):
            value = getattr(self, name)
            if value is not None and (value.dtype != spec.scales or value.shape != sub_shape):
                raise ValueError(f"{self.type.name}: {name} must be {np.dtype(spec.scales).name} of shape {sub_shape}")

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, n) of the weight these parameters quantize."""
        return self.d.shape[0], self.d.shape[1] * _SPECS[self.type].block

    def params(self) -> GGMLParams:
        """The parameters alone (drops `codes` from a GGMLBlocks)."""
        return GGMLParams(type=self.type, d=self.d, m=self.m, dmin=self.dmin, scales=self.scales, mins=self.mins)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class GGMLBlocks(GGMLParams):
    """A quantized `(rows, n)` weight: the parameters and the int8 codes `(rows, n)` (module docstring, table)."""

    codes: np.ndarray

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.codes, np.ndarray) or self.codes.dtype != np.int8 or self.codes.shape != self.shape:
            raise ValueError(f"{self.type.name}: codes must be int8 of shape {self.shape}")


def _check_type(t, obj: GGMLParams) -> GGMLQuantizationType:
    gt = ggml_type(t)
    if obj.type != gt:
        raise ValueError(f"the blocks hold {obj.type.name}, not {gt.name}")
    return gt


def _check_range(name: str, a: np.ndarray, lo: int, hi: int, t: GGMLQuantizationType) -> None:
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise ValueError(f"{t.name} {name} must lie in [{lo}, {hi}], got [{int(a.min())}, {int(a.max())}]")


# ----------------------------------------------------------------------------------------------- fp16, rounding

def fp32_to_fp16(f) -> np.ndarray:
    """GGML_FP32_TO_FP16 (ggml_compute_fp32_to_fp16, ggml-impl.h) on an array: float16, round to nearest even.
    Equal to numpy's conversion on every non-NaN input; NaN becomes ggml's quiet NaN 0x7E00 (with its sign)."""
    f = np.asarray(f, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        base = (np.abs(f) * _F(2.0 ** 112)) * _F(2.0 ** -110)
    w = f.view(np.uint32)
    shl1_w = w + w
    sign = w & np.uint32(0x80000000)
    bias = np.maximum(shl1_w & np.uint32(0xFF000000), np.uint32(0x71000000))
    base = ((bias >> np.uint32(1)) + np.uint32(0x07800000)).view(np.float32) + base
    bits = base.view(np.uint32)
    nonsign = ((bits >> np.uint32(13)) & np.uint32(0x7C00)) + (bits & np.uint32(0x0FFF))
    out = (sign >> np.uint32(16)) | np.where(shl1_w > np.uint32(0xFF000000), np.uint32(0x7E00), nonsign)
    return out.astype(np.uint16).view(np.float16)


def _fp16_round(f) -> np.ndarray:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(f)): the fp32 value of what ggml stores."""
    return fp32_to_fp16(f).astype(np.float32)


def _nearest_int(f: np.ndarray) -> np.ndarray:
    """nearest_int(): round half to even through the float32 sum with 1.5*2^23, int32. Bit-exact also where C's
    assert (|f| <= 4194303) would fail (release builds return the same garbage)."""
    f = np.asarray(f, dtype=np.float32)
    return ((f + _MAGIC).view(np.int32) & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def _rint(f: np.ndarray) -> np.ndarray:
    """nearest_int() as float32, for arguments bounded by a few times nmax (there it equals round half to even)."""
    return np.rint(f)


def _u8(i: np.ndarray) -> np.ndarray:
    """C's conversion of an int to uint8_t (modulo 256), as int32."""
    return np.asarray(i).astype(np.int32) & 0xFF


def _i8(i: np.ndarray) -> np.ndarray:
    """C's conversion of an int to int8_t (modulo 256, two's complement), as int32."""
    return ((np.asarray(i).astype(np.int32) + 128) & 0xFF) - 128


def _roundf(f: np.ndarray) -> np.ndarray:
    """C roundf: half away from zero (float32 in, float32 out)."""
    t = np.trunc(f)
    return t + np.where(np.abs(f - t) >= _F(0.5), np.sign(f), _F(0))


# ----------------------------------------------------------------------------------------------- C-order sums

def _sum(a: np.ndarray) -> np.ndarray:
    """`float s = 0; for (i...) s += a[i];` over axis 0, float32, in order."""
    s = np.zeros(a.shape[1:], np.float32)
    for row in a:
        s += row
    return s


def _sum_first(a: np.ndarray) -> np.ndarray:
    """`float s = a[0]; for (i = 1...) s += a[i];` over axis 0 (make_qkx2_quants' sum_w, sum_x)."""
    s = a[0].copy()
    for row in a[1:]:
        s += row
    return s


def _row_sum(a: np.ndarray) -> np.ndarray:
    """`float s = 0; for (j < n_per_row) s += a[j];` along the last axis (accumulate is sequential; + 0 turns the
    -0 that a[0] = -0 could leave into C's +0)."""
    return np.add.accumulate(a, axis=-1, dtype=np.float32)[..., -1] + _F(0)


def _first(x: np.ndarray, key: np.ndarray, target: np.ndarray) -> np.ndarray:
    """x[i] at the first i (axis 0) where key[i] == target: what C's scan `if (key < best)` keeps, its sign of zero
    included (np.argmin itself may prefer a later -0 to a +0)."""
    return np.take_along_axis(x, np.argmax(key == target[None], axis=0)[None], axis=0)[0]


def _first_min(x: np.ndarray) -> np.ndarray:
    """`float min = x[0]; if (x[i] < min) min = x[i];` over axis 0."""
    return _first(x, x, x.min(axis=0))


def _first_max(x: np.ndarray) -> np.ndarray:
    """`if (x[i] > max) max = x[i];` over axis 0."""
    return _first(x, x, x.max(axis=0))


def _pos_max(a: np.ndarray, axis: int) -> np.ndarray:
    """`float max = 0; if (a[j] > max) max = a[j];`: +0 unless some a[j] > 0."""
    m = a.max(axis=axis)
    return np.where(m > 0, m, _F(0))


def _abs_max(x: np.ndarray) -> np.ndarray:
    """`if (ax > amax) { amax = ax; max = x[i]; }` from amax = 0 over axis 0: the first x of largest |x|, signed."""
    ax = np.abs(x)
    r = _first(x, ax, ax.max(axis=0))
    return np.where(r == 0, _F(0), r)      # all zero: max stays C's initial +0


# ----------------------------------------------------------------------------------------------- ggml's searches
# Arrays are element-major: x (n, N) holds N groups (sub-blocks) of n weights; every loop over `i < n` in C becomes
# a loop over axis 0 (sums) or a whole-array operation. Results: per group (N,), codes L (n, N) float32.

def make_qx_quants(x: np.ndarray, nmax: int, qw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw): symmetric scale search over 19 trial scales.
    Returns (scale, L) with L = nmax + clamp(l, -nmax, nmax-1) in [0, 2*nmax-1]; weights qw, or x*x."""
    mx = _abs_max(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    w = x * x if qw is None else qw
    wx = w * x
    lo, hi = _F(-nmax), _F(nmax - 1)
    iscale = _F(-nmax) / mx
    l = np.clip(_rint(iscale * x), lo, hi)
    L = l + _F(nmax)
    sumlx, suml2 = _sum(wx * l), _sum((w * l) * l)
    scale = np.where(suml2 != 0, sumlx / suml2, _F(0))
    best = scale * sumlx
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = -(_F(nmax) + _F(0.1) * _F(is_)) / mx
        l = np.clip(_rint(iscale * x), lo, hi)
        sumlx, suml2 = _sum(wx * l), _sum((w * l) * l)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better, l + _F(nmax), L)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, _F(0), scale), np.where(zero, _F(0), L)


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants(n, nmax, x, L, do_rmse=true): scale from x*x-weighted least squares, then up to 5 passes of
    coordinate descent on the codes. Returns (scale, L), L in [0, 2*nmax-1] (0 for an all-zero group)."""
    mx = _abs_max(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    lo, hi = -nmax, nmax - 1
    L = np.clip(_rint((_F(-nmax) / mx) * x), _F(lo), _F(hi))
    w = x * x
    wx = w * x
    sumlx, suml2 = _sum(wx * L), _sum((w * L) * L)
    for _ in range(5):  # C stops after a pass without change; another pass would change nothing either
        for i in range(x.shape[0]):
            Li = L[i]
            slx = sumlx - wx[i] * Li
            sl2 = suml2 - (w[i] * Li) * Li
            new_l = np.clip(_nearest_int((x[i] * sl2) / slx), lo, hi).astype(np.float32)
            slx2 = slx + wx[i] * new_l
            sl22 = sl2 + (w[i] * new_l) * new_l
            take = (slx > 0) & (new_l != Li) & (sl22 > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[i] = np.where(take, new_l, Li)
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
    scale = np.where(suml2 > 0, sumlx / suml2, _F(0))
    return np.where(zero, _F(0), scale), np.where(zero, _F(0), L + _F(nmax))


def make_qkx_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants / make_qkx3_quants (the same computation when weights are given): asymmetric scale and min
    search over nstep+1 trial scales, each refined by weighted least squares. Returns (scale, the_min, L) with
    x ~ scale*L - the_min, L in [0, nmax], the_min >= 0 (C's *the_min)."""
    mn = _first_min(x)
    mx = x.max(axis=0)
    sum_w = _sum_first(w)
    sum_x = _sum_first(w * x)
    mn = np.where(mn > 0, _F(0), mn)
    flat = mx == mn
    iscale = _F(nmax) / (mx - mn)
    scale = _F(1) / iscale
    L = np.clip(_rint(iscale * (x - mn)), _F(0), _F(nmax))
    diff = (scale * L + mn) - x
    best = _sum(w * (np.abs(diff) if use_mad else diff * diff))
    for is_ in range(nstep + 1):
        iscale = (_F(rmin) + _F(rdelta) * _F(is_) + _F(nmax)) / (mx - mn)
        Laux = np.clip(_rint(iscale * (x - mn)), _F(0), _F(nmax))
        wl = w * Laux
        sum_l, sum_l2, sum_xl = _sum(wl), _sum(wl * Laux), _sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = np.where(pos, _F(0), this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        diff = (this_scale * Laux + this_min) - x
        cur = _sum(w * (np.abs(diff) if use_mad else diff * diff))
        better = (D > 0) & (cur < best)
        L = np.where(better, Laux, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    return np.where(flat, _F(0), scale), -mn, np.where(flat, _F(0), L)


def make_qp_quants(x: np.ndarray, nmax: int, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qp_quants(n, nmax, x, L, quant_weights): scale for non-negative values (sub-block scales or mins) over
    9 trial scales, then up to 5 passes of coordinate descent. Returns (scale, L), L as C's uint8_t L[i]."""
    mx = np.maximum(x.max(axis=0), _F(0))
    zero = mx < GROUP_MAX_EPS
    iscale = _F(nmax) / mx
    L = _u8(_nearest_int(iscale * x)).astype(np.float32)
    scale = _F(1) / iscale
    diff = x - scale * L
    best_mse = _sum((qw * diff) * diff)
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = (_F(0.1) * _F(is_) + _F(nmax)) / mx
        scale_is = _F(1) / iscale_is
        l = np.minimum(_nearest_int(iscale_is * x), nmax).astype(np.float32)
        diff = x - scale_is * l
        mse = _sum((qw * diff) * diff)
        better = mse < best_mse
        best_mse = np.where(better, mse, best_mse)
        iscale = np.where(better, iscale_is, iscale)
    l = np.minimum(_nearest_int(iscale * x), nmax)
    L = _u8(l).astype(np.float32)
    l = l.astype(np.float32)
    qwx = qw * x
    sumlx, suml2 = _sum(qwx * l), _sum((qw * l) * l)
    for _ in range(5):
        for i in range(x.shape[0]):
            Li = L[i]
            slx = sumlx - qwx[i] * Li
            sl2 = suml2 - (qw[i] * Li) * Li
            new_l = np.minimum(_nearest_int((x[i] * sl2) / slx), nmax)
            new_f = new_l.astype(np.float32)
            slx2 = slx + qwx[i] * new_f
            sl22 = sl2 + (qw[i] * new_f) * new_f
            take = (slx > 0) & (sl2 > 0) & (new_f != Li) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
            L[i] = np.where(take, _u8(new_l).astype(np.float32), Li)
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
    scale = np.where(suml2 > 0, sumlx / suml2, _F(0))
    return np.where(zero, _F(0), scale), np.where(zero, _F(0), L)


# ----------------------------------------------------------------------------------------------- scale packing

def _k4_scale_bytes(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """The 12 scale bytes of Q4_K / Q5_K from 8 scales and 8 mins (..., 8), C's statements with uint8_t stores
    (values up to 255 behave as in C)."""
    b = np.zeros((*ls.shape[:-1], 12), np.int32)
    b[..., 0:4] = ls[..., 0:4]
    b[..., 4:8] = lm[..., 0:4]
    b[..., 8:12] = _u8((ls[..., 4:8] & 0xF) | ((lm[..., 4:8] & 0xF) << 4))
    b[..., 0:4] = _u8(b[..., 0:4] | ((ls[..., 4:8] >> 4) << 6))
    b[..., 4:8] = _u8(b[..., 4:8] | ((lm[..., 4:8] >> 4) << 6))
    return b


def _k4_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for j = 0..7: 12 bytes (..., 12) -> (scales, mins) (..., 8), 6 bits each."""
    b = b.astype(np.int32)
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _q3_scale_bytes(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes from 16 six-bit values s = sc + 32 (..., 16)."""
    b = np.zeros((*s.shape[:-1], 12), np.int32)
    b[..., 0:8] = (s[..., 0:8] & 0xF) | ((s[..., 8:16] & 0xF) << 4)
    for g in range(4):
        b[..., 8:12] |= ((s[..., 4 * g:4 * g + 4] >> 4) & 3) << (2 * g)
    return b


def _q3_scales(b: np.ndarray) -> np.ndarray:
    """Inverse of `_q3_scale_bytes` (dequantize_row_q3_K's kmask shuffle): (..., 12) -> s (..., 16) in 0..63."""
    b = b.astype(np.int32)
    low = np.concatenate([b[..., 0:8] & 0xF, b[..., 0:8] >> 4], axis=-1)
    high = np.concatenate([(b[..., 8:12] >> (2 * g)) & 3 for g in range(4)], axis=-1)
    return low | (high << 4)


# ----------------------------------------------------------------------------------------------- quantizers
# Each takes a batch of blocks X (NB, block) float32, the importance weights QW (NB, block) or None, and returns
# _Q: d (and m / dmin) as float16, integer scales / mins (NB, n_sub), codes (NB, block) int8.

class _Q(NamedTuple):
    d: np.ndarray
    m: np.ndarray | None = None
    dmin: np.ndarray | None = None
    scales: np.ndarray | None = None
    mins: np.ndarray | None = None
    codes: np.ndarray | None = None


def _em(X: np.ndarray, n: int) -> np.ndarray:
    """(NB, block) -> element-major groups of n: (n, NB*block/n)."""
    return np.ascontiguousarray(X.reshape(-1, n).T)


def _from_em(L: np.ndarray, NB: int) -> np.ndarray:
    return L.T.reshape(NB, -1)


def _quantize_row_q8_0_ref(X, QW=None, sigma2=None) -> _Q:
    """quantize_row_q8_0_ref (quantize_q8_0 ignores quant_weights)."""
    amax = np.abs(X).max(axis=1)
    d = amax / _F(127)
    id_ = np.where(d != 0, _F(1) / np.where(d != 0, d, _F(1)), _F(0))
    q = _roundf(X * id_[:, None])
    return _Q(d=fp32_to_fp16(d), codes=q.astype(np.int8))


def _legacy_sym_ref(X, nmax: int) -> _Q:
    """quantize_row_q4_0_ref / quantize_row_q5_0_ref: d = max / -nmax, q = MIN(2*nmax-1, (int8_t)(x*id + nmax+.5))."""
    mx = _abs_max(X.T)
    d = mx / _F(-nmax)
    id_ = np.where(d != 0, _F(1) / np.where(d != 0, d, _F(1)), _F(0))
    q = np.trunc(X * id_[:, None] + _F(nmax + 0.5))
    return _Q(d=fp32_to_fp16(d), codes=np.minimum(q, 2 * nmax - 1).astype(np.int8))


def _legacy_asym_ref(X, nmax: int) -> _Q:
    """quantize_row_q4_1_ref / quantize_row_q5_1_ref: d = (max - min)/nmax, m = min, q = (int)((x - min)*id + .5)."""
    mn, mx = _first_min(X.T), _first_max(X.T)
    d = (mx - mn) / _F(nmax)
    id_ = np.where(d != 0, _F(1) / np.where(d != 0, d, _F(1)), _F(0))
    q = np.trunc((X - mn[:, None]) * id_[:, None] + _F(0.5)).astype(np.int32)
    # q4_1: MIN(15, (int8_t)(..)); q5_1: (uint8_t)(..) without MIN, whose bit 5 the packing drops
    q = np.minimum(q, 15) if nmax == 15 else _u8(q) & 31
    return _Q(d=fp32_to_fp16(d), m=fp32_to_fp16(mn), codes=q.astype(np.int8))


def _legacy_weights(X, QW, sigma2):
    """quantize_row_q4_0_impl & co: weight[j] = qw[j] * sqrtf(sigma2 + x[j]*x[j]), sigma2 = row mean square."""
    return QW * np.sqrt(sigma2[:, None] + X * X)


def _legacy_sym_impl(X, QW, sigma2, nmax: int) -> _Q:
    """quantize_row_q4_0_impl / quantize_row_q5_0_impl: d = make_qx_quants(32, nmax, x, L, 1, weight), codes L."""
    scale, L = make_qx_quants(_em(X, 32), nmax, _em(_legacy_weights(X, QW, sigma2), 32))
    return _Q(d=fp32_to_fp16(scale), codes=_from_em(L, X.shape[0]).astype(np.int8))


def _legacy_asym_impl(X, QW, sigma2, nmax: int) -> _Q:
    """quantize_row_q4_1_impl / quantize_row_q5_1_impl: make_qkx3_quants(32, nmax, .., -0.9f, 0.05f, 36, false);
    d = scale, m = -the_min, codes L."""
    scale, the_min, L = make_qkx_quants(_em(X, 32), _em(_legacy_weights(X, QW, sigma2), 32), nmax,
                                        -0.9, 0.05, 36, False)
    return _Q(d=fp32_to_fp16(scale), m=fp32_to_fp16(-the_min), codes=_from_em(L, X.shape[0]).astype(np.int8))


def _sub_view(a: np.ndarray, NB: int) -> np.ndarray:
    """Per-group results (N,) of element-major sub-blocks -> (NB, n_sub)."""
    return a.reshape(NB, -1)


def _requant(X, scale, offset, lo: int, hi: int, L_search) -> np.ndarray:
    """The requantization every quantize_row_*_K ends with: per sub-block d = scale, dm = offset,
    `if (!d) continue; l = nearest_int((x + dm)/d)` clamped; skipped sub-blocks keep the search's codes.
    X, L_search (NB, n_sub, sub); scale, offset (NB, n_sub) float32; returns int32 codes (as L, unsigned)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        l = np.clip(_nearest_int((X + offset[..., None]) / scale[..., None]), lo, hi)
    return np.where((scale != 0)[..., None], l, L_search)


def _super_sigma2(X, factor: int) -> np.ndarray:
    """`sum_x2 += x[l]*x[l]` over the super-block, then factor*sum_x2/QK_K."""
    xt = np.ascontiguousarray(X.T)
    return (_F(factor) * _sum(xt * xt)) / _F(QK_K)


def _q2_k(X, QW) -> _Q:
    """quantize_row_q2_K_ref (QW None) / quantize_row_q2_K_impl."""
    NB = X.shape[0]
    x = _em(X, 16)
    if QW is None:
        scales, mins, L = make_qkx_quants(x, np.abs(x), 3, -0.5, 0.1, 15, True)
        scales, mins = _sub_view(scales, NB), _sub_view(mins, NB)
        max_scale = _pos_max(scales, axis=1)
        max_min = _pos_max(mins, axis=1)
        q4scale = _F(15)
        with np.errstate(divide="ignore", invalid="ignore"):
            ls = np.where((max_scale > 0)[:, None], _nearest_int((q4scale / max_scale)[:, None] * scales), 0)
            lm = np.where((max_min > 0)[:, None], _nearest_int((q4scale / max_min)[:, None] * mins), 0)
        d = fp32_to_fp16(np.where(max_scale > 0, max_scale / q4scale, _F(0)))
        dmin = fp32_to_fp16(np.where(max_min > 0, max_min / q4scale, _F(0)))
    else:
        sigma2 = _super_sigma2(X, 1)
        weight = _em(QW, 16) * np.sqrt(np.repeat(sigma2, 16)[None] + x * x)
        sw = _sub_view(_sum(weight), NB)
        scales, mins, L = make_qkx_quants(x, weight, 3, -0.9, 0.05, 36, False)
        dm, ls = make_qp_quants(_sub_view(scales, NB).T.copy(), 15, sw.T.copy())
        mm, lm = make_qp_quants(_sub_view(mins, NB).T.copy(), 15, sw.T.copy())
        ls, lm = ls.T.astype(np.int32), lm.T.astype(np.int32)
        d, dmin = fp32_to_fp16(dm), fp32_to_fp16(mm)
    byte = _u8(_u8(ls) | (lm << 4))          # y[i].scales[j] = l; y[i].scales[j] |= (l << 4)
    sc, mn = byte & 0xF, byte >> 4
    scale = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    offset = dmin.astype(np.float32)[:, None] * mn.astype(np.float32)
    L = _from_em(L, NB).reshape(NB, 16, 16)
    codes = _requant(X.reshape(NB, 16, 16), scale, offset, 0, 3, L)
    return _Q(d=d, dmin=dmin, scales=sc.astype(np.uint8), mins=mn.astype(np.uint8),
              codes=codes.reshape(NB, QK_K).astype(np.int8))


def _q3_k(X, QW) -> _Q:
    """quantize_row_q3_K_ref (QW None) / quantize_row_q3_K_impl."""
    NB = X.shape[0]
    x = _em(X, 16)
    if QW is None:
        scales, L = make_q3_quants(x, 4)
        scales = _sub_view(scales, NB)
        max_scale = _abs_max(scales.T)
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = _F(-32) / max_scale
            l = np.clip(_i8(_nearest_int(iscale[:, None] * scales)), -32, 31) + 32
        s = np.where((max_scale != 0)[:, None], l, 0)
        d = fp32_to_fp16(np.where(max_scale != 0, _F(1) / iscale, _F(0)))
    else:
        sigma2 = _super_sigma2(X, 2)
        weight = _em(QW, 16) * np.sqrt(np.repeat(sigma2, 16)[None] + x * x)
        sw = _sub_view(_sum(weight), NB)
        scales, L = make_qx_quants(x, 4, weight)
        d_block, Ls = make_qx_quants(_sub_view(scales, NB).T.copy(), 32, sw.T.copy())
        s = Ls.T.astype(np.int32)
        d = fp32_to_fp16(d_block)
    s = _q3_scales(_q3_scale_bytes(s))       # what the packed bytes decode to
    sc = s - 32
    scale = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    L = _from_em(L, NB).reshape(NB, 16, 16).astype(np.int32)
    codes = _requant(X.reshape(NB, 16, 16), scale, np.zeros_like(scale), -4, 3, L - 4)
    return _Q(d=d, scales=sc.astype(np.int8), codes=codes.reshape(NB, QK_K).astype(np.int8))


def _q45_k(X, QW, nmax: int) -> _Q:
    """quantize_row_q4_K_ref / quantize_row_q5_K_ref (QW None), quantize_row_q4_K_impl / quantize_row_q5_K_impl."""
    NB = X.shape[0]
    x = _em(X, 32)
    if QW is None:
        av_x = np.sqrt(_sum(x * x) / _F(32))
        weights = av_x[None] + np.abs(x)
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        scales, mins, L = make_qkx_quants(x, weights, nmax, rmin, 0.1, nstep, False)
        scales, mins = _sub_view(scales, NB), _sub_view(mins, NB)
        max_scale = _pos_max(scales, axis=1)
        max_min = _pos_max(mins, axis=1)
        with np.errstate(divide="ignore"):
            inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _F(0))
            inv_min = np.where(max_min > 0, _F(63) / max_min, _F(0))
        ls = np.minimum(_u8(_nearest_int(inv_scale[:, None] * scales)), 63)
        lm = np.minimum(_u8(_nearest_int(inv_min[:, None] * mins)), 63)
        d, dmin = fp32_to_fp16(max_scale / _F(63)), fp32_to_fp16(max_min / _F(63))
    else:
        sigma2 = _super_sigma2(X, 2)
        weights = _em(QW, 32) * np.sqrt(np.repeat(sigma2, 8)[None] + x * x)
        sw = _sub_view(_sum(weights), NB)
        scales, mins, L = make_qkx_quants(x, weights, nmax, -0.9, 0.05, 36, False)
        d_block, ls = make_qp_quants(_sub_view(scales, NB).T.copy(), 63, sw.T.copy())
        m_block, lm = make_qp_quants(_sub_view(mins, NB).T.copy(), 63, sw.T.copy())
        ls, lm = ls.T.astype(np.int32), lm.T.astype(np.int32)
        if nmax == 31:  # quantize_row_q5_K_impl clamps, q4_K_impl does not
            ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
        d, dmin = fp32_to_fp16(d_block), fp32_to_fp16(m_block)
    sc, mn = _k4_scales(_k4_scale_bytes(ls, lm))
    scale = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    offset = dmin.astype(np.float32)[:, None] * mn.astype(np.float32)
    L = _from_em(L, NB).reshape(NB, 8, 32)
    codes = _requant(X.reshape(NB, 8, 32), scale, offset, 0, nmax, L)
    return _Q(d=d, dmin=dmin, scales=sc.astype(np.uint8), mins=mn.astype(np.uint8),
              codes=codes.reshape(NB, QK_K).astype(np.int8))


def _q6_k(X, QW) -> _Q:
    """quantize_row_q6_K_ref (QW None) / quantize_row_q6_K_impl (make_qx_quants weighted by the imatrix alone)."""
    NB = X.shape[0]
    x = _em(X, 16)
    scales, L = make_qx_quants(x, 32, None if QW is None else _em(QW, 16))
    scales = _sub_view(scales, NB)
    max_scale = _abs_max(scales.T)
    zero = np.abs(max_scale) < GROUP_MAX_EPS          # memset(&y[i], 0, sizeof(block_q6_K))
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = _F(-128) / max_scale
        sc = _i8(np.minimum(127, _nearest_int(iscale[:, None] * scales)))
        d = fp32_to_fp16(np.where(zero, _F(0), _F(1) / iscale))
    sc = np.where(zero[:, None], 0, sc)
    scale = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    L = _from_em(L, NB).reshape(NB, 16, 16).astype(np.int32)
    codes = _requant(X.reshape(NB, 16, 16), scale, np.zeros_like(scale), -32, 31, L - 32)
    codes = np.where(zero[:, None, None], -32, codes)
    return _Q(d=d, scales=sc.astype(np.int8), codes=codes.reshape(NB, QK_K).astype(np.int8))


def _quantizer(t: GGMLQuantizationType, has_imatrix: bool):
    """The C path quantize_<type> takes: `_ref` without quant_weights, `_impl` with them (Q8_0: always ref)."""
    if t == _T.Q8_0:
        return _quantize_row_q8_0_ref
    nmax = {_T.Q4_0: 8, _T.Q5_0: 16, _T.Q4_1: 15, _T.Q5_1: 31}.get(t)
    if t in (_T.Q4_0, _T.Q5_0):
        if has_imatrix:
            return lambda X, QW, s2: _legacy_sym_impl(X, QW, s2, nmax)
        return lambda X, QW, s2: _legacy_sym_ref(X, nmax)
    if t in (_T.Q4_1, _T.Q5_1):
        if has_imatrix:
            return lambda X, QW, s2: _legacy_asym_impl(X, QW, s2, nmax)
        return lambda X, QW, s2: _legacy_asym_ref(X, nmax)
    k = {_T.Q2_K: _q2_k, _T.Q3_K: _q3_k, _T.Q6_K: _q6_k,
         _T.Q4_K: lambda X, QW: _q45_k(X, QW, 15), _T.Q5_K: lambda X, QW: _q45_k(X, QW, 31)}[t]
    return lambda X, QW, s2: k(X, QW)


_CHUNK = 1 << 18  # weights per batch: keeps the temporaries of the searches near the caches


def _as_weight(t: GGMLQuantizationType, W, name: str = "W") -> np.ndarray:
    W = np.asarray(W, dtype=np.float32)
    if W.ndim != 2 or W.shape[0] == 0:
        raise ValueError(f"{name} must be 2-D (rows, columns) with at least one row, got shape {W.shape}")
    _check_columns(t, W.shape[1])
    if not np.isfinite(W).all():
        raise ValueError(f"{name} has non-finite values (inf or nan); ggml's quantizers assume finite weights")
    return np.ascontiguousarray(W)


def _as_imatrix(imatrix, n: int) -> np.ndarray | None:
    if imatrix is None:
        return None
    q = np.ascontiguousarray(np.asarray(imatrix, dtype=np.float32))
    if q.shape != (n,):
        raise ValueError(f"imatrix must hold one weight per column: shape ({n},), got {q.shape}")
    if not np.isfinite(q).all():
        raise ValueError("imatrix has non-finite values")
    return q


def _quantize(t, W, imatrix, row_ms=None) -> GGMLBlocks:
    t = ggml_type(t)
    W = _as_weight(t, W)
    rows, n = W.shape
    spec = _SPECS[t]
    qw = _as_imatrix(imatrix, n)
    nb = n // spec.block
    X = W.reshape(rows * nb, spec.block)
    sigma2 = None
    if qw is not None and spec.block == 32:   # the legacy _impl paths: mean square of the whole row
        ms = _row_sum(W * W) / _F(n) if row_ms is None else np.asarray(row_ms, dtype=np.float32).reshape(rows)
        sigma2 = np.repeat(ms, nb)
    fn = _quantizer(t, qw is not None)
    step = max(1, _CHUNK // spec.block)
    parts = []
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for s in range(0, rows * nb, step):
            e = min(s + step, rows * nb)
            QW = None if qw is None else qw.reshape(nb, spec.block)[np.arange(s, e) % nb]
            parts.append(fn(X[s:e], QW, None if sigma2 is None else sigma2[s:e]))

    def cat(field, shape):
        if getattr(parts[0], field) is None:
            return None
        return np.concatenate([getattr(p, field) for p in parts]).reshape(shape)

    sub = (rows, nb, spec.block // spec.sub)
    return GGMLBlocks(type=t, d=cat("d", (rows, nb)), m=cat("m", (rows, nb)), dmin=cat("dmin", (rows, nb)),
                      scales=cat("scales", sub), mins=cat("mins", sub), codes=cat("codes", (rows, n)))


def quantize_ref(t, W, imatrix=None) -> GGMLBlocks:
    """llama.cpp's quantize_<type>(W, nrow, n_per_row, imatrix), bit for bit: `pack(t, quantize_ref(t, W, q))` is
    the bytes llama-quantize writes. W (rows, n) float, n a multiple of block_size(t); imatrix (n,) or None: the
    importance of each column as llama-quantize passes it, the mean over calibration tokens of the squared input
    activation (llama-imatrix's sums divided by their counts)."""
    return _quantize(t, W, imatrix)


def fit(t, W, imatrix=None, row_ms=None) -> GGMLParams:
    """The block and sub-block parameters llama.cpp chooses for W (those of `quantize_ref`), sub-block scales
    quantized as stored. Round weights onto them with `round_codes`. `row_ms` (rows,): the mean square of each whole
    row, which the legacy types' imatrix search weights by (`sigma2`), for W a column slice of those rows (default:
    W's own)."""
    return _quantize(t, W, imatrix, row_ms).params()


# ----------------------------------------------------------------------------------------------- per-weight grid

def _cols(params: GGMLParams, columns) -> np.ndarray:
    n = params.shape[1]
    if columns is None:
        return np.arange(n)
    if isinstance(columns, slice):
        return np.arange(n)[columns]
    cols = np.asarray(columns, dtype=np.int64).reshape(-1)
    if cols.size and (cols.min() < 0 or cols.max() >= n):
        raise ValueError(f"columns must lie in [0, {n})")
    return cols


def _per_weight(a: np.ndarray, per: int, cols: np.ndarray) -> np.ndarray:
    """Block (rows, nb) or sub-block (rows, nb, n_sub) values -> per weight (rows, len(cols)), float32."""
    return a.reshape(a.shape[0], -1)[:, cols // per].astype(np.float32)


def scale_offset(t, params: GGMLParams, columns=None) -> tuple[np.ndarray, np.ndarray]:
    """Per weight fp32 (scale, offset) with x = scale*q - offset equal to `dequantize` (finite d; +0 / -0 aside):
    Q8_0 (d, 0), Q4_0 (d, 8d), Q5_0 (d, 16d), Q4_1/Q5_1 (d, -m), K types (d*sc, dmin*mn) or (d*sc, 0), computed as
    ggml does (d*sc in fp32). `columns` (slice or indices) restricts to those columns: (rows, len(columns))."""
    t = _check_type(t, params)
    spec = _SPECS[t]
    cols = _cols(params, columns)
    d = _per_weight(params.d, spec.block, cols)
    if spec.scales is None:
        if t in (_T.Q4_1, _T.Q5_1):
            return d, -_per_weight(params.m, spec.block, cols)
        zero = {_T.Q8_0: 0, _T.Q4_0: 8, _T.Q5_0: 16}[t]
        return d, d * _F(zero)
    scale = d * _per_weight(params.scales, spec.sub, cols)
    if not spec.dmin:
        return scale, np.zeros_like(scale)
    return scale, _per_weight(params.dmin, spec.block, cols) * _per_weight(params.mins, spec.sub, cols)


def round_codes(t, W, params: GGMLParams, columns=None) -> np.ndarray:
    """Codes (int8, the module's convention) of W on the fixed grid `params`, with ggml's rounding rule for the type
    (module docstring). W (rows, n), or (rows, len(columns)) with `columns` a slice / indices of params' columns:
    a GPTQ-style quantizer fits once and rounds column by column."""
    t = _check_type(t, params)
    spec = _SPECS[t]
    cols = _cols(params, columns)
    W = np.asarray(W, dtype=np.float32)
    if W.shape != (params.shape[0], cols.size):
        raise ValueError(f"W has shape {W.shape}, expected {(params.shape[0], cols.size)} for these columns")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if spec.scales is not None:
            scale, offset = scale_offset(t, params, cols)
            q = np.clip(_nearest_int((W + offset) / scale), spec.lo, spec.hi)
            return np.where(scale != 0, q, 0).astype(np.int8)
        d = _per_weight(params.d, spec.block, cols)
        id_ = np.where(d != 0, _F(1) / np.where(d != 0, d, _F(1)), _F(0))
        if t == _T.Q8_0:
            q = _roundf(W * id_)
        elif t in (_T.Q4_0, _T.Q5_0):
            q = np.trunc(W * id_ + _F(spec.hi // 2 + 1.5))
        else:
            q = np.trunc((W - _per_weight(params.m, spec.block, cols)) * id_ + _F(0.5))
        return np.clip(q, spec.lo, spec.hi).astype(np.int8)


# ----------------------------------------------------------------------------------------------- dequantize

def dequantize(t, blocks: GGMLBlocks) -> np.ndarray:
    """ggml's dequantize_row_<type>, bit for bit: float32 (rows, n)."""
    t = _check_type(t, blocks)
    spec = _SPECS[t]
    rows, n = blocks.shape
    nb = n // spec.block
    q = blocks.codes.reshape(rows, nb, -1, spec.sub).astype(np.float32)
    d = blocks.d.astype(np.float32)[:, :, None, None]
    if t == _T.Q8_0:
        y = q * d
    elif t in (_T.Q4_0, _T.Q5_0):
        y = (q - _F(spec.hi // 2 + 1)) * d                  # x0 = q - 8 (int), x0*d
    elif t in (_T.Q4_1, _T.Q5_1):
        y = q * d + blocks.m.astype(np.float32)[:, :, None, None]
    else:
        dl = d[..., 0] * blocks.scales.astype(np.float32)       # d1 = d * sc
        y = dl[..., None] * q
        if spec.dmin:
            y = y - (blocks.dmin.astype(np.float32)[:, :, None] * blocks.mins.astype(np.float32))[..., None]
    return y.reshape(rows, n)


# ----------------------------------------------------------------------------------------------- pack / unpack

def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype("<f2").view(np.uint8).reshape(-1, 2)


def _f16_from(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").reshape(-1).astype(np.float16)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """(NB, k, 32) single bits -> (NB, 32) bytes, bit k of byte l = bits[:, k, l] (Q3_K hmask, Q5_K qh)."""
    return sum(bits[:, k].astype(np.int32) << k for k in range(bits.shape[1])).astype(np.uint8)


def _from_bit_planes(b: np.ndarray, k: int) -> np.ndarray:
    return np.stack([(b.astype(np.int32) >> j) & 1 for j in range(k)], axis=1)


def _crumbs(L: np.ndarray) -> np.ndarray:
    """2-bit values (NB, 256) -> qs (NB, 64): per half h, qs[32h+l] = L[128h+l] | L[128h+32+l] << 2 | ... << 6."""
    v = L.reshape(-1, 2, 4, 32).astype(np.int32)
    return sum(v[:, :, j] << (2 * j) for j in range(4)).reshape(-1, 64).astype(np.uint8)


def _from_crumbs(qs: np.ndarray) -> np.ndarray:
    v = qs.reshape(-1, 2, 1, 32).astype(np.int32) >> (2 * np.arange(4)).reshape(1, 1, 4, 1)
    return (v & 3).reshape(-1, QK_K)


def _nibbles_k(L: np.ndarray) -> np.ndarray:
    """4-bit values (NB, 256) -> qs (NB, 128): qs[32c+l] = L[64c+l] | L[64c+32+l] << 4."""
    v = L.reshape(-1, 4, 2, 32).astype(np.int32)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def _from_nibbles_k(qs: np.ndarray) -> np.ndarray:
    v = qs.reshape(-1, 4, 1, 32).astype(np.int32) >> np.array([0, 4]).reshape(1, 1, 2, 1)
    return (v & 0xF).reshape(-1, QK_K)


def _pack_blocks(t: GGMLQuantizationType, b: GGMLBlocks) -> list[np.ndarray]:
    """Per block (NB, ...) byte fields in struct order."""
    spec = _SPECS[t]
    NB = b.d.size
    L = b.codes.reshape(NB, spec.block).astype(np.int32) - {_T.Q3_K: -4, _T.Q6_K: -32}.get(t, 0)
    d = _f16_bytes(b.d)
    if t == _T.Q8_0:
        return [d, L.astype(np.int8).view(np.uint8)]
    if spec.block == 32:
        qs = ((L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4)).astype(np.uint8)
        head = [d] + ([_f16_bytes(b.m)] if spec.m else [])
        if spec.hi == 15:
            return head + [qs]
        qh = np.packbits((L >> 4).astype(np.uint8), axis=1, bitorder="little")
        return head + [qh, qs]
    if t == _T.Q2_K:
        sc = (b.scales.reshape(NB, 16).astype(np.int32) | (b.mins.reshape(NB, 16).astype(np.int32) << 4))
        return [sc.astype(np.uint8), _crumbs(L), d, _f16_bytes(b.dmin)]
    if t == _T.Q3_K:
        hmask = _bit_planes((L >> 2).reshape(NB, 8, 32))
        s = _q3_scale_bytes(b.scales.reshape(NB, 16).astype(np.int32) + 32).astype(np.uint8)
        return [hmask, _crumbs(L & 3), s, d]
    if t in (_T.Q4_K, _T.Q5_K):
        s = _k4_scale_bytes(b.scales.reshape(NB, 8).astype(np.int32),
                            b.mins.reshape(NB, 8).astype(np.int32)).astype(np.uint8)
        head = [d, _f16_bytes(b.dmin), s]
        if t == _T.Q4_K:
            return head + [_nibbles_k(L)]
        return head + [_bit_planes((L >> 4).reshape(NB, 8, 32)), _nibbles_k(L & 0xF)]
    # Q6_K
    v = L.reshape(NB, 2, 4, 32)
    ql = np.concatenate([(v[:, :, 0] & 0xF) | ((v[:, :, 2] & 0xF) << 4),
                         (v[:, :, 1] & 0xF) | ((v[:, :, 3] & 0xF) << 4)], axis=2)   # (NB, 2, 64)
    qh = sum((v[:, :, k] >> 4) << (2 * k) for k in range(4))                         # (NB, 2, 32)
    return [ql.reshape(NB, 128).astype(np.uint8), qh.reshape(NB, 64).astype(np.uint8),
            np.ascontiguousarray(b.scales.reshape(NB, 16)).view(np.uint8), d]


def pack(t, blocks: GGMLBlocks) -> np.ndarray:
    """The bytes ggml stores: uint8 (rows, bytes_per_row(t, n)), blocks in row order, each the C struct."""
    t = _check_type(t, blocks)
    spec = _SPECS[t]
    _check_range("codes", blocks.codes, spec.lo, spec.hi, t)
    if spec.scales is not None:
        lo, hi = _SCALE_RANGE[t]
        _check_range("scales", blocks.scales, lo, hi, t)
        if spec.dmin:
            _check_range("mins", blocks.mins, lo, hi, t)
    rows, n = blocks.shape
    raw = np.concatenate(_pack_blocks(t, blocks), axis=1)
    return raw.reshape(rows, bytes_per_row(t, n))


def unpack(t, raw: np.ndarray, shape: tuple[int, int]) -> GGMLBlocks:
    """Exact inverse of `pack`: uint8 (rows, bytes_per_row) or flat bytes -> GGMLBlocks of weight shape (rows, n)."""
    t = ggml_type(t)
    spec = _SPECS[t]
    rows, n = shape
    _check_columns(t, n)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.size != rows * bytes_per_row(t, n):
        raise ValueError(f"{t.name} {rows}x{n} needs {rows * bytes_per_row(t, n)} uint8 bytes, got {raw.size} "
                         f"{raw.dtype}")
    nb = n // spec.block
    B = raw.reshape(rows * nb, GGML_QUANT_SIZES[t][1])
    f16 = lambda o: _f16_from(B[:, o:o + 2]).reshape(rows, nb)
    sub = (rows, nb, spec.block // spec.sub)
    m = dmin = scales = mins = None
    if t == _T.Q8_0:
        d, L = f16(0), B[:, 2:].view(np.int8).astype(np.int32)
    elif spec.block == 32:
        o = 4 if spec.m else 2
        d = f16(0)
        m = f16(2) if spec.m else None
        qh = None
        if spec.hi == 31:
            qh, o = np.unpackbits(B[:, o:o + 4], axis=1, bitorder="little").astype(np.int32), o + 4
        qs = B[:, o:o + 16].astype(np.int32)
        L = np.concatenate([qs & 0xF, qs >> 4], axis=1)
        if qh is not None:
            L = L | (qh << 4)
    elif t == _T.Q2_K:
        s = B[:, 0:16].astype(np.int32)
        scales, mins = (s & 0xF).astype(np.uint8).reshape(sub), (s >> 4).astype(np.uint8).reshape(sub)
        L, d, dmin = _from_crumbs(B[:, 16:80]), f16(80), f16(82)
    elif t == _T.Q3_K:
        hbit = _from_bit_planes(B[:, 0:32], 8).reshape(-1, QK_K)
        L = (_from_crumbs(B[:, 32:96]) | (hbit << 2)) - 4
        scales = (_q3_scales(B[:, 96:108]) - 32).astype(np.int8).reshape(sub)
        d = f16(108)
    elif t in (_T.Q4_K, _T.Q5_K):
        d, dmin = f16(0), f16(2)
        sc, mn = _k4_scales(B[:, 4:16])
        scales, mins = sc.astype(np.uint8).reshape(sub), mn.astype(np.uint8).reshape(sub)
        if t == _T.Q4_K:
            L = _from_nibbles_k(B[:, 16:144])
        else:
            L = _from_nibbles_k(B[:, 48:176]) | (_from_bit_planes(B[:, 16:48], 8).reshape(-1, QK_K) << 4)
    else:  # Q6_K
        ql = B[:, 0:128].reshape(-1, 2, 2, 32).astype(np.int32)     # (NB, half, ql[0:32] / ql[32:64], l)
        qh = B[:, 128:192].reshape(-1, 2, 1, 32).astype(np.int32) >> (2 * np.arange(4)).reshape(1, 1, 4, 1)
        low = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
        L = (low | ((qh & 3) << 4)).reshape(-1, QK_K) - 32
        scales = B[:, 192:208].view(np.int8).reshape(sub).copy()
        d = f16(208)
    return GGMLBlocks(type=t, d=d, m=m, dmin=dmin, scales=scales, mins=mins,
                      codes=np.asarray(L).reshape(rows, n).astype(np.int8))
