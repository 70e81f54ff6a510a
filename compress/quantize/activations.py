"""Activation quantization of a weight-and-activation scheme (docs/formats.md#w8a8-int8): the arithmetic the
checkpoint is served with, so that the run's evaluation is the number a user gets.

`w8a8-int8`: each linear's input is quantized per token (dynamic: the scale is computed at run time from the token's
own values), symmetric int8, as compressed-tensors defines it (what transformers computes when it loads the
export): `s = max|x| / 127.5` (the range 255 over 2; a zero scale becomes float32's eps), `q = clamp(round(x / s),
-128, 127)`, `x_hat = q s`. tests/quantize/test_activations.py checks it against compressed-tensors' own forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ActivationSpec:
    bits: int = 8
    strategy: str = "token"  # one scale per token (a row of the linear's input)
    dynamic: bool = True

    def as_compressed_tensors(self) -> dict:
        """The `input_activations` entry of a compressed-tensors `config_groups` group."""
        return {"num_bits": self.bits, "type": "int", "symmetric": True, "strategy": self.strategy,
                "dynamic": self.dynamic}


SCHEME_ACTIVATIONS = {"w8a8-int8": ActivationSpec()}


def fake_quant(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """`x` quantized and dequantized per token (module docstring), in x's dtype."""
    half = (2 ** spec.bits - 1) / 2
    s = x.abs().amax(-1, keepdim=True) / half
    s = torch.where(s == 0, torch.finfo(torch.float32).eps, s)
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
    specs = {b.key: SCHEME_ACTIVATIONS[b.cfg.scheme] for b in stages
             if b.cfg.stage == "quantize" and getattr(b.cfg, "scheme", None) in SCHEME_ACTIVATIONS}
    return {name: specs[q.stage] for q in qweights if q.stage in specs for name in q.weights}
