"""The `allocate` stage: bit widths under an effective-bit budget (docs/allocate.md, docs/moe.md).

This package owns mixed precision from the problem to the plan: `problem.py` (column chunks, options and their
solvers: greedy, lagrangian, uniform, refine), `ppo.py` (the RL controller), `experts.py` (the expert-level program
of MoE models), `terminal.py` (the real-model loss: reward, sensitivity, refine), `configs.py` (the methods'
options), `stage.py` (the chunk methods' checks, search and registration), `moe.py` (`allocate: moe`), `plan.py`
(the `Plan` hand-off to the next quantize stage) and `figures.py` (heatmap, learning curves). The MoE statistics
it ranks experts by live with the model code (compress/models/moe.py).
"""
