"""Importance scores for structured pruning (docs/prune.md): FFN channels, KV-head groups, whole blocks.

Every score is "how much of the block's output would go with this unit", higher = keep:

- `calibrated` FFN channel j of a block: `E[a_j^2] * ||W_down[:, j]||^2`, with `a_j` the channel's activation
  (the input of `down_proj`) over the calibration tokens: the expected energy the channel writes into the
  residual stream, ignoring correlations between channels (the Wanda / Minitron activation x weight score,
  squared). `magnitude`: `||W_gate[j]|| * ||W_up[j]|| * ||W_down[:, j]||`, weights only (the baseline).
- `calibrated` KV group g (one KV head and the query heads that read it): the same expected output energy of
  its query heads at `o_proj`, `sum_{d in heads(g)} E[o_d^2] * ||W_o[:, d]||^2`. `magnitude`:
  `||W_v[g]|| * ||W_o[:, heads(g)]||`.
- Blocks: `cosine`, the block influence of ShortGPT, `1 - E[cos(x_in, x_out)]` over the calibration tokens (a
  block that barely turns the residual stream matters little); `loss`, the increase of the calibration
  cross-entropy when the block alone is skipped; `last`, the baseline, scores blocks by position (the last go
  first). Several blocks go one at a time (`blocks_to_remove`): the blocks still there are scored with the ones
  already chosen skipped, and the least important goes next (removing a block changes what its neighbours see).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compress.calibration import collect_energy
from compress.models.adapters import accepts_use_cache
from compress.structure import block_heads


@torch.no_grad()
def ffn_scores(adapter, tokens: torch.Tensor | None, batch_size: int) -> dict[int, torch.Tensor]:
    """Per dense-MLP block: the score of each FFN channel (calibrated when `tokens` is given, else magnitude)."""
    blocks = [i for i in range(len(adapter.blocks)) if adapter.role(i, "mlp_down") is not None]
    if tokens is None:
        out = {}
        for i in blocks:
            s = adapter.role(i, "mlp_down").weight.float().norm(dim=0)
            for role in ("mlp_gate", "mlp_up"):
                if adapter.role(i, role) is not None:
                    s = s * adapter.role(i, role).weight.float().norm(dim=1)
            out[i] = s
        return out
    energy = collect_energy(adapter.model, tokens, {i: (adapter.role(i, "mlp_down"), "input") for i in blocks},
                            batch_size=batch_size)
    return {i: energy[i].float() * adapter.role(i, "mlp_down").weight.float().pow(2).sum(0) for i in blocks}


@torch.no_grad()
def head_scores(adapter, tokens: torch.Tensor | None, batch_size: int) -> dict[int, torch.Tensor]:
    """Per block: the score of each KV group (calibrated when `tokens` is given, else magnitude)."""
    _, _, hd = adapter.attention_shape()
    n = len(adapter.blocks)
    if tokens is not None:
        energy = collect_energy(adapter.model, tokens, {i: (adapter.role(i, "o"), "input") for i in range(n)},
                                batch_size=batch_size)
    out = {}
    for i in range(n):
        heads, kv = block_heads(adapter, i)
        o = adapter.role(i, "o").weight.float()
        if tokens is not None:
            per_dim = energy[i].float() * o.pow(2).sum(0)  # (heads * hd,)
            out[i] = per_dim.view(kv, -1).sum(1)
        else:
            v = adapter.role(i, "v").weight.float().view(kv, -1).norm(dim=1)
            out[i] = v * o.view(o.shape[0], kv, -1).pow(2).sum((0, 2)).sqrt()
    return out


def _skip(_m, args, kwargs, out):
    """Forward hook: the block passes its input through (as if it were removed)."""
    x = args[0] if args else kwargs["hidden_states"]
    return (x, *out[1:]) if isinstance(out, tuple) else x


@torch.no_grad()
def block_scores(adapter, tokens: torch.Tensor, how: str, batch_size: int,
                 skipped: tuple[int, ...] = ()) -> torch.Tensor:
    """Per block, its importance by `how` (`cosine`, `loss` or `last`; module docstring), measured with the
    blocks `skipped` passing their input through; theirs is +inf."""
    n = len(adapter.blocks)
    if how == "last":
        return torch.arange(n, 0, -1, dtype=torch.float64)
    model = adapter.model
    kw = {"use_cache": False} if accepts_use_cache(model) else {}
    live = [i for i in range(n) if i not in skipped]
    out = torch.full((n,), float("inf"), dtype=torch.float64)
    handles = [adapter.blocks[i].register_forward_hook(_skip, with_kwargs=True) for i in skipped]
    try:
        if how == "cosine":
            sums = torch.zeros(n, dtype=torch.float64)
            count = 0

            def hook(i):
                def fn(_m, args, kwargs, out):
                    x = args[0] if args else kwargs["hidden_states"]
                    y = out[0] if isinstance(out, tuple) else out
                    sums[i] += F.cosine_similarity(x.double(), y.double(), dim=-1).sum()
                return fn

            handles += [adapter.blocks[i].register_forward_hook(hook(i), with_kwargs=True) for i in live]
            for b in tokens.split(batch_size):
                model(input_ids=b, **kw)
                count += b.numel()
            out[live] = 1 - sums[live] / count
            return out

        def loss() -> float:
            total = 0.0
            for b in tokens.split(batch_size):
                total += float(model(input_ids=b, labels=b, **kw).loss) * b.shape[0]
            return total / tokens.shape[0]

        base = loss()
        for i in live:
            h = adapter.blocks[i].register_forward_hook(_skip, with_kwargs=True)
            try:
                out[i] = loss() - base
            finally:
                h.remove()
        return out
    finally:
        for h in handles:
            h.remove()


def blocks_to_remove(adapter, tokens: torch.Tensor | None, how: str, n: int,
                     batch_size: int) -> tuple[list[int], list[torch.Tensor]]:
    """The positions of the `n` blocks to remove, chosen one at a time (module docstring), and each round's
    scores (`last`: one round, by position)."""
    removed: list[int] = []
    rounds: list[torch.Tensor] = []
    while len(removed) < n:
        s = block_scores(adapter, tokens, how, batch_size, tuple(removed))
        rounds.append(s)
        if how == "last":
            return sorted(top(-s, n)), rounds
        removed.append(min(range(s.numel()), key=lambda j: (float(s[j]), -j)))  # ties: the later block
    return sorted(removed), rounds


ALIGN = 32  # the packed loaders' unit (quantize.spine.LOADER_ALIGN): the finest default multiple


def powers_below(n: int) -> list[int]:
    """The powers of two below `n`, largest first."""
    return [1 << k for k in range(max(n - 1, 1).bit_length() - 1, -1, -1) if 1 << k < n]


def kept_count(width: int, ratio: float, multiple: int) -> int:
    """Channels kept of `width` when `ratio` of them go: the nearest multiple of `multiple` (ties keep more),
    at least one multiple, at most `width`."""
    want = width * (1 - ratio) / multiple
    k = int(want) + (1 if want - int(want) >= 0.5 else 0)
    return min(width, max(multiple, k * multiple))


def top(scores: torch.Tensor, k: int) -> list[int]:
    """The positions of the `k` largest scores, in increasing order (ties: the earlier position)."""
    order = sorted(range(scores.numel()), key=lambda j: (-float(scores[j]), j))
    return sorted(order[:k])


def global_counts(scores: dict[int, torch.Tensor], ratio: float, multiple: int) -> dict[int, int]:
    """Per block, channels kept when one threshold over every block's scores removes `ratio` of all channels;
    each block's count rounded to `multiple` (at least one multiple)."""
    total = sum(s.numel() for s in scores.values())
    keep = total - round(ratio * total)
    allv = torch.cat([s.double() for s in scores.values()])
    thr = allv.sort(descending=True).values[keep - 1] if keep else float("inf")
    out = {}
    for i, s in scores.items():
        n = int((s.double() >= thr).sum())
        out[i] = min(s.numel(), max(multiple, int(round(n / multiple)) * multiple))
    return out
