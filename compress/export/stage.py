"""Export formats, registered as ("export", name). Each reads only the model and its QuantizedWeights."""

from __future__ import annotations

from typing import Literal

from compress.config import StrictModel
from compress.registry import register


class HFExportConfig(StrictModel):
    format: Literal["hf"] = "hf"
    directory: str = "hf"


class FakeExportConfig(StrictModel):
    format: Literal["fake"] = "fake"
    directory: str = "hf-fake"


def _export(ctx, cfg, fmt: str) -> dict:
    from compress.export.hf import export_hf, export_hf_streaming

    out = ctx.workspace.path(cfg.directory)
    meta = {"recipe_sha256": ctx.loaded.sha256, "model": ctx.loaded.recipe.model.path}
    if ctx.streamer is not None:
        res = export_hf_streaming(ctx.model, ctx.streamer.source, lambda i: ctx.workspace.load_block(ctx.block_stage, i),
                                  ctx.qweights, ctx.tokenizer, out, meta=meta)
    else:
        res = export_hf(ctx.model, ctx.qweights, ctx.tokenizer, out, fmt=fmt, meta=meta)
    return {"path": str(out), **res}


@register("export", "hf", HFExportConfig, "packed auto-round checkpoint loadable by transformers")
def export_hf_stage(ctx, cfg: HFExportConfig) -> dict:
    return _export(ctx, cfg, "auto_round")


@register("export", "fake", FakeExportConfig, "dequantized floating-point checkpoint for FP-only tools")
def export_fake_stage(ctx, cfg: FakeExportConfig) -> dict:
    return _export(ctx, cfg, "fake")


class OnnxExportConfig(StrictModel):
    format: Literal["onnx"] = "onnx"
    directory: str = "onnx"


@register("export", "onnx", OnnxExportConfig, "ONNX graph with com.microsoft::MatMulNBits linears (onnxruntime)")
def export_onnx_stage(ctx, cfg: OnnxExportConfig) -> dict:
    from compress.export.onnx import export_onnx

    return export_onnx(ctx.model, ctx.qweights, ctx.workspace.path(cfg.directory), meta=_meta(ctx))


class OpenVINOExportConfig(StrictModel):
    format: Literal["openvino"] = "openvino"
    directory: str = "openvino"


@register("export", "openvino", OpenVINOExportConfig, "OpenVINO IR with compressed u2/u4/u8 weight constants")
def export_openvino_stage(ctx, cfg: OpenVINOExportConfig) -> dict:
    from compress.export.openvino import export_openvino

    return export_openvino(ctx.model, ctx.qweights, ctx.workspace.path(cfg.directory), meta=_meta(ctx))


def _meta(ctx) -> dict:
    """Provenance written into graph-format exports."""
    return {"recipe_sha256": ctx.loaded.sha256, "model": ctx.loaded.recipe.model.path}
