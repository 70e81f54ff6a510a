"""Typed hand-offs between stages (docs/stages.md).

A stage declares in its registration the hand-offs it consumes and produces; the bind step checks at plan
time that every consumed one has a producer before it, and the pipeline passes each stage the values it
consumes (`ctx.inputs[Type]`) and stores what it emits (`ctx.emit(value)`). Every hand-off knows how to
save itself in its stage's directory `stages/NN-stage-method/` and how to load itself back, so a finished
stage is never applied again on `--resume`: its hand-offs are loaded (and their effect on the in-memory
model restored).

    QuantizedWeights  the rounded layers of a `quantize` stage (codes in the stage's block checkpoints)
    Plan              a mixed-precision allocation (compress/allocate/plan.py), for the next quantize
    ModelSpec         the model's shapes: per block FFN channels, heads, experts; which source blocks remain
    TrainedWeights    parameters a training stage changed (router fine-tuning, heal), written back on --resume
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
    channels, attention heads and expert widths. `kept_ffn[s]` / `kept_heads[s]`, when given, list the FFN
    channels / KV heads that source block s keeps, in source indices (the rest were removed; a KV head keeps
    the query heads that read it). Exporters read it and refuse, at plan time, shapes their format cannot
    hold; `compress inspect` prints it; `restore` replays it on a model (compress/structure.py)."""

    model_type: str
    hidden_size: int
    head_dim: int
    source_blocks: int
    blocks: tuple[BlockShape, ...]
    kept_ffn: dict[int, tuple[int, ...]] = field(default_factory=dict)
    kept_heads: dict[int, tuple[int, ...]] = field(default_factory=dict)

    FILE: ClassVar[str] = "model_spec.json"

    @classmethod
    def of(cls, adapter) -> "ModelSpec":
        """The shapes of `adapter`'s model as it is now (works on a weightless skeleton too)."""
        heads, kv, head_dim = adapter.attention_shape()
        blocks = []
        for i in range(len(adapter.blocks)):
            q, k = adapter.role(i, "q"), adapter.role(i, "k")
            if q is not None and k is not None:  # per-head projections (fused or latent attention: the config's)
                heads, kv = q.out_features // head_dim, k.out_features // head_dim
            up, gate_up = adapter.role(i, "mlp_up"), adapter.role(i, "mlp_gate_up")
            ffn = up.out_features if up is not None else gate_up.out_features // 2 if gate_up is not None else None
            experts = tuple(e.up_proj.out_features for e in adapter.experts(i) or ())
            blocks.append(BlockShape(i, ffn, heads, kv, experts))
        c = adapter.model.config
        return cls(adapter.model_type, c.hidden_size, head_dim, len(adapter.blocks), tuple(blocks))

    def uniform(self, attr: str) -> bool:
        """One value over the blocks that have one (DeepSeek's MoE blocks have no dense FFN width)."""
        return len({getattr(b, attr) for b in self.blocks} - {None}) <= 1

    def differences(self, base: "ModelSpec") -> list[str]:
        """What changed from `base` (the source model), in words."""
        out = []
        if len(self.blocks) != len(base.blocks):
            out.append(f"{len(self.blocks)} of {len(base.blocks)} blocks kept")
        by_source = {b.source: b for b in base.blocks}
        for b in self.blocks:
            s = by_source[b.source]
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

    # -- what a block keeps, in source indices ----------------------------------------------------------------
    def ffn_sources(self, b: BlockShape) -> tuple[int, ...]:
        return self.kept_ffn.get(b.source, tuple(range(b.ffn or 0)))

    def head_sources(self, b: BlockShape) -> tuple[int, ...]:
        return self.kept_heads.get(b.source, tuple(range(b.kv_heads)))

    def keeping(self, *, blocks=None, ffn=None, kv_heads=None) -> "ModelSpec":
        """This spec after keeping `blocks` (positions in self.blocks), and per kept position the FFN channels
        `ffn[pos]` / KV heads `kv_heads[pos]` (positions within that block as it is now)."""
        from dataclasses import replace

        positions = list(range(len(self.blocks))) if blocks is None else list(blocks)
        ffn, kv_heads = ffn or {}, kv_heads or {}
        out, kept_ffn, kept_heads = [], {}, {}
        for pos in positions:
            b = self.blocks[pos]
            f, h = self.ffn_sources(b), self.head_sources(b)
            if pos in ffn:
                f = tuple(f[j] for j in ffn[pos])
            if pos in kv_heads:
                per = b.heads // b.kv_heads
                h = tuple(h[j] for j in kv_heads[pos])
                b = replace(b, heads=per * len(h), kv_heads=len(h))
            b = replace(b, ffn=len(f) if b.ffn is not None else None)
            out.append(b)
            if b.source in self.kept_ffn or pos in ffn:
                kept_ffn[b.source] = f
            if b.source in self.kept_heads or pos in kv_heads:
                kept_heads[b.source] = h
        return replace(self, blocks=tuple(out), kept_ffn=kept_ffn, kept_heads=kept_heads)

    def to_json(self) -> dict:
        d = asdict(self)
        d["kept_ffn"] = {str(k): list(v) for k, v in self.kept_ffn.items()}
        d["kept_heads"] = {str(k): list(v) for k, v in self.kept_heads.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModelSpec":
        blocks = tuple(BlockShape(**{**b, "experts": tuple(b["experts"])}) for b in d["blocks"])
        return cls(d["model_type"], d["hidden_size"], d["head_dim"], d["source_blocks"], blocks,
                   {int(k): tuple(v) for k, v in d.get("kept_ffn", {}).items()},
                   {int(k): tuple(v) for k, v in d.get("kept_heads", {}).items()})

    def save(self, ws, key: str) -> None:
        ws.write_json(f"stages/{key}/{self.FILE}", self.to_json())

    @classmethod
    def load(cls, ctx, key: str) -> "ModelSpec":
        """Read the spec and bring the in-memory model (at the shapes of the spec this stage used, if any) to it."""
        spec = cls.from_json(json.loads(cls.artifact(ctx, key, cls.FILE).read_text()))
        spec.restore(ctx.adapter, ctx.inputs.get(ModelSpec))
        return spec

    def restore(self, adapter, previous: "ModelSpec | None" = None) -> None:
        """Bring the model, whose shapes are `previous` (None: the source model's), to this spec: keep its blocks,
        KV heads and FFN channels (compress/structure.py) and write the shapes into the config."""
        from compress import structure

        prev = previous or ModelSpec.of(adapter)
        have = [b.source for b in prev.blocks]
        if any(b.source not in have for b in self.blocks):
            raise RunFailure(f"this ModelSpec keeps source blocks {[b.source for b in self.blocks]}, but the model "
                             f"has only {have}")
        if [b.source for b in self.blocks] != have:
            structure.keep_blocks(adapter, [have.index(b.source) for b in self.blocks])
        for pos, b in enumerate(self.blocks):
            before = prev.blocks[have.index(b.source)]
            for want, now, edit in ((self.head_sources(b), prev.head_sources(before), structure.keep_kv_groups),
                                    (self.ffn_sources(b), prev.ffn_sources(before), structure.keep_ffn)):
                if want != now:
                    if any(s not in now for s in want):
                        raise RunFailure(f"block {b.source}: this ModelSpec keeps channels or heads the model "
                                         "no longer has")
                    edit(adapter, pos, [now.index(s) for s in want])
        structure.sync_config(adapter)


# -- TrainedWeights -----------------------------------------------------------------------------------------
@dataclass
class TrainedWeights(Handoff):
    """The parameters a training stage changed, by name (`trained.safetensors`); loading writes them back into
    the in-memory model, so a resumed run continues from the trained model. Exports read the model."""

    weights: dict[str, torch.Tensor]
    FILE: ClassVar[str] = "trained.safetensors"

    def save(self, ws, key: str) -> None:
        from safetensors.torch import save

        ws.write_bytes(f"stages/{key}/{self.FILE}", save({n: w.contiguous() for n, w in self.weights.items()}))

    @classmethod
    def load(cls, ctx, key: str) -> "TrainedWeights":
        from safetensors.torch import load_file

        weights = load_file(str(cls.artifact(ctx, key, cls.FILE)))
        params = dict(ctx.model.named_parameters())
        missing = sorted(set(weights) - set(params))
        if missing:
            raise RunFailure(f"stage {key}: {cls.FILE} holds parameters the model does not have, e.g. {missing[0]}")
        with torch.no_grad():
            for n, w in weights.items():
                params[n].copy_(w)
        return cls(weights)
