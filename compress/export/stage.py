"""Export formats, registered as ("export", name). Each reads only the model and its QuantizedWeights."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal, Optional

from pydantic import Field, field_validator

from compress.config import StrictModel
from compress.errors import BadInput
from compress.handoff import QuantizedWeights
from compress.registry import register


class ExportConfig(StrictModel):
    """What every export format has: `directory`, a relative path inside the output directory."""

    directory: str

    @field_validator("directory")
    @classmethod
    def _inside_output(cls, v: str) -> str:
        return export_directory(v)


def export_directory(v: str) -> str:
    """`v` normalised (`a//b/` -> `a/b`), or ValueError: an export writes only inside the output directory,
    in a directory of its own that the run does not use for anything else."""
    from compress.workspace import RESERVED

    p = PurePosixPath(v.replace("\\", "/"))
    if not v.strip() or p.is_absolute() or v.startswith("~") or ".." in p.parts or str(p) == ".":
        raise ValueError(f"`{v}` must be a relative path inside the output directory (not absolute, not `.`, "
                         "no `..`)")
    if p.parts[0] in RESERVED or p.parts[0].startswith("."):
        raise ValueError(f"`{v}` is a name the run itself uses (or a hidden name); choose another directory")
    return str(p)


Dtype = Literal["float16", "bfloat16", "float32"]
DTYPE_HELP = ("the tensors that stay unquantized (embeddings, norms, a float LM head), as every peer writes them; "
              "default float16, bfloat16 for architectures whose activations leave float16's range (Gemma 2/3), "
              "where an explicit float16 is refused")


class HFExportConfig(ExportConfig):
    format: Literal["hf"] = "hf"
    directory: str = "hf"
    packing: Literal["auto", "auto_round", "awq", "gptq"] = Field(
        "auto", description="`auto`: auto_round:auto_gptq when every layer is symmetric, auto_round:auto_awq when "
                            "the asymmetric ones are 4 or 8 bits (both served by vLLM), else auto_round; `auto_round`: "
                            "GPTQ v2 for every layer (transformers only); `awq`; `gptq`: a plain GPTQ checkpoint "
                            "(symmetric) for engines without auto-round support (docs/serving.md#layouts)")
    dtype: Optional[Dtype] = Field(None, description=DTYPE_HELP)
    container: Optional[int] = Field(None, ge=2, le=8, description="store every packed layer at least at this width "
                                     "(weights unchanged): e.g. 4 puts a 3/4-bit plan in 4-bit containers, which "
                                     "vLLM CPU serves")


class FakeExportConfig(ExportConfig):
    format: Literal["fake"] = "fake"
    directory: str = "hf-fake"
    dtype: Optional[Dtype] = Field(None, description=DTYPE_HELP)


def _qweights(ctx) -> dict:
    """Every layer the run's quantize stages rounded (none: a run without one exports the FP model)."""
    q = ctx.inputs.get(QuantizedWeights)
    return q.weights if q is not None else {}


def export_dtype(arch, cfg) -> str:
    """The unquantized tensors' dtype: the recipe's, else float16 unless the architecture overflows it (bfloat16)."""
    if cfg.dtype == "float16" and arch.float16:
        raise BadInput(f"export {cfg.format}: dtype float16 would make this model's logits non-finite: "
                       f"{arch.float16}; use `dtype: bfloat16` (or float32)")
    return cfg.dtype or ("bfloat16" if arch.float16 else "float16")


def check_dtype(adapter, cfg, facts):
    """At plan time: refuse float16 where it overflows, say when the default becomes bfloat16; the config with its
    dtype resolved."""
    dtype = export_dtype(adapter.arch, cfg)
    if cfg.dtype is None and dtype != "float16":
        facts.notes.append(f"export {cfg.format}: unquantized tensors in {dtype}, not float16: {adapter.arch.float16}")
    return cfg.model_copy(update={"dtype": dtype})


def _export(ctx, cfg, fmt: str) -> dict:
    from compress.export.hf import export_hf, export_hf_streaming

    out = ctx.workspace.path(cfg.directory)
    meta = _meta(ctx)
    if ctx.streamer is not None:
        stage = ctx.inputs[QuantizedWeights].stage
        res = export_hf_streaming(ctx.model, ctx.streamer.source,
                                  lambda i: ctx.workspace.load_block(stage, i, required=True),
                                  _qweights(ctx), ctx.tokenizer, out, meta=meta, packing=cfg.packing,
                                  dtype=cfg.dtype, container=cfg.container)
    else:
        qweights = _qweights(ctx)  # none (a run that prunes without quantizing): a plain checkpoint
        packed = {"packing": cfg.packing, "container": cfg.container} if fmt == "auto_round" else {}
        res = export_hf(ctx.model, qweights, ctx.tokenizer, out, fmt=fmt if qweights else "fake", meta=meta,
                        dtype=cfg.dtype, **(packed if qweights else {}))
    return {"path": str(out), **res}


EXPORT = {"uses": (QuantizedWeights,)}  # exports run last; their results go into the report


def check_hf(adapter, cfg: HFExportConfig, facts) -> HFExportConfig:
    """At plan time: the dtype (check_dtype); the quantized layers no auto-round loader reads packed, which the
    export writes dense."""
    from compress.export.hf import planned_dense

    cfg = check_dtype(adapter, cfg, facts)
    dense = planned_dense(adapter, facts.quantized)
    if dense:
        name, why = next(iter(dense.items()))
        facts.notes.append(f"export hf: {len(dense)} quantized layers will be stored dense (e.g. `{name}`: {why})")
    if 1 in facts.widths:
        facts.notes.append("export hf: experts the allocation rounds to 1 bit (the sign rule) will be stored dense: "
                           "no auto-round loader reads a 1-bit layer packed")
    return cfg


@register("export", "hf", HFExportConfig, "packed auto-round checkpoint loadable by transformers", check=check_hf,
          **EXPORT)
def export_hf_stage(ctx, cfg: HFExportConfig) -> dict:
    return _export(ctx, cfg, "auto_round")


@register("export", "fake", FakeExportConfig, "dequantized floating-point checkpoint for FP-only tools",
          check=check_dtype, **EXPORT)
def export_fake_stage(ctx, cfg: FakeExportConfig) -> dict:
    return _export(ctx, cfg, "fake")


class CompressedTensorsExportConfig(ExportConfig):
    format: Literal["compressed-tensors"] = "compressed-tensors"
    directory: str = "compressed-tensors"
    dtype: Optional[Dtype] = Field(None, description=DTYPE_HELP + "; also the per-channel weight scales'")


def check_compressed_tensors(adapter, cfg: CompressedTensorsExportConfig, facts):
    """At plan time: the dtype (check_dtype); every quantized layer must be an 8-bit (int8 or E4M3) per-channel one."""
    from compress.export.compressed_tensors import check_layer

    cfg = check_dtype(adapter, cfg, facts)
    for *_, layers in facts.quantized:
        for name, spec in layers.items():
            if (why := check_layer(name, spec)) is not None:
                raise BadInput(f"export compressed-tensors: {why}")
    return cfg


@register("export", "compressed-tensors", CompressedTensorsExportConfig,
          "compressed-tensors checkpoint (vLLM, transformers) with activation quantization: `scheme: w8a8-int8`, "
          "`fp8`",
          check=check_compressed_tensors, capabilities=frozenset({"activations"}), requires=("compressed_tensors",),
          **EXPORT)
def export_compressed_tensors_stage(ctx, cfg: CompressedTensorsExportConfig) -> dict:
    from compress.export.compressed_tensors import export_compressed_tensors

    qweights = _qweights(ctx)
    out = ctx.workspace.path(cfg.directory)
    res = export_compressed_tensors(ctx.model, qweights, ctx.activations, ctx.tokenizer, out, dtype=cfg.dtype,
                                    meta=_meta(ctx), kv=ctx.kv)
    return {"path": str(out), **res}


GGUFType = Literal["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K",
                   "Q4_K_M", "Q3_K_M"]


class GGUFExportConfig(ExportConfig):
    format: Literal["gguf"] = "gguf"
    directory: str = "gguf"
    type: GGUFType = Field("Q4_K_M", description="the file type, with llama.cpp's per-tensor types (Q4_K_M, Q3_K_M, "
                                                 "Q2_K are mixes; the output tensor Q6_K): layers a quantize stage "
                                                 "rounded are written from their codes, which needs the type's grid "
                                                 "(Q4_0 / Q5_0 / Q8_0: sym 4 / 5 / 8 bits, group 32); the rest is "
                                                 "rounded by llama.cpp's reference quantizer (docs/gguf.md)")


def check_gguf(adapter, cfg: GGUFExportConfig, facts) -> None:
    """At plan time: a family llama.cpp runs and compress writes, a tokenizer llama.cpp pre-tokenizes the same, and
    every layer a quantize stage rounds on a grid the file's type for that tensor holds; the per-tensor type plan
    and the file size go to the plan's notes (`--dry-run`)."""
    from collections import Counter

    from compress.errors import BadInput
    from compress.export import gguf as g

    if adapter.arch.kind != "causal":
        raise BadInput(f"the gguf export writes decoders, not the {adapter.arch.kind} `{adapter.model_type}`")
    if facts.stream:
        raise BadInput("the gguf export does not write a streamed model yet (`model.stream: true`); drop `gguf` or "
                       "stream: false")
    if facts.mixed:
        raise BadInput("the gguf export writes one GGML type per tensor: an `allocate` plan gives layers per-chunk "
                       "widths; remove the allocate stage or drop `gguf` from export.formats")
    asked = _stage_gguf(facts)
    if "type" not in cfg.model_fields_set and len(set(asked.values())) == 1:  # the file type the stage rounded for
        cfg = cfg.model_copy(update={"type": next(iter(asked.values()))})
    for i, t in asked.items():
        if t != cfg.type:
            raise BadInput(f"stage {i} rounds on llama.cpp's blocks for `gguf: {t}`, but export gguf type is "
                           f"{cfg.type}: give the export the stage's type (or leave the export's `type` out)")
    grids = {n: spec.ggml for *_, layers in facts.quantized for n, spec in layers.items() if spec.ggml}
    try:
        entries, plan = g.tensor_plan(adapter.model, cfg.type, grids)  # BadInput for a family it does not write
    except ValueError as e:
        raise BadInput(f"export gguf: {e}; give the parts of one tensor (a stacked expert tensor) one type") from e
    by_layer = {hf.removesuffix(".weight"): plan[name] for hf, name, _ in entries}
    for i, method, rounding, layers in facts.quantized:
        for layer, spec in layers.items():
            t = by_layer.get(layer)
            if spec.ggml is not None or t is None or t in g.gtypes.FLOAT:  # a grid layer: the plan took its type
                continue
            near = g.grid_type(spec.bits, spec.group_size, spec.sym)
            if near != t:
                hint = (f"type: {near} (the grid stage {i} rounds on)" if near else
                        f"`gguf: {cfg.type}` on the quantize stage (it then rounds on llama.cpp's blocks), "
                        "sym: true, group_size: 32 and bits 4, 5 or 8 (Q4_0, Q5_0, Q8_0), or no quantize stage "
                        "(llama.cpp's reference rounding of every type)")
                raise BadInput(f"export gguf type {cfg.type} stores `{layer}` as {t}, but stage {i} "
                               f"(`quantize`/{method}) rounds it at {spec.bits} bits, group {spec.group_size}, "
                               f"{'sym' if spec.sym else 'asym'}: compress writes a layer it rounded only on that "
                               f"same grid (it never rounds twice). Nearest: {hint}")
    counts = Counter(plan.values())
    size = g.planned_bytes(entries, plan)
    facts.notes.append(f"export gguf {cfg.type}: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
                       + f" tensors; about {size / 1e6:.1f} MB")
    return cfg


def _stage_gguf(facts) -> dict[int, str]:
    """{quantize stage index: its `gguf` file type} for the stages that round on llama.cpp's grids."""
    return {i: rounding[3] for i, _, rounding, _ in facts.quantized if rounding[3]}


@register("export", "gguf", GGUFExportConfig, "GGUF file llama.cpp, Ollama and LM Studio run", check=check_gguf,
          **EXPORT)
def export_gguf_stage(ctx, cfg: GGUFExportConfig) -> dict:
    from pathlib import Path

    from compress.export.gguf import export_gguf
    from compress.models.loading import resolve_source

    src, gguf_file = resolve_source(ctx.loaded.recipe.model.path, ctx.loaded.recipe.model.gguf_file)
    source = Path(src) / gguf_file if gguf_file else None
    return export_gguf(ctx.model, _qweights(ctx), ctx.tokenizer, ctx.workspace.path(cfg.directory),
                       file_type=cfg.type, meta=_meta(ctx), source=source)


class OnnxExportConfig(ExportConfig):
    format: Literal["onnx"] = "onnx"
    directory: str = "onnx"
    kv_cache: bool = Field(False, description="attention_mask and past/present key-value inputs and outputs, for "
                                              "incremental decoding")
    builder: Literal["torch", "genai"] = Field(
        "torch", description="`torch`: torch's exporter traces the model, every decoder family (model.onnx); `genai`: "
                             "the ONNX Runtime GenAI model builder writes a directory `onnxruntime_genai` runs "
                             "(genai_config.json, KV cache; llama, mistral, qwen2, qwen3, granite, phi3, gemma2)")
    genai_config: bool = Field(True, description="with `kv_cache` and `builder: torch`: also genai_config.json and the "
                                                 "tokenizer files, the directory `onnxruntime_genai` runs")


def check_graph(adapter, cfg, facts) -> None:
    """At plan time, for the graphs (onnx, and openvino converted from it): a decoder, and, for the GenAI builder,
    a run it can take; widths MatMulNBits cannot hold are announced before any calibration."""
    import logging

    from compress.errors import BadInput
    from compress.export.onnx import NBITS

    if adapter.arch.kind != "causal":
        raise BadInput(f"the {cfg.format} export writes decoders (causal language models), not the "
                       f"{adapter.arch.kind} `{adapter.model_type}`; drop `{cfg.format}` from export.formats")
    if getattr(cfg, "builder", "torch") == "genai":
        return check_builder(adapter, cfg, facts)
    if cfg.format == "onnx" and cfg.kv_cache and cfg.genai_config:
        from compress.export.onnx import genai_why_not

        why = genai_why_not(adapter.model.config)
        if why:
            raise BadInput(f"export onnx with `kv_cache: true` writes a directory ONNX Runtime GenAI runs, which "
                           f"cannot run this model: {why}; set `genai_config: false` to write the graph for "
                           "onnxruntime alone")
    dense = sorted(b for b in facts.widths if b not in NBITS and b != 16)
    if dense:
        logging.getLogger(__name__).warning(
            "export %s: %s-bit layers will be written as dense fp32 MatMuls (MatMulNBits holds %s bits)", cfg.format,
            "/".join(map(str, dense)), ", ".join(map(str, NBITS)))


def check_builder(adapter, cfg, facts) -> None:
    """At plan time, for `builder: genai`: the ONNX Runtime GenAI builder (`compress/export/genai.py`) must hold
    every quantized layer."""
    from compress.errors import BadInput
    from compress.export.genai import why_not
    from compress.export.hf import planned_dense
    from compress.extras import require

    dense = planned_dense(adapter, facts.quantized)
    schemes = [(n, s.bits, s.group_size, n not in dense) for *_, layers in facts.quantized for n, s in layers.items()]
    why = "an `allocate` plan gives layers per-chunk bit widths" if facts.mixed else why_not(adapter.model.config,
                                                                                             schemes)
    if why:
        raise BadInput(f"export {cfg.format} with `builder: genai`: the ONNX Runtime GenAI builder cannot take this "
                       f"run: {why}; use `builder: torch` (the default), which writes every decoder family")
    require(("onnxruntime_genai", "onnx_ir"), f"export {cfg.format} with `builder: genai`")


@register("export", "onnx", OnnxExportConfig, "ONNX graph with com.microsoft::MatMulNBits linears (onnxruntime)",
          check=check_graph, requires=("onnx", "onnxscript"), **EXPORT)
def export_onnx_stage(ctx, cfg: OnnxExportConfig) -> dict:
    from compress.export.onnx import export_onnx

    if cfg.builder == "genai":
        from compress.export.genai import export_genai

        return export_genai(ctx.model, _qweights(ctx), ctx.tokenizer, ctx.workspace.path(cfg.directory),
                            meta=_meta(ctx))
    return export_onnx(ctx.model, _qweights(ctx), ctx.workspace.path(cfg.directory), meta=_meta(ctx),
                       kv_cache=cfg.kv_cache, genai=cfg.genai_config, tokenizer=ctx.tokenizer)


Device = Literal["CPU", "GPU", "NPU"]


class OpenVINOExportConfig(ExportConfig):
    format: Literal["openvino"] = "openvino"
    directory: str = "openvino"
    device: list[Device] = Field(default_factory=lambda: ["CPU"],
                                 description="target devices (CPU, GPU, NPU; one name or a list); NPU needs "
                                             "symmetric int4 weights with group_size 128 or -1")
    kv_cache: bool = Field(False, description="attention_mask and past/present key-value inputs and outputs, for "
                                              "incremental decoding")
    stateful: bool = Field(True, description="with `kv_cache`: the KV cache kept as the model's state, with "
                                             "position_ids and beam_idx inputs, the tokenizer IRs and configs: the "
                                             "directory OpenVINO GenAI's LLMPipeline runs; false: explicit past/present "
                                             "inputs and outputs")
    precision: Literal["exact", "device"] = Field(
        "exact", description="`exact`: the IR carries f32 inference and no dynamic quantization in its runtime_options "
                             "(what the export is validated with); `device`: the device's defaults (bf16 on CPUs that "
                             "have it: faster, less exact)")

    @field_validator("device", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        v = [v] if isinstance(v, str) else v
        if isinstance(v, list) and not v:
            raise ValueError("give at least one device")
        if isinstance(v, list) and len({d if isinstance(d, str) else id(d) for d in v}) != len(v):
            raise ValueError("a device is listed more than once")
        return v


def check_openvino_targets(adapter, cfg: OpenVINOExportConfig, facts) -> None:
    """At plan time: every layer the recipe quantizes must suit each target device (NPU: sym int4, group
    128 or per-channel), so a run does not calibrate for an export that must fail. `facts`: the bind step's
    layer plans of every quantize stage, and whether an allocation plan assigns per-chunk widths."""
    from compress.errors import BadInput
    from compress.export.openvino import npu_problems

    check_graph(adapter, cfg, facts)
    if cfg.kv_cache and cfg.stateful:
        from compress.extras import DIST, missing

        if missing(("openvino_tokenizers",)):
            raise BadInput("export openvino with `kv_cache: true` writes the tokenizer IRs OpenVINO GenAI reads and needs "
                           f"openvino-tokenizers, which is not installed: pip install '{DIST}[export]'")
    if "NPU" not in cfg.device:
        return
    if facts.mixed:
        raise BadInput("export openvino targets NPU, which runs symmetric int4 only: an `allocate` stage assigns "
                       "other bit widths; remove it or drop NPU from the openvino `device` list")
    for i, method, rounding, layers in facts.quantized:
        bad = {n: p for n, s in layers.items() if (p := npu_problems(s.bits, s.group_size, s.sym))}
        if bad:
            name, problems = next(iter(bad.items()))
            where = "its `overrides`" if not npu_problems(*rounding[:3]) else f"stages.{i}"
            raise BadInput(f"export openvino targets NPU, which runs symmetric int4 weights with group size 128 or "
                           f"per-channel: stage {i} (`quantize`/{method}) quantizes {len(bad)} layers otherwise "
                           f"(e.g. `{name}`). Change in {where}: {'; '.join(problems)}; or drop NPU from the openvino "
                           "`device` list")


@register("export", "openvino", OpenVINOExportConfig, "OpenVINO IR with compressed u2/u4/u8 weight constants",
          check=check_openvino_targets, requires=("openvino", "onnx", "onnxscript"), **EXPORT)  # the IR is converted from the ONNX graph
def export_openvino_stage(ctx, cfg: OpenVINOExportConfig) -> dict:
    from compress.export.openvino import export_openvino

    # a graph an earlier export of this run traced with these inputs is converted, not traced again (the stateful IR
    # takes position_ids, which the onnx export's graph does not)
    stateful = cfg.kv_cache and cfg.stateful
    graph = next((e["path"] for e in ctx.exports.values() if e.get("graph") == "torch" and e.get("kv_cache") ==
                  cfg.kv_cache and e.get("position_ids", False) == stateful), None)
    return export_openvino(ctx.model, _qweights(ctx), ctx.workspace.path(cfg.directory), meta=_meta(ctx),
                           devices=tuple(cfg.device), kv_cache=cfg.kv_cache, exact=cfg.precision == "exact",
                           onnx_path=graph, stateful=stateful, tokenizer=ctx.tokenizer)


def _meta(ctx) -> dict:
    """Provenance written into every export: the recipe's hash, the model's name and the sha256 of its files (not
    the path typed, which means nothing elsewhere; a `${VAR}` in the name stays the reference, not its value)."""
    from compress.quantize.spine import adapted_groups

    model = ctx.identity["model"]
    meta = {"recipe_sha256": ctx.loaded.sha256, "model": model["name"], "model_sha256": model["sha256"]}
    adapted = {n: g for *_, layers in ctx.facts.quantized for n, g in adapted_groups(layers).items()}
    if adapted:
        meta["adapted_groups"] = adapted  # {layer: [the recipe's group_size, the group it got]}
    return meta
