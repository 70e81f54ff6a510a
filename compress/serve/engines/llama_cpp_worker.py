"""llama.cpp's side of `compress serve-check --engine llama.cpp` and of compress's GGUF tools, run with the llama.cpp
environment's own python (`compress serve-env llama.cpp`; the caller is compress/serve/engines/llamacpp.py, named
apart from the `llama_cpp` package, which a `llama_cpp.py` beside this file would shadow).

Standalone on purpose: that environment has llama-cpp-python and llama.cpp's tools, not compress. Usage:
`python llama_cpp_worker.py REQUEST.json RESULT.json`; REQUEST = {"op": ..., ...}:

    decode    {"model": gguf, "prompts": [[token ids]], "n_tokens": n, "top_k": k, "eos": [ids], "threads": t,
              "kv_type": "f16" | "f32"} -> {"tokens": [[ids]], "top": [[{id: logprob}]]} (the `Decoded` JSON of
              compress/serve/decoded.py): greedy from each prompt's ids as given (nothing added, no BOS), the
              log-probabilities of llama.cpp's own logits before the EOS mask, EOS (the model's and `eos`) masked
              for all `n_tokens` steps.
    score     {"model", "windows": [{"tokens": [ids], "first": i}], "threads", "kv_type"} -> {"nll": [[nats]]}: each
              window from an empty KV cache; the negative log-likelihood of tokens[j + 1] from the logits at
              position j, for j = first .. len - 2 (compress/eval/metrics.py's `Window`).
    quantize  {"model": F32/F16 gguf, "out": gguf, "type": "Q4_K_M" | "Q8_0" | ..., "threads", "imatrix": file or
              null} -> {"type", "bytes"}: `llama_cpp.llama_model_quantize`; with an importance matrix, the
              environment's `llama-quantize --imatrix` (the C API takes the matrix already read and normalised, which
              is what that program's loader does, for both the .gguf and the legacy .dat format).
    imatrix   {"model", "text": file, "out": file (.gguf, or .dat for the legacy format), "chunk_size": n_ctx,
              "chunks": n, "threads"} -> {"out", "log"}: the environment's `llama-imatrix`.

Every result also carries "llama_cpp" (the binding's version) and "system" (llama.cpp's system info line).
"""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np

KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}
BIN = Path(sys.executable).parent  # the environment's bin/: llama-quantize, llama-imatrix, llama-perplexity


def load(req: dict, n_ctx: int) -> "llama_cpp.Llama":
    """The model with every position's logits kept; the context rounded up to 256."""
    return llama_cpp.Llama(model_path=req["model"], n_ctx=-(-max(n_ctx, 64) // 256) * 256, n_batch=512,
                           n_ubatch=512, logits_all=True, n_threads=req.get("threads"),
                           n_threads_batch=req.get("threads"), type_k=KV_TYPES[req.get("kv_type", "f16")],
                           type_v=KV_TYPES[req.get("kv_type", "f16")], flash_attn=False, verbose=False)


def fresh(llm) -> None:
    """An empty KV cache: the next `eval` starts at position 0."""
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def decode(req: dict) -> dict:
    prompts, n, k = req["prompts"], req["n_tokens"], req["top_k"]
    llm = load(req, max(len(p) for p in prompts) + n)
    eos = [e for e in {*req.get("eos", []), llm.token_eos()} if 0 <= e < llm.n_vocab()]
    tokens, top = [], []
    for prompt in prompts:
        fresh(llm)
        llm.eval(prompt)
        gen, steps = [], []
        for _ in range(n):
            logp = log_softmax(llm.scores[llm.n_tokens - 1])
            best = np.argsort(-logp, kind="stable")[:k]
            steps.append({str(int(i)): float(logp[i]) for i in best})
            logp[eos] = -np.inf
            nxt = int(np.argmax(logp))
            gen.append(nxt)
            llm.eval([nxt])
        tokens.append(gen)
        top.append(steps)
    return {"tokens": tokens, "top": top, "n_vocab": llm.n_vocab(), "metadata": _metadata(llm)}


def score(req: dict) -> dict:
    windows = req["windows"]
    llm = load(req, max(len(w["tokens"]) for w in windows))
    nll = []
    for w in windows:
        ids, first = w["tokens"], w["first"]
        fresh(llm)
        llm.eval(ids)
        logp = log_softmax(llm.scores[first:len(ids) - 1])
        nll.append([-float(logp[j, t]) for j, t in enumerate(ids[first + 1:])])
    return {"nll": nll}


def quantize(req: dict) -> dict:
    name = req["type"].upper()
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}", None)
    if ftype is None:
        known = sorted(k.removeprefix("LLAMA_FTYPE_MOSTLY_") for k in dir(llama_cpp) if k.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise SystemExit(f"unknown llama.cpp quantization type {req['type']}; known: {', '.join(known)}")
    threads = int(req.get("threads") or 0)
    if req.get("imatrix"):
        cmd = [str(BIN / "llama-quantize"), "--imatrix", req["imatrix"], req["model"], req["out"], name, str(threads or 1)]
        log = _tool(cmd)
    else:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, threads
        rc = llama_cpp.llama_model_quantize(req["model"].encode(), req["out"].encode(), ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"llama_model_quantize failed ({rc}) on {req['model']} -> {name}")
        log = ""
    return {"type": name, "bytes": os.path.getsize(req["out"]), "imatrix": req.get("imatrix"), "log": log[-2000:]}


def imatrix(req: dict) -> dict:
    out = req["out"]
    cmd = [str(BIN / "llama-imatrix"), "-m", req["model"], "-f", req["text"], "-o", out,
           "--output-format", "dat" if out.endswith(".dat") else "gguf", "-c", str(req.get("chunk_size", 512)),
           "--chunks", str(req.get("chunks", -1)), "-b", str(req.get("chunk_size", 512)), "--no-ppl"]
    if req.get("threads"):
        cmd += ["-t", str(req["threads"])]
    log = _tool(cmd)
    return {"out": out, "bytes": os.path.getsize(out), "log": log[-2000:]}


def _tool(cmd: list) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"{Path(cmd[0]).name} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout + proc.stderr


def _metadata(llm) -> dict:
    keep = ("general.architecture", "general.file_type", "tokenizer.ggml.model", "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    return {k: v for k, v in llm.metadata.items() if k in keep}


def tokenize(req: dict) -> dict:
    """llama.cpp's tokenization of `text` (with BOS where the file's tokenizer adds one)."""
    llm = llama_cpp.Llama(model_path=req["model"], vocab_only=True, verbose=False)
    return {"tokens": llm.tokenize(req["text"].encode("utf-8"), add_bos=True, special=False)}


OPS = {"decode": decode, "score": score, "quantize": quantize, "imatrix": imatrix, "tokenize": tokenize}


def main(request_path: str, result_path: str) -> None:
    req = json.loads(Path(request_path).read_text())
    if req.get("op") not in OPS:
        raise SystemExit(f"unknown op {req.get('op')!r}; one of {', '.join(OPS)}")
    result = OPS[req["op"]](req)
    result.update(llama_cpp=llama_cpp.__version__, system=llama_cpp.llama_print_system_info().decode().strip())
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
