"""ProbScale (docs/select.md): per-layer task probes, layer relevance, an exact knapsack over layers, baselines,
re-probing of the chosen subnetwork, a power-law fit over a budget sweep, and a classification heal.

Layer `l` is the residual stream after `l` blocks (0: the embeddings' output). Its features for a sentence are
the hidden states mean-pooled over the sentence's tokens (`pooling: mean`) or the last token's (`last`, for
decoders). They are computed block by block: each batch of sentences runs the model up to block 0's input
(the forward stops there), then through the blocks one after another, pooling after each, so nothing but the
pooled (n, hidden) features is kept. The same pass runs any subset of the blocks in order: the features of a
subnetwork's output without building it (`subnet`).

A probe is scikit-learn's L2 logistic regression on standardised features; its `C` is chosen from `cs` on a dev
split and `a[t][l]` is its dev accuracy. The relevance of block l (docs/select.md):

    g[t][l] = max(0, a[t][l] - a[t][l-1])   (gain: added)      or   a[t][l] - chance[t]   (gain: chance)
    r[l]    = sum_t w_t * g[t][l] / (max_l a[t][l] - chance[t])
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from compress.errors import BadInput
from compress.models.adapters import accepts_use_cache

CS = (0.01, 0.1, 1.0, 10.0)
STRATEGIES = ("probscale", "bottom", "top", "every", "random")


# -- data ---------------------------------------------------------------------------------------------------
@dataclass
class Task:
    """A labelled task split for probing: `fit` trains the probes, `dev` scores them (and picks C); `test`,
    when given, is only reported."""

    name: str
    weight: float
    fit: tuple[list[str], list[int]]
    dev: tuple[list[str], list[int]]
    test: tuple[list[str], list[int]] | None = None
    classes: int = field(init=False)

    def __post_init__(self):
        labels = set(self.fit[1]) | set(self.dev[1])
        self.classes = max(labels) + 1
        if len(set(self.fit[1])) < 2:
            raise BadInput(f"task `{self.name}`: its probe training rows hold a single label")

    @property
    def chance(self) -> float:
        """Accuracy of always answering the dev split's most frequent label."""
        y = self.dev[1]
        return max(y.count(c) for c in set(y)) / len(y)


def split(texts: Sequence[str], labels: Sequence[int], *, dev_fraction: float, limit: int | None, seed: int):
    """(fit, dev) of the rows, shuffled with `seed`, at most `limit` rows in all."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    order = order[:limit] if limit else order
    n_dev = max(1, round(dev_fraction * len(order)))
    if len(order) - n_dev < 2:
        raise BadInput(f"{len(order)} labelled rows are too few to split into probe training and dev rows")
    pick = lambda idx: ([texts[i] for i in idx], [int(labels[i]) for i in idx])  # noqa: E731
    return pick(order[n_dev:]), pick(order[:n_dev])


# -- features -----------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def encode(tokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids of each text with the tokenizer's special tokens (BERT: [CLS] ... [SEP]; Llama: BOS ...)."""
    return tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]


def _pad_id(tokenizer) -> int:
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if t is not None:
            return int(t)
    return 0


def _batches(ids: list[list[int]], batch_size: int, pad: int):
    """(rows, input_ids, attention_mask) over the texts sorted by length (little padding), right-padded."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for s in range(0, len(order), batch_size):
        rows = order[s:s + batch_size]
        width = max(len(ids[i]) for i in rows)
        x = torch.full((len(rows), width), pad, dtype=torch.long)
        m = torch.zeros((len(rows), width), dtype=torch.long)
        for j, i in enumerate(rows):
            x[j, :len(ids[i])] = torch.tensor(ids[i])
            m[j, :len(ids[i])] = 1
        yield rows, x, m


def block_inputs(adapter, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """(hidden states, the other arguments) that block 0 receives for this batch; the forward stops there. The
    other arguments are `(positional, keyword)`: BERT's encoder passes the attention mask positionally."""
    got = {}

    def hook(_mod, args, kw):
        got["x"] = args[0] if args else kw.pop("hidden_states")
        kw = {k: v for k, v in kw.items() if k not in ("past_key_values", "cache", "past_key_value")}
        got["kw"] = (tuple(args[1:]), kw)
        raise _Stop

    model = adapter.model
    h = adapter.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        kw = {"use_cache": False} if accepts_use_cache(model) else {}
        model(input_ids=input_ids, attention_mask=attention_mask, **kw)
    except _Stop:
        pass
    finally:
        h.remove()
    return got["x"], got["kw"]


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "last":
        return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


def _run(block, x, kw):
    args, kwargs = kw
    out = block(x, *args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def features(adapter, ids: list[list[int]], pad: int, *, blocks: Sequence[int] | None = None,
             pooling: str = "mean", batch_size: int = 64, every: bool = True,
             progress: Callable | None = None) -> list[torch.Tensor]:
    """Pooled features (n, hidden) float32 after the embeddings and after each block of `blocks` (positions in
    the model's current block list, run in that order; None: all). `every=False`: only the last one."""
    blocks = list(range(len(adapter.blocks))) if blocks is None else list(blocks)
    n = len(ids)
    outs = [None] * (len(blocks) + 1 if every else 1)
    for rows, x_ids, mask in _batches(ids, batch_size, pad):
        x, kw = block_inputs(adapter, x_ids, mask)
        pooled = [pool(x, mask, pooling)] if every else []
        for p in blocks:
            x = _run(adapter.blocks[p], x, kw)
            if every:
                pooled.append(pool(x, mask, pooling))
        if not every:
            pooled = [pool(x, mask, pooling)]
        for j, f in enumerate(pooled):
            if outs[j] is None:
                outs[j] = torch.empty((n, f.shape[-1]), dtype=torch.float32)
            outs[j][rows] = f.float()
        if progress:
            progress(len(rows))
    return outs


# -- probes ------------------------------------------------------------------------------------------------
def _probe(C: float, seed: int):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=1000, random_state=seed))


def probe(X_fit: torch.Tensor, y_fit, X_dev: torch.Tensor, y_dev, *, cs: Sequence[float] = CS, seed: int = 0):
    """(dev accuracy, C, fitted pipeline) of the best logistic-regression probe over `cs` (ties: smaller C)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    best = None
    for C in sorted(cs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            clf = _probe(C, seed).fit(X_fit.double().numpy(), np.asarray(y_fit))
        acc = float((clf.predict(X_dev.double().numpy()) == np.asarray(y_dev)).mean())
        if best is None or acc > best[0]:
            best = (acc, C, clf)
    return best


def accuracy(clf, X: torch.Tensor, y) -> float:
    return float((clf.predict(X.double().numpy()) == np.asarray(y)).mean())


# -- relevance and selection -------------------------------------------------------------------------------
def relevance(acc: dict[str, list[float]], chance: dict[str, float], weights: dict[str, float],
              gain: str = "added") -> list[float]:
    """r[l] for l = 0 (embeddings) .. L (module docstring); weights are normalised to sum 1."""
    total = sum(weights.values())
    L1 = len(next(iter(acc.values())))
    r = [0.0] * L1
    for t, a in acc.items():
        scale = max(max(a) - chance[t], 1e-6)
        for ell in range(L1):
            g = a[ell] - chance[t] if gain == "chance" or ell == 0 else max(0.0, a[ell] - a[ell - 1])
            r[ell] += weights[t] / total * g / scale
    return r


def knapsack(values: Sequence[float], costs: Sequence[int], budget: float) -> list[int]:
    """The subset (sorted indices) maximising the sum of `values` with total cost <= `budget`: exact 0/1
    knapsack by mixed-integer linear programming (scipy's HiGHS). A second solve picks, among the subsets of
    that best value, one that uses the most budget (layers of relevance 0 are kept rather than left out)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(values)
    if n == 0 or budget < min(costs):
        return []
    c, v = np.asarray(costs, dtype=float), np.asarray(values, dtype=float)
    fits = LinearConstraint(c[None, :], -np.inf, float(budget))
    opts = dict(integrality=np.ones(n), bounds=Bounds(0, 1), options={"mip_rel_gap": 0.0})
    best = milp(-v, constraints=fits, **opts)
    if not best.success:
        raise RuntimeError(f"knapsack solver failed: {best.message}")
    target = float(v @ np.round(best.x)) - 1e-9 * max(1.0, float(np.abs(v).sum()))
    fill = milp(-c, constraints=[fits, LinearConstraint(v[None, :], target, np.inf)], **opts)
    x = fill.x if fill.success else best.x
    return [i for i in range(n) if x[i] > 0.5]


def brute_force(values: Sequence[float], costs: Sequence[int], budget: float) -> float:
    """The best objective over every subset (the check of `knapsack`, for a few layers)."""
    n, best = len(values), 0.0
    for mask in range(1 << n):
        idx = [i for i in range(n) if mask >> i & 1]
        if sum(costs[i] for i in idx) <= budget:
            best = max(best, sum(values[i] for i in idx))
    return best


def _greedy(order: Sequence[int], costs: Sequence[int], budget: float) -> list[int]:
    kept, used = [], 0
    for i in order:
        if used + costs[i] <= budget:
            kept.append(i)
            used += costs[i]
    return sorted(kept)


def baseline(name: str, costs: Sequence[int], budget: float, seed: int = 0) -> list[int]:
    """The heuristic subsets at a budget: `bottom` (first layers), `top` (last layers), `every` (the most layers
    evenly spaced that fit, the last included), `random` (layers in a seeded random order while they fit)."""
    n = len(costs)
    if name == "bottom":
        return _greedy(range(n), costs, budget)
    if name == "top":
        return _greedy(range(n - 1, -1, -1), costs, budget)
    if name == "every":
        for k in range(n, 0, -1):
            idx = sorted({round((j + 1) * n / k) - 1 for j in range(k)})
            if sum(costs[i] for i in idx) <= budget:
                return idx
        return []
    if name == "random":
        order = list(range(n))
        random.Random(seed).shuffle(order)
        return _greedy(order, costs, budget)
    raise BadInput(f"unknown selection `{name}` (known: {', '.join(STRATEGIES)})")


def reprobe(keep: list[int], costs: Sequence[int], budget: float, score: Callable[[list[int]], float],
            rounds: int) -> tuple[list[int], list[dict]]:
    """Up to `rounds` times, the best swap of a kept block for a removed one that fits the budget, by `score`
    (the actual subnetwork's retained probe accuracy), taken when it improves by more than 1e-4."""
    swaps, current = [], score(keep)
    for _ in range(rounds):
        best = None
        used = sum(costs[i] for i in keep)
        for out in keep:
            for add in range(len(costs)):
                if add in keep or used - costs[out] + costs[add] > budget:
                    continue
                cand = sorted([i for i in keep if i != out] + [add])
                v = score(cand)
                if v > current + 1e-4 and (best is None or v > best[0]):
                    best = (v, cand, out, add)
        if best is None:
            break
        current, keep = best[0], best[1]
        swaps.append({"removed": best[2], "added": best[3], "retained": round(current, 6)})
    return keep, swaps


# -- the scaling fit -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PowerLaw:
    """P(N) = p_inf - A * N^-alpha, N in millions of parameters."""

    p_inf: float
    A: float
    alpha: float

    def __call__(self, n: float) -> float:
        return self.p_inf - self.A * (n / 1e6) ** -self.alpha

    def smallest(self, target: float) -> float | None:
        """The smallest N with P(N) >= target (None: the fit never reaches it)."""
        if self.p_inf <= target:
            return None
        return 1e6 * (self.A / (self.p_inf - target)) ** (1 / self.alpha)


def fit_power_law(n: Sequence[float], p: Sequence[float]) -> PowerLaw:
    """Least-squares fit of P(N) = p_inf - A N^-alpha (A >= 0, 0.01 <= alpha <= 5) to at least 3 points."""
    from scipy.optimize import curve_fit

    x, y = np.asarray(n, dtype=float) / 1e6, np.asarray(p, dtype=float)
    if len(x) < 3:
        raise BadInput(f"the scaling fit needs at least 3 budgets, got {len(x)}")
    f = lambda N, p_inf, A, alpha: p_inf - A * N ** -alpha  # noqa: E731
    best = None
    for alpha0 in (0.3, 1.0, 2.0):  # a few starts: the fit is not convex
        try:
            popt, _ = curve_fit(f, x, y, p0=(y.max(), max(1e-3, (y.max() - y.min()) * x.min() ** alpha0), alpha0),
                                bounds=([-np.inf, 0.0, 0.01], [np.inf, np.inf, 5.0]), maxfev=20000)
        except RuntimeError:
            continue
        err = float(((f(x, *popt) - y) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, popt)
    if best is None:
        raise RuntimeError("the power-law fit did not converge")
    return PowerLaw(*map(float, best[1]))


# -- heal: a short fine-tune of the kept blocks with a classification head per task ---------------------------
def probe_head(clf, classes: int) -> torch.nn.Linear:
    """The fitted probe (standardiser + logistic regression) as one linear layer on the raw pooled features:
    W' = W / sigma, b' = b - W' mu. A binary probe's single logit becomes class 1's (class 0's is 0); a class
    the probe never saw gets a large negative bias."""
    scaler, lr = clf[0], clf[-1]
    w = torch.as_tensor(lr.coef_ / scaler.scale_, dtype=torch.float32)
    b = torch.as_tensor(lr.intercept_, dtype=torch.float32) - w @ torch.as_tensor(scaler.mean_, dtype=torch.float32)
    head = torch.nn.Linear(w.shape[1], classes)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-30.0)
        seen = [int(c) for c in lr.classes_]
        if w.shape[0] == 1:  # binary
            head.bias[seen[0]] = 0.0
            head.weight[seen[1]], head.bias[seen[1]] = w[0], b[0]
        else:
            head.weight[seen], head.bias[seen] = w, b
    return head


def heal(adapter, tokenizer, tasks: list[Task], *, steps: int, lr: float, head_lr: float, batch_size: int,
         max_length: int, pooling: str, seed: int, cs: Sequence[float] = CS, progress: Callable | None = None) -> dict:
    """Linear probe, then fine-tune (LP-FT): each task's head starts as the logistic-regression probe fitted on
    the subnetwork's frozen pooled output (C picked on the dev split), then every block parameter (not the
    embeddings, final norm or LM head) and the heads train together, cross-entropy summed over the tasks (one
    batch of each per step), AdamW with linear warmup (6%) and decay. A randomly initialised head would first
    have to catch up with the probe, and a short fine-tune ends below it. Returns per task the head's dev (and
    test) accuracy before (`probe_dev`) and after training."""
    pad = _pad_id(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    body = [p for blk in adapter.blocks for p in blk.parameters()]
    was = [p.requires_grad for p in body]
    ids = {t.name: encode(tokenizer, t.fit[0], max_length) for t in tasks}
    heads, before = {}, {}
    for t in tasks:
        X = features(adapter, ids[t.name] + encode(tokenizer, t.dev[0], max_length), pad, pooling=pooling,
                     every=False)[0]
        n = len(t.fit[0])
        before[t.name], _, clf = probe(X[:n], t.fit[1], X[n:], t.dev[1], cs=cs, seed=seed)
        heads[t.name] = probe_head(clf, t.classes)
    opt = torch.optim.AdamW([{"params": body, "lr": lr},
                             {"params": [p for h in heads.values() for p in h.parameters()], "lr": head_lr}],
                            weight_decay=0.01)
    warm = max(1, round(0.06 * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / (steps - warm + 1e-9))))
    order = {t.name: [] for t in tasks}
    for p in body:
        p.requires_grad_(True)
    adapter.model.train()
    # dropout draws from torch's global generator, which nothing else seeds: seeded here (the run is reproducible)
    # and restored after (the caller's draws are not moved)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        try:
            for _ in range(steps):
                loss = 0.0
                for t in tasks:
                    if len(order[t.name]) < batch_size:
                        order[t.name] = torch.randperm(len(ids[t.name]), generator=gen).tolist()
                    rows = [order[t.name].pop() for _ in range(batch_size)]
                    sub, x_ids, mask = next(_batches([ids[t.name][i] for i in rows], batch_size, pad))
                    with torch.no_grad():
                        x, kw = block_inputs(adapter, x_ids, mask)
                    for blk in adapter.blocks:
                        x = _run(blk, x, kw)
                    y = torch.tensor([t.fit[1][rows[j]] for j in sub])  # the batch is sorted by length
                    loss = loss + F.cross_entropy(heads[t.name](pool(x, mask, pooling).float()), y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(body, 1.0)
                opt.step()
                sched.step()
                if progress:
                    progress(1)
        finally:
            adapter.model.eval()
            for p, w in zip(body, was):
                p.requires_grad_(w)
    out = {}
    for t in tasks:
        res = {}
        for part in ("dev", "test"):
            split_ = getattr(t, part)
            if split_ is None:
                continue
            X = features(adapter, encode(tokenizer, split_[0], max_length), pad, pooling=pooling, every=False)[0]
            with torch.no_grad():
                res[part] = float((heads[t.name](X).argmax(-1) == torch.tensor(split_[1])).float().mean())
        out[t.name] = {"probe_dev": before[t.name], **res}
    return out
