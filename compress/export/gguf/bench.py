"""`compress bench gguf`: compress's GGUF files against llama.cpp's own quantize of the same model, same tokens.

For `model` (a local directory): compress writes an F16 GGUF (a conversion run); llama.cpp computes an importance
matrix on the calibration text (`llama-imatrix`) and quantizes that F16 file to each type with and without it
(`llama_model_quantize`, `compress/serve/engines/llamacpp.py`); compress writes each type from its own runs
(`methods`: GPTQ on each type's own blocks, `gguf: TYPE`, one run per seed; `--methods gptq,autoround` adds
AutoRound on the same blocks; and at Q4_0 GPTQ on compress's own W4 sym group 32 grid, which Q4_0 holds exactly;
`allocate` adds each method after an allocation of llama.cpp types per tensor at the bits per weight the type's own
mix gives the same tensors, `mix_budget`). Every file is read by compress (`compress eval FILE
--reference MODEL`: the file's tensors dequantized by gguf) on the same first `max_tokens` tokens of `data`: KL to the
full-precision model, top-1 agreement, perplexity ratio, and the file's size.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import yaml

from compress.eval.machine import machine, machine_text

TYPES = ("Q4_0", "Q4_K_M", "Q3_K_M", "Q2_K")
METHODS = ("gptq",)
# compress's own grid a type holds exactly: (label, stage)
OWN_GRID = {"Q4_0": ("compress gptq (W4 sym g32)",
                     {"stage": "quantize", "method": "gptq", "bits": 4, "group_size": 32, "sym": True})}


def stages(file_type: str, methods=METHODS, allocate: str | None = None, budget: float | None = None,
           allocate_options: dict | None = None) -> list[tuple[str, list[dict]]]:
    """(row label, stages) of compress's rows at `file_type`; with `allocate` (a method, with `allocate_options`),
    also each method after that allocation of llama.cpp types at `budget` bits per weight
    (docs/gguf.md#mixed-precision-plans)."""
    out = [(f"compress {m} (gguf: {file_type})", [{"stage": "quantize", "method": m, "gguf": file_type}])
           for m in methods]
    if allocate:
        opts = allocate_options or {}
        named = "".join(f", {k}: {v}" for k, v in opts.items())
        out += [(f"compress {m} + allocate {allocate}{named} (gguf: {file_type})",
                 [{"stage": "allocate", "method": allocate, "budget": budget, **opts},
                  {"stage": "quantize", "method": m, "gguf": file_type}]) for m in methods]
    return out + ([(OWN_GRID[file_type][0], [OWN_GRID[file_type][1]])] if file_type in OWN_GRID else [])


def mix_budget(model: str, file_type: str) -> float:
    """The bits per weight llama.cpp's `file_type` gives the tensors an allocation plans (the block linears that are
    tensors of their own), rounded up to 6 decimals: an allocation at this budget writes the same bytes, give or
    take a few bits."""
    import math

    import transformers
    from accelerate import init_empty_weights

    from compress.allocate.problem import gguf_option, option_bits
    from compress.allocate.stage import gguf_layers
    from compress.export.gguf import layer_types
    from compress.models.adapters import ModelAdapter

    config = transformers.AutoConfig.from_pretrained(model)
    with init_empty_weights():
        adapter = ModelAdapter(transformers.AutoModelForCausalLM.from_config(config))
    names = {n for i in range(len(adapter.blocks)) for n in adapter.block_linears(i)}
    layers, _ = gguf_layers(adapter, names, file_type)
    types = layer_types(adapter.model, file_type)
    bits = sum(option_bits(*lin.weight.shape, 0, gguf_option(types[n]), True, 0) for n, (lin, _) in layers.items())
    return math.ceil(bits / sum(lin.weight.numel() for lin, _ in layers.values()) * 1e6) / 1e6


def _run(tmp: Path, model: str, stages: list, file_type: str, calibration: str, seed: int) -> Path:
    from compress import pipeline
    from compress.recipe import load_recipe

    doc = {"version": 1, "description": "compress bench gguf", "model": {"path": model, "dtype": "float32"},
           "calibration": {"sources": [calibration], "nsamples": 64, "seqlen": 256, "seed": seed},
           "stages": stages, "eval": {"enabled": False},
           "export": {"formats": [{"format": "gguf", "type": file_type}]}}
    path, out = tmp / f"r-{file_type}-{seed}.yaml", tmp / f"o-{file_type}-{seed}"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    pipeline.run(load_recipe(path), out, force=True, quiet=True)
    return out / "gguf" / f"model-{file_type}.gguf"


def _score(file: Path, model: str, data: str, max_tokens: int) -> dict:
    from compress.eval.cli import evaluate_checkpoint

    r = next(iter(evaluate_checkpoint(str(file), reference=model, data=[data], max_tokens=max_tokens,
                                      gen_prompts=0).values()))
    return {"kl": r["kl"], "top1": r["top1"], "ppl": r["ppl"], "ppl_ratio": r["ppl_ratio"],
            "bytes": file.stat().st_size}


def run(model: str, data: str, calibration: str, *, types=TYPES, methods=METHODS, seeds: int = 3,
        max_tokens: int = 8192, imatrix_chunks: int = 64, allocate: str | None = None,
        allocate_options: dict | None = None, baselines: bool = True) -> dict:
    from compress.serve.engines import llamacpp

    t0, rows = time.time(), []
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        tmp = Path(tmp)
        f16 = _run(tmp, model, [], "F16", calibration, 0)
        imatrix = tmp / "imatrix.dat"
        llamacpp.imatrix(f16, Path(calibration), imatrix, chunk_size=256, chunks=imatrix_chunks)
        for t in types:
            for label, im in (("llama.cpp quantize", None), ("llama.cpp quantize + imatrix", imatrix)):
                dst = tmp / f"llama-{t}-{'im' if im else 'plain'}.gguf"
                llamacpp.quantize(f16, dst, t, imatrix=im)
                rows.append({"type": t, "method": label, "seed": None, **_score(dst, model, data, max_tokens)})
            budget = mix_budget(model, t) if allocate else None
            rows_of = stages(t, methods, allocate, budget, allocate_options)
            for label, recipe_stages in rows_of[(0 if baselines else len(methods)):]:
                for seed in range(seeds):
                    file = _run(tmp, model, recipe_stages, t, calibration, seed)
                    rows.append({"type": t, "method": label, "seed": seed, "budget": budget if "allocate" in label
                                 else None, **_score(file, model, data, max_tokens)})
                    shutil.rmtree(file.parent.parent, ignore_errors=True)
    return {"model": model, "data": data, "calibration": calibration, "max_tokens": max_tokens, "methods": list(methods),
            "types": list(types), "allocate": allocate, "allocate_options": allocate_options or {},
            "baselines": baselines,
            "imatrix_chunks": imatrix_chunks, "rows": rows, "seconds": round(time.time() - t0, 1),
            "date": time.strftime("%Y-%m-%d"), "machine": machine()}


def markdown(res: dict) -> str:
    import statistics

    flags = "".join([f" --types {','.join(res['types'])}" if tuple(res.get("types", TYPES)) != TYPES else "",
                     f" --methods {','.join(res['methods'])}" if tuple(res["methods"]) != METHODS else "",
                     f" --allocate {res['allocate']}" if res.get("allocate") else "",
                     "".join(f" --allocate-option {k}={v}" for k, v in res.get("allocate_options", {}).items()),
                     " --allocated-only" if res.get("baselines") is False else ""])
    lines = [f"`compress bench gguf --model {res['model']} --data {res['data']} --calibration {res['calibration']} "
             f"--max-tokens {res['max_tokens']}{flags}` ({res['date']}, {res['seconds'] / 60:.0f} min): every file read by "
             f"compress against the full-precision model on the same tokens; compress's rows: mean and spread over "
             f"seeds.{machine_text(res.get('machine'))}", "",
             "| type | method | KL | top-1 | ppl ratio | file bytes | seeds |", "|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in res["rows"]:
        groups.setdefault((r["type"], r["method"]), []).append(r)
    for (t, method), rs in groups.items():
        kl = [r["kl"] for r in rs]
        if rs[0].get("budget"):
            method += f" at {rs[0]['budget']} bpw"
        spread = f" ± {statistics.pstdev(kl):.5f}" if len(kl) > 1 else ""
        lines.append(f"| {t} | {method} | {statistics.mean(kl):.5f}{spread} | "
                     f"{statistics.mean(r['top1'] for r in rs):.4f} | {statistics.mean(r['ppl_ratio'] for r in rs):.4f} "
                     f"| {rs[0]['bytes']:,} | {len(rs)} |")
    return "\n".join(lines) + "\n"
