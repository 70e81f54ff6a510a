"""export_hf / read_quantized: tiny Llamas and stories260K, reloaded with transformers + auto-round only."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import STORIES260K
from helpers import check_reload, in_blocks, quantize_model
from tiny import tiny_llama
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from compress.export.hf import export_hf, read_quantized

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("group_size", (32, -1))
@pytest.mark.parametrize("sym", (True, False))
@pytest.mark.parametrize("bits", (2, 4, 8))
def test_tiny_llama_roundtrip(tmp_path, bits, sym, group_size):
    """The default packing (GPTQ v1 for sym, AWQ for asym 4/8, GPTQ v2 for asym 2) reads back bit-exactly; the
    transformers-loadable packing (`auto_round`, GPTQ v2) reloads in transformers with auto-round's torch loader."""
    model = tiny_llama(seed=bits)
    qweights = quantize_model(model, in_blocks((bits, group_size, sym)))
    if sym:
        assert any((qw.scales < 0).any() for qw in qweights.values())  # full-range sym: negative scales
    out = tmp_path / "ckpt"
    result = export_hf(model, qweights, None, out, meta={"recipe_hash": "abc"})
    assert result["bytes"] == sum(Path(f).stat().st_size for f in result["files"]) > 0
    expected = "auto_round:auto_gptq" if sym else ("auto_round:auto_awq" if bits in (4, 8) else "auto_round")
    assert result["packing"] == expected and (result["serving"] is None) == (sym or bits in (4, 8))
    config, back = read_quantized(out)
    assert_same(back, qweights)
    qc = config["quantization_config"]
    assert qc["packing_format"] == expected
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["data_type"]) == (bits, group_size, sym, "int")
    assert qc["block_name_to_quantize"] == "model.layers" and "extra_config" not in qc
    assert config["compress"] == {"format": "auto_round", "version": 1, "meta": {"recipe_hash": "abc"}}
    assert config["dtype"] == "float16"
    with open(out / "model.safetensors", "rb") as f:  # non-quantized tensors in fp16 (the default), scales fp16
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["model.norm.weight"]["dtype"] == "F16"
    assert header["model.layers.0.self_attn.q_proj.scales"]["dtype"] == "F16"
    assert "model.layers.0.self_attn.q_proj.weight" not in header
    if not sym:  # what transformers + auto-round (no kernel package) loads: GPTQ v2
        export_hf(model, qweights, None, out, packing="auto_round", dtype="float32")
        assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    check_reload(model, qweights, out, 128)


def assert_same(back: dict, qweights: dict) -> None:
    assert set(back) == set(qweights)
    for name, qw in back.items():
        orig = qweights[name]
        assert (qw.bits, qw.group_size, qw.sym, qw.chunk_bits) == (orig.bits, orig.group_size, orig.sym,
                                                                   orig.chunk_bits), name
        assert torch.equal(qw.codes, orig.codes) and torch.equal(qw.zeros, orig.zeros), name
        assert torch.equal(qw.scales, orig.scales), name


def test_unpackable_intermediate_172(tmp_path, caplog):
    model = tiny_llama(intermediate_size=172)
    qweights = quantize_model(model, in_blocks((4, 32, False)))
    with caplog.at_level(logging.WARNING, logger="compress.export.hf"):
        res = export_hf(model, qweights, None, tmp_path / "ckpt", packing="auto_round")
    mlp = {n for n in qweights if ".mlp." in n}
    logged = [r.getMessage() for r in caplog.records if r.name == "compress.export.hf"]
    assert len(logged) == 1 and f"{len(mlp)} of {len(qweights)} quantized layers are written dense" in logged[0]
    assert res["dense_layers"] == len(mlp)
    config, back, loaded = check_reload(model, qweights, tmp_path / "ckpt", 128)
    assert set(back) == set(qweights) - mlp
    extra = config["quantization_config"]["extra_config"]
    assert all(extra[n] == {"bits": 16, "data_type": "fp"} for n in mlp)
    assert all(type(loaded.get_submodule(n)) is torch.nn.Linear for n in mlp)


def test_mixed_schemes_tied_lm_head_bias(tmp_path):
    """Per-layer bits/groups/sym in extra_config, an unquantized block linear, a quantized tied lm_head,
    biases; one asym layer switches the checkpoint to real zero points ("auto_round")."""
    model = tiny_llama(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    schemes = [(2, 32, True), (4, 32, False), (8, -1, True), (3, 64, True), (4, 16, False), (2, 32, True)]
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    plan = {n: schemes[i % len(schemes)] for i, n in enumerate(names) if n != "model.layers.1.self_attn.v_proj"}
    plan["lm_head"] = (8, 32, True)
    qweights = quantize_model(model, plan.get)
    export_hf(model, qweights, None, tmp_path / "ckpt")
    assert_same(read_quantized(tmp_path / "ckpt")[1], qweights)
    export_hf(model, qweights, None, tmp_path / "ckpt", packing="auto_round")
    config, back, _ = check_reload(model, qweights, tmp_path / "ckpt", 128)
    assert set(back) == set(qweights)
    qc = config["quantization_config"]
    assert qc["packing_format"] == "auto_round" and config["tie_word_embeddings"] is False
    assert qc["extra_config"]["model.layers.1.self_attn.v_proj"] == {"bits": 16, "data_type": "fp"}
    assert qc["extra_config"]["lm_head"] == {"bits": 8, "group_size": 32, "sym": True, "data_type": "int"}


def test_stories260k_w4_g32_asym(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(STORIES260K).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
    qweights = quantize_model(model, in_blocks((4, 32, False)))
    out = tmp_path / "stories-w4g32"
    export_hf(model, qweights, tokenizer, out, packing="auto_round")
    _, back, _ = check_reload(model, qweights, out, model.config.vocab_size)
    assert set(back) == {n for n in qweights if ".self_attn." in n}  # 172-wide MLP stays dense
    reloaded_tok = AutoTokenizer.from_pretrained(out)
    text = "Once upon a time"
    assert reloaded_tok(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_fake_format_and_replace(tmp_path):
    model = tiny_llama()
    qweights = quantize_model(model, in_blocks((4, 32, True)))
    out = tmp_path / "ckpt"
    export_hf(model, qweights, None, out, fmt="auto_round")
    export_hf(model, qweights, None, out, fmt="fake", meta={"k": 1}, dtype="float32")  # replaces the previous one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary siblings left
    config, back = read_quantized(out)
    assert back == {} and "quantization_config" not in config
    assert config["compress"] == {"format": "fake", "version": 1, "meta": {"k": 1}}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_errors(tmp_path):
    model = tiny_llama()
    qweights = quantize_model(model, in_blocks((4, 32, True)))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError):
        export_hf(model, qweights, None, tmp_path / "busy")
    with pytest.raises(ValueError, match="unknown export format"):
        export_hf(model, qweights, None, tmp_path / "x", fmt="gguf")
    with pytest.raises(ValueError, match="not a module"):
        export_hf(model, {"model.nope": next(iter(qweights.values()))}, None, tmp_path / "x")
    with pytest.raises(ValueError, match="JSON"):
        export_hf(model, qweights, None, tmp_path / "x", meta={"t": torch.zeros(1)})
    assert not (tmp_path / "x").exists()
    export_hf(model, qweights, None, tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    config["compress"]["version"] = 99
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="version 99"):
        read_quantized(tmp_path / "ok")


def test_read_quantized_reads_auto_rounds_own_export(tmp_path):
    """A sym checkpoint written by auto-round itself (RTN, iters=0) reads back to QuantizedWeights whose
    dequantization equals what auto-round's loader computes, negative scales included."""
    from auto_round import AutoRound

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=512, max_position_embeddings=64)  # the vocab covers the stories tokenizer
    model = LlamaForCausalLM(cfg).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
    ar = AutoRound(model, tokenizer, bits=4, group_size=32, sym=True, iters=0, disable_opt_rtn=True,
                   dataset=["once upon a time"] * 4, nsamples=2, seqlen=8, device_map="cpu")
    ar.quantize_and_save(str(tmp_path / "ar"), format="auto_round")
    out = next((tmp_path / "ar").rglob("config.json")).parent
    config, qweights = read_quantized(out)
    assert config["quantization_config"]["packing_format"] == "auto_round:auto_gptq" and len(qweights) == 7
    assert any((qw.scales < 0).any() for qw in qweights.values())
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.nn.Module.float(loaded)
    for name, qw in qweights.items():
        module = loaded.get_submodule(name)
        with torch.no_grad():
            assert torch.equal(module(torch.eye(qw.in_features)), qw.dequantize().T), name
