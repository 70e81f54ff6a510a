"""The `quantize` stage: weights rounded to a few bits, block by block (docs/quantize.md, docs/stages.md).

This package owns the spine (`spine.py`: one stage for every quantizer, the layer plan and its group fitting, the
final-block objective, FlipGuard, the `lm_head` option, the `QuantizedWeights` hand-off and the adapted-groups
report section), the quantizers registered on it (`rtn.py`, `gptq.py`, `autoround.py`), the SignRound tuner that
AutoRound and the final block share (`signround.py`), the logit-aware objective (`lfq.py`) and FlipGuard
(`guard.py`). The block-wise calibration loop it runs is the shared driver (compress/driver.py).
"""
