"""Tiny models built from configs (plumbing tests only; quality is measured on real models)."""

import torch
import transformers as T

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the families whose defaults lie outside tiny vocabularies


FAMILIES = {  # model_type -> its tiny config from the shared sizes
    "llama": lambda common: T.LlamaConfig(**common),
    "mistral": lambda common: T.MistralConfig(**common),
    "qwen2": lambda common: T.Qwen2Config(**common),
    "qwen3": lambda common: T.Qwen3Config(**common, head_dim=16),
    "qwen2_moe": lambda common: T.Qwen2MoeConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                  num_experts=4, num_experts_per_tok=2),
    "mixtral": lambda common: T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda common: T.Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2),
    "gemma2": lambda common: T.Gemma2Config(**common, head_dim=16, **IDS),
    "gemma3_text": lambda common: T.Gemma3TextConfig(**common, head_dim=16, **IDS),
    "phi3": lambda common: T.Phi3Config(**common, **IDS),
    "olmo2": lambda common: T.Olmo2Config(**common, **IDS),
    "granite": lambda common: T.GraniteConfig(**common, embedding_multiplier=2.0, residual_multiplier=0.5,
                               attention_multiplier=0.2, logits_scaling=3.0),
    # DeepSeek-style multi-head latent attention; block 0 a dense MLP, block 1 routed + shared experts
    "deepseek_v3": lambda common: T.DeepseekV3Config(**{**common, "num_key_value_heads": common["num_attention_heads"]},
                                      moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                      n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                                      kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                      n_group=2, topk_group=1, **IDS),
}


def configs(**overrides):
    """{model_type: its tiny config} of every family (`overrides` applied to each)."""
    return {t: config_of(t, **overrides) for t in FAMILIES}


def config_of(model_type: str, **overrides):
    return FAMILIES[model_type]({**COMMON, **overrides})


def tiny_causal(model_type: str, seed: int = 0, dtype=torch.float32, init_std: float | None = 0.05, **config):
    """A `model_type` model with matrices N(0, init_std) (None: the architecture's own initialisation);
    `config` overrides the shared sizes (hidden_size, ...) and flags (tie_word_embeddings, attention_bias, ...)."""
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config_of(model_type, **config)).to(dtype).eval()
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, init_std)
    return model


def tiny_bert(seed: int = 0):
    torch.manual_seed(seed)
    cfg = T.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=128, max_position_embeddings=128)
    return T.BertModel(cfg).eval()


def tiny_llama(seed: int = 0, **config):
    """tiny_causal's llama with the architecture's own initialisation and 64 positions (the export and rotation
    tests' tolerances were set on it)."""
    return tiny_causal("llama", seed, init_std=None, max_position_embeddings=64, **config)


def save_tiny(model_type: str, path, seed: int = 0, **config):
    """A tiny model directory with stories260K's tokenizer (vocabulary 512), for recipe runs."""
    import shutil

    from conftest import MODELS

    tiny_causal(model_type, seed, vocab_size=512, **config).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(MODELS / "stories260K" / f, path)
    return path
