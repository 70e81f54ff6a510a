"""Text that ships with compress, named in recipes as `bundled:NAME` (README.md here: source and licence).

`bundled:botchan-calibration` and `bundled:botchan-eval` are disjoint parts of one public-domain novel, so a
bundled recipe calibrates and evaluates from an installed wheel in any directory. `resolve` turns a reference into
the file's path; anything else is returned unchanged.
"""

from __future__ import annotations

from pathlib import Path

from compress.errors import BadInput

PREFIX = "bundled:"
ROOT = Path(__file__).resolve().parent


def names() -> list[str]:
    """The shipped texts, as the NAME of `bundled:NAME`."""
    return sorted(p.stem for p in ROOT.glob("*.txt"))


def is_ref(source: str) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def resolve(source: str) -> str:
    """The path of the shipped text `bundled:NAME` (NAME with or without `.txt`); other sources unchanged.
    Raises BadInput naming the known texts."""
    if not is_ref(source):
        return source
    name = source[len(PREFIX):].strip().removesuffix(".txt")
    if name not in names():
        import difflib

        close = difflib.get_close_matches(name, names(), n=1)
        hint = f"did you mean `{PREFIX}{close[0]}`? " if close else ""
        known = ", ".join(PREFIX + n for n in names())
        raise BadInput(f"`{source}`: no bundled text `{name}`; {hint}known: {known}")
    return str(ROOT / f"{name}.txt")
