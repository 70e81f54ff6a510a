"""The `finetune` stage: training a compressed model's own parts against the full-precision one.

This package owns router fine-tuning of quantized MoE models (`router.py`, GEMQ stage D; docs/moe.md): the
routers trained so the quantized experts are chosen as the full-precision model chooses, and its report section.
"""
