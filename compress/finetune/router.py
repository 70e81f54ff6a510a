"""`stage: finetune, method: router`: router fine-tuning of a quantized MoE model (GEMQ stage D; docs/moe.md).

After rounding, tokens reach other experts than in full precision. This stage trains only the routers (the
`gate` of every MoE block; experts, attention, embeddings, norms, the LM head and the shared-expert gates are
frozen and checked unchanged afterwards) of the model as the earlier stages left it (dequantized weights in
memory), on the first `samples` calibration sequences cut to `seqlen` tokens, with AdamW for `epochs` passes
in batches of `batch_size`. `loss`:

- `lm` (default): next-token cross-entropy (as published: lr 1e-4, weight decay 1e-4, one epoch, batch 1);
- `kl` (lr 1e-3 by default): sum over MoE layers of KL(p_FP || p_Q) between the full-precision model's router distribution and the
  quantized one's on the same tokens (the full-precision model is reloaded from the recipe's model for the
  targets, then released).

Reported before and after: the top-k match rate (the fraction of (token, layer) pairs whose set of top-k
experts equals full precision's), the mean router KL, and the cross-entropy on those tokens. The fine-tuned
routers are the stage's hand-off (`TrainedWeights`, `trained.safetensors` in its directory), written back into
the model on `--resume` and read by every export from the model.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from compress.config import StrictModel
from compress.errors import BadInput
from compress.handoff import TrainedWeights
from compress.models.moe import frozen, moe_blocks
from compress.registry import Section, register

log = logging.getLogger(__name__)


LR = {"lm": 1e-4, "kl": 1e-3}  # default learning rate per loss


class RouterConfig(StrictModel):
    stage: Literal["finetune"] = "finetune"
    method: Literal["router"] = "router"
    loss: Literal["lm", "kl"] = Field("lm", description="lm: next-token cross-entropy (published; the lower "
                                                        "perplexity on stories-moe); kl: KL from the full-precision "
                                                        "routers' distributions (the closer routing)")
    lr: float | None = Field(None, gt=0, description="default: 1e-4 for lm (published), 1e-3 for kl")
    weight_decay: float = Field(1e-4, ge=0)
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(1, ge=1)
    samples: int = Field(128, ge=1, description="calibration sequences to train on")
    seqlen: int = Field(256, ge=2, description="tokens per sequence")


def routers(adapter) -> dict[str, torch.nn.Parameter]:
    """Every MoE router's weight, by parameter name."""
    return {f"{adapter.block_name(i)}.{adapter.arch.router}.weight": adapter.router(i).weight
            for i in moe_blocks(adapter)}


def check(adapter, cfg: RouterConfig, facts):
    if not routers(adapter):
        raise BadInput(f"`finetune: router` needs an MoE model with routers; `{adapter.model_type}` has none")
    if not facts.after_quantize:
        raise BadInput(f"stage {facts.index} (`finetune`/router) needs a `quantize` stage before it: it tunes the "
                       "routers of the quantized model toward full precision")
    return cfg


def _fingerprint(model, skip: set[str]) -> str:
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        if n not in skip:
            h.update(n.encode())
            h.update(p.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _router_logits(adapter, model, tokens: torch.Tensor, batch_size: int, grad: bool = False):
    """(per MoE layer: router logits (rows, experts) over all of `tokens`, LM loss of each batch)."""
    seen: dict[int, list] = {}
    hooks = [adapter.router(i).register_forward_hook(lambda _m, _a, out, i=i: seen.setdefault(i, []).append(out[0]))
             for i in moe_blocks(adapter)]
    losses = []
    try:
        with torch.set_grad_enabled(grad):
            for b in tokens.split(batch_size):
                losses.append(model(input_ids=b, labels=b, use_cache=False).loss)
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(v).float() for i, v in seen.items()}, losses


def _compare(fp: dict, q: dict, top_k: dict) -> tuple[float, float]:
    """(top-k set match rate, mean router KL(p_FP || p_Q)) over every (token, MoE layer)."""
    match, kl = [], []
    for i, z in q.items():
        k = top_k[i]
        a = torch.topk(fp[i], k, -1).indices.sort(-1).values
        b = torch.topk(z, k, -1).indices.sort(-1).values
        match.append((a == b).all(-1).float())
        kl.append(F.kl_div(F.log_softmax(z, -1), F.log_softmax(fp[i], -1), log_target=True, reduction="none").sum(-1))
    return float(torch.cat(match).mean()), float(torch.cat(kl).mean())


def apply(ctx, cfg: RouterConfig) -> dict:
    t0 = time.time()
    adapter, model = ctx.adapter, ctx.model
    tokens = ctx.calibration_tokens()[:cfg.samples, :cfg.seqlen]
    params = routers(adapter)
    top_k = {i: adapter.router(i).top_k for i in moe_blocks(adapter)}
    fp = ctx.reference()
    fp_logits, _ = _router_logits(fp, fp.model, tokens, cfg.batch_size)
    q_logits, losses = _router_logits(adapter, model, tokens, cfg.batch_size)
    before = _compare(fp_logits, q_logits, top_k) + (float(torch.stack(losses).mean()),)

    mark = _fingerprint(model, set(params))
    start = {n: p.detach().clone() for n, p in params.items()}
    lr = cfg.lr if cfg.lr is not None else LR[cfg.loss]
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(ctx.seed)
    rows = {i: z.shape[0] // tokens.shape[0] for i, z in fp_logits.items()}  # router rows per sequence
    bar = ctx.progress(total=cfg.epochs * -(-tokens.shape[0] // cfg.batch_size), desc=f"{ctx.key} routers",
                       unit="batch")
    with frozen(model):
        for p in params.values():
            p.requires_grad_(True)
        for _ in range(cfg.epochs):
            for idx in torch.randperm(tokens.shape[0], generator=gen).split(cfg.batch_size):
                opt.zero_grad()
                if cfg.loss == "lm":
                    loss = _router_logits(adapter, model, tokens[idx], len(idx), grad=True)[1][0]
                else:
                    z, _ = _router_logits(adapter, model, tokens[idx], len(idx), grad=True)
                    loss = sum(F.kl_div(F.log_softmax(z[i], -1), F.log_softmax(_rows(fp_logits[i], idx, rows[i]), -1),
                                        log_target=True, reduction="batchmean") for i in z)
                loss.backward()
                opt.step()
                bar.update(1)
    bar.close()
    if _fingerprint(model, set(params)) != mark:
        raise RuntimeError("router fine-tuning changed a parameter other than the routers")
    if all(torch.equal(start[n], p) for n, p in params.items()):
        raise RuntimeError("router fine-tuning left every router unchanged")
    q_logits, losses = _router_logits(adapter, model, tokens, cfg.batch_size)
    after = _compare(fp_logits, q_logits, top_k) + (float(torch.stack(losses).mean()),)
    ctx.emit(TrainedWeights({n: p.detach().clone() for n, p in params.items()}))
    out = {"loss": cfg.loss, "lr": lr, "epochs": cfg.epochs, "sequences": tokens.shape[0], "routers": len(params),
           "router_params": sum(p.numel() for p in params.values()),
           "topk_match_before": round(before[0], 6), "topk_match_after": round(after[0], 6),
           "router_kl_before": round(before[1], 6), "router_kl_after": round(after[1], 6),
           "ce_before": round(before[2], 6), "ce_after": round(after[2], 6), "seconds": round(time.time() - t0, 3)}
    log.info("router fine-tuning (%s): top-k match %.4f -> %.4f, router KL %.5f -> %.5f, CE %.4f -> %.4f", cfg.loss,
             before[0], after[0], before[1], after[1], before[2], after[2])
    return {**out, "routers": out}


def _rows(z: torch.Tensor, idx: torch.Tensor, per_seq: int) -> torch.Tensor:
    """The router rows of sequences `idx` (rows are sequence-major)."""
    return z.view(-1, per_seq, z.shape[-1])[idx].reshape(-1, z.shape[-1])


def _markdown(rt: dict) -> str:
    return (f"\n## Router fine-tuning\n\n{rt['routers']} routers ({rt['router_params']} parameters), loss "
            f"`{rt['loss']}`, {rt['epochs']} epoch(s) over {rt['sequences']} calibration sequences; against "
            "full precision on those tokens:\n\n| | top-k match | router KL | cross-entropy |\n"
            "|---|---|---|---|\n"
            f"| before | {rt['topk_match_before']} | {rt['router_kl_before']} | {rt['ce_before']} |\n"
            f"| after | {rt['topk_match_after']} | {rt['router_kl_after']} | {rt['ce_after']} |\n")


ROUTERS = Section("routers", _markdown)  # report.json `routers` and its report.md section

register("finetune", "router", RouterConfig, "router fine-tuning of a quantized MoE model (GEMQ)", check=check,
         produces=(TrainedWeights,), report=(ROUTERS,), reference=True)(apply)
