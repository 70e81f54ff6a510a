"""Kernel backends behind one interface, chosen at load time, and `QuantLinear`.

See docs/kernels.md#backends-and-selection.

A backend turns a QuantizedWeight into its own packed state once (`prepare`) and multiplies
activations by it (`matmul(x, state) -> x @ W_hat.T` in fp32). `reference` (dequantize, then matmul)
is the oracle every other backend is tested against; `cpu` is the C++ kernel of `kernels/cpu.py` with
fp32 activations (the reference up to float rounding), `cpu-a8` the same kernel with activations
rounded to int8 per block (faster; 8-bit weights keep fp32 activations), `triton` the Triton kernel of
`kernels/gpu.py` (on a CUDA device; without one, or with TRITON_INTERPRET=1, in Triton's CPU interpreter,
which only tests use).
`select("auto", qw)` picks `triton` when a CUDA device and triton are present and it supports the weight,
else `cpu` when it supports the weight and its build succeeded, else `reference`.
A mixed-precision weight (per-chunk bits) runs as `Mixed`: one matmul per bit-width slice of the input
columns (`packing.split_mixed`), each slice on the backend `select` picks for it, fp16 chunks dense, summed.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from compress.kernels import cpu, gpu
from compress.qweight import QuantizedWeight

logger = logging.getLogger(__name__)


class Backend(Protocol):
    name: str

    def prepare(self, qw: QuantizedWeight): ...

    def matmul(self, x: torch.Tensor, state) -> torch.Tensor: ...


class Reference:
    name = "reference"

    def prepare(self, qw: QuantizedWeight) -> QuantizedWeight:
        return qw

    def matmul(self, x: torch.Tensor, state: QuantizedWeight) -> torch.Tensor:
        return x.float() @ state.dequantize(torch.float32).T


class CPU:
    def __init__(self, act: str = "fp32", scalar: bool = False):
        self.act, self.scalar = act, scalar  # scalar: force the scalar C++ path (tests)
        self.name = "cpu" if act == "fp32" else "cpu-a8"

    def prepare(self, qw: QuantizedWeight) -> cpu.PackedCPU | cpu.Packed3 | cpu.PackedTiles:
        return cpu.pack(qw, cpu.layout_for(qw, self.act))

    def matmul(self, x: torch.Tensor, state: cpu.PackedCPU) -> torch.Tensor:
        return cpu.matmul(x, state, act=self.act, scalar=self.scalar)


class Triton:
    name = "triton"

    def prepare(self, qw: QuantizedWeight) -> gpu.PackedGPU:
        return gpu.pack(qw)

    def matmul(self, x: torch.Tensor, state: gpu.PackedGPU) -> torch.Tensor:
        return gpu.matmul(x, state)


class Mixed:
    """Per-width slices of a mixed weight, each on its own backend; y = sum_b x[:, cols_b] @ W_b.T."""

    def __init__(self, inner: str):
        self.inner = inner
        self.name = f"mixed-{inner}"

    def prepare(self, qw: QuantizedWeight) -> list:
        from compress.kernels.packing import split_mixed

        state = []
        for bits, cols, part in split_mixed(qw):
            if isinstance(part, QuantizedWeight):
                b = select(self.inner, part)
                state.append((cols, b, b.prepare(part)))
            else:
                state.append((cols, None, part.float()))
        return state

    def matmul(self, x: torch.Tensor, state: list) -> torch.Tensor:
        y = None
        for cols, backend, st in state:
            xs = x.float()[..., cols]
            part = xs @ st.T if backend is None else backend.matmul(xs, st)
            y = part if y is None else y + part
        return y


BACKENDS = {"reference": Reference, "cpu": CPU, "cpu-a8": lambda: CPU(act="int8"), "triton": Triton}


def select(name: str, qw: QuantizedWeight) -> Backend:
    """`auto`, `cpu`, `cpu-a8`, `triton` or `reference`. `auto` (= `triton` on a CUDA device, else `cpu` when
    possible) falls back to the reference path (logged at debug level per layer; a missing compiler is
    logged once by `cpu.extension`). An explicit backend that cannot run raises."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown kernel backend `{name}` (known: auto, {', '.join(BACKENDS)})")
    if qw.mixed:
        return Mixed(name)
    if name == "reference":
        return Reference()
    if name == "triton" or (name == "auto" and torch.cuda.is_available()):
        reason = gpu.supports(qw) or gpu.available()
        if reason is None:
            return Triton()
        if name == "triton":
            raise ValueError(f"the triton backend cannot run this weight: {reason}; use backend `auto` or "
                             "`reference`")
    reason = cpu.supports(qw) or (None if cpu.extension() is not None else "no compiled cpu kernel")
    if reason is None:
        return BACKENDS["cpu" if name == "auto" else name]()
    if name != "auto":
        raise ValueError(f"the cpu backend cannot run this weight: {reason}; use backend `auto` or `reference`")
    logger.debug("reference path for a %dx%d weight: %s", qw.out_features, qw.in_features, reason)
    return Reference()


class QuantLinear(nn.Module):
    """`nn.Linear` replacement holding a packed QuantizedWeight; forward runs the chosen backend in fp32
    and returns the input's dtype."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, backend: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.bits, self.group_size = qw.bits, qw.group_size
        self.backend = select(backend, qw)
        self.state = self.backend.prepare(qw)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, qw: QuantizedWeight, backend: str = "auto") -> "QuantLinear":
        return cls(qw, linear.bias, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.backend.matmul(x, self.state).to(x.device)  # triton's state may sit on the GPU, the model not
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, backend={self.backend.name}")


def quantize_model(model: nn.Module, qweights: dict[str, QuantizedWeight], backend: str = "auto") -> nn.Module:
    """Replace each named linear of `model` by a QuantLinear of its QuantizedWeight, in place."""
    for name, qw in qweights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(getattr(parent, child), qw, backend))
    return model
