"""`python -m bench scale`: what a streamed quantization costs at real model shapes, and how it grows.

No real weights of these sizes are on the machine, so each model is **random weights at the real shapes**
(configs of SmolLM2-135M, Qwen3-0.6B and Llama-3.2-1B), written once as bf16 safetensors shards. Each cell
runs `compress run` in a fresh process (a clean peak RSS) on a recipe with `model.stream: true`, one
`quantize` stage (W4 g128 symmetric), the `hf` export and no in-run evaluation, and reads back from the
run's own report:

* `s_per_block`: the median time between consecutive block checkpoints (one block measured: the quantize stage's
  seconds, setup included);
* `load_rss_mb`: RSS resident once the load stage is done (Python, torch, transformers and the resident
  non-block tensors: embeddings, final norm, head; not the load's own transient peak),
  `quantize_peak_rss_mb` the quantize stage's own peak (compress.rss), `peak_rss_mb` the run's peak;
* `block_mb` (one block's fp32 weights, as the stage holds them) and `act_mb` (the calibration activations
  of one block, `nsamples x seqlen x hidden x 4` bytes), and
  `rss_over_block` = (quantize peak - load) / (block + activations): the issue's bound is 1.5;
* `disk_mb`: bytes the run wrote (export, block checkpoints, report).

GPTQ and AutoRound can be measured on the first blocks only (`--blocks gptq=3` and AutoRound 1 by default: a
model of the same shapes with that many blocks, AutoRound with `final_block: same` and `iters` from the
command) and extrapolated: seconds per block x blocks (AutoRound also per iteration x 200, its default).

Extrapolation to Llama-3.1-8B and 70B shapes: per-block seconds are fitted, per method, as
`t = a * P + b * F` over the measured models, where P is the block's weight count (reading, rounding and
writing them; the forward passes) and F the GPTQ work `sum over linears of d_out * d_in^2 + tokens * d_in^2`
(the column-by-column updates and the Hessian); RTN and AutoRound (whose steps are forward and backward
passes through the block) use P only. Totals are per-block x blocks. Peak RSS is predicted as the libraries
(`LIBRARIES_MB`) + the non-block tensors at bf16 + the quantize stage's growth per MB of working set, measured on
the largest shape, x the target's working set (`working_mb`).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SHAPES = {  # the real configs' shapes (hidden, FFN, blocks, heads, KV heads, head dim, vocabulary, tied head)
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True),
    "tiny": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False),
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                          tie_word_embeddings=False),
}
TARGETS = ("llama-3.1-8b", "llama-3.1-70b")  # always in the extrapolation table, measured or not
# calibration activations a method holds: the quantized-model inputs, replaced batch by batch by the block's
# outputs; AutoRound also the full-precision inputs and targets
ACT_COPIES = {"autoround": 3}
LIBRARIES_MB = 1200  # Python + torch + transformers + the run's imports, as measured by the load stage
BITS, GROUP = 4, 128


def block_linears(s: dict) -> list[tuple[int, int]]:
    """(d_out, d_in) of one block's linears."""
    h, f, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    return [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]


def features(s: dict, tokens: int) -> tuple[float, float]:
    """(P, F) of one block (module docstring)."""
    lins = block_linears(s)
    return (float(sum(o * i for o, i in lins)),
            float(sum(o * i * i + tokens * i * i for o, i in lins)))


def build(name: str, out: Path) -> Path:
    """Random weights at `name`'s shapes as bf16 safetensors shards (one per block, one for the rest, and the
    index, as `save_pretrained` lays out a sharded checkpoint), written tensor by tensor: the model is never whole
    in memory (Llama-3.1-8B's 16 GB on a 24 GB machine). Matrices N(0, 0.02), norms 1; with stories260K's
    tokenizer files when available. Written under a temporary name, renamed when complete."""
    import torch
    import transformers as T
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    s = dict(SHAPES[name])
    cls = {"llama": T.LlamaConfig, "qwen3": T.Qwen3Config}[s.pop("model_type")]
    config = cls(**s, max_position_embeddings=4096, torch_dtype="bfloat16")
    with init_empty_weights():
        skeleton = T.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    skeleton.tie_weights()  # from_config leaves a tied head a tensor of its own
    shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}  # a tied head is then not listed
    del skeleton
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    groups: dict[str, list[str]] = {}
    for n in shapes:  # model.layers.i.* -> shard i, the rest -> one shard
        parts = n.split(".")
        key = f"layer{int(parts[2]):04d}" if parts[:2] == ["model", "layers"] else "rest"
        groups.setdefault(key, []).append(n)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for k, (key, names) in enumerate(sorted(groups.items())):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in names:
            shape = shapes[n]
            t = (torch.randn(shape, generator=gen) * 0.02 if len(shape) > 1 else torch.ones(shape)).to(torch.bfloat16)
            tensors[n] = t
            weight_map[n] = file
            total += t.numel() * 2
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _tokenizer(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _tokenizer(out: Path) -> None:
    """stories260K's tokenizer (512 ids, inside every vocabulary here; the weights are random: any text will do)."""
    from bench.quality import MODELS

    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        if (MODELS / "stories260K" / f).exists():
            shutil.copy(MODELS / "stories260K" / f, out / f)


def recipe(model: Path, method: str, cal: str, nsamples: int, seqlen: int, iters: int) -> str:
    extra = {"autoround": f", iters: {iters}, batch_size: 4, final_block: same",
             "gptq": ", final_block: same"}.get(method, "")  # the method alone: no last block tuned through the head
    return textwrap.dedent(f"""
        version: 1
        model: {{path: {model}, stream: true}}
        calibration: {{sources: [{cal}], nsamples: {nsamples}, seqlen: {seqlen}}}
        stages:
          - {{stage: quantize, method: {method}, bits: {BITS}, group_size: {GROUP}, sym: true{extra}}}
        eval: {{enabled: false}}
        export: {{formats: [hf]}}
    """)


def check_export(hf: Path) -> dict:
    """Does transformers load the `hf` export, without the memory for all of it? Every block's tensors have block
    0's names, shapes and dtypes (read from the files' headers: nothing is loaded), as many blocks as the config
    says; then a one-block checkpoint cut from it (the non-block tensors and block 0, the config with
    `num_hidden_layers: 1`) loads with transformers' `from_pretrained` (auto-round's loader: it refuses a shape that
    does not fit) and its logits on 16 tokens are finite and agree with compress's own reader of the same file."""
    import re

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from compress.export.runtime import load_packed

    config = json.loads((hf / "config.json").read_text())
    headers, where = {}, {}
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                headers[k], where[k] = (tuple(sl.get_shape()), sl.get_dtype()), f
    per_block: dict[int, dict] = {}
    for k, v in headers.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)", k)
        if m:
            per_block.setdefault(int(m[1]), {})[m[2]] = v
    n = config["num_hidden_layers"]
    if sorted(per_block) != list(range(n)):
        raise RuntimeError(f"{hf}: blocks {sorted(per_block)[:3]}... in the files, {n} in the config")
    odd = [i for i in range(n) if per_block[i] != per_block[0]]
    if odd:
        raise RuntimeError(f"{hf}: blocks {odd[:5]} differ from block 0 in names, shapes or dtypes")
    keep = [k for k in headers if not k.startswith("model.layers.") or k.startswith("model.layers.0.")]
    with tempfile.TemporaryDirectory() as d:
        one = Path(d)
        tensors = {}
        for k in keep:
            with safe_open(str(where[k]), "pt") as h:
                tensors[k] = h.get_tensor(k)
        save_file(tensors, str(one / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        (one / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
        ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            theirs = torch.nn.Module.float(AutoModelForCausalLM.from_pretrained(one))(ids).logits  # (as eval does)
            ours = load_packed(one, "reference")[0](ids).logits
        diff = float((theirs - ours).abs().max() / ours.abs().max())
    if not torch.isfinite(theirs).all() or diff > 0.05:
        raise RuntimeError(f"{hf}: transformers' logits of the one-block cut are not finite or differ from "
                           f"compress's by {diff:.3g} (relative to the largest)")
    return {"blocks_checked": n, "tensors": len(headers), "one_block_loads_in_transformers": True,
            "one_block_logits_rel_diff": round(diff, 6)}


def run_cell(model: Path, method: str, work: Path, cal: str, nsamples: int, seqlen: int, iters: int,
             check: bool = False) -> dict:
    """One streamed run in a fresh process; its report's timings, RSS and the bytes it wrote (`check`: and
    `check_export` of its export)."""
    r = work / f"{model.name}-{method}.yaml"
    r.write_text(recipe(model, method, cal, nsamples, seqlen, iters))
    out = work / f"out-{model.name}-{method}"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "compress.cli", "run", str(r), "-o", str(out), "--force", "--quiet",
                           "--json"], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{model.name}/{method}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout)
    stages = {st["name"]: st for st in report["stages"]}
    disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    ends = sorted(p.stat().st_mtime for p in out.glob("stages/*/block_*.safetensors"))
    gaps = np.diff(ends)  # each block's own seconds, from its checkpoint's time (the first block also pays the setup)
    checked = {"export_check": check_export(out / "hf")} if check else {}
    shutil.rmtree(out)
    return {"wall_s": round(time.time() - t0, 1), "quantize_s": stages["quantize"]["seconds"],
            "block_s": round(float(np.median(gaps)), 3) if len(gaps) else None,
            "load_rss_mb": stages["load"]["rss_mb"], "quantize_peak_rss_mb": stages["quantize"]["peak_rss_mb"],
            "peak_rss_mb": report["peak_rss_mb"], "export_peak_rss_mb": stages["export"]["peak_rss_mb"],
            "disk_mb": round(disk / 2**20, 1), **checked}


def run(models: list[str], methods: list[str], *, nsamples: int, seqlen: int, iters: int, cal: str,
        keep: Path | None = None, measured: dict | None = None, check: bool = False) -> dict:
    """`measured`: method or "model/method" -> blocks to run (the first ones of the shapes; missing: all)."""
    measured = measured or {}
    from compress.eval.machine import machine

    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    rows = []
    try:
        for name in models:
            s = SHAPES[name]
            model, built = None, 0.0
            P, F = features(s, nsamples * seqlen)
            block_mb = P * 4 / 2**20
            act_mb = nsamples * seqlen * s["hidden_size"] * 4 / 2**20  # the calibration activations, once
            for method in methods:
                n = measured.get(f"{name}/{method}") or measured.get(method) or s["num_hidden_layers"]
                n = min(n, s["num_hidden_layers"])
                if n < s["num_hidden_layers"]:  # the first n blocks of these shapes, extrapolated to the depth
                    part = build_blocks(name, n, work)
                    cell = run_cell(part, method, work, cal, nsamples, seqlen, iters)
                    shutil.rmtree(part)
                else:
                    if model is None:  # the whole model, built only when a method runs every block
                        t0 = time.time()
                        model = keep / name if keep and (keep / name / "config.json").exists() else \
                            build(name, (keep or work) / name)
                        built = round(time.time() - t0, 1)
                    cell = run_cell(model, method, work, cal, nsamples, seqlen, iters, check=check)
                per_block = cell["block_s"] or cell["quantize_s"] / n  # one block: setup included
                cell.update(measured_blocks=n, extrapolated_s=round(per_block * s["num_hidden_layers"], 1))
                if method == "autoround":
                    cell["extrapolated_200_iters_s"] = round(per_block * s["num_hidden_layers"] * 200 / iters, 1)
                grown = cell["quantize_peak_rss_mb"] - cell["load_rss_mb"]
                rows.append({"model": name, "method": method, "blocks": s["num_hidden_layers"],
                             "hidden": s["hidden_size"], "ffn": s["intermediate_size"], "build_s": built,
                             "block_params": int(P), "gptq_work": F, "s_per_block": round(per_block, 3),
                             "block_mb": round(block_mb, 1), "act_mb": round(act_mb, 1),
                             "rss_over_block": round(grown / (block_mb + act_mb), 3), **cell})
                logger.info("scale %s/%s: %.2f s per block, peak RSS %.0f MB (load %.0f MB)", name, method,
                            per_block, cell["peak_rss_mb"], cell["load_rss_mb"])
            if keep is None and model is not None:
                shutil.rmtree(model, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "bits": BITS, "group_size": GROUP,
            "measured_blocks": measured,
            "nsamples": nsamples, "seqlen": seqlen, "autoround_iters": iters, "rows": rows,
            "extrapolation": extrapolate(rows, nsamples * seqlen, iters)}


def build_blocks(name: str, n: int, work: Path) -> Path:
    """`name`'s shapes with only `n` blocks."""
    SHAPES[f"{name}-{n}blocks"] = {**SHAPES[name], "num_hidden_layers": n}
    try:
        return build(f"{name}-{n}blocks", work / f"{name}-{n}blocks")
    finally:
        del SHAPES[f"{name}-{n}blocks"]


def extrapolate(rows: list[dict], tokens: int, iters: int) -> list[dict]:
    """Per method, least squares of s_per_block on (1, F) (GPTQ) or (1, P) (RTN, AutoRound) over the measured
    models, applied to the targets' shapes (module docstring); AutoRound scaled from `iters` to 200 iterations.
    Peak RSS: the load stage's (libraries + non-block tensors in bf16) plus the growth measured on the largest model,
    scaled by the block's working set (weights, activations and, for GPTQ, its Hessians: `working_mb`)."""
    out = []
    for method in sorted({r["method"] for r in rows}):
        mine = [r for r in rows if r["method"] == method and r["model"] != "tiny"] or \
            [r for r in rows if r["method"] == method]
        gptq = method == "gptq"
        X = np.array([[1.0, r["gptq_work"] if gptq else r["block_params"]] for r in mine])
        y = np.array([r["s_per_block"] for r in mine])
        coef = np.linalg.lstsq(X, y, rcond=None)[0] if len(mine) >= 2 else np.array([0.0, y[0] / X[0, 1]])
        scale = 200 / iters if method == "autoround" else 1
        big = max(mine, key=lambda r: r["block_params"])
        growth = (big["quantize_peak_rss_mb"] - big["load_rss_mb"]) / working_mb(SHAPES[big["model"]], tokens, method)
        for name in dict.fromkeys([*(r["model"] for r in mine), *TARGETS]):
            s = SHAPES[name]
            P, F = features(s, tokens)
            per_block = max(float(coef @ np.array([1.0, F if gptq else P])), 0.0)
            # the non-block tensors at the checkpoint's bf16: model.stream keeps the embeddings and a head no stage
            # computes with so (the bench's methods run `final_block: same`)
            rest = (s["vocab_size"] * s["hidden_size"] * (1 if s.get("tie_word_embeddings") else 2)
                    + s["hidden_size"]) * 2 / 2**20
            out.append({"model": name, "method": method, "measured": any(r["model"] == name for r in mine),
                        "block_params": int(P), "blocks": s["num_hidden_layers"],
                        "s_per_block": round(per_block, 2),
                        "total_h": round(per_block * s["num_hidden_layers"] * scale / 3600, 2),
                        "working_mb": round(working_mb(s, tokens, method), 1),
                        "peak_rss_gb": round((LIBRARIES_MB + rest + growth * working_mb(s, tokens, method)) / 1024, 1)})
    return out


def working_mb(s: dict, tokens: int, method: str) -> float:
    """One block's fp32 weights and the calibration activations it holds (`ACT_COPIES`), and for GPTQ the
    Hessians (one per distinct input, while they are collected: q/k/v share one, gate/up one; each packed, an
    upper triangle, and factored in its own storage)."""
    P, _ = features(s, tokens)
    mb = (P + ACT_COPIES.get(method, 1) * tokens * s["hidden_size"]) * 4 / 2**20
    if method == "gptq":
        h, f, q = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"] * s["head_dim"]
        mb += sum(n * (n + 1) // 2 for n in (h, q, h, f)) * 4 / 2**20
    return mb


def markdown(result: dict) -> str:
    from compress.eval.machine import machine_text

    lines = [f"Streamed quantization (`model.stream: true`) of random weights at real shapes, W{result['bits']} "
             f"g{result['group_size']} sym, calibration {result['nsamples']} x {result['seqlen']} tokens, `hf` export, "
             f"{result['date']}; AutoRound {result['autoround_iters']} iterations, `final_block: same`."
             f"{machine_text(result.get('machine'))}", "",
             "| model | method | blocks | hidden | FFN | s / block | quantize s | run peak RSS MB | quantize peak MB | "
             "resident after load MB | block + act MB | (quantize peak - load) / (block + act) | disk MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        q = f"{r['quantize_s']}" if r["measured_blocks"] == r["blocks"] else \
            f"{r['quantize_s']} ({r['measured_blocks']} blocks; {r['extrapolated_s']} for {r['blocks']})"
        lines.append(f"| {r['model']} | {r['method']} | {r['blocks']} | {r['hidden']} | {r['ffn']} | "
                     f"{r['s_per_block']} | {q} | {r['peak_rss_mb']} | {r['quantize_peak_rss_mb']} | {r['load_rss_mb']} | "
                     f"{r['block_mb'] + r['act_mb']:.1f} | {r['rss_over_block']} | {r['disk_mb']} |")
    lines += ["", "Extrapolation (per-block seconds fitted as `c + a x` on the measured shapes, x the block's weights, "
              "GPTQ's `sum d_out d_in^2 + tokens d_in^2`; AutoRound at 200 iterations; peak RSS = libraries + "
              "non-block tensors at bf16 + the quantize stage's growth per MB of working set measured on the largest shape x the "
              "target's working set: block + activations, GPTQ also its Hessians):", "",
              "| shape | method | measured | params / block | s / block | total hours | working set MB | "
              "peak RSS GB |", "|---|---|---|---|---|---|---|---|"]
    for e in result["extrapolation"]:
        lines.append(f"| {e['model']} | {e['method']} | {'yes' if e['measured'] else 'no'} | {e['block_params']:,} | "
                     f"{e['s_per_block']} | {e['total_h']} | {e['working_mb']} | {e['peak_rss_gb']} |")
    return "\n".join(lines) + "\n"
