"""MoE expert statistics and the `allocate method: moe` stage (docs/moe.md) on tiny MoE models."""

import json

import pytest
import torch
import yaml
from conftest import TEXT, invoke, plan_path
from helpers import lab, quick_suite
from safetensors.torch import load_file
from tiny import save_tiny, tiny_causal

from compress.models import moe
from compress.models.adapters import ModelAdapter
from compress.primitives import rtn
from compress.workspace import Workspace

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("model_type", MOE)
def test_streamed_gradients_equal_a_full_backward(model_type):
    model = tiny_causal(model_type)
    a = ModelAdapter(model)
    tokens = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    _, grads, _ = moe.layer_output_grads(a, tokens, 3)
    seen = {}

    def keep(i):
        def hook(_m, _args, out):
            h = out[0] if isinstance(out, tuple) else out
            h.retain_grad()
            seen[i] = h
        return hook

    hooks = [b.register_forward_hook(keep(i)) for i, b in enumerate(a.blocks)]
    model(input_ids=tokens, labels=tokens).loss.backward()
    for h in hooks:
        h.remove()
    for i in range(len(a.blocks)):
        assert (torch.cat(grads[i]) - seen[i].grad).abs().max() <= 1e-6 * seen[i].grad.abs().max()


@pytest.mark.parametrize("model_type", MOE)
def test_coefficients_are_the_published_quantity(model_type):
    """coef(l, e, b) equals sum g^2 (z_FP - z_{e->b})^2 with z the whole MoE block's output, and falls with b."""
    a = ModelAdapter(tiny_causal(model_type))
    tokens = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    inputs, grads, kw = moe.layer_output_grads(a, tokens, 4)
    r = moe.routing(a, 1, inputs[1], kw)
    coef, forced = moe.coefficients(a, 1, r, grads[1], (2, 3, 4), 32, False, 1)
    assert not any(forced) and (coef[:, 0] > coef[:, 1]).all() and (coef[:, 1] > coef[:, 2]).all()
    block = moe._moe_module(a, 1)
    g2 = grads[1][0].double() ** 2
    with torch.no_grad():
        x = r.x.reshape(4, 24, -1)
        z = block(x)
        if isinstance(z, tuple):
            z = z[0]
        e, lins = 2, a.experts(1)[2]
        saved = {n: getattr(lins, n).weight.data.clone() for n in ("gate_proj", "up_proj", "down_proj")}
        for n, w in saved.items():
            getattr(lins, n).weight.data = rtn(w, 3, 32, False).dequantize()
        zq = block(x)
        zq = zq[0] if isinstance(zq, tuple) else zq
        for n, w in saved.items():
            getattr(lins, n).weight.data = w
    ref = (g2 * (z.double() - zq.double()) ** 2).sum()
    assert float(coef[e, 1]) == pytest.approx(float(ref), rel=1e-6)


def test_an_expert_that_never_fires_is_force_routed():
    a = ModelAdapter(tiny_causal("mixtral"))
    never_fires(a.router(0), 3)
    tokens = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(2))
    inputs, grads, kw = moe.layer_output_grads(a, tokens, 4)
    r = moe.routing(a, 0, inputs[0], kw)
    assert r.loads()[3] == 0
    coef, forced = moe.coefficients(a, 0, r, grads[0], (2, 3, 4), 32, False, 8)
    assert forced == [False, False, False, True]
    assert torch.isfinite(coef).all() and (coef[3] > 0).all()


def never_fires(router, e):
    """Bias the router's logit of expert e by -inf: it is never in the top-k."""
    def hook(mod, _args, out):
        logits = out[0].clone()
        logits[:, e] = float("-inf")
        top, index = torch.topk(torch.softmax(logits.float(), -1), mod.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index
    return router.register_forward_hook(hook)


def moe_recipe(tmp_path, model_type="mixtral", budget=3.4, method="gptq", **alloc):
    model = save_tiny(model_type, tmp_path / model_type)
    rec = {"version": 1, "model": {"path": str(model)},
           "calibration": {"sources": [str(TEXT / "tinystories" / "tinystories_val.txt")], "nsamples": 8,
                           "seqlen": 64},
           "stages": [{"stage": "allocate", "method": "moe", "budget": budget, "samples": 4, "seqlen": 32, **alloc},
                      {"stage": "quantize", "method": method, "bits": 4, "group_size": 32, "sym": False}],
           "eval": {"enabled": False}}
    path = tmp_path / f"{model_type}-{budget}.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


@pytest.mark.parametrize("model_type", MOE)
def test_the_stage_plans_and_the_quantizer_applies_it(tmp_path, model_type):
    out = tmp_path / "out"
    rc, _, err = invoke("run", moe_recipe(tmp_path, model_type), "--output", out, "--json")
    assert rc == 0, err
    plan = json.loads(plan_path(out).read_text())
    assert plan["chunk_size"] == 0 and plan["effective_bits"] <= 3.4
    bits = plan["info"]["expert_bits"]
    for layer in bits.values():  # the published rule: every layer has a 4-bit and a 3-bit expert
        assert {3, 4} <= set(layer.values())
    with Workspace(out, resume=True) as ws:
        key = next((out / "stages").glob("*-quantize-*")).name
        qweights = {**ws.load_block(key, 0, required=True), **ws.load_block(key, 1, required=True)}
    for name, v in plan["layers"].items():
        assert qweights[name].bits == v["bits"][0] and not qweights[name].mixed, name
    assert all(qweights[n].bits == 4 for n in qweights if "experts" not in n)  # attention, shared expert: `bits`
    assert not any("gate.weight" in n or n.endswith("mlp.gate") for n in qweights)  # routers never rounded
    stats = json.loads(next((out / "stages").glob("*-allocate-*/statistics.json")).read_text())
    assert sum(stats["loads"]["0"]) == 4 * 32 * 2  # every token routed to top-2 experts


def test_plan_time_errors(tmp_path):
    rc, _, err = invoke("run", moe_recipe(tmp_path, budget=2.7), "--output", tmp_path / "o", "--dry-run")
    assert rc != 0 and "below the cheapest plan" in err
    rec = yaml.safe_load(moe_recipe(tmp_path).read_text())
    rec["model"] = {"path": str(save_tiny("llama", tmp_path / "llama"))}
    (tmp_path / "dense.yaml").write_text(yaml.safe_dump(rec))
    rc, _, err = invoke("run", tmp_path / "dense.yaml", "--output", tmp_path / "o", "--dry-run")
    assert rc != 0 and "routed experts" in err


def test_one_bit_experts_are_planned_rounded_and_announced(tmp_path):
    """`bits: [1, 2, 3]` at 2.0 bits per expert parameter (the published 1-bit sign candidate): the plan uses 1-bit
    experts within the budget, GPTQ rounds them by the sign rule; the plan says the hf export stores them dense;
    AutoRound is refused before any work."""
    out = tmp_path / "out"
    path = moe_recipe(tmp_path, budget=2.0, bits=[1, 2, 3], top_widths=0)
    rec = yaml.safe_load(path.read_text())
    rec["export"] = {"formats": ["hf"]}
    path.write_text(yaml.safe_dump(rec))
    rc, text, err = invoke("run", path, "--output", tmp_path / "dry", "--dry-run")
    assert rc == 0 and "1 bit (the sign rule) will be stored dense" in " ".join(text.split()), err
    rc, _, err = invoke("run", path, "--output", out, "--json")
    assert rc == 0, err
    plan = json.loads(plan_path(out).read_text())
    widths = [b for layer in plan["info"]["expert_bits"].values() for b in layer.values()]
    assert 1 in widths and max(widths) > 1 and plan["effective_bits"] <= 2.0
    with Workspace(out, resume=True) as ws:
        key = next((out / "stages").glob("*-quantize-*")).name
        qweights = {**ws.load_block(key, 0, required=True), **ws.load_block(key, 1, required=True)}
    one = [q for n, q in qweights.items() if q.bits == 1]
    assert one and all(set(q.codes.unique().tolist()) <= {0, 1} for q in one)
    extra = json.loads((out / "hf" / "config.json").read_text())["quantization_config"]["extra_config"]
    for name, q in qweights.items():  # 1-bit experts stored dense (bits 16), the others at their width
        assert extra.get(name, {}).get("bits", 4) == (16 if q.bits == 1 else q.bits), name
    rc, _, err = invoke("run", moe_recipe(tmp_path, budget=2.0, method="autoround", bits=[1, 2, 3], top_widths=0),
                        "--output", tmp_path / "ar", "--dry-run")
    assert rc != 0 and "1-bit (sign) experts are rounded by `rtn` or `gptq`" in err


def test_gptq_never_rounds_an_unseen_expert_from_nothing():
    """An expert no calibration row reaches: without forced routing GPTQ's Hessian is empty and the expert's
    weights become zeros; with it, the expert is rounded from the rows its router scores highest."""
    from compress.driver import collect_hessians
    from compress.quantize.gptq import gptq

    a = ModelAdapter(tiny_causal("mixtral"))
    hook = never_fires(a.router(0), 3)
    tokens = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(3))
    inputs, _, kw = moe.layer_output_grads(a, tokens, 4)
    block = a.blocks[0]
    linears = a.block_linears(0)
    name = "model.layers.0.mlp.experts.3.up_proj"
    bare = collect_hessians(block, linears, inputs[0], kw)
    covered = collect_hessians(block, linears, inputs[0], kw, moe.Coverage(a, 0, min_tokens=16))
    hook.remove()
    assert bare[name].to_dense().abs().max() == 0 and covered[name].diag().min() > 0
    W = linears[name].weight.data
    for H, zero in ((bare, True), (covered, False)):
        qw, _ = gptq(W, H[name], bits=3, group_size=32, sym=False)
        assert (qw.dequantize().abs().max() == 0) == zero
    untouched = "model.layers.0.mlp.experts.0.up_proj"
    assert torch.equal(bare[untouched].to_dense(), covered[untouched].to_dense())


@pytest.mark.parametrize("loss", ["kl", "lm"])
def test_router_finetuning_moves_only_the_routers_and_resumes(tmp_path, loss):
    rec = yaml.safe_load(moe_recipe(tmp_path, budget=3.4, method="rtn").read_text())
    rec["export"] = {"formats": ["hf"]}
    rec["stages"].append({"stage": "finetune", "method": "router", "loss": loss, "samples": 8, "seqlen": 64,
                          "batch_size": 2, "epochs": 2, "lr": 1e-3})
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(rec))
    out = tmp_path / "out"
    rc, stdout, err = invoke("run", path, "--output", out, "--json")
    assert rc == 0, err
    m = json.loads(stdout)["routers"]
    assert "## Router fine-tuning" in (out / "report.md").read_text()
    assert m["routers"] == 2
    if loss == "kl":  # each loss lowers what it trains on (on the tiny model, lm moves routers away from FP)
        assert m["router_kl_after"] < 0.8 * m["router_kl_before"] and m["topk_match_after"] > m["topk_match_before"]
    else:
        assert m["ce_after"] < m["ce_before"]
    saved = load_file(next((out / "stages").glob("*-finetune-router/trained.safetensors")))
    (out / "hf").rename(tmp_path / "hf-first")
    rc, stdout, err = invoke("run", path, "--output", out, "--resume", "--json")  # loads the routers, no retraining
    assert rc == 0, err
    assert next(s for s in json.loads(stdout)["stages"] if s["name"] == "finetune")["resumed"]
    for hf in (tmp_path / "hf-first", out / "hf"):  # the exports carry the tuned routers, resumed or not
        exported = load_file(hf / "model.safetensors")
        for name, w in saved.items():  # the checkpoint's own names (mixtral: block_sparse_moe.gate)
            layer = name.split(".mlp.")[0] + "."
            (key,) = [k for k in exported if k.startswith(layer) and k.endswith(".gate.weight")]
            assert torch.equal(exported[key].float(), w.half().float()), name  # stored in fp16 (export.hf.dtype)


def test_router_finetuning_needs_a_quantized_moe_model(tmp_path):
    rec = yaml.safe_load(moe_recipe(tmp_path).read_text())
    rec["stages"] = [{"stage": "finetune", "method": "router"}, rec["stages"][1]]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(rec))
    rc, _, err = invoke("run", tmp_path / "r.yaml", "--output", tmp_path / "o", "--dry-run")
    assert rc != 0 and "needs a `quantize` stage before it" in err


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=pytest.mark.slow) if m != "qwen3_moe" else m
                                        for m in MOE])  # one trace each: the Llama-style MoE ones in the slow tier
def test_per_expert_widths_survive_every_export(tmp_path, model_type):
    """Experts at 1 (the sign rule), 2, 3 and 4 bits (attention at 4): transformers with auto-round's loader,
    onnxruntime and OpenVINO give the in-memory model's logits (routing in the graphs); the hf checkpoint declares
    each packed width and stores the 1-bit experts dense."""
    from helpers import (
        check_reload,
        op_types,
        ort_logits,
        quantize_model,
        rel_err,
        run_ir,
    )

    from compress.export.hf import export_hf
    from compress.export.onnx import export_onnx
    from compress.export.openvino import export_openvino

    model = tiny_causal(model_type, seed=5)
    ModelAdapter(model)
    widths = {}

    def scheme(name):
        if not name.startswith("model.layers.") or name.endswith(("mlp.gate", "shared_expert_gate")):
            return None
        if ".experts." in name:
            widths[name] = (1, 2, 3, 4)[int(name.split(".experts.")[1].split(".")[0]) % 4]
            return widths[name], 32, False
        return 4, 32, False

    qweights = quantize_model(model, scheme)
    assert set(widths.values()) == {1, 2, 3, 4}
    res = export_hf(model, qweights, None, tmp_path / "hf")
    assert set(res["dense"]) == {n for n, b in widths.items() if b == 1}
    assert all("1-bit" in why for why in res["dense"].values())
    _, back, _ = check_reload(model, qweights, tmp_path / "hf", 128)
    assert all(back[n].bits == b for n, b in widths.items() if b > 1) and not set(back) & set(res["dense"])
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    res = export_onnx(model, qweights, tmp_path / "onnx")
    ops = op_types(res["path"])
    assert ops["TopK"] == 2 and ops["MatMulNBits"] == sum(1 for n, q in qweights.items() if q.bits not in (1, 3))
    assert rel_err(ort_logits(res["path"], ids), ref) < 1e-3
    ov_res = export_openvino(model, qweights, tmp_path / "ov", onnx_path=res["path"])
    out, _ = run_ir(ov_res["path"], ids)
    assert rel_err(out, ref) < 1e-3


def test_graph_exports_announce_dense_widths_and_take_every_decoder_family(tmp_path):
    rec = yaml.safe_load(moe_recipe(tmp_path).read_text())
    rec["export"] = {"formats": ["onnx"]}
    (tmp_path / "o.yaml").write_text(yaml.safe_dump(rec))
    rc, _, err = invoke("run", tmp_path / "o.yaml", "--output", tmp_path / "o", "--dry-run")
    assert rc == 0 and "3-bit layers will be written as dense" in err
    rec["model"] = {"path": str(save_tiny("olmo2", tmp_path / "olmo2"))}
    rec["stages"] = rec["stages"][1:]
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(rec))
    rc, _, err = invoke("run", tmp_path / "q.yaml", "--output", tmp_path / "q", "--dry-run")
    assert rc == 0, err  # torch's exporter writes every decoder family


@pytest.mark.parametrize("model_type", [pytest.param("mixtral", marks=pytest.mark.e2e),
                                        pytest.param("qwen2_moe", marks=pytest.mark.e2e)])
def test_the_bundled_gemq_recipe_runs_on_tiny_moe_models(tmp_path, model_type):
    """recipes/moe-2.5-gemq.yaml as written, shrunk, with the tiny model's narrower groups (32: its experts are
    64 and 128 wide) and a budget they can meet; the exports give the in-run model's predictions."""
    from conftest import REPO
    from helpers import shrink

    recipe = REPO / "recipes" / "moe-2.5-gemq.yaml"
    spec = yaml.safe_load(recipe.read_text())
    model = save_tiny(model_type, tmp_path / model_type)
    text = str(TEXT / "tinystories" / "tinystories_val.txt")
    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe, "--model", model, "--output", out, "--json", *shrink(spec),
                             "--calibration", text, "--eval-data", text, "--set", "stages.1.group_size=32",
                             "--set", "stages.0.budget=3.4", "--set", "stages.0.samples=4", "--set",
                             "stages.2.samples=8", "--set", "stages.2.seqlen=64")
    assert rc == 0, err
    report = json.loads(stdout)
    assert [s["name"] for s in report["stages"] if s["name"] not in ("load", "eval", "export")] == \
        ["allocate", "quantize", "finetune"]
    assert report["allocation"]["effective_bits"] <= 3.4 and report["routers"]["routers"] == 2
    assert set(report["exports"]) == {"hf", "openvino"}
    rc, text, err = invoke("inspect", out / "hf")
    assert rc == 0, err
    plan = report["allocation"]["expert_bits"]
    for layer, experts in plan.items():  # inspect reads the plan's widths back from the checkpoint
        assert f"model.layers.{layer}.mlp expert bits: " + " ".join(f"{e}:{b}" for e, b in experts.items()) in text
    ev = next(iter(report["eval"].values()))
    assert ev["ppl_ratio"] > 0.5 and ev["top1"] > 0.2


@pytest.mark.e2e
def test_the_moe_suite_runs_quick(tmp_path):
    """`python -m bench quality --suite moe --quick`: every row on a tiny random Mixtral (plumbing, no claim)."""
    result, md = quick_suite(tmp_path, "moe")
    assert [r["method"] for r in result["summary"]] == ["uniform", "local", "greedy", "gemq", "gemq+ft", "gemq+ft-lm"]
    assert all(c["effective_bits"] <= c["budget"] for c in result["cells"])
    assert "rtn_w2_ratio" in result["model"] and "loads" in result["model"]
    assert "## Expected outcomes" in md.read_text()
    gemq, ft = (next(c for c in result["cells"] if c["method"] == m) for m in ("gemq", "gemq+ft"))
    assert ft["expert_bits"] == gemq["expert_bits"]  # gemq+ft continues gemq's run
    assert ft["alloc_seconds"] == gemq["alloc_seconds"]


@pytest.mark.e2e
def test_the_moe_suite_measures_in_parts_and_merges(tmp_path):
    """--merge folds an earlier result's cells in (a cell run now replaces the same one); a result of other
    settings is refused."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    rc, _, err = lab("quality", "--suite", "moe", "--quick", "--method", "uniform", "--method", "local",
                     "--json", a)
    assert rc == 0, err
    rc, _, err = lab("quality", "--suite", "moe", "--quick", "--method", "local", "--merge", a,
                     "--json", b)
    assert rc == 0, err
    first, merged = json.loads(a.read_text()), json.loads(b.read_text())
    assert [r["method"] for r in merged["summary"]] == ["uniform", "local"]
    assert [c["method"] for c in merged["cells"]] == ["uniform", "local"]
    assert merged["cells"][0] == first["cells"][0]
    assert merged["model"]["loads"] == first["model"]["loads"]
    c = tmp_path / "c.json"  # 2.0 bits: below any 2-bit plan, the published candidates with the 1-bit sign rule
    rc, _, err = lab("quality", "--suite", "moe", "--quick", "--method", "uniform", "--budget", "2.0",
                     "--merge", b, "--json", c)
    assert rc == 0, err
    low = [x for x in json.loads(c.read_text())["cells"] if x["budget"] == 2.0]
    assert len(low) == 1 and low[0]["bits"] == [1, 2, 3] and low[0]["effective_bits"] <= 2.0
    assert {w for layer in low[0]["expert_bits"].values() for w in layer.values()} == {1}  # uniform: the widest fit
    d = tmp_path / "d.json"  # AutoRound cannot round 1-bit experts: its 2.0 cells are infeasible, GPTQ's stay
    rc, _, err = lab("quality", "--suite", "moe", "--quick", "--method", "uniform", "--budget", "2.0",
                     "--quantizer", "autoround", "--merge", c, "--json", d, "--markdown", d.with_suffix(".md"))
    assert rc == 0, err
    ar = json.loads(d.read_text())
    assert [x["quantizer"] for x in ar["infeasible"]] == ["autoround"] and "sign" in ar["infeasible"][0]["reason"]
    assert [x for x in ar["cells"] if x["budget"] == 2.0] == low
    assert "autoround @ 2.0 bits: infeasible" in d.with_suffix(".md").read_text()
    e = tmp_path / "e.json"  # --group: one group size for every budget; a setting, so it does not merge with b
    rc, _, err = lab("quality", "--suite", "moe", "--quick", "--method", "uniform", "--group", "32",
                     "--json", e)
    assert rc == 0, err
    assert {x["group_size"] for x in json.loads(e.read_text())["cells"]} == {32}
    rc, _, err = lab("quality", "--suite", "moe", "--quick", "--method", "uniform", "--group", "32",
                     "--merge", b)
    assert rc == 1 and "group" in err
    first["settings"]["stat_samples"] += 1
    a.write_text(json.dumps(first))
    rc, _, err = lab("quality", "--suite", "moe", "--quick", "--method", "local", "--merge", a)
    assert rc == 1 and "stat_samples" in err


def test_progressive_rounds_measure_on_the_previous_plan_and_quantize_from_full_precision(tmp_path):
    """`rounds: [4.2]`: the final statistics are measured with the experts rounded to the 4.2-bit plan (other
    coefficients than on FP); the quantize stage (rtn) still rounds the full-precision experts."""
    outs = {}
    for name, extra in (("fp", {}), ("progressive", {"rounds": [4.2]})):
        out = tmp_path / name
        rc, stdout, err = invoke("run", moe_recipe(tmp_path, budget=3.4, method="rtn", **extra), "--output", out,
                                 "--json")
        assert rc == 0, err
        outs[name] = (json.loads(plan_path(out).read_text()),
                      json.loads(next((out / "stages").glob("*-allocate-*/statistics.json")).read_text()))
    (fp_plan, fp_stats), (pr_plan, pr_stats) = outs["fp"], outs["progressive"]
    assert pr_plan["info"]["rounds"][0]["budget"] == 4.2 and fp_plan["info"]["rounds"] == []
    assert pr_stats["coefficients"] != fp_stats["coefficients"]
    from transformers import AutoModelForCausalLM

    fp = ModelAdapter(AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral"))
    with Workspace(tmp_path / "progressive", resume=True) as ws:
        key = next((tmp_path / "progressive" / "stages").glob("*-quantize-*")).name
        got = {**ws.load_block(key, 0, required=True), **ws.load_block(key, 1, required=True)}
    for name, v in pr_plan["layers"].items():
        W = fp.model.get_submodule(name).weight.data
        assert torch.equal(got[name].codes, rtn(W, v["bits"][0], 32, False).codes), name
    rc, _, err = invoke("run", moe_recipe(tmp_path, budget=3.4, rounds=[3.0]), "--output", tmp_path / "bad",
                        "--dry-run")
    assert rc != 0 and "must decrease" in err
