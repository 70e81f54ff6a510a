"""The frozen path from the last block's output to logits (final norm, LM head, soft-capping): what the
final-block objective (compress/quantize/lfq.py), the spine and the MoE statistics (compress/models/moe.py) share.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.errors import BadInput


class LogitHead(nn.Module):
    """The model's own path from the last block's output to logits, frozen: final norm, LM head, and
    logit soft-capping where the config has it."""

    def __init__(self, norm: nn.Module | None, head: nn.Module, softcap: float | None = None):
        super().__init__()
        self.norm, self.head, self.softcap = norm, head, softcap

    @classmethod
    def of(cls, adapter) -> LogitHead:
        _, head = adapter.lm_head()
        if adapter.kind != "causal" or head is None:
            raise BadInput(f"`final_block` other than `same` needs a causal LM with an LM head; "
                           f"`{adapter.model_type}` has none")
        out = cls(adapter.final_norm(), head, getattr(adapter.model.config, "final_logit_softcapping", None))
        out.requires_grad_(False)  # frozen: gradients reach only the last block's rounding parameters
        return out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.head(self.norm(h) if self.norm is not None else h).float()
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z
