"""Optimised RTN (`method: rtn, optimize: true`; compress/quantize/rtn.py, docs/quantize.md#optimised-rtn): per
group never a higher weight error than plain RTN, on the same grid (codes in range, fp16 scales, integer zero
points), deterministic, through a recipe to an hf export that reloads, with allocation plans, refused with `gguf`."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import invoke
from helpers import check_reload

from compress.driver import LayerSpec
from compress.primitives import fit_mixed, group_view, rtn
from compress.quantize.rtn import RTNConfig, optimized_rtn, quantize_layer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _weights(kind: str, rows=64, cols=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(rows, cols, generator=g) * 0.02
    if kind == "heavy":  # Student-t with 2 degrees of freedom: outliers in most groups
        return torch.distributions.StudentT(2.0).sample((rows, cols)) * 0.01
    # one-sided groups and a few huge outliers (the asymmetric zero point matters)
    W = torch.rand(rows, cols, generator=g) * 0.05 - 0.01
    W[torch.rand(rows, cols, generator=g) < 0.01] *= 40
    return W


def _group_error(W, qw, group):
    return group_view((W - qw.dequantize()) ** 2, group).sum(-1)


@pytest.mark.parametrize("kind", ["normal", "heavy", "skewed"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_never_worse_than_rtn_per_group_and_on_the_same_grid(kind, sym, bits):
    """Per group, the optimised error <= plain RTN's (up to float summation order); a lower total; codes within
    [0, 2^b), scales fp16-representable, zero points integers (2^(b-1) for sym), group size 64 with a short last
    group (320 = 5 x 64, and 100 columns: 64 + 36)."""
    for cols, group in ((320, 64), (100, 64), (320, -1)):
        W = _weights(kind, cols=cols, seed=bits)
        plain, opt = rtn(W, bits, group, sym), optimized_rtn(W, bits, group, sym)
        g = cols if group == -1 else group
        e_plain, e_opt = _group_error(W, plain, g), _group_error(W, opt, g)
        assert (e_opt <= e_plain * (1 + 1e-5) + 1e-12).all(), (e_opt - e_plain).max()
        assert e_opt.sum() < e_plain.sum() * (0.995 if bits <= 4 else 1.0)
        assert int(opt.codes.max()) < 2**bits and opt.codes.dtype == torch.uint8
        assert torch.equal(opt.scales.half().float(), opt.scales) and (opt.scales.abs() >= 1e-5).all()
        assert opt.zeros.dtype == torch.uint8 and int(opt.zeros.max()) < 2**bits
        if sym:
            assert (opt.zeros == 2 ** (bits - 1)).all()
        assert (opt.bits, opt.group_size, opt.sym) == (bits, group, sym)
        assert opt.effective_bits() == plain.effective_bits()
        # the codes are the nearest ones for the stored scales and zero points (RTN's rounding rule)
        q = torch.clamp(torch.round(group_view(W, g) / opt.scales[..., None]) + opt.zeros[..., None].float(), 0,
                        2**bits - 1)
        assert torch.equal(q.reshape(W.shape[0], -1)[:, :cols].to(torch.uint8), opt.codes)


def test_the_gain_is_real():
    """Total squared error on Gaussian weights, g64: at least 5% below RTN at W4 and 15% at W2 (measured on this
    data: W4 sym 0.90, W2 sym 0.81, W2 asym 0.59 of RTN's)."""
    W = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    for bits, sym, most in ((4, True, 0.95), (4, False, 0.95), (3, False, 0.90), (2, True, 0.85), (2, False, 0.70)):
        ratio = (_group_error(W, optimized_rtn(W, bits, 64, sym), 64).sum()
                 / _group_error(W, rtn(W, bits, 64, sym), 64).sum())
        assert ratio < most, (bits, sym, ratio)


def test_deterministic_and_independent_of_threads_and_chunking(monkeypatch):
    import compress.quantize.rtn as R

    W = _weights("heavy", rows=96, cols=256, seed=3)
    a = optimized_rtn(W, 3, 64, False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        b = optimized_rtn(W, 3, 64, False)
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    monkeypatch.setattr(R, "CHUNK_ELEMENTS", 64 * 5)  # 5 groups per chunk, many chunks
    c = optimized_rtn(W, 3, 64, False)
    for x in (b, c):
        assert torch.equal(a.codes, x.codes) and torch.equal(a.scales, x.scales) and torch.equal(a.zeros, x.zeros)


def test_degenerate_groups():
    """All-zero and constant groups, a single column, one bit (the sign rule has no scale to search: plain RTN)."""
    W = torch.zeros(4, 128)
    W[1] = 0.5
    W[2, :64] = -1e-9
    for sym in (True, False):
        qw = optimized_rtn(W, 4, 64, sym)
        assert torch.equal(qw.dequantize(), rtn(W, 4, 64, sym).dequantize()) or \
            (W - qw.dequantize()).square().sum() <= (W - rtn(W, 4, 64, sym).dequantize()).square().sum()
    one = optimized_rtn(torch.randn(8, 1), 4, -1, False)
    assert one.codes.shape == (8, 1)
    W = torch.randn(8, 64)
    assert torch.equal(optimized_rtn(W, 1, 32, True).codes, rtn(W, 1, 32, True).codes)


def test_allocation_plan_chunks():
    """With a per-chunk plan, `minmax` chunks are optimised, `clip` chunks keep their clipping search, kept chunks
    stay fp16: chunk by chunk the error is at most fit_mixed's."""
    from types import SimpleNamespace

    W = _weights("heavy", rows=32, cols=256, seed=5)
    options = [(2, "minmax"), (3, "clip"), (16, "keep"), (4, "minmax")]
    mixed = SimpleNamespace(options=options, chunk_size=64, energy=None, map_bits=2)
    spec = SimpleNamespace(ggml=None, fp=None, mixed=mixed, group_size=32, sym=False, bits=4)
    opt, plain = quantize_layer(W, spec, optimize=True), fit_mixed(W, options, 64, 32, False, None, 2)
    assert opt.chunk_bits == plain.chunk_bits and opt.storage_bits() == plain.storage_bits()
    d_opt, d_plain = (W - opt.dequantize()) ** 2, (W - plain.dequantize()) ** 2
    for j in range(4):
        a, b = d_opt[:, 64 * j:64 * (j + 1)].sum(), d_plain[:, 64 * j:64 * (j + 1)].sum()
        assert a < b if options[j][1] == "minmax" else torch.equal(a, b), (j, a, b)


def test_uniform_layer_spec_and_config():
    W = _weights("normal", rows=16, cols=128)
    spec = LayerSpec(4, 64, True)
    assert torch.equal(quantize_layer(W, spec, True).codes, optimized_rtn(W, 4, 64, True).codes)
    assert torch.equal(quantize_layer(W, spec).codes, rtn(W, 4, 64, True).codes)
    assert RTNConfig().optimize is False and RTNConfig(optimize=True).optimize is True
    with pytest.raises(ValueError, match="llama.cpp's own fit"):
        RTNConfig(optimize=True, gguf="Q4_0")


def _recipe(tmp_path, model, sym=True):
    rec = {"version": 1, "model": {"path": str(model)}, "calibration": {"nsamples": 4, "seqlen": 64},
           "stages": [{"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32, "sym": sym,
                       "optimize": True}],
           "eval": {"enabled": False}, "export": {"formats": ["hf"]}}
    path = tmp_path / "rtn-opt.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


@pytest.mark.parametrize("sym", [True, False])
def test_recipe_end_to_end_hf_export_reloads(tmp_path, sym):
    """A recipe with `optimize: true` on a tiny llama writes an hf export whose packed layers are exactly
    `optimized_rtn` of the model's weights, and reloads in transformers (check_reload; asym: the checkpoint in
    auto-round's own packing, which transformers loads without a kernel package, as tests/export does)."""
    from tiny import save_tiny
    from transformers import AutoModelForCausalLM

    from compress.export.hf import export_hf, read_quantized

    path = save_tiny("llama", tmp_path / "m")
    out = tmp_path / "out"
    rc, _, err = invoke("run", _recipe(tmp_path, path, sym), "--output", out)
    assert rc == 0, err
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    qweights = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers."):
            qw = optimized_rtn(m.weight.data, 4, 32, sym)
            m.weight.data = qw.dequantize()
            qweights[name] = qw
    _, back = read_quantized(out / "hf")
    assert set(back) == set(qweights)
    for name, qw in back.items():
        ref = qweights[name]
        assert torch.equal(qw.codes, ref.codes) and torch.equal(qw.scales, ref.scales), name
        assert torch.equal(qw.zeros, ref.zeros), name
    hf = out / "hf"
    if not sym:
        hf = tmp_path / "hf-auto-round"
        export_hf(model, qweights, None, hf, packing="auto_round", dtype="float32")
    check_reload(model, qweights, hf, 512)


def test_plan_time_refusal_with_gguf(tmp_path):
    from tiny import save_tiny

    path = save_tiny("llama", tmp_path / "m")
    rec = yaml.safe_load(_recipe(tmp_path, path).read_text())
    rec["stages"][0] = {"stage": "quantize", "method": "rtn", "gguf": "Q4_0", "optimize": True}
    p = tmp_path / "g.yaml"
    p.write_text(yaml.safe_dump(rec))
    rc, _, err = invoke("run", p, "--output", tmp_path / "o", "--dry-run")
    assert rc != 0 and "optimize" in err and "llama.cpp's own fit" in err
