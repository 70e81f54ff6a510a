"""`python -m bench quality` in quick mode on stories260K: every method/width through the real pipeline."""

import math

import pytest

from bench.quality import METHODS, QUICK, run_quality, selected
from compress.errors import BadInput


@pytest.mark.e2e
def test_quick_stories260k_rows_and_table():
    rows, md = run_quality(quick=True, only=["stories260K"])
    assert {r["model"] for r in rows} == {"stories260K"}
    cells = {(r["method"], r["bits"]) for r in rows if r["method"] != "fp"}
    assert cells == {(m, b) for m in METHODS for b in QUICK.widths}
    assert [r["method"] for r in rows].count("fp") == 1
    for r in rows:
        assert r["metric"] == "ppl" and r["group_size"] in (None, 32)
        for k in ("value", "fp_value", "ratio", "kl", "top1", "effective_bits"):
            assert isinstance(r[k], float) and math.isfinite(r[k]), (r["method"], r["bits"], k, r[k])
        if r["method"] != "fp":
            assert math.isfinite(r["seconds"]) and r["seconds"] >= 0
            assert r["bits"] < r["effective_bits"] < r["bits"] + 1  # scales and zero points on top
    fp = next(r for r in rows if r["method"] == "fp")
    assert all(r["fp_value"] == fp["value"] for r in rows)  # same eval tokens for every cell
    assert md.startswith("# Quality benchmark")
    header = "| model | method | bits | group | eff. bits | metric | value | FP |"
    assert header in md and md.count("\n| stories260K |") == len(rows)
    assert "total wall time" in md


def test_only_rejects_unknown_model():
    with pytest.raises(BadInput, match="unknown model `nope`"):
        selected(False, ["nope"])
    assert [b.name for b in selected(True, None)] == ["stories260K", "stories-llama-1m"]



# -- the lab apart from the product (#46) ------------------------------------------------------------------------
@pytest.mark.parametrize("command", [[], ["quality"], ["reproduce"], ["scale"]], ids=lambda c: " ".join(c) or "bench")
def test_lab_help_has_an_example(command):
    from helpers import lab

    rc, out, err = lab(*command, "--help")
    assert rc == 0, err
    assert "Example" in out and "python -m bench" in out


def test_lab_runs_as_python_m_bench_and_compress_bench_keeps_the_speed_commands():
    """`python -m bench` from the checkout, with compress's exit codes; `compress bench` holds only what a user
    measures on their machine (kernels, decode, eval; serve and gguf: the engines on their model), and no product
    module imports the lab."""
    import ast
    import subprocess
    import sys

    import typer
    from conftest import REPO, invoke

    from compress import cli

    proc = subprocess.run([sys.executable, "-m", "bench", "quality", "--suite", "nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "unknown --suite `nope`" in proc.stderr, proc.stderr
    assert set(typer.main.get_command(cli.bench_app).commands) == {"kernels", "decode", "eval", "serve", "gguf"}
    rc, _, err = invoke("bench", "quality", "--quick")
    assert rc == 1 and "quality" in err
    lab_imports = []
    for folder in ("compress", "eval", "kernels"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                lab_imports += [f"{path}: {n}" for n in names if n == "bench" or n.startswith("bench.")]
    assert not lab_imports

@pytest.mark.e2e
def test_quick_lfq_suite_on_stories260k():
    from bench.lfq import QUICK as LQ
    from bench.lfq import VARIANTS, run_lfq

    result, md = run_lfq(quick=True, only=["stories260K"])
    assert [(c["variant"], c["bits"], c["seed"]) for c in result["cells"]] == [(v, 2, 0) for v in VARIANTS]
    assert [r["variant"] for r in result["summary"]] == list(VARIANTS)
    plain = result["cells"][0]
    for c in result["cells"]:
        assert c["fp_ppl"] == plain["fp_ppl"] and c["group_size"] == 32
        assert 0 <= c["gen_prefix"] <= LQ.new_tokens and 0 <= c["gen_agree"] <= 1 and c["kl"] > 0
    # same calibration and blocks before the last: only the final objective differs, so results differ
    assert len({round(c["kl"], 9) for c in result["cells"]}) == 3
    assert [t["target"] for t in result["targets"]] == [
        "stories260K W2: LFQ KL <= 0.85 x plain", "stories260K W2: LFQ greedy prefix > plain",
        "stories260K W2: LFQ ppl <= 1.01 x plain"]
    assert md.startswith("# LFQ benchmark") and md.count("\n| stories260K | W2 |") == 3


@pytest.mark.e2e
def test_quick_walsh_suite_on_stories260k():
    from bench.walsh import VARIANTS, run_walsh

    result, md = run_walsh(quick=True, only=["stories260K"])
    assert [(c["variant"], c["bits"], c["group_size"]) for c in result["cells"]] == [(v, 2, 64) for v in VARIANTS]
    first = result["cells"][0]
    for c in result["cells"]:
        assert c["fp_ppl"] == first["fp_ppl"] and math.isfinite(c["ppl"]) and c["kl"] > 0
    # same calibration and AutoRound settings: only the rotation differs, so every variant scores differently
    assert len({round(c["kl"], 9) for c in result["cells"]}) == len(VARIANTS)
    assert [t["target"] for t in result["targets"]] == [
        "stories260K W2: walsh-spectral ppl <= 0.75 x AutoRound", "stories260K W2: walsh-spectral-auto ppl <= 0.75 x AutoRound",
        "stories260K W2: walsh-spectral-auto-unpadded ppl <= 0.75 x AutoRound",
        "stories260K W2: walsh-spectral ppl <= auto-round Hadamard", "stories260K W2: fused within 10% of walsh-spectral"]
    assert md.startswith("# Walsh benchmark") and md.count("\n| stories260K | W2 |") == len(VARIANTS)
    stored = {r["variant"]: r["bits_per_model_weight"] for r in result["summary"]}
    assert stored["walsh-spectral"] > stored["autoround"] * 1.05 and stored["walsh"] == stored["autoround"]
    assert stored["walsh-spectral-auto-unpadded"] == stored["autoround"]


def test_walsh_suite_runs_chosen_variants_beside_vanilla(monkeypatch):
    from bench import walsh as bench_walsh
    from compress.errors import BadInput

    ran = []
    monkeypatch.setattr(bench_walsh, "cell", lambda bench, path, calib, bits, group, variant, *a: ran.append(variant) or
                        {"model": bench.name, "bits": bits, "group_size": group, "variant": variant, "seed": 0, "ppl": 2.0,
                         "kl": 0.1, "top1": 0.5, "fp_ppl": 1.0, "seconds": 1.0, "effective_bits": 2.25,
                         "quantized_params": 1000 if variant == "autoround" else 1200})
    result, _ = bench_walsh.run_walsh(quick=True, only=["stories260K"], variants=["walsh-spectral-auto"])
    assert ran == ["autoround", "walsh-spectral-auto"] and result["settings"]["variants"] == ran
    assert result["targets"][0]["value"].endswith("(x1.000; FP itself: x0.500)")
    assert [r["bits_per_model_weight"] for r in result["summary"]] == [2.25, 2.7]  # padding stores 20% more
    with pytest.raises(BadInput, match="unknown walsh variant"):
        bench_walsh.run_walsh(quick=True, only=["stories260K"], variants=["walsh-spectral-typo"])


@pytest.mark.e2e
def test_quick_mixed_suite_on_stories260k(tmp_path):
    from bench.mixed import METHODS as MM
    from bench.mixed import run_mixed

    result, md = run_mixed(quick=True, only=["stories260K"], curve_png=tmp_path / "curves.png")
    assert [(c["method"], c["budget"], c["seed"]) for c in result["cells"]] == [(m, 3.0, 0) for m in MM]
    for c in result["cells"]:
        assert c["effective_bits"] <= 3.0 and c["fp_ppl"] == result["cells"][0]["fp_ppl"] and c["kl"] > 0
        assert c["report_effective_bits"] == round(c["effective_bits"], 4)
    mixed = [c for c in result["cells"] if c["method"] != "uniform"]
    assert all(c["effective_bits"] >= 2.99 for c in mixed)  # filled toward the budget
    assert result["cells"][0]["effective_bits"] < 2.6  # uniform: the nearest feasible width is 2 bits at g32
    assert len(result["cells"][-1]["curve"]) == 2 and (tmp_path / "curves.png").stat().st_size > 1000
    assert result["targets"][0]["target"].startswith("stories260K @ 3.0: RL ppl <= 0.95 x best baseline")
    assert md.startswith("# Mixed-precision benchmark") and md.count("\n| stories260K | 3.0 |") == len(MM)


def test_mixed_suite_runs_chosen_rows_with_a_longer_refine(monkeypatch, tmp_path):
    from bench import mixed as bench_mixed
    from compress.errors import BadInput

    ran = []

    def fake_cell(bench, path, calib, method, budget, seed, s, tmp):
        ran.append((method, budget, seed, s.refine))
        return {"model": bench.name, "budget": budget, "group_size": 32, "method": method, "seed": seed, "fp_ppl": 5.0,
                "ppl": {"greedy-sens+refine": 10.0, "rl+refine": 9.0}[method], "kl": 0.1, "top1": 0.5,
                "effective_bits": budget - 0.001, "report_effective_bits": budget, "alloc_seconds": 60.0,
                "search_seconds": 50.0, "proxy_error": None, "picked": None, "curve": []}

    monkeypatch.setattr(bench_mixed, "cell", fake_cell)
    result, md = bench_mixed.run_mixed(quick=True, only=["stories260K"], budgets=[3.0], seeds=[1],
                                       methods=["rl+refine", "greedy-sens+refine"], refine=20000,
                                       curve_png=tmp_path / "curves.png")
    assert not (tmp_path / "curves.png").exists() and "curve_png" not in result["meta"]  # no curves, no empty plot
    assert ran == [("greedy-sens+refine", 3.0, 1, 20000), ("rl+refine", 3.0, 1, 20000)]
    assert result["settings"]["refine"] == 20000 and result["settings"]["methods"] == [m for m, *_ in ran]
    assert result["targets"][0]["value"] == "9.0000 vs 10.0000 (x0.9000)"  # the RL row against the baseline row
    with pytest.raises(BadInput, match="unknown mixed method"):
        bench_mixed.run_mixed(quick=True, only=["stories260K"], methods=["rl+refin"])


@pytest.mark.e2e
def test_reproduce_reruns_seeded_cells_bit_for_bit():
    """`python -m bench reproduce`: the quick cells rerun identically against an earlier run on this machine
    (the stored JSONs come from other CPUs; their float sums differ in the last digits), and a changed value
    is reported field by field: the rerun is diffed against the first run with one value moved, which is the one
    difference it reports (two runs, not three: the e2e tier's cost)."""
    import copy

    from conftest import REPO

    from bench.reproduce import run_reproduce

    bench = REPO / "bench"
    first, _ = run_reproduce(bench, quick=True)
    assert [r["cell"] for r in first["cells"]] == [["rtn", 4], ["gptq", 2], ["greedy", 2.5, 0]]
    moved = copy.deepcopy(first)
    value = first["cells"][0]["values"]["value"]
    moved["cells"][0]["values"]["value"] += 1e-6
    again, md = run_reproduce(bench, quick=True, against=moved)
    assert [r["identical"] for r in again["cells"]] == [False, True, True] and "All identical: **no**" in md
    assert again["cells"][0]["diff"] == [f"value: stored {value + 1e-6!r}, now {value!r}"]


@pytest.mark.e2e
def test_the_recipes_lab_keeps_each_report_and_finds_a_changed_one(tmp_path):
    """`python -m bench recipes`: a second run of a bundled recipe against the first is identical but for the timings
    (here: but for the one line changed in the first's report since, which is reported and exits 1)."""
    from helpers import lab

    from bench.recipes import masked, run_recipes

    first = run_recipes(tmp_path / "a", only=["quickstart"], log=lambda _: None)
    assert first["recipes"]["quickstart"] == {"rc": 0, "identical": None, "diff": []}
    report = (tmp_path / "a" / "quickstart.report.md").read_text()
    assert "| quantize | autoround | (timed) |" in masked(report) and "## Evaluation" in report
    (tmp_path / "a" / "quickstart.report.md").write_text(report.replace("## Evaluation", "## Evaluated"))
    rc, out, _ = lab("recipes", "--out", tmp_path / "b", "--against", tmp_path / "a", "--recipe", "quickstart")
    assert rc == 1 and "| quickstart | 0 | **no** | line " in out and "Evaluated" in out
    a, b = (masked((tmp_path / d / "quickstart.report.md").read_text()).splitlines() for d in "ab")
    pairs = [(x, y) for x, y in zip(a, b) if x != y]  # one: the heading changed since, the rerun's as the first
    assert len(a) == len(b) and len(pairs) == 1 and pairs[0][1].startswith("## Evaluation") and \
        pairs[0][0] == pairs[0][1].replace("## Evaluation", "## Evaluated"), pairs