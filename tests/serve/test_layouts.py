"""The hf export's layouts (compress/export/layouts.py): every packing round-trips bit-exactly, containers keep the
weights, the AWQ layout is AutoAWQ's, and the checkpoint-level choices (packing, containers, dtype) are what the
engines need."""

import json

import pytest
import torch
from helpers import quantize_model
from tiny import tiny_llama

from compress.export import layouts
from compress.export.hf import export_hf, read_quantized
from compress.kernels.packing import awq_pack, awq_unpack
from compress.primitives import rtn
from compress.qweight import QuantizedWeight

W = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))


def mixed(sym: bool) -> QuantizedWeight:
    """Chunks of 128 columns at 4 and 2 bits (group 64)."""
    q4, q2 = rtn(W, 4, 64, sym), rtn(W, 2, 64, sym)
    codes, zeros, scales = q4.codes.clone(), q4.zeros.clone(), q4.scales.clone()
    codes[:, 128:], zeros[:, 2:], scales[:, 2:] = q2.codes[:, 128:], q2.zeros[:, 2:], q2.scales[:, 2:]
    return QuantizedWeight(codes, scales, zeros, 4, 64, sym, chunk_size=128, chunk_bits=(4, 2))


def same(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    return (a.bits, a.group_size, a.sym, a.chunk_bits) == (b.bits, b.group_size, b.sym, b.chunk_bits) and \
        torch.equal(a.codes, b.codes) and torch.equal(a.zeros, b.zeros) and torch.equal(a.scales, b.scales)


def test_awq_layout_is_autoawqs():
    """AutoAWQ's packing loop (WQLinear_GEMM.from_linear), written out: column col*8 + order[i] in nibble i."""
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    qw = QuantizedWeight(codes, torch.ones(16, 1), torch.randint(0, 16, (16, 1), dtype=torch.uint8), 4, -1, False)
    intweight = codes.T.to(torch.int64)
    ref = torch.zeros(64, 2, dtype=torch.int64)
    for col in range(2):
        for i, c in enumerate([0, 2, 4, 6, 1, 3, 5, 7]):
            ref[:, col] |= intweight[:, col * 8 + c] << (i * 4)
    ref = torch.where(ref >= 2**31, ref - 2**32, ref).to(torch.int32)
    assert torch.equal(awq_pack(qw)["qweight"], ref)


@pytest.mark.parametrize("bits", (4, 8))
def test_awq_round_trip(bits):
    qw = rtn(W, bits, 64, False)
    t = awq_pack(qw)
    assert t["qweight"].shape == (256, 64 * bits // 32) and t["qzeros"].shape == (4, 64 * bits // 32)
    assert same(awq_unpack(t, bits, 64, False), qw)
    with pytest.raises(ValueError, match="AWQ layout holds"):
        awq_pack(rtn(W, 3, 64, False))


LAYOUTS = [(p, True) for p in ("auto_round:auto_gptq", "auto_round:auto_awq", "auto_round", "gptq")] + [
    (p, False) for p in ("auto_round:auto_awq", "auto_round")]  # GPTQ v1 holds symmetric layers only


@pytest.mark.parametrize("packing,sym", LAYOUTS)
@pytest.mark.parametrize("kind", ("uniform-3-in-4", "uniform-4", "mixed-4-2"))
def test_every_layout_round_trips(packing, sym, kind):
    qw = {"uniform-3-in-4": rtn(W, 3, 64, sym), "uniform-4": rtn(W, 4, 64, sym), "mixed-4-2": mixed(sym)}[kind]
    container = 4
    t = layouts.pack(qw, packing, container)
    chunks = {"chunk_size": 128, "chunk_bits": [4, 2], "map_bits": 0} if qw.mixed else None
    back = layouts.unpack(t, packing, {"bits": container, "group_size": 64, "sym": sym}, chunks,
                          None, qw.bits if qw.bits != container else None)
    assert same(back, qw)
    stored = layouts.widen(qw, container)
    assert torch.equal(stored.dequantize(), qw.dequantize())  # a container keeps the weights
    if sym:  # every stored zero is the container's own: an engine that never reads zeros gets it right
        assert (stored.zeros == 2 ** (container - 1)).all()


def test_choose():
    s4, a4, a3 = rtn(W, 4, 64, True), rtn(W, 4, 64, False), rtn(W, 3, 64, False)
    assert layouts.choose({"a": s4}) == ("auto_round:auto_gptq", None)
    assert layouts.choose({"a": s4, "b": a4}) == ("auto_round:auto_awq", None)
    packing, why = layouts.choose({"a": a3})
    assert packing == "auto_round" and "vLLM refuses" in why
    assert layouts.choose({"a": a3}, wide={"a": 4})[0] == "auto_round:auto_awq"  # 3 bits in a 4-bit container
    assert layouts.choose({"a": s4}, "gptq") == ("gptq", None)
    with pytest.raises(ValueError, match="symmetric layers only"):
        layouts.choose({"a": a4}, "gptq")
    with pytest.raises(ValueError, match="holds"):
        layouts.choose({"a": a3}, "awq")


def test_containers_follow_vllms_fused_layers():
    q3, q4 = rtn(W, 3, 64, True), rtn(W, 4, 64, True)
    packed = {"m.layers.0.self_attn.q_proj": q3, "m.layers.0.self_attn.k_proj": q4, "m.layers.0.self_attn.v_proj": q3,
              "m.layers.0.self_attn.o_proj": q3, "m.layers.0.mlp.experts.0.up_proj": q3,
              "m.layers.0.mlp.experts.1.up_proj": q4}
    assert layouts.containers(packed) == {"m.layers.0.self_attn.q_proj": 4, "m.layers.0.self_attn.v_proj": 4}
    assert set(layouts.containers(packed, 4)) == {n for n, q in packed.items() if q.bits == 3}
    assert layouts.fused_group("m.layers.0.mlp.experts.7.down_proj") == "m.layers.0.mlp.experts"


def test_mixed_model_checkpoint(tmp_path):
    """A tiny Llama with 3-bit q/v beside a 4-bit k, and a plain GPTQ checkpoint: the config declares the
    containers, the meta restores each layer, the dtype is float16 unless asked otherwise."""
    model = tiny_llama()
    plan = {n: (3 if n.endswith(("q_proj", "v_proj")) else 4, 32, True) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")}
    qweights = quantize_model(model, plan.get)
    res = export_hf(model, qweights, None, tmp_path / "ar")
    config, back = read_quantized(tmp_path / "ar")
    assert all(same(back[n], q) for n, q in qweights.items())
    assert res["packing"] == "auto_round:auto_gptq" and "extra_config" not in config["quantization_config"]
    assert set(config["compress"]["meta"]["widened"]) == {n for n in plan if plan[n][0] == 3}
    export_hf(model, qweights, None, tmp_path / "gptq", packing="gptq", dtype="bfloat16")
    config, back = read_quantized(tmp_path / "gptq")
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["desc_act"], config["dtype"]) == ("gptq", 4, False, "bfloat16")
    assert all(same(back[n], q) for n, q in qweights.items())
    header = json.loads((tmp_path / "gptq" / "model.safetensors").read_bytes()[8:][:int.from_bytes(
        (tmp_path / "gptq" / "model.safetensors").read_bytes()[:8], "little")])
    assert header["model.norm.weight"]["dtype"] == "BF16"
