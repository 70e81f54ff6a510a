"""The `allocate` stage: bit widths under an effective-bit budget (docs/allocate.md, docs/moe.md).

    configs.py   the methods' options          plan.py      the Plan hand-off (plan.json + energy)
    stage.py     checks, search, registration  terminal.py  the real-model loss (reward, sensitivity, refine)
    figures.py   heatmap and learning curves   moe.py       expert-level widths of MoE models (GEMQ)
    compress/allocation.py, compress/ppo.py, compress/expert_allocation.py, compress/moe.py: problems, solvers
"""

from compress.methods.allocate import moe, stage  # noqa: F401  (register the methods)
