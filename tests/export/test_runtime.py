"""Exported checkpoints on our kernels: `load_packed` (QuantLinear on every packed layer) reproduces the
in-memory quantized model, and `compress eval --backend` / `compress generate` run on an export."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MODELS, TEXT, invoke
from helpers import quantized
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.export.hf import export_hf, loadable
from compress.export.runtime import load_packed
from compress.kernels import cpu
from compress.kernels.backends import QuantLinear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

STORIES = MODELS / "stories260K"
VAL = TEXT / "tinystories" / "tinystories_val.txt"


def export(tmp_path, bits, group, sym):
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    qweights = quantized(model, bits, group, sym)  # W <- W_hat in the model
    out = tmp_path / f"w{bits}"
    export_hf(model, qweights, AutoTokenizer.from_pretrained(STORIES), out, dtype="float32")  # exact comparisons
    return model, qweights, out


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    return export(tmp_path_factory.mktemp("rt"), 4, 32, True)


@pytest.mark.parametrize("bits,sym", [(4, True), (2, False)])
@pytest.mark.parametrize("backend,tol", [("cpu", 1e-5), ("reference", 1e-5), ("cpu-a8", 5e-2)])
def test_quant_linear_model_matches_dequantized_model(tmp_path, bits, sym, backend, tol):
    model, qweights, out = export(tmp_path, bits, 32, sym)
    loaded, info = load_packed(out, backend)
    # stories260K's MLP (172 channels) does not fit auto-round's kernels: written dense by the hf export
    packed = {n for n, qw in qweights.items() if loadable(qw)}
    assert info["quantized_layers"] == len(packed) == 5 * 4
    assert {n for n, m in loaded.named_modules() if isinstance(m, QuantLinear)} == packed
    assert info["backend"] == {backend: len(packed)}
    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = model(ids).logits, loaded(ids).logits
    err = ((got - ref).abs().max() / (ref.max() - ref.min())).item()
    assert err < tol, err
    if backend == "cpu-a8":  # int8 activations: close, not exact
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_eval_backends_agree_on_an_export(w4, monkeypatch):
    """Also: windows go through the prefill path (dequantize, BLAS), and stderr says which backend runs and
    shows the progress bar with tokens/s, with --json too."""
    _, _, out = w4
    ppl, prefill = {}, []
    real = cpu.matmul_dequant
    monkeypatch.setattr(cpu, "matmul_dequant", lambda x, *a, **k: prefill.append(x.shape) or real(x, *a, **k))
    for backend in ("cpu", "reference", "transformers"):
        rc, stdout, err = invoke("eval", out, "--data", VAL, "--max-tokens", 512, "--backend", backend, "--json")
        assert rc == 0, err
        ppl[backend] = json.loads(stdout)[VAL.name]["ppl"]
        assert "tok/s" in err and "ppl" in err
        if backend == "cpu":
            assert "backend: cpu (20 of 20 packed layers)" in err
            assert prefill and all(s[0] * s[1] >= 256 for s in prefill)  # batches of 256-token windows
    assert ppl["cpu"] == pytest.approx(ppl["reference"], rel=1e-5)
    assert ppl["transformers"] == pytest.approx(ppl["reference"], rel=1e-2)  # auto-round: fp16 norms/embeddings
    rc, stdout, err = invoke("eval", out, "--data", "bundled:botchan-eval", "--max-tokens", 256, "--json")
    assert rc == 0 and json.loads(stdout)["botchan-eval.txt"]["ppl"] > 1, err  # the text shipped with compress
    rc, _, err = invoke("eval", out, "--data", VAL, "--backend", "gpu")
    assert rc == 1 and "unknown --backend `gpu`" in err


def test_generate_known_answer_and_speed(w4):
    """stories260K's documented greedy story (shared/data/README.md), then the same from an export."""
    rc, stdout, err = invoke("generate", STORIES, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--json")
    assert rc == 0, err
    res = json.loads(stdout)
    assert res["continuation"].startswith(", there was a little girl named Lily")
    assert res["backend"] == {} and res["tokens_per_s"] > 0 and res["new_tokens"] == 12
    _, _, out = w4
    texts = {}
    for backend in ("cpu", "reference"):
        rc, stdout, err = invoke("generate", out, "--prompt", "Once upon a time", "--max-new-tokens", 16,
                                 "--backend", backend, "--json")
        assert rc == 0, err
        res = json.loads(stdout)
        assert res["backend"] == {backend: 20} and res["tokens_per_s"] > 0 and res["prefill_s"] > 0
        texts[backend] = res["continuation"]
    assert texts["cpu"] == texts["reference"] and len(texts["cpu"]) > 10
    rc, stdout, err = invoke("generate", out, "--prompt", "Once upon a time", "--max-new-tokens", 4)
    assert rc == 0 and stdout.startswith("Once upon a time") and "tokens/s" in err and "backend {'cpu': 20}" in err
    assert "backend: cpu (20 of 20 packed layers)" in err and "generate" in err and "tok/s" in err
