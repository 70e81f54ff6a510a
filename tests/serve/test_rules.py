"""The servability rules (compress/serve/rules.py): one test per engine rule, and the plan's use of them
(`--dry-run` prints the table, `export.serve` refuses a plan an engine cannot serve, with the nearest setting)."""

import json

import pytest
import yaml
from conftest import invoke
from tiny import save_tiny

from compress.serve import rules
from compress.serve.rules import Checkpoint, Layer


def ckpt(bits=4, group=128, sym=True, packing="auto_round:auto_gptq", dtype="float16", d_in=256, names=None,
         **kw) -> Checkpoint:
    names = names or ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    return Checkpoint([Layer(n, 256, d_in, bits, group, sym) for n in names], packing=packing, dtype=dtype, **kw)


def why(engine, c) -> str:
    return "; ".join(map(str, rules.ENGINES[engine].check(c)))


def test_w4_sym_g128_is_served_by_the_hf_engines():
    rows = rules.table(ckpt())
    assert [e for e, p in rows.items() if not p] == ["vllm-cpu", "vllm", "sglang", "transformers"]


@pytest.mark.parametrize("engine", ("vllm-cpu", "vllm", "sglang", "tgi", "transformers"))
def test_hf_engines_need_an_hf_export(engine):
    assert "no `hf` export" in why(engine, ckpt(packing=None))


def test_vllm_cpu_rules():
    assert "4-bit weights only" in why("vllm-cpu", ckpt(bits=8)) and "bits: 4" in why("vllm-cpu", ckpt(bits=8))
    assert "export.hf container: 4" in why("vllm-cpu", ckpt(bits=3, packing="auto_round:auto_awq"))
    assert "packing auto_round is not read" in why("vllm-cpu", ckpt(sym=False, packing="auto_round"))
    assert why("vllm-cpu", ckpt(sym=False, packing="auto_round:auto_awq")) == ""
    bad_group = why("vllm-cpu", ckpt(group=96, d_in=192))
    assert "group_size 96" in bad_group and "(group_size 64)" in bad_group  # the nearest group that divides 192
    assert "dtype float32 is refused" in why("vllm-cpu", ckpt(dtype="float32"))
    assert "MoE experts" in why("vllm-cpu", ckpt(experts=True))


def test_vllm_fused_layers_share_one_scheme():
    c = ckpt()
    c.layers[1] = Layer(c.layers[1].name, 256, 256, 4, 64, True)
    assert "fuses layers of different schemes" in why("vllm", c) and "qkv_proj" in why("vllm", c)


def test_vllm_cuda_rules():
    assert why("vllm", ckpt(bits=3)) == ""  # humming
    assert "asymmetric at 8 bits" in why("vllm", ckpt(bits=8, sym=False, packing="auto_round:auto_awq"))
    assert "group_size 256" in why("vllm", ckpt(group=256))


def test_sglang_and_tgi_rules():
    assert "SGLang runs 4/8-bit" in why("sglang", ckpt(bits=3))
    assert "not auto-round" in why("tgi", ckpt())
    assert why("tgi", ckpt(packing="gptq")) == ""
    assert "4/8-bit symmetric" in why("tgi", ckpt(packing="gptq", bits=2))


def test_transformers_rules():
    assert why("transformers", ckpt(bits=2, sym=False, packing="auto_round")) == ""
    assert "auto-round-lib" in why("transformers", ckpt(sym=False, packing="auto_round:auto_awq"))
    assert "gptqmodel" in why("transformers", ckpt(packing="gptq"))


def test_graph_engines_and_llama_cpp():
    assert "no `openvino` export" in why("openvino-genai", ckpt())
    assert "stateful" in why("openvino-genai", ckpt(graphs={"openvino": {"genai": False}}))
    assert why("openvino-genai", ckpt(graphs={"openvino": {"genai": True}})) == ""
    assert "genai_config.json" in why("ort-genai", ckpt(graphs={"onnx": {"genai": False}}))
    assert why("ort-genai", ckpt(graphs={"onnx": {"genai": True}})) == ""
    assert "no `gguf` export" in why("llama.cpp", ckpt()) and why("llama.cpp", ckpt(gguf="Q4_K_M")) == ""


def test_weight_and_activation_schemes_are_served_from_the_compressed_tensors_export():
    """A `scheme` run writes only compressed-tensors: vLLM (CPU for int8, CUDA for both), SGLang and transformers read
    it, TGI does not; FP8 has no CPU kernel in vLLM; float32 is refused by the engines that serve half precision."""
    int8 = rules.table(Checkpoint([], scheme="w8a8-int8"))
    assert [e for e, p in int8.items() if not p] == ["vllm-cpu", "vllm", "sglang", "transformers"]
    fp8 = rules.table(Checkpoint([], scheme="fp8"))
    assert [e for e, p in fp8.items() if not p] == ["vllm", "sglang", "transformers"]
    assert "no kernel in vLLM's CPU build" in why("vllm-cpu", Checkpoint([], scheme="fp8"))
    assert "scheme: w8a8-int8" in why("vllm-cpu", Checkpoint([], scheme="fp8"))
    block = rules.table(Checkpoint([], scheme="fp8-block"))  # SGLang's block FP8 not checked
    assert [e for e, p in block.items() if not p] == ["vllm", "transformers"]
    assert "128 x 128 blocks" in why("sglang", Checkpoint([], scheme="fp8-block"))
    assert "not compressed-tensors" in why("tgi", Checkpoint([], scheme="w8a8-int8"))
    for fp4 in ("nvfp4a16", "mxfp4a16"):
        rows = rules.table(Checkpoint([], scheme=fp4))
        assert [e for e, p in rows.items() if not p] == ["vllm", "transformers"]
    for w4 in ("w4a8-int8", "w4a8-fp8", "w4a4"):  # int4 weights with quantized activations: transformers only
        rows = rules.table(Checkpoint([], scheme=w4))
        assert [e for e, p in rows.items() if not p] == ["transformers"], w4
        assert "scheme: w8a8-int8" in why("vllm-cpu", Checkpoint([], scheme=w4))
    f32 = Checkpoint([], scheme="w8a8-int8", scheme_dtype="float32")
    assert "compressed-tensors dtype: float16" in why("vllm", f32) and why("transformers", f32) == ""


def test_markdown_marks_unverified_engines():
    md = rules.markdown(rules.table(ckpt()))
    assert "| vllm-cpu | hf, compressed-tensors | yes |" in md and "| vllm * | hf, compressed-tensors | yes |" in md
    assert "| tgi * | hf | no |" in md and "| llama.cpp | gguf | no |" in md


def _recipe(tmp_path, model, quantize: dict, export: dict) -> str:
    r = {"version": 1, "model": {"path": str(model), "dtype": "float32"},
         "calibration": {"sources": ["bundled:botchan-calibration"], "nsamples": 2, "seqlen": 32},
         "stages": [{"stage": "quantize", "method": "rtn", **quantize}], "export": export}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    return str(path)


def test_plan_prints_the_table_and_export_serve_refuses(tmp_path):
    model = save_tiny("llama", tmp_path / "m")
    ok = _recipe(tmp_path, model, {"bits": 4, "group_size": 32, "sym": False}, {"formats": ["hf"], "serve": ["vllm-cpu"]})
    rc, out, err = invoke("run", ok, "--dry-run")
    assert rc == 0, err
    assert "vllm-cpu        serves it" in out and "llama.cpp       no: the run writes no `gguf` export" in out
    rc, out, err = invoke("run", ok, "--dry-run", "--json")
    assert json.loads(out)["serving"]["vllm-cpu"] == []
    bad = _recipe(tmp_path, model, {"bits": 3, "group_size": 32, "sym": True}, {"formats": ["hf"], "serve": ["vllm-cpu"]})
    rc, out, err = invoke("run", bad, "--dry-run")
    assert rc == 1 and "vllm-cpu cannot serve" in err and "export.hf container: 4" in err
    fixed = _recipe(tmp_path, model, {"bits": 3, "group_size": 32, "sym": True},
                    {"formats": [{"format": "hf", "container": 4}], "serve": ["vllm-cpu"]})
    assert invoke("run", fixed, "--dry-run")[0] == 0
    gptq = _recipe(tmp_path, model, {"bits": 4, "group_size": 32, "sym": False},
                   {"formats": [{"format": "hf", "packing": "gptq"}]})
    rc, _, err = invoke("run", gptq, "--dry-run")
    assert rc == 1 and "symmetric layers only" in err
    unknown = _recipe(tmp_path, model, {"bits": 4, "group_size": 32, "sym": True}, {"formats": ["hf"], "serve": ["tensorrt"]})
    rc, _, err = invoke("run", unknown, "--dry-run")
    assert rc == 1 and "unknown engine `tensorrt`" in err
