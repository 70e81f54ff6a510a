"""`compress bench serve`: the schemes users serve, exported by real runs and checked in an engine.

For each scheme of `SCHEMES` (RTN, so a cell takes seconds of quantization: the layouts are what is checked, not
the rounding), one pipeline run writes the `hf` export of `model`; `serve_check` then loads it in `engine` and
compares greedy decoding with transformers on the same weights (`compress/serve/check.py`), and transformers itself
in the engine's dtype gives the floor (what that dtype alone costs on the model). The mixed scheme is an `allocate`
plan of 3- and 4-bit 64-column chunks in 4-bit containers (`export.hf.container: 4`), symmetric and asymmetric; `sym-3-in-4-unshifted` rewrites the mixed symmetric export with every 3-bit part keeping its own zero 4
(no re-centring) and must disagree: the proof that the check sees zeros an engine ignores.

`grid` (`--grid`, engine transformers): bits 2, 3, 4, 8 x sym/asym, RTN g64, and AutoRound W3 g64 asym, each export
in the packing the default picks (and, for the asymmetric 4/8-bit ones, AWQ, which auto-round's CPU loader reads
only with `auto-round-lib`, also in `auto_round`), loaded by `AutoModelForCausalLM.from_pretrained` and scored on the
first `max_tokens` tokens of `data`: perplexity as transformers delivers it (auto-round's loader, computing in
`dtype`) against compress's reading of the same files in fp32, and the run's own report.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import yaml

from compress.eval.machine import machine, machine_text

SCHEMES = {
    "W4 g128 sym": {"bits": 4, "sym": True},
    "W4 g128 asym": {"bits": 4, "sym": False},
    "3/4 mixed g64 sym, 4-bit containers": {"mixed": True, "sym": True},
    "3/4 mixed g64 asym, 4-bit containers": {"mixed": True, "sym": False},
}
UNSHIFTED = "3/4 mixed g64 sym, zeros not re-centred (must disagree)"


def recipe(model: str, scheme: dict) -> dict:
    # W4 g128: a layer 128 does not divide gets the largest group that does (SmolLM2's 576: 64); a per-chunk plan
    # has one group for every layer, 64 here, so that every layer of SmolLM2 is packed
    quantize = {"stage": "quantize", "method": "rtn", "group_size": 64 if scheme.get("mixed") else 128,
                "sym": scheme["sym"]}
    stages = [quantize | {"bits": scheme["bits"]}] if not scheme.get("mixed") else [
        {"stage": "allocate", "method": "greedy", "budget": 3.7, "options": [{"bits": 3}, {"bits": 4}]}, quantize]
    return {"version": 1, "description": "compress bench serve", "model": {"path": model, "dtype": "float32"},
            "calibration": {"sources": ["bundled:botchan-calibration"], "nsamples": 8, "seqlen": 128},
            "stages": stages, "eval": {"enabled": False},
            "export": {"formats": [{"format": "hf", "container": 4}] if scheme.get("mixed") else ["hf"]}}


# (method, bits, sym): RTN at every width, and AutoRound W3 g64 asym (tuned weights: the case issue 47 reported
# as 66 in compress's report vs 184 in transformers), light settings
GRID = [("rtn", b, s) for b in (2, 3, 4, 8) for s in (True, False)] + [("autoround", 3, False)]
AUTOROUND = {"iters": 10, "batch_size": 2}


def grid_recipe(model: str, method: str, bits: int, sym: bool, data: str, max_tokens: int, packing: str) -> dict:
    quantize = {"stage": "quantize", "method": method, "bits": bits, "group_size": 64, "sym": sym}
    doc = {"version": 1, "description": "compress bench serve --grid", "model": {"path": model, "dtype": "float32"},
           "stages": [quantize | (AUTOROUND if method == "autoround" else {})],
           "eval": {"data": [data], "window": 256, "max_tokens": max_tokens},
           "export": {"formats": [{"format": "hf", "packing": packing}]}}
    if method == "autoround":
        doc["calibration"] = {"sources": ["bundled:botchan-calibration"], "nsamples": 16, "seqlen": 128}
    return doc


def _exported(tmp: Path, doc: dict) -> tuple[Path, dict, dict]:
    """Run the recipe `doc` into tmp/out: (the output directory, its report, its hf quantization_config)."""
    from compress import pipeline
    from compress.recipe import load_recipe

    path, out = tmp / "recipe.yaml", tmp / "out"
    shutil.rmtree(out, ignore_errors=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    report = pipeline.run(load_recipe(path), out, force=True, quiet=True)
    return out, report, json.loads((out / "hf" / "config.json").read_text())["quantization_config"]


def run_grid(model: str, data: str, max_tokens: int = 8192, dtype: str = "float32") -> dict:
    """`dtype`: transformers' compute dtype (auto-round's CPU loader forces float16, whose matmuls are slow on CPUs
    without fp16 arithmetic; the layout is what the grid checks, so float32 by default, float16 as an option)."""
    from compress.errors import BadInput
    from compress.serve.check import serve_check

    t0, rows = time.time(), []
    with tempfile.TemporaryDirectory(prefix="bench-serve-grid-") as tmp:
        for method, bits, sym in GRID:
            for packing in ["auto"] + (["auto_round"] if not sym and bits in (4, 8) else []):
                out, report, qc = _exported(Path(tmp), grid_recipe(model, method, bits, sym, data, max_tokens,
                                                                   packing))
                row = {"method": method, "bits": bits, "sym": sym, "packing": qc["packing_format"],
                       "report_ppl": round(next(iter(report["eval"].values()))["ppl"], 4)}
                try:
                    res = serve_check(out, "transformers", n_tokens=8, dtype=dtype, perplexity=data,
                                      max_tokens=max_tokens)
                    row.update(res["perplexity"], loaded_layers=res["loaded_layers"], tokens=res["tokens"])
                except BadInput as e:
                    row["refused"] = str(e).split(":")[0]
                rows.append(row)
    return {"model": model, "data": data, "max_tokens": max_tokens, "dtype": dtype, "rows": rows,
            "seconds": round(time.time() - t0, 1), "date": time.strftime("%Y-%m-%d"), "machine": machine()}


def markdown_grid(res: dict) -> str:
    dtype = res.get("dtype", "float32")
    half = f"transformers_{dtype}" if dtype != "float32" else None
    lines = [f"`compress bench serve --grid --model {res['model']} --data {res['data']} --max-tokens "
             f"{res['max_tokens']} --dtype {dtype}` ({res['date']}, {res['seconds'] / 60:.0f} min): g64 hf exports "
             "loaded by `AutoModelForCausalLM.from_pretrained` (auto-round 0.16.1's loader) against compress's reading "
             f"of the same files, same tokens; ratio = transformers (fp32) / compress.{machine_text(res.get('machine'))}",
             "", "| method | bits | sym | packing | report ppl | compress ppl (fp32) | transformers ppl (fp32) | ratio | "
             + (f"transformers {dtype} | " if half else "") + "loader layer |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if half else "") + "---|"]
    for r in res["rows"]:
        head = f"| {r.get('method', 'rtn')} | {r['bits']} | {r['sym']} | {r['packing']} | {r['report_ppl']} |"
        if "refused" in r:
            lines.append(f"{head} | refused: {r['refused']} | | " + ("| " if half else "") + "|")
            continue
        layer = ", ".join(x.rsplit(".", 2)[-2] + "." + x.rsplit(".", 1)[-1] for x in r["loaded_layers"])
        lines.append(f"{head} {r['compress']} | {r['transformers_fp32']} | {r['ratio']} | "
                     + (f"{r[half]} | " if half else "") + f"{layer} |")
    return "\n".join(lines) + "\n"


def unshift(hf: Path) -> None:
    """Rewrite a mixed symmetric export as an engine that ignored zeros would need it not to be: each narrower part
    keeps its own zero 2^(b-1) in the 4-bit container (the layout before re-centring)."""
    from safetensors.torch import save_file

    from compress.export.hf import load_tensors, read_quantized
    from compress.kernels.packing import gptq_pack
    from compress.qweight import QuantizedWeight

    config, qweights = read_quantized(hf)
    tensors = load_tensors(hf)
    for name, qw in qweights.items():
        raw = QuantizedWeight(codes=qw.codes, scales=qw.scales, zeros=qw.zeros, bits=4, group_size=qw.group_size,
                              sym=True)
        packed = gptq_pack(raw, v1=True)
        tensors.update({f"{name}.{k}": packed[k] for k in ("qweight", "qzeros", "scales")})
    (hf / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    for key in ("widened", "mixed"):  # compress's own reader now sees what the file says: the real zeros
        config["compress"]["meta"].pop(key, None)
    (hf / "config.json").write_text(json.dumps(config, indent=2))


def run(model: str, engine: str = "vllm", dtype: str = "float16", unshifted: bool = True) -> dict:
    from compress.serve.check import require_wna16, serve_check

    if engine == "vllm":  # every scheme here is int4 weight-only
        require_wna16("nothing was exported")
    t0, rows = time.time(), []
    cells = [*SCHEMES.items()] + ([(UNSHIFTED, SCHEMES["3/4 mixed g64 sym, 4-bit containers"])] if unshifted else [])
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        for name, scheme in cells:
            out, _, qc = _exported(Path(tmp), recipe(model, scheme))
            if name == UNSHIFTED:
                unshift(out / "hf")
            res = serve_check(out, engine, dtype=dtype, floor=True)
            stored = json.loads((out / "manifest.json").read_text())["exports"]["hf"]
            rows.append({"scheme": name, "packing": qc.get("packing_format", qc.get("quant_method")),
                         "dense_layers": stored.get("dense_layers", 0),
                         **{k: res[k] for k in ("tokens", "top5_overlap", "max_dlogprob", "ties", "agree")},
                         "floor": res.get("floor"),
                         "kernels": res.get("kernels", []), "engine_version": res.get(engine)})
    return {"model": model, "engine": engine, "dtype": dtype, "rows": rows, "seconds": round(time.time() - t0, 1),
            "date": time.strftime("%Y-%m-%d"), "machine": machine()}


def markdown(res: dict) -> str:
    lines = [f"`compress bench serve --model {res['model']} --engine {res['engine']}` ({res['date']}, engine dtype "
             f"{res['dtype']}, reference: transformers in float32 on the same weights, 4 prompts x 32 greedy tokens)."
             f"{machine_text(res.get('machine'))}", "",
             "| scheme | packing | layers stored dense | tokens equal | top-5 overlap | max \\|dlogprob\\| | agrees | floor: transformers in "
             "the same dtype (tokens, max \\|dlogprob\\|) | kernels |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        t, f = r["tokens"], r.get("floor") or {}
        floor = f"{f['tokens']['equal']}/{f['tokens']['total']}, {f['max_dlogprob']}" if f else "-"
        lines.append(f"| {r['scheme']} | {r['packing']} | {r.get('dense_layers', 0)} | {t['equal']}/{t['total']} | {r['top5_overlap']} | "
                     f"{r['max_dlogprob']} | {'yes' if r['agree'] else 'no'} | {floor} | {', '.join(r['kernels']) or '-'} |")
    return "\n".join(lines) + "\n"
