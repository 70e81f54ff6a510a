"""`compress bench kernels`: packed GEMM speed on this machine, side by side in one process.

For each weight shape (N x K), batch and format (int4 g128, int2 g64, int3 g128) it times, repeated (min and
median): our C++ kernel (what `cpu.matmul` runs at that batch: from `cpu.prefill_rows` rows on, the prefill
path, dequantize then BLAS) with fp32 activations (`ours-cpu`, exact up to float rounding) and with
int8 activations (`ours-cpu-a8`, one scale per 128 or group columns; int2 in the cpu-tiles layout where
the build prefers it, `a8_layouts`), the reference path
(`reference`: dequantize, then matmul), torch's int4 CPU kernel (`torch-int4`, int4 only, bf16
activations: its fast path), an OpenVINO compiled weight-compressed MatMul
(`openvino-int4` / `openvino-int2`: u4/u2 constant -> convert -> subtract zero -> multiply scale ->
reshape -> MatMul), and dense torch fp32 / bf16 matmuls (format `dense`). The machine's streaming
read bandwidth (a pass over a 512 MiB tensor) is measured in the same run; `gbps` is the bytes each
backend's weight occupies divided by its minimum time, `bw_fraction` that over the read bandwidth,
and `rel_err` the backend's largest deviation from the fp32 reference output at that batch, relative
to the reference's largest magnitude (dense rows: the bf16 rounding of the weights, fp32 rows 0).
`arithmetic_ms` is `ours-cpu-a8`'s batch-1 time on the last shape with memory out of the way (row slices
that stay in cache, `arithmetic_ms()`): near or above its `ms_min`, the kernel is bound by its instructions.
`side_by_side` times the batch-1 sides of the targets (ours int4 and int2, torch int4, OpenVINO int4) on the
last shape in one round-robin loop, so their ratios do not mix two phases of a noisy machine. `prefill` times
the batch kernel against the prefill path at 1 to 256 rows on the first shape, per bit width and activations, and
gives the cut-over `cpu.PREFILL_ROWS` holds for this ISA.

Every timed call starts with cold caches (`Evict`: the L3 of these VMs reports 32 to 300 MiB, enough to
hold a packed 8192x8192 int4 or int2 weight, and decoding a real model streams its weights from DRAM).

`isa="avx2"` (`compress bench kernels --isa avx2`) measures what an AVX2-only CPU runs, on an AVX-512 one:
our kernel built for AVX2 (`COMPRESS_CPU_ISA=avx2`: `-march=haswell`, no AVX-512 instruction anywhere in
it), torch's own kernels (int4, and its CPU ops in general) dispatched for AVX2
(`ATEN_CPU_CAPABILITY=avx2`) and MKL's fp32 GEMM limited to AVX2 (`MKL_ENABLE_INSTRUCTIONS=AVX2`), both read
when the process starts (the CLI restarts itself with them). torch's bf16 matmul (oneDNN) and OpenVINO stay on
the native ISA: OpenVINO 2026.4's CPU plugin cannot compile its MatMul with oneDNN capped to AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2`: "could not create a primitive descriptor"). The JSON records each side's ISA.

On a machine whose cores are shared with other work, run it with `OMP_WAIT_POLICY=PASSIVE` in the
environment (read when torch starts): spinning OpenMP workers otherwise cost the torch and ours-cpu
rows up to 10x at 2 threads. The value in effect is recorded in the JSON (`omp_wait_policy`).
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import numpy as np
import torch

from compress.eval.machine import machine, machine_text
from compress.kernels import cpu
from compress.kernels.backends import Reference
from compress.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

SHAPES = ((4096, 4096), (11008, 4096), (8192, 8192))  # (out, in)
BATCHES = (1, 8, 32)
FORMATS = ((4, 128), (2, 64), (3, 128))  # int3: ours (two planes) and the reference only
EVICT_MIB = 512  # > the last-level cache (32-300 MiB L3 on the 2-core VMs used here)
QUICK = dict(shapes=((1024, 1024),), batches=(1, 8), repeats=3)


def timed(fn, repeats: int, before=None) -> tuple[float, float]:
    """(min, median) milliseconds of `fn()` over `repeats` runs after one warm-up; `before()` runs
    untimed ahead of each (the cache eviction)."""
    fn()
    ts = []
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return min(ts), statistics.median(ts)


class Evict:
    """Streams over a buffer larger than the last-level cache so each timed call reads its weights
    from DRAM, as decoding a model much larger than the cache does."""

    def __init__(self, mib: int):
        self.buf = torch.ones(mib * 2**20 // 4)

    def __call__(self):
        self.buf.add_(0.0)  # read and write every line: the buffer displaces the weights


def read_bandwidth_gbps(mib: int, repeats: int, evict=None) -> float:
    """Streaming read of a `mib` MiB fp32 tensor: the faster of `sum` and BLAS `dot(a, a)` (one pass)."""
    a = torch.ones(mib * 2**20 // 4)
    ms = min(timed(lambda: a.sum(), repeats, evict)[0], timed(lambda: torch.dot(a, a), repeats, evict)[0])
    return a.numel() * 4 / ms / 1e6


def random_qweight(n: int, k: int, bits: int, group: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    ng = -(-k // group)
    return QuantizedWeight(codes=torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g),
                           scales=(torch.rand(n, ng, generator=g) * 0.02 + 0.001).half().float(),
                           zeros=torch.randint(0, 2**bits, (n, ng), dtype=torch.uint8, generator=g),
                           bits=bits, group_size=group, sym=False)


def torch_int4(qw: QuantizedWeight):
    """(fn(x), bytes) for torch's `_weight_int4pack_mm_for_cpu`: w = (q - 8) * scale + offset. It runs in
    bf16 (activations, scales and offsets), its fast path; fp32 activations take a far slower one."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.codes.to(torch.int32), 1)
    s = qw.scales.float()
    offset = (8 - qw.zeros.float()) * s
    sz = torch.stack([s.T, offset.T], dim=-1).bfloat16().contiguous()  # (n_groups, N, 2)
    fn = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, qw.group_size, sz)  # noqa: E731
    return fn, packed.numel() * packed.element_size() + sz.numel() * sz.element_size()


def openvino_matmul(qw: QuantizedWeight, batch: int):
    """(fn(x), bytes) for an OpenVINO CPU model with u4/u2 codes, u4 or f16 zero points, fp16 scales."""
    import openvino as ov
    import openvino.opset13 as ops

    n, k, g = qw.out_features, qw.in_features, qw.group_size
    ng, t = k // g, {4: ov.Type.u4, 2: ov.Type.u2}[qw.bits]
    x = ops.parameter([batch, k], np.float32, name="x")
    w = ops.convert(ops.constant(qw.codes.numpy().reshape(n, ng, g), dtype=t), ov.Type.f16)
    zeros = qw.zeros.numpy().reshape(n, ng, 1)
    # u2 zero points as f16: OpenVINO 2026.4's CPU plugin cannot compile a u2 FullyConnected whose zero points are
    # an integer constant on AVX-512 machines ("could not create a primitive descriptor"); u4 ones compile.
    zp = ops.convert(ops.constant(zeros, dtype=t), ov.Type.f16) if qw.bits == 4 else ops.constant(zeros.astype(np.float16))
    w = ops.subtract(w, zp)
    w = ops.multiply(w, ops.constant(qw.scales.numpy().astype(np.float16).reshape(n, ng, 1)))
    w = ops.convert(ops.reshape(w, ops.constant(np.array([n, k], np.int64)), False), ov.Type.f32)
    model = ov.Model([ops.matmul(x, w, False, True)], [x])
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": torch.get_num_threads()})
    req = compiled.create_infer_request()
    fn = lambda xx: req.infer([xx])  # noqa: E731
    return fn, n * k * qw.bits // 8 + n * ng * (2 + (qw.bits / 8 if qw.bits == 4 else 2))


def _row(shape, batch, fmt, backend, ms, nbytes, bw, err) -> dict:
    gbps = nbytes / ms[0] / 1e6
    return {"shape": shape, "batch": batch, "format": fmt, "backend": backend, "ms_min": round(ms[0], 4),
            "ms_median": round(ms[1], 4), "gbps": round(gbps, 2), "bw_fraction": round(gbps / bw, 3),
            "rel_err": float(f"{err:.2e}")}


def rel_err(y, ref: torch.Tensor) -> float:
    y = torch.as_tensor(np.asarray(y) if not isinstance(y, torch.Tensor) else y).float()
    return ((y - ref).abs().max() / ref.abs().max()).item()


def dense_rows(shape: str, n: int, k: int, batches, repeats: int, bw: float, evict) -> list[dict]:
    """torch fp32 and bf16 matmul rows (the dense weights are freed on return)."""
    rows, w = [], torch.randn(n, k) * 0.02
    wb = w.bfloat16()
    for b in batches:
        x = torch.randn(b, k)
        xb, ref = x.bfloat16(), x @ w.T
        rows.append(_row(shape, b, "dense", "torch-fp32", timed(lambda: x @ w.T, repeats, evict),
                         w.numel() * 4, bw, 0.0))
        rows.append(_row(shape, b, "dense", "torch-bf16", timed(lambda: xb @ wb.T, repeats, evict),
                         w.numel() * 2, bw, rel_err(xb @ wb.T, ref)))
    return rows


def bench_shape(n: int, k: int, batches, repeats: int, bw: float, evict) -> list[dict]:
    shape = f"{n}x{k}"
    rows = dense_rows(shape, n, k, batches, repeats, bw, evict)
    for bits, group in FORMATS:
        fmt = f"int{bits}-g{group}"
        qw = random_qweight(n, k, bits, group)
        packed = cpu.pack(qw) if cpu.extension() is not None else None
        packed_a8 = cpu.pack(qw, cpu.layout_for(qw, "int8")) if packed is not None else None
        for b in batches:
            x = torch.randn(b, k)
            ref = Reference().matmul(x, qw)
            cases = []  # (backend, fn, bytes)
            if packed is not None:
                cases += [("ours-cpu", lambda: cpu.matmul(x, packed), packed.nbytes()),
                          ("ours-cpu-a8", lambda: cpu.matmul(x, packed_a8, act="int8"), packed_a8.nbytes())]
            cases.append(("reference", lambda: Reference().matmul(x, qw), qw.storage_bits() // 8))
            if bits == 4:
                fn4, nbytes4 = torch_int4(qw)
                cases.append(("torch-int4", lambda: fn4(x), nbytes4))
            if bits in (2, 4):
                fno, nbyteso = openvino_matmul(qw, b)
                xn = x.numpy()
                cases.append((f"openvino-int{bits}", lambda: fno(xn)[0], nbyteso))
            for name, fn, nbytes in cases:
                reps = max(1, repeats // 4) if name == "reference" else repeats
                rows.append(_row(shape, b, fmt, name, timed(fn, reps, evict), nbytes, bw, rel_err(fn(), ref)))
            logger.info("%s batch %d %s done", shape, b, fmt)
    return rows


def round_robin(sides: dict, repeats: int, evict) -> dict[str, list[float]]:
    """Milliseconds of each side over `repeats` rounds (after one untimed call each), every round timing every
    side once after an eviction, so a slow phase of the machine hits all sides alike."""
    times = {name: [] for name in sides}
    for fn in sides.values():
        fn()
    for _ in range(repeats):
        for name, fn in sides.items():
            evict()
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


def side_by_side(n: int, k: int, repeats: int, evict) -> dict:
    """The batch-1 ratios the targets name, on an `n` x `k` weight, with every side timed in one round-robin
    loop: each repeat times ours int4 g128 and int2 g64 (`cpu-a8`), torch's int4 and OpenVINO's int4 once each,
    each after an eviction, so a slow phase of the machine hits all sides alike. (The per-format rows time one
    backend's repeats after another's, a minute apart for int4 and int2.) Minimum and median per side."""
    q4, q2 = random_qweight(n, k, 4, 128), random_qweight(n, k, 2, 64)
    p4, p2 = cpu.pack(q4, cpu.layout_for(q4, "int8")), cpu.pack(q2, cpu.layout_for(q2, "int8"))
    x = torch.randn(1, k)
    xn = x.numpy()
    fn4, _ = torch_int4(q4)
    fno, _ = openvino_matmul(q4, 1)
    sides = {"ours-int4": lambda: cpu.matmul(x, p4, act="int8"), "ours-int2": lambda: cpu.matmul(x, p2, act="int8"),
             "torch-int4": lambda: fn4(x), "openvino-int4": lambda: fno(xn)}
    times = round_robin(sides, repeats, evict)
    lo = {name: min(ts) for name, ts in times.items()}
    return {"shape": f"{n}x{k}", "batch": 1, "repeats": repeats,
            "ms_min": {name: round(v, 4) for name, v in lo.items()},
            "ms_median": {name: round(statistics.median(ts), 4) for name, ts in times.items()},
            "int2_vs_int4": round(lo["ours-int4"] / lo["ours-int2"], 3),
            "torch_int4_vs_ours_int4": round(lo["torch-int4"] / lo["ours-int4"], 3),
            "openvino_int4_vs_ours_int4": round(lo["openvino-int4"] / lo["ours-int4"], 3)}


PREFILL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_FORMATS = ((2, 64), (3, 128), (4, 128), (8, 128))


def prefill(n: int, k: int, repeats: int, evict, rows=PREFILL_ROWS, formats=PREFILL_FORMATS) -> dict:
    """Where the prefill path (`cpu.matmul_dequant`: dequantize slice by slice, then BLAS) overtakes our batch-1
    kernel, per activation type and bit width, on an `n` x `k` weight: both timed at each row count, side by side
    (alternating, each after an eviction), minimum of `repeats`. `cutover` is the smallest row count from which
    the prefill path is faster at every measured count (what `cpu.PREFILL_ROWS` should hold for this ISA);
    `table` is what the code holds now, `cpu.kernel_isa()` the row of it this machine reads."""
    out = {"shape": f"{n}x{k}", "isa": cpu.kernel_isa(), "rows": list(rows), "repeats": repeats, "cells": []}
    for bits, group in formats:
        qw = random_qweight(n, k, bits, group)
        for act in ("fp32", "int8"):
            p = cpu.pack(qw, cpu.layout_for(qw, act))
            kernel, dense = [], []
            for r in rows:
                x = torch.randn(r, k)
                times = round_robin({"kernel": lambda: cpu.matmul(x, p, act=act, prefill=2**62),
                                     "prefill": lambda: cpu.matmul(x, p, act=act, prefill=1)}, repeats, evict)
                kernel.append(round(min(times["kernel"]), 4))
                dense.append(round(min(times["prefill"]), 4))
            faster = [d < kk for kk, d in zip(kernel, dense)]
            cut = next((r for i, r in enumerate(rows) if all(faster[i:])), None)
            out["cells"].append({"bits": bits, "group": group, "act": act, "kernel_ms": kernel, "prefill_ms": dense,
                                 "cutover": cut, "table": cpu.PREFILL_ROWS.get((out["isa"], act, bits))})
            logger.info("prefill int%d %s: cut-over at %s rows", bits, act, cut)
    return out


def arithmetic_ms(n: int, k: int, bits: int, group: int, threads: int, repeats: int, rows=(64, 192)) -> float:
    """Our `cpu-a8` batch-1 kernel's arithmetic alone for an `n` x `k` weight on `threads` cores, memory out
    of the way: one thread times two row slices small enough to stay in the cache (64 and 192 rows; int4 at
    k = 8192: 0.8 MB), the difference (the fixed cost of a call cancels) is scaled to `n` rows and divided by
    the threads. Against the weight's bytes over the read bandwidth it tells whether the kernel is bound by
    its instructions or by memory."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, ts = torch.randn(1, k), []
        for r in rows:
            qw = random_qweight(r, k, bits, group)
            p = cpu.pack(qw, cpu.layout_for(qw, "int8"))
            ts.append(min(timed(lambda: cpu.matmul(x, p, act="int8"), repeats)[0] for _ in range(3)))
    finally:
        torch.set_num_threads(previous)
    return max(ts[1] - ts[0], 0.0) / (rows[1] - rows[0]) * n / threads


ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # read at process start
                    "COMPRESS_CPU_ISA": "avx2"}}


def isa_env_missing(isa: str) -> dict:
    """The environment variables `isa` needs that this process did not start with ({} for `native`)."""
    if isa not in ("native", *ISA_ENV):
        raise ValueError(f"unknown isa {isa!r} (known: native, {', '.join(ISA_ENV)})")
    return {k: v for k, v in ISA_ENV.get(isa, {}).items() if os.environ.get(k) != v}


def run(quick: bool = False, repeats: int = 10, threads: int | None = None, isa: str = "native",
        prefill_only: bool = False) -> dict:
    """`isa="avx2"` (with `ISA_ENV` set when the process started): our kernel's AVX2 build, and torch and MKL
    on their AVX2 code, as on an AVX2-only CPU. `prefill_only`: the `prefill` section alone (no rows)."""
    missing = isa_env_missing(isa)
    if missing:
        raise ValueError(f"isa {isa!r} needs {missing} in the environment before torch starts")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        shapes, batches = (QUICK["shapes"], QUICK["batches"]) if quick else (SHAPES, BATCHES)
        repeats = QUICK["repeats"] if quick else repeats
        evict = Evict(16 if quick else EVICT_MIB)
        bw = read_bandwidth_gbps(64 if quick else 512, repeats, evict)
        kernel = cpu.extension() is not None and not prefill_only
        rows = [r for n, k in shapes for r in bench_shape(n, k, batches, repeats, bw, evict)] if not prefill_only else []
        (n, k), used = shapes[-1], torch.get_num_threads()
        arith = ({f"int{b}-g{g}": round(arithmetic_ms(n, k, b, g, used, 30 if quick else 300), 4)
                  for b, g in ((4, 128), (2, 64))} if kernel else {})
        sbs = side_by_side(n, k, 2 * repeats, evict) if kernel else {}
        pre = (prefill(*shapes[0], repeats, evict, rows=(1, 8, 64) if quick else PREFILL_ROWS)
               if cpu.extension() is not None else {})
        return {"machine": machine(), "read_bandwidth_gbps": round(bw, 2), "threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                "cpu_kernel": cpu.extension() is not None, "isa": isa, "kernel_build": cpu.build_isa(),
                "a8_isa": a8_isa(), "a8_layouts": a8_layouts(),
                "torch_isa": torch.backends.cpu.get_cpu_capability(),
                "arithmetic_ms": {"shape": f"{n}x{k}", **arith}, "side_by_side": sbs, "prefill": pre, "rows": rows}
    finally:
        torch.set_num_threads(previous)


def a8_layouts() -> dict:
    """The layout our `cpu-a8` rows pack each format in (`cpu.layout_for`)."""
    if cpu.extension() is None:
        return {}
    return {f"int{b}-g{g}": cpu.layout_for(random_qweight(16, 128, b, g), "int8") for b, g in FORMATS}


def a8_isa() -> str:
    """The code our `cpu-a8` rows run: avx512-vnni, avx2 or scalar/none (the build's best; see `kernel_build`)."""
    ext = cpu.extension()
    if ext is None:
        return "none"
    return "avx512-vnni" if ext.has_avx512() else "avx2" if ext.has_avx2() else "scalar"


def markdown(result: dict) -> str:
    """One table: shape, batch, format, backend, ms min / median, GB/s, fraction of read bandwidth."""
    isa = f" `cpu-a8` code: {result['a8_isa']}." if "a8_isa" in result else ""
    if result.get("a8_layouts"):
        isa += " `cpu-a8` layouts: " + ", ".join(f"{f} {lay}" for f, lay in result["a8_layouts"].items()) + "."
    if "kernel_build" in result:
        isa += f" Our kernel built for: {result['kernel_build']}."
    if "torch_isa" in result:
        isa += f" torch kernels: {result['torch_isa']}; OpenVINO and torch bf16: native."
    lines = [f"Streaming read bandwidth: {result['read_bandwidth_gbps']} GB/s, {result['threads']} threads."
             f"{machine_text(result.get('machine'))}{isa}", ""]
    arith = {f: ms for f, ms in result.get("arithmetic_ms", {}).items() if f != "shape"}
    if arith:
        rows = {(r["shape"], r["format"]): r for r in result["rows"] if r["batch"] == 1 and r["backend"] == "ours-cpu-a8"}
        shape = result["arithmetic_ms"]["shape"]
        lines.insert(1, f"\n`ours-cpu-a8` at {shape}, batch 1, arithmetic alone (row slices in cache, see "
                        "`arithmetic_ms`) vs its minimum time from memory: " + "; ".join(
                            f"{f} {ms:.3f} vs {rows[(shape, f)]['ms_min']:.3f} ms" for f, ms in arith.items()
                            if (shape, f) in rows) + ".")
    sbs = result.get("side_by_side")
    if sbs:
        ms = sbs["ms_min"]
        lines.insert(1, f"\nSide by side (`side_by_side`: one round-robin loop, {sbs['shape']}, batch 1, minimum of "
                        f"{sbs['repeats']}): ours int4 {ms['ours-int4']:.3f} ms, int2 {ms['ours-int2']:.3f} ms "
                        f"({sbs['int2_vs_int4']:.2f}x int4), torch int4 {ms['torch-int4']:.3f} ms (ours "
                        f"{sbs['torch_int4_vs_ours_int4']:.2f}x), OpenVINO int4 {ms['openvino-int4']:.3f} ms (ours "
                        f"{sbs['openvino_int4_vs_ours_int4']:.2f}x).")
    if result.get("prefill"):
        lines += [prefill_markdown(result["prefill"]), ""]
    if result["rows"]:
        lines += ["| shape | batch | format | backend | ms min | ms median | GB/s | of read bw | rel. error |",
                  "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['batch']} | {r['format']} | {r['backend']} | {r['ms_min']:.3f} | "
                     f"{r['ms_median']:.3f} | {r['gbps']:.1f} | {r['bw_fraction']:.0%} | {r['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def prefill_markdown(pre: dict) -> str:
    """The prefill table: per format and activations, kernel / prefill-path ms at each row count, the cut-over."""
    lines = [f"Prefill cut-over (`prefill`: {pre['shape']}, kernel ISA {pre['isa']}, minimum of {pre['repeats']}, "
             "alternating; kernel ms / prefill-path ms per rows of x; `cutover`: the measured first row count from "
             "which the prefill path wins, `table`: `cpu.PREFILL_ROWS`, 0 = never):", "",
             "| format | act | " + " | ".join(f"{r} rows" for r in pre["rows"]) + " | cutover | table |",
             "|---|---|" + "---:|" * (len(pre["rows"]) + 2)]
    for c in pre["cells"]:
        cells = " | ".join(f"{k:.2f} / {d:.2f}" for k, d in zip(c["kernel_ms"], c["prefill_ms"]))
        lines.append(f"| int{c['bits']}-g{c['group']} | {c['act']} | {cells} | {c['cutover'] or 'never'} | "
                     f"{c['table']} |")
    return "\n".join(lines)
