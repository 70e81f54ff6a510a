"""`rotate` stage, `method: autoround_hadamard`: auto-round's own QuaRot-style Hadamard rotation, for comparison.

Calls `auto_round.algorithms.transforms.hadamard.dispatcher.apply_hadamard_rotation` with the
`inplace` backend (auto-round 0.16: residual-stream rotation absorbed into the weights, norms fused,
plus per-layer *online* Hadamard transforms kept as forward pre-hooks on the layers whose inputs
cannot be rotated offline, e.g. `down_proj`; `fuse_online_to_weight: true` also rotates those
layers' weights so the hook and weight transforms cancel in full precision). The quantizer that
follows rounds the rotated weights. The hooks are run-time operators that no exporter here writes
(auto-round itself only exports this backend in its "fake" format), so a recipe with this stage and
`export.formats` is refused at plan time: it is an evaluation-only baseline for `rotate/walsh`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from compress.config import StrictModel
from compress.errors import BadInput
from compress.registry import register


class AutoRoundHadamardConfig(StrictModel):
    stage: Literal["rotate"] = "rotate"
    method: Literal["autoround_hadamard"] = "autoround_hadamard"
    hadamard_type: Literal["hadamard", "quarot_hadamard", "random_hadamard"] = Field(
        "hadamard", description="auto-round preset: deterministic Hadamard, QuaRot's fast Hadamard, or random")
    fuse_online: bool = Field(True, description="auto-round `fuse_online_to_weight`")


def check(adapter, cfg: AutoRoundHadamardConfig, facts=None) -> None:
    if adapter.kind != "causal":
        raise BadInput(f"rotate/autoround_hadamard needs a decoder; `{adapter.model_type}` is an encoder")


@register("rotate", "autoround_hadamard", AutoRoundHadamardConfig,
          "auto-round's own QuaRot-style Hadamard rotation (evaluation-only baseline)", check=check,
          replay=True, evaluation_only=lambda cfg: ("keeps auto-round's online Hadamard hooks (use `rotate/walsh` "
                                                    "with `fused: true`)"))
def apply(ctx, cfg: AutoRoundHadamardConfig) -> dict:
    from auto_round.algorithms.transforms.hadamard.dispatcher import (
        apply_hadamard_rotation,
    )

    model = ctx.adapter.model
    check(ctx.adapter, cfg)
    apply_hadamard_rotation(model, {"backend": "inplace", "hadamard_type": f"inplace_{cfg.hadamard_type}",
                                    "fuse_online_to_weight": cfg.fuse_online}, "int")
    for p in model.parameters():  # auto-round rewrites weights under inference_mode; quantizers need autograd
        if p.is_inference():
            p.data = p.data.clone()
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return {"online_hooks": hooks, "hadamard_type": cfg.hadamard_type}
