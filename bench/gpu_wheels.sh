#!/bin/bash
# The wheels bench/gpu_check.py --quickstart needs on the GPU machine (Python 3.12, x86-64; its image has torch,
# accelerate, safetensors, typer, rich, tqdm, psutil, scipy, sentencepiece, but not pydantic, transformers>=5.20,
# auto-round or gguf), downloaded here into DIR (default .whl/, git-ignored) to travel with the tree:
#   bash bench/gpu_wheels.sh && echo /.whl/ >> .git/info/exclude   # then the device run carries .whl
#   python -m bench.gpu_check --wheel-dir .whl --quickstart ../models/stories-llama-1m --json $OUT/gpu.json
set -euo pipefail
dir=${1:-.whl}; mkdir -p "$dir"
# the versions this machine's environment runs (the ones its tests passed with)
for name in pydantic pydantic-core transformers auto-round gguf tokenizers huggingface-hub annotated-types \
            typing-inspection; do
  spec=$(python -c "import importlib.metadata as m, sys; print(sys.argv[1] + '==' + m.version(sys.argv[1]))" "$name")
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$dir" "$spec"
done
du -sh "$dir"
