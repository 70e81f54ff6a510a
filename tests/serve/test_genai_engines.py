"""The GenAI engines on a run's exports: `compress run` writes `onnx` and `openvino` with `kv_cache: true`, and
ONNX Runtime GenAI (`compress/serve/engines/ort_genai.py`) and OpenVINO GenAI's LLMPipeline
(`compress/serve/engines/openvino_genai.py`) greedy-decode the prompts to the tokens transformers decodes on the same
dequantized weights (the run's `fake` export, fp32), and so does the stateless IR (explicit past/present inputs).
Each family is a tiny random model with stories260K's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CAL, invoke
from tiny import config_of, save_tiny

from compress.serve.decoded import N_TOKENS, PROMPTS, TOP_K, Decoded, compare

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # stories260K's; some tiny configs have none
FAST = ("llama", "qwen3_moe")  # the default tier: a dense and a routed family; the others in the slow tier
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "granite", "gemma2", "gemma3_text", "phi3", "olmo2", "mixtral",
            "qwen2_moe", "qwen3_moe", "deepseek_v3"]
NO_ORT_GENAI = {"deepseek_v3"}  # keys and values of different widths: refused at plan time (test below)


def _fake_export() -> dict:
    """The dequantized checkpoint in the model's fp32 (an export `dtype`, where the format has one)."""
    from compress.export.stage import FakeExportConfig

    return {"format": "fake", **({"dtype": "float32"} if "dtype" in FakeExportConfig.model_fields else {})}


def _model(tmp_path, model_type: str):
    extra = {"original_max_position_embeddings": 256} if model_type == "phi3" else {}
    layers = {} if model_type == "deepseek_v3" else {"num_hidden_layers": 1}  # its block 1 holds the experts
    ids = IDS if config_of(model_type).eos_token_id is None else {}
    return save_tiny(model_type, tmp_path / model_type, **ids, **layers, **extra)


def _run(tmp_path, model, formats: list) -> tuple[int, str, str]:
    doc = {"version": 1, "model": {"path": str(model), "dtype": "float32"},
           "calibration": {"sources": [str(CAL)], "nsamples": 4, "seqlen": 32},
           "stages": [{"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32}],
           "eval": {"enabled": False}, "export": {"formats": formats}}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
    return invoke("run", recipe, "--output", tmp_path / "out", "--json")


def _prompts(model) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer(p).input_ids for p in PROMPTS]


def reference_model(fake, source):
    """transformers' model on the `fake` export's weights in fp32. Where transformers does not load that checkpoint
    (mixtral: the export writes its routed experts one linear each under the legacy `block_sparse_moe` name, which
    transformers 5.25 does not map back, leaving the fused experts randomly initialised), the weights go into the
    `source` model with compress's per-expert layout (`ModelAdapter`), strictly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from compress.models.adapters import ModelAdapter

    model, info = AutoModelForCausalLM.from_pretrained(fake, dtype=torch.float32, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        ModelAdapter(model)
        tensors = {k.replace(".block_sparse_moe.", ".mlp."): v for f in sorted(Path(fake).glob("*.safetensors"))
                   for k, v in load_file(f).items()}
        model.load_state_dict(tensors, strict=True)
    return model.eval()


def transformers_decode(model, prompts: list[list[int]], n_tokens: int) -> Decoded:
    """The reference: transformers' greedy decoding in fp32, EOS masked for n_tokens (min_new_tokens), top-k of the
    raw logits."""
    tokens, top = [], []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=1, max_new_tokens=n_tokens,
                                 min_new_tokens=n_tokens, repetition_penalty=1.0, output_logits=True,
                                 return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        steps = []
        for logits in out.logits:
            logp = torch.log_softmax(logits[0].double(), -1)
            values, ids = logp.topk(TOP_K)
            steps.append({int(i): float(v) for i, v in zip(ids, values)})
        top.append(steps)
    return Decoded(tokens, top)


def stateless_decode(onnx_path, prompts: list[list[int]], n_tokens: int, eos=()) -> Decoded:
    """Greedy decoding through the explicit past/present inputs of the `kv_cache` graph converted to an OpenVINO IR
    (what `openvino` writes with `stateful: false`), compiled with EXACT_CPU_CONFIG; `eos` masked as the others do."""
    import numpy as np
    import openvino as ov

    from compress.export.openvino import EXACT_CPU_CONFIG

    compiled = ov.Core().compile_model(ov.convert_model(str(onnx_path)), "CPU", EXACT_CPU_CONFIG)
    names = [o.get_any_name() for o in compiled.outputs]
    pasts = [i for i in compiled.inputs if i.get_any_name().startswith("past_key_values.")]
    tokens = []
    for prompt in prompts:
        ids = list(prompt)
        feeds = {p.get_any_name(): np.zeros((1, p.get_partial_shape()[1].get_length(), 0,
                                              p.get_partial_shape()[3].get_length()), np.float32) for p in pasts}
        step = ids
        for _ in range(n_tokens):
            result = compiled({"input_ids": np.asarray([step]), "attention_mask": np.ones((1, len(ids)), np.int64),
                               **feeds})
            out = {name: result[compiled.output(i)] for i, name in enumerate(names)}
            logits = out["logits"][0, -1].copy()
            logits[list(eos)] = -np.inf
            step = [int(logits.argmax())]
            ids += step
            feeds = {p.get_any_name(): out[p.get_any_name().replace("past_key_values", "present")] for p in pasts}
        tokens.append(ids[len(prompt):])
    return Decoded(tokens)


@pytest.mark.parametrize("model_type", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow)
                                        for m in FAMILIES])
def test_genai_engines_decode_what_transformers_decodes(model_type, tmp_path):
    from transformers import GenerationConfig

    from compress.serve.engines import openvino_genai, ort_genai

    model = _model(tmp_path, model_type)
    formats = [_fake_export(), {"format": "onnx", "kv_cache": True, "genai_config": model_type not in NO_ORT_GENAI},
               {"format": "openvino", "kv_cache": True}]
    rc, stdout, err = _run(tmp_path, model, formats)
    assert rc == 0, err
    exports = json.loads(stdout)["exports"]
    prompts = _prompts(model)
    ref = transformers_decode(reference_model(exports["fake"], model), prompts, N_TOKENS)
    total = len(PROMPTS) * N_TOKENS
    assert sum(map(len, ref.tokens)) == total
    ov = openvino_genai.decode(tmp_path / "out" / "openvino", prompts, N_TOKENS)
    assert compare(ref, ov)["equal"] == total and ov.top == []
    # the stateless IR of the same weights (explicit past/present) decodes the same tokens
    eos = GenerationConfig.from_pretrained(exports["fake"]).eos_token_id
    stateless = stateless_decode(tmp_path / "out" / "onnx" / "model.onnx", prompts, N_TOKENS,
                                 eos if isinstance(eos, list) else [eos])
    assert compare(ref, stateless)["equal"] == total
    if model_type in NO_ORT_GENAI:
        return
    ort = ort_genai.decode(tmp_path / "out" / "onnx", prompts, N_TOKENS)
    agreement = compare(ref, ort)
    assert agreement["equal"] == total, agreement
    assert agreement["top5_overlap"] == 1.0 and agreement["max_dlogprob"] < 1e-3, agreement


def test_the_directories_hold_what_the_engines_load(tmp_path):
    """The openvino directory: a stateful IR (input_ids, attention_mask, position_ids, beam_idx -> logits, the KV cache
    as ReadValue/Assign variables), the tokenizer IRs, config.json and generation_config.json; the onnx directory:
    genai_config.json naming the graph's inputs and outputs, and the tokenizer files."""
    import openvino as ov

    model = _model(tmp_path, "llama")
    rc, _, err = _run(tmp_path, model, [{"format": "onnx", "kv_cache": True}, {"format": "openvino", "kv_cache": True}])
    assert rc == 0, err
    out = tmp_path / "out"
    names = {p.name for p in (out / "openvino").iterdir()}
    assert {"openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_detokenizer.xml",
            "config.json", "generation_config.json", "tokenizer.json"} <= names
    ir = ov.Core().read_model(out / "openvino" / "openvino_model.xml")
    assert [p.get_any_name() for p in ir.inputs] == ["input_ids", "attention_mask", "position_ids", "beam_idx"]
    assert [p.get_any_name() for p in ir.outputs] == ["logits"]
    assert sum(op.get_type_name() == "ReadValue" for op in ir.get_ops()) == 2 == len(ir.get_sinks())
    assert json.loads(ir.get_rt_info(["compress", "meta"]).astype(str))["stateful"] is True
    config = json.loads((out / "onnx" / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert config["model"]["type"] == "decoder" and decoder["filename"] == "model.onnx"
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (1, 2, 16)
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key" and "position_ids" not in decoder["inputs"]
    assert config["model"]["eos_token_id"] == 2 and config["search"]["past_present_share_buffer"] is False
    assert (out / "onnx" / "tokenizer.json").exists()


def test_a_cache_onnxruntime_genai_cannot_hold_is_refused_at_plan_time(tmp_path):
    """DeepSeek's latent cache: refused with the reason unless `genai_config: false`, which writes the graph alone;
    `stateful: false` keeps the openvino IR's explicit past/present inputs (converted from that same graph)."""
    import openvino as ov

    model = _model(tmp_path, "deepseek_v3")
    rc, _, err = _run(tmp_path, model, [{"format": "onnx", "kv_cache": True}])
    assert rc == 1 and "multi-head latent attention" in err and "genai_config: false" in err, err
    assert not (tmp_path / "out").exists()  # refused before anything ran
    rc, _, err = _run(tmp_path, model, [{"format": "onnx", "kv_cache": True, "genai_config": False},
                                        {"format": "openvino", "kv_cache": True, "stateful": False}])
    assert rc == 0, err
    out = tmp_path / "out"
    assert not (out / "onnx" / "genai_config.json").exists() and not (out / "onnx" / "tokenizer.json").exists()
    ir = ov.Core().read_model(out / "openvino" / "openvino_model.xml")
    assert [p.get_any_name() for p in ir.inputs][:3] == ["input_ids", "attention_mask", "past_key_values.0.key"]
    assert not ir.get_sinks() and not (out / "openvino" / "openvino_tokenizer.xml").exists()
