"""ONNX through the ONNX Runtime GenAI model builder, for the families the hand-written graph does not write.

`export_genai(model, qweights, tokenizer, out_dir)` writes our quantized weights as a GPTQ checkpoint in a
temporary directory and runs `onnxruntime_genai.models.builder.create_model` on it (docs/formats.md#onnx-genai).
The builder's GPTQ loader (onnxruntime-genai 0.18) unpacks `qweight`/`qzeros`/`scales`/`g_idx`, with zero
points stored minus one (GPTQ v1; it adds one back modulo 2^b, so an asymmetric zero point of 0 round-trips),
and repacks them as MatMulNBits with the checkpoint's bits (2, 4 or 8) and block size: our codes and scales
survive bit for bit. Per-layer schemes go in GPTQModel's `dynamic` (`+:^<layer>[.]` prefixes of the tensor
names). Options: `accuracy_level=1` (fp32 compute; the default 4 quantizes activations to int8),
`shared_embeddings=false` and, unless we quantized it, `nodes_to_exclude=/lm_head/MatMul` (the builder would
round the float head and a tied embedding to int4 itself). The result is a directory `onnxruntime_genai.Model`
runs (model.onnx with GroupQueryAttention and a KV cache, genai_config.json, the tokenizer files).

What it cannot take: a linear inside a block left unquantized (the build fails), 3-bit or mixed-precision
layers, Phi-3 with long-RoPE scaling (`original_max_position_embeddings` differing from
`max_position_embeddings`), and families it has no builder for here (olmo2; gemma3, whose per-layer-type rope
parameters its builder does not read): `why_not` says so at plan time. Gemma 2's sliding-window attention runs
only when the generator's `max_length` (its KV cache capacity) is at least `sliding_window`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from compress.export.layouts import gptq_config
from compress.kernels.packing import gptq_pack
from compress.qweight import QuantizedWeight

FORMAT, FORMAT_VERSION = "onnx-genai", 1
BUILDER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "gemma2")
BITS = (2, 4, 8)
OPTIONS = ["accuracy_level=1", "shared_embeddings=false"]


def why_not(config, schemes) -> str | None:
    """Why the builder cannot write this model (`schemes`: (name, bits, group, loadable by hf) of every quantized
    layer), or None."""
    if not schemes:
        return "no quantized layers (the builder path writes a quantize stage's checkpoint)"
    if config.model_type not in BUILDER_TYPES:
        return f"the ONNX Runtime GenAI builder path covers {', '.join(BUILDER_TYPES)}, not `{config.model_type}`"
    if config.model_type == "phi3" and getattr(config, "original_max_position_embeddings", None) not in (
            None, config.max_position_embeddings):
        return "Phi-3 with long-RoPE scaling (original_max_position_embeddings != max_position_embeddings)"
    odd = [n for n, bits, _, _ in schemes if bits not in BITS]
    if odd:
        return f"{len(odd)} layers have bit widths the builder does not read (it takes {BITS}), e.g. `{odd[0]}`"
    dense = [n for n, _, _, packed in schemes if not packed]
    if dense:
        return (f"{len(dense)} quantized layers cannot be stored packed (widths not multiples of 32, e.g. "
                f"`{dense[0]}`) and the builder fails on a float linear inside a block")
    return None


def export_genai(model, qweights: dict[str, QuantizedWeight], tokenizer, out_dir, meta: dict | None = None) -> dict:
    from compress.export.hf import loadable
    from compress.files import staged_directory

    schemes = [(n, q.bits, q.group_size, loadable(q)) for n, q in qweights.items()]
    if any(q.mixed for q in qweights.values()):
        raise ValueError("the GenAI builder path cannot hold mixed-precision layers")
    why = why_not(model.config, schemes)
    if why:
        raise ValueError(why)
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="genai-") as tmp, \
            staged_directory(out_dir, marker="genai_config.json") as dst:
        stage = Path(tmp) / "gptq"
        _write_gptq(model, qweights, tokenizer, stage)
        _build(stage, dst, Path(tmp) / "cache", head_quantized=any(n == "lm_head" for n in qweights))
        (dst / "compress.json").write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION,
                                                       "meta": meta or {}}, indent=2) + "\n")
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {"path": str(out_dir), "files": [str(p) for p in files], "bytes": sum(p.stat().st_size for p in files),
            "dense_layers": 0}


def _write_gptq(model, qweights: dict[str, QuantizedWeight], tokenizer, stage: Path) -> None:
    """The model with every quantized layer packed GPTQ v1 (`g_idx` included), and its quantization_config."""
    sd = model.state_dict()
    for name, qw in qweights.items():
        del sd[f"{name}.weight"]
        sd.update({f"{name}.{k}": v.cpu() for k, v in gptq_pack(qw, v1=True).items()})
    model.save_pretrained(stage, state_dict=sd)
    qc = gptq_config(qweights)
    path = stage / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = qc
    path.write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)


def _build(stage: Path, out: Path, cache: Path, head_quantized: bool) -> None:
    import contextlib
    import io
    import logging

    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    options = OPTIONS + ([] if head_quantized else ["nodes_to_exclude=/lm_head/MatMul"])
    quiet = logging.getLogger("onnxruntime")
    level, quiet.level = quiet.level, logging.WARNING  # its quantizer logs every node it skips
    try:  # the builder prints its progress and draws bars of its own
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            opts = parse_extra_options(None, str(stage), str(out), "int4", "cpu", str(cache), options)
            create_model(None, str(stage), str(out), "int4", "cpu", str(cache), **opts)
    finally:
        quiet.level = level
