"""Serving: which engines serve an export, and the check that they do.

This package owns the servability rules of the engines users deploy with (`rules.py`: vLLM CUDA and CPU, SGLang,
TGI, transformers, OpenVINO GenAI, ONNX Runtime GenAI, llama.cpp; printed by `--dry-run`, written into report.md and
the model card, enforced at plan time by `export.serve`), the engines' own environments (`envs.py`: vLLM and
llama.cpp live in virtual environments that `compress serve-env NAME` builds and caches) and `compress serve-check`
(`check.py` with one runner per engine in `engines/`): load an export in an engine, greedy-decode fixed prompts and
compare with transformers on the same export (a GGUF file: with compress's own reading of it; docs/serving.md).
`engines/llamacpp.py` also gives compress llama.cpp's quantize, importance matrix, perplexity windows and
convert_hf_to_gguf.py.
"""
