"""ONNX export with MatMulNBits: onnxruntime reproduces the in-memory quantized model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import MODELS, TEXT, invoke
from helpers import load, op_types, ort_logits, quantized, rel_err
from tiny import tiny_causal
from transformers import AutoModelForCausalLM

from compress.errors import BadInput
from compress.export.onnx import export_onnx, pack_lsb
from compress.kernels.backends import quantize_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("name,bits,group,sym", [
    *(pytest.param(*case, marks=pytest.mark.slow) for case in  # each trace costs seconds: in the slow tier (the
      # default tier exports stories260K in test_rotate.py, test_groups.py and the KV-cache test below)
      [("stories260K", 4, 32, True), ("stories260K", 2, 32, False), ("stories260K", 8, -1, False), ("ref-llama-7m", 4, 128, True),
       ("ref-llama-7m", 2, 64, False)]),
])
def test_onnx_matches_quantized_model(name, bits, group, sym, tmp_path):
    model = load(name)
    qweights = quantized(model, bits, group, sym)
    res = export_onnx(model, qweights, tmp_path)
    assert res["dense_layers"] == 0
    assert op_types(res["path"])["MatMulNBits"] == len(qweights) == 7 * model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    out = ort_logits(res["path"], ids)
    with torch.no_grad():
        ref = model(ids).logits.numpy()
        quantize_model(model, qweights)  # the same model running our kernels
        ours = model(ids).logits.numpy()
    assert rel_err(out, ref) < 1e-3 and rel_err(out, ours) < 1e-3
    props = {p.key: p.value for p in onnx.load(res["path"], load_external_data=False).metadata_props}
    assert props["compress.format"] == "onnx-matmulnbits" and json.loads(props["compress.meta"])["version"] == 1


def test_a_graph_past_the_protobuf_limit_writes_external_data(tmp_path, monkeypatch):
    """Past EXTERNAL_DATA_BYTES (1.5 GB, below protobuf's 2 GiB) the tensors go to model.onnx.data; onnxruntime
    loads the pair. The threshold is lowered here so a tiny model crosses it."""
    import compress.export.onnx as ox

    monkeypatch.setattr(ox, "EXTERNAL_DATA_BYTES", 1000)
    model = tiny_causal("llama")
    qweights = quantized(model, 4, 32, True)
    res = export_onnx(model, qweights, tmp_path)
    graph, data = tmp_path / "model.onnx", tmp_path / "model.onnx.data"
    assert data.stat().st_size > 2 * graph.stat().st_size and res["bytes"] == graph.stat().st_size + data.stat().st_size
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        quantize_model(model, qweights)
        assert rel_err(ort_logits(res["path"], ids), model(ids).logits.numpy()) < 1e-3


def test_unexpressible_layers_are_dense_and_logits_still_match(tmp_path, caplog):
    model = tiny_causal("llama")
    qweights = quantized(model, 3, 32, False)  # MatMulNBits here: bits 2, 4, 8
    res = export_onnx(model, qweights, tmp_path)
    assert res["dense_layers"] == len(qweights) and "MatMulNBits" not in op_types(res["path"])
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert rel_err(ort_logits(res["path"], ids), model(ids).logits.numpy()) < 1e-4


def test_qkv_bias_model(tmp_path):
    model = tiny_causal("qwen2")
    qweights = quantized(model, 4, 32, True)
    res = export_onnx(model, qweights, tmp_path)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        assert rel_err(ort_logits(res["path"], ids), model(ids).logits.numpy()) < 1e-3


def test_pack_lsb_first_value_low_bits():
    assert pack_lsb(np.array([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack_lsb(np.array([0xA, 0x5]), 4).tolist() == [0x5A]


def test_an_encoder_is_refused(tmp_path):
    from tiny import tiny_bert

    with pytest.raises(BadInput, match="writes causal language models"):
        export_onnx(tiny_bert(), {}, tmp_path)


@pytest.mark.slow  # a run exporting onnx: tests/quantize/test_groups.py runs one in the default tier
def test_recipe_exports_onnx(tmp_path):
    """`export: formats: [fake, onnx]` through `compress run`: the ONNX logits match the dequantized checkpoint."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""version: 1
model: {{path: {MODELS / 'stories260K'}, dtype: float32}}
calibration: {{sources: [{TEXT / 'tinystories' / 'tinystories_val.txt'}], nsamples: 4, seqlen: 32}}
stages:
  - {{stage: quantize, method: rtn, bits: 4, group_size: 32, sym: false}}
export:
  formats: [fake, onnx]
""")
    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe, "--output", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    onnx_path = report["exports"]["onnx"]
    fake = AutoModelForCausalLM.from_pretrained(report["exports"]["fake"], dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        assert rel_err(ort_logits(onnx_path, ids), fake(ids).logits.numpy()) < 1e-3


def ort_decode_inputs(model, ids, mask, past=None):
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    for i in range(cfg.num_hidden_layers):
        for j, kv in enumerate(("key", "value")):
            feed[f"past_key_values.{i}.{kv}"] = (past[2 * i + j] if past is not None else
                                                 np.zeros((ids.shape[0], cfg.num_key_value_heads, 0, hd), np.float32))
    return feed


@pytest.mark.parametrize("name,bits,group", [pytest.param("stories260K", 4, 32, marks=pytest.mark.slow),
                                             pytest.param("ref-llama-7m", 2, 64, marks=pytest.mark.slow)])
def test_onnx_kv_cache_decodes_incrementally(name, bits, group, tmp_path):
    """Prefill, then one token per call with the returned present key values: each step's logits equal
    the full forward's at that position; a padded (attention_mask 0) tail changes nothing before it."""
    model = load(name)
    qweights = quantized(model, bits, group, True)
    res = export_onnx(model, qweights, tmp_path, kv_cache=True)
    sess = ort.InferenceSession(res["path"], providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]
    assert outputs[0] == "logits" and len(outputs) == 1 + 2 * model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits.numpy()
    out = sess.run(None, ort_decode_inputs(model, ids[:, :9], torch.ones(2, 9, dtype=torch.int64)))
    assert rel_err(out[0], full[:, :9]) < 1e-4
    for t in range(9, 14):
        out = sess.run(None, ort_decode_inputs(model, ids[:, t : t + 1], torch.ones(2, t + 1, dtype=torch.int64),
                                               out[1:]))
        assert out[1].shape[2] == t + 1
        assert rel_err(out[0][:, 0], full[:, t]) < 1e-4, t
    mask = torch.ones(2, 14, dtype=torch.int64)
    mask[1, 10:] = 0  # row 1: 10 real tokens, then padding
    padded = sess.run(["logits"], ort_decode_inputs(model, ids, mask))[0]
    with torch.no_grad():
        short = model(ids[1:, :10]).logits.numpy()
    assert rel_err(padded[1:, :10], short) < 1e-4 and rel_err(padded[:1], full[:1]) < 1e-4


@pytest.mark.parametrize("positions,rope", [pytest.param(32768, None, marks=pytest.mark.slow),
                                            pytest.param(131072, None, marks=pytest.mark.slow),
                                            pytest.param(131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192, "rope_theta": 5e5}, marks=pytest.mark.slow)])
def test_long_context_models_export_without_position_tables(positions, rope, tmp_path):
    """The causal mask and the rotary angles are computed in the graph: the file holds the weights, not a
    positions x positions mask (64 GiB at 128k positions) or a positions x head_dim table, and positions far
    past the first ones still match transformers."""
    cfg = {"max_position_embeddings": positions, **({"rope_parameters": rope} if rope else {})}
    model = tiny_causal("llama", **cfg)
    weights = sum(p.numel() * 4 for p in model.parameters())
    qweights = quantized(model, 4, 32, True)
    res = export_onnx(model, qweights, tmp_path)
    assert res["bytes"] < weights  # packed int4 block linears, fp32 embeddings, head and norms
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        quantize_model(model, qweights)
        ref = model(ids).logits.numpy()
    assert rel_err(ort_logits(res["path"], ids), ref) < 1e-3
    kv = export_onnx(model, qweights, tmp_path / "kv", kv_cache=True)
    sess = ort.InferenceSession(kv["path"], providers=["CPUExecutionProvider"])
    past = positions - 4  # the last positions the model has: rotary angles of large positions
    n_kv, hd = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    feeds = {"input_ids": ids[:, :2].numpy(), "attention_mask": np.ones((1, past + 2), np.int64)}
    for i in range(model.config.num_hidden_layers):
        for k in ("key", "value"):
            feeds[f"past_key_values.{i}.{k}"] = np.zeros((1, n_kv, past, hd), np.float32)
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, feeds)))
    assert out["present.0.key"].shape[2] == past + 2
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(model.config.num_hidden_layers):
        cache.update(torch.zeros(1, n_kv, past, hd), torch.zeros(1, n_kv, past, hd), i)
    with torch.no_grad():
        ref = model(ids[:, :2], past_key_values=cache, attention_mask=torch.ones(1, past + 2, dtype=torch.long),
                    position_ids=torch.tensor([[past, past + 1]])).logits.numpy()
    assert rel_err(out["logits"], ref) < 1e-3
