"""Rounding on llama.cpp's grids (compress/quantize/ggml_grid.py): what a quantize stage with `gguf: TYPE` holds is
exactly ggml's blocks, and the calibrated methods lower the layer's output error below llama.cpp's own imatrix
rounding of the same weights."""

import numpy as np
import pytest
import torch

from compress.driver import LayerSpec
from compress.kernels import ggml
from compress.quantize import ggml_grid
from compress.quantize.gptq import gptq
from compress.quantize.signround import _GridTuned
from compress.qweight import qweights_to_tensors, tensors_to_qweights

TYPES = [t.name for t in ggml.TYPES]


def _data(seed=0, rows=48, n=512):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, n, generator=g)
    X = torch.randn(1024, n, generator=g) @ (torch.eye(n) + 0.3 * torch.randn(n, n, generator=g) / n**0.5)
    X = X * (0.2 + 3 * torch.rand(n, generator=g))  # uneven column importance, correlated inputs
    return W, X, 2 * X.T @ X / X.shape[0]


@pytest.mark.parametrize("t", TYPES)
def test_a_grid_weight_is_ggmls_blocks_exactly(t):
    """Dequantized by compress = ggml's dequantize_row_* of the same blocks, bit for bit; the storage is the blocks'
    bytes; checkpoints keep the blocks; RTN is llama.cpp's own rounding (same values as quantize_ref)."""
    W, _, _ = _data()
    qw = ggml_grid.rtn(W, t)
    b = ggml_grid.blocks(qw)
    assert np.array_equal(qw.dequantize().numpy(), ggml.dequantize(t, b))
    assert qw.storage_bits() == W.shape[0] * ggml.bytes_per_row(t, W.shape[1]) * 8
    assert np.array_equal(ggml.unpack(t, ggml.pack(t, b), W.shape).codes, b.codes)
    back = tensors_to_qweights(*qweights_to_tensors({"x": qw}))["x"]
    assert back.grid.type == qw.grid.type and torch.equal(back.dequantize(), qw.dequantize())
    ref = ggml.dequantize(t, ggml.quantize_ref(t, W.numpy()))
    same = (qw.dequantize().numpy() == ref).mean()
    # legacy types: llama.cpp rounds with the fp32 d before storing it as fp16; compress on the stored grid
    assert same == 1.0 if t.endswith("_K") else same > 0.99


@pytest.mark.parametrize("t", TYPES)
def test_gptq_on_the_grid_beats_llama_cpps_imatrix_rounding(t):
    """GPTQ on the type's blocks, fitted with the imatrix diag(H)/2: lower output error than llama.cpp's imatrix
    quantize of the same weight (kernels.ggml.quantize_ref with that imatrix), which beats plain RTN."""
    W, X, H = _data(1)
    qw, _ = gptq(W, H, bits=0, group_size=0, sym=True, ggml=t)
    assert qw.grid.type.name == t
    assert np.array_equal(qw.dequantize().numpy(), ggml.dequantize(t, ggml_grid.blocks(qw)))

    def err(Wq):
        return ((W - Wq) @ X.T).square().mean().item()

    imatrix = ggml.dequantize(t, ggml.quantize_ref(t, W.numpy(), (H.diag() / 2).numpy()))
    e_gptq, e_im, e_rtn = err(qw.dequantize()), err(torch.from_numpy(imatrix)), err(ggml_grid.rtn(W, t).dequantize())
    assert e_gptq < 0.97 * e_im and e_im <= e_rtn * 1.001, (e_gptq, e_im, e_rtn)  # Q8_0: no imatrix path


@pytest.mark.parametrize("t", ["Q4_K", "Q3_K", "Q2_K", "Q6_K", "Q4_0"])
def test_autoround_tunes_rounding_on_the_fixed_grid(t):
    """AutoRound's grid layer: at V = 0 its fake quantization is llama.cpp's rounding on the fitted blocks; any V
    gives codes on the same grid whose QuantizedWeight dequantizes to exactly the tuned forward pass's weights."""
    W, X, _ = _data(2, rows=16, n=256)
    tuned = _GridTuned(W, LayerSpec(4, 32, False, ggml=t), (X.square().mean(0)))
    at_zero = tuned.qdq()[0].detach()
    fitted = ggml_grid.to_qweight(tuned.grid, ggml.round_codes(t, W.numpy(), tuned.grid))
    assert (at_zero == fitted.dequantize()).float().mean() > 0.999  # legacy: trunc(x + 8.5) vs round half even
    V = (torch.rand(W.shape, generator=torch.Generator().manual_seed(0)) - 0.5)
    qw = tuned.to_qweight(V)
    assert torch.equal(qw.dequantize(), tuned.qdq(V)[0].detach())
    assert np.array_equal(qw.dequantize().numpy(), ggml.dequantize(t, ggml_grid.blocks(qw)))
    assert not torch.equal(qw.codes, fitted.codes)


@pytest.mark.parametrize("t", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K"])
def test_a_slice_fits_as_its_whole_row(t):
    """GPTQ fits each block on its own columns: with the whole row's mean square (`row_ms`, what the legacy types'
    imatrix search weighs by) a slice gets the parameters llama.cpp gives those columns of the whole row."""
    W, X, _ = _data(3, rows=8)
    im = X.square().mean(0).numpy()
    w = W.numpy()
    whole = ggml.fit(t, w, im)
    b = ggml.block_size(t)
    ms = (w.astype(np.float32) ** 2).sum(1, dtype=np.float32) / np.float32(w.shape[1])
    part = ggml.fit(t, w[:, b:2 * b], im[b:2 * b], ms)
    assert np.array_equal(part.d, whole.d[:, 1:2])
