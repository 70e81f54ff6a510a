"""Round-to-nearest weight quantization (no calibration data)."""

from __future__ import annotations

from typing import Literal

from compress.config import QuantizeConfig
from compress.driver import BlockData
from compress.primitives import fit_mixed, rtn
from compress.quantize import ggml_grid
from compress.quantize.spine import CHUNK_PLAN, SIGN, Quantizer, quantizer
from compress.qweight import QuantizedWeight


class RTNConfig(QuantizeConfig):
    method: Literal["rtn"] = "rtn"


@quantizer(RTNConfig, "round-to-nearest, group-wise, no calibration")
class RTN(Quantizer):
    capabilities = frozenset({CHUNK_PLAN, SIGN})

    def quantize_block(self, data: BlockData) -> dict[str, QuantizedWeight]:
        return {name: quantize_layer(lin.weight.data, data.specs[name]) for name, lin in data.linears.items()}


def quantize_layer(W, s) -> QuantizedWeight:
    """RTN at the layer's bits, or, with an allocation plan, each chunk fitted with its own option, or on the layer's
    llama.cpp grid (`gguf`: llama.cpp's own fit and rounding without an importance matrix)."""
    if s.ggml is not None:
        return ggml_grid.rtn(W, s.ggml)
    if s.mixed is not None:
        m = s.mixed
        return fit_mixed(W, list(m.options), m.chunk_size, s.group_size, s.sym, m.energy, m.map_bits)
    return rtn(W, s.bits, s.group_size, s.sym)
