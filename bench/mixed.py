"""`python -m bench quality --suite mixed`: mixed-precision allocation against its baselines
(docs/allocate.md#measured-results).

On the models that are sensitive at low bits (stories260K, stories-llama-1m), at effective budgets 2.25,
2.5 and 3.0 bits, every cell is one real pipeline run (`allocate` then `quantize: rtn`) with the same
calibration and evaluation: `uniform` (the single option whose uniform plan has the most bits within the
budget: the nearest feasible width), `greedy` (error-per-bit knapsack), `lagrangian` (multiple-choice
knapsack by Lagrangian relaxation), `greedy-sens` (greedy on the proxy weighted by the measured layer
sensitivities the RL controller uses) and `rl` (PPO controller with the perplexity terminal reward), each of
the last two also followed by `refine` (`greedy-sens+refine`, `rl+refine`: random pair moves kept when they
lower the selection slice's perplexity, `allocation.refine`), for three seeds (the seed picks the calibration
windows and the PPO seed). The final rounding of every unit is
plain fitting (min-max or the activation-weighted clipping search of its option), not AutoRound, so that
the matrix fits a 2-core machine; the allocators are compared on the same rounding.

Group size (= chunk width) per budget: the smallest of 32, 64, 128 whose 2-bit asymmetric option costs at
most `budget - 0.1` effective bits (3.0 -> 32, 2.5 -> 64, 2.25 -> 128), so every budget leaves room to
mix. A model whose layers are narrower than that group (stories260K: d_in 64 cannot hold a 128-group, and
2.25 bits is below its cheapest plan at any smaller group) is reported as infeasible at that budget.
Scores: perplexity, mean KL(FP || Q) and top-1 on the evaluation text; the exact effective bits of the
plan (codes + fp16 scales + zero points + plan metadata); allocation seconds (statistics + search).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from bench import quality as bq

BASELINES = ("uniform", "greedy", "lagrangian", "greedy-sens", "greedy-sens+refine")
RL_METHODS = ("rl", "rl+refine")
METHODS = BASELINES + RL_METHODS
METRICS = ("ppl", "kl", "top1", "effective_bits", "alloc_seconds", "search_seconds")
GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class MixedSettings:
    base: bq.Settings = replace(bq.FULL, eval_tokens=16_384)
    seeds: tuple[int, ...] = (0, 1, 2)
    budgets: tuple[float, ...] = (2.25, 2.5, 3.0)
    updates: int = 100
    episodes: int = 8
    reward_samples: int = 8
    reward_seqlen: int = 128
    select_samples: int = 32
    select_seqlen: int = 256
    sensitivity: str = "layer"  # layer | unit | none
    warm_start: int = 100
    keep_best: int = 8
    refine: int = 2000  # pair moves of the +refine rows


FULL = MixedSettings()
QUICK = MixedSettings(base=replace(bq.QUICK, eval_tokens=512), seeds=(0,), budgets=(3.0,), updates=2, episodes=2,
                      reward_samples=2, reward_seqlen=32, select_samples=4, select_seqlen=64, warm_start=10,
                      keep_best=2, refine=5)
RL_FIELDS = ("updates", "episodes", "reward_samples", "reward_seqlen", "select_samples", "select_seqlen",
             "sensitivity", "warm_start", "keep_best")


def group_for(budget: float) -> int:
    return next(g for g in GROUPS if 2 + 18 / g <= budget - 0.1)


def recipe(bench, path, calib, method, budget, seed, s: MixedSettings) -> dict:
    method, refined = method.removesuffix("+refine"), method.endswith("+refine")
    g = group_for(budget)
    base = replace(s.base, seed=seed)
    rec = bq.recipe(bench, path, calib, "rtn", 4, base)
    alloc = {"stage": "allocate", "method": method, "budget": budget, "group_size": g, "chunk_size": g, "sym": False}
    if method == "rl":
        alloc.update({k: getattr(s, k) for k in RL_FIELDS}, terminal="ppl", seed=seed,
                     reward_seqlen=min(s.reward_seqlen, base.seqlen), select_seqlen=min(s.select_seqlen, base.seqlen))
    if method == "greedy-sens":  # the greedy baseline with the RL controller's measured layer sensitivities
        alloc.update(method="greedy", sensitivity=s.sensitivity if s.sensitivity != "none" else "layer",
                     select_samples=s.select_samples, select_seqlen=min(s.select_seqlen, base.seqlen))
    if refined:
        alloc.update(refine=s.refine)
    rec["stages"] = [alloc, {"stage": "quantize", "method": "rtn", "group_size": g, "sym": False}]
    rec["eval"]["generation"] = {"prompts": 0}
    rec["description"] = f"bench mixed: {bench.name} {method} budget {budget} seed {seed}"
    return rec


def run_cell(rec: dict, tmp: Path) -> tuple[dict, dict, list]:
    """(report, allocate stage metrics, RL curve or []) of one pipeline run in a scratch directory."""
    from compress import pipeline
    from compress.recipe import load_recipe

    name = f"{Path(rec['model']['path']).name}-{rec['stages'][0]['method']}-{rec['stages'][0]['budget']}"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    out = tmp / name
    try:
        report = pipeline.run(load_recipe(path), out, force=True, quiet=True)
        manifest = json.loads((out / "manifest.json").read_text())
        metrics = next(st["metrics"] for k, st in manifest["stages"].items() if "allocate" in k)
        curve_file = next((out / "stages").glob("*-allocate-*/rl_curve.json"), None)
        curve = json.loads(curve_file.read_text()) if curve_file else []
        return report, metrics, curve
    finally:
        shutil.rmtree(out, ignore_errors=True)


def cell(bench, path, calib, method, budget, seed, s: MixedSettings, tmp: Path) -> dict:
    rec = recipe(bench, path, calib, method, budget, seed, s)
    report, metrics, curve = run_cell(rec, tmp)
    ev = next(iter(report["eval"].values()))
    return {"model": bench.name, "budget": budget, "group_size": rec["stages"][0]["group_size"], "method": method,
            "seed": seed, "fp_ppl": ev["fp_ppl"], "ppl": ev["ppl"], "kl": ev["kl"], "top1": ev["top1"],
            "effective_bits": metrics["effective_bits"], "report_effective_bits": report["size"]["effective_bits"],
            "alloc_seconds": metrics["seconds"], "search_seconds": metrics.get("search_seconds", 0.0),
            "proxy_error": metrics.get("proxy_error"), "picked": metrics.get("picked"), "curve": curve}


def feasible(path: str, budget: float) -> str | None:
    """None, or why no plan can meet `budget` on this model (narrowest layer vs group, cheapest option)."""
    from compress.models.loading import load_config

    cfg = load_config(path, None)
    g = group_for(budget)
    narrow = min(cfg.hidden_size, cfg.intermediate_size)
    if g > narrow:
        return (f"budget {budget} needs groups of {g} (2-bit at {2 + 18 / g:.3f} bits), wider than the model's "
                f"{narrow}-column layers; at group {narrow} the cheapest plan costs {2 + 18 / narrow:.4f} bits")
    return None


def summarize(cells: list[dict]) -> list[dict]:
    out = []
    for (model, budget, method), cs in bq.seed_groups(cells, ("model", "budget", "method"),
                                                      lambda k: (k[0], k[1], METHODS.index(k[2]))):
        out.append({"model": model, "budget": budget, "method": method, "group_size": cs[0]["group_size"],
                    "seeds": len(cs), "fp_ppl": cs[0]["fp_ppl"],
                    "max_effective_bits": max(c["effective_bits"] for c in cs),
                    "min_effective_bits": min(c["effective_bits"] for c in cs), **bq.mean_sd(cs, METRICS)})
    return out


def targets(summary: list[dict], infeasible: list[dict]) -> list[dict]:
    """The better RL row's mean ppl <= 0.95 x the best baseline row's (refined baselines included); the realised
    effective bits of every non-uniform cell within 0.01 of the budget and never above; RL allocation < 20 min
    per run (with refine)."""
    by = {(r["model"], r["budget"], r["method"]): r for r in summary}
    out = []
    for model, budget in dict.fromkeys((k[0], k[1]) for k in by):
        rls = [by[(model, budget, m)] for m in RL_METHODS if (model, budget, m) in by]
        bases = [by[(model, budget, m)] for m in BASELINES if (model, budget, m) in by]
        if not rls or not bases:
            continue
        best, best_rl = min(bases, key=lambda b: b["ppl"]), min(rls, key=lambda b: b["ppl"])
        out.append({"target": f"{model} @ {budget}: RL ppl <= 0.95 x best baseline ({best_rl['method']} vs "
                              f"{best['method']})",
                    "met": best_rl["ppl"] <= 0.95 * best["ppl"],
                    "value": f"{best_rl['ppl']:.4f} vs {best['ppl']:.4f} (x{best_rl['ppl'] / best['ppl']:.4f})"})
        slowest = by.get((model, budget, RL_METHODS[-1]), rls[0])  # rl+refine: the search and the refinement
        mix = [by[(model, budget, m)] for m in METHODS[1:] if (model, budget, m) in by]
        lo, hi = min(m["min_effective_bits"] for m in mix), max(m["max_effective_bits"] for m in mix)
        names = ", ".join(m["method"] for m in mix)
        out.append({"target": f"{model} @ {budget}: realised b_eff in [budget - 0.01, budget] ({names})",
                    "met": budget - 0.01 <= lo and hi <= budget, "value": f"{lo:.5f} .. {hi:.5f}"})
        out.append({"target": f"{model} @ {budget}: RL allocation < 20 min", "met": slowest["alloc_seconds"] < 1200,
                    "value": f"{slowest['alloc_seconds']:.1f} s mean (statistics + search)"})
    for x in infeasible:
        out.append({"target": f"{x['model']} @ {x['budget']}: any plan within the budget", "met": False,
                    "value": x["reason"]})
    return out


def run_mixed(quick: bool = False, only: list[str] | None = None, curve_png: Path | None = None,
              budgets: list[float] | None = None, seeds: list[int] | None = None, methods: list[str] | None = None,
              refine: int | None = None) -> tuple[dict, str]:
    """budgets / seeds / methods: run only these (default: all of the settings); refine: pair moves of the
    `+refine` rows (default 2000), e.g. to see how far a longer search on both sides moves them."""
    from compress.errors import BadInput

    chosen = bq.pick(methods, list(METHODS), "mixed method", "--method")
    if refine is not None and refine < 1:
        raise BadInput(f"--refine must be at least 1, got {refine}")
    s = QUICK if quick else FULL
    s = replace(s, budgets=tuple(budgets or s.budgets), seeds=tuple(seeds or s.seeds), refine=refine or s.refine)
    t0 = time.time()
    meta = bq.suite_meta(quick)
    cells, infeasible = [], []
    benches = [b for b in bq.selected(quick, only) if b.name in bq.SENSITIVE]
    with tempfile.TemporaryDirectory(prefix="compress-bench-mixed-") as tmp_dir:
        tmp = Path(tmp_dir)
        for bench in benches:
            path, calib = bq.model_path(bench), bq.calibration_file(bench, tmp)
            for budget in s.budgets:
                reason = feasible(path, budget)
                if reason:
                    infeasible.append({"model": bench.name, "budget": budget, "reason": reason})
                    continue
                for seed in s.seeds:
                    for method in chosen:
                        cells.append(cell(bench, path, calib, method, budget, seed, s, tmp))
                        c = cells[-1]
                        bq.log.info("mixed %s @%s seed %d %s: ppl %.4f b_eff %.5f alloc %.1fs", bench.name, budget,
                                    seed, method, c["ppl"], c["effective_bits"], c["alloc_seconds"])
    meta["wall_seconds"] = round(time.time() - t0, 1)
    summary = summarize(cells)
    result = {"meta": meta, "settings": {**s.base.__dict__, "seeds": list(s.seeds), "budgets": list(s.budgets),
                                         **{k: getattr(s, k) for k in RL_FIELDS}, "refine": s.refine,
                                         "methods": chosen},
              "summary": summary, "cells": cells, "infeasible": infeasible,
              "targets": targets(summary, infeasible)}
    if curve_png is not None and write_curves(cells, curve_png):
        result["meta"]["curve_png"] = curve_png.name
    return result, markdown(result)


def write_curves(cells: list[dict], path: Path) -> bool:
    """The `rl` rows' learning curves (the `rl+refine` rows' when only those ran); False when there are none."""
    from compress.allocate.figures import write_curve

    rl = ([c for c in cells if c["method"] == "rl" and c["curve"]]
          or [c for c in cells if c["method"] == "rl+refine" and c["curve"]])
    if not rl:
        return False
    write_curve([c["curve"] for c in rl], path,
                labels=[f"{c['model']} @{c['budget']} seed {c['seed']}" for c in rl])
    return True


def rl_extras(s: dict) -> str:
    """The RL settings beyond updates and the training reward (absent from results recorded before them)."""
    if "select_samples" not in s:
        return ""
    out = [f"final plan picked on {s['select_samples']} x {s['select_seqlen']} calibration tokens among the "
           f"argmax, the {s['keep_best']} best training episodes and 4 sampled plans"]
    if s["sensitivity"] != "none":
        out.append(f"proxy errors weighted per {s['sensitivity']} by the measured loss sensitivity (same slice)")
    if s["warm_start"]:
        out.append(f"policy warm-started by {s['warm_start']} behaviour-cloning steps toward the (weighted) greedy "
                   "plan, which is also a final candidate")
    return "; " + "; ".join(out)


def markdown(result: dict) -> str:
    m, s = result["meta"], result["settings"]
    f, pm = bq._fmt, bq.pm
    lines = [
        "# Mixed-precision benchmark: RL (PPO) allocation vs uniform, greedy and Lagrangian\n",
        "- `greedy-sens`: the greedy knapsack on the proxy errors weighted by the same measured layer sensitivities "
        "as the RL controller (same selection slice): the baseline with the RL controller's statistics",
        *([f"- `+refine`: the plan then refined by {s['refine']} random pair moves (one unit one option up, "
           "another one down), each kept when it lowers the perplexity of the selection slice within the budget"]
          if "refine" in s else []),
        bq.suite_header(m),
        f"- every cell: `allocate` (9 options: 2/3/4/8 bits x min-max/clip-search, plus 16-bit keep; asymmetric; "
        f"chunk = group) then `quantize: rtn` fitting each unit with its option (plain fitting, no AutoRound); "
        f"calibration {s['nsamples']} x {s['seqlen']} tokens from the first 80% of TinyStories val; seeds "
        f"{s['seeds']} (calibration windows and PPO seed)",
        f"- RL: {s['updates']} PPO updates x {s['episodes']} episodes, terminal reward -10 x (log ppl_Q - log ppl_FP) "
        f"on {s['reward_samples']} x {s['reward_seqlen']} calibration tokens" + rl_extras(s),
        f"- perplexity/KL/top-1: {s['window']}-token windows over the first {s['eval_tokens']} tokens of the last "
        "20% of TinyStories val; eff. bits = exact effective bits of the plan (codes, fp16 scales, zero points, "
        "plan metadata); alloc s = statistics + search seconds",
        "- values: mean ± sample standard deviation over seeds"
        + (f"; RL learning curves: `{m['curve_png']}`" if m.get("curve_png") else "") + "\n",
        "| model | budget | group | method | ppl | KL | top-1 | eff. bits (max) | alloc s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        lines.append(f"| {r['model']} | {r['budget']} | {r['group_size']} | {r['method']} | {pm(r, 'ppl')} | "
                     f"{pm(r, 'kl')} | {pm(r, 'top1', 3)} | {f(r['effective_bits'], 5)} ({f(r['max_effective_bits'], 5)}) "
                     f"| {pm(r, 'alloc_seconds', 1)} |")
    if result["summary"]:
        fp = {r["model"]: r["fp_ppl"] for r in result["summary"]}
        lines.append("\nFP perplexity: " + ", ".join(f"{k} {v:.4f}" for k, v in fp.items()))
    for x in result["infeasible"]:
        lines.append(f"\n{x['model']} @ {x['budget']}: infeasible: {x['reason']}")
    return "\n".join(lines + bq.outcomes(result["targets"])) + "\n"
