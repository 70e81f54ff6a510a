"""bench.rtn_output_error: per-layer weight and output errors of plain and optimised RTN."""

from __future__ import annotations

import torch
from tiny import tiny_causal

from bench.rtn_output_error import markdown, output_errors


def test_output_errors_per_layer_and_the_searchs_guarantee():
    model = tiny_causal("llama")
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    errors = output_errors(model, tokens, 3, 32, False)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert set(errors) == linears
    for e in errors.values():
        assert e["opt"][0] <= e["rtn"][0] * (1 + 1e-6)  # the search never raises a group's weight error
        assert e["rtn"][1] > 0 and e["opt"][1] > 0
    md = markdown(errors, {"model": "m", "bits": 3, "group": 32, "sym": False, "command": "c", "date": "d",
                           "windows": 4, "seqlen": 16})
    assert "| rtn |" in md and "| opt |" in md and f"of {len(linears)}" in md
