"""W2 perplexity of AutoRound with and without the walsh rotate stage, same calibration and AutoRound
settings in every cell (the `eval/bench_quality.py` cells with one `rotate` stage put in front).

    python eval/bench_walsh.py [iters] [model ...]   (prints one JSON row per cell)
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quality as bq  # noqa: E402

VARIANTS = {
    "autoround": None,
    "walsh+autoround": {"stage": "rotate", "method": "walsh", "fused": False},
    "walsh-spectral+autoround": {"stage": "rotate", "method": "walsh", "fused": False, "mode": "spectral"},
    "walsh-fused+autoround": {"stage": "rotate", "method": "walsh", "fused": True},
    "walsh-fused-rotation-only+autoround": {"stage": "rotate", "method": "walsh", "fused": True, "mode": "none"},
}


def main(iters: int, names: list[str], bits: int = 2, seeds=(0,)) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for bench in [b for b in bq.benches() if b.name in names]:
            path, calib = bq.model_path(bench), bq.calibration_file(bench, tmp)
            for seed in seeds:
                for variant, rot in VARIANTS.items():
                    rec = bq.recipe(bench, path, calib, "autoround", bits, bq.Settings(iters=iters, seed=seed))
                    if rot:
                        rec["stages"].insert(0, copy.deepcopy(rot))
                    t = time.time()
                    report = run(rec, tmp / variant)
                    ev = next(iter(report["eval"].values()))
                    row = {"model": bench.name, "variant": variant, "bits": bits, "group_size": bench.group_size,
                           "iters": iters, "seed": seed, "ppl": round(ev["ppl"], 4), "fp_ppl": round(ev["fp_ppl"], 4),
                           "kl": round(ev["kl"], 4), "top1": round(ev["top1"], 4), "tokens": ev["tokens"],
                           "seconds": round(time.time() - t, 1)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def run(rec: dict, out: Path) -> dict:
    """bench_quality.run_cell, with the scratch directory named by the caller (stage 0 may be `rotate`)."""
    from compress import pipeline
    from compress.recipe import load_recipe

    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(rec, sort_keys=False))
    try:
        return pipeline.run(load_recipe(path), out, force=True, quiet=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, sys.argv[2:] or ["stories-llama-1m"])
