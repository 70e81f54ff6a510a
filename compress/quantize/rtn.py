"""Round-to-nearest weight quantization (no calibration data), plain or optimised (`optimize: true`).

Optimised RTN (docs/quantize.md#optimised-rtn) searches, per group, the fp16 scale and the integer zero point
that minimise the weight reconstruction error `sum_i (w_i - s (clamp(round(w_i / s) + z, 0, 2^b - 1) - z))^2`,
with no calibration data, and keeps nearest-code rounding: the result is a plain `QuantizedWeight` on the same
integer grid as `primitives.rtn` (bits, group size, sym; full-range sym keeps `z = 2^(b-1)`), so every export
writes it unchanged. Plain RTN's own qparams are the first candidate and a candidate replaces the best only when
its error is strictly lower, so the error of every group is never above plain RTN's.

The search, vectorised over all groups of a chunk of rows (`optimized_rtn`):

1. coarse: range ratios `r` on a geometric grid from `lo(b)` to 1 (the range clipped by `r`, as
   `primitives.clip_search` clips it: `wmin * r`, `wmax * r`, so the zero point stays where RTN puts it);
2. fine: ratios between the coarse neighbours of each group's best, and for asymmetric weights the zero points
   one level either side of the best (the joint (s, z) search);
3. refit: twice, the least-squares scale for the best codes with the zero point fixed,
   `s = sum w (q - z) / sum (q - z)^2` (the closed-form step of llama.cpp's `make_qx_quants`), rounded to fp16
   and re-rounded; kept where it lowers the error.

Every candidate scale is rounded to fp16 before its error is measured, so the error compared is the stored one.

Sources, read before writing this (docs/quantize.md#optimised-rtn):

- HQQ (Badri & Shaji, 2023), `mobiusml/hqq` `hqq/core/optimize.py` `optimize_weights_proximal`: a half-quadratic
  solver of `||W - dequant(quant(W))||_p^p` (p = 0.7) that alternates nearest codes, the lp shrinkage operator on
  the residual and a closed-form update of a *float* zero point at a fixed min-max scale. A float zero is not on
  this grid (integer zero points; full-range sym has none), so its proximal step is not used; what is kept is
  its alternation of "codes for the parameters, parameters for the codes" (step 3, for the l2 error).
- auto-round 0.16.1 (`intel/auto-round`, `auto_round/data_type/int.py` `search_scales` /
  `quant_tensor_opt_rtn_sym`, `auto_round/data_type/utils.py` `get_quant_func`, `auto_round/data_type/neuqi.py`):
  with `iters=0` and opt-RTN on, symmetric int weights get a grid over the inverse scale around the min-max one
  (llama.cpp's `make_qx_quants` style), weighted by an activation imatrix it collects from calibration data;
  asymmetric weights stay plain min-max unless `enable_neuqi`, a joint (scale, integer zero point) search over a
  coarse log grid of scale fractions and a fine additive one (NeUQI, arXiv 2505.17595). Steps 1-2 follow that
  coarse + fine layout without an imatrix (calibration-free).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
from pydantic import Field, model_validator

from compress.config import QuantizeConfig
from compress.driver import BlockData
from compress.primitives import SCALE_EPS, assemble_mixed, choose_qparams, fit, group_view, quantize_codes, rtn
from compress.quantize import floatgrid, ggml_grid
from compress.quantize.spine import CHUNK_PLAN, FLOAT, SIGN, Quantizer, quantizer
from compress.qweight import QuantizedWeight

OPTIMIZE_HELP = ("search each group's fp16 scale and integer zero point for the lowest weight reconstruction error "
                 "(optimised RTN, calibration-free; the same grid and exports as plain RTN; "
                 "docs/quantize.md#optimised-rtn)")


class RTNConfig(QuantizeConfig):
    method: Literal["rtn"] = "rtn"
    optimize: bool = Field(False, description=OPTIMIZE_HELP)

    @model_validator(mode="after")
    def _optimize_on_grids(self):
        if self.optimize and self.gguf is not None:
            raise ValueError(f"`optimize: true` does not apply with `gguf: {self.gguf}`: on llama.cpp's grids the "
                             "rtn method already uses llama.cpp's own fit, which searches each block's scale (and "
                             "minimum); drop `optimize` (or `gguf`)")
        return self


@quantizer(RTNConfig, "round-to-nearest, group-wise, no calibration (`optimize: true`: per-group scale/zero search)")
class RTN(Quantizer):
    capabilities = frozenset({CHUNK_PLAN, SIGN, FLOAT})

    def quantize_block(self, data: BlockData) -> dict[str, QuantizedWeight]:
        opt = getattr(self.cfg, "optimize", False)
        gs = floatgrid.block_global_scales(data)  # NVFP4: q/k/v and gate/up share one
        return {name: quantize_layer(lin.weight.data, data.specs[name], opt, gs.get(name))
                for name, lin in data.linears.items()}


def quantize_layer(W, s, optimize: bool = False, gscale: float | None = None) -> QuantizedWeight:
    """RTN at the layer's bits, or, with an allocation plan, each chunk fitted with its own option, or on the layer's
    llama.cpp grid (`gguf`: llama.cpp's own fit and rounding without an importance matrix). `optimize`: the
    optimised RTN of this module's docstring, for a uniform layer and for a plan's `minmax` chunks (`clip` chunks
    keep their activation-weighted clipping search; 1-bit sign weights have no scale to search: plain)."""
    if s.ggml is not None:
        return ggml_grid.rtn(W, s.ggml)
    if s.fp is not None:
        return floatgrid.rtn(W, s.group_size, s.fp, gscale)
    if s.mixed is not None:
        m = s.mixed
        if not optimize:
            from compress.primitives import fit_mixed

            return fit_mixed(W, list(m.options), m.chunk_size, s.group_size, s.sym, m.energy, m.map_bits)
        return _fit_mixed_optimized(W, list(m.options), m.chunk_size, s.group_size, s.sym, m.energy, m.map_bits)
    if optimize and s.bits > 1:
        return optimized_rtn(W, s.bits, s.group_size, s.sym)
    return rtn(W, s.bits, s.group_size, s.sym)


def _fit_mixed_optimized(W, options, chunk_size, group_size, sym, energy, map_bits) -> QuantizedWeight:
    """`primitives.fit_mixed` with each `minmax` chunk rounded by `optimized_rtn`."""
    parts = []
    for j, (bits, treatment) in enumerate(options):
        a, e = j * chunk_size, min((j + 1) * chunk_size, W.shape[1])
        if bits == 16:
            parts.append(None)
        elif treatment == "minmax":
            parts.append(optimized_rtn(W[:, a:e], bits, group_size, sym))
        else:
            parts.append(fit(W[:, a:e], bits, treatment, group_size, sym, None if energy is None else energy[a:e]))
    return assemble_mixed(W, parts, chunk_size, group_size, sym, map_bits)


# -- the search ------------------------------------------------------------------------------------------
COARSE = 8  # geometric ratios from lo(bits) to 1 (1 is plain RTN's range)
FINE = 4  # ratios strictly between the best coarse ratio's neighbours
REFITS = 2  # least-squares scale refits of the best codes
CHUNK_ELEMENTS = 1 << 17  # weights per chunk of groups (temporaries of 512 KB: in cache)


def lowest_ratio(bits: int) -> float:
    """The smallest range ratio searched: wider clipping pays at fewer bits (auto-round's NeUQI bounds its scale
    fractions by 0.25 / 0.15 / 0.05 at >= 4 / 3 / 2 bits; without an imatrix the heavy clipping of its 2-bit bound
    never won here, so 0.3)."""
    return 0.5 if bits >= 4 else 0.4 if bits == 3 else 0.3


def coarse_ratios(bits: int) -> torch.Tensor:
    lo = lowest_ratio(bits)
    return torch.logspace(math.log10(lo), 0.0, COARSE, dtype=torch.float64, device="cpu").float()


def optimized_rtn(W: torch.Tensor, bits: int, group_size: int, sym: bool) -> QuantizedWeight:
    """Optimised RTN (module docstring): per group the fp16 scale and integer zero point with the lowest squared
    reconstruction error among plain RTN's and the searched candidates; codes are the nearest ones for them
    (`quantize_codes`), so the layout is exactly `primitives.rtn`'s."""
    if bits == 1:
        return rtn(W, bits, group_size, sym)
    d_out, d_in = W.shape
    s0, z0 = choose_qparams(W, bits, group_size, sym)  # plain RTN: the first candidate
    g = d_in if group_size == -1 else group_size
    Wg = group_view(W.detach().float(), g)  # (d_out, n_groups, g), the short last group zero-padded (error 0)
    n_groups = Wg.shape[1]
    flat, s0f, z0f = Wg.reshape(-1, g), s0.reshape(-1, 1), z0.reshape(-1, 1)
    best_s, best_z = s0f.clone(), z0f.clone()
    ratios = coarse_ratios(bits).to(W.device)
    rows = max(1, CHUNK_ELEMENTS // g)

    def run(a):
        sl = slice(a, min(a + rows, flat.shape[0]))
        best_s[sl], best_z[sl] = _search(flat[sl], s0f[sl], z0f[sl], bits, sym, ratios)

    on_threads(run, range(0, flat.shape[0], rows))
    s, z = best_s.reshape(d_out, n_groups), best_z.reshape(d_out, n_groups)
    codes = quantize_codes(W, s, z, bits, group_size)
    return QuantizedWeight(codes=codes, scales=s, zeros=z.to(torch.uint8), bits=bits, group_size=group_size, sym=sym)


def on_threads(fn, items) -> None:
    """`fn` on every item, the items spread over `torch.get_num_threads()` Python threads, each torch op on one
    intra-op thread: the chunks are independent and small, and OpenMP's barriers on every small op cost more than
    the op (10x slower on a loaded 2-core machine, measured). The result does not depend on the thread count."""
    threads = torch.get_num_threads()
    items = list(items)
    torch.set_num_threads(1)
    try:
        if threads == 1 or len(items) == 1:
            for it in items:
                fn(it)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, items))
    finally:
        torch.set_num_threads(threads)


def _fp16_scale(s: torch.Tensor) -> torch.Tensor:
    """`s` rounded to fp16 with its magnitude kept >= SCALE_EPS (sign kept: full-range sym scales may be < 0)."""
    s = torch.where(s < 0, s.clamp(max=-SCALE_EPS), s.clamp(min=SCALE_EPS))
    return s.half().float()


def _error(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmax: int) -> torch.Tensor:
    """Per group squared error of nearest codes for (s, z), as `quantize_codes` rounds them."""
    q = torch.div(x, s).round_().add_(z).clamp_(0, qmax)
    return q.sub_(z).mul_(s).sub_(x).square_().sum(-1, keepdim=True)


def _search(x, s0, z0, bits, sym, ratios):
    """The best (s, z) per group of `x` (groups, g) by the coarse, fine and refit steps; starts from RTN's."""
    qmax = 2**bits - 1
    best_s, best_z, best_e = s0, z0, _error(x, s0, z0, qmax)
    # the range of each group as RTN takes it, so that ratio r clips it as clip_search does (the zero point stays)
    wmin = x.amin(-1, keepdim=True).clamp(max=0)
    wmax = x.amax(-1, keepdim=True).clamp(min=0)
    if sym:
        span = s0.sign() * torch.maximum(-wmin, wmax) / 2 ** (bits - 1)  # RTN's scale before fp16 rounding

    def candidate(r):
        if sym:
            return _fp16_scale(span * r), z0
        s = _fp16_scale((wmax - wmin) * r / qmax)
        return s, torch.round(-wmin * r / s).clamp_(0, qmax)

    def consider(s, z):
        nonlocal best_s, best_z, best_e
        e = _error(x, s, z, qmax)
        better = e < best_e
        best_s, best_z, best_e = torch.where(better, s, best_s), torch.where(better, z, best_z), torch.minimum(e, best_e)

    n = len(ratios)
    best_i = torch.full_like(s0, n - 1, dtype=torch.long)  # index of each group's best coarse ratio (n-1: RTN)
    for i, r in enumerate(ratios[:-1].tolist()):  # the last coarse ratio, 1, is RTN itself
        before = best_e
        consider(*candidate(r))
        best_i = torch.where(best_e < before, i, best_i)
    # fine: between the neighbours of each group's best coarse ratio
    lo, hi = ratios[(best_i - 1).clamp(min=0)], ratios[(best_i + 1).clamp(max=n - 1)]
    for t in (torch.arange(1, FINE + 1, dtype=torch.float32, device="cpu") / (FINE + 1)).tolist():
        r = lo * (1 - t) + hi * t
        s, z = candidate(r)
        consider(s, z)
    if not sym:  # the joint search: the best scale with the zero point one level either side
        s_b, z_b = best_s, best_z
        for dz in (-1.0, 1.0):
            consider(s_b, (z_b + dz).clamp(0, qmax))
    for _ in range(REFITS):  # least squares: the scale for the best codes, zero point fixed
        q = torch.div(x, best_s).round_().add_(best_z).clamp_(0, qmax).sub_(best_z)
        den = q.square().sum(-1, keepdim=True)
        s = torch.where(den > 0, (x * q).sum(-1, keepdim=True) / den.clamp(min=1e-30), best_s)
        consider(_fp16_scale(s), best_z)
    return best_s, best_z
