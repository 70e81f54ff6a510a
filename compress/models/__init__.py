"""Models: what the rest of compress knows about a checkpoint, as data (docs/architectures.md).

This package owns the architecture adapters (`adapters.py`: roles of every module per family), loading from a
directory, a GGUF file or the Hub (`loading.py`), block streaming of models larger than memory (`streaming.py`),
the frozen final norm + LM head that the final-block objective, the spine and the MoE statistics share
(`head.py`), the MoE statistics and forced routing (`moe.py`), and the models shipped in PyPI packages
(`smollm2.py`, `minilm.py`).
"""
