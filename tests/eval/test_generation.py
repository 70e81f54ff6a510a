"""Greedy-continuation agreement (eval/generation.py) on stories260K."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MODELS, TEXT
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.errors import BadInput
from compress.eval.data import read_text, token_stream
from compress.eval.generation import (
    common_prefix,
    compare_generation,
    greedy,
    prompts_from,
)
from compress.primitives import rtn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def stories():
    path = MODELS / "stories260K"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = token_stream(tok, read_text(TEXT / "tinystories" / "tinystories_val.txt")[-20_000:])
    return model, tok, ids


def test_common_prefix():
    a = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [9, 2, 3, 4]])
    b = torch.tensor([[1, 2, 3, 4], [1, 2, 0, 4], [1, 2, 3, 4]])
    assert common_prefix(a, b).tolist() == [4, 2, 0]


def test_prompts_are_evenly_spaced_with_bos():
    ids = torch.arange(100, 200)
    p = prompts_from(ids, 3, 5, bos_id=1)
    assert p.tolist() == [[1, 100, 101, 102, 103], [1, 148, 149, 150, 151], [1, 196, 197, 198, 199]]
    assert prompts_from(ids, 2, 4).tolist() == [[100, 101, 102, 103], [196, 197, 198, 199]]
    with pytest.raises(BadInput, match="need at least 9 tokens"):
        prompts_from(ids[:5], 2, 10, bos_id=1)


def test_greedy_with_cache_equals_full_recompute(stories):
    model, tok, ids = stories
    p = prompts_from(ids, 3, 16, tok.bos_token_id)
    cont = greedy(model, p, 12)
    seq = p
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cont, seq[:, 16:])


def test_identical_models_agree_completely(stories):
    model, tok, ids = stories
    r = compare_generation(model, model, ids, prompts=4, prompt_tokens=16, new_tokens=20, bos_id=tok.bos_token_id)
    assert r["gen_prefix"] == 20 and r["gen_agree"] == 1.0 and r["gen_top1"] == 1.0 and abs(r["gen_kl"]) < 1e-9


def test_coarser_quantization_diverges_sooner(stories):
    """W2 RTN continuations leave FP's sooner and further than W4 RTN's."""
    model, tok, ids = stories

    def quantized(bits):
        q = copy.deepcopy(model)
        with torch.no_grad():
            for layer in q.model.layers:
                for lin in [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]:
                    lin.weight.copy_(rtn(lin.weight.data, bits, 32, False).dequantize())
        return q

    kw = dict(prompts=8, prompt_tokens=16, new_tokens=48, bos_id=tok.bos_token_id)
    w4, w2 = (compare_generation(model, quantized(b), ids, **kw) for b in (4, 2))
    assert w2["gen_prefix"] < w4["gen_prefix"] < 48
    assert w2["gen_kl"] > w4["gen_kl"] > 0 and w2["gen_top1"] < w4["gen_top1"] < 1
    assert 0 <= w2["gen_agree"] < w4["gen_agree"] <= 1
