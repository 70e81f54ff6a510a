"""Typed configs shared by stages. Every config forbids unknown keys, so a misspelt recipe key is an error,
not a silently ignored setting. Quantizer options: docs/quantize.md#shared-options."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EVAL_MAX_TOKENS = 32768  # a run's and `compress eval`'s cap per file: minutes, not an hour, on a laptop


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def check_group_size(v: int) -> int:
    if v != -1 and v <= 0:
        raise ValueError("group_size must be a positive integer or -1 (per-channel)")
    return v


# one GGML tensor type (a quantize stage's override of the file type's per-tensor plan)
GGMLType = Literal["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K"]


class LayerOverride(StrictModel):
    """Per-layer override: `pattern` is a regex matched (re.search) against the module name."""

    pattern: str
    bits: Optional[int] = Field(None, ge=2, le=8)
    group_size: Optional[int] = None
    sym: Optional[bool] = None
    skip: bool = False
    gguf: Optional[GGMLType] = Field(None, description="with the stage's `gguf`: this layer's GGML type instead of "
                                                       "the one llama.cpp's plan gives it (llama-quantize's "
                                                       "--tensor-type)")

    _gs = field_validator("group_size")(lambda cls, v: v if v is None else check_group_size(v))


class GuardConfig(StrictModel):
    """FlipGuard before rounding (docs/guard.md): data-free, against quantization-conditioned backdoors."""

    method: Literal["flipguard"] = "flipguard"
    rule: Literal["clip", "flip"] = Field("clip", description="`clip`: pull each group's outermost weights in by "
                                          "`shrink` quantization steps of its range, which moves every rounding "
                                          "boundary of the group; `flip`: move the weights next to a boundary across it")
    shrink: float = Field(1.0, gt=0, le=4, description="rule clip: steps of each group's range removed (the grid's "
                                                       "step shrinks by shrink / (2^bits - 1))")
    d_max: float = Field(0.15, gt=0, le=0.5, description="rule flip: weights closer than this to a rounding boundary "
                                                          "(in quantization steps) are candidates")
    rho: float = Field(0.5, gt=0, le=1, description="rule flip: share of the candidates moved, nearest first")
    eps: float = Field(0.1, gt=0, lt=0.5, description="rule flip: how far past the boundary a moved weight lands "
                                                      "(steps)")


FinalBlock = Literal["auto", "same", "lfq", "hard_ce"]
# the quantized GGUF file types (export/gguf/types.py FILE_TYPES less the float ones)
GGUFQuantType = Literal["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "Q4_K_M",
                        "Q3_K_M"]
FINAL_BLOCK_HELP = ("objective of the last decoder block: `same` (the method's own), `lfq` (KL to the FP model's "
                    "token distribution through the frozen head), `hard_ce` (next-token CE, for comparison), "
                    "`auto` (`lfq` on a causal LM with an LM head, `same` otherwise); other than `same`, the last "
                    "block is tuned by AutoRound's sign-gradient rounding through the frozen final norm and head")


# the weight grid each scheme fixes; FLOAT_SCHEMES: the float element format of a scheme's weights (floatgrid.py)
SCHEMES = {"w8a8-int8": {"bits": 8, "group_size": -1, "sym": True}, "fp8": {"bits": 8, "group_size": -1, "sym": True},
           "fp8-block": {"bits": 8, "group_size": 128, "sym": True},
           **{k: {"bits": 4, "group_size": 16, "sym": True} for k in ("nvfp4a16", "nvfp4")},
           **{k: {"bits": 4, "group_size": 32, "sym": True} for k in ("mxfp4a16", "mxfp4")},
           **{k: {"bits": 4, "group_size": 128, "sym": True} for k in ("w4a8-int8", "w4a8-fp8", "w4a4")}}
FLOAT_SCHEMES = {"fp8": "e4m3", "fp8-block": "e4m3-block", "nvfp4a16": "e2m1", "mxfp4a16": "mxfp4", "nvfp4": "e2m1",
                 "mxfp4": "mxfp4"}
DYNAMIC_ONLY = ("nvfp4", "mxfp4", "fp8-block")  # activations scaled per group (16, 32, 128) at run time
WEIGHT_ONLY_SCHEMES = ("nvfp4a16", "mxfp4a16")  # schemes that leave the activations in full precision
Scheme = Literal["w8a8-int8", "fp8", "fp8-block", "nvfp4a16", "mxfp4a16", "w4a8-int8", "w4a8-fp8", "w4a4", "nvfp4",
                 "mxfp4"]


class QuantizeConfig(StrictModel):
    """Fields every weight-only quantizer shares."""

    stage: Literal["quantize"] = "quantize"
    method: str
    bits: int = Field(4, ge=2, le=8, description="weight bits, 2..8")
    group_size: int = Field(128, description="group length along the input dimension; -1 = per-channel. A target: a "
                                             "layer it does not fit gets the nearest group that does, at plan time "
                                             "(docs/quantize.md#group-size-adaptation)")
    strict_groups: bool = Field(False, description="refuse a layer `group_size` does not fit instead of adapting its "
                                                   "group")
    sym: bool = Field(True, description="symmetric (full-range, auto-round style) or asymmetric with zero points")
    lm_head: bool = Field(False, description="also quantize lm_head (RTN); embeddings are never quantized")
    overrides: list[LayerOverride] = Field(default_factory=list, description="per-layer regex overrides")
    guard: Optional[GuardConfig] = Field(None, description="`flipguard` (or a mapping with its options): perturb the "
                                                           "weights before rounding so that a quantization-"
                                                           "conditioned backdoor's codes do not come back")
    final_block: FinalBlock = Field("same", description=FINAL_BLOCK_HELP)
    final_iters: Optional[int] = Field(None, gt=0, description="AutoRound steps on the last block when `final_block` "
                                                               "is not `same` (default 200; autoround: its `iters`)")
    gguf: Optional[GGUFQuantType] = Field(None, description="round onto llama.cpp's grids for this GGUF file type: "
                                                            "each layer gets the type llama.cpp's quantize assigns it "
                                                            "(Q4_K_M, Q3_K_M, Q2_K are mixes) and the method optimises "
                                                            "that type's blocks, written byte for byte by the gguf "
                                                            "export (replaces bits, group_size and sym; "
                                                            "docs/gguf.md#rounding-on-llamacpps-grids)")

    scheme: Optional[Scheme] = Field(
        None, description="a weight-and-activation format (docs/formats.md#w8a8-int8): `w8a8-int8` is int8 weights per "
                          "output channel (bits 8, group_size -1, sym, set for you) and int8 activations per token, "
                          "quantized at run time; `fp8` the same with FP8 E4M3 weights and activations (methods rtn, "
                          "gptq, autoround; docs/formats.md#fp8); `fp8-block` E4M3 weights with a scale per 128 x 128 "
                          "block and FP8 activations per token and group of 128 columns, dynamic (llm-compressor's "
                          "FP8_BLOCK; every quantized layer's in_features a multiple of 128); `nvfp4a16` NVFP4 E2M1 "
                          "weights in groups of 16 "
                          "with E4M3 scales and an fp32 scale per tensor, activations untouched "
                          "(docs/formats.md#nvfp4); `mxfp4a16` E2M1 in groups of 32 with power-of-two (E8M0) scales; "
                          "`w4a8-int8`, `w4a8-fp8`, `w4a4`: int4 weights in groups of 128 (sym) with int8, FP8 or "
                          "int4 activations per token (docs/formats.md#w4a8-and-w4a4); `nvfp4` / `mxfp4`: "
                          "`nvfp4a16` / `mxfp4a16`'s weights with FP4 activations too (E2M1 per group of 16 with "
                          "E4M3 scales under a calibrated per-layer global scale / per 32 with power-of-two scales; "
                          "docs/formats.md#fp4-activations-scheme-nvfp4-mxfp4); "
                          "the evaluation computes with them, and only the `compressed-tensors` export carries them")

    activations: Literal["dynamic", "static"] = Field(
        "dynamic", description="with a `scheme`: dynamic (a scale per token, computed at run time from the token) or "
                               "static (one scale per layer input, calibrated once on the calibration text: max |x| "
                               "/ 127.5 for int8, / 448 for fp8, stored as the export's input_scale)")

    kv_cache: Optional[Literal["fp8", "int8", "int4"]] = Field(
        None, description="with a `scheme`: also quantize the KV cache, keys (after RoPE) and values as the server "
                          "stores them: `fp8` (E4M3, what vLLM takes), `int8` or `int4` (symmetric); the evaluation "
                          "computes with it and the compressed-tensors export writes `kv_cache_scheme` and the scales "
                          "(docs/formats.md#quantized-kv-cache)")
    kv_scales: Literal["tensor", "head", "dynamic"] = Field(
        "tensor", description="the KV cache's scales: `tensor` (one static scale per layer for K and for V, "
                              "calibrated on the calibration text: what vLLM and llm-compressor use), `head` (static, "
                              "per KV head) or `dynamic` (per token and head, computed at run time: KV4 of the W4A4KV4 "
                              "studies; transformers only)")

    _gs = field_validator("group_size")(lambda cls, v: check_group_size(v))

    @model_validator(mode="before")
    @classmethod
    def _scheme(cls, v):
        """A scheme fixes the weights' grid: it fills bits / group_size / sym, and refuses other values for them."""
        if isinstance(v, dict) and v.get("scheme") in (None, *WEIGHT_ONLY_SCHEMES) and \
                v.get("activations", "dynamic") != "dynamic":
            raise ValueError(f"`activations: {v['activations']}` quantizes activations: give a `scheme` that does "
                             "(w8a8-int8, fp8, w4a8-int8, w4a8-fp8, w4a4)"
                             + (f"; `{v['scheme']}` leaves them in full precision" if v.get("scheme") else " too"))
        if isinstance(v, dict) and v.get("kv_cache") is not None and v.get("scheme") is None:
            raise ValueError("`kv_cache` is written by the compressed-tensors export, which carries a `scheme`: give "
                             "one (w8a8-int8, fp8, w4a8-int8, w4a8-fp8, w4a4, nvfp4a16, mxfp4a16)")
        if isinstance(v, dict) and v.get("kv_scales", "tensor") != "tensor" and v.get("kv_cache") is None:
            raise ValueError(f"`kv_scales: {v['kv_scales']}` sets the KV cache's scales: give `kv_cache` (fp8, int8, "
                             "int4) too")
        if isinstance(v, dict) and v.get("scheme") in DYNAMIC_ONLY and v.get("activations", "dynamic") != "dynamic":
            raise ValueError(f"`scheme: {v['scheme']}` scales its activations per group at run time (NVFP4's "
                             "global scale is calibrated for you): remove `activations: static`")
        if not isinstance(v, dict) or v.get("scheme") is None:
            return v
        fixed = SCHEMES.get(v["scheme"]) if isinstance(v["scheme"], str) else None
        if fixed is None:
            return v  # the Literal reports the unknown name (or the wrong type)
        clash = [f"{k}: {v[k]}" for k, want in fixed.items() if k in v and v[k] != want]
        if clash:
            raise ValueError(f"`scheme: {v['scheme']}` sets {', '.join(f'{k}: {w}' for k, w in fixed.items())}; "
                             f"remove {', '.join(clash)}")
        if v.get("gguf"):
            raise ValueError(f"`scheme: {v['scheme']}` and `gguf` are two formats: choose one")
        for o in v.get("overrides") or ():
            if isinstance(o, dict) and any(o.get(k) is not None for k in ("bits", "group_size", "sym")):
                raise ValueError(f"`scheme: {v['scheme']}` fixes every layer's grid: an override may only `skip` a "
                                 f"layer (pattern `{o.get('pattern')}`)")
        return {**v, **fixed}

    @field_validator("guard", mode="before")
    @classmethod
    def _guard_name(cls, v):
        return {"method": v} if isinstance(v, str) else v
