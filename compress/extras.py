"""Optional dependencies: which extra of the `compress-llm` distribution installs a module, and the plan-time
check that refuses a recipe (or a command) needing one that is missing, before anything heavy runs.

A stage or export declares the modules it imports (`registry.Entry.requires`); `check_recipe` runs on every
loaded recipe, so `validate`, `run --dry-run` and `run` all refuse with the exact install command.
"""

from __future__ import annotations

from importlib.util import find_spec

from compress.errors import BadInput

DIST = "compress-llm"
# module -> (what pip installs, the extra that brings it)
EXTRAS = {
    "onnx": ("onnx", "export"),
    "onnxruntime_genai": ("onnxruntime-genai", "export"),
    "onnx_ir": ("onnx-ir", "export"),
    "onnxscript": ("onnxscript", "export"),
    "openvino": ("openvino", "export"),
    "compressed_tensors": ("compressed-tensors", "export"),
    "sklearn": ("scikit-learn", "select"),
    "lm_eval": ("lm-eval", "lmeval"),
    "triton": ("triton", "gpu"),
}


def missing(modules) -> list[str]:
    return [m for m in modules if find_spec(m) is None]


def require(modules, what: str) -> None:
    """BadInput naming `what`, the missing packages and the install command, when any of `modules` is absent."""
    gone = missing(modules)
    if not gone:
        return
    extras = sorted({EXTRAS[m][1] for m in gone})
    raise BadInput(f"{what} needs {', '.join(EXTRAS[m][0] for m in gone)}, which is not installed: "
                   f"pip install '{DIST}[{','.join(extras)}]'")


def check_recipe(recipe) -> None:
    """Every module the recipe's stages and exports import, present (compress/registry.py `requires`)."""
    from compress import registry

    for cfg in recipe.stage_configs:
        require(registry.get(cfg.stage, cfg.method).requires, f"stage `{cfg.stage}: {cfg.method}`")
    for name in recipe.export.names():
        require(registry.get("export", name).requires, f"export `{name}`")
