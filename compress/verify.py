"""`compress verify` and the checks of exported artifacts: every file a run wrote against the sha256 its
manifest recorded."""

from __future__ import annotations

import json
from pathlib import Path

from compress.errors import BadInput
from compress.inputs import file_sha256
from compress.workspace import MANIFEST, NOT_ARTIFACTS, is_run


def run_root(directory: Path) -> tuple[Path, str] | None:
    """(the run's output directory, `directory` relative to it) if `directory` is a run's output or lies inside
    one; None for a directory outside any run (a download, a copy)."""
    directory = Path(directory).resolve()
    for root in (directory, *directory.parents):
        if (root / MANIFEST).is_file():
            return (root, directory.relative_to(root).as_posix() if directory != root else "") if is_run(root) \
                else None
    return None


def verify(root: Path, under: str = "") -> tuple[int, list[str]]:
    """(files checked, problems) of the files a run's manifest lists (below `under`, a relative directory):
    each must exist and match its sha256. Problems read `hf/model.safetensors: content changed`."""
    root = Path(root)
    try:
        files = json.loads((root / MANIFEST).read_text()).get("files")
    except (OSError, ValueError) as e:
        raise BadInput(f"`{root / MANIFEST}` is missing or unreadable ({e}); is `{root}` a run's output?") from None
    if not isinstance(files, dict):
        raise BadInput(f"`{root / MANIFEST}` lists no file checksums (a run that did not finish, or an older one)")
    prefix = f"{under.strip('/')}/" if under else ""
    listed = {rel: sha for rel, sha in files.items() if rel.startswith(prefix)}
    problems = []
    for rel, sha in listed.items():
        path = root / rel
        digest = file_sha256(path) if path.is_file() else None
        if digest is None:
            problems.append(f"{rel}: missing")
        elif digest != sha:
            problems.append(f"{rel}: content changed (sha256 {digest[:8]}, recorded {sha[:8]})")
    for p in sorted((root / under).rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in files and rel not in NOT_ARTIFACTS:
            problems.append(f"{rel}: not written by the run")
    return len(listed), problems


def verify_artifact(directory: Path) -> None:
    """If `directory` is a run's output or a directory inside one, check its files against the run's manifest
    (BadInput naming each problem); a directory outside any run (a download, a copy) is left alone."""
    found = run_root(directory) if Path(directory).is_dir() else None
    if found is None:
        return
    root, under = found
    _, problems = verify(root, under)
    if problems:
        raise BadInput(f"`{Path(directory).resolve()}` does not match the checksums in `{root / MANIFEST}` (corrupt "
                       f"or modified): {'; '.join(problems[:5])}")
