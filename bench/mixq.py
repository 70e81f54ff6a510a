"""MixQ-style W4A4 MXFP4 baseline (issue #51; `python -m bench peers --scheme mxfp4 --cells mixq-32`): SmoothQuant
smoothing, then every linear's `k` loudest input columns kept at 8 bits and the rest in MXFP4, weights and
activations alike. The idea of the W4A4 MXFP4 challenge entry among our seed papers (outlier channels at a higher
precision beside a microscaled 4-bit body), as a baseline for InfoQuant and the Hadamard rotation; no compressed-tensors
engine runs per-column mixed precision, so this is an evaluation of the arithmetic, not an export.

What a cell `mixq-K` computes, on the seed's calibration windows (the same ones every cell draws):

1. compress's SmoothQuant stage as the `sq+rtn` cell runs it (alpha searched per group on MXFP4's served
   arithmetic, folded into the norms): the recipe of that cell, run by compress's pipeline without evaluation or
   export, once per seed for all the run's mixq-K cells; its per-block scales (the stage directory's
   `smoothquant_block_NNNN.safetensors`) are folded into a fresh full-precision model with the stage's own
   `fold.apply_scales`;
2. per quantized linear (every linear of the blocks, as the quantize stage rounds), max |x| per input column over the
   calibration windows on the smoothed model; the K columns with the largest are its outlier columns;
3. weights: the outlier columns set aside, the rest rounded to MXFP4 (E2M1 in groups of 32 columns with power-of-two
   scales: `activations.fp4_quant`, the same arithmetic as compress's MXFP4 weight RTN), the outlier columns in FP8
   E4M3 with one scale per output row (max |w| / 448); activations the same per token: MXFP4 on the other columns,
   E4M3 with a per-token scale on the outlier columns;
4. scored with compress's evaluator (`compare_causal`, the function `compress eval` runs) against the full-precision
   model on the bench's evaluation tokens.

With K = 0 this is the `sq+rtn` cell's arithmetic exactly (tests/bench/test_mixq.py checks the evaluation equals
the pipeline's own). Storage per weight: 4 bits and an 8-bit scale per 32 on the body, 8 bits on the outlier
columns, an fp16 scale per row for them and a 16-bit index per outlier column.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

OUTLIER_BITS, SCALE_BITS, INDEX_BITS = 8, 16, 16


def columns_of(cell: str) -> int:
    """K of a `mixq-K` cell."""
    return int(cell.split("-", 1)[1])


def _fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x on E4M3 with one scale per row (its last dimension's max |x| / 448), dequantized."""
    from compress.quantize.activations import ActivationSpec, round_to

    spec = ActivationSpec(type="float")
    return round_to(x, x.abs().amax(-1, keepdim=True) / spec.half, spec)


def mixed(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """x (rows along its last dimension) with the columns `cols` on FP8 per row and the others on MXFP4 (those
    columns zeroed for the groups' scales), dequantized; `cols` empty: plain MXFP4."""
    from compress.quantize.activations import SCHEME_ACTIVATIONS, fp4_quant

    mx = SCHEME_ACTIVATIONS["mxfp4"]
    if cols.numel() == 0:
        return fp4_quant(x, mx)
    body = x.clone()
    body[..., cols] = 0
    out = fp4_quant(body, mx)
    out[..., cols] = _fp8_rows(x[..., cols].float()).to(x.dtype)
    return out


def storage_bits(d_out: int, d_in: int, k: int) -> int:
    """Bits of one (d_out, d_in) weight with k outlier columns (module docstring)."""
    body = d_out * (d_in - k) * 4 + d_out * math.ceil(d_in / 32) * 8
    return body + (d_out * k * OUTLIER_BITS + d_out * SCALE_BITS + k * INDEX_BITS if k else 0)


@torch.no_grad()
def outlier_columns(model, names: list[str], calib: torch.Tensor, k: int, batch_size: int = 8) -> dict:
    """{layer: the k input columns of largest max |x| over the calibration windows} (sorted indices)."""
    if k == 0:  # nothing to choose: no calibration pass
        return {n: torch.empty(0, dtype=torch.long) for n in names}
    top: dict[str, torch.Tensor] = {}
    handles = []

    def watch(name):
        def hook(_m, args):
            a = args[0].detach().abs().flatten(0, -2).amax(0).float()
            top[name] = a if name not in top else torch.maximum(top[name], a)
        return hook

    try:
        for n in names:
            handles.append(model.get_submodule(n).register_forward_pre_hook(watch(n)))
        for i in range(0, calib.shape[0], batch_size):
            model(calib[i:i + batch_size])
    finally:
        for h in handles:
            h.remove()
    return {n: torch.sort(torch.topk(top[n], min(k, top[n].numel())).indices).values for n in names}


def smoothed_model(path: str, run_dir: Path):
    """The full-precision model with the SmoothQuant stage's scales of `run_dir` folded in (step 1)."""
    from safetensors.torch import load_file

    from compress.models.adapters import ModelAdapter
    from compress.models.loading import load_model
    from compress.smooth import fold
    from compress.smooth.smoothquant import FOLD

    model, tok = load_model(path, "float32")
    adapter = ModelAdapter(model)
    stage = next((run_dir / "stages").glob("*smooth*"))
    for i in range(len(adapter.blocks)):
        f = stage / FOLD.format(i)
        if not f.is_file():
            raise RuntimeError(f"{f} is missing: the SmoothQuant stage did not finish")
        fold.apply_scales(adapter, fold.groups(adapter, i), load_file(str(f)))
    names = [n for i in range(len(adapter.blocks)) for n in adapter.block_linears(i)]
    return model, tok, names


def mixq_cell(cell: str, path: str, s: dict, seed: int, calib: torch.Tensor, tmp: Path) -> dict:
    """One seed of a `mixq-K` cell: its row (kl, top1, ppl_ratio, ..., effective_bits)."""
    import time

    import yaml

    from bench.peers import TEST, WINDOW, NotAvailable, compress_recipe
    from compress import pipeline
    from compress.eval.data import read_text, token_stream
    from compress.eval.generation import compare_causal
    from compress.models.loading import load_model
    from compress.recipe import load_recipe

    if s.get("scheme") != "mxfp4" or s.get("kv_cache"):
        raise NotAvailable("MixQ's baseline is W4A4 MXFP4: --scheme mxfp4, without --kv-cache")
    k = columns_of(cell)
    rec = compress_recipe(path, "sq+rtn", s, seed)
    rec.update(eval={"enabled": False}, export={"formats": []})
    out = tmp / f"mixq-smoothquant-{seed}"  # the seed's smoothing, shared by the run's mixq-K cells
    t = time.time()
    if not (out / "done").is_file():
        shutil.rmtree(out, ignore_errors=True)
        (tmp / f"{out.name}.yaml").write_text(yaml.safe_dump(rec, sort_keys=False))
        pipeline.run(load_recipe(tmp / f"{out.name}.yaml"), out, force=True, quiet=True)
        (out / "done").write_text("")
    model, tok, names = smoothed_model(path, out)
    cols = outlier_columns(model, names, calib, k)
    bits = weights = 0
    with torch.no_grad():
        for n in names:
            lin = model.get_submodule(n)
            lin.weight.copy_(mixed(lin.weight.float(), cols[n]).to(lin.weight.dtype))
            bits += storage_bits(*lin.weight.shape, cols[n].numel())
            weights += lin.weight.numel()
    seconds = time.time() - t
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, c=cols[n]: (mixed(args[0], c), *args[1:])) for n in names]
    try:
        ref, _ = load_model(path, "float32")
        ids = token_stream(tok, read_text(TEST))
        ev = compare_causal(ref, model, ids, window=WINDOW, bos_id=getattr(tok, "bos_token_id", None),
                            max_tokens=s["max_tokens"], prompts=0, prompt_tokens=0, new_tokens=0)
    finally:
        for h in handles:
            h.remove()
    return {**{key: ev[key] for key in ("kl", "top1", "ppl_ratio", "ppl", "fp_ppl", "tokens")},
            "outlier_columns": k, "quantized_layers": len(names), "quantized_weights": weights,
            "linear_bytes": bits // 8, "effective_bits": round(bits / weights, 4),
            "quantize_seconds": round(seconds, 2),
            "bytes_from": "bench/mixq.py storage_bits: MXFP4 body + FP8 outlier columns, their row scales and indices "
                          "(no file: no engine runs it)"}
