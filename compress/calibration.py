"""Calibration data: local text files (or a Hub dataset when the recipe names one) -> token batches.

Sampling is deterministic for a seed: the sources are tokenized into one stream, and `nsamples`
windows of `seqlen` tokens start at offsets drawn with `torch.Generator().manual_seed(seed)`.
Nothing is ever downloaded unless a source is written `hf:<dataset>[:split]`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from compress.errors import BadInput
from compress.eval.data import read_text, token_stream

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
