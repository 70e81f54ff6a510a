"""`compress inspect`: what an exported checkpoint holds, read back from its own metadata."""

from __future__ import annotations

from pathlib import Path

from compress.errors import BadInput
from compress.verify import verify_artifact


def inspect_checkpoint(directory: Path) -> dict:
    from compress.export.hf import read_quantized

    directory = _export_of(Path(directory))
    if not (directory / "config.json").exists():
        raise BadInput(f"`{directory}` is not a checkpoint directory (no config.json)")
    verify_artifact(directory)
    config, qweights = read_quantized(directory)
    meta = (config.get("compress") or {}).get("meta") or {}
    rows = [
        {"name": n, "shape": f"{q.out_features}x{q.in_features}", "bits": q.bits, "group_size": q.group_size,
         "sym": q.sym, "effective_bits": q.effective_bits()}
        for n, q in sorted(qweights.items())
    ]
    numel = sum(q.codes.numel() for q in qweights.values())
    bits = sum(q.storage_bits() for q in qweights.values())
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    return {"directory": str(directory), "quantization_config": config.get("quantization_config"),
            "layers": rows, "quantized_layers": len(rows), "experts": expert_bits(qweights),
            "effective_bits": round(bits / numel, 4) if numel else None, "bytes": size,
            "structure": structure(directory).to_json(), "prunepath": config.get("prunepath"),
            "adapted_groups": meta.get("adapted_groups") or {}, "dense": meta.get("dense") or {}}


def expert_bits(qweights: dict) -> dict[str, dict[str, int | str]]:
    """{block prefix: {expert: bits}} of the routed experts (`mixed` when an expert's linears differ)."""
    import re

    out: dict[str, dict[str, set]] = {}
    for name, q in qweights.items():
        m = re.match(r"(.+)\.experts\.(\d+)\.[^.]+$", name)
        if m:
            out.setdefault(m.group(1), {}).setdefault(m.group(2), set()).add(q.bits)
    return {block: {e: (next(iter(b)) if len(b) == 1 else "mixed")
                    for e, b in sorted(experts.items(), key=lambda kv: int(kv[0]))}
            for block, experts in sorted(out.items())}


def structure(directory: Path):
    """The checkpoint's ModelSpec (blocks, FFN channels, heads, experts), from its config on a weightless
    skeleton: what a pruning or selection stage left."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from compress.handoff import ModelSpec
    from compress.models.adapters import ARCHS, ModelAdapter

    config = AutoConfig.from_pretrained(directory)
    if config.model_type not in ARCHS:
        raise BadInput(f"`{directory}`: unsupported architecture `{config.model_type}`")
    cls = AutoModelForCausalLM if ARCHS[config.model_type].kind == "causal" else AutoModel
    with init_empty_weights():
        return ModelSpec.of(ModelAdapter(cls.from_config(config)))


def _export_of(directory: Path) -> Path:
    """A run's output directory (it has a manifest.json, no config.json) stands for its packed `hf` export:
    the checkpoint directory inside it whose config.json has a quantization_config."""
    import json

    if (directory / "config.json").exists() or not (directory / "manifest.json").is_file():
        return directory
    for config in sorted([*directory.glob("*/config.json"), *directory.glob("*/*/config.json")]):
        try:
            if "quantization_config" in json.loads(config.read_text()):
                return config.parent
        except (OSError, ValueError):
            continue
    return directory
