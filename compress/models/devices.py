"""Where the block-wise work runs: the recipe's `device` / `devices` and `--device` (docs/accelerators.md).

The model stays on the CPU (or on disk, `model.stream`); the driver moves one block at a time, with the
calibration activations, to the device for its statistics, tuning and propagation, and back. `devices`
(several) splits the calibration batches of a block across them for its Hessians, which are summed on the
first device (the all-reduce of data parallelism, in one process).

Nothing here imports a device library: torch answers what it sees (`torch.cuda`, `torch.xpu`, `torch.backends.mps`).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from compress.errors import BadInput

PATTERN = r"auto|cpu|cuda(:\d+)?|xpu(:\d+)?|mps"
CHOICES = "auto, cpu, cuda, cuda:N, xpu, xpu:N or mps"


def _count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    if kind == "mps":
        return int(torch.backends.mps.is_available())
    return 1  # cpu


def visible() -> str:
    """What torch sees, for an error message: 'torch 2.13.0+cpu sees no accelerator (built without CUDA)'."""
    seen = [f"{n} {k}" for k in ("cuda", "xpu", "mps") if (n := _count(k))]
    if seen:
        names = [torch.cuda.get_device_name(i) for i in range(_count("cuda"))] if _count("cuda") else []
        return f"torch {torch.__version__} sees " + ", ".join(seen) + (f" ({', '.join(names)})" if names else "")
    built = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no device visible"
    return f"torch {torch.__version__} sees no accelerator ({built})"


def resolve(spec: str) -> torch.device:
    """The device a recipe's `device` names, refused (BadInput) when torch does not see it. `auto`: the first
    CUDA device, else the first XPU, else the CPU."""
    spec = str(spec).strip().lower()
    if not re.fullmatch(PATTERN, spec):
        raise BadInput(f"device `{spec}`: choose {CHOICES}")
    if spec == "auto":
        for kind in ("cuda", "xpu"):
            if _count(kind):
                return torch.device(kind, 0)
        return torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cpu":
        return dev
    n = _count(dev.type)
    index = dev.index or 0
    if index >= n:
        raise BadInput(f"device `{spec}` is asked for, but {visible()}; use `device: cpu` (or `auto`, which takes an "
                       "accelerator only when one is there)")
    return torch.device(dev.type, index)


def resolve_all(device: str, devices: list[str] | str | None) -> list[torch.device]:
    """Every device a run uses, the first being where the block's own work runs: `devices: all` is every device of
    `device`'s kind (at least the one `device` resolves to), a list is resolved name by name."""
    first = resolve(device)
    if devices is None:
        return [first]
    if devices == "all":
        return [first] if first.type == "cpu" else [torch.device(first.type, i) for i in range(_count(first.type))]
    out = [resolve(d) for d in devices]
    if len(set(out)) != len(out) and any(d.type != "cpu" for d in out):
        raise BadInput(f"`devices` names a device twice: {', '.join(map(str, out))}")
    if str(device).strip().lower() != "auto" and out[0] != first:
        raise BadInput(f"`device: {device}` is not the first of `devices` ({', '.join(map(str, out))}): the block's "
                       "own work runs on the first; list it first, or leave `device` at auto")
    return out


def move(obj, device: torch.device):
    """`obj` with every tensor in it (through tuples, lists and dicts) on `device`; the object itself when nothing
    moves (the CPU run is untouched)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, tuple):
        return tuple(move(o, device) for o in obj)
    if isinstance(obj, list):
        return [move(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a QuantizedWeight, its llama.cpp grid
        moved = {f.name: move(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        if all(moved[k] is getattr(obj, k) for k in moved):
            return obj
        return dataclasses.replace(obj, **moved)
    return obj


DETERMINISM = ("torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG=:4096:8: an "
               "operation without a deterministic kernel warns in run.log (its results may then vary between runs)")


def deterministic(device: torch.device) -> None:
    """Deterministic kernels where torch has them on `device`; the others warn (named in run.log)."""
    import logging
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS first starts in this process
    torch.use_deterministic_algorithms(True, warn_only=True)
    logging.captureWarnings(True)


def name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    return device.type


def _memory(device: torch.device):
    return getattr(torch, device.type, None) if device.type in ("cuda", "xpu") else None


def reset_peak(device: torch.device) -> None:
    if (mem := _memory(device)) is not None:
        mem.reset_peak_memory_stats(device)


def peak_mb(device: torch.device) -> float | None:
    """The device memory allocated at most since `reset_peak`, in MB (None on the CPU: the stage's RSS says it)."""
    if (mem := _memory(device)) is None:
        return None
    return round(mem.max_memory_allocated(device) / 2**20, 1)


def out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
