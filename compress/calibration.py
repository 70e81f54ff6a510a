"""Calibration data: local text files (or a Hub dataset when the recipe names one) -> token batches.

Sampling is deterministic for a seed: the sources are tokenized into one stream, and `nsamples`
windows of `seqlen` tokens start at offsets drawn with `torch.Generator().manual_seed(seed)`.
Nothing is ever downloaded unless a source is written `hf:<dataset>[:split]`.
"""

from __future__ import annotations

import hashlib
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


def calibration_tokens(tokenizer, sources: list[str], *, nsamples: int, seqlen: int, seed: int,
                       field: str = "text", bos_id: int | None = None) -> torch.Tensor:
    """(nsamples, seqlen) LongTensor. With `bos_id`, each window starts with BOS then seqlen-1 text tokens."""
    stream = torch.cat([token_stream(tokenizer, source_text(s, field)) for s in expand_sources(sources)])
    body = seqlen - (1 if bos_id is not None else 0)
    if stream.numel() <= body:
        raise BadInput(
            f"calibration text has {stream.numel()} tokens, fewer than one window of {seqlen}; "
            "give more text or lower calibration.seqlen"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - body, (nsamples,), generator=g)
    rows = torch.stack([stream[s : s + body] for s in starts.tolist()])
    if bos_id is not None:
        rows = torch.cat([torch.full((nsamples, 1), bos_id, dtype=rows.dtype), rows], dim=1)
    return rows


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
        for b in tokens.split(batch_size):
            model(input_ids=b, use_cache=False) if accepts_use_cache(model) else model(input_ids=b)
            if progress:
                progress(1)
    finally:
        for h in handles:
            h.remove()
    return {k: sums[k] / count[k] for k in sums}


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
