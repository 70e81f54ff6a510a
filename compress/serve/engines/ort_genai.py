"""ONNX Runtime GenAI runner: greedy decoding of an `onnx` export directory (`genai_config.json` beside `model.onnx`:
the torch-traced graph with `kv_cache: true`, or the `builder: genai` directory) with `onnxruntime_genai`.

Each prompt (token ids) runs in a generator of its own, batch 1, with `min_length = max_length = len(prompt) + n_tokens`
so EOS cannot end it early (as `min_new_tokens` does in transformers: the EOS logits are masked until then) and every
prompt yields exactly `n_tokens`. Before each token the generator's logits for that position (`get_logits()`, read
before `generate_next_token()` applies the min-length mask, so they are the model's own) give the top-5
log-probabilities of `Decoded.top`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compress.serve.decoded import TOP_K, Decoded


def top_logprobs(logits: np.ndarray, k: int = TOP_K) -> dict[int, float]:
    """{token id: log-probability} of the k most likely tokens of one position's logits."""
    x = logits.astype(np.float64)
    logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
    ids = np.argsort(-logp, kind="stable")[:k]
    return {int(i): float(logp[i]) for i in ids}


def decode(export_dir: Path, prompts: list[list[int]], n_tokens: int) -> Decoded:
    import onnxruntime_genai as og

    if not (Path(export_dir) / "genai_config.json").exists():
        raise ValueError(f"{export_dir} has no genai_config.json: export onnx with `kv_cache: true` (builder torch) or "
                         "`builder: genai`")
    model = og.Model(str(export_dir))
    tokens, top = [], []
    for prompt in prompts:
        params = og.GeneratorParams(model)
        length = len(prompt) + n_tokens
        params.set_search_options(do_sample=False, num_beams=1, batch_size=1, max_length=length, min_length=length)
        generator = og.Generator(model, params)
        generator.append_tokens(np.asarray([prompt], dtype=np.int32))
        out, tops = [], []
        for _ in range(n_tokens):
            logits = np.asarray(generator.get_logits(), dtype=np.float32)
            tops.append(top_logprobs(logits.reshape(-1, logits.shape[-1])[-1]))
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
        tokens.append(out)
        top.append(tops)
        del generator
    return Decoded(tokens, top)
