"""rotate/walsh: exact in full precision (float64) on tiny llama/qwen2/qwen3/MoE models and the real
checkpoints, broken when a reader of the rotated stream is left out, exportable after quantization."""

from __future__ import annotations

import pytest
import torch
from helpers import check_reload, in_blocks, quantize_model
from pydantic import ValidationError
from tiny import tiny_llama
from transformers import AutoModelForCausalLM

from compress.errors import BadInput as BadInputErr
from compress.export.hf import export_hf
from compress.models.adapters import ModelAdapter
from compress.rotation import scaling
from compress.rotation.walsh import WalshConfig
from tests.conftest import MODELS
from tests.rotating import (
    CONFIGS,
    exact_rmsnorm,
    ids,
    plain_rmsnorm,
    recipe_of,
    rel,
    rotate,
)
from tests.tiny import tiny_causal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen2_moe", "mixtral"])
def test_tiny_models_are_invariant_in_float64(model_type, name):
    model = exact_rmsnorm(tiny_causal(model_type, dtype=torch.float64))
    ModelAdapter(model)  # per-expert linears (exact) before the reference: fused experts refuse float64
    x = ids(128)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    qk_norm = model_type == "qwen3"
    if CONFIGS[name].get("pair_pca") and qk_norm or CONFIGS[name].get("head_pca") and not qk_norm:
        from compress.errors import BadInput

        with pytest.raises(BadInput, match="q_norm"):
            rotate(model, 128, **CONFIGS[name])
        return
    with torch.no_grad():
        before = model(x).logits
        metrics = rotate(model, 128, **CONFIGS[name])
        after = model(x).logits
    assert rel(after, before) < 1e-10
    if CONFIGS[name].get("pair_pca"):
        assert metrics["pair_pca_layers"] == 2
    if CONFIGS[name].get("head_pca"):
        assert metrics["head_pca_layers"] == 2
        assert type(model.model.layers[0].self_attn.q_norm).__name__ == "MatrixGammaRMSNorm"
    now = model.state_dict()
    assert set(now) != set(state) or any(not torch.equal(now[k], v) for k, v in state.items())  # it did something
    if name.startswith("spectral"):  # every quantizable linear, but attention stays plain under q_norm (Qwen3)
        per_block = {"qwen2_moe": 4 + 3 * 5, "mixtral": 4 + 3 * 4}.get(model_type, 7) - 4 * (model_type == "qwen3")
        assert metrics["spectral_linears"] == 2 * per_block
    elif CONFIGS[name].get("mode") != "none":
        n_up = {"qwen2_moe": 2 * 5, "mixtral": 2 * 4}.get(model_type, 2)  # experts (+ shared expert) per block
        assert metrics["norm"] == 4 and metrics["v_o"] == 2 and metrics["up_down"] == n_up
    if CONFIGS[name].get("alpha") == "auto":  # one pick per scale vector
        scaled = metrics.get("spectral_linears") or metrics["norm"] + metrics["v_o"] + metrics["up_down"]
        assert sum(metrics["alpha_picked"].values()) == scaled


@pytest.mark.parametrize("model_type,cfg", [("llama", "fused"), ("qwen3", "fused"), ("qwen2_moe", "fused"),
                                            ("llama", "pair_pca"), ("qwen3", "head_pca")])
def test_transformers_norms_within_1e6(model_type, cfg):
    """The same with transformers' own (float32-internal) RMSNorm: the requirement is 1e-6 relative."""
    model = tiny_causal(model_type, dtype=torch.float64)
    ModelAdapter(model)
    x = ids(128)
    with torch.no_grad():
        before = model(x).logits
        rotate(model, 128, **CONFIGS[cfg])
        assert rel(model(x).logits, before) < 1e-6


@pytest.mark.parametrize("fused", [True, False])
def test_leaving_out_the_router_breaks_moe_invariance(monkeypatch, fused):
    """The router reads the rotated/scaled stream too; skipping it must be caught by the logits check."""
    model = exact_rmsnorm(tiny_causal("qwen2_moe", dtype=torch.float64))
    ModelAdapter(model)
    x = ids(128)
    with torch.no_grad():
        before = model(x).logits
    original = ModelAdapter.norm_readers

    def without_router(self, i, role):
        return [m for m in original(self, i, role) if m is not self.router(i)]

    monkeypatch.setattr(ModelAdapter, "norm_readers", without_router)
    with torch.no_grad():
        rotate(model, 128, fused=fused)
        assert rel(model(x).logits, before) > 1e-3


def test_tied_embeddings_are_untied_when_fused():
    model = exact_rmsnorm(tiny_llama(tie_word_embeddings=True).double())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    x = ids(128)
    with torch.no_grad():
        before = model(x).logits
        metrics = rotate(model, 128)
        assert rel(model(x).logits, before) < 1e-10
    assert metrics["untied_embeddings"] and model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["stories260K", "stories-llama-1m", "ref-llama-7m"])
@pytest.mark.parametrize("cfg", ["fused", "no_rotation-wht", "spectral", "pair_pca"])
def test_real_models_are_invariant_in_float64(name, cfg):
    model = AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float64).eval()
    vocab = model.config.vocab_size
    x = ids(vocab, 64)
    with torch.no_grad():
        before = model(x).logits
        before_exact = exact_rmsnorm(model)(x).logits
        plain_rmsnorm(model)
        metrics = rotate(model, vocab, **CONFIGS[cfg])
        after = model(x).logits
        after_exact = exact_rmsnorm(model)(x).logits
    assert rel(after, before) < 1e-6  # transformers' RMSNorm (float32 inside)
    assert rel(after_exact, before_exact) < 1e-10
    assert metrics["untied_embeddings"] == (cfg == "fused" and name == "stories260K")


def test_scales_formula():
    s = scaling.scales(torch.ones(8, dtype=torch.float64), 0.5)
    torch.testing.assert_close(s, torch.full((8,), 2**0.5, dtype=torch.float64))  # uniform energy -> sqrt(2)
    e = torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(scaling.scales(e, 1.0), torch.tensor([4.0, 2.0, 1.0, 1.0], dtype=torch.float64))


def _rtn_error(W, s, a, bits=2, group=16):
    """sum_k a_k / s_k^2 ||(W s - RTN(W s))[:, k]||^2, written out independently of scaling.Scaler."""
    from compress.primitives import rtn

    Ws = W * s
    return float((((Ws - rtn(Ws.float(), bits, group, False).dequantize(torch.float32).double()) / s) ** 2 * a).sum())


def test_auto_alpha_picks_the_grid_alpha_with_the_least_weighted_rounding_error():
    g = torch.Generator().manual_seed(0)
    grid = (0.0, 0.25, 0.5, 1.0)
    scaler = scaling.Scaler("auto", grid, (2, 16, False))
    picks = []
    for case in range(6):
        W = torch.randn(24, 32, generator=g, dtype=torch.float64)
        e = torch.rand(32, generator=g, dtype=torch.float64) + 0.05
        e[case] = 40.0  # one loud input coordinate
        # the loud coordinate is real (actual = e), or only in the basis the scale is computed in (actual flat)
        actual = e if case % 2 == 0 else torch.ones(32, dtype=torch.float64)
        s = scaler(e, [W], actual)
        errors = {a: _rtn_error(W, scaling.scales(e, a), actual) for a in grid}
        best = min(errors, key=errors.get)
        assert scaler.picked[-1] == best
        torch.testing.assert_close(s, scaling.scales(e, best))
        picks.append(best)
    assert any(p > 0 for p in picks[0::2]), picks  # a loud real coordinate is worth boosting
    assert all(p == 0.0 for p in picks[1::2]), picks  # boosting a coordinate the reader does not see only costs
    assert scaler.summary()["alpha_picked"] == {str(a): picks.count(a) for a in grid}
    fixed = scaling.Scaler(0.5)
    torch.testing.assert_close(fixed(e, [W]), scaling.scales(e, 0.5))
    assert fixed.summary() == {}


def test_auto_alpha_needs_a_quantize_stage_after_the_rotation():
    from compress.bind import bind
    from compress.quantize.rtn import RTNConfig

    llama = ModelAdapter(tiny_causal("llama"))
    cfg = WalshConfig(alpha="auto")
    with pytest.raises(BadInputErr, match="alpha: auto.*quantize"):
        bind(recipe_of([cfg]), llama)
    binding = bind(recipe_of([cfg, RTNConfig(bits=3, group_size=32, sym=True)]), llama)
    assert binding.stages[0].facts.rounding == (3, 32, True)
    with pytest.raises(ValidationError):
        WalshConfig(alpha="best")
    with pytest.raises(ValidationError):
        WalshConfig(alpha="auto", alpha_grid=[])


def test_config_validation():
    with pytest.raises(ValidationError, match="choose one"):
        WalshConfig(pair_pca=True, head_pca=True)
    with pytest.raises(ValidationError, match="pair_pca"):
        WalshConfig(fused=False, mode="spectral", pair_pca=True)
    qwen3 = ModelAdapter(tiny_causal("qwen3"))
    from compress.bind import bind

    with pytest.raises(BadInputErr, match="head_pca.*export"):
        bind(recipe_of([WalshConfig(head_pca=True)], ["hf"]), qwen3)
    bind(recipe_of([WalshConfig(head_pca=True)]), qwen3)
    with pytest.raises(ValidationError, match="influence_basis"):
        WalshConfig(fused=True, influence_basis="wht")
    with pytest.raises(ValidationError, match="changes nothing"):
        WalshConfig(fused=False, mode="none")
    with pytest.raises(ValidationError, match="fused: false"):
        WalshConfig(mode="spectral")
    with pytest.raises(ValidationError, match="fused: false"):
        WalshConfig(fused=False, mode="spectral", influence_basis="channel")
    with pytest.raises(ValidationError):
        WalshConfig(mode="spectral_pca")
    with pytest.raises(ValidationError):
        WalshConfig(alpha=0.5, extra=1)
    assert WalshConfig().basis == "channel" and WalshConfig(fused=False).basis == "wht"


def test_unsupported_hidden_size_is_refused_before_changing_anything():
    from compress.errors import BadInput

    model = tiny_llama()
    model.config.hidden_size = 3 * 172  # what check() reads
    w = model.model.embed_tokens.weight.clone()
    with pytest.raises(BadInput, match="516"):
        rotate(model, 128)
    assert torch.equal(model.model.embed_tokens.weight, w)


@pytest.mark.parametrize("tied", [True, False])
def test_rotated_quantized_model_exports_and_reloads(tmp_path, tied):
    """The fused result is a plain Llama: the existing hf export packs it and transformers reloads it with
    the in-memory quantized model's logits (check_reload compares them three ways)."""
    model = tiny_llama(tie_word_embeddings=tied)
    with torch.no_grad():
        rotate(model, 128)
    qweights = quantize_model(model, in_blocks((2, 32, False)))
    out = tmp_path / "ckpt"
    export_hf(model, qweights, None, out)
    config, back, loaded = check_reload(model, qweights, out, 128)
    assert set(back) == set(qweights) and config["tie_word_embeddings"] is False
    norm = loaded.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm.float(), torch.ones_like(norm.float()))  # energy scales live in the norms


def test_rotate_after_quantize_is_refused(tmp_path):
    from tests.conftest import REPO, invoke

    rc, _, err = invoke("run", REPO / "recipes" / "w2-walsh-fused-autoround.yaml", "--model", MODELS / "stories260K",
                        "--output", tmp_path / "o", "--set", "stages.0={stage: quantize, method: rtn, bits: 4, group_size: 32}",
                        "--set", "stages.1={stage: rotate, method: walsh}")
    assert rc != 0 and "rotations must run before quantization" in err


def test_resume_reapplies_the_rotation(tmp_path):
    """A finished rotate stage is re-applied on resume (the model is reloaded), so the resumed run
    re-applies the quantize checkpoints to the same rotated weights and exports the same bytes."""
    import json

    from helpers import tensor_hashes

    from tests.conftest import REPO, invoke

    args = ["run", REPO / "recipes" / "w2-walsh-fused-autoround.yaml", "--model", MODELS / "stories-llama-1m",
            "--output", tmp_path / "o", "--json", "--set", "calibration.nsamples=4", "--set", "calibration.seqlen=32",
            "--set", "stages.1.iters=2", "--set", "eval.enabled=false"]
    rc, stdout, err = invoke(*args)
    assert rc == 0, err
    first = tensor_hashes(tmp_path / "o")
    rc, stdout, err = invoke(*args, "--resume")
    assert rc == 0, err
    assert [s["resumed"] for s in json.loads(stdout)["stages"] if "resumed" in s] == [True, True]
    assert tensor_hashes(tmp_path / "o") == first


def test_size_report_compares_against_the_model_as_loaded(tmp_path):
    """A fused rotation unties stories260K's head: the untied copy is a cost of the result (packed
    bytes), not part of the full-precision baseline."""
    import json

    from tests.conftest import REPO, invoke

    fp = AutoModelForCausalLM.from_pretrained(MODELS / "stories260K")
    fp_bytes = sum(p.numel() * p.element_size() for p in fp.parameters())
    head = fp.lm_head.weight
    rc, stdout, err = invoke("run", REPO / "recipes" / "w2-walsh-fused-autoround.yaml", "--model", MODELS / "stories260K",
                             "--output", tmp_path / "o", "--json", "--set", "calibration.nsamples=4",
                             "--set", "calibration.seqlen=32", "--set", "eval.enabled=false", "--set", "export.formats=[]",
                             "--set", "stages.1={stage: quantize, method: rtn, bits: 4, group_size: 32}")
    assert rc == 0, err
    size = json.loads(stdout)["size"]
    assert size["fp_bytes"] == fp_bytes
    replaced = sum(m.weight.numel() * 4 for n, m in fp.named_modules() if n.startswith("model.layers.")
                   and isinstance(m, torch.nn.Linear))
    qbytes = -(-size["effective_bits"] * size["quantized_params"] // 8)
    assert abs(size["packed_bytes"] - (fp_bytes + head.numel() * 4 - replaced + qbytes)) <= 4  # effective_bits is rounded


@pytest.mark.parametrize("name", [pytest.param("stories260K", marks=pytest.mark.slow),
                                  pytest.param("stories-llama-1m", marks=pytest.mark.slow)])
def test_fused_rotated_quantized_model_runs_in_onnxruntime_and_openvino(name, tmp_path):
    """The fused variant is an ordinary Llama at full compression: the ONNX (MatMulNBits) and OpenVINO
    (compressed constants) exports of the rotated, quantized model reproduce its logits."""
    from helpers import load, op_types, ort_logits, quantized, rel_err, run_ir

    from compress.export.onnx import export_onnx
    from compress.export.openvino import export_openvino

    model = load(name)
    with torch.no_grad():
        rotate(model, model.config.vocab_size, fused=True)
    qweights = quantized(model, 4, 32, False)
    ids_ = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids_).logits.numpy()
    onnx_res = export_onnx(model, qweights, tmp_path / "onnx")
    assert onnx_res["dense_layers"] == 0 and op_types(onnx_res["path"])["MatMulNBits"] == len(qweights)
    assert rel_err(ort_logits(onnx_res["path"], ids_), ref) < 1e-3
    ov_res = export_openvino(model, qweights, tmp_path / "ov", onnx_path=onnx_res["path"])
    out, fc = run_ir(ov_res["path"], ids_)
    assert fc.get("u4", 0) >= 6 * model.config.num_hidden_layers and rel_err(out, ref) < 1e-3


def test_pair_pca_decorrelates_each_rope_plane_and_a_reflection_would_break_rope():
    """After pair-PCA the k outputs of every RoPE plane are uncorrelated on the calibration tokens; the
    same transform with one plane reflected (det -1) changes the logits, which is why det is forced to +1."""
    from compress.calibration import collect_moments, head_covariance

    model = exact_rmsnorm(tiny_causal("qwen2", dtype=torch.float64))  # GQA and q/k biases
    adapter = ModelAdapter(model)
    heads, kv, hd = adapter.attention_shape()
    x = ids(128)
    with torch.no_grad():
        before = model(x).logits
        rotate(model, 128, fused=False, mode="none", pair_pca=True)
        assert rel(model(x).logits, before) < 1e-10
        tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))  # rotate()'s tokens
        cov = collect_moments(model, tokens, {0: (adapter.role(0, "k"), "output")}, head_covariance(kv))[0]
        c = torch.arange(hd // 2)
        aa, bb, ab = cov[:, c, c], cov[:, c + hd // 2, c + hd // 2], cov[:, c, c + hd // 2]
        assert (ab.abs() <= 1e-9 * (aa + bb)).all()  # E[ab] = 0 in every plane: principal axes
        assert (aa >= bb - 1e-12).all()  # principal axis first
        for m in (adapter.role(0, "k"), adapter.role(0, "q")):  # reflect plane 0 of every q and k head alike
            rows = torch.arange(m.weight.shape[0] // hd) * hd + hd // 2
            m.weight[rows] *= -1
            m.bias[rows] *= -1
        assert rel(model(x).logits, before) > 1e-6  # F R(t) = R(-t) F: q.k after RoPE changes


def test_the_figure_passes_show_progress(tmp_path):
    """The two calibration passes of the energy figure are not a silent wait: each has its progress bar."""
    from tests.conftest import REPO, invoke

    rc, _, err = invoke("run", REPO / "recipes" / "w2-walsh-fused-autoround.yaml", "--model", MODELS / "stories260K",
                        "--output", tmp_path / "o", "--set", "calibration.nsamples=4", "--set",
                        "calibration.seqlen=32", "--set", "stages.1.iters=1", "--set", "eval.enabled=false")
    assert rc == 0, err
    for when in ("before", "after"):
        assert f"energy {when} rotation (report figure)" in err and "batch" in err, err
