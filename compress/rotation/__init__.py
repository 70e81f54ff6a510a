"""The `rotate` stage: exact re-parametrisations that make weights easier to round (docs/walsh.md).

This package owns the Walsh-Hadamard transforms (`hadamard.py`), the weight surgery of the fused rotation
(`surgery.py`), the q/k principal-axis rotations (`pca.py`), the BBT-spectral energy scale (`scaling.py`), the
`walsh` stage (`walsh.py`) with its evaluation-only research modes (`research.py`), InfoQuant's learned rotations
(`infoquant.py`), and auto-round's own Hadamard rotation for comparison (`autoround_hadamard.py`).
"""
