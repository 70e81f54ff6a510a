"""Allocation plans of llama.cpp types (docs/gguf.md#mixed-precision-plans): an `allocate` stage before a quantize
stage on llama.cpp's grids gives each tensor of the file one type, within a budget in bits per weight, and the file,
the plan and the run's own evaluation agree."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import yaml
from conftest import invoke, plan_path
from tiny import save_tiny
from transformers import AutoModelForCausalLM

from compress.allocate.problem import Option, build_problem, gguf_option, option_bits
from compress.quantize import ggml_grid

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _recipe(tmp_path, model, stages, name="r.yaml", eval_=False):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({
        "version": 1, "model": {"path": str(model)}, "stages": stages,
        "calibration": {"sources": ["bundled:botchan-calibration"], "nsamples": 2, "seqlen": 32},
        "eval": ({"data": ["bundled:botchan-eval"], "max_tokens": 512, "generation": {"prompts": 0}} if eval_
                 else {"enabled": False}),
        "export": {"formats": ["gguf"]}}))
    return path


def test_a_type_costs_its_block_bytes_and_falls_back_as_llama_cpp_does():
    # Q4_K: 144 bytes per 256 weights; Q8_0: 34 per 32; a 576-wide row cannot hold K blocks: Q4_K -> Q5_0 (22 / 32)
    assert option_bits(8, 512, 0, gguf_option("Q4_K"), True, 3) == 8 * 2 * 144 * 8
    assert option_bits(8, 512, 0, gguf_option("Q8_0"), True, 3) == 8 * 16 * 34 * 8
    assert option_bits(8, 576, 0, gguf_option("Q4_K"), True, 0) == 8 * 18 * 22 * 8
    assert gguf_option("Q6_K") == Option(6, "gguf", "Q6_K") and gguf_option("Q6_K").label == "Q6_K"


def test_a_types_error_is_the_energy_weighted_error_of_llama_cpps_rounding():
    """The proxy of a type is llama.cpp's fit and rounding of the whole tensor with the input energy as its importance
    matrix; its cost the type's bytes; one unit per tensor whatever the widths."""
    g = torch.Generator().manual_seed(0)
    W1, W2 = torch.randn(64, 512, generator=g), torch.randn(32, 256, generator=g)
    e1, e2 = torch.rand(512, generator=g) + 0.1, torch.rand(256, generator=g) + 0.1
    opts = [gguf_option(t) for t in ("Q2_K", "Q4_K", "Q8_0")]
    p, hats = build_problem({"a": (W1, e1, 0), "b": (W2, e2, 1)}, 2, opts, 512, 512, True, 5.0)
    assert p.n_units == 2 and p.chunk == 512
    for u, (W, e) in enumerate(((W1, e1), (W2, e2))):
        for o, t in enumerate(("Q2_K", "Q4_K", "Q8_0")):
            hat = ggml_grid.rtn(W, t, e).dequantize()
            want = float(((W - hat).double() ** 2 * e.double()).sum())
            assert float(p.err[u, o]) == pytest.approx(want, rel=1e-9)
            assert int(p.cost[u, o]) == option_bits(W.shape[0], W.shape[1], 0, opts[o], True, 0)
    assert (p.err[:, 0] > p.err[:, 1]).all() and (p.err[:, 1] > p.err[:, 2]).all()
    assert torch.equal(hats["b"][1], ggml_grid.rtn(W2, "Q4_K", e2).dequantize())


def test_an_allocation_gives_each_tensor_a_llama_cpp_type_and_the_file_is_the_run(tmp_path):
    """greedy at 4.5 bits per weight before GPTQ on Q4_K_M blocks: the plan mixes types within the budget; every block
    linear of the file has its plan's type, the embeddings and output the mix's; the file's tensor bytes are the plan's
    bits; compress's reading of the file gives the run's own report."""
    from compress.eval.cli import evaluate_checkpoint
    from compress.export.gguf import tensor_plan
    from gguf import GGUFReader

    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    path = _recipe(tmp_path, src, [{"stage": "allocate", "method": "greedy", "budget": 4.5},
                                   {"stage": "quantize", "method": "gptq", "gguf": "Q4_K_M"}], eval_=True)
    rc, out, err = invoke("run", path, "--dry-run")
    assert rc == 0 and "one llama.cpp type per tensor (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0) for 28 block linears" \
        in out, out + err
    rc, out, err = invoke("run", path, "--output", tmp_path / "o", "--json")
    assert rc == 0, err
    report = json.loads(out)
    plan = json.loads(plan_path(tmp_path / "o").read_text())
    assert plan["chunk_size"] == 0 and 4.45 < plan["effective_bits"] <= 4.5
    planned = {n: v["type"] for n, v in plan["layers"].items()}
    assert len(planned) == 28 and len(set(planned.values())) >= 3, Counter(planned.values())
    file = tmp_path / "o" / "gguf" / "model-Q4_K_M.gguf"
    tensors = {t.name: t for t in GGUFReader(file).tensors}
    model = AutoModelForCausalLM.from_pretrained(src)
    entries, _ = tensor_plan(model, "Q4_K_M")
    gguf_name = {hf.removesuffix(".weight"): name for hf, name, _ in entries}
    assert {n: tensors[gguf_name[n]].tensor_type.name for n in planned} == planned
    assert sum(int(tensors[gguf_name[n]].n_bytes) for n in planned) * 8 == plan["total_bits"]
    assert tensors["output.weight"].tensor_type.name == "Q6_K" and tensors["token_embd.weight"].tensor_type.name == "Q4_K"
    got = next(iter(evaluate_checkpoint(str(file), reference=str(src), data=["bundled:botchan-eval"],
                                        max_tokens=512, gen_prompts=0).values()))
    ran = next(iter(report["eval"].values()))
    assert got["ppl"] == pytest.approx(ran["ppl"], rel=1e-5)
    # the plan file replays: `method: file` gives the same types
    again = _recipe(tmp_path, src, [{"stage": "allocate", "method": "file", "path": str(plan_path(tmp_path / "o"))},
                                    {"stage": "quantize", "method": "rtn", "gguf": "Q4_K_M"}], name="f.yaml")
    rc, _, err = invoke("run", again, "--output", tmp_path / "f")
    assert rc == 0, err
    tensors = {t.name: t for t in GGUFReader(tmp_path / "f" / "gguf" / "model-Q4_K_M.gguf").tensors}
    assert {n: tensors[gguf_name[n]].tensor_type.name for n in planned} == planned


def test_uniform_takes_the_widest_type_within_the_budget(tmp_path):
    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    path = _recipe(tmp_path, src, [{"stage": "allocate", "method": "uniform", "budget": 5.0,
                                    "options": [{"gguf": "Q3_K"}, {"gguf": "Q4_K"}, {"gguf": "Q6_K"}]},
                                   {"stage": "quantize", "method": "rtn", "gguf": "Q3_K_M"}])
    rc, _, err = invoke("run", path, "--output", tmp_path / "o")
    assert rc == 0, err
    plan = json.loads(plan_path(tmp_path / "o").read_text())
    assert {v["type"] for v in plan["layers"].values()} == {"Q4_K"} and plan["effective_bits"] == 4.5


def test_plan_time_refusals(tmp_path):
    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    grid = {"stage": "quantize", "method": "rtn", "gguf": "Q4_K_M"}
    plain = {"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32}
    cases = [
        ([{"stage": "allocate", "method": "greedy", "budget": 4.5, "options": [{"bits": 4}, {"bits": 8}]}, grid],
         "the options are llama.cpp types"),
        ([{"stage": "allocate", "method": "greedy", "budget": 4.5, "options": [{"gguf": "Q4_K"}]}, plain],
         "plans llama.cpp types, but the next quantize stage does not round on llama.cpp's grids"),
        ([{"stage": "allocate", "method": "greedy", "budget": 4.5, "group_size": 32}, grid],
         "`group_size` does not apply"),
        ([{"stage": "allocate", "method": "greedy", "budget": 2.0}, grid], "is below the cheapest plan (2.6250"),
        ([{"stage": "allocate", "method": "moe", "budget": 3.0}, grid], "plans expert bit widths"),
        ([{"stage": "allocate", "method": "greedy", "budget": 4.5, "options": [{"gguf": "Q4_K", "treatment": "clip"}]},
          grid], "takes no treatment"),
        ([{"stage": "allocate", "method": "greedy", "budget": 4.5, "options": [{"gguf": "Q4_K"}, {"bits": 4}]}, grid],
         "either all llama.cpp types"),
    ]
    for i, (stages, msg) in enumerate(cases):
        rc, _, err = invoke("run", _recipe(tmp_path, src, stages, name=f"r{i}.yaml"), "--dry-run")
        assert rc == 1 and msg in err, (msg, err)


def test_routed_experts_keep_the_mix_type(tmp_path):
    """A layer's routed experts are one tensor in the file: the allocation plans the other tensors and says so."""
    src = save_tiny("mixtral", tmp_path / "m", hidden_size=256, intermediate_size=256, num_hidden_layers=2)
    path = _recipe(tmp_path, src, [{"stage": "allocate", "method": "greedy", "budget": 4.5},
                                   {"stage": "quantize", "method": "rtn", "gguf": "Q4_K_M"}])
    rc, out, err = invoke("run", path, "--dry-run")
    assert rc == 0 and "routed expert layers (e.g. `model.layers.0.mlp.experts" in out, out + err
    assert "for 8 block linears" in out, out


def test_measured_sensitivities_and_refine_score_the_types_on_the_real_model(tmp_path):
    """lagrangian with layer sensitivities and refine moves: the real-model loss is measured with each tensor on its
    type's llama.cpp rounding (one unit per tensor), and the plan stays within the budget."""
    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    path = _recipe(tmp_path, src, [{"stage": "allocate", "method": "lagrangian", "budget": 4.0,
                                    "sensitivity": "layer", "refine": 6, "select_samples": 2, "select_seqlen": 32},
                                   {"stage": "quantize", "method": "rtn", "gguf": "Q4_K_M"}])
    rc, _, err = invoke("run", path, "--output", tmp_path / "o")
    assert rc == 0, err
    plan = json.loads(plan_path(tmp_path / "o").read_text())
    assert plan["effective_bits"] <= 4.0 and len(plan["info"]["layer_sensitivity"]) == 14
    assert plan["info"]["refine"]["loss_end"] <= plan["info"]["refine"]["loss_start"]
    assert {v["type"] for v in plan["layers"].values()} <= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"}
