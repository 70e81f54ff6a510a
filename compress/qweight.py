"""The one middle representation: `QuantizedWeight`.

Every method produces one per quantized linear layer; exporters and kernels read only this.

Layout (paper notation, `W` is `nn.Linear.weight`, shape `(d_out, d_in)`):

    codes  uint8  (d_out, d_in)      unsigned codes in [0, 2^bits)
    scales fp32   (d_out, n_groups)  fp16-representable; may be negative (auto-round full-range sym)
    zeros  uint8  (d_out, n_groups)  zero points in [0, 2^bits); 2^(bits-1) for symmetric
    W_hat[o, i] = scales[o, i // g] * (codes[o, i] - zeros[o, i // g])

Group policy: groups run along `d_in`. `group_size == -1` means per-channel (one group of `d_in`).
When `group_size` does not divide `d_in`, the last group of each row is shorter
(`n_groups = ceil(d_in / g)`), as auto-round does by zero padding: its scale and zero point are
computed over the real columns only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALE_BITS = 16  # scales are stored as fp16


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    sym: bool

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        d_out, d_in = self.codes.shape
        if self.scales.shape != (d_out, self.n_groups) or self.zeros.shape != (d_out, self.n_groups):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} / zeros {tuple(self.zeros.shape)} do not match "
                f"codes {tuple(self.codes.shape)} with group size {self.group_size}"
            )

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def group(self) -> int:
        """Group length along d_in (d_in for per-channel)."""
        return self.in_features if self.group_size == -1 else self.group_size

    @property
    def n_groups(self) -> int:
        return math.ceil(self.in_features / self.group)

    def group_index(self) -> torch.Tensor:
        """`g_idx`: the group of each input column, shape (d_in,)."""
        return torch.arange(self.in_features) // self.group

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g_idx = self.group_index()
        s = self.scales.to(torch.float32)[:, g_idx]
        z = self.zeros.to(torch.float32)[:, g_idx]
        return (s * (self.codes.to(torch.float32) - z)).to(dtype)

    def storage_bits(self) -> int:
        """Bits this weight takes in a packed export: codes, fp16 scales, zero points if asymmetric."""
        zero_bits = 0 if self.sym else self.bits
        n = self.out_features * self.n_groups
        return self.codes.numel() * self.bits + n * (SCALE_BITS + zero_bits)

    def effective_bits(self) -> float:
        """ALGORITHMS.md 0.3: b + (b_scale + b_zero) / g, computed exactly from the stored tensors."""
        return self.storage_bits() / self.codes.numel()
