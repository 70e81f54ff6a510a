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


def test_stored_weights_are_the_evaluated_weights_exactly():
    from compress.export.compressed_tensors import stored_weight
    from compress.quantize.rtn import rtn

    W = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    qw = rtn(W, 8, -1, True)
    w, s = stored_weight(qw)
    assert w.dtype == torch.int8 and s.shape == (48, 1)
    assert torch.equal(w.float() * s, qw.dequantize())
    with pytest.raises(ValueError, match="8-bit per-channel"):
        stored_weight(rtn(W, 4, 32, True))


@pytest.mark.parametrize("method,scheme", [("rtn", "w8a8-int8"), ("gptq", "w8a8-int8"), ("gptq", "fp8")])
def test_transformers_computes_what_the_run_evaluated(tmp_path, method, scheme):
    """The run's in-memory model with its activation hooks and transformers' load of the export (compressed-tensors
    decompresses the weights and quantizes each linear's input per token): the same logits, and `compress eval` of
    the export gives the run's KL."""
    from transformers import AutoModelForCausalLM

    from compress.export.hf import load_tensors
    from compress.quantize.activations import ActivationSpec, quantized_inputs

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, method, f"scheme: {scheme}"), "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["activations"]["layers"] == 28
    kind = "float" if scheme == "fp8" else "int"
    ct = out / "compressed-tensors"
    cfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == f"{kind}-quantized"
    group = cfg["config_groups"]["group_0"]
    assert group["input_activations"] == {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token",
                                          "dynamic": True} and len(group["targets"]) == 28
    assert group["weights"]["type"] == kind
    tensors = load_tensors(ct)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == (torch.float8_e4m3fn if kind == "float"
                                                                   else torch.int8)

    theirs = torch.nn.Module.float(AutoModelForCausalLM.from_pretrained(ct)).eval()
    ours = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        for name in group["targets"]:  # compress's dequantized weights, and its activation hooks
            ours.get_submodule(name).weight.copy_(tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"])
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
        with quantized_inputs(ours, {n: ActivationSpec(type=kind) for n in group["targets"]}):
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


@pytest.mark.parametrize("scheme", ["w8a8-int8", "fp8"])
def test_static_activation_scales_are_calibrated_stored_and_read(tmp_path, scheme):
    """`activations: static`: one input scale per layer, calibrated on the calibration text (max |x| / 127.5, or
    / 448 for fp8, in the export dtype), stored as `input_scale` with a per-tensor, non-dynamic group; transformers'
    load of the export computes what the run evaluated, and `compress eval` of it gives the run's KL. Without a
    scheme it is refused."""
    from transformers import AutoModelForCausalLM

    from compress.export.hf import load_tensors
    from compress.quantize.activations import ActivationSpec, quantized_inputs

    out = tmp_path / "out"
    kind = "float" if scheme == "fp8" else "int"
    r = recipe(tmp_path, "rtn", scheme=f"scheme: {scheme}, activations: static",
               fmt="{format: compressed-tensors, dtype: float32}")
    rc, stdout, err = invoke("run", r, "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["activations"]["static"] == 28
    ct = out / "compressed-tensors"
    group = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"] == {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "tensor",
                                          "dynamic": False} and len(group["targets"]) == 28
    tensors = load_tensors(ct)
    scales = {n: tensors[f"{n}.input_scale"] for n in group["targets"]}
    assert all(s.shape == (1,) and float(s) > 0 for s in scales.values())
    assert len({float(s) for s in scales.values()}) > 10  # calibrated per layer

    theirs = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    specs = {n: ActivationSpec(strategy="tensor", dynamic=False, scale=float(scales[n]), type=kind)
             for n in group["targets"]}
    with torch.no_grad():
        for name in group["targets"]:
            ours.get_submodule(name).weight.copy_(tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"])
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
        with quantized_inputs(ours, specs):
            a = ours(ids).logits
        b = theirs(ids).logits
        with quantized_inputs(ours, {n: ActivationSpec(type=kind) for n in specs}):
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


def test_fp8_weights_are_compressed_tensors_own_rounding():
    """`scheme: fp8` weights: RTN gives bit for bit the E4M3 elements and scales compressed-tensors' own observer and
    quantize give (llm-compressor's FP8_DYNAMIC), the export stores those bytes, and GPTQ on the same grid lowers the
    output error; every value is on the grid."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from compress.export.compressed_tensors import stored_weight
    from compress.qweight import qweights_to_tensors, tensors_to_qweights
    from compress.quantize import floatgrid
    from compress.quantize.gptq import gptq

    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 128, generator=g) * 0.05
    W[3, 5] = 0.9  # an outlier: its row's scale, the other elements small on the grid
    qw = floatgrid.rtn(W, -1, "e4m3")
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
    s, z = calculate_qparams(W.amin(1, keepdim=True), W.amax(1, keepdim=True), args)
    s = s.half().float()  # the export dtype's scale
    assert torch.equal(qw.scales, s)
    assert torch.equal(quantize(W, s, z, args, dtype=torch.float8_e4m3fn).view(torch.uint8), qw.codes)
    w, scale = stored_weight(qw)
    assert w.dtype == torch.float8_e4m3fn and torch.equal(w.float() * scale, qw.dequantize())
    assert qw.effective_bits() == 8 + 16 / 128
    back = tensors_to_qweights(*qweights_to_tensors({"l": qw}))["l"]
    assert back.fp == "e4m3" and torch.equal(back.dequantize(), qw.dequantize())

    X = torch.randn(512, 128, generator=g)
    H = 2 * X.T @ X / 512
    qg, _ = gptq(W, H, bits=8, group_size=-1, sym=True, fp="e4m3")
    err = {k: float(((X @ (q.dequantize() - W).T) ** 2).sum()) for k, q in (("rtn", qw), ("gptq", qg))}
    assert err["gptq"] < 0.95 * err["rtn"], err
    on_grid = floatgrid.encode(qg.dequantize() / qg.scales, "e4m3")
    assert torch.equal(floatgrid.decode(on_grid, "e4m3") * qg.scales, qg.dequantize())


def test_fp8_is_refused_where_it_cannot_run(tmp_path):
    """A method without a float grid (AutoRound), an LFQ final block, and an export that cannot carry it are refused
    at plan time, naming what can."""
    rc, _, err = invoke("run", recipe(tmp_path, "autoround", "scheme: fp8"), "--dry-run")
    assert rc == 1 and "rounds onto integer grids only" in err and "gptq or rtn" in err, err
    rc, _, err = invoke("run", recipe(tmp_path, "gptq", "scheme: fp8, final_block: lfq"), "--dry-run")
    assert rc == 1 and "final_block: same" in err, err
    rc, _, err = invoke("run", recipe(tmp_path, "rtn", "scheme: fp8", fmt="hf"), "--dry-run")
    assert rc == 1 and "`scheme: fp8`" in err and "hf cannot carry" in err, err
    rc, out, err = invoke("run", recipe(tmp_path, "gptq", "scheme: fp8"), "--dry-run", "--json")
    assert rc == 0, err
