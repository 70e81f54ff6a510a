"""`compress sweep RECIPE --grid stages.0.bits=2,3,4 --grid ...`: one run per point of the grid, each in its own
output directory (`OUT/points/bits=2_group_size=32/`), then the compare report over them (`OUT/compare.md`,
`OUT/pareto.png`, `OUT/sweep.json`).

Every point's recipe is validated and planned before any runs, so a bad grid value fails in seconds. A sweep is
resumable: rerun the same command and a point whose report exists for the same resolved recipe is kept, an
interrupted point continues from its finished stages (`--resume`), the others run. `--executor local` runs the
points one after another in this process; `--executor ray` sends each to a Ray cluster (`--ray-address`, or a
local Ray instance when none is given) as a task of `--cpus-per-point` CPUs; the workers must see the same paths
(the recipe's data and OUT: a shared filesystem). A point that fails its gates is reported, not fatal; a point
that fails to run makes the sweep exit 2 after the others finished. docs/ci.md#compare-and-sweep.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import time
from pathlib import Path

from compress.errors import BadInput, CompressError, RunFailure

log = logging.getLogger("compress")


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`KEY=V1,V2,...` -> (KEY, [V1, V2, ...]); values stay text (the recipe's `--set` parses them as YAML)."""
    out = []
    for spec in specs:
        key, eq, raw = spec.partition("=")
        values = [v.strip() for v in raw.split(",")]
        if not eq or not key.strip() or not all(values):
            raise BadInput(f"--grid expects dotted.key=v1,v2,... (e.g. stages.0.bits=2,3,4), got `{spec}`")
        if any(k == key.strip() for k, _ in out):
            raise BadInput(f"--grid names `{key.strip()}` twice: give all its values in one --grid")
        out.append((key.strip(), values))
    if not out:
        raise BadInput("sweep: give at least one --grid KEY=V1,V2")
    return out


def points(grid: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """[(directory name, [KEY=VALUE overrides])] over the grid's cartesian product."""
    lasts = [k.rsplit(".", 1)[-1] for k, _ in grid]
    labels = lasts if len(set(lasts)) == len(lasts) else [k for k, _ in grid]
    out = []
    for combo in itertools.product(*[vals for _, vals in grid]):
        name = "_".join(f"{label}={v}" for label, v in zip(labels, combo))
        out.append((re.sub(r"[^A-Za-z0-9_.=+-]", "-", name), [f"{k}={v}" for (k, _), v in zip(grid, combo)]))
    return out


def _load(recipe: Path, overrides: list[str], replacements: dict):
    from compress.recipe import load_recipe, validate_paths

    loaded = load_recipe(recipe, overrides=overrides, **replacements)
    validate_paths(loaded.recipe)
    return loaded


def run_point(recipe: str, overrides: list[str], replacements: dict, out: str, cwd: str, quiet: bool = True) -> dict:
    """Run one point (in this process or in a Ray worker): its status and report's path."""
    from compress import pipeline
    from compress.gates import GateFailure

    os.chdir(cwd)  # the recipe's relative paths, as for the driver
    out_path = Path(out)
    start = time.time()
    try:
        loaded = _load(Path(recipe), overrides, replacements)
        if _done(out_path, loaded.sha256):
            gates = json.loads((out_path / "report.json").read_text()).get("gates") or []
            return {"status": "gates failed" if not all(g["passed"] for g in gates) else "passed",
                    "earlier": True, "seconds": 0.0}
        pipeline.run(loaded, out_path, resume=out_path.exists(), quiet=quiet)
        status = {"status": "passed"}
    except GateFailure as e:
        status = {"status": "gates failed", "error": str(e).splitlines()[0]}
    except CompressError as e:
        status = {"status": "failed", "error": str(e), "exit_code": e.exit_code}
    except Exception as e:  # noqa: BLE001 - one point's crash is reported; the others still run
        status = {"status": "failed", "error": f"{type(e).__name__}: {e}", "exit_code": 2}
    return {**status, "seconds": round(time.time() - start, 2)}


def _done(out: Path, sha256: str) -> bool:
    """A point finished earlier for the same resolved recipe (its report exists and the manifest says so)."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return (out / "report.json").is_file() and manifest.get("recipe_sha256") == sha256


def sweep(recipe: Path, grid_specs: list[str], output: Path, *, overrides: list[str] = (), replacements: dict | None = None,
          executor: str = "local", ray_address: str | None = None, cpus_per_point: float = 1,
          gpus_per_point: float = 0, quiet: bool = True,
          metric: str = "ppl_ratio") -> dict:
    """Run the grid and write the compare report; {"points": [...], "compare": {...}}."""
    from compress.publish.compare import compare

    replacements = replacements or {}
    grid = parse_grid(list(grid_specs))
    todo = points(grid)
    for name, extra in todo:  # every point's recipe valid before any work
        try:
            _load(Path(recipe), [*overrides, *extra], replacements)
        except BadInput as e:
            raise BadInput(f"sweep point `{name}` ({', '.join(extra)}): {e}") from None
    output = Path(output)
    (output / "points").mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    args = [(str(recipe), [*overrides, *extra], replacements, str((output / "points" / name).resolve()), cwd, quiet)
            for name, extra in todo]
    log.info("sweep: %d points (%s) on the %s executor", len(todo), " x ".join(f"{k}: {len(v)}" for k, v in grid),
             executor)
    if executor == "local":
        results = []
        for (name, _), a in zip(todo, args):
            log.info("sweep point %s", name)
            results.append(run_point(*a))
            log.info("sweep point %s: %s", name, results[-1]["status"])
            os.chdir(cwd)
    elif executor == "ray":
        results = _ray(args, ray_address, cpus_per_point, gpus_per_point)
    else:
        raise BadInput(f"--executor `{executor}`: local or ray")
    table = [{"point": name, "overrides": extra, "output": str(output / "points" / name), **res}
             for (name, extra), res in zip(todo, results)]
    finished = [Path(t["output"]) for t in table if t["status"] != "failed"]
    summary = {"recipe": str(recipe), "grid": [{"key": k, "values": v} for k, v in grid], "executor": executor,
               "points": table}
    if finished:
        summary["compare"] = compare(finished, metric=metric, plot=output / "pareto.png")
        (output / "compare.md").write_text(summary["compare"]["markdown"])
    (output / "sweep.json").write_text(json.dumps(summary, indent=2, default=str))
    failed = [t for t in table if t["status"] == "failed"]
    if failed:
        raise RunFailure(f"sweep: {len(failed)} of {len(table)} points failed: "
                         + "; ".join(f"{t['point']}: {t['error'].splitlines()[0]}" for t in failed[:3])
                         + f"; the others are in {output} (rerun the same command to retry the failed ones)")
    return summary


def _ray(args: list[tuple], address: str | None, cpus: float, gpus: float = 0) -> list[dict]:
    try:
        import ray
    except ImportError:
        raise BadInput("--executor ray needs Ray: pip install 'compress-llm[cluster]' (or `pip install ray`)") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({} if address else {"num_cpus": max(1, os.cpu_count() or 1)}))
    try:
        have = ray.cluster_resources().get("GPU", 0)
        if gpus > have:  # Ray would wait for it forever
            raise BadInput(f"--gpus-per-point {gpus:g}: the Ray cluster has {have:g} GPUs, so no point could start")
        task = ray.remote(run_point).options(num_cpus=cpus, num_gpus=gpus)
        return ray.get([task.remote(*a) for a in args])
    finally:
        if started:
            ray.shutdown()
