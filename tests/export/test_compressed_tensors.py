"""`scheme: w8a8-int8` and the `compressed-tensors` export (docs/formats.md#w8a8-int8): the scheme's grid, the
plan-time refusals, the export's exact round trip, and transformers (through the compressed-tensors library)
computing what compress's evaluation computed."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MODELS, invoke

from compress.recipe import Recipe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
pytest.importorskip("compressed_tensors", reason="the `export` extra (CI installs it)")

MODEL = MODELS / "stories-llama-1m"
BASE = {"version": 1, "model": {"path": "m"}}


def recipe(tmp_path, method="rtn", scheme="scheme: w8a8-int8", fmt="{format: compressed-tensors, dtype: float32}"):
    p = tmp_path / f"r-{method}.yaml"
    p.write_text(f"""
version: 1
model: {{path: {MODEL}, dtype: float32}}
calibration: {{sources: [bundled:botchan-calibration], nsamples: 8, seqlen: 64}}
stages:
  - {{stage: quantize, method: {method}, {scheme}}}
eval: {{data: [bundled:botchan-eval], max_tokens: 1024, generation: {{prompts: 0}}}}
export: {{formats: [{fmt}]}}
""")
    return p


def test_the_scheme_fixes_the_weight_grid():
    cfg = Recipe.model_validate({**BASE, "stages": [{"stage": "quantize", "method": "gptq",
                                                     "scheme": "w8a8-int8"}]}).stages[0]
    assert (cfg.bits, cfg.group_size, cfg.sym) == (8, -1, True)
    for extra, match in (({"bits": 4}, "remove bits: 4"), ({"sym": False}, "remove sym: False"),
                         ({"gguf": "Q4_0"}, "two formats"),
                         ({"overrides": [{"pattern": "down", "bits": 4}]}, "may only `skip`")):
        with pytest.raises(ValueError, match=match):
            Recipe.model_validate({**BASE, "stages": [{"stage": "quantize", "method": "rtn", "scheme": "w8a8-int8",
                                                       **extra}]})
    with pytest.raises(ValueError):
        Recipe.model_validate({**BASE, "stages": [{"stage": "quantize", "method": "rtn", "scheme": "w4a4"}]})


def test_exports_that_cannot_carry_activations_are_refused_at_plan_time(tmp_path):
    rc, _, err = invoke("run", recipe(tmp_path, fmt="hf"), "--dry-run")
    assert rc == 1 and "quantizes activations too (`scheme: w8a8-int8`), which hf cannot carry" in err, err
    rc, _, err = invoke("run", recipe(tmp_path, scheme="bits: 8, group_size: -1"), "--dry-run")
    assert rc == 1 and "give the quantize stage `scheme: w8a8-int8`" in err, err
    rc, out, err = invoke("run", recipe(tmp_path), "--dry-run", "--json")
    assert rc == 0 and json.loads(out)["export"] == ["compressed-tensors"], err


def test_int8_weights_are_the_evaluated_weights_exactly():
    from compress.export.compressed_tensors import int8_weight
    from compress.quantize.rtn import rtn

    W = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    qw = rtn(W, 8, -1, True)
    w, s = int8_weight(qw)
    assert w.dtype == torch.int8 and s.shape == (48, 1)
    assert torch.equal(w.float() * s, qw.dequantize())
    with pytest.raises(ValueError, match="int8 per-channel"):
        int8_weight(rtn(W, 4, 32, True))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_transformers_computes_what_the_run_evaluated(tmp_path, method):
    """The run's in-memory model with its activation hooks and transformers' load of the export (compressed-tensors
    decompresses the weights and quantizes each linear's input per token): the same logits, and `compress eval` of
    the export gives the run's KL."""
    from transformers import AutoModelForCausalLM

    from compress.export.hf import load_tensors
    from compress.quantize.activations import ActivationSpec, quantized_inputs

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, method), "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["activations"]["layers"] == 28
    ct = out / "compressed-tensors"
    cfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    group = cfg["config_groups"]["group_0"]
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                          "dynamic": True} and len(group["targets"]) == 28
    tensors = load_tensors(ct)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8

    theirs = torch.nn.Module.float(AutoModelForCausalLM.from_pretrained(ct)).eval()
    ours = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        for name in group["targets"]:  # compress's dequantized weights, and its activation hooks
            ours.get_submodule(name).weight.copy_(tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"])
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
        with quantized_inputs(ours, {n: ActivationSpec() for n in group["targets"]}):
            a = ours(ids).logits
        b = theirs(ids).logits
        plain = ours(ids).logits  # without the activation quantization: visibly different
    assert (a - b).abs().max() <= 1e-5 * a.abs().max(), float((a - b).abs().max())
    assert (plain - b).abs().max() > 100 * (a - b).abs().max()

    rc, stdout, err = invoke("eval", ct, "--reference", MODEL, "--data", "bundled:botchan-eval", "--max-tokens",
                             "1024", "--gen-prompts", "0", "--json")
    assert rc == 0, err
    ev, run = json.loads(stdout)["botchan-eval.txt"], report["eval"]["botchan-eval.txt"]
    assert ev["kl"] == pytest.approx(run["kl"], rel=1e-3, abs=1e-6) and ev["top1"] == pytest.approx(run["top1"])


def test_static_activation_scales_are_calibrated_stored_and_read(tmp_path):
    """`activations: static`: one input scale per layer, calibrated on the calibration text (max |x| / 127.5 in the
    export dtype), stored as `input_scale` with a per-tensor, non-dynamic group; transformers' load of the export
    computes what the run evaluated, and `compress eval` of it gives the run's KL. Without a scheme it is refused."""
    from transformers import AutoModelForCausalLM

    from compress.export.hf import load_tensors
    from compress.quantize.activations import ActivationSpec, quantized_inputs

    out = tmp_path / "out"
    r = recipe(tmp_path, "rtn", scheme="scheme: w8a8-int8, activations: static",
               fmt="{format: compressed-tensors, dtype: float32}")
    rc, stdout, err = invoke("run", r, "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["activations"]["static"] == 28
    ct = out / "compressed-tensors"
    group = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                          "dynamic": False} and len(group["targets"]) == 28
    tensors = load_tensors(ct)
    scales = {n: tensors[f"{n}.input_scale"] for n in group["targets"]}
    assert all(s.shape == (1,) and float(s) > 0 for s in scales.values())
    assert len({float(s) for s in scales.values()}) > 10  # calibrated per layer

    theirs = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    specs = {n: ActivationSpec(strategy="tensor", dynamic=False, scale=float(scales[n])) for n in group["targets"]}
    with torch.no_grad():
        for name in group["targets"]:
            ours.get_submodule(name).weight.copy_(tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"])
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
        with quantized_inputs(ours, specs):
            a = ours(ids).logits
        b = theirs(ids).logits
        with quantized_inputs(ours, {n: ActivationSpec() for n in specs}):
            dynamic = ours(ids).logits  # per-token scales: a different arithmetic
    assert (a - b).abs().max() <= 1e-5 * a.abs().max(), float((a - b).abs().max())
    assert (dynamic - b).abs().max() > 100 * (a - b).abs().max()
    rc, stdout, err = invoke("eval", ct, "--reference", MODEL, "--data", "bundled:botchan-eval", "--max-tokens",
                             "1024", "--gen-prompts", "0", "--json")
    assert rc == 0, err
    ev, run = json.loads(stdout)["botchan-eval.txt"], report["eval"]["botchan-eval.txt"]
    assert ev["kl"] == pytest.approx(run["kl"], rel=1e-3, abs=1e-6)
    rc, _, err = invoke("run", recipe(tmp_path, scheme="bits: 8, activations: static", fmt="hf"), "--dry-run")
    assert rc == 1 and "give a `scheme`" in err, err
