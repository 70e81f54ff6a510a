"""stories-moe: the MoE reference model of the moe suite, distilled from stories260K when it is missing.

There is no real MoE small enough for a 2-core machine, so one is made the way stories-llama-1m was
(`../shared/tools`, its README): about 4M tokens sampled from stories260K at temperature 1 (seeded), then a
Mixtral-architecture student (8 experts, top-2, hidden 128, 4 layers) trained on KL(teacher || student) for a
fixed time. It lives in the cache (`$COMPRESS_CACHE/models/stories-moe`, never in the repository); `build`
records the sha256 of its weights and the tools' settings in `build.json` beside it, and the suite writes that
hash into its results. Training is time-bounded, so a rebuild on another machine is a different model: the hash
says which one a result was measured on.

    python -m bench.moe_model    # builds it (about an hour on 2 cores) and prints its directory
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.quality import CACHE, MODELS, REPO

TOOLS = REPO.parent / "shared" / "tools"
DIR = CACHE / "models" / "stories-moe"
SAMPLES = CACHE / "models" / "stories260K-samples-4m"
N_TOKENS, SAMPLE_SEED = 4_000_000, 0
STUDENT = ["--arch", "mixtral", "--hidden", "128", "--inter", "384", "--layers", "4", "--heads", "4", "--kv", "2",
           "--experts", "8", "--topk", "2", "--moe-inter", "128", "--batch", "32", "--minutes", "45", "--seed", "0"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def path() -> Path | None:
    """The built model's directory, or None."""
    return DIR if (DIR / "build.json").is_file() else None


def build(log=print) -> Path:
    """Sample, distil, hash; each step is skipped when its output exists (so an interrupted build resumes)."""
    if path():
        return DIR
    teacher = MODELS / "stories260K"
    env = {**os.environ, "THREADS": os.environ.get("THREADS", "2")}
    if not SAMPLES.with_suffix(".pt").is_file():
        SAMPLES.parent.mkdir(parents=True, exist_ok=True)
        log(f"sampling {N_TOKENS:,} tokens from {teacher} into {SAMPLES}.pt")
        subprocess.run([sys.executable, str(TOOLS / "gen_samples.py"), str(teacher), str(SAMPLES), str(N_TOKENS),
                        str(SAMPLE_SEED)], check=True, env=env)
    tmp = DIR.with_name(DIR.name + ".partial")
    if not (tmp / "model.safetensors").is_file():
        log(f"distilling the mixtral student into {tmp} ({' '.join(STUDENT)})")
        t = time.time()
        subprocess.run([sys.executable, str(TOOLS / "train_kd.py"), "--teacher", str(teacher), "--data",
                        str(SAMPLES.with_suffix(".pt")), "--out", str(tmp), *STUDENT], check=True, env=env)
        log(f"distilled in {time.time() - t:.0f} s")
    info = {"sha256": sha256(tmp / "model.safetensors"), "teacher": str(teacher.name), "samples": N_TOKENS,
            "sample_seed": SAMPLE_SEED, "student": STUDENT, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (tmp / "build.json").write_text(json.dumps(info, indent=1))
    tmp.rename(DIR)
    return DIR


if __name__ == "__main__":
    print(build())
