"""`python -m bench quality --suite moe`: expert-level allocation (GEMQ) against its baselines (docs/moe.md).

Model: stories-moe (bench/moe_model.py builds it into the cache when it is missing; its sha256 goes into
the results), calibrated on the first 80% of TinyStories val and scored on the last 20%. First the model is
characterised: FP perplexity, RTN W2 and W3 (g64) perplexity ratios (it can rank low-bit methods only if
rounding hurts it), the tokens routed to each expert and the spread of the experts' sensitivities (from the
statistics of one `allocate moe` run).

Then at 2.0, 2.5 and 3.0 bits per expert parameter, three seeds (the seed picks the calibration windows), for
the quantizers GPTQ (as published) and AutoRound, every cell one pipeline run with the same calibration:

    uniform   `allocate moe, solve: uniform` (the widest single width that fits)
    local     `solve: local` (per-layer program, the published baseline)
    greedy    `solve: greedy` (allocate's error-per-bit knapsack at expert granularity, same statistics)
    gemq      `solve: global`
    gemq+ft   `solve: global`, then `finetune: router`

Candidate widths: the stage's default 2, 3 and 4 bits where a 2-bit plan fits the budget, else the published
1, 2 and 3 (1 bit: the sign rule; 2.0 bits, GPTQ only: AutoRound does not round signs, so its 2.0 cells are
recorded infeasible). Attention layers at 4 bits, the same group for every layer (the smallest of 64 and 128
whose narrowest candidate fits the budget). Scores: perplexity, KL(FP || Q) and top-1 on
the evaluation text; the plan's bits per expert parameter; statistics + allocation seconds; for gemq+ft the
router top-k match and KL before and after.
`--quick` runs the same code on a tiny random Mixtral (plumbing only: no quality claim).
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
from compress import registry
from compress.quantize.spine import SIGN

METHODS = ("uniform", "local", "greedy", "gemq", "gemq+ft", "gemq+ft-lm")
SOLVE = {"uniform": "uniform", "local": "local", "greedy": "greedy", "gemq": "global", "gemq+ft": "global",
         "gemq+ft-lm": "global"}
FT = {"gemq+ft": "kl", "gemq+ft-lm": "lm"}  # router fine-tuning loss of each row
METRICS = ("ppl", "kl", "top1", "effective_bits", "alloc_seconds")


@dataclass(frozen=True)
class MoESettings:
    base: bq.Settings = replace(bq.FULL, eval_tokens=16_384)
    seeds: tuple[int, ...] = (0, 1, 2)
    budgets: tuple[float, ...] = (2.0, 2.5, 3.0)
    quantizers: tuple[str, ...] = ("gptq", "autoround")
    stat_samples: int = 32
    stat_seqlen: int = 256
    ft_samples: int = 64
    ft_lr: float = 1e-3  # loss kl
    ft_lr_lm: float = 1e-4  # loss lm (the published objective and learning rate)
    group: int | None = None  # one group size for every budget (`--group`); None: `group_for`'s choice


FULL = MoESettings()
QUICK = MoESettings(base=replace(bq.QUICK, eval_tokens=512), seeds=(0,), budgets=(3.4,), quantizers=("gptq",),
                    stat_samples=4, stat_seqlen=32, ft_samples=4)
GROUPS = (64, 128)
WIDTHS, PUBLISHED_WIDTHS = (2, 3, 4), (1, 2, 3)  # the stage's default candidates; GEMQ's (1 bit: the sign rule)


def cost(bits: int, group: int) -> float:
    """Bits per parameter of an asymmetric `bits`-bit expert: fp16 scale and zero point per group (none at 1 bit)."""
    from compress.qweight import unit_storage_bits

    return unit_storage_bits(1, group, group, bits, False) / group


def widths_for(budget: float) -> tuple[int, ...]:
    """The candidate widths at `budget`: the default where a 2-bit plan fits with room to mix, else the
    published ones with 1 bit."""
    return WIDTHS if cost(2, GROUPS[-1]) <= budget - 0.1 else PUBLISHED_WIDTHS


def group_for(budget: float, narrowest: int, bits=WIDTHS) -> int | None:
    """The smallest group whose narrowest candidate leaves room to mix, or None."""
    return next((g for g in GROUPS if g <= narrowest and cost(min(bits), g) <= budget - 0.1), None)


def top_widths_for(budget: float, group: int, experts: int, bits=WIDTHS) -> int:
    """The most widths (<= 2, the published rule) every layer can be required to hold at least one expert of,
    with the cheapest plan within `budget`: a b-bit asymmetric expert costs b + (16 + b) / group bits per
    parameter (fp16 scale, b-bit zero point per group; 16 / group at 1 bit), so the rule's price grows with the
    overhead."""
    cost_of = {b: cost(b, group) for b in bits}
    top = sorted(bits, reverse=True)
    for t in (2, 1, 0):
        if ((experts - t) * cost_of[min(bits)] + sum(cost_of[b] for b in top[:t])) / experts <= budget:
            return t
    return 0


def recipe(path: str, calib: str, text: str, method: str, quantizer: str, budget: float, group: int, seed: int,
           s: MoESettings, top_widths: int = 2, bits=WIDTHS) -> dict:
    base = replace(s.base, seed=seed)
    q = {"stage": "quantize", "method": quantizer, "bits": 4, "group_size": group, "sym": False}
    if quantizer == "autoround":
        q.update(iters=base.iters, batch_size=base.ar_batch_size)
    stages = [{"stage": "allocate", "method": "moe", "budget": budget, "solve": SOLVE[method], "top_widths": top_widths,
               "bits": list(bits), "samples": s.stat_samples, "seqlen": min(s.stat_seqlen, base.seqlen)}, q]
    if method in FT:
        stages.append({"stage": "finetune", "method": "router", "loss": FT[method],
                       "lr": s.ft_lr if FT[method] == "kl" else s.ft_lr_lm,
                       "samples": min(s.ft_samples, base.nsamples), "seqlen": base.seqlen})
    ev = {"data": [text], "window": base.window, "generation": {"prompts": 0}}
    if text.endswith("tinystories_val.txt"):
        ev["text_slice"] = [0.8, 1.0]
    if base.eval_tokens:
        ev["max_tokens"] = base.eval_tokens
    return {"version": 1, "description": f"bench moe: {method} {quantizer} {budget} seed {seed}",
            "model": {"path": path, "dtype": "float32"},
            "calibration": {"sources": [calib], "nsamples": base.nsamples, "seqlen": base.seqlen, "seed": seed},
            "stages": stages, "eval": ev, "export": {"formats": []}}


def run(rec: dict, tmp: Path, out: Path, resume: bool = False) -> tuple[dict, dict]:
    """(report, the allocate stage's statistics.json) of one pipeline run into `out` (the caller removes it);
    `resume` continues an earlier run there (its finished stages with the same settings are loaded)."""
    from compress import pipeline
    from compress.recipe import load_recipe

    path = tmp / "cell.yaml"
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    report = pipeline.run(load_recipe(path), out, resume=resume, force=not resume, quiet=True)
    stats = json.loads(next((out / "stages").glob("*-allocate-moe/statistics.json")).read_text())
    return report, stats


def cell(path, calib, text, method, quantizer, budget, group, seed, s: MoESettings, tmp: Path,
         out: Path, resume: bool = False, top_widths: int = 2, bits=WIDTHS) -> tuple[dict, dict]:
    report, stats = run(recipe(path, calib, text, method, quantizer, budget, group, seed, s, top_widths, bits), tmp,
                        out, resume)
    ev = next(iter(report["eval"].values()))
    alloc = next(st for st in report["stages"] if st["name"] == "allocate")
    row = {"method": method, "quantizer": quantizer, "budget": budget, "group_size": group, "seed": seed,
           "top_widths": top_widths, "bits": list(bits),
           "fp_ppl": ev["fp_ppl"], "ppl": ev["ppl"], "kl": ev["kl"], "top1": ev["top1"],
           "effective_bits": report["allocation"]["effective_bits"], "alloc_seconds": alloc["seconds"],
           "expert_bits": report["allocation"]["expert_bits"]}
    if "routers" in report:
        row.update({k: report["routers"][k] for k in ("topk_match_before", "topk_match_after", "router_kl_before",
                                                       "router_kl_after")})
    return row, stats


def characterise(path: str, calib: str, text: str, s: MoESettings, tmp: Path) -> dict:
    """FP perplexity and RTN W2/W3 g64 perplexity ratios of the model (a dense `quantize: rtn` run each)."""
    out = {}
    for bits in (2, 3):
        rec = recipe(path, calib, text, "uniform", "rtn", 9.0, 64, s.seeds[0], s)
        rec["stages"] = [{"stage": "quantize", "method": "rtn", "bits": bits, "group_size": 64, "sym": False}]
        rep = bq.run_cell(rec, tmp)
        ev = next(iter(rep["eval"].values()))
        out.update(fp_ppl=ev["fp_ppl"], **{f"rtn_w{bits}_ratio": ev["ppl_ratio"]})
    return out


def targets(rows: list[dict], cells: list[dict]) -> list[dict]:
    """The issue's targets, each with `met`: GEMQ + router FT <= 0.85 x uniform perplexity at 2.5 bits; global <=
    local in at least 2 of 3 seeds at every budget; router FT lowers router KL by >= 10% and raises the top-k
    match; statistics + allocation under 10 minutes."""
    by = {(r["quantizer"], r["budget"], r["method"]): r for r in rows}
    ppl = {(c["quantizer"], c["budget"], c["method"], c["seed"]): c["ppl"] for c in cells}
    out = []
    for (qz, budget, method), r in by.items():
        where = f"{qz} @ {budget}"
        if method in FT and budget == 2.5 and (u := by.get((qz, budget, "uniform"))):
            out.append({"target": f"{where}: GEMQ + router FT ({FT[method]}) ppl <= 0.85 x uniform",
                        "met": r["ppl"] <= 0.85 * u["ppl"],
                        "value": f"{r['ppl']:.4f} vs {u['ppl']:.4f} (x{r['ppl'] / u['ppl']:.4f}; full precision "
                                 f"is x{r['fp_ppl'] / u['ppl']:.4f})"})
        if method == "gemq" and (qz, budget, "local") in by:
            seeds = [k[3] for k in ppl if k[:3] == (qz, budget, "gemq") and (qz, budget, "local", k[3]) in ppl]
            n = sum(ppl[(qz, budget, "gemq", s)] <= ppl[(qz, budget, "local", s)] for s in seeds)
            out.append({"target": f"{where}: global <= local ppl in >= 2 of 3 seeds", "met": n >= min(2, len(seeds)),
                        "value": f"{n} of {len(seeds)}"})
        if method in FT and "router_kl_before" in r:
            drop = 1 - r["router_kl_after"] / r["router_kl_before"]
            out.append({"target": f"{where}: router FT ({FT[method]}) lowers router KL >= 10% and raises top-k match",
                        "met": drop >= 0.10 and r["topk_match_after"] > r["topk_match_before"],
                        "value": f"router KL {-100 * drop:+.1f}%, match {r['topk_match_before']:.4f} -> "
                                 f"{r['topk_match_after']:.4f}"})
    slow = max((c["alloc_seconds"] for c in cells), default=0.0)
    out.append({"target": "statistics + allocation < 10 min", "met": slow < 600, "value": f"{slow:.1f} s at most"})
    return out


KEY = ("quantizer", "budget", "method", "seed")


def key(c: dict) -> tuple:
    return tuple(c[k] for k in KEY)


def settings_of(s: MoESettings) -> dict:
    return {**s.base.__dict__, **{k: v for k, v in s.__dict__.items() if k != "base"}}


def earlier_results(files, s: MoESettings) -> list[dict]:
    """The results to fold in (`--merge`): same settings but the selections (budgets, seeds, quantizers)."""
    from compress.errors import BadInput

    out, mine = [], {k: v for k, v in settings_of(s).items() if k not in ("budgets", "seeds", "quantizers")}
    default = settings_of(FULL)  # a setting newer than a result: that result was measured at its default
    for f in files:
        try:
            r = json.loads(Path(f).read_text())
            theirs = {k: r["settings"][k] if k in r["settings"] else default[k] for k in mine}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BadInput(f"--merge {f}: not a result of --suite moe ({e})") from None
        if json.loads(json.dumps(mine)) != theirs:
            diff = sorted(k for k in mine if json.loads(json.dumps(mine[k])) != theirs[k])
            raise BadInput(f"--merge {f}: measured with other settings ({', '.join(diff)})")
        out.append(r)
    return out


def run_moe(quick: bool = False, budgets=None, seeds=None, methods=None, quantizers=None,
            merge=(), group: int | None = None) -> tuple[dict, str]:
    """The suite's result and markdown. `budgets`, `seeds`, `methods`, `quantizers` select cells; `merge` folds
    in the cells of earlier results of the same model and settings (a cell run now replaces one with the same
    quantizer, budget, method and seed), so the matrix can be measured in parts; `group` replaces the per-budget
    choice of group size (a setting: results of different groups do not merge)."""
    from bench import moe_model
    from compress.errors import BadInput

    chosen = bq.pick(methods, list(METHODS), "moe method", "--method")
    s = QUICK if quick else FULL
    quantizers = bq.pick(quantizers, list(FULL.quantizers), "moe quantizer", "--quantizer") if quantizers else None
    s = replace(s, budgets=tuple(budgets or s.budgets), seeds=tuple(seeds or s.seeds),
                quantizers=tuple(quantizers or s.quantizers), group=group)
    earlier = earlier_results(merge, s)
    t0, meta = time.time(), bq.suite_meta(quick)
    cells, infeasible, stats = [], [], None
    for r in earlier:
        cells = [c for c in cells if key(c) not in {key(d) for d in r["cells"]}] + r["cells"]
        infeasible += [x for x in r["infeasible"] if x not in infeasible]
    with tempfile.TemporaryDirectory(prefix="compress-bench-moe-") as tmp_dir:
        tmp = Path(tmp_dir)
        text = str(bq.TEXT / "tinystories" / "tinystories_val.txt")
        calib = bq.calibration_file(bq.benches()[0], tmp)
        if quick:
            path, narrowest = _tiny(tmp), 64
            model = {"name": "tiny random mixtral (plumbing only)"}
        else:
            path = str(moe_model.build(bq.log.info))
            narrowest = 128
            model = {"name": "stories-moe", **json.loads((Path(path) / "build.json").read_text())}
        from compress.models.loading import load_config

        experts = load_config(path, None).num_local_experts
        for r in earlier:
            if r["model"].get("sha256") != model.get("sha256"):
                raise BadInput(f"--merge: a result measured on another model (sha256 {r['model'].get('sha256')}, "
                               f"this one {model.get('sha256')})")
        model.update(characterise(path, calib, text, s, tmp))
        for budget in s.budgets:
            bits = widths_for(budget)
            group = group_for(budget, narrowest, bits) if s.group is None else s.group
            if group is None or group > narrowest or cost(min(bits), group) > budget:
                g = group or GROUPS[-1]
                x = {"budget": budget, "reason": f"{min(bits)}-bit experts cost {cost(min(bits), g):.4f} bits "
                     f"per parameter at group {g} (scales and zero points)" + (
                         f"; the narrowest expert input is {narrowest}" if g > narrowest else "")}
                infeasible += [x] if x not in infeasible else []
                continue
            for qz in s.quantizers:
                if 1 in bits and qz not in registry.having("quantize", SIGN):
                    x = {"budget": budget, "quantizer": qz, "reason": f"the only plans within {budget} bits have "
                         f"1-bit (sign) experts, which {qz} cannot round (it tunes offsets on the integer grid of 2 "
                         f"bits and more); 2-bit experts cost {cost(2, GROUPS[-1]):.4f} bits per parameter at group "
                         f"{GROUPS[-1]}"}
                    infeasible += [x] if x not in infeasible else []
                    continue
                for seed in s.seeds:
                    for method in chosen:
                        # gemq+ft(-lm) continue gemq's run: the same allocation and quantization, then routers
                        out = tmp / f"cell-{method.split('+')[0]}"
                        try:
                            row, st = cell(path, calib, text, method, qz, budget, group, seed, s, tmp, out,
                                           resume=method in FT and out.exists(),
                                           top_widths=top_widths_for(budget, group, experts, bits), bits=bits)
                        finally:
                            if not (method.startswith("gemq") and any(m in FT for m in chosen[chosen.index(method)
                                                                                              + 1:])):
                                shutil.rmtree(out, ignore_errors=True)
                        stats = stats or st
                        cells = [c for c in cells if key(c) != key(row)] + [row]
                        bq.log.info("moe %s %s @%s seed %d: ppl %.4f bits %.4f alloc %.1fs", method, qz, budget, seed,
                                    row["ppl"], row["effective_bits"], row["alloc_seconds"])
    if not stats and earlier:  # no cell ran now: the statistics' summary of the merged results
        model.update({k: earlier[-1]["model"][k] for k in ("loads", "forced", "sensitivity_spread")
                      if k in earlier[-1]["model"]})
    if stats:
        two = stats["bits"].index(2)  # the spread of the 2-bit coefficients (every candidate list here has 2)
        coef = [c[two] for layer in stats["coefficients"].values() for c in layer]
        model.update(loads=stats["loads"], forced=stats["forced"],
                     sensitivity_spread=max(coef) / max(min(coef), 1e-30))
    measured = {(c["quantizer"], c["budget"]) for c in cells}  # a merged result's infeasible, since made feasible:
    infeasible = [x for x in infeasible if not any(m[1] == x["budget"] and x.get("quantizer", m[0]) == m[0]
                                                   for m in measured)]
    meta["wall_seconds"] = round(time.time() - t0, 1)
    summary = [{"quantizer": k[0], "budget": k[1], "method": k[2], "seeds": len(cs), "fp_ppl": cs[0]["fp_ppl"],
                **bq.mean_sd(cs, METRICS + ("topk_match_before", "topk_match_after", "router_kl_before",
                                            "router_kl_after"))}
               for k, cs in bq.seed_groups(cells, ("quantizer", "budget", "method"),
                                           lambda k: (k[0], k[1], METHODS.index(k[2])))]
    s = replace(s, **{f: tuple(sorted({c[k] for c in cells} | set(getattr(s, f)))) for f, k in
                      (("budgets", "budget"), ("seeds", "seed"), ("quantizers", "quantizer"))})  # merged ones too
    result = {"meta": meta, "model": model, "settings": settings_of(s),
              "summary": summary, "cells": cells, "infeasible": infeasible, "targets": targets(summary, cells)}
    return result, markdown(result)


def _tiny(tmp: Path) -> str:
    import torch
    import transformers as T

    torch.manual_seed(0)
    cfg = T.MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, num_local_experts=4,
                          num_experts_per_tok=2)
    out = tmp / "tiny-mixtral"
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(bq.MODELS / "stories260K" / f, out)
    return str(out)


def markdown(result: dict) -> str:
    m, md, s = result["meta"], result["model"], result["settings"]
    pm = bq.pm
    lines = ["# MoE benchmark: expert-level allocation (GEMQ) vs uniform, local and greedy\n", bq.suite_header(m),
             f"- model: {md['name']}" + (f" (sha256 `{md['sha256'][:16]}`)" if md.get("sha256") else "")
             + f"; FP perplexity {md['fp_ppl']:.4f}; RTN g64 perplexity ratio W2 x{md['rtn_w2_ratio']:.3f}, "
             f"W3 x{md['rtn_w3_ratio']:.3f}"
             + (f"; expert sensitivity (2-bit coefficient) max/min x{md['sensitivity_spread']:.3g}"
                if "sensitivity_spread" in md else ""),
             f"- calibration {s['nsamples']} x {s['seqlen']} tokens (first 80% of TinyStories val), statistics on "
             f"{s['stat_samples']} x {s['stat_seqlen']}; router fine-tuning `kl` lr {s['ft_lr']} (gemq+ft), `lm` lr "
             f"{s['ft_lr_lm']} (gemq+ft-lm), "
             f"{s['ft_samples']} sequences; attention at 4 bits; seeds {list(s['seeds'])}",
             "- per-layer rule (`top_widths`: every layer keeps an expert at each of the top t widths; published: 2), "
             "the most that fits each budget once scales and zero points are counted: " + ", ".join(
                 f"{b} bits -> {t}" for b, t in sorted({(c["budget"], c.get("top_widths", 2))
                                                        for c in result["cells"]})),
             "- candidate widths of an expert and group size: " + ", ".join(
                 f"{b} bits -> {w} at g{g}" for b, w, g in sorted({(c["budget"], tuple(c.get("bits", WIDTHS)),
                                                                    c["group_size"]) for c in result["cells"]})),
             "- values: mean ± sample standard deviation over seeds\n",
             "| quantizer | budget | method | ppl | KL | top-1 | bits/expert param | alloc s | top-k match (FT) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        ft = (f"{r['topk_match_before']:.3f} -> {r['topk_match_after']:.3f}" if "topk_match_after" in r else "-")
        lines.append(f"| {r['quantizer']} | {r['budget']} | {r['method']} | {pm(r, 'ppl')} | {pm(r, 'kl')} | "
                     f"{pm(r, 'top1', 3)} | {pm(r, 'effective_bits', 4)} | {pm(r, 'alloc_seconds', 1)} | {ft} |")
    for x in result["infeasible"]:
        lines.append(f"\n{x['quantizer'] + ' @ ' if 'quantizer' in x else ''}{x['budget']} bits: infeasible: "
                     f"{x['reason']}")
    if "loads" in md:
        lines.append("\nTokens routed per expert (statistics slice): " + "; ".join(
            f"layer {k}: {v}" for k, v in md["loads"].items()))
    return "\n".join(lines + bq.outcomes(result["targets"])) + "\n"
