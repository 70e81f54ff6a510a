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


def quantizable(name: str, ndim: int) -> bool:
    """llama.cpp's tensor_allows_quantization for the families written here."""
    return ndim >= 2 and name.endswith("weight") and "_norm.weight" not in name and "ffn_gate_inp.weight" not in name


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def plan(file_type: str, tensors: list[tuple[str, tuple[int, ...]]], *, n_head: int, n_head_kv: int,
         n_expert: int = 0) -> dict[str, str]:
    """{gguf tensor name: GGML type name} for `tensors` [(name, shape as (rows, ne0) / (experts, rows, ne0))] in
    file order."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown GGUF type `{file_type}`; choose one of {', '.join(FILE_TYPES)}")
    default = FILE_TYPES[file_type][0]
    names = [n for n, _ in tensors]
    tied = "output.weight" not in names
    n_v = sum(1 for n in names if n.endswith("attn_v.weight"))
    n_down = sum(1 for n in names if re.search(r"ffn_down(_exps)?\.weight$", n))
    gqa = n_head // max(n_head_kv, 1)
    i_v = i_down = 0
    out = {}
    for name, shape in tensors:
        if not quantizable(name, len(shape)):
            out[name] = "F32"
            continue
        if default in FLOAT:
            out[name] = default
            continue
        ne0, t = shape[-1], default
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            from compress.kernels.ggml import block_size

            t = "Q8_0" if ne0 % block_size(default) or default == "Q8_0" else "Q6_K"
        elif name.endswith("attn_v.weight"):
            if file_type == "Q2_K":
                t = "Q4_K" if gqa >= 4 else "Q3_K"
            elif file_type == "Q3_K_M":
                t = "Q5_K" if i_v < 2 else "Q4_K"
            elif file_type == "Q4_K_M" and _more_bits(i_v, n_v):
                t = "Q6_K"
            if n_expert == 8:
                t = "Q8_0"
            i_v += 1
        elif name.endswith("attn_k.weight") and n_expert == 8:
            t = "Q8_0"
        elif re.search(r"ffn_down(_exps)?\.weight$", name):
            layer, n_layer = i_down, n_down  # one ffn_down tensor per layer in every family written here
            if file_type == "Q2_K":
                t = "Q3_K"
            elif file_type == "Q3_K_M":
                t = "Q5_K" if layer < n_layer // 16 else "Q4_K"
            elif file_type == "Q4_K_M" and _more_bits(layer, n_layer):
                t = "Q6_K"
            i_down += 1
        elif name.endswith("attn_output.weight"):
            if n_expert == 8:
                if file_type in ("Q2_K", "Q3_K_M", "Q4_K_M"):
                    t = "Q5_K"
            elif file_type == "Q2_K":
                t = "Q3_K"
            elif file_type == "Q3_K_M":
                t = "Q4_K"
        out[name] = fallback(t, ne0)
    return out


def fallback(t: str, ne0: int) -> str:
    """tensor_type_fallback: a type whose block divides the width (F16 when none does)."""
    if t in FLOAT:
        return t
    from compress.kernels.ggml import fallback_type

    c = fallback_type(t, ne0)
    return "F16" if c is None else c.name
