"""Helpers shared by the tests (one place, instead of tests importing tests): tiny and real models quantized
by RTN, reload checks of the hf export, ONNX Runtime and OpenVINO runners, quick recipe settings."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import openvino as ov
import torch
from conftest import MODELS, TEXT
from transformers import AutoModelForCausalLM

from compress.export.hf import read_quantized
from compress.export.openvino import EXACT_CPU_CONFIG
from compress.primitives import rtn


def quantize_model(model, scheme_of) -> dict:
    """RTN every linear for which scheme_of(name) gives (bits, group_size, sym); set W <- W_hat."""
    qweights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (scheme := scheme_of(name)) is not None:
            qw = rtn(module.weight.data, *scheme)
            module.weight.data = qw.dequantize(module.weight.dtype)
            qweights[name] = qw
    return qweights


def in_blocks(scheme):
    return lambda name: scheme if name.startswith("model.layers.") else None


def check_reload(model, qweights, out_dir, vocab):
    """Reload with transformers, compare logits three ways, and read_quantized bit-exactly."""
    loaded = AutoModelForCausalLM.from_pretrained(out_dir)
    config, back = read_quantized(out_dir)
    x = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x).logits
        as_loaded = loaded(x).logits.float()  # auto-round runs it in fp16 on CPU
        torch.nn.Module.float(loaded)  # PreTrainedModel.float() refuses quantized models
        fp32 = loaded(x).logits
    rng = (ref.max() - ref.min()).item()
    assert (fp32 - ref).abs().max().item() < 1e-3 * rng  # the unquantized tensors are stored in fp16
    assert (as_loaded - ref).abs().max().item() < 1e-2 * rng
    for name, qw in back.items():  # each packed layer decodes exactly
        layer = loaded.get_submodule(name)
        with torch.no_grad():
            w = layer(torch.eye(qw.in_features)) - (layer.bias if getattr(layer, "bias", None) is not None else 0)
        assert torch.equal(w.T, qw.dequantize(torch.float32)), name
        orig = qweights[name]
        assert (qw.bits, qw.group_size, qw.sym) == (orig.bits, orig.group_size, orig.sym), name
        assert torch.equal(qw.codes, orig.codes) and torch.equal(qw.zeros, orig.zeros), name
        assert torch.equal(qw.scales, orig.scales), name
        assert type(loaded.get_submodule(name)).__name__ == "QuantLinear", name
    return config, back, loaded


def quantized(model, bits, group, sym, skip=()):
    """RTN every linear inside the blocks (names ending in `skip` left out), W <- W_hat."""
    return quantize_model(model, lambda n: (bits, group, sym) if n.startswith("model.layers.") and not n.endswith(skip)
                          else None)


def ort_logits(path, ids: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(["logits"], {"input_ids": ids.numpy()})[0]


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(out - ref).max() / (ref.max() - ref.min()))


def op_types(path) -> dict[str, int]:
    counts = {}
    for node in onnx.load(str(path)).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def load(name):
    return AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float32).eval()


def fc_precisions(compiled) -> dict:
    """(layerType, runtimePrecision) counts of the compiled model's FullyConnected layers."""
    out = {}
    for op in compiled.get_runtime_model().get_ops():
        rt = op.get_rt_info()
        if rt["layerType"].astype(str) == "FullyConnected":
            key = rt["runtimePrecision"].astype(str)
            out[key] = out.get(key, 0) + 1
    return out


def run_ir(path, ids: torch.Tensor):
    compiled = ov.Core().compile_model(str(path), "CPU", {**EXACT_CPU_CONFIG, "INFERENCE_NUM_THREADS": 1})
    runtime = fc_precisions(compiled)
    return compiled([ids.numpy()])[0], runtime


# what the bundled recipes read before they shipped their own text (`bundled:botchan-*`): tests that check numbers on
# a bundled recipe pass it, so the numbers stay comparable
WIKITEXT = ["--calibration", str(TEXT / "wikitext-2" / "valid.txt"),
            "--eval-data", str(TEXT / "wikitext-2-raw" / "wiki.test.raw")]


def shrink(recipe: dict) -> list[str]:
    """--set options that make a recipe quick; nothing else about it changes."""
    sets = ["calibration.nsamples=8", "calibration.seqlen=64", "eval.max_tokens=512"]
    for i, stage in enumerate(recipe["stages"]):
        if "iters" in stage:
            sets.append(f"stages.{i}.iters=2")
        if "updates" in stage:
            sets.append(f"stages.{i}.updates=2")
        if "steps" in stage:
            sets.append(f"stages.{i}.steps=4")
        if "samples" in stage:
            sets.append(f"stages.{i}.samples=4")
    return [a for s in sets for a in ("--set", s)]


def tensor_hashes(out: Path, export: str = "hf") -> dict[str, str]:
    """sha256 of every tensor's bytes in OUT/EXPORT/model.safetensors."""
    from safetensors import safe_open

    hashes = {}
    with safe_open(str(out / export / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name).contiguous().reshape(-1)
            hashes[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    return hashes


def lab(*args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m bench ARGS` (the lab, bench/__main__.py) run in this process from
    the repository root, as conftest's `invoke` runs `compress`."""
    from conftest import in_process

    from bench.__main__ import main

    return in_process(main, args)


def quick_suite(tmp_path: Path, suite: str, *args) -> tuple[dict, Path]:
    """`python -m bench quality --suite SUITE --quick`: its JSON result and the path of its markdown (the
    figures go beside it)."""
    import json

    js, md = tmp_path / f"{suite}.json", tmp_path / f"{suite}.md"
    rc, _, err = lab("quality", "--suite", suite, "--quick", "--json", js, "--markdown", md, *args)
    assert rc == 0, err
    return json.loads(js.read_text()), md
