"""kernels/ggml.py: llama.cpp's block formats against the gguf package (dequantize for every type, quantize for
the legacy types, bit for bit), against llama.cpp's own bytes on a fixed input (GOLDEN, every type, with and
without imatrix), the byte layout's round trips, the fit / round split, the K quantizers' quality.

A live byte-for-byte oracle is an entry of ORACLES: `oracle(type_name, W, imatrix) -> uint8 (rows, bytes)`;
llama.cpp's own `quantize_<type>` (ggml-quants.c through ctypes, or gguf-py once it has K quants) slots in there for
every type and both paths, with CASES as its inputs."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest

from compress.kernels import ggml

T = gguf.GGMLQuantizationType
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
ALL = LEGACY + KQUANTS
# byte offsets of the fp16 fields (d, m, dmin) inside one block
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def _gguf_quantize(name, W, imatrix):
    assert imatrix is None
    return gguf.quants.quantize(W, T[name])


ORACLES = {name: _gguf_quantize for name in LEGACY}  # + llama.cpp for all ten, with imatrix too


def weights(rows, n, seed=0) -> np.ndarray:
    """Gaussian rows at varied scales, plus the blocks that take the searches' special branches."""
    rng = np.random.default_rng(seed)
    return _edges(rng.standard_normal((rows, n)) * 10.0 ** rng.uniform(-4, 1, (rows, 1)))


def _edges(W: np.ndarray) -> np.ndarray:
    W = W.copy()
    W[0, :64] = 0                                     # an all-zero block / sub-blocks
    W[1] = np.abs(W[1])                               # all positive: the min clamps to 0
    W[2] = -np.abs(W[2])
    W[3, 40:] = 1.5                                   # constant blocks
    W[4, ::3] = 0
    W[5] *= 1e-7                                      # scales that underflow fp16
    W[6] = np.round(W[6] * 4 / np.abs(W[6]).max())    # ties
    W[7, 5] = 40 * np.abs(W[7]).max()                 # an outlier
    return W.astype(np.float32)


def _splitmix64(i: np.ndarray) -> np.ndarray:
    z = i.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def golden_input(rows=64, n=1024) -> tuple[np.ndarray, np.ndarray]:
    """(W, imatrix) built with integer hashing and exact float operations only, so the same on every platform and
    numpy version: sums of four 16-bit uniforms (1 in 64 weights times 8: tails), rows scaled by 2^-k, `_edges`."""
    z = _splitmix64(np.arange(rows * n)).reshape(rows, n)
    u = [((z >> np.uint64(16 * k)) & np.uint64(0xFFFF)).astype(np.float64) / 65536 for k in range(4)]
    W = (u[0] + u[1] + u[2] + u[3] - 2) * np.where(u[3] < 1 / 64, 8.0, 1.0) * 2.0 ** -(np.arange(rows) % 12)[:, None]
    q = _splitmix64(np.arange(n) + rows * n)
    imatrix = ((q & np.uint64(0xFFFF)).astype(np.float64) / 4096) ** 2 * ((q >> np.uint64(16)) % np.uint64(10) != 0)
    return _edges(W), imatrix.astype(np.float32)


def random_raw(name, rows, n, seed=0, finite=True) -> np.ndarray:
    """Random bytes of `rows` rows; with `finite`, every fp16 field holds a finite value (subnormals included)."""
    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, (rows * n // bs, ts), dtype=np.uint8)
    if finite:
        for o in F16_FIELDS[name]:
            h = rng.integers(0, 0x7C00, raw.shape[0], dtype=np.uint16) | (rng.integers(0, 2, raw.shape[0]) << 15)
            raw[:, o:o + 2] = h.astype(np.uint16).astype("<u2").view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.astype(np.float32).view(np.uint32),
                                                 b.astype(np.float32).view(np.uint32))


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal floats, NaN nowhere; +0 == -0 (scale*q - offset and ggml's (q-8)*d differ in the sign of a zero)."""
    return a.shape == b.shape and not np.isnan(a).any() and np.array_equal(a, b)


CASES = [(weights(16, 512, seed=1), None), (weights(8, 768, seed=2), None)]


# ------------------------------------------------------------------------------------------------ sizes, shapes

def test_sizes():
    for name in ALL:
        bs, ts = gguf.GGML_QUANT_SIZES[T[name]]
        assert ggml.block_size(name) == bs == (256 if name.endswith("_K") else 32)
        assert ggml.bytes_per_row(name, 4 * bs) == 4 * ts
        assert ggml.bits_per_weight(name) == ts * 8 / bs
    assert (ggml.bits_per_weight("Q4_K"), ggml.bits_per_weight("q6_k"), ggml.bits_per_weight(T.Q8_0)) == \
        (4.5, 6.5625, 8.5)
    assert ggml.bytes_per_row("Q4_K", 4096) == 16 * 144


def test_fallback_type():
    """llama-quantize's tensor_type_fallback: SmolLM2's 576-column weights cannot be K-quantized."""
    assert ggml.fallback_type("Q4_K", 1536) == T.Q4_K
    assert [ggml.fallback_type(k, 576) for k in KQUANTS] == [T.Q4_0, T.Q4_0, T.Q5_0, T.Q5_1, T.Q8_0]
    assert ggml.fallback_type("Q4_0", 576) == T.Q4_0 and ggml.fallback_type("Q4_K", 80) is None
    assert ggml.fallback_type("Q8_0", 48) is None


def test_bad_inputs():
    W = np.zeros((4, 576), np.float32)                # 576 % 256 = 64: no K type
    for call in (lambda: ggml.quantize_ref("Q4_K", W), lambda: ggml.fit("Q6_K", W),
                 lambda: ggml.bytes_per_row("Q4_K", 576),
                 lambda: ggml.unpack("Q4_K", np.zeros(576, np.uint8), (4, 576)),
                 lambda: ggml.quantize_ref("Q4_0", np.zeros((4, 48), np.float32))):
        with pytest.raises(ValueError, match="multiple of"):
            call()
    with pytest.raises(ValueError, match="2-D"):
        ggml.quantize_ref("Q8_0", np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        ggml.quantize_ref("Q4_K", np.full((1, 256), np.inf, np.float32))
    with pytest.raises(ValueError, match="one weight per column"):
        ggml.quantize_ref("Q4_K", np.ones((1, 256), np.float32), imatrix=np.ones(255, np.float32))
    with pytest.raises(ValueError, match="unsupported"):
        ggml.block_size("F16")
    b = ggml.quantize_ref("Q4_0", np.ones((1, 32), np.float32))
    with pytest.raises(ValueError, match="hold Q4_0"):
        ggml.pack("Q4_1", b)
    with pytest.raises(ValueError, match="needs 18"):
        ggml.unpack("Q4_0", np.zeros(17, np.uint8), (1, 32))
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 15\]"):
        ggml.pack("Q4_0", ggml.GGMLBlocks(type="Q4_0", d=b.d, codes=np.full((1, 32), 16, np.int8)))
    with pytest.raises(ValueError, match="dmin"):
        ggml.GGMLParams(type="Q4_K", d=np.zeros((1, 1), np.float16), scales=np.zeros((1, 1, 8), np.uint8))


# ------------------------------------------------------------------------------------------------ bytes

@pytest.mark.parametrize("name", ALL)
def test_dequantize_matches_gguf_bit_for_bit(name):
    n = 2 * ggml.block_size(name)
    raw = random_raw(name, 64, n, seed=3)
    blocks = ggml.unpack(name, raw, (64, n))
    assert same_bits(ggml.dequantize(name, blocks), gguf.quants.dequantize(raw, T[name]))


@pytest.mark.parametrize("name", ALL)
def test_pack_unpack_round_trip(name):
    n = 2 * ggml.block_size(name)
    raw = random_raw(name, 32, n, seed=4, finite=False)         # any bytes, NaN and inf halves included
    assert np.array_equal(ggml.pack(name, ggml.unpack(name, raw, (32, n))), raw)
    b = ggml.quantize_ref(name, weights(8, n, seed=5))
    back = ggml.unpack(name, ggml.pack(name, b), b.shape)
    for field in ("d", "m", "dmin", "scales", "mins", "codes"):
        x, y = getattr(b, field), getattr(back, field)
        assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)))


def test_code_conventions():
    """The codes are the integers dequantize_row_* multiplies: spot checks of the layout on hand-made blocks."""
    raw = np.zeros((1, 18), np.uint8)
    raw[0, :2] = np.array([1.0], "<f2").view(np.uint8)
    raw[0, 2] = 0x1F                                  # weight 0 = 15, weight 16 = 1
    b = ggml.unpack("Q4_0", raw, (1, 32))
    assert (b.codes[0, 0], b.codes[0, 16], b.codes[0, 1]) == (15, 1, 0)
    assert ggml.dequantize("Q4_0", b)[0, [0, 16, 1]].tolist() == [7.0, -7.0, -8.0]
    q6 = np.zeros((1, 210), np.uint8)                 # all-zero Q6_K block: codes -32
    assert (ggml.unpack("Q6_K", q6, (1, 256)).codes == -32).all()
    q3 = np.zeros((1, 110), np.uint8)
    q3[0, 0] = 1                                      # hmask bit 0 of byte 0: weight 0's high bit
    c = ggml.unpack("Q3_K", q3, (1, 256))
    assert c.codes[0, 0] == 0 and (c.codes[0, 1:] == -4).all() and (c.scales == -32).all()


def test_fp16_conversion_is_numpys():
    rng = np.random.default_rng(6)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([65504, 65519.99, 65520, 1e6, 6.1035156e-05, 5.96e-08, 2.98e-08, 2.9802322e-08, 1e-9, 0,
                      0.1, 1 / 3], np.float32)
    f = np.concatenate([bits.view(np.float32), edges, -edges])
    f = f[~np.isnan(f)]
    with np.errstate(over="ignore"):
        expected = f.astype(np.float16).view(np.uint16)
    assert np.array_equal(ggml.fp32_to_fp16(f).view(np.uint16), expected)


# ------------------------------------------------------------------------------------------------ quantizers

# sha256 (first 32 hex digits) of the bytes llama.cpp's quantize_<type> writes for golden_input(), without and with
# its imatrix: ggml-quants.c of llama-cpp-python 0.3.36's vendored llama.cpp, compiled as ggml-base is
# (gcc 12 -O3 -DNDEBUG, baseline x86-64: no FMA) and called through ctypes. Q8_0 ignores the imatrix.
GOLDEN = {
    ("Q8_0", False): "7162c16dd11685bdffc5ccc4737c5b6b", ("Q8_0", True): "7162c16dd11685bdffc5ccc4737c5b6b",
    ("Q4_0", False): "9e18d686ea9491849fbf4552af1eeffc", ("Q4_0", True): "9e379695bde31b013e3057c44c671d34",
    ("Q4_1", False): "d09e0e0f7767b26412c660791c5e5832", ("Q4_1", True): "86903b745b539529031b1aaa3bc2ff6e",
    ("Q5_0", False): "563fe4f4709d38f3e54a1bc6d1e24c3d", ("Q5_0", True): "51fa0cae1d25403452f9ff3d49bdfccf",
    ("Q5_1", False): "08b903faabf1cf9d136332c24f7fcc4e", ("Q5_1", True): "9fcc9cf2fa09fef4750852a1f7c5a933",
    ("Q2_K", False): "a423e51d80fc298210087043509c9d07", ("Q2_K", True): "3b37eb188aa5b8d22909413d4c0c8055",
    ("Q3_K", False): "8dd84b3cda11314c8dc5cf345519406b", ("Q3_K", True): "5ede70469db08cdc7d21b1cd8012d5d7",
    ("Q4_K", False): "fd4427f331dd3bdf56979ae055bef210", ("Q4_K", True): "0a29972c99932b55f94abeb0c5bf81e1",
    ("Q5_K", False): "f16e3105657b155c68e2e20b0d7a4d81", ("Q5_K", True): "68a032a7b8b8b31229689b34f7a2349e",
    ("Q6_K", False): "d06ca81885ef3d0c9fd78db763547042", ("Q6_K", True): "453810a242746c4b83ebda8a677b78b4",
}


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("with_imatrix", [False, True])
def test_quantize_ref_matches_llama_cpp_golden(name, with_imatrix):
    W, imatrix = golden_input()
    raw = ggml.pack(name, ggml.quantize_ref(name, W, imatrix if with_imatrix else None))
    assert raw.shape == (64, ggml.bytes_per_row(name, 1024))
    assert hashlib.sha256(raw.tobytes()).hexdigest()[:32] == GOLDEN[name, with_imatrix]


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_quantize_ref_bytes_match_oracle(name):
    for W, imatrix in CASES:
        W = W[:, : W.shape[1] // ggml.block_size(name) * ggml.block_size(name)]
        assert np.array_equal(ggml.pack(name, ggml.quantize_ref(name, W, imatrix)), ORACLES[name](name, W, imatrix))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("with_imatrix", [False, True])
def test_fit_round_split(name, with_imatrix):
    W = weights(12, 512, seed=7)
    imatrix = np.random.default_rng(8).exponential(1, 512).astype(np.float32) if with_imatrix else None
    ref = ggml.quantize_ref(name, W, imatrix)
    params = ggml.fit(name, W, imatrix)
    assert np.array_equal(params.d.view(np.uint16), ref.d.view(np.uint16))
    codes = ggml.round_codes(name, W, params)
    scale, offset = ggml.scale_offset(name, params)
    assert same_values(scale * codes.astype(np.float32) - offset,
                       ggml.dequantize(name, ggml.GGMLBlocks(**vars(params), codes=codes)))
    if name in KQUANTS:   # llama.cpp requantizes with the stored parameters: same codes where the scale is non-zero
        assert np.array_equal(np.where(scale != 0, codes, 0), np.where(scale != 0, ref.codes, 0))
        assert (scale != 0).mean() > 0.75
    else:                 # codes of the search (fp32 scale) vs the nearest point of the stored grid: never farther
        normal = np.repeat(np.abs(params.d.astype(np.float32)) >= 2.0**-14, 32, axis=1)  # d not subnormal
        assert np.abs(codes.astype(int) - ref.codes)[normal].max() <= 1 and (codes != ref.codes).any()
        y_ref, y = ggml.dequantize(name, ref), scale * codes - offset
        assert (np.abs(y - W) <= np.abs(y_ref - W) + 1e-6 * np.abs(W).max(axis=1, keepdims=True)).all()
    assert np.array_equal(ggml.dequantize(name, ggml.GGMLBlocks(**vars(params), codes=ref.codes)),
                          ggml.dequantize(name, ref))
    # column by column, as a GPTQ loop rounds: the same codes
    cols = slice(100, 101)
    assert np.array_equal(ggml.round_codes(name, W[:, cols], params, columns=cols), codes[:, cols])
    assert same_bits(ggml.scale_offset(name, params, columns=[3, 300])[1], offset[:, [3, 300]])


@pytest.mark.parametrize("name", KQUANTS)
def test_k_fit_is_per_super_block(name):
    """Fitting a 256-column slice gives that slice's parameters (what a block-wise GPTQ relies on)."""
    W = weights(8, 768, seed=9)
    imatrix = np.random.default_rng(10).exponential(1, 768).astype(np.float32)
    whole, part = ggml.quantize_ref(name, W, imatrix), ggml.quantize_ref(name, W[:, 256:512], imatrix[256:512])
    assert np.array_equal(whole.d[:, 1:2].view(np.uint16), part.d.view(np.uint16))
    assert np.array_equal(whole.scales[:, 1:2], part.scales) and np.array_equal(whole.codes[:, 256:512], part.codes)


def _naive(W, group, lo, hi, asym):
    """Per-group min/max (asym) or max-abs (sym) rounding with fp32 parameters: the baseline a search must beat."""
    X = W.reshape(-1, group).astype(np.float64)
    if asym:
        mn = X.min(axis=1, keepdims=True)
        s = (X.max(axis=1, keepdims=True) - mn) / (hi - lo)
        return (np.clip(np.round((X - mn) / s), lo, hi) * s + mn).reshape(W.shape)
    s = np.abs(X).max(axis=1, keepdims=True) / -lo
    return (np.clip(np.round(X / s), lo, hi) * s).reshape(W.shape)


@pytest.mark.parametrize("name,group,lo,hi,asym", [("Q2_K", 16, 0, 3, True), ("Q3_K", 16, -4, 3, False),
                                                   ("Q4_K", 32, 0, 15, True), ("Q5_K", 32, 0, 31, True),
                                                   ("Q6_K", 16, -32, 31, False)])
def test_k_quants_beat_naive_rounding(name, group, lo, hi, asym):
    W = np.random.default_rng(11).standard_normal((32, 1024)).astype(np.float32)
    b = ggml.quantize_ref(name, W)
    assert b.codes.min() >= lo and b.codes.max() <= hi
    rel = lambda Y: np.linalg.norm(Y - W) / np.linalg.norm(W)
    err, naive = rel(ggml.dequantize(name, b)), rel(_naive(W, group, lo, hi, asym))
    assert err < naive, (err, naive)
    assert err > 0.5 * naive                              # a grid of that many levels cannot do much better


@pytest.mark.parametrize("name", ALL)
def test_imatrix_weights_the_error(name):
    """With an importance matrix the quantizers trade error on unimportant columns for the important ones (the
    _impl paths); Q8_0 has none and ignores it."""
    rng = np.random.default_rng(12)
    W = rng.standard_normal((16, 512)).astype(np.float32)
    imatrix = np.where(rng.random(512) < 0.1, 100.0, 1.0).astype(np.float32)
    plain, weighted = ggml.quantize_ref(name, W), ggml.quantize_ref(name, W, imatrix)
    err = lambda b: float((imatrix * (ggml.dequantize(name, b) - W) ** 2).sum())
    if name == "Q8_0":
        assert np.array_equal(ggml.pack(name, plain), ggml.pack(name, weighted))
    else:
        assert err(weighted) < 0.8 * err(plain)
