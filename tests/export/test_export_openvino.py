"""OpenVINO IR export: compressed integer constants, and OpenVINO on CPU reproduces the quantized model."""

from __future__ import annotations

import json

import numpy as np
import openvino as ov
import pytest
import torch
from conftest import MODELS, TEXT, invoke
from helpers import load, quantized, rel_err, run_ir

from compress.export.onnx import export_onnx
from compress.export.openvino import EXACT_CPU_CONFIG, export_openvino

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("name,bits,group,sym,ctype", [
    *(pytest.param(*case, marks=pytest.mark.slow) for case in  # each trace costs seconds: the rest in the slow tier
      [("stories260K", 2, 32, True, "u2"), ("stories260K", 4, 32, False, "u4"), ("stories260K", 8, -1, False, "u8"), ("ref-llama-7m", 4, 128, True, "u4"),
       ("ref-llama-7m", 2, 64, False, "u2")]),
])
def test_openvino_matches_quantized_model(name, bits, group, sym, ctype, tmp_path):
    model = load(name)
    qweights = quantized(model, bits, group, sym)
    res = export_openvino(model, qweights, tmp_path)
    assert res["low_bit_constants"][ctype] >= len(qweights)
    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    out, fc = run_ir(res["path"], ids)
    # the runtime keeps the weights compressed (the CPU plugin may fuse one pair of projections per block)
    assert fc.get(ctype, 0) >= 6 * model.config.num_hidden_layers
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    assert rel_err(out, ref) < 1e-3
    info = json.loads(ov.Core().read_model(res["path"]).get_rt_info(["compress", "meta"]).astype(str))
    assert info["format"] == "openvino-ir" and info["version"] == 1


@pytest.mark.slow  # a run exporting openvino: tests/quantize/test_groups.py runs one in the default tier
def test_recipe_exports_openvino(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""version: 1
model: {{path: {MODELS / 'stories260K'}, dtype: float32}}
calibration: {{sources: [{TEXT / 'tinystories' / 'tinystories_val.txt'}], nsamples: 4, seqlen: 32}}
stages:
  - {{stage: quantize, method: rtn, bits: 4, group_size: 32, sym: true}}
export:
  formats: [fake, openvino]
""")
    rc, stdout, err = invoke("run", recipe, "--output", tmp_path / "out", "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    from transformers import AutoModelForCausalLM

    fake = AutoModelForCausalLM.from_pretrained(report["exports"]["fake"], dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (1, 20))
    out, fc = run_ir(report["exports"]["openvino"], ids)
    with torch.no_grad():
        assert rel_err(out, fake(ids).logits.numpy()) < 1e-3
    assert np.isfinite(out).all() and fc.get("u4", 0) >= 30


NPU_RECIPE = """version: 1
model: {{path: {model}, dtype: float32}}
calibration: {{sources: [{text}], nsamples: 4, seqlen: 32}}
stages:
  - {{stage: quantize, method: autoround, bits: {bits}, group_size: {group}, sym: {sym}, iters: 2{extra}}}
export:
  formats: [{{format: openvino, device: {device}}}]
"""


@pytest.mark.parametrize("bits,group,sym,extra,device,message", [
    (2, 128, "true", "", "[CPU, NPU]", "Change in stages.0: bits: 2 -> 4"),
    (4, 64, "true", "", "NPU", "Change in stages.0: group_size: 64 -> 128 or -1 (per-channel)"),
    (4, 128, "false", "", "[NPU]", "Change in stages.0: sym: false -> true"),
    (4, 128, "true", ", overrides: [{pattern: down_proj, bits: 8}]", "[NPU, CPU]",
     "Change in its `overrides`: bits: 8 -> 4"),
])
def test_npu_target_is_checked_before_calibration(tmp_path, bits, group, sym, extra, device, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(NPU_RECIPE.format(model=MODELS / "ref-llama-7m", text=TEXT / "wikitext-2" / "valid.txt",
                                        bits=bits, group=group, sym=sym, extra=extra, device=device))
    rc, _, err = invoke("run", recipe, "--output", tmp_path / "out")
    assert rc == 1, err
    assert "targets NPU" in err and message in err and "drop NPU from the openvino `device` list" in err
    assert not (tmp_path / "out").exists()  # nothing calibrated, nothing written
    rc, _, err = invoke("run", recipe, "--output", tmp_path / "out", "--dry-run")
    assert rc == 1 and message in err


def test_npu_target_accepts_sym_int4_g128_and_per_channel(tmp_path):
    for group in (128, -1):
        recipe = tmp_path / f"r{group}.yaml"
        recipe.write_text(NPU_RECIPE.format(model=MODELS / "ref-llama-7m", text=TEXT / "wikitext-2" / "valid.txt",
                                            bits=4, group=group, sym="true", extra="", device="[CPU, NPU]"))
        rc, stdout, err = invoke("run", recipe, "--output", tmp_path / f"out{group}", "--dry-run", "--json")
        assert rc == 0, err
        assert json.loads(stdout)["export"] == ["openvino"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(NPU_RECIPE.format(model=MODELS / "ref-llama-7m", text=TEXT / "wikitext-2" / "valid.txt", bits=4,
                                     group=128, sym="true", extra="", device="[CPU, TPU]"))
    rc, _, err = invoke("validate", bad)
    assert rc == 1 and "`device[1]`" in err and "should be 'CPU', 'GPU' or 'NPU'" in err


def test_export_records_targets_and_compiles_where_it_can(tmp_path):
    model = load("stories260K")
    qweights = quantized(model, 4, -1, True)
    res = export_openvino(model, qweights, tmp_path, devices=("CPU", "NPU"))
    assert res["devices"] == ["CPU", "NPU"] and res["compiled_on"] == ["CPU"] and res["not_compiled"] == ["NPU"]
    ir = ov.Core().read_model(res["path"])
    assert ir.get_rt_info(["compress", "devices"]).astype(str) == "CPU,NPU"
    assert json.loads(ir.get_rt_info(["compress", "meta"]).astype(str))["devices"] == ["CPU", "NPU"]
    with pytest.raises(ValueError, match=r"NPU target: 35 layers .*bits: 2 -> 4; group_size: 32 -> 128"):
        export_openvino(model, quantized(load("stories260K"), 2, 32, True), tmp_path / "x", devices=("NPU",))


@pytest.mark.slow  # two conversions (~23 s)
def test_the_ir_carries_the_runtime_options_the_cpu_plugin_reads(tmp_path):
    """A plain `compile_model` (no config) reads the IR's runtime_options: no dynamic quantization (the CPU
    default rounds activations to int8 in groups of 32); `exact=False` leaves the device's defaults. The CPU
    plugin does not read the inference precision from an IR (OpenVINO 2026.4 reads KV-cache and dynamic
    quantization options there), so f32 on a CPU with bf16 takes `EXACT_CPU_CONFIG` at compile time."""
    model = load("stories260K")
    qweights = quantized(model, 4, 32, False)
    core = ov.Core()
    graph = tmp_path / "graph"
    export_onnx(model, qweights, graph)  # traced once, converted twice
    ir = export_openvino(model, qweights, tmp_path / "a", onnx_path=graph / "model.onnx")["path"]
    assert core.compile_model(ir, "CPU").get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 0
    exact = core.compile_model(ir, "CPU", EXACT_CPU_CONFIG)
    assert str(exact.get_property("INFERENCE_PRECISION_HINT")) in ("<Type: 'float32'>", "f32")
    plain = core.compile_model(export_openvino(model, qweights, tmp_path / "b", exact=False,
                                               onnx_path=graph / "model.onnx")["path"], "CPU")
    assert plain.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") != 0
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    assert rel_err(exact([ids.numpy()])[0], ref) < 1e-4
