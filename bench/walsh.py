"""`python -m bench quality --suite walsh`: AutoRound with and without a rotation in front of it.

On the models that are sensitive at low bits (stories260K, stories-llama-1m), every cell is one real
pipeline run with the same calibration, AutoRound settings and seed (auto-round's own block objective in
every block, `final_block: same`, so the rotation is measured alone); only the `rotate` stage differs:

* `autoround`: no rotation (vanilla AutoRound);
* `autoround_hadamard`: auto-round's own QuaRot-style Hadamard rotation (`rotate/autoround_hadamard`,
  its `inplace` backend with online hooks; runs on CPU);
* `walsh-spectral`: the published BBT-spectral mode (per-linear Walsh transform of the input + energy
  scaling, a run-time operator: evaluation only);
* `walsh-spectral-auto`: the same with `alpha: auto` (per linear, the alpha of {0, .25, .5, .75, 1}
  with the least energy-weighted RTN error at the cell's bits: AWQ's exponent search on the BBT scale);
* `walsh-spectral-auto-unpadded`: the same at each input's own size (`pad: none`, a K * 2^m Hadamard), so
  the rounded weights do not grow (the published pow2 padding rounds and stores 172 -> 256 columns of
  stories260K's down_proj, 384 -> 512 of stories-llama-1m's);
* `walsh`: the published deployable mode (`fused: false, mode: no_rotation`: Walsh-basis energy scaling
  absorbed into the norms), as in `recipes/w2-walsh-autoround.yaml`;
* `walsh-pair_pca`: `walsh` plus the SO(2) pair-PCA of q/k inside each RoPE plane (the paper's
  `spectral_pca_2d`; deployable);
* `walsh-fused`: our fused variant (residual + value-head Walsh rotation absorbed into the weights,
  then channel-energy scaling), as in `recipes/w2-walsh-fused-autoround.yaml`.

W2 g64 over three seeds (the seed picks the calibration windows and AutoRound's minibatch order),
W3 g64 and W4 g128 (stories260K's hidden size 64 cannot hold a 128-group: per-channel) over one.
The all-MiniLM-L6-v2 encoder (post-LayerNorm, where only the spectral mode applies) is scored by
embedding cosine and probe accuracy at W2 and W3.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench import quality as bq

VARIANTS = {
    "autoround": None,
    "autoround_hadamard": {"stage": "rotate", "method": "autoround_hadamard"},
    "walsh-spectral": {"stage": "rotate", "method": "walsh", "fused": False, "mode": "spectral"},
    "walsh-spectral-auto": {"stage": "rotate", "method": "walsh", "fused": False, "mode": "spectral", "alpha": "auto"},
    "walsh-spectral-auto-unpadded": {"stage": "rotate", "method": "walsh", "fused": False, "mode": "spectral",
                                     "alpha": "auto", "pad": "none"},
    "walsh": {"stage": "rotate", "method": "walsh", "fused": False, "mode": "no_rotation", "influence_basis": "wht"},
    "walsh-pair_pca": {"stage": "rotate", "method": "walsh", "fused": False, "mode": "no_rotation",
                       "influence_basis": "wht", "pair_pca": True},
    "walsh-fused": {"stage": "rotate", "method": "walsh", "fused": True},
}
ENCODER_VARIANTS = ("autoround", "walsh-spectral")
CAUSAL_METRICS = ("ppl", "kl", "top1")
ENCODER_METRICS = ("cosine", "probe_acc")


@dataclass(frozen=True)
class WalshSettings:
    base: bq.Settings = replace(bq.FULL, iters=100, eval_tokens=30_000)  # half auto-round's default: 2-core budget (as --suite lfq)
    seeds: tuple[int, ...] = (0, 1, 2)  # for W2; W3 and W4 run seed 0 only
    widths: tuple[int, ...] = (2, 3, 4)
    encoder_widths: tuple[int, ...] = (2, 3)


FULL = WalshSettings()
QUICK = WalshSettings(base=replace(bq.QUICK, iters=4), seeds=(0,), widths=(2,), encoder_widths=())


def group_for(bench: bq.Bench, bits: int, hidden: int) -> int:
    if bits < 4:
        return 64
    return 128 if hidden >= 128 else -1


def cell(bench, path, calib, bits, group_size, variant, seed, s: WalshSettings, tmp: Path) -> dict:
    rec = bq.recipe(bench, path, calib, "autoround-plain", bits, replace(s.base, seed=seed))
    rec["stages"][0]["group_size"] = group_size
    if VARIANTS[variant]:
        rec["stages"].insert(0, copy.deepcopy(VARIANTS[variant]))
    rec["description"] += f" rotate={variant} seed={seed}"
    report = bq.run_cell(rec, tmp)
    ev = next(iter(report["eval"].values()))
    metrics = ENCODER_METRICS if bench.kind == "encoder" else CAUSAL_METRICS
    row = {"model": bench.name, "bits": bits, "group_size": group_size, "variant": variant, "seed": seed,
           **{k: ev[k] for k in metrics}, "effective_bits": report["size"]["effective_bits"],
           "quantized_params": report["size"]["quantized_params"],  # padded (spectral) layers store more of them
           "seconds": round(sum(st["seconds"] for st in report["stages"] if st["name"] in ("rotate", "quantize")), 2)}
    fp_key = "fp_ppl" if bench.kind == "causal" else "fp_probe_acc"
    row[fp_key] = ev[fp_key]
    return row


def summarize(cells: list[dict]) -> list[dict]:
    """Mean and sample standard deviation (0 for one seed) per (model, bits, variant)."""
    order = list(VARIANTS)
    out = []
    for key, cs in bq.seed_groups(cells, ("model", "bits", "variant"), lambda k: (k[0], k[1], order.index(k[2]))):
        row = {k: cs[0][k] for k in ("model", "bits", "group_size", "variant", "fp_ppl", "fp_probe_acc") if k in cs[0]}
        row.update(seeds=len(cs), seconds=statistics.mean(c["seconds"] for c in cs),
                   effective_bits=cs[0]["effective_bits"], quantized_params=cs[0]["quantized_params"])
        out.append({**row, **bq.mean_sd(cs, CAUSAL_METRICS + ENCODER_METRICS)})
    vanilla = {(r["model"], r["bits"]): r["quantized_params"] for r in out if r["variant"] == "autoround"}
    for r in out:  # the rounded weights' storage per weight of the model as loaded (spectral pads d_in to 2^m)
        n = vanilla.get((r["model"], r["bits"]))
        r["bits_per_model_weight"] = round(r["effective_bits"] * r["quantized_params"] / n, 4) if n else None
    return out


def targets(summary: list[dict]) -> list[dict]:
    """Issue targets on the causal models: at W2, walsh-spectral (published) ppl <= 0.75 x vanilla AutoRound
    and <= auto-round's Hadamard; the fused variant within 10% of the published mode; at W4 every
    rotation within noise of vanilla (|ppl difference| <= 2% here, one seed)."""
    by = {(r["model"], r["bits"], r["variant"]): r for r in summary if "ppl" in r}
    out = []
    for model in sorted({k[0] for k in by}):
        get = lambda bits, v: by.get((model, bits, v))  # noqa: E731
        ar, pub, had, fused = get(2, "autoround"), get(2, "walsh-spectral"), get(2, "autoround_hadamard"), get(2, "walsh-fused")
        for v in ("walsh-spectral", "walsh-spectral-auto", "walsh-spectral-auto-unpadded"):
            r = get(2, v)
            if ar and r:  # no quantized model can go below x(FP / AutoRound), the model it approximates
                out.append({"target": f"{model} W2: {v} ppl <= 0.75 x AutoRound", "met": r["ppl"] <= 0.75 * ar["ppl"],
                            "value": f"{r['ppl']:.3f} vs {ar['ppl']:.3f} (x{r['ppl'] / ar['ppl']:.3f}; FP itself: "
                                     f"x{ar['fp_ppl'] / ar['ppl']:.3f})"})
        if had and pub:
            out.append({"target": f"{model} W2: walsh-spectral ppl <= auto-round Hadamard", "met": pub["ppl"] <= had["ppl"],
                        "value": f"{pub['ppl']:.3f} vs {had['ppl']:.3f}"})
        if fused and pub:
            out.append({"target": f"{model} W2: fused within 10% of walsh-spectral", "met": fused["ppl"] <= 1.1 * pub["ppl"],
                        "value": f"{fused['ppl']:.3f} vs {pub['ppl']:.3f} (x{fused['ppl'] / pub['ppl']:.3f})"})
        ar4 = get(4, "autoround")
        for v in VARIANTS:
            r4 = get(4, v)
            if ar4 and r4 and v != "autoround":
                d = r4["ppl"] / ar4["ppl"] - 1
                out.append({"target": f"{model} W4: {v} within noise of AutoRound (|diff| <= 2%)", "met": abs(d) <= 0.02,
                            "value": f"{r4['ppl']:.4f} vs {ar4['ppl']:.4f} ({d:+.2%})"})
    return out


def run_walsh(quick: bool = False, only: list[str] | None = None,
              variants: list[str] | None = None) -> tuple[dict, str]:
    """variants: run only these rotations (and always vanilla `autoround`, the reference of every ratio)."""
    from compress.models.loading import load_config

    chosen = bq.pick(variants and ["autoround", *variants], list(VARIANTS), "walsh variant", "--variant")
    s = QUICK if quick else FULL
    t0 = time.time()
    meta = bq.suite_meta(quick)
    cells = []
    benches = [b for b in bq.selected(quick, only) if b.name in bq.SENSITIVE or b.kind == "encoder"]
    with tempfile.TemporaryDirectory(prefix="compress-bench-walsh-") as tmp_dir:
        tmp = Path(tmp_dir)
        for bench in benches:
            path, calib = bq.model_path(bench), bq.calibration_file(bench, tmp)
            encoder = bench.kind == "encoder"
            hidden = load_config(path, None).hidden_size
            for bits in s.encoder_widths if encoder else s.widths:
                for seed in s.seeds if bits == 2 else s.seeds[:1]:
                    for variant in [v for v in (ENCODER_VARIANTS if encoder else VARIANTS) if v in chosen]:
                        group = bench.group_size if encoder else group_for(bench, bits, hidden)
                        cells.append(cell(bench, path, calib, bits, group, variant, seed, s, tmp))
                        bq.log.info("walsh %s W%d seed %d %s: %s", bench.name, bits, seed, variant,
                                    {k: cells[-1][k] for k in ("ppl", "cosine") if k in cells[-1]})
    summary = summarize(cells)
    result = bq.suite_result(meta, t0, s, cells, summary, targets(summary), encoder_widths=list(s.encoder_widths),
                             variants=chosen)
    return result, markdown(result)


def markdown(result: dict) -> str:
    m, s = result["meta"], result["settings"]
    f, pm = bq._fmt, bq.pm
    lines = [
        "# Walsh benchmark: AutoRound after no rotation, auto-round's Hadamard, and the walsh modes\n",
        bq.suite_header(m),
        f"- every cell: AutoRound asymmetric (`final_block: same`), {s['iters']} iterations per block "
        f"(batch {s['ar_batch_size']}), "
        f"calibration {s['nsamples']} x {s['seqlen']} tokens (causal: first 80% of TinyStories val; MiniLM: SST-2 "
        f"held-out train sentences, {s['encoder_seqlen']} tokens); W2 over seeds {s['seeds']}, W3/W4 seed "
        f"{s['seeds'][0]}; seconds = rotate + quantize stages",
        f"- causal: perplexity/KL/top-1 on {s['window']}-token windows over the first {s['eval_tokens']} tokens of "
        "the last 20% of TinyStories val; MiniLM: mean-pooled embedding cosine to FP and a logistic probe's SST-2 "
        "dev accuracy",
        "- values: mean ± sample standard deviation over seeds\n",
        "- stored bits: bits of the rounded weights (codes, scales, zero points) per quantized weight of the model as "
        "loaded; `walsh-spectral*` pad each linear's input to the next power of two (stories260K's down_proj "
        "172 -> 256 columns), so they store more than their per-weight effective bits say\n",
        "| model | bits | group | rotation | ppl | KL | top-1 | cosine | probe acc | stored bits | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        lines.append(f"| {r['model']} | W{r['bits']} | {r['group_size']} | {r['variant']} | {pm(r, 'ppl')} | "
                     f"{pm(r, 'kl')} | {pm(r, 'top1', 3)} | {pm(r, 'cosine')} | {pm(r, 'probe_acc', 3)} | "
                     f"{f(r.get('bits_per_model_weight'), 3)} | {f(r['seconds'], 1)} |")
    fp = {(r["model"], r.get("fp_ppl", r.get("fp_probe_acc"))) for r in result["summary"]}
    lines.append("\nFull precision: " + "; ".join(f"{mdl} {'ppl' if v > 1 else 'probe acc'} {f(v, 4)}"
                                                 for mdl, v in sorted(fp)))
    return "\n".join(lines + bq.outcomes(result["targets"])) + "\n"
