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
    for wrong in ("w4a16", [], {"a": 1}):  # a list or a mapping once raised TypeError (found by the fuzz test)
        with pytest.raises(ValueError, match="Input should be 'w8a8-int8'"):
            Recipe.model_validate({**BASE, "stages": [{"stage": "quantize", "method": "rtn", "scheme": wrong}]})


def test_exports_that_cannot_carry_activations_are_refused_at_plan_time(tmp_path):
    rc, _, err = invoke("run", recipe(tmp_path, fmt="hf"), "--dry-run")
    assert rc == 1 and "quantizes activations too (`scheme: w8a8-int8`), which hf cannot carry" in err, err
    rc, _, err = invoke("run", recipe(tmp_path, scheme="bits: 8, group_size: -1"), "--dry-run")
    assert rc == 1 and "give the quantize stage `scheme: w8a8-int8`" in err, err
    rc, out, err = invoke("run", recipe(tmp_path), "--dry-run", "--json")
    assert rc == 0 and json.loads(out)["export"] == ["compressed-tensors"], err


def test_stored_weights_are_the_evaluated_weights_exactly():
    from compress.export.compressed_tensors import stored_tensors
    from compress.quantize.rtn import rtn

    W = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    qw = rtn(W, 8, -1, True)
    t = stored_tensors(qw)
    w, s = t["weight"], t["weight_scale"]
    assert w.dtype == torch.int8 and s.shape == (48, 1)
    assert torch.equal(w.float() * s, qw.dequantize())
    with pytest.raises(ValueError, match="8-bit per-channel"):
        stored_tensors(rtn(W, 8, 32, True))


@pytest.mark.parametrize("method,scheme", [("rtn", "w8a8-int8"), ("gptq", "w8a8-int8"), ("gptq", "fp8"),
                                           ("gptq", "fp8-block")])
def test_transformers_computes_what_the_run_evaluated(tmp_path, method, scheme):
    """The run's in-memory model with its activation hooks and transformers' load of the export (compressed-tensors
    decompresses the weights and quantizes each linear's input per token, or per token and group of 128): the same
    logits, and `compress eval` of the export gives the run's KL."""
    from transformers import AutoModelForCausalLM

    from compress.export.hf import load_tensors
    from compress.quantize.activations import SCHEME_ACTIVATIONS, quantized_inputs

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, method, f"scheme: {scheme}"), "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["activations"]["layers"] == 28
    kind = "int" if scheme == "w8a8-int8" else "float"
    spec = SCHEME_ACTIVATIONS[scheme]
    ct = out / "compressed-tensors"
    cfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == f"{kind}-quantized"
    group = cfg["config_groups"]["group_0"]
    assert group["input_activations"] == {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True,
                                          **({"strategy": "group", "group_size": 128} if scheme == "fp8-block" else
                                             {"strategy": "token"})} and len(group["targets"]) == 28
    assert group["weights"]["type"] == kind
    assert group["weights"]["strategy"] == ("block" if scheme == "fp8-block" else "channel")
    tensors = load_tensors(ct)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == (torch.float8_e4m3fn if kind == "float"
                                                                   else torch.int8)
    if scheme == "fp8-block":  # k_proj: 64 rows, one short block of rows; down_proj: 384 columns, 3 blocks
        assert tensors["model.layers.0.self_attn.k_proj.weight_scale"].shape == (1, 1)
        assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (1, 3)

    theirs = torch.nn.Module.float(AutoModelForCausalLM.from_pretrained(ct)).eval()
    ours = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        for name in group["targets"]:  # compress's dequantized weights (a block's scale over its 128 x 128), and its
            # activation hooks
            w, s = tensors[f"{name}.weight"].float(), tensors[f"{name}.weight_scale"]
            if scheme == "fp8-block":
                s = s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
            ours.get_submodule(name).weight.copy_(w * s)
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
        with quantized_inputs(ours, dict.fromkeys(group["targets"], spec)):
            a = ours(ids).logits
        b = theirs(ids).logits
        plain = ours(ids).logits  # without the activation quantization: visibly different
    _served_as_evaluated(a, b, plain, ct, report)


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

    from compress.export.compressed_tensors import stored_tensors
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
    t = stored_tensors(qw)
    w, scale = t["weight"], t["weight_scale"]
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


def test_fp8_block_weights_are_compressed_tensors_own_rounding():
    """`scheme: fp8-block` weights: RTN gives bit for bit the E4M3 elements compressed-tensors' block quantize gives
    with the observer's scale per 128 x 128 block (a short last block of rows included), the export stores one
    scale per block, compressed-tensors' dequantize of the stored tensors is the run's weight, and GPTQ on the same
    grid lowers the output error with every block sharing one scale."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from compress.export.compressed_tensors import stored_tensors
    from compress.qweight import qweights_to_tensors, tensors_to_qweights
    from compress.quantize import floatgrid
    from compress.quantize.gptq import gptq

    g = torch.Generator().manual_seed(0)
    W = torch.randn(200, 256, generator=g) * 0.05
    W[150, 5] = 3.0  # an outlier: the scale of its block (rows 128..199, columns 0..127) only
    qw = floatgrid.rtn(W, 128, "e4m3-block")
    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True,
                            dynamic=False)
    blocks = torch.nn.functional.pad(W, (0, 0, 0, 56)).reshape(2, 128, 2, 128).transpose(1, 2)  # (2, 2, 128, 128)
    s, z = calculate_qparams(blocks.amin((-1, -2)), blocks.amax((-1, -2)), args)
    s = s.half().float()
    assert s.shape == (2, 2) and s[1, 0] > 10 * s[1, 1]
    assert torch.equal(quantize(W, s, z, args, dtype=torch.float8_e4m3fn).view(torch.uint8), qw.codes)
    t = stored_tensors(qw)
    assert t["weight"].dtype == torch.float8_e4m3fn and torch.equal(t["weight_scale"], s)
    assert torch.equal(dequantize(t["weight"], t["weight_scale"], z, args=args).float(), qw.dequantize())
    assert qw.effective_bits() == 8 + 16 * 4 / (200 * 256)
    back = tensors_to_qweights(*qweights_to_tensors({"l": qw}))["l"]
    assert back.fp == "e4m3-block" and torch.equal(back.dequantize(), qw.dequantize())

    X = torch.randn(512, 256, generator=g)
    H = 2 * X.T @ X / 512
    qg, _ = gptq(W, H, bits=8, group_size=128, sym=True, fp="e4m3-block")
    err = {k: float(((X @ (q.dequantize() - W).T) ** 2).sum()) for k, q in (("rtn", qw), ("gptq", qg))}
    assert err["gptq"] < 0.95 * err["rtn"], err
    assert stored_tensors(qg)["weight_scale"].shape == (2, 2)  # one scale per block, or it raises
    on_grid = floatgrid.encode(qg.dequantize() / floatgrid.per_column(qg.scales, 256, 128), "e4m3")
    assert torch.equal(floatgrid.decode(on_grid, "e4m3") * floatgrid.per_column(qg.scales, 256, 128),
                       qg.dequantize())


def test_fp8_block_needs_whole_blocks_of_columns(tmp_path):
    """The layers whose in_features 128 does not divide (stories260K: 64, 172, every one) are refused at plan time
    together, with the one skip override that leaves them in full precision; static activations are refused by the
    recipe."""
    p = tmp_path / "r.yaml"
    p.write_text(recipe(tmp_path, "rtn", "scheme: fp8-block").read_text().replace(str(MODEL),
                                                                                   str(MODELS / "stories260K")))
    rc, _, err = invoke("run", p, "--dry-run")
    assert rc == 1 and "scales groups of 128 columns, which do not divide the in_features (64, 172) of 35 layers" \
        in err and "{pattern: '(down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)$', skip: true}" in err, err
    rc, _, err = invoke("run", recipe(tmp_path, "rtn", "scheme: fp8-block, activations: static"), "--dry-run")
    assert rc == 1 and "per group at run time" in err, err
    rc, out, err = invoke("run", recipe(tmp_path, "gptq", "scheme: fp8-block"), "--dry-run", "--json")
    assert rc == 0, err


def test_fp8_is_refused_where_it_cannot_run(tmp_path, monkeypatch):
    """A method without a float grid (a quantizer that does not declare FLOAT) and an export that cannot carry it are
    refused at plan time, naming what can; AutoRound and an LFQ final block plan."""
    from compress.quantize.rtn import RTN

    for method in ("autoround", "gptq"):
        rc, _, err = invoke("run", recipe(tmp_path, method, "scheme: fp8, final_block: lfq"), "--dry-run")
        assert rc == 0, err
    monkeypatch.setattr(RTN, "capabilities", frozenset())
    rc, _, err = invoke("run", recipe(tmp_path, "rtn", "scheme: fp8"), "--dry-run")
    assert rc == 1 and "rounds onto integer grids only" in err and "autoround, gptq" in err, err
    monkeypatch.undo()
    rc, _, err = invoke("run", recipe(tmp_path, "rtn", "scheme: fp8", fmt="hf"), "--dry-run")
    assert rc == 1 and "`scheme: fp8`" in err and "hf cannot carry" in err, err
    rc, out, err = invoke("run", recipe(tmp_path, "gptq", "scheme: fp8"), "--dry-run", "--json")
    assert rc == 0, err


def test_nvfp4_weights_are_compressed_tensors_own_rounding():
    """`scheme: nvfp4a16`: RTN gives bit for bit the packed E2M1 codes, E4M3 group scales and global scale of
    compressed-tensors' own NVFP4A16 observer and packer (a zero group included), q/k/v share one global scale (the
    smallest, as llm-compressor fuses them for vLLM), and GPTQ on the same grid lowers the output error."""
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    from compress.export.compressed_tensors import stored_tensors
    from compress.qweight import qweights_to_tensors, tensors_to_qweights
    from compress.quantize import floatgrid
    from compress.quantize.gptq import gptq

    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 128, generator=g) * 0.05
    W[2, :16] = 0
    gs = generate_gparam(W.min(), W.max())
    Wg = W.reshape(64, -1, 16)
    s, _ = calculate_qparams(Wg.amin(-1), Wg.amax(-1), NVFP4A16["weights"], global_scale=gs)
    qw = floatgrid.rtn(W, 16, "e2m1")
    assert qw.global_scale == float(gs) and torch.equal(qw.scales, s.float() / gs)
    t = stored_tensors(qw)
    assert torch.equal(t["weight_packed"], quantize_and_pack_fp4(W, s, gs, None, 16))
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and torch.equal(t["weight_scale"].float(), s.float())
    assert qw.effective_bits() == 4 + 8 / 16 + 32 / W.numel()
    back = tensors_to_qweights(*qweights_to_tensors({"l": qw}))["l"]
    assert back.global_scale == qw.global_scale and torch.equal(back.dequantize(), qw.dequantize())

    shared = floatgrid.global_scales({"m.q_proj": W, "m.k_proj": 3 * W, "m.o_proj": W})
    assert shared["m.q_proj"] == shared["m.k_proj"] == floatgrid.global_scale(3 * W)
    assert shared["m.o_proj"] == floatgrid.global_scale(W) > shared["m.q_proj"]  # not fused: its own

    X = torch.randn(512, 128, generator=g)
    H = 2 * X.T @ X / 512
    qg, _ = gptq(W, H, bits=4, group_size=16, sym=True, fp="e2m1")
    err = {k: float(((X @ (q.dequantize() - W).T) ** 2).sum()) for k, q in (("rtn", qw), ("gptq", qg))}
    assert err["gptq"] < 0.95 * err["rtn"], err
    assert qg.global_scale == qw.global_scale and torch.equal(stored_tensors(qg)["weight_scale"].float() /
                                                              qg.global_scale, qg.scales)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_nvfp4_export_loads_in_transformers(tmp_path, method):
    """The `nvfp4-pack-quantized` export: transformers (through compressed-tensors, which unpacks to bfloat16) holds
    exactly compress's weights rounded to bfloat16, so in bfloat16 both compute the same logits; `compress eval` of the
    export gives the run's KL to 1% (its weights bf16-rounded); activations stay in full precision, and `activations:
    static` is refused for this weight-only scheme."""
    from transformers import AutoModelForCausalLM

    from compress.export.hf import load_tensors
    from compress.qweight import decode_float

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, method, "scheme: nvfp4a16"), "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert "activations" not in report and 4.5 < report["size"]["effective_bits"] < 4.52
    ct = out / "compressed-tensors"
    cfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "nvfp4-pack-quantized"
    group = cfg["config_groups"]["group_0"]
    assert "input_activations" not in group and len(group["targets"]) == 28
    assert group["weights"]["strategy"] == "tensor_group" and group["weights"]["group_size"] == 16
    tensors = load_tensors(ct)
    theirs = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.bfloat16).eval()
    ours = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()  # its rotary tables in fp32
    with torch.no_grad():
        for name in group["targets"]:  # compress's exact fp32 weights, rounded to bfloat16 by the copy
            p = tensors[f"{name}.weight_packed"]
            codes = torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1)
            s = tensors[f"{name}.weight_scale"].float() / tensors[f"{name}.weight_global_scale"]
            assert len(set(tensors[f"{name}.weight_global_scale"].tolist())) == 1
            ours.get_submodule(name).weight.copy_(decode_float(codes, "e2m1") * s.repeat_interleave(16, 1))
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
        b = theirs(ids).logits  # the first forward decompresses the weights
        for name in group["targets"]:
            assert torch.equal(theirs.get_submodule(name).weight, ours.get_submodule(name).weight), name
        a = ours(ids).logits
    assert torch.equal(a, b)
    gs = [float(tensors[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"]) for p in "qkv"]
    assert gs[0] == gs[1] == gs[2]  # vLLM fuses q/k/v into one weight with one global scale
    rc, stdout, err = invoke("eval", ct, "--reference", MODEL, "--data", "bundled:botchan-eval", "--max-tokens",
                             "1024", "--gen-prompts", "0", "--json")
    assert rc == 0, err
    ev, run = json.loads(stdout)["botchan-eval.txt"], report["eval"]["botchan-eval.txt"]
    assert ev["kl"] == pytest.approx(run["kl"], rel=1e-2)
    rc, _, err = invoke("run", recipe(tmp_path, method, "scheme: nvfp4a16, activations: static"), "--dry-run")
    assert rc == 1 and "leaves them in full precision" in err, err
    rc, _, err = invoke("run", recipe(tmp_path, method, "scheme: nvfp4a16", fmt="hf"), "--dry-run")
    assert rc == 1 and "rounds onto the NVFP4 float grid" in err and "export `compressed-tensors`" in err, err


@pytest.mark.parametrize("scheme", ["fp8", "fp8-block", "nvfp4a16"])
def test_autoround_tunes_the_float_grid(scheme):
    """AutoRound on a float grid: the scales are the observer's (RTN's), the tuned rounding offsets move some codes
    to the other neighbouring grid value, never off the grid, and lower the block's output error against RTN."""
    from compress.driver import BlockData, LayerSpec
    from compress.quantize import floatgrid
    from compress.quantize.signround import AutoRoundConfig, signround_block

    g = torch.Generator().manual_seed(0)
    fp, group = {"fp8": ("e4m3", -1), "fp8-block": ("e4m3-block", 128), "nvfp4a16": ("e2m1", 16)}[scheme]
    d_in, d_out = (256, 160) if scheme == "fp8-block" else (64, 32)  # blocks: 2 x 2, the second of 32 rows
    lin = torch.nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d_out, d_in, generator=g) * 0.05)
    block = torch.nn.Sequential(lin)
    spec = LayerSpec(4 if fp == "e2m1" else 8, group, True, fp=fp)
    channels = 1 + torch.rand(d_in, generator=g) * 4  # a few loud input channels, the same in every batch
    xs = [torch.randn(4, 16, d_in, generator=g) * channels for _ in range(4)]
    with torch.no_grad():
        targets = [lin(x) for x in xs]
    W = lin.weight.data.clone()
    data = BlockData(index=0, block=block, linears={"0": lin}, specs={"0": spec}, inputs=xs, kwargs=[{}] * 4,
                     fp_targets=targets)
    qw = signround_block(data, AutoRoundConfig(bits=spec.bits, group_size=group, iters=200, final_block="same"))["0"]
    ref = floatgrid.rtn(W, group, fp)
    assert qw.fp == fp and torch.equal(qw.scales, ref.scales) and qw.global_scale == ref.global_scale
    assert 0 < int((qw.codes != ref.codes).sum()) < W.numel() // 4
    s = qw.scales.repeat_interleave(W.shape[1] // qw.n_groups, 1)
    assert torch.equal(floatgrid.decode(floatgrid.encode(qw.dequantize() / s, fp), fp) * s, qw.dequantize())

    def err(q):
        return sum(float(((x @ (q.dequantize() - W).T) ** 2).sum()) for x in xs)
    assert err(qw) < err(ref)


def test_mxfp4_weights_are_compressed_tensors_own_rounding(tmp_path):
    """`scheme: mxfp4a16`: RTN gives bit for bit the packed E2M1 codes and E8M0 scales of compressed-tensors' MXFP4A16
    observer and packer (a zero group and a loud group included); the export loads in transformers and `compress
    eval` of it gives the run's KL (power-of-two scales: exact in bfloat16)."""
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams

    from compress.export.compressed_tensors import stored_tensors
    from compress.quantize import floatgrid

    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    W[2, :32] = 0
    W[3, 32:64] *= 100
    Wg = W.reshape(64, -1, 32)
    s, _ = calculate_qparams(Wg.amin(-1), Wg.amax(-1), MXFP4A16["weights"])
    qw = floatgrid.rtn(W, 32, "mxfp4")
    assert torch.equal(qw.scales, s.float()) and qw.global_scale is None
    t = stored_tensors(qw)
    assert torch.equal(t["weight_packed"], quantize_and_pack_fp4(W, s, None, None, 32))
    assert torch.equal(t["weight_scale"], compress_mx_scale(s, torch.uint8))
    assert qw.effective_bits() == 4 + 8 / 32

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, "gptq", "scheme: mxfp4a16"), "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    ct = out / "compressed-tensors"
    cfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mxfp4-pack-quantized"
    assert cfg["config_groups"]["group_0"]["weights"]["group_size"] == 32
    rc, stdout, err = invoke("eval", ct, "--reference", MODEL, "--data", "bundled:botchan-eval", "--max-tokens",
                             "1024", "--gen-prompts", "0", "--json")
    assert rc == 0, err
    ev, run = json.loads(stdout)["botchan-eval.txt"], report["eval"]["botchan-eval.txt"]
    assert ev["kl"] == pytest.approx(run["kl"], rel=1e-4)


def test_scales_are_stored_exactly_in_a_half_precision_export(tmp_path):
    """A float16 export keeps the unquantized tensors in float16 and every weight scale in float32 (the exact value
    the run evaluated, whatever the export dtype), which transformers reads back."""
    from compress.export.hf import load_tensors

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, "rtn", fmt="compressed-tensors"), "-o", out, "--json")
    assert rc == 0, err
    tensors = load_tensors(out / "compressed-tensors")
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16
    rc, ev, err = invoke("eval", out / "compressed-tensors", "--reference", MODEL, "--data", "bundled:botchan-eval",
                         "--max-tokens", "1024", "--gen-prompts", "0", "--json")
    assert rc == 0, err
    run = json.loads(stdout)["eval"]["botchan-eval.txt"]["kl"]
    assert json.loads(ev)["botchan-eval.txt"]["kl"] == pytest.approx(run, rel=0.05)


def test_int4_weights_are_compressed_tensors_own_layout():
    """`w4a8-int8` / `w4a8-fp8` / `w4a4` weights: compressed-tensors' own `int-quantized` compression of the run's
    dequantized weight (the format it infers for the W4A8 / W4AFP8 / W4A4 presets), scales float32 per group."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from compress.export.compressed_tensors import FORMATS, stored_tensors
    from compress.quantize.rtn import rtn

    for preset in ("W4A8", "W4AFP8", "W4A4"):
        scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
        assert infer_module_format(torch.nn.Linear, scheme).value == FORMATS["int4"]
    W = torch.randn(48, 200, generator=torch.Generator().manual_seed(0))
    W[3, :40] = 0  # a zero group
    qw = rtn(W, 4, 40, True)
    t = stored_tensors(qw)
    assert t["weight"].dtype == torch.int8 and t["weight_scale"].dtype == torch.float32
    assert t["weight_scale"].shape == (48, 5) and int(t["weight"].min()) >= -8 and int(t["weight"].max()) <= 7
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=40)
    theirs = quantize(qw.dequantize(), t["weight_scale"], torch.zeros_like(t["weight_scale"], dtype=torch.int8),
                      args, dtype=torch.int8)
    assert torch.equal(theirs, t["weight"])
    assert torch.equal(t["weight"].float() * t["weight_scale"].repeat_interleave(40, 1), qw.dequantize())
    with pytest.raises(ValueError, match="4-bit grouped symmetric"):
        stored_tensors(rtn(W, 4, 40, False))


@pytest.mark.parametrize("method,scheme", [("gptq", "w4a8-int8"), ("rtn", "w4a8-fp8"), ("rtn", "w4a4")])
def test_int4_schemes_load_in_transformers_as_evaluated(tmp_path, method, scheme):
    """W4A8 (int8 or FP8 activations) and W4A4: transformers' load of the `int-quantized` export computes the run's
    logits (compress's dequantized weights with its activation hooks), and `compress eval` of it gives the run's KL."""
    from transformers import AutoModelForCausalLM

    from compress.export.hf import load_tensors
    from compress.quantize.activations import SCHEME_ACTIVATIONS, quantized_inputs

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, method, f"scheme: {scheme}"), "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    ct = out / "compressed-tensors"
    cfg = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "int-quantized" and len(cfg["config_groups"]) == 1
    group = cfg["config_groups"]["group_0"]
    spec = SCHEME_ACTIVATIONS[scheme]
    assert group["weights"] == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                "dynamic": False, "group_size": 128} and group["format"] == "int-quantized"
    assert group["input_activations"] == {"num_bits": spec.bits, "type": spec.type, "symmetric": True,
                                          "strategy": "token", "dynamic": True} and len(group["targets"]) == 28
    tensors = load_tensors(ct)
    theirs = torch.nn.Module.float(AutoModelForCausalLM.from_pretrained(ct)).eval()
    ours = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        for name in group["targets"]:  # compress's dequantized weights (int4 values in int8), its activation hooks
            q = tensors[f"{name}.weight"]
            assert q.dtype == torch.int8 and -8 <= int(q.min()) and int(q.max()) <= 7
            ours.get_submodule(name).weight.copy_(q * tensors[f"{name}.weight_scale"].repeat_interleave(128, 1))
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
        with quantized_inputs(ours, dict.fromkeys(group["targets"], spec)):
            a = ours(ids).logits
        b = theirs(ids).logits
        plain = ours(ids).logits
    _served_as_evaluated(a, b, plain, ct, report)


def _served_as_evaluated(a, b, plain, ct, report):
    """transformers' logits `b` are the run's (`a`: compress's weights and activation hooks; `plain`: without the
    hooks, visibly different), and `compress eval` of the export `ct` gives the run's KL and top-1."""
    assert (a - b).abs().max() <= 1e-5 * a.abs().max(), float((a - b).abs().max())
    assert (plain - b).abs().max() > 100 * (a - b).abs().max()
    rc, stdout, err = invoke("eval", ct, "--reference", MODEL, "--data", "bundled:botchan-eval", "--max-tokens",
                             "1024", "--gen-prompts", "0", "--json")
    assert rc == 0, err
    ev, run = json.loads(stdout)["botchan-eval.txt"], report["eval"]["botchan-eval.txt"]
    assert ev["kl"] == pytest.approx(run["kl"], rel=1e-3, abs=1e-6) and ev["top1"] == pytest.approx(run["top1"])


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "fp8-block"])
def test_group_activations_are_compressed_tensors_arithmetic(scheme):
    """`nvfp4` / `mxfp4` activations (E2M1 per 16 under a global scale / per 32 with power-of-two scales) and
    `fp8-block`'s (E4M3 per token and group of 128): compress's fake quantization equals compressed-tensors'
    `forward_quantize` with the preset's `input_activations` bit for bit in float32, an outlier group included."""
    from dataclasses import replace

    from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    from compress.quantize.activations import SCHEME_ACTIVATIONS, fake_quant

    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 1, 7] = 40.0
    spec = SCHEME_ACTIVATIONS[scheme]
    module = torch.nn.Module()
    module.quantization_status = QuantizationStatus.FROZEN
    if scheme == "nvfp4":
        g = 448 * 6 / float(x.abs().amax()) / 2  # a calibrated global scale from a wider range than x's
        module.input_global_scale = torch.nn.Parameter(torch.tensor([g]), requires_grad=False)
        spec = replace(spec, scale=g)
    theirs = forward_quantize(module, x, "input", QuantizationArgs(**spec.as_compressed_tensors()))
    assert torch.equal(fake_quant(x, spec), theirs)
    assert not torch.equal(theirs, x)


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_fp4_w4a4_export_is_served_as_evaluated(tmp_path, scheme):
    """`scheme: nvfp4` / `mxfp4` (llm-compressor's NVFP4 / MXFP4 presets, W4A4): the export carries the FP4
    `input_activations` (NVFP4: each layer's calibrated `input_global_scale`, 448 * 6 / max |x| over the calibration
    text, equal for the layers reading one input); `compress eval` of it gives the run's KL exactly (its reading: the
    exact weights, compressed-tensors' activation arithmetic in float32); transformers loads it (in bfloat16, the
    library's only decompression) and quantizes the activations: on real text its KL to the FP model is compress's
    (to 20%: bf16 scales round other elements), well above the weights' alone. `activations: static` is refused."""
    from transformers import AutoModelForCausalLM

    from compress.export.compressed_tensors import as_evaluated

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, "rtn", f"scheme: {scheme}"), "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    serving = report["serving"]  # vLLM CUDA (Blackwell) runs FP4 W4A4 in half precision, its CPU build has no kernel
    assert report["activations"]["layers"] == 28 and all("dtype" in p for p in serving["vllm"])
    assert any("no CPU kernel" in p or "CPU build" in p for p in serving["vllm-cpu"]), serving["vllm-cpu"]
    ct = out / "compressed-tensors"
    group = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    a = group["input_activations"]
    assert (a["strategy"], a["group_size"], a["dynamic"]) == (("tensor_group", 16, "local") if scheme == "nvfp4"
                                                             else ("group", 32, True))
    if scheme == "nvfp4":
        from compress.export.hf import load_tensors

        t = load_tensors(ct)
        gs = [float(t[f"model.layers.0.self_attn.{p}_proj.input_global_scale"]) for p in "qkv"]
        assert gs[0] == gs[1] == gs[2] > 0 and float(t["model.layers.0.self_attn.o_proj.input_global_scale"]) != gs[0]
    rc, stdout, err = invoke("eval", ct, "--reference", MODEL, "--data", "bundled:botchan-eval", "--max-tokens",
                             "1024", "--gen-prompts", "0", "--json")
    assert rc == 0, err
    assert json.loads(stdout)["botchan-eval.txt"]["kl"] == pytest.approx(report["eval"]["botchan-eval.txt"]["kl"],
                                                                          rel=1e-5)

    from transformers import AutoTokenizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from compress import data as bundled
    from compress.eval.data import read_text, token_stream

    ids = token_stream(AutoTokenizer.from_pretrained(MODEL), read_text(bundled.resolve("bundled:botchan-eval")))
    ids = ids[:256].reshape(2, 128)
    ours = torch.nn.Module.float(AutoModelForCausalLM.from_pretrained(
        ct, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))).eval()
    with torch.no_grad():
        fp = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()(ids).logits.log_softmax(-1)
        plain = ours(ids).logits.log_softmax(-1)  # weights only: the dequantized load drops the activations' rounding
        assert as_evaluated(ours, ct) == ["FP4 activations of 28 layers quantized by compress's hooks (weights "
                                          "dequantized)"]
        evaluated = ours(ids).logits.log_softmax(-1)
        theirs = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.bfloat16).eval()(ids).logits.float()
    kl = {k: float((fp.exp() * (fp - v)).sum(-1).mean()) for k, v in
          (("plain", plain), ("evaluated", evaluated), ("theirs", theirs.log_softmax(-1)))}
    # transformers' bf16 arithmetic rounds other elements (its FP4 scales are computed in bf16): the same loss
    assert kl["theirs"] == pytest.approx(kl["evaluated"], rel=0.2) and kl["theirs"] > 1.5 * kl["plain"], kl
    rc, _, err = invoke("run", recipe(tmp_path, "rtn", f"scheme: {scheme}, activations: static"), "--dry-run")
    assert rc == 1 and "remove `activations: static`" in err, err


def test_fp4_reading_resolves_llm_compressor_targets():
    """llm-compressor's config groups target the module class (`Linear`) or `re:` patterns, compress's name the
    layers: each resolves to the packed layers the checkpoint stores (the LM head, ignored, has none)."""
    from compress.export.compressed_tensors import _targets

    tensors = dict.fromkeys(["a.q_proj.weight_packed", "a.o_proj.weight_packed", "lm_head.weight", "a.q_proj.x"])
    assert _targets(["Linear"], tensors) == ["a.q_proj", "a.o_proj"]
    assert _targets(["re:.*q_proj$"], tensors) == ["a.q_proj"]
    assert _targets(["a.o_proj"], tensors) == ["a.o_proj"]
