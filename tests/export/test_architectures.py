"""The architecture matrix: each family from a tiny random config of the real one (docs/architectures.md).

Quantized by RTN, GPTQ and AutoRound through the block driver, exported to `hf` and reloaded by transformers +
auto-round with logits matching; the fused Walsh rotation exact in float64 where it applies and refused at plan
time (with the reason) where it does not; `onnx` and `openvino` graphs (torch's exporter) with logits matching and
KV-cache decoding; an unknown `model_type` refused with the supported list.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CAL, invoke
from helpers import check_reload
from tiny import save_tiny, tiny_causal

from compress.driver import LayerSpec, run_blockwise
from compress.export.hf import export_hf, loadable
from compress.models.adapters import ARCHS, ModelAdapter
from compress.quantize.autoround import AutoRound, AutoRoundConfig
from compress.quantize.gptq import GPTQ, GPTQConfig
from compress.quantize.rtn import RTN, RTNConfig
from tests.rotating import exact_rmsnorm, ids, rotate

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

NEW = ["gemma2", "gemma3_text", "phi3", "olmo2", "granite", "deepseek_v3", "qwen3_moe"]
QUANTIZERS = {
    "rtn": lambda: RTN(RTNConfig(method="rtn")),
    "gptq": lambda: GPTQ(GPTQConfig(method="gptq")),
    "autoround": lambda: AutoRound(AutoRoundConfig(iters=2, batch_size=2, final_block="same")),
}


def test_every_new_family_is_supported():
    assert set(NEW) <= set(ARCHS)


@pytest.mark.parametrize("method", sorted(QUANTIZERS))
@pytest.mark.parametrize("model_type", NEW)
def test_quantize_and_reload_in_transformers(model_type, method, tmp_path):
    model = tiny_causal(model_type)
    ad = ModelAdapter(model)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    spec = LayerSpec(bits=4, group_size=32, sym=method != "gptq")
    qweights = run_blockwise(model=model, blocks=ad.blocks, block_linears=ad.block_linears,
                             specs=lambda n, lin: spec, quantizer=QUANTIZERS[method](), tokens=tokens,
                             load_block=lambda i: None, save_block=lambda i, q: None)
    n_linears = sum(len(ad.block_linears(i)) for i in range(len(ad.blocks)))
    assert len(qweights) == n_linears
    export_hf(model, qweights, None, tmp_path / "hf", packing="auto_round")  # asym: what transformers loads alone
    _, back, _ = check_reload(model, qweights, tmp_path / "hf", 128)  # logits within 1e-3 of the in-memory model
    assert set(back) == {n for n, q in qweights.items() if loadable(q)}  # DeepSeek's 40-wide kv_a: dense
    assert len(back) >= len(qweights) - len(ad.blocks)


def _recipe(tmp_path, model, stages: str, formats: str = "hf"):
    """A dry-run recipe on `model` (a path) with these stage lines."""
    path = tmp_path / "r.yaml"
    path.write_text(f"""version: 1
model: {{path: {model}}}
calibration: {{sources: [{CAL}], nsamples: 4, seqlen: 32}}
stages:
{stages}
export: {{formats: [{formats}]}}
eval: {{enabled: false}}
""")
    return path


QUANTIZE = "  - {stage: quantize, method: rtn, bits: 4, group_size: 32}"
ROTATABLE = ["granite", "qwen3_moe"]


@pytest.mark.parametrize("model_type", ROTATABLE)
def test_fused_walsh_is_exact_in_float64(model_type):
    model = exact_rmsnorm(tiny_causal(model_type, dtype=torch.float64))
    ModelAdapter(model)
    x = ids(128)
    with torch.no_grad():
        before = model(x).logits
        metrics = rotate(model, 128, fused=True)
        after = model(x).logits
    assert metrics["norm"] == 4
    assert (after - before).abs().max() / before.abs().max() < 1e-10


@pytest.mark.parametrize("model_type,why", [
    ("gemma2", "post-norms"), ("gemma3_text", "post-norms"), ("olmo2", "no pre-norms"), ("phi3", "fuses q/k/v"),
    ("deepseek_v3", "latent attention"),
])
def test_walsh_and_pruning_refused_at_plan_time_with_the_reason(model_type, why, tmp_path):
    path = save_tiny(model_type, tmp_path / model_type, max_position_embeddings=512)
    recipe = _recipe(tmp_path, path, "  - {stage: rotate, method: walsh, fused: true}\n" + QUANTIZE)
    rc, _, err = invoke("run", recipe, "--output", tmp_path / "o", "--dry-run")
    assert rc == 1 and f"does not apply to `{model_type}`" in err and why in err, err
    if model_type in ("phi3", "deepseek_v3"):
        recipe = _recipe(tmp_path, path, "  - {stage: prune, method: ffn, ratio: 0.25}\n" + QUANTIZE)
        rc, _, err = invoke("run", recipe, "--output", tmp_path / "o", "--dry-run")
        assert rc == 1 and "`prune: ffn` does not apply" in err, err


BUILDER = {"qwen3", "granite", "phi3", "gemma2"}  # the new families the ONNX Runtime GenAI builder writes


@pytest.mark.parametrize("model_type", NEW)
def test_a_plan_on_each_family_runs_and_graph_exports_say_which_path_they_take(model_type, tmp_path):
    extra = {"original_max_position_embeddings": 512} if model_type == "phi3" else {}
    path = save_tiny(model_type, tmp_path / model_type, max_position_embeddings=512, **extra)
    rc, out, err = invoke("run", _recipe(tmp_path, path, QUANTIZE.replace("32", "128")), "--output", tmp_path / "o",
                          "--dry-run")
    assert rc == 0 and "group_size adapted" in out, err  # 64-wide layers: per-channel
    for formats in ("onnx", "openvino"):  # torch's exporter writes every family
        rc, _, err = invoke("run", _recipe(tmp_path, path, QUANTIZE, formats), "--output", tmp_path / "o", "--dry-run")
        assert rc == 0, err
    rc, _, err = invoke("run", _recipe(tmp_path, path, QUANTIZE, "{format: onnx, builder: genai}"), "--output",
                        tmp_path / "o", "--dry-run")
    if model_type in BUILDER:
        assert rc == 0, err
    else:
        assert rc == 1 and "builder: genai" in err and f"not `{model_type}`" in err, err


def _feeds(session, ids, attention, past=None):
    import numpy as np

    feeds = {"input_ids": ids.numpy(), "attention_mask": attention.numpy()}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = (past[i.name.replace("past_key_values", "present")] if past is not None else
                             np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32))
    return feeds


@pytest.mark.parametrize("model_type", NEW + [pytest.param(m, marks=pytest.mark.slow) for m in  # the earlier families
                                              ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe")])
def test_graph_exports_match_and_decode_with_a_kv_cache(model_type, tmp_path):
    """`onnx` (torch's exporter, MatMulNBits) and the `openvino` IR converted from it: prompt logits equal the
    in-memory quantized model's, then two decode steps through the KV cache, on a right-padded batch of two."""
    import onnxruntime as ort
    import openvino as ov
    from helpers import in_blocks, quantize_model, rel_err

    from compress.export.onnx import export_onnx
    from compress.export.openvino import EXACT_CPU_CONFIG, export_openvino

    model = tiny_causal(model_type, **({} if model_type == "deepseek_v3" else {"num_hidden_layers": 1}))  # trace time
    ModelAdapter(model)
    qweights = quantize_model(model, lambda n: (8, 64, True) if n.endswith("down_proj") else in_blocks((4, 32, False))(n))
    res = export_onnx(model, qweights, tmp_path / "onnx", kv_cache=True)
    assert res["dense_layers"] == 0
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    attention = torch.ones(2, 9, dtype=torch.long)
    attention[1, 5:] = 0  # the second row's prompt is 5 tokens, right-padded to 7
    with torch.no_grad():
        ref = model(ids, attention_mask=attention).logits.numpy()
    ov_res = export_openvino(model, qweights, tmp_path / "ov", kv_cache=True, onnx_path=res["path"])
    assert ov_res["low_bit_constants"]["u4"] > 0
    session = ort.InferenceSession(res["path"], providers=["CPUExecutionProvider"])
    runs = {"onnxruntime": session.run,
            "openvino": _ov_run(ov.Core().compile_model(ov_res["path"], "CPU", EXACT_CPU_CONFIG))}
    names = [o.name for o in session.get_outputs()]
    for runtime, run in runs.items():
        out = dict(zip(names, run(None, _feeds(session, ids[:, :7], attention[:, :7]))))
        assert rel_err(out["logits"][0], ref[0, :7]) < 1e-5, runtime
        assert rel_err(out["logits"][1, :5], ref[1, :5]) < 1e-5, runtime
        for step in (7, 8):
            out = dict(zip(names, run(None, _feeds(session, ids[:, step:step + 1], attention[:, :step + 1], out))))
            assert rel_err(out["logits"][0], ref[0, step:step + 1]) < 1e-5, (runtime, step)


def _ov_run(compiled):
    def run(_, feeds):
        result = compiled(feeds)
        return [result[compiled.output(i)] for i in range(len(compiled.outputs))]
    return run


@pytest.mark.parametrize("model_type", [m if m in ("qwen3", "gemma2") else pytest.param(m, marks=pytest.mark.slow)
                                        for m in sorted(BUILDER)])  # a build each: granite and phi3 in the slow tier
def test_genai_builder_export_runs_in_onnxruntime_genai_with_exact_logits(model_type, tmp_path):
    """Our codes and scales survive the builder: onnxruntime_genai's first-step logits equal the in-memory
    quantized model's, and greedy generation with its KV cache agrees."""
    import numpy as np
    import onnxruntime_genai as og
    from conftest import STORIES260K
    from helpers import in_blocks, quantize_model, rel_err
    from transformers import AutoTokenizer

    from compress.export.genai import export_genai

    extra = {"phi3": {"original_max_position_embeddings": 256},
             "gemma2": {"sliding_window": 8}}.get(model_type, {})  # its KV cache must hold the window
    model = tiny_causal(model_type, vocab_size=512, **extra)
    qweights = quantize_model(model, lambda n: (8, 64, True) if n.endswith("down_proj") else in_blocks((4, 32, False))(n))
    res = export_genai(model, qweights, AutoTokenizer.from_pretrained(STORIES260K), tmp_path / "onnx")
    prompt = [1, 37, 99, 250, 4, 17, 300, 8]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1].numpy()
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    m = og.Model(res["path"])
    params = og.GeneratorParams(m)
    params.set_search_options(do_sample=False, max_length=len(prompt) + 6)
    gen = og.Generator(m, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    logits = np.asarray(gen.get_output("logits"), np.float32).reshape(-1, ref.shape[-1])[-1]
    assert rel_err(logits, ref) < 1e-5
    tokens = []
    while not gen.is_done():
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
    assert tokens == greedy
    assert json.loads((tmp_path / "onnx" / "compress.json").read_text())["format"] == "onnx-genai"


def test_unknown_model_type_is_refused_at_plan_time_with_the_list(tmp_path):
    import transformers as T

    path = tmp_path / "gpt2"
    T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(path)
    rc, _, err = invoke("run", _recipe(tmp_path, path, QUANTIZE), "--output", tmp_path / "o", "--dry-run")
    assert rc == 1 and "unsupported architecture `gpt2`" in err and "gemma2" in err and "phi3" in err, err


def test_a_run_exports_onnx_through_the_builder(tmp_path):
    path = save_tiny("qwen3", tmp_path / "qwen3", max_position_embeddings=512)
    recipe = _recipe(tmp_path, path, QUANTIZE, "hf, {format: onnx, builder: genai}")
    rc, stdout, err = invoke("run", recipe, "--output", tmp_path / "o", "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert (tmp_path / "o" / "onnx" / "genai_config.json").exists()
    assert report["size"]["stored"]["onnx"]["dense_layers"] == 0
    meta = json.loads((tmp_path / "o" / "onnx" / "compress.json").read_text())["meta"]
    assert meta["recipe_sha256"] == report["recipe_sha256"]


def test_gemma_exports_bfloat16_and_refuses_float16(tmp_path):
    """Gemma's residual stream leaves float16's range (Gemma-3-270M: every logit non-finite in float16): the hf and
    fake exports default to bfloat16 there, say so in the plan, write it, and refuse an explicit float16."""
    path = save_tiny("gemma3_text", tmp_path / "gemma3", max_position_embeddings=512)
    recipe = _recipe(tmp_path, path, QUANTIZE, "hf, fake")
    rc, out, err = invoke("run", recipe, "--output", tmp_path / "o", "--dry-run")
    assert rc == 0, err
    assert out.count("unquantized tensors in bfloat16, not float16") == 2 and "Gemma 3's residual stream" in out
    rc, _, err = invoke("run", recipe, "--output", tmp_path / "o")
    assert rc == 0, err
    for d in ("hf", "hf-fake"):
        assert json.loads((tmp_path / "o" / d / "config.json").read_text())["dtype"] == "bfloat16"
    rc, _, err = invoke("run", _recipe(tmp_path, path, QUANTIZE, "{format: hf, dtype: float16}"), "--output",
                        tmp_path / "o2", "--dry-run")
    assert rc == 1 and "dtype float16 would make this model's logits non-finite" in err and "bfloat16" in err, err
    llama = save_tiny("llama", tmp_path / "llama")  # elsewhere float16 stays the default, said nowhere
    rc, out, err = invoke("run", _recipe(tmp_path, llama, QUANTIZE), "--output", tmp_path / "o3", "--dry-run")
    assert rc == 0 and "not float16" not in out, err
    rc, _, err = invoke("run", _recipe(tmp_path, llama, QUANTIZE), "--output", tmp_path / "o3")
    assert rc == 0, err
    assert json.loads((tmp_path / "o3" / "hf" / "config.json").read_text())["dtype"] == "float16"
