"""Publishing a run: CI mode, the model card, `compress push` to the Hub, compare and sweep (docs/ci.md,
docs/hub.md).

This package owns the Hub upload (`hub.py`), the generated model card (`card.py`), CI mode (`ci.py`),
`compress compare` (`compare.py`) and `compress sweep` (`sweep.py`); it reads a finished run's outputs only.
"""
