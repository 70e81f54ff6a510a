"""`python -m bench quality --suite select`: ProbScale against the heuristic layer subsets (docs/select.md).

Models: all-MiniLM-L6-v2 (the encoder) and stories-llama-1m (a decoder, mean-pooled features). Tasks: SST-2
(probes trained on `sst2/train_heldout_6735.tsv`, tested on `sst2/dev.tsv`) and AG News (probes on rows 0-6000
of `ag_news/test.tsv`, tested on rows 6000-7000), weighted equally (`both`) and each alone. Per seed, the probe
rows of each task (`max_examples`, a quarter of them the dev split that scores the layer probes and picks C)
are drawn with the seed; `random` draws its layers with it; heal batches follow it.

Budgets: 1/2, 1/3 and 1/6 of the transformer-layer parameters. Methods: `probscale` (knapsack on relevance),
`probscale+reprobe` (one round of swaps scored on the dev split; joint weighting at 1/3), `bottom`, `top`,
`every`, `random`, and `oracle` (variant `oracle`, joint weighting): every maximal subset within the budget
probed on the actual subnetwork and the best on the dev split kept, the ceiling of any rule that scores
subsets on the dev split. The heal cells (a fine-tune each, the suite's cost on 2 cores) run for the joint weighting at
1/3, the budget of the target; `SelectSettings` widens both.

Scores, per task on its test rows, as a share of the full model's accuracy with the same head training:
- `probe` (no heal): a logistic-regression probe (C picked on the dev split) on the subnetwork's pooled output,
  against the same probe on the full model's output;
- `heal`: the subnetwork's blocks and a linear head per task (starting as its probe) fine-tuned together
  (`heal_steps`, compress.select.probscale.heal), against the full model fine-tuned the same way.
A cell's value is the mean retained share over the weighting's tasks.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench import quality as bq
from compress.select import probscale as ps

METHODS = ("probscale", "probscale+reprobe", "bottom", "top", "every", "random", "oracle")
BASELINES = ("bottom", "top", "every", "random")
VARIANTS = ("probe", "heal", "oracle")
WEIGHTINGS = {"both": ("sst2", "ag_news"), "sst2": ("sst2",), "ag_news": ("ag_news",)}
MODELS = ("all-MiniLM-L6-v2", "stories-llama-1m")


@dataclass(frozen=True)
class SelectSettings:
    models: tuple[str, ...] = MODELS
    seeds: tuple[int, ...] = (0, 1, 2)
    budgets: tuple[float, ...] = (1 / 2, 1 / 3, 1 / 6)
    max_examples: int = 1000
    max_length: int = 64  # SST-2 sentences are shorter; AG News averages ~50 tokens
    cs: tuple[float, ...] = (0.01, 0.1, 1.0)  # C = 10 was never picked on MiniLM's 384 features
    heal_steps: int = 150
    heal_lr: float = 1e-4
    heal_head_lr: float = 1e-3
    heal_batch: int = 16
    # a 2-core budget: the heal cells (a fine-tune each) run for the joint weighting at the target budget 1/3, and
    # probscale+reprobe (a subnetwork probe per swap) there too
    heal_weightings: tuple[str, ...] = ("both",)
    heal_budgets: tuple[float, ...] = (1 / 3,)
    reprobe_weightings: tuple[str, ...] = ("both",)
    reprobe_budgets: tuple[float, ...] = (1 / 3,)
    # the oracle: every maximal subset within the budget probed, the best on the dev split kept (a ceiling for
    # any rule that scores subsets on the dev split; ProbScale scores layers of the full model)
    oracle_weightings: tuple[str, ...] = ("both",)
    ag_news_test: tuple[int, int] = (6000, 7000)
    variants: tuple[str, ...] = VARIANTS


FULL = SelectSettings()
QUICK = SelectSettings(models=("tiny-bert",), seeds=(0,), budgets=(1 / 2,), max_examples=80, max_length=32,
                       heal_steps=2, heal_batch=4, heal_budgets=(1 / 2,), reprobe_budgets=(1 / 2,))


def tasks(seed: int, s: SelectSettings, quick: bool) -> list[ps.Task]:
    from compress.eval.data import read_labeled

    text = bq.TEXT
    x, y = read_labeled(text / "sst2" / "train_heldout_6735.tsv")
    fit, dev = ps.split(x, y, dev_fraction=0.25, limit=s.max_examples, seed=seed)
    test = read_labeled(text / "sst2" / "dev.tsv")
    out = [ps.Task("sst2", 1.0, fit, dev, (test[0][:60], test[1][:60]) if quick else test)]
    x, y = read_labeled(text / "ag_news" / "test.tsv")
    fit, dev = ps.split(x[:6000], y[:6000], dev_fraction=0.25, limit=s.max_examples, seed=seed)
    lo, hi = s.ag_news_test
    test = (x[lo:hi], y[lo:hi])
    out.append(ps.Task("ag_news", 1.0, fit, dev, (test[0][:60], test[1][:60]) if quick else test))
    return out


def load(name: str, tmp: Path):
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    if name == "tiny-bert":  # plumbing only: a random 4-layer BERT with MiniLM's tokenizer
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        tok = AutoTokenizer.from_pretrained(bq.model_path(bq.Bench("all-MiniLM-L6-v2", "encoder", 64)))
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                         intermediate_size=64)
        return BertModel(cfg).eval(), tok
    if name == "all-MiniLM-L6-v2":
        path = bq.model_path(bq.Bench(name, "encoder", 64))
        return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    path = str(bq.MODELS / name)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


class Scorer:
    """Test accuracies of subnetworks of one model for one seed's tasks, cached by (blocks, task)."""

    def __init__(self, model, tok, task_list: list[ps.Task], s: SelectSettings, seed: int):
        from compress.models.adapters import ModelAdapter

        self.model, self.tok, self.s, self.seed = model, tok, s, seed
        self.adapter = ModelAdapter(model)
        self.tasks = {t.name: t for t in task_list}
        self.pad = ps._pad_id(tok)
        self.ids = {t.name: ps.encode(tok, t.fit[0] + t.dev[0] + t.test[0], s.max_length) for t in task_list}
        self.probe_cache: dict = {}
        self.heal_cache: dict = {}

    def layer_acc(self) -> dict[str, list[float]]:
        out = {}
        for name, t in self.tasks.items():
            n, m = len(t.fit[0]), len(t.fit[0]) + len(t.dev[0])
            feats = ps.features(self.adapter, self.ids[name][:m], self.pad)
            out[name] = [ps.probe(X[:n], t.fit[1], X[n:], t.dev[1], cs=self.s.cs, seed=self.seed)[0] for X in feats]
        return out

    def probe(self, blocks, task: str, part: str = "test") -> float:
        key = (tuple(blocks), task)
        if key not in self.probe_cache:
            t = self.tasks[task]
            n, m = len(t.fit[0]), len(t.fit[0]) + len(t.dev[0])
            X = ps.features(self.adapter, self.ids[task], self.pad, blocks=blocks, every=False)[0]
            dev, _, clf = ps.probe(X[:n], t.fit[1], X[n:m], t.dev[1], cs=self.s.cs, seed=self.seed)
            self.probe_cache[key] = {"dev": dev, "test": ps.accuracy(clf, X[m:], t.test[1])}
        return self.probe_cache[key][part]

    def heal(self, blocks, names: tuple[str, ...]) -> dict[str, float]:
        from compress.structure import keep_blocks

        key = (tuple(blocks), names)
        if key not in self.heal_cache:
            model = copy.deepcopy(self.model)
            from compress.models.adapters import ModelAdapter

            adapter = ModelAdapter(model)
            keep_blocks(adapter, list(blocks))
            s = self.s
            res = ps.heal(adapter, self.tok, [self.tasks[n] for n in names], steps=s.heal_steps, lr=s.heal_lr,
                          head_lr=s.heal_head_lr, batch_size=s.heal_batch, max_length=s.max_length,
                          pooling="mean", seed=self.seed, cs=s.cs)
            self.heal_cache[key] = {n: res[n]["test"] for n in names}
        return self.heal_cache[key]


def maximal_subsets(costs, budget) -> list[list[int]]:
    """Every block subset within the budget to which no further block fits."""
    out = []
    for k in range(1, len(costs) + 1):
        for sub in itertools.combinations(range(len(costs)), k):
            left = budget - sum(costs[i] for i in sub)
            if left >= 0 and all(costs[i] > left for i in range(len(costs)) if i not in sub):
                out.append(list(sub))
    return out


def subsets(acc, chance, names, costs, budget, seed, scorer, reprobe: bool, oracle: bool) -> dict[str, list[int]]:
    r = ps.relevance({n: acc[n] for n in names}, {n: chance[n] for n in names}, {n: 1.0 for n in names})
    out = {"probscale": ps.knapsack(r[1:], costs, budget)}
    for b in BASELINES:
        out[b] = ps.baseline(b, costs, budget, seed)
    if not (reprobe or oracle):
        return out
    full = {n: scorer.probe(list(range(len(costs))), n, "dev") for n in names}

    def retained(k):
        return sum(scorer.probe(k, n, "dev") / full[n] for n in names) / len(names)

    if reprobe:
        keep = out["probscale"]
        if keep:
            keep, _ = ps.reprobe(keep, costs, budget, retained, 1)
        out["probscale+reprobe"] = keep
    if oracle:
        out["oracle"] = max(maximal_subsets(costs, budget), key=retained)
    return out


def run_select(quick: bool = False, seeds=None, models=None, variants=None, merge=(),
               checkpoint: Path | None = None) -> tuple[dict, str]:
    """The suite's result and markdown; `checkpoint`: a JSON file rewritten with the cells measured so far after
    every (weighting, budget), which `--merge` folds in when a run is cut short."""
    from compress.errors import BadInput
    from compress.select.stage import costs as block_costs

    s = QUICK if quick else FULL
    s = replace(s, seeds=tuple(seeds or s.seeds), models=tuple(models or s.models),
                variants=tuple(variants or s.variants))
    if merge and not seeds and not models:  # only folding earlier results together: measure nothing new
        s = replace(s, models=())
    bad = [v for v in s.variants if v not in VARIANTS]
    if bad:
        raise BadInput(f"--variant of --suite select: {', '.join(VARIANTS)} (not {bad})")
    cells, layers, earlier, earlier_layers = [], [], [], []
    spent = 0.0
    for f in merge:
        try:
            r = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            raise BadInput(f"--merge {f}: {e}") from None
        if r.get("suite") != "select":
            raise BadInput(f"--merge {f}: not a result of --suite select")
        earlier += r["cells"]
        earlier_layers += r["layers"]
        spent += r.get("seconds", 0.0)  # the merged runs' measuring time counts too
    t0 = time.time()
    for name in s.models:
        model, tok = load(name, Path("."))
        for seed in s.seeds:
            torch.manual_seed(seed)
            task_list = tasks(seed, s, quick)
            sc = Scorer(model, tok, task_list, s, seed)
            acc = sc.layer_acc()
            chance = {t.name: t.chance for t in task_list}
            layers.append({"model": name, "seed": seed, "acc": acc,
                           "relevance": {w: ps.relevance({n: acc[n] for n in ns}, {n: chance[n] for n in ns},
                                                         {n: 1.0 for n in ns}) for w, ns in WEIGHTINGS.items()}})
            cost, _ = block_costs(sc.adapter)
            all_blocks = list(range(len(cost)))
            full_probe = {n: sc.probe(all_blocks, n) for n in WEIGHTINGS["both"]}
            for w, names in WEIGHTINGS.items():
                for budget in s.budgets:
                    b = budget * sum(cost)
                    fits = b >= min(cost)
                    reprobe = w in s.reprobe_weightings and budget in s.reprobe_budgets
                    oracle = "oracle" in s.variants and w in s.oracle_weightings
                    picks = subsets(acc, chance, names, cost, b, seed, sc, reprobe, oracle) if fits else {}
                    absent = {m for m, on in (("probscale+reprobe", reprobe), ("oracle", oracle)) if not on}
                    for method in METHODS:
                        if method in absent:  # with a block that fits, every other method has its pick
                            continue
                        probed = "probe" in s.variants or method == "oracle"  # `oracle` cells are probe cells
                        keep = picks.get(method, [])
                        cell = {"model": name, "seed": seed, "weighting": w, "budget": round(budget, 4),
                                "method": method, "kept": keep, "params": sum(cost[i] for i in keep)}
                        if not keep:
                            if probed:
                                cells.append({**cell, "variant": "probe", "retained": None,
                                              "note": "no block fits the budget"})
                            continue
                        if probed:
                            acc_t = {n: round(sc.probe(keep, n), 4) for n in names}
                            cells.append({**cell, "variant": "probe", "accuracy": acc_t,
                                          "full": {n: round(full_probe[n], 4) for n in names},
                                          "retained": round(sum(acc_t[n] / full_probe[n] for n in names) / len(names), 4)})
                        if ("heal" in s.variants and w in s.heal_weightings and budget in s.heal_budgets
                                and method != "oracle"):
                            full_heal = sc.heal(all_blocks, names)
                            acc_h = sc.heal(keep, names)
                            cells.append({**cell, "variant": "heal", "accuracy": {n: round(v, 4) for n, v in acc_h.items()},
                                          "full": {n: round(v, 4) for n, v in full_heal.items()},
                                          "retained": round(sum(acc_h[n] / full_heal[n] for n in names) / len(names), 4)})
                        bq.log.info("select %s seed %d %s budget %.3f %s: %s", name, seed, w, budget, method,
                                    [c["retained"] for c in cells[-2:]])
                    if checkpoint:
                        checkpoint.write_text(json.dumps({"suite": "select", "settings": asdict(s), "partial": True,
                                                          "cells": cells, "layers": layers}) + "\n")
    # a cell measured now, or in a later --merge file, replaces the same cell measured earlier
    cells = list({_key(c): c for c in earlier + cells}.values())
    layers = list({(x["model"], x["seed"]): x for x in earlier_layers + layers}.values())
    s = replace(s, models=tuple(dict.fromkeys(c["model"] for c in cells)),
                seeds=tuple(sorted({c["seed"] for c in cells})))
    result = {"suite": "select", "settings": asdict(s), "meta": bq.suite_meta(quick),
              "seconds": round(spent + time.time() - t0, 1), "cells": cells, "layers": layers}
    return result, markdown(result)


def _key(cell: dict) -> tuple:
    return cell["model"], cell["seed"], cell["variant"], cell["weighting"], cell["budget"], cell["method"]


def _fmt_budget(b: float) -> str:
    return {0.5: "1/2", 0.3333: "1/3", 0.1667: "1/6"}.get(round(b, 4), str(b))


def markdown(result: dict) -> str:
    cells = result["cells"]
    out = ["# Layer selection: ProbScale vs heuristic subsets\n",
           f"Settings: {json.dumps(result['settings'])}. {result['meta']}. Values: share of the full model's test "
           "accuracy (same head training), mean over the weighting's tasks and over seeds (min-max in brackets); "
           "`probe`: logistic probe on the subnetwork's output, `heal`: blocks + head fine-tuned. Reproduce: "
           "`python -m bench quality --suite select --json bench/select.json --markdown bench/select.md`.\n"]
    for model in dict.fromkeys(c["model"] for c in cells):
        for variant in ("probe", "heal"):
            for w in WEIGHTINGS:
                rows = [c for c in cells if c["model"] == model and c["variant"] == variant and c["weighting"] == w]
                if not rows:
                    continue
                budgets = sorted({c["budget"] for c in rows}, reverse=True)
                out.append(f"\n## {model}, {variant}, tasks: {w}\n\n| method | "
                           + " | ".join(f"budget {_fmt_budget(b)}" for b in budgets) + " |\n|---|"
                           + "---|" * len(budgets) + "\n")
                for m in METHODS:
                    if not any(c["method"] == m for c in rows):
                        continue
                    vals = []
                    for b in budgets:
                        got = [c["retained"] for c in rows if c["method"] == m and c["budget"] == b]
                        v = [x for x in got if x is not None]
                        vals.append(f"{sum(v) / len(v):.4f} [{min(v):.3f}-{max(v):.3f}]" if v
                                    else "no block fits" if got else "-")
                    out.append(f"| {m} | " + " | ".join(vals) + " |\n")
                wins = []
                for b in budgets:
                    seeds = sorted({c["seed"] for c in rows if c["budget"] == b})
                    valid = [c for c in rows if c["retained"] is not None]
                    for p in ("probscale", "probscale+reprobe"):
                        if any(c["method"] == p and c["budget"] == b for c in valid):
                            ok = sum(1 for sd in seeds if _beats(valid, b, sd, p))
                            wins.append(f"{_fmt_budget(b)} {p}: {ok}/{len(seeds)}")
                out.append("\n>= every baseline (seeds): " + "; ".join(wins) + "\n")
        out.append(_targets([c for c in cells if c["model"] == model], model))
    return "".join(out)


def _targets(cells: list[dict], model: str) -> str:
    """The issue's targets on this model: ProbScale >= every baseline at every budget in >= 2 of 3 seeds (per
    weighting and variant), and at 1/3 of the layer parameters with heal >= 95% of the full model on each task."""
    lines = [f"\n### Targets on {model}\n"]
    for variant in ("probe", "heal"):
        for w in WEIGHTINGS:
            rows = [c for c in cells if c["variant"] == variant and c["weighting"] == w and c["retained"] is not None]
            if not rows:
                continue
            verdicts = []
            for b in sorted({c["budget"] for c in rows}, reverse=True):
                seeds = sorted({c["seed"] for c in rows if c["budget"] == b})
                ok = sum(1 for sd in seeds if _beats(rows, b, sd, "probscale"))
                verdicts.append(f"{_fmt_budget(b)}: {ok}/{len(seeds)}")
            lines.append(f"- {variant}, {w}: probscale >= every baseline in " + ", ".join(verdicts) + " seeds\n")
    healed = [c for c in cells if c["variant"] == "heal" and c["method"] == "probscale" and c["budget"] == 0.3333
              and c["weighting"] == "both"]
    for c in healed:
        per = {t: round(c["accuracy"][t] / c["full"][t], 4) for t in c["accuracy"]}
        lines.append(f"- heal, 1/3 of layer parameters, seed {c['seed']}: retained per task {per} "
                     f"({'>= 0.95 on both' if min(per.values()) >= 0.95 else 'below 0.95'})\n")
    return "".join(lines)


def _beats(rows, b, seed, method) -> bool:
    mine = [c["retained"] for c in rows if c["method"] == method and c["budget"] == b and c["seed"] == seed]
    base = [c["retained"] for c in rows if c["method"] in BASELINES and c["budget"] == b
            and c["seed"] == seed]
    return bool(mine) and all(mine[0] >= x - 1e-9 for x in base)
