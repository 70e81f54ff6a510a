"""LFQ: logit-aware final-block quantization (arXiv 2605.29756; docs/quantize.md#final-block-objective-lfq).

Blocks 1..L-1 keep their method's own objective. The last decoder block is tuned (AutoRound's
sign-gradient rounding) to minimise, through the frozen final norm and the frozen full-precision
LM head,

    lfq:      KL(p_FP || p_Q) per token  (= soft cross-entropy against the FP distribution + const)
    hard_ce:  next-token cross-entropy against the calibration tokens (auto-round's `enable_lfq`,
              kept for comparison; its maintainers report accuracy drops)

The teacher logits are recomputed per minibatch from the cached FP block outputs (hidden size
only) and the loss is chunked over tokens with a detached hidden state, so no full-vocabulary
logits exist for more than `chunk_tokens` tokens at a time: memory is
O(chunk_tokens x vocab) whatever the calibration size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compress.errors import BadInput
from compress.models.head import LogitHead


def resolve_final_block(cfg, adapter):
    """`cfg` with `final_block: auto` replaced by what it means for this model; an objective through the LM
    head on a model without one is a BadInput (raised at plan time, before anything is loaded)."""
    causal = adapter.kind == "causal" and adapter.lm_head()[1] is not None
    if cfg.final_block == "auto":
        return cfg.model_copy(update={"final_block": "lfq" if causal else "same"})
    if cfg.final_block != "same" and not causal:
        raise BadInput(f"`final_block: {cfg.final_block}` needs a causal LM with an LM head; `{adapter.model_type}` "
                       "has none (use `same`, or `auto`, which is `same` here)")
    return cfg


def uses_head(cfg) -> bool:
    """Whether a resolved config tunes the last block through the LM head."""
    if cfg.final_block == "auto":
        raise ValueError("`final_block: auto` depends on the model: resolve it with resolve_final_block(cfg, adapter)")
    return cfg.final_block != "same"


def kl_per_token(z_teacher: torch.Tensor, z_student: torch.Tensor) -> torch.Tensor:
    """KL(softmax(z_teacher) || softmax(z_student)) per row, in nats."""
    log_t, log_s = F.log_softmax(z_teacher.float(), -1), F.log_softmax(z_student.float(), -1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token labels of (batch, seq) tokens; the last position of each row is ignored (-100)."""
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    return labels


def logit_loss_backward(out: torch.Tensor, fp_out: torch.Tensor, head: LogitHead, mode: str,
                        tokens: torch.Tensor | None = None, chunk_tokens: int = 512) -> float:
    """Loss of the block output `out` (batch, seq, hidden) through `head`, back-propagated into the
    block's graph chunk by chunk; returns the mean loss per token.

    `lfq`: teacher = head(fp_out) (the FP block's output on the FP trajectory), no gradient.
    `hard_ce`: targets = `tokens` shifted by one.
    """
    h = out.detach().requires_grad_(True)
    flat_h = h.reshape(-1, h.shape[-1])
    if mode == "lfq":
        flat_t = fp_out.reshape(-1, fp_out.shape[-1])
        n = flat_h.shape[0]
    elif mode == "hard_ce":
        if tokens is None:
            raise ValueError("hard_ce needs the calibration tokens")
        flat_lab = shifted_labels(tokens).reshape(-1)
        n = int((flat_lab != -100).sum())
    else:
        raise ValueError(f"unknown final-block objective {mode!r}")
    total = 0.0
    for s in range(0, flat_h.shape[0], chunk_tokens):
        z_q = head(flat_h[s : s + chunk_tokens])
        if mode == "lfq":
            with torch.no_grad():
                z_t = head(flat_t[s : s + chunk_tokens])
            loss = kl_per_token(z_t, z_q).sum() / n
        else:
            loss = F.cross_entropy(z_q, flat_lab[s : s + chunk_tokens], ignore_index=-100, reduction="sum") / n
        loss.backward()
        total += loss.item()
    out.backward(h.grad)
    return total
