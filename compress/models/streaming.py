"""Stream blocks from a checkpoint's safetensors shards (models larger than memory).

The model is built on the `meta` device (accelerate's `init_empty_weights`); embeddings, final
norm and LM head are read at once; each block's tensors are read only when the driver reaches
that block and dropped back to `meta` after it, so only one block is resident at a time.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open

from compress.errors import BadInput
from compress.models.adapters import ARCHS, ModelAdapter
from compress.models.loading import (
    DTYPES,
    load_config,
    quiet_transformers,
    resolve_source,
)


class WeightSource:
    """Tensor name -> shard file of a local safetensors checkpoint; reads one tensor at a time."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: self.dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (self.dir / "model.safetensors").exists():
            with safe_open(str(self.dir / "model.safetensors"), "pt") as f:
                self.where = {k: self.dir / "model.safetensors" for k in f.keys()}
        else:
            raise BadInput(f"streaming needs a safetensors checkpoint; `{self.dir}` has none")

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), "pt") as f:
            return f.get_tensor(name)

    def with_prefix(self, prefix: str) -> list[str]:
        return [n for n in self.where if n.startswith(prefix)]


def load_streaming(path: str, dtype: str = "float32", head_in_use: bool = True):
    """(model with meta blocks, tokenizer, WeightSource). Only non-block tensors are read now.

    The input embeddings and an LM head that no stage computes with (`head_in_use` False: no final block tuned
    through it, no `lm_head` quantization) stay in the checkpoint's own dtype (bf16 for most checkpoints: half of
    fp32; Llama-3-8B's untied embeddings and head are 4.2 GB at fp32, docs/scale.md); the embeddings' output is cast
    to `dtype` (a lookup: exact), so the blocks see what they would see from an fp32 copy. A head tied to the
    embeddings follows the head's rule."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    config = load_config(path)
    src, gguf = resolve_source(path)
    if gguf or not Path(src).is_dir():
        raise BadInput("model.stream needs a local directory with safetensors shards (not a GGUF file or Hub id)")
    if ARCHS[config.model_type].experts:
        raise BadInput(f"model.stream does not support MoE models (`{config.model_type}`) yet; set model.stream: false")
    cls = AutoModelForCausalLM if ARCHS[config.model_type].kind == "causal" else AutoModel
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config, dtype=DTYPES[dtype])
    keep_large_allocations_unmapped()
    source = WeightSource(src)
    missing = [k for k in model.state_dict() if k not in source.where and "lm_head" not in k]
    if missing:
        raise BadInput(f"`{path}`: checkpoint tensor names do not match the model (missing {missing[:3]})")
    adapter = ModelAdapter(model)
    blocks_path = adapter.blocks_path + "."
    tied = getattr(config, "tie_word_embeddings", False)
    stored = _stored_dtype_tensors(model, adapter, tied and head_in_use, head_in_use)
    for name in source.names:
        if not name.startswith(blocks_path):
            value = source.get(name)
            value = value if name in stored else value.to(DTYPES[dtype])
            set_module_tensor_to_device(model, name, "cpu", value=value, dtype=value.dtype)  # (else: the meta dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    emb = adapter.embeddings()
    if emb is not None and emb.weight.dtype != DTYPES[dtype]:
        emb.register_forward_hook(lambda _m, _args, out: out.to(DTYPES[dtype]))
    model.eval()
    return model, AutoTokenizer.from_pretrained(src), source


def _stored_dtype_tensors(model, adapter, embeddings_as_head: bool, head_in_use: bool) -> set[str]:
    """Names of the non-block tensors kept in the checkpoint's dtype (`load_streaming`): the embeddings unless
    they are a head some stage computes with, the head unless a stage computes with it."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    out = set()
    emb = adapter.embeddings()
    if emb is not None and not embeddings_as_head:
        out.add(names[id(emb.weight)])
    head_name, head = adapter.lm_head()
    if head is not None and not head_in_use:
        out.add(f"{head_name}.weight")
    return out


class BlockStreamer:
    """`materialize(i)` reads block i from the shards; `release(i)` returns it to `meta`."""

    def __init__(self, model: torch.nn.Module, adapter: ModelAdapter, source: WeightSource, dtype: str):
        self.model, self.adapter, self.source, self.dtype = model, adapter, source, DTYPES[dtype]

    def materialize(self, i: int) -> None:
        prefix = self.adapter.block_name(i) + "."
        for name in self.source.with_prefix(prefix):
            set_module_tensor_to_device(self.model, name, "cpu", value=self.source.get(name).to(self.dtype))

    def release(self, i: int) -> None:
        self.adapter.blocks[i].to("meta")
        gc.collect()
        _trim()


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_large_allocations_unmapped() -> None:
    """glibc raises its mmap threshold after large blocks are freed (up to 32 MB), so later block weights come
    from the heap and the freed ones stay in RSS: streaming 28 blocks of Qwen3-0.6B's shapes grew RSS by about
    one block per block. A fixed 128 KiB threshold (M_MMAP_THRESHOLD) returns every freed weight to the OS
    (docs/scale.md)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD


def _trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
