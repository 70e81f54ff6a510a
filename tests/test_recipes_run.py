"""Every bundled recipe runs as written on ref-llama-7m (hidden 256, 6 blocks, vocab 4096), with only
the model, the output directory, the data (the WikiText files in ../shared, as before the recipes shipped their
own text: tests/test_bundled_data.py checks that) and smaller calibration/iteration/eval sizes changed, and exports
a checkpoint that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MODELS, REPO, invoke, plan_path
from helpers import WIKITEXT, shrink

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

MODEL = MODELS / "ref-llama-7m"
# moe: tests/allocate/test_moe.py; select (an encoder recipe): tests/select/test_select.py
RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if not p.name.startswith(("moe-", "select-")))


def test_bundled_recipes():
    """The recipes the issues ask for are bundled (every bundled recipe runs in the test below)."""
    required = {"quickstart.yaml", "w4-gptq.yaml", "w3-autoround.yaml", "w2-autoround.yaml", "w2-autoround-lfq.yaml",
                "w4-onnx.yaml", "w4-openvino.yaml", "w2-walsh-autoround.yaml", "w2-walsh-fused-autoround.yaml",
                "mixed-2.5-rl.yaml", "mixed-2.5-greedy.yaml", "prune-ffn25-w4.yaml",
                "prunepath-w4.yaml", "gguf-q4_0.yaml", "gguf-q4_k_m.yaml", "w8a8-int8.yaml", "w4a4-infoquant.yaml"}
    assert required <= {p.name for p in RECIPES}
    assert (REPO / "recipes" / "moe-2.5-gemq.yaml").is_file() and (REPO / "recipes" / "select-probscale.yaml").is_file()


@pytest.mark.e2e
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_bundled_recipe_runs_and_exports(recipe: Path, tmp_path):
    from transformers import AutoModelForCausalLM

    spec = yaml.safe_load(recipe.read_text())
    stage = next(s for s in spec["stages"] if s["stage"] == "quantize")
    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe, "--model", MODEL, "--output", out, "--json", *shrink(spec), *WIKITEXT)
    assert rc == 0, err
    report = json.loads(stdout)
    assert [s["method"] for s in report["stages"] if s["name"] == "quantize"] == [stage["method"]]
    ran = [s["name"] for s in report["stages"] if s["name"] not in ("load", "eval", "export")]
    assert ran == [s["stage"] for s in spec["stages"]]
    ev = next(iter(report["eval"].values()))
    assert ev["tokens"] == 512 and ev["ppl_ratio"] > 0.9 and ev["top1"] > 0.3
    prompts = spec["eval"].get("generation", {}).get("prompts", 16)
    assert ev["gen_prompts"] == prompts and 0 <= ev["gen_prefix"] <= ev["gen_new_tokens"] and ev["gen_kl"] >= 0
    grid = stage.get("gguf")  # on llama.cpp's blocks: the embeddings and the output are rounded too, gguf only
    assert report["size"]["quantized_layers"] == 6 * 7 + (2 if grid else 0)
    assert report["size"]["bytes"] < report["size"]["fp_bytes"]

    manifest = json.loads((out / "manifest.json").read_text())
    assert all(st["status"] == "done" for st in manifest["stages"].values())
    if spec["stages"][0]["stage"] == "rotate" and spec["stages"][0]["method"] == "walsh":
        rot = manifest["stages"]["00-rotate-walsh"]  # both norms of each of the 6 blocks, every up -> down pair
        assert rot["metrics"]["norm"] == 2 * 6 and rot["metrics"]["up_down"] == 6
        (title, png), = report["figures"].items()  # the energy spectrum before/after, linked from report.md
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{title}]({png})" in (out / "report.md").read_text()
    gguf = [f if isinstance(f, dict) else {"format": f, "type": grid} for f in spec["export"]["formats"]
            if f == "gguf" or isinstance(f, dict) and f["format"] == "gguf"]
    if gguf:  # the layers the stage rounded are in the file from their codes (tests/export/test_gguf.py: exactly)
        file = out / "gguf" / f"model-{gguf[0]['type']}.gguf"
        assert file.is_file() and (out / "gguf" / "Modelfile").is_file()
        assert manifest["exports"]["gguf"]["from_codes"] == report["size"]["quantized_layers"]
        back = AutoModelForCausalLM.from_pretrained(out / "gguf", gguf_file=file.name)
        assert back.model.layers[0].self_attn.q_proj.weight.shape == (256, 256)
    if grid:
        return
    if stage.get("scheme"):  # weights and activations: compressed-tensors, loaded by transformers through its library
        qc = json.loads((out / "compressed-tensors" / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["input_activations"]
        loaded = AutoModelForCausalLM.from_pretrained(out / "compressed-tensors", dtype=torch.float32)
        with torch.no_grad():
            assert torch.isfinite(loaded(torch.tensor([[1, 400, 23, 1999]])).logits).all()
        return
    config = json.loads((out / "hf" / "config.json").read_text())
    qc = config["quantization_config"]
    alloc = next((s for s in spec["stages"] if s["stage"] == "allocate"), None)
    if alloc:  # mixed precision: the plan's budget holds, layers are stored in exact per-layer containers
        plan = json.loads(plan_path(out).read_text())
        assert plan["method"] == alloc["method"] and alloc["budget"] - 0.01 <= plan["effective_bits"] <= alloc["budget"]
        assert report["size"]["effective_bits"] == round(plan["effective_bits"], 4)
        assert len(config["compress"]["meta"]["mixed"]) == 6 * 7
        assert (qc["group_size"], qc["sym"]) == (stage["group_size"], stage["sym"])
    else:
        assert (qc["bits"], qc["group_size"], qc["sym"]) == (stage["bits"], stage["group_size"], stage["sym"])

    loaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    loaded = torch.nn.Module.float(loaded).eval()  # auto-round forces fp16 on CPU
    ids = torch.tensor([[1, 400, 23, 1999, 7, 3071, 56, 812]])
    with torch.no_grad():
        logits = loaded(ids).logits
    assert logits.shape == (1, 8, 4096) and torch.isfinite(logits).all()
    if "onnx" in spec["export"]["formats"]:  # onnxruntime vs the reloaded checkpoint (fp16-rounded norms/embeddings)
        import onnxruntime as ort

        sess = ort.InferenceSession(str(out / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
        onnx_logits = torch.from_numpy(sess.run(["logits"], {"input_ids": ids.numpy()})[0])
        assert (onnx_logits - logits).abs().max() < 1e-2 * (logits.max() - logits.min())
    ov_formats = [f for f in spec["export"]["formats"] if isinstance(f, dict) and f["format"] == "openvino"]
    if ov_formats:  # the IR on OpenVINO's CPU plugin vs the reloaded checkpoint; other targets recorded, not run
        import openvino as ov

        from compress.export.openvino import EXACT_CPU_CONFIG

        path = out / "openvino" / "openvino_model.xml"
        core = ov.Core()
        ir = core.read_model(str(path))
        assert ir.get_rt_info(["compress", "devices"]).astype(str) == ",".join(ov_formats[0]["device"])
        ov_logits = torch.from_numpy(core.compile_model(ir, "CPU", EXACT_CPU_CONFIG)([ids.numpy()])[0])
        assert (ov_logits - logits).abs().max() < 1e-2 * (logits.max() - logits.min())
        recorded = manifest["exports"]["openvino"]
        assert recorded["devices"] == ov_formats[0]["device"] and "CPU" in recorded["compiled_on"]
        assert sorted(recorded["compiled_on"] + recorded["not_compiled"]) == sorted(recorded["devices"])

    rc, stdout, err = invoke("inspect", out / "hf", "--json")
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["quantized_layers"] > 0
    if alloc:
        assert {r["bits"] for r in info["layers"]} <= {2, 3, 4, 8}
    else:
        assert {r["bits"] for r in info["layers"]} == {stage["bits"]}
