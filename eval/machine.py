"""The machine a speed or quality benchmark ran on, as its JSON records it and its markdown names it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine_text(m: dict | None) -> str:
    """' Machine: 2 CPUs, <model> (<simd flags>).' for a benchmark's markdown, '' for results without it."""
    return f" Machine: {m['nproc']} CPUs, {m['cpu']} ({', '.join(m.get('simd', []))})." if m else ""


def machine() -> dict:
    cpu, flags = platform.processor() or "?", []
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
        have = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
        flags = [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "amx_int8") if f in have]
    except OSError:
        pass
    import torch

    return {"nproc": os.cpu_count(), "cpu": cpu, "simd": flags, "torch_threads": torch.get_num_threads(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}
