"""OpenVINO IR export: the ONNX graph of `compress.export.onnx`, converted by OpenVINO's ONNX frontend.

The frontend turns each `com.microsoft::MatMulNBits` into a compressed integer Constant (u2 / u4 / u8
codes and zero points) followed by the decompression subgraph (Convert, Subtract, Multiply, Reshape),
the pattern of ALGORITHMS.md 8.5, so the IR keeps the weights compressed and the CPU plugin runs them
as a low-bit `FullyConnected` (runtime precision u2 / u4 / u8). Files: `openvino_model.xml` / `.bin`,
with rt_info `compress/format` = "openvino-ir", `compress/version` and `compress/meta` (JSON).

To reproduce the exported model's numbers on CPU, compile with `EXACT_CPU_CONFIG`: by default the CPU
plugin quantizes activations to int8 for u4/u8 weights (dynamic quantization) and may run in bf16.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

from compress.qweight import QuantizedWeight

FORMAT, FORMAT_VERSION = "openvino-ir", 1
EXACT_CPU_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}


def low_bit_constants(ov_model) -> dict[str, int]:
    """Count of Constants per integer element type of at most 8 bits (u2, u4, u8, ...)."""
    types = Counter(op.get_output_element_type(0).get_type_name() for op in ov_model.get_ops()
                    if op.get_type_name() == "Constant")
    return {t: n for t, n in types.items() if t in ("u1", "u2", "u3", "u4", "i4", "u8", "i8")}


def export_openvino(model, qweights: dict[str, QuantizedWeight], out_dir: str | Path, meta: dict | None = None) -> dict:
    """Write `out_dir/openvino_model.xml` (+ .bin); returns path, bytes and the low-bit constant counts."""
    import openvino as ov

    from compress.export.onnx import export_onnx

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        res = export_onnx(model, qweights, tmp, meta=meta)
        ov_model = ov.convert_model(res["path"])
    info = {"format": FORMAT, "version": FORMAT_VERSION, "meta": meta or {}, "dense_layers": res["dense_layers"]}
    ov_model.set_rt_info(FORMAT, ["compress", "format"])
    ov_model.set_rt_info(str(FORMAT_VERSION), ["compress", "version"])
    ov_model.set_rt_info(json.dumps(info), ["compress", "meta"])
    path = out / "openvino_model.xml"
    ov.save_model(ov_model, str(path), compress_to_fp16=False)
    nbytes = path.stat().st_size + path.with_suffix(".bin").stat().st_size
    return {"path": str(path), "bytes": nbytes, "low_bit_constants": low_bit_constants(ov_model),
            "dense_layers": res["dense_layers"]}
