"""`rotate` stage, `method: infoquant`: InfoQuant's peak-suppressing orthogonal transform (PSOT), learned on the
calibration activations and absorbed into the weights like the fused Walsh rotation (docs/infoquant.md).

InfoQuant (arXiv 2605.26175; its code: github.com/LLIKKE/InfoQuant) shapes each linear's input so that a low-bit
uniform quantizer loses little: a small range *and* enough spread within it. Its objective has no quantizer in it:
for rotated, centred activations `U` (one row per token) and per-token weights `w`,

    cost(U) = || softmax(|U| / T) * |U| * w ||_F          (T = 2; the softmax runs over a row's channels)

a soft maximum of each token's magnitudes (peaky tokens cost most), minimised over orthogonal matrices by Cayley SGD
on the Stiefel manifold (Li et al. 2020; the step `min(lr, 1 / ||W||_1)` along the skew-symmetric direction `W`,
lr decaying linearly from `lr` to `lr / 100`), from a random-sign Walsh-Hadamard matrix. Tokens with an outlier
(any channel more than k* standard deviations from the window's mean, k* chosen adaptively where the set of outlier
positions over the first 10 windows stops changing) weigh `outlier_weight` (30), the others 1.

What is learned here, and what differs from the paper's code (which keeps the residual stream in per-layer bases and
pays two online matmuls per layer, plus online Hadamards on down_proj and q/k, for which no serving engine has an
operator):

* one residual rotation `Q1` (hidden x hidden) for the whole network, the cost of rows drawn from every layer's
  attention input (input_layernorm's output) and MLP input (post_attention_layernorm's) pooled, absorbed exactly as the
  fused Walsh rotation is (RMSNorm weights folded into their readers, embeddings `E Q1`, readers `W Q1`, writers
  `Q1^T W`): plain weights of the same architecture;
* per block and KV head a value rotation `Q2` (head_dim x head_dim) on v_proj's output and o_proj's input, the
  paper's `L_M + L_V (L_M / L_V)` (both terms balanced, the ratio not differentiated), absorbed into v_proj's rows
  and o_proj's columns;
* down_proj's input (a product of two projections) has no rotation that plain weights can carry: it is quantized as
  it is, like every method at the same scheme.

The activations are captured once, from the model with its norms folded (float32, at most `max_tokens` tokens);
the learned matrices are saved in the stage's directory, so `--resume` replays them instead of learning again.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import Field
from safetensors.torch import load, save

from compress.calibration import forward_batches
from compress.config import StrictModel
from compress.registry import register
from compress.rotation.hadamard import hadamard_transform
from compress.rotation.surgery import fuse_norms, rotate_residual, rotate_value_heads, untie_embeddings

log = logging.getLogger(__name__)


class InfoQuantConfig(StrictModel):
    stage: Literal["rotate"] = "rotate"
    method: Literal["infoquant"] = "infoquant"
    steps: int = Field(500, ge=0, description="Cayley SGD steps of the residual rotation (0: the random-sign "
                                              "Walsh-Hadamard start, unlearned)")
    head_steps: int = Field(200, ge=0, description="Cayley SGD steps of the value-head rotations")
    value_heads: bool = Field(True, description="also learn a rotation per block and KV head (v_proj / o_proj)")
    batch_tokens: int = Field(512, ge=16, description="rows drawn per step (residual: from every block's attention "
                                                      "and MLP inputs pooled; value heads: the same tokens in every "
                                                      "block)")
    max_tokens: int = Field(8192, ge=64, description="calibration tokens whose activations are captured (the "
                                                     "first windows of the calibration batch)")
    temperature: float = Field(2.0, gt=0, description="T of the softmax in the peak cost")
    outlier_weight: float = Field(30.0, ge=1, description="weight of a token with an outlier channel (others: 1)")
    lr: float = Field(2.0, gt=0, description="Cayley SGD's largest step (the step is min(lr, 1 / ||W||_1))")


# -- the objective ---------------------------------------------------------------------------------------------------

def peak_terms(u: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(|u| / T) * |u| over the last dimension, `u` centred on it first."""
    u = u - u.mean(-1, keepdim=True)
    a = u.abs()
    return torch.softmax(a / temperature, -1) * a


def peak_cost(u: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """|| softmax(|u| / T) * |u| * w ||_F with the softmax over the last dimension, `u` centred on it (..., d);
    `w` (...,) a weight per row."""
    return torch.linalg.vector_norm(peak_terms(u, temperature) * w.unsqueeze(-1))


def outlier_tokens(acts: torch.Tensor, eta: int = 10, ks: int = 50, stable: float = 0.02,
                   share: float = 0.4) -> torch.Tensor:
    """(windows, seqlen) bool: the tokens with a channel more than k* standard deviations from their window's mean
    (over the window's tokens and channels), `acts` (windows, seqlen, channels). k* is the first k >= 1 at which
    r_k = (union_k - avg_k) / union_k over the first `eta` windows changes by less than `stable` while the union
    of flagged positions is below `share` of the window (avg_k: flagged tokens per window), else the first k that
    flags nothing (InfoQuant's adaptive outlier-token selection)."""
    a = acts.float()
    mu = a.mean((1, 2), keepdim=True)
    sd = a.std((1, 2), keepdim=True, unbiased=False).clamp_min(1e-12)
    dev = ((a - mu).abs() / sd).amax(-1)  # (windows, seqlen): each token's largest deviation, in sigmas
    first, seqlen = dev[:eta], dev.shape[1]
    kstar, r_prev = ks, None
    for k in range(ks):
        flag = first > k
        union = int(flag.any(0).sum())
        if union == 0:
            kstar = k
            break
        r = (union - float(flag.sum(1).float().mean())) / union
        if r_prev is not None and abs(r - r_prev) < stable and union < share * seqlen:
            kstar = k
            break
        r_prev = r
    return dev > kstar


def cayley_step(Q: torch.Tensor, G: torch.Tensor, lr: float) -> torch.Tensor:
    """One Cayley SGD step (Li et al. 2020, InfoQuant's optimizer) of orthogonal matrices `Q` (..., n, n), used
    as `x @ Q`, with gradients `G`: the exact Cayley transform along W = W_hat - W_hat^T, step min(lr, 1/||W||_1)."""
    X = Q / torch.linalg.vector_norm(Q, dim=-1, keepdim=True).clamp_min(1e-8)
    Xt = X.transpose(-1, -2)
    MX = -G.transpose(-1, -2) @ X
    W_hat = MX - 0.5 * Xt @ (X @ MX)
    W = W_hat - W_hat.transpose(-1, -2)
    alpha = torch.clamp(1 / (W.abs().sum(-2).amax(-1) + 1e-8), max=lr)[..., None, None]
    eye = torch.eye(Q.shape[-1], dtype=Q.dtype)
    return torch.linalg.solve(eye - 0.5 * alpha * W, (eye + 0.5 * alpha * W) @ Xt).transpose(-1, -2)


def orthogonalize(Q: torch.Tensor) -> torch.Tensor:
    """The nearest orthogonal matrices (polar factor), float64: what is absorbed must be exactly orthogonal."""
    U, _, Vh = torch.linalg.svd(Q.double())
    return U @ Vh


def signed_hadamard(n: int, generator: torch.Generator) -> torch.Tensor:
    """diag(s) H / sqrt(n) with random signs s: the start of every rotation."""
    s = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1
    return s[:, None] * hadamard_transform(torch.eye(n))


# -- capture and learning --------------------------------------------------------------------------------------------

@torch.no_grad()
def capture(adapter, tokens: torch.Tensor, max_tokens: int, progress=None) -> dict:
    """{("x"|"p"|"v"|"m", block): (windows, seqlen, channels) float32} of the first windows of `tokens` (at most
    `max_tokens` tokens): attention and MLP inputs (the norms' outputs), v_proj's output and o_proj's input."""
    windows = tokens[:max(1, max_tokens // tokens.shape[1])]
    got: dict = {}
    handles = []

    def keep(key):
        return lambda x: got.setdefault(key, []).append(x.detach().float().reshape(x.shape[0], x.shape[1], -1))

    for i in range(len(adapter.blocks)):
        for key, m, where in ((("x", i), adapter.role(i, "input_norm"), "output"),
                              (("p", i), adapter.role(i, "post_attn_norm"), "output"),
                              (("v", i), adapter.role(i, "v"), "output"), (("m", i), adapter.role(i, "o"), "input")):
            f = keep(key)
            handles.append(m.register_forward_hook(lambda _m, _a, out, f=f: f(out)) if where == "output" else
                           m.register_forward_pre_hook(lambda _m, args, f=f: f(args[0])))
    try:
        forward_batches(adapter.model, windows, 8, progress)
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat(v) for k, v in got.items()}


def _weights(acts: torch.Tensor, outlier_weight: float) -> torch.Tensor:
    return 1 + (outlier_weight - 1) * outlier_tokens(acts).float().reshape(-1)


def minimise(Q: torch.Tensor, loss, steps: int, n: int, cfg: InfoQuantConfig, generator: torch.Generator,
             progress=None) -> tuple[torch.Tensor, list[float]]:
    """Cayley SGD from `Q`: each step `loss(Q, rows)` on `cfg.batch_tokens` random rows of `n`, lr decaying linearly
    from cfg.lr to cfg.lr / 100; returns the matrices and the loss of each step."""
    history = []
    for t in range(steps):
        idx = torch.randint(0, n, (cfg.batch_tokens,), generator=generator)
        Qp = Q.clone().requires_grad_(True)
        with torch.enable_grad():  # a stage may run under no_grad
            value = loss(Qp, idx)
            value.backward()
        Q = cayley_step(Q, Qp.grad, cfg.lr * (1 - 0.99 * t / max(steps, 1)))
        history.append(float(value.detach()))
        if progress:
            progress(1)
    return Q, history


def learn_residual(xs: list[torch.Tensor], ws: list[torch.Tensor], cfg: InfoQuantConfig, generator: torch.Generator,
                   progress=None) -> tuple[torch.Tensor, list[float]]:
    """Q1 (d, d) minimising the peak cost of the rows of every tap `xs[t]` (n, d), weighted by `ws[t]` (n,): each
    step's rows are drawn from all taps pooled (the inputs of every block's attention and MLP, each row RMS-normalised
    by its norm, so the taps weigh alike); returns Q1 and the cost of each step's rows."""
    X, Wt = torch.cat(xs), torch.cat(ws)  # (taps * n, d), (taps * n,)

    def loss(Q, idx):
        return peak_cost(X[idx] @ Q, Wt[idx], cfg.temperature)

    return minimise(signed_hadamard(X.shape[-1], generator), loss, cfg.steps, X.shape[0], cfg, generator, progress)


def learn_value_heads(vs: list[torch.Tensor], ms: list[torch.Tensor], wvs: list[torch.Tensor],
                      wms: list[torch.Tensor], kv: int, hd: int, cfg: InfoQuantConfig, generator: torch.Generator,
                      progress=None) -> tuple[torch.Tensor, list[float]]:
    """(blocks, kv, hd, hd) value rotations: per block, L_M + L_V (L_M / L_V) (ratio not differentiated), L_V the
    peak cost of v_proj's output per KV head, L_M of o_proj's input per query head (head h reads KV head h // g)."""
    V, M, WV, WM = torch.stack(vs), torch.stack(ms), torch.stack(wvs), torch.stack(wms)
    blocks, n = V.shape[0], V.shape[1]
    heads = M.shape[-1] // hd

    def cost(x, Q, w):  # x (blocks, b, h, hd), Q (blocks, h, hd, hd), w (blocks, b): each block's peak cost
        terms = peak_terms(x.transpose(1, 2) @ Q, cfg.temperature) * w[:, None, :, None]
        return torch.linalg.vector_norm(terms.reshape(blocks, -1), dim=1)

    def loss(Q, idx):
        lm = cost(M[:, idx].reshape(blocks, -1, heads, hd), Q.repeat_interleave(heads // kv, 1), WM[:, idx])
        lv = cost(V[:, idx].reshape(blocks, -1, kv, hd), Q, WV[:, idx])
        return (lm + lv * (lm.detach() / lv.detach().clamp_min(1e-12))).sum()

    start = signed_hadamard(hd, generator).expand(blocks, kv, hd, hd).contiguous()
    return minimise(start, loss, cfg.head_steps, n, cfg, generator, progress)


def a4_error(rows: torch.Tensor, Q: torch.Tensor | None) -> float:
    """Relative squared error of int4 per-token quantization (symmetric, compressed-tensors' W4A4 activations) of
    `rows @ Q`: the error the learned basis is for."""
    from compress.quantize.activations import ActivationSpec, fake_quant

    y = rows if Q is None else rows @ Q.float()
    return float(((fake_quant(y, ActivationSpec(bits=4)) - y) ** 2).sum() / (y ** 2).sum().clamp_min(1e-30))


# -- the stage -------------------------------------------------------------------------------------------------------

def check(adapter, cfg: InfoQuantConfig, facts=None) -> None:
    """What the fused Walsh rotation needs (pre-norm RMSNorm decoder, Walsh-Hadamard sizes for the start)."""
    from compress.rotation.walsh import WalshConfig
    from compress.rotation.walsh import check as walsh_check

    walsh_check(adapter, WalshConfig(fused=True, mode="none"))


@register("rotate", "infoquant", InfoQuantConfig,
          "InfoQuant's peak-suppressing orthogonal transform (learned residual and value-head rotations, absorbed "
          "into the weights)", check=check, replay=True)
def apply(ctx, cfg: InfoQuantConfig) -> dict:
    adapter = ctx.adapter
    check(adapter, cfg)
    heads, kv, hd = adapter.attention_shape()
    untied = untie_embeddings(adapter)
    fuse_norms(adapter)
    rel = f"{ctx.key}/rotations.safetensors"
    saved = ctx.workspace.verified(rel) if ctx.workspace is not None else None
    metrics = {"untied_embeddings": untied, "steps": cfg.steps, "head_steps": cfg.head_steps}
    if saved is not None:
        found = load(saved.read_bytes())
        Q1, Q2 = found["Q1"], found.get("Q2")
        log.info("%s: the learned rotations of the earlier run (%s)", ctx.key, rel)
    else:
        Q1, Q2, learned = _learn(ctx, adapter, cfg, kv, hd)
        metrics.update(learned)
        if ctx.workspace is not None:
            buf = {"Q1": Q1.contiguous(), **({"Q2": Q2.contiguous()} if Q2 is not None else {})}
            ctx.workspace.write_bytes(rel, save(buf))
    rotate_residual(adapter, Q1)
    if Q2 is not None:
        rotate_value_heads(adapter, list(Q2))
    return metrics


def _learn(ctx, adapter, cfg: InfoQuantConfig, kv: int, hd: int):
    tokens = ctx.calibration_tokens()
    n_windows = max(1, cfg.max_tokens // tokens.shape[1])
    bar = ctx.progress(total=-(-min(n_windows, tokens.shape[0]) // 8), desc=f"{ctx.key} capture", unit="batch")
    try:
        acts = capture(adapter, tokens, cfg.max_tokens, bar.update)
    finally:
        bar.close()
    blocks = range(len(adapter.blocks))
    g = torch.Generator().manual_seed(ctx.seed)
    flat = {k: a.reshape(-1, a.shape[-1]) for k, a in acts.items()}
    weights = {k: _weights(a, cfg.outlier_weight) for k, a in acts.items()}
    res = [k for i in blocks for k in (("x", i), ("p", i))]
    bar = ctx.progress(total=cfg.steps, desc=f"{ctx.key} residual rotation (PSOT)", unit="step")
    try:
        Q1, hist1 = learn_residual([flat[k] for k in res], [weights[k] for k in res], cfg, g, bar.update)
    finally:
        bar.close()
    Q1 = orthogonalize(Q1)
    probe = torch.cat([flat[k][:: max(1, flat[k].shape[0] // 256)] for k in res])
    out = {"calibration_tokens": int(flat[res[0]].shape[0]),
           "outlier_token_share": round(float(sum((weights[k] > 1).float().mean() for k in res)) / len(res), 4),
           "a4_error": {"none": a4_error(probe, None), "hadamard": a4_error(probe, signed_hadamard(
               Q1.shape[0], torch.Generator().manual_seed(ctx.seed))), "learned": a4_error(probe, Q1)},
           "cost_first_last": [round(hist1[0], 4), round(hist1[-1], 4)] if hist1 else None}
    Q2 = None
    if cfg.value_heads:
        bar = ctx.progress(total=cfg.head_steps, desc=f"{ctx.key} value-head rotations (PSOT)", unit="step")
        try:
            Q2, hist2 = learn_value_heads([flat[("v", i)] for i in blocks], [flat[("m", i)] for i in blocks],
                                          [weights[("v", i)] for i in blocks], [weights[("m", i)] for i in blocks],
                                          kv, hd, cfg, g, bar.update)
        finally:
            bar.close()
        Q2 = orthogonalize(Q2.reshape(-1, hd, hd)).reshape(Q2.shape)
        out["head_cost_first_last"] = [round(hist2[0], 4), round(hist2[-1], 4)] if hist2 else None
    log.info("%s: int4 per-token error of the attention/MLP inputs: none %.4f, Walsh-Hadamard %.4f, learned %.4f",
             ctx.key, out["a4_error"]["none"], out["a4_error"]["hadamard"], out["a4_error"]["learned"])
    return Q1, Q2, out
