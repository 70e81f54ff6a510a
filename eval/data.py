"""Evaluation text: reading files, slicing them and turning them into one token stream.

File formats follow `shared/data/README.md`: UTF-8 text with `\\r\\n` normalised to `\\n`; `.jsonl` with
one JSON object per line; tab-separated files without quoting (`csv.QUOTE_NONE`, because SST-2
text contains `"`).
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import torch

from compress.errors import BadInput

log = logging.getLogger(__name__)

_TSV_HEADERS = ("sentence", "text")


def read_text(path: str | Path, *, field: str = "text") -> str:
    """Return the evaluation text of `path`, with `\\r\\n` normalised to `\\n`.

    `.jsonl`: the `field` of each line, joined with a blank line ("\\n\\n").
    `.tsv`: the first column of each row, joined with "\\n" (a `sentence`/`text` header is skipped).
    Anything else: the whole file. Raises BadInput for a missing, unreadable or empty file.
    """
    path = Path(path)
    raw = _read_utf8(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        text = "\n\n".join(_jsonl_field(raw, field, path))
    elif suffix == ".tsv":
        text = "\n".join(row[0] for row in _tsv_rows(raw, skip_header=True))
    else:
        text = raw
    if not text.strip():
        raise BadInput(f"{path}: no text found (is the file or its '{field}' field empty?)")
    return text


def read_labeled_tsv(path: str | Path) -> tuple[list[str], list[int]]:
    """Read `sentence<TAB>label` rows: SST-2 (header, integer labels) or AG News (no header).

    String labels are mapped to integers in sorted order of the distinct labels, so
    `["World", "Sports", ...]` always gives the same ids. Integer labels are kept as they are.
    """
    path = Path(path)
    rows = _tsv_rows(_read_utf8(path), skip_header=True)
    bad = [i for i, row in enumerate(rows) if len(row) < 2]
    if bad:
        raise BadInput(f"{path}: row {bad[0] + 1} has no label column; expected 'text<TAB>label'")
    sentences = [row[0] for row in rows]
    raw_labels = [row[1].strip() for row in rows]
    if not sentences:
        raise BadInput(f"{path}: no labeled rows found")
    return sentences, _label_ids(raw_labels)


def read_labeled(path: str | Path) -> tuple[list[str], list[int]]:
    """Labelled rows of a `.tsv` (`read_labeled_tsv`) or a `.jsonl` file (one object per line with a string
    `text` or `sentence` and a `label`, integer or string; string labels map to ids in sorted order)."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        return read_labeled_tsv(path)
    texts, labels = [], []
    for lineno, record in _jsonl_records(_read_utf8(path), path):
        text = record.get("text", record.get("sentence")) if isinstance(record, dict) else None
        if not isinstance(text, str) or "label" not in record:
            raise BadInput(f"{path}:{lineno}: expected an object with a string `text` (or `sentence`) and a `label`")
        texts.append(text)
        labels.append(str(record["label"]).strip())
    if not texts:
        raise BadInput(f"{path}: no labeled rows found")
    return texts, _label_ids(labels)


def text_slice(text: str, start: float, end: float) -> str:
    """The characters of `text` between fractions `start` and `end` (0 <= start < end <= 1).

    Both cut points are moved forward to the next whitespace so that no word is split; the result
    is stripped. `text_slice(t, 0.8, 1.0)` is "the last 20%".
    """
    if not 0.0 <= start < end <= 1.0:
        raise BadInput(f"text slice [{start}, {end}] is invalid; need 0 <= start < end <= 1")
    lo = _next_space(text, round(start * len(text)))
    hi = _next_space(text, round(end * len(text)))
    return text[lo:hi].strip()


def token_stream(tokenizer, text: str, *, chunk_chars: int = 32_768) -> torch.Tensor:
    """Token ids of `text` as a 1-D LongTensor, without special tokens.

    The text is encoded in chunks of whole lines, so long files stay fast even for tokenizers
    without a pre-tokenizer. Each chunk is encoded together with the line before and the line
    after it, and the tokens of that context are dropped by character offset. This removes the
    dummy-prefix "▁" that SentencePiece-style tokenizers add at the start of every call and the
    end-of-string effects of regex pre-tokenizers, so the result equals encoding the whole text at
    once (checked in tests). If a token crosses a chunk boundary, the whole text is encoded.
    """
    spans = _line_chunks(text, chunk_chars)
    if len(spans) == 1 or not getattr(tokenizer, "is_fast", False):
        return _encode(tokenizer, text)
    parts = [(_previous_line_start(text, s), s, e, _next_line_end(text, e)) for s, e in spans]
    enc = tokenizer([text[c:r] for c, _, _, r in parts], add_special_tokens=False,
                    return_offsets_mapping=True)
    ids: list[int] = []
    for (c, s, e, _), chunk_ids, offsets in zip(parts, enc["input_ids"], enc["offset_mapping"]):
        kept = _tokens_within(chunk_ids, offsets, s - c, e - c)
        if kept is None:
            log.debug("token_stream: a token crosses a chunk boundary; encoding the whole text")
            return _encode(tokenizer, text)
        ids.extend(kept)
    return torch.tensor(ids, dtype=torch.long)


# --- helpers ---------------------------------------------------------------------------------


def _read_utf8(path: Path) -> str:
    if not path.is_file():
        raise BadInput(f"{path}: file not found; give the path of a UTF-8 text, .jsonl or .tsv file")
    try:
        raw = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot read as UTF-8 text ({exc})") from exc
    if not raw.strip():
        raise BadInput(f"{path}: the file is empty")
    return raw.replace("\r\n", "\n")


def _jsonl_records(raw: str, path: Path):
    """(line number, parsed object) of each non-empty line."""
    for lineno, line in enumerate(raw.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc


def _jsonl_field(raw: str, field: str, path: Path) -> list[str]:
    texts = []
    for lineno, record in _jsonl_records(raw, path):
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise BadInput(f"{path}:{lineno}: expected an object with a string field '{field}'")
        texts.append(record[field])
    return texts


def _tsv_rows(raw: str, *, skip_header: bool) -> list[list[str]]:
    rows = [row for row in csv.reader(raw.split("\n"), delimiter="\t", quoting=csv.QUOTE_NONE) if row]
    if skip_header and rows and rows[0][0].strip().lower() in _TSV_HEADERS:
        rows = rows[1:]
    return rows


def _label_ids(raw_labels: list[str]) -> list[int]:
    if all(label.lstrip("-").isdigit() for label in raw_labels):
        return [int(label) for label in raw_labels]
    index = {label: i for i, label in enumerate(sorted(set(raw_labels)))}
    return [index[label] for label in raw_labels]


def _next_space(text: str, pos: int) -> int:
    while 0 < pos < len(text) and not text[pos].isspace():
        pos += 1
    return pos


def _line_chunks(text: str, chunk_chars: int) -> list[tuple[int, int]]:
    """(start, end) character spans of about `chunk_chars`, each ending after a run of newlines."""
    spans, start = [], 0
    while start < len(text):
        cut = text.find("\n", start + chunk_chars)
        end = len(text) if cut < 0 else cut
        while end < len(text) and text[end] == "\n":
            end += 1
        spans.append((start, end))
        start = end
    return spans or [(0, 0)]


def _previous_line_start(text: str, start: int) -> int:
    """Start of the last non-empty line before `start` (0 for the first chunk)."""
    while start > 0 and text[start - 1] == "\n":
        start -= 1
    return text.rfind("\n", 0, start) + 1


def _next_line_end(text: str, end: int) -> int:
    """End (after its newline) of the line that starts at `end`."""
    cut = text.find("\n", end)
    return len(text) if cut < 0 else cut + 1


def _tokens_within(ids: list[int], offsets: list[tuple[int, int]], lo: int, hi: int) -> list[int] | None:
    """Tokens whose characters lie in [lo, hi); None if a token crosses `lo` or `hi`."""
    kept = []
    for token, (begin, end) in zip(ids, offsets):
        if begin < lo < end or begin < hi < end:
            return None
        if lo <= begin < hi:
            kept.append(token)
    return kept


def _encode(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
