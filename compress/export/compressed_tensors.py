"""The `compressed-tensors` export (docs/formats.md#w8a8-int8, #fp8): a checkpoint in the format vLLM reads first
and transformers loads through the `compressed-tensors` library, carrying the activation quantization of a scheme.

`w8a8-int8` is written as compressed-tensors' `int-quantized` format: each quantized linear's `weight` is int8 (the
code minus 128: compress's symmetric 8-bit grid has its zero point at 128, so the values are exactly the ones the
run evaluated), `weight_scale` its (d_out, 1) per-channel scales in float32 (exact whatever the export dtype: a
bfloat16 one would round compress's fp16 scales; vLLM holds them in float32), and one `config_groups` group
per activation setting naming its layers, with `input_activations` int8 per token, dynamic, or (`activations:
static`) int8 per tensor with each layer's calibrated `input_scale` (shape (1,), the export dtype). Unquantized tensors
(embeddings, norms, the LM head) are in the export dtype, a tied head stays tied.

`fp8` is written as `float-quantized`: each `weight` is `float8_e4m3fn` (the very bit patterns the run evaluated),
`weight_scale` (d_out, 1) in float32, weights and activations `type: float` (llm-compressor's `FP8_DYNAMIC`
preset; static: its `FP8` one, with `input_scale`). `fp8-block` (its `FP8_BLOCK`): `weight_scale` (ceil(d_out / 128),
d_in / 128) float32, weights `strategy: block, block_structure: [128, 128]`, activations `strategy: group,
group_size: 128`, dynamic.

`nvfp4a16` is written as `nvfp4-pack-quantized` (llm-compressor's `NVFP4A16` preset): `weight_packed` uint8 (d_out,
d_in / 2), two E2M1 codes a byte (the first column in the low nibble), `weight_scale` float8_e4m3fn (d_out, d_in /
16), `weight_global_scale` fp32 (1,), weights `strategy: tensor_group, group_size: 16`, no `input_activations`.
`mxfp4a16` as `mxfp4-pack-quantized` (its `MXFP4A16`): the same packing, `weight_scale` uint8 E8M0 exponents (d_out,
d_in / 32), `strategy: group, group_size: 32`. `nvfp4` / `mxfp4` (W4A4, llm-compressor's NVFP4 / MXFP4 presets) add
the FP4 `input_activations` (NVFP4: `tensor_group` 16, dynamic `local`, each layer's calibrated `input_global_scale`
fp32 (1,); MXFP4: `group` 32, dynamic).

`w4a8-int8`, `w4a8-fp8` and `w4a4` are written as `int-quantized` too, the format compressed-tensors itself chooses
for llm-compressor's W4A8, W4AFP8 and W4A4 presets (`infer_module_format`; vLLM's `CompressedTensorsW4A8Int` reads only
it): `weight` int8 holding the 4-bit values (codes minus 8: compress's symmetric 4-bit grid has its zero point at 8),
`weight_scale` (d_out, d_in / group) float32, weights `strategy: group` with the layer's group size (a layer whose
width 128 does not divide keeps the plan's adapted group, in a config group of its own); `input_activations` int8,
FP8 or int4 per token.

A `kv_cache` (compress/quantize/kvcache.py) adds `kv_cache_scheme` and, with static scales, each attention module's
`k_scale` / `v_scale` in the export dtype (shape (1,), or (kv_heads, 1, 1) per head), llm-compressor's layout.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from compress.export.hf import DTYPES, FORMAT_VERSION, MAX_SHARD, _cast, _patch_config
from compress.files import staged_directory
from compress.qweight import FLOAT_BLOCK_ROWS, QuantizedWeight
from compress.quantize.activations import ActivationSpec

# compressed-tensors' format and `weights` arguments of each weight kind (`kind`)
FORMATS = {"int": "int-quantized", "int4": "int-quantized", "e4m3": "float-quantized", "e4m3-block": "float-quantized",
           "e2m1": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
FP4 = {"e2m1": 16, "mxfp4": 32}  # the E2M1 kinds (NVFP4, MXFP4) and their groups
WEIGHT_ARGS = {
    "int": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
    "int4": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False},  # + group_size
    "e4m3": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
    "e4m3-block": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "dynamic": False,
                   "block_structure": (FLOAT_BLOCK_ROWS["e4m3-block"], 128)},  # FP8_BLOCK (a tuple: hashed)
    "e2m1": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
             "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},  # llm-compressor's NVFP4A16 preset
    "mxfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
              "dynamic": False, "scale_dtype": "torch.uint8"},  # its MXFP4A16 preset
}


def kind(qw) -> str:
    """The weight kind of a LayerSpec or QuantizedWeight: its float element format, else "int" (8-bit) or "int4"."""
    return getattr(qw, "fp", None) or ("int4" if qw.bits == 4 else "int")


def weight_args(qw) -> dict:
    """The compressed-tensors `weights` arguments of a layer (its group size for int4)."""
    k = kind(qw)
    return {**WEIGHT_ARGS[k], "group_size": qw.group_size} if k == "int4" else WEIGHT_ARGS[k]


def check_layer(name: str, qw) -> str | None:
    """Why `name` (a LayerSpec or a QuantizedWeight) cannot be written by this export (None: it can): an 8-bit
    per-channel symmetric layer, int8 or FP8 E4M3, a 4-bit symmetric grouped one, or an NVFP4 / MXFP4 one."""
    k = kind(qw)
    if k in FP4 and qw.bits == 4 and qw.group_size == FP4[k]:
        return None
    if k == "e4m3-block" and qw.bits == 8 and qw.group_size == WEIGHT_ARGS[k]["block_structure"][1]:
        return None
    if k not in FP4 and qw.bits == 8 and qw.group_size == -1 and qw.sym:
        return None
    if k == "int4" and qw.group_size > 0 and qw.sym:
        return None
    return (f"`{name}` is {qw.bits}-bit, group {qw.group_size}, {'sym' if qw.sym else 'asym'}: this export writes "
            "the weights of a `scheme` (w8a8-int8, fp8: 8-bit per-channel symmetric; fp8-block: 128 x 128 blocks; "
            "w4a8-int8, w4a8-fp8, w4a4: "
            "4-bit grouped symmetric; nvfp4a16, mxfp4a16, nvfp4, mxfp4)")


def stored_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The layer's tensors as compressed-tensors stores them, exactly the run's weights: int8 `weight` (codes minus
    128) or float8_e4m3fn `weight`, with (d_out, 1) float32 `weight_scale`; NVFP4:
    `weight_packed` (two E2M1 codes a byte, the first in the low nibble), float8_e4m3fn `weight_scale` per 16
    columns and the fp32 `weight_global_scale`."""
    if (why := check_layer("layer", qw)) is not None or qw.mixed or qw.grid is not None:
        raise ValueError(why or "a mixed-precision or llama.cpp-grid weight is not a compressed-tensors layer")
    k = kind(qw)
    if k == "e2m1":
        g = torch.tensor([qw.global_scale], dtype=torch.float32)
        s8 = (qw.scales * g).to(torch.float8_e4m3fn)
        if not torch.equal(s8.float() / g, qw.scales):
            raise ValueError("an NVFP4 weight's scales times its global scale are not E4M3 values")
        return {"weight_packed": _packed(qw), "weight_scale": s8, "weight_global_scale": g}
    if k == "mxfp4":  # E8M0: the biased exponent of each power-of-two scale
        return {"weight_packed": _packed(qw), "weight_scale": (torch.log2(qw.scales) + 127).to(torch.uint8)}
    if k == "e4m3":
        return {"weight": qw.codes.view(torch.float8_e4m3fn), "weight_scale": qw.scales.reshape(-1, 1)}
    if k == "e4m3-block":  # one scale per block: the first row of each block of rows
        rows = FLOAT_BLOCK_ROWS[k]
        s = qw.scales[::rows].contiguous()
        if not torch.equal(s.repeat_interleave(rows, 0)[:qw.out_features], qw.scales):
            raise ValueError("an FP8 block weight's scales differ within a block of rows")
        return {"weight": qw.codes.view(torch.float8_e4m3fn), "weight_scale": s.float()}
    if k == "int4":
        if not bool((qw.zeros == 8).all()):
            raise ValueError("a symmetric 4-bit weight has its zero point at 8")
        return {"weight": (qw.codes.to(torch.int16) - 8).to(torch.int8), "weight_scale": qw.scales.float()}
    if not bool((qw.zeros == 128).all()):
        raise ValueError("a symmetric 8-bit weight has its zero point at 128")
    return {"weight": (qw.codes.to(torch.int16) - 128).to(torch.int8), "weight_scale": qw.scales.reshape(-1, 1)}


def _packed(qw: QuantizedWeight) -> torch.Tensor:
    """Two E2M1 codes a byte, the first column in the low nibble (compressed-tensors' `pack_fp4_to_uint8`)."""
    return qw.codes[:, 0::2] | (qw.codes[:, 1::2] << 4)


def _kind_of_args(args: dict) -> str:
    return next(k for k, a in WEIGHT_ARGS.items() if all(args.get(f) == v for f, v in a.items()))


def quantization_config(weights: dict[str, dict], acts: dict[str, ActivationSpec], ignore: list[str],
                        kv=None) -> dict:
    """One `config_groups` group per (`weights` arguments, activation setting) (static layers share one: their scales
    are tensors; a weight-only scheme's layers have no `input_activations`); one weight kind per checkpoint (one
    scheme per run), which names the format."""
    settings = {n: (tuple(args.items()), None if n not in acts else replace(acts[n], scale=None))
                for n, args in weights.items()}
    groups = {}
    for args, setting in dict.fromkeys(settings.values()):
        groups[f"group_{len(groups)}"] = {
            "targets": sorted(n for n, v in settings.items() if v == (args, setting)), "weights": dict(args),
            **({"input_activations": setting.as_compressed_tensors()} if setting is not None else {}),
            "format": FORMATS[_kind_of_args(dict(args))]}
    found = {_kind_of_args(a) for a in weights.values()}
    if len(found) > 1:
        raise ValueError(f"one scheme per checkpoint: weights of kinds {sorted(found)}")
    return {"quant_method": "compressed-tensors", "format": FORMATS[found.pop() if found else "int"],
            "quantization_status": "compressed", "config_groups": groups, "ignore": ignore,
            "kv_cache_scheme": kv.as_compressed_tensors() if kv is not None else None}


def scheme_of(qweights: dict, acts: dict[str, ActivationSpec]) -> str | None:
    """The `scheme` whose weights and activations these are (None: no quantized layer)."""
    name = next(iter(qweights), None)
    if name is None:
        return None
    k, a = kind(qweights[name]), acts.get(name)
    if k == "int4":
        return "w4a4" if a.bits == 4 else "w4a8-fp8" if a.type == "float" else "w4a8-int8"
    if k in FP4:
        return {"e2m1": "nvfp4", "mxfp4": "mxfp4"}[k] + ("" if a is not None else "a16")
    return {"int": "w8a8-int8", "e4m3": "fp8", "e4m3-block": "fp8-block"}[k]


def export_compressed_tensors(model, qweights: dict[str, QuantizedWeight], acts: dict[str, ActivationSpec],
                              tokenizer, out_dir, *, dtype: str = "float16", meta: dict | None = None,
                              kv=None) -> dict:
    """Write `model` (its quantized linears holding `qw.dequantize()`) with `qweights` as int8 / FP8 and the activation
    settings `acts` ({layer: spec}, every quantized layer) to `out_dir`, with the KV cache's `kv_cache_scheme` and
    static `k_scale` / `v_scale` of `kv` (a calibrated kvcache.KVCache); returns files, bytes, dtype."""
    kinds = {n: kind(qw) for n, qw in qweights.items()}
    missing = sorted(n for n, k in kinds.items() if k not in FP4 and n not in acts)
    if missing:
        raise ValueError(f"layers quantized without an activation scheme: {missing[:3]}")
    state = _cast(model.state_dict(), DTYPES[dtype])
    for name, qw in qweights.items():
        a = acts.get(name)
        if a is not None and kinds[name] != "int4" and (a.fp4 != kinds[name] if kinds[name] in FP4 or a.fp4 else
                                                        kinds[name].startswith("e4m3") != (a.type == "float")):
            raise ValueError(f"`{name}`: {kinds[name]} weights with {a.fp4 or a.type} activations")
        del state[f"{name}.weight"]
        for key, t in stored_tensors(qw).items():  # every scale exact: float32, E4M3 or E8M0 as the format says
            state[f"{name}.{key}"] = t
        if a is not None and not a.dynamic:  # a static input scale, calibrated (already a value of `dtype`)
            state[f"{name}.input_scale"] = torch.tensor([a.scale], dtype=DTYPES[dtype])
        if a is not None and a.fp4 == "e2m1":  # NVFP4's calibrated global input scale, float32 as the weights'
            state[f"{name}.input_global_scale"] = torch.tensor([a.scale], dtype=torch.float32)
    for name, (k_scale, v_scale) in (kv.layers.items() if kv is not None and kv.scales != "dynamic" else ()):
        state[f"{name}.k_scale"], state[f"{name}.v_scale"] = k_scale.to(DTYPES[dtype]), v_scale.to(DTYPES[dtype])
    weights = {n: weight_args(qw) for n, qw in qweights.items()}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ignore = [n for n in linears if n not in qweights]
    out_dir = Path(out_dir)
    with staged_directory(out_dir, marker="config.json") as tmp:
        model.save_pretrained(tmp, state_dict=state, max_shard_size=MAX_SHARD)
        _patch_config(tmp, {"quantization_config": quantization_config(weights, acts, ignore, kv), "dtype": dtype,
                            "compress": {"format": "compressed-tensors", "version": FORMAT_VERSION,
                                         "meta": meta or {}}})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {"files": [str(p) for p in files], "bytes": sum(p.stat().st_size for p in files), "dtype": dtype,
            "format": FORMATS[next(iter(kinds.values()), "int")], "scheme": scheme_of(qweights, acts),
            "layers": len(qweights), "kv_cache": [kv.type, kv.scales] if kv is not None else None}


# --- reading: a checkpoint of this export computed as the run evaluated it ---------------------------------------

FP4_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}  # a packed FP4 format's W4A4 scheme


def load_options(config) -> dict:
    """transformers' `from_pretrained` options for the checkpoint whose config this is: an FP4 one (`scheme: nvfp4a16`,
    `mxfp4a16`, `nvfp4`, `mxfp4`) is dequantized at load (the library's lazy decompression unpacks to bfloat16, which
    an fp32 model cannot multiply; `as_evaluated` then puts the exact weights and the FP4 activations back). Other
    checkpoints: no option."""
    qc = getattr(config, "quantization_config", None) or {}
    fmt = qc.get("format") if isinstance(qc, dict) else getattr(qc, "format", None)
    if fmt not in FP4_FORMATS:
        return {}
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def as_evaluated(model, directory) -> list[str]:
    """Make `model`, transformers' load of a compressed-tensors checkpoint in `directory` (with `load_options`),
    compute what the run evaluated where the library does not: FP4 layers' exact weights and activations
    (`_fp4_as_evaluated`), and the KV cache its `kv_cache_scheme` names (kvcache.from_checkpoint). Returns what
    compress did, one line each (nothing for a checkpoint the library computes as evaluated)."""
    from compress.quantize import kvcache

    done = []
    if n := _fp4_as_evaluated(model, Path(directory)):
        done.append(f"FP4 activations of {n} layers quantized by compress's hooks (weights dequantized)")
    if kvcache.from_checkpoint(model, Path(directory)) == "compress":
        done.append("the KV cache is quantized by compress's hooks with the stored scales (this compressed-tensors "
                    "does not hook this transformers' attention)")
    return done


def _fp4_as_evaluated(model, directory: Path) -> int:
    """`model`, transformers' dequantized load of an FP4 checkpoint, made to compute what the run evaluated: each FP4
    layer's exact stored weights (decoded here, the inverse of `stored_tensors`; the library's are bf16-rounded) and,
    for `scheme: nvfp4` / `mxfp4`, the activation quantization the load dropped (compressed-tensors' arithmetic in
    float32 with the stored `input_global_scale`, forward pre-hooks that stay). Returns the number of layers whose
    inputs it hooks."""
    import json

    from compress.export.hf import load_tensors
    from compress.quantize import floatgrid
    from compress.quantize.activations import SCHEME_ACTIVATIONS, fake_quant

    config = directory / "config.json"
    qc = (json.loads(config.read_text()).get("quantization_config") or {}) if config.is_file() else {}
    groups = [g for g in (qc.get("config_groups") or {}).values() if g.get("format") in FP4_FORMATS]
    if not groups:
        return 0
    tensors = load_tensors(directory)
    n = 0
    for g in groups:
        spec = SCHEME_ACTIVATIONS[FP4_FORMATS[g["format"]]]
        fmt = floatgrid.fmt_of(spec.fp4)
        for name in _targets(g["targets"], tensors):
            packed = tensors[f"{name}.weight_packed"]
            codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)  # `_packed` undone
            scale = tensors[f"{name}.weight_scale"].float()
            scale = (scale / tensors[f"{name}.weight_global_scale"].float() if spec.fp4 == "e2m1" else
                     torch.exp2(scale - 127))
            lin = model.get_submodule(name)
            w = floatgrid.decode(codes, spec.fp4) * floatgrid.per_column(scale, codes.shape[1], fmt.group)
            lin.weight.data = w[:, :lin.in_features].to(lin.weight.dtype)
            if g.get("input_activations") is None:
                continue
            s = spec if spec.fp4 != "e2m1" else replace(spec, scale=float(tensors[f"{name}.input_global_scale"]))
            lin.register_forward_pre_hook(lambda _m, args, s=s: (fake_quant(args[0], s), *args[1:]))
            n += 1
    return n


def _targets(targets: list[str], tensors: dict) -> list[str]:
    """The packed layers a compressed-tensors config group targets: layer names (compress's exports), a module class
    (`Linear`: llm-compressor's) or `re:` patterns, among the layers the checkpoint stores packed."""
    import re

    packed = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    return [n for n in packed if any(t == n or t == "Linear" or (t.startswith("re:") and re.match(t[3:], n))
                                     for t in targets)]
