"""ONNX export: Llama-architecture decoders with quantized linears as `com.microsoft::MatMulNBits`.

`export_onnx(model, qweights, out_dir)` writes `model.onnx`: input `input_ids` int64 (batch, seq),
output `logits` fp32 (batch, seq, vocab), full causal attention without a KV cache. With
`kv_cache=True` (incremental decoding, the names optimum uses) it also takes `attention_mask` int64
(batch, past + seq; 1 = attend, 0 = padding) and `past_key_values.{i}.key` / `.value` fp32
(batch, kv_heads, past, head_dim) per block (past = 0 on the first call), and returns
`present.{i}.key` / `.value` (batch, kv_heads, past + seq, head_dim); positions run from past to
past + seq - 1 (right padding, or none, in a batch). The graph is
written op by op from the model's config and weights (embedding Gather, RMSNorm, RoPE from the
model's own cos/sin tables, grouped-query attention, SiLU MLP) rather than traced: torch 2.13's
TorchScript exporter stops at transformers' mask code (`aten::diff`) and its dynamo exporter needs
onnxscript, which is not installed here. Supported `model_type`s: llama, mistral (no sliding
window), qwen2 (q/k/v biases), and the sparse MoE models mixtral and qwen2_moe (router, top-k and every
expert in the graph, each expert's linears at their own width; `LlamaOnnx.moe`).

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

import json
import logging
import math
from pathlib import Path

import numpy as np
import torch

from compress.errors import BadInput
from compress.qweight import QuantizedWeight
from compress.files import staged_directory

logger = logging.getLogger(__name__)

FORMAT, FORMAT_VERSION, OPSET = "onnx-matmulnbits", 1, 17
MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
NBITS = (2, 4, 8)
# protobuf refuses messages past 2 GiB: above this, the tensors go to model.onnx.data beside the graph
EXTERNAL_DATA_BYTES = 1.5e9


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


class Graph:
    """Accumulates ONNX nodes and initializers with unique names."""

    def __init__(self):
        self.nodes, self.inits, self._n = [], [], 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, array, hint: str = "c") -> str:
        from onnx import numpy_helper

        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, domain: str = "", outputs: int = 1, **attrs):
        """The node's output name (a list of `outputs` names when it has several)."""
        from onnx import helper

        out = self.name(op_type.lower())
        names = [out] if outputs == 1 else [f"{out}.{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=out, domain=domain, **attrs))
        return out if outputs == 1 else names


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().float().numpy()


class LlamaOnnx:
    """Writes one Llama-style decoder into a Graph; `linear` picks MatMulNBits or a dense MatMul."""

    def __init__(self, model, qweights: dict[str, QuantizedWeight], kv_cache: bool = False):
        self.model, self.cfg, self.qweights, self.g = model, model.config, qweights, Graph()
        self.kv_cache, self.presents = kv_cache, []
        self.dense: list[str] = []
        self.hd = getattr(self.cfg, "head_dim", None) or self.cfg.hidden_size // self.cfg.num_attention_heads

    def linear(self, x: str, name: str) -> str:
        g, mod = self.g, self.model.get_submodule(name)
        qw = self.qweights.get(name)
        if qw is not None and qw.mixed:
            y = self.mixed(x, name, qw)
        elif qw is not None and block_size(qw) is not None:
            t = matmulnbits_tensors(qw)
            y = g.op("MatMulNBits", x, g.const(t["B"], name + ".B"), g.const(t["scales"], name + ".scales"),
                     g.const(t["zero_points"], name + ".zp"), domain="com.microsoft", K=qw.in_features,
                     N=qw.out_features, bits=qw.bits, block_size=block_size(qw), accuracy_level=0)
        else:
            if qw is not None:
                self.dense.append(name)
            w = qw.dequantize() if qw is not None else mod.weight
            y = g.op("MatMul", x, g.const(_f32(w).T.copy(), name + ".weight_t"))
        if getattr(mod, "bias", None) is not None:
            y = g.op("Add", y, g.const(_f32(mod.bias), name + ".bias"))
        return y

    def mixed(self, x: str, name: str, qw: QuantizedWeight) -> str:
        """sum over bit widths b of MatMulNBits(Gather(x, cols_b)) (dense MatMul where MatMulNBits cannot)."""
        from compress.kernels.packing import split_mixed

        g, y = self.g, None
        for bits, cols, part in split_mixed(qw):
            xs = g.op("Gather", x, g.const(cols.numpy().astype(np.int64), f"{name}.cols{bits}"), axis=-1)
            hint = f"{name}.w{bits}"
            if isinstance(part, QuantizedWeight) and block_size(part) is not None:
                t = matmulnbits_tensors(part)
                ys = g.op("MatMulNBits", xs, g.const(t["B"], hint + ".B"), g.const(t["scales"], hint + ".scales"),
                          g.const(t["zero_points"], hint + ".zp"), domain="com.microsoft", K=part.in_features,
                          N=part.out_features, bits=bits, block_size=block_size(part), accuracy_level=0)
            else:
                self.dense.append(f"{name}[{bits}-bit]")
                w = part.dequantize() if isinstance(part, QuantizedWeight) else part.float()
                ys = g.op("MatMul", xs, g.const(_f32(w).T.copy(), hint + ".weight_t"))
            y = ys if y is None else g.op("Add", y, ys)
        return y

    def rmsnorm(self, x: str, mod) -> str:
        g = self.g
        eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))
        ms = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)
        inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(np.array(eps, np.float32)))))
        return g.op("Mul", g.op("Mul", x, inv), g.const(_f32(mod.weight), "norm"))

    def rope(self, x: str, cos: str, sin: str) -> str:
        """x (B, H, S, D) * cos + rotate_half(x) * sin, cos/sin (S, D)."""
        g, half = self.g, self.hd // 2
        axis, start, mid, end = (g.const(np.array([v], np.int64)) for v in (-1, 0, half, self.hd))
        x1 = g.op("Slice", x, start, mid, axis)
        x2 = g.op("Slice", x, mid, end, axis)
        rot = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rot, sin))

    def heads(self, x: str, n: int) -> str:
        """(B, S, n*D) -> (B, n, S, D)."""
        g = self.g
        return g.op("Transpose", g.op("Reshape", x, g.const(np.array([0, 0, n, self.hd], np.int64))),
                    perm=[0, 2, 1, 3])

    def attention(self, x: str, prefix: str, attn, cos: str, sin: str, mask: str, i: int) -> str:
        g, nh, nkv = self.g, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = self.rope(self.heads(self.linear(x, prefix + ".q_proj"), nh), cos, sin)
        k = self.rope(self.heads(self.linear(x, prefix + ".k_proj"), nkv), cos, sin)
        v = self.heads(self.linear(x, prefix + ".v_proj"), nkv)
        if self.kv_cache:  # keys and values of the earlier positions come first
            k = g.op("Concat", self.past(i, "key"), k, axis=2)
            v = g.op("Concat", self.past(i, "value"), v, axis=2)
            self.presents += [(k, f"present.{i}.key"), (v, f"present.{i}.value")]
        if nh != nkv:  # grouped-query attention: repeat each kv head nh/nkv times
            rep = np.array([1, 1, nh // nkv, 1, 1], np.int64)
            to_heads = g.const(np.array([0, nh, -1, self.hd], np.int64))
            axis2 = g.const(np.array([2], np.int64))
            k, v = (g.op("Reshape", g.op("Expand", g.op("Unsqueeze", t, axis2), g.const(rep)), to_heads)
                    for t in (k, v))
        scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])),
                      g.const(np.array(attn.scaling, np.float32)))
        probs = g.op("Softmax", g.op("Add", scores, mask), axis=-1)
        ctx = g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", ctx, g.const(np.array([0, 0, nh * self.hd], np.int64)))
        return self.linear(ctx, prefix + ".o_proj")

    def mlp(self, x: str, prefix: str) -> str:
        g = self.g
        gate = self.linear(x, prefix + ".gate_proj")
        act = g.op("Mul", gate, g.op("Sigmoid", gate))
        return self.linear(g.op("Mul", act, self.linear(x, prefix + ".up_proj")), prefix + ".down_proj")

    def routed_mlp(self, x: str, prefix: str, mlp) -> str:
        """A PrunePath FFN (compress/prunepath.py) at its checkpoint's tau: router softmax, experts sorted by
        probability (TopK over all of them), active while the mass ranked above them is below tau (at least
        k_min), the mask scattered back and repeated over each expert's neurons; the FFN's hidden activations
        are multiplied by it (every neuron is computed: the graph has no gather)."""
        g = self.g
        e, s = mlp.experts, mlp.expert_size
        if mlp.tau >= 1:
            return self.mlp(x, prefix)
        logits = g.op("MatMul", x, g.const(_f32(mlp.router.weight).T.copy(), prefix + ".router.weight_t"))
        probs = g.op("Softmax", logits, axis=-1)
        top, idx = g.op("TopK", probs, g.const(np.array([e], np.int64)), axis=-1, outputs=2)
        above = g.op("Sub", g.op("CumSum", top, g.const(np.array(-1, np.int64))), top)
        keep = g.op("Less", above, g.const(np.array(mlp.tau, np.float32)))
        first = np.zeros(e, bool)
        first[:mlp.k_min] = True
        keep = g.op("Cast", g.op("Or", keep, g.const(first)), to=1)
        mask = g.op("ScatterElements", g.op("Mul", probs, g.const(np.array(0, np.float32))), idx, keep, axis=-1)
        mask = g.op("Expand", g.op("Unsqueeze", mask, g.const(np.array([-1], np.int64))),
                    g.op("Concat", g.op("Shape", mask), g.const(np.array([s], np.int64)), axis=0))
        mask = g.op("Reshape", mask, g.const(np.array([0, 0, -1], np.int64)))
        gate = self.linear(x, prefix + ".gate_proj")
        act = g.op("Mul", gate, g.op("Sigmoid", gate))
        h = g.op("Mul", g.op("Mul", act, self.linear(x, prefix + ".up_proj")), mask)
        return self.linear(h, prefix + ".down_proj")

    def moe(self, x: str, prefix: str, block) -> str:
        """A sparse MoE block (mixtral, qwen2_moe): softmax router, top-k with the model's renormalisation, every
        expert at its own width weighted by its routing weight (zero where it is not among the top k), plus the
        sigmoid-gated shared expert where the model has one. Every expert runs on every token (dense dispatch:
        exact, E/k times the expert compute of a sparse kernel)."""
        g, router = self.g, block.gate
        logits = g.op("MatMul", x, g.const(_f32(router.weight).T.copy(), prefix + ".gate.weight_t"))
        probs = g.op("Softmax", logits, axis=-1)
        top, _ = g.op("TopK", probs, g.const(np.array([router.top_k], np.int64)), axis=-1, outputs=2)
        kth = g.op("Slice", top, g.const(np.array([router.top_k - 1], np.int64)),
                   g.const(np.array([router.top_k], np.int64)), g.const(np.array([-1], np.int64)))
        w = g.op("Mul", probs, g.op("Cast", g.op("GreaterOrEqual", probs, kth), to=1))
        if getattr(router, "norm_topk_prob", True):  # mixtral always renormalises; qwen2_moe by its config
            w = g.op("Div", w, g.op("ReduceSum", w, g.const(np.array([-1], np.int64)), keepdims=1))
        y = None
        for e in range(len(block.experts)):
            w_e = g.op("Slice", w, g.const(np.array([e], np.int64)), g.const(np.array([e + 1], np.int64)),
                       g.const(np.array([-1], np.int64)))
            y_e = g.op("Mul", self.mlp(x, f"{prefix}.experts.{e}"), w_e)
            y = y_e if y is None else g.op("Add", y, y_e)
        if getattr(block, "shared_expert", None) is not None:
            gate = g.op("Sigmoid", g.op("MatMul", x, g.const(_f32(block.shared_expert_gate.weight).T.copy(),
                                                             prefix + ".shared_expert_gate.weight_t")))
            y = g.op("Add", y, g.op("Mul", self.mlp(x, prefix + ".shared_expert"), gate))
        return y

    # rotary types whose frequencies do not depend on the sequence length: computed in the graph from inv_freq
    STATIC_ROPE = ("default", "linear", "llama3", "yarn")

    def positions(self, ids: str) -> tuple[str, str, str]:
        """cos, sin (S, D) and the additive mask (S, T) or (B, 1, S, T) for positions past .. past+S-1
        attending to keys 0 .. T-1 (T = past + S; past = 0 without a KV cache). Both are computed in the graph
        from the positions (no table of max_position_embeddings rows: a 128k-position model's mask alone would
        be 64 GiB); a rotary type whose frequencies change with the length (dynamic NTK, longrope) falls back
        to a cos/sin table, which is linear in the positions."""
        g, inner = self.g, self.model.model
        rope = inner.rotary_emb
        neg = np.finfo(np.float32).min
        one, two, zero = (g.const(np.array([v], np.int64)) for v in (1, 2, 0))
        seq = g.op("Slice", g.op("Shape", ids), one, two, zero)
        past = g.op("Slice", g.op("Shape", self.past(0, "key")), two, g.const(np.array([3], np.int64)), zero) \
            if self.kv_cache else zero
        total = g.op("Add", past, seq)
        scalar = lambda t: g.op("Squeeze", t, g.const(np.array([0], np.int64)))  # noqa: E731
        step = g.const(np.array(1, np.int64))
        rows = g.op("Range", scalar(past), scalar(total), step)  # (S,) query positions
        cols = g.op("Range", g.const(np.array(0, np.int64)), scalar(total), step)  # (T,) key positions
        if getattr(rope, "rope_type", "default") in self.STATIC_ROPE:
            freqs = g.op("Mul", g.op("Unsqueeze", g.op("Cast", rows, to=1), g.const(np.array([1], np.int64))),
                         g.const(_f32(rope.inv_freq)[None, :], "rope_inv_freq"))
            emb = g.op("Concat", freqs, freqs, axis=-1)
            scale = g.const(np.array(float(getattr(rope, "attention_scaling", 1.0)), np.float32))
            cos_s, sin_s = g.op("Mul", g.op("Cos", emb), scale), g.op("Mul", g.op("Sin", emb), scale)
        else:
            n_pos = self.cfg.max_position_embeddings
            with torch.no_grad():
                cos, sin = rope(torch.zeros(1, 1, self.hd), torch.arange(n_pos).unsqueeze(0))
            cos_s = g.op("Slice", g.const(_f32(cos[0]), "rope_cos"), past, total, zero)
            sin_s = g.op("Slice", g.const(_f32(sin[0]), "rope_sin"), past, total, zero)
        later = g.op("Greater", g.op("Unsqueeze", cols, zero), g.op("Unsqueeze", rows, one))  # key after query
        mask_s = g.op("Where", later, g.const(np.array(neg, np.float32)), g.const(np.array(0, np.float32)))
        if self.kv_cache:  # padding: (1 - attention_mask) * min on the key axis, clamped so sums stay finite
            keep = g.op("Cast", "attention_mask", to=1)
            pad = g.op("Mul", g.op("Sub", g.const(np.array(1, np.float32)), keep), g.const(np.array(neg, np.float32)))
            pad = g.op("Unsqueeze", pad, g.const(np.array([1, 2], np.int64)))
            mask_s = g.op("Max", g.op("Add", mask_s, pad), g.const(np.array(neg, np.float32)))
        return cos_s, sin_s, mask_s

    def past(self, i: int, kv: str) -> str:
        return f"past_key_values.{i}.{kv}"

    def build(self):
        from onnx import TensorProto, helper

        g, inner = self.g, self.model.model
        ids = "input_ids"
        cos, sin, mask = self.positions(ids)
        h = g.op("Gather", g.const(_f32(inner.embed_tokens.weight), "embed_tokens"), ids)
        for i, layer in enumerate(inner.layers):
            p = f"model.layers.{i}"
            h = g.op("Add", h, self.attention(self.rmsnorm(h, layer.input_layernorm), p + ".self_attn",
                                              layer.self_attn, cos, sin, mask, i))
            x = self.rmsnorm(h, layer.post_attention_layernorm)
            if isinstance(getattr(layer.mlp, "experts", None), int):  # a PrunePath FFN (experts: how many)
                y = self.routed_mlp(x, p + ".mlp", layer.mlp)
            elif getattr(layer.mlp, "experts", None) is not None:
                y = self.moe(x, p + ".mlp", layer.mlp)
            else:
                y = self.mlp(x, p + ".mlp")
            h = g.op("Add", h, y)
        logits = self.linear(self.rmsnorm(h, inner.norm), "lm_head")
        inputs = [helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "seq"])]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", self.cfg.vocab_size])]
        for src, name in [(logits, "logits"), *self.presents]:
            g.nodes.append(helper.make_node("Identity", [src], [name], name=name))
        if self.kv_cache:
            nkv = self.cfg.num_key_value_heads
            inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]))
            for i in range(len(inner.layers)):
                for kv in ("key", "value"):
                    inputs.append(helper.make_tensor_value_info(self.past(i, kv), TensorProto.FLOAT,
                                                                ["batch", nkv, "past", self.hd]))
                    outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                                 ["batch", nkv, "total", self.hd]))
        graph = helper.make_graph(g.nodes, "compress", inputs, outputs, g.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                       helper.make_opsetid("com.microsoft", 1)])


def export_onnx(model, qweights: dict[str, QuantizedWeight], out_dir: str | Path, meta: dict | None = None,
                kv_cache: bool = False) -> dict:
    """Write `out_dir/model.onnx` (weights inline, or in `model.onnx.data` above 1.5 GB); returns path, bytes.
    `kv_cache`: attention_mask and past/present key-value inputs and outputs (module docstring)."""
    import onnx

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise BadInput(f"the onnx export supports model types {', '.join(MODEL_TYPES)}, not `{model_type}`; "
                       "drop `onnx` from export.formats")
    builder = LlamaOnnx(model, qweights, kv_cache)
    proto = builder.build()
    if builder.dense:
        logger.warning("onnx: %d quantized layers written as dense MatMuls (not MatMulNBits-expressible): %s",
                       len(builder.dense), ", ".join(builder.dense[:5]))
    info = {"format": FORMAT, "version": FORMAT_VERSION, "meta": meta or {}, "dense_layers": builder.dense,
            "kv_cache": kv_cache}
    onnx.helper.set_model_props(proto, {"compress.format": FORMAT, "compress.version": str(FORMAT_VERSION),
                                        "compress.meta": json.dumps(info)})
    out = Path(out_dir)
    large = proto.ByteSize() > EXTERNAL_DATA_BYTES
    with staged_directory(out, marker="model.onnx") as tmp:  # a kill leaves no half-written model.onnx
        onnx.save_model(proto, str(tmp / "model.onnx"), save_as_external_data=large, location="model.onnx.data")
    nbytes = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model.onnx"))
    return {"path": str(out / "model.onnx"), "bytes": nbytes, "dense_layers": len(builder.dense)}
