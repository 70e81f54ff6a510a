"""Model adapters: architecture plumbing as data, so that no method matches module names or branches on
`model_type`.

An `ArchMap` names, per Hugging Face `model_type`, where the roles live: the block list, the
embeddings, the final norm, the LM head, and inside a block the attention projections, the MLP,
the norms, the router and experts. Methods ask the adapter for roles; they never match module
names themselves. A new architecture is one entry in `ARCHS` plus a tiny-model test.

Fused MoE experts (transformers 5 stores them as 3-D parameters) are rewritten once, at load, into
`LinearExperts`: one `nn.Linear` triple per expert, numerically identical, so every linear-layer
method (hooks, Hessians, AutoRound) sees ordinary linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from compress.errors import BadInput

LLAMA_ROLES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "mlp_gate": "mlp.gate_proj",
    "mlp_up": "mlp.up_proj",
    "mlp_down": "mlp.down_proj",
    "input_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
}


@dataclass(frozen=True)
class ArchMap:
    kind: str  # "causal" | "encoder"
    blocks: tuple[str, ...]  # candidate dotted paths of the block ModuleList
    embeddings: tuple[str, ...]
    final_norm: tuple[str, ...] = ()
    lm_head: tuple[str, ...] = ()
    roles: dict = field(default_factory=dict)  # role -> path relative to a block
    experts: str | None = None  # path (relative to a block) of the experts container
    router: str | None = None
    not_quantized: tuple[str, ...] = ()  # roles never quantized (routers, scalar gates)
    optional: tuple[str, ...] = ()  # roles some blocks lack (DeepSeek's dense first blocks vs MoE ones)
    limits: dict = field(default_factory=dict)  # feature ("rotate", "prune") -> why this architecture cannot have it
    norm_offset: float = 0.0  # the norms scale by (norm_offset + weight): Gemma's RMSNorm multiplies by 1 + weight
    float16: str = ""  # why this architecture's activations leave float16's range ("": float16 is safe)


_CAUSAL = dict(kind="causal", blocks=("model.layers",), embeddings=("model.embed_tokens",),
               final_norm=("model.norm",), lm_head=("lm_head",))

# Gemma 2/3: `post_attention_layernorm` normalises the attention *output*; the MLP reads `pre_feedforward_layernorm`.
GEMMA_ROLES = {**LLAMA_ROLES, "post_attn_norm": "pre_feedforward_layernorm", "attn_out_norm": "post_attention_layernorm",
               "mlp_out_norm": "post_feedforward_layernorm"}
POST_NORMS = ("{} normalises each branch's output before the residual add (post-norms) and its RMSNorm scales by "
              "1 + weight: a rotation of the residual stream does not commute with those norms")
NO_RESIDUAL_ROTATION = {"rotate": POST_NORMS}
GEMMA_FLOAT16 = ("{}'s residual stream leaves float16's range (Gemma-3-270M: about 1e5 on the BOS token after block "
                 "8, every logit non-finite in float16); Google ships it in bfloat16")

ARCHS: dict[str, ArchMap] = {
    "llama": ArchMap(**_CAUSAL, roles=LLAMA_ROLES),
    "mistral": ArchMap(**_CAUSAL, roles=LLAMA_ROLES),
    "qwen2": ArchMap(**_CAUSAL, roles=LLAMA_ROLES),
    "qwen3": ArchMap(**_CAUSAL, roles={**LLAMA_ROLES, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}),
    "qwen2_moe": ArchMap(
        **_CAUSAL,
        roles={**{k: v for k, v in LLAMA_ROLES.items() if not k.startswith("mlp_")},
               "shared_gate": "mlp.shared_expert.gate_proj", "shared_up": "mlp.shared_expert.up_proj",
               "shared_down": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate"},
        experts="mlp.experts", router="mlp.gate", not_quantized=("shared_expert_gate",),
    ),
    "mixtral": ArchMap(**_CAUSAL, roles={k: v for k, v in LLAMA_ROLES.items() if not k.startswith("mlp_")},
                       experts="mlp.experts", router="mlp.gate"),
    "qwen3_moe": ArchMap(**_CAUSAL, roles={**{k: v for k, v in LLAMA_ROLES.items() if not k.startswith("mlp_")},
                                           "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
                         experts="mlp.experts", router="mlp.gate"),
    "gemma2": ArchMap(**_CAUSAL, roles=GEMMA_ROLES, norm_offset=1.0, float16=GEMMA_FLOAT16.format("Gemma 2"),
                      limits={"rotate": POST_NORMS.format("Gemma 2") + "; it also soft-caps attention and final "
                                                                     "logits"}),
    "gemma3_text": ArchMap(**_CAUSAL, roles={**GEMMA_ROLES, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
                           norm_offset=1.0, float16=GEMMA_FLOAT16.format("Gemma 3"),
                           limits={"rotate": POST_NORMS.format("Gemma 3")}),
    "olmo2": ArchMap(**_CAUSAL, roles={**{k: v for k, v in LLAMA_ROLES.items() if not k.endswith("_norm")},
                                       "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
                                       "attn_out_norm": "post_attention_layernorm",
                                       "mlp_out_norm": "post_feedforward_layernorm"},
                     limits={"rotate": "OLMo 2 has no pre-norms: it normalises each branch's output (post-norms) and "
                                       "all of q and k (q_norm/k_norm over every head), which a rotation of the "
                                       "residual stream does not commute with"}),
    # Granite: Llama blocks with scalar embedding, residual, attention and logit multipliers (rotations commute)
    "granite": ArchMap(**_CAUSAL, roles=LLAMA_ROLES),
    "phi3": ArchMap(**_CAUSAL, roles={"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj",
                                      "mlp_gate_up": "mlp.gate_up_proj", "mlp_down": "mlp.down_proj",
                                      "input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"},
                    limits={"rotate": "Phi-3 fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; the value-"
                                      "head rotation of the fused mode needs the value rows on their own",
                            "prune": "Phi-3 fuses q/k/v and gate/up projections; structured pruning slices them "
                                     "separately"}),
    # DeepSeek V2/V3 multi-head latent attention: q (or q_a/q_b low rank) and a shared kv_a / kv_b projection;
    # the first `first_k_dense_replace` blocks have a dense MLP, the others routed + shared experts
    "deepseek_v3": ArchMap(
        **_CAUSAL,
        roles={"q": "self_attn.q_proj", "q_a": "self_attn.q_a_proj", "kv_a": "self_attn.kv_a_proj_with_mqa",
               "o": "self_attn.o_proj", "mlp_gate": "mlp.gate_proj", "mlp_up": "mlp.up_proj", "mlp_down": "mlp.down_proj",
               "shared_gate": "mlp.shared_experts.gate_proj", "shared_up": "mlp.shared_experts.up_proj",
               "shared_down": "mlp.shared_experts.down_proj", "input_norm": "input_layernorm",
               "post_attn_norm": "post_attention_layernorm"},
        experts="mlp.experts", router="mlp.gate",
        optional=("q", "q_a", "mlp_gate", "mlp_up", "mlp_down", "shared_gate", "shared_up", "shared_down"),
        limits={"rotate": "multi-head latent attention: keys and values come out of `kv_b_proj` interleaved per "
                          "head, which the value-head rotation of the fused mode does not handle",
                "prune": "multi-head latent attention has no per-head q/k/v projections to slice"}),
    "bert": ArchMap(
        kind="encoder", blocks=("encoder.layer", "bert.encoder.layer"),
        embeddings=("embeddings", "bert.embeddings"),
        roles={"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
               "o": "attention.output.dense", "mlp_up": "intermediate.dense", "mlp_down": "output.dense",
               "input_norm": "attention.output.LayerNorm", "post_attn_norm": "output.LayerNorm"},
    ),
}


# Residual-stream plumbing of pre-norm decoders, by role (used by rotations, `compress.rotation`).
# A role not defined for an architecture is absent; a defined role whose module is missing is an error.
NORM_READERS = {
    "input_norm": ("q", "k", "v", "qkv", "q_a", "kv_a"),
    "post_attn_norm": ("mlp_gate", "mlp_up", "mlp_gate_up", "shared_gate", "shared_up", "shared_expert_gate"),
}
RESIDUAL_WRITERS = ("o", "mlp_down", "shared_down")
UP_DOWN = (("mlp_up", "mlp_down"), ("shared_up", "shared_down"))


class LinearExperts(nn.ModuleList):
    """Per-expert `nn.Linear` replacement for transformers' fused `*Experts` modules (same forward).

    A ModuleList, so experts are named `...experts.{e}.gate_proj` like per-expert checkpoints.
    """

    def __init__(self, fused: nn.Module):
        n_inter = fused.down_proj.shape[-1]
        experts = []
        for e in range(fused.num_experts):
            mlp = nn.Module()
            mlp.gate_proj = _linear(fused.gate_up_proj[e, :n_inter])
            mlp.up_proj = _linear(fused.gate_up_proj[e, n_inter:])
            mlp.down_proj = _linear(fused.down_proj[e])
            experts.append(mlp)
        super().__init__(experts)
        object.__setattr__(self, "act_fn", fused.act_fn)  # not a child: keep the list pure experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on the rows `x` (no routing weight)."""
        mlp = self[e]
        return mlp.down_proj(self.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(len(self)):
            token_idx, k_pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            h = self.expert(e, hidden_states[token_idx])
            out.index_add_(0, token_idx, (h * top_k_weights[token_idx, k_pos, None]).to(out.dtype))
        return out


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    lin.weight.data.copy_(weight.data)
    return lin


def get_module(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _first(model: nn.Module, paths: tuple[str, ...]) -> tuple[str, nn.Module] | tuple[None, None]:
    for p in paths:
        m = get_module(model, p)
        if m is not None:
            return p, m
    return None, None


class ModelAdapter:
    """Roles of one loaded model. Block linears are addressed by full module names."""

    def __init__(self, model: nn.Module):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in ARCHS:
            raise BadInput(
                f"unsupported architecture `{model_type}`; supported: {', '.join(sorted(ARCHS))}"
            )
        self.model = model
        self.model_type = model_type
        self.arch = ARCHS[model_type]
        self.blocks_path, self._blocks = _first(model, self.arch.blocks)
        if self._blocks is None:
            raise BadInput(f"`{model_type}` model has none of the block lists {self.arch.blocks}")
        if self.arch.experts:
            self._linearize_experts()

    @property
    def kind(self) -> str:
        return self.arch.kind

    @property
    def blocks(self) -> nn.ModuleList:
        return self._blocks

    def block_name(self, i: int) -> str:
        return f"{self.blocks_path}.{i}"

    def embeddings(self) -> nn.Module:
        return _first(self.model, self.arch.embeddings)[1]

    def final_norm(self) -> nn.Module | None:
        return _first(self.model, self.arch.final_norm)[1]

    def lm_head(self) -> tuple[str | None, nn.Module | None]:
        return _first(self.model, self.arch.lm_head)

    def role(self, i: int, role: str) -> nn.Module | None:
        path = self.arch.roles.get(role)
        return get_module(self.blocks[i], path) if path else None

    def experts(self, i: int) -> LinearExperts | None:
        return get_module(self.blocks[i], self.arch.experts) if self.arch.experts else None

    def router(self, i: int) -> nn.Module | None:
        return get_module(self.blocks[i], self.arch.router) if self.arch.router else None

    def refuse(self, feature: str, what: str) -> None:
        """BadInput naming why `what` (a stage) cannot run on this architecture, if its map limits `feature`."""
        why = self.arch.limits.get(feature)
        if why:
            raise BadInput(f"{what} does not apply to `{self.model_type}`: {why}")

    def attention_shape(self) -> tuple[int, int, int]:
        """(num_attention_heads, num_key_value_heads, head_dim) from the model config."""
        c = self.model.config
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or getattr(c, "qk_head_dim", None) or c.hidden_size // heads
        return heads, kv, head_dim

    def _roles(self, i: int, names) -> list[nn.Module]:
        out = []
        for r in names:
            if r in self.arch.roles:
                m = self.role(i, r)
                if m is None and r in self.arch.optional:
                    continue
                if m is None:
                    raise BadInput(f"block {i} of `{self.model_type}` has no module at role `{r}` "
                                   f"({self.arch.roles[r]})")
                out.append(m)
        return out

    def norm_readers(self, i: int, norm_role: str) -> list[nn.Module]:
        """Every module of block i whose `.weight` (out, hidden) multiplies the output of `norm_role`:
        attention projections, or the MLP inputs incl. router, every expert and shared expert(s)."""
        mods = self._roles(i, NORM_READERS[norm_role])
        if norm_role == "post_attn_norm":
            if self.router(i) is not None:  # MoE blocks (DeepSeek's first blocks are dense)
                mods.append(self.router(i))
            for e in self.experts(i) or ():
                mods += [e.gate_proj, e.up_proj]
        return mods

    def residual_writers(self, i: int) -> list[nn.Module]:
        """Every linear of block i whose output is added to the residual stream (o, down, experts' down)."""
        return self._roles(i, RESIDUAL_WRITERS) + [e.down_proj for e in self.experts(i) or ()]

    def up_down_pairs(self, i: int) -> list[tuple[nn.Linear, nn.Linear]]:
        """(up, down) of every gated MLP in block i: `down(act(gate(x)) * up(x))` is linear in up's rows."""
        pairs = [tuple(self._roles(i, pair)) for pair in UP_DOWN if pair[0] in self.arch.roles]
        pairs = [p for p in pairs if len(p) == 2]  # optional roles a block lacks (DeepSeek's MoE vs dense blocks)
        return pairs + [(e.up_proj, e.down_proj) for e in self.experts(i) or ()]

    def block_linears(self, i: int) -> dict[str, nn.Linear]:
        """Every quantizable nn.Linear of block i (routers and scalar gates excluded), full names."""
        skip = {id(self.role(i, r)) for r in self.arch.not_quantized}
        prefix = self.block_name(i)
        return {
            f"{prefix}.{n}": m
            for n, m in self.blocks[i].named_modules()
            if isinstance(m, nn.Linear) and id(m) not in skip
        }

    def _linearize_experts(self) -> None:
        for blk in self.blocks:
            parent_path, _, leaf = self.arch.experts.rpartition(".")
            parent = get_module(blk, parent_path) if parent_path else blk
            fused = getattr(parent, leaf, None) if parent is not None else None
            if fused is not None and hasattr(fused, "gate_up_proj"):
                setattr(parent, leaf, LinearExperts(fused))


def accepts_use_cache(model) -> bool:
    """Whether the model's forward takes `use_cache` (decoders do; BERT encoders do not)."""
    return getattr(model.config, "is_decoder", True) and getattr(model.config, "model_type", "") != "bert"
