"""`compress bench decode --quick`: every backend decodes the tiny random Llama, JSON and markdown written."""

import json

import pytest
from conftest import invoke


@pytest.mark.e2e  # a quick benchmark suite, like the others: CI runs -m e2e
def test_bench_decode_quick(tmp_path):
    js, md = tmp_path / "d.json", tmp_path / "d.md"
    rc, stdout, err = invoke("bench", "decode", "--quick", "--threads", "1", "--json", js, "--markdown", md)
    assert rc == 0, err
    result = json.loads(js.read_text())
    assert result["size"] == "tiny" and result["new_tokens"] == 8 and result["threads"] == 1
    rows = {r["backend"]: r for r in result["rows"]}
    assert set(rows) == {"torch-fp32", "ours-int4", "ours-int4-a8", "openvino-int4"}
    assert rows["ours-int4"]["kernel"] == "cpu" and rows["torch-fp32"]["speedup_vs_fp32"] == 1.0
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["ms_per_token"] > 0 and 0 <= r["agree"] <= 1
        assert abs(r["tokens_per_s"] * r["ms_per_token"] / 1e3 - 1) < 0.02
    assert "| ours-int4 |" in md.read_text() and "| openvino-int4 |" in stdout


def test_bench_decode_rejects_unknown_size():
    rc, _, err = invoke("bench", "decode", "--size", "7b")
    assert rc == 1 and "unknown --size `7b`" in err


def test_bench_decode_ffn_mass_rows(tmp_path):
    """--ffn-mass: the PrunePath rows, fp32 and int4, at each tau; fewer experts active at a lower tau."""
    js = tmp_path / "d.json"
    rc, stdout, err = invoke("bench", "decode", "--quick", "--threads", "1", "--no-openvino", "--ffn-mass", 0.4,
                             "--ffn-mass", 1.0, "--json", js)
    assert rc == 0, err
    rows = json.loads(js.read_text())["prunepath"]
    assert [(r["backend"], r["tau"]) for r in rows] == [("torch-fp32 prunepath", 0.4), ("torch-fp32 prunepath", 1.0),
                                                        ("ours-cpu prunepath", 0.4), ("ours-cpu prunepath", 1.0)]
    assert rows[0]["ffn_active"] < 1 and rows[1]["ffn_active"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows)
    assert "| torch-fp32 prunepath | 0.4 |" in stdout
    rc, _, err = invoke("bench", "decode", "--quick", "--ffn-mass", 1.5)
    assert rc == 1 and "(0, 1]" in err
