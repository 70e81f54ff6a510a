"""The real-model loss an allocation is scored by: the RL controller's terminal reward, the layer
sensitivities and the `refine` moves (docs/allocate.md)."""

from __future__ import annotations

import torch

from compress.allocate.problem import Problem
from compress.calibration import collect_energy


def collect_stats(ctx, layers: dict) -> dict[str, torch.Tensor]:
    """a_k = E[x_k^2] per input column of every planned linear, FP trajectory, one pass of the model."""
    taps = {name: (lin, "input") for name, (lin, _) in layers.items()}
    return {n: e.float() for n, e in collect_energy(ctx.model, ctx.calibration_tokens(), taps).items()}


class Terminal:
    """The real-model terminal reward: plan -> -kappa * (log ppl_Q - log ppl_FP) (or KL, or relative hidden MSE)."""

    def __init__(self, model, layers: dict, hats: dict, p: Problem, tokens: torch.Tensor, kind: str, kappa: float,
                 chunk_size: int):
        self.model, self.p, self.kind, self.kappa = model, p, kind, kappa
        self.lins = {n: lin for n, (lin, _) in layers.items()}
        self.hats, self.tokens, self.c = hats, tokens, chunk_size
        self.fp = {n: lin.weight.detach().clone() for n, lin in self.lins.items()}
        self.ref = self._measure()

    @torch.no_grad()
    def _measure(self):
        out = self.model(input_ids=self.tokens, use_cache=False, output_hidden_states=self.kind == "hidden_mse")
        if self.kind == "hidden_mse":
            return out.hidden_states[-1].float()
        if self.kind == "kl":
            return torch.log_softmax(out.logits.float(), -1)
        logits = out.logits[:, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       self.tokens[:, 1:].reshape(-1)))

    @torch.no_grad()
    def apply(self, choice: torch.Tensor, only: int | None = None) -> None:
        """Every planned layer (or layer index `only`) takes its plan's fake-quantized weight."""
        start = 0
        for li, name in enumerate(self.p.layers):
            hat = self.hats[name]
            n = int((self.p.unit_layer == li).sum())
            cols = choice[start:start + n].repeat_interleave(self.c)[: hat.shape[2]]
            start += n
            if only is not None and li != only:
                continue
            idx = cols.view(1, 1, -1).expand(1, hat.shape[1], -1)
            self.lins[name].weight.copy_(hat.gather(0, idx)[0])

    @torch.no_grad()
    def restore(self) -> None:
        for n, lin in self.lins.items():
            lin.weight.copy_(self.fp[n])

    def loss(self, choice: torch.Tensor, only: int | None = None) -> float:
        """Increase of the loss (log ppl, or relative hidden MSE) over the FP model under the plan."""
        self.apply(choice, only)
        try:
            q = self._measure()
        finally:
            self.restore()
        return self._delta(q)

    def unit_loss(self, u: int, option: int) -> float:
        """Loss increase with unit u alone at `option` (every other weight full precision)."""
        name = self.p.layers[int(self.p.unit_layer[u])]
        j = int(self.p.unit_chunk[u])
        with torch.no_grad():
            cols = slice(j * self.c, (j + 1) * self.c)
            self.lins[name].weight[:, cols] = self.hats[name][option, :, cols]
        try:
            return self._delta(self._measure())
        finally:
            self.restore()

    def _delta(self, q) -> float:
        if self.kind == "hidden_mse":
            return float(((q - self.ref) ** 2).mean() / (self.ref ** 2).mean())
        if self.kind == "kl":
            return float((self.ref.exp() * (self.ref - q)).sum(-1).mean())
        return q - self.ref

    def __call__(self, choice: torch.Tensor) -> float:
        return -self.kappa * self.loss(choice)


def sensitivity(term: Terminal, p: Problem, level: str) -> torch.Tensor:
    """Loss increase per unit of proxy error of every layer (`layer`: (L,)) or unit (`unit`: (U,)) alone at its
    cheapest option, floored at 1% of the largest (one whose measured increase is noise-level still costs
    something)."""
    cheap = p.cheapest()
    e = p.err.gather(1, cheap.view(-1, 1))[:, 0]
    if level == "layer":
        e = torch.zeros(len(p.layers), dtype=torch.float64).index_add_(0, p.unit_layer, e)
        dl = [term.loss(cheap, only=li) for li in range(len(p.layers))]
    else:
        dl = [term.unit_loss(u, int(cheap[u])) for u in range(p.n_units)]
    w = torch.tensor(dl, dtype=torch.float64).clamp_min(0) / e.clamp_min(1e-30)
    return w.clamp_min(0.01 * float(w.max())) if float(w.max()) > 0 else torch.ones_like(w)
