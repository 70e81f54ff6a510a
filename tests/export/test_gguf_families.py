"""The gguf export's families beyond llama/qwen: gemma2, gemma3 (`gemma3_text`), phi3, granite, olmo2 and the MoE
families mixtral, qwen2_moe, qwen3_moe, written as llama.cpp's convert_hf_to_gguf.py writes them.

Default tier: what transformers' GGUF loader reads back (the families it supports), every file tensor against the
model's own tensors (the families it does not), the MoE type plan, plan-time refusals, a quantize stage's expert
codes. Engine tier (`compress serve-env llama.cpp`): llama.cpp's logits on the F32 files against transformers' on
the source models, and llama.cpp's own quantize of compress's F32 file against compress's quantized files."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers as T
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.export.gguf import arch, export_gguf, tensor_plan, types
from conftest import MODELS, invoke

FAMILIES = ["phi3", "gemma2", "gemma3_text", "granite", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe"]
IN_TRANSFORMERS = ["phi3", "gemma2", "gemma3_text", "qwen2_moe", "qwen3_moe"]  # its GGUF loader's architectures
IDS = [1, 5, 77, 300, 12, 9, 400, 31, 2, 8, 511, 64, 3, 250]


def _config(family, **over):
    """A tiny config of `family`: 64 wide by default; `query_pre_attn_scalar` is Gemma's head_dim (llama.cpp's
    attention scale), qwen3_moe renormalises its top-k (llama.cpp's qwen3moe always does)."""
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=520, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update({"gemma2": dict(head_dim=16), "gemma3_text": dict(head_dim=16), "qwen3_moe": dict(head_dim=16),
               "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                               logits_scaling=3.0),
               "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
               "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64),
               }.get(family, {}))
    if family == "qwen3_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    kw.update(over)
    if family.startswith("gemma"):
        kw.setdefault("query_pre_attn_scalar", kw["head_dim"])
    return T.AutoConfig.for_model(family, **kw)


def _tiny(family, path, seed=0, **over):
    """A tiny `family` model directory (matrices N(0, 0.05), norms perturbed so that Gemma's +1 shows) with
    stories260K's SentencePiece tokenizer plus `<|endoftext|>` (id 512; llama.cpp's phi3 looks it up)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family, **over)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (p if p.dim() == 1 else 0))
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(MODELS / "stories260K" / f, path)
    (path / "added_tokens.json").write_text('{"<|endoftext|>": 512}')
    return path


def _write(src, out, file_type="F32"):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    res = export_gguf(model, {}, AutoTokenizer.from_pretrained(src), out, file_type=file_type)
    return model, out / res["file"], res


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


# what transformers' GGUF loader does not read from the file (it takes its config defaults), given to it
LOADER = {"gemma2": dict(query_pre_attn_scalar=16), "gemma3_text": dict(query_pre_attn_scalar=16),
          "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=64),
          "qwen3_moe": dict(moe_intermediate_size=32, norm_topk_prob=True)}


@pytest.mark.parametrize("family", IN_TRANSFORMERS)
def test_f32_file_is_the_model_in_transformers(family, tmp_path):
    """transformers' GGUF loader (which undoes Gemma's +1 norms, splits phi3's fused tensors as the model has them,
    unstacks the experts) gives the model's logits from the file, bit for bit."""
    model, file, res = _write(_tiny(family, tmp_path / "m"), tmp_path / "g")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file=file.name, dtype=torch.float32,
                                                **LOADER.get(family, {})).eval()
    assert type(back) is type(model)
    assert torch.equal(_logits(model), _logits(back))
    assert set(res["types"]) == {"F32"}


def _read(file):
    from gguf import GGUFReader

    r = GGUFReader(str(file))
    fields = {}
    for k, f in r.fields.items():
        if (k.startswith("tokenizer.") and k != "tokenizer.ggml.add_space_prefix") or not f.types:
            continue
        fields[k] = f.contents()
    return fields, {t.name: np.asarray(t.data).reshape([int(x) for x in reversed(t.shape)]) for t in r.tensors}


def _expected(model, family) -> dict[str, np.ndarray]:
    """The file's tensors as llama.cpp's converter derives them from the model's state, written out by hand."""
    cfg, sd = model.config, {k: v.detach().float() for k, v in model.state_dict().items()}
    fam = arch.FAMILIES[family]
    out = {}
    for name, t in sd.items():
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or family == "gemma2"):
            continue
        if ".experts." in name:
            e = t.shape[0]
            key = name.rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                ff = t.shape[1] // 2
                out[arch.tensor_name(key + ".gate_proj.weight", fam.arch, 2)] = t[:, :ff]
                out[arch.tensor_name(key + ".up_proj.weight", fam.arch, 2)] = t[:, ff:]
            else:
                out[arch.tensor_name(key + ".down_proj.weight", fam.arch, 2)] = t
            assert e == cfg.num_local_experts if family == "mixtral" else cfg.num_experts
            continue
        if fam.permute_qk and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, -1).transpose(1, 2).reshape(t.shape)
        if fam.norm_shift and name.endswith("norm.weight"):
            t = t + 1
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(-1)
        out[arch.tensor_name(name, fam.arch, 2)] = t
    return {k: v.numpy() for k, v in out.items()}


KEYS = {  # hyperparameters beyond the common ones, as convert_hf_to_gguf.py writes them for the tiny configs
    "phi3": {"phi3.rope.dimension_count": 16, "phi3.rope.scaling.original_context_length": 4096,
             "phi3.attention.sliding_window": 0},
    "gemma2": {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
               "gemma2.attention.sliding_window": 4096, "gemma2.attention.key_length": 16},
    "gemma3": {"gemma3.rope.freq_base": 1e6, "gemma3.rope.freq_base_swa": 1e4, "gemma3.attention.sliding_window": 4096,
               "gemma3.attention.key_length": 16},
    "granite": {"granite.attention.scale": 0.2, "granite.embedding_scale": 2.0, "granite.residual_scale": 0.5,
                "granite.logit_scale": 3.0, "granite.rope.dimension_count": 16, "granite.vocab_size": 520},
    "olmo2": {"olmo2.attention.layer_norm_rms_epsilon": 1e-5, "olmo2.rope.freq_base": 1e4},
    "llama": {"llama.expert_count": 4, "llama.expert_used_count": 2, "llama.feed_forward_length": 128,
              "llama.rope.dimension_count": 16},
    "qwen2moe": {"qwen2moe.expert_count": 4, "qwen2moe.expert_used_count": 2,
                 "qwen2moe.expert_feed_forward_length": 32, "qwen2moe.expert_shared_feed_forward_length": 64},
    "qwen3moe": {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                 "qwen3moe.expert_feed_forward_length": 32, "qwen3moe.attention.key_length": 16},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_and_key_as_llama_cpps_converter_writes_it(family, tmp_path):
    """Each file tensor is the model's tensor as the converter transforms it (q/k rows permuted for the llama
    layout, Gemma's norms + 1, experts stacked (experts, rows, columns), qwen2_moe's shared-expert gate 1-D, phi3's
    fused tensors as they are), every name in llama.cpp's tensor list of the architecture, and the family's keys."""
    import gguf

    model, file, _ = _write(_tiny(family, tmp_path / "m"), tmp_path / "g")
    fields, tensors = _read(file)
    a = fields["general.architecture"]
    assert a == arch.FAMILIES[family].arch
    expect = _expected(model, family)
    assert list(tensors) == list(expect)
    for name, w in tensors.items():
        assert w.shape == expect[name].shape and np.array_equal(w, expect[name]), name
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == a)
    known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch_id] for i in range(2)}
    assert {n.rsplit(".", 1)[0] for n in tensors} <= known
    assert fields[f"{a}.block_count"] == 2 and fields[f"{a}.embedding_length"] == 64
    for k, v in KEYS[a].items():
        assert fields[k] == pytest.approx(v, rel=1e-6), k
    if family in ("gemma2", "gemma3_text"):
        assert fields["tokenizer.ggml.add_space_prefix"] is False  # Gemma(2|3)Model.set_vocab
    if family == "gemma2":
        assert "output.weight" not in tensors and f"{a}.rope.freq_base" not in fields  # Gemma2Model writes none
    if family == "granite":
        assert f"{a}.attention.key_length" not in fields  # GraniteModel drops head_dim


def _names(n_layers, n_expert, *, shexp=False, qkv=False, width=256):
    out = [("token_embd.weight", (512, width)), ("output.weight", (512, width))]
    for i in range(n_layers):
        b = f"blk.{i}."
        attn = [(b + "attn_qkv.weight", (width + 128, width))] if qkv else [
            (b + "attn_q.weight", (width, width)), (b + "attn_k.weight", (64, width)), (b + "attn_v.weight", (64, width))]
        out += [(b + "attn_norm.weight", (width,))] + attn + [(b + "attn_output.weight", (width, width))]
        if n_expert:
            out += [(b + "ffn_gate_inp.weight", (n_expert, width)), (b + "ffn_gate_exps.weight", (n_expert, 512, width)),
                    (b + "ffn_up_exps.weight", (n_expert, 512, width)), (b + "ffn_down_exps.weight", (n_expert, width, 512))]
            if shexp:
                out += [(b + "ffn_gate_inp_shexp.weight", (width,)), (b + "ffn_gate_shexp.weight", (512, width)),
                        (b + "ffn_up_shexp.weight", (512, width)), (b + "ffn_down_shexp.weight", (width, 512))]
        else:
            out += [(b + "ffn_up.weight", (1024, width)), (b + "ffn_down.weight", (width, 512))]
    return out


def test_moe_type_plan_follows_llama_cpp():
    """llama-quant.cpp's MoE rules (checked against llama.cpp's own quantize in the engine tier): 8 experts put
    attn_v and attn_k at Q8_0 and attn_output at Q5_K for the K mixes; the experts' and shared experts' ffn_down take
    their layer from the name (Q4_K_M's "more bits" layers), the router stays F32 and the 1-D shared-expert gate too;
    phi3's fused attn_qkv is an attn_v-like tensor."""
    p = types.plan("Q4_K_M", _names(8, 8), n_head=8, n_head_kv=2, n_expert=8)
    assert {p[f"blk.{i}.attn_v.weight"] for i in range(8)} == {"Q8_0"} == {p[f"blk.{i}.attn_k.weight"] for i in range(8)}
    assert p["blk.3.attn_output.weight"] == "Q5_K" and p["blk.3.attn_q.weight"] == "Q4_K"
    assert p["blk.0.ffn_gate_inp.weight"] == "F32" and p["blk.0.ffn_gate_exps.weight"] == "Q4_K"
    six = [i for i in range(8) if p[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"]
    assert six == [0, 3, 6, 7]  # use_more_bits(i, 8): i < 1, i >= 7, (i - 1) % 3 == 2
    p = types.plan("Q4_K_M", _names(8, 4, shexp=True), n_head=8, n_head_kv=2, n_expert=4)
    assert [i for i in range(8) if p[f"blk.{i}.ffn_down_shexp.weight"] == "Q6_K"] == six
    assert p["blk.0.attn_v.weight"] == "Q6_K" and p["blk.2.attn_v.weight"] == "Q4_K"  # 4 experts: no Q8_0 bump
    assert p["blk.0.ffn_gate_inp_shexp.weight"] == "F32" and p["blk.0.attn_output.weight"] == "Q4_K"
    p = types.plan("Q3_K_M", _names(16, 8), n_head=8, n_head_kv=2, n_expert=8)
    assert p["blk.0.ffn_down_exps.weight"] == "Q5_K" and p["blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert p["blk.1.ffn_up_exps.weight"] == "Q3_K" and p["blk.1.attn_output.weight"] == "Q5_K"
    p = types.plan("Q2_K", _names(2, 4, shexp=True), n_head=8, n_head_kv=2, n_expert=4)
    assert (p["blk.1.ffn_down_exps.weight"], p["blk.1.ffn_down_shexp.weight"], p["blk.1.ffn_up_exps.weight"],
            p["blk.1.attn_output.weight"], p["blk.1.attn_v.weight"]) == ("Q3_K", "Q3_K", "Q2_K", "Q3_K", "Q4_K")
    p = types.plan("Q4_K_M", _names(8, 0, qkv=True), n_head=8, n_head_kv=2)
    assert [p[f"blk.{i}.attn_qkv.weight"] for i in (0, 2, 3)] == ["Q6_K", "Q4_K", "Q6_K"]
    assert types.n_dims((1, 64)) == 1 and types.n_dims((4, 1, 64)) == 3 and types.n_dims((64, 1)) == 2


def _recipe(tmp_path, model, stages, export, name="r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"version": 1, "model": {"path": str(model)}, "stages": stages,
                                    "calibration": {"sources": ["bundled:botchan-calibration"], "nsamples": 2,
                                                    "seqlen": 32},
                                    "eval": {"enabled": False}, "export": {"formats": export}}))
    return path


@pytest.mark.parametrize("family,over,msg", [
    ("gemma2", {"query_pre_attn_scalar": 256}, "query_pre_attn_scalar 256: llama.cpp scales attention by 1/sqrt(16)"),
    ("gemma3_text", {"layer_types": ["full_attention", "full_attention"]}, "llama.cpp's fixed pattern"),
    ("qwen3_moe", {"norm_topk_prob": False}, "llama.cpp's qwen3moe always renormalises"),
    ("qwen2_moe", {"norm_topk_prob": True}, "llama.cpp's qwen2moe never renormalises"),
    ("gemma2", {"tie_word_embeddings": False}, "no output tensor"),
])
def test_plan_refuses_what_llama_cpp_would_compute_otherwise(family, over, msg, tmp_path):
    model = _tiny(family, tmp_path / "m", **over)
    rc, _, err = invoke("run", _recipe(tmp_path, model, [], ["gguf"]), "--dry-run")
    assert rc == 1 and msg in err, err


def test_a_quantize_stage_writes_each_experts_codes(tmp_path):
    """`gguf: Q4_K_M` on RTN rounds each expert (compress's per-expert linears) on llama.cpp's blocks; the file
    stacks their codes byte for byte, and they are llama.cpp's reference rounding of each expert's weights."""
    from gguf import GGUFReader

    from compress.kernels import ggml

    src = _tiny("qwen2_moe", tmp_path / "m", hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                shared_expert_intermediate_size=256)
    path = _recipe(tmp_path, src, [{"stage": "quantize", "method": "rtn", "gguf": "Q4_K_M"}], ["gguf"])
    rc, out, err = invoke("run", path, "--dry-run")
    assert rc == 0 and "export gguf Q4_K_M:" in out, err
    rc, out, err = invoke("run", path, "--output", tmp_path / "o")
    assert rc == 0, err
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    file = {t.name: t for t in GGUFReader(str(tmp_path / "o" / "gguf" / "model-Q4_K_M.gguf")).tensors}
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert '"from_codes": ' in json.dumps(manifest)
    gate_up = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    t = file["blk.1.ffn_up_exps.weight"]
    assert t.tensor_type.name == "Q4_K" and [int(x) for x in t.shape] == [256, 256, 4]
    raw = np.asarray(t.data)
    for e in range(4):
        ref = ggml.pack("Q4_K", ggml.quantize_ref("Q4_K", gate_up[e, 256:].numpy()))
        assert np.array_equal(raw[e], ref.reshape(raw[e].shape)), e


# -- engine tier: llama.cpp itself ------------------------------------------------------------------------

LOGITS = """
import json, sys
import numpy as np
import llama_cpp
req = json.load(open(sys.argv[1]))
llm = llama_cpp.Llama(model_path=req["model"], n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True, n_threads=2,
                      type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False, verbose=False)
llm.eval(req["tokens"])
json.dump({"logits": np.asarray(llm.scores[:len(req["tokens"])]).tolist()}, open(sys.argv[2], "w"))
"""


def _llama_cpp_logits(file, ids, tmp_path):
    from compress.serve.envs import python_of

    (tmp_path / "logits.py").write_text(LOGITS)
    (tmp_path / "req.json").write_text(json.dumps({"model": str(file), "tokens": ids}))
    proc = subprocess.run([str(python_of("llama.cpp")), str(tmp_path / "logits.py"), str(tmp_path / "req.json"),
                           str(tmp_path / "res.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.tensor(json.loads((tmp_path / "res.json").read_text())["logits"])


@pytest.mark.engine
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_computes_what_transformers_does(family, tmp_path):
    """llama.cpp (as vendored by llama-cpp-python 0.3.36) loads compress's F32 file and its logits on 14 tokens are
    transformers' on the source model within 1e-3 of the largest logit (float32 everywhere, KV cache too)."""
    model, file, _ = _write(_tiny(family, tmp_path / "m"), tmp_path / "g")
    a, b = _logits(model), _llama_cpp_logits(file, IDS, tmp_path)
    diff = (a - b).abs().max().item()
    print(family, f"max |dlogit| {diff:.2e}, max |logit| {a.abs().max().item():.3f}", file=sys.stderr)
    assert diff <= 1e-3 * a.abs().max().item()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.engine
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpps_quantize_of_the_f32_file_is_compresss_file(family, tmp_path):
    """256-wide models (the K-quants are real), 4 layers, mixtral with 8 experts (llama-quant.cpp's 8-expert rules):
    llama.cpp's quantize of compress's F32 file to Q4_K_M, Q3_K_M and Q2_K gives every tensor the type `types.plan`
    gives it, and the same bytes as compress's own file of that type."""
    from gguf import GGUFReader

    from compress.serve.engines import llamacpp

    over = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_key_value_heads=1)
    over.update({"gemma2": dict(head_dim=64), "gemma3_text": dict(head_dim=64), "qwen3_moe": dict(head_dim=64),
                 "mixtral": dict(num_local_experts=8),
                 "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=512)}.get(family, {}))
    if family == "qwen3_moe":
        over["moe_intermediate_size"] = 256
    model, f32, _ = _write(_tiny(family, tmp_path / "m", **over), tmp_path / "g")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    for ft in ("Q4_K_M", "Q3_K_M", "Q2_K"):
        llamacpp.quantize(f32, tmp_path / f"lc-{ft}.gguf", ft)
        theirs = {t.name: t for t in GGUFReader(str(tmp_path / f"lc-{ft}.gguf")).tensors}
        _, plan = tensor_plan(model, ft)
        assert {k: t.tensor_type.name for k, t in theirs.items()} == plan, ft
        res = export_gguf(model, {}, tok, tmp_path / "c", file_type=ft)
        ours = {t.name: t for t in GGUFReader(str(tmp_path / "c" / res["file"])).tensors}
        for name, t in theirs.items():
            assert np.array_equal(np.asarray(ours[name].data), np.asarray(t.data)), (ft, name)
