"""`python -m bench recipes`: every bundled recipe run as the e2e tier runs it, each in its own process, keeping its
report.md; with `--against DIR`, each compared with an earlier run's, byte for byte but the Stages table's timing and
memory columns.

A change that keeps behaviour (a refactoring) keeps every report: run it before the change (`--out before/`) and
after (`--out after/ --against before/`) on one machine. The settings are the e2e tier's (tests/helpers.py
`shrink` and `WIKITEXT`, tests/test_recipes_run.py): ref-llama-7m with a few calibration samples, iterations and
evaluation tokens; the MoE recipe on a tiny random Mixtral (tests/tiny.py) with the groups and budget its experts
allow; the select recipe as shipped (MiniLM from its PyPI package) with fewer probe rows and heal steps. Each run
writes into the same directory (RUN, in the temporary directory), so the paths a report prints are the same in
every run; two of these commands do not run at once. `--repo` runs
another checkout's compress and recipes (e.g. a `git worktree` of the commit before), with this checkout's
settings.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RUN = Path(tempfile.gettempdir()) / "compress-bench-recipes"
TIMED = re.compile(r"^(\| (load|quantize|eval|export|allocate|prune|heal|select|rotate|finetune) \| [\w.-]+ \|).*$")


def _tests():
    """The e2e tier's helpers (tests/helpers.py, tests/tiny.py), importable from the lab."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    import helpers
    import tiny
    from conftest import MODELS, TEXT

    return helpers, tiny, MODELS, TEXT


def arguments(recipe: Path, work: Path) -> list[str]:
    """`compress run` arguments of one bundled recipe, shrunk as the e2e tier shrinks it."""
    helpers, tiny, models, text = _tests()
    spec = yaml.safe_load(recipe.read_text())
    out = ["run", str(recipe), "--output", str(work / "run"), "--force"]
    if recipe.stem.startswith("select-"):  # tests/select/test_select.py
        return out + ["--set", "stages.0.max_examples=200", "--set", "stages.0.heal.steps=2",
                      "--set", "stages.0.tasks.1.test_rows=[6000,6200]"]
    if recipe.stem.startswith("moe-"):  # tests/allocate/test_moe.py
        model = work / "mixtral"
        if not model.exists():
            tiny.save_tiny("mixtral", model)
        data = str(text / "tinystories" / "tinystories_val.txt")
        return out + ["--model", str(model), *helpers.shrink(spec), "--calibration", data, "--eval-data", data,
                      "--set", "stages.1.group_size=32", "--set", "stages.0.budget=3.4", "--set",
                      "stages.0.samples=4", "--set", "stages.2.samples=8", "--set", "stages.2.seqlen=64"]
    return out + ["--model", str(models / "ref-llama-7m"), *helpers.shrink(spec), *helpers.WIKITEXT]


def masked(report: str) -> str:
    """report.md without the Stages table's seconds and memory."""
    return "\n".join(TIMED.sub(r"\1 (timed) |", line) for line in report.splitlines()) + "\n"


def run_recipes(out: Path, against: Path | None = None, only: list[str] | None = None, repo: Path = REPO,
                log=print) -> dict:
    """Run the bundled recipes of `repo`'s checkout with its compress (or `only` these stems); report.md of each in
    OUT/NAME.report.md. Returns
    {"recipes": {name: {"rc": int, "identical": bool | None, "diff": [...]}}, "identical": bool}."""
    out, repo = out.resolve(), repo.resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    results = {}
    for recipe in sorted((repo / "recipes").glob("*.yaml")):
        if only and recipe.stem not in only:
            continue
        shutil.rmtree(RUN / "run", ignore_errors=True)
        proc = subprocess.run([sys.executable, "-m", "compress.cli", *arguments(recipe, RUN), "--quiet"], cwd=repo,
                              env=env, capture_output=True, text=True)
        row = {"rc": proc.returncode, "identical": None, "diff": []}
        report = RUN / "run" / "report.md"
        if proc.returncode == 0 and report.exists():
            shutil.copy(report, out / f"{recipe.stem}.report.md")
            earlier = against / f"{recipe.stem}.report.md" if against else None
            if earlier is not None and earlier.exists():
                a, b = masked(earlier.read_text()).splitlines(), masked(report.read_text()).splitlines()
                row["diff"] = [f"line {i + 1}: {x!r} -> {y!r}" for i, (x, y) in enumerate(zip(a, b)) if x != y]
                if len(a) != len(b):
                    row["diff"].append(f"{len(a)} lines -> {len(b)} lines")
                row["identical"] = not row["diff"]
        else:
            row["diff"] = [proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"]
        results[recipe.stem] = row
        log(f"{recipe.stem}: exit {row['rc']}" + ("" if row["identical"] is None else
                                                  ", identical" if row["identical"] else f", {len(row['diff'])} "
                                                  "lines differ"))
    shutil.rmtree(RUN, ignore_errors=True)
    ok = all(r["rc"] == 0 and r["identical"] is not False for r in results.values())
    return {"recipes": results, "identical": ok}


def markdown(result: dict, against: Path | None) -> str:
    lines = ["# Bundled recipes' report.md" + (f", against {against}" if against else ""), "",
             "| recipe | exit | identical | differences |", "|---|---|---|---|"]
    for name, r in result["recipes"].items():
        same = "-" if r["identical"] is None else "yes" if r["identical"] else "**no**"
        lines.append(f"| {name} | {r['rc']} | {same} | {'; '.join(r['diff'][:4]) or '-'} |")
    return "\n".join(lines) + "\n"
