"""Quality gates: `gates:` in a recipe, checked against the run's report.

A gate is `PATH OP NUMBER`, e.g. `eval.tinystories.ppl_ratio <= 1.05`, `size.effective_bits <= 4.3` or
`tasks.sst2_mc.acc_delta >= -0.02` (a log-likelihood task of `eval.tasks`, by its name). PATH
names a number of report.json: dotted keys, where an evaluation file may be named by its file name
(`tinystories_val.txt`), its stem (`tinystories_val`), its directory (`tinystories`) or `*` (every file: the
worst one decides). Every PATH is checked at plan time against the keys the report will have (`report_paths`),
so a typo fails before any work. After the run each gate is marked in report.json and report.md, written as
JUnit XML (`gates.xml`, which CI systems display), and a failing gate makes `compress run` exit 3 naming the
gate, the measured value and the margin. docs/ci.md.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import quoteattr

from compress.errors import BadInput, CompressError

OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
_GATE = re.compile(r"^\s*([A-Za-z0-9_.*\-]+)\s*(<=|>=|==|<|>)\s*([-+0-9.eE]+)\s*$")

CAUSAL_METRICS = ("fp_ppl", "ppl", "ppl_ratio", "kl", "top1", "tokens")
GENERATION_METRICS = ("gen_prefix", "gen_agree", "gen_kl", "gen_top1")
SIZE_METRICS = ("fp_bytes", "bytes", "packed_bytes", "effective_bits", "quantized_params", "quantized_layers")
STORED_METRICS = ("bytes", "packed_layers", "dense_layers")
RUN_METRICS = ("seconds", "peak_rss_mb")
TASK_METRICS = ("fp_acc", "acc", "acc_delta", "fp_acc_norm", "acc_norm", "acc_norm_delta", "docs")


class GateFailure(CompressError):
    """One or more gates failed: the run finished and wrote everything; CI should fail the job."""

    exit_code = 3


@dataclass(frozen=True)
class Gate:
    text: str
    path: str
    op: str
    threshold: float

    @classmethod
    def parse(cls, text: str) -> "Gate":
        m = _GATE.match(text) if isinstance(text, str) else None
        if not m:
            raise ValueError(f"gate {text!r}: write `PATH OP NUMBER` with OP one of {', '.join(OPS)}, e.g. "
                             "`eval.tinystories.ppl_ratio <= 1.05`")
        try:
            threshold = float(m.group(3))
        except ValueError:
            raise ValueError(f"gate {text!r}: `{m.group(3)}` is not a number") from None
        return cls(text.strip(), m.group(1), m.group(2), threshold)


def report_paths(recipe, kind: str, exports: list[str]) -> dict[str, list[str]]:
    """{section: the metric names report.json will hold} for this recipe, known before the run: the gates'
    plan-time check. `eval.FILE` sections are keyed by the evaluation file's name."""
    out: dict[str, list[str]] = {"": list(RUN_METRICS), "size": list(SIZE_METRICS)}
    ev = recipe.eval
    if ev.enabled and ev.data and not recipe.model.stream:
        if kind == "causal":
            metrics = list(CAUSAL_METRICS) + (list(GENERATION_METRICS) if ev.generation.prompts else [])
        else:
            metrics = ["cosine"] + (["fp_probe_acc", "probe_acc"] if ev.probe_train else [])
        for path in ev.data:
            out[f"eval.{Path(path).name}"] = metrics
    if ev.enabled and ev.tasks and not recipe.model.stream and kind == "causal":  # `tasks.sst2_mc.acc_delta >= -0.02`
        from compress.eval.mc_tasks import task_name

        for spec in ev.tasks:
            out[f"tasks.{task_name(spec)}"] = list(TASK_METRICS)
    for fmt in exports:
        if fmt in ("hf", "onnx", "openvino"):  # the exports that store quantized layers packed or dense
            out[f"size.stored.{fmt}"] = list(STORED_METRICS)
    return out


def _eval_files(paths: dict) -> list[str]:
    return [k[len("eval."):] for k in paths if k.startswith("eval.")]


def resolve(gate: Gate, paths: dict[str, list[str]], dirs: dict[str, str]) -> list[tuple[str, str]]:
    """The (section, metric) pairs `gate` reads; BadInput naming what exists when its path matches nothing."""
    head, _, metric = gate.path.rpartition(".")
    if head == "eval" or head.startswith("eval."):
        name = head[len("eval."):] if head.startswith("eval.") else ""
        files = _eval_files(paths)
        if name == "*":
            sections = [f"eval.{f}" for f in files]
        else:
            sections = [f"eval.{f}" for f in files if name in (f, Path(f).stem)]
            if not sections:  # the file's directory: eval.tinystories for .../tinystories/tinystories_val.txt
                sections = [f"eval.{f}" for f in files if dirs.get(f) == name]
        if len(sections) > 1 and name != "*":
            raise BadInput(f"gate `{gate.text}`: `{name}` names {len(sections)} evaluation files "
                           f"({', '.join(s[5:] for s in sections)}); use a file name")
        if not sections:
            raise BadInput(f"gate `{gate.text}`: no evaluation file `{name}`"
                           + (f"; the recipe evaluates {', '.join(files)} (by file name, stem, directory or `*`)"
                              if files else "; the recipe evaluates nothing (`eval.data` is empty, eval is disabled "
                              "or the model is streamed)"))
    else:
        sections = [head]
        if head not in paths:
            raise BadInput(f"gate `{gate.text}`: the report has no section `{head or '(top level)'}`; sections: "
                           + ", ".join(s or "(top level)" for s in paths))
    for s in sections:
        if metric not in paths[s]:
            raise BadInput(f"gate `{gate.text}`: `{s}` has no `{metric}`; it has {', '.join(paths[s])}")
    return [(s, metric) for s in sections]


def check(gates: list[str], recipe, kind: str, exports: list[str]) -> list[tuple[Gate, list[tuple[str, str]]]]:
    """Parse every gate and resolve it against this recipe's report (plan time): [(gate, its (section, metric)
    pairs)]."""
    paths, dirs = report_paths(recipe, kind, exports), _dirs(recipe)
    return [(g, resolve(g, paths, dirs)) for g in map(Gate.parse, gates)]


def _dirs(recipe) -> dict[str, str]:
    """Evaluation file name -> the name of its directory (a gate may name the file by it)."""
    return {Path(p).name: Path(p).parent.name for p in recipe.eval.data}


def _lookup(report: dict, section: str, metric: str):
    node = report
    if section.startswith("eval."):
        node = (report.get("eval") or {}).get(section[5:]) or {}
    else:
        for key in filter(None, section.split(".")):
            node = (node or {}).get(key) or {}
    return node.get(metric) if isinstance(node, dict) else None


def evaluate(gates: list[str], recipe, kind: str, exports: list[str], report: dict) -> list[dict]:
    """Each gate with its measured value, margin (how far inside the threshold: negative when failing) and
    verdict. With several files (`*`), the worst file's value is the measured one."""
    out = []
    for g, pairs in check(gates, recipe, kind, exports):
        values = [(s, _lookup(report, s, m)) for s, m in pairs]
        missing = [s for s, v in values if not isinstance(v, (int, float)) or isinstance(v, bool)
                   or not math.isfinite(v)]
        row = {"gate": g.text, "op": g.op, "threshold": g.threshold}
        if missing:
            row.update(path=f"{missing[0]}.{g.path.rpartition('.')[2]}", value=None, margin=None, passed=False,
                       reason="not measured (missing or non-finite in the report)")
        else:
            sign = -1 if g.op in ("<=", "<") else 1  # margin > 0: inside the threshold
            worst = min(values, key=lambda sv: sign * (sv[1] - g.threshold))
            margin = sign * (worst[1] - g.threshold) if g.op != "==" else -abs(worst[1] - g.threshold)
            passed = all(OPS[g.op](v, g.threshold) for _, v in values)
            row.update(path=f"{worst[0]}.{g.path.rpartition('.')[2]}".lstrip("."), value=worst[1],
                       margin=round(margin, 6), passed=passed)
        out.append(row)
    return out


def failure_message(results: list[dict]) -> str:
    failed = [r for r in results if not r["passed"]]
    lines = [f"{len(failed)} of {len(results)} gates failed:"]
    for r in failed:
        if r["value"] is None:
            lines.append(f"  {r['gate']}: {r['reason']}")
        else:
            lines.append(f"  {r['gate']}: measured {r['path']} = {r['value']:.6g}, threshold {r['threshold']:g}, "
                         f"margin {r['margin']:+.6g}")
    return "\n".join(lines)


def junit_xml(results: list[dict], name: str = "compress gates") -> str:
    """JUnit XML with one test case per gate (a failure element for each failed one)."""
    failures = sum(not r["passed"] for r in results)
    cases = []
    for r in results:
        attrs = f"classname={quoteattr('compress.gates')} name={quoteattr(r['gate'])}"
        if r["passed"]:
            cases.append(f"  <testcase {attrs}><system-out>{_text(r)}</system-out></testcase>")
        else:
            msg = r.get("reason") or f"measured {r['value']:.6g}, threshold {r['threshold']:g}, margin {r['margin']:+.6g}"
            cases.append(f"  <testcase {attrs}><failure message={quoteattr(msg)} type=\"gate\">{_text(r)}"
                         "</failure></testcase>")
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuites>\n<testsuite name={quoteattr(name)} '
            f'tests="{len(results)}" failures="{failures}" errors="0" skipped="0">\n' + "\n".join(cases)
            + "\n</testsuite>\n</testsuites>\n")


def _text(r: dict) -> str:
    from xml.sax.saxutils import escape

    return escape(f"{r['path']} = {r['value']} ({r['op']} {r['threshold']:g})")


def table(results: list[dict]) -> str:
    """The gates as a markdown table (report.md, the CI summary and the model card show the same one)."""
    def num(v, fmt):
        return "" if v is None else format(v, fmt)

    rows = "".join(f"| {'PASS' if r['passed'] else 'FAIL'} | `{r['gate']}` | {r['path']} | {num(r['value'], '.6g')} | "
                   f"{num(r['margin'], '+.6g')} |\n" for r in results)
    return "| | gate | measured | value | margin |\n|---|---|---|---|---|\n" + rows


def markdown(results: list[dict]) -> str:
    """report.md's Gates section."""
    return "\n## Gates\n\n" + table(results)
