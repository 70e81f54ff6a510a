"""Which model families the GGUF export writes, and how: llama.cpp's architecture name, the hyperparameters it
reads, the tensor names (`gguf`'s own name map) and the q/k layout.

The families are those whose llama.cpp conversion (`convert_hf_to_gguf.py`, `conversion/llama.py`, `qwen.py`) is a
renaming plus, for llama and mistral, llama.cpp's interleaved rotary layout: q and k rows permuted per head
(`permute`), which moves whole rows, so a quantized weight's codes and scales move with them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.errors import BadInput


@dataclass(frozen=True)
class Family:
    arch: str  # llama.cpp's general.architecture
    permute_qk: bool  # HF's rotate-half -> llama.cpp's interleaved rotary layout


FAMILIES = {
    "llama": Family("llama", True),
    "mistral": Family("llama", True),
    "qwen2": Family("qwen2", False),
    "qwen3": Family("qwen3", False),
}


def family(config) -> Family:
    f = FAMILIES.get(config.model_type)
    if f is None:
        raise BadInput(f"the GGUF export writes {', '.join(sorted(FAMILIES))}; `{config.model_type}` is not one of "
                       "them yet: drop `gguf` from export.formats")
    if getattr(config, "rope_scaling", None) and (config.rope_scaling or {}).get("rope_type") not in (None, "default"):
        raise BadInput(f"the GGUF export does not write rope scaling `{config.rope_scaling.get('rope_type')}` yet")
    return f


def hparams(writer, config, fam: Family) -> None:
    """The hyperparameters llama.cpp reads for `fam` (convert_hf_to_gguf.py's TextModel.set_gguf_parameters)."""
    heads = config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta", None)
    if rope is not None:
        writer.add_rope_freq_base(float(rope))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if fam.arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim or config.hidden_size // heads)


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
