"""CPU kernel vs the reference (dequantize, then matmul), the cpu-rows layout, QuantLinear and fallbacks."""

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import held_lock
from kernel_cases import assert_close_to_reference, rand_qw
from tiny import tiny_causal

from compress.kernels import cpu
from compress.kernels.backends import (
    CPU,
    QuantLinear,
    Reference,
    quantize_model,
    select,
)
from compress.qweight import QuantizedWeight


@pytest.fixture(scope="module")
def ext():
    mod = cpu.extension()
    if mod is None:
        pytest.fail("the cpu kernel did not build; a C++ compiler is expected on this machine")
    return mod


@pytest.fixture(params=["kernel", "prefill"])
def path(request, monkeypatch):
    """Run the test on the batch-1 kernel at every row count, then on the prefill path (dequantize, BLAS)."""
    monkeypatch.setattr(cpu, "prefill_rows", lambda p, act: 2**62 if request.param == "kernel" else 1)
    return request.param


CASES = [  # bits, group, (out, in): in not a multiple of the group -> short last group
    (4, 128, (48, 256)), (4, 128, (40, 300)), (2, 64, (48, 256)), (2, 64, (33, 200)),
    (8, 128, (24, 200)), (4, -1, (32, 100)), (2, -1, (16, 72)), (4, 32, (16, 96)), (2, 32, (16, 160)),
    (3, 128, (40, 300)), (3, 32, (16, 96)), (3, -1, (16, 100)),
]


@pytest.mark.parametrize("bits,group,shape", CASES)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("scalar", [False, True])
def test_kernel_matches_reference(ext, bits, group, shape, sym, scalar, path):
    qw = rand_qw(*shape, bits, group, sym)
    backend = CPU(scalar=scalar)
    state = backend.prepare(qw)
    for batch in (1, 3, 8, 13):
        x = torch.randn(batch, shape[1])
        assert_close_to_reference(backend.matmul(x, state), Reference().matmul(x, qw))


A8_CASES = [(*c, "rows") for c in CASES if c[0] in cpu.A8_BITS] + [(*c, "tiles") for c in CASES if c[0] in (2, 3)]


@pytest.mark.parametrize("bits,group,shape,layout", A8_CASES)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("scalar,avx512", [(False, True), (False, False), (True, False)])
def test_int8_activations_match_reference_on_rounded_x(ext, bits, group, shape, layout, sym, scalar, avx512, path):
    """cpu-a8 is exact for the activations it rounds: compare with the reference on those (both layouts of
    2-bit weights; batches 1, 5, 8 run every batch tile, 33 rows a part-filled row tile)."""
    qw = rand_qw(*shape, bits, group, sym)
    state = cpu.pack(qw, layout)
    block = cpu.xblock(state)
    for batch in (1, 5, 8):
        x = torch.randn(batch, shape[1])
        xpad = torch.nn.functional.pad(x, (0, state.kpad - shape[1]))
        xq, sx = cpu.quantize_x(xpad, block)
        xhat = (xq.view(batch, -1, block).float() * sx.unsqueeze(-1)).view(batch, -1)[:, : shape[1]]
        y = cpu.matmul(x, state, act="int8", scalar=scalar, avx512=avx512)
        assert_close_to_reference(y, Reference().matmul(xhat, qw))
        assert (xhat - x).abs().max() <= x.abs().max() / 254 + 1e-6  # the rounding it documents


@pytest.mark.parametrize("bits,group,layout", [(2, 32, "rows"), (2, 64, "rows"), (2, 128, "rows"), (4, 32, "rows"),
                                               (4, 128, "rows"), (2, -1, "rows"), (2, 32, "tiles"),
                                               (2, 64, "tiles"), (2, 128, "tiles"), (2, -1, "tiles")])
@pytest.mark.parametrize("avx512", [True, False])
def test_int8_activations_at_the_extremes(ext, bits, group, layout, avx512):
    """Largest codes times activations that all round to +-127: the int16 partial sums of the paths
    without VNNI must not saturate or wrap (a wrong bound shows here, not on random data)."""
    n, k = 24, 2048
    codes = torch.full((n, k), 2**bits - 1, dtype=torch.uint8)
    ng = 1 if group == -1 else k // group
    qw = QuantizedWeight(codes=codes, scales=torch.full((n, ng), 2.0**-7), zeros=torch.zeros(n, ng, dtype=torch.uint8),
                         bits=bits, group_size=group, sym=False)
    state = cpu.pack(qw, layout)
    for x in (torch.ones(1, k), -torch.ones(1, k), torch.ones(3, k)):
        y = cpu.matmul(x, state, act="int8", avx512=avx512)
        assert_close_to_reference(y, Reference().matmul(x, qw))


def test_prefill_path_is_taken_from_the_cut_over_and_matches_the_kernel(ext, monkeypatch):
    """Below `prefill_rows` the kernel runs, from it on `matmul_dequant` (its buffer reused, sliced when the weight
    is larger than one slice); both agree, for every layout, with 3-bit planes and int8 activations."""
    calls = []
    real = cpu.matmul_dequant
    monkeypatch.setattr(cpu, "matmul_dequant", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cpu, "SLICE_ELEMENTS", 40 * 300)  # 40 rows a slice: 3 slices for 100 rows
    for bits, group, layout, act in [(4, 128, "rows", "fp32"), (3, 128, "tiles", "int8"), (2, 64, "tiles", "int8"),
                                     (8, 32, "rows", "int8"), (3, -1, "rows", "fp32")]:
        qw = rand_qw(100, 300, bits, group, sym=False)
        state = cpu.pack(qw, layout)
        cut = cpu.prefill_rows(state, act)
        assert 1 < cut < 2**62 or act == "int8"
        x = torch.randn(min(cut, 64), 300)
        calls.clear()
        below = cpu.matmul(x[:1], state, act=act)
        assert not calls
        y = cpu.matmul(x, state, act=act, prefill=2)
        assert calls and y.shape == (x.shape[0], 100)
        assert_close_to_reference(y, cpu.matmul(x, state, act=act, prefill=2**62))
        assert_close_to_reference(y[:1], below)


def test_dequantize_matches_the_quantized_weight(ext):
    for bits, group, layout in [(4, 128, "rows"), (2, 64, "tiles"), (3, 32, "rows"), (3, 128, "tiles"),
                                (8, -1, "rows"), (2, 32, "rows")]:
        qw = rand_qw(37, 200, bits, group, sym=False)
        assert torch.equal(cpu.dequantize(cpu.pack(qw, layout)), qw.dequantize(torch.float32))


def test_tiles_layout_known_answer(ext):
    """cpu-tiles: byte 2r + j of vector o, field f, is row r, column 8o + 2f + j; metadata (tiles, groups, 16)."""
    n, k = 20, 256
    codes = ((torch.arange(n).view(n, 1) * 7 + torch.arange(k).view(1, k) * 3) % 4).to(torch.uint8)
    qw = QuantizedWeight(codes=codes, scales=torch.arange(n * 4, dtype=torch.float32).view(n, 4) / 64,
                         zeros=(torch.arange(n * 4) % 4).to(torch.uint8).view(n, 4), bits=2, group_size=64, sym=False)
    p = cpu.pack(qw, "tiles")
    assert p.words.shape == (2, k) and p.scales.shape == (2, 4, 16) and p.kpad == k and p.out_features == n
    b = p.words.contiguous().view(torch.uint8).view(2, k // 8, 32).to(torch.int64)
    for t in range(2):
        for r in range(16):
            row = 16 * t + r
            for col in range(k):
                o, f, j = col // 8, (col % 8) // 2, col % 2
                want = int(codes[row, col]) if row < n else 0
                assert (b[t, o, 2 * r + j] >> (2 * f)) & 3 == want
            for g in range(4):
                assert p.scales[t, g, r].item() == (qw.scales[row, g].item() if row < n else 0)
                assert p.zeros[t, g, r].item() == (qw.zeros[row, g].item() if row < n else 0)


def test_tiles_are_picked_where_the_build_prefers_them(ext):
    assert ext.prefers_tiles() == ext.has_avx2()
    qw2, qw4 = rand_qw(16, 128, 2, 64, False), rand_qw(16, 128, 4, 64, False)
    want = cpu.PackedTiles if ext.prefers_tiles() else cpu.PackedCPU
    assert isinstance(CPU(act="int8").prepare(qw2), want)
    assert isinstance(CPU(act="int8").prepare(qw4), cpu.PackedCPU) and isinstance(CPU().prepare(qw2), cpu.PackedCPU)
    assert isinstance(CPU(act="int8").prepare(rand_qw(16, 128, 3, 64, False)).lo, want)  # int3's 2-bit plane
    with pytest.raises(ValueError, match="int8 activations only"):
        cpu.matmul(torch.ones(1, 128), cpu.pack(qw2, "tiles"))
    with pytest.raises(ValueError, match="2 bits only"):
        cpu.pack(qw4, "tiles")
    with pytest.raises(ValueError, match="unknown cpu layout"):
        cpu.pack(qw2, "columns")


def test_avx2_and_avx512_compiled_here(ext):
    flags = cpu._cpu_flags().decode().split()
    assert ext.has_avx2() == ("avx2" in flags)
    avx512 = all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512_vnni"))
    assert ext.has_avx512() == (avx512 and cpu.build_isa() == "native")


@pytest.mark.e2e  # moved out of the default tier (its time budget); CI runs -m e2e
@pytest.mark.skipif(cpu.build_isa() != "native", reason="this is the run it starts")
def test_every_kernel_test_passes_with_the_avx2_build():
    """The whole file again in a child process with the kernel built for AVX2 (`COMPRESS_CPU_ISA=avx2`,
    -march=haswell: no AVX-512 instruction, the AVX2 zero-point correction): what AVX2-only CPUs run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "COMPRESS_CPU_ISA": "avx2"}
    # the file's own tiers (this e2e test included, so it can skip itself there), on one worker
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           "-m", "not slow and not gpu", __file__],
                          cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" in proc.stdout  # this test skipped itself there


def test_build_isa_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setenv("COMPRESS_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="COMPRESS_CPU_ISA='avx9'"):
        cpu.build_isa()


def test_layout_known_answer():
    """Byte t of word i holds column 32*s + 4*i + t in field s (module docstring of kernels/cpu.py)."""
    for bits in (1, 2, 4, 8):
        P, k = 8 // bits, 32 * (8 // bits)
        codes = (torch.arange(k) % 2**bits).to(torch.uint8).view(1, k)
        p = cpu.pack_plane(codes, torch.ones(1, 1), torch.zeros(1, 1), bits, -1)  # 1 bit: a plane of int3
        words = p.words.view(-1).to(torch.int64) & 0xFFFFFFFF
        for i in range(8):
            for t in range(4):
                for s in range(P):
                    assert (words[i] >> (8 * t + bits * s)) & (2**bits - 1) == (32 * s + 4 * i + t) % 2**bits
    qw2 = QuantizedWeight(codes=torch.full((1, 200), 3, dtype=torch.uint8), scales=torch.ones(1, 4),
                          zeros=torch.zeros(1, 4, dtype=torch.uint8), bits=2, group_size=64, sym=False)
    p = cpu.pack(qw2)
    assert p.kpad == 256 and p.words.shape == (1, 16) and p.scales.shape == (1, 4) and p.gshift == 1
    assert (p.words[0, :8] == -1).all()  # columns 0..127: every 2-bit field is 3


def test_permute_x_matches_fields():
    """The fp32 path reads field j = t*P + s of lane i at chunk offset 8j + i: column 32s + 4i + t."""
    bits, P = 4, 2
    x = torch.arange(64, dtype=torch.float32).view(1, 64)
    xp = cpu.permute_x(x, bits).view(-1)
    for t in range(4):
        for s in range(P):
            for i in range(8):
                assert xp[8 * (t * P + s) + i] == 32 * s + 4 * i + t


def test_quant_linear_bias_dtype_and_shape(ext):
    qw = rand_qw(40, 128, 4, 128, False)
    lin = torch.nn.Linear(128, 40)
    ql = QuantLinear.from_linear(lin, qw)
    assert ql.backend.name == "cpu" and "backend=cpu" in repr(ql)
    x = torch.randn(2, 5, 128)
    ref = x @ qw.dequantize().T + lin.bias.detach()
    assert_close_to_reference(ql(x), ref)
    assert ql(x.bfloat16()).dtype == torch.bfloat16


def test_unsupported_weights_use_reference(ext):
    qw5 = rand_qw(16, 96, 5, 32, False)
    assert select("auto", qw5).name == "reference"
    with pytest.raises(ValueError, match="5-bit"):
        select("cpu", qw5)
    assert select("cpu-a8", rand_qw(16, 96, 4, 32, False)).name == "cpu-a8"
    assert select("auto", rand_qw(16, 96, 4, 48, False)).name == "reference"  # group not a power of two
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select("cuda", qw5)


def test_int3_runs_as_two_planes(ext):
    """3-bit codes = low 2-bit plane + 4 x high 1-bit plane, 3 bits of storage per weight."""
    qw = rand_qw(32, 256, 3, 64, False)
    p = cpu.pack(qw)
    assert isinstance(p, cpu.Packed3) and (p.lo.bits, p.hi.bits) == (2, 1)
    assert p.lo.words.numel() * 32 == 32 * p.lo.kpad * 2 and p.hi.words.numel() * 32 == 32 * p.hi.kpad
    assert torch.equal(p.hi.scales, 4 * p.lo.scales) and not p.hi.zeros.any()
    one = QuantizedWeight(codes=torch.full((1, 256), 7, dtype=torch.uint8), scales=torch.ones(1, 1),
                          zeros=torch.zeros(1, 1, dtype=torch.uint8), bits=3, group_size=-1, sym=False)
    assert cpu.matmul(torch.ones(1, 256), cpu.pack(one)).item() == 7 * 256
    assert select("auto", qw).name == "cpu"


def test_no_compiler_falls_back_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(cpu, "_EXT", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    qw = rand_qw(16, 128, 4, 128, True)
    with caplog.at_level(logging.WARNING, logger="compress.kernels.cpu"):
        layers = [QuantLinear(qw) for _ in range(3)]
    assert all(layer.backend.name == "reference" for layer in layers)
    assert sum("no C++ compiler" in r.message for r in caplog.records) == 1
    x = torch.randn(2, 128)
    assert torch.allclose(layers[0](x), x @ qw.dequantize().T)


def test_quantize_model_matches_dequantized_model(ext):
    model = tiny_causal("llama")
    qweights = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers"):
            qweights[name] = rand_qw(mod.out_features, mod.in_features, 4, 32, False, seed=len(qweights))
            mod.weight.data = qweights[name].dequantize()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
        quantize_model(model, qweights)
        out = model(ids).logits
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == len(qweights) == 14
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


# -- the build lock (hardening item 7) --------------------------------------------------------------------
LOAD = "import logging, sys; logging.basicConfig(); from compress.kernels import cpu; sys.exit(cpu.extension() is None)"


def test_a_stale_build_lock_from_a_killed_build_does_not_hang_the_next_load(ext, tmp_path):
    """torch's BUILD/lock outlives a killed build and made every later load wait forever."""
    build = cpu._build_dir()
    cache = tmp_path / "cache"
    shutil.copytree(build, cache / "kernels" / build.name)
    (cache / "kernels" / build.name / "lock").write_text("")  # what a SIGKILLed build leaves
    env = {**os.environ, "COMPRESS_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "removing a stale CPU kernel build lock" in done.stderr
    assert not (cache / "kernels" / build.name / "lock").exists()


def test_a_wait_for_a_live_build_is_announced_with_its_pid_and_bounded(tmp_path, caplog):
    with held_lock(tmp_path / "compress.lock") as holder:
        with caplog.at_level("WARNING"), pytest.raises(TimeoutError, match="did not finish within 1 s"):
            with cpu._build_lock(tmp_path, wait_s=1):
                pass
        assert f"waiting for another process (pid {holder}) that is building the CPU kernel" in caplog.text
    with cpu._build_lock(tmp_path, wait_s=1):  # released with its holder
        assert (tmp_path / "compress.lock").read_text() == f"{os.getpid()}\n"
