"""The servability table of a run: from its plan before any calibration, and from the checkpoint it wrote.

`planned(adapter, export_spec, quantized, widths, mixed)` builds the `rules.Checkpoint` the recipe will produce (the
bind step's layer plans; for an `allocate` plan, every layer at the narrowest container it may get), `check(...)` refuses at plan time a plan an engine of `export.serve` cannot serve, and `written(model,
qweights, exports)` builds it from the QuantizedWeights and the export results after the run (exact widths).
"""

from __future__ import annotations

from types import SimpleNamespace

from compress.errors import BadInput
from compress.serve import rules

def planned(adapter, export_spec, quantized, widths: set, mixed: bool, scheme: str | None = None,
            kv: tuple[str, str] | None = None) -> rules.Checkpoint:
    """The checkpoint the plan will write (`quantized`: the bind step's (index, method, rounding, {name: LayerSpec})
    of every quantize stage; `widths`: every width a layer may end up with; `mixed`: an allocation plan gives
    per-chunk widths: `_stored_width`; `scheme`: the quantize stages' weight-and-activation scheme, which only the
    compressed-tensors export writes, and `kv` its KV cache (type, scales))."""
    from compress.export.hf import why_dense
    from compress.export.layouts import choose, containers
    from compress.export.stage import export_dtype

    names = export_spec.names()
    hf = export_spec.config("hf") if "hf" in names else None
    layers = {}
    for *_, specs in quantized:
        for name, spec in specs.items():
            if spec.ggml is not None:
                continue  # llama.cpp blocks: only the gguf export stores them (bind.planned refuses the others)
            lin = adapter.model.get_submodule(name)
            if spec.bits == 1 or why_dense(lin.out_features, lin.in_features, spec.group_size):
                continue  # stored dense: every engine reads a dense layer
            bits = _stored_width(widths, hf.container if hf is not None else None) if mixed else spec.bits
            layers[name] = SimpleNamespace(bits=bits, group_size=spec.group_size, sym=spec.sym,
                                           out_features=lin.out_features, in_features=lin.in_features)
    packing, wide = None, {}
    if hf is not None and layers:
        wide = containers(layers, hf.container)
        try:
            packing, _ = choose(layers, hf.packing, wide)
        except ValueError as e:
            raise BadInput(f"export hf: {e}") from e
    return rules.Checkpoint(
        layers=[rules.Layer(n, q.out_features, q.in_features, wide.get(n, q.bits), q.group_size, q.sym)
                for n, q in layers.items()],
        packing=packing if hf is not None else None,
        dtype=export_dtype(adapter.arch, hf) if hf is not None else "float16",
        model_type=adapter.model_type, experts=any(".experts." in n for n in layers), graphs=_graphs(export_spec),
        gguf=export_spec.config("gguf").type if "gguf" in names else None,
        scheme=scheme if "compressed-tensors" in names else None,
        kv=kv if "compressed-tensors" in names else None,
        scheme_dtype=export_dtype(adapter.arch, export_spec.config("compressed-tensors"))
        if "compressed-tensors" in names else "float16")


def _stored_width(widths: set, container: int | None) -> int:
    """The width a layer of a mixed plan is stored at, before the allocation runs: its widest chunk, which may be
    any of the plan's widths, raised to `container`; when that leaves several, the narrowest (the check holds for
    every layer the allocation can produce)."""
    stored = {max(b, container or 0) for b in widths if b not in (1, 16)}
    return min(stored)


def written(qweights: dict, exports: dict, model_type: str) -> rules.Checkpoint:
    """The checkpoint a run wrote: its hf export's packed layers at their stored widths, packing and dtype."""
    from compress.export.hf import loadable
    from compress.export.layouts import containers

    hf, ct = exports.get("hf") or {}, exports.get("compressed-tensors") or {}
    packed = {n: q for n, q in qweights.items() if loadable(q)} if hf.get("packing") else {}
    wide = containers(packed, hf.get("container"))
    return rules.Checkpoint(
        layers=[rules.Layer(n, q.out_features, q.in_features, wide.get(n, q.bits), q.group_size, q.sym)
                for n, q in packed.items()],
        packing=hf.get("packing"), dtype=hf.get("dtype", "float16"), model_type=model_type,
        experts=any(".experts." in n for n in packed),
        graphs={k: {"genai": _runs_genai(k, v)} for k, v in exports.items() if k in ("onnx", "openvino")},
        gguf=(exports.get("gguf") or {}).get("type"), scheme=ct.get("scheme"),
        scheme_dtype=ct.get("dtype", "float16"), kv=tuple(ct["kv_cache"]) if ct.get("kv_cache") else None)


def _runs_genai(fmt: str, result: dict) -> bool:
    """Whether the export result is a directory its GenAI engine runs: onnx with genai_config.json (the torch graph
    with `kv_cache` + `genai_config`, or the builder's), openvino stateful."""
    if fmt == "openvino":
        return bool(result.get("stateful"))
    return bool(result.get("genai_config")) or result.get("graph") != "torch"


def _graphs(export_spec) -> dict:
    out = {}
    for fmt in ("onnx", "openvino"):
        if fmt in export_spec.names():
            cfg = export_spec.config(fmt)
            kv = bool(getattr(cfg, "kv_cache", False))
            genai = kv and cfg.stateful if fmt == "openvino" else getattr(cfg, "builder", "") == "genai" or (
                kv and cfg.genai_config)
            out[fmt] = {"genai": bool(genai)}
    return out


def check(ckpt: rules.Checkpoint, serve: list[str]) -> dict[str, list[rules.Problem]]:
    """The table; BadInput when an engine the recipe requires (`export.serve`) cannot serve the plan."""
    rows = rules.table(ckpt)
    bad = [(e, rows[e]) for e in serve if rows[e]]
    if bad:
        lines = [f"  {e}: " + "; ".join(str(p) for p in problems) for e, problems in bad]
        raise BadInput("export.serve: the plan writes a checkpoint that " + ", ".join(e for e, _ in bad) +
                       " cannot serve:\n" + "\n".join(lines))
    return rows
