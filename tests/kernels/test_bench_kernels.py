"""`compress bench kernels --quick`: one process, every backend, JSON in the documented schema."""

import json
import os

import pytest
from conftest import invoke


def test_bench_kernels_quick_json_and_markdown(tmp_path):
    js, md = tmp_path / "k.json", tmp_path / "k.md"
    rc, stdout, err = invoke("bench", "kernels", "--quick", "--threads", "1", "--json", js, "--markdown", md)
    assert rc == 0, err
    result = json.loads(js.read_text())
    assert result["read_bandwidth_gbps"] > 0.5 and result["threads"] == 1
    assert result["a8_isa"] in ("avx512-vnni", "avx2", "scalar") and result["machine"]["nproc"] >= 1
    arith = result["arithmetic_ms"]
    assert arith["shape"] == "1024x1024" and set(arith) == {"shape", "int4-g128", "int2-g64"}
    assert all(0 <= arith[f] < 50 for f in ("int4-g128", "int2-g64"))  # a timing: tiny at 1024x1024
    rows = result["rows"]
    keys = {"shape", "batch", "format", "backend", "ms_min", "ms_median", "gbps", "bw_fraction", "rel_err"}
    assert all(set(r) == keys and 0 < r["ms_min"] <= r["ms_median"] for r in rows)
    got = {(r["format"], r["backend"]) for r in rows}
    assert got == {("dense", "torch-fp32"), ("dense", "torch-bf16"), ("int4-g128", "ours-cpu"),
                   ("int4-g128", "ours-cpu-a8"), ("int2-g64", "ours-cpu-a8"),
                   ("int4-g128", "reference"), ("int4-g128", "torch-int4"), ("int4-g128", "openvino-int4"),
                   ("int2-g64", "ours-cpu"), ("int2-g64", "reference"), ("int2-g64", "openvino-int2"),
                   ("int3-g128", "ours-cpu"), ("int3-g128", "ours-cpu-a8"), ("int3-g128", "reference")}
    assert {r["batch"] for r in rows} == {1, 8}
    err = {(r["format"], r["backend"]): r["rel_err"] for r in rows if r["batch"] == 8}
    assert err[("int4-g128", "ours-cpu")] < 1e-5 and err[("int2-g64", "ours-cpu")] < 1e-5
    assert err[("int3-g128", "ours-cpu")] < 1e-5 and err[("int3-g128", "ours-cpu-a8")] < 3e-2
    assert err[("int4-g128", "ours-cpu-a8")] < 3e-2 and err[("int4-g128", "openvino-int4")] < 3e-2
    assert "| 1024x1024 | 1 | int4-g128 | ours-cpu |" in md.read_text() and "| ours-cpu |" in stdout
    assert "arithmetic alone" in md.read_text()
    sbs = result["side_by_side"]
    assert sbs["shape"] == "1024x1024" and sbs["repeats"] == 6
    assert set(sbs["ms_min"]) == {"ours-int4", "ours-int2", "torch-int4", "openvino-int4"}
    assert all(0 < sbs["ms_min"][k] <= sbs["ms_median"][k] for k in sbs["ms_min"])
    ratio = sbs["ms_min"]["ours-int4"] / sbs["ms_min"]["ours-int2"]  # from the rounded minima
    assert abs(sbs["int2_vs_int4"] - ratio) <= 0.01 * ratio
    assert "Side by side" in md.read_text()
    pre = result["prefill"]
    assert pre["shape"] == "1024x1024" and pre["rows"] == [1, 8, 64] and pre["isa"] in ("avx512", "avx2", "scalar")
    assert {(c["bits"], c["act"]) for c in pre["cells"]} == {(b, a) for b in (2, 3, 4, 8) for a in ("fp32", "int8")}
    for c in pre["cells"]:
        assert len(c["kernel_ms"]) == len(c["prefill_ms"]) == 3 and min(c["kernel_ms"] + c["prefill_ms"]) > 0
        faster = [d < k for k, d in zip(c["kernel_ms"], c["prefill_ms"])]
        assert c["cutover"] == next((r for i, r in enumerate(pre["rows"]) if all(faster[i:])), None)
    assert "Prefill cut-over" in md.read_text()


@pytest.mark.e2e  # moved out of the default tier (its time budget); CI runs -m e2e
def test_bench_kernels_isa_avx2_runs_every_side_on_its_avx2_code(tmp_path):
    """`--isa avx2` restarts the command with torch and MKL capped to AVX2 (read at process start), and runs
    `cpu-a8` on its AVX2 code; run in a child process, since the command replaces its process."""
    import subprocess
    import sys

    from conftest import REPO

    js = tmp_path / "k.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "COMPRESS_CPU_ISA")}
    proc = subprocess.run([sys.executable, "-c", "import sys; from compress import cli; sys.exit(cli.main())", "bench", "kernels",
                           "--quick", "--threads", "1", "--isa", "avx2", "--json", str(js)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(js.read_text())
    from compress.kernels import cpu

    assert result["isa"] == "avx2" and result["torch_isa"] in ("AVX2", "DEFAULT")
    assert result["kernel_build"] == "avx2" and result["a8_isa"] == ("avx2" if cpu.extension().has_avx2() else "scalar")
    assert all(r["rel_err"] < 3e-2 for r in result["rows"] if r["backend"] in ("ours-cpu-a8", "torch-int4"))


def test_bench_kernels_rejects_an_unknown_isa():
    rc, _, err = invoke("bench", "kernels", "--quick", "--isa", "avx9")
    assert rc == 1 and "unknown isa" in err


def test_bench_kernels_prefill_only(tmp_path):
    js = tmp_path / "k.json"
    rc, stdout, err = invoke("bench", "kernels", "--quick", "--prefill-only", "--threads", "1", "--json", js)
    assert rc == 0, err
    result = json.loads(js.read_text())
    assert result["rows"] == [] and not result["side_by_side"] and len(result["prefill"]["cells"]) == 8
    assert "Prefill cut-over" in stdout and "| shape | batch |" not in stdout
