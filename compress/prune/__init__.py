"""The `prune` and `heal` stages: structure removed from a model (docs/prune.md).

This package owns the importance scores (`scores.py`: FFN channels, KV-head groups, whole blocks), structured
pruning (`structured.py`: `prune` methods ffn, heads, depth), PrunePath (`routing.py`: dense FFNs split into
experts routed per token; `prunepath.py`: the stage and its `PathRouters` hand-off), the short distillation that
heals a pruned model (`heal.py`) and their lines in report.md's Structure section (`report.py`). The slicing of a
loaded model to a `ModelSpec` is the shared compress/structure.py.
"""
