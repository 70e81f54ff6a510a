"""The gguf export: what transformers' GGUF loader (and, in the engine tier, llama.cpp) reads back, llama.cpp's
per-tensor type plan, and the plan-time refusals."""

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
import transformers as T
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.export.gguf import export_gguf, types
from conftest import MODELS, TEXT as TEXTS, invoke

from tiny import COMMON, save_tiny

TEXT = "Once upon a time, there was a little dog named Max. He liked 33 apples!"


def _roundtrip(src, out, file_type="F32", same_tokens=True):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src)
    res = export_gguf(model, {}, tok, out, file_type=file_type)
    back = AutoModelForCausalLM.from_pretrained(out, gguf_file=res["file"], dtype=torch.float32).eval()
    tok_back = AutoTokenizer.from_pretrained(out, gguf_file=res["file"])
    ids = tok(TEXT)["input_ids"]
    assert tok_back(TEXT)["input_ids"] == ids or not same_tokens
    with torch.no_grad():
        x = torch.tensor([ids])
        return res, model(x).logits, back(x).logits


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_f32_file_is_the_model_in_transformers(family, tmp_path):
    """Every tensor written where transformers' GGUF loader (which undoes llama.cpp's q/k layout) expects it: the
    logits of the file are the model's, bit for bit; the tokenizer encodes the same ids."""
    if family == "qwen3":  # transformers' GGUF loader takes Qwen3's default head_dim (128), not key_length
        src = tmp_path / "m"
        torch.manual_seed(0)
        cfg = T.Qwen3Config(**{**COMMON, "vocab_size": 512, "tie_word_embeddings": True}, head_dim=128)
        T.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
            shutil.copy(MODELS / "stories260K" / f, src)
    else:
        src = save_tiny(family, tmp_path / "m", **({"attention_bias": True} if family == "qwen2" else {}))
    # stories260K's SentencePiece files: transformers reads them as another tokenizer in a Qwen directory, llama.cpp
    # (and the GGUF) as what they are
    res, a, b = _roundtrip(src, tmp_path / "g", same_tokens=family in ("llama", "mistral"))
    assert torch.equal(a, b)
    assert (tmp_path / "g" / "Modelfile").read_text() == f"FROM ./{res['file']}\n"
    assert not list((tmp_path / "g").glob("*.partial"))


@pytest.mark.parametrize("name", ["stories260K", "ref-llama-7m"])
def test_real_tokenizers(name, tmp_path):
    """A SentencePiece tokenizer (stories260K: `llama`) and a byte-level BPE one (ref-llama-7m: `gpt2`, GPT-2's
    pre-tokenizer)."""
    res, a, b = _roundtrip(MODELS / name, tmp_path / "g", "F16")
    assert (a - b).abs().max() < 0.05 and res["types"]["F16"] > 0  # fp16 weights


def _names(n_layers, tied=False):
    out = [("token_embd.weight", (512, 256))] + ([] if tied else [("output.weight", (512, 256))])
    for i in range(n_layers):
        out += [(f"blk.{i}.attn_norm.weight", (256,)), (f"blk.{i}.attn_q.weight", (256, 256)),
                (f"blk.{i}.attn_k.weight", (64, 256)), (f"blk.{i}.attn_v.weight", (64, 256)),
                (f"blk.{i}.attn_output.weight", (256, 256)), (f"blk.{i}.ffn_gate.weight", (768, 256)),
                (f"blk.{i}.ffn_up.weight", (768, 256)), (f"blk.{i}.ffn_down.weight", (256, 768))]
    return out


def test_type_plan_follows_llama_cpp():
    """llama-quant.cpp's choices: Q4_K_M bumps attn_v and ffn_down of the "more bits" layers to Q6_K (layers 0-3,
    28-31 and every third between of 32), the output is Q6_K, norms F32; Q3_K_M, Q2_K as their rules say."""
    p = types.plan("Q4_K_M", _names(32), n_head=8, n_head_kv=2)
    six = sorted(int(n.split(".")[1]) for n, t in p.items() if n.endswith("attn_v.weight") and t == "Q6_K")
    assert six == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert six == sorted(int(n.split(".")[1]) for n, t in p.items() if n.endswith("ffn_down.weight") and t == "Q6_K")
    assert p["output.weight"] == "Q6_K" and p["token_embd.weight"] == "Q4_K" and p["blk.0.attn_norm.weight"] == "F32"
    assert p["blk.5.attn_q.weight"] == "Q4_K"
    assert types.plan("Q4_K_M", _names(2, tied=True), n_head=8, n_head_kv=2)["token_embd.weight"] == "Q6_K"
    p = types.plan("Q3_K_M", _names(32), n_head=8, n_head_kv=2)
    assert [p[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert [p[f"blk.{i}.ffn_down.weight"] for i in (0, 1, 2)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert p["blk.3.attn_output.weight"] == "Q4_K" and p["blk.3.ffn_up.weight"] == "Q3_K"
    p = types.plan("Q2_K", _names(4), n_head=8, n_head_kv=2)  # grouped-query ratio 4
    assert (p["blk.0.attn_v.weight"], p["blk.0.ffn_down.weight"], p["blk.0.ffn_up.weight"]) == ("Q4_K", "Q3_K", "Q2_K")
    assert types.plan("Q2_K", _names(4), n_head=8, n_head_kv=8)["blk.0.attn_v.weight"] == "Q3_K"
    p = types.plan("Q4_0", _names(2), n_head=8, n_head_kv=2)
    assert p["output.weight"] == "Q6_K" and p["token_embd.weight"] == "Q4_0"
    assert types.plan("Q8_0", _names(2), n_head=8, n_head_kv=2)["output.weight"] == "Q8_0"
    # widths the block does not divide: the fallbacks
    assert [types.fallback(t, 576) for t in ("Q4_K", "Q6_K", "Q2_K", "Q5_K", "Q4_0")] == \
        ["Q5_0", "Q8_0", "Q4_0", "Q5_1", "Q4_0"]
    assert types.fallback("Q4_K", 172) == "F16" and types.fallback("Q8_0", 172) == "F16"


def _recipe(tmp_path, model, stages, export):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "model": {"path": str(model)}, "stages": stages,
                                    "calibration": {"sources": ["bundled:botchan-calibration"], "nsamples": 2,
                                                    "seqlen": 32},
                                    "eval": {"enabled": False}, "export": {"formats": export}}))
    return path


def test_plan_refuses_a_grid_the_type_does_not_hold_and_shows_the_types(tmp_path):
    model = save_tiny("llama", tmp_path / "m")
    bad = _recipe(tmp_path, model, [{"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 128}],
                  [{"format": "gguf", "type": "Q4_0"}])
    rc, _, err = invoke("run", bad, "--dry-run")
    assert rc == 1 and "stores `model.layers.0.self_attn.q_proj` as Q4_0" in err and "group_size: 32" in err, err
    asym = _recipe(tmp_path, model, [{"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32,
                                      "sym": False}], [{"format": "gguf", "type": "Q4_0"}])
    rc, _, err = invoke("run", asym, "--dry-run")
    assert rc == 1 and "asym" in err, err
    ok = _recipe(tmp_path, model, [], [{"format": "gguf", "type": "F16"}])
    rc, out, err = invoke("run", ok, "--dry-run")
    assert rc == 0 and "export gguf F16: 16 F16, 5 F32 tensors" in out and "llama.cpp       serves it" in out, out
    rc, _, err = invoke("run", _recipe(tmp_path, save_tiny("deepseek_v3", tmp_path / "d3"), [], ["gguf"]), "--dry-run")
    assert rc == 1 and "`deepseek_v3` is not one of them yet" in err, err


def test_a_conversion_recipe_writes_the_file(tmp_path):
    """No stages, export formats: the model converted; report and serving table name the file."""
    model = save_tiny("llama", tmp_path / "m")
    rc, out, err = invoke("run", _recipe(tmp_path, model, [], [{"format": "gguf", "type": "F32"}]), "--output",
                          tmp_path / "o", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["serving"]["llama.cpp"] == [] and (tmp_path / "o" / "gguf" / "model-F32.gguf").is_file()


def _tensors(path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(path)
    return {t.name: (t.tensor_type.name, dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0])))
            for t in r.tensors}


@pytest.mark.parametrize("bits,file_type", [(4, "Q4_0"), (8, "Q8_0"), (5, "Q5_0")])
def test_codes_compress_rounded_are_the_file(bits, file_type, tmp_path):
    """RTN sym group 32 is Q4_0 / Q5_0 / Q8_0's own grid: each layer's tensor in the file dequantizes (by gguf's
    reader) to exactly the weights compress evaluated, q and k rows in llama.cpp's order."""
    from compress.export.gguf import arch
    from compress.export.hf import read_quantized

    model = save_tiny("llama", tmp_path / "m")
    rc, out, err = invoke("run", _recipe(tmp_path, model, [{"stage": "quantize", "method": "rtn", "bits": bits,
                                                            "group_size": 32, "sym": True}],
                                         ["hf", {"format": "gguf", "type": file_type}]),
                          "--output", tmp_path / "o", "--json")
    assert rc == 0, err
    res = json.loads(out)["exports"]
    assert res["gguf"]
    file = _tensors(tmp_path / "o" / "gguf" / f"model-{file_type}.gguf")
    config, qweights = read_quantized(tmp_path / "o" / "hf")
    cfg = AutoModelForCausalLM.from_pretrained(model).config
    assert len(qweights) == 14
    for name, qw in qweights.items():
        t, w = file[arch.tensor_name(name + ".weight", "llama", 2)]
        expect = qw.dequantize()
        perm = arch.permutation(name, cfg, arch.FAMILIES["llama"], expect.shape[0])
        assert t == file_type and np.array_equal(w, (expect if perm is None else expect[perm]).numpy()), name
    assert file["output.weight"][0] == "Q8_0"  # Q6_K for the output, whose 64 columns fall back to Q8_0


def test_k_types_hold_llama_cpps_rounding(tmp_path):
    """A conversion to Q4_K_M of a 256-wide model: every tensor at llama.cpp's type, holding what llama.cpp's
    reference quantizer (kernels/ggml.py, byte-exact to ggml-quants.c) gives its weights; transformers loads it."""
    from compress.export.gguf import arch
    from compress.kernels import ggml

    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    res = export_gguf(model, {}, tok, tmp_path / "g", file_type="Q4_K_M")
    file = _tensors(tmp_path / "g" / res["file"])
    assert res["types"] == {"Q4_K": 25, "Q6_K": 5, "F32": 9}  # attn_v, ffn_down of layers 2 and 3; the output
    state = model.state_dict()
    for name, t in state.items():
        g = arch.tensor_name(name, "llama", 4)
        kind, w = file[g]
        if t.dim() == 1:
            assert kind == "F32" and np.array_equal(w[0], t.numpy())
            continue
        perm = arch.permutation(name.removesuffix(".weight"), model.config, arch.FAMILIES["llama"], t.shape[0])
        ref = (t if perm is None else t[perm]).numpy()
        assert np.array_equal(w, ggml.dequantize(kind, ggml.quantize_ref(kind, ref))), g
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file=res["file"])
    assert back.model.layers[3].mlp.down_proj.weight.shape == (256, 512)


@pytest.mark.engine
@pytest.mark.parametrize("stages,file_type", [
    ([{"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32, "sym": True}], "Q4_0"),
    ([], "Q4_K_M"), ([], "Q2_K"), ([], "F16"),
    ([{"stage": "quantize", "method": "gptq", "gguf": "Q4_K_M"}], "Q4_K_M"),
    ([{"stage": "quantize", "method": "rtn", "gguf": "Q2_K"}], "Q2_K")])
def test_llama_cpp_runs_what_compress_writes(stages, file_type, tmp_path):
    """llama.cpp (compress serve-env llama.cpp) loads compress's own files of ref-llama-7m (byte-level BPE, the
    `gpt2` tokenizer; 256 wide, so the K-quants are real): greedy tokens as compress reads the file, perplexity on
    compress's windows within 0.5%; and llama.cpp tokenizes the text as transformers does."""
    from compress.serve.check import serve_check
    from compress.serve.engines import llamacpp

    model = MODELS / "ref-llama-7m"
    rc, _, err = invoke("run", _recipe(tmp_path, model, stages, [{"format": "gguf", "type": file_type}]),
                        "--output", tmp_path / "o")
    assert rc == 0, err
    res = serve_check(tmp_path / "o", "llama.cpp", dtype="float32", perplexity=str(TEXTS / "wikitext-2-raw" / "wiki.test.raw"), max_tokens=4096)
    print(file_type, json.dumps({k: res[k] for k in ("tokens", "top5_overlap", "max_dlogprob", "perplexity")}),
          json.dumps({k: res["emulated"][k] for k in ("tokens", "max_dlogprob")}))
    # every greedy token equal, or each divergence at a tie of compress's reading (its two tokens within TIE nats:
    # on this flat 7M model one rounding flips a near-tie and the rest of that continuation differs)
    assert res["agree"] and res["tokens"]["total"] == 128
    assert max(res["tokens"]["equal"], res["emulated"]["tokens"]["equal"]) >= 96
    assert abs(res["perplexity"]["ratio"] - 1) < 0.005, res["perplexity"]
    ids = AutoTokenizer.from_pretrained(model)(TEXT)["input_ids"]
    out = llamacpp.run("tokenize", {"model": str(tmp_path / "o" / "gguf" / f"model-{file_type}.gguf"), "text": TEXT})
    assert out["tokens"] == ids


@pytest.mark.parametrize("stage", [{"method": "gptq"}, {"method": "autoround", "iters": 4},
                                   {"method": "gptq", "final_block": "lfq", "final_iters": 4}, {"method": "rtn"}],
                         ids=["gptq", "autoround", "gptq-lfq", "rtn"])
def test_a_quantize_stage_on_llama_cpps_grids_is_the_file(stage, tmp_path):
    """`gguf: Q4_K_M` on each method (and the LFQ final block): every tensor the file stores quantized (the
    embeddings and output too) was rounded by the run on its own type's blocks, written byte for byte: compress's
    reading of the file gives the run's own report to the digit; the export takes the stage's type; the dry run
    names the types."""
    from compress.eval.cli import evaluate_checkpoint

    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512)
    path = _recipe(tmp_path, src, [{"stage": "quantize", "gguf": "Q4_K_M", **stage}], ["gguf"])
    doc = yaml.safe_load(path.read_text())
    doc["eval"] = {"data": ["bundled:botchan-eval"], "max_tokens": 512, "generation": {"prompts": 0}}
    path.write_text(yaml.safe_dump(doc))
    if stage["method"] == "gptq" and len(stage) == 1:  # attn_v, ffn_down of layer 1 (of 2) and the output Q6_K
        rc, out, err = invoke("run", path, "--dry-run")
        assert rc == 0 and "export gguf Q4_K_M: 5 F32, 13 Q4_K, 3 Q6_K tensors" in out, out + err
    rc, out, err = invoke("run", path, "--output", tmp_path / "o", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["size"]["quantized_layers"] == 2 * 7 + 2
    file = tmp_path / "o" / "gguf" / "model-Q4_K_M.gguf"
    got = next(iter(evaluate_checkpoint(str(file), reference=str(src), data=["bundled:botchan-eval"],
                                        max_tokens=512, gen_prompts=0).values()))
    ran = next(iter(report["eval"].values()))
    assert got["ppl"] == pytest.approx(ran["ppl"], rel=1e-5) and got["kl"] == pytest.approx(ran["kl"], rel=1e-3, abs=1e-6)


def test_plan_refuses_what_a_grid_stage_cannot_give(tmp_path):
    model = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512)
    stage = {"stage": "quantize", "method": "rtn", "gguf": "Q3_K_M"}
    cases = [([stage], ["gguf", "hf"], "only the gguf export stores; drop hf"),
             ([{**stage, "bits": 3}], ["gguf"], "`bits` does not apply"),
             ([{"stage": "quantize", "method": "rtn", "overrides": [{"pattern": "q_proj", "gguf": "Q8_0"}]}],
              ["gguf"], "the stage has no `gguf` file type"),
             ([stage], [{"format": "gguf", "type": "Q4_K_M"}], "but export gguf type is Q4_K_M"),
             ([{"stage": "allocate", "method": "moe", "budget": 3.5}, stage], ["gguf"], "plans expert bit widths")]
    for stages, export, msg in cases:
        rc, _, err = invoke("run", _recipe(tmp_path, model, stages, export), "--dry-run")
        assert rc == 1 and msg in err, (msg, err)
    rc, out, err = invoke("run", _recipe(tmp_path, model, [stage], ["gguf"]), "--dry-run")
    assert rc == 0 and "export gguf Q3_K_M" in out, err


def test_an_override_gives_a_layer_its_own_type(tmp_path):
    """Overrides set per-tensor types (llama-quantize's --tensor-type): the dry run's plan, the file and the run's
    rounding all carry them."""
    src = save_tiny("llama", tmp_path / "m", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    stage = {"stage": "quantize", "method": "rtn", "gguf": "Q4_K_M",
             "overrides": [{"pattern": r"layers\.0\.mlp", "gguf": "Q8_0"}, {"pattern": "o_proj", "gguf": "Q2_K"}]}
    path = _recipe(tmp_path, src, [stage], ["gguf"])
    rc, out, err = invoke("run", path, "--dry-run")
    # layer 0's gate, up, down at Q8_0, the 4 o_proj at Q2_K (from 25 Q4_K); attn_v, ffn_down of layers 2, 3 and the
    # output stay Q6_K
    assert rc == 0 and "export gguf Q4_K_M: 9 F32, 4 Q2_K, 18 Q4_K, 5 Q6_K, 3 Q8_0 tensors" in out, out + err
    rc, out, err = invoke("run", path, "--output", tmp_path / "o")
    assert rc == 0, err
    file = _tensors(tmp_path / "o" / "gguf" / "model-Q4_K_M.gguf")
    assert file["blk.0.ffn_down.weight"][0] == "Q8_0" and file["blk.3.attn_output.weight"][0] == "Q2_K"
    assert file["blk.1.ffn_up.weight"][0] == "Q4_K"
