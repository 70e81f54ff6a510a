"""Safe file writes: atomic files, staged export directories, JSON that every parser reads."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path


def strict_json(obj) -> str:
    """JSON that every parser reads: NaN and infinities become null (`json.dumps` writes a bare `NaN`)."""
    return json.dumps(_finite(obj), indent=2, default=str, allow_nan=False) + "\n"


def non_finite(obj, where: str = "") -> list[str]:
    """Dotted paths of the NaN / infinite floats in a JSON-like object."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [where]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in non_finite(v, f"{where}.{k}" if where else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in non_finite(v, f"{where}[{i}]")]
    return []


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


STAGING = re.compile(r"^\..+\.(tmp|old)$")  # hidden staging names: `.hf.1a2b3c4d.tmp`, `.model.onnx.x7k.tmp`


@contextmanager
def staged_directory(out_dir: Path, *, marker: str):
    """Yield an empty hidden sibling of `out_dir` to write into; on success it replaces `out_dir` whole, so a
    kill leaves the previous export or none, never a half-written one. `out_dir` must be absent, empty, or
    an earlier export (it holds `marker`)."""
    out_dir = Path(out_dir)
    if out_dir.is_file() or (out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / marker).exists()):
        raise FileExistsError(f"{out_dir} exists and is not an earlier export; choose an empty directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = out_dir.with_name(f".{out_dir.name}.{tag}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        old = out_dir.with_name(f".{out_dir.name}.{tag}.old")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
