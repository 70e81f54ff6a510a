"""`python -m bench quality --suite lfq`: AutoRound with and without LFQ (and hard-label CE).

On the models that are sensitive at low bits (stories260K g32, stories-llama-1m g64) at W2 and W3,
plus W4 as a control (g128 on stories-llama-1m; stories260K's hidden size 64 cannot hold a
128-group, so its control is per-channel), every cell is one real pipeline run with the same
calibration, iterations and seed across the three final-block objectives (`same` = plain
AutoRound, `lfq`, `hard_ce`), repeated for three seeds (the seed picks the calibration windows and
AutoRound's minibatch order). Scores: perplexity, mean KL(FP || Q) and top-1 on the evaluation text,
and greedy-continuation agreement (common prefix, token agreement, KL/top-1 along the FP
continuation) on held-out prompts of the same text.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench import quality as bq

VARIANTS = ("same", "lfq", "hard_ce")
METRICS = ("ppl", "kl", "top1", "gen_prefix", "gen_agree", "gen_kl", "gen_top1")


@dataclass(frozen=True)
class LfqSettings:
    base: bq.Settings = replace(bq.FULL, iters=100, ar_batch_size=8, eval_tokens=30_000)  # half auto-round's default: 2-core budget
    seeds: tuple[int, ...] = (0, 1, 2)
    widths: tuple[int, ...] = (2, 3, 4)
    prompts: int = 16
    prompt_tokens: int = 32
    new_tokens: int = 64


FULL = LfqSettings()
QUICK = LfqSettings(base=replace(bq.QUICK, iters=10), seeds=(0,), widths=(2,), prompts=2, prompt_tokens=8, new_tokens=8)


def group_for(bench: bq.Bench, bits: int, hidden: int) -> int:
    if bits < 4:
        return bench.group_size
    return 128 if hidden >= 128 else -1


def cell(bench, path, calib, bits, group_size, variant, seed, s: LfqSettings, tmp: Path) -> dict:
    base = replace(s.base, seed=seed)
    rec = bq.recipe(bench, path, calib, "autoround", bits, base)
    rec["stages"][0].update(group_size=group_size, final_block=variant)
    rec["eval"]["generation"] = {"prompts": s.prompts, "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens}
    rec["description"] += f" final_block={variant} seed={seed}"
    report = bq.run_cell(rec, tmp)
    ev = next(iter(report["eval"].values()))
    return {"model": bench.name, "bits": bits, "group_size": rec["stages"][0]["group_size"], "variant": variant,
            "seed": seed, "fp_ppl": ev["fp_ppl"], **{k: ev[k] for k in METRICS},
            "effective_bits": report["size"]["effective_bits"],
            "seconds": round(sum(st["seconds"] for st in report["stages"] if st["name"] == "quantize"), 2)}


def summarize(cells: list[dict]) -> list[dict]:
    """Mean and spread (sample standard deviation; 0 for one seed) over seeds per (model, bits, variant)."""
    out = []
    for (model, bits, variant), cs in bq.seed_groups(cells, ("model", "bits", "variant"),
                                                     lambda k: (k[0], -k[1], VARIANTS.index(k[2]))):
        out.append({"model": model, "bits": bits, "group_size": cs[0]["group_size"], "variant": variant,
                    "seeds": len(cs), "fp_ppl": cs[0]["fp_ppl"], "seconds": statistics.mean(c["seconds"] for c in cs),
                    **bq.mean_sd(cs, METRICS)})
    return out


def targets(summary: list[dict]) -> list[dict]:
    """At W2 and W3 on each model: LFQ mean KL <= 0.85 x plain, mean greedy prefix above plain, and
    perplexity no worse than plain by more than 1%."""
    by = {(r["model"], r["bits"], r["variant"]): r for r in summary}
    out = []
    for (model, bits, variant), r in by.items():
        plain = by.get((model, bits, "same"))
        if variant != "lfq" or bits > 3 or not plain:
            continue
        out += [
            {"target": f"{model} W{bits}: LFQ KL <= 0.85 x plain", "met": r["kl"] <= 0.85 * plain["kl"],
             "value": f"{r['kl']:.4f} vs {plain['kl']:.4f} (x{r['kl'] / plain['kl']:.3f})"},
            {"target": f"{model} W{bits}: LFQ greedy prefix > plain", "met": r["gen_prefix"] > plain["gen_prefix"],
             "value": f"{r['gen_prefix']:.2f} vs {plain['gen_prefix']:.2f}"},
            {"target": f"{model} W{bits}: LFQ ppl <= 1.01 x plain", "met": r["ppl"] <= 1.01 * plain["ppl"],
             "value": f"{r['ppl']:.4f} vs {plain['ppl']:.4f} (x{r['ppl'] / plain['ppl']:.4f})"},
        ]
    return out


def run_lfq(quick: bool = False, only: list[str] | None = None) -> tuple[dict, str]:
    from compress.models.loading import load_config

    s = QUICK if quick else FULL
    t0 = time.time()
    meta = bq.suite_meta(quick)
    cells = []
    benches = [b for b in bq.selected(quick, only) if b.name in bq.SENSITIVE]
    with tempfile.TemporaryDirectory(prefix="compress-bench-lfq-") as tmp_dir:
        tmp = Path(tmp_dir)
        for bench in benches:
            path, calib = bq.model_path(bench), bq.calibration_file(bench, tmp)
            hidden = load_config(path, None).hidden_size
            for bits in s.widths:
                group_size = group_for(bench, bits, hidden)
                for seed in s.seeds:
                    for variant in VARIANTS:
                        cells.append(cell(bench, path, calib, bits, group_size, variant, seed, s, tmp))
                        bq.log.info("lfq %s W%d seed %d %s: ppl %.4f kl %.4f prefix %.1f", bench.name, bits, seed,
                                    variant, cells[-1]["ppl"], cells[-1]["kl"], cells[-1]["gen_prefix"])
    summary = summarize(cells)
    result = bq.suite_result(meta, t0, s, cells, summary, targets(summary), prompts=s.prompts,
                             prompt_tokens=s.prompt_tokens, new_tokens=s.new_tokens)
    return result, markdown(result)


def markdown(result: dict) -> str:
    m, s = result["meta"], result["settings"]
    f, pm = bq._fmt, bq.pm
    lines = [
        "# LFQ benchmark: AutoRound with and without logit-aware final-block tuning\n",
        bq.suite_header(m),
        f"- every cell: AutoRound asymmetric, {s['iters']} iterations per block (batch {s['ar_batch_size']}), "
        f"calibration {s['nsamples']} x {s['seqlen']} tokens from the first 80% of TinyStories val; seeds "
        f"{s['seeds']} (calibration windows and minibatch order); `same` = plain AutoRound, `lfq` = last block "
        "on KL to the FP distribution through the frozen head, `hard_ce` = last block on next-token CE",
        f"- perplexity/KL/top-1: {s['window']}-token windows over the first {s['eval_tokens']} tokens of the last "
        f"20% of TinyStories val; greedy: {s['prompts']} prompts of {s['prompt_tokens']} tokens from the same "
        f"text, {s['new_tokens']} new tokens each; prefix = mean common-prefix length with the FP continuation, "
        "agree = token agreement rate, gen KL/top-1 = along the FP continuation (teacher-forced)",
        "- values: mean ± sample standard deviation over seeds\n",
        "| model | bits | group | final block | ppl | KL | top-1 | greedy prefix | agree | gen KL | gen top-1 | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        lines.append(f"| {r['model']} | W{r['bits']} | {r['group_size']} | {r['variant']} | {pm(r, 'ppl')} | "
                     f"{pm(r, 'kl')} | {pm(r, 'top1', 3)} | {pm(r, 'gen_prefix', 2)} | {pm(r, 'gen_agree', 3)} | "
                     f"{pm(r, 'gen_kl')} | {pm(r, 'gen_top1', 3)} | {f(r['seconds'], 1)} |")
    return "\n".join(lines + bq.outcomes(result["targets"])) + "\n"
