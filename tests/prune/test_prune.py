"""Structured pruning (`stage: prune`, methods ffn, heads, depth; docs/prune.md)."""

import copy
import json
import shutil

import pytest
import torch
import yaml
from conftest import CAL, MODELS, REPO, invoke
from helpers import quick_suite
from tiny import tiny_causal

from compress.handoff import ModelSpec
from compress.models.adapters import ModelAdapter
from compress.prune.scores import (
    block_scores,
    blocks_to_remove,
    ffn_scores,
    global_counts,
    head_scores,
    kept_count,
    top,
)
from compress.structure import keep_blocks, keep_ffn, keep_kv_groups, sync_config

TOKENS = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(0))


def dead_units(model_type="llama"):
    """A tiny model whose FFN channels 0..31 (every block), KV head 1 (every block) and block 1 write nothing:
    removing them changes no output."""
    model = tiny_causal(model_type, num_hidden_layers=3)
    a = ModelAdapter(model)
    _, _, hd = a.attention_shape()
    with torch.no_grad():
        for i in range(3):
            a.role(i, "mlp_down").weight[:, :32] = 0
            a.role(i, "o").weight[:, 2 * hd:] = 0  # query heads 2, 3 read KV head 1
        a.role(1, "o").weight.zero_()
        a.role(1, "mlp_down").weight.zero_()
    return model, a


def logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_removing_units_that_write_nothing_is_exact_and_the_scores_find_them(model_type):
    model, a = dead_units(model_type)
    ref = logits(model)
    f, h = ffn_scores(a, TOKENS, 2), head_scores(a, TOKENS, 2)
    for i in (0, 2):  # block 1 writes nothing at all
        assert top(f[i], 96) == list(range(32, 128))
        assert float(f[i][:32].max()) == 0 and float(f[i][32:].min()) > 0
        assert top(h[i], 1) == [0]
    assert top(block_scores(a, TOKENS, "cosine", 2), 2) == [0, 2]
    assert abs(float(block_scores(a, TOKENS, "loss", 2)[1])) < 1e-6  # skipping it changes no loss
    assert top(block_scores(a, TOKENS, "last", 2), 2) == [0, 1]
    keep_blocks(a, [0, 2])
    for i in range(2):
        keep_ffn(a, i, list(range(32, 128)))
        keep_kv_groups(a, i, [0])
    sync_config(a)
    c = model.config
    assert (c.num_hidden_layers, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (2, 96, 2, 1)
    assert [blk.self_attn.layer_idx for blk in a.blocks] == [0, 1]
    torch.testing.assert_close(logits(model), ref, atol=1e-5, rtol=0)
    out = model.generate(TOKENS[:1, :4], max_new_tokens=4, do_sample=False)  # the KV cache follows the new shapes
    assert out.shape == (1, 8)


@pytest.mark.parametrize("how", ["cosine", "loss"])
def test_blocks_go_one_at_a_time_scored_without_the_ones_already_chosen(how):
    """Scores with a block skipped are the scores of the model without it, and the second block removed is the
    least important one of that smaller model (not the second of the first ranking)."""
    import copy

    model = tiny_causal("llama", num_hidden_layers=4)
    a = ModelAdapter(model)
    first = block_scores(a, TOKENS, how, 2)
    gone, rounds = blocks_to_remove(a, TOKENS, how, 2, 2)
    assert len(rounds) == 2 and torch.equal(rounds[0], first)
    g0 = min(range(4), key=lambda j: (float(first[j]), -j))
    assert g0 in gone and rounds[1][g0] == float("inf")
    smaller = copy.deepcopy(model)
    sa = ModelAdapter(smaller)
    left = [p for p in range(4) if p != g0]
    keep_blocks(sa, left)
    sync_config(sa)
    alone = block_scores(sa, TOKENS, how, 2)
    torch.testing.assert_close(rounds[1][left], alone, atol=1e-9, rtol=1e-6)
    assert sorted(gone) == sorted([g0, left[int(torch.argmin(alone))]])
    assert blocks_to_remove(a, None, "last", 2, 2)[0] == [2, 3]
    torch.testing.assert_close(block_scores(a, TOKENS, how, 2), first, atol=0, rtol=0)  # no hook left behind


def test_magnitude_scores_read_weights_only():
    model, a = dead_units()
    f, h = ffn_scores(a, None, 2), head_scores(a, None, 2)
    assert float(f[0][:32].max()) == 0 and float(f[0][32:].min()) > 0
    assert float(h[0][1]) == 0 and float(h[0][0]) > 0


def test_kept_counts_round_to_the_multiple():
    assert kept_count(384, 0.25, 32) == 288 and kept_count(384, 0.25, 64) == 320  # 4.5 x 64: ties keep more
    assert kept_count(384, 0.5, 64) == 192 and kept_count(172, 0.25, 1) == 129 and kept_count(64, 0.99, 32) == 32
    s = {0: torch.tensor([5.0, 4, 3, 2]), 1: torch.tensor([1.0, 0.5, 0.4, 0.3])}
    assert global_counts(s, 0.5, 1) == {0: 4, 1: 0} or global_counts(s, 0.5, 1) == {0: 4, 1: 1}
    assert global_counts(s, 0.5, 2) == {0: 4, 1: 2}  # at least one multiple per layer


def test_spec_composes_in_source_indices_and_restores_a_fresh_model():
    model, a = dead_units()
    s0 = ModelSpec.of(a)
    s1 = s0.keeping(blocks=[0, 2])
    s2 = s1.keeping(ffn={0: list(range(32, 128)), 1: list(range(64, 128))}, kv_heads={1: [1]})
    assert [b.source for b in s2.blocks] == [0, 2]
    assert s2.kept_ffn == {0: tuple(range(32, 128)), 2: tuple(range(64, 128))} and s2.kept_heads == {2: (1,)}
    s3 = s2.keeping(ffn={1: list(range(32))})  # positions in the block as it is now: sources 64..95
    assert s3.kept_ffn[2] == tuple(range(64, 96))
    s1.restore(a, s0)
    s2.restore(a, s1)
    s3.restore(a, s2)
    fresh, b = dead_units()
    s3.restore(b)  # one step from the source model
    torch.testing.assert_close(logits(fresh), logits(model), atol=0, rtol=0)
    assert ModelSpec.of(b).blocks[1].ffn == 32 and ModelSpec.of(b).blocks[1].kv_heads == 1


def write(tmp_path, stages, formats=("hf",), model=None, name="prune.yaml"):
    doc = {"version": 1, "model": {"path": str(model or MODELS / "stories260K")},
           "calibration": {"sources": [str(CAL)], "nsamples": 8, "seqlen": 64},
           "stages": stages,
           "eval": {"data": [str(CAL)], "max_tokens": 512, "generation": {"prompts": 0}},
           "export": {"formats": list(formats)}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


STAGES = [{"stage": "prune", "method": "depth", "blocks": 1, "samples": 4, "seqlen": 32},
          {"stage": "prune", "method": "ffn", "ratio": 0.25, "samples": 4, "seqlen": 32},
          {"stage": "prune", "method": "heads", "ratio": 0.5, "samples": 4, "seqlen": 32},
          {"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32}]


def test_plan_time_shapes_and_refusals(tmp_path):
    rc, text, err = invoke("run", write(tmp_path, STAGES), "--dry-run", "--json")
    assert rc == 0, err
    plan = json.loads(text)
    # stories260K: 5 blocks, FFN 172, 8 heads / 4 KV heads; ffn 0.25 of 172 -> 129 -> 128 (multiple: group 32)
    assert "4 of 5 blocks kept" in plan["structure"]
    assert any("ffn 172 -> 128" in s for s in plan["structure"])
    assert any("kv_heads 4 -> 2" in s for s in plan["structure"])
    assert plan["stages"][3]["layers"] == 4 * 7  # the quantize stage plans on the pruned skeleton
    bad = {"after quantize": (STAGES[3:] + STAGES[:1], "after a `quantize`"),
           "global for hf": ([{**STAGES[1], "scope": "global"}], "intermediate_size"),
           "every block": ([{**STAGES[0], "blocks": 5}], "removes every one"),
           "every head": ([{**STAGES[2], "ratio": 0.9}], "removes them all")}
    for what, (stages, msg) in bad.items():
        rc, _, err = invoke("run", write(tmp_path, stages, name=f"{what}.yaml"), "--dry-run")
        assert rc == 1 and msg in err, (what, err)


def test_a_chain_runs_resumes_and_exports_what_transformers_loads(tmp_path):
    """depth -> ffn -> heads -> rtn W4 on stories260K: the hf checkpoint loads in transformers with the pruned
    config and reproduces the in-memory model; --resume replays the specs (same report) without pruning again."""
    out = tmp_path / "out"
    path = write(tmp_path, STAGES, formats=("hf", "onnx"))
    rc, text, err = invoke("run", path, "--output", out, "--json")
    assert rc == 0, err
    report = json.loads(text)
    assert [(s["stage"], s["method"]) for s in report["structure"]] == [("prune", "depth"), ("prune", "ffn"),
                                                                        ("prune", "heads")]
    assert "4 of 5 blocks kept" in report["structure"][0]["changes"]
    assert "## Structure" in (out / "report.md").read_text()
    cfg = json.loads((out / "hf" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 128, 4, 2, 8)
    from compress.export.hf import read_quantized

    names = read_quantized(out / "hf")[1]
    # 4 blocks x 5 packed layers; k and v (2 KV heads x 8 = 16 outputs) are written dense (auto-round's loaders
    # need multiples of 32)
    assert len(names) == 20 and {n.split(".")[2] for n in names} == {"0", "1", "2", "3"}
    ev = next(iter(report["eval"].values()))
    assert 1.0 < ev["ppl_ratio"] < 100  # a fifth of the blocks, a quarter of the FFN, half the heads, no heal
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    torch.nn.Module.float(loaded)
    assert len(loaded.model.layers) == 4
    rc, text2, err = invoke("eval", out / "hf", "--data", str(CAL), "--max-tokens", "512", "--json")
    assert rc == 0, err
    assert abs(json.loads(text2)[CAL.name]["ppl"] - ev["ppl"]) / ev["ppl"] < 1e-3
    shutil.rmtree(out / "hf")
    rc, text3, err = invoke("run", path, "--output", out, "--resume", "--json")
    assert rc == 0, err
    again = json.loads(text3)
    assert all(s["resumed"] for s in again["stages"] if s["name"] in ("prune", "quantize"))
    assert next(iter(again["eval"].values()))["ppl"] == ev["ppl"]


def test_heal_lowers_the_kl_trains_no_embedding_and_resumes(tmp_path):
    stages = [{"stage": "prune", "method": "ffn", "ratio": 0.5, "samples": 4, "seqlen": 32},
              {"stage": "heal", "method": "distill", "steps": 30, "batch_size": 2, "seqlen": 64, "lr": 2e-3}]
    out = tmp_path / "out"
    path = write(tmp_path, stages, formats=())
    rc, text, err = invoke("run", path, "--output", out, "--json")
    assert rc == 0, err
    report = json.loads(text)
    heal = next(s for s in report["structure"] if s["stage"] == "heal")
    assert heal["kl_after"] < 0.8 * heal["kl_before"], heal
    from safetensors.torch import load_file

    saved = load_file(next((out / "stages").glob("*-heal-distill/trained.safetensors")))
    assert saved and not any("embed" in n or "lm_head" in n for n in saved)
    assert saved["model.layers.0.mlp.down_proj.weight"].shape == (64, 86)
    rc, text2, err = invoke("run", path, "--output", out, "--resume", "--json")
    assert rc == 0, err
    assert next(iter(json.loads(text2)["eval"].values()))["ppl"] == next(iter(report["eval"].values()))["ppl"]
    rc, _, err = invoke("run", write(tmp_path, [STAGES[3], stages[1]], formats=(), name="late.yaml"), "--dry-run")
    assert rc == 1 and "heal before quantizing" in err


def test_heads_and_depth_prune_an_moe_model_too():
    model = tiny_causal("mixtral", num_hidden_layers=3)
    a = ModelAdapter(model)
    s0 = ModelSpec.of(a)
    assert head_scores(a, TOKENS, 2)[0].shape == (2,) and block_scores(a, TOKENS, "cosine", 2).shape == (3,)
    s1 = s0.keeping(blocks=[0, 2], kv_heads={0: [1], 2: [0]})
    s1.restore(a, s0)
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == (2, 1)
    assert logits(model).shape == (4, 24, 128) and ModelSpec.of(a).blocks[1].experts == s0.blocks[2].experts


@pytest.mark.e2e
def test_the_prune_suite_runs_quick(tmp_path):
    """`python -m bench quality --suite prune --quick`: every row on stories260K with tiny sizes (plumbing)."""
    result, md = quick_suite(tmp_path, "prune")
    fams = [(r["family"], r["importance"], r["heal"], r["quant"]) for r in result["summary"]]
    assert ("ffn", "calibrated", True, None) in fams and ("depth", "last", False, None) in fams
    assert ("dense", "-", False, "w2") in fams and ("ffn", "calibrated", True, "w4") in fams
    dense4 = next(r for r in result["summary"] if r["quant"] == "w4" and r["family"] == "dense")
    pruned4 = next(r for r in result["summary"] if r["quant"] == "w4" and r["family"] == "ffn")
    assert pruned4["bytes"] < dense4["bytes"] < result["cells"][0]["fp_bytes"]
    assert (tmp_path / "prune-pareto.png").stat().st_size > 0 and "## Expected outcomes" in md.read_text()
    path = next(r for r in result["summary"] if r["family"] == "prunepath")
    assert [p["tau"] for p in path["curve"]] == [0.5, 1.0] and path["curve"][-1]["active"] == 1.0
    assert path["curve"][0]["active"] < 1 and (tmp_path / "prune-prunepath.png").stat().st_size > 0
    assert any(t["target"].startswith("PrunePath") for t in result["targets"])


def test_onnx_and_openvino_hold_per_layer_ffn_widths_fewer_heads_and_blocks(tmp_path):
    """The traced graphs bake each layer's own FFN width in (what `scope: global` leaves); logits match the
    pruned model in onnxruntime and OpenVINO."""
    from helpers import ort_logits, rel_err, run_ir

    from compress.export.onnx import export_onnx
    from compress.export.openvino import export_openvino

    model, a = dead_units()
    s0 = ModelSpec.of(a)
    s0.keeping(blocks=[0, 2], ffn={0: list(range(32, 128)), 2: list(range(64, 128))}, kv_heads={0: [0], 2: [1]}) \
        .restore(a, s0)
    assert [a.role(i, "mlp_up").out_features for i in range(2)] == [96, 64]
    ids = TOKENS[:1]
    ref = logits(model, ids).numpy()
    res = export_onnx(model, {}, tmp_path / "onnx")
    assert rel_err(ort_logits(res["path"], ids), ref) < 1e-4
    xml = export_openvino(model, {}, tmp_path / "ov", onnx_path=res["path"])["path"]
    assert rel_err(run_ir(xml, ids)[0], ref) < 1e-3


# -- planned widths are honoured: the multiple follows the quantize stage's groups ------------------------------
def _bind(stages, model):
    from types import SimpleNamespace as NS

    from compress.bind import bind
    from compress.recipe import ExportSpec

    return bind(NS(stage_configs=stages, export=ExportSpec(), model=NS(stream=False)), ModelAdapter(model))


def _skeleton(width: int, hidden: int = 64):
    import transformers as T
    from accelerate import init_empty_weights

    with init_empty_weights():
        return T.AutoModelForCausalLM.from_config(T.LlamaConfig(
            hidden_size=hidden, intermediate_size=width, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64))


@pytest.mark.parametrize("width", [172, 256, 384, 576, 1536])
def test_every_ffn_width_group_and_ratio_exports_the_planned_width(width, tmp_path):
    """FFN widths x groups {32, 64, 128} x ratios {0.1, 0.25, 0.5}: the plan (the bind step on the weightless
    skeleton) removes channels in every cell, its down_proj keeps whole groups of the group the quantize stage
    will use there, and the prune stage + RTN + hf export on the real model write exactly the planned width
    (config.json's intermediate_size and the packed down_proj)."""
    from types import SimpleNamespace as NS

    from compress.export.hf import export_hf, read_quantized
    from compress.prune.structured import FFNPruneConfig, apply
    from compress.quantize.rtn import RTNConfig, quantize_layer
    from compress.quantize.spine import planned_layers

    down = "model.layers.0.mlp.down_proj"
    source = tiny_causal("llama", hidden_size=64, intermediate_size=width, num_hidden_layers=1, vocab_size=64)
    for g in (32, 64, 128):
        for ratio in (0.1, 0.25, 0.5):
            quant = RTNConfig(bits=4, group_size=g, sym=True)
            b = _bind([FFNPruneConfig(ratio=ratio, importance="magnitude"), quant], _skeleton(width))
            planned, group = b.spec.blocks[0].ffn, b.stages[1].facts.layers[down].group_size
            cell = (width, g, ratio, b.stages[0].cfg.multiple, planned, group)
            assert planned < width and planned % group == 0 and planned % 32 == 0, cell
            assert any(f"ffn {width} -> {planned}" in c for c in b.stages[0].facts.changes), cell
            if b.stages[0].cfg.multiple != g:  # adapted: the plan says so
                assert any("the multiple follows the group" in n for n in b.stages[0].facts.notes), cell
            model = copy.deepcopy(source)
            a = ModelAdapter(model)
            ctx = NS(adapter=a, inputs={}, facts=b.stages[0].facts, emit=lambda v: None)
            apply(ctx, b.stages[0].cfg)
            layers = planned_layers(a, quant)
            qweights = {n: quantize_layer(a.model.get_submodule(n).weight.data, s) for n, s in layers.items()}
            for n, qw in qweights.items():
                qw.dequantize(out=a.model.get_submodule(n).weight.data)
            out = tmp_path / f"{g}-{ratio}"
            export_hf(model, qweights, None, out)
            config, back = read_quantized(out)
            assert config["intermediate_size"] == planned and layers[down].group_size == group, cell
            assert back[down].in_features == planned and back[down].group_size == group, cell


def test_the_issue_qwen3_ffn_256_at_group_128_prunes_and_says_how(tmp_path):
    """qwen3, FFN 256, recipes/prune-ffn25-w4.yaml (ratio 0.25, AutoRound group 128): multiples of 128 round 192
    back up to 256 (nothing pruned, reported as success before); the multiple now follows down_proj's group at the
    narrower width (64), --dry-run and report.md say so, and the export holds 192."""
    from helpers import shrink
    from tiny import save_tiny

    model = save_tiny("qwen3", tmp_path / "m", hidden_size=96, intermediate_size=256, num_attention_heads=6,
                      num_key_value_heads=2)
    rec = yaml.safe_load((REPO / "recipes" / "prune-ffn25-w4.yaml").read_text())
    args = ["prune-ffn25-w4", "--model", model, "--calibration", str(CAL), "--eval-data", str(CAL),
            "--set", "export.formats=[hf]", *shrink(rec)]
    rc, text, err = invoke("run", *args, "--dry-run")
    assert rc == 0, err
    assert "block 0 ffn 256 -> 192" in text and "the multiple follows the group" in text
    assert "model.layers.0.mlp.down_proj: 128 -> 64" in text
    out = tmp_path / "out"
    rc, text, err = invoke("run", *args, "--output", out, "--json")
    assert rc == 0, err
    assert json.loads((out / "hf" / "config.json").read_text())["intermediate_size"] == 192
    md = (out / "report.md").read_text()
    assert "block 0 ffn 256 -> 192" in md and "the multiple follows the group" in md


def test_a_prune_that_would_remove_nothing_is_refused_at_plan_time():
    """Nothing to remove at any allowed multiple, an explicit multiple that keeps everything, or no quantize stage
    and a ratio below one channel: exit 1 at plan time with the nearest ratio that prunes."""
    from compress.errors import BadInput
    from compress.prune.structured import FFNPruneConfig
    from compress.quantize.rtn import RTNConfig

    q = RTNConfig(bits=4, group_size=32)
    with pytest.raises(BadInput, match=r"would remove nothing.*use `ratio: 0.5` or more \(keeps 32 of 64\)"):
        _bind([FFNPruneConfig(ratio=0.2), q], _skeleton(64))  # 51.2 rounds to 64 at 32
    with pytest.raises(BadInput, match=r"multiple 128 .*`ratio: 0.5` or more.*or set a smaller `multiple`"):
        _bind([FFNPruneConfig(ratio=0.25, multiple=128), q], _skeleton(256))
    with pytest.raises(BadInput, match=r"would remove nothing.*`ratio: 0.01` or more"):
        _bind([FFNPruneConfig(ratio=0.001)], _skeleton(172))
    b = _bind([FFNPruneConfig(ratio=0.25, multiple=64), q], _skeleton(256))  # explicit: honoured as given
    assert b.spec.blocks[0].ffn == 192 and not b.stages[0].facts.notes
