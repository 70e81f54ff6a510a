"""`compress bench eval`: `compress eval` of a packed export against the run's own evaluation, same tokens."""

import json

from conftest import MODELS, TEXT, invoke


def test_bench_eval_times_both_evaluations_and_they_agree(tmp_path):
    js, md = tmp_path / "e.json", tmp_path / "e.md"
    rc, stdout, err = invoke("bench", "eval", "--model", MODELS / "stories260K", "--data",
                             TEXT / "tinystories" / "tinystories_val.txt", "--bits", 4, "--group", 32,
                             "--max-tokens", 1024, "--json", js, "--markdown", md)
    assert rc == 0, err
    (cell,) = json.loads(js.read_text())["cells"]
    assert cell["bits"] == 4 and cell["run_eval_s"] > 0 and cell["packed_eval_s"] > 0
    run, packed = cell["run_eval_s"], cell["packed_eval_s"]  # both rounded to 0.01 s
    assert (packed - 0.005) / (run + 0.005) - 1e-3 <= cell["ratio"] <= (packed + 0.005) / (run - 0.005) + 1e-3
    assert cell["backends"] == {"cpu": 20}  # stories260K's MLP is written dense by the hf export
    assert cell["kl_diff"] < 1e-4 and abs(cell["packed"]["ppl"] - cell["run"]["ppl"]) < 1e-3 * cell["run"]["ppl"]
    assert "| W4 g32 asym |" in md.read_text() and "cpu 20" in stdout


def test_bench_eval_defaults_to_a_text_shipped_with_compress(tmp_path):
    """Without --data it evaluates the bundled Botchan text, so it runs from a wheel with no checkout beside it."""
    js = tmp_path / "e.json"
    rc, _, err = invoke("bench", "eval", "--model", MODELS / "stories260K", "--bits", 4, "--group", 32,
                        "--max-tokens", 512, "--json", js)
    assert rc == 0, err
    result = json.loads(js.read_text())
    assert result["data"] == "bundled:botchan-eval" and result["cells"][0]["tokens"] == 512
