"""`quantize method: autoround`: AutoRound / SignRound (arXiv 2309.05516; docs/quantize.md#autoround), every block
tuned by the SignRound tuner (signround.py) on our calibration data.
"""

from __future__ import annotations

import torch

from compress.driver import BlockData
from compress.quantize.signround import AutoRoundConfig, signround_block
from compress.quantize.spine import CHUNK_PLAN, FLOAT, Quantizer, quantizer
from compress.qweight import QuantizedWeight

__all__ = ["AutoRound", "AutoRoundConfig"]


@quantizer(AutoRoundConfig, "AutoRound sign-gradient rounding (Intel auto-round)")
class AutoRound(Quantizer):
    needs_fp_targets = needs_data = True
    capabilities = frozenset({CHUNK_PLAN, FLOAT})

    def __init__(self, cfg: AutoRoundConfig):
        super().__init__(cfg)
        self.batch_size = cfg.batch_size

    def quantize_block(self, data: BlockData) -> dict[str, QuantizedWeight]:
        with torch.enable_grad():
            return signround_block(data, self.cfg)
