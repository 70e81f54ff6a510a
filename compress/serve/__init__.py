"""Serving: which engines serve an export, and the check that they do.

This package owns the servability rules of the engines users deploy with (`rules.py`: vLLM CUDA and CPU, SGLang,
TGI, transformers, OpenVINO GenAI, ONNX Runtime GenAI, llama.cpp; printed by `--dry-run`, written into report.md and
the model card, enforced at plan time by `export.serve`), the engines' own environments (`envs.py`: vLLM lives in a
virtual environment that `compress serve-env vllm` builds and caches) and `compress serve-check` (`check.py` with one
runner per engine in `engines/`): load an export in an engine, greedy-decode fixed prompts and compare with
transformers on the same export (docs/serving.md).
"""
