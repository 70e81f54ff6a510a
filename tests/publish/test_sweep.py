"""`compress compare` and `compress sweep` (local and on a Ray instance the test starts): one output per grid
point, resumable, then the compare table and Pareto plot."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import CAL, invoke, recipe


def _recipe(tmp):
    path = recipe(tmp, eval_data=[CAL])
    doc = yaml.safe_load(path.read_text())
    doc["gates"] = ["eval.tinystories_val.ppl_ratio <= 1.5"]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    path = _recipe(tmp)
    rc, out, err = invoke("sweep", path, "--grid", "stages.0.bits=2,4", "--grid", "stages.0.group_size=32",
                          "-o", tmp / "sw", "--json")
    assert rc == 0, err
    return path, tmp / "sw", json.loads(out)


def test_sweep_runs_every_point_in_its_own_output_then_compares(swept):
    _, sw, res = swept
    names = [p["point"] for p in res["points"]]
    assert names == ["bits=2_group_size=32", "bits=4_group_size=32"]
    status = {p["point"]: p["status"] for p in res["points"]}
    assert status["bits=4_group_size=32"] == "passed" and status["bits=2_group_size=32"] == "gates failed"
    for name in names:
        manifest = json.loads((sw / "points" / name / "manifest.json").read_text())
        st = manifest["recipe"]["stages"][0]
        assert f"bits={st['bits']}_group_size={st['group_size']}" == name
    md = (sw / "compare.md").read_text()
    assert md == res["compare"]["markdown"] and "| bits=4_group_size=32 | rtn W4 g32 |" in md
    assert (sw / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["run"]: r for r in res["compare"]["rows"]}
    assert rows["bits=2_group_size=32"]["ppl_ratio"] > rows["bits=4_group_size=32"]["ppl_ratio"]
    assert res["compare"]["front"] == names  # 2 bits: smaller; 4 bits: closer to FP
    assert json.loads((sw / "sweep.json").read_text())["points"] == res["points"]


def test_a_rerun_keeps_finished_points_and_continues_an_interrupted_one(swept):
    path, sw, _ = swept
    (sw / "points" / "bits=4_group_size=32" / "report.json").unlink()  # as if killed after its stages
    rc, out, err = invoke("sweep", path, "--grid", "stages.0.bits=2,4", "--grid", "stages.0.group_size=32",
                          "-o", sw, "--json")
    assert rc == 0, err
    res = json.loads(out)
    earlier = {p["point"]: p.get("earlier", False) for p in res["points"]}
    assert earlier == {"bits=2_group_size=32": True, "bits=4_group_size=32": False}
    report = json.loads((sw / "points" / "bits=4_group_size=32" / "report.json").read_text())
    assert [s["resumed"] for s in report["stages"] if s["name"] == "quantize"] == [True]


def test_a_bad_grid_value_fails_before_any_point_runs(tmp_path):
    rc, _, err = invoke("sweep", _recipe(tmp_path), "--grid", "stages.0.bits=4,banana", "-o", tmp_path / "sw")
    assert rc == 1 and "sweep point `bits=banana`" in err
    assert not (tmp_path / "sw" / "points" / "bits=4").exists()
    rc, _, err = invoke("sweep", _recipe(tmp_path), "--grid", "stages.0.bits", "-o", tmp_path / "sw")
    assert rc == 1 and "--grid expects dotted.key=v1,v2" in err


def test_compare_prints_a_table_and_a_plot_and_rejects_a_non_run(swept, tmp_path):
    _, sw, _ = swept
    runs = [sw / "points" / "bits=2_group_size=32", sw / "points" / "bits=4_group_size=32"]
    rc, out, err = invoke("compare", *runs, "--plot", tmp_path / "p.png", "--markdown", tmp_path / "c.md",
                          "--size", "effective_bits", "--metric", "kl")
    assert rc == 0, err
    assert out.strip() == (tmp_path / "c.md").read_text().strip()
    assert "Pareto front (effective bits vs kl, lower is better): `bits=2_group_size=32` -> `bits=4_group_size=32`" in out
    assert (tmp_path / "p.png").stat().st_size > 1000
    rc, _, err = invoke("compare", tmp_path)
    assert rc == 1 and "holds no finished run" in err


def test_pareto_front():
    from compress.publish.compare import pareto

    pts = [(1.0, 5.0), (2.0, 3.0), (2.0, 4.0), (3.0, 3.0), (4.0, 1.0)]
    assert pareto(pts) == [0, 1, 4]
    assert pareto([(1.0, 0.5), (2.0, 0.9), (3.0, 0.8)], "max") == [0, 1]


@pytest.mark.slow  # a Ray instance (~5 s) and a worker process per point that imports torch and transformers
def test_sweep_on_a_local_ray_instance(tmp_path):
    ray = pytest.importorskip("ray", reason="the `cluster` extra")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rc, out, err = invoke("sweep", _recipe(tmp_path), "--grid", "stages.0.bits=4,8", "-o", tmp_path / "sw",
                              "--executor", "ray", "--json")
        assert rc == 0, err
        assert ray.is_initialized()  # the sweep used the test's instance and left it running
        rc, _, err = invoke("sweep", _recipe(tmp_path), "--grid", "stages.0.bits=2", "-o", tmp_path / "sw2",
                            "--executor", "ray", "--gpus-per-point", "1")
        assert rc == 1 and "--gpus-per-point 1: the Ray cluster has 0 GPUs" in err, err
    finally:
        ray.shutdown()
    res = json.loads(out)
    assert [p["status"] for p in res["points"]] == ["passed", "passed"] and res["executor"] == "ray"
    for p in res["points"]:
        assert json.loads((tmp_path / "sw" / "points" / p["point"] / "report.json").read_text())["gates"][0]["passed"]
