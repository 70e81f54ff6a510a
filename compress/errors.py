"""Error types with exit-code semantics for the CLI.

`BadInput` (exit 1) is the user's to fix: a recipe key, a path, an option. `RunFailure` (exit 2) is
something that went wrong while computing. Messages say what was wrong and what to do.
"""


class CompressError(Exception):
    exit_code = 2


class BadInput(CompressError):
    """Invalid recipe, path or option. The CLI prints the message and exits with 1, no traceback."""

    exit_code = 1


class RunFailure(CompressError):
    """A failure while running a valid recipe. The CLI exits with 2."""

    exit_code = 2
