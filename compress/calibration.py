"""Calibration data: local text files (or a Hub dataset when the recipe names one) -> token batches.

Sampling is deterministic for a seed: the sources are tokenized into one stream, and `nsamples`
windows of `seqlen` tokens start at offsets drawn with `torch.Generator().manual_seed(seed)`.
Nothing is ever downloaded unless a source is written `hf:<dataset>[:split]`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from compress.errors import BadInput
from compress.eval.data import read_text, token_stream
from compress.models.adapters import accepts_use_cache

TEXT_SUFFIXES = (".txt", ".raw", ".jsonl", ".tsv", ".md")


def expand_sources(sources: list[str]) -> list[str]:
    """Files as given; directories expand to their text files (sorted); `hf:` ids are kept."""
    out: list[str] = []
    for s in sources:
        p = Path(s).expanduser()
        if s.startswith("hf:"):
            out.append(s)
        elif p.is_dir():
            files = sorted(str(f) for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES)
            if not files:
                raise BadInput(f"calibration directory `{s}` holds no text files ({', '.join(TEXT_SUFFIXES)})")
            out.extend(files)
        elif p.exists():
            out.append(str(p))
        else:
            raise BadInput(f"calibration source `{s}` does not exist")
    return out


def load_hub_text(spec: str, field: str) -> str:
    from datasets import load_dataset

    name, _, split = spec[3:].partition(":")
    ds = load_dataset(name, split=split or "train")
    return "\n\n".join(str(r[field]) for r in ds)


def source_text(source: str, field: str = "text") -> str:
    return load_hub_text(source, field) if source.startswith("hf:") else read_text(source, field=field)


@dataclass
class Document:
    """One calibration file: plain text, or conversations (lists of {role, content}) to render."""

    path: str
    text: str | None = None
    conversations: list | None = None

    @property
    def kind(self) -> str:
        return "text" if self.conversations is None else "chat"


def read_document(path: str, *, field: str = "text", messages: str = "messages", fmt: str = "auto") -> Document:
    """A calibration file as a Document; `fmt` `auto` reads .jsonl rows holding `messages` as conversations.
    Raises BadInput naming file:line for a malformed conversation."""
    if path.startswith("hf:") or fmt == "text" or (fmt == "auto" and not _is_chat(path, messages)):
        return Document(path, text=source_text(path, field))
    from compress.eval.data import _jsonl_records, _read_utf8

    conversations = []
    for lineno, row in _jsonl_records(_read_utf8(Path(path)), Path(path)):
        turns = row.get(messages) if isinstance(row, dict) else None
        if not (isinstance(turns, list) and turns and all(
                isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
                for t in turns)):
            raise BadInput(f"{path}:{lineno}: expected an object whose '{messages}' is a non-empty list of "
                           "{\"role\": str, \"content\": str}")
        conversations.append([{"role": t["role"], "content": t["content"]} for t in turns])
    if not conversations:
        raise BadInput(f"{path}: no conversations found")
    return Document(path, conversations=conversations)


def _is_chat(path: str, messages: str) -> bool:
    """A .jsonl file whose first row has a `messages` field."""
    import json

    if Path(path).suffix.lower() != ".jsonl":
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    return False
                return isinstance(row, dict) and messages in row
    return False


def render(doc: Document, tokenizer) -> str:
    """The document's text: conversations through the tokenizer's chat template (`role: content` lines, one blank
    line between conversations, when it has none)."""
    if doc.conversations is None:
        return doc.text
    if getattr(tokenizer, "chat_template", None):
        return "".join(tokenizer.apply_chat_template(c, tokenize=False) for c in doc.conversations)
    return "\n\n".join("\n".join(f"{t['role']}: {t['content']}" for t in c) for c in doc.conversations)


def calibration_tokens(tokenizer, sources: list[str], *, nsamples: int, seqlen: int, seed: int,
                       field: str = "text", bos_id: int | None = None, weights: list[float] | None = None,
                       messages: str = "messages", fmt: str = "auto") -> tuple[torch.Tensor, dict]:
    """((nsamples, seqlen) LongTensor, what each source gave). With `bos_id`, each window starts with BOS then
    seqlen-1 text tokens. Without `weights` the sources form one stream and windows start anywhere in it; with
    them, source i gets round(nsamples * w_i / sum(w)) windows (largest remainders) from its own stream."""
    streams, info = [], {}
    for source in sources:
        docs = [read_document(f, field=field, messages=messages, fmt=fmt) for f in expand_sources([source])]
        stream = torch.cat([token_stream(tokenizer, render(d, tokenizer)) for d in docs])
        streams.append(stream)
        kinds = sorted({d.kind for d in docs})
        info[source] = {"format": "/".join(kinds), "tokens": stream.numel()}
        if "chat" in kinds:
            info[source]["conversations"] = sum(len(d.conversations) for d in docs if d.conversations)
            info[source]["chat_template"] = bool(getattr(tokenizer, "chat_template", None))
    body = seqlen - (1 if bos_id is not None else 0)
    g = torch.Generator().manual_seed(seed)
    if weights is None:
        stream = torch.cat(streams)
        if stream.numel() <= body:
            raise BadInput(f"calibration text has {stream.numel()} tokens, fewer than one window of {seqlen}; "
                           "give more text or lower calibration.seqlen")
        starts = torch.randint(0, stream.numel() - body, (nsamples,), generator=g).tolist()
        rows = [stream[s: s + body] for s in starts]
        bounds = torch.tensor([s.numel() for s in streams]).cumsum(0)
        counts = torch.bincount(torch.bucketize(torch.tensor(starts), bounds, right=True), minlength=len(streams))
    else:
        counts = _shares(weights, nsamples)
        rows = []
        for source, stream, n in zip(sources, streams, counts.tolist()):
            if n and stream.numel() <= body:
                raise BadInput(f"calibration source `{source}` has {stream.numel()} tokens, fewer than one window "
                               f"of {seqlen}; give more text, lower its weight to 0 or lower calibration.seqlen")
            if n:
                starts = torch.randint(0, stream.numel() - body, (n,), generator=g).tolist()
                rows += [stream[s: s + body] for s in starts]
    for source, n in zip(sources, counts.tolist()):
        info[source].update(windows=n, calibration_tokens=n * seqlen)
    tokens = torch.stack(rows)
    if bos_id is not None:
        tokens = torch.cat([torch.full((nsamples, 1), bos_id, dtype=tokens.dtype), tokens], dim=1)
    return tokens, info


def _shares(weights: list[float], n: int) -> torch.Tensor:
    """n split in proportion to `weights`, by largest remainders (ties: the earlier source)."""
    w = torch.tensor(weights, dtype=torch.float64)
    exact = n * w / w.sum()
    counts = exact.floor().long()
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]).item(), i))
    for i in order[: n - int(counts.sum())]:
        counts[i] += 1
    return counts


def tokens_hash(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()


# -- statistics of the calibration data that rotations and allocations read ------------------------------------
@torch.no_grad()
def collect_moments(model: nn.Module, tokens: torch.Tensor, taps: dict, stat: Callable, batch_size: int = 8,
                    progress: Callable | None = None) -> dict:
    """Mean over every calibration row reaching each tap of `stat`: `stat(rows)` gets the rows (float64,
    shape (n, d)) and returns their sum of some per-row statistic (e.g. `(rows**2).sum(0)`).

    taps: key -> (module, "input" | "output"); returns key -> mean statistic, for taps that saw rows.
    One forward pass of the whole model per batch of `tokens`; `progress(1)` after each.
    """
    sums, count = {}, {}

    def add(key, x):
        x = x.detach().reshape(-1, x.shape[-1]).double()
        if x.shape[0]:
            sums[key] = sums.get(key, 0) + stat(x)
            count[key] = count.get(key, 0) + x.shape[0]

    handles = []
    for key, (m, where) in taps.items():
        if where == "input":
            handles.append(m.register_forward_pre_hook(lambda _m, args, k=key: add(k, args[0])))
        else:
            handles.append(m.register_forward_hook(lambda _m, _a, out, k=key: add(k, out)))
    try:
        forward_batches(model, tokens, batch_size, progress)
    finally:
        for h in handles:
            h.remove()
    return {k: sums[k] / count[k] for k in sums}


def forward_batches(model: nn.Module, tokens: torch.Tensor, batch_size: int = 8,
                    progress: Callable | None = None) -> None:
    """`model` over `tokens` in batches of windows (without a KV cache), for what its hooks collect; `progress(1)`
    after each batch."""
    for b in tokens.split(batch_size):
        model(input_ids=b, use_cache=False) if accepts_use_cache(model) else model(input_ids=b)
        if progress:
            progress(1)


def collect_energy(model: nn.Module, tokens: torch.Tensor, taps: dict, transform: Callable | None = None,
                   batch_size: int = 8, progress: Callable | None = None) -> dict:
    """Per-coordinate mean of `transform(x)**2` (float64) over every calibration row reaching each tap."""
    def stat(x):
        h = transform(x) if transform else x
        return (h * h).sum(0)

    return collect_moments(model, tokens, taps, stat, batch_size, progress)


def head_covariance(n_heads: int) -> Callable:
    """`collect_moments` statistic: per head, the (head_dim x head_dim) second moment of its output slice."""
    def stat(x):
        y = x.reshape(x.shape[0], n_heads, -1)
        return torch.einsum("rni,rnj->nij", y, y)
    return stat
