"""The `select` stage: ProbScale, the layer subset that keeps the most task-relevant layers under a parameter
budget (docs/select.md).

This package owns the probes, relevance, knapsack, baselines, budget sweep and heal (`probscale.py`), the stage
and its checks (`stage.py`) and its report sections (`report.py`: the selection, its Structure line).
"""
