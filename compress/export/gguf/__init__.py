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


def tensor_plan(model, file_type: str, types: dict[str, str] | None = None,
                ) -> tuple[list[tuple[str, str, tuple[int, ...]]], dict[str, str]]:
    """[(HF name, GGUF name, shape)] in file order and {GGUF name: type}. A GGUF tensor made of several of the
    model's tensors (stacked experts) has an entry per source, with that source's part of the shape (rows, ne0),
    so the entries' sizes add up to the file's. `types` {HF layer: type}: the types a quantize stage rounded
    layers on (its `gguf` and its overrides' `gguf`), which replace llama.cpp's choice for their tensors."""
    entries, plan, _ = _plan(model, file_type, types)
    return entries, plan


def layer_types(model, file_type: str) -> dict[str, str]:
    """{HF layer name (no `.weight`): the GGML type the file stores its weight in}."""
    entries, plan = tensor_plan(model, file_type)
    return {hf.removesuffix(".weight"): plan[g] for hf, g, _ in entries if hf.endswith(".weight")}


def _plan(model, file_type: str, types: dict[str, str] | None = None):
    config = model.config
    fam, tensors = archs.layout(model)
    entries = []
    for t in tensors:
        rows: dict[str, int] = {}
        for p in t.parts:
            rows[p.source] = rows.get(p.source, 0) + int(np.prod(p.shape[:-1]))
        entries += [(src, t.name, (r, t.shape[-1])) for src, r in rows.items()]
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    plan = gtypes.plan(file_type, [(t.name, t.shape) for t in tensors], n_head=config.num_attention_heads,
                       n_head_kv=kv, n_expert=archs.n_experts(config, fam))
    for t in tensors if types else ():
        chosen = {types[s] for s in {p.source.removesuffix(".weight") for p in t.parts} if s in types}
        if len(chosen) > 1:
            raise ValueError(f"{t.name} is one tensor in the file, stored at one type, but its parts were rounded "
                             f"on {', '.join(sorted(chosen))}")
        if chosen:
            plan[t.name] = chosen.pop()
    return entries, plan, (fam, tensors)


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
    grids = {n: qw.grid.type.name for n, qw in qweights.items() if qw.grid is not None}
    _, plan, (fam, tensors) = _plan(model, file_type, grids)
    if fam.arch == "phi3" and "<|endoftext|>" not in tokenizer.get_vocab():
        from compress.errors import BadInput

        raise BadInput("llama.cpp's phi3 looks up the token `<|endoftext|>` when it loads a file, and this tokenizer "
                       "has none: llama.cpp would not load the GGUF")
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
        how = vocabs.add_vocab(writer, tok_dir, config.vocab_size)  # the files llama.cpp's converter would read
    else:
        with tempfile.TemporaryDirectory(prefix="compress-gguf-tok-") as tmp_tok:
            tokenizer.save_pretrained(tmp_tok)
            how = vocabs.add_vocab(writer, Path(tmp_tok), config.vocab_size)
    if fam.norm_shift and how == "spm":  # Gemma(2|3)Model.set_vocab
        writer.add_add_space_prefix(False)
    state = model.state_dict()
    held = source_blocks(source) if source is not None else {}
    from_codes, kept, counts = 0, 0, {}
    for ft in tensors:
        t = plan[ft.name]
        coded = [_coded(p, t, file_type, qweights, config, fam) for p in ft.parts]
        if all(c is not None for c in coded):
            data = coded[0] if len(ft.shape) < 3 else np.stack(coded)
            from_codes += len(coded)
        else:
            ws = [_float(p, state, config, fam) for p in ft.parts]
            data = None
            if ft.name in held and not any(c is not None for c in coded):
                data = _unchanged(t, torch.cat(ws).reshape(-1, ft.shape[-1]), held[ft.name])
                kept += data is not None
            if data is None:
                pieces = [c if c is not None else
                          _encode(t, w.numpy(), None if imatrix is None else imatrix.get(p.layer))
                          for c, w, p in zip(coded, ws, ft.parts)]
                data = pieces[0] if len(ft.shape) < 3 else np.stack(pieces)
                from_codes += sum(c is not None for c in coded)
        writer.add_tensor(ft.name, np.ascontiguousarray(data), raw_dtype=gguf.GGMLQuantizationType[t])
        counts[t] = counts.get(t, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp_path, path)
    (out_dir / "Modelfile").write_text(f"FROM ./{path.name}\n")
    return {"path": str(out_dir), "file": path.name, "type": file_type, "types": counts,
            "bytes": path.stat().st_size, "from_codes": from_codes, "from_source": kept}


def _coded(part, t: str, file_type: str, qweights, config, fam) -> np.ndarray | None:
    """The raw blocks of one 2-D part of a file tensor written from its quantized layer's codes, or None (a layer
    compress did not quantize, or a file type that stores it in floating point)."""
    qw = qweights.get(part.layer) if part.source.endswith(".weight") and not part.index else None
    if qw is None or (qw.grid is None and t in gtypes.FLOAT):
        return None
    perm = archs.permutation(part.layer, config, fam, part.shape[0])
    if qw.grid is not None:
        if qw.grid.type.name != t:
            raise ValueError(f"`{part.layer}` was rounded on {qw.grid.type.name} blocks, but the {file_type} file "
                             f"stores it as {t}")
        from compress.kernels import ggml
        from compress.quantize import ggml_grid

        return ggml.pack(t, ggml_grid.blocks(qw, None if perm is None else perm.numpy()))
    if code_type(qw) != t:
        raise ValueError(f"`{part.layer}` was quantized at {qw.bits} bits, group {qw.group_size}, "
                         f"{'sym' if qw.sym else 'asym'}, which GGUF type {t} does not hold")
    return _from_codes(t, qw, perm)


def _float(part, state, config, fam) -> torch.Tensor:
    """One 2-D part of a file tensor in float32, as llama.cpp's converter transforms it (q/k row order, Gemma's
    norm offset)."""
    w = archs.part_tensor(state, part).detach().float()
    perm = archs.permutation(part.layer, config, fam, w.shape[0]) if part.source.endswith("weight") else None
    if perm is not None:
        w = w[perm]
    if fam.norm_shift and part.source.endswith("norm.weight"):
        w = w + 1  # Gemma's RMSNorm scales by 1 + weight; llama.cpp's by the stored weight
    return w


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
