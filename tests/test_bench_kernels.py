"""`compress bench kernels --quick`: one process, every backend, JSON in the documented schema."""

import json

from conftest import invoke


def test_bench_kernels_quick_json_and_markdown(tmp_path):
    js, md = tmp_path / "k.json", tmp_path / "k.md"
    rc, stdout, err = invoke("bench", "kernels", "--quick", "--threads", "1", "--json", js, "--markdown", md)
    assert rc == 0, err
    result = json.loads(js.read_text())
    assert result["read_bandwidth_gbps"] > 0.5 and result["threads"] == 1
    assert result["a8_isa"] in ("avx512-vnni", "avx2", "scalar") and result["machine"]["nproc"] >= 1
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


def test_bench_kernels_no_avx512_runs_the_avx2_code(tmp_path):
    js = tmp_path / "k.json"
    rc, _, err = invoke("bench", "kernels", "--quick", "--threads", "1", "--no-avx512", "--json", js)
    assert rc == 0, err
    result = json.loads(js.read_text())
    from compress.kernels import cpu

    assert result["a8_isa"] == ("avx2" if cpu.extension().has_avx2() else "scalar")
    assert all(r["rel_err"] < 3e-2 for r in result["rows"] if r["backend"] == "ours-cpu-a8")
