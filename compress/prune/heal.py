"""`stage: heal, method: distill`: a short distillation of a pruned model from the full-precision one
(docs/prune.md).

The teacher is the recipe's model in full precision (`ctx.reference()`, shared with the evaluation); the student
is the model as the earlier stages left it (pruned). For `steps` AdamW steps (`lr`, cosine decay to zero after `warmup` steps, gradient norm
clipped to 1) on batches of `batch_size` calibration sequences cut to `seqlen` tokens (cycled, reshuffled each
pass), the loss is KL(p_teacher || p_student) of the next-token distributions at `temperature`, averaged
over tokens. Every parameter trains except the embeddings and the LM head (tied or not): they hold most of a
small model's parameters and pruning left them whole. PrunePath FFNs train as they run, at their threshold
(the active experts of each token; the routers get no gradient through the hard selection). Reported: the KL on the first batch before and after.
The trained parameters are the stage's hand-off (`TrainedWeights`), written back on `--resume`. It must come
before any `quantize` stage (the quantizer rounds the healed weights).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from compress.config import StrictModel
from compress.errors import BadInput
from compress.handoff import TrainedWeights
from compress.prune.report import HEALED
from compress.registry import register

log = logging.getLogger(__name__)


class HealConfig(StrictModel):
    stage: Literal["heal"] = "heal"
    method: Literal["distill"] = "distill"
    steps: int = Field(200, ge=1)
    lr: float = Field(5e-4, gt=0)
    warmup: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(4, ge=1)
    seqlen: int = Field(256, ge=2)
    temperature: float = Field(1.0, gt=0)


def check(adapter, cfg: HealConfig, facts):
    if adapter.kind != "causal":
        raise BadInput(f"`heal` distils a decoder (causal) model; `{adapter.model_type}` is an encoder")
    if facts.after_quantize:
        raise BadInput(f"stage {facts.index} (`heal`) comes after a `quantize` stage; heal before quantizing (the "
                       "quantizer rounds the healed weights)")
    return cfg


def trainable(adapter) -> dict[str, torch.nn.Parameter]:
    """Every parameter but the embeddings and the LM head."""
    skip = {id(p) for p in adapter.embeddings().parameters()}
    _, head = adapter.lm_head()
    if head is not None:
        skip |= {id(p) for p in head.parameters()}
    return {n: p for n, p in adapter.model.named_parameters() if id(p) not in skip}


def _kl(student_logits, teacher_logits, t: float) -> torch.Tensor:
    s = F.log_softmax(student_logits.float() / t, -1).flatten(0, -2)
    q = F.log_softmax(teacher_logits.float() / t, -1).flatten(0, -2)
    return F.kl_div(s, q, log_target=True, reduction="batchmean") * t * t


def apply(ctx, cfg: HealConfig) -> dict:
    t0 = time.time()
    model = ctx.model
    tokens = ctx.calibration_tokens()[:, :cfg.seqlen]
    teacher = ctx.reference().model
    params = trainable(ctx.adapter)
    was = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n in params)
    opt = torch.optim.AdamW(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup)) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    gen = torch.Generator().manual_seed(ctx.seed)
    first = tokens[:cfg.batch_size]
    kw = {"use_cache": False}

    def kl_on(batch) -> float:
        with torch.no_grad():
            return float(_kl(model(input_ids=batch, **kw).logits, teacher(input_ids=batch, **kw).logits,
                             cfg.temperature))

    before = kl_on(first)
    order: list[torch.Tensor] = []
    bar = ctx.progress(total=cfg.steps, desc=f"{ctx.key} heal", unit="step")
    model.train()
    try:
        for _ in range(cfg.steps):
            if not order:
                order = list(torch.randperm(tokens.shape[0], generator=gen).split(cfg.batch_size))
            batch = tokens[order.pop(0)]
            with torch.no_grad():
                target = teacher(input_ids=batch, **kw).logits
            loss = _kl(model(input_ids=batch, **kw).logits, target, cfg.temperature)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
            opt.step()
            sched.step()
            bar.update(1)
    finally:
        model.eval()
        bar.close()
        for n, p in model.named_parameters():
            p.requires_grad_(was[n])
    after = kl_on(first)
    if not math.isfinite(after):
        raise RuntimeError(f"heal diverged (KL {after}); lower `lr`")
    ctx.emit(TrainedWeights({n: p.detach().clone() for n, p in params.items()}))
    log.info("heal: KL to full precision %.4f -> %.4f in %d steps", before, after, cfg.steps)
    return {"structure": {"stage": "heal", "method": "distill", "kl_before": round(before, 6),
                          "kl_after": round(after, 6), "steps": cfg.steps,
                          "trained_params": sum(p.numel() for p in params.values()),
                          "seconds": round(time.time() - t0, 3)}}


register("heal", "distill", HealConfig, "distil the pruned model from the full-precision one (KL on logits)",
         check=check, produces=(TrainedWeights,), routed=True, report=(HEALED,), reference=True)(apply)
