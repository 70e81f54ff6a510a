"""bench/gemma3.py: the Gemma-3-270M config check against its GGUF metadata (no model, no network)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.gemma3 import PUBLISHED, expected_config, fix_config, gguf_metadata

# the metadata of gemma-3-270m-q4_k_m.gguf (sha256 a5fd3b62...), as gguf_metadata reads it
META = {
    "general.architecture": "gemma3", "gemma3.context_length": 32768, "gemma3.embedding_length": 640,
    "gemma3.block_count": 18, "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count": 4,
    "gemma3.attention.layer_norm_rms_epsilon": 9.999999974752427e-07, "gemma3.attention.key_length": 256,
    "gemma3.attention.value_length": 256, "gemma3.rope.freq_base": 1000000.0, "gemma3.attention.sliding_window": 512,
    "gemma3.attention.head_count_kv": 1, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0, "vocab_size": 262144,
    "has_output": False,
}


def _as_written() -> dict:
    """config.json as transformers 5.25's GGUF loader writes it for that file."""
    cfg = {k: v for k, v in expected_config(META).items()}
    cfg.update({"_model_name_or_path": "Gemma 3 270m", "rms_norm_eps": 9.999999974752427e-07, "dtype": "float32",
                "_sliding_window_pattern": 6, "initializer_range": 0.02, "use_cache": True, "unk_token_id": 3,
                "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": False})
    return cfg


def test_expected_config_is_the_published_one():
    exp = expected_config(META)
    for key, want in PUBLISHED.items():
        if key in exp:
            assert exp[key] == want, key
    assert exp["layer_types"].count("full_attention") == 3
    assert [i for i, t in enumerate(exp["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert exp["model_type"] == "gemma3_text" and exp["architectures"] == ["Gemma3ForCausalLM"]


def test_what_transformers_writes_gets_cosmetic_fixes_only():
    cfg, changes = fix_config(_as_written(), META)
    assert cfg["rms_norm_eps"] == 1e-6 and "_model_name_or_path" not in cfg
    assert len(changes) == 2, changes
    assert cfg["unk_token_id"] == 3 and cfg["dtype"] == "float32"  # the rest is kept
    again, none = fix_config(cfg, META)
    assert again == cfg and none == []


def test_misread_fields_are_rewritten_from_the_gguf():
    bad = _as_written()
    bad.update({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                "query_pre_attn_scalar": 224, "sliding_window": 4096, "final_logit_softcapping": 30.0,
                "tie_word_embeddings": False, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                "layer_types": ["sliding_attention"] * 18})
    cfg, changes = fix_config(bad, META)
    want, _ = fix_config(_as_written(), META)
    assert cfg == want
    fixed = {line.split(":")[0] for line in changes}
    assert {"model_type", "architectures", "query_pre_attn_scalar", "sliding_window", "final_logit_softcapping",
            "tie_word_embeddings", "rope_theta", "rope_local_base_freq", "rope_parameters", "layer_types"} <= fixed


def test_another_size_is_refused_against_the_published_config():
    other = dict(META, **{"gemma3.embedding_length": 1152, "gemma3.block_count": 26})
    cfg = _as_written()
    with pytest.raises(ValueError, match="hidden_size 1152"):
        fix_config(cfg, other)
    out, _ = fix_config(cfg, other, published=None)
    assert out["hidden_size"] == 1152 and len(out["layer_types"]) == 26 and out["layer_types"][5] == "full_attention"
    with pytest.raises(ValueError, match="not a gemma3 GGUF"):
        fix_config(cfg, dict(META, **{"general.architecture": "llama"}))


def test_gguf_metadata_reads_a_written_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(32768)
    w.add_embedding_length(640)
    w.add_block_count(18)
    w.add_feed_forward_length(2048)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(512)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_token_list(["<pad>", "<eos>", "<bos>", "a"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = gguf_metadata(path)
    assert meta["vocab_size"] == 4 and meta["has_output"] is False
    assert meta["gemma3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6) and meta["gemma3.block_count"] == 18
    exp = expected_config(meta)
    assert exp["rms_norm_eps"] == 1e-6 and exp["tie_word_embeddings"] is True and exp["pad_token_id"] == 0
    assert exp["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
