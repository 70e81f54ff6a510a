"""Which GGML type each tensor of a GGUF file gets: llama.cpp's own choice (`src/llama-quant.cpp`,
`llama_tensor_get_type_impl` and `tensor_type_fallback`, llama.cpp as vendored by llama-cpp-python 0.3.36), for the
file types the export writes, so a compress file and llama.cpp's quantize of the same model hold the same types.

- what is quantized at all: 2-D `*.weight` tensors except norms (1-D tensors stay F32);
- the output (and a tied token embedding, which llama.cpp uses as the output) is Q6_K unless the type is Q8_0, or
  Q8_0 when its width is not a multiple of the block;
- Q4_K_M: attn_v and ffn_down of the "more bits" layers (the first and last eighth, every third between) are Q6_K;
- Q3_K_M: attn_v Q5_K for the first two, else Q4_K; ffn_down Q5_K in the first 1/16 of the layers, else Q4_K;
  attn_output Q4_K;
- Q2_K: attn_v Q4_K with a grouped-query ratio >= 4, else Q3_K; ffn_down and attn_output Q3_K;
- MoE: with 8 experts attn_v and attn_k are Q8_0 and attn_output Q5_K in the K mixes; the experts' and shared
  experts' ffn_down take the layer in their name; routers (`ffn_gate_inp`) and 1-D tensors stay F32; phi3's fused
  attn_qkv follows the attn_v rules (checked against llama.cpp's own quantize, tests/export/test_gguf_families.py);
- a tensor whose width (ne0, the input columns) the chosen block does not divide falls back (Q2_K/Q3_K -> Q4_0,
  Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; F16 when that does not divide either).
"""

from __future__ import annotations

import re

# file type -> (the default tensor type, llama.cpp's LLAMA_FTYPE value for general.file_type)
FILE_TYPES = {
    "F32": ("F32", 0), "F16": ("F16", 1), "BF16": ("BF16", 32), "Q8_0": ("Q8_0", 7),
    "Q4_0": ("Q4_0", 2), "Q4_1": ("Q4_1", 3), "Q5_0": ("Q5_0", 8), "Q5_1": ("Q5_1", 9),
    "Q6_K": ("Q6_K", 18), "Q5_K": ("Q5_K", 16), "Q4_K": ("Q4_K", 14), "Q3_K": ("Q3_K", 11),
    "Q2_K": ("Q2_K", 10), "Q4_K_M": ("Q4_K", 15), "Q3_K_M": ("Q3_K", 12),
}
# Q5_K, Q4_K, Q3_K written alone are llama.cpp's Q5_K_S, Q4_K_S, Q3_K_S file types without their per-tensor bumps:
# every quantized tensor at that type (the output as above)
FLOAT = {"F32", "F16", "BF16"}


def n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims of a tensor of torch `shape`: trailing axes of size 1 in ggml's order (leading in torch's) do not
    count (qwen2_moe's (1, hidden) `ffn_gate_inp_shexp` is 1-D)."""
    ne = list(reversed(shape))
    for i in range(len(ne) - 1, 0, -1):
        if ne[i] > 1:
            return i + 1
    return 1


def quantizable(name: str, shape) -> bool:
    """llama.cpp's tensor_allows_quantization for the families written here (`shape`: torch order; an int is read
    as the number of dimensions)."""
    ndim = shape if isinstance(shape, int) else n_dims(tuple(shape))
    return ndim >= 2 and name.endswith("weight") and "_norm.weight" not in name and "ffn_gate_inp.weight" not in name


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def plan(file_type: str, tensors: list[tuple[str, tuple[int, ...]]], *, n_head: int, n_head_kv: int,
         n_expert: int = 0) -> dict[str, str]:
    """{gguf tensor name: GGML type name} for `tensors` [(name, shape as (rows, ne0) / (experts, rows, ne0))] in
    file order. The categories are llama-quant.cpp's (`tensor_get_category`: a name containing `attn_qkv.weight`,
    `attn_v.weight`, ..., `ffn_up`, `ffn_gate`, `ffn_down`, so the experts' and shared experts' tensors count as
    FFN ones); attn_qkv (phi3) is an attn_v-like tensor; with experts (`n_expert` > 1) a tensor's layer is the one in
    its name, else its rank among its kind."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown GGUF type `{file_type}`; choose one of {', '.join(FILE_TYPES)}")
    default = FILE_TYPES[file_type][0]
    names = [n for n, _ in tensors]
    tied = "output.weight" not in names
    attn_v = ("attn_v.weight", "attn_qkv.weight")
    n_v = sum(1 for n in names if any(k in n for k in attn_v))
    blocks = [int(m.group(1)) for n in names if (m := re.match(r"blk\.(\d+)\.", n))]
    n_layer = max(blocks) + 1 if blocks else 0
    gqa = n_head // max(n_head_kv, 1)
    i_v = i_down = 0
    out = {}
    for name, shape in tensors:
        if not quantizable(name, shape):
            out[name] = "F32"
            continue
        if default in FLOAT:
            out[name] = default
            continue
        ne0, t = shape[-1], default
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            from compress.kernels.ggml import block_size

            t = "Q8_0" if ne0 % block_size(default) or default == "Q8_0" else "Q6_K"
        elif name == "token_embd.weight":
            pass
        elif any(k in name for k in attn_v):
            if file_type == "Q2_K":
                t = "Q4_K" if gqa >= 4 else "Q3_K"
            elif file_type == "Q3_K_M":
                t = "Q5_K" if i_v < 2 else "Q4_K"
            elif file_type == "Q4_K_M" and _more_bits(i_v, n_v):
                t = "Q6_K"
            if n_expert == 8:
                t = "Q8_0"
            i_v += 1
        elif "attn_k.weight" in name:
            if n_expert == 8:
                t = "Q8_0"
        elif "attn_q.weight" in name:
            pass
        elif "attn_output.weight" in name:
            if n_expert == 8:
                if file_type in ("Q2_K", "Q3_K_M", "Q4_K_M"):
                    t = "Q5_K"
            elif file_type == "Q2_K":
                t = "Q3_K"
            elif file_type == "Q3_K_M":
                t = "Q4_K"
        elif "ffn_up" in name or "ffn_gate" in name:
            pass
        elif "ffn_down" in name:
            layer = int(re.match(r"blk\.(\d+)\.", name).group(1)) if n_expert > 1 else i_down
            if file_type == "Q2_K":
                t = "Q3_K"
            elif file_type == "Q3_K_M":
                t = "Q5_K" if layer < n_layer // 16 else "Q4_K"
            elif file_type == "Q4_K_M" and _more_bits(layer, n_layer):
                t = "Q6_K"
            i_down += 1
        out[name] = fallback(t, ne0)
    return out


def fallback(t: str, ne0: int) -> str:
    """tensor_type_fallback: a type whose block divides the width (F16 when none does)."""
    if t in FLOAT:
        return t
    from compress.kernels.ggml import fallback_type

    c = fallback_type(t, ne0)
    return "F16" if c is None else c.name
