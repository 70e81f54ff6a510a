"""ONNX export: the transformers model traced by torch's own exporter, quantized linears as `com.microsoft::MatMulNBits`.

`export_onnx(model, qweights, out_dir)` writes `model.onnx`: input `input_ids` int64 (batch, seq), output `logits`
fp32 (batch, seq, vocab). With `kv_cache=True` (incremental decoding, the names optimum uses) it also takes
`attention_mask` int64 (batch, past + seq; 1 = attend, 0 = padding) and `past_key_values.{i}.key` / `.value` fp32
(batch, kv heads, past, head dim: the model's own cache layout, e.g. DeepSeek's MLA caches its compressed latent,
kv_lora_rank wide, as keys and its rotary keys, qk_rope_head_dim wide, as values, in one head) per block (past = 0
on the first call), and returns `present.{i}.key` / `.value` (batch, kv heads, past + seq, head dim); positions run
from past to past + seq - 1 (right padding, or none, in a batch). Sliding-window layers get their whole past and
mask it themselves. With `position_ids=True` as well, the positions are an input (`position_ids` int64 (batch, seq),
after `attention_mask`), as OpenVINO GenAI's stateful models take them (`compress.export.openvino`). With
`genai=True` the directory also holds `genai_config.json` (`genai_config`: ONNX Runtime GenAI's generic `decoder`
type, whose default input and output names are these) and the tokenizer's files, so `onnxruntime_genai.Model(dir)`
runs it; `genai_why_not` names the families its KV cache cannot hold (keys and values of different widths:
DeepSeek's latent cache).

The graph is not written by hand: `torch.onnx.export(dynamo=True)` traces the transformers model itself with
`torch.export`, so every decoder family transformers runs is written the same way (docs/architectures.md).
Before tracing, each quantized linear is swapped, for the duration of the export only, for a module calling the
custom op `compress::matmul_nbits` on the tensors below; the exporter's translation table writes that op as
MatMulNBits, so the codes, scales and zero points go into the graph bit for bit. Routed experts run every expert
on every token weighted by the router's top-k weights (zero elsewhere): per-expert token selection has
data-dependent shapes, which `torch.export` cannot trace; the result is the same.

MatMulNBits (docs/formats.md#matmulnbits-operator), for a QuantizedWeight of shape (N, K) with b in {2, 4, 8} bits:
  B            uint8 (N, k_blocks, block*b/8)  codes along K, LSB first within each byte, K zero padded
  scales       fp32  (N, k_blocks)             (negative scales are kept as they are)
  zero_points  uint8 (N, ceil(k_blocks*b/8))   zero points packed the same way along k_blocks
  block_size = group size (per-channel: the next power of two >= K, at least 16).
Weights MatMulNBits cannot hold (3, 5, 6, 7 bits; a group that is not a power of two >= 16) are
written as dequantized fp32 MatMuls and listed in the metadata under `dense_layers`.
A mixed-precision weight (per-chunk bits from an `allocate` plan) becomes one node chain per bit width:
`Gather` of that width's input columns (the permutation of `kernels.packing.split_mixed`), a MatMulNBits
(or a dense MatMul for 3-bit slices and fp16-kept chunks, listed as `name[b-bit]` under `dense_layers`),
and `Add` of the slices' outputs: each width is stored at its own size.
The file is self-describing: metadata_props `compress.format` = "onnx-matmulnbits", `compress.version`
and `compress.meta` (JSON).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from compress.files import staged_directory
from compress.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

FORMAT, FORMAT_VERSION, OPSET = "onnx-matmulnbits", 1, 18
NBITS = (2, 4, 8)
# protobuf refuses messages past 2 GiB: above this, the tensors go to model.onnx.data beside the graph
EXTERNAL_DATA_BYTES = 1.5e9
MAX_LEN = 1 << 17  # the sequence dims' upper bound for torch.export (the longest input a graph may be run with)


def pack_lsb(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values (..., n) with n*bits % 8 == 0 -> bytes (..., n*bits/8), first value in the low bits."""
    per = 8 // bits
    v = values.astype(np.uint8).reshape(*values.shape[:-1], -1, per)
    out = np.zeros(v.shape[:-1], np.uint8)
    for i in range(per):
        out |= v[..., i] << np.uint8(i * bits)
    return out


def block_size(qw: QuantizedWeight) -> int | None:
    """MatMulNBits block size for `qw`, or None when it cannot be expressed."""
    if qw.bits not in NBITS:
        return None
    if qw.group_size == -1:
        return max(16, 1 << math.ceil(math.log2(qw.in_features)))
    g = qw.group_size
    return g if g >= 16 and g & (g - 1) == 0 else None


def matmulnbits_tensors(qw: QuantizedWeight) -> dict[str, np.ndarray]:
    """QuantizedWeight -> MatMulNBits B, scales, zero_points (module docstring)."""
    bs, b = block_size(qw), qw.bits
    n, k = qw.codes.shape
    kb = math.ceil(k / bs)
    codes = np.zeros((n, kb * bs), np.uint8)
    codes[:, :k] = qw.codes.cpu().numpy()
    per = 8 // b
    zeros = np.zeros((n, math.ceil(kb / per) * per), np.uint8)
    zeros[:, :kb] = qw.zeros.cpu().numpy()
    return {"B": pack_lsb(codes.reshape(n, kb, bs), b), "scales": qw.scales.cpu().float().numpy(),
            "zero_points": pack_lsb(zeros, b)}


@torch.library.custom_op("compress::matmul_nbits", mutates_args=())
def matmul_nbits(x: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, k: int, n: int,
                 bits: int, block_size: int) -> torch.Tensor:
    """x @ W.T for W packed as MatMulNBits (docs/formats.md#matmulnbits-operator)."""
    per, kb = 8 // bits, b.shape[1]
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    mask = (1 << bits) - 1
    codes = ((b.unsqueeze(-1) >> shifts) & mask).reshape(n, kb, block_size).float()
    zeros = ((zero_points.unsqueeze(-1) >> shifts) & mask).reshape(n, -1)[:, :kb].float()
    w = ((codes - zeros[..., None]) * scales[..., None]).reshape(n, kb * block_size)[:, :k]
    return x @ w.to(x.dtype).T


@matmul_nbits.register_fake
def _(x, b, scales, zero_points, k, n, bits, block_size):
    return x.new_empty(*x.shape[:-1], n)


def _onnx_matmul_nbits(x, b, scales, zero_points, k: int, n: int, bits: int, block_size: int):
    return _matmul_nbits_op()(x, b, scales, zero_points, K=k, N=n, bits=bits, block_size=block_size,
                              accuracy_level=0)


@functools.cache
def _matmul_nbits_op():
    """onnxscript's handle on ORT's contrib op, with the schema onnx itself does not know."""
    import onnxscript
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    schema = OpSchema(
        "MatMulNBits", "com.microsoft", 1,
        inputs=[param("A", "T1"), param("B", "T2"), param("scales", "T1"), param("zero_points", "T2")],
        outputs=[param("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)"], "activations"), ("T2", ["tensor(uint8)"], "packed codes")],
        attributes=[OpSchema.Attribute(a, OpSchema.AttrType.INT, "")
                    for a in ("K", "N", "bits", "block_size", "accuracy_level")])
    return onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "MatMulNBits", schema)


class PackedLinear(nn.Module):
    """x -> MatMulNBits(x, codes of `qw`) (+ bias)."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        for key, array in matmulnbits_tensors(qw).items():
            self.register_buffer(key, torch.from_numpy(array))
        self.k, self.n, self.bits, self.block = qw.in_features, qw.out_features, qw.bits, block_size(qw)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x):
        y = torch.ops.compress.matmul_nbits(x, self.B, self.scales, self.zero_points, self.k, self.n, self.bits,
                                            self.block)
        return y if self.bias is None else y + self.bias


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class MixedLinear(nn.Module):
    """sum over bit widths b of linear_b(x[..., cols_b]) (`kernels.packing.split_mixed`)."""

    def __init__(self, parts: list[tuple[torch.Tensor, nn.Module]], bias: torch.Tensor | None):
        super().__init__()
        for i, (cols, _) in enumerate(parts):
            self.register_buffer(f"cols{i}", cols.long())
        self.parts = nn.ModuleList(m for _, m in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x):
        y = sum(m(x.index_select(-1, getattr(self, f"cols{i}"))) for i, m in enumerate(self.parts))
        return y if self.bias is None else y + self.bias


def substitute(qw: QuantizedWeight, bias, dense: list[str], name: str) -> nn.Module:
    """The export-time module for the quantized linear `name`; appends what is written dense to `dense`."""
    from compress.kernels.packing import split_mixed

    if not qw.mixed:
        if block_size(qw) is not None:
            return PackedLinear(qw, bias)
        dense.append(name)
        return DenseLinear(qw.dequantize(), bias)
    parts = []
    for bits, cols, part in split_mixed(qw):
        if isinstance(part, QuantizedWeight) and block_size(part) is not None:
            parts.append((cols, PackedLinear(part, None)))
        else:
            dense.append(f"{name}[{bits}-bit]")
            parts.append((cols, DenseLinear(part.dequantize() if isinstance(part, QuantizedWeight) else part, None)))
    return MixedLinear(parts, bias)


def _dense_dispatch(self, hidden_states, top_k_index, top_k_weights):
    """LinearExperts.forward without data-dependent shapes: every expert on every row, weighted."""
    weights = torch.zeros(hidden_states.shape[0], len(self), dtype=top_k_weights.dtype,
                          device=hidden_states.device).scatter(1, top_k_index, top_k_weights)
    out = torch.zeros_like(hidden_states)
    for e in range(len(self)):
        out = out + self.expert(e, hidden_states) * weights[:, e:e + 1].to(hidden_states.dtype)
    return out


@contextlib.contextmanager
def substituted(model: nn.Module, qweights: dict[str, QuantizedWeight]):
    """The model with packed modules in place of its quantized linears and dense expert dispatch; restored after.
    Yields the names of the quantized layers written dense."""
    from compress.models.adapters import LinearExperts

    swapped, dense = [], []
    try:
        for name, qw in qweights.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, leaf)
            setattr(parent, leaf, substitute(qw, getattr(old, "bias", None), dense, name))
            swapped.append((parent, leaf, old))
        experts = [m for m in model.modules() if isinstance(m, LinearExperts)]
        for m in experts:
            m.forward = _dense_dispatch.__get__(m)
        yield dense
    finally:
        for parent, leaf, old in reversed(swapped):
            setattr(parent, leaf, old)
        for m in [m for m in model.modules() if isinstance(m, LinearExperts)]:
            m.__dict__.pop("forward", None)


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class _Step(nn.Module):
    """(input_ids, attention_mask, past k/v per layer) -> (logits, present k/v per layer); positions run from the
    past's length."""

    def __init__(self, model, layers: int):
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, past):
        start = past[0].shape[2]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0) + start
        return self.step(input_ids, attention_mask, positions, past)

    def step(self, input_ids, attention_mask, position_ids, past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                            position_ids=position_ids, use_cache=True).logits
        return logits, [t for layer in cache.layers for t in (layer.keys, layer.values)]


class _StepAt(_Step):
    """_Step with the positions an input (`position_ids` int64 (batch, seq)), as optimum's graphs and OpenVINO
    GenAI's stateful models take them: left-padded rows and a cache that was trimmed keep their positions."""

    def forward(self, input_ids, attention_mask, position_ids, past):
        return self.step(input_ids, attention_mask, position_ids, past)


def cache_shapes(model) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(heads, dim) of each layer's cached keys and values, from a one-token forward."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.ones(1, 1, dtype=torch.long), cache=cache, use_cache=True)
    return [((layer.keys.shape[1], layer.keys.shape[3]), (layer.values.shape[1], layer.values.shape[3]))
            for layer in cache.layers]


def trace(model, path: Path, kv_cache: bool, metadata: dict[str, str], position_ids: bool = False) -> None:
    """Export the (already substituted) model to `path` with the I/O of the module docstring and `metadata`
    (metadata_props); the tensors go to `model.onnx.data` beside it above EXTERNAL_DATA_BYTES. `position_ids`
    (with `kv_cache`): the positions are an input after `attention_mask` instead of running from the past's length."""
    import warnings

    import onnx_ir
    from torch.export import Dim

    batch, seq = Dim("batch", max=1024), Dim("seq", max=MAX_LEN)
    ids = torch.full((2, 3), 1, dtype=torch.long)
    table = {torch.ops.compress.matmul_nbits.default: _onnx_matmul_nbits}
    if kv_cache:
        shapes = cache_shapes(model)
        past_len = 2
        past = [torch.zeros(2, h, past_len, d) for kv in shapes for h, d in kv]
        mask = torch.ones(2, past_len + ids.shape[1], dtype=torch.long)
        dims = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: Dim("total", max=2 * MAX_LEN)}}
        if position_ids:
            module = _StepAt(model, len(shapes))
            args = (ids, mask, torch.arange(past_len, past_len + ids.shape[1]).expand(ids.shape[0], -1), past)
            dims["position_ids"] = {0: batch, 1: seq}
        else:
            module, args = _Step(model, len(shapes)), (ids, mask, past)
        dims["past"] = [{0: batch, 2: Dim("past", max=MAX_LEN)} for _ in past]
        pairs = [f"{i}.{kv}" for i in range(len(shapes)) for kv in ("key", "value")]
        inputs = ["input_ids", "attention_mask", *(["position_ids"] if position_ids else []),
                  *(f"past_key_values.{p}" for p in pairs)]
        outputs = ["logits", *(f"present.{p}" for p in pairs)]
    else:
        module, args, dims = _Logits(model), (ids,), {"input_ids": {0: batch, 1: seq}}
        inputs, outputs = ["input_ids"], ["logits"]
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module.eval(), args, dynamic_shapes=dims, dynamo=True, opset_version=OPSET,
                                    input_names=inputs, output_names=outputs, custom_translation_table=table,
                                    optimize=True, verbose=False, external_data=False)
    for node in program.model.graph.all_nodes():  # the exporter's per-node stack traces and class paths
        node.metadata_props.clear()
    program.model.metadata_props.update(metadata)
    onnx_ir.save(program.model, path, external_data=f"{path.name}.data" if _large(program) else None)


@contextlib.contextmanager
def float32(model):
    """The graph computes in fp32 (MatMulNBits' activations): a half-precision model is traced in fp32 and put
    back after (bf16/fp16 -> fp32 -> bf16/fp16 is exact)."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        yield
        return
    model.float()
    try:
        yield
    finally:
        model.to(dtype)


def _large(program) -> bool:
    size = sum(math.prod(v.shape) * v.dtype.itemsize for v in program.model.graph.initializers.values()
               if v.const_value is not None)
    return size > EXTERNAL_DATA_BYTES


@contextlib.contextmanager
def _quiet():
    """torch's exporter logs each step at INFO/WARNING (torchvision missing, ...): keep the run's log readable."""
    names = ("torch.onnx", "torch.export", "torch._dynamo", "torch._export", "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_onnx(model, qweights: dict[str, QuantizedWeight], out_dir: str | Path, meta: dict | None = None,
                kv_cache: bool = False, position_ids: bool = False, genai: bool = False, tokenizer=None) -> dict:
    """Write `out_dir/model.onnx` (+ `model.onnx.data` above 1.5 GB); returns path, bytes, dense layer count.
    `kv_cache`: attention_mask and past/present key-value inputs and outputs (module docstring); `position_ids` (with
    it): the positions an input too. `genai` (with `kv_cache`): also `genai_config.json` and `tokenizer`'s files, the
    directory `onnxruntime_genai.Model` runs (`genai_config`; a cache it cannot hold is refused by `genai_why_not`)."""
    from compress.errors import BadInput

    if not type(model).__name__.endswith("ForCausalLM"):
        raise BadInput(f"the onnx export writes causal language models (decoders), not "
                       f"`{getattr(model.config, 'model_type', type(model).__name__)}`; drop `onnx` from export.formats")
    genai = genai and kv_cache
    if genai and (why := genai_why_not(model.config)):
        raise ValueError(f"ONNX Runtime GenAI cannot run this graph: {why}")
    out = Path(out_dir)
    with float32(model), substituted(model, qweights) as dense, staged_directory(out, marker="model.onnx") as tmp:
        if dense:
            logger.warning("onnx: %d quantized layers written as dense MatMuls (not MatMulNBits-expressible): %s",
                           len(dense), ", ".join(dense[:5]))
        info = {"format": FORMAT, "version": FORMAT_VERSION, "meta": meta or {}, "dense_layers": dense,
                "kv_cache": kv_cache, "position_ids": kv_cache and position_ids}
        trace(model, tmp / "model.onnx", kv_cache, {"compress.format": FORMAT, "compress.version": str(FORMAT_VERSION),
                                                    "compress.meta": json.dumps(info)}, position_ids=position_ids)
        if genai:
            config = genai_config(model, cache_shapes(model), tokenizer, position_ids)
            (tmp / "genai_config.json").write_text(json.dumps(config, indent=2) + "\n")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            else:
                logger.warning("onnx: no tokenizer to write beside genai_config.json; onnxruntime_genai runs the "
                               "directory on token ids only")
    nbytes = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model.onnx"))
    return {"path": str(out / "model.onnx"), "bytes": nbytes, "dense_layers": len(dense), "graph": "torch",
            "kv_cache": kv_cache, "position_ids": kv_cache and position_ids, "genai_config": genai}


def genai_why_not(config) -> str | None:
    """Why ONNX Runtime GenAI (0.18) cannot run the `kv_cache` graph of a model with this config, or None. Its KV
    cache gives keys and values one width (`head_size`, the empty past it feeds first has that shape), so a family
    that caches keys and values of different widths is refused."""
    if getattr(config, "kv_lora_rank", None):  # DeepSeek's multi-head latent attention
        return (f"`{config.model_type}` (multi-head latent attention) caches its compressed latent "
                f"({config.kv_lora_rank} wide) as keys and the rotary keys ({config.qk_rope_head_dim} wide) as values, "
                "and onnxruntime_genai's KV cache gives keys and values one width (head_size)")
    return None


def _token_id(model, tokenizer, name: str):
    """`name` (bos/eos/pad_token_id) from the generation config, else the model's config, else the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, name, None) if source is not None else None
        if value is not None:
            return value
    return None


def genai_config(model, shapes, tokenizer=None, position_ids: bool = False) -> dict:
    """genai_config.json for the `kv_cache` graph (onnxruntime_genai's `decoder` type: any decoder-only model; its
    default input and output names are this graph's). `shapes`: `cache_shapes(model)`, one (heads, width) for every
    layer's keys and values, or ValueError. The KV cache is not shared between past and present (the graph
    concatenates), so `past_present_share_buffer` is false; EOS, BOS and padding come from the model's generation
    config (else its config, else the tokenizer)."""
    kinds = {kv for layer in shapes for kv in layer}
    if len(kinds) != 1:
        raise ValueError(f"onnxruntime_genai's KV cache holds one (heads, width) for every key and value; this model "
                         f"caches {sorted(kinds)}")
    (heads, width), = kinds
    cfg, gen = model.config, getattr(model, "generation_config", None)
    context = min(getattr(cfg, "max_position_embeddings", None) or MAX_LEN, MAX_LEN)
    eos = _token_id(model, tokenizer, "eos_token_id")
    pad = _token_id(model, tokenizer, "pad_token_id")
    ids = {"bos_token_id": _token_id(model, tokenizer, "bos_token_id"), "eos_token_id": eos,
           "pad_token_id": pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)}
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
              **({"position_ids": "position_ids"} if position_ids else {}),
              "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    outputs = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    decoder = {"session_options": {"log_id": "onnxruntime-genai", "provider_options": []}, "filename": "model.onnx",
               "head_size": width, "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
               "num_hidden_layers": len(shapes), "num_key_value_heads": heads, "inputs": inputs, "outputs": outputs}
    search = {"do_sample": bool(getattr(gen, "do_sample", False)), "max_length": context, "min_length": 0,
              "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": False,
              "repetition_penalty": float(getattr(gen, "repetition_penalty", None) or 1.0),
              "temperature": float(getattr(gen, "temperature", None) or 1.0),
              "top_k": int(getattr(gen, "top_k", None) or 50), "top_p": float(getattr(gen, "top_p", None) or 1.0)}
    model_cfg = {**{k: v for k, v in ids.items() if v is not None}, "context_length": context,
                 "vocab_size": cfg.vocab_size, "type": "decoder", "decoder": decoder}
    return {"model": model_cfg, "search": search}
