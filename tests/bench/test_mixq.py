"""The MixQ-style baseline of `python -m bench peers --scheme mxfp4` (bench/mixq.py): its mixed rounding, and on
stories-llama-1m its K = 0 cell equals compress's own `sq+rtn` MXFP4 run (same smoothing, same rounding, same
evaluation), while outlier columns at 8 bits lower the KL."""

from __future__ import annotations

import pytest
import torch

from bench.mixq import columns_of, mixed, storage_bits
from compress.quantize.activations import SCHEME_ACTIVATIONS, fp4_quant

MX = SCHEME_ACTIVATIONS["mxfp4"]


def test_mixed_rounding_keeps_outlier_columns_on_fp8_and_out_of_the_groups_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g)
    assert torch.equal(mixed(x, torch.tensor([], dtype=torch.long)), fp4_quant(x, MX))
    cols = torch.tensor([3, 40])
    loud = x.clone()
    loud[:, cols] *= 100  # outliers: without the split they would set their groups' scales
    out = mixed(loud, cols)
    rest = torch.ones(96, dtype=torch.bool)
    rest[cols] = False
    body = loud.clone()
    body[:, cols] = 0
    assert torch.equal(out[:, rest], fp4_quant(body, MX)[:, rest])  # the body as if the outliers were not there
    assert torch.equal(out[:, rest], mixed(x, cols)[:, rest])  # their size does not reach the other columns
    hi = loud[:, cols]
    assert ((out[:, cols] - hi).abs() <= hi.abs().amax(1, keepdim=True) / 448 * 16 + 1e-6).all()  # E4M3's step
    assert ((out[:, cols] - hi).abs() <= hi.abs() / 16 + 1e-6).all()  # E4M3: 3 mantissa bits, half a step
    assert not torch.equal(fp4_quant(loud, MX)[:, rest], out[:, rest])  # plain MXFP4 lets them widen the groups


def test_storage_counts_the_body_the_outliers_and_their_indices():
    assert storage_bits(8, 64, 0) == 8 * 64 * 4 + 8 * 2 * 8  # MXFP4: 4.25 bits a weight
    assert storage_bits(8, 64, 4) == 8 * 60 * 4 + 8 * 2 * 8 + 8 * 4 * 8 + 8 * 16 + 4 * 16
    assert columns_of("mixq-32") == 32


@pytest.mark.e2e
def test_mixq_zero_equals_the_sq_rtn_run_and_outliers_lower_the_kl(tmp_path):
    from conftest import MODELS

    from bench.mixq import mixq_cell
    from bench.peers import NotAvailable, compress_cell, fp_linears, windows

    path = str(MODELS / "stories-llama-1m")
    s = {"scheme": "mxfp4", "kv_cache": None, "bits": 4, "group_size": 32, "sym": True, "nsamples": 8,
         "seqlen": 64, "max_tokens": 1024, "peer_iters": 2, "mc_task": None, "mc_limit": None}
    calib = windows(path, 8, 64, 0)
    theirs = compress_cell("sq+rtn", path, s, 0, fp_linears(path), tmp_path)
    zero = mixq_cell("mixq-0", path, s, 0, calib, tmp_path)
    assert zero["tokens"] == theirs["tokens"] and zero["kl"] == pytest.approx(theirs["run_kl"], rel=1e-4)
    assert zero["effective_bits"] == 4.25 and zero["quantized_layers"] == 4 * 7
    wide = mixq_cell("mixq-32", path, s, 0, calib, tmp_path)
    assert wide["kl"] < 0.9 * zero["kl"] and 4.25 < wide["effective_bits"] < 5.5
    with pytest.raises(NotAvailable, match="mxfp4"):
        mixq_cell("mixq-32", path, {**s, "scheme": "w4a4"}, 0, calib, tmp_path)
