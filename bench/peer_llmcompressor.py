"""Run inside llm-compressor's own environment (`python -m bench peers --build-env llmcompressor`), by
bench/peers.py: quantize one model with llm-compressor's `oneshot` on the given calibration windows, save its
compressed-tensors checkpoint, and write what compress scores: the model's weights as that checkpoint holds
them, the quantized layers dequantized by compressed-tensors' own decompressor (AWQ's rescaled norms
included), and the stored bytes of each layer's codes, scales and zero points. It imports nothing
from compress (a different transformers lives here).

    python bench/peer_llmcompressor.py JOB.json

JOB.json: {"model", "windows" (a .pt of an (N, L) LongTensor), "out", "method" ("gptq" | "awq+rtn" | "sq+gptq"),
"bits", "group_size", "sym", "scheme" (null, or "w8a8-int8" / "fp8" / "nvfp4a16": llm-compressor's W8A8 /
FP8_DYNAMIC / NVFP4A16 preset,
GPTQ weights ("gptq"), with "sq+gptq" after `SmoothQuantModifier(smoothing_strength=0.8)` as its
examples/quantization_w8a8_int8 does, or its observer's rounding alone ("rtn": `QuantizationModifier`, as its
examples/quantization_w8a8_fp8 does)), "kv_cache" (null, or compress's TYPE[:SCALES]: its `kv_cache_scheme`, static
per tensor or per head)}.
Writes out/compressed/ (the checkpoint), out/result.json and, weight-only, out/dequantized.safetensors (a scheme's
checkpoint is scored as served: bench/peers.py loads it with transformers + compressed-tensors).
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

STORED = ("weight_packed", "weight_scale", "weight_zero_point")  # codes, scales, zero points (not weight_shape)


def header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def stored_bytes(ckpt: Path) -> dict:
    """{layer: bytes of its codes, scales and zero points} in the compressed checkpoint's safetensors."""
    out: dict[str, int] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for name, meta in header(f).items():
            if name == "__metadata__":
                continue
            layer, _, suffix = name.rpartition(".")
            if suffix in STORED:
                out[layer] = out.get(layer, 0) + meta["data_offsets"][1] - meta["data_offsets"][0]
    return out


def cpu_without_pinning() -> list[str]:
    """llm-compressor 0.14.0.1's AWQ pins its cached activations (`IntermediatesCache.pin_memory`, to speed up
    host-to-device copies in its grid search), which torch refuses without an accelerator ("Cannot access
    accelerator device when none is available"). Pinning changes no value: without CUDA it is skipped here."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.cuda.is_available():
        return []
    IntermediatesCache.pin_memory = lambda self, *a, **k: None
    return ["llmcompressor.pipelines.cache.IntermediatesCache.pin_memory: a no-op (no accelerator)"]


def versions() -> dict:
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers

    return {"llmcompressor": llmcompressor.__version__, "compressed-tensors": compressed_tensors.__version__,
            "transformers": transformers.__version__, "torch": torch.__version__}


def described(recipe: list) -> list[str]:
    return [type(m).__name__ + " " + json.dumps(m.model_dump(exclude_none=True, mode="json"), default=str)
            for m in recipe]


def main(job_path: str) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = json.loads(Path(job_path).read_text())
    patched = cpu_without_pinning()
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    windows = torch.load(job["windows"])
    n, seqlen = windows.shape
    ds = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    if job.get("scheme"):  # a weight-and-activation preset (llm-compressor's examples/quantization_w8a8_int8, _fp8)
        preset = {"w8a8-int8": "W8A8", "fp8": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK",
                  "nvfp4a16": "NVFP4A16", "mxfp4a16": "MXFP4A16",
                  "w4a8-int8": "W4A8", "w4a8-fp8": "W4AFP8", "w4a4": "W4A4", "nvfp4": "NVFP4",
                  "mxfp4": "MXFP4"}[job["scheme"]]
        if job["method"] not in ("gptq", "sq+gptq", "rtn"):
            raise SystemExit(f"method {job['method']!r} has no {preset} recipe here")
        recipe = [SmoothQuantModifier(smoothing_strength=0.8)] if job["method"] == "sq+gptq" else []
        modifier = QuantizationModifier if job["method"] == "rtn" else GPTQModifier
        kv = {}
        if job.get("kv_cache"):  # its kv_cache_scheme: TYPE[:SCALES] as compress's `kv_cache` / `kv_scales`
            typ, _, scales = job["kv_cache"].partition(":")
            strategy = {"": "tensor", "tensor": "tensor", "head": "attn_head"}.get(scales)
            if strategy is None:
                raise SystemExit(f"--kv-cache {job['kv_cache']}: llm-compressor calibrates static KV scales only")
            kv = {"kv_cache_scheme": QuantizationArgs(num_bits=8 if typ in ("fp8", "int8") else 4,
                                                      type="float" if typ == "fp8" else "int", symmetric=True,
                                                      strategy=strategy, dynamic=False)}
        recipe.append(modifier(targets="Linear", scheme=preset, ignore=["lm_head"], **kv))
    else:  # W4A16-style: integer weights in groups, activations untouched, every Linear but the LM head
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=job["bits"], type="int", symmetric=job["sym"], strategy="group", group_size=job["group_size"]))
        quant = {"config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}
        if job["method"] == "gptq":
            recipe = [GPTQModifier(**quant)]  # its defaults: block_size 128, dampening_frac 0.01, actorder static
        elif job["method"] == "awq+rtn":
            recipe = [AWQModifier(), QuantizationModifier(**quant)]  # AWQ's defaults (n_grid 20, duo_scaling True)
        else:
            raise SystemExit(f"unknown method {job['method']!r}")
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(job["model"])
    t = time.time()
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe, num_calibration_samples=n, max_seq_length=seqlen,
            shuffle_calibration_samples=False,
            pipeline="sequential" if job["method"] in ("gptq", "sq+gptq") else "independent")
    seconds = time.time() - t
    ckpt = out / "compressed"
    model.save_pretrained(ckpt, save_compressed=True)
    tok.save_pretrained(ckpt)
    qc = json.loads((ckpt / "config.json").read_text()).get("quantization_config", {})
    if job.get("scheme"):  # scored as served (bench/peers.py loads the checkpoint itself)
        result = {"seconds": round(seconds, 2), "format": qc.get("format"), "quant_method": qc.get("quant_method"),
                  "versions": versions(), "patched": patched, "recipe": described(recipe)}
        (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        return
    # read the checkpoint back as its users do, dequantized by compressed-tensors (run_compressed=False)
    from transformers.utils.quantization_config import CompressedTensorsConfig

    back = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(run_compressed=False))
    sizes = stored_bytes(ckpt)
    # every parameter, not only the quantized layers': AWQ also rescales the norms it smooths into
    # (the decompressed modules keep weight_scale / weight_zero_point as parameters: not model weights)
    weights = {n: p.detach().float().contiguous().clone() for n, p in back.named_parameters()
               if n.rpartition(".")[2] in ("weight", "bias")}
    save_file(weights, str(out / "dequantized.safetensors"))
    result = {"seconds": round(seconds, 2), "layers": len(sizes), "stored_bytes": sizes,
              "format": qc.get("format"), "quant_method": qc.get("quant_method"),
              "versions": versions(), "patched": patched, "recipe": described(recipe)}
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
