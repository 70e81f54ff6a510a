"""The measurement of bench/onnx-graph.md: the hand-written graph (a file from git history) against
compress.export.onnx on ref-llama-7m W4 g32 with a KV cache: export seconds, decode ms/token, logits."""

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from transformers import AutoModelForCausalLM

from compress.export.onnx import export_onnx
from compress.primitives import rtn

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "data" / "models" / "ref-llama-7m"


def main(handwritten: str, out: str = "/tmp/onnx-graph-compare") -> None:
    spec = importlib.util.spec_from_file_location("handwritten_onnx", handwritten)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    qweights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            qweights[name] = rtn(module.weight.data, 4, 32, False)
            module.weight.data = qweights[name].dequantize(module.weight.dtype)
    paths = {}
    for label, fn in (("hand-written", old.export_onnx), ("torch", export_onnx)):
        t = time.time()
        paths[label] = fn(model, qweights, f"{out}/{label}", kv_cache=True)["path"]
        print(f"{label}: export {time.time() - t:.1f} s, {Path(paths[label]).stat().st_size:,} bytes")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    sessions = {k: ort.InferenceSession(p, options) for k, p in paths.items()}
    ids = torch.randint(3, 1000, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    best = {k: float("inf") for k in sessions}
    for _ in range(5):
        for label, session in sessions.items():
            best[label] = min(best[label], decode(session))
    for label, session in sessions.items():
        logits = session.run(["logits"], feeds(session, ids.numpy(), None))[0]
        err = np.abs(logits - ref).max() / (ref.max() - ref.min())
        print(f"{label}: decode {best[label] * 1e3:.2f} ms/token ({best[label] / best['hand-written']:.2f}x), "
              f"logits rel err {err:.1e}")


def feeds(session, ids, present, start=0):
    f = {"input_ids": ids, "attention_mask": np.ones((1, start + ids.shape[1]), np.int64)}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            f[i.name] = (present[i.name.replace("past_key_values", "present")] if present is not None
                         else np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32))
    return f


def decode(session, prompt=64, steps=32) -> float:
    names = [o.name for o in session.get_outputs()]
    ids = np.random.RandomState(0).randint(3, 1000, (1, prompt))
    out = dict(zip(names, session.run(None, feeds(session, ids, None))))
    t = time.perf_counter()
    for i in range(steps):
        out = dict(zip(names, session.run(None, feeds(session, ids[:, -1:], out, prompt + i))))
    return (time.perf_counter() - t) / steps


if __name__ == "__main__":
    main(*sys.argv[1:])
