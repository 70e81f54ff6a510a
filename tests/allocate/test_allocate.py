"""The `allocate` stage (docs/allocate.md#tests) and the mixed-precision QuantizedWeight through packing,
kernels, the workspace and the exports."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import CAL, MODELS, REPO, TEXT, invoke, plan_path
from helpers import check_reload
from tiny import tiny_causal

from compress.allocate.problem import Option
from compress.errors import BadInput
from compress.kernels.backends import QuantLinear
from compress.kernels.packing import mixed_pack, mixed_unpack
from compress.primitives import fit_mixed
from compress.qweight import qweights_to_tensors, tensors_to_qweights

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
OPTS = [Option(2, "minmax"), Option(3, "minmax"), Option(4, "minmax"), Option(16, "keep")]


@pytest.mark.e2e  # moved out of the default tier (its time budget); CI runs -m e2e
def test_rl_stage_with_sensitivity_and_warm_start(tmp_path):
    common = dict(updates=2, episodes=2, reward_samples=2, reward_seqlen=32, select_samples=4, select_seqlen=64)
    out = tmp_path / "rl"
    rc, _, err = invoke("run", recipe(tmp_path, method="rl", warm_start=20, keep_best=2, **common),
                        "--output", out, "--json")
    assert rc == 0, err
    plan = json.loads(plan_path(out).read_text())
    info = plan["info"]
    assert 2.49 < plan["effective_bits"] <= 2.5
    assert set(info["layer_sensitivity"]) == set(plan["layers"]) and min(info["layer_sensitivity"].values()) > 0
    assert info["picked"] and info["final_select"] <= 0
    out = tmp_path / "rl0"
    rc, _, err = invoke("run", recipe(tmp_path, method="rl", warm_start=0, sensitivity="none", steps="layer", **common),
                        "--output", out, "--json")
    assert rc == 0, err
    info = json.loads(plan_path(out).read_text())["info"]
    assert "layer_sensitivity" not in info and info["picked"] != "reference"
    out = tmp_path / "rlu"
    rc, _, err = invoke("run", recipe(tmp_path, method="rl", sensitivity="unit", terminal="kl", **common),
                        "--output", out, "--json")
    assert rc == 0, err
    plan = json.loads(plan_path(out).read_text())
    w = plan["info"]["unit_sensitivity"]
    assert len(w) == sum(len(v["options"]) for v in plan["layers"].values()) and min(w) > 0
    assert plan["effective_bits"] <= 2.5 and plan["info"]["final_select"] <= 0  # -kappa * KL


@pytest.mark.e2e  # moved out of the default tier (its time budget); CI runs -m e2e
def test_greedy_with_the_rl_controllers_statistics(tmp_path):
    """`sensitivity: layer` on greedy measures the same layer weights as the rl stage (same selection slice)
    and solves the weighted problem; the weights change the plan."""
    sl = dict(select_samples=4, select_seqlen=64)
    plans = {}
    for name, extra in [("plain", {}), ("sens", {"sensitivity": "layer", **sl}),
                        ("rl", dict(updates=1, episodes=2, reward_samples=2, reward_seqlen=32, warm_start=1, **sl))]:
        out = tmp_path / name
        method = "rl" if name == "rl" else "greedy"
        rc, _, err = invoke("run", recipe(tmp_path, method=method, **extra), "--output", out, "--json")
        assert rc == 0, err
        plans[name] = json.loads(plan_path(out).read_text())
    sens = plans["sens"]["info"]["layer_sensitivity"]
    assert sens == plans["rl"]["info"]["layer_sensitivity"] and "layer_sensitivity" not in plans["plain"]["info"]
    assert 2.49 < plans["sens"]["effective_bits"] <= 2.5
    assert plans["sens"]["layers"] != plans["plain"]["layers"]


@pytest.mark.e2e  # moved out of the default tier (its time budget); CI runs -m e2e
def test_refine_in_the_stage(tmp_path):
    """`refine` after greedy: the plan records the moves, its selection loss did not rise, the budget holds."""
    out = tmp_path / "refined"
    rc, _, err = invoke("run", recipe(tmp_path, method="greedy", refine=40, select_samples=4, select_seqlen=64),
                        "--output", out, "--json")
    assert rc == 0, err
    plan = json.loads(plan_path(out).read_text())
    r = plan["info"]["refine"]
    assert r["tries"] == 40 and r["evaluated"] > 0 and r["loss_end"] <= r["loss_start"]
    assert plan["effective_bits"] <= 2.5


# -- (4) mixed weights through packing, kernels, workspace, export -------------------------------------------
def mixed_of(W, seed, with_keep=True):
    gen = torch.Generator().manual_seed(seed)
    widths = (2, 3, 4, 8, 16) if with_keep else (2, 3, 4, 8)
    n = -(-W.shape[1] // 32)
    opts = [(widths[int(i)], "keep" if widths[int(i)] == 16 else "clip")
            for i in torch.randint(0, len(widths), (n,), generator=gen)]
    if with_keep:
        opts[0] = (16, "keep")
    return fit_mixed(W, opts, 32, 32, False, torch.rand(W.shape[1], generator=gen), 3)


def test_mixed_pack_roundtrip_and_backends():
    W = torch.randn(64, 172)  # a short last chunk, as stories260K's down_proj
    qw = mixed_of(W, 0)
    back = mixed_unpack(*mixed_pack(qw))
    for f in ("codes", "scales", "zeros", "kept", "chunk_bits"):
        assert torch.equal(torch.as_tensor(getattr(back, f)), torch.as_tensor(getattr(qw, f))), f
    x = torch.randn(3, 172)
    ref = x @ qw.dequantize().T
    for backend in ("auto", "reference"):
        assert (QuantLinear(qw, None, backend)(x) - ref).abs().max() < 1e-4
    tensors, meta = qweights_to_tensors({"a": qw})
    again = tensors_to_qweights(tensors, json.loads(json.dumps(meta)))["a"]
    assert torch.equal(again.dequantize(), qw.dequantize()) and again.chunk_bits == qw.chunk_bits


def test_mixed_hf_export_reproduces_fake_quant(tmp_path):
    from compress.export.hf import export_hf

    model = tiny_causal("llama")
    qweights = {}
    for k, (name, m) in enumerate((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)):
        if name.startswith("model.layers."):
            qw = mixed_of(m.weight.data, k, with_keep=(k == 3))
            m.weight.data = qw.dequantize()
            qweights[name] = qw
    export_hf(model, qweights, None, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert set(config["compress"]["meta"]["mixed"]) == set(qweights)
    _, back, loaded = check_reload(model, {n: q for n, q in qweights.items() if q.kept is None}, tmp_path / "hf", 128)
    kept_layer = next(n for n, q in qweights.items() if q.kept is not None)
    assert kept_layer not in back  # an fp16 chunk makes the layer dense (module docstring of export/hf.py)
    for name, qw in back.items():
        assert qw.chunk_bits == qweights[name].chunk_bits


# -- recipe, plan file, plan-time errors -------------------------------------------------------------
def recipe(tmp_path, method="greedy", budget=2.5, **alloc):
    rec = {"version": 1, "model": {"path": str(MODELS / "stories260K")},
           "calibration": {"sources": [str(TEXT / "tinystories" / "tinystories_val.txt")], "nsamples": 8,
                           "seqlen": 64},
           "stages": [{"stage": "allocate", "method": method, "budget": budget, "group_size": 64, "chunk_size": 64,
                       "options": [{"bits": 2}, {"bits": 3}, {"bits": 4}, {"bits": 2, "treatment": "clip"}],
                       **alloc},
                      {"stage": "quantize", "method": "rtn", "group_size": 64, "sym": False}],
           "eval": {"enabled": False}}
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


def test_plan_time_errors(tmp_path):
    rc, _, err = invoke("run", recipe(tmp_path, budget=2.5), "--output", tmp_path / "o", "--dry-run")
    assert rc == 0, err
    rc, _, err = invoke("run", recipe(tmp_path, budget=2.25), "--output", tmp_path / "o", "--dry-run")
    assert rc != 0 and "below the cheapest plan" in err
    rc, _, err = invoke("run", recipe(tmp_path, chunk_size=96), "--output", tmp_path / "o", "--dry-run")
    assert rc != 0 and "chunk_size 96 is not a multiple of group_size 64" in err
    rc, _, err = invoke("run", recipe(tmp_path, method="file", budget=None), "--output", tmp_path / "o", "--dry-run")
    assert rc != 0


def test_the_bind_step_hands_the_plan_to_the_next_quantize_stage():
    """The bind step finds the quantize stage an allocation is for by position (an identical `allocate` config
    after it is not "another allocate before it"), fills `group_size`/`sym`/`chunk_size` from it, and refuses
    a plan nobody applies, one overwritten before use, and a quantizer that cannot fit it."""
    from types import SimpleNamespace as NS

    from tiny import tiny_causal

    from compress.allocate.configs import GreedyConfig
    from compress.bind import bind
    from compress.models.adapters import ModelAdapter
    from compress.quantize.gptq import GPTQConfig
    from compress.quantize.rtn import RTNConfig
    from compress.recipe import ExportSpec

    adapter = ModelAdapter(tiny_causal("llama"))

    def run(*stages):
        return bind(NS(stage_configs=list(stages), export=ExportSpec(), model=NS(stream=False)), adapter)

    a, q = GreedyConfig(budget=4.5), RTNConfig(bits=4, group_size=32, sym=True)
    b = run(a, q, GreedyConfig(budget=4.5), RTNConfig(bits=4, group_size=32, sym=True))
    assert (b.stages[0].cfg.group_size, b.stages[0].cfg.sym, b.stages[0].cfg.chunk_size) == (32, True, 32)
    assert b.stages[1].facts.plan_from == "00-allocate-greedy" and b.stages[3].facts.plan_from == "02-allocate-greedy"
    assert set(b.stages[0].facts.layers) == set(b.stages[1].facts.layers)
    with pytest.raises(BadInput, match="another `allocate`"):
        run(a, GreedyConfig(budget=4.5), q)
    with pytest.raises(BadInput, match="needs a `quantize` stage after it"):
        run(q, a)
    with pytest.raises(BadInput, match="uses method `gptq`"):
        run(a, GPTQConfig(bits=4, group_size=32))
    with pytest.raises(BadInput, match="must agree"):
        run(GreedyConfig(budget=4.5, group_size=64), q)


def test_a_plan_is_applied_once(tmp_path):
    """allocate -> rtn -> rtn W8: the plan is consumed by the first quantize stage only; the second rounds every
    layer at its own 8 bits (the run's weights are the later stage's: no mixed layer, ~8.5 effective bits)."""
    rec = yaml.safe_load(recipe(tmp_path).read_text())
    rec["stages"].append({"stage": "quantize", "method": "rtn", "bits": 8, "group_size": 64, "sym": False})
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump(rec))
    rc, stdout, err = invoke("run", path, "--output", tmp_path / "o", "--json")
    assert rc == 0, err
    size = json.loads(stdout)["size"]
    assert 8 < size["effective_bits"] < 9 and size["quantized_layers"] == 5 * 7


def test_run_plan_artifacts_and_plan_file(tmp_path):
    out = tmp_path / "g"
    rc, stdout, err = invoke("run", recipe(tmp_path), "--output", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    plan = json.loads(plan_path(out).read_text())
    assert plan["effective_bits"] <= 2.5 and plan["effective_bits"] > 2.49
    assert report["size"]["effective_bits"] == round(plan["effective_bits"], 4)
    assert plan_path(out).with_name("plan_heatmap.png").stat().st_size > 1000
    assert "plan_heatmap.png" in (out / "report.md").read_text()
    # the same plan from the file: no search, identical quantized weights
    path = tmp_path / "file.yaml"
    rec = yaml.safe_load(recipe(tmp_path).read_text())
    rec["stages"][0] = {"stage": "allocate", "method": "file", "path": str(plan_path(out))}
    path.write_text(yaml.safe_dump(rec))
    rc, _, err = invoke("run", path, "--output", tmp_path / "f", "--json")
    assert rc == 0, err
    from safetensors.torch import load_file

    for blk in sorted((out / "stages" / "01-quantize-rtn").glob("*.safetensors")):
        a, b = load_file(str(blk)), load_file(str(tmp_path / "f" / "stages" / "01-quantize-rtn" / blk.name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads(plan_path(tmp_path / "f").read_text())["layers"] == plan["layers"]


def mixed_stories260k():
    """stories260K with every block linear mixed (2/3/4/8 bits and fp16 chunks, g32), W <- W_hat."""
    from helpers import load

    model = load("stories260K")
    qweights = {}
    for k, (name, m) in enumerate((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)):
        if name.startswith("model.layers."):
            qw = mixed_of(m.weight.data, k, with_keep=(k % 5 == 0))
            m.weight.data = qw.dequantize()
            qweights[name] = qw
    return model, qweights


@pytest.mark.slow  # two graph traces (~27 s)
def test_mixed_onnx_and_openvino_reproduce_the_model(tmp_path):
    import openvino as ov
    from helpers import op_types, ort_logits, rel_err

    from compress.export.onnx import export_onnx
    from compress.export.openvino import EXACT_CPU_CONFIG, export_openvino
    from compress.kernels.backends import quantize_model

    model, qweights = mixed_stories260k()
    res = export_onnx(model, qweights, tmp_path / "onnx")
    ops = op_types(res["path"])
    widths = {(n, b) for n, q in qweights.items() for b in set(q.chunk_bits)}
    assert ops["MatMulNBits"] == sum(1 for _, b in widths if b in (2, 4, 8))
    assert res["dense_layers"] == sum(1 for _, b in widths if b in (3, 16))
    assert ops["Gather"] > 0  # each width's input columns (projections reading the same input share them)
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    out = ort_logits(res["path"], ids)
    ov_res = export_openvino(model, qweights, tmp_path / "ov", onnx_path=res["path"])
    compiled = ov.Core().compile_model(ov_res["path"], "CPU", EXACT_CPU_CONFIG)
    ov_out = compiled({"input_ids": ids.numpy()})[compiled.output(0)]
    with torch.no_grad():
        ref = model(ids).logits.numpy()
        quantize_model(model, qweights)  # the mixed backend: one matmul per bit-width slice
        ours = model(ids).logits.numpy()
    assert rel_err(out, ref) < 1e-3 and rel_err(ours, ref) < 1e-4 and rel_err(ov_out, ref) < 1e-3
    assert ov_res["low_bit_constants"]


def test_the_bundled_greedy_recipe_runs_on_a_hidden_size_that_is_not_a_multiple_of_its_chunk(tmp_path):
    """recipes/mixed-2.5-greedy.yaml (64-column chunks, AutoRound g64) on a llama with hidden size 96: every
    attention and up/gate layer ends in a 32-column chunk. It used to fail after calibration (AutoRound's
    quantizer got a 64-wide perturbation for the 32 columns); now the plan holds, the stored bits equal it and
    `compress inspect` reads the export back."""
    from helpers import shrink
    from tiny import save_tiny

    from compress.export.hf import read_quantized

    model = save_tiny("llama", tmp_path / "m", hidden_size=96, intermediate_size=256, num_attention_heads=6,
                      num_key_value_heads=2)
    rec = yaml.safe_load((REPO / "recipes" / "mixed-2.5-greedy.yaml").read_text())
    out = tmp_path / "out"
    rc, text, err = invoke("run", "mixed-2.5-greedy", "--model", model, "--calibration", str(CAL),
                           "--eval-data", str(CAL), "--output", out, "--json", *shrink(rec))
    assert rc == 0, err
    plan = json.loads(plan_path(out).read_text())
    assert plan["chunk_size"] == 64 and plan["layers"]["model.layers.0.self_attn.q_proj"]["shape"] == [96, 96]
    assert len(plan["layers"]["model.layers.0.self_attn.q_proj"]["options"]) == 2  # 64 + a short 32
    assert plan["effective_bits"] <= 2.5
    report = json.loads(text)
    assert report["size"]["effective_bits"] == round(plan["effective_bits"], 4)  # the fitted weights' own bits
    rc, _, err = invoke("inspect", out / "hf")
    assert rc == 0, err
    _, back = read_quantized(out / "hf")
    for name, qw in back.items():  # the layers hf holds packed carry their chunk map
        assert list(qw.chunk_bits) == plan["layers"][name]["bits"]
