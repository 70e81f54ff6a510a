"""Expert statistics of MoE models (GEMQ stage A; docs/moe.md#statistics).

For every MoE layer l, routed expert e and candidate width b:

    coef(l, e, b) = sum_{tokens, hidden} g_l^2 * (z_FP - z_{e->b})^2

`z` is the MoE block's output (routing weights included), `z_{e->b}` the same with only expert e rounded to
b bits (RTN at the quantize stage's group size and symmetry), and `g_l` the gradient of the LM loss at
the output of decoder layer l (equal to dL/dz through the residual connection). Only expert e's term of z
changes, so `z_FP - z_{e->b} = w_e(t) (f_e(x_t) - f_e^b(x_t))` over the tokens t routed to e, with w_e(t)
the routing weight: one expert forward per width instead of a whole block.

Gradients stream block by block: the forward pass keeps each block's input hidden states (tokens x
hidden per block), the backward pass recomputes one block at a time from its stored input, so memory holds
one block's graph, never the whole model's; each block's coefficients are computed as soon as its gradient
exists, so one block's gradients are held at a time.

Coverage: `loads` counts the tokens routed to each expert (top-k). An expert with fewer than `min_tokens`
routed tokens is given the `min_tokens` tokens with the highest router logit for it, each at weight 1/top_k
(forced routing: what rounding it would cost where it would fire), so no expert's coefficient is zero or
undefined for lack of data. The quantizer's statistics of such an expert are forced the same way
(compress/driver.py, `collect_hessians`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compress.driver import block_forward, capture_block0_inputs
from compress.models.head import LogitHead
from compress.primitives import rtn


@dataclass
class Routing:
    """One MoE layer's routing on the calibration tokens (flattened to rows)."""

    x: torch.Tensor  # (rows, hidden) the MoE block's input
    logits: torch.Tensor  # (rows, experts) router logits
    index: torch.Tensor  # (rows, top_k) chosen experts
    weight: torch.Tensor  # (rows, top_k) their routing weights

    def loads(self) -> list[int]:
        return torch.bincount(self.index.reshape(-1), minlength=self.logits.shape[1]).tolist()

    def rows_of(self, e: int, min_tokens: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(row indices, routing weights, forced) of expert e's tokens."""
        rows, k = torch.where(self.index == e)
        if rows.numel() >= min_tokens:
            return rows, self.weight[rows, k], False
        top = torch.topk(self.logits[:, e], min(min_tokens, self.logits.shape[0])).indices
        return top, torch.full((top.numel(),), 1.0 / self.index.shape[1]), True


def moe_blocks(adapter) -> list[int]:
    return [i for i in range(len(adapter.blocks)) if adapter.experts(i) is not None]


@contextlib.contextmanager
def frozen(model):
    """Every parameter of `model` without gradients inside the block; each one's flag restored after."""
    saved = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, r in saved:
            p.requires_grad_(r)


def layer_output_grads(adapter, tokens: torch.Tensor, batch_size: int, at_block=None) -> tuple[list, list, list]:
    """(inputs, outputs' gradients, kwargs): per block, per batch, the block's input hidden states and
    dL/d(block output) of the mean next-token cross-entropy over all of `tokens`. With `at_block(i, inputs_i,
    grads_i, kwargs)`,
    each block's gradients are handed to it as soon as they exist (last block first) and not kept: memory then
    holds the blocks' inputs and one block's gradients."""
    blocks, model = adapter.blocks, adapter.model
    x0, kw = capture_block0_inputs(model, blocks[0], tokens, batch_size)
    inputs = [x0]
    with torch.no_grad():
        for i in range(len(blocks) - 1):
            inputs.append([block_forward(blocks[i], x, k) for x, k in zip(inputs[-1], kw)])
    head = LogitHead.of(adapter)
    n_targets = tokens.shape[0] * (tokens.shape[1] - 1)
    grads: list = [None] * len(blocks)
    with frozen(model), torch.enable_grad():
        g = []
        for x, k, ids in zip(inputs[-1], kw, tokens.split(batch_size)):
            h = block_forward(blocks[-1], x, k).detach().requires_grad_(True)
            z = head(h)
            loss = F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
            (loss / n_targets).backward()
            g.append(h.grad)
        for i in range(len(blocks) - 1, -1, -1):
            if at_block is None:
                grads[i] = g
            else:
                with torch.no_grad():
                    at_block(i, inputs[i], g, kw)
            if i == 0:
                break
            g_in = []
            for x, k, gb in zip(inputs[i], kw, g):
                x = x.detach().requires_grad_(True)
                block_forward(blocks[i], x, k).backward(gb)
                g_in.append(x.grad)
            g = g_in
    return inputs, grads, kw


def routing(adapter, i: int, inputs: list, kw: list) -> Routing:
    """Layer i's MoE input and router decisions on the stored block inputs."""
    moe = _moe_module(adapter, i)
    seen = []
    h = moe.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        with torch.no_grad():
            for x, k in zip(inputs, kw):
                block_forward(adapter.blocks[i], x, k)
    finally:
        h.remove()
    x = torch.cat(seen)
    router = adapter.router(i)
    with torch.no_grad():
        logits, weight, index = router(x)
    return Routing(x, logits.float(), index, weight.float())


def _moe_module(adapter, i: int):
    """The module that owns the router and the experts (its input is the MoE block's input)."""
    path = adapter.arch.experts.rpartition(".")[0]
    from compress.models.adapters import get_module

    return get_module(adapter.blocks[i], path)


@torch.no_grad()
def coefficients(adapter, i: int, r: Routing, grads: list, bits: tuple[int, ...], group_size: int, sym: bool,
                 min_tokens: int) -> tuple[torch.Tensor, list[bool]]:
    """(experts, len(bits)) float64 coefficients of MoE layer i, and which experts were force-routed."""
    experts = adapter.experts(i)
    g2 = torch.cat([g.reshape(-1, g.shape[-1]) for g in grads]).double() ** 2
    out = torch.zeros(len(experts), len(bits), dtype=torch.float64)
    forced = []
    for e in range(len(experts)):
        rows, w, was_forced = r.rows_of(e, min_tokens)
        forced.append(was_forced)
        x = r.x[rows]
        ref = experts.expert(e, x)
        linears = {n: getattr(experts[e], n) for n in ("gate_proj", "up_proj", "down_proj")}
        saved = {n: lin.weight.data.clone() for n, lin in linears.items()}
        for j, b in enumerate(bits):
            for n, lin in linears.items():
                gs = group_size if group_size != -1 and group_size <= lin.in_features else -1
                lin.weight.data = rtn(saved[n], b, gs, sym).dequantize(saved[n].dtype)
            dz = (w[:, None] * (ref - experts.expert(e, x))).double()
            out[e, j] = (g2[rows] * dz ** 2).sum()
        for n, lin in linears.items():
            lin.weight.data = saved[n]
    return out, forced


def expert_names(adapter, i: int) -> list[list[str]]:
    """Per expert of block i, its linears' module names (as `block_linears` names them)."""
    prefix = f"{adapter.block_name(i)}.{adapter.arch.experts}"
    return [[f"{prefix}.{e}.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
            for e in range(len(adapter.experts(i)))]


class Coverage:
    """Forced routing for the quantizer's statistics of MoE block i: while `collect_hessians` propagates the
    block (hooks on its linears), the MoE module's input rows are kept; `finish(counts)` then runs every expert
    that received fewer than `min_tokens` rows on the `min_tokens` rows its router scores highest, through the
    same hooked linears, so its Hessian is never empty (GPTQ would zero an expert it never saw)."""

    def __init__(self, adapter, i: int, min_tokens: int = 16):
        self.adapter, self.i, self.min_tokens = adapter, i, min_tokens

    def __enter__(self):  # re-entered when collect_hessians collects again: starts over
        self.rows: list[torch.Tensor] = []
        self.forced: list[int] = []
        moe = _moe_module(self.adapter, self.i)
        self._hook = moe.register_forward_pre_hook(
            lambda _m, args: self.rows.append(args[0].reshape(-1, args[0].shape[-1]).detach()))
        return self

    def __exit__(self, *exc):
        self._hook.remove()

    @torch.no_grad()
    def finish(self, counts: dict[str, int]) -> list[int]:
        if not self.rows:
            return []
        x = torch.cat(self.rows)
        experts = self.adapter.experts(self.i)
        logits = self.adapter.router(self.i)(x)[0].float()
        for e, names in enumerate(expert_names(self.adapter, self.i)):
            if counts.get(names[0], self.min_tokens) < self.min_tokens:
                top = torch.topk(logits[:, e], min(self.min_tokens, x.shape[0])).indices
                experts.expert(e, x[top])
                self.forced.append(e)
        self.rows = []
        return self.forced
