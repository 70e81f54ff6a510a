"""`python -m bench scale`: the cost model's fit and a tiny end-to-end run (docs/stages.md#streaming-at-scale)."""

from __future__ import annotations

import json

import pytest
from helpers import lab

from bench.scale import (
    LIBRARIES_MB,
    SHAPES,
    TARGETS,
    block_linears,
    extrapolate,
    features,
    working_mb,
)


def test_block_shapes_and_cost_features():
    s = SHAPES["llama-3.2-1b"]
    lins = block_linears(s)
    assert sum(o * i for o, i in lins) == 60_817_408  # Llama-3.2-1B: 4 attention + 3 MLP matrices per block
    P, F = features(s, 1000)
    assert P == 60_817_408 and F > P * 2048


def test_extrapolation_recovers_an_exact_cost_model():
    """Rows whose seconds follow t = c + b F (GPTQ) and t = c + a P (RTN) exactly give back the model, so the
    targets' predictions are exact; peak RSS scales the largest shape's growth by the working set."""
    a, b, c, tokens = 2e-8, 3e-12, 0.5, 4096
    rows = []
    for name in ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"):
        P, F = features(SHAPES[name], tokens)
        base = {"model": name, "block_params": P, "gptq_work": F, "load_rss_mb": 1000.0}
        rows.append({**base, "method": "gptq", "s_per_block": c + b * F,
                     "quantize_peak_rss_mb": 1000 + 2 * working_mb(SHAPES[name], tokens, "gptq")})
        rows.append({**base, "method": "rtn", "s_per_block": c + a * P, "quantize_peak_rss_mb": 1010.0})
    out = {(e["model"], e["method"]): e for e in extrapolate(rows, tokens, iters=10)}
    for target in TARGETS:
        s = SHAPES[target]
        assert not out[(target, "gptq")]["measured"]
        P, F = features(s, tokens)
        assert out[(target, "gptq")]["s_per_block"] == pytest.approx(c + b * F, rel=1e-2)
        assert out[(target, "rtn")]["s_per_block"] == pytest.approx(c + a * P, rel=1e-2)
        assert out[(target, "gptq")]["total_h"] == pytest.approx((c + b * F) * s["num_hidden_layers"] / 3600,
                                                                 abs=0.01)
        rest = s["vocab_size"] * s["hidden_size"] * 2 * 2 / 2**20  # untied embeddings and head, bf16 (streamed)
        expect = (LIBRARIES_MB + rest + 2 * working_mb(s, tokens, "gptq")) / 1024
        assert out[(target, "gptq")]["peak_rss_gb"] == pytest.approx(expect, abs=0.1)


@pytest.mark.e2e
def test_bench_scale_quick_runs_streamed_cells(tmp_path):
    rc, stdout, err = lab("scale", "--quick", "--blocks", "tiny/rtn=2", "--json", tmp_path / "s.json")
    assert rc == 0, err
    result = json.loads((tmp_path / "s.json").read_text())
    assert {(r["model"], r["method"]) for r in result["rows"]} == {("tiny", m) for m in ("rtn", "gptq", "autoround")}
    assert {r["method"]: r["measured_blocks"] for r in result["rows"]} == {"rtn": 2, "gptq": 3, "autoround": 1}
    for r in result["rows"]:
        assert r["s_per_block"] > 0 and r["disk_mb"] > 0
        assert r["peak_rss_mb"] >= r["quantize_peak_rss_mb"] > r["load_rss_mb"] > 0
    whole = [r for r in result["rows"] if r["measured_blocks"] == r["blocks"]]
    assert whole and all(r["export_check"]["one_block_loads_in_transformers"] and
                         r["export_check"]["blocks_checked"] == r["blocks"] and
                         r["export_check"]["one_block_logits_rel_diff"] < 0.05 for r in whole), whole
    assert {e["model"] for e in result["extrapolation"]} >= set(TARGETS)
    assert "| llama-3.1-70b |" in stdout


@pytest.mark.parametrize("spec", ["nope/rtn=2", "rtn=0", "tiny/bogus=1"])
def test_bench_scale_refuses_a_bad_blocks_spec(spec):
    rc, _, err = lab("scale", "--quick", "--blocks", spec)
    assert rc != 0 and "--blocks" in err
