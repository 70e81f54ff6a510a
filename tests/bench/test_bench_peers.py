"""`python -m bench peers`: compress cells beside auto-round (and the peers that cannot run here, with the reason)
on a tiny model, every row in the table."""

from __future__ import annotations

import json
import math

import pytest
from conftest import MODELS
from helpers import lab

from bench.peers import CELLS, NOTES, markdown, safetensors_bytes, size_of

TINY = ["--model", "stories-llama-1m", "--bits", "4", "--group", "64", "--sym", "--nsamples", "4", "--seqlen", "64",
        "--max-tokens", "512", "--peer-iters", "2", "--seeds", "0"]


@pytest.mark.e2e
def test_peers_tiny_every_row(tmp_path, monkeypatch):
    """compress's main cells and auto-round's run and score on the same tokens; llm-compressor, whose environment is
    not built in this fresh engines folder, and every cell left out by --cells are rows with the reason. (The cells
    left out here, the AWQ ones, auto-round's iters=0 and NNCF, take minutes on a busy 2-core VM; the module
    docstring's ref-llama-7m command runs them all.)"""
    monkeypatch.setenv("COMPRESS_ENGINES", str(tmp_path / "engines"))
    run = ["rtn", "rtn-opt", "gptq", "autoround", "autoround+lfq", "ar", "llmc-gptq"]
    rc, out, err = lab("peers", *TINY, "--cells", ",".join(run), "--mc-limit", "16", "--json", tmp_path / "p.json",
                       "--markdown", tmp_path / "p.md")
    assert rc == 0, err
    res = json.loads((tmp_path / "p.json").read_text())
    cells = {c["cell"]: c for c in res["cells"]}
    assert list(cells) == list(CELLS)
    first = cells["rtn"]["runs"][0]
    for name in ("rtn", "rtn-opt", "gptq", "autoround", "autoround+lfq", "ar"):
        c = cells[name]
        assert c["status"] == "ok", (name, c.get("reason"))
        r = c["runs"][0]
        assert math.isfinite(r["kl"]) and r["kl"] > 0 and 0 < r["top1"] <= 1 and r["tokens"] == first["tokens"] > 0
        assert r["fp_ppl"] == pytest.approx(first["fp_ppl"], rel=1e-6)  # same tokens, same reference
        assert 4 < r["effective_bits"] < 4.5 and r["linear_bytes"] > 0
        assert r["quantized_weights"] == first["quantized_weights"]  # same layers
        assert 0 <= r["acc"] <= 1 and 0 <= r["acc_norm"] <= 1  # sst2_mc, the first 16 documents
    assert set(res["meta"]["fp_task"]) == {"acc", "acc_norm"} and res["meta"]["mc_limit"] == 16
    assert cells["rtn"]["seeds"] == [] and cells["gptq"]["seeds"] == [0]
    assert cells["llmc-gptq"]["status"] == "not available" and "--build-env llmcompressor" in cells["llmc-gptq"]["reason"]
    for name in set(CELLS) - set(run):
        assert cells[name]["status"] == "not run" and cells[name]["reason"] == "not among --cells"
    md = (tmp_path / "p.md").read_text()
    assert md.startswith("# Peers: stories-llama-1m W4 g64 sym") and "python -m bench peers" in md
    for name in CELLS:
        assert f"\n| {name} | " in md
    assert "not available: its environment is not built" in md and "not run: not among --cells" in md


def test_markdown_rows_for_every_status_and_stored_bytes(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a.qweight": torch.zeros(4, 8, dtype=torch.int32), "a.scales": torch.zeros(2, 8, dtype=torch.float16),
               "a.qzeros": torch.zeros(2, 1, dtype=torch.int32), "a.bias": torch.zeros(8)}, str(tmp_path / "m.safetensors"))
    per = safetensors_bytes(tmp_path, ("qweight", "qzeros", "scales"))
    assert per == {"a": 4 * 8 * 4 + 2 * 8 * 2 + 2 * 4}
    assert size_of(per, {"a": 256, "b": 100}) == {"linear_bytes": 168, "quantized_weights": 256, "quantized_layers": 1,
                                                  "effective_bits": 5.25}
    machine = {"nproc": 2, "cpu": "x", "torch_threads": 2, "load_average": [0.0]}
    meta = {"model": "m", "bits": 3, "group_size": 64, "sym": False, "command": "python -m bench peers", "date": "d",
            "wall_seconds": 1.0, "machine": machine, "calibration": "c", "seeds": [0, 1], "evaluation": "e",
            "peer_iters": 2, "mc_task": "sst2_mc", "mc_limit": None, "fp_task": {"acc": 0.5, "acc_norm": 0.25}}
    runs = [{"kl": 0.1, "top1": 0.9, "ppl_ratio": 1.1, "acc": 0.5, "linear_bytes": 10, "effective_bits": 3.25,
             "quantize_seconds": 1.0, "quantized_weights": 5, "quantized_layers": 1}, {"kl": 0.3, "top1": 0.7, "acc": 0.7,
            "ppl_ratio": 1.3, "linear_bytes": 10, "effective_bits": 3.25, "quantize_seconds": 3.0,
            "quantized_weights": 5, "quantized_layers": 1}]
    from bench.peers import summarize

    mean, std = summarize(runs)
    cells = [{"cell": "gptq", "tool": "compress", "version": "v", "method": "gptq", "status": "ok", "runs": runs,
              "mean": mean, "std": std},
             {"cell": "nncf-awq", "tool": "nncf", "version": "v", "method": "awq", "status": "not available",
              "reason": "NNCF has no INT3_ASYM weight mode", "runs": []}]
    md = markdown({"meta": meta, "cells": cells})
    assert "| gptq | compress v | gptq | 0.20000 +- 0.14142 | 0.8000 +- 0.1414 | 1.2000 +- 0.1414 | 0.6000 +- 0.1414 |" in md
    assert "| sst2_mc acc |" in md and "the FP model: acc 0.5000, acc_norm 0.2500" in md
    assert "| nncf-awq | nncf v | awq | not available: NNCF has no INT3_ASYM weight mode |" in md
    assert "Every cell quantized the same 5 weights (1 linear layers)." in md
    assert all(f"- {tool}:" in md for tool in NOTES)


def test_peers_help_and_bad_options():
    rc, out, err = lab("peers", "--help")
    assert rc == 0 and "Example" in out and "python -m bench peers" in out, err
    words = {w.strip(",.()") for w in out.replace("│", " ").split()}
    assert set(CELLS) <= words, set(CELLS) - words  # --help names every cell
    rc, _, err = lab("peers", "--seeds", "a,b")
    assert rc == 1 and "--seeds `a,b`" in err
    rc, _, err = lab("peers", "--cells", "rtn,nope")
    assert rc == 1 and "unknown --cells nope" in err


def test_summary_merges_files_and_puts_each_sides_best_together(tmp_path):
    from bench.peers import summary

    def cell(name, tool, kls, bits=4.25, seeds=None):
        runs = [{"kl": k, "top1": 0.5, "acc": 0.6, "effective_bits": bits, "seed": s}
                for k, s in zip(kls, seeds or range(len(kls)))]
        from bench.peers import summarize

        mean, std = summarize(runs)
        return {"cell": name, "tool": tool, "status": "ok", "runs": runs, "mean": mean, "std": std}

    meta = {"model": "/x/smol", "bits": 4, "group_size": 128, "sym": True, "nsamples": 64, "seqlen": 256}
    one = {"meta": meta, "cells": [cell("gptq", "compress", [0.3]), cell("awq+gptq", "compress", [0.2]),
                                   cell("llmc-awq", "llm-compressor", [0.4], 4.5),
                                   {"cell": "nncf-awq", "tool": "nncf", "status": "failed", "reason": "r", "runs": []}]}
    # seeds 1 and 2 of one cell, run later with the same settings: pooled with seed 0 (a rerun of seed 0 replaces it)
    seeds = {"meta": meta, "cells": [cell("awq+gptq", "compress", [0.1, 0.3], seeds=[1, 2])]}
    md = summary([("a.json", one), ("b.json", seeds)])
    row = next(line for line in md.splitlines() if line.startswith("| smol |"))
    assert "compress awq+gptq (3 seeds) | 0.2000 +- 0.1000 |" in row and "llm-compressor llmc-awq | 0.4000 |" in row
    assert "| 0.50 | a.json, b.json |" in row and "W4 g128 sym" in row
    rerun = {"meta": meta, "cells": [cell("awq+gptq", "compress", [0.05])]}  # seed 0 again: replaces the first
    row = next(line for line in summary([("a.json", one), ("b.json", seeds), ("c.json", rerun)]).splitlines()
               if line.startswith("| smol |"))
    assert "compress awq+gptq (3 seeds) | 0.1500 +- 0.1323 |" in row, row
    other = {"meta": {**meta, "nsamples": 128}, "cells": [cell("awq+gptq", "compress", [0.25])]}  # not poolable
    row = next(line for line in summary([("a.json", one), ("b.json", seeds), ("d.json", other)]).splitlines()
               if line.startswith("| smol |"))
    assert "compress awq+gptq | 0.2500 |" in row, row
    rc, out, err = lab("peers-summary", tmp_path / "missing.json")
    assert rc == 1 and "not a `bench peers --json` file" in err


def test_each_finished_cell_is_saved_as_it_lands(tmp_path, monkeypatch):
    """An interrupted run keeps what it measured: `checkpoint` gets the cells so far after each one, marked partial,
    and `python -m bench peers` writes them where the final file goes."""
    from bench import peers

    seen = []
    monkeypatch.setattr(peers, "compress_cell", lambda cell, *a: {"kl": {"rtn": 0.2, "gptq": 0.1}[cell], "top1": 0.5,
                                                                  "quantized_weights": 5, "quantized_layers": 1})
    res = peers.run_peers(str(MODELS / "stories-llama-1m"), 4, 64, True, nsamples=2, seqlen=16, seeds=(0,),
                          max_tokens=64, cells=["rtn", "gptq"], mc_task=None, checkpoint=seen.append)
    assert [[c["cell"] for c in r["cells"] if c["status"] == "ok"] for r in seen] == [["rtn"], ["rtn", "gptq"]]
    assert all(r["meta"]["partial"] for r in seen) and "partial" not in res["meta"]
    from bench.__main__ import _save_partial

    _save_partial(seen[0], peers.markdown, tmp_path / "p.json", tmp_path / "p.md")
    assert json.loads((tmp_path / "p.json").read_text())["meta"]["partial"] is True
    assert "**Partial: the cells finished so far" in (tmp_path / "p.md").read_text()


@pytest.mark.e2e
@pytest.mark.parametrize("scheme,ours", [("w8a8-int8", ("rtn", "gptq", "sq+gptq")), ("fp8", ("rtn", "gptq")),
                                         ("nvfp4a16", ("rtn",)), ("w4a4", ("walsh+rtn", "infoquant+rtn"))])
def test_peers_w8a8_scheme_scores_checkpoints_as_served(tmp_path, monkeypatch, scheme, ours):
    """`--scheme w8a8-int8` / `fp8`: compress's rtn, gptq and SmoothQuant + GPTQ cells export compressed-tensors,
    scored as served (transformers + compressed-tensors, activations quantized per token), which agrees with the
    run's own evaluation (W4A4 with `--kv-cache int4:dynamic`: its KV cache too); weight-only cells are rows with the
    reason, and SmoothQuant without a scheme is refused."""
    monkeypatch.setenv("COMPRESS_ENGINES", str(tmp_path / "engines"))
    run = [*ours, "awq+gptq", "llmc-sq+gptq"]
    kv = ["--kv-cache", "int4:dynamic"] if scheme == "w4a4" else []  # W4A4KV4: scored with compress's KV hooks
    rc, out, err = lab("peers", *TINY, "--scheme", scheme, *kv, "--cells", ",".join(run), "--mc-task", "",
                       "--json", tmp_path / "p.json", "--markdown", tmp_path / "p.md")
    assert rc == 0, err
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["meta"]["kv_cache"] == (kv[1] if kv else None)
    bits, group = {"nvfp4a16": (4, 16), "w4a4": (4, 128)}.get(scheme, (8, -1))
    assert (res["meta"]["scheme"], res["meta"]["bits"], res["meta"]["group_size"]) == (scheme, bits, group)
    stored = 8 if scheme == "w4a4" else bits  # W4A4's int-quantized layout holds each int4 value in a byte
    cells = {c["cell"]: c for c in res["cells"]}
    for name in ours:
        assert cells[name]["status"] == "ok", (name, cells[name].get("reason"))
        r = cells[name]["runs"][0]
        # served arithmetic == the run's evaluation (NVFP4: loaded with bf16-rounded weights)
        assert r["kl"] == pytest.approx(r["run_kl"], rel=1e-2 if scheme == "nvfp4a16" else 2e-3, abs=1e-5)
        assert stored < r["effective_bits"] < stored + 0.6 and r["bytes_from"].startswith("compressed-tensors")
    assert cells["awq+gptq"]["status"] == "not available" and "weight-only cell" in cells["awq+gptq"]["reason"]
    assert cells["llmc-sq+gptq"]["status"] == "not available"  # its environment is not built here
    assert (tmp_path / "p.md").read_text().startswith(f"# Peers: stories-llama-1m {scheme.upper()}")
    rc, out, err = lab("peers", *TINY, "--cells", "sq+gptq", "--mc-task", "", "--json", tmp_path / "q.json")
    assert rc == 0, err
    q = {c["cell"]: c for c in json.loads((tmp_path / "q.json").read_text())["cells"]}
    assert q["sq+gptq"]["status"] == "not available" and "--scheme w8a8-int8" in q["sq+gptq"]["reason"]
