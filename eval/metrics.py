"""Language-model metrics on a token stream: perplexity, and fidelity of a compressed model to FP.

Sliding-window protocol (shared/data/README.md). The stream `ids` (1-D, N tokens) is first cut to
`max_tokens`. Window k covers tokens [k*stride, min(k*stride + window, N)); windows stop once one
reaches the end of the stream. With `bos_id`, BOS is prepended to every window, so its first token
is predicted from BOS and is a target too (stories260K: 511-token windows + BOS = 512 positions).
Each target is scored exactly once, in the first window that contains it with some context:

* with BOS: all N tokens are scored;
* without BOS, stride < window: tokens 1..N-1 (N - 1 targets);
* without BOS, stride == window: each window's first token has no context, so N - #windows.

With stride < window, a window after the first scores only its last `stride` targets; the tokens
before them are context. Logits are consumed batch by batch; nothing of size N x vocab is kept.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from compress.errors import BadInput

_ROWS_ELEMENTS = 1 << 22  # float64 elements per chunk of (positions x vocab) in the KL maths


@dataclass(frozen=True)
class Window:
    """One model input: `inputs` (L,) and the logit positions [first, L - 1) that are scored."""

    inputs: torch.Tensor
    first: int

    @property
    def targets(self) -> torch.Tensor:
        return self.inputs[self.first + 1 :]


def windows(ids: torch.Tensor, *, window: int, stride: int | None = None,
            bos_id: int | None = None) -> Iterator[Window]:
    """The sliding windows over a 1-D stream, in order (see the module docstring)."""
    stride = window if stride is None else stride
    _check_protocol(ids, window, stride, bos_id)
    n, offset, scored_to = ids.numel(), int(bos_id is not None), 0
    prefix = ids.new_tensor([bos_id]) if bos_id is not None else ids.new_empty(0)
    for start in range(0, n, stride):
        end = min(start + window, n)
        first_target = max(scored_to, start + 1 - offset)  # stream index of the first scored target
        if end - first_target > 0:
            yield Window(torch.cat([prefix, ids[start:end]]), first_target - start - 1 + offset)
        scored_to = end
        if end == n:
            break


def count_windows(n: int, *, window: int, stride: int | None = None) -> int:
    """Number of windows over a stream of `n` tokens (for progress bars)."""
    stride = window if stride is None else stride
    return 1 if n <= window else 1 + math.ceil((n - window) / stride)


def perplexity(model, ids: torch.Tensor, *, window: int = 256, stride: int | None = None,
               bos_id: int | None = None, max_tokens: int | None = None, batch_size: int = 8,
               progress: bool = False) -> float:
    """exp(mean next-token cross-entropy) of `model` over `ids` under the sliding-window protocol."""
    nll, count = 0.0, 0
    for batch in _batches(ids, window, stride, bos_id, max_tokens, batch_size, progress, "ppl"):
        for win, logits in zip(batch, _logits(model, batch)):
            nll += _nll_sum(logits[win.first : -1], win.targets)
            count += win.targets.numel()
    return math.exp(nll / count)


def compare_lm(fp_model, q_model, ids: torch.Tensor, *, window: int = 256, stride: int | None = None,
               bos_id: int | None = None, max_tokens: int | None = None, batch_size: int = 8,
               progress: bool = False) -> dict:
    """Score `fp_model` and `q_model` on the same windows in one pass.

    Returns `fp_ppl`, `ppl` (of q_model), `ppl_ratio` (ppl / fp_ppl), `kl` (mean over scored
    positions of KL(P_fp || P_q) over the full vocabulary, in nats), `top1` (fraction of scored
    positions where the argmaxes agree) and `tokens` (number of scored positions).
    """
    fp_nll = q_nll = kl = 0.0
    agree = count = 0
    for batch in _batches(ids, window, stride, bos_id, max_tokens, batch_size, progress, "compare"):
        for win, fp_logits, q_logits in zip(batch, _logits(fp_model, batch), _logits(q_model, batch)):
            fp_logits, q_logits = fp_logits[win.first : -1], q_logits[win.first : -1]
            targets = win.targets.to(fp_logits.device)
            fp_nll += _nll_sum(fp_logits, targets)
            q_nll += _nll_sum(q_logits, targets.to(q_logits.device))
            q_logits = q_logits.to(fp_logits.device)
            kl += float(token_kl(fp_logits, q_logits).sum())
            agree += int((fp_logits.argmax(-1) == q_logits.argmax(-1)).sum())
            count += targets.numel()
    fp_ppl, ppl = math.exp(fp_nll / count), math.exp(q_nll / count)
    return {"fp_ppl": fp_ppl, "ppl": ppl, "ppl_ratio": ppl / fp_ppl, "kl": kl / count,
            "top1": agree / count, "tokens": count}


def token_kl(fp_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_fp || P_q) per position (nats, float64) for logits of shape (..., vocab)."""
    fp_flat = fp_logits.reshape(-1, fp_logits.shape[-1])
    q_flat = q_logits.reshape(-1, q_logits.shape[-1])
    rows = max(1, _ROWS_ELEMENTS // fp_flat.shape[-1])
    parts = [_kl_rows(fp_flat[i : i + rows], q_flat[i : i + rows]) for i in range(0, len(fp_flat), rows)]
    return torch.cat(parts).reshape(fp_logits.shape[:-1]) if parts else fp_flat.new_zeros(0, dtype=torch.float64)


def mean_kl(fp_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(P_fp || P_q), for logits of shape (..., vocab)."""
    return float(token_kl(fp_logits, q_logits).mean())


def top1_agreement(fp_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Fraction of positions where the two models' most likely tokens are the same."""
    return float((fp_logits.argmax(-1) == q_logits.argmax(-1)).double().mean())


# --- helpers ---------------------------------------------------------------------------------


def _check_protocol(ids: torch.Tensor, window: int, stride: int, bos_id: int | None) -> None:
    if ids.dim() != 1:
        raise BadInput(f"expected a 1-D token stream, got shape {tuple(ids.shape)}")
    if window < (1 if bos_id is not None else 2):
        raise BadInput(f"window={window} is too small to score anything; use at least 2 (1 with BOS)")
    if not 1 <= stride <= window:
        raise BadInput(f"stride={stride} must be between 1 and window={window}")
    if ids.numel() < (1 if bos_id is not None else 2):
        raise BadInput(f"the token stream has {ids.numel()} tokens; nothing to score")


def _batches(ids, window, stride, bos_id, max_tokens, batch_size, progress, desc) -> Iterator[list[Window]]:
    """Windows grouped into batches of equal length (only the last window can be shorter)."""
    ids = ids[:max_tokens] if max_tokens is not None else ids
    total = count_windows(ids.numel(), window=window, stride=stride)
    with progress_bar(total, desc, "win", progress) as bar:
        batch: list[Window] = []
        scored, t0 = 0, time.perf_counter()

        def advance(n: int) -> None:
            nonlocal scored
            scored += sum(w.targets.numel() for w in batch)
            bar.set_postfix_str(f"{scored / max(time.perf_counter() - t0, 1e-9):.0f} tok/s", refresh=False)
            bar.update(n)

        for win in windows(ids, window=window, stride=stride, bos_id=bos_id):
            if batch and (len(batch) == batch_size or len(win.inputs) != len(batch[0].inputs)):
                yield batch
                advance(len(batch))
                batch = []
            batch.append(win)
        if batch:
            yield batch
            advance(bar.total - bar.n)


def progress_bar(total: int, desc: str, unit: str, show: bool) -> tqdm:
    """A tqdm bar on stderr: redrawn in place on a terminal; elsewhere (a log, `--json` piped) a line every 15 s."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not show, mininterval=0.1 if tty else 15,
                dynamic_ncols=tty, ascii=not tty)


def _logits(model, batch: list[Window]) -> torch.Tensor:
    """Logits (batch, L, vocab) of a batch of equal-length windows."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(torch.stack([w.inputs for w in batch]).to(device)).logits


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.float(), targets.to(logits.device), reduction="sum"))


def _kl_rows(fp_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    fp_logp = F.log_softmax(fp_logits.double(), dim=-1)
    q_logp = F.log_softmax(q_logits.double(), dim=-1)
    return (fp_logp.exp() * (fp_logp - q_logp)).sum(-1)
