"""OpenVINO GenAI runner: greedy decoding of an `openvino` export directory with `openvino_genai.LLMPipeline` on CPU.

The directory is the stateful IR an `openvino` export writes with `kv_cache: true` (`stateful: true`, the default):
`openvino_model.xml` with `input_ids`, `attention_mask`, `position_ids`, `beam_idx` and the KV cache as state, beside
the tokenizer IRs and `generation_config.json`. The pipeline is compiled with `EXACT_CPU_CONFIG` (f32 inference, no
dynamic quantization, an f32 KV cache), the numbers the export is validated with. Each prompt (token ids, as an
`ov.Tensor`) is generated on its own with `min_new_tokens = max_new_tokens = n_tokens`, so EOS is masked until then
(as in transformers) and every prompt yields exactly `n_tokens`.

`Decoded.top` stays empty: LLMPipeline gives no per-step logits (`EncodedResults.scores` is one cumulative score per
sequence, and `GenerationConfig.logprobs` returns at most the chosen token's log-probability, not a top-5).
"""

from __future__ import annotations

from pathlib import Path

from compress.serve.decoded import Decoded


def decode(export_dir: Path, prompts: list[list[int]], n_tokens: int) -> Decoded:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    from compress.export.openvino import EXACT_CPU_CONFIG

    ir = Path(export_dir) / "openvino_model.xml"
    inputs = {name for port in ov.Core().read_model(str(ir)).inputs for name in port.get_names()}
    if "beam_idx" not in inputs:
        raise ValueError(f"{ir} is not a stateful IR (no beam_idx input): LLMPipeline runs the `openvino` export "
                         "written with `kv_cache: true` (and `stateful: true`, the default)")
    pipe = og.LLMPipeline(str(export_dir), "CPU", **EXACT_CPU_CONFIG)
    config = pipe.get_generation_config()
    config.do_sample, config.num_beams = False, 1
    config.max_new_tokens = config.min_new_tokens = n_tokens
    tokens = []
    for prompt in prompts:
        result = pipe.generate(ov.Tensor(np.asarray([prompt], dtype=np.int64)), config)
        tokens.append([int(t) for t in result.tokens[0]])
    return Decoded(tokens)
