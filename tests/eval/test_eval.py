"""Tests for compress.eval: data reading, LM metrics on stories260K, encoder fidelity and probes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from compress.errors import BadInput
from compress.eval.data import read_labeled_tsv, read_text, text_slice, token_stream
from compress.eval.encoder import (
    compare_encoder,
    cosine_fidelity,
    embed,
    embed_batch,
    mean_pool,
    train_probe,
)
from compress.eval.metrics import (
    compare_lm,
    mean_kl,
    perplexity,
    top1_agreement,
    windows,
)
from compress.models.minilm import ensure_minilm

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
STORIES = DATA / "models" / "stories260K"
TINYSTORIES = DATA / "text" / "tinystories" / "tinystories_val.txt"
SST2_DEV = DATA / "text" / "sst2" / "dev.tsv"

needs_data = pytest.mark.usefixtures("data_dir")  # fails, naming the path, when shared/data is missing


# --- data ------------------------------------------------------------------------------------


def test_read_text_normalises_crlf(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes("first line\r\nsecond – ünïcode\r\n".encode())
    assert read_text(path) == "first line\nsecond – ünïcode\n"


@pytest.mark.parametrize("content", [b"", b"  \n\r\n"])
def test_read_text_rejects_empty_file(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(BadInput, match="empty"):
        read_text(path)


def test_read_text_rejects_missing_and_non_utf8(tmp_path):
    with pytest.raises(BadInput, match="not found"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(BadInput, match="UTF-8"):
        read_text(tmp_path / "latin1.txt")


def test_read_text_jsonl_and_tsv(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one", "id": 1}\r\n\n{"text": "two"}\n')
    assert read_text(tmp_path / "a.jsonl") == "one\n\ntwo"
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    assert read_text(tmp_path / "b.jsonl", field="body") == "x"
    with pytest.raises(BadInput, match="b.jsonl:1"):
        read_text(tmp_path / "b.jsonl")
    (tmp_path / "c.tsv").write_text('sentence\tlabel\nhe said "hi\t1\nbye\t0\n')
    assert read_text(tmp_path / "c.tsv") == 'he said "hi\nbye'


@needs_data
def test_read_labeled_tsv_sst2_and_ag_news():
    sentences, labels = read_labeled_tsv(SST2_DEV)
    assert len(sentences) == 872 and sum(labels) == 444 and set(labels) == {0, 1}
    assert sentences[0].startswith("it 's a charming")
    sentences, labels = read_labeled_tsv(DATA / "text" / "ag_news" / "test.tsv")
    assert len(sentences) == 7600
    assert [labels.count(c) for c in range(4)] == [1900] * 4


def test_text_slice_cuts_at_whitespace():
    text = "alpha beta gamma delta epsilon"
    assert text_slice(text, 0.0, 1.0) == text
    assert text_slice(text, 0.3, 0.7) == "gamma delta"  # 0.3 lands inside "beta", 0.7 inside "delta"
    parts = [text_slice(text, a / 4, (a + 1) / 4) for a in range(4)]
    assert " ".join(p for p in parts if p).split() == text.split()
    with pytest.raises(BadInput):
        text_slice(text, 0.5, 0.5)


@needs_data
def test_token_stream_equals_whole_text_encoding():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    text = read_text(TINYSTORIES)
    ids = token_stream(tok, text)
    assert ids.dtype == torch.long and ids.numel() == 393_018  # the README's token count
    assert torch.equal(ids, torch.tensor(tok(text, add_special_tokens=False)["input_ids"]))
    # A regex byte-level BPE (end-of-string whitespace rule) with many small chunks.
    tok7m = AutoTokenizer.from_pretrained(DATA / "models" / "ref-llama-7m")
    sst = read_text(SST2_DEV)
    expected = torch.tensor(tok7m(sst, add_special_tokens=False)["input_ids"])
    assert torch.equal(token_stream(tok7m, sst, chunk_chars=300), expected)


# --- LM metrics ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    return model, token_stream(tok, read_text(TINYSTORIES))


@pytest.fixture(scope="module")
def perturbed(stories):
    model = copy.deepcopy(stories[0])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    return model


@needs_data
def test_stories260k_perplexity_matches_readme(stories):
    model, ids = stories
    # Every 16th of the README's 511-token windows (49 windows, 25k tokens), spread over the file:
    # the first 20k tokens alone give 4.27 (the file's perplexity varies a lot along it).
    sample = ids[: len(ids) // 511 * 511].view(-1, 511)[::16].reshape(-1)
    ppl = perplexity(model, sample, window=511, bos_id=1, batch_size=8)
    assert ppl == pytest.approx(5.322, rel=0.10)


@needs_data
def test_compare_lm_with_itself(stories):
    model, ids = stories
    out = compare_lm(model, model, ids, window=511, bos_id=1, max_tokens=3000)
    assert out["kl"] == pytest.approx(0.0, abs=1e-9)
    assert out["top1"] == 1.0 and out["ppl_ratio"] == 1.0
    assert out["tokens"] == 3000  # with BOS every token is a target
    assert out["fp_ppl"] == pytest.approx(perplexity(model, ids, window=511, bos_id=1, max_tokens=3000))


@needs_data
def test_compare_lm_with_perturbed_copy(stories, perturbed):
    model, ids = stories
    out = compare_lm(model, perturbed, ids, window=128, bos_id=1, max_tokens=3000)
    assert out["kl"] > 1e-4 and out["top1"] < 1.0 and out["ppl_ratio"] > 1.0
    assert out["ppl"] == pytest.approx(perplexity(perturbed, ids, window=128, bos_id=1, max_tokens=3000))
    one = compare_lm(model, perturbed, ids, window=128, bos_id=1, max_tokens=3000, batch_size=1)
    for key in ("fp_ppl", "ppl", "kl", "top1"):
        assert one[key] == pytest.approx(out[key], rel=1e-4), key


@needs_data
def test_kl_and_top1_helpers(stories, perturbed):
    model, ids = stories
    x = torch.cat([torch.tensor([1]), ids[:200]]).unsqueeze(0)
    with torch.no_grad():
        fp, q = model(x).logits, perturbed(x).logits
    p = fp.double().softmax(-1)
    manual = (p * (p.log() - q.double().log_softmax(-1))).sum(-1).mean()
    assert mean_kl(fp, q) == pytest.approx(float(manual), rel=1e-9)
    assert mean_kl(fp, fp) == 0.0 and top1_agreement(fp, fp) == 1.0
    assert 0.5 < top1_agreement(fp, q) < 1.0


@pytest.mark.parametrize("n,window,stride,bos,expected", [
    (1000, 64, 16, None, 999),   # overlapping, no BOS: every token but the first, once
    (1000, 64, 16, 1, 1000),     # overlapping, BOS: every token once
    (1000, 64, 64, None, 1000 - 16),  # non-overlapping, no BOS: 16 windows lose their first token
    (1000, 64, 64, 1, 1000),
    (1000, 64, 1, None, 999),
    (50, 64, 16, None, 49),      # stream shorter than one window
])
def test_windows_score_each_target_exactly_once(n, window, stride, bos, expected):
    ids = torch.arange(n) + 10
    seen = []
    for w in windows(ids, window=window, stride=stride, bos_id=bos):
        assert len(w.inputs) <= window + (bos is not None)
        seen.extend((w.targets - 10).tolist())
        if stride < window and w.first > 0:  # a later window scores only its last `stride` targets
            assert len(w.targets) <= stride
    assert len(seen) == len(set(seen)) == expected
    assert seen == sorted(seen) and seen[-1] == n - 1


@needs_data
def test_overlapping_windows_count_and_context(stories):
    model, ids = stories
    out = compare_lm(model, model, ids, window=64, stride=16, max_tokens=1000, batch_size=4)
    assert out["tokens"] == 999
    longer_context = perplexity(model, ids, window=64, stride=16, max_tokens=1000)
    assert longer_context < perplexity(model, ids, window=64, max_tokens=1000)


@needs_data
def test_progress_bar_goes_to_stderr(stories, capsys):
    model, ids = stories
    perplexity(model, ids, window=64, max_tokens=640, progress=True)
    err = capsys.readouterr().err
    assert "10/10" in err


def test_bad_protocol_options():
    with pytest.raises(BadInput, match="stride"):
        list(windows(torch.arange(10), window=4, stride=5))
    with pytest.raises(BadInput, match="1-D"):
        list(windows(torch.zeros(2, 3, dtype=torch.long), window=4))


# --- encoder ---------------------------------------------------------------------------------


def _toy_bert(seed=0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    return BertModel(cfg).eval()


def _toy_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(38)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def _toy_sentences(n, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (n,), generator=gen)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 38, (int(k),), generator=gen)) for k in lengths]


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert torch.equal(mean_pool(hidden, torch.tensor([[1, 1, 0]])), torch.tensor([[2.0, 3.0]]))


def test_embed_is_padding_invariant_and_batches():
    model, tok = _toy_bert(), _toy_tokenizer()
    sentences = _toy_sentences(10, seed=1)
    emb = embed(model, tok, sentences, batch_size=3)
    assert emb.shape == (10, 32) and emb.dtype == torch.float32
    alone = torch.cat([embed(model, tok, [s]) for s in sentences])
    torch.testing.assert_close(emb, alone, atol=1e-5, rtol=1e-5)
    enc = tok(sentences[:2], padding=True, return_tensors="pt")
    torch.testing.assert_close(embed_batch(model, enc["input_ids"], enc["attention_mask"]), emb[:2])


def test_cosine_fidelity():
    model, tok = _toy_bert(), _toy_tokenizer()
    sentences = _toy_sentences(8, seed=2)
    emb = embed(model, tok, sentences)
    assert cosine_fidelity(emb, emb) == pytest.approx(1.0, abs=1e-6)
    assert cosine_fidelity(emb, -emb) == pytest.approx(-1.0, abs=1e-6)
    other = embed(_toy_bert(seed=1), tok, sentences)
    assert cosine_fidelity(emb, other) < 0.99
    with pytest.raises(BadInput):
        cosine_fidelity(emb, emb[:3])


def _blobs(n, seed, classes=3, dim=16):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(123)) * 3 + 5
    y = torch.randint(0, classes, (n,), generator=gen)
    return centres[y] + torch.randn(n, dim, generator=gen), y


def test_probe_separable_and_deterministic():
    X, y = _blobs(300, seed=0)
    X_test, y_test = _blobs(200, seed=1)
    probe = train_probe(X, y, seed=0)
    assert probe.accuracy(X, y) == 1.0 and probe.accuracy(X_test, y_test) >= 0.97
    again = train_probe(X, y, seed=0)
    assert torch.equal(probe.weight, again.weight) and torch.equal(probe.bias, again.bias)
    torch.testing.assert_close(probe.mean, X.double().mean(0))


def test_compare_encoder_on_toy_model():
    model, tok = _toy_bert(), _toy_tokenizer()
    # Label: does the sentence contain "w0"? Mean pooling sees it, so the probe can learn it.
    sentences = _toy_sentences(240, seed=3)
    sentences = [s + (" w0 w0 w0" if i % 2 else "") for i, s in enumerate(sentences)]
    labels = [int("w0" in s.split()) for s in sentences]
    train, test = (sentences[:160], labels[:160]), (sentences[160:], labels[160:])
    same = compare_encoder(model, model, tok, probe_train=train, probe_test=test)
    assert same["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert same["probe_acc"] == same["fp_probe_acc"] >= 0.9
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.2 * torch.randn_like(p))
    out = compare_encoder(model, noisy, tok, probe_train=train, probe_test=test)
    assert set(out) == {"cosine", "fp_probe_acc", "probe_acc"} and out["cosine"] < 0.999


def test_compare_encoder_reuses_the_fp_side_until_the_fp_weights_or_data_change(monkeypatch):
    """The FP probe and embeddings are computed once per FP model and data: a second compressed model costs
    one pass over the test sentences; changing one FP weight or one sentence recomputes them."""
    import compress.eval.encoder as enc

    model, tok = _toy_bert(), _toy_tokenizer()
    sentences = _toy_sentences(60, seed=4)
    labels = [i % 2 for i in range(60)]
    train, test = (sentences[:40], labels[:40]), (sentences[40:], labels[40:])
    calls = []
    real = enc.embed
    monkeypatch.setattr(enc, "embed", lambda m, *a, **k: calls.append(m) or real(m, *a, **k))
    first = compare_encoder(model, copy.deepcopy(model), tok, probe_train=train, probe_test=test)
    assert len(calls) == 3  # FP train, FP test, compressed test
    again = compare_encoder(model, copy.deepcopy(model), tok, probe_train=train, probe_test=test)
    assert len(calls) == 4 and again == first
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    compare_encoder(model, model, tok, probe_train=train, probe_test=test)
    assert len(calls) == 7
    compare_encoder(model, model, tok, probe_train=train, probe_test=(test[0][:-1] + ["w1"], test[1]))
    assert len(calls) == 10


# --- slow ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ensure_minilm_and_self_cosine(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    path = ensure_minilm(tmp_path)
    assert path == tmp_path / "all-minilm-l6-v2" and (path / "model.safetensors").is_file()
    assert ensure_minilm(tmp_path) == path  # cached: no second download
    model, tok = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    sentences = read_labeled_tsv(SST2_DEV)[0][:20]
    emb = embed(model, tok, sentences)
    assert emb.shape == (20, 384)
    assert cosine_fidelity(emb, embed(model, tok, sentences, batch_size=7)) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow
@needs_data
def test_stories260k_full_file_perplexity(stories):
    model, ids = stories
    assert perplexity(model, ids, window=511, bos_id=1) == pytest.approx(5.322, abs=5e-4)


def test_compress_eval_is_bounded_by_default_and_says_how_to_evaluate_everything(tmp_path):
    """`compress eval` caps each file at a run's default (EVAL_MAX_TOKENS), says so on stderr, and evaluates the
    whole file with --max-tokens 0."""
    import json

    from conftest import CAL, STORIES260K, invoke

    from compress.config import EVAL_MAX_TOKENS

    common = ("--reference", STORIES260K, "--gen-prompts", "0", "--json")
    rc, out, err = invoke("eval", STORIES260K, "--data", CAL, *common)
    assert rc == 0, err
    assert f"evaluating at most {EVAL_MAX_TOKENS} tokens of each file in 256-token windows" in err
    assert "--max-tokens 0: the whole file" in err
    assert json.loads(out)[CAL.name]["tokens"] <= EVAL_MAX_TOKENS
    small = tmp_path / "small.txt"
    small.write_text(CAL.read_text()[:20000])
    rc, out, err = invoke("eval", STORIES260K, "--data", small, "--max-tokens", "0", "--text-slice", "0.5", "1.0",
                          *common)
    assert rc == 0 and "evaluating every token of the [0.5, 1.0) slice of each file" in err, err
    half = json.loads(out)["small.txt"]["tokens"]
    rc, out, _ = invoke("eval", STORIES260K, "--data", small, "--max-tokens", "0", *common)
    assert 0.4 < half / json.loads(out)["small.txt"]["tokens"] < 0.6


def test_compress_eval_shows_a_progress_bar_on_a_terminal(tmp_path):
    """On a pseudo-terminal the evaluation draws a progress bar with an ETA (tqdm's `<remaining`)."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from conftest import CAL, STORIES260K

    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a fresh pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-m", "compress.cli", "eval", str(STORIES260K), "--data", str(CAL),
                             "--reference", str(STORIES260K), "--gen-prompts", "0", "--max-tokens", "4096"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=sub, close_fds=True)
    os.close(sub)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    proc.wait(timeout=300)
    os.close(main)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "compare" in text and "win" in text and "<" in text and "100%" in text, text
