"""`python -m bench.awq`: AWQ (`stage: smooth, method: awq`, docs/quantize.md#awq) before RTN and GPTQ, with and
without its clipping search, against the quantizer alone, on real models.

Every cell is one pipeline run (bench.quality.run_cell): calibration WikiText-2 valid, 64 x 256 tokens, seed 0 (the
same windows for the smoothing and the quantizer); evaluation WikiText-2 raw test, the first `--max-tokens` tokens in
256-token windows, against the full-precision model on the same tokens (KL(FP || Q), top-1 agreement, perplexity
ratio), and the seconds of the smooth and quantize stages. Same settings as bench/rtn-optimized.md, so its RTN and
GPTQ rows are comparable.

    python -m bench.awq --only ref-llama-7m --json bench/awq-ref-llama-7m.json --markdown bench/awq-ref-llama-7m.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from bench.quality import run_cell
from bench.rtn_optimized import SETTINGS, TEST, VALID, model_path, setting, settings_of, write

log = logging.getLogger(__name__)
# cell -> (smooth stage options or None, quantize method)
CELLS = {
    "rtn": (None, "rtn"),
    "awq(clip)+rtn": ({"clip": True}, "rtn"),
    "awq(no clip)+rtn": ({"clip": False}, "rtn"),
    "gptq": (None, "gptq"),
    "awq(clip)+gptq": ({"clip": True}, "gptq"),
    "awq(no clip)+gptq": ({"clip": False}, "gptq"),
}


def recipe(path: str, cell: str, bits: int, group: int, sym: bool, max_tokens: int) -> dict:
    smooth, method = CELLS[cell]
    stages = [] if smooth is None else [{"stage": "smooth", "method": "awq", **smooth}]
    stages.append({"stage": "quantize", "method": method, "bits": bits, "group_size": group, "sym": sym})
    return {"version": 1, "description": f"bench awq: {cell} W{bits} g{group}",
            "model": {"path": path, "dtype": "float32"},
            "calibration": {"sources": [str(VALID)], "nsamples": 64, "seqlen": 256, "seed": 0},
            "stages": stages,
            "eval": {"data": [str(TEST)], "window": 256, "max_tokens": max_tokens, "generation": {"prompts": 0}},
            "export": {"formats": []}}


def cell_row(name: str, cell: str, bits: int, group: int, sym: bool, max_tokens: int, tmp: Path) -> dict:
    t = time.time()
    rep = run_cell(recipe(model_path(name), cell, bits, group, sym, max_tokens), tmp)
    ev = next(iter(rep["eval"].values()))
    sec = {k: round(sum(s["seconds"] for s in rep["stages"] if s.get("name") == k), 2) for k in ("smooth", "quantize")}
    return {"model": name, "bits": bits, "group_size": group, "sym": sym, "method": cell, "kl": ev["kl"],
            "top1": ev["top1"], "ppl_ratio": ev["ppl_ratio"], "tokens": ev["tokens"],
            "effective_bits": rep["size"]["effective_bits"], "smooth_seconds": sec["smooth"],
            "quantize_seconds": sec["quantize"], "cell_seconds": round(time.time() - t, 1)}


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"`{m['command']}`", "",
             f"{m['date']}, {m['wall_seconds']} s. Machine: {m['machine']['nproc']} CPUs, {m['machine']['cpu']} "
             f"(torch threads {m['machine']['torch_threads']}, load average at the start "
             f"{m['machine']['load_average']}). Evaluation: WikiText-2 raw test, the first {m['max_tokens']} tokens "
             "in 256-token windows, against the full-precision model on the same tokens. Calibration (AWQ and GPTQ): "
             "WikiText-2 valid, 64 x 256 tokens, seed 0.", "",
             "| model | setting | method | KL | top-1 | ppl ratio | eff. bits | smooth s | quantize s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['model']} | {setting(r)} | {r['method']} | {r['kl']:.4f} | {r['top1']:.4f} | "
                     f"{r['ppl_ratio']:.4f} | {r['effective_bits']} | {r['smooth_seconds']} | "
                     f"{r['quantize_seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.awq", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", help="run only these models (repeatable): " + ", ".join(SETTINGS))
    p.add_argument("--cells", default=",".join(CELLS), help="comma-separated: " + ", ".join(CELLS))
    p.add_argument("--setting", action="append", help="run only these settings (repeatable), e.g. W3g64asym")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from compress.eval.machine import machine

    t0 = time.time()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "max_tokens": a.max_tokens, "command": "python -m bench.awq " + " ".join(sys.argv[1:])}
    cells = [c.strip() for c in a.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        p.error(f"unknown cells {unknown}; known: {', '.join(CELLS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.only or list(SETTINGS):
            for bits, group, sym in settings_of(name, a.setting):
                for cell in cells:
                    rows.append(cell_row(name, cell, bits, group, sym, a.max_tokens, Path(tmp)))
                    log.info("%s", json.dumps(rows[-1]))
    meta["wall_seconds"] = round(time.time() - t0, 1)
    res = {"meta": meta, "rows": rows}
    write(res, markdown(res), a.json, a.markdown)


if __name__ == "__main__":
    main()
