"""`compress serve-check OUT --engine E`: the export loaded in an engine agrees with transformers on the same weights.

The engine greedy-decodes `PROMPTS` (token ids from the export's tokenizer, `N_TOKENS` new tokens each, EOS masked
until then as every engine's min-tokens option does) in `dtype` and reports its top-5 log-probabilities per
position; the reference is transformers' own modeling code on exactly the export's weights (`reference_model`: the
packed layers read back by `read_quantized`, bit-exact, as dense linears; every other tensor as stored) in float32,
so the differences measured are the engine's. `compare` counts the equal tokens, the top-5 overlap and the largest
|dlogprob|; `agree`: every token equal, or each divergence at a tie of the reference (its two tokens within
`TIE` nats: an fp16 rounding can flip it, a mis-read weight does not stop there).

Engines and what they load from a run's output directory (or an export directory given directly):

    vllm            the hf export (or, for a weight-and-activation scheme, the compressed-tensors export, whose
                    reference is transformers' loading of it), in vLLM's own environment (`compress serve-env vllm`), a subprocess running
                    `engines/vllm_worker.py`
    transformers    the hf export through `AutoModelForCausalLM.from_pretrained` (auto-round's loader, which forces
                    fp16 on CPU); the reference is then compress's own reading of the same files. `perplexity` also
                    compares both perplexities on a text's first `max_tokens` tokens.
    openvino-genai  the openvino export (`engines/openvino_genai.py`); reference from the run's hf export
    ort-genai       the onnx export (`engines/ort_genai.py`); reference from the run's hf export
    llama.cpp       a GGUF file (the run's gguf export, or a .gguf given directly), in llama.cpp's own environment
                    (`compress serve-env llama.cpp`, `engines/llamacpp.py`); the reference is compress's reading
                    of the same file (transformers' GGUF loader); `perplexity` compares both on the same windows

A check writes nothing into the export directory: the directory's listing and modification times are compared
before and after, and a change is an error.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch

from compress.errors import BadInput, RunFailure
from compress.serve.decoded import N_TOKENS, PROMPTS, TOP_K, Decoded, compare

logger = logging.getLogger(__name__)

ENGINES = ("vllm", "transformers", "openvino-genai", "ort-genai", "llama.cpp")
READS = {"vllm": "hf", "transformers": "hf", "openvino-genai": "openvino", "ort-genai": "onnx", "llama.cpp": "gguf"}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
WINDOW = 256  # compress's evaluation window (the recipe default): the llama.cpp perplexity's windows


def serve_check(out, engine: str, *, n_tokens: int = N_TOKENS, dtype: str = "float16",
                perplexity: str | None = None, max_tokens: int = 4096, floor: bool = False) -> dict:
    """{"engine", "export", "reference", "tokens": {equal, total}, "top5_overlap", "max_dlogprob", "agree", ...};
    `floor`: also transformers itself in `dtype` against the float32 reference ("floor": what that dtype alone
    costs on this model, the oracle an engine's numbers are read against)."""
    if engine not in ENGINES:
        raise BadInput(f"unknown engine `{engine}`; choose one of {', '.join(ENGINES)}")
    if dtype not in DTYPES:
        raise BadInput(f"unknown dtype `{dtype}`; choose one of {', '.join(DTYPES)}")
    if engine == "llama.cpp":  # a GGUF file, its reference compress's own reading of it
        if floor:
            raise BadInput("--floor is transformers in --dtype against float32 on an hf export; llama.cpp reads GGUF")
        return check_gguf(Path(out), n_tokens=n_tokens, dtype=dtype, perplexity=perplexity, max_tokens=max_tokens)
    export, hf = _directories(Path(out), engine)
    kv = _vllm_refusals(export, dtype) if engine == "vllm" else None  # refused before anything runs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    before = _snapshot(export)
    ref_model = reference_model(hf, torch.float32)
    eos = _eos_ids(hf)
    reference = greedy(ref_model, prompts, n_tokens, eos)
    result = {"engine": engine, "export": str(export), "reference": f"transformers on {hf} (float32)", "dtype": dtype,
              "prompts": len(prompts), "new_tokens": n_tokens}
    if engine == "vllm":
        got, info = _vllm(export, prompts, n_tokens, dtype, kv)
        result.update(info)
        if "CPUInt8ScaledMMLinearKernel" in info["kernels"] and not has_vnni():
            result["warning"] = INT8_WITHOUT_VNNI
    elif engine == "transformers":
        loaded = _transformers(export)
        result["loaded_dtype"] = str(next(loaded.parameters()).dtype).removeprefix("torch.")
        torch.nn.Module.to(loaded, DTYPES[dtype])  # auto-round's CPU loader forces float16; compute in --dtype
        packed = _packed_names(export)
        result["loaded_layers"] = sorted({f"{type(m).__module__}.{type(m).__name__}" for n, m in loaded.named_modules()
                                          if n in packed})  # the loader's backend
        got = greedy(loaded, prompts, n_tokens, eos)
        if perplexity:
            result["perplexity"] = _perplexities(loaded, ref_model, tokenizer, perplexity, max_tokens)
    elif engine == "openvino-genai":
        from compress.serve.engines import openvino_genai

        got = openvino_genai.decode(export, prompts, n_tokens)
    else:
        from compress.serve.engines import ort_genai

        got = ort_genai.decode(export, prompts, n_tokens)
    if floor and dtype != "float32":
        f = compare(reference, greedy(reference_model(hf, DTYPES[dtype]), prompts, n_tokens, eos))
        result["floor"] = {"tokens": {"equal": f["equal"], "total": f["total"]}, "top5_overlap": f["top5_overlap"],
                           "max_dlogprob": f["max_dlogprob"], "ties": f["ties"],
                           "divergences": len(f["divergences"])}
    if _snapshot(export) != before:
        raise RuntimeError(f"the {engine} check wrote into {export}; a check must leave the export as it was")
    cmp = compare(reference, got)
    result.update(tokens={"equal": cmp["equal"], "total": cmp["total"]}, top5_overlap=cmp["top5_overlap"],
                  max_dlogprob=cmp["max_dlogprob"], divergences=cmp["divergences"], ties=cmp["ties"],
                  agree=len(cmp["divergences"]) == cmp["ties"])
    return result


# -- what is checked against what ---------------------------------------------------------------------

def _directories(out: Path, engine: str) -> tuple[Path, Path]:
    """(the export the engine loads, the hf export the reference is built from)."""
    if not out.is_dir():
        raise BadInput(f"`{out}` is not a directory")
    fmt = READS[engine]
    if (out / "manifest.json").is_file():  # a run's output directory
        exports = _run_exports(out)
        if fmt == "hf" and "hf" not in exports and "compressed-tensors" in exports:  # a weight-and-activation scheme
            return exports["compressed-tensors"], exports["compressed-tensors"]
        if fmt not in exports:
            raise BadInput(f"`{out}` has no `{fmt}` export, which {engine} loads; add `{fmt}` to export.formats")
        export = exports[fmt]
        hf = exports.get("hf") or exports.get("fake")
    elif fmt == "hf" and is_compressed_tensors(out):
        return out, out
    else:
        export = out
        sibling = [out.parent / d for d in ("hf", "hf-fake") if (out.parent / d / "config.json").is_file()]
        hf = out if fmt == "hf" else (sibling[0] if sibling else None)
    if hf is None:
        raise BadInput(f"the reference is transformers on the run's hf export: give the run's output directory, "
                       f"whose export.formats include `hf` beside `{fmt}`")
    if fmt == "hf" and not (export / "config.json").is_file():
        raise BadInput(f"`{export}` is not a Hugging Face checkpoint (no config.json)")
    return export, hf


def _run_exports(out: Path) -> dict[str, Path]:
    """{format: directory} of a run's exports, from its manifest (each export's `directory`, relative to the run)."""
    manifest = json.loads((out / "manifest.json").read_text())
    found = {fmt: out / e["directory"] for fmt, e in (manifest.get("exports") or {}).items() if e.get("directory")}
    return {k: v for k, v in found.items() if v.is_dir()}


def _snapshot(directory: Path) -> list:
    return sorted((str(p.relative_to(directory)), p.stat().st_mtime_ns, p.stat().st_size)
                  for p in directory.rglob("*"))


def _eos_ids(hf: Path) -> set[int]:
    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = hf / name
        if path.is_file():
            e = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(e if isinstance(e, list) else [e] if e is not None else [])
    return ids


# -- the reference and transformers -------------------------------------------------------------------

def is_compressed_tensors(directory: Path) -> bool:
    """A compressed-tensors checkpoint (compress's `compressed-tensors` export, llm-compressor's output)."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        return False
    qc = json.loads(config.read_text()).get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors"


def reference_model(hf: Path, dtype: torch.dtype):
    """transformers' model class on exactly the export's weights: packed layers decoded by `read_quantized` into
    plain `nn.Linear`s, every other tensor as stored; in `dtype`, eval mode. A compressed-tensors checkpoint (a
    weight-and-activation scheme) is transformers' own loading of it through the compressed-tensors library, which
    quantizes the activations as the scheme says: the reference an engine serving that scheme must agree with."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if is_compressed_tensors(hf):
        from compress.export import compressed_tensors

        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, **compressed_tensors.load_options(
            AutoConfig.from_pretrained(hf)))
        model = torch.nn.Module.to(model, dtype).eval()
        compressed_tensors.as_evaluated(model, hf)  # FP4 and KV-cache arithmetic where the library leaves it out
        return model

    from compress.export.hf import load_tensors, read_quantized
    from compress.export.runtime import PACKED_SUFFIXES, _check_keys
    from compress.prune import routing

    tensors = load_tensors(hf)
    _, qweights = read_quantized(hf, tensors)
    config = AutoConfig.from_pretrained(hf)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    routing.attach(model)
    dense = {k: v for k, v in tensors.items() if not k.endswith(PACKED_SUFFIXES)}
    _check_keys(model, model.load_state_dict(dense, strict=False), qweights, hf)  # no tensor left behind
    for name, qw in qweights.items():
        model.get_submodule(name).weight.data = qw.dequantize(torch.float32)
    model.tie_weights()
    return model.to(dtype).eval()


def _transformers(export: Path):
    from transformers import AutoModelForCausalLM

    qc = json.loads((export / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("packing_format") == "auto_round:auto_awq":
        try:
            import auto_round_kernel  # noqa: F401
        except ImportError:
            raise BadInput("auto-round loads `auto_round:auto_awq` on CPU only with its kernel package (without it, "
                           "it silently builds layers without weights): `pip install auto-round-lib`, or export with "
                           "`packing: auto_round`") from None
    if qc.get("quant_method") == "gptq":
        from compress.extras import require

        require(("gptqmodel",), "transformers loading a GPTQ checkpoint")
    return AutoModelForCausalLM.from_pretrained(export).eval()


def _packed_names(export: Path) -> set[str]:
    from compress.export.hf import read_quantized

    return set(read_quantized(export)[1])


def greedy(model, prompts: list[list[int]], n_tokens: int, eos: set[int]) -> Decoded:
    """Greedy decoding with the KV cache, EOS masked for the first `n_tokens` (engines' min-tokens rule); the top-k
    log-probabilities are the model's own (before the mask)."""
    tokens, top = [], []
    device = next(model.parameters()).device
    # the cache argument's name: `cache` in transformers >= 5.2x (`past_key_values` is deprecated there)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model(input_ids=ids, use_cache=True)
            past, gen, steps = _cache(out), [], []
            logits = out.logits[0, -1]
            for _ in range(n_tokens):
                logp = torch.log_softmax(logits.float(), -1)
                vals, idx = logp.topk(TOP_K)
                steps.append({int(i): float(v) for i, v in zip(idx, vals)})
                masked = logp.clone()
                masked[[e for e in eos if e < masked.numel()]] = -float("inf")
                nxt = int(masked.argmax())
                gen.append(nxt)
                out = model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True, **{key: past})
                past, logits = _cache(out), out.logits[0, -1]
            tokens.append(gen)
            top.append(steps)
    return Decoded(tokens, top)


def _cache(out):
    return getattr(out, "cache", None) or out.past_key_values


def _perplexities(loaded, reference, tokenizer, data: str, max_tokens: int) -> dict:
    """Perplexity of transformers' loading and of compress's reading of the same export, same tokens (fp32
    compute for both: `torch.nn.Module.float` on the loaded model, whose packed layers then decode exactly)."""
    from compress.eval.data import read_text, token_stream
    from compress.eval.metrics import perplexity

    from compress.data import resolve

    ids = token_stream(tokenizer, read_text(resolve(data)))
    # a run's own protocol (compress/evaluate.py): 256-token windows, each after the BOS token where there is one
    kw = {"max_tokens": max_tokens, "window": WINDOW, "bos_id": getattr(tokenizer, "bos_token_id", None)}
    dtype = next(loaded.parameters()).dtype
    out = {"data": data, "max_tokens": max_tokens}
    if dtype != torch.float32:  # transformers in the check's dtype, then in float32 (what the dtype alone costs)
        out["transformers_" + str(dtype).removeprefix("torch.")] = round(perplexity(loaded, ids, **kw), 4)
        torch.nn.Module.float(loaded)
    out["transformers_fp32"] = round(perplexity(loaded, ids, **kw), 4)
    out["compress"] = round(perplexity(reference.float(), ids, **kw), 4)
    out["ratio"] = round(out["transformers_fp32"] / out["compress"], 4)
    return out


# -- vLLM in its own environment ----------------------------------------------------------------------

NO_WNA16_KERNEL = ("vLLM's CPU build runs int4 weight-only layers only on AVX-512 CPUs: the library it loads on an "
                   "AVX2-only CPU (_C_AVX2) has no `cpu_gemm_wna16` kernel, so every W4A16 checkpoint fails at its first "
                   "forward; serve it with vLLM on an AVX-512 CPU or a GPU, or here with llama.cpp (`export: gguf`) or "
                   "OpenVINO GenAI (`export: openvino`)")


INT8_WITHOUT_VNNI = (
    "this CPU has no VNNI (AVX512_VNNI / AVX_VNNI): oneDNN's int8 GEMM, which vLLM's CPUInt8ScaledMMLinearKernel runs, "
    "then multiplies with AVX2's vpmaddubsw, whose int16 sums of two u8 x s8 products saturate; each int8 layer is off "
    "by about 1-3% of its output (measured on ref-llama-7m's down_proj: 1.6% with typical activations, 0.02% when "
    "no pair can saturate), so vLLM's W8A8 on this CPU disagrees with the checkpoint's arithmetic by more than its "
    "float16 floor. Run W8A8 on a VNNI CPU (Intel Cascade Lake or later, AMD Zen 4 or later) for agreement")


def has_vnni() -> bool:
    """The CPU multiplies int8 with VNNI's int32 accumulation (Linux: its flags)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags or "asimddp" in flags


def cpu_isa() -> str:
    """The widest x86 vector ISA torch sees, as vLLM's CPU platform chooses its library by it."""
    if not hasattr(torch.cpu, "_is_avx512_supported"):
        return "not x86"
    if torch.cpu._is_avx512_supported():
        return "AVX-512" + (" BF16" if torch.cpu._is_avx512_bf16_supported() else "")
    return "AVX2" if torch.cpu._is_avx2_supported() else "no AVX2"


def _kernel_of(line: str) -> str:
    """The kernel a vLLM log line names: "Using CPUWNA16LinearKernel for ..." (mixed-precision layers) or "Selected
    CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8" (scaled-mm layers)."""
    word = " Using " if " Using " in line else " Selected "
    return line.split(word, 1)[1].split(" for ")[0]


def _root_cause(log: str, lines: int = 25) -> str:
    """The first traceback of an engine's log (vLLM's engine process prints the root cause there; the caller's own
    traceback, last, only says the engine died) and the log's last lines."""
    text = log.strip().splitlines()
    first = next((i for i, line in enumerate(text) if "Traceback (most recent call last)" in line), None)
    tail = text[-15:]
    if first is None or first >= len(text) - 15:
        return "\n".join(tail)
    return "\n".join(text[first:first + lines] + ["..."] + tail)


def require_wna16(what: str) -> None:
    """RunFailure naming the CPU where vLLM's CPU build has no int4 weight-only kernel (no AVX-512); `what`: what
    was not done."""
    if not cpu_isa().startswith("AVX-512"):
        raise RunFailure(NO_WNA16_KERNEL + f" (this CPU: {cpu_isa()}); {what}")


def _vllm_refusals(export: Path, dtype: str) -> dict | None:
    """The export's `kv_cache_scheme` (None: none); BadInput or RunFailure, before anything runs, where vLLM cannot
    run the export: float32 for a checkpoint that is not compressed-tensors, int weight-only layers on a CPU without
    AVX-512 (no `cpu_gemm_wna16`), an FP8 KV cache on x86 without AVX-512 or AMX."""
    if dtype not in ("float16", "bfloat16") and not is_compressed_tensors(export):
        raise BadInput("vLLM refuses float32 for auto-round checkpoints (`torch.float32 is not supported for "
                       "quantization method inc`); use --dtype float16 (a compressed-tensors export runs in float32)")
    qc = json.loads((export / "config.json").read_text()).get("quantization_config") or {}
    if _weight_only_int(qc):
        require_wna16(f"{export} was not run")
    kv = qc.get("kv_cache_scheme")
    if kv and not cpu_isa().startswith("AVX-512") and not torch.cpu._is_amx_tile_supported():
        raise RunFailure(f"{export} has an FP8 KV cache, which vLLM's CPU attention runs on x86 with AVX-512 or AMX "
                         f"only (this CPU: {cpu_isa()}); it was not run")
    return kv


def _weight_only_int(qc: dict) -> bool:
    """Whether a quantization_config has integer weight-only layers, which vLLM's CPU build runs on its WNA16 kernel:
    the hf export's GPTQ / AWQ / auto-round packing, or a compressed-tensors group with int weights and no
    input_activations."""
    if qc.get("quant_method") in ("gptq", "awq", "auto-round"):
        return True
    return any((g.get("weights") or {}).get("type", "int") == "int" and not g.get("input_activations")
               for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights"))


def _vllm(export: Path, prompts: list[list[int]], n_tokens: int, dtype: str, kv: dict | None) -> tuple[Decoded, dict]:
    """Greedy decoding in vLLM of an export `_vllm_refusals` passed (`kv`: its kv_cache_scheme)."""
    from compress.serve.envs import python_of

    python = python_of("vllm")
    worker = Path(__file__).parent / "engines" / "vllm_worker.py"
    with tempfile.TemporaryDirectory(prefix="serve-check-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"model": str(export.resolve()), "prompts": prompts, "n_tokens": n_tokens, "top_k": TOP_K,
                                   "dtype": dtype, "kv_cache_dtype": "fp8" if kv else "auto"}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE", "1")}
        proc = subprocess.run([str(python), str(worker), str(req), str(res)], capture_output=True, text=True,
                              cwd=tmp, env=env)
        if proc.returncode != 0:
            log = proc.stdout + proc.stderr
            if "has no attribute 'cpu_gemm_wna16'" in log:
                raise RunFailure(NO_WNA16_KERNEL + f" (this CPU: {cpu_isa()}); {export} was not run")
            raise RuntimeError(f"vLLM could not run {export} (exit {proc.returncode}):\n"
                               + _root_cause(proc.stdout + proc.stderr))
        data = json.loads(res.read_text())
    kernels = sorted({_kernel_of(line) for line in (proc.stdout + proc.stderr).splitlines()
                      if "LinearKernel" in line and (" Using " in line or " Selected " in line)})
    return Decoded.from_json(data), {"vllm": data.get("vllm"), "kernels": kernels}


# -- llama.cpp: a GGUF file against compress's reading of it -------------------------------------------

def check_gguf(out: Path, *, n_tokens: int, dtype: str, perplexity: str | None = None,
               max_tokens: int = 4096) -> dict:
    """llama.cpp's greedy decoding of a GGUF file against compress's own reading of the same file (transformers'
    GGUF loader, which dequantizes every tensor with the `gguf` package, in float32), on the same token ids (the
    file's tokenizer as transformers reads it). `perplexity`: llama.cpp's per-token NLL (`score`) on exactly the
    windows compress's perplexity scores (`WINDOW` tokens, no BOS, the text's first `max_tokens` tokens), each from
    an empty KV cache. `dtype` is llama.cpp's KV cache type. llama.cpp computes with the weights as stored but
    rounds each linear layer's input to its weight type's dot-product format (F16, Q8_0, Q8_K): "emulated" compares
    it with compress's reading rounded the same way (`llamacpp.emulate_activations`; the KV cache in float32), and
    a divergence from the float32 reading that is not a tie still agrees when none remains against that one."""
    from compress.models.loading import load_model
    from compress.serve.engines import llamacpp
    from compress.serve.envs import python_of

    gguf = gguf_file(Path(out))
    python_of(llamacpp.ENV)  # a missing environment is said before any model is read
    before = _snapshot(gguf.parent)
    model, tokenizer = load_model(str(gguf), "float32")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    eos = _model_eos(model)
    reference = greedy(model, prompts, n_tokens, eos)
    got, info = llamacpp.decode(gguf, prompts, n_tokens, eos, dtype=dtype)
    result = {"engine": "llama.cpp", "export": str(gguf), "dtype": dtype, "prompts": len(prompts),
              "new_tokens": n_tokens, "reference": f"compress on {gguf.name} (transformers' GGUF loader, float32)",
              "bos": [p[:1] == [tokenizer.bos_token_id] for p in prompts], **info}
    if perplexity:
        result["perplexity"] = _gguf_perplexities(gguf, model, tokenizer, perplexity, max_tokens, dtype)
    handles, types = llamacpp.emulate_activations(model, gguf)  # compress's reading, llama.cpp's rounding
    emulated = greedy(model, prompts, n_tokens, eos)
    for h in handles:
        h.remove()
    if _snapshot(gguf.parent) != before:
        raise RuntimeError(f"the llama.cpp check wrote into {gguf.parent}; a check must leave the export as it was")
    cmp, emu = compare(reference, got), compare(emulated, got)
    result.update(tokens={"equal": cmp["equal"], "total": cmp["total"]}, top5_overlap=cmp["top5_overlap"],
                  max_dlogprob=cmp["max_dlogprob"], divergences=cmp["divergences"], ties=cmp["ties"],
                  weight_types=dict(sorted(Counter(t or "F32" for t in types.values()).items())),
                  emulated={"tokens": {"equal": emu["equal"], "total": emu["total"]}, "top5_overlap":
                            emu["top5_overlap"], "max_dlogprob": emu["max_dlogprob"], "ties": emu["ties"],
                            "divergences": emu["divergences"]},
                  agree=len(cmp["divergences"]) == cmp["ties"] or len(emu["divergences"]) == emu["ties"])
    return result


def gguf_file(out: Path) -> Path:
    """The .gguf a check reads: `out` itself, the run's gguf export, or the one .gguf in a directory."""
    if out.is_file():
        if out.suffix != ".gguf":
            raise BadInput(f"`{out}` is not a .gguf file")
        return out
    if not out.is_dir():
        raise BadInput(f"`{out}` does not exist")
    directory = out
    if (out / "manifest.json").is_file():
        exports = _run_exports(out)
        if "gguf" not in exports:
            raise BadInput(f"`{out}` has no `gguf` export, which llama.cpp loads; add `gguf` to export.formats")
        directory = exports["gguf"]
    elif (out / "gguf").is_dir() and not list(out.glob("*.gguf")):
        directory = out / "gguf"
    found = sorted(directory.glob("*.gguf"))
    if len(found) != 1:
        raise BadInput(f"`{directory}` holds {len(found)} .gguf files ({', '.join(p.name for p in found) or 'none'}); "
                       "give the one to check")
    return found[0]


def _model_eos(model) -> set[int]:
    ids = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        e = getattr(cfg, "eos_token_id", None)
        ids |= set(e if isinstance(e, list) else [e] if e is not None else [])
    return ids


def _gguf_perplexities(gguf: Path, model, tokenizer, data: str, max_tokens: int, dtype: str) -> dict:
    """llama.cpp's and compress's perplexity on the same windows of `data`'s first `max_tokens` tokens."""
    from compress.data import resolve
    from compress.eval.data import read_text, token_stream
    from compress.eval.metrics import perplexity, windows
    from compress.serve.engines import llamacpp

    ids = token_stream(tokenizer, read_text(resolve(data)))[:max_tokens]
    ws = list(windows(ids, window=WINDOW))
    nll = llamacpp.score(gguf, ws, dtype=dtype)
    count = sum(len(n) for n in nll)
    if count != sum(w.targets.numel() for w in ws):
        raise RuntimeError(f"llama.cpp scored {count} tokens of {sum(w.targets.numel() for w in ws)}")
    ours = perplexity(model, ids, window=WINDOW)
    theirs = math.exp(sum(map(sum, nll)) / count)
    return {"data": data, "max_tokens": max_tokens, "window": WINDOW, "tokens": count, "windows": len(ws),
            "llama.cpp": round(theirs, 4), "compress": round(ours, 4), "ratio": round(theirs / ours, 5)}
