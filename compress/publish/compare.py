"""`compress compare OUT...`: the runs' size and quality side by side, the size-vs-quality Pareto front, as
markdown for a pull-request comment and a PNG plot. Reads only each run's report.json and manifest.json.
docs/ci.md#compare-and-sweep.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from compress.errors import BadInput

QUALITY = {"ppl_ratio": "min", "kl": "min", "top1": "max", "gen_agree": "max", "cosine": "max", "probe_acc": "max"}
SIZES = {"bytes": "MiB", "effective_bits": "effective bits"}


def load_run(path: Path) -> dict:
    path = Path(path)
    try:
        report = json.loads((path / "report.json").read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"`{path}` holds no finished run (report.json: {e}); compare the directories `compress run` "
                       "wrote") from None
    try:
        recipe = json.loads((path / "manifest.json").read_text()).get("recipe") or {}
    except (OSError, ValueError):
        recipe = {}
    return {"path": path, "report": report, "recipe": recipe}


def _stages(recipe: dict) -> str:
    return ", ".join(f"{s['method']}" + (f" W{s['bits']}" if s.get("bits") else "")
                     + (f" g{s['group_size']}" if s.get("group_size") else "") for s in recipe.get("stages", []))


def _names(paths: list[Path]) -> list[str]:
    """Short distinct names: the directory names, or more of each path where two share a name."""
    names = [p.name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [p.as_posix() for p in paths]


def rows(runs: list[dict], metric: str = "ppl_ratio", data: str | None = None) -> tuple[list[dict], str | None]:
    """One row per run: name, stages, size, `metric` on the evaluation file `data` (default: the first file every
    run evaluated), gates passed; and the file used."""
    files = [list((r["report"].get("eval") or {})) for r in runs]
    common = [f for f in files[0] if all(f in fs for fs in files)] if files else []
    if data is None:
        data = common[0] if common else None
    elif not all(data in fs for fs in files):
        raise BadInput(f"--data `{data}`: not evaluated by every run (files: {sorted({f for fs in files for f in fs})})")
    out = []
    for name, r in zip(_names([r["path"] for r in runs]), runs):
        rep, size = r["report"], r["report"].get("size") or {}
        ev = (rep.get("eval") or {}).get(data, {}) if data else {}
        gates = rep.get("gates") or []
        out.append({"run": name, "model": rep.get("model"), "stages": _stages(r["recipe"]),
                    "effective_bits": size.get("effective_bits"),
                    "MiB": round(size["bytes"] / 2**20, 3) if size.get("bytes") else None,
                    **{m: ev.get(m) for m in QUALITY if m in ev},
                    "gates": f"{sum(g['passed'] for g in gates)}/{len(gates)}" if gates else "-"})
    if metric not in QUALITY:
        raise BadInput(f"--metric `{metric}`: one of {', '.join(QUALITY)}")
    return out, data


def pareto(points: list[tuple[float, float]], better: str = "min") -> list[int]:
    """Indices of the points no other point dominates: size no larger and quality no worse, one strictly."""
    sign = 1 if better == "min" else -1
    front = []
    for i, (x, y) in enumerate(points):
        if any(x2 <= x and sign * y2 <= sign * y and (x2 < x or sign * y2 < sign * y)
               for j, (x2, y2) in enumerate(points) if j != i):
            continue
        front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def compare(paths: list[Path], *, metric: str = "ppl_ratio", size: str = "bytes", data: str | None = None,
            plot: Path | None = None) -> dict:
    """{"rows", "front" (run names), "data", "markdown", "plot"} over the runs in `paths`."""
    if not paths:
        raise BadInput("compare: name at least one run's output directory")
    if size not in SIZES:
        raise BadInput(f"--size `{size}`: one of {', '.join(SIZES)}")
    runs = [load_run(p) for p in paths]
    table, data = rows(runs, metric, data)
    xkey = "MiB" if size == "bytes" else "effective_bits"
    usable = [i for i, r in enumerate(table) if _num(r.get(xkey)) and _num(r.get(metric))]
    front_idx = pareto([(table[i][xkey], table[i][metric]) for i in usable], QUALITY[metric])
    front = [table[usable[k]]["run"] for k in front_idx]
    for r in table:
        r["pareto"] = "yes" if r["run"] in front else ""
    cols = ["run", "stages", "effective_bits", "MiB", *[m for m in QUALITY if any(m in r for r in table)], "gates",
            "pareto"]
    md = [f"### compress compare: {len(table)} runs" + (f", quality on `{data}`" if data else ""), "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in table]
    md += ["", f"Pareto front ({SIZES[size]} vs {metric}, {'lower' if QUALITY[metric] == 'min' else 'higher'} is "
           f"better): " + (" -> ".join(f"`{n}`" for n in front) or "none (no run reports both)")]
    out = {"rows": table, "front": front, "data": data, "metric": metric, "size": size, "markdown": "\n".join(md) + "\n"}
    if plot is not None:
        out["plot"] = str(_plot(table, xkey, metric, front, Path(plot), data))
        out["markdown"] += f"\n![size vs {metric}]({Path(plot).name})\n"
    return out


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else str(v)


def _plot(table: list[dict], xkey: str, metric: str, front: list[str], path: Path, data: str | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = [r for r in table if _num(r.get(xkey)) and _num(r.get(metric))]
    ax.scatter([r[xkey] for r in pts], [r[metric] for r in pts], color="tab:blue", zorder=2)
    for r in pts:
        ax.annotate(r["run"], (r[xkey], r[metric]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    fr = [r for r in pts if r["run"] in front]
    ax.plot([r[xkey] for r in fr], [r[metric] for r in fr], color="tab:red", marker="o", label="Pareto front", zorder=3)
    ax.set_xlabel({"MiB": "size (MiB)", "effective_bits": "effective bits per quantized weight"}[xkey])
    ax.set_ylabel(f"{metric}" + (f" on {data}" if data else ""))
    ys = [r[metric] for r in pts if r[metric] > 0]
    if ys and max(ys) / min(ys) > 20:  # ratios spanning orders of magnitude (2-bit next to 4-bit)
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
