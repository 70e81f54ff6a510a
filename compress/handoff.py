"""Typed hand-offs between stages (docs/stages.md).

A stage declares in its registration the hand-offs it consumes and produces; the bind step checks at plan
time that every consumed one has a producer before it, and the pipeline passes each stage the values it
consumes (`ctx.inputs[Type]`) and stores what it emits (`ctx.emit(value)`). Every hand-off knows how to
save itself in its stage's directory `stages/NN-stage-method/` and how to load itself back, so a finished
stage is never applied again on `--resume`: its hand-offs are loaded (and their effect on the in-memory
model restored).

    QuantizedWeights  the rounded layers of a `quantize` stage (codes in the stage's block checkpoints)
    Plan              a mixed-precision allocation (compress/methods/allocate/plan.py), for the next quantize
    ModelSpec         the model's shapes: per block FFN channels, heads, experts; which source blocks remain
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch

from compress.errors import RunFailure
from compress.qweight import QuantizedWeight


class Handoff:
    """A value one stage produces and later ones consume. `must_be_consumed`: the bind step refuses a recipe
    in which no later stage consumes it (an allocation plan nobody applies)."""

    must_be_consumed: ClassVar[bool] = False

    def save(self, ws, key: str) -> None:
        raise NotImplementedError

    @classmethod
    def load(cls, ctx, key: str):
        raise NotImplementedError

    @staticmethod
    def artifact(ctx, key: str, name: str):
        """stages/KEY/NAME, verified against the sha256 recorded when it was written; RunFailure when it is
        missing or corrupt (the stage is recorded as finished)."""
        path = ctx.workspace.verified(f"stages/{key}/{name}")
        if path is None:
            raise RunFailure(f"stage {key} is recorded as finished but its {name} is missing or corrupt; rerun "
                             "with --force")
        return path


def name(kind: type) -> str:
    return kind.__name__


# -- QuantizedWeights -----------------------------------------------------------------------------------------
@dataclass
class QuantizedWeights(Handoff):
    """Every layer one quantize stage rounded, by module name. The codes of block layers live in the stage's
    block checkpoints (`stage`); the other layers (the LM head) in `weights.safetensors` next to them."""

    weights: dict[str, QuantizedWeight]
    stage: str
    blocks: int
    block_layers: list[str] = field(default_factory=list)

    INDEX: ClassVar[str] = "weights.json"
    EXTRA: ClassVar[str] = "weights.safetensors"

    def save(self, ws, key: str) -> None:
        from safetensors.torch import save

        from compress.qweight import qweights_to_tensors

        extra = {n: q for n, q in self.weights.items() if n not in set(self.block_layers)}
        tensors, meta = qweights_to_tensors(extra)
        ws.write_bytes(f"stages/{key}/{self.EXTRA}", save(tensors, metadata={"qweights": json.dumps(meta)}))
        ws.write_json(f"stages/{key}/{self.INDEX}", {"blocks": self.blocks, "block_layers": self.block_layers,
                                                      "extra": sorted(extra)})

    @classmethod
    def load(cls, ctx, key: str) -> "QuantizedWeights":
        """Read every block checkpoint and the extra layers, and write the dequantized weights into the model
        (streamed: the codes stay in the checkpoints, the returned weights keep scales and zeros only)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        from compress.driver import light, set_weight
        from compress.qweight import tensors_to_qweights

        ws = ctx.workspace
        index_path, extra_path = cls.artifact(ctx, key, cls.INDEX), cls.artifact(ctx, key, cls.EXTRA)
        index = json.loads(index_path.read_text())
        weights: dict[str, QuantizedWeight] = {}
        for i in range(index["blocks"]):
            done = ws.load_block(key, i, required=True)
            weights.update({n: light(q) for n, q in done.items()} if ctx.streamer else done)
        with safe_open(str(extra_path), "pt") as f:
            meta = json.loads(f.metadata()["qweights"])
        weights.update(tensors_to_qweights(load_file(str(extra_path)), meta))
        if ctx.streamer is None:
            for n, q in weights.items():
                set_weight(ctx.model.get_submodule(n), q)
        return cls(weights, key, index["blocks"], index["block_layers"])

    @staticmethod
    def merged(values: list["QuantizedWeights"]) -> dict[str, QuantizedWeight]:
        """Every quantized layer of the run, a later stage's rounding of a layer replacing an earlier one."""
        out: dict[str, QuantizedWeight] = {}
        for v in values:
            out.update(v.weights)
        return out


# -- ModelSpec ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockShape:
    source: int  # the block's index in the source model
    ffn: int | None  # FFN channels of the dense MLP (None: the block has none, e.g. an MoE block)
    heads: int
    kv_heads: int
    experts: tuple[int, ...] = ()  # FFN channels of each expert


@dataclass(frozen=True)
class ModelSpec(Handoff):
    """The model's shapes after structural change: which source blocks remain and, per block, its FFN
    channels, attention heads and expert widths. `kept_ffn[i]`, when given, lists the source FFN channels
    block i keeps (the rest were removed). Exporters read it and refuse, at plan time, shapes their format
    cannot hold; `compress inspect` prints it."""

    model_type: str
    hidden_size: int
    head_dim: int
    source_blocks: int
    blocks: tuple[BlockShape, ...]
    kept_ffn: dict[int, tuple[int, ...]] = field(default_factory=dict)

    FILE: ClassVar[str] = "model_spec.json"

    @classmethod
    def of(cls, adapter) -> "ModelSpec":
        """The shapes of `adapter`'s model as it is now (works on a weightless skeleton too)."""
        _, _, head_dim = adapter.attention_shape()
        blocks = []
        for i in range(len(adapter.blocks)):
            q, k = adapter.role(i, "q"), adapter.role(i, "k")
            up = adapter.role(i, "mlp_up")
            experts = tuple(e.up_proj.out_features for e in adapter.experts(i) or ())
            blocks.append(BlockShape(i, up.out_features if up is not None else None, q.out_features // head_dim,
                                     k.out_features // head_dim, experts))
        c = adapter.model.config
        return cls(adapter.model_type, c.hidden_size, head_dim, len(adapter.blocks), tuple(blocks))

    def uniform(self, attr: str) -> bool:
        return len({getattr(b, attr) for b in self.blocks}) <= 1

    def differences(self, base: "ModelSpec") -> list[str]:
        """What changed from `base` (the source model), in words."""
        out = []
        if len(self.blocks) != len(base.blocks):
            out.append(f"{len(self.blocks)} of {len(base.blocks)} blocks kept")
        for b in self.blocks:
            s = base.blocks[b.source]
            for attr in ("ffn", "heads", "kv_heads", "experts"):
                if getattr(b, attr) != getattr(s, attr):
                    out.append(f"block {b.source} {attr} {getattr(s, attr)} -> {getattr(b, attr)}")
        return out

    def text(self) -> str:
        def span(attr):
            vals = [getattr(b, attr) for b in self.blocks]
            return str(vals[0]) if len(set(vals)) == 1 else ", ".join(map(str, vals))

        lines = [f"structure: {len(self.blocks)} of {self.source_blocks} blocks, hidden {self.hidden_size}, "
                 f"head_dim {self.head_dim}",
                 f"  ffn channels: {span('ffn')}", f"  heads: {span('heads')} (kv {span('kv_heads')})"]
        if any(b.experts for b in self.blocks):
            lines.append(f"  experts: {span('experts')}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = asdict(self)
        d["kept_ffn"] = {str(k): list(v) for k, v in self.kept_ffn.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModelSpec":
        blocks = tuple(BlockShape(**{**b, "experts": tuple(b["experts"])}) for b in d["blocks"])
        return cls(d["model_type"], d["hidden_size"], d["head_dim"], d["source_blocks"], blocks,
                   {int(k): tuple(v) for k, v in d.get("kept_ffn", {}).items()})

    def save(self, ws, key: str) -> None:
        ws.write_json(f"stages/{key}/{self.FILE}", self.to_json())

    @classmethod
    def load(cls, ctx, key: str) -> "ModelSpec":
        """Read the spec and bring the in-memory model to it (FFN channels are sliced as `kept_ffn` says)."""
        spec = cls.from_json(json.loads(cls.artifact(ctx, key, cls.FILE).read_text()))
        spec.restore(ctx.adapter)
        return spec

    def restore(self, adapter) -> None:
        """Slice the model's FFN channels to `kept_ffn`; other structural changes cannot be restored yet and
        are refused (the stage that made them must register `replay=True`)."""
        now = ModelSpec.of(adapter)
        if [b.source for b in self.blocks] != [b.source for b in now.blocks] or any(
                (a.heads, a.kv_heads, a.experts) != (b.heads, b.kv_heads, b.experts)
                for a, b in zip(self.blocks, now.blocks)):
            raise RunFailure("this ModelSpec removes blocks, heads or experts, which a resumed run cannot restore "
                             "from the spec alone; the stage that produced it must replay")
        for i, kept in self.kept_ffn.items():
            if now.blocks[i].ffn == len(kept):
                continue
            idx = torch.tensor(kept, dtype=torch.long)
            for role in ("mlp_gate", "mlp_up"):
                if adapter.role(i, role) is not None:
                    _slice_linear(adapter.role(i, role), rows=idx)
            _slice_linear(adapter.role(i, "mlp_down"), cols=idx)


def _slice_linear(lin, rows=None, cols=None) -> None:
    with torch.no_grad():
        w = lin.weight.data
        w = w[rows] if rows is not None else w
        w = w[:, cols] if cols is not None else w
        lin.weight = torch.nn.Parameter(w.contiguous(), requires_grad=False)
        if rows is not None and lin.bias is not None:
            lin.bias = torch.nn.Parameter(lin.bias.data[rows].contiguous(), requires_grad=False)
        lin.out_features, lin.in_features = lin.weight.shape
