"""Rounding on llama.cpp's block grids: a quantize stage's `gguf: TYPE` (docs/gguf.md#rounding-on-llamacpps-grids).

With `gguf: Q4_K_M` every layer the GGUF file stores quantized gets the type llama.cpp's quantize assigns it
(`export/gguf/types.py`), and the stage's method rounds onto exactly that type's grid: the block and sub-block
parameters are fitted as llama.cpp fits them (`kernels.ggml.fit`, sub-block scales quantized as stored), with an
importance matrix where the method has calibration statistics (GPTQ: `diag(H) / 2`, the mean squared input llama.cpp's
imatrix holds; AutoRound: the same, captured on the block's inputs), and the codes come from the method: RTN
(ggml's rounding rule, `kernels.ggml.round_codes`), GPTQ (column by column with error propagation, the parameters of
each block fitted when its first column is reached), AutoRound (a tuned rounding offset per weight, the grid fixed).
The result is a `QuantizedWeight` carrying the blocks (`grid`), which evaluates to exactly what the file holds and
which the gguf export writes byte for byte.

Codes: the module `kernels.ggml` keeps ggml's own convention (signed for Q8_0, Q3_K, Q6_K); a QuantizedWeight holds
them unsigned (`code + SHIFT`) with the fixed zero point `ZERO`, so `scales * (codes - zeros) - offsets` is ggml's
dequantization.
"""

from __future__ import annotations

import numpy as np
import torch

from compress.kernels import ggml
from compress.qweight import GRID_FIELDS, QuantizedWeight


def shift(t) -> int:
    """What makes ggml's code unsigned: 128 (Q8_0), 4 (Q3_K), 32 (Q6_K), else 0."""
    return -ggml.code_range(t)[0]


def zero(t) -> int:
    """The fixed zero point of the unsigned codes: Q4_0 8, Q5_0 16, and the shift of the signed types."""
    name = ggml.ggml_type(t).name
    return shift(t) + {"Q4_0": 8, "Q5_0": 16}.get(name, 0)


def sub_block(t) -> int:
    return ggml.sub_block(t)


def code_bits(t) -> int:
    lo, hi = ggml.code_range(t)
    return (hi - lo).bit_length()


def sym(t) -> bool:
    """No float minimum: x = scale * (q - zero)."""
    return zero(t) != 0


def layer_spec(t):
    """The `LayerSpec` of a layer rounded on type `t`'s blocks."""
    from compress.driver import LayerSpec

    return LayerSpec(code_bits(t), sub_block(t), sym(t), ggml=ggml.ggml_type(t).name)


def to_qweight(params: ggml.GGMLParams, codes: np.ndarray) -> QuantizedWeight:
    """The QuantizedWeight of blocks `params` with ggml codes `codes` (int, the kernels.ggml convention)."""
    t = params.type
    scale, _ = ggml.scale_offset(t, params, slice(0, params.shape[1], ggml.sub_block(t)))
    unsigned = torch.from_numpy(np.asarray(codes, dtype=np.int16) + shift(t)).to(torch.uint8)
    zeros = torch.full(scale.shape, zero(t), dtype=torch.uint8)
    return QuantizedWeight(codes=unsigned, scales=torch.from_numpy(scale), zeros=zeros, bits=code_bits(t),
                           group_size=ggml.sub_block(t), sym=sym(t), grid=params)


def blocks(qw: QuantizedWeight, rows=None) -> ggml.GGMLBlocks:
    """The ggml blocks of a weight rounded on a llama.cpp grid (`rows`: a row order, e.g. the q/k permutation)."""
    p = qw.grid
    if p is None:
        raise ValueError("this weight was not rounded on a llama.cpp grid (no `grid`)")
    sel = slice(None) if rows is None else np.asarray(rows)
    fields = {f: (None if getattr(p, f) is None else getattr(p, f)[sel]) for f in GRID_FIELDS}
    codes = (qw.codes.to(torch.int16) - shift(p.type)).numpy().astype(np.int8)[sel]
    return ggml.GGMLBlocks(type=p.type, codes=codes, **fields)


def concat(parts: list[ggml.GGMLParams]) -> ggml.GGMLParams:
    """Block parameters of consecutive column ranges joined along the columns."""
    if len(parts) == 1:
        return parts[0]
    fields = {}
    for f in GRID_FIELDS:
        vals = [getattr(p, f) for p in parts]
        fields[f] = None if vals[0] is None else np.concatenate(vals, axis=1)
    return ggml.GGMLParams(type=parts[0].type, **fields)


def _np(W: torch.Tensor) -> np.ndarray:
    return W.detach().to(torch.float32).cpu().numpy()


def rtn(W: torch.Tensor, t, imatrix=None) -> QuantizedWeight:
    """llama.cpp's fit of the blocks (with `imatrix`, the mean squared input per column, when given), then ggml's
    rounding onto the stored grid."""
    w = _np(W)
    im = None if imatrix is None else _np(torch.as_tensor(imatrix)).reshape(-1)
    params = ggml.fit(t, w, im)
    return to_qweight(params, ggml.round_codes(t, w, params))


class GridGroups:
    """GPTQ's per-group state (`gptq._Groups`' interface) on a llama.cpp grid: the parameters of each block (32 or
    256 columns) fitted by llama.cpp's search on the error-updated weights when its first column is reached (all up
    front from `W` with `static`, as act_order needs), weighted by `imatrix`; each column rounded with ggml's rule."""

    def __init__(self, W: torch.Tensor, t, imatrix: torch.Tensor | None, static: bool):
        self.t = ggml.ggml_type(t)
        self.g = ggml.block_size(self.t)
        self.static = static
        self.imatrix = None if imatrix is None else _np(imatrix).reshape(-1)
        self.row_ms = _np(W.float().square().mean(1))  # the legacy types' imatrix search weighs by the whole row's
        n_blocks = W.shape[1] // self.g
        self.params: list[ggml.GGMLParams | None] = [None] * n_blocks
        self.scale = torch.zeros(W.shape[0], W.shape[1])
        self.offset = torch.zeros(W.shape[0], W.shape[1])
        if static:
            for k in range(n_blocks):
                self._fit(k, W[:, k * self.g:(k + 1) * self.g])

    def _fit(self, k: int, W_block: torch.Tensor) -> None:
        cols = slice(k * self.g, (k + 1) * self.g)
        im = None if self.imatrix is None else self.imatrix[cols]
        p = ggml.fit(self.t, _np(W_block), im, self.row_ms)
        self.params[k] = p
        s, o = ggml.scale_offset(self.t, p)
        self.scale[:, cols], self.offset[:, cols] = torch.from_numpy(s), torch.from_numpy(o)

    def aligned_block(self, block_size: int) -> int:
        return block_size if self.static else max(1, block_size // self.g) * self.g

    def refresh(self, j: int, W_rest: torch.Tensor) -> None:
        if not self.static and j % self.g == 0:
            self._fit(j // self.g, W_rest[:, : self.g])

    def quantize(self, w: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = j // self.g
        q = ggml.round_codes(self.t, _np(w)[:, None], self.params[k], [j - k * self.g])[:, 0]
        qt = torch.from_numpy(q.astype(np.float32))
        return (torch.from_numpy(q.astype(np.int16) + shift(self.t)).to(torch.uint8),
                self.scale[:, j] * qt - self.offset[:, j])

    def quantized_weight(self, codes: torch.Tensor) -> QuantizedWeight:
        signed = codes.to(torch.int16).numpy() - shift(self.t)
        return to_qweight(concat(self.params), signed)
