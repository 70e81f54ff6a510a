"""PrunePath (`stage: prune, method: prunepath`; docs/prune.md): the checks of ALGORITHMS.md 6.7 on tiny models,
and the stage in a recipe."""

import json

import pytest
import torch
import yaml
from conftest import CAL, MODELS, invoke
from tiny import tiny_causal

from compress.models.adapters import ModelAdapter
from compress.prune import routing as pp
from compress.structure import keep_ffn

X = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))


def mlp_out(mlp, x=X):
    with torch.no_grad():
        return mlp(x)


def test_balanced_clusters_are_exact_sizes_and_find_planted_groups():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g)
    rows = centres.repeat_interleave(8, 0) + 0.05 * torch.randn(32, 16, generator=g)
    perm = torch.randperm(32, generator=g)
    clusters = pp.balanced_clusters(rows[perm], 8)
    assert sorted(len(c) for c in clusters) == [8, 8, 8, 8] and sorted(sum(clusters, [])) == list(range(32))
    for c in clusters:  # every planted group recovered
        assert len({int(perm[j]) // 8 for j in c}) == 1


def test_top_p_takes_the_smallest_prefix_reaching_tau():
    p = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    assert pp.top_p_mask(p, 0.5).tolist() == [[False, True, False, False]]  # 0.5 reaches 0.5
    assert pp.top_p_mask(p, 0.51).tolist() == [[False, True, False, True]]  # the crossing expert included
    assert pp.top_p_mask(p, 0.9).tolist() == [[False, True, True, True]]
    assert pp.top_p_mask(p, 1.0).all() and pp.top_p_mask(p, 0.0).sum() == 1  # k_min 1
    assert pp.top_p_mask(p, 0.1, k_min=3).sum() == 3
    probs = [torch.softmax(torch.randn(100, 8, generator=torch.Generator().manual_seed(2)), -1)]
    fractions = [pp.active_fraction(probs, t) for t in torch.linspace(0, 1, 21).tolist()]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0  # rho(tau) is monotone
    tau = pp.tau_for(probs, 0.5)
    assert pp.active_fraction(probs, tau) >= 0.5 > pp.active_fraction(probs, tau - 1e-3)


def test_permutation_and_tau_one_reproduce_the_dense_ffn_and_a_trained_router_beats_a_random_one():
    model = tiny_causal("llama")
    a = ModelAdapter(model)
    mlp = a.blocks[0].mlp
    ref = mlp_out(mlp)
    order = [j for c in pp.balanced_clusters(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 1), 16)
             for j in c]
    keep_ffn(a, 0, order)
    torch.testing.assert_close(mlp_out(mlp), ref, atol=1e-6, rtol=0)  # permuting neurons changes nothing
    with torch.no_grad():
        norms = pp.expert_norms(mlp, X, 16)
        shares = norms / norms.sum(-1, keepdim=True)
        torch.testing.assert_close(sum(mlp.down_proj.weight[:, 16 * e:16 * e + 16] @ (
            mlp.act_fn(mlp.gate_proj.weight[16 * e:16 * e + 16] @ X.T) * (mlp.up_proj.weight[16 * e:16 * e + 16] @ X.T))
            for e in range(8)).T, ref, atol=1e-5, rtol=0)  # the experts partition the FFN
    w, before, after = pp.train_router(X, shares, torch.zeros(8, 64), epochs=200, lr=1e-2)
    assert after < 0.5 * before
    wrapped = pp.PrunePathMLP(mlp, pp.PathRouter(w), 16, tau=1.0)
    torch.testing.assert_close(mlp_out(wrapped), ref, atol=1e-6, rtol=0)  # tau = 1 is the dense FFN

    def captured(router_w, k=2):  # share of the output norm the top-k experts by the router carry
        top = torch.topk(X @ router_w.T, k, -1).indices
        return float(norms.gather(1, top).sum() / norms.sum())

    rand = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    assert captured(w) > captured(rand)
    wrapped.tau = 0.5
    y = mlp_out(wrapped)
    assert 0 < wrapped.last_active < 1 and not torch.allclose(y, ref)


def write(tmp_path, stages, formats=("hf",)):
    doc = {"version": 1, "model": {"path": str(MODELS / "stories-llama-1m")},
           "calibration": {"sources": [str(CAL)], "nsamples": 8, "seqlen": 64},
           "stages": stages, "eval": {"data": [str(CAL)], "max_tokens": 1024, "generation": {"prompts": 0}},
           "export": {"formats": list(formats)}}
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_stage_sets_tau_for_the_target_quantizes_dense_and_resumes(tmp_path):
    stages = [{"stage": "prune", "method": "prunepath", "expert_size": 32, "target_active": 0.5, "samples": 8,
               "seqlen": 64, "epochs": 5},
              {"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32}]
    out = tmp_path / "out"
    path = write(tmp_path, stages)
    rc, text, err = invoke("run", path, "--output", out, "--json")
    assert rc == 0, err
    report = json.loads(text)
    st = report["structure"][0]
    assert st["method"] == "prunepath" and 0.5 <= st["active_fraction"] < 0.6 and 0 < st["tau"] < 1
    assert all(v["kl_after"] < v["kl_before"] for v in st["router_fit"].values())
    spec = json.loads(next((out / "stages").glob("*-prune-prunepath/model_spec.json")).read_text())
    assert sorted(spec["kept_ffn"]["0"]) == list(range(384)) and spec["kept_ffn"]["0"] != list(range(384))
    ev = next(iter(report["eval"].values()))
    assert 1.0 < ev["ppl_ratio"] < 3.0
    rc, text2, err = invoke("run", path, "--output", out, "--resume", "--json")
    assert rc == 0, err
    assert next(iter(json.loads(text2)["eval"].values()))["ppl"] == ev["ppl"]
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out / "hf")  # plain transformers: the dense fallback
    assert loaded.config.intermediate_size == 384 and loaded.config.prunepath["tau"] == st["tau"]
    runs = {}
    for backend in ("cpu", "transformers"):  # our packed loader and auto-round's both rebuild the routed FFNs
        for mass in (None, 1.0, 0.3):
            args = ["--ffn-mass", mass] if mass else []
            rc, text, err = invoke("eval", out / "hf", "--data", CAL, "--max-tokens", 1024, "--backend", backend,
                                   "--json", *args)
            assert rc == 0, err
            runs[backend, mass] = json.loads(text)[CAL.name]
    assert abs(runs["cpu", None]["ppl"] - ev["ppl"]) / ev["ppl"] < 1e-3  # the checkpoint's own tau
    for backend in ("cpu", "transformers"):
        assert runs[backend, 1.0]["ffn_active"] == 1.0 and runs[backend, 0.3]["ffn_active"] < 0.5
        assert runs[backend, 1.0]["ppl"] < runs[backend, None]["ppl"] < runs[backend, 0.3]["ppl"]
    rc, text, err = invoke("inspect", out / "hf")
    assert rc == 0 and "prunepath: blocks [0, 1, 2, 3] as routed experts of 32 neurons" in text, err
    rc, text, err = invoke("generate", out / "hf", "--prompt", "Once upon a time", "--max-new-tokens", 8,
                           "--ffn-mass", 0.7, "--json")
    assert rc == 0, err
    rc, _, err = invoke("eval", MODELS / "stories-llama-1m", "--data", CAL, "--ffn-mass", 0.5)
    assert rc == 1 and "PrunePath" in err


def test_plan_time_refusals(tmp_path):
    bad = {"odd experts": ({"expert_size": 100}, (), "does not divide"),
           "prune after": ({}, ({"stage": "prune", "method": "ffn", "ratio": 0.25},), "prune first"),
           "twice": ({}, ({"stage": "prune", "method": "prunepath"},), "split once"),
           "groups": ({"expert_size": 32}, ({"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 48},),
                      "do not nest")}
    for what, (opts, more, msg) in bad.items():
        path = write(tmp_path, [{"stage": "prune", "method": "prunepath", **opts}, *more], formats=())
        rc, _, err = invoke("run", path, "--dry-run")
        assert rc == 1 and msg in err, (what, err)


@pytest.mark.parametrize("packed", [False, True])
def test_the_gather_path_equals_the_masked_ffn_for_one_token(packed):
    """Decode (one token) computes only the active experts: rows of gate/up and columns of down as views, or
    per-expert packed slices on the cpu kernel; the masked path (two tokens) is the oracle."""
    from compress.kernels.backends import quantize_model
    from compress.primitives import rtn

    model = tiny_causal("llama")
    mlp = model.model.layers[0].mlp
    router = 0.1 * torch.randn(4, 64, generator=torch.Generator().manual_seed(4))  # flat enough to vary k
    if packed:
        qweights = {f"model.layers.0.mlp.{r}": rtn(getattr(mlp, r).weight.data, 4, 32, False)
                    for r in ("gate_proj", "up_proj", "down_proj")}
        quantize_model(model, qweights, "cpu")
    wrapped = pp.PrunePathMLP(model.model.layers[0].mlp, pp.PathRouter(router), 32, tau=0.6)
    model.model.layers[0].mlp = wrapped
    if packed:
        assert pp.prepare_gather(model, qweights, "cpu") == 1 and len(wrapped.parts) == 4
    seen = set()
    for i in range(16):
        x = X[i:i + 1].unsqueeze(0)  # (1, 1, hidden): one decode step
        fast = mlp_out(wrapped, x)
        seen.add(wrapped.last_active)
        slow = mlp_out(wrapped, torch.cat([x, x], 1))[:, :1]  # two tokens: the masked path
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)
    assert len(seen) > 1 and max(seen) < 1


def test_onnx_and_openvino_route_the_ffn_like_the_model(tmp_path):
    """The graphs compute the routed FFN at the checkpoint's tau (mask in the graph): logits equal the model's."""
    from helpers import ort_logits, rel_err, run_ir

    from compress.export.onnx import export_onnx
    from compress.export.openvino import export_openvino

    model = tiny_causal("llama")
    a = ModelAdapter(model)
    gen = torch.Generator().manual_seed(5)
    for i in range(2):
        pp.wrap(a, i, 0.1 * torch.randn(4, 64, generator=gen), 32, 0.6, 1)
    ids = torch.randint(0, 128, (1, 12), generator=gen)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.numpy()
        dense = model(input_ids=ids, use_cache=False).logits.numpy() if pp.set_tau(model, 1.0) else None
    pp.set_tau(model, 0.6)
    assert rel_err(dense, ref) > 1e-3  # the routing changes the output
    graph = export_onnx(model, {}, tmp_path / "onnx")["path"]
    assert rel_err(ort_logits(graph, ids), ref) < 1e-5
    assert rel_err(run_ir(export_openvino(model, {}, tmp_path / "ov", onnx_path=graph)["path"], ids)[0], ref) < 1e-3
