"""The `gguf` export: one GGUF file llama.cpp, Ollama and LM Studio run (docs/gguf.md).

`export_gguf(model, qweights, tokenizer, out_dir, file_type=...)` writes `model-<TYPE>.gguf` and an Ollama
`Modelfile` beside it, with the `gguf` package's writer: the architecture's hyperparameters and tensor names
(`arch.py`), the tokenizer as llama.cpp's converter writes it (`vocab.py`), and every tensor at the type llama.cpp's
quantize would give it (`types.py`). A layer compress quantized is written from its codes, exactly: rounded on the type's own blocks
(a quantize stage's `gguf: TYPE`, compress/quantize/ggml_grid.py), or on compress's integer grid where that is the
type's (sym 8/5/4-bit group 32 is Q8_0/Q5_0/Q4_0); both checked at plan time. Every other quantized tensor is rounded
by llama.cpp's own reference quantizer (`compress.kernels.ggml`), optionally with an importance matrix.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from compress.export.gguf import arch as archs
from compress.export.gguf import types as gtypes
from compress.export.gguf import vocab as vocabs
from compress.qweight import QuantizedWeight

# the legacy types compress's own symmetric grid is exactly: bits -> GGML type (group 32)
FROM_CODES = {8: "Q8_0", 5: "Q5_0", 4: "Q4_0"}


def grid_type(bits: int, group_size: int, sym: bool) -> str | None:
    """The GGML type whose grid compress's (bits, group_size, sym) rounding is, or None."""
    return FROM_CODES.get(bits) if sym and group_size == 32 else None


def code_type(qw: QuantizedWeight) -> str | None:
    """The GGML type that holds `qw` exactly, or None."""
    if qw.grid is not None:
        return qw.grid.type.name
    return None if qw.mixed or qw.in_features % 32 else grid_type(qw.bits, qw.group_size, qw.sym)


def file_name(file_type: str) -> str:
    return f"model-{file_type}.gguf"


def tensor_plan(model, file_type: str) -> tuple[list[tuple[str, str, tuple[int, ...]]], dict[str, str]]:
    """[(HF name, GGUF name, shape)] in file order and {GGUF name: type}."""
    config = model.config
    fam = archs.family(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    entries = []
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        entries.append((name, archs.tensor_name(name, fam.arch, config.num_hidden_layers), tuple(t.shape)))
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    plan = gtypes.plan(file_type, [(g, s) for _, g, s in entries], n_head=config.num_attention_heads, n_head_kv=kv)
    return entries, plan


def layer_types(model, file_type: str) -> dict[str, str]:
    """{HF layer name (no `.weight`): the GGML type the file stores its weight in}."""
    entries, plan = tensor_plan(model, file_type)
    return {hf.removesuffix(".weight"): plan[g] for hf, g, _ in entries if hf.endswith(".weight")}


def planned_bytes(entries, plan: dict[str, str]) -> int:
    """The tensor bytes a file of `plan` holds (the header and vocabulary aside)."""
    import gguf

    total = 0
    for _, name, shape in entries:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[plan[name]]]
        total += int(np.prod(shape)) // block * size
    return total


def source_blocks(path) -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF tensor name: (type, raw blocks)} of the quantized tensors of a GGUF file the model was read from."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in reader.tensors
            if t.tensor_type.name not in gtypes.FLOAT}


def _unchanged(t: str, w: torch.Tensor, source) -> np.ndarray | None:
    """The source file's blocks of this tensor when they are at type `t` and hold exactly `w` (no stage changed it):
    written back as they were, so GGUF -> compress -> GGUF keeps every untouched tensor's bytes (a K-quant's search
    on its own dequantized values does not always find the same blocks again)."""
    if source is None or source[0] != t:
        return None
    from compress.kernels import ggml

    raw = source[1]
    try:
        held = ggml.dequantize(t, ggml.unpack(t, raw.reshape(-1), tuple(w.shape)))
    except ValueError:
        return None
    return raw if np.array_equal(held, w.numpy()) else None


def export_gguf(model, qweights: dict[str, QuantizedWeight], tokenizer, out_dir, *, file_type: str,
                imatrix: dict[str, torch.Tensor] | None = None, meta: dict | None = None, source=None) -> dict:
    """Write `out_dir/model-<file_type>.gguf` (and `Modelfile`); returns {"path", "file", "type", "types", "bytes",
    "from_codes", "from_source"}. `source`: the GGUF file the model was read from, whose blocks are kept for every
    tensor that is still exactly what they hold (`_unchanged`)."""
    import tempfile

    import gguf

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    fam = archs.family(config)
    entries, plan = tensor_plan(model, file_type)
    path = out_dir / file_name(file_type)
    tmp_path = path.with_suffix(".gguf.partial")
    writer = gguf.GGUFWriter(tmp_path, fam.arch)
    writer.add_name((meta or {}).get("name") or Path(str(getattr(config, "_name_or_path", "") or "model")).name)
    archs.hparams(writer, config, fam)
    writer.add_file_type(gtypes.FILE_TYPES[file_type][1])
    if file_type not in gtypes.FLOAT:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tok_dir = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if any((tok_dir / f).is_file() for f in ("tokenizer.model", "tokenizer.json")):
        vocabs.add_vocab(writer, tok_dir, config.vocab_size)  # the files llama.cpp's converter would read
    else:
        with tempfile.TemporaryDirectory(prefix="compress-gguf-tok-") as tok_dir:
            tokenizer.save_pretrained(tok_dir)
            vocabs.add_vocab(writer, Path(tok_dir), config.vocab_size)
    state = model.state_dict()
    held = source_blocks(source) if source is not None else {}
    from_codes, kept, counts = 0, 0, {}
    for hf_name, g_name, _ in entries:
        layer = hf_name.removesuffix(".weight")
        t = plan[g_name]
        perm = archs.permutation(layer, config, fam, state[hf_name].shape[0]) if hf_name.endswith("weight") else None
        qw = qweights.get(layer)
        if qw is not None and qw.grid is not None:
            if qw.grid.type.name != t:
                raise ValueError(f"`{layer}` was rounded on {qw.grid.type.name} blocks, but the {file_type} file "
                                 f"stores it as {t}")
            from compress.kernels import ggml
            from compress.quantize import ggml_grid

            data = ggml.pack(t, ggml_grid.blocks(qw, None if perm is None else perm.numpy()))
            from_codes += 1
        elif qw is not None and t not in gtypes.FLOAT:
            if code_type(qw) != t:
                raise ValueError(f"`{layer}` was quantized at {qw.bits} bits, group {qw.group_size}, "
                                 f"{'sym' if qw.sym else 'asym'}, which GGUF type {t} does not hold")
            data = _from_codes(t, qw, perm)
            from_codes += 1
        else:
            w = state[hf_name].detach().float()
            if perm is not None:
                w = w[perm]
            data = None if t in gtypes.FLOAT else _unchanged(t, w, held.get(g_name))
            if data is None:
                data = _encode(t, w.numpy(), None if imatrix is None else imatrix.get(layer))
            else:
                kept += 1
        writer.add_tensor(g_name, data, raw_dtype=gguf.GGMLQuantizationType[t])
        counts[t] = counts.get(t, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp_path, path)
    (out_dir / "Modelfile").write_text(f"FROM ./{path.name}\n")
    return {"path": str(out_dir), "file": path.name, "type": file_type, "types": counts,
            "bytes": path.stat().st_size, "from_codes": from_codes, "from_source": kept}


def _encode(t: str, w: np.ndarray, imatrix) -> np.ndarray:
    """The raw data of fp32 `w` (rows, ne0) at type `t` (llama.cpp's reference rounding for quantized types)."""
    import gguf

    if t == "F32":
        return np.ascontiguousarray(w, dtype=np.float32)
    if t == "F16":
        return w.astype(np.float16)
    if t == "BF16":
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16)
    from compress.kernels import ggml

    return ggml.pack(t, ggml.quantize_ref(t, w, None if imatrix is None else np.asarray(imatrix, dtype=np.float32)))


def _from_codes(t: str, qw: QuantizedWeight, perm) -> np.ndarray:
    """The raw blocks of a compress weight on type `t`'s grid, exactly: d = its fp16 scale; Q4_0 / Q5_0 store the
    code itself (x = d (q - 2^(b-1)), the zero compress's symmetric grid has), Q8_0 the signed code - 128."""
    from compress.kernels import ggml

    codes, scales = qw.codes, qw.scales
    if perm is not None:
        codes, scales = codes[perm], scales[perm]
    q = codes.to(torch.int16) - (128 if t == "Q8_0" else 0)
    blocks = ggml.GGMLBlocks(type=ggml.ggml_type(t), d=scales.numpy().astype(np.float16),
                             codes=q.to(torch.int8).numpy())
    return ggml.pack(t, blocks)
