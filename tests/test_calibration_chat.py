"""Calibration for instruction models: chat JSONL rendered with the chat template, weighted sources, and the
tokens each source gave (docs/recipes.md#calibration)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CAL, STORIES260K, invoke
from transformers import AutoTokenizer

from compress.calibration import _shares, calibration_tokens, read_document, render
from compress.errors import BadInput
from compress.eval.data import token_stream

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}")


def _chat(path, n=60):
    lines = [x for x in CAL.read_text().split("\n") if len(x) > 40]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": lines[2 * i]},
                                             {"role": "assistant", "content": lines[2 * i + 1]}]}) + "\n")
    return path


@pytest.fixture
def tok():
    return AutoTokenizer.from_pretrained(STORIES260K)


def test_conversations_use_the_chat_template_or_plain_lines(tok, tmp_path):
    doc = read_document(str(_chat(tmp_path / "c.jsonl", 3)))
    assert doc.kind == "chat" and len(doc.conversations) == 3
    assert render(doc, tok).startswith("user: ")  # this tokenizer has no template: `role: content` lines
    tok.chat_template = TEMPLATE
    text = render(doc, tok)
    assert text == "".join(tok.apply_chat_template(c, tokenize=False) for c in doc.conversations)
    assert text.startswith("<|user|>\n") and text.count("<|assistant|>") == 3


def test_a_plain_jsonl_stays_text_and_a_bad_conversation_names_its_line(tmp_path):
    plain = tmp_path / "p.jsonl"
    plain.write_text(json.dumps({"text": "once upon a time"}) + "\n")
    assert read_document(str(plain)).kind == "text"
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                   + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(BadInput, match=r"b\.jsonl:2: expected an object whose 'messages'"):
        read_document(str(bad))


@pytest.mark.parametrize("weights,n,expect", [([3, 1], 8, [6, 2]), ([1, 1, 1], 10, [4, 3, 3]), ([0, 1], 5, [0, 5]),
                                              ([0.5, 0.25, 0.25], 3, [1, 1, 1])])
def test_windows_split_by_largest_remainders(weights, n, expect):
    assert _shares(weights, n).tolist() == expect


def test_weighted_sources_draw_their_windows_from_their_own_text(tok, tmp_path):
    tok.chat_template = TEMPLATE
    chat = str(_chat(tmp_path / "c.jsonl"))
    tokens, info = calibration_tokens(tok, [chat, str(CAL)], nsamples=8, seqlen=32, seed=0, weights=[3, 1])
    assert tokens.shape == (8, 32)
    assert [info[s]["windows"] for s in (chat, str(CAL))] == [6, 2]
    assert info[chat]["format"] == "chat" and info[chat]["conversations"] == 60 and info[chat]["chat_template"]
    assert info[str(CAL)]["calibration_tokens"] == 64
    streams = [token_stream(tok, render(read_document(p), tok)) for p in (chat, str(CAL))]

    def within(row, stream):  # the window is a run of the stream's tokens
        return bool((stream.unfold(0, row.numel(), 1) == row).all(1).any())
    assert all(within(r, streams[0]) for r in tokens[:6]) and all(within(r, streams[1]) for r in tokens[6:])
    again, _ = calibration_tokens(tok, [chat, str(CAL)], nsamples=8, seqlen=32, seed=0, weights=[3, 1])
    assert torch.equal(tokens, again)
    # without weights: one stream, windows counted by the source they start in
    _, info = calibration_tokens(tok, [chat, str(CAL)], nsamples=16, seqlen=32, seed=0)
    assert sum(v["windows"] for v in info.values()) == 16


def _recipe(tmp_path, cal: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(f"""version: 1
model: {{path: {STORIES260K}}}
calibration:
{cal}
  nsamples: 4
  seqlen: 32
stages:
  - {{stage: quantize, method: gptq, bits: 4, group_size: 32}}
eval: {{enabled: false}}
export: {{formats: [hf]}}
""")
    return path


def test_a_run_reports_the_tokens_each_source_gave(tmp_path):
    chat = _chat(tmp_path / "c.jsonl")
    r = _recipe(tmp_path, f"  sources: [{chat}, {CAL}]\n  weights: [1, 1]")
    rc, stdout, err = invoke("run", r, "--output", tmp_path / "o", "--json")
    assert rc == 0, err
    cal = json.loads(stdout)["calibration"]
    assert cal[str(chat)]["windows"] == 2 and cal[str(chat)]["format"] == "chat" and cal[str(CAL)]["windows"] == 2
    assert "## Calibration" in (tmp_path / "o" / "report.md").read_text()


def test_bad_calibration_settings_fail_at_plan_time(tmp_path):
    chat = _chat(tmp_path / "c.jsonl")
    rc, _, err = invoke("run", _recipe(tmp_path, f"  sources: [{chat}, {CAL}]\n  weights: [1]"), "--output",
                        tmp_path / "o", "--dry-run")
    assert rc == 1 and "`weights` has 1 entries for 2 sources" in err, err
    with open(chat, "a") as f:
        f.write(json.dumps({"messages": "not a list"}) + "\n")
    rc, _, err = invoke("run", _recipe(tmp_path, f"  sources: [{chat}]"), "--output", tmp_path / "o", "--dry-run")
    assert rc == 1 and "c.jsonl:61" in err, err
