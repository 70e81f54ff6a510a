"""Run an exported `hf` checkpoint with compress's own kernels, without auto-round's loader.

`load_packed(directory, backend)` builds the model from its config.json (fp32), loads the dense
tensors (embeddings, norms, layers written dense), reads the packed layers back as QuantizedWeights
(`hf.read_quantized`, bit-exact) and puts a `QuantLinear` running `backend` (`kernels/backends.py`:
auto, cpu, cpu-a8, triton, reference) in place of each. The result computes what the in-memory
quantized model computed (up to the backend's float rounding), whereas auto-round's loader casts the
model to fp16 on CPU. Used by `compress eval --backend` and `compress generate`.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from compress.errors import BadInput

logger = logging.getLogger(__name__)

PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def is_packed(directory) -> bool:
    import json

    path = Path(directory) / "config.json"
    qc = json.loads(path.read_text()).get("quantization_config") if path.exists() else None
    return qc is not None and qc.get("quant_method") in ("auto-round", "gptq")  # compressed-tensors: transformers


def load_packed(directory, backend: str = "auto"):
    """(model in eval mode, {"backend": {name: count}, "quantized_layers": n}) for a packed checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from compress.export.hf import load_tensors, read_quantized
    from compress.kernels.backends import QuantLinear, quantize_model
    from compress.prune import routing as prunepath

    directory = Path(directory)
    tensors = load_tensors(directory)
    _, qweights = read_quantized(directory, tensors)
    if not qweights:
        raise BadInput(f"`{directory}` holds no packed layer; evaluate it without --backend")
    config = AutoConfig.from_pretrained(directory)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # build plain nn.Linear layers; ours replace the packed ones
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    prunepath.attach(model)  # routed FFNs (docs/prune.md): their routers are ordinary tensors of the file
    dense = {k: v for k, v in tensors.items() if not k.endswith(PACKED_SUFFIXES)}
    result = model.load_state_dict(dense, strict=False)
    _check_keys(model, result, qweights, directory)
    model.tie_weights()
    try:
        quantize_model(model, qweights, backend)
    except ValueError as e:
        raise BadInput(f"backend `{backend}`: {e}") from e
    prunepath.prepare_gather(model, qweights, backend)  # decode computes only a token's active experts
    used = Counter(m.backend.name for m in model.modules() if isinstance(m, QuantLinear))
    logger.info("%s: %d packed layers on backends %s", directory, len(qweights), dict(used))
    return model.eval(), {"backend": dict(used), "quantized_layers": len(qweights)}


def _check_keys(model, result, qweights, directory) -> None:
    """Every tensor in the files is used; the only weights missing are the packed layers' (and a tied
    output embedding)."""
    packed = {f"{n}.weight" for n in qweights}
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - packed - tied
    if result.unexpected_keys or missing:
        raise BadInput(f"`{directory}` does not match its config: unexpected tensors "
                       f"{sorted(result.unexpected_keys)[:5]}, missing {sorted(missing)[:5]}")
