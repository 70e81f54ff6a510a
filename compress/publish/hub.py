"""`compress push OUT --repo ORG/NAME` and the recipe's `push:`: a finished run's exports, report and a
generated model card to the Hugging Face Hub, in one commit, through huggingface_hub's `HfApi`.

Layout in the repository: the `hf` export at the root (so `from_pretrained("ORG/NAME")` works), every other
export in its directory (`onnx/`, `openvino/`), the report and the resolved recipe in `compress/`, the card as
README.md. Before anything is sent the run's files are checked against its manifest, and a run whose gates
failed is refused. The token comes from huggingface_hub (HF_TOKEN or the token file of `hf auth login`); compress
never reads, logs or writes it. A push is one commit: it lands entirely or not at all; files the repository
already holds unchanged are not uploaded again, and a push that changes nothing makes no commit. docs/hub.md.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import yaml

from compress.errors import BadInput, RunFailure
from compress.workspace import MANIFEST

log = logging.getLogger("compress")

REPORT_FILES = ("report.json", "report.md", "gates.xml")
ATTEMPTS = 3  # commit attempts on a 5xx or a dropped connection (a commit is atomic: retrying is safe)


class PushFailure(RunFailure):
    """The Hub refused or could not be reached; nothing was committed."""


def plan(root: Path, repo: str, *, base_model: str | None = None) -> tuple[list[tuple[str, object, int]], str]:
    """([(path in the repository, local path or bytes, size)], model card) of the finished run in `root`."""
    from compress.publish.card import model_kind, render
    from compress.verify import verify

    root = Path(root)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        report = json.loads((root / "report.json").read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"`{root}` is not a finished run's output (no readable {MANIFEST} and report.json: {e}); "
                       "push the directory `compress run` wrote") from None
    checked, problems = verify(root)
    if problems:
        raise BadInput(f"`{root}` does not match its manifest's checksums: {'; '.join(problems[:5])}; "
                       "nothing was pushed (rerun the export, or `compress verify` for the full list)")
    failed = [g["gate"] for g in report.get("gates") or [] if not g["passed"]]
    if failed:
        raise BadInput(f"the run's gates failed ({'; '.join(failed)}): a run that failed its gates is not pushed")
    exports = manifest.get("exports") or {}
    if not exports:
        raise BadInput(f"the run in `{root}` exported nothing: add `export: {{formats: [hf]}}` to the recipe")
    files: list[tuple[str, object, int]] = []
    formats: dict[str, str] = {}
    for fmt, info in exports.items():
        directory = info.get("directory", fmt)
        formats[fmt] = "" if fmt == "hf" else directory
        base = root / directory
        for p in sorted(base.rglob("*")):
            if p.is_file():
                rel = p.relative_to(base).as_posix()
                files.append((f"{formats[fmt]}/{rel}" if formats[fmt] else rel, p, p.stat().st_size))
    for name in REPORT_FILES:
        if (root / name).is_file():
            files.append((f"compress/{name}", root / name, (root / name).stat().st_size))
    recipe = yaml.safe_dump(manifest.get("recipe") or {}, sort_keys=False).encode()
    files.append(("compress/recipe.yaml", recipe, len(recipe)))
    card = render(manifest, report, repo, formats, base_model=base_model, kind=model_kind(root, exports))
    files.append(("README.md", card.encode(), len(card.encode())))
    clash = [p for p in {f[0] for f in files} if sum(f[0] == p for f in files) > 1]
    if clash:
        raise BadInput(f"two files would land on the same path in the repository: {', '.join(sorted(clash))}")
    log.info("push: %d files checked against the manifest", checked)
    return files, card


def push(root: Path, repo: str, *, private: bool = False, revision: str | None = None, create_pr: bool = False,
         dry_run: bool = False, base_model: str | None = None, endpoint: str | None = None) -> dict:
    """Push the run in `root` to `repo`; returns what was pushed (with `dry_run`, what would be, and the card)."""
    files, card = plan(root, repo, base_model=base_model)
    listing = [{"path": p, "bytes": n} for p, _, n in files]
    if dry_run:
        return {"repo": repo, "revision": revision or "main", "files": listing,
                "bytes": sum(n for _, _, n in files), "card": card}
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=endpoint)
    where = api.endpoint
    branch = revision or "main"
    with _errors(repo, branch, where):
        api.create_repo(repo, private=private or None, exist_ok=True, repo_type="model")  # None: the default
        if branch != "main":
            api.create_branch(repo, branch=branch, exist_ok=True)
        before = api.repo_info(repo, revision=branch).sha
        ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(src) if isinstance(src, Path) else src)
               for p, src, _ in files]
        message = f"compress: {json.loads((Path(root) / 'report.json').read_text()).get('model', '')} compressed"
        for attempt in range(1, ATTEMPTS + 1):
            try:
                info = api.create_commit(repo, ops, commit_message=message, revision=branch, create_pr=create_pr)
                break
            except Exception as e:  # noqa: BLE001 - only transient failures are retried
                if attempt == ATTEMPTS or not _transient(e):
                    raise
                log.warning("push: %s; retrying the commit (%d of %d)", _status_text(e), attempt + 1, ATTEMPTS)
                time.sleep(attempt)
    changed = info.oid != before or bool(info.pr_url)
    out = {"repo": repo, "revision": branch, "commit": info.oid, "url": info.commit_url, "pr_url": info.pr_url,
           "files": len(files), "bytes": sum(n for _, _, n in files), "changed": changed, "endpoint": where}
    log.info("push: %s", f"{repo}@{branch}: commit {info.oid[:12]}" + ("" if changed else " (nothing changed)")
             + (f", pull request {info.pr_url}" if info.pr_url else ""))
    return out


def _cause(e: BaseException) -> BaseException:
    """The HTTP or network error behind `e` (huggingface_hub wraps an upload's failure in a RuntimeError)."""
    seen = e
    while seen is not None:
        if getattr(seen, "response", None) is not None or isinstance(seen, _network_errors()):
            return seen
        seen = seen.__cause__ or seen.__context__
    return e


def _status(e) -> int | None:
    response = getattr(_cause(e), "response", None)
    return getattr(response, "status_code", None)


def _status_text(e) -> str:
    s = _status(e)
    return f"the Hub answered {s}" if s else f"{type(e).__name__}: {e}"


def _network_errors() -> tuple[type, ...]:
    """The HTTP client's transport errors (huggingface_hub 1.x uses httpx, 2.x its fork httpx2)."""
    found: list[type] = [ConnectionError]
    for name in ("httpx2", "httpx"):
        try:
            found.append(__import__(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def _transient(e) -> bool:
    s = _status(e)
    return (s is not None and s >= 500) or s == 429 or isinstance(_cause(e), _network_errors())


class _errors:
    """huggingface_hub's and the network's errors as PushFailure with what to do (the token is never shown)."""

    def __init__(self, repo: str, branch: str, endpoint: str):
        self.repo, self.branch, self.endpoint = repo, branch, endpoint

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, (BadInput, KeyboardInterrupt)):
            return False
        from huggingface_hub.errors import HfHubHTTPError

        e = _cause(e)
        if isinstance(e, _network_errors()):
            raise PushFailure(f"push: cannot reach {self.endpoint} ({type(e).__name__}: {e}); nothing was "
                              "committed. Check the network (and HF_ENDPOINT), then rerun `compress push`") from None
        if not isinstance(e, HfHubHTTPError) and _status(e) is None:
            return False
        s = _status(e)
        what = {401: "authentication failed: set HF_TOKEN (a token with write access) or run `hf auth login`",
                403: f"the token has no write access to `{self.repo}` (its namespace belongs to another user or "
                     "organization, or the token is read-only)",
                404: f"`{self.repo}` (revision `{self.branch}`) was not found, or the token cannot see it"}.get(s)
        if what is None:
            what = (f"the Hub answered {s} after {ATTEMPTS} attempts (a server-side failure); rerun `compress push` "
                    "later" if s and s >= 500 else f"the Hub refused the push ({s})")
        detail = str(e).splitlines()[0][:300] if str(e) else ""
        raise PushFailure(f"push to {self.repo}: {what}; nothing was committed" + (f" [{detail}]" if detail else "")) \
            from None
