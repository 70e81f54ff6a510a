"""The output directory of a run: atomic writes, the manifest, per-block checkpoints.

Every file is written to a temporary name in the same directory, then renamed, so an interrupted
run never leaves a half-written file. `manifest.json` records the resolved recipe and its hash,
package versions, and for each stage its status, inputs hash, seconds and peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from compress.errors import BadInput
from compress.qweight import QuantizedWeight

MANIFEST = "manifest.json"
FORMAT = {"name": "compress-workspace", "version": 1}


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


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


class Workspace:
    def __init__(self, root: Path | str, *, resume: bool = False, force: bool = False):
        self.root = Path(root)
        self._check_writable()
        existing = self.root.exists() and any(self.root.iterdir())
        if existing and not (resume or force):
            raise BadInput(
                f"output directory `{self.root}` is not empty; pass --resume to continue the run there "
                "or --force to start over"
            )
        if existing and force and not resume:
            self._clear()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # e.g. under /proc or /sys, where even root cannot create directories
            raise BadInput(f"cannot create output directory `{self.root}`: {e.strerror or e}; "
                           "choose a writable path with --output") from e
        self.manifest = self._read_manifest() if resume else {}
        self.manifest.setdefault("format", FORMAT)
        self.manifest.setdefault("stages", {})

    def _check_writable(self) -> None:
        probe = self.root if self.root.exists() else next((p for p in self.root.parents if p.exists()), Path("."))
        if not os.access(probe, os.W_OK):
            raise BadInput(f"output directory `{self.root}` is not writable (read-only path?)")

    def _clear(self) -> None:
        for child in self.root.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()

    def _read_manifest(self) -> dict:
        path = self.root / MANIFEST
        if not path.exists():
            return {}
        data = json.loads(path.read_text())
        if data.get("format", {}).get("version") != FORMAT["version"]:
            raise BadInput(f"`{path}` was written by an unknown workspace version; use --force to start over")
        return data

    def path(self, rel: str) -> Path:
        return self.root / rel

    def write_bytes(self, rel: str, data: bytes) -> Path:
        atomic_write_bytes(self.path(rel), data)
        return self.path(rel)

    def write_text(self, rel: str, text: str) -> Path:
        return self.write_bytes(rel, text.encode())

    def write_json(self, rel: str, obj) -> Path:
        return self.write_text(rel, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")

    def save_manifest(self) -> None:
        self.write_json(MANIFEST, self.manifest)

    # -- stages ---------------------------------------------------------------------------------
    def stage_done(self, key: str, inputs_hash: str) -> bool:
        st = self.manifest["stages"].get(key)
        return bool(st) and st.get("status") == "done" and st.get("inputs_hash") == inputs_hash

    def stage_begin(self, key: str, name: str, method: str, inputs_hash: str) -> None:
        st = self.manifest["stages"].get(key, {})
        if st.get("inputs_hash") != inputs_hash:  # different inputs: earlier checkpoints are stale
            shutil.rmtree(self.path(f"stages/{key}"), ignore_errors=True)
        self.manifest["stages"][key] = {"name": name, "method": method, "status": "running",
                                       "inputs_hash": inputs_hash, "started": time.time()}
        self.save_manifest()

    def stage_end(self, key: str, seconds: float, metrics: dict | None = None) -> None:
        st = self.manifest["stages"][key]
        st.update(status="done", seconds=round(seconds, 3), peak_rss_mb=round(peak_rss_mb(), 1), metrics=metrics or {})
        self.save_manifest()

    # -- per-block checkpoints -----------------------------------------------------------------
    def _block_path(self, key: str, i: int) -> Path:
        return self.path(f"stages/{key}/block_{i:04d}.safetensors")

    def save_block(self, key: str, i: int, qweights: dict[str, QuantizedWeight]) -> None:
        tensors, meta = qweights_to_tensors(qweights)
        path = self._block_path(key, i)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata={"qweights": json.dumps(meta)})
        os.replace(tmp, path)

    def load_block(self, key: str, i: int) -> dict[str, QuantizedWeight] | None:
        path = self._block_path(key, i)
        if not path.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["qweights"])
        return tensors_to_qweights(load_file(str(path)), meta)


def qweights_to_tensors(qweights: dict[str, QuantizedWeight]) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = {}, {}
    for name, qw in qweights.items():
        tensors[f"{name}.codes"] = qw.codes.contiguous()
        tensors[f"{name}.scales"] = qw.scales.contiguous()
        tensors[f"{name}.zeros"] = qw.zeros.contiguous()
        meta[name] = {"bits": qw.bits, "group_size": qw.group_size, "sym": qw.sym}
        if qw.mixed:
            meta[name].update(chunk_size=qw.chunk_size, chunk_bits=list(qw.chunk_bits), map_bits=qw.map_bits)
            if qw.kept is not None:
                tensors[f"{name}.kept"] = qw.kept.contiguous()
    return tensors, meta


def tensors_to_qweights(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, QuantizedWeight]:
    out = {}
    for name, m in meta.items():
        m = dict(m)
        if "chunk_bits" in m:
            m["chunk_bits"] = tuple(m["chunk_bits"])
        out[name] = QuantizedWeight(codes=tensors[f"{name}.codes"], scales=tensors[f"{name}.scales"],
                                    zeros=tensors[f"{name}.zeros"], kept=tensors.get(f"{name}.kept"), **m)
    return out
