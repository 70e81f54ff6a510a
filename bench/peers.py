"""`python -m bench peers`: compress side by side with the other weight-only PTQ tools, one command (issue #49 item 5).

One model, one weight setting (`--bits`, `--group`, `--sym/--asym`), the same calibration windows for every cell
(WikiText-2 valid, `--nsamples` x `--seqlen` tokens drawn with each seed by compress's own sampler,
`compress.calibration.calibration_tokens`, BOS first as the pipeline does) and the same evaluation tokens (WikiText-2
raw test, the first `--max-tokens` tokens in 256-token windows), scored by compress's evaluator against the
full-precision model: KL(FP || Q), top-1 agreement, the perplexity ratio, and the stored bytes of the quantized linear
layers (codes + scales + zero points, as each tool stores them, read from its own checkpoint) with the effective bits
per weight they make. Cells:

compress (each a recipe run by `pipeline.run`, exported `hf`; bytes: qweight + qzeros + scales of that export)
    rtn, rtn-opt (`optimize: true`), gptq, autoround (plain: `final_block: same`), awq+gptq and awq+autoround
    (`{stage: smooth, method: awq}` before the quantize stage), autoround+lfq (`final_block: lfq`, as
    compress/recipes/w2-autoround-lfq.yaml). AutoRound cells run `--peer-iters` iterations.
auto-round (its own API, in this environment)
    ar: `AutoRound(model, tok, bits, group_size, sym, iters=--peer-iters, dataset=<the windows>, nsamples, seqlen,
    seed)`, its default algorithm otherwise; ar-rtn: the same with `iters=0` (its RTN, opt-RTN on). Saved in its own
    `auto_round` format, loaded by compress's loader (`compress eval`), bytes from that checkpoint.
llm-compressor (its own environment: `--build-env llmcompressor`, ~/.cache/compress/engines/llmcompressor-<version>)
    llmc-gptq: `GPTQModifier` (its defaults); llmc-awq: `AWQModifier` then `QuantizationModifier` (RTN), both with a
    W4A16-style group scheme at the setting, every Linear but lm_head (bench/peer_llmcompressor.py). It saves a
    compressed-tensors checkpoint (bytes: weight_packed + weight_scale + weight_zero_point); compress cannot load
    that format, so the venv reads it back dequantized through compressed-tensors and hands the weights over.
NNCF (in this environment: `pip install nncf==3.4.0`, OpenVINO backend)
    nncf-awq: `nncf.compress_weights(fp_ir, mode=INT{bits}_SYM/ASYM, group_size, ratio=1.0, awq=True,
    scale_estimation=True, dataset=<the windows>, subset_size=N, backup_mode=NONE)` on the FP OpenVINO IR that
    compress's openvino exporter writes (embeddings and lm_head stay FP, as in every other cell); its dequantized
    weights (the IR's own decompression subgraph, run by OpenVINO) go back into the torch model, matched to the torch
    layers through the FP IR (MatMul names kept by NNCF; the FP weights equal the layers' exactly); bytes: the IR's
    low-bit code, zero-point and scale constants.

`--scheme w8a8-int8` / `fp8` / `nvfp4a16` (issue #51): a scheme instead of a weight setting: int8 (or FP8 E4M3)
per-channel symmetric weights, int8 (E4M3) per-token dynamic activations; or NVFP4 weights (E2M1, groups of 16,
E4M3 scales, fp32 global scale), activations untouched. Cells rtn, gptq, autoround, sq+gptq and sq+rtn (`{stage: smooth, method: smoothquant}`,
alpha searched; sq0.8+rtn: `alpha: 0.8`, llm-compressor's example's strength) exported as compressed-tensors; llmc-gptq and llmc-sq+gptq run llm-compressor's W8A8 preset (its
examples/quantization_w8a8_int8: `SmoothQuantModifier(smoothing_strength=0.8)` then `GPTQModifier(scheme="W8A8")`);
with fp8 its FP8_DYNAMIC preset, and llmc-rtn its examples/quantization_w8a8_fp8 recipe
(`QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])`, data-free); with nvfp4a16 its
NVFP4A16 preset the same ways (its examples/quantization_w4a16_fp4). NVFP4 checkpoints are scored as `compress eval`
loads them: dequantized at load by compressed-tensors (bf16-rounded weights), the same path for every tool.
Every checkpoint is scored as served: loaded by transformers through compressed-tensors (quantized activations
included) and evaluated by compress's evaluator; bytes: weight + weight_scale. `--scheme nvfp4` / `mxfp4` are the
W4A4 FP4 presets (FP4 activations: `compress eval` reads them as evaluated, docs/formats.md). `--kv-cache
TYPE[:SCALES]` also quantizes the KV cache (docs/formats.md#quantized-kv-cache): compress's cells with `kv_cache` /
`kv_scales`, llm-compressor's with its `kv_cache_scheme` (static scales only); W4A4KV4 is `--scheme w4a4 --kv-cache
int4:dynamic`.

A cell that cannot run (a tool missing, a stage not written yet, a mode the tool lacks) is a row with the reason.
Data-free cells (rtn, rtn-opt) run once; the others run once per `--seeds` seed (the windows' seed; auto-round's
and compress's AutoRound seed too) and report mean and standard deviation.

Reference commands (SmolLM2-135M-Instruct, `~/.cache/compress-data/smollm2-135m-instruct`; never W4 asym g32 on it:
its FP weights are a dequantized Q4_1 GGUF grid):

    python -m bench peers --model smollm2-135m-instruct --bits 4 --group 128 --sym --seeds 0,1,2 \
        --json bench/peers-smollm2-w4g128sym.json --markdown bench/peers-smollm2-w4g128sym.md
    python -m bench peers --model smollm2-135m-instruct --bits 4 --group 64 --sym --seeds 0,1,2 \
        --json bench/peers-smollm2-w4g64sym.json --markdown bench/peers-smollm2-w4g64sym.md
    python -m bench peers --model smollm2-135m-instruct --bits 3 --group 64 --asym --seeds 0,1,2 \
        --json bench/peers-smollm2-w3g64asym.json --markdown bench/peers-smollm2-w3g64asym.md
    python -m bench peers --model smollm2-135m-instruct --bits 2 --group 64 --asym --seeds 0,1,2 \
        --json bench/peers-smollm2-w2g64asym.json --markdown bench/peers-smollm2-w2g64asym.md

    python -m bench peers --model smollm2-135m-instruct --scheme w8a8-int8 --nsamples 64 --seqlen 256 \
        --seeds 0 --cells rtn,gptq,sq+gptq,llmc-gptq,llmc-sq+gptq --mc-task '' --build-env llmcompressor \
        --json bench/peers-smollm2-w8a8.json --markdown bench/peers-smollm2-w8a8.md
    python -m bench peers --model smollm2-135m-instruct --scheme fp8 --nsamples 64 --seqlen 256 \
        --seeds 0 --cells rtn,gptq,sq+gptq,llmc-rtn,llmc-gptq --mc-task '' --build-env llmcompressor \
        --json bench/peers-smollm2-fp8.json --markdown bench/peers-smollm2-fp8.md
    python -m bench peers --model smollm2-135m-instruct --scheme nvfp4a16 --nsamples 64 --seqlen 256 \
        --seeds 0 --cells rtn,gptq,llmc-rtn,llmc-gptq --mc-task '' --build-env llmcompressor \
        --json bench/peers-smollm2-nvfp4a16.json --markdown bench/peers-smollm2-nvfp4a16.md

The bench/peers-smollm2-*.md files were made with lighter settings for a 2-core machine (`--nsamples 64 --seqlen
256 --peer-iters 50 --seeds 0` and a subset of `--cells`; each file's header gives its command), and
`python -m bench peers-summary bench/peers-smollm2-*.json` tabulates them (docs/quantize.md).
(defaults: 128 x 512 calibration tokens, 8192 evaluation tokens, `--peer-iters 200`; build llm-compressor's
environment first with `python -m bench peers --build-env llmcompressor --cells rtn`, about 1.5 minutes.)
Tiny end-to-end check (tests/bench/test_bench_peers.py runs a smaller one):

    python -m bench peers --model ref-llama-7m --bits 4 --group 128 --sym --nsamples 8 --seqlen 128 \
        --max-tokens 2048 --peer-iters 10 --seeds 0
"""

from __future__ import annotations

import datetime
import json
import logging
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from bench.quality import MODELS, TEXT

log = logging.getLogger(__name__)
SMOLLM2 = Path.home() / ".cache" / "compress-data" / "smollm2-135m-instruct"
GEMMA3 = Path.home() / ".cache" / "compress-data" / "gemma-3-270m"  # bench/tools/gemma3.sh makes it
TEST = TEXT / "wikitext-2-raw" / "wiki.test.raw"
VALID = TEXT / "wikitext-2" / "valid.txt"
WINDOW = 256

MIXQ_CELLS = tuple(f"mixq-{k}" for k in (0, 32, 64))  # bench/mixq.py: K loudest input columns in FP8
# cell -> (tool, what it runs)
CELLS = {
    "rtn": ("compress", "rtn"),
    "rtn-opt": ("compress", "rtn, optimize: true"),
    "gptq": ("compress", "gptq"),
    "gptq-ao": ("compress", "gptq, act_order: true (columns by decreasing diag(H), llm-compressor's actorder static)"),
    "autoround": ("compress", "autoround (final_block: same)"),
    "awq+gptq": ("compress", "smooth awq -> gptq"),
    "awq+autoround": ("compress", "smooth awq -> autoround (final_block: same)"),
    "sq+gptq": ("compress", "smooth smoothquant (alpha searched) -> gptq"),
    "sq+rtn": ("compress", "smooth smoothquant (alpha searched) -> rtn"),
    "sq0.8+rtn": ("compress", "smooth smoothquant (alpha: 0.8, llm-compressor's example) -> rtn"),
    "walsh+gptq": ("compress", "rotate walsh (fused, mode none: QuaRot's R1 + per-head R2, no online R4) -> gptq"),
    "walsh+rtn": ("compress", "rotate walsh (fused, mode none) -> rtn"),
    "infoquant+gptq": ("compress", "rotate infoquant (PSOT: learned residual + value-head rotations) -> gptq"),
    "infoquant+rtn": ("compress", "rotate infoquant -> rtn"),
    "walsh+sq+gptq": ("compress", "rotate walsh (fused, mode none) -> smooth smoothquant -> gptq"),
    "infoquant+sq+gptq": ("compress", "rotate infoquant -> smooth smoothquant -> gptq"),
    "autoround+lfq": ("compress", "autoround, final_block: lfq"),
    "ar": ("auto-round", "AutoRound (its default algorithm)"),
    "ar-rtn": ("auto-round", "AutoRound iters=0 (its RTN, opt-RTN)"),
    "llmc-gptq": ("llm-compressor", "GPTQModifier"),
    "llmc-rtn": ("llm-compressor", "QuantizationModifier (its observer's rounding; --scheme only)"),
    "llmc-awq": ("llm-compressor", "AWQModifier -> QuantizationModifier (RTN)"),
    "llmc-sq+gptq": ("llm-compressor", "SmoothQuantModifier(smoothing_strength=0.8) -> GPTQModifier"),
    "nncf-awq": ("nncf", "compress_weights awq + scale_estimation (OpenVINO)"),
    **{c: ("mixq", f"smooth smoothquant -> MXFP4 W4A4 with each linear's {c.removeprefix('mixq-')} loudest input "
                   "columns in FP8 (an evaluation, bench/mixq.py)") for c in MIXQ_CELLS},
}
DATA_FREE = {"rtn", "rtn-opt", "llmc-rtn"}
LLMC_METHODS = {"llmc-gptq": "gptq", "llmc-awq": "awq+rtn", "llmc-sq+gptq": "sq+gptq", "llmc-rtn": "rtn"}
# with a weight-and-activation `--scheme`: the cells that can run it (the others are weight-only methods or tools), and
# the cells that only make sense with one (SmoothQuant smooths for quantized activations)
SCHEME_CELLS = {"rtn", "gptq", "gptq-ao", "autoround", "walsh+gptq", "walsh+rtn", "infoquant+gptq", "infoquant+rtn",
                "walsh+sq+gptq", "infoquant+sq+gptq",
                "sq+gptq", "sq+rtn", "sq0.8+rtn", "llmc-rtn", "llmc-gptq", "llmc-sq+gptq", *MIXQ_CELLS}
LLMC_PRESETS = {"w8a8-int8": "W8A8", "fp8": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK",
                "nvfp4a16": "NVFP4A16", "mxfp4a16": "MXFP4A16",
                "w4a8-int8": "W4A8", "w4a8-fp8": "W4AFP8", "w4a4": "W4A4", "nvfp4": "NVFP4",
                "mxfp4": "MXFP4"}  # llm-compressor's preset of each scheme
NEEDS_SCHEME = {"sq+gptq", "sq+rtn", "sq0.8+rtn", "walsh+sq+gptq", "infoquant+sq+gptq", "llmc-rtn", "llmc-sq+gptq",
                *MIXQ_CELLS}
METRICS = ("kl", "top1", "ppl_ratio", "ppl", "acc", "acc_norm", "linear_bytes", "effective_bits", "quantize_seconds")


class NotAvailable(Exception):
    """A peer that cannot run here; the message is the reason the table shows."""


# -- peers' own environments --------------------------------------------------------------------------------------
# llm-compressor pins transformers <= 5.17 and auto-round <= 0.15.1 (ours: 5.25, 0.16.1): it lives in a virtual
# environment built once and cached beside the serving engines' (compress/serve/envs.py's mechanism: built in a
# `.partial` sibling, renamed into place with a ready.json once its check imports work). torch first, pinned to the
# CPU build this machine has (any other pulls the CUDA wheels).
LLMCOMPRESSOR = "0.14.0.1"
PEER_ENVS = {
    "llmcompressor": {
        "dir": f"llmcompressor-{LLMCOMPRESSOR}",
        "install": [["torch==2.13.0"], [f"llmcompressor=={LLMCOMPRESSOR}"]],
        "remove": [],
        "check": "import llmcompressor, compressed_tensors, transformers, torch; print('llmcompressor', "
                 "llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__, 'transformers', "
                 "transformers.__version__, 'torch', torch.__version__)",
    },
}


def _register() -> None:
    from compress.serve import envs

    for name, spec in PEER_ENVS.items():
        envs.ENVS.setdefault(name, spec)


def build_env(name: str, force: bool = False, echo=print) -> dict:
    """Build (or reuse) a peer's environment under ~/.cache/compress/engines (COMPRESS_ENGINES)."""
    from compress.errors import BadInput
    from compress.serve import envs

    if name not in PEER_ENVS:
        raise BadInput(f"unknown peer environment `{name}` (known: {', '.join(PEER_ENVS)})")
    _register()
    return envs.build(name, force=force, echo=echo)


def env_python(name: str) -> Path:
    """The environment's python, or NotAvailable naming the command that builds it."""
    from compress.serve import envs

    _register()
    d = envs.path_of(name)
    if not (d / "ready.json").is_file():
        raise NotAvailable(f"its environment is not built (looked in {d}); build it once with "
                           f"`python -m bench peers --build-env {name}`")
    return d / "bin" / "python"


# -- inputs ---------------------------------------------------------------------------------------------------------

def model_path(name: str) -> str:
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name == "smollm2-135m-instruct":
        return str(SMOLLM2)
    if name == "gemma-3-270m":
        return str(GEMMA3)
    if (MODELS / name).is_dir():
        return str(MODELS / name)
    from compress.errors import BadInput

    raise BadInput(f"--model `{name}`: not a directory, smollm2-135m-instruct, gemma-3-270m or a model under {MODELS}")


def windows(path: str, nsamples: int, seqlen: int, seed: int):
    """The (nsamples, seqlen) calibration windows a compress recipe with these settings draws (BOS first)."""
    from transformers import AutoTokenizer

    from compress.calibration import calibration_tokens

    tok = AutoTokenizer.from_pretrained(path)
    tokens, _ = calibration_tokens(tok, [str(VALID)], nsamples=nsamples, seqlen=seqlen, seed=seed,
                                   bos_id=getattr(tok, "bos_token_id", None))
    return tokens


def fp_linears(path: str) -> dict[str, int]:
    """{module name: weight count} of the model's nn.Linear layers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def safetensors_bytes(ckpt: Path, suffixes: tuple[str, ...]) -> dict[str, int]:
    """{layer: bytes of its tensors named layer.<suffix>} in a checkpoint's safetensors (headers only)."""
    out: dict[str, int] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            layer, _, suffix = name.rpartition(".")
            if name != "__metadata__" and suffix in suffixes:
                out[layer] = out.get(layer, 0) + meta["data_offsets"][1] - meta["data_offsets"][0]
    return out


def scheme_bytes(ckpt: Path) -> dict[str, int]:
    """{layer: bytes of its weight (or NVFP4's weight_packed + weight_global_scale) + weight_scale} of a
    compressed-tensors checkpoint's quantized layers (those with a weight_scale; the others' `weight` is a dense
    tensor, not counted)."""
    per = {}
    for suffix in ("weight", "weight_packed", "weight_global_scale", "weight_scale"):
        for layer, n in safetensors_bytes(ckpt, (suffix,)).items():
            per.setdefault(layer, {})[suffix] = n
    return {layer: sum(v.values()) for layer, v in per.items() if "weight_scale" in v}


def size_of(per_layer: dict[str, int], linears: dict[str, int], rename=lambda n: n) -> dict:
    names = {rename(n) for n in per_layer}
    missing = sorted(names - set(linears))
    if missing:
        raise RuntimeError(f"stored layers not among the model's Linear layers: {missing[:3]}")
    weights = sum(linears[n] for n in names)
    nbytes = sum(per_layer.values())
    return {"linear_bytes": nbytes, "quantized_weights": weights, "quantized_layers": len(names),
            "effective_bits": round(nbytes * 8 / weights, 4) if weights else None}


def score(ckpt: str, path: str, s: dict) -> dict:
    """compress's evaluator (`compress eval`) on a checkpoint, against the FP model on the evaluation tokens; with
    `s["mc_task"]`, its accuracy on that log-likelihood multiple-choice task too (`task_accuracy`)."""
    from compress.eval.cli import evaluate_checkpoint

    ev = next(iter(evaluate_checkpoint(str(ckpt), reference=path, data=[str(TEST)], window=WINDOW,
                                       max_tokens=s["max_tokens"], gen_prompts=0).values()))
    return {**{k: ev[k] for k in ("kl", "top1", "ppl_ratio", "ppl", "fp_ppl", "tokens")}, **task_accuracy(ckpt, s)}


def task_accuracy(ckpt: str, s: dict) -> dict:
    """{"acc", "acc_norm"} of the checkpoint on `s["mc_task"]` (lm-eval's scoring, compress/eval/mc_tasks.py) over
    its first `s["mc_limit"]` documents; {} without a task."""
    if not s.get("mc_task"):
        return {}
    from compress.eval.cli import mc_task_accuracy

    res = next(iter(mc_task_accuracy(str(ckpt), [s["mc_task"]], limit=s.get("mc_limit")).values()))
    return {"acc": res["acc"], "acc_norm": res["acc_norm"]}


def score_weights(weights: dict, path: str, s: dict, tmp: Path) -> dict:
    """Put the dequantized weights {module.weight: tensor} into the FP model, save it, score it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())
    for name, w in weights.items():
        p = params[name]
        if tuple(w.shape) != tuple(p.shape):
            raise RuntimeError(f"{name}: dequantized shape {tuple(w.shape)} != the model's {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(w.to(p.dtype))
    out = tmp / "dequantized"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    try:
        return score(str(out), path, s)
    finally:
        shutil.rmtree(out, ignore_errors=True)


# -- compress cells -------------------------------------------------------------------------------------------------

def compress_recipe(path: str, cell: str, s: dict, seed: int) -> dict:
    # a cell is its stages joined by "+": an optional rotation (walsh, infoquant), an optional smoothing (awq, sq,
    # sq0.8), then the quantizer (autoround+lfq: AutoRound with the LFQ final block)
    parts = cell.split("+")
    rotation = parts.pop(0) if parts[0] in ("walsh", "infoquant") else None
    smooth = {"awq": "awq", "sq": "smoothquant", "sq0.8": "smoothquant"}.get(parts[0]) if len(parts) > 1 else None
    method = {"rtn-opt": "rtn", "gptq-ao": "gptq"}.get(parts[-1], parts[-1] if parts[-1] != "lfq" else "autoround")
    q = {"stage": "quantize", "method": method, "bits": s["bits"], "group_size": s["group_size"], "sym": s["sym"]}
    if s.get("scheme"):  # the scheme fixes the weights' grid
        q = {"stage": "quantize", "method": method, "scheme": s["scheme"]}
    if s.get("kv_cache"):  # TYPE or TYPE:SCALES (docs/formats.md#quantized-kv-cache)
        typ, _, scales = s["kv_cache"].partition(":")
        q.update(kv_cache=typ, **({"kv_scales": scales} if scales else {}))
    if cell == "rtn-opt":
        q["optimize"] = True
    if cell == "gptq-ao":
        q["act_order"] = True
    if method == "autoround":
        q.update(iters=s["peer_iters"], final_block="lfq" if cell == "autoround+lfq" else "same")
    first = {"stage": "smooth", "method": smooth, **({"alpha": 0.8} if "sq0.8" in parts else {})}
    stages = ([first] if smooth else []) + [q]
    if rotation:
        stages.insert(0, {"stage": "rotate", "method": rotation, **({"fused": True, "mode": "none"}
                                                                     if rotation == "walsh" else {})})
    return {"version": 1, "description": f"bench peers: {cell} W{s['bits']} g{s['group_size']}",
            "model": {"path": path, "dtype": "float32"},
            "calibration": {"sources": [str(VALID)], "nsamples": s["nsamples"], "seqlen": s["seqlen"], "seed": seed},
            "stages": stages,
            "eval": {"data": [str(TEST)], "window": WINDOW, "max_tokens": s["max_tokens"], "generation": {"prompts": 0}},
            # a scheme's checkpoint in float32, as llm-compressor saves the float32 model it quantized: only the
            # quantization differs (an fp16 export would also round the embeddings and norms, which E4M3's coarse
            # activation grid turns into a visible KL difference)
            "export": {"formats": [{"format": "compressed-tensors", "dtype": "float32"} if s.get("scheme") else "hf"]}}


def compress_cell(cell: str, path: str, s: dict, seed: int, linears: dict, tmp: Path) -> dict:
    from compress import pipeline
    from compress.errors import CompressError
    from compress.export.hf import module_names
    from compress.recipe import load_recipe

    rec = compress_recipe(path, cell, s, seed)
    name = f"compress-{cell.replace('+', '-')}-{seed}"
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(rec, sort_keys=False))
    out = tmp / name
    try:
        try:
            rep = pipeline.run(load_recipe(tmp / f"{name}.yaml"), out, force=True, quiet=True)
        except CompressError as e:
            if cell.startswith("awq+"):  # the smooth stage may not exist yet: say so, do not stop the bench
                raise NotAvailable(f"{type(e).__name__}: {e}") from e
            raise
        if s.get("scheme"):  # scored as the peer's checkpoint is: loaded by transformers + compressed-tensors
            ckpt = Path(rep["exports"]["compressed-tensors"])
            row = score(str(ckpt), path, s)
            row.update(size_of(scheme_bytes(ckpt), linears), bytes_from="compressed-tensors: weight (NVFP4: packed + global scale) + weight_scale",
                       quantize_seconds=round(sum(st["seconds"] for st in rep["stages"]
                                                  if st["name"] in ("quantize", "smooth")), 2),
                       run_kl=next(iter(rep["eval"].values()))["kl"])
            return row
        ev = next(iter(rep["eval"].values()))
        row = {k: ev[k] for k in ("kl", "top1", "ppl_ratio", "ppl", "fp_ppl", "tokens")}
        row.update(task_accuracy(rep["exports"]["hf"], s))
        row["quantize_seconds"] = round(sum(st["seconds"] for st in rep["stages"]
                                            if st["name"] in ("quantize", "smooth")), 2)
        ckpt = next((p.parent for p in out.rglob("config.json")
                     if "quantization_config" in json.loads(p.read_text())), None)
        dense = (rep["size"].get("stored", {}).get("hf") or {}).get("dense_layers", 0)
        if ckpt is not None and not dense:
            config = json.loads((ckpt / "config.json").read_text())
            row.update(size_of(safetensors_bytes(ckpt, ("qweight", "qzeros", "scales")), linears,
                               module_names(config.get("model_type"))))
            row["bytes_from"] = "hf export: qweight + qzeros + scales"
        else:  # layers the hf export writes dense: compress's own accounting (codes, fp16 scales, zeros)
            size = rep["size"]
            row.update(linear_bytes=round(size["effective_bits"] * size["quantized_params"] / 8),
                       quantized_weights=size["quantized_params"], quantized_layers=size["quantized_layers"],
                       effective_bits=size["effective_bits"],
                       bytes_from=f"compress's storage bits ({dense} layers the hf export writes dense)")
        return row
    finally:
        shutil.rmtree(out, ignore_errors=True)


# -- auto-round -----------------------------------------------------------------------------------------------------

def autoround_cell(iters: int, path: str, s: dict, seed: int, calib, linears: dict, tmp: Path) -> dict:
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.export.hf import module_names

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    out = tmp / f"auto-round-{iters}-{seed}"
    n, seqlen = calib.shape
    t = time.time()
    ar = AutoRound(model, tok, bits=s["bits"], group_size=s["group_size"], sym=s["sym"], iters=iters,
                   dataset=[calib[i:i + 1] for i in range(n)], nsamples=n, seqlen=seqlen, device_map="cpu", seed=seed)
    ar.quantize_and_save(str(out), format="auto_round")
    seconds = time.time() - t
    try:
        ckpt = next(out.rglob("config.json")).parent
        row = score(str(ckpt), path, s)
        config = json.loads((ckpt / "config.json").read_text())
        row.update(size_of(safetensors_bytes(ckpt, ("qweight", "qzeros", "scales")), linears,
                           module_names(config.get("model_type"))))
        row.update(quantize_seconds=round(seconds, 2), bytes_from="auto_round checkpoint: qweight + qzeros + scales")
        return row
    finally:
        shutil.rmtree(out, ignore_errors=True)


# -- llm-compressor -------------------------------------------------------------------------------------------------

def llmc_cell(method: str, path: str, s: dict, seed: int, calib, linears: dict, tmp: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    python = env_python("llmcompressor")
    work = tmp / f"llmc-{method}-{seed}"
    work.mkdir(parents=True, exist_ok=True)
    torch.save(calib, work / "windows.pt")
    job = {"model": path, "windows": str(work / "windows.pt"), "out": str(work / "out"), "method": method,
           "bits": s["bits"], "group_size": s["group_size"], "sym": s["sym"], "scheme": s.get("scheme"),
           "kv_cache": s.get("kv_cache")}
    (work / "job.json").write_text(json.dumps(job))
    script = Path(__file__).with_name("peer_llmcompressor.py")
    try:
        proc = subprocess.run([str(python), str(script), str(work / "job.json")], capture_output=True, text=True)
        if proc.returncode:
            tail = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()][-3:]
            raise RuntimeError(f"llm-compressor run failed (exit {proc.returncode}): {' | '.join(tail)}")
        res = json.loads((work / "out" / "result.json").read_text())
        if s.get("scheme"):  # its checkpoint as served: transformers + compressed-tensors, quantized activations
            ckpt = work / "out" / "compressed"
            row = score(str(ckpt), path, s)
            row.update(size_of(scheme_bytes(ckpt), linears), quantize_seconds=res["seconds"],
                       versions=res["versions"], patched=res["patched"], recipe=res["recipe"],
                       bytes_from="compressed-tensors: weight (NVFP4: packed + global scale) + weight_scale")
            return row
        row = score_weights(load_file(str(work / "out" / "dequantized.safetensors")), path, s, work)
        row.update(size_of(res["stored_bytes"], linears))
        row.update(quantize_seconds=res["seconds"], versions=res["versions"], patched=res["patched"],
                   bytes_from=f"compressed-tensors {res['format']}: weight_packed + weight_scale + weight_zero_point",
                   recipe=res["recipe"])
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- NNCF -----------------------------------------------------------------------------------------------------------

def fp_ir(path: str, tmp: Path) -> Path:
    """The FP OpenVINO IR of the model (compress's openvino exporter, no quantized layers), made once per run."""
    out = tmp / "fp-openvino"
    if not (out / "openvino_model.xml").is_file():
        import torch
        from transformers import AutoModelForCausalLM

        from compress.export.openvino import export_openvino

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        export_openvino(model, {}, out)
    return out / "openvino_model.xml"


def _weight_inputs(node) -> list:
    """Every node of the constant subgraph feeding `node` (a MatMul's weight input), `node` included."""
    seen, todo, out = set(), [node], []
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        todo += [i.get_source_output().get_node() for i in n.inputs()]
    return out


LOW_BIT = ("u4", "i4", "u8", "i8", "u3", "u2", "i2", "i3")


def _matmul_weights(model, core, *, quantized: bool):
    """(MatMul name, its weight as a torch (out, in) tensor, the bytes of its weight constants, the names of its weight
    subgraph's nodes) for each MatMul whose
    weight input is constant: all of them in an FP IR, those with low-bit constants (decompression subgraphs) in a
    compressed one."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as opset
    import torch

    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        sub = _weight_inputs(op.input(1).get_source_output().get_node())
        if any(n.get_type_name() == "Parameter" for n in sub):
            continue  # activations x activations (attention)
        consts = [n for n in sub if n.get_type_name() == "Constant"
                  and n.get_output_element_type(0).get_type_name() not in ("i32", "i64")]  # not reshape targets
        if quantized and not any(n.get_output_element_type(0).get_type_name() in LOW_BIT for n in consts):
            continue
        weight_model = ov.Model([opset.result(op.input(1).get_source_output())], [], "w")
        w = core.compile_model(weight_model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({})
        w = torch.from_numpy(np.array(next(iter(w.values())), dtype=np.float32))
        if not op.get_attributes().get("transpose_b", False):
            w = w.T
        yield op.get_friendly_name(), w, sum(n.get_byte_size() for n in consts), {n.get_friendly_name() for n in sub}


def nncf_cell(path: str, s: dict, seed: int, calib, linears: dict, tmp: Path) -> dict:
    try:
        import nncf
        import openvino as ov
    except ImportError as e:
        raise NotAvailable(f"{e} (pip install nncf==3.4.0; openvino is compress's `openvino` extra)") from e
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    mode_name = f"INT{s['bits']}_{'SYM' if s['sym'] else 'ASYM'}"
    mode = getattr(nncf.CompressWeightsMode, mode_name, None)
    if mode is None:
        raise NotAvailable(f"NNCF {nncf.__version__} has no {mode_name} weight mode (int modes: "
                           f"{', '.join(m.name for m in nncf.CompressWeightsMode if m.name.startswith('INT'))})")
    core = ov.Core()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch_w = {n: m.weight.detach() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # NNCF keeps the MatMuls' names; its AWQ rescales pairs of weights (up by 1/s, down by s), so the quantized
    # weights are matched to torch layers through the FP IR, where each MatMul's weight equals its layer's exactly
    names = {}
    fp = core.read_model(str(fp_ir(path, tmp)))
    fp_ops = {op.get_friendly_name() for op in fp.get_ordered_ops()}
    for name, w, _, _ in _matmul_weights(fp, core, quantized=False):
        cands = [(float((w - fw).norm() / fw.norm()), n) for n, fw in torch_w.items() if fw.shape == w.shape]
        err, n = min(cands, default=(float("inf"), None))
        if err < 1e-5:
            names[name] = n
    fp = core.read_model(str(fp_ir(path, tmp)))
    data = nncf.Dataset([{"input_ids": calib[i:i + 1].numpy().astype(np.int64)} for i in range(calib.shape[0])])
    t = time.time()
    q = nncf.compress_weights(fp, mode=mode, group_size=s["group_size"], ratio=1.0, awq=True, scale_estimation=True,
                              dataset=data, subset_size=calib.shape[0], backup_mode=nncf.BackupMode.NONE)
    seconds = time.time() - t
    weights, per_layer, decompression = {}, {}, set()
    for name, w, nbytes, sub in _matmul_weights(q, core, quantized=True):
        if name not in names:
            raise RuntimeError(f"OpenVINO MatMul {name} of the quantized IR has no FP twin named so")
        weights[f"{names[name]}.weight"], per_layer[names[name]] = w, nbytes
        decompression |= sub
    # AWQ's scales must all be inside the weights handed over (MatMul -> Multiply -> MatMul: merged into the first);
    # a scale node NNCF inserts on activations (its Act -> MatMul patterns) would be lost in the torch model
    extra = sorted({op.get_friendly_name() for op in q.get_ordered_ops()} - fp_ops - decompression)
    if extra:
        raise RuntimeError(f"NNCF added {len(extra)} nodes outside the weights' decompression ({', '.join(extra[:3])}"
                           "...): the hand-over to torch would drop them")
    row = score_weights(weights, path, s, tmp)
    row.update(size_of(per_layer, linears))
    row.update(quantize_seconds=round(seconds, 2), versions={"nncf": nncf.__version__, "openvino": ov.__version__},
               bytes_from="OpenVINO IR: low-bit code and zero-point constants + scale constants")
    return row


# -- the run --------------------------------------------------------------------------------------------------------

def version_of(tool: str) -> str:
    import importlib.metadata as md

    try:
        if tool in ("compress", "mixq"):
            return md.version("compress-llm")
        if tool == "auto-round":
            return md.version("auto-round")
        if tool == "nncf":
            return f"{md.version('nncf')} (openvino {md.version('openvino')})"
    except md.PackageNotFoundError:
        return "not installed"
    return LLMCOMPRESSOR


def summarize(runs: list[dict]) -> tuple[dict, dict]:
    mean, std = {}, {}
    for k in METRICS:
        vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        if vals:
            mean[k] = statistics.fmean(vals)
            std[k] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return mean, std


def run_peers(model: str, bits: int, group: int, sym: bool, *, nsamples: int = 128, seqlen: int = 512,
              seeds: tuple[int, ...] = (0, 1, 2), max_tokens: int = 8192, peer_iters: int = 200,
              cells: list[str] | None = None, tmp: Path | None = None, command: str | None = None,
              mc_task: str | None = "sst2_mc", mc_limit: int | None = None, scheme: str | None = None,
              kv_cache: str | None = None, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Every cell of CELLS (or `cells`) on one model and setting; returns {"meta", "cells"}. `checkpoint(result)`
    after each cell that ran, with the cells so far and `meta["partial"]` (an interrupted run keeps them)."""
    import tempfile

    from compress.errors import BadInput
    from compress.eval.machine import machine

    unknown = [c for c in cells or () if c not in CELLS]
    if unknown:
        raise BadInput(f"unknown --cells {', '.join(unknown)} (known: {', '.join(CELLS)})")
    if scheme is not None:
        from compress.config import SCHEMES

        if scheme not in SCHEMES:
            raise BadInput(f"unknown --scheme `{scheme}` (known: {', '.join(SCHEMES)})")
        bits, group, sym = SCHEMES[scheme]["bits"], SCHEMES[scheme]["group_size"], SCHEMES[scheme]["sym"]
    if kv_cache is not None and scheme is None:
        raise BadInput("--kv-cache quantizes the KV cache of a --scheme checkpoint: give --scheme too")
    path = model_path(model)
    s = {"scheme": scheme, "kv_cache": kv_cache, "bits": bits, "group_size": group, "sym": sym, "nsamples": nsamples,
         "seqlen": seqlen,
         "max_tokens": max_tokens, "peer_iters": peer_iters, "mc_task": mc_task, "mc_limit": mc_limit}
    t0 = time.time()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "command": command or "python -m bench peers " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["peers"]
                                                                          else sys.argv[1:]),
            "model": model, "model_path": path, **s, "seeds": list(seeds), "window": WINDOW,
            "calibration": f"{VALID.relative_to(TEXT.parent)}: {nsamples} x {seqlen} tokens per seed "
                           "(compress.calibration.calibration_tokens, BOS first)",
            "evaluation": f"{TEST.relative_to(TEXT.parent)}: the first {max_tokens} tokens in {WINDOW}-token windows"}
    linears = fp_linears(path)
    if mc_task:
        meta["fp_task"] = task_accuracy(path, s)
        log.info("peers: FP %s %s", mc_task, meta["fp_task"])
    out = []
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        d = Path(d)
        calib = {seed: windows(path, nsamples, seqlen, seed) for seed in seeds}
        for cell, (tool, what) in CELLS.items():
            entry = {"cell": cell, "tool": tool, "version": version_of(tool), "method": what,
                     "seeds": [] if cell in DATA_FREE else list(seeds), "runs": []}
            out.append(entry)
            if cells and cell not in cells:
                entry.update(status="not run", reason="not among --cells")
                continue
            if scheme and cell not in SCHEME_CELLS:
                entry.update(status="not available", reason=f"a weight-only cell; --scheme {scheme} quantizes "
                                                            "activations too")
                continue
            if kv_cache and tool not in ("compress", "llm-compressor"):
                entry.update(status="not available", reason=f"--kv-cache {kv_cache}: compress's and llm-compressor's "
                                                            "cells only")
                continue
            if not scheme and cell in NEEDS_SCHEME:
                entry.update(status="not available", reason="SmoothQuant smooths for quantized activations: give "
                                                            "--scheme w8a8-int8")
                continue
            try:
                for seed in ([seeds[0]] if cell in DATA_FREE else seeds):
                    log.info("peers: %s seed %s", cell, seed)
                    t = time.time()
                    if tool == "compress":
                        row = compress_cell(cell, path, s, seed, linears, d)
                    elif cell == "ar":
                        row = autoround_cell(peer_iters, path, s, seed, calib[seed], linears, d)
                    elif cell == "ar-rtn":
                        row = autoround_cell(0, path, s, seed, calib[seed], linears, d)
                    elif tool == "llm-compressor":
                        row = llmc_cell(LLMC_METHODS[cell], path, s, seed, calib[seed], linears, d)
                    elif tool == "mixq":
                        from bench.mixq import mixq_cell

                        row = mixq_cell(cell, path, s, seed, calib[seed], d)
                    else:
                        row = nncf_cell(path, s, seed, calib[seed], linears, d)
                    row.update(seed=None if cell in DATA_FREE else seed, cell_seconds=round(time.time() - t, 1))
                    entry["runs"].append(row)
                    log.info("peers: %s", json.dumps({"cell": cell, **{k: row.get(k) for k in METRICS}}))
                entry["mean"], entry["std"] = summarize(entry["runs"])
                entry["status"] = "ok"
            except NotAvailable as e:
                entry.update(status="not available", reason=str(e))
            except Exception as e:  # a peer that fails is a row with the reason, never a dropped one
                log.exception("peers: %s failed", cell)
                entry.update(status="failed", reason=f"{type(e).__name__}: {e}".strip()[:600])
            if entry["status"] != "ok":
                log.warning("peers: %s %s: %s", cell, entry["status"], entry["reason"])
            if checkpoint is not None and entry["status"] != "not run":
                checkpoint({"meta": {**meta, "partial": True, "wall_seconds": round(time.time() - t0, 1)},
                            "cells": list(out)})
    meta["wall_seconds"] = round(time.time() - t0, 1)
    return {"meta": meta, "cells": out}


def _fmt(entry: dict, key: str, digits: int) -> str:
    m, sd = entry["mean"].get(key), entry["std"].get(key)
    if m is None:
        return "-"
    if key == "linear_bytes":
        return f"{m:,.0f}" + (f" +- {sd:,.0f}" if len(entry["runs"]) > 1 and sd else "")
    return f"{m:.{digits}f}" + (f" +- {sd:.{digits}f}" if len(entry["runs"]) > 1 else "")


NOTES = {
    "compress": "a recipe run by compress's pipeline on the windows (calibration.seed = the seed), evaluated in the "
                "run; bytes from its `hf` export",
    "auto-round": "auto-round's own AutoRound API on the same windows (a list of (1, L) token tensors), "
                  "device_map cpu, seed = the seed, saved with format auto_round and read by compress's loader",
    "llm-compressor": "llm-compressor's oneshot in its own environment (bench/peer_llmcompressor.py) on the same "
                      "windows (shuffle off), a W4A16-style int group scheme on every Linear but lm_head, saved "
                      "compressed (pack-quantized), dequantized back by compressed-tensors and scored here; scales "
                      "and zero points are stored as the model's dtype makes them (float32 scales for this float32 "
                      "model); its AWQ's memory pinning is skipped on CPU (torch refuses to pin without an "
                      "accelerator)",
    "nncf": "NNCF on compress's FP OpenVINO IR of the model, the same windows as `input_ids`; embeddings and "
            "lm_head kept FP (backup_mode NONE); the IR's dequantized weights are put back into the torch model "
            "and scored here",
    "mixq": "an evaluation of MixQ's arithmetic (bench/mixq.py): compress's SmoothQuant stage on the windows, the "
            "outlier columns chosen on them, the fake-quantized model scored by compress's evaluator; no checkpoint",
}


def markdown(res: dict) -> str:
    m = res["meta"]
    mach = m["machine"]
    setting = _setting(m)
    task = m.get("mc_task") or "task"
    fp = m.get("fp_task") or {}
    task_line = (f" `{task} acc`: accuracy on that log-likelihood multiple-choice task (lm-eval's scoring, "
                 f"{'the first ' + str(m['mc_limit']) if m.get('mc_limit') else 'all'} documents; the FP model: "
                 f"acc {fp['acc']:.4f}, acc_norm {fp['acc_norm']:.4f})." if fp else "")
    lines = [f"# Peers: {m['model']} {setting}", "", f"`{m['command']}`", "",
             *(["**Partial: the cells finished so far; the run did not complete.**", ""] if m.get("partial") else []),
             f"{m['date']}, {m['wall_seconds']} s. Machine: {mach['nproc']} CPUs, {mach['cpu']} (torch threads "
             f"{mach['torch_threads']}, load average at the start {mach['load_average']}). Calibration: "
             f"{m['calibration']}, seeds {', '.join(map(str, m['seeds']))}. Evaluation: {m['evaluation']}, "
             "against the full-precision model on the same tokens (compress's evaluator). AutoRound iterations: "
             f"{m['peer_iters']}. Data-free cells run once; the others give mean +- standard deviation over the "
             "seeds. `linear bytes`: the quantized linear layers' codes + scales + zero points as each tool "
             "stores them; `eff. bits`: those bits per quantized weight; `quantize s`: the tool's quantization "
             "(compress: its smooth and quantize stages)." + task_line, "",
             *[f"{note}\n" for note in m.get("notes", ())],
             f"| cell | tool | method | KL | top-1 | ppl ratio | {task} acc | linear bytes | eff. bits | quantize s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in res["cells"]:
        head = f"| {e['cell']} | {e['tool']} {e['version']} | {e['method']} |"
        if e["status"] != "ok":
            lines.append(f"{head} {e['status']}: {e['reason'].replace('|', '/')} | | | | | | |")
            continue
        lines.append(f"{head} {_fmt(e, 'kl', 5)} | {_fmt(e, 'top1', 4)} | {_fmt(e, 'ppl_ratio', 4)} | "
                     f"{_fmt(e, 'acc', 4)} | {_fmt(e, 'linear_bytes', 0)} | {_fmt(e, 'effective_bits', 3)} | "
                     f"{_fmt(e, 'quantize_seconds', 1)} |")
    ok = [e for e in res["cells"] if e["status"] == "ok"]
    weights = {e["runs"][0].get("quantized_weights") for e in ok}
    if len(weights) > 1:
        lines += ["", "Quantized weights differ between cells: " + ", ".join(
            f"{e['cell']} {e['runs'][0].get('quantized_weights')}" for e in ok)]
    elif weights:
        lines += ["", f"Every cell quantized the same {weights.pop():,} weights "
                      f"({ok[0]['runs'][0].get('quantized_layers')} linear layers)."]
    lines += ["", "What each peer did:", ""] + [f"- {tool}: {note}." for tool, note in NOTES.items()]
    if m.get("scheme"):
        lines += ["", f"With `--scheme {m['scheme']}` the above is replaced, for every tool, by: each checkpoint is "
                      "compressed-tensors (compress: its `compressed-tensors` export; llm-compressor: its own save), "
                      "loaded by transformers through compressed-tensors (activations quantized as the checkpoint "
                      "says) and scored by compress's evaluator on the same tokens; bytes: weight + weight_scale of "
                      "the quantized layers. llm-compressor runs its "
                      f"{LLMC_PRESETS[m['scheme']]} preset: "
                      "`GPTQModifier` (llmc-gptq; "
                      "after `SmoothQuantModifier(smoothing_strength=0.8)` in llmc-sq+gptq, as its "
                      "examples/quantization_w8a8_int8 does) or `QuantizationModifier` (llmc-rtn, as its "
                      "examples/quantization_w8a8_fp8 does)."]
    return "\n".join(lines) + "\n"


def _setting(m: dict) -> str:
    if m.get("scheme"):
        return m["scheme"].upper() + (f" KV {m['kv_cache']}" if m.get("kv_cache") else "")
    return f"W{m['bits']} g{m['group_size']} {'sym' if m['sym'] else 'asym'}"


def best_of(res: dict) -> dict:
    """{"compress": entry, "peer": entry}: each side's lowest mean KL among the cells that ran (None if none did)."""
    ok = [e for e in res["cells"] if e["status"] == "ok" and e["mean"].get("kl") is not None]
    side = lambda e: "compress" if e["tool"] == "compress" else "peer"  # noqa: E731
    return {k: min((e for e in ok if side(e) == k), key=lambda e: e["mean"]["kl"], default=None)
            for k in ("compress", "peer")}


# settings two files must share for their runs of one cell to be pooled as seeds of one measurement
_RUN_SETTINGS = ("nsamples", "seqlen", "max_tokens", "peer_iters")


def _pool(a: dict, b: dict) -> dict:
    """Cell `a`'s runs with `b`'s (a later run of a seed replaces the earlier one), mean and spread recomputed."""
    runs = {r.get("seed"): r for r in a["runs"]} | {r.get("seed"): r for r in b["runs"]}
    runs = [runs[k] for k in sorted(runs, key=lambda k: (k is None, k))]
    mean, std = summarize(runs)
    return {**b, "seeds": [r.get("seed") for r in runs], "runs": runs, "mean": mean, "std": std}


def summary(results: list[tuple[str, dict]]) -> str:
    """One row per (model, setting) of several `run_peers` results (their files merged by model and setting: the
    runs of a cell that two files both ran with the same calibration, evaluation and iterations are pooled by seed,
    otherwise a later file's cell replaces an earlier one's): compress's best cell beside the best peer's,
    KL (mean +- standard deviation over the seeds), top-1, task accuracy and stored bits, and the ratio of the KLs."""
    merged: dict[tuple, dict] = {}
    for name, res in results:
        m = res["meta"]
        key = (Path(m["model"]).name, m["bits"], m["group_size"], m["sym"])  # a name or a path to it
        into = merged.setdefault(key, {"meta": m, "cells": [], "files": []})
        into["files"].append(name)
        same = all(m.get(k) == into["meta"].get(k) for k in _RUN_SETTINGS)
        for e in res["cells"]:
            prior = next((c for c in into["cells"] if c["cell"] == e["cell"]), None)
            if prior is not None and prior["status"] == "ok" and e["status"] == "ok" and same:
                e = _pool(prior, e)
            if e["status"] == "ok" or prior is None:
                into["cells"] = [c for c in into["cells"] if c["cell"] != e["cell"]] + [e]
    lines = ["| model | setting | compress's best | KL | top-1 | acc | bits | best peer | KL | top-1 | acc | bits | "
             "KL ratio | files |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, *_), res in merged.items():
        best = best_of(res)
        row = [Path(model).name, _setting(res["meta"])]
        for e in (best["compress"], best["peer"]):
            if e is None:
                row += ["-", "-", "-", "-", "-"]
                continue
            seeds = f" ({len(e['runs'])} seeds)" if len(e["runs"]) > 1 else ""
            row += [f"{e['tool']} {e['cell']}{seeds}", _fmt(e, "kl", 4), _fmt(e, "top1", 3),
                    _fmt(e, "acc", 3) if "acc" in e["mean"] else "-", _fmt(e, "effective_bits", 3)]
        ratio = (best["compress"]["mean"]["kl"] / best["peer"]["mean"]["kl"]
                 if best["compress"] and best["peer"] else None)
        row += [f"{ratio:.2f}" if ratio is not None else "-", ", ".join(res["files"])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"

