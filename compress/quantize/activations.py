"""Activation quantization of a weight-and-activation scheme (docs/formats.md#w8a8-int8): the arithmetic the
checkpoint is served with, so that the run's evaluation is the number a user gets.

`w8a8-int8`: each linear's input is quantized per token (dynamic: the scale is computed at run time from the token's
own values), symmetric int8, as compressed-tensors defines it (what transformers computes when it loads the
export): `s = max|x| / 127.5` (the range 255 over 2; a zero scale becomes float32's eps), `q = clamp(round(x / s),
-128, 127)`, `x_hat = q s`. tests/export/test_compressed_tensors.py checks it against compressed-tensors' own forward.

`fp8`: the same per-token (or static per-tensor) scales with E4M3's range, `s = max|x| / 448`, and `x_hat =
E4M3(clamp(x / s, -448, 448)) s` (torch's cast: round to nearest even), compressed-tensors' float arithmetic.
`fp8-block`: FP8 with a dynamic scale per token and group of 128 columns (its `group` strategy, what vLLM's block FP8
kernels quantize the input with).

`activations: static`: one scale per layer input (strategy `tensor`), calibrated once after the quantize stages on
the calibration text, through the model with its quantized weights and full-precision activations (`calibrate`):
`s = max|x| / 127.5` over every calibration token, rounded to the dtype the export stores it in (its `input_scale`),
so the evaluation uses the stored value; `q = clamp(round(x / s), -128, 127)` as above.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from compress.quantize import floatgrid


@dataclass(frozen=True)
class ActivationSpec:
    bits: int = 8
    strategy: str = "token"  # one scale per token (a row of the linear's input), or "tensor" (static)
    dynamic: bool = True
    scale: float | None = None  # static: the calibrated scale (None: not calibrated yet)
    type: str = "int"  # or "float": FP8 E4M3 elements (`scheme: fp8`), E2M1 with `fp4`
    fp4: str | None = None  # E2M1 activations in groups: "e2m1" (NVFP4, 16) or "mxfp4" (MXFP4, 32), floatgrid's names
    group: int = 0  # strategy "group": a dynamic scale per token and group of this many columns (`fp8-block`: 128)

    @property
    def half(self) -> float:
        """Half the grid's range: max |x| / half is the scale that maps max |x| to the grid's edge (int8: 127.5,
        E4M3: 448, E2M1: 6, compressed-tensors' `calculate_range`)."""
        return 6.0 if self.fp4 else FP8_MAX if self.type == "float" else (2 ** self.bits - 1) / 2

    @property
    def calibrated(self) -> bool:
        """Whether a scale is calibrated on the calibration text: static scales, and NVFP4's global scale."""
        return not self.dynamic or self.fp4 == "e2m1"

    def as_compressed_tensors(self) -> dict:
        """The `input_activations` entry of a compressed-tensors `config_groups` group."""
        if self.fp4 == "e2m1":  # llm-compressor's NVFP4 preset
            return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
                    "dynamic": "local", "observer": "static_minmax", "scale_dtype": "torch.float8_e4m3fn"}
        if self.fp4 == "mxfp4":  # its MXFP4 preset
            return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": True, "scale_dtype": "torch.uint8"}
        return {"num_bits": self.bits, "type": self.type, "symmetric": True, "strategy": self.strategy,
                "dynamic": self.dynamic, **({"group_size": self.group} if self.group else {})}

    def describe(self) -> str:
        if self.fp4:
            return {"e2m1": "NVFP4 (E2M1 per 16, E4M3 scales under a calibrated global scale)",
                    "mxfp4": "MXFP4 (E2M1 per 32, power-of-two scales)"}[self.fp4]
        kind = "fp8 (E4M3)" if self.type == "float" else f"int{self.bits}"
        return f"{kind} " + ("per tensor, static scales calibrated on the calibration text" if not self.dynamic else
                             f"per token and group of {self.group}, dynamic" if self.group else "per token, dynamic")


FP8_MAX = 448.0  # E4M3's largest finite value
SCHEME_ACTIVATIONS = {"w8a8-int8": ActivationSpec(), "fp8": ActivationSpec(type="float"),
                      "fp8-block": ActivationSpec(type="float", strategy="group", group=128),
                      "w4a8-int8": ActivationSpec(), "w4a8-fp8": ActivationSpec(type="float"),
                      "w4a4": ActivationSpec(bits=4),
                      "nvfp4": ActivationSpec(bits=4, type="float", strategy="tensor_group", fp4="e2m1"),
                      "mxfp4": ActivationSpec(bits=4, type="float", strategy="group", fp4="mxfp4")}
STATIC_ACTIVATIONS = {k: replace(v, strategy="tensor", dynamic=False) for k, v in SCHEME_ACTIVATIONS.items()
                      if v.fp4 is None and not v.group}


def spec_of(scheme: str | None, activations: str = "dynamic") -> ActivationSpec | None:
    """The activation setting of a quantize stage's `scheme` and `activations` (None: weight-only, with no scheme or
    a weight-only one: nvfp4a16)."""
    if scheme not in SCHEME_ACTIVATIONS:
        return None
    return (STATIC_ACTIVATIONS if activations == "static" else SCHEME_ACTIVATIONS)[scheme]


def fake_quant(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """`x` quantized and dequantized (module docstring), in x's dtype: per token (and group), or with the static scale
    (one not calibrated yet: max |x| over the whole tensor, as calibration would give on x alone)."""
    if spec.fp4:
        return fp4_quant(x, spec)
    half = spec.half
    if spec.group:  # compressed-tensors' dynamic `group`: the columns must divide (the plan checks every layer's)
        g = x.unflatten(-1, (-1, spec.group))
        return round_to(g, g.abs().amax(-1, keepdim=True) / half, spec).flatten(-2)
    if spec.dynamic:
        s = x.abs().amax(-1, keepdim=True) / half
    elif spec.scale is not None:
        s = torch.tensor(spec.scale, dtype=x.dtype)
    else:
        s = x.abs().amax() / half
    return round_to(x, s, spec)


def fp4_quant(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """`x` on an E2M1 grid per group of its last dimension, dequantized (compressed-tensors' dynamic `tensor_group` /
    `group` quantization): NVFP4 scales `E4M3(G max|x| / 6) / G` per 16 under the global scale G (`spec.scale`,
    calibrated; None: x's own `448 * 6 / max|x|`), MXFP4 power-of-two scales per 32 (compress/quantize/floatgrid.py,
    the weights' rounding, on the rows of x)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    g = floatgrid.FORMATS[spec.fp4].group
    gscale = None
    if spec.fp4 == "e2m1":
        gscale = spec.scale if spec.scale is not None else floatgrid.global_scale(rows)
    s = floatgrid.per_column(floatgrid.scales(rows, g, spec.fp4, gscale), rows.shape[1], g)
    q = floatgrid.decode(floatgrid.encode(rows / s, spec.fp4), spec.fp4) * s
    return q.reshape(x.shape).to(x.dtype)


def round_to(x: torch.Tensor, s: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """`x` on the grid of `spec` with scales `s` (broadcast against x; a zero becomes float32's eps), dequantized:
    compressed-tensors' `fake_quantize` steps."""
    half = spec.half
    s = torch.where(s == 0, torch.finfo(torch.float32).eps, s)
    if spec.type == "float":  # clamp to E4M3's range, cast (round to nearest even), back
        return torch.clamp(x / s, -half, half).to(torch.float8_e4m3fn).to(x.dtype) * s
    lo, hi = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    return torch.clamp(torch.round(x / s), lo, hi) * s


@contextmanager
def quantized_inputs(model: nn.Module, layers: dict[str, ActivationSpec]):
    """While inside: each named linear's input is fake-quantized by its spec (forward pre-hooks, removed after)."""
    handles = []
    try:
        for name, spec in layers.items():
            handles.append(model.get_submodule(name).register_forward_pre_hook(
                lambda _m, args, spec=spec: (fake_quant(args[0], spec), *args[1:])))
        yield
    finally:
        for h in handles:
            h.remove()


def scheme_layers(stages, qweights) -> dict[str, ActivationSpec]:
    """{layer: ActivationSpec} of every layer a quantize stage with an activation scheme rounded: `stages` are the
    bound stages (their configs as run), `qweights` the QuantizedWeights hand-offs (`.stage`, `.weights`)."""
    specs = {b.key: spec for b in stages if b.cfg.stage == "quantize"
             and (spec := spec_of(getattr(b.cfg, "scheme", None), b.cfg.activations)) is not None}
    return {name: specs[q.stage] for q in qweights if q.stage in specs for name in q.weights}


@torch.no_grad()
def calibrate(model: nn.Module, layers: dict[str, ActivationSpec], tokens: torch.Tensor, dtype: torch.dtype,
              batch_size: int = 8) -> dict[str, ActivationSpec]:
    """`layers` with every static spec's scale calibrated: max |x| / half (127.5; E4M3: 448) at the layer's input
    over `tokens` (batches of windows through `model`, its activations in full precision), rounded to `dtype` (the stored
    input_scale's). Dynamic specs are returned as they are."""
    static = [n for n, s in layers.items() if s.calibrated]
    top = dict.fromkeys(static, 0.0)
    handles = []
    try:
        for name in static:
            handles.append(model.get_submodule(name).register_forward_pre_hook(
                lambda _m, args, name=name: top.__setitem__(name, max(top[name], float(args[0].abs().amax())))))
        for i in range(0, tokens.shape[0], batch_size):
            model(tokens[i:i + batch_size])
    finally:
        for h in handles:
            h.remove()
    out = dict(layers)
    for name in static:
        if layers[name].fp4 == "e2m1":  # NVFP4's global input scale, 448 * 6 / max|x|, stored in float32
            out[name] = replace(layers[name], scale=floatgrid.global_scale(torch.tensor([top[name]])))
            continue
        s = torch.tensor(max(top[name], 1e-30) / layers[name].half, dtype=torch.float32).to(dtype).float().item()
        out[name] = replace(layers[name], scale=s)
    return out
