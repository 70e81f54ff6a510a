"""Hugging Face checkpoints: auto-round's native packed format, or a plain dequantized ("fake") one.

`export_hf(model, qweights, tokenizer, out_dir, fmt="auto_round")` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads with only transformers and
auto-round installed; `read_quantized(out_dir)` reads the QuantizedWeights back, bit-exact.

What the loader expects (read from transformers 5.24 and auto-round 0.16.1)
---------------------------------------------------------------------------
* transformers sees `config.json["quantization_config"]["quant_method"] == "auto-round"` and hands
  the model to auto-round (`transformers/quantizers/quantizer_auto_round.py` ->
  `auto_round.inference.convert_model.convert_hf_model`). No backend name or device_map is needed
  on CPU: backend "auto" picks `auto_round:torch_zp` (`auto_round_extension/torch/qlinear_torch_zp`)
  for packing_format `auto_round:auto_gptq` and `auto_round:torch` (`qlinear_torch`) for
  `auto_round`. Both dequantize in plain torch, `W = scales * (q - zeros)`, then matmul.
* Which layers are quantized: every `nn.Linear` / `Conv1D` whose name starts with (plain
  `str.startswith`) one of the comma-separated `block_name_to_quantize` prefixes gets the default
  scheme (`bits`, `group_size`, `sym`, `data_type`), overridden per layer by `extra_config[name]`;
  layers outside the blocks (e.g. `lm_head`) are quantized only if `extra_config` names them.
  `{"bits": 16, "data_type": "fp"}` keeps a layer a plain `nn.Linear` (this is what auto-round's own
  exporter writes for layers it cannot pack), so every non-packed linear inside a block is declared
  that way here.
* packing formats (`compress/export/layouts.py`, docs/serving.md#layouts): the packing format is global; a
  checkpoint whose packed layers are all symmetric is `auto_round:auto_gptq` (GPTQ v1), an asymmetric one
  `auto_round:auto_awq` when every packed layer is 4 or 8 bits (vLLM reads both), else `auto_round` (GPTQ v2, real
  zero points; transformers only); `packing: gptq` writes a plain GPTQ checkpoint instead. auto-round's CPU loader in
  transformers reads `auto_round:auto_awq` only with a kernel package (`auto-round-lib` or `gptqmodel`): without
  one it falls back to a layer without weights, which `compress serve-check --engine transformers` refuses.
* Tensors that stay unquantized (embeddings, norms, a float LM head, biases) are written in `dtype` (float16 by
  default, as every peer writes them; `export.hf.dtype`), and config.json's `dtype` says so.
* The torch backends accept a layer only if in_features % 32 == 0, out_features % 32 == 0 and
  in_features % group_size == 0 (`exllamav2_feature_checker`; the QuantLinear buffers are sized
  `in // 32 * bits` and its forward repeats scales `group_size` times), and bits in 2..8. Only the
  CUDA tritonv2 backends read a short last group; on CPU `backend="auto"` then falls back to
  `auto_round:fake`, which fails at the first forward. So the plan fits each layer's group to its width
  (`quantize.spine.fit_group`) and layers still failing the check (`why_dense`: a width not a multiple
  of 32) are written dense in the model's dtype and declared bits 16 (docs/formats.md#which-layers-are-packed),
  as are 1-bit (sign) layers, which no loader's grid holds.
* The loader builds QuantLinear without `g_idx`, so `g_idx` is not written (it is always k // g);
  per-layer tensors are `qweight`, `qzeros`, `scales` (fp16) and `bias` (model dtype).
* After loading, auto-round casts the whole model to float16 on CPU because its torch backends
  declare compute dtypes float16/bfloat16 only (`post_init`: "Forced model to torch.float16"),
  even though the checkpoint keeps fp32 tensors. `PreTrainedModel.float()` refuses quantized
  models; `torch.nn.Module.float(model)` restores fp32 compute (non-quantized tensors stay rounded
  to fp16; the packed layers then decode exactly), which is how the tests compare logits.
* If no layer ends up packed, no backend is used and the model stays in its own dtype.
* Negative scales (auto-round full-range sym) need nothing special: the kernels multiply by them.

Mixed precision (an `allocate` plan: one bit width per column chunk; docs/formats.md#mixed-precision-layers-in-hf)
-----------------------------------------------------------------------------------------------------------------
auto-round's format has one `bits` per layer (`extra_config`), not per chunk, and transformers builds
its modules from the config, so split linears would need custom modeling code. We write an **exact
container** instead: a mixed layer is packed at its widest chunk's bit width (`qw.bits`); a chunk of
fewer bits keeps its own codes, scales and zero points, which the wider container holds unchanged
(a b-bit code is also a valid B-bit code for B > b, and `W = s * (q - z)` is the same; a symmetric chunk is
re-centred to the container's zero 2^(B-1), `layouts.widen`, since vLLM never reads a symmetric layer's zeros), so
the checkpoint reproduces the in-memory model exactly and loads with stock transformers + auto-round.
The price is storage: each layer costs its widest chunk's bits per weight on disk (e.g. a layer
with 2- and 3-bit chunks is stored at 3 bits), so the checkpoint is larger than the plan's effective
bits say; `compress.meta.mixed` records every mixed layer's chunk map (`chunk_size`, `chunk_bits`,
`map_bits`) so `read_quantized` returns the mixed QuantizedWeights and the report can state both. A layer
with a chunk kept in fp16 cannot be held by an integer container and is written dense (bits 16).
The packed per-width layout (`kernels.packing.mixed_pack`) and the ONNX export store each width at its
own size.

Artifact self-description: config.json carries `"compress": {"format", "version", "meta"}`;
`read_quantized` refuses versions it does not know; it reads every layout written here, and auto-round's own
`auto_round:auto_gptq` / `auto_round` / `auto_round:auto_awq` checkpoints. Files are written into a temporary sibling directory and renamed into place.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from compress.export import layouts
from compress.files import staged_directory
from compress.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
FMTS = ("auto_round", "fake")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DENSE = {"bits": 16, "data_type": "fp"}
MAX_SHARD = "5GB"


def _layer_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


# -- public API ------------------------------------------------------------------------------

def loadable(qw: QuantizedWeight) -> bool:
    """Whether auto-round's CPU/torch backends can serve this layer packed (module docstring)."""
    return dense_reason(qw) is None


def dense_reason(qw: QuantizedWeight) -> str | None:
    """Why the export writes this layer dense, or None when it is packed."""
    if qw.kept is not None and qw.kept.numel():
        return "chunks kept in fp16: no integer container holds them"  # module docstring
    if qw.bits == 1:
        return "1-bit (sign) weights: no auto-round loader reads them packed"
    if qw.fp is not None:
        return f"{qw.fp} float weights: only the compressed-tensors export stores them"
    return why_dense(qw.out_features, qw.in_features, qw.group_size)


def stored_bytes(model, qweights: dict[str, QuantizedWeight], dtype: str = "float16") -> int:
    """Bytes of the tensors the export writes: the model's parameters (floating ones in `dtype`), each packed layer's
    qweight, qzeros (written for symmetric layers too: the loaders read them) and fp16 scales in place of its
    weight."""
    size = DTYPES[dtype].itemsize

    def nbytes(p):
        return p.numel() * (size if p.is_floating_point() else p.element_size())

    total = sum(nbytes(p) for p in model.parameters())
    for name, qw in qweights.items():
        if loadable(qw):
            w = model.get_submodule(name).weight
            total += (qw.codes.numel() + qw.n_groups * qw.out_features) * qw.bits // 8 + qw.scales.numel() * 2
            total -= nbytes(w)
    return total


def why_dense(d_out: int, d_in: int, group_size: int) -> str | None:
    """Why a (d_out, d_in) layer with this group is written dense (no auto-round loader reads it packed), or None."""
    if d_in % 32 or d_out % 32:
        return f"{d_out}x{d_in}: auto-round's loaders need in and out features that are multiples of 32"
    if group_size != -1 and d_in % group_size:
        return f"group {group_size} does not divide in_features {d_in} (a short last group: CUDA triton only)"
    return None


def planned_dense(adapter, quantized) -> dict[str, str]:
    """{layer: why} for the quantized layers the hf export will write dense, from the bind step's layer plans."""
    out = {}
    for *_, layers in quantized:
        for name, spec in layers.items():
            lin = adapter.model.get_submodule(name)
            why = why_dense(lin.out_features, lin.in_features, spec.group_size)
            if why:
                out[name] = why
    return out


def export_hf(model, qweights: dict[str, QuantizedWeight], tokenizer, out_dir, *, fmt: str = "auto_round",
              meta: dict | None = None, packing: str = "auto", dtype: str = "float16",
              container: int | None = None) -> dict:
    """Write `model` (whose quantized linears hold `qw.dequantize()`) to `out_dir`.

    fmt "auto_round": packed checkpoint in `packing` (`layouts.choose`); "fake": `save_pretrained` of the
    dequantized model. `dtype`: the unquantized tensors' (float16, bfloat16, float32); `container`: the least width
    a packed layer is stored at (`layouts.containers`).
    Returns {"files": [absolute paths], "bytes": total size, "dense_layers": how many quantized layers are written
    dense, "dense": {layer: why}, "packing": the packing_format (packed checkpoints), "serving": why vLLM cannot
    read it (None when it can)}.
    """
    if fmt not in FMTS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {FMTS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {tuple(DTYPES)}")
    compress_info = {"format": fmt, "version": FORMAT_VERSION, "meta": {**(meta or {}), **mixed_meta(qweights)}}
    try:
        json.dumps(compress_info)
    except TypeError as e:
        raise ValueError(f"export meta must be JSON-serializable: {e}") from e
    _check_qweights(model, qweights)
    out_dir = Path(out_dir)
    extra = {}
    with staged_directory(out_dir, marker="config.json") as tmp:
        if fmt == "fake":
            model.save_pretrained(tmp, state_dict=_cast(model.state_dict(), DTYPES[dtype]), max_shard_size=MAX_SHARD)
            _patch_config(tmp, {"compress": compress_info, "dtype": dtype})
            dense = {n: "a dequantized checkpoint" for n in qweights}
        else:
            dense, extra = _write_auto_round(model, qweights, tmp, compress_info, packing, DTYPES[dtype], container)
            if dense:
                compress_info["meta"]["dense"] = dense  # {layer: why}: `compress inspect` says so
                _patch_config(tmp, {"compress": compress_info})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {"files": [str(p) for p in files], "bytes": sum(p.stat().st_size for p in files),
            "dense_layers": len(dense), "dense": dense, "dtype": dtype, **extra}


def _cast(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The floating-point tensors in `dtype` (a tied pair stays one tensor: the cast is memoised by identity)."""
    done = {}
    out = {}
    for k, v in state_dict.items():
        if v.is_floating_point() and v.dtype != dtype:
            key = (v.data_ptr(), v.dtype, tuple(v.shape))
            if key not in done:
                done[key] = v.to(dtype)
            v = done[key]
        out[k] = v
    return out


def read_quantized(out_dir, tensors: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict[str, QuantizedWeight]]:
    """(config.json as a dict, {layer name: QuantizedWeight}) of an auto-round checkpoint (`tensors`:
    its tensors when the caller has read them already)."""
    out_dir = Path(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    info = config.get("compress")
    if info is not None and info.get("version") != FORMAT_VERSION:
        raise ValueError(f"{out_dir}: compress checkpoint version {info.get('version')} is not supported "
                         f"(this reader knows version {FORMAT_VERSION})")
    qc = config.get("quantization_config")
    if qc is None:
        return config, {}  # a "fake" (dequantized) checkpoint holds no QuantizedWeight
    method = qc.get("quant_method")
    packing = layouts.GPTQ if method == "gptq" else qc.get("packing_format")
    if method == "gptq" and (qc.get("desc_act") or qc.get("checkpoint_format", "gptq") != "gptq"):
        raise ValueError(f"{out_dir}: a GPTQ checkpoint with desc_act or checkpoint_format "
                         f"{qc.get('checkpoint_format')!r} is not one compress reads (it reads GPTQ v1 without act-order)")
    if method not in ("auto-round", "gptq") or packing not in (*layouts.AUTO_ROUND_PACKINGS, layouts.GPTQ):
        raise ValueError(f"{out_dir}: cannot read quant_method {method!r} with packing_format {packing!r}; supported: "
                         f"auto-round with {', '.join(layouts.AUTO_ROUND_PACKINGS)}, or gptq")
    tensors = load_tensors(out_dir) if tensors is None else tensors
    names = sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))
    extra = qc.get("extra_config") or {}
    meta = (info or {}).get("meta") or {}
    sym_layers = set(meta.get("sym_layers") or ())
    qweights = {}
    rename = module_names(config.get("model_type"))
    for stored in names:
        name = rename(stored)  # the module's name (extra_config's and the loaded model's), not the file's
        scheme = {**qc, **extra.get(name, extra.get(stored, {})), **_dynamic(qc, stored)}
        if scheme.get("data_type", "int") != "int":
            raise ValueError(f"{out_dir}: layer {name} has data_type {scheme['data_type']!r}; only int is supported")
        t = {k: tensors[f"{stored}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx") if f"{stored}.{k}" in tensors}
        qweights[name] = layouts.unpack(t, packing, scheme, (meta.get("mixed") or {}).get(name),
                                        True if name in sym_layers else None, (meta.get("widened") or {}).get(name))
    return config, qweights


def _dynamic(qc: dict, stored: str) -> dict:
    """A GPTQ checkpoint's per-layer override (GPTQModel's `dynamic`: `+:regex` -> scheme) for this tensor prefix."""
    import re

    for pattern, scheme in (qc.get("dynamic") or {}).items():
        if pattern.startswith("+:") and re.match(pattern[2:], stored + "."):
            return scheme
    return {}


def module_names(model_type: str | None):
    """file tensor prefix -> module name: transformers saves some architectures under their original checkpoint
    names (mixtral's `block_sparse_moe`) and renames them back on load; apply its renaming rules."""
    import re

    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # an older transformers: file names are module names
        return lambda name: name
    rules = [(r.source_patterns[0], r.target_patterns[0]) for r in get_checkpoint_conversion_mapping(model_type) or []
             if type(r) is WeightRenaming]

    def rename(name: str) -> str:
        for src, dst in rules:
            name = re.sub(src, dst, name)
        return name

    return rename


def mixed_meta(qweights: dict[str, QuantizedWeight]) -> dict:
    """{"mixed": {layer: chunk map}} for the mixed-precision layers (none: {})."""
    mixed = {n: {"chunk_size": qw.chunk_size, "chunk_bits": list(qw.chunk_bits), "map_bits": qw.map_bits}
             for n, qw in qweights.items() if qw.mixed}
    return {"mixed": mixed} if mixed else {}


# -- auto-round writer -----------------------------------------------------------------------

def _write_auto_round(model, qweights: dict[str, QuantizedWeight], tmp: Path, compress_info: dict, packing: str,
                      dtype: torch.dtype, container: int | None = None) -> tuple[dict[str, str], dict]:
    """Write the packed checkpoint; returns ({layer: why} for the quantized layers written dense,
    {"packing": packing_format, "serving": why vLLM cannot read it, or None})."""
    if not qweights:
        raise ValueError("fmt='auto_round' needs at least one QuantizedWeight; use fmt='fake' for a plain model")
    dense = {n: why for n, qw in qweights.items() if (why := dense_reason(qw))}
    packed = {n: qw for n, qw in qweights.items() if n not in dense}
    if dense:
        name, why = next(iter(dense.items()))
        logger.warning("hf export: %d of %d quantized layers are written dense in %s (no auto-round loader reads them "
                       "packed), e.g. %s: %s", len(dense), len(qweights), str(dtype).removeprefix("torch."), name, why)
    wide = layouts.containers(packed, container)
    qconfig, serving = _quantization_config(model, packed, qweights, packing, wide)
    fmt = _packing_of(qconfig)
    compress_info["meta"].update(_layout_meta(packed, fmt, wide))
    state_dict = _cast(model.state_dict(), dtype)
    for name, qw in packed.items():
        del state_dict[f"{name}.weight"]
        state_dict.update({f"{name}.{k}": v.cpu() for k, v in layouts.pack(qw, fmt, wide.get(name)).items()})
    model.save_pretrained(tmp, state_dict=state_dict, max_shard_size=MAX_SHARD)
    updates = {"quantization_config": qconfig, "compress": compress_info, "dtype": str(dtype).removeprefix("torch.")}
    if _output_embedding_name(model) in packed and _ties_embeddings(model):
        updates["tie_word_embeddings"] = False  # the packed lm_head no longer shares the embedding tensor
    _patch_config(tmp, updates)
    return dense, {"packing": fmt, "serving": serving}


def _layout_meta(packed: dict[str, QuantizedWeight], fmt: str, wide: dict[str, int]) -> dict:
    """What `read_quantized` needs beyond the config to restore each layer bit-exactly: the layers stored in a wider
    container than their own width ({layer: own bits}) and, in an AWQ checkpoint, the symmetric layers (declared
    asymmetric there)."""
    meta = {}
    if wide:
        meta["widened"] = {n: packed[n].bits for n in sorted(wide)}
    if fmt == layouts.AWQ_PACKING and (sym := sorted(n for n, qw in packed.items() if qw.sym)):
        meta["sym_layers"] = sym
    return meta


def _packing_of(qconfig: dict) -> str:
    return layouts.GPTQ if qconfig["quant_method"] == "gptq" else qconfig["packing_format"]


def _quantization_config(model, packed: dict[str, QuantizedWeight], qweights: dict[str, QuantizedWeight],
                         packing: str = "auto", wide: dict[str, int] | None = None) -> tuple[dict, str | None]:
    """(the checkpoint's `quantization_config`, why vLLM cannot read it or None): auto-round's (a default scheme,
    block prefixes, per-layer `extra_config`) or, for packing `gptq`, GPTQ's (a default scheme, GPTQModel's
    `dynamic` for the other layers and for the quantized-but-dense ones)."""
    wide = wide or {}
    fmt, serving = layouts.choose(packed, packing, wide)
    awq = fmt == layouts.AWQ_PACKING
    if fmt == layouts.GPTQ:
        return layouts.gptq_config(packed, qweights, wide), serving
    blocks = _blocks(model, packed) or _blocks(model, _supported_layers(model))  # never let the loader guess
    scheme = {n: (wide.get(n, qw.bits), qw.group_size, qw.sym and not awq) for n, qw in packed.items()}
    pool = [scheme[n] for n in packed if _in_blocks(n, blocks)] or list(scheme.values()) or \
        [(qw.bits, qw.group_size, qw.sym) for qw in qweights.values()]
    bits, group_size, sym = Counter(pool).most_common(1)[0][0]
    extra = {}
    for name in packed:
        if not _in_blocks(name, blocks) or scheme[name] != (bits, group_size, sym):
            b, g, sy = scheme[name]
            extra[name] = {"bits": b, "group_size": g, "sym": sy, "data_type": "int"}
    for name in _supported_layers(model):
        if _in_blocks(name, blocks) and name not in packed:
            extra[name] = dict(DENSE)
    for name, m in model.named_modules():  # MoE routers: auto-round's loader unfuses some into nn.Linear (qwen3_moe)
        if type(m).__name__.endswith("TopKRouter") and _in_blocks(name, blocks):
            extra[name] = dict(DENSE)
    qconfig = {
        "quant_method": "auto-round",
        "packing_format": fmt,
        "bits": bits, "group_size": group_size, "sym": sym, "data_type": "int",
        "block_name_to_quantize": ",".join(blocks) if blocks else None,
    }
    if extra:
        qconfig["extra_config"] = extra
    return qconfig, serving


def _in_blocks(name: str, blocks: list[str]) -> bool:
    return any(name.startswith(b) for b in blocks)  # the loader's own rule (check_start_with_block_name)


def _supported_layers(model) -> list[str]:
    """Names of the layers auto-round's loader may quantize (exact type match, as it does)."""
    return [n for n, m in model.named_modules() if type(m) in _layer_types()]


def _blocks(model, names) -> list[str]:
    return sorted({b for b in (_block_of(model, n) for n in names) if b is not None})


def _block_of(model, name: str) -> str | None:
    """The outermost nn.ModuleList above `name` (e.g. "model.layers"), or None (e.g. lm_head)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if isinstance(model.get_submodule(prefix), nn.ModuleList):
            return prefix
    return None


def _output_embedding_name(model) -> str | None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if m is out), None) if out is not None else None


def _ties_embeddings(model) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def _dtype_of(model, name: str) -> str:
    return str(model.get_submodule(name).weight.dtype).removeprefix("torch.")


def _check_qweights(model, qweights: dict[str, QuantizedWeight]) -> None:
    for name, qw in qweights.items():
        try:
            module = model.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"quantized layer {name!r} is not a module of the model") from e
        if type(module) is not nn.Linear:
            raise ValueError(f"quantized layer {name!r} is a {type(module).__name__}; only nn.Linear is supported")
        if tuple(module.weight.shape) != tuple(qw.codes.shape):
            raise ValueError(f"{name}: weight {tuple(module.weight.shape)} does not match the QuantizedWeight "
                             f"{tuple(qw.codes.shape)}")
        w = module.weight.detach()
        if not torch.allclose(w.float(), qw.dequantize(w.dtype).to(w.device).float(), rtol=1e-3, atol=1e-6):
            logger.warning("%s: the model's weight is not qw.dequantize(); the exported layer will differ from "
                           "the in-memory model", name)


# -- files -----------------------------------------------------------------------------------

def _patch_config(directory: Path, updates: dict) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(updates)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no .safetensors files")
    tensors = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


# -- streaming writer (models larger than memory) ----------------------------------------------

def export_hf_streaming(model, source, block_qweights, qweights: dict[str, QuantizedWeight], tokenizer, out_dir,
                        *, meta: dict | None = None, packing: str = "auto", dtype: str = "float16",
                        container: int | None = None) -> dict:
    """auto-round checkpoint written one block at a time, without the model's weights in memory.

    `model` is the skeleton (blocks on `meta`) used only for names and config; `source` a
    `WeightSource` over the original shards; `block_qweights(i)` returns block i's QuantizedWeights
    (codes included) from the block checkpoints; `qweights` holds every quantized layer (codes may
    be `light` views) for the quantization config. One shard per block, plus one for the rest.
    """
    from safetensors.torch import save_file

    from compress.models.adapters import ModelAdapter

    compress_info = {"format": "auto_round", "version": FORMAT_VERSION,
                     "meta": {**(meta or {}), **mixed_meta(qweights)}}
    packed = {n: qw for n, qw in qweights.items() if loadable(qw)}
    wide = layouts.containers(packed, container)
    qconfig, serving = _quantization_config(model, packed, qweights, packing, wide)
    fmt = _packing_of(qconfig)
    compress_info["meta"].update(_layout_meta(packed, fmt, wide))
    adapter = ModelAdapter(model)
    n_blocks = len(adapter.blocks)
    out_dir = Path(out_dir)
    weight_map = {}
    with staged_directory(out_dir, marker="config.json") as tmp:
        prefixes = [adapter.block_name(i) + "." for i in range(n_blocks)]
        rest = [n for n in source.names if not any(n.startswith(p) for p in prefixes)]
        groups = [(rest, {n: q for n, q in qweights.items() if not any(n.startswith(p) for p in prefixes)})]
        groups += [(source.with_prefix(p), None) for p in prefixes]
        for k, (names, qws) in enumerate(groups):
            qws = qws if qws is not None else block_qweights(k - 1)
            tensors = _shard_tensors(source, names, qws, packed, fmt, DTYPES[dtype], wide)
            fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({t: fname for t in tensors})
            del tensors
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                      indent=2) + "\n")
        model.config.save_pretrained(tmp)
        _patch_config(tmp, {"quantization_config": qconfig, "compress": compress_info, "dtype": dtype})
        gen = source.dir / "generation_config.json"
        if gen.exists():
            shutil.copy(gen, tmp / gen.name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {"files": [str(p) for p in files], "bytes": sum(p.stat().st_size for p in files), "packing": fmt,
            "serving": serving, "dtype": dtype}


def _shard_tensors(source, names, qws: dict[str, QuantizedWeight], packed, fmt: str, dtype: torch.dtype,
                   wide: dict[str, int]) -> dict:
    tensors = {}
    for name in names:
        layer = name.removesuffix(".weight")
        if layer in qws and name.endswith(".weight"):
            qw = qws[layer]
            if layer in packed:
                tensors.update({f"{layer}.{k}": v.contiguous() for k, v in layouts.pack(qw, fmt, wide.get(layer)).items()})
            else:
                tensors[name] = qw.dequantize(dtype).contiguous()
        else:
            t = source.get(name)
            tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return tensors
