"""The `compressed-tensors` export (docs/formats.md#w8a8-int8, #fp8): a checkpoint in the format vLLM reads first
and transformers loads through the `compressed-tensors` library, carrying the activation quantization of a scheme.

`w8a8-int8` is written as compressed-tensors' `int-quantized` format: each quantized linear's `weight` is int8 (the
code minus 128: compress's symmetric 8-bit grid has its zero point at 128, so the values are exactly the ones the
run evaluated), `weight_scale` its (d_out, 1) per-channel scales in the export dtype, and one `config_groups` group
per activation setting naming its layers, with `input_activations` int8 per token, dynamic, or (`activations:
static`) int8 per tensor with each layer's calibrated `input_scale` (shape (1,), the export dtype). Unquantized tensors
(embeddings, norms, the LM head) are in the export dtype, a tied head stays tied.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from compress.export.hf import DTYPES, FORMAT_VERSION, MAX_SHARD, _cast, _patch_config
from compress.files import staged_directory
from compress.qweight import QuantizedWeight
from compress.quantize.activations import ActivationSpec

FORMATS = {"int": "int-quantized", "float": "float-quantized"}  # compressed-tensors' format of each weight type


def check_layer(name: str, qw) -> str | None:
    """Why `name` (a LayerSpec or a QuantizedWeight) cannot be written as an 8-bit per-channel layer, int8 or FP8
    E4M3 (None: it can)."""
    if qw.bits != 8 or qw.group_size != -1 or not qw.sym or getattr(qw, "fp", None) not in (None, "e4m3"):
        return (f"`{name}` is {qw.bits}-bit, group {qw.group_size}, {'sym' if qw.sym else 'asym'}: this export writes "
                "8-bit per-channel symmetric weights (`scheme: w8a8-int8` or `scheme: fp8`)")
    return None


def stored_weight(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight (d_out, d_in): int8, or float8_e4m3fn for an fp8 weight; scale (d_out, 1)) with weight * scale ==
    qw.dequantize()."""
    if (why := check_layer("layer", qw)) is not None or qw.mixed or qw.grid is not None:
        raise ValueError(why or "a mixed-precision or llama.cpp-grid weight is not an 8-bit per-channel layer")
    if qw.fp is not None:
        return qw.codes.view(torch.float8_e4m3fn), qw.scales.reshape(-1, 1)
    if not bool((qw.zeros == 128).all()):
        raise ValueError("a symmetric 8-bit weight has its zero point at 128")
    return (qw.codes.to(torch.int16) - 128).to(torch.int8), qw.scales.reshape(-1, 1)


def quantization_config(acts: dict[str, ActivationSpec], ignore: list[str]) -> dict:
    """One `config_groups` group per activation setting (static layers share one: their scales are tensors); the
    weights have the activations' element type (int8 with int8, E4M3 with E4M3: one scheme per run)."""
    groups = {}
    settings = {n: replace(s, scale=None) for n, s in acts.items()}  # a static layer's own scale is a tensor
    for setting in dict.fromkeys(settings.values()):
        groups[f"group_{len(groups)}"] = {
            "targets": sorted(n for n, s in settings.items() if s == setting),
            "weights": {"num_bits": 8, "type": setting.type, "symmetric": True, "strategy": "channel",
                        "dynamic": False},
            "input_activations": setting.as_compressed_tensors()}
    types = {s.type for s in settings.values()}
    if len(types) > 1:
        raise ValueError(f"one scheme per checkpoint: activations of types {sorted(types)}")
    return {"quant_method": "compressed-tensors", "format": FORMATS[types.pop() if types else "int"],
            "quantization_status": "compressed", "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None}


def export_compressed_tensors(model, qweights: dict[str, QuantizedWeight], acts: dict[str, ActivationSpec],
                              tokenizer, out_dir, *, dtype: str = "float16", meta: dict | None = None) -> dict:
    """Write `model` (its quantized linears holding `qw.dequantize()`) with `qweights` as int8 / FP8 and the activation
    settings `acts` ({layer: spec}, every quantized layer) to `out_dir`; returns files, bytes, dtype."""
    missing = sorted(set(qweights) - set(acts))
    if missing:
        raise ValueError(f"layers quantized without an activation scheme: {missing[:3]}")
    state = _cast(model.state_dict(), DTYPES[dtype])
    for name, qw in qweights.items():
        if (qw.fp is not None) != (acts[name].type == "float"):
            raise ValueError(f"`{name}`: {qw.fp or 'int8'} weights with {acts[name].type} activations")
        w, s = stored_weight(qw)
        state[f"{name}.weight"] = w
        state[f"{name}.weight_scale"] = s.to(DTYPES[dtype])
        if not acts[name].dynamic:  # a static input scale, calibrated (already a value of `dtype`)
            state[f"{name}.input_scale"] = torch.tensor([acts[name].scale], dtype=DTYPES[dtype])
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ignore = [n for n in linears if n not in qweights]
    out_dir = Path(out_dir)
    with staged_directory(out_dir, marker="config.json") as tmp:
        model.save_pretrained(tmp, state_dict=state, max_shard_size=MAX_SHARD)
        _patch_config(tmp, {"quantization_config": quantization_config(acts, ignore), "dtype": dtype,
                            "compress": {"format": "compressed-tensors", "version": FORMAT_VERSION,
                                         "meta": meta or {}}})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {"files": [str(p) for p in files], "bytes": sum(p.stat().st_size for p in files), "dtype": dtype,
            "format": quantization_config(acts, [])["format"], "layers": len(qweights)}
