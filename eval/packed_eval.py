"""`compress bench eval`: `compress eval` of a packed export against the run's own evaluation, same tokens.

For each bit width, one real pipeline run (RTN, asymmetric, `group` columns; every linear of the blocks packed;
`hf` export) evaluates its in-memory quantized model against the full-precision one on the first `max_tokens`
tokens of `data` (report.json, stage `eval`: seconds, ppl, KL). Then, in the same process and on the same
tokens, `compress eval OUT/hf --reference MODEL --data FILE` (`evaluate_checkpoint`, backend `auto`: our
packed kernels, whose prefill path dequantizes slice by slice and calls BLAS, docs/kernels.md#prefill) is
timed. `ratio` = packed evaluation seconds / the run's; `kl_diff` = |KL of the file - KL of the run|.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import yaml

from compress.eval.machine import machine, machine_text

BITS = (2, 3, 4, 8)
DEFAULTS = dict(group=64, max_tokens=32768, window=256)


def recipe(model: str, data: str, bits: int, group: int, max_tokens: int, window: int) -> dict:
    return {"version": 1, "description": f"bench eval: RTN W{bits} g{group} asym, hf export",
            "model": {"path": model, "dtype": "float32"},
            "stages": [{"stage": "quantize", "method": "rtn", "bits": bits, "group_size": group, "sym": False}],
            "eval": {"data": [data], "window": window, "max_tokens": max_tokens},
            "export": {"formats": ["hf"]}}


def cell(model: str, data: str, bits: int, tmp: Path, group: int, max_tokens: int, window: int) -> dict:
    """One bit width: the run (its eval timed by the pipeline) and `compress eval` of its export."""
    from compress import pipeline
    from compress.eval.cli import evaluate_checkpoint
    from compress.recipe import load_recipe

    path, out = tmp / f"w{bits}.yaml", tmp / f"w{bits}"
    path.write_text(yaml.safe_dump(recipe(model, data, bits, group, max_tokens, window), sort_keys=False))
    report = pipeline.run(load_recipe(path), out, force=True, quiet=True)
    run_s = next(t["seconds"] for t in report["stages"] if t["name"] == "eval")
    run_ev = next(iter(report["eval"].values()))
    backends = {}
    t = time.perf_counter()
    packed = evaluate_checkpoint(str(out / "hf"), reference=model, data=[data], window=window, max_tokens=max_tokens,
                                 notify=backends.update)
    packed_s = time.perf_counter() - t
    ev = next(iter(packed.values()))
    shutil.rmtree(out, ignore_errors=True)
    return {"bits": bits, "group": group, "tokens": ev["tokens"], "run_eval_s": round(run_s, 2),
            "packed_eval_s": round(packed_s, 2), "ratio": round(packed_s / run_s, 3), "backends": backends,
            "run": {k: run_ev[k] for k in ("ppl", "kl", "top1")}, "packed": {k: ev[k] for k in ("ppl", "kl", "top1")},
            "kl_diff": float(f"{abs(ev['kl'] - run_ev['kl']):.3e}")}


def run(model: str, data: str, bits=BITS, group: int = DEFAULTS["group"], max_tokens: int = DEFAULTS["max_tokens"],
        window: int = DEFAULTS["window"]) -> dict:
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        cells = [cell(model, data, b, Path(tmp), group, max_tokens, window) for b in bits]
    return {"model": model, "data": data, "machine": machine(), "max_tokens": max_tokens, "window": window,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "seconds": round(time.time() - t0, 1), "cells": cells}


def markdown(result: dict) -> str:
    lines = [f"`compress eval` of each packed `hf` export vs the run's own evaluation, {result['cells'][0]['tokens']} "
             f"scored tokens of `{Path(result['data']).name}` ({result['window']}-token windows), "
             f"model `{Path(result['model']).name}`, {result['date']}.{machine_text(result['machine'])}", "",
             "| weights | run eval s | `compress eval` s | ratio | ppl run / file | KL run / file | KL diff | backends |",
             "|---|---:|---:|---:|---|---|---:|---|"]
    for c in result["cells"]:
        r, p = c["run"], c["packed"]
        lines.append(f"| W{c['bits']} g{c['group']} asym | {c['run_eval_s']:.1f} | {c['packed_eval_s']:.1f} | "
                     f"{c['ratio']:.2f}x | {r['ppl']:.4f} / {p['ppl']:.4f} | {r['kl']:.5f} / {p['kl']:.5f} | "
                     f"{c['kl_diff']:.1e} | {', '.join(f'{k} {v}' for k, v in c['backends'].items())} |")
    return "\n".join(lines) + "\n"
