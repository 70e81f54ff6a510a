"""The `allocate` stage: mixed precision over column chunks under an effective-bit budget (docs/allocate.md).

    configs.py   the methods' options          plan.py      the Plan hand-off (plan.json + energy)
    stage.py     checks, search, registration  terminal.py  the real-model loss (reward, sensitivity, refine)
    figures.py   heatmap and learning curves   compress/allocation.py, compress/ppo.py: the problem and PPO
"""

from compress.methods.allocate import stage  # noqa: F401  (registers the methods)
