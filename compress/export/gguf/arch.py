"""Which model families the GGUF export writes, and how: llama.cpp's architecture name, the hyperparameters it
reads, the tensor names (`gguf`'s own name map) and the transforms llama.cpp's `convert_hf_to_gguf.py` applies
(the environment's copy of llama-cpp-python 0.3.36's converter: `conversion/llama.py`, `qwen.py`, `gemma.py`,
`phi.py`, `granite.py`, `olmo.py`, `base.py`):

- llama, mistral, mixtral, granite: q and k rows permuted per head into llama.cpp's interleaved rotary layout
  (`LlamaModel.permute`), which moves whole rows, so a quantized weight's codes and scales move with them exactly;
- gemma2, gemma3: the RMSNorm weights stored as `1 + weight` (HF's Gemma RMSNorm scales by it), no `output` tensor
  in gemma2 (the embeddings are the output);
- phi3: `qkv_proj` and `gate_up_proj` stay fused (`attn_qkv`, `ffn_up` with gate and up rows);
- MoE (mixtral, qwen2_moe, qwen3_moe): each layer's experts stacked into 3-D `ffn_{gate,up,down}_exps` tensors
  (experts, rows, columns), the router `ffn_gate_inp` (never quantized), qwen2_moe's shared expert `*_shexp` and its
  gate `ffn_gate_inp_shexp`. Experts come as transformers 5's fused 3-D parameters (`mlp.experts.gate_up_proj`,
  `down_proj`) or as compress's per-expert linears (`mlp.experts.{e}.gate_proj`, compress/models/adapters.py).

`layout(model)` lists the file's tensors, each with the parts of the model's state it is made of.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from compress.errors import BadInput


@dataclass(frozen=True)
class Family:
    arch: str  # llama.cpp's general.architecture
    permute_qk: bool = False  # HF's rotate-half -> llama.cpp's interleaved rotary layout
    norm_shift: bool = False  # Gemma: llama.cpp stores RMSNorm weights as 1 + weight
    output: bool = True  # False: llama.cpp has no output tensor (the token embeddings are the output)
    experts: str | None = None  # the config attribute of the routed expert count (MoE families)


FAMILIES = {
    "llama": Family("llama", permute_qk=True),
    "mistral": Family("llama", permute_qk=True),
    "mixtral": Family("llama", permute_qk=True, experts="num_local_experts"),
    "granite": Family("granite", permute_qk=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "qwen2_moe": Family("qwen2moe", experts="num_experts"),
    "qwen3_moe": Family("qwen3moe", experts="num_experts"),
    "gemma2": Family("gemma2", norm_shift=True, output=False),
    "gemma3_text": Family("gemma3", norm_shift=True),
    "phi3": Family("phi3"),
    "olmo2": Family("olmo2"),
}


def _rope(config) -> dict:
    """{layer type or "": rope parameters} (transformers 5 nests them per layer type for Gemma 3)."""
    p = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if p and all(isinstance(v, dict) for v in p.values()):
        return dict(p)
    return {"": {"rope_theta": getattr(config, "rope_theta", None), **p}}


def rope_theta(config, kind: str = "full_attention"):
    p = _rope(config)
    return (p.get(kind) or p.get("") or {}).get("rope_theta")


def n_experts(config, fam: Family) -> int:
    return int(getattr(config, fam.experts, 0) or 0) if fam.experts else 0


def family(config) -> Family:
    """The family of `config`, or BadInput where llama.cpp would not compute what transformers does."""
    mt = config.model_type
    f = FAMILIES.get(mt)
    if f is None:
        raise BadInput(f"the GGUF export writes {', '.join(sorted(FAMILIES))}; `{mt}` is not one of "
                       "them yet: drop `gguf` from export.formats")
    for p in _rope(config).values():
        if (p or {}).get("rope_type") not in (None, "default"):
            raise BadInput(f"the GGUF export does not write rope scaling `{p.get('rope_type')}` yet")
    n_layer, heads = config.num_hidden_layers, config.num_attention_heads
    why = None
    if mt in ("gemma2", "gemma3_text"):
        # llama.cpp: 1/sqrt(head_dim) except the 27B models (1/sqrt(hidden / heads)); swa layers on a fixed pattern
        big = n_layer == (46 if mt == "gemma2" else 62)
        scale = config.hidden_size // heads if big else config.head_dim
        pattern = 2 if mt == "gemma2" else 6
        swa = ["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(n_layer)]
        if config.query_pre_attn_scalar != scale:
            why = (f"query_pre_attn_scalar {config.query_pre_attn_scalar}: llama.cpp scales attention by "
                   f"1/sqrt({scale})")
        elif list(getattr(config, "layer_types", None) or swa) != swa:
            why = f"layer_types other than llama.cpp's fixed pattern (every {pattern}th layer global)"
        elif mt == "gemma2" and rope_theta(config) not in (None, 10000.0):
            why = "a rope_theta other than 10000 (llama.cpp's converter does not write Gemma 2's)"
        elif mt == "gemma3_text" and rope_theta(config, "sliding_attention") not in (None, 10000.0):
            why = "a local rope_theta other than 10000 (llama.cpp's is fixed)"
        elif getattr(config, "attn_logit_softcapping", None) and mt == "gemma3_text":
            why = "attention logit soft-capping (llama.cpp's gemma3 has none)"
        elif mt == "gemma2" and not getattr(config, "tie_word_embeddings", True):
            why = "an LM head apart from the embeddings (llama.cpp's gemma2 has no output tensor)"
    elif mt == "granite" and (getattr(config, "head_dim", None) or config.hidden_size // heads) \
            != config.hidden_size // heads:
        why = "head_dim other than hidden_size / heads (llama.cpp's converter drops it)"
    elif f.experts:
        sparse = getattr(config, "decoder_sparse_step", 1) or 1
        if sparse != 1 or getattr(config, "mlp_only_layers", None):
            why = "dense layers among the MoE ones (decoder_sparse_step, mlp_only_layers)"
        norm = {"qwen2_moe": False, "qwen3_moe": True}.get(mt)
        if norm is not None and bool(getattr(config, "norm_topk_prob", norm)) != norm:
            why = (f"norm_topk_prob: {not norm} (llama.cpp's {f.arch} {'always' if norm else 'never'} renormalises "
                   "the top-k routing weights)")
    if why:
        raise BadInput(f"the GGUF export cannot write this `{mt}`: {why}; llama.cpp would compute another model. "
                       "Drop `gguf` from export.formats")
    return f


def hparams(writer, config, fam: Family) -> None:
    """The hyperparameters llama.cpp reads for `fam`, as convert_hf_to_gguf.py's set_gguf_parameters writes them
    (TextModel's generic keys plus each family's own)."""
    mt = config.model_type
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    theta = rope_theta(config)
    if theta is not None and mt != "gemma2":  # Gemma2Model.set_gguf_parameters writes no rope base
        writer.add_rope_freq_base(float(theta))
    if mt == "gemma3_text" and (local := rope_theta(config, "sliding_attention")) is not None:
        writer.add_rope_freq_base_swa(float(local))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if head_dim is not None and mt != "granite":  # GraniteModel drops head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if fam.experts:
        writer.add_expert_count(n_experts(config, fam))
        writer.add_expert_used_count(config.num_experts_per_tok)
    if mt in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None) is not None:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if fam.arch in ("llama", "granite"):
        writer.add_vocab_size(config.vocab_size)
        rope_dim = head_dim if mt != "granite" and head_dim else config.hidden_size // heads
        writer.add_rope_dimension_count(rope_dim)
    if mt == "granite":
        for key, add in (("attention_multiplier", writer.add_attention_scale),
                         ("embedding_multiplier", writer.add_embedding_scale),
                         ("residual_multiplier", writer.add_residual_scale),
                         ("logits_scaling", writer.add_logit_scale)):
            if value := getattr(config, key, None):
                add(float(value))
    if mt == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if mt == "gemma3_text":
        if cap := getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(cap)
        writer.add_sliding_window(config.sliding_window)
    if mt == "phi3":
        rope = _rope(config)[""]
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        rot = float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
        writer.add_rope_dimension_count(int(rot * config.hidden_size) // heads)
        writer.add_sliding_window(getattr(config, "sliding_window", None) or 0)


def permutation(name: str, config, fam: Family, rows: int) -> torch.Tensor | None:
    """The row order llama.cpp's layout gives q_proj / k_proj (LlamaModel.permute), or None."""
    if not fam.permute_qk:
        return None
    heads = config.num_attention_heads
    if name.endswith("self_attn.q_proj"):
        n = heads
    elif name.endswith("self_attn.k_proj"):
        n = getattr(config, "num_key_value_heads", None) or heads
    else:
        return None
    return torch.arange(rows).reshape(n, 2, rows // n // 2).transpose(1, 2).reshape(rows)


def tensor_name(name: str, arch: str, n_blocks: int) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight` (gguf's name map)."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    mapped = gguf.get_tensor_name_map(arch_id, n_blocks).get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise BadInput(f"the GGUF export has no llama.cpp name for tensor `{name}`")
    return mapped


@dataclass
class Part:
    """A 2-D piece of a file tensor: `index` into the model's state tensor `source` (() for all of it)."""

    source: str  # state_dict key
    index: tuple = ()
    shape: tuple[int, ...] = ()

    @property
    def layer(self) -> str:  # the module whose weight it is (a per-expert linear's name for stacked experts)
        return self.source.removesuffix(".weight")


@dataclass
class FileTensor:
    name: str  # the GGUF name
    shape: tuple[int, ...]  # torch order: (rows, ne0) or (experts, rows, ne0)
    parts: list[Part] = field(default_factory=list)  # one, or one per expert (stacked on a new first axis)


# transformers 5's fused expert parameters and compress's per-expert linears
_FUSED = re.compile(r"^(?P<p>.*\.experts)\.(?P<w>gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight$")


def layout(model) -> tuple[Family, list[FileTensor]]:
    """The tensors of the GGUF file of `model` in file order (each at its first source's place in the state)."""
    config = model.config
    fam = family(config)
    n = config.num_hidden_layers
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out: dict[str, FileTensor] = {}

    def add(hf_name: str, part: Part, shape: tuple[int, ...], stacked: int = 0):
        g = tensor_name(hf_name, fam.arch, n)
        t = out.get(g)
        if t is None:
            t = out[g] = FileTensor(g, ((stacked,) if stacked else ()) + shape)
        t.parts.append(part)

    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and (tied or not fam.output):
            continue
        shape = tuple(t.shape)
        if m := _FUSED.match(name):
            e = shape[0]
            if m["w"] == "down_proj":
                for i in range(e):
                    add(f"{m['p']}.down_proj.weight", Part(name, (i,), shape[1:]), shape[1:], e)
            else:
                ff = shape[1] // 2
                for w, rows in (("gate_proj", slice(0, ff)), ("up_proj", slice(ff, 2 * ff))):
                    for i in range(e):
                        add(f"{m['p']}.{w}.weight", Part(name, (i, rows), (ff, shape[2])), (ff, shape[2]), e)
        elif m := _EXPERT.match(name):
            add(f"{m['p']}.{m['w']}.weight", Part(name, (), shape), shape, n_experts(config, fam))
        elif name.endswith("mlp.shared_expert_gate.weight") and shape[0] == 1:
            add(name, Part(name, (), shape[1:]), shape[1:])  # (1, hidden) -> (hidden,), as llama.cpp reads it
        else:
            add(name, Part(name, (), shape), shape)
    for t in out.values():
        if len(t.shape) == 3 and len(t.parts) != t.shape[0]:
            raise BadInput(f"`{t.name}` has {len(t.parts)} experts, the config {t.shape[0]}")
    return fam, list(out.values())


def part_tensor(state: dict, part: Part) -> torch.Tensor:
    t = state[part.source]
    return (t[part.index] if part.index else t).reshape(part.shape)
