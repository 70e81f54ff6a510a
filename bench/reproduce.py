"""`python -m bench reproduce`: rerun seeded cells of the stored benchmark JSONs and diff their values.

Every quality cell is a seeded pipeline run, so a refactoring that keeps behaviour must give the same
numbers bit for bit. This reruns a chosen set of cells of `bench/quality.json` and the walsh, lfq and
mixed suites on stories260K, stories-llama-1m and ref-llama-7m (the settings are read back from each stored JSON) and compares every value that is
not a timing. A difference is listed field by field; the exit status is non-zero when any cell differs.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

from bench import lfq, mixed, walsh
from bench import quality as bq

TIMING = {"seconds", "cell_seconds", "alloc_seconds", "search_seconds", "curve"}
# (suite, stored file, model, cell): the cells the README quotes, one or more per method family and model
SMALL, MID, REF = "stories260K", "stories-llama-1m", "ref-llama-7m"
CELLS = [
    *[("ptq", "quality.json", SMALL, k) for k in [("rtn", 4), ("gptq", 4), ("autoround", 4), ("rtn", 2), ("gptq", 2),
                                                    ("autoround", 2), ("autoround-plain", 2)]],
    *[("ptq", "quality.json", MID, k) for k in [("autoround", 4), ("rtn", 2), ("gptq", 2), ("autoround", 2)]],
    ("ptq", "quality.json", REF, ("autoround", 4)),
    *[("walsh", "walsh-stories260K.json", SMALL, k) for k in [("walsh", 2, 0), ("walsh-fused", 2, 0),
                                                              ("autoround_hadamard", 2, 0)]],
    ("walsh", "walsh-stories-llama-1m.json", MID, ("walsh", 2, 0)),
    *[("lfq", "lfq-stories260K.json", SMALL, k) for k in [("lfq", 2, 0), ("hard_ce", 2, 0)]],
    ("lfq", "lfq-stories-llama-1m.json", MID, ("lfq", 2, 0)),
    *[("mixed", "mixed-stories260K.json", SMALL, k) for k in [("greedy", 2.5, 0), ("lagrangian", 2.5, 0),
                                                              ("uniform", 3.0, 0), ("rl", 2.5, 0)]],
    *[("mixed", "mixed-stories-llama-1m.json", MID, k) for k in [("greedy", 2.5, 0), ("rl", 2.5, 0)]],
    ("mixed-refine", "mixed-refine-stories260K.json", SMALL, ("greedy-sens+refine", 2.5, 0)),
]
QUICK = [("ptq", "quality.json", SMALL, ("rtn", 4)), ("ptq", "quality.json", SMALL, ("gptq", 2)),
         ("mixed", "mixed-stories260K.json", SMALL, ("greedy", 2.5, 0))]


def _settings(cls, stored: dict, base_cls=bq.Settings):
    """The suite's dataclass with the stored settings (tuples where the dataclass has tuples)."""
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items() if k in names}
    if "base" in names:
        base_names = {f.name for f in dataclasses.fields(base_cls)}
        kw["base"] = base_cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()
                                 if k in base_names})
    return cls(**kw)


def _diff(stored: dict, fresh: dict) -> list[str]:
    return [f"{k}: stored {stored.get(k)!r}, now {fresh.get(k)!r}" for k in sorted(set(stored) | set(fresh))
            if k not in TIMING and stored.get(k) != fresh.get(k)]


def _rerun(suite: str, key: tuple, stored: list | dict, bench, path: str, calib: str, tmp: Path) -> tuple[dict, dict]:
    model = bench.name
    if suite == "ptq":
        method, bits = key
        old = next(r for r in stored if r["model"] == model and r["method"] == method and r["bits"] == bits)
        s = dataclasses.replace(bq.FULL, nsamples=old["nsamples"], seqlen=old["seqlen"],
                                iters=old["iters"] or bq.FULL.iters)
        return old, bq.cell_row(bench, method, bits, bq.run_cell(bq.recipe(bench, path, calib, method, bits, s), tmp), s)
    cells, settings = stored["cells"], stored["settings"]
    if suite in ("walsh", "lfq"):
        variant, bits, seed = key
        old = next(c for c in cells if c["model"] == model and c["variant"] == variant and c["bits"] == bits
                   and c["seed"] == seed)
        mod = walsh if suite == "walsh" else lfq
        s = _settings(mod.WalshSettings if suite == "walsh" else mod.LfqSettings, settings)
        return old, mod.cell(bench, path, calib, bits, old["group_size"], variant, seed, s, tmp)
    method, budget, seed = key
    old = next(c for c in cells if c["model"] == model and c["method"] == method and c["budget"] == budget
               and c["seed"] == seed)
    return old, mixed.cell(bench, path, calib, method, budget, seed, _settings(mixed.MixedSettings, settings), tmp)


def run_reproduce(bench_dir: Path = Path("bench"), quick: bool = False, suites: list[str] | None = None,
                  against: dict | None = None, models: list[str] | None = None) -> tuple[dict, str]:
    """`against`: an earlier result of this function; its fresh values replace the stored JSONs' as reference."""
    earlier = {(r["suite"], r.get("model", SMALL), tuple(r["cell"])): r["values"]
               for r in (against or {}).get("cells", [])}
    chosen = [c for c in (QUICK if quick else CELLS) if (not suites or c[0] in suites) and (not models or c[2] in models)]
    benches = {b.name: b for b in bq.benches()}
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory(prefix="compress-bench-reproduce-") as tmp_dir:
        tmp = Path(tmp_dir)
        for suite, file, model, key in chosen:
            bench = benches[model]
            path, calib = bq.model_path(bench), bq.calibration_file(bench, tmp)
            stored = json.loads((bench_dir / file).read_text())
            t = time.time()
            old, new = _rerun(suite, key, stored, bench, path, calib, tmp)
            if against is not None:
                old = earlier[(suite, model, tuple(key))]
            diff = _diff(old, new)
            rows.append({"suite": suite, "file": file, "model": model, "cell": list(key), "identical": not diff,
                         "diff": diff, "values": {k: v for k, v in new.items() if k not in TIMING},
                         "seconds": round(time.time() - t, 1)})
            bq.log.info("reproduce %s %s %s: %s", suite, model, key, "identical" if not diff else "; ".join(diff))
    result = {"meta": {**bq.suite_meta(quick), "wall_seconds": round(time.time() - t0, 1)}, "cells": rows,
              "reference": "an earlier run of this command" if against is not None else "the stored JSONs",
              "identical": all(r["identical"] for r in rows)}
    return result, markdown(result)


def markdown(result: dict) -> str:
    lines = [f"# Seeded benchmark cells, rerun and diffed against {result['reference']}", "",
             bq.suite_header(result["meta"]), "",
             "Every value of a cell except its timings must be equal, bit for bit, to the stored one.", "",
             "| suite | file | model | cell | identical | differences | s |", "|---|---|---|---|---|---|---:|"]
    for r in result["cells"]:
        lines.append(f"| {r['suite']} | {r['file']} | {r.get('model', SMALL)} | {' '.join(map(str, r['cell']))} | "
                     f"{'yes' if r['identical'] else '**no**'} | {'; '.join(r['diff']) or '-'} | {r['seconds']} |")
    lines += ["", f"All identical: {'yes' if result['identical'] else '**no**'}", ""]
    return "\n".join(lines)
