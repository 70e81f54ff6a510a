"""`stage: select, method: probscale`: keep the layer subset that maximises task-weighted probe relevance under a
parameter budget (compress/select/probscale.py; docs/select.md).

Per task (a labelled TSV/JSONL file; `rows` slices it) the stage splits up to `max_examples` rows into probe
training and dev rows (`dev_fraction`, seeded), probes every layer (embeddings = layer 0), computes each block's
relevance (`gain: added` or `chance`), and keeps the blocks an exact knapsack picks within `budget` (a ratio of
the transformer-layer parameters, or with `budget_of: total` of all parameters; a number above 1 is a parameter
count; `auto`: the smallest budget the power-law fit over a budget sweep predicts keeps `target` of the full
model's probe accuracy). `pick` runs a baseline instead (`bottom`, `top`, `every`, `random`) at the same budget.
`reprobe: N` then swaps a kept block for a removed one, up to N times, when the actual subnetwork's probe
accuracy improves; `heal` fine-tunes the kept blocks with a classification head per task. The result is a
`ModelSpec` (the kept blocks, re-indexed) and the healed parameters (`TrainedWeights`, empty without heal):
the exports write an ordinary smaller checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import torch
from pydantic import Field, PrivateAttr, field_validator, model_validator

from compress.config import StrictModel
from compress.errors import BadInput
from compress.handoff import ModelSpec, TrainedWeights
from compress.prune.prunepath import PathRouters
from compress.registry import register
from compress.select import probscale as ps
from compress.select.report import SELECTED, SELECTION

log = logging.getLogger(__name__)


class TaskConfig(StrictModel):
    name: str = Field(..., min_length=1)
    path: str = Field(..., description="labelled rows: TSV `text<TAB>label` (a header is skipped) or JSONL "
                                       "{text|sentence, label}")
    rows: tuple[int, int] | None = Field(None, description="[start, end) rows of `path` used for probing")
    test: str | None = Field(None, description="labelled rows only reported on (accuracy of the subnetwork)")
    test_rows: tuple[int, int] | None = None
    weight: float = Field(1.0, gt=0)


class HealOptions(StrictModel):
    steps: int = Field(300, ge=1)
    lr: float = Field(1e-4, gt=0, description="learning rate of the kept blocks")
    head_lr: float = Field(1e-3, gt=0, description="learning rate of the classification heads (they start as the probes)")
    batch_size: int = Field(32, ge=1)


class ProbScaleConfig(StrictModel):
    stage: Literal["select"] = "select"
    method: Literal["probscale"] = "probscale"
    tasks: list[TaskConfig] = Field(..., min_length=1)
    budget: float | Literal["auto"] = Field(..., description="ratio (<= 1) or parameter count (> 1) of `budget_of`; "
                                                           "auto: the smallest meeting `target` by the scaling fit")
    budget_of: Literal["layers", "total"] = "layers"
    target: float = Field(0.95, gt=0, le=1, description="budget: auto: share of the full model's probe accuracy")
    pick: Literal["probscale", "bottom", "top", "every", "random"] = "probscale"
    gain: Literal["added", "chance"] = "added"
    reprobe: int = Field(0, ge=0, description="swaps tried on the actual subnetwork (0: none)")
    heal: HealOptions | None = None
    pooling: Literal["mean", "last"] = "mean"
    max_examples: int = Field(4000, ge=4, description="rows per task used for probing (fit + dev)")
    dev_fraction: float = Field(0.25, gt=0, lt=1)
    max_length: int = Field(128, ge=2)
    batch_size: int = Field(64, ge=1)
    cs: list[float] = Field([0.01, 0.1, 1.0, 10.0], min_length=1, description="probe C values searched")
    _kept: int | None = PrivateAttr(None)  # plan time: the blocks a fixed budget holds (`check` counts them)

    @field_validator("budget")
    @classmethod
    def _budget(cls, v):
        if v != "auto" and v <= 0:
            raise ValueError("budget must be positive (a ratio <= 1 or a parameter count), or `auto`")
        return v

    @model_validator(mode="after")
    def _names(self):
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must differ: {names}")
        return self

    def files(self) -> list[str]:
        return [p for t in self.tasks for p in (t.path, t.test) if p]


# -- tasks ---------------------------------------------------------------------------------------------------
def _rows(path: str, span):
    from compress.eval.data import read_labeled

    texts, labels = read_labeled(path)
    if span is not None:
        lo, hi = span
        if not 0 <= lo < hi or lo >= len(texts):
            raise BadInput(f"{path}: rows [{lo}, {hi}) is outside its {len(texts)} rows")
        texts, labels = texts[lo:hi], labels[lo:hi]
    return texts, labels


def load_tasks(cfg: ProbScaleConfig, seed: int) -> list[ps.Task]:
    out = []
    for t in cfg.tasks:
        texts, labels = _rows(t.path, t.rows)
        fit, dev = ps.split(texts, labels, dev_fraction=cfg.dev_fraction, limit=cfg.max_examples, seed=seed)
        test = _rows(t.test, t.test_rows) if t.test else None
        out.append(ps.Task(t.name, t.weight, fit, dev, test))
    return out


# -- budget ----------------------------------------------------------------------------------------------------
def costs(adapter) -> tuple[list[int], int]:
    """(parameters of each block, parameters outside the blocks): a tied head counted once."""
    blocks = [sum(p.numel() for p in blk.parameters()) for blk in adapter.blocks]
    total = sum(p.numel() for p in adapter.model.parameters())
    return blocks, total - sum(blocks)


def layer_budget(cfg, block_costs: list[int], fixed: int, budget=None) -> float:
    """The budget in block parameters."""
    b = cfg.budget if budget is None else budget
    layers = sum(block_costs)
    if cfg.budget_of == "layers":
        return b * layers if b <= 1 else b
    total = b * (layers + fixed) if b <= 1 else b
    if total - fixed < min(block_costs):
        raise BadInput(f"`budget: {b}` of the total parameters ({total:.0f}) leaves no room for a block: the "
                       f"embeddings, norms and head alone hold {fixed} (use `budget_of: layers` or a larger budget)")
    return total - fixed


def check(adapter, cfg: ProbScaleConfig, facts):
    if facts.after_quantize:
        raise BadInput(f"stage {facts.index} (`select`) comes after a `quantize` stage; select first (the quantizer "
                       "rounds the kept layers)")
    if PathRouters in facts.produced:
        raise BadInput(f"stage {facts.index} (`select`) comes after `prune: prunepath`; select the layers first")
    if facts.stream:
        raise BadInput("`select` needs the whole model in memory; remove model.stream")
    if cfg.pooling == "last" and adapter.kind == "encoder":
        raise BadInput("`pooling: last` is for decoders; an encoder's sentence features are mean-pooled")
    for t in cfg.tasks:
        for path, span in ((t.path, t.rows), (t.test, t.test_rows)):
            if path:
                texts, labels = _rows(path, span)
                if len(set(labels)) < 2:
                    raise BadInput(f"task `{t.name}`: {path} holds a single label")
    block_costs, fixed = costs(adapter)
    cfg = cfg.model_copy()
    if cfg.budget != "auto":
        b = layer_budget(cfg, block_costs, fixed)
        if b < min(block_costs):
            raise BadInput(f"`budget: {cfg.budget}` ({b:.0f} layer parameters) is smaller than one block "
                           f"({min(block_costs)} parameters)")
        cfg._kept = len(ps.baseline("bottom", block_costs, b))
    elif len(block_costs) < 3:
        raise BadInput("`budget: auto` fits a power law over a budget sweep, which needs at least 3 blocks")
    return cfg


def reshape(spec: ModelSpec, cfg) -> ModelSpec:
    """Plan time: as many blocks as the budget holds (the first ones stand in: which is measured later);
    with `budget: auto` the count is only known after measuring (the plan keeps every block)."""
    return spec if cfg._kept is None else spec.keeping(blocks=range(cfg._kept))


# -- the stage ---------------------------------------------------------------------------------------------------
class _Prober:
    """Probe accuracies of the full model's layers and of subnetworks, per task, on the tasks' fit/dev rows."""

    def __init__(self, ctx, cfg, tasks: list[ps.Task]):
        self.adapter, self.cfg, self.tasks, self.ctx = ctx.adapter, cfg, tasks, ctx
        self.pad = ps._pad_id(ctx.tokenizer)
        self.ids = {t.name: ps.encode(ctx.tokenizer, t.fit[0] + t.dev[0], cfg.max_length) for t in tasks}
        self.cache: dict[tuple, float] = {}

    def _acc(self, t: ps.Task, X: torch.Tensor) -> float:
        n = len(t.fit[0])
        return ps.probe(X[:n], t.fit[1], X[n:], t.dev[1], cs=self.cfg.cs, seed=self.ctx.seed)[0]

    def layers(self) -> dict[str, list[float]]:
        out = {}
        for t in self.tasks:
            bar = self.ctx.progress(total=len(self.ids[t.name]), desc=f"{self.ctx.key} features {t.name}",
                                    unit="text")
            try:
                feats = ps.features(self.adapter, self.ids[t.name], self.pad, pooling=self.cfg.pooling,
                                    batch_size=self.cfg.batch_size, progress=bar.update)
            finally:
                bar.close()
            out[t.name] = [self._acc(t, X) for X in feats]
        return out

    def subnet(self, keep: list[int]) -> dict[str, float]:
        """Dev probe accuracy per task of the blocks `keep` run in order."""
        out = {}
        for t in self.tasks:
            key = (t.name, tuple(keep))
            if key not in self.cache:
                X = ps.features(self.adapter, self.ids[t.name], self.pad, blocks=keep, pooling=self.cfg.pooling,
                                batch_size=self.cfg.batch_size, every=False)[0]
                self.cache[key] = self._acc(t, X)
            out[t.name] = self.cache[key]
        return out

    def retained(self, keep: list[int], full: dict[str, float]) -> float:
        """Task-weighted share of the full model's probe accuracy the subnetwork keeps."""
        acc, total = self.subnet(keep), sum(t.weight for t in self.tasks)
        return sum(t.weight / total * acc[t.name] / full[t.name] for t in self.tasks)


def _pick(cfg, r: list[float], block_costs: list[int], budget: float, seed: int) -> list[int]:
    if cfg.pick == "probscale":
        return ps.knapsack(r[1:], block_costs, budget)
    return ps.baseline(cfg.pick, block_costs, budget, seed)


def _sweep(prober, cfg, r, block_costs, full, seed) -> tuple[list[dict], ps.PowerLaw | None]:
    layers = sum(block_costs)
    points, seen = [], set()
    for j in range(1, len(block_costs) + 1):
        b = j / len(block_costs) * layers
        keep = _pick(cfg, r, block_costs, b, seed)
        if not keep or tuple(keep) in seen:
            continue
        seen.add(tuple(keep))
        points.append({"budget": round(b), "params": sum(block_costs[i] for i in keep), "kept": keep,
                       "retained": round(prober.retained(keep, full), 6)})
    try:
        law = ps.fit_power_law([p["params"] for p in points], [p["retained"] for p in points])
    except (BadInput, RuntimeError) as e:
        log.warning("select: no scaling fit (%s)", e)
        law = None
    return points, law


def apply(ctx, cfg: ProbScaleConfig) -> dict:
    t0 = time.time()
    adapter = ctx.adapter
    before = ctx.inputs.get(ModelSpec) or ModelSpec.of(adapter)
    tasks = load_tasks(cfg, ctx.seed)
    prober = _Prober(ctx, cfg, tasks)
    acc = prober.layers()
    chance = {t.name: t.chance for t in tasks}
    weights = {t.name: t.weight for t in tasks}
    r = ps.relevance(acc, chance, weights, cfg.gain)
    block_costs, fixed = costs(adapter)
    full = {t.name: acc[t.name][-1] for t in tasks}
    scaling = None
    if cfg.budget == "auto":
        points, law = _sweep(prober, cfg, r, block_costs, full, ctx.seed)
        need = law.smallest(cfg.target) if law else None
        fits = [p for p in points if need is not None and p["params"] >= need]
        chosen = min(fits, key=lambda p: p["params"]) if fits else points[-1]
        budget = float(chosen["params"])
        scaling = {"points": points, "target": cfg.target, "smallest_params": None if need is None else round(need),
                   "fit": None if law is None else {"p_inf": round(law.p_inf, 6), "A": round(law.A, 6),
                                                    "alpha": round(law.alpha, 6)},
                   "budget_params": round(budget)}
    else:
        budget = layer_budget(cfg, block_costs, fixed)
    keep = _pick(cfg, r, block_costs, budget, ctx.seed)
    if not keep:
        raise BadInput(f"the budget ({budget:.0f} layer parameters) holds no block")
    picked = list(keep)
    swaps = []
    if cfg.reprobe:
        keep, swaps = ps.reprobe(keep, block_costs, budget, lambda k: prober.retained(k, full), cfg.reprobe)
    sub = prober.subnet(keep)
    test = _test_accuracy(ctx, cfg, tasks, keep)
    params = sum(p.numel() for p in adapter.model.parameters())
    after = before.keeping(blocks=keep)
    after.restore(adapter, before)
    healed = {}
    if cfg.heal:
        h = cfg.heal
        bar = ctx.progress(total=h.steps, desc=f"{ctx.key} heal", unit="step")
        try:
            healed = ps.heal(adapter, ctx.tokenizer, tasks, steps=h.steps, lr=h.lr, head_lr=h.head_lr,
                             batch_size=h.batch_size, max_length=cfg.max_length, pooling=cfg.pooling, seed=ctx.seed,
                             cs=cfg.cs, progress=bar.update)
        finally:
            bar.close()
    ctx.emit(after)
    ctx.emit(TrainedWeights({n: p.detach().clone() for n, p in adapter.blocks.named_parameters(
        prefix=adapter.blocks_path)} if cfg.heal else {}))
    left = sum(p.numel() for p in adapter.model.parameters())
    layers_total = sum(block_costs)
    kept_layers = sum(block_costs[i] for i in keep)
    sources = [b.source for b in before.blocks]
    table = [{"layer": ell, "block": None if ell == 0 else sources[ell - 1],
              "params": fixed if ell == 0 else block_costs[ell - 1],
              **{f"acc_{t}": round(acc[t][ell], 4) for t in acc}, "relevance": round(r[ell], 6),
              "kept": ell == 0 or (ell - 1) in keep} for ell in range(len(r))]
    selection = {
        "pick": cfg.pick, "gain": cfg.gain, "tasks": {t.name: {"weight": t.weight, "chance": round(t.chance, 4),
                                                                "fit": len(t.fit[0]), "dev": len(t.dev[0])}
                                                       for t in tasks},
        "budget": cfg.budget, "budget_of": cfg.budget_of, "budget_layer_params": round(budget),
        "kept_blocks": [sources[i] for i in keep], "picked_blocks": [sources[i] for i in picked], "swaps": swaps,
        "layer_params": {"kept": kept_layers, "total": layers_total, "ratio": round(kept_layers / layers_total, 4)},
        "total_params": {"kept": left, "total": params, "ratio": round(left / params, 4)},
        "dev_accuracy": {t: {"full": round(full[t], 4), "subnet": round(sub[t], 4)} for t in sub},
        "test_accuracy": test, "table": table, "scaling": scaling,
        "heal": {"steps": cfg.heal.steps, "accuracy": healed} if cfg.heal else None,
        "seconds": round(time.time() - t0, 2)}
    metrics = {"selection": selection,
               "structure": {"stage": "select", "method": "probscale", "pick": cfg.pick, "parameters_before": params,
                             "parameters_after": left, "changes": after.differences(before)}}
    if ctx.workspace is not None and not getattr(ctx, "replaying", False):
        from compress.eval.figures import relevance_figure, save_png

        rel = save_png(relevance_figure(table, list(acc), scaling), ctx.workspace, f"figures/{ctx.key}-relevance.png")
        metrics["figures"] = {"layer relevance and probe accuracy": rel}
    log.info("select %s: kept blocks %s of %d (%.1f%% of layer parameters, %.1f%% of all); subnetwork dev probe %s",
             cfg.pick, selection["kept_blocks"], len(block_costs), 100 * kept_layers / layers_total,
             100 * left / params, ", ".join(f"{t} {v['subnet']} (full {v['full']})"
                                            for t, v in selection["dev_accuracy"].items()))
    return metrics


def _test_accuracy(ctx, cfg, tasks, keep) -> dict:
    """Per task with a test file: the probe (trained on fit rows at the dev-chosen C) on the full model's and on
    the subnetwork's output."""
    out = {}
    pad = ps._pad_id(ctx.tokenizer)
    for t in tasks:
        if t.test is None:
            continue
        ids_train = ps.encode(ctx.tokenizer, t.fit[0] + t.dev[0], cfg.max_length)
        ids_test = ps.encode(ctx.tokenizer, t.test[0], cfg.max_length)
        res = {}
        for name, blocks in (("full", None), ("subnet", keep)):
            X = ps.features(ctx.adapter, ids_train + ids_test, pad, blocks=blocks, pooling=cfg.pooling,
                            batch_size=cfg.batch_size, every=False)[0]
            n, m = len(t.fit[0]), len(ids_train)
            _, _, clf = ps.probe(X[:n], t.fit[1], X[n:m], t.dev[1], cs=cfg.cs, seed=ctx.seed)
            res[name] = round(ps.accuracy(clf, X[m:], t.test[1]), 4)
        out[t.name] = res
    return out


register("select", "probscale", ProbScaleConfig,
         "probe each layer for the tasks and keep the most relevant layers within a parameter budget",
         check=check, uses=(ModelSpec,), produces=(ModelSpec, TrainedWeights), reshape=reshape,
         requires=("sklearn",), report=(SELECTION, SELECTED))(apply)
