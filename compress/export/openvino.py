"""OpenVINO IR export: the ONNX graph of `compress.export.onnx`, converted by OpenVINO's ONNX frontend.

The frontend turns each `com.microsoft::MatMulNBits` into a compressed integer Constant (u2 / u4 / u8
codes and zero points) followed by the decompression subgraph (Convert, Subtract, Multiply, Reshape),
the pattern of docs/formats.md#compressed-weight-subgraph, so the IR keeps the weights compressed and
the CPU plugin runs them as a low-bit `FullyConnected` (runtime precision u2 / u4 / u8). Files:
`openvino_model.xml` / `.bin`, with rt_info `compress/format` = "openvino-ir", `compress/version` and
`compress/meta` (JSON).

With `kv_cache` and `stateful` the directory is what OpenVINO GenAI's `LLMPipeline(dir, "CPU")` runs: the graph is
traced with a `position_ids` input, `make_stateful` adds `beam_idx` and keeps the KV cache as ReadValue / Assign
variables (inputs input_ids, attention_mask, position_ids, beam_idx; output logits), and `write_genai_files` puts
the tokenizer's OpenVINO IRs (`openvino_tokenizer.xml`, `openvino_detokenizer.xml`), its files, `config.json` and
`generation_config.json` beside it. Without `stateful` the IR keeps the graph's explicit past/present inputs.

To reproduce the exported model's numbers on CPU, compile with `EXACT_CPU_CONFIG`: by default the CPU
plugin quantizes activations to int8 for u4/u8 weights (dynamic quantization), may run in bf16 and keeps a
fused attention's KV cache in u8.

Device targets (`devices`: CPU, GPU, NPU; the recipe's `device:`) are recorded in rt_info
`compress/devices` and in `compress/meta`; the export compiles the IR on each target this machine's
OpenVINO offers (`compiled_on`) and lists the others as `not_compiled`. NPU runs LLM weights as
symmetric int4, grouped by 128 or per-channel: OpenVINO's "GenAI on NPU" guide (2024.6 / 2025 docs)
exports NPU models with `--weight-format int4 --sym --group-size 128` (or `-1`, channel-wise, for
models above ~1B parameters), and its MatMulNBits NPU pattern (openvino PR 29671) is sym int4
channel-wise. `npu_problems` checks a recipe's layer settings against that before calibration. The
symmetric IR carries u4 codes with a constant u4 zero point of 8 (NNCF's INT4_SYM form when it was
introduced; current NNCF writes i4 codes without a zero point): that an NPU compiles this form is
not verified here (no NPU).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections import Counter
from pathlib import Path

from compress.files import staged_directory
from compress.qweight import QuantizedWeight

logger = logging.getLogger(__name__)

FORMAT, FORMAT_VERSION = "openvino-ir", 1
EXACT_CPU_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
                    "KV_CACHE_PRECISION": "f32"}
DEVICES = ("CPU", "GPU", "NPU")
NPU_BITS, NPU_GROUPS = 4, (128, -1)


def npu_problems(bits: int, group_size: int, sym: bool) -> list[str]:
    """What keeps a layer quantized with these settings off the NPU, each as `option: value -> fix`."""
    out = []
    if bits != NPU_BITS:
        out.append(f"bits: {bits} -> 4")
    if not sym:
        out.append("sym: false -> true")
    if group_size not in NPU_GROUPS:
        out.append(f"group_size: {group_size} -> 128 or -1 (per-channel)")
    return out


def low_bit_constants(ov_model) -> dict[str, int]:
    """Count of Constants per integer element type of at most 8 bits (u2, u4, u8, ...)."""
    types = Counter(op.get_output_element_type(0).get_type_name() for op in ov_model.get_ops()
                    if op.get_type_name() == "Constant")
    return {t: n for t, n in types.items() if t in ("u1", "u2", "u3", "u4", "i4", "u8", "i8")}


def export_openvino(model, qweights: dict[str, QuantizedWeight], out_dir: str | Path, meta: dict | None = None,
                    devices: tuple[str, ...] | list[str] = ("CPU",), kv_cache: bool = False,
                    exact: bool = True, onnx_path: str | Path | None = None, stateful: bool = False,
                    tokenizer=None) -> dict:
    """Write `out_dir/openvino_model.xml` (+ .bin) for the target `devices`; returns path, bytes, the
    low-bit constant counts, and the devices it was compiled on here / not compiled on. `kv_cache`: the
    inputs and outputs of `export_onnx(kv_cache=True)` (attention_mask, past / present key values).
    `stateful` (with `kv_cache`): the directory OpenVINO GenAI's `LLMPipeline` runs: the model takes `input_ids`,
    `attention_mask`, `position_ids` and `beam_idx` and keeps its KV cache as state (`make_stateful`), beside it the
    tokenizer's OpenVINO IRs, its files, `config.json` and `generation_config.json` (`write_genai_files`).
    `exact`: `EXACT_CPU_CONFIG` is written into the IR's `runtime_options`. The CPU plugin reads the dynamic
    quantization and KV-cache settings from there (a plain `compile_model` keeps activations in float) but not the
    inference precision: on CPUs with bf16 the f32 the IR was validated with takes `EXACT_CPU_CONFIG` (or
    `{"INFERENCE_PRECISION_HINT": "f32"}`) at compile time. False leaves the device's defaults (faster, less
    exact).
    `onnx_path`: a graph `export_onnx` wrote from these weights with this `kv_cache` (and `position_ids` when
    `stateful`), converted instead of tracing the model again (a run exporting both formats traces once)."""
    import openvino as ov

    unknown = [d for d in devices if d not in DEVICES]
    if unknown:
        raise ValueError(f"unknown OpenVINO device {unknown[0]!r}; choose from {', '.join(DEVICES)}")
    if "NPU" in devices:
        bad = {n: p for n, qw in qweights.items() if (p := npu_problems(qw.bits, qw.group_size, qw.sym))}
        if bad:
            name, problems = next(iter(bad.items()))
            raise ValueError(f"NPU target: {len(bad)} layers are not symmetric int4 with group 128 / per-channel, "
                             f"e.g. {name} ({'; '.join(problems)})")
    stateful = stateful and kv_cache

    from compress.export.onnx import export_onnx

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if onnx_path is None:  # trace into a temporary directory
            tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.onnx.",
                                                                  suffix=".tmp"))
            onnx_path = export_onnx(model, qweights, Path(tmp) / "onnx", meta=meta, kv_cache=kv_cache,
                                    position_ids=stateful)["path"]
        ov_model = ov.convert_model(str(onnx_path))
        dense = len(json.loads(onnx_meta(onnx_path)["compress.meta"])["dense_layers"])
    if stateful:
        make_stateful(ov_model)
    info = {"format": FORMAT, "version": FORMAT_VERSION, "meta": meta or {}, "dense_layers": dense,
            "devices": list(devices), "kv_cache": kv_cache, "stateful": stateful,
            "runtime_options": EXACT_CPU_CONFIG if exact else {}}
    ov_model.set_rt_info(FORMAT, ["compress", "format"])
    ov_model.set_rt_info(str(FORMAT_VERSION), ["compress", "version"])
    ov_model.set_rt_info(",".join(devices), ["compress", "devices"])
    ov_model.set_rt_info(json.dumps(info), ["compress", "meta"])
    for key, value in (EXACT_CPU_CONFIG.items() if exact else ()):
        ov_model.set_rt_info(str(value), ["runtime_options", key])
    with staged_directory(out, marker="openvino_model.xml") as tmp:  # a kill leaves no half-written IR
        ov.save_model(ov_model, str(tmp / "openvino_model.xml"), compress_to_fp16=False)
        tokenizer_irs = write_genai_files(model, tokenizer, tmp) if stateful else None
    path = out / "openvino_model.xml"
    nbytes = path.stat().st_size + path.with_suffix(".bin").stat().st_size
    compiled, missing = compile_on(path, devices)
    return {"path": str(path), "bytes": nbytes, "low_bit_constants": low_bit_constants(ov_model),
            "dense_layers": dense, "devices": list(devices), "compiled_on": compiled,
            "not_compiled": missing, "kv_cache": kv_cache, "stateful": stateful,
            **({"tokenizer_irs": tokenizer_irs} if stateful else {})}


def make_stateful(ov_model) -> None:
    """The converted `kv_cache` graph made stateful in place, as OpenVINO GenAI's LLMPipeline runs it (the layout
    optimum-intel's exporter writes, `optimum/exporters/openvino/stateful.py`): a `beam_idx` input (int32, batch)
    reorders each layer's past along the batch (a Gather in front of every consumer of the past input), then
    OpenVINO's MakeStateful pass turns each `past_key_values.*` / `present.*` pair into a ReadValue / Assign
    variable, and each variable starts as zeros of (batch of `input_ids`, heads, 0, width)."""
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    names = [p.get_any_name() for p in ov_model.inputs]
    if "position_ids" not in names:
        raise ValueError("a stateful IR for OpenVINO GenAI is converted from a graph with a `position_ids` input "
                         "(export_onnx(kv_cache=True, position_ids=True))")
    pasts = [n for n in names if n.startswith("past_key_values.")]
    presents = [n.replace("past_key_values.", "present.", 1) for n in pasts]
    batch = ov_model.input("input_ids").get_partial_shape()[0]
    beam_idx = ops.parameter(ov.PartialShape([batch]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    for name in pasts:
        port = ov_model.input(name)
        consumers = list(port.get_target_inputs())  # before the Gather becomes one
        reordered = ops.gather(port, beam_idx, ops.constant(np.int64(0)))
        for consumer in consumers:
            consumer.replace_source_output(reordered.output(0))
    ov_model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(ov_model, dict(zip(pasts, presents)))
    rows = ops.gather(ops.shape_of(ov_model.input("input_ids"), output_type="i64"), ops.constant(np.array([0])),
                      ops.constant(np.int64(0)))
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":  # its initial value: zeros, batch rows, no past
            dims = [rows] + [ops.constant(np.array([d.get_min_length()], np.int64))
                             for d in list(op.get_output_partial_shape(0))[1:]]
            zero = ops.constant(np.zeros((), op.get_output_element_type(0).to_dtype()))
            op.set_arguments([ops.broadcast(zero, ops.concat(dims, 0))])
    ov_model.validate_nodes_and_infer_types()


def write_genai_files(model, tokenizer, out: Path) -> str:
    """What LLMPipeline reads beside the model: `config.json`, `generation_config.json`, the tokenizer's files and its
    OpenVINO IRs (`openvino_tokenizer.xml`, `openvino_detokenizer.xml`, by `openvino_tokenizers.convert_tokenizer`).
    Returns "written", or why the tokenizer IRs are missing (no tokenizer, or one the converter refuses: the
    pipeline then runs on token ids only)."""
    import openvino as ov

    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is None:
        logger.warning("openvino export: no tokenizer; LLMPipeline runs the IR on token ids only")
        return "no tokenizer"
    tokenizer.save_pretrained(out)
    try:
        from openvino_tokenizers import convert_tokenizer

        encoder, decoder = convert_tokenizer(tokenizer, with_detokenizer=True)
    except Exception as e:  # noqa: BLE001 - the converter covers most Hugging Face tokenizers, not all, and says why
        logger.warning("openvino export: openvino_tokenizers cannot convert this tokenizer (%s); LLMPipeline runs "
                       "the IR on token ids only", e)
        return f"not converted: {e}"
    ov.save_model(encoder, str(out / "openvino_tokenizer.xml"))
    ov.save_model(decoder, str(out / "openvino_detokenizer.xml"))
    return "written"


def onnx_meta(path) -> dict[str, str]:
    import onnx

    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def compile_on(path: Path, devices) -> tuple[list[str], list[str]]:
    """Compile the saved IR on each target device this OpenVINO offers; (compiled, not available here)."""
    import openvino as ov

    core = ov.Core()
    here = {d.split(".")[0] for d in core.available_devices}
    compiled = []
    for device in devices:
        if device in here:
            core.compile_model(str(path), device)
            compiled.append(device)
    missing = [d for d in devices if d not in compiled]
    if missing:
        logger.warning("openvino export: %s not available on this machine; the IR was not compiled for it",
                       ", ".join(missing))
    return compiled, missing
