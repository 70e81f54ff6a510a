"""A run's inputs: read and checked at plan time, and identified by content for `--resume`.

- `local_paths(loaded)`: every local path a run reads (the output directory may not be or contain one).
- `check_data(loaded, kind)`: reads each calibration, evaluation and probe file the way the run will,
  so a bad file fails before any computation (exit 1, the file and the recipe line named).
- `fingerprint(recipe)`: sha256 of the content of the model's files and of the calibration files.
  Stage keys hash these, not the paths: a file replaced under the same name recomputes the stages.
- `changes(old, new)`: what differs between two fingerprints, in words, for the resume log.

A stage config may name a file of its own in a field called `path` (allocate's `file` method), or several
through a `files()` method (select's task files): they are inputs too, checked by its stage's plan-time check and hashed into that stage's key (`stage_files`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from compress.errors import BadInput

CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


# -- which paths ----------------------------------------------------------------------------------------
def local_paths(loaded) -> list[tuple[str, Path]]:
    """(what, path) for every local file or directory the run reads: model, data, stage files, the recipe."""
    r = loaded.recipe
    out = [("recipe", Path(loaded.path))]
    if Path(r.model.path).expanduser().exists():
        out.append(("model", Path(r.model.path)))
    out += [("calibration source", Path(s)) for s in r.calibration.sources if not s.startswith("hf:")]
    out += [("eval file", Path(s)) for s in r.eval.data]
    if r.eval.probe_train:
        out.append(("probe file", Path(r.eval.probe_train)))
    out += [("eval task file", Path(t.partition("=")[2] or t)) for t in r.eval.tasks
            if "=" in t or t.endswith((".yaml", ".yml"))]
    out += [(f"stage {i} file", Path(p)) for i, cfg in enumerate(r.stage_configs) for p in _stage_paths(cfg)]
    return out


def _stage_paths(cfg) -> list[str]:
    """The files a stage config names: its `files()` when it has one (several files), else a `path` field."""
    if callable(getattr(cfg, "files", None)):
        return list(cfg.files())
    path = getattr(cfg, "path", None)
    return [path] if isinstance(path, str) else []


# -- plan-time content checks ------------------------------------------------------------------------
def check_data(loaded, kind: str) -> None:
    """Read every data file as the run will (`kind`: "causal" or "encoder"); all problems at once."""
    from compress.calibration import expand_sources, read_document
    from compress.eval.data import read_labeled_tsv, read_text, text_slice

    r = loaded.recipe
    problems = []

    def attempt(loc, fn):
        try:
            fn()
        except BadInput as e:
            problems.append((loc, str(e)))

    c = r.calibration
    for i, s in enumerate(c.sources):
        if not s.startswith("hf:"):
            attempt(("calibration", "sources", i), lambda s=s: [
                read_document(f, field=c.text_field, messages=c.messages_field, fmt=c.format)
                for f in expand_sources([s])])
    if r.eval.enabled:
        for i, path in enumerate(r.eval.data):
            if kind == "encoder":
                attempt(("eval", "data", i), lambda p=path: read_labeled_tsv(p))
            else:
                attempt(("eval", "data", i), lambda p=path: _eval_text(p, r.eval.text_slice, read_text, text_slice))
        if r.eval.probe_train:
            attempt(("eval", "probe_train"), lambda: read_labeled_tsv(r.eval.probe_train))
        for i, spec in enumerate(r.eval.tasks):
            attempt(("eval", "tasks", i), lambda s=spec: _task(s, r.eval.task_data, kind))
    if problems:
        from compress.recipe_yaml import with_where

        raise BadInput("\n".join(with_where(loc, msg, loaded.locator) for loc, msg in problems))


def _task(spec: str, data_dir, kind: str) -> None:
    from compress.eval.mc_tasks import resolve_task

    if kind == "encoder":
        raise BadInput("eval.tasks scores a causal language model's log-likelihoods; this model is an encoder")
    resolve_task(spec, data_dir)


def _eval_text(path, span, read_text, text_slice) -> None:
    text = read_text(path)
    if span and not text_slice(text, *span):
        raise BadInput(f"{path}: eval.text_slice {list(span)} of this file holds no text")


# -- content fingerprints --------------------------------------------------------------------------
def fingerprint(recipe) -> dict:
    """{"model": {file: sha256} or {"hub": id}, "calibration": {source: sha256 or "hub"}}."""
    return {"model": _model_files(recipe.model), "calibration": _calibration_files(recipe.calibration)}


def _model_files(m) -> dict:
    from compress.models.loading import resolve_source

    src, gguf = resolve_source(m.path, m.gguf_file)
    root = Path(src)
    if not root.is_dir():  # a Hub id: the revision the cache holds is what transformers loads
        return {"hub": m.path}
    files = [root / gguf] if gguf else sorted(p for p in root.iterdir() if p.is_file())
    return {p.name: file_sha256(p) for p in files}


def _calibration_files(c) -> dict:
    from compress.calibration import expand_sources

    return {s: "hub" if s.startswith("hf:") else file_sha256(Path(s)) for s in expand_sources(list(c.sources))}


def identity(loaded, record: dict) -> dict:
    """What identifies the run's inputs in its report and exports: each file's name and sha256, never the path the
    user typed (it means nothing on another machine). `record`: manifest["inputs"] (fingerprint). The model's
    name comes from the recipe as recorded, so a `${VAR}` in it stays a reference; its sha256 covers every file."""
    import hashlib

    files = record.get("model") or {}
    if "hub" in files:
        model = {"name": files["hub"], "sha256": None}
    else:
        digest = hashlib.sha256("".join(f"{n}:{h}\n" for n, h in sorted(files.items())).encode()).hexdigest()
        model = {"name": Path(loaded.recorded["model"]["path"]).name, "sha256": digest}
    r = loaded.recipe
    return {"model": model,
            "calibration": {Path(s).name: h for s, h in (record.get("calibration") or {}).items()},
            "eval": {Path(p).name: file_sha256(Path(p).expanduser()) for p in r.eval.data}}


def stage_files(cfg) -> dict:
    """{path: sha256} of the files a stage config names (see the module docstring)."""
    return {p: file_sha256(Path(p).expanduser()) for p in _stage_paths(cfg) if Path(p).expanduser().is_file()}


def changes(old: dict, new: dict) -> list[str]:
    """e.g. ["calibration `valid.txt`: content changed (sha256 1a2b3c4d -> 5e6f7a8b)", "model `x`: removed"]."""
    out = []
    for part in ("model", "calibration"):
        a, b = old.get(part) or {}, new.get(part) or {}
        for name in sorted(set(a) | set(b)):
            if name not in b:
                out.append(f"{part} `{name}`: no longer an input")
            elif name not in a:
                out.append(f"{part} `{name}`: new input")
            elif a[name] != b[name]:
                out.append(f"{part} `{name}`: content changed (sha256 {str(a[name])[:8]} -> {str(b[name])[:8]})")
    return out
