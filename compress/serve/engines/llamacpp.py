"""llama.cpp from compress: each call runs `llama_cpp_worker.py` with the llama.cpp environment's python (`compress
serve-env llama.cpp`), JSON in and JSON out, as `serve-check --engine vllm` runs vLLM.

    decode(gguf, prompts, n_tokens, eos)      greedy tokens and top-5 log-probabilities (`Decoded`)
    score(gguf, windows)                      per-token NLL of compress's perplexity windows, each from an empty cache
    quantize(src, dst, type, imatrix=None)    an F32/F16 GGUF to Q4_0 ... Q8_0, Q2_K ... Q6_K (llama_model_quantize)
    imatrix(gguf, text, out, ...)             llama-imatrix's importance matrix of a text
    convert(hf_dir, out, outtype)             llama.cpp's own convert_hf_to_gguf.py (the sdist's, in the environment)

and, in this process, `emulate_activations(model, gguf)`: llama.cpp's CPU kernels round a linear layer's input
to the dot-product format of its weight's type (F16 for F16 weights, Q8_0 blocks of 32 for Q4_0/Q5_0/Q8_0/IQ4_NL,
Q8_1 for Q4_1/Q5_1, Q8_K blocks of 256 for the K- and IQ-quants: ggml-cpu's `vec_dot_type`); the hooks round a
transformers model's inputs the same way, so compress's reading of a file can be compared with llama.cpp's
arithmetic as well as with float32.

A missing environment is a BadInput naming `compress serve-env llama.cpp`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from compress.errors import BadInput
from compress.serve.decoded import TOP_K, Decoded

ENV = "llama.cpp"
WORKER = Path(__file__).parent / "llama_cpp_worker.py"
KV_TYPES = {"float32": "f32", "float16": "f16"}


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run(op: str, request: dict, *, timeout: float | None = None) -> dict:
    """The worker's result for `op`; RuntimeError with its output's tail when it fails."""
    from compress.serve.envs import python_of

    python = python_of(ENV)
    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"op": op, "threads": threads(), **request}))
        proc = subprocess.run([str(python), str(WORKER), str(req), str(res)], capture_output=True, text=True,
                              cwd=tmp, timeout=timeout, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"llama.cpp `{op}` failed (exit {proc.returncode}):\n{tail}")
        return json.loads(res.read_text())


def decode(gguf: Path, prompts: list[list[int]], n_tokens: int, eos: set[int], *, dtype: str = "float16"
           ) -> tuple[Decoded, dict]:
    """(greedy decoding, {"llama_cpp", "system", "metadata"}); `dtype`: the KV cache's type (weights compute as
    stored; float16 is llama.cpp's default)."""
    out = run("decode", {"model": str(Path(gguf).resolve()), "prompts": prompts, "n_tokens": n_tokens,
                         "top_k": TOP_K, "eos": sorted(eos), "kv_type": _kv(dtype)})
    return Decoded.from_json(out), {k: out.get(k) for k in ("llama_cpp", "system", "metadata")}


def score(gguf: Path, windows, *, dtype: str = "float16") -> list[list[float]]:
    """Per window (compress.eval.metrics.Window), the NLL (nats) of each of its targets, in order."""
    ws = [{"tokens": [int(t) for t in w.inputs], "first": int(w.first)} for w in windows]
    return run("score", {"model": str(Path(gguf).resolve()), "windows": ws, "kv_type": _kv(dtype)})["nll"]


def quantize(src: Path, dst: Path, qtype: str, *, imatrix: Path | None = None) -> dict:
    return run("quantize", {"model": str(Path(src).resolve()), "out": str(Path(dst).resolve()), "type": qtype,
                            "imatrix": str(Path(imatrix).resolve()) if imatrix else None})


def imatrix(gguf: Path, text: Path, out: Path, *, chunk_size: int = 512, chunks: int = -1) -> dict:
    """llama-imatrix over `text` in chunks of `chunk_size` tokens (at most `chunks`; -1: all); `out` ending in .dat
    gets the legacy format, else GGUF."""
    return run("imatrix", {"model": str(Path(gguf).resolve()), "text": str(Path(text).resolve()),
                           "out": str(Path(out).resolve()), "chunk_size": chunk_size, "chunks": chunks})


def convert(hf_dir: Path, out: Path, outtype: str = "f32", *, pre_tokenizer: str | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (the environment's copy, with its pinned transformers 4.57) on a Hugging
    Face checkpoint directory. Two quirks of small custom models are met here: a transformers-5 tokenizer config
    (`tokenizer_class: TokenizersBackend`, unknown to 4.57) is read as `PreTrainedTokenizerFast` (the same
    tokenizer.json), from a staged copy of the directory; `pre_tokenizer` (e.g. "gpt-2" for a byte-level BPE with
    GPT-2's regex) names llama.cpp's pre-tokenizer for a BPE vocabulary its hash table does not know (the script
    refuses those: "BPE pre-tokenizer was not recognized")."""
    from compress.serve.envs import path_of, python_of

    python = python_of(ENV)
    script = path_of(ENV) / "share" / "llama.cpp" / "convert_hf_to_gguf.py"
    with tempfile.TemporaryDirectory(prefix="convert-") as tmp:
        src = _staged(Path(hf_dir), Path(tmp) / "model")
        args = [str(src), "--outfile", str(Path(out).resolve()), "--outtype", outtype]
        shim = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); import conversion.base as b; "
                f"b.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre_tokenizer!r}; "
                "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")
        cmd = ([str(python), "-c", shim, str(script.parent), str(script)] if pre_tokenizer
               else [str(python), str(script)]) + args
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir} (exit {proc.returncode}):\n{tail}")
    return Path(out)


def _staged(hf_dir: Path, dest: Path) -> Path:
    """`hf_dir`, or a copy of it (links to its files) whose tokenizer_config.json names PreTrainedTokenizerFast
    where it named transformers 5's TokenizersBackend."""
    config = hf_dir / "tokenizer_config.json"
    cfg = json.loads(config.read_text()) if config.is_file() else {}
    if cfg.get("tokenizer_class") != "TokenizersBackend":
        return hf_dir
    dest.mkdir()
    for f in hf_dir.iterdir():
        if f.is_file() and f.name != config.name:
            (dest / f.name).symlink_to(f.resolve())
    (dest / config.name).write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return dest


def _kv(dtype: str) -> str:
    if dtype not in KV_TYPES:
        raise BadInput(f"llama.cpp keeps its KV cache in float16 (its default) or float32; --dtype {dtype} is neither")
    return KV_TYPES[dtype]


# -- llama.cpp's activation rounding, emulated on a transformers model ------------------------------------

def q8_blocks(x: torch.Tensor, block: int, fp16_scale: bool) -> torch.Tensor:
    """ggml's quantize_row_q8_0/q8_1 (`fp16_scale`: d = amax/127 stored as fp16) and q8_K (fp32 d) along the last
    dimension in blocks of `block`: round(x * 127/amax) * d (round half to even, as the SIMD and ref code do)."""
    shape = x.shape
    b = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127
    q = torch.round(b * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    scale = d.half().float() if fp16_scale else d
    return (q * scale).reshape(shape).to(x.dtype)


ACTIVATIONS = {  # ggml-cpu's vec_dot_type of each weight type, as a rounding of the input
    "F16": lambda x: x.half().to(x.dtype), "BF16": lambda x: x.bfloat16().to(x.dtype),
    **{t: lambda x: q8_blocks(x, 32, True) for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4")},
    **{t: lambda x: q8_blocks(x, 256, False) for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS",
                                                       "IQ3_XXS", "IQ3_S", "IQ2_S", "IQ1_S", "IQ1_M", "IQ4_XS",
                                                       "TQ1_0", "TQ2_0")},
}


def emulate_activations(model, gguf: Path) -> tuple[list, dict[str, str]]:
    """Forward pre-hooks rounding each nn.Linear's input as llama.cpp does for that layer's weight type in `gguf`
    (names mapped by gguf-py's tensor map; a tied LM head takes token_embd's type). Returns (the hooks' handles,
    {layer: weight type}); remove the handles to restore the model."""
    import gguf as gg

    reader = gg.GGUFReader(str(gguf))
    types = {t.name.removesuffix(".weight"): t.tensor_type.name for t in reader.tensors}
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    names = gg.get_tensor_name_map(next(a for a, n in gg.MODEL_ARCH_NAMES.items() if n == arch),
                                   model.config.num_hidden_layers)
    handles, found = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        key = names.get_name(name)
        qtype = types.get(key) or (types.get("token_embd") if key == "output" else None)
        if qtype in ACTIVATIONS:
            fn = ACTIVATIONS[qtype]
            handles.append(module.register_forward_pre_hook(lambda m, args, fn=fn: (fn(args[0]), *args[1:])))
        found[name] = qtype
    return handles, found
