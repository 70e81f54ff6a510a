"""Upstream reproducer (auto-round 0.16.1, transformers 5.25, CPU, no `auto-round-lib`): a checkpoint auto-round
itself writes in its `auto_round:auto_awq` format does not load in plain transformers. The loader selects the
`auto_round:fake` backend ("Better backend is found ... pip install auto-round-lib"), whose FakeActQuantLinear
expects dequantized weights and activation quantization: the forward pass fails (`TypeError: unsupported operand
type(s) for +: 'NoneType' and 'str'` in auto_round/data_type/utils.py pad_bits). compress therefore writes
asymmetric checkpoints for plain transformers with `packing: auto_round` (docs/serving.md), and its servability
table marks `transformers` as needing auto-round-lib for `auto_round:auto_awq`.

    python docs/repro/auto_round_awq_cpu.py MODEL_DIR   # e.g. ../shared/data/models/ref-llama-7m
"""

import sys
import tempfile
from pathlib import Path

import torch
from auto_round import AutoRound
from transformers import AutoModelForCausalLM, AutoTokenizer

src = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(src)
with tempfile.TemporaryDirectory() as out:
    AutoRound(model, tok, bits=4, group_size=32, sym=False, iters=0).quantize_and_save(out, format="auto_round:auto_awq")
    saved = next(p.parent for p in Path(out).rglob("config.json"))  # auto-round writes a subdirectory
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    try:
        loaded(torch.tensor([[1, 2, 3]]))
    except Exception as e:  # auto-round 0.16.1 without auto-round-lib
        print(f"REPRODUCED: {type(e).__name__}: {e}")
        sys.exit(1)
    print("loads and runs: not reproduced (auto-round-lib installed, or fixed upstream)")
