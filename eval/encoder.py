"""Encoder (BERT-style) fidelity: mean-pooled embeddings, cosine to FP, and a linear probe.

Protocol (shared/data/README.md): sentence embedding = mean of `last_hidden_state` over the
attention mask; the probe is multiclass logistic regression trained on FP embeddings of the probe
training set and applied to FP and to compressed embeddings of the probe test set.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from compress.errors import BadInput

log = logging.getLogger(__name__)


def embed(model, tokenizer, sentences: Sequence[str], *, batch_size: int = 64,
          max_length: int = 128) -> torch.Tensor:
    """Mean-pooled last hidden states, float32 (n, hidden) on CPU.

    `tokenizer(list_of_str, padding=True, truncation=True, max_length=..., return_tensors="pt")`
    must return `input_ids` and `attention_mask` (any Hugging Face tokenizer does).
    """
    parts = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(list(sentences[i : i + batch_size]), padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt")
        parts.append(embed_batch(model, enc["input_ids"], enc["attention_mask"]))
    if not parts:
        raise BadInput("no sentences to embed")
    return torch.cat(parts)


def embed_batch(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean-pooled embeddings (batch, hidden) of one pre-tokenized, padded batch."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
    return mean_pool(out.last_hidden_state, attention_mask.to(device)).float().cpu()


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of `hidden` (batch, seq, d) over positions where `attention_mask` (batch, seq) is 1."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def cosine_fidelity(fp_emb: torch.Tensor, q_emb: torch.Tensor) -> float:
    """Mean cosine similarity between matching rows of two (n, d) embedding matrices."""
    if fp_emb.shape != q_emb.shape:
        raise BadInput(f"embedding shapes differ: {tuple(fp_emb.shape)} vs {tuple(q_emb.shape)}")
    return float(F.cosine_similarity(fp_emb.double(), q_emb.double(), dim=-1).mean())


@dataclass(frozen=True)
class Probe:
    """Multiclass logistic regression on standardised inputs: softmax(((X - mean) / std) W + b)."""

    mean: torch.Tensor  # (d,)
    std: torch.Tensor  # (d,)
    weight: torch.Tensor  # (d, classes)
    bias: torch.Tensor  # (classes,)

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        return ((X.double() - self.mean) / self.std) @ self.weight + self.bias

    def predict(self, X: torch.Tensor) -> torch.Tensor:
        return self.logits(X).argmax(-1)

    def accuracy(self, X: torch.Tensor, y) -> float:
        return float((self.predict(X) == torch.as_tensor(y)).double().mean())


def train_probe(X: torch.Tensor, y, *, seed: int = 0, epochs: int = 200, l2: float = 1e-3) -> Probe:
    """Fit a softmax probe on (X (n, d), y (n,) ints 0..C-1) with full-batch L-BFGS in float64.

    Loss: mean cross-entropy + l2/2 * ||W||^2 (the bias is not penalised). `epochs` is the number
    of L-BFGS iterations, each one pass over the data. The problem is convex and starts from zero
    weights, so the fit is deterministic; `seed` fixes torch's RNG for the fit all the same.
    """
    X, y = X.double(), torch.as_tensor(y, dtype=torch.long)
    if X.dim() != 2 or len(X) != len(y) or len(y) == 0:
        raise BadInput(f"probe data must be X (n, d) and y (n,); got {tuple(X.shape)} and {tuple(y.shape)}")
    mean, std = X.mean(0), X.std(0).clamp(min=1e-8)
    Z = (X - mean) / std
    W = torch.zeros(X.shape[1], int(y.max()) + 1, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(W.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], max_iter=epochs, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(Z @ W + b, y) + 0.5 * l2 * W.pow(2).sum()
        loss.backward()
        return loss

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        opt.step(closure)
    return Probe(mean, std, W.detach(), b.detach())


# The FP side of `compare_encoder` (probe, FP embeddings of the test sentences) of the last FP model seen, by
# fingerprint: a benchmark scores many compressed models against one FP model, and embedding the probe's
# training set is most of an encoder evaluation's time.
_FP_SIDE: dict[str, tuple] = {}


def _fingerprint(model, tokenizer, *args) -> str:
    """sha256 of the model's tensors (name and bytes), the tokenizer's identity and `args` (sentences,
    labels, settings), so any change to the FP weights or the data misses the cache."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr((type(tokenizer).__name__, getattr(tokenizer, "name_or_path", ""), len(tokenizer))).encode())
    h.update(repr(args).encode())
    return h.hexdigest()


def compare_encoder(fp_model, q_model, tokenizer, *, probe_train: tuple[Sequence[str], Sequence[int]],
                    probe_test: tuple[Sequence[str], Sequence[int]], batch_size: int = 64,
                    max_length: int = 128, seed: int = 0) -> dict:
    """Cosine fidelity and probe accuracy of `q_model` against `fp_model`.

    Returns `cosine` (mean cosine between FP and compressed embeddings of the probe_test
    sentences), `fp_probe_acc` and `probe_acc` (accuracy on probe_test of a probe trained on FP
    embeddings of probe_train, applied to FP and to compressed embeddings).
    """
    def run(model, sentences):
        return embed(model, tokenizer, sentences, batch_size=batch_size, max_length=max_length)

    (train_x, train_y), (test_x, test_y) = probe_train, probe_test
    key = _fingerprint(fp_model, tokenizer, probe_train, probe_test, batch_size, max_length, seed)
    if key not in _FP_SIDE:
        _FP_SIDE.clear()  # one entry: the FP side of the model being benchmarked
        _FP_SIDE[key] = train_probe(run(fp_model, train_x), train_y, seed=seed), run(fp_model, test_x)
    probe, fp_test = _FP_SIDE[key]
    q_test = run(q_model, test_x)
    return {"cosine": cosine_fidelity(fp_test, q_test), "fp_probe_acc": probe.accuracy(fp_test, test_y),
            "probe_acc": probe.accuracy(q_test, test_y)}
