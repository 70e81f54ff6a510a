"""The SignRound tuner (arXiv 2309.05516) with Intel auto-round's quantizers and optimizer: what the `autoround`
quantizer (autoround.py) runs on every block and the spine's final-block objective runs on the last one.

Per block (docs/quantize.md#autoround): every linear gets a rounding perturbation V (init 0) and, with
minmax tuning, per-group range coefficients alpha, beta (init 1, clamped to [0, 1]). The block's
output on the quantized-model inputs is fitted to the full-precision block's output on the
full-precision inputs by MSE (the last block optionally through the frozen LM head: `final_block`,
see lfq.py), with auto-round's `SignSGD` (p <- p - lr * sign(grad)), lr decayed
linearly to 0 over `iters`, keeping the parameters of the best loss seen. Fake quantization is
auto-round's own `int_sym` (full range, scales may be negative) / `int_asym`, so the rounding is
auto-round's; the loop runs in our driver on our calibration data (auto-round's own default would
download a dataset).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD
from auto_round.data_type.int import quant_tensor_asym, quant_tensor_sym
from pydantic import Field

from compress.config import FINAL_BLOCK_HELP, FinalBlock, QuantizeConfig
from compress.driver import BlockData, LayerSpec, block_forward
from compress.primitives import assemble_mixed, group_view, resolve_group
from compress.quantize.lfq import logit_loss_backward
from compress.qweight import KEEP_BITS, QuantizedWeight


class AutoRoundConfig(QuantizeConfig):
    method: Literal["autoround"] = "autoround"
    iters: int = Field(200, ge=0, description="sign-gradient steps per block (0 = RTN)")
    lr: Optional[float] = Field(None, gt=0, description="learning rate; default 1/iters")
    batch_size: int = Field(8, gt=0, description="calibration samples per step")
    minmax_tuning: bool = Field(True, description="also tune the per-group range (alpha, beta)")
    quanted_input: bool = Field(True, description="feed each block the quantized model's inputs")
    final_block: FinalBlock = Field("auto", description=FINAL_BLOCK_HELP)  # the method's own objective otherwise
    chunk_tokens: int = Field(512, gt=0, description="tokens per full-vocabulary logit chunk (final_block)")


class _Tuned:
    """Tunable parameters of one linear: V (d_out*n_groups, g), alpha and beta (d_out*n_groups,).

    Columns narrower than the group (the short last chunk of a mixed layer: its one, short group) are tuned as one
    group of their own width: auto-round's quantizers do not pad a row shorter than `group_size`."""

    def __init__(self, W: torch.Tensor, spec: LayerSpec, minmax: bool):
        self.W, self.spec = W.float(), spec
        g = resolve_group(W.shape[1], spec.group_size)
        self.group = spec.group_size if g <= W.shape[1] else W.shape[1]
        g = min(g, W.shape[1])
        rows = W.shape[0] * group_view(W, g).shape[1]
        self.V = torch.zeros(rows, g, device=W.device, requires_grad=True)
        self.alpha = torch.ones(rows, device=W.device, requires_grad=minmax)
        self.beta = torch.ones(rows, device=W.device, requires_grad=minmax)
        grouped = group_view(self.W, g).reshape(rows, g)
        self.wmin, self.wmax = grouped.amin(1).clamp(max=0), grouped.amax(1).clamp(min=0)

    def params(self):
        return [self.V] + ([self.alpha, self.beta] if self.alpha.requires_grad else [])

    def qdq(self, V=None, alpha=None, beta=None):
        fn = quant_tensor_sym if self.spec.sym else quant_tensor_asym
        with torch.no_grad():
            self.alpha.clamp_(0, 1), self.beta.clamp_(0, 1)
        return fn(self.W, bits=self.spec.bits, group_size=self.group,
                  v=self.V if V is None else V, min_scale=self.alpha if alpha is None else alpha,
                  max_scale=self.beta if beta is None else beta, tensor_min=self.wmin, tensor_max=self.wmax)

    def snapshot(self):
        return tuple(t.detach().clone() for t in (self.V, self.alpha, self.beta))

    def to_qweight(self, V, alpha, beta) -> QuantizedWeight:
        """Codes exactly as auto-round rounds them: clamp(round(w/s + V) + z)."""
        _, s, zp = self.qdq(V, alpha, beta)
        b, d_out = self.spec.bits, self.W.shape[0]
        g = V.shape[1]
        Wg = group_view(self.W, g).reshape(-1, g)
        s = s.reshape(-1, 1).float()
        if self.spec.sym:
            m = 2 ** (b - 1)
            q = torch.clamp(torch.round(Wg / s + V), -m, m - 1) + m
            z = torch.full_like(s, m)
        else:
            z = zp.reshape(-1, 1).float()
            q = torch.clamp(torch.round(Wg / s + V) + z, 0, 2**b - 1)
        codes = q.reshape(d_out, -1)[:, : self.W.shape[1]].to(torch.uint8)
        return QuantizedWeight(codes=codes, scales=s.reshape(d_out, -1), zeros=z.reshape(d_out, -1).to(torch.uint8),
                               bits=b, group_size=self.spec.group_size, sym=self.spec.sym)


class _MixedTuned:
    """A layer with an allocation plan (per-chunk bits): one `_Tuned` per bit width over that width's chunks
    (whole chunks, so groups stay whole), chunks kept in fp16 fixed. The treatment of a unit only shapes the
    allocation's proxy error: AutoRound's own range tuning (alpha, beta) replaces the clipping search."""

    def __init__(self, W: torch.Tensor, spec: LayerSpec, minmax: bool):
        m = spec.mixed
        self.W, self.spec, self.c = W.float(), spec, m.chunk_size
        d_in = W.shape[1]
        bounds = [(s, min(s + self.c, d_in)) for s in range(0, d_in, self.c)]
        self.cols, self.slices = {}, {}
        for (s, e), (bits, _) in zip(bounds, m.options):
            self.cols.setdefault(bits, []).extend(range(s, e))
        for bits, cols in self.cols.items():
            if bits != KEEP_BITS:
                sub = replace(spec, bits=bits, mixed=None)
                self.slices[bits] = _Tuned(self.W[:, cols], sub, minmax)
        self.base = self.W.half().float()  # kept chunks: fp16 values

    def params(self):
        return [p for t in self.slices.values() for p in t.params()]

    def qdq(self, *snap):
        W = self.base.clone()
        for k, (bits, t) in enumerate(self.slices.items()):
            W[:, self.cols[bits]] = t.qdq(*(snap[k] if snap else ()))[0]
        return (W,)

    def snapshot(self):
        return tuple(t.snapshot() for t in self.slices.values())

    def to_qweight(self, *snap) -> QuantizedWeight:
        """Each width's tuned codes cut back into chunks, then one mixed QuantizedWeight."""
        m, g = self.spec.mixed, self.spec.group_size
        parts, done = [], {bits: t.to_qweight(*snap[k]) for k, (bits, t) in enumerate(self.slices.items())}
        pos = {bits: 0 for bits in done}
        for s in range(0, self.W.shape[1], self.c):
            e = min(s + self.c, self.W.shape[1])
            bits = m.options[s // self.c][0]
            if bits == KEEP_BITS:
                parts.append(None)
                continue
            qw, a = done[bits], pos[bits]
            ga, gb = a // g, math.ceil((a + e - s) / g)
            parts.append(QuantizedWeight(codes=qw.codes[:, a:a + e - s], scales=qw.scales[:, ga:gb],
                                         zeros=qw.zeros[:, ga:gb], bits=bits, group_size=g, sym=qw.sym))
            pos[bits] += e - s
        return assemble_mixed(self.W, parts, self.c, g, self.spec.sym, m.map_bits)


class _GridTuned:
    """A layer on a llama.cpp grid (`gguf`, compress/quantize/ggml_grid.py): the blocks fitted once by llama.cpp's
    search weighted by the importance matrix of the block's inputs, then only the rounding offset V (rows, n) tuned:
    q = clamp(round((w + offset) / scale + V)), x = scale * q - offset, the stored grid's own arithmetic. The range
    tuning (alpha, beta) has no counterpart on a grid whose scales are fixed by the search."""

    def __init__(self, W: torch.Tensor, spec: LayerSpec, imatrix: torch.Tensor | None):
        from compress.kernels import ggml

        self.W, self.t = W.float(), spec.ggml
        self.grid = ggml.fit(self.t, self.W.numpy(), None if imatrix is None else imatrix.numpy())
        s, o = ggml.scale_offset(self.t, self.grid)
        self.scale, self.offset = torch.from_numpy(s), torch.from_numpy(o)
        self.lo, self.hi = ggml.code_range(self.t)
        self.live = self.scale != 0
        self.safe = torch.where(self.live, self.scale, torch.ones_like(self.scale))
        self.V = torch.zeros_like(self.W, requires_grad=True)

    def params(self):
        return [self.V]

    def _codes(self, V):
        x = (self.W + self.offset) / self.safe + V
        q = x + (torch.round(x) - x).detach()  # straight-through rounding
        return torch.where(self.live, q.clamp(self.lo, self.hi), torch.zeros_like(q))

    def qdq(self, V=None):
        return (self.scale * self._codes(self.V if V is None else V) - self.offset,)

    def snapshot(self):
        return (self.V.detach().clone(),)

    def to_qweight(self, V) -> QuantizedWeight:
        from compress.quantize import ggml_grid

        with torch.no_grad():
            q = self._codes(V)
        return ggml_grid.to_qweight(self.grid, q.to(torch.int16).numpy())


class _FloatTuned:
    """A layer on a float grid (`scheme: fp8`, `nvfp4a16`; compress/quantize/floatgrid.py): the group scales fixed
    by the format's observer (NVFP4: under the fused layers' shared global scale), then only a rounding offset V per
    weight tuned, added to w / s before the element's rounding (auto-round's `nv_fp4` / fp8 arithmetic: x / s + V,
    clamped, rounded with a straight-through gradient). The range tuning (alpha, beta) is not applied: the scales
    stay the observer's, as the export's checkers expect them."""

    def __init__(self, W: torch.Tensor, spec: LayerSpec, gscale: float | None):
        from compress.quantize import floatgrid

        self.W, self.spec, self.gscale = W.float(), spec, gscale
        if spec.fp == "e2m1" and gscale is None:
            self.gscale = floatgrid.global_scale(self.W)
        self.s = floatgrid.scales(self.W, spec.group_size, spec.fp, self.gscale)
        self.s_col = floatgrid.per_column(self.s, W.shape[1], resolve_group(W.shape[1], spec.group_size))
        self.V = torch.zeros_like(self.W, requires_grad=True)

    def params(self):
        return [self.V]

    def qdq(self, V=None):
        from compress.quantize import floatgrid

        return (floatgrid.round_ste(self.W / self.s_col + (self.V if V is None else V), self.spec.fp) * self.s_col,)

    def snapshot(self):
        return (self.V.detach().clone(),)

    def to_qweight(self, V) -> QuantizedWeight:
        from compress.quantize import floatgrid

        with torch.no_grad():
            codes = floatgrid.encode(self.W / self.s_col + V, self.spec.fp)
        return floatgrid.weight(codes, self.s, self.spec.group_size, self.spec.fp, self.gscale)


def _tuned(W: torch.Tensor, spec: LayerSpec, minmax: bool, imatrix=None, gscale=None):
    if spec.ggml is not None:
        return _GridTuned(W, spec, imatrix)
    if getattr(spec, "fp", None) is not None:
        return _FloatTuned(W, spec, gscale)
    return _MixedTuned(W, spec, minmax) if spec.mixed is not None else _Tuned(W, spec, minmax)


def input_importance(data: BlockData, names) -> dict[str, torch.Tensor]:
    """{linear: mean squared input per column} over the block's calibration inputs (what llama.cpp's imatrix
    holds), for the layers `names`."""
    sums, counts, hooks = {}, {}, []

    def hook(name):
        def record(_, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.square().sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return record

    for n in names:
        hooks.append(data.linears[n].register_forward_pre_hook(hook(n)))
    try:
        with torch.no_grad():
            for x, kw in zip(data.inputs, data.kwargs):
                block_forward(data.block, x, kw)
    finally:
        for h in hooks:
            h.remove()
    return {n: sums[n] / counts[n] for n in sums}


def signround_block(data: BlockData, cfg: AutoRoundConfig) -> dict[str, QuantizedWeight]:
    """Tune one block; returns the best QuantizedWeight of each linear in `data.linears`."""
    from compress.quantize.floatgrid import block_global_scales

    grid = [n for n in data.linears if data.specs[n].ggml is not None]
    imatrix = input_importance(data, grid) if grid else {}
    gs = block_global_scales(data)  # NVFP4: q/k/v and gate/up share one
    tuned = {n: _tuned(lin.weight.data, data.specs[n], cfg.minmax_tuning, imatrix.get(n), gs.get(n))
             for n, lin in data.linears.items()}
    inputs = data.inputs if cfg.quanted_input else data.fp_inputs
    originals = {n: lin.forward for n, lin in data.linears.items()}
    for n, lin in data.linears.items():
        lin.forward = (lambda t, l: lambda x: F.linear(x, t.qdq()[0].to(x.dtype), l.bias))(tuned[n], lin)
    best = {n: t.snapshot() for n, t in tuned.items()}
    try:
        if cfg.iters > 0:
            best = _tune(data, tuned, inputs, cfg)
    finally:
        for n, lin in data.linears.items():
            lin.forward = originals[n]
    return {n: tuned[n].to_qweight(*best[n]) for n in tuned}


def _tune(data: BlockData, tuned: dict, inputs, cfg: AutoRoundConfig):
    lr = cfg.lr or 1.0 / cfg.iters
    params = [p for t in tuned.values() for p in t.params()]
    opt = SignSGD(params, lr=lr, weight_decay=0)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=cfg.iters)
    g = torch.Generator().manual_seed(data.seed)
    order = torch.randperm(len(inputs), generator=g, device="cpu").tolist()  # the same order on every device
    best_loss, best = float("inf"), {n: t.snapshot() for n, t in tuned.items()}
    through_head = data.head is not None and cfg.final_block != "same"
    for block_param in data.block.parameters():
        block_param.requires_grad_(False)
    for it in range(cfg.iters):
        j = order[it % len(order)]
        opt.zero_grad()
        out = block_forward(data.block, inputs[j], data.kwargs[j])
        if through_head:
            loss = logit_loss_backward(out, data.fp_targets[j], data.head, cfg.final_block,
                                       data.tokens[j] if data.tokens else None, cfg.chunk_tokens)
        else:
            mse = F.mse_loss(out.float(), data.fp_targets[j].float())
            (mse * 1000).backward()  # auto-round's scale; irrelevant to SignSGD's sign
            loss = mse.item()
        if loss < best_loss:  # the parameters that produced this loss (the step comes after)
            best_loss, best = loss, {n: t.snapshot() for n, t in tuned.items()}
        opt.step()
        sched.step()
    return best
