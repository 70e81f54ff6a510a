"""`python -m bench quality --suite prune`: structured pruning on stories-llama-1m (docs/prune.md).

Every cell is one pipeline run (calibrated on the first 80% of TinyStories val, scored on the last 20%, the seed
picks the calibration windows and the heal batches), three seeds:

    ffn     25% and 50% of the FFN channels, `calibrated` vs `magnitude`, each without and with `heal`
    prunepath  experts of 16 neurons (24 per FFN of 384; also 32 and 8: the expert-size ablation), tau for 50%
            active experts, healed at that tau; then the one checkpoint evaluated at every tau of `taus`
            (`compress eval --ffn-mass`): perplexity vs active fraction, next to static FFN pruning at the same
            fraction (`PATH-prunepath.png` beside the Pareto plot)
    depth   1 and 2 blocks, `cosine` and `loss` (calibrated) vs `last`
    w4      the chained recipes: ffn 25% / 50% and depth 1 (calibrated + heal) then AutoRound W4 (group 32), next to the
            dense AutoRound W4 / W3 / W2 points (group 32): the size / perplexity Pareto plot (`--markdown` PATH ->
            PATH-pareto.png)

Scores: perplexity, KL(FP || pruned) and top-1 on the evaluation text; the model's bytes (weights as stored:
fp32 for what is not quantized, packed codes with their scales for what is).
`--quick` runs a few cells on stories260K with tiny sizes (plumbing only: no quality claim).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench import quality as bq

METRICS = ("ppl", "kl", "top1", "bytes", "params")
KEY = ("family", "amount", "importance", "heal", "quant")


@dataclass(frozen=True)
class PruneSettings:
    base: bq.Settings = replace(bq.FULL, eval_tokens=30_000)
    model: str = "stories-llama-1m"
    seeds: tuple[int, ...] = (0, 1, 2)
    ratios: tuple[float, ...] = (0.25, 0.5)
    depths: tuple[int, ...] = (1, 2)
    group: int = 32  # FFN widths kept as multiples of it (25% of 384 -> 288, 50% -> 192)
    score_samples: int = 32
    heal_steps: int = 200  # the heal stage's default: 200 x 4 x 128 tokens (~40 s per cell on 2 cores)
    heal_lr: float = 1e-3
    heal_batch: int = 4
    heal_seqlen: int = 128
    # PrunePath neurons per expert, the first the headline; 32, the published size for FFNs of 3072+, leaves
    # 12 experts in an FFN of 384
    expert_sizes: tuple[int, ...] = (16, 32, 8)
    taus: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


FULL = PruneSettings()
QUICK = PruneSettings(base=replace(bq.QUICK, iters=2, eval_tokens=512), model="stories260K", seeds=(0,),
                      ratios=(0.5,), depths=(1,), group=32, score_samples=4, heal_steps=4, heal_batch=2,
                      expert_sizes=(43,), taus=(0.5, 1.0))


def rows(s: PruneSettings) -> list[dict]:
    """Every setting of the matrix (a cell per seed)."""
    out = []
    for r in s.ratios:
        for imp in ("calibrated", "magnitude"):
            for heal in (False, True):
                out.append({"family": "ffn", "amount": r, "importance": imp, "heal": heal, "quant": None})
    for n in s.expert_sizes:
        out.append({"family": "prunepath", "amount": 0.5, "importance": f"router, experts of {n}", "heal": True,
                    "quant": None, "expert_size": n})
    for n in s.depths:
        for imp in ("cosine", "loss", "last"):
            out.append({"family": "depth", "amount": n, "importance": imp, "heal": False, "quant": None})
    for r in s.ratios:
        out.append({"family": "ffn", "amount": r, "importance": "calibrated", "heal": True, "quant": "w4"})
    out.append({"family": "depth", "amount": s.depths[0], "importance": "cosine", "heal": True, "quant": "w4"})
    for bits in (4, 3, 2):
        out.append({"family": "dense", "amount": 0, "importance": "-", "heal": False, "quant": f"w{bits}"})
    return out


def recipe(row: dict, path: str, calib: str, text: str, seed: int, s: PruneSettings) -> dict:
    base = replace(s.base, seed=seed)
    stages = []
    if row["family"] == "prunepath":
        stages.append({"stage": "prune", "method": "prunepath", "expert_size": row["expert_size"],
                       "target_active": row["amount"], "samples": min(s.score_samples, base.nsamples),
                       "seqlen": base.seqlen})
    elif row["family"] != "dense":
        p = {"stage": "prune", "method": row["family"], "importance": row["importance"],
             "samples": min(s.score_samples, base.nsamples), "seqlen": base.seqlen}
        p.update({"ratio": row["amount"], "multiple": s.group} if row["family"] == "ffn" else {"blocks": row["amount"]})
        stages.append(p)
    if row["heal"]:
        stages.append({"stage": "heal", "method": "distill", "steps": s.heal_steps, "lr": s.heal_lr,
                       "batch_size": s.heal_batch, "seqlen": min(s.heal_seqlen, base.seqlen)})
    if row["quant"]:
        stages.append({"stage": "quantize", "method": "autoround", "bits": int(row["quant"][1:]),
                       "group_size": s.group, "sym": False, "iters": base.iters, "batch_size": base.ar_batch_size})
    ev = {"data": [text], "text_slice": [0.8, 1.0], "window": base.window, "generation": {"prompts": 0}}
    if base.eval_tokens:
        ev["max_tokens"] = base.eval_tokens
    return {"version": 1, "description": f"bench prune: {row} seed {seed}", "model": {"path": path, "dtype": "float32"},
            "calibration": {"sources": [calib], "nsamples": base.nsamples, "seqlen": base.seqlen, "seed": seed},
            "stages": stages, "eval": ev,
            "export": {"formats": ["hf"] if row["family"] == "prunepath" else []}}


def run(rec: dict, tmp: Path, then=None) -> tuple[dict, object]:
    """(report, `then(output directory)` before it is removed) of one pipeline run."""
    import shutil

    import yaml

    from compress import pipeline
    from compress.recipe import load_recipe

    path, out = tmp / "cell.yaml", tmp / "cell"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    try:
        report = pipeline.run(load_recipe(path), out, force=True, quiet=True)
        return report, then(out) if then else None
    finally:
        shutil.rmtree(out, ignore_errors=True)


def tau_curve(out: Path, text: str, fp: str, s: PruneSettings) -> list[dict]:
    """Perplexity and active fraction of one PrunePath checkpoint at every tau (`compress eval --ffn-mass`)."""
    from compress.eval.cli import evaluate_checkpoint

    curve = []
    for tau in s.taus:
        ev = evaluate_checkpoint(str(out / "hf"), reference=fp, data=[text], window=s.base.window,
                                 max_tokens=s.base.eval_tokens, gen_prompts=0, ffn_mass=tau, text_slice=(0.8, 1.0))
        r = next(iter(ev.values()))
        curve.append({"tau": tau, "active": r["ffn_active"], "ppl": r["ppl"], "kl": r["kl"]})
    return curve


def cell(row: dict, path, calib, text, seed: int, s: PruneSettings, tmp: Path) -> dict:
    then = (lambda out: tau_curve(out, text, path, s)) if row["family"] == "prunepath" else None
    report, curve = run(recipe(row, path, calib, text, seed, s), tmp, then)
    ev = next(iter(report["eval"].values()))
    out = {**row, "seed": seed, "fp_ppl": ev["fp_ppl"], "ppl": ev["ppl"], "kl": ev["kl"], "top1": ev["top1"],
           "bytes": report["size"]["packed_bytes"], "fp_bytes": report["size"]["fp_bytes"]}
    steps = report.get("structure", [])
    prune = next((st for st in steps if st["stage"] == "prune"), None)
    out["params"] = prune["parameters_after"] if prune else None
    heal = next((st for st in steps if st["stage"] == "heal"), None)
    if heal:
        out.update(heal_kl_before=heal["kl_before"], heal_kl_after=heal["kl_after"])
    if curve:
        out.update(curve=curve, tau=prune["tau"], active=prune["active_fraction"])
    return out


def summarize(cells: list[dict]) -> list[dict]:
    keys = [tuple(r[k] for k in KEY) for r in rows(FULL)] + [tuple(r[k] for k in KEY) for r in rows(QUICK)]
    order = {k: i for i, k in reversed(list(enumerate(keys)))}
    out = []
    for k, cs in bq.seed_groups(cells, KEY, lambda k: order.get(k, len(order))):
        r = {**dict(zip(KEY, k)), "seeds": len(cs), "fp_ppl": cs[0]["fp_ppl"],
             **(bq.mean_sd(cs, ("params",)) if cs[0]["params"] is not None else {"params": None}),
             **bq.mean_sd(cs, ("ppl", "kl", "top1", "bytes", "tau", "active"))}
        if "curve" in cs[0]:  # PrunePath: perplexity and active fraction per tau, mean over seeds
            r["curve"] = [{"tau": pt["tau"], **bq.mean_sd([c["curve"][j] for c in cs], ("active", "ppl", "kl"))}
                          for j, pt in enumerate(cs[0]["curve"])]
        out.append(r)
    return out


def targets(summary: list[dict]) -> list[dict]:
    """FFN 25% calibrated + heal <= 1.10 x FP perplexity; calibrated beats magnitude at both ratios (with and
    without heal); depth: the calibrated choice at least as good as the last blocks in every cell."""
    by = {tuple(r[k] for k in KEY): r for r in summary}
    out = []
    for k, r in by.items():
        fam, amount, imp, heal, quant = k
        if quant:
            continue
        if fam == "ffn" and imp == "calibrated":
            if amount == 0.25 and heal:
                out.append({"target": "ffn 25% calibrated + heal ppl <= 1.10 x FP",
                            "met": r["ppl"] <= 1.10 * r["fp_ppl"],
                            "value": f"{r['ppl']:.4f} vs FP {r['fp_ppl']:.4f} (x{r['ppl'] / r['fp_ppl']:.4f})"})
            m = by.get((fam, amount, "magnitude", heal, None))
            if m:
                out.append({"target": f"ffn {amount:.0%}{' + heal' if heal else ''}: calibrated ppl < magnitude",
                            "met": r["ppl"] < m["ppl"], "value": f"{r['ppl']:.4f} vs {m['ppl']:.4f}"})
        if fam == "prunepath" and (static := by.get(("ffn", 1 - amount, "calibrated", True, None))):
            out.append({"target": f"PrunePath ({imp}) at {amount:.0%} active FFN (+ heal) ppl < static FFN pruning to "
                                  f"{1 - amount:.0%} (calibrated + heal)", "met": r["ppl"] < static["ppl"],
                        "value": f"{r['ppl']:.4f} (active {r['active']:.3f} on calibration tokens) vs "
                                 f"{static['ppl']:.4f}"})
        if fam == "depth" and imp in ("cosine", "loss") and (last := by.get((fam, amount, "last", heal, None))):
            out.append({"target": f"depth -{amount} blocks: {imp} ppl <= last blocks", "met": r["ppl"] <= last["ppl"],
                        "value": f"{r['ppl']:.4f} vs {last['ppl']:.4f}"})
    return out


def pareto_png(summary: list[dict], path: Path) -> None:
    from compress.eval.figures import _pyplot

    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in summary:
        label = (f"{r['family']} {r['amount']}" if r["family"] != "dense" else "dense") + \
                (f" {r['importance']}" if r["family"] != "dense" else "") + (" +heal" if r["heal"] else "") + \
                (f" {r['quant'].upper()}" if r["quant"] else " fp32")
        marker = "o" if r["quant"] else "^"
        ax.scatter(r["bytes"] / 1e6, r["ppl"], marker=marker, s=18)
        ax.annotate(label, (r["bytes"] / 1e6, r["ppl"]), fontsize=5)
    if summary:
        ax.axhline(summary[0]["fp_ppl"], ls="--", lw=0.8, color="grey")
    ax.set_xlabel("model bytes (MB; fp32 where not quantized)")
    ax.set_ylabel("perplexity (TinyStories val, last 20%)")
    ax.set_yscale("log")
    ax.set_title("structured pruning and W4/W3/W2 AutoRound: size vs perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def curve_png(summary: list[dict], path: Path) -> None:
    """Perplexity vs active FFN fraction: PrunePath over tau, static FFN pruning (+ heal), full precision."""
    from compress.eval.figures import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in summary:
        if "curve" in r:
            ax.plot([p["active"] for p in r["curve"]], [p["ppl"] for p in r["curve"]], "o-",
                    label=f"PrunePath, {r['importance'].removeprefix('router, ')} (heal at {r['amount']:.0%} active), "
                          f"tau {r['curve'][0]['tau']}..1")
    static = [r for r in summary if r["family"] == "ffn" and r["importance"] == "calibrated" and not r["quant"]]
    for heal in (False, True):
        pts = sorted((1 - r["amount"], r["ppl"]) for r in static if r["heal"] == heal)
        if pts:
            ax.plot(*zip(*pts), "s--", label=f"static FFN pruning, calibrated{' + heal' if heal else ''}")
    if summary:
        ax.axhline(summary[0]["fp_ppl"], ls=":", color="grey", label="full precision")
    ax.set_xlabel("active FFN fraction")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def run_prune(quick: bool = False, pareto: Path | None = None) -> tuple[dict, str]:
    s = QUICK if quick else FULL
    t0, meta = time.time(), bq.suite_meta(quick)
    cells = []
    bench = next(b for b in bq.benches() if b.name == s.model)
    with tempfile.TemporaryDirectory(prefix="compress-bench-prune-") as tmp_dir:
        tmp = Path(tmp_dir)
        path, calib = bq.model_path(bench), bq.calibration_file(bench, tmp)
        text = str(bq.TEXT / "tinystories" / "tinystories_val.txt")
        for row in rows(s):
            seeds = s.seeds if row["importance"] not in ("magnitude", "last") or row["heal"] else s.seeds[:1]
            for seed in seeds:  # magnitude / last without heal use no data: one seed
                c = cell(row, path, calib, text, seed, s, tmp)
                cells.append(c)
                bq.log.info("prune %s %s %s heal=%s %s seed %d: ppl %.4f", row["family"], row["amount"],
                            row["importance"], row["heal"], row["quant"], seed, c["ppl"])
    summary = summarize(cells)
    meta["wall_seconds"] = round(time.time() - t0, 1)
    result = {"meta": meta, "model": s.model, "settings": {**s.base.__dict__, **{k: v for k, v in s.__dict__.items()
                                                                              if k != "base"}},
              "summary": summary, "cells": cells, "targets": targets(summary)}
    if pareto:
        pareto_png(summary, pareto)
        curves = pareto.with_name(pareto.name.replace("-pareto", "-prunepath"))
        curve_png(summary, curves)
        result.update(pareto=str(pareto), curves=str(curves))
    return result, markdown(result)


def markdown(result: dict) -> str:
    m, s, pm = result["meta"], result["settings"], bq.pm
    lines = ["# Structured pruning benchmark: FFN channels, depth, heal, chained with AutoRound\n",
             bq.suite_header(m),
             f"- model: {result['model']}; calibration {s['nsamples']} x {s['seqlen']} tokens (first 80% of "
             f"TinyStories val), scores on {s['score_samples']} sequences; heal {s['heal_steps']} steps, lr "
             f"{s['heal_lr']}, batch {s['heal_batch']} x {s['heal_seqlen']} tokens; AutoRound {s['iters']} iterations, "
             f"group {s['group']}, asymmetric; "
             f"evaluation: {s['window']}-token windows over the first {s['eval_tokens']} tokens of "
             "the last 20%",
             "- values: mean ± sample standard deviation over seeds (magnitude and last without heal read no data: "
             "one seed)\n",
             "| family | amount | importance | heal | quant | params | bytes | ppl | KL | top-1 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        amount = {"ffn": f"{r['amount']:.0%}", "depth": f"-{r['amount']} blocks",
                  "prunepath": f"{r['amount']:.0%} active"}.get(r["family"], "-")
        lines.append(f"| {r['family']} | {amount} | {r['importance']} | {'yes' if r['heal'] else 'no'} | "
                     f"{r['quant'] or 'fp32'} | {r['params']:,.0f} | {r['bytes']:,.0f} | {pm(r, 'ppl')} | "
                     f"{pm(r, 'kl')} | {pm(r, 'top1', 3)} |" if r.get("params") is not None else
                     f"| {r['family']} | {amount} | {r['importance']} | {'yes' if r['heal'] else 'no'} | "
                     f"{r['quant'] or 'fp32'} | - | {r['bytes']:,.0f} | {pm(r, 'ppl')} | {pm(r, 'kl')} | "
                     f"{pm(r, 'top1', 3)} |")
    for r in result["summary"]:
        if "curve" in r:
            lines += ["", f"PrunePath, {r['importance'].removeprefix('router, ')} (one checkpoint, healed at tau "
                          f"{r['tau']:.4f}), `--ffn-mass` tau vs active FFN fraction (evaluation text) and perplexity:",
                      "",
                      "| tau | active | ppl | KL |", "|---|---|---|---|"]
            lines += [f"| {p['tau']} | {pm(p, 'active', 3)} | {pm(p, 'ppl')} | {pm(p, 'kl')} |" for p in r["curve"]]
    if result.get("pareto"):
        lines.append(f"\n![size vs perplexity]({Path(result['pareto']).name})")
        lines.append(f"\n![perplexity vs active FFN fraction]({Path(result['curves']).name})")
    return "\n".join(lines + bq.outcomes(result["targets"])) + "\n"
