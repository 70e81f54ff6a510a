"""`stage: prune, method: prunepath`: every dense FFN split into routed experts with a run-time mass threshold
(compress/prune/routing.py; docs/prune.md).

The stage clusters each FFN's neurons into experts of `expert_size`, permutes them contiguous (recorded in the
`ModelSpec` as the order every FFN keeps its channels in, so `--resume` and the exports replay it), trains one
router per layer on the first `samples` calibration sequences (`epochs`, `lr`), and picks the threshold: `tau`
as given, or the one whose mean active fraction of experts on those tokens is `target_active` (bisection). The
routers, `expert_size`, `k_min` and `tau` are the `PathRouters` hand-off (`routers.safetensors` +
`prunepath.json`); loading it wraps the FFNs again. Later stages that calibrate (quantize, allocate) see the
dense FFNs (the pipeline runs every stage with tau = 1), the evaluation runs at `tau`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from compress.config import StrictModel
from compress.errors import BadInput
from compress.handoff import Handoff, ModelSpec
from compress.prune import routing as pp
from compress.prune.report import PRUNED
from compress.registry import register

log = logging.getLogger(__name__)


class PrunePathConfig(StrictModel):
    stage: Literal["prune"] = "prune"
    method: Literal["prunepath"] = "prunepath"
    expert_size: int = Field(32, ge=1, description="neurons per expert")
    target_active: float | None = Field(0.5, gt=0, le=1, description="mean fraction of experts active; sets tau")
    tau: float | None = Field(None, gt=0, le=1, description="cumulative router mass of the active experts (instead "
                                                           "of target_active)")
    k_min: int = Field(1, ge=1)
    samples: int = Field(32, ge=1)
    seqlen: int = Field(256, ge=2)
    batch_size: int = Field(8, ge=1)
    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-3, gt=0)

    @model_validator(mode="after")
    def _one_knob(self):
        if self.tau is not None:
            self.target_active = None
        return self


@dataclass
class PathRouters(Handoff):
    """The PrunePath routers by block, with the experts' size, k_min and the threshold tau."""

    routers: dict[int, torch.Tensor]
    expert_size: int
    k_min: int
    tau: float
    FILE: ClassVar[str] = "routers.safetensors"
    META: ClassVar[str] = "prunepath.json"

    def save(self, ws, key: str) -> None:
        from safetensors.torch import save

        ws.write_bytes(f"stages/{key}/{self.FILE}", save({str(i): w.contiguous() for i, w in self.routers.items()}))
        ws.write_json(f"stages/{key}/{self.META}", {"expert_size": self.expert_size, "k_min": self.k_min,
                                                     "tau": self.tau})

    @classmethod
    def load(cls, ctx, key: str) -> "PathRouters":
        from safetensors.torch import load_file

        meta = json.loads(cls.artifact(ctx, key, cls.META).read_text())
        routers = {int(i): w for i, w in load_file(str(cls.artifact(ctx, key, cls.FILE))).items()}
        for i, w in routers.items():
            pp.wrap(ctx.adapter, i, w, meta["expert_size"], meta["tau"], meta["k_min"])
        pp.describe(ctx.model, meta["expert_size"], meta["k_min"], meta["tau"], sorted(routers))
        return cls(routers, meta["expert_size"], meta["k_min"], meta["tau"])


def _dense_blocks(spec: ModelSpec) -> list[int]:
    return [p for p, b in enumerate(spec.blocks) if b.ffn is not None]


def check(adapter, cfg: PrunePathConfig, facts):
    adapter.refuse("prune", "`prune: prunepath`")
    if adapter.kind != "causal" or not _dense_blocks(facts.spec):
        raise BadInput(f"`prune: prunepath` needs a decoder with dense gated MLPs; `{adapter.model_type}` has none")
    if facts.after_quantize:
        raise BadInput(f"stage {facts.index} (`prune`/prunepath) comes after a `quantize` stage; split the FFNs "
                       "before quantizing")
    if PathRouters in facts.produced:
        raise BadInput(f"stage {facts.index}: a second `prune: prunepath`; the FFNs are split once")
    for p in _dense_blocks(facts.spec):
        n = facts.spec.blocks[p].ffn
        if n % cfg.expert_size:
            raise BadInput(f"`expert_size: {cfg.expert_size}` does not divide block {p}'s {n} FFN channels")
    if facts.rounding and facts.rounding[1] > 0 and cfg.expert_size % facts.rounding[1] and \
            facts.rounding[1] % cfg.expert_size:
        raise BadInput(f"`expert_size: {cfg.expert_size}` and the quantize stage's group size {facts.rounding[1]} "
                       "do not nest: an expert must be whole groups (or a group whole experts)")
    return cfg


def reshape(spec: ModelSpec, cfg: PrunePathConfig) -> ModelSpec:
    return spec  # the neurons are permuted, none removed


@torch.no_grad()
def _mlp_inputs(adapter, tokens: torch.Tensor, blocks: list[int], batch_size: int) -> dict[int, torch.Tensor]:
    seen: dict[int, list] = {i: [] for i in blocks}
    hooks = [adapter.blocks[i].mlp.register_forward_pre_hook(lambda _m, a, i=i: seen[i].append(a[0].detach()))
             for i in blocks]
    try:
        for b in tokens.split(batch_size):
            adapter.model(input_ids=b, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat([x.reshape(-1, x.shape[-1]) for x in v]).float() for i, v in seen.items()}


def apply(ctx, cfg: PrunePathConfig) -> dict:
    adapter = ctx.adapter
    before = ctx.inputs.get(ModelSpec) or ModelSpec.of(adapter)
    blocks = _dense_blocks(before)
    order = {}
    for i in blocks:
        g, u = adapter.role(i, "mlp_gate").weight, adapter.role(i, "mlp_up").weight
        clusters = pp.balanced_clusters(torch.cat([g, u], 1).float(), cfg.expert_size, seed=ctx.seed)
        order[i] = [j for c in clusters for j in c]
    after = before.keeping(ffn=order)
    after.restore(adapter, before)  # every FFN's neurons now expert by expert
    ctx.emit(after)
    tokens = ctx.calibration_tokens()[:cfg.samples, :cfg.seqlen]
    xs = _mlp_inputs(adapter, tokens, blocks, cfg.batch_size)
    routers, probs, fit = {}, [], {}
    for i in blocks:
        mlp, x = adapter.blocks[i].mlp, xs[i]
        with torch.no_grad():
            norms = pp.expert_norms(mlp, x, cfg.expert_size)
            shares = norms / norms.sum(-1, keepdim=True).clamp_min(1e-12)
            init = torch.nn.functional.normalize(mlp.gate_proj.weight.float().view(-1, cfg.expert_size, x.shape[1])
                                                 .mean(1), dim=1)
        routers[i], lb, la = pp.train_router(x, shares, init, epochs=cfg.epochs, lr=cfg.lr, seed=ctx.seed)
        fit[str(before.blocks[i].source)] = {"kl_before": round(lb, 6), "kl_after": round(la, 6)}
        with torch.no_grad():
            probs.append(torch.softmax(x @ routers[i].T, -1))
    tau = cfg.tau if cfg.tau is not None else pp.tau_for(probs, cfg.target_active, cfg.k_min)
    for i in blocks:
        pp.wrap(adapter, i, routers[i], cfg.expert_size, tau, cfg.k_min)
    pp.describe(adapter.model, cfg.expert_size, cfg.k_min, tau, blocks)
    ctx.emit(PathRouters(routers, cfg.expert_size, cfg.k_min, tau))
    active = pp.active_fraction(probs, tau, cfg.k_min)
    log.info("prunepath: %d FFNs in experts of %d, tau %.4f, %.1f%% of experts active on the calibration tokens",
             len(blocks), cfg.expert_size, tau, 100 * active)
    params = sum(p.numel() for p in adapter.model.parameters())
    return {"structure": {"stage": "prune", "method": "prunepath", "importance": "router",
                          "parameters_before": params - sum(r.numel() for r in routers.values()),
                          "parameters_after": params,
                          "changes": [f"{len(blocks)} FFNs split into experts of {cfg.expert_size}; tau {tau:.4f}: "
                                      f"{100 * active:.1f}% of experts active"],
                          "tau": tau, "active_fraction": active, "router_fit": fit}}


register("prune", "prunepath", PrunePathConfig, "split FFNs into routed experts with a run-time mass threshold",
         check=check, uses=(ModelSpec,), produces=(ModelSpec, PathRouters), reshape=reshape,
         report=(PRUNED,))(apply)
