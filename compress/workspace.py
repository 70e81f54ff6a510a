"""The output directory of a run: atomic writes, the manifest, per-block checkpoints.

Every file is written to a temporary name in the same directory, then renamed, so an interrupted
run never leaves a half-written file. `manifest.json` records the resolved recipe and its hash,
package versions, and for each stage its status, inputs hash, seconds and peak RSS.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from compress import locking, rss
from compress.errors import BadInput, RunFailure
from compress.files import STAGING, atomic_write_bytes, strict_json
from compress.inputs import file_sha256
from compress.qweight import QuantizedWeight, qweights_to_tensors, tensors_to_qweights

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = {"name": "compress-workspace", "version": 1}


LOCK = ".compress.lock"
# names the run itself writes at the top of its directory; an export directory may not take one
RESERVED = frozenset({MANIFEST, LOCK, "stages", "figures", "run.log", "report.json", "report.md"})


NOT_ARTIFACTS = (MANIFEST, LOCK, "run.log", "SHA256SUMS", "summary.md")  # what `manifest.files` does not list
# (SHA256SUMS and summary.md: written from the manifest after a run in CI mode, compress/publish/ci.py)


def is_run(root: Path) -> bool:
    """Whether ROOT/manifest.json is a compress workspace's (a run marks its output with it at once)."""
    try:
        data = json.loads((Path(root) / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("format"), dict) and \
        data["format"].get("name") == FORMAT["name"]


class Workspace:
    """The output directory of one run, held under an exclusive lock from construction to `close()`.

    A run never destroys what it did not create:
    - the output may not be, or contain, any of `inputs` ((label, path) pairs: the model, data files,
      the recipe);
    - `force` clears only a directory that a previous run marked as its own (its `manifest.json`, which
      is written as soon as the workspace exists) and `resume` continues only such a directory;
    - a second run on the same directory fails at once, naming the holder's pid, and touches nothing.
    """

    def __init__(self, root: Path | str, *, resume: bool = False, force: bool = False,
                 inputs: list[tuple[str, Path]] = ()):
        self.root = Path(root)
        self._check_not_an_input(inputs)
        if self.root.exists() and not self.root.is_dir():
            raise BadInput(f"output `{self.root}` is a file, not a directory; choose a directory with --output")
        self._check_writable()
        self.created = not self.root.exists()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # e.g. under /proc or /sys, where even root cannot create directories
            raise BadInput(f"cannot create output directory `{self.root}`: {e.strerror or e}; "
                           "choose a writable path with --output") from e
        self._lock_fd = None
        self._known: set[str] = set()  # files this process wrote or verified (their recorded sha256 holds)
        try:
            self._lock()
            self._open(resume, force)
        except BaseException:
            self.close(remove_root=self.created)
            raise

    def _open(self, resume: bool, force: bool) -> None:
        existing = [p for p in self.root.iterdir() if p.name != LOCK]
        ours = is_run(self.root)
        if existing and not (resume or force):
            raise BadInput(f"output directory `{self.root}` is not empty; pass --resume to continue the run there "
                           "or --force to start over")
        if existing and not ours:
            raise BadInput(f"output directory `{self.root}` holds files that no compress run wrote (it has no "
                           f"compress {MANIFEST}); --resume and --force only take a previous run's directory: choose another "
                           "--output, or empty this one yourself")
        self.manifest = self._read_manifest() if existing else {}
        if existing and force and not resume:
            self._clear()
            self.manifest = {}
        self._remove_staging()
        self.fresh = not existing or (force and not resume)  # nothing here but what this run writes
        self.manifest.setdefault("format", FORMAT)
        self.manifest.setdefault("stages", {})
        self.save_manifest()  # marks the directory as a run's own from the start

    def _check_not_an_input(self, inputs) -> None:
        out = self.root.expanduser().resolve()
        for label, path in inputs:
            p = Path(path).expanduser().resolve()
            if p == out or out in p.parents:
                what = "is" if p == out else "contains"
                raise BadInput(f"output directory `{self.root}` {what} the {label} `{path}`; a run would overwrite "
                               "its own input: choose another --output")

    def _check_writable(self) -> None:
        probe = self.root if self.root.exists() else next((p for p in self.root.parents if p.exists()), Path("."))
        if not os.access(probe, os.W_OK):
            raise BadInput(f"output directory `{self.root}` is not writable (read-only path?)")

    # -- the lock -------------------------------------------------------------------------------
    def _lock(self) -> None:
        """An exclusive flock on OUTPUT/.compress.lock holding our pid; released by the kernel if we die."""
        try:
            self._lock_fd = locking.acquire(self.root / LOCK)
        except locking.Busy as e:
            raise BadInput(f"output directory `{self.root}` is in use by another compress run "
                           f"({f'pid {e.pid}' if e.pid else 'another process'}); wait for it to finish or choose "
                           "another --output") from None

    def close(self, *, remove_root: bool = False) -> None:
        """Release the lock (the lock file is removed first, while still held). With `remove_root`, also
        remove the output directory if nothing else is left in it."""
        if self._lock_fd is not None:
            locking.release(self._lock_fd, self.root / LOCK)
            self._lock_fd = None
        if remove_root:
            try:
                self.root.rmdir()
            except OSError:
                pass

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def finished_stages(self) -> list[str]:
        return [k for k, st in self.manifest.get("stages", {}).items() if st.get("status") == "done"]

    def discard(self) -> None:
        """Remove what this run wrote into a directory that held nothing else (see `fresh`), then release
        it. Best effort: a file that cannot be removed is logged, never raised over the run's own error."""
        if not self.fresh:
            self.close()
            return
        for child in self.root.iterdir():
            if child.name == LOCK:
                continue
            try:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            except OSError as e:
                log.warning("could not remove `%s` while cleaning up: %s", child, e.strerror or e)
        self.close(remove_root=self.created)

    def _remove_staging(self) -> None:
        """Drop what a killed run left half-written: hidden `*.tmp` / `*.old` staging files and directories at
        the top and in each stage directory (every finished file was renamed into place)."""
        dirs = [self.root, *[d for d in (self.root / "stages").glob("*") if d.is_dir()]]
        for d in dirs:
            for p in d.iterdir():
                if STAGING.match(p.name):
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()

    def _clear(self) -> None:
        for child in self.root.iterdir():
            if child.name == LOCK:
                continue
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()

    def _read_manifest(self) -> dict:
        path = self.root / MANIFEST
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadInput(f"`{path}` is unreadable ({e}); use --force to start over") from None
        if not isinstance(data, dict) or data.get("format", {}).get("version") != FORMAT["version"]:
            raise BadInput(f"`{path}` was written by an unknown workspace version; use --force to start over")
        return data

    def path(self, rel: str) -> Path:
        """OUTPUT/rel; refused if it leads outside the output directory (`..`, an absolute path, a symlink)."""
        path = self.root / rel
        if not path.resolve().is_relative_to(self.root.resolve()):
            raise BadInput(f"`{rel}` leads outside the output directory `{self.root}` (an absolute path, `..` or a "
                           "symlink); a run writes only inside its output directory")
        return path

    def write_bytes(self, rel: str, data: bytes) -> Path:
        """Write OUTPUT/rel atomically and record its sha256; an intact file with the same bytes is left alone."""
        digest = hashlib.sha256(data).hexdigest()
        if rel != MANIFEST and self.manifest.get("files", {}).get(rel) == digest and self.verified(rel):
            return self.path(rel)
        atomic_write_bytes(self.path(rel), data)
        if rel != MANIFEST:
            self._record(rel, digest)
        return self.path(rel)

    def _record(self, rel: str, digest: str) -> None:
        self.manifest.setdefault("files", {})[rel] = digest
        self._known.add(rel)

    # -- checksums ------------------------------------------------------------------------------
    def verified(self, rel: str) -> Path | None:
        """OUTPUT/rel if it exists and matches the sha256 recorded when it was written; a file that does not
        (flipped bytes, a write the manifest never saw) is logged, removed and reported as absent, so the
        caller recomputes it."""
        path = self.path(rel)
        if not path.is_file():
            return None
        recorded = self.manifest.get("files", {}).get(rel)
        if recorded is not None and (rel in self._known or file_sha256(path) == recorded):
            self._known.add(rel)
            return path
        why = "does not match the sha256 recorded when it was written" if recorded else "has no recorded sha256"
        log.warning("`%s` %s (corrupt or unfinished): recomputing it", rel, why)
        path.unlink()
        self.manifest.get("files", {}).pop(rel, None)
        return None

    def record_files(self) -> None:
        """Complete manifest["files"] with the sha256 of every file in OUTPUT that this process did not write or
        verify itself (what exporters wrote); the manifest, run.log and the lock are not artifacts.
        `compress verify` checks them."""
        files = self.manifest.setdefault("files", {})
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and rel not in self._known and rel not in NOT_ARTIFACTS:
                files[rel] = file_sha256(p)
        self.manifest["files"] = {k: files[k] for k in sorted(files) if self.path(k).is_file()}

    def write_text(self, rel: str, text: str) -> Path:
        return self.write_bytes(rel, text.encode())

    def write_json(self, rel: str, obj) -> Path:
        return self.write_text(rel, strict_json(obj))

    def save_manifest(self) -> None:
        self.write_json(MANIFEST, self.manifest)

    # -- stages ---------------------------------------------------------------------------------
    def stage_done(self, key: str, inputs_hash: str) -> bool:
        st = self.manifest["stages"].get(key)
        return bool(st) and st.get("status") == "done" and st.get("inputs_hash") == inputs_hash

    def stage_begin(self, key: str, name: str, method: str, inputs_hash: str) -> None:
        st = self.manifest["stages"].get(key, {})
        if st.get("inputs_hash") != inputs_hash:  # different inputs: earlier checkpoints are stale
            if st:
                log.info("stage %s: recomputed (its inputs or its config changed since the earlier run)", key)
            shutil.rmtree(self.path(f"stages/{key}"), ignore_errors=True)
            files = self.manifest.get("files", {})
            for rel in [r for r in files if r.startswith(f"stages/{key}/")]:
                del files[rel]
        self.manifest["stages"][key] = {"name": name, "method": method, "status": "running",
                                       "inputs_hash": inputs_hash, "started": time.time()}
        self.save_manifest()
        rss.new_stage()  # the stage's peak_rss_mb is its own

    def stage_end(self, key: str, seconds: float, metrics: dict | None = None) -> None:
        st = self.manifest["stages"][key]
        st.update(status="done", seconds=round(seconds, 3), **rss.stage_marks(), metrics=metrics or {})
        self.save_manifest()

    # -- per-block checkpoints -----------------------------------------------------------------
    @staticmethod
    def _block_rel(key: str, i: int) -> str:
        return f"stages/{key}/block_{i:04d}.safetensors"

    def save_block(self, key: str, i: int, qweights: dict[str, QuantizedWeight]) -> None:
        """Write block i's checkpoint to a temporary name, record its sha256 in the manifest, then rename it into
        place; a kill in between leaves a recorded hash without its file (recomputed), never the reverse."""
        tensors, meta = qweights_to_tensors(qweights)
        rel = self._block_rel(key, i)
        path = self.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata={"qweights": json.dumps(meta)})
        self._record(rel, file_sha256(tmp))
        self.save_manifest()  # before the rename: a checkpoint in place always has its sha256 recorded
        os.replace(tmp, path)

    def load_block(self, key: str, i: int, *, required: bool = False) -> dict[str, QuantizedWeight] | None:
        """Block i's QuantizedWeights if its checkpoint exists and is intact, else None (recompute it); with
        `required`, a missing or corrupt checkpoint is an error (a finished stage read by an exporter)."""
        path = self.verified(self._block_rel(key, i))
        if path is None:
            if required:
                raise RunFailure(f"the checkpoint of block {i} of stage {key} is missing or corrupt; rerun with "
                                 "--resume to recompute it")
            return None
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["qweights"])
        return tensors_to_qweights(load_file(str(path)), meta)
