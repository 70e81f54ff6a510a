"""Bit-exact tests for kernels/packing.py, including equality with auto-round's own packers."""

from __future__ import annotations

import pytest
import torch

from compress.kernels.packing import gptq_pack, gptq_unpack, pack, packable, unpack
from compress.primitives import rtn
from compress.qweight import QuantizedWeight

BITS = (2, 3, 4, 8)
pytestmark = pytest.mark.filterwarnings("ignore:To copy construct:UserWarning")  # auto-round 3-bit packer


def random_qw(bits, sym, group_size=32, out_f=64, in_f=128, seed=0) -> QuantizedWeight:
    """Random codes and zeros; fp16-exact scales of both signs (full-range sym can be negative)."""
    g = torch.Generator().manual_seed(seed)
    n_groups = -(-in_f // (in_f if group_size == -1 else group_size))
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g).to(torch.uint8)
    scales = (torch.randn(out_f, n_groups, generator=g) * 0.01).half().float()
    if sym:
        zeros = torch.full((out_f, n_groups), 2 ** (bits - 1), dtype=torch.uint8)
    else:
        zeros = torch.randint(0, 2**bits, (out_f, n_groups), generator=g).to(torch.uint8)
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits, group_size=group_size, sym=sym)


def assert_qw_equal(a: QuantizedWeight, b: QuantizedWeight):
    assert (a.bits, a.group_size, a.sym) == (b.bits, b.group_size, b.sym)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.zeros, b.zeros)
    assert torch.equal(a.scales, b.scales)


# -- bitstream ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
def test_pack_roundtrip(bits):
    v = torch.randint(0, 2**bits, (3, 5, 96))
    p = pack(v, bits)
    assert p.dtype == torch.int32 and p.shape == (3, 5, 96 * bits // 32)
    u = unpack(p, bits, 96)
    assert u.dtype == torch.uint8 and torch.equal(u, v.to(torch.uint8))


def test_pack_known_words():
    # 4-bit: value j in nibble j, LSB first; 0xF in the top nibble makes the word negative
    v = torch.tensor([1, 2, 3, 4, 5, 6, 7, 15])
    assert pack(v, 4).item() == torch.tensor(0xF7654321 - 2**32).item()
    # 3-bit: v10 straddles words 0/1 (low 2 bits at 30-31, high bit at word 1 bit 0)
    v = torch.zeros(32, dtype=torch.int64)
    v[10] = 0b101
    assert pack(v, 3).tolist() == [1 << 30, 1, 0]
    v = torch.zeros(32, dtype=torch.int64)
    v[21] = 0b110  # low bit at word 1 bit 31, high 2 bits at word 2 bits 0-1
    assert pack(v, 3).tolist() == [0, 0, 0b11]


def test_pack_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack(torch.zeros(3, 10, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pack(torch.full((16,), 4), 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        pack(torch.zeros(32, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="do not hold"):
        unpack(torch.zeros(4, dtype=torch.int32), 4, 16)


@pytest.mark.parametrize("bits", (2, 3, 4, 5, 6, 7, 8))
def test_pack_equals_auto_round_bitstream(bits):
    from auto_round.utils.bit_packing import pack_bitstream

    v = torch.randint(0, 2**bits, (7, 128))
    assert torch.equal(pack(v, bits), pack_bitstream(v, bits, dim=-1))


# -- GPTQ layout --------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sym", (True, False))
@pytest.mark.parametrize("v1", (True, False))
@pytest.mark.parametrize("group_size", (32, -1))
def test_gptq_roundtrip(bits, sym, v1, group_size):
    qw = random_qw(bits, sym, group_size, seed=bits)
    t = gptq_pack(qw, v1)
    K, N, G = qw.in_features, qw.out_features, qw.n_groups
    assert t["qweight"].shape == (K * bits // 32, N) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (G, N * bits // 32) and t["qzeros"].dtype == torch.int32
    assert t["scales"].shape == (G, N) and t["scales"].dtype == torch.float16
    assert t["g_idx"].shape == (K,) and t["g_idx"].dtype == torch.int32
    assert (t["scales"] < 0).any()  # negative scales survive
    assert_qw_equal(gptq_unpack(t, bits, group_size, sym, v1), qw)


def test_gptq_v1_sym_zero_word():
    # classic AutoGPTQ sym 4-bit: zero 8 is stored as 7 in every nibble
    t = gptq_pack(random_qw(4, True), v1=True)
    assert (t["qzeros"] == 0x77777777).all()
    t = gptq_pack(random_qw(4, True), v1=False)
    assert (t["qzeros"] == torch.tensor(0x88888888 - 2**32, dtype=torch.int64).to(torch.int32)).all()


def test_gptq_short_last_group():
    qw = rtn(torch.randn(32, 96), 4, 64, sym=False)  # groups of 64 and 32 columns
    assert qw.n_groups == 2
    assert_qw_equal(gptq_unpack(gptq_pack(qw, False), 4, 64, False, False), qw)


def test_packable_and_errors():
    assert packable(random_qw(4, True, out_f=64, in_f=128))
    assert not packable(random_qw(4, True, out_f=172, in_f=64))  # 172*4 % 32 != 0
    assert not packable(random_qw(3, True, out_f=64, in_f=96 + 8))
    with pytest.raises(ValueError, match="does not fit"):
        gptq_pack(random_qw(4, True, group_size=-1, out_f=172, in_f=64), v1=True)
    qw = random_qw(4, False)
    bad = QuantizedWeight(codes=qw.codes, scales=qw.scales + 1e-9, zeros=qw.zeros, bits=4, group_size=32, sym=False)
    with pytest.raises(ValueError, match="fp16"):
        gptq_pack(bad, v1=False)
    t = gptq_pack(qw, v1=False)
    t["g_idx"] = t["g_idx"].flip(0)
    with pytest.raises(ValueError, match="act-order"):
        gptq_unpack(t, 4, 32, False, False)


# -- equality with auto-round's QuantLinear packers -------------------------------------------

def auto_round_pack(qw: QuantizedWeight, v1: bool) -> dict[str, torch.Tensor]:
    """Pack with auto-round's own QuantLinear (qlinear_torch_zp = v1, qlinear_torch = v2)."""
    if v1:
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    else:
        from auto_round_extension.torch.qlinear_torch import QuantLinear
    layer = QuantLinear(qw.bits, qw.group_size, qw.in_features, qw.out_features, bias=False)
    layer.device = torch.device("cpu")
    linear = torch.nn.Linear(qw.in_features, qw.out_features, bias=False)
    linear.weight.data = qw.dequantize()
    layer.pack(linear, qw.scales, qw.zeros.to(torch.int32), None, device="cpu")
    return {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sym", (True, False))
def test_gptq_pack_equals_auto_round(bits, sym):
    # auto-round's v1 packer clamps zero-1 at 0 (cannot hold zero 0), so v1 is compared on zeros >= 1
    qw = random_qw(bits, sym, seed=10 + bits)
    if not sym:
        qw = QuantizedWeight(codes=qw.codes, scales=qw.scales, zeros=qw.zeros.clamp(min=1), bits=bits,
                             group_size=32, sym=False)
    for v1 in (True, False):
        ours, theirs = gptq_pack(qw, v1), auto_round_pack(qw, v1)
        for k in ("qweight", "qzeros", "scales"):
            assert torch.equal(ours[k], theirs[k]), (k, v1)


@pytest.mark.parametrize("bits", BITS)
def test_gptq_unpack_matches_auto_round_forward(bits):
    """auto-round's own dequantizing forward on our packed tensors reproduces W_hat = dequantize()."""
    from auto_round_extension.torch.qlinear_torch import QuantLinear

    qw = random_qw(bits, sym=False, seed=20 + bits)
    layer = QuantLinear(bits, 32, qw.in_features, qw.out_features, bias=False)
    t = gptq_pack(qw, v1=False)
    layer.qweight, layer.qzeros, layer.scales = t["qweight"], t["qzeros"], t["scales"].float()
    x = torch.eye(qw.in_features)
    assert torch.equal(layer(x), qw.dequantize().T)
