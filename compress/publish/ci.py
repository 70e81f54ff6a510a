"""CI mode (`compress run --ci`, on by itself when `CI=true`): no progress bars, the log as JSON lines on
stderr, and after the run (also when a gate failed) the artifact layout a CI job uploads: `SHA256SUMS` over
every artifact (`sha256sum -c SHA256SUMS` in OUTPUT checks them), `gates.xml` (JUnit, written by the run when
the recipe has gates) and `summary.md`, a one-screen summary that is also printed for the job log and appended
to `$GITHUB_STEP_SUMMARY` when set. `stages/` is the resume state, not an artifact. docs/ci.md.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

ARTIFACT_EXCLUDE = ("stages/",)


def enabled(flag: bool) -> bool:
    return flag or os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


class JsonLines(logging.Formatter):
    """One JSON object per record: time (ISO 8601, UTC), level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        from datetime import datetime, timezone

        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(handler: logging.Handler) -> None:
    handler.setFormatter(JsonLines())
    try:  # huggingface_hub's own progress bars (a push)
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


def sha256sums(root: Path) -> str:
    """`sha256sum` lines for every artifact the run's manifest recorded (the resume state excluded)."""
    from compress.workspace import MANIFEST

    files = json.loads((Path(root) / MANIFEST).read_text()).get("files") or {}
    return "".join(f"{sha}  {rel}\n" for rel, sha in sorted(files.items()) if not rel.startswith(ARTIFACT_EXCLUDE))


def summary(root: Path, report: dict | None, error: str | None = None) -> str:
    """A one-screen markdown summary: model, quality, size, gates, exports, push."""
    from compress.eval.report import summary_lines
    from compress.gates import table as gates_table

    manifest = json.loads((Path(root) / "manifest.json").read_text())
    recipe = manifest.get("recipe") or {}
    stages = ", ".join(f"{s['stage']} {s['method']}" + (f" W{s['bits']}" if s.get("bits") else "")
                       for s in recipe.get("stages", []))
    lines = [f"### compress: {(report or {}).get('model', recipe.get('model', {}).get('path'))} ({stages})", ""]
    if report:
        lines += [f"- {line}" for line in summary_lines(report)]
        gates = report.get("gates") or []
        if gates:
            passed = sum(g["passed"] for g in gates)
            lines += ["", f"**gates: {passed} of {len(gates)} passed**", "", gates_table(gates).rstrip("\n")]
        exports = report.get("exports") or {}
        if exports:
            lines += ["", "exports: " + ", ".join(f"`{k}`" for k in exports)]
    push = manifest.get("push")
    if push:
        lines.append(f"pushed: {push['repo']}@{push['revision']} commit `{push['commit'][:12]}`"
                     + ("" if push.get("changed") else " (nothing changed)"))
    if error:
        lines += ["", f"**error:** {error}"]
    return "\n".join(lines) + "\n"


def write_artifacts(root: Path, report: dict | None, error: str | None = None) -> str:
    """SHA256SUMS and summary.md in `root`; the summary's text (printed by the caller)."""
    root = Path(root)
    (root / "SHA256SUMS").write_text(sha256sums(root))
    text = summary(root, report, error)
    (root / "summary.md").write_text(text)
    step = os.environ.get("GITHUB_STEP_SUMMARY")
    if step:
        try:
            with open(step, "a") as f:
                f.write(text)
        except OSError as e:
            print(f"warning: cannot append to GITHUB_STEP_SUMMARY ({e})", file=sys.stderr)
    return text
