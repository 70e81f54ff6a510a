"""One prepared GPU check for a session that has an H200 (run from the repository root):

    python -m bench.gpu_check [--wheel-dir DIR] [--json OUT.json] [--quick]

(as a module: `python bench/gpu_check.py` would put bench/ first on the path, where select.py shadows the standard
library's `select`).

1. Makes `triton` importable: torch's CUDA wheels on Linux already depend on it; otherwise
   `pip install triton==3.9.0` (from `--wheel-dir` when the machine has no index).
2. Makes `compress.kernels` importable without installing the package (aliases `kernels/`), so the
   machine needs only torch and triton.
3. Correctness: `pytest -m gpu tests/kernels/test_kernels_gpu.py` (the compiled kernels on CUDA vs x @ W_hat.T,
   every bit width and path) when pytest is present; every benchmark row also reports its relative
   error against the dense fp32 product of the same dequantized weight.
4. Benchmark, int4 g128 (and int2 g64) at batch 1 (and 8, 32): ours (`triton`, the default launch
   configuration and the best of a small sweep), torch bf16 dense (`x @ W.T`), torch's tinygemm int4
   (`_weight_int4pack_mm`, bf16). Two timings per case:
     * `ms_flush`: triton.testing.do_bench, which clears the L2 before every call (launch included);
     * `ms_graph`: one CUDA graph replaying the product over R distinct copies of the weight (more
       bytes than 4x the 50 MiB L2), divided by R: what decoding a model layer after layer sees.
   `gbps` = weight bytes (codes + scales + zero points, or bf16) / time; `hbm_fraction` = gbps / 4800.
Targets (issue 5): int4 batch-1 8192x8192 >= 60% of HBM peak and faster than torch's int4.
5. `--quickstart MODEL` (a local model directory that travels with the tree, or a `--carry`-ed one): the bundled
   quickstart recipe run twice in fresh processes, `--device cuda` and `--device cpu`, same seed; their KL, top-1,
   perplexity ratio, quantize seconds and the device's peak memory side by side (docs/accelerators.md). Needs
   compress's own dependencies there: `bench/gpu_wheels.sh` downloads the ones the GPU image lacks into .whl/
   (carried; `--wheel-dir .whl` installs them).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HBM_GBPS = 4800.0  # H200 HBM3e peak
L2_BYTES = 50 * 2**20


def ensure_triton(wheel_dir: str | None) -> str:
    try:
        import triton
    except ImportError:
        cmd = [sys.executable, "-m", "pip", "install", "triton==3.9.0"]
        if wheel_dir:
            cmd += ["--no-index", "--find-links", wheel_dir]
        print("installing triton:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        import triton
    return triton.__version__


def ensure_compress() -> None:
    """Import `compress` from this checkout, installed or not (compress/kernels links to kernels/)."""
    sys.path.insert(0, str(REPO))
    importlib.import_module("compress.kernels.gpu")


def run_pytest() -> int | None:
    try:
        import pytest
    except ImportError:
        print("pytest not installed: skipping the test file; the benchmark rows still check correctness")
        return None
    sys.path.insert(0, str(REPO / "tests"))
    # only the compiled-kernel tests: the interpreter tests would leave triton.language patched
    args = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "gpu", str(REPO / "tests/kernels/test_kernels_gpu.py")]
    return int(pytest.main(args))


def torch_int4_gpu(qw):
    """(fn(x), bytes) for torch's tinygemm `_weight_int4pack_mm`: w = (q - 8) * scale + offset, bf16."""
    import torch

    codes = qw.codes.to(torch.int32).cuda()
    packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
    s = qw.scales.float().cuda()
    offset = (8 - qw.zeros.float().cuda()) * s
    sz = torch.stack([s.T, offset.T], dim=-1).bfloat16().contiguous()  # (n_groups, N, 2)
    fn = lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, qw.group_size, sz)  # noqa: E731
    return fn, packed.numel() * packed.element_size() + sz.numel() * sz.element_size()


def time_flush(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="min"))


def time_graph(make_fns, nbytes: int) -> float:
    """ms per call of one CUDA graph over R distinct weights (R * nbytes > 4x L2)."""
    import torch

    reps = max(2, math.ceil(4 * L2_BYTES / nbytes))
    fns = [make_fns() for _ in range(reps)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


SWEEP = [(bn, bk, sk, nw) for bn in (64, 128, 256) for bk in (64, 128, 256) for sk in (1, 2, 4, 8) for nw in (4, 8)]


def best_config(gpu, p, x):
    best = None
    for bn, bk, sk, nw in SWEEP:
        if (bk * p.bits) % 32:
            continue
        cfg = gpu.Config(gpu.pick_config(p, x.shape[0]).block_m, bn, bk, sk, nw)
        try:
            ms = time_flush(lambda: gpu.matmul(x, p, cfg))
        except Exception as e:  # a configuration the compiler rejects (shared memory, registers)
            print(f"  config {cfg} failed: {type(e).__name__}", flush=True)
            continue
        if best is None or ms < best[1]:
            best = (cfg, ms)
    return best


def bench(n: int, k: int, bits: int, group: int, batch: int, sweep: bool) -> list[dict]:
    import torch

    from compress.kernels import gpu
    from compress.kernels.bench import random_qweight

    qw = random_qweight(n, k, bits, group)
    w = qw.dequantize().cuda()
    x = torch.randn(batch, k, device="cuda")
    ref = x @ w.T
    xb = x.bfloat16()
    rows = []

    def row(backend, fn, nbytes, make_fns, extra=None):
        err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
        ms_flush = time_flush(fn)
        ms_graph = time_graph(make_fns, nbytes)
        gbps = nbytes / min(ms_flush, ms_graph) / 1e6
        r = {"shape": f"{n}x{k}", "batch": batch, "format": f"int{bits}-g{group}", "backend": backend,
             "ms_flush": round(ms_flush, 5), "ms_graph": round(ms_graph, 5), "gbps": round(gbps, 1),
             "hbm_fraction": round(gbps / HBM_GBPS, 3), "rel_err": float(f"{err:.2e}"), **(extra or {})}
        print(json.dumps(r), flush=True)
        rows.append(r)

    p = gpu.pack(qw, torch.device("cuda"))
    cfg = gpu.pick_config(p, batch)

    def ours_fns(c):
        def make():
            pp = dataclasses.replace(p, words=p.words.clone(), scales=p.scales.clone(), zeros=p.zeros.clone())
            return lambda: gpu.matmul(xb, pp, c)
        return make

    row("triton", lambda: gpu.matmul(xb, p, cfg), p.nbytes(), ours_fns(cfg), {"config": str(cfg)})
    if sweep:
        found = best_config(gpu, p, xb)
        if found:
            row("triton-best", lambda: gpu.matmul(xb, p, found[0]), p.nbytes(), ours_fns(found[0]),
                {"config": str(found[0])})
    wb = w.bfloat16()
    row("torch-bf16", lambda: xb @ wb.T, wb.numel() * 2, lambda: (lambda ww: (lambda: xb @ ww.T))(wb.clone()))
    if bits == 4:
        try:
            fn4, nbytes4 = torch_int4_gpu(qw)
            row("torch-int4", lambda: fn4(xb), nbytes4, lambda: (lambda f: (lambda: f(xb)))(torch_int4_gpu(qw)[0]))
        except RuntimeError as e:
            print(f"torch-int4 unavailable: {e}", flush=True)
    return rows


def ensure_requirements(wheel_dir: str | None) -> None:
    """compress's own dependencies, from `wheel_dir` (no index) when one is missing (the GPU image has torch,
    accelerate, safetensors, typer, rich; not pydantic, transformers>=5.20, auto-round or gguf)."""
    missing = [m for m in ("pydantic", "auto_round", "gguf") if importlib.util.find_spec(m) is None]
    import transformers

    if missing or tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 20):
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *(sorted(Path(wheel_dir).glob("*.whl"))
                                                                        if wheel_dir else [])]
        if not wheel_dir:
            raise SystemExit(f"missing {missing or ['transformers>=5.20']}: give --wheel-dir (bench/gpu_wheels.sh)")
        print("installing:", " ".join(map(str, cmd)), flush=True)
        subprocess.run(list(map(str, cmd)), check=True)
        importlib.invalidate_caches()


def quickstart(model: str, device: str, out: Path, extra: list[str] = ()) -> dict:
    """The bundled quickstart on `device` in a fresh process: its eval, the quantize stage's seconds, peak RSS and
    device peak (report.json)."""
    import time

    cmd = [sys.executable, "-c", "from compress import cli; cli.entry()", "run", str(REPO / "recipes" /
           "quickstart.yaml"), "--model", model, "--device", device, "--output", str(out), "--force", "--quiet",
           "--json", *extra]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        return {"device": device, "error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}
    report = json.loads(p.stdout)
    stage = next(s for s in report["stages"] if s["name"] == "quantize")
    ev = next(iter(report["eval"].values()))
    return {"device": device, "kl": ev["kl"], "top1": ev["top1"], "ppl_ratio": ev["ppl_ratio"],
            "quantize_s": stage["seconds"], "peak_rss_mb": stage["peak_rss_mb"],
            "device_peak_mb": stage.get("device_peak_mb"), "wall_s": round(time.time() - t0, 1)}


def quickstart_pair(model: str, devices=("cuda", "cpu"), extra: list[str] = ()) -> dict:
    """The quickstart on each device, side by side, and the relative KL difference of the first to the second."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        runs = [quickstart(model, dev, Path(d) / dev.replace(":", "_"), extra) for dev in devices]
    out = {"model": model, "runs": runs}
    if all("kl" in r for r in runs):
        out["kl_rel_diff"] = round(runs[0]["kl"] / runs[1]["kl"] - 1, 4)
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel-dir", help="install triton from wheels in this folder (no index)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="only int4 8192x8192 batch 1, no config sweep")
    ap.add_argument("--no-tests", action="store_true", help="skip the pytest run")
    ap.add_argument("--quickstart", metavar="MODEL", help="also run the quickstart recipe on cuda and on cpu")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine (the CPU CI runs the kernel interpreted)")
        return 2
    info = {"triton": ensure_triton(args.wheel_dir), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "hbm_peak_gbps": HBM_GBPS}
    ensure_compress()
    print(json.dumps(info), flush=True)
    info["pytest_rc"] = None if args.no_tests else run_pytest()
    cases = [(8192, 8192, 4, 128, 1)]
    if not args.quick:
        cases += [(8192, 8192, 4, 128, 8), (8192, 8192, 4, 128, 32), (4096, 4096, 4, 128, 1),
                  (11008, 4096, 4, 128, 1), (8192, 8192, 2, 64, 1)]
    rows = [r for i, (n, k, b, g, m) in enumerate(cases) for r in bench(n, k, b, g, m, sweep=not args.quick and i == 0)]
    head = [r for r in rows if r["shape"] == "8192x8192" and r["batch"] == 1 and r["format"] == "int4-g128"]
    ours = min((r for r in head if r["backend"].startswith("triton")), key=lambda r: min(r["ms_flush"], r["ms_graph"]))
    t4 = next((r for r in head if r["backend"] == "torch-int4"), None)
    info["targets"] = {
        "int4_b1_8192_hbm_fraction": ours["hbm_fraction"], "meets_60pct_hbm": ours["hbm_fraction"] >= 0.6,
        "faster_than_torch_int4": None if t4 is None else min(ours["ms_flush"], ours["ms_graph"])
        < min(t4["ms_flush"], t4["ms_graph"]),
    }
    print(json.dumps(info["targets"]), flush=True)
    if args.quickstart:
        ensure_requirements(args.wheel_dir)
        info["quickstart"] = quickstart_pair(args.quickstart)
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "rows": rows}, indent=2) + "\n")
    return 0 if info["pytest_rc"] in (None, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
