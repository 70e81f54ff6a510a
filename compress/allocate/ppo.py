"""A small deterministic PPO controller for chunk allocation (docs/allocate.md#the-rl-controller; our own
implementation).

Episode: units are visited in problem order (layer by layer, chunk by chunk); the state of unit u is its
static features (depth, layer type, chunk position, energy and weight statistics, relative log proxy
error per option) plus the remaining discretionary budget fraction, the fraction of units left and the
previous action (one-hot). The action is an option, masked so that the episode can always finish
within the budget (`allocation.action_mask`). Reward: dense `-err(u, a) / sum_u err(u, cheapest)` per
step, plus potential-based budget shaping (Ng, Harada & Russell 1999) with potential
`Phi(s) = price * slack(s)`, the discretionary bits left times the Lagrangian bit price of the problem
(`allocation.bit_price`, normalised like the errors), 0 at the end: each action pays `price * extra bits`
at once and the last step pays for the slack left. The shaping sums to the constant `-Phi(s_0)`, so it
changes no policy's ranking by return, but with GAE each action sees its bit price immediately instead of
through the units forced to their cheapest option at the end of the episode. Plus a terminal reward from
the real model (`terminal(choice) -> float`, e.g. `-kappa * (log ppl_Q - log ppl_FP)` on a calibration
slice) at the last step.

PPO: clip 0.2, gamma 1 (episodic), GAE lambda 0.95, Adam, entropy bonus, value loss coefficient,
`episodes` parallel episodes per update, `epochs` passes over minibatches of `minibatch` steps.

Step modes (`steps`, docs/allocate.md#long-episodes): `unit` (default) = one step per
unit, as above; `layer` = one step per layer with factorised actions: every chunk of the layer is decided
by the same policy network applied to that chunk's features and the budget state at the layer's start
(no previous action), i.e. independent per-chunk heads; the chunks are still masked one after another by
the bits their layer has used so far, so every episode stays feasible. A step's reward is the sum of its
chunks' rewards, its log-probability the sum of its chunks' log-probabilities, its value the critic at its
first chunk; GAE and the clipped objective run over the L layer steps instead of the U unit steps.
Policy and critic: separate 2-layer tanh MLPs. Everything is seeded from `seed` (torch.Generator for
sampling and minibatch order, `torch.manual_seed` under a fork_rng for the initial weights).

Warm start (`warm_start` > 0, needs a `reference` plan, e.g. the greedy knapsack plan): before PPO, the
policy is behaviour-cloned toward the reference for `warm_start` Adam steps (cross-entropy of the masked
policy on the states along the reference episode), so that PPO starts near the baseline's plan and the
terminal reward moves it from there; the reference plan is also one of the final candidates. This means the
controller's plan is never worse than the reference *by the selection score* (a calibration-data measure);
it can still be worse on other text.

Final plan: candidates are the argmax decode, the `keep_best` best training episodes by return, the 4
best-proxy of `final_samples` fresh samples and the reference plan, each filled toward the budget; the plan
is the best by `select(choice)` (a real-model score on a larger calibration slice than the training
terminal, so the pick is not fitted to the training reward's noise), else by terminal - normalised proxy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from compress.allocate.problem import Problem, action_mask, bit_price, fill, suffix_min

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PPOSettings:
    updates: int = 50
    episodes: int = 8
    epochs: int = 4
    minibatch: int = 256
    lr: float = 3e-4
    clip: float = 0.2
    gae_lambda: float = 0.95
    entropy: float = 0.01
    value_coef: float = 0.5
    hidden: int = 256
    seed: int = 0
    final_samples: int = 32  # plans sampled from the trained policy, besides its argmax plan
    steps: str = "unit"  # unit: one step per unit | layer: one step per layer, factorised per-chunk heads
    keep_best: int = 1  # best training episodes (by return) kept as final candidates
    warm_start: int = 0  # behaviour-cloning steps toward the reference plan before PPO
    warm_lr: float = 1e-3


@dataclass
class PPOResult:
    choice: torch.Tensor  # final plan (after the budget fill)
    picked: str = "argmax"  # which candidate became the plan
    curve: list[dict] = field(default_factory=list)  # per update: mean return, proxy, terminal
    seconds: float = 0.0


def mlp(n_in: int, n_out: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, n_out))


class Rollout:
    """Runs E masked episodes in lockstep and records what the PPO update needs (per unit, in both step modes)."""

    def __init__(self, p: Problem, layer_steps: bool = False):
        self.p, self.tail = p, suffix_min(p)
        self.layer_steps = layer_steps
        # step of every unit: itself, or (layer steps) its layer's rank; units are visited layer by layer
        start = torch.ones(p.n_units, dtype=torch.bool)
        start[1:] = p.unit_layer[1:] != p.unit_layer[:-1]
        self.step_of = torch.cumsum(start.long(), 0) - 1 if layer_steps else torch.arange(p.n_units)
        self.first = start.nonzero().view(-1) if layer_steps else torch.arange(p.n_units)  # first unit per step
        self.n_opt = len(p.options)
        self.dense_norm = float(p.err.gather(1, p.cheapest().view(-1, 1)).sum()) or 1.0
        self.slack0 = max(p.budget - int(self.tail[0]), 1)
        self.extra = (p.cost - p.cost.min(1, keepdim=True).values).double()  # (U, O) bits above the cheapest
        self.price = bit_price(p) / self.dense_norm  # shaping potential per discretionary bit

    def state(self, u: int, used: torch.Tensor, prev: torch.Tensor, at: int | None = None) -> torch.Tensor:
        """Static features of unit u, discretionary budget left (fraction), units left (fraction), the price
        of each option in shares of the budget left per remaining unit (log1p), previous action one-hot.
        The budget terms are those before unit `at` (default u; layer steps: the layer's first unit)."""
        at = u if at is None else at
        E, U = used.shape[0], self.p.n_units
        slack = (self.p.budget - used - self.tail[at]).double()
        share = slack.clamp_min(0).view(-1, 1) / (U - at) + 1.0
        price = torch.log1p(self.extra[u].view(1, -1) / share).clamp(max=10)
        prev1 = torch.zeros(E, self.n_opt + 1)
        prev1[torch.arange(E), prev] = 1
        return torch.cat([self.p.features[u].expand(E, -1), (slack / self.slack0).float().view(-1, 1),
                          torch.full((E, 1), (U - at) / U), price.float(), prev1], 1)

    @property
    def n_features(self) -> int:
        return self.p.features.shape[1] + 2 + 2 * self.n_opt + 1

    def run(self, policy: nn.Module, E: int, gen: torch.Generator | None, sample: bool = True,
            force: torch.Tensor | None = None):
        """(S, A, M, LP, R), each (U, E, ...): states, actions, masks, log-probabilities, rewards per unit.
        Layer steps: every unit of a layer sees the state at the layer's start (no previous action), i.e. the
        policy's per-chunk heads are factorised; each chunk is still masked by the bits its layer has used so
        far, so every episode stays feasible. `force`: take these actions (teacher forcing)."""
        p, U = self.p, self.p.n_units
        used = torch.zeros(E, dtype=torch.int64)
        none = torch.full((E,), self.n_opt, dtype=torch.int64)
        prev, used0, at = none, used, 0
        S, A, M, LP, R = [], [], [], [], []
        with torch.no_grad():
            for u in range(U):
                if self.layer_steps:
                    if int(self.first[self.step_of[u]]) == u:
                        used0, at = used, u
                    s = self.state(u, used0, none, at)
                else:
                    s = self.state(u, used, prev)
                mask = action_mask(p, u, used, self.tail)
                logits = policy(s).masked_fill(~mask, -1e9)
                dist = torch.distributions.Categorical(logits=logits)
                if force is not None:
                    a = force[u].expand(E)
                else:
                    a = torch.multinomial(dist.probs, 1, generator=gen).view(-1) if sample else logits.argmax(1)
                S.append(s), A.append(a), M.append(mask), LP.append(dist.log_prob(a))
                shaping = -self.price * (self.extra[u, a] if u + 1 < U else (p.budget - used - self.tail[u]).double())
                R.append(-p.err[u, a].float() / self.dense_norm + shaping.float())
                used = used + p.cost[u, a]
                prev = a
        return torch.stack(S), torch.stack(A), torch.stack(M), torch.stack(LP), torch.stack(R)


def gae(rewards: torch.Tensor, values: torch.Tensor, lam: float) -> torch.Tensor:
    """(T, E) advantages with gamma = 1 and a terminal state after step T-1."""
    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[1])
    for t in reversed(range(T)):
        nxt = values[t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[t] + nxt - values[t]
        last = delta + lam * last
        adv[t] = last
    return adv


def train(p: Problem, terminal: Callable[[torch.Tensor], float] | None, s: PPOSettings,
          progress: Callable[[int, dict], None] | None = None, reference: torch.Tensor | None = None,
          select: Callable[[torch.Tensor], float] | None = None) -> PPOResult:
    """Train the controller, then return the better (by terminal reward, else proxy) of the argmax plan
    and the best sampled episode, each filled greedily toward the budget. The controller's tensors are
    tiny (E x 256), so it runs on one intra-op thread (several threads only add synchronisation)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(p, terminal, s, progress, reference, select)
    finally:
        torch.set_num_threads(threads)


def _train(p: Problem, terminal, s: PPOSettings, progress, reference, select) -> PPOResult:
    t0 = time.time()
    if s.steps not in ("unit", "layer"):
        raise ValueError(f"steps must be `unit` or `layer`, got {s.steps!r}")
    ro = Rollout(p, layer_steps=s.steps == "layer")
    with torch.random.fork_rng():
        torch.manual_seed(s.seed)
        policy, critic = mlp(ro.n_features, ro.n_opt, s.hidden), mlp(ro.n_features, 1, s.hidden)
    if s.warm_start:
        if reference is None:
            raise ValueError("warm_start needs a reference plan")
        clone(policy, ro, reference, s.warm_start, s.warm_lr)
    opt = torch.optim.Adam(list(policy.parameters()) + list(critic.parameters()), lr=s.lr)
    gen = torch.Generator().manual_seed(s.seed)
    best: list[tuple[float, int, torch.Tensor]] = []  # the keep_best best episodes: (return, serial, plan)
    curve = []
    for upd in range(s.updates):
        S, A, M, LP, R = ro.run(policy, s.episodes, gen)
        choices = A.T  # (E, U)
        term = torch.tensor([terminal(c) if terminal else 0.0 for c in choices])
        R[-1] += term
        ret = R.sum(0)
        for i in range(len(choices)):
            if not any(torch.equal(b[2], choices[i]) for b in best):
                best.append((float(ret[i]), upd * s.episodes + i, choices[i].clone()))
        best = sorted(best, key=lambda b: (-b[0], b[1]))[: max(s.keep_best, 1)]
        R = torch.zeros(len(ro.first), R.shape[1]).index_add_(0, ro.step_of, R)  # rewards per step
        with torch.no_grad():
            V = critic(S[ro.first]).squeeze(-1)
        adv = gae(R, V, s.gae_lambda)
        _update(policy, critic, opt, ro, S, A, M, LP, adv, adv + V, s, gen)
        proxy = torch.stack([torch.tensor(p.err_of(c)) for c in choices]) / ro.dense_norm
        row = {"update": upd, "return": float(ret.mean()), "proxy": float(proxy.mean()),
               "terminal": float(term.mean()), "best_return": best[0][0]}
        curve.append(row)
        if progress:
            progress(upd, row)
    seen = [b[2] for b in best]
    return PPOResult(*_final(p, ro, policy, terminal, seen, s, gen, reference, select), curve=curve,
                     seconds=time.time() - t0)


def clone(policy: nn.Module, ro: Rollout, reference: torch.Tensor, steps: int, lr: float) -> float:
    """Behaviour cloning: `steps` full-batch Adam steps of masked cross-entropy toward `reference`'s action
    on every state of the reference episode; returns the final mean probability of the reference actions."""
    S, _, M, *_ = ro.run(policy, 1, None, force=reference)
    S, M = S[:, 0], M[:, 0]
    bad = (~M.gather(1, reference.view(-1, 1))).nonzero()
    if len(bad):
        raise ValueError(f"the reference plan leaves the budget at unit {int(bad[0, 0])}")
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    for _ in range(steps):
        logits = policy(S).masked_fill(~M, -1e9)
        loss = nn.functional.cross_entropy(logits, reference)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        prob = policy(S).masked_fill(~M, -1e9).softmax(1).gather(1, reference.view(-1, 1)).mean()
    log.info("warm start: %d cloning steps, mean probability of the reference action %.3f", steps, float(prob))
    return float(prob)


def _final(p: Problem, ro: Rollout, policy, terminal, seen, s: PPOSettings, gen, reference, select):
    """The plan among the candidates (module docstring), each filled toward the budget: the best by
    `select`, else by terminal - normalised proxy (proxy alone without a terminal)."""
    _, A, *_ = ro.run(policy, 1, None, sample=False)
    cands = {"argmax": fill(p, A[:, 0])}
    cands.update({("best-seen" if k == 0 else f"best-seen-{k}"): fill(p, c) for k, c in enumerate(seen)})
    if s.final_samples:
        _, A, *_ = ro.run(policy, s.final_samples, gen)
        filled = sorted((fill(p, a) for a in A.T), key=p.err_of)
        cands.update({f"sample-{k}": c for k, c in enumerate(filled[:4])})
    if reference is not None:
        cands["reference"] = fill(p, reference)
    unique = {}
    for k, c in cands.items():  # score each distinct plan once
        if not any(torch.equal(c, d) for d in unique.values()):
            unique[k] = c
    if select is not None:
        score = {k: select(c) for k, c in unique.items()}
    else:
        score = {k: (terminal(c) if terminal else 0.0) - p.err_of(c) / ro.dense_norm for k, c in unique.items()}
    picked = max(score, key=score.get)
    log.info("final candidates %s; picked %s", {k: round(v, 4) for k, v in score.items()}, picked)
    return unique[picked], picked


def _update(policy, critic, opt, ro: Rollout, S, A, M, LP, adv, ret, s: PPOSettings, gen) -> None:
    """PPO epochs over minibatches of `minibatch` (step, episode) pairs; with layer steps a step's log-probability
    is the sum over its chunks' heads (its entropy the mean) and its value the critic at its first unit."""
    if ro.layer_steps:
        return _update_layers(policy, critic, opt, ro, S, A, M, LP, adv, ret, s, gen)
    T, E = A.shape
    flat = lambda x: x.reshape(T * E, *x.shape[2:])  # noqa: E731
    S, A, M, LP, adv, ret = map(flat, (S, A, M, LP, adv, ret))
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    n = S.shape[0]
    for _ in range(s.epochs):
        order = torch.randperm(n, generator=gen)
        for k in range(0, n, s.minibatch):
            idx = order[k:k + s.minibatch]
            logits = policy(S[idx]).masked_fill(~M[idx], -1e9)
            dist = torch.distributions.Categorical(logits=logits)
            ratio = torch.exp(dist.log_prob(A[idx]) - LP[idx])
            v = critic(S[idx]).squeeze(-1)
            _step(policy, critic, opt, ratio, adv[idx], v, ret[idx], dist.entropy().mean(), s)


def _update_layers(policy, critic, opt, ro: Rollout, S, A, M, LP, adv, ret, s: PPOSettings, gen) -> None:
    L, E = adv.shape
    count = torch.zeros(L).index_add_(0, ro.step_of, torch.ones(len(ro.step_of))).view(-1, 1)
    adv, ret = adv.reshape(-1), ret.reshape(-1)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    n = L * E
    for _ in range(s.epochs):
        order = torch.randperm(n, generator=gen)
        for k in range(0, n, s.minibatch):
            idx = order[k:k + s.minibatch]
            dist = torch.distributions.Categorical(logits=policy(S).masked_fill(~M, -1e9))  # (U, E)
            log_ratio = torch.zeros(L, E).index_add(0, ro.step_of, dist.log_prob(A) - LP)
            ent = torch.zeros(L, E).index_add(0, ro.step_of, dist.entropy()) / count
            v = critic(S[ro.first]).squeeze(-1).reshape(-1)
            _step(policy, critic, opt, torch.exp(log_ratio.reshape(-1)[idx]), adv[idx], v[idx], ret[idx],
                  ent.reshape(-1)[idx].mean(), s)


def _step(policy, critic, opt, ratio, adv, v, ret, entropy, s: PPOSettings) -> None:
    """One clipped-PPO gradient step."""
    pg = -torch.min(ratio * adv, ratio.clamp(1 - s.clip, 1 + s.clip) * adv).mean()
    loss = pg + s.value_coef * ((v - ret) ** 2).mean() - s.entropy * entropy
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(list(policy.parameters()) + list(critic.parameters()), 0.5)
    opt.step()
