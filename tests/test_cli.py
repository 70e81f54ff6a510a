"""End-to-end tests of the `compress` command line, run in-process through `cli.main` (exit codes).

One short real run (quickstart recipe, AutoRound W4, 2 iterations) on stories-llama-1m is shared by
the tests that check its outputs; bad inputs must exit 1 with one clear line, no traceback, and
leave no output directory behind.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MODELS, REPO, TEXT, invoke
from helpers import WIKITEXT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

QUICKSTART = REPO / "recipes" / "quickstart.yaml"
STORIES1M = MODELS / "stories-llama-1m"
STORIES260K = MODELS / "stories260K"
WIKI = TEXT / "wikitext-2-raw" / "wiki.test.raw"
SMALL = ["--set", "calibration.nsamples=8", "--set", "calibration.seqlen=64", "--set", "stages.0.iters=2",
         "--set", "eval.max_tokens=2048"]
COMMANDS = [[], ["run"], ["validate"], ["eval"], ["inspect"], ["recipes"], ["bench"], ["bench", "kernels"]]






# -- help, recipes, validate, dry run ------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "compress")
def test_help_has_an_example(command):
    rc, out, err = invoke(*command, "--help")
    assert rc == 0, err
    assert "Example" in out


def test_console_script_help_and_bad_option_exit_codes():
    exe = shutil.which("compress")
    base = [exe] if exe else [sys.executable, "-c", "from compress import cli; cli.entry()"]
    ok = subprocess.run(base + ["--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0 and "Example" in ok.stdout
    bad = subprocess.run(base + ["run", "--no-such-option"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 1
    assert "--no-such-option" in bad.stderr and "Traceback" not in bad.stderr


def test_recipes_lists_every_bundled_recipe_with_its_description():
    rc, out, _ = invoke("recipes")
    assert rc == 0
    bundled = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(bundled) >= 8
    for path in bundled:
        desc = yaml.safe_load(path.read_text())["description"]
        assert f"recipes/{path.name}: {desc}" in out


def test_validate_bundled_recipes():
    rc, out, err = invoke("validate", *sorted((REPO / "recipes").glob("*.yaml")))
    assert rc == 0, err
    assert out.count("ok  ") == len(list((REPO / "recipes").glob("*.yaml")))


def test_validate_reports_a_bad_recipe_with_exit_1(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(QUICKSTART.read_text().replace("  nsamples:", "  nsample:"))
    rc, _, err = invoke("validate", QUICKSTART, bad)
    assert rc == 1
    line = QUICKSTART.read_text().splitlines().index("  nsamples: 16") + 1
    assert f"unknown key `nsample` at {bad}:{line}, did you mean `nsamples`?" in err


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    out_dir = tmp_path / "out"
    rc, out, err = invoke("run", QUICKSTART, "--model", STORIES1M, "--output", out_dir, "--dry-run")
    assert rc == 0, err
    assert "(llama, 4 blocks, 918,656 parameters)" in out
    assert "00-quantize-autoround: 28 layers; last block: `final_block: lfq`" in out  # `auto` on a causal LM
    assert "estimated peak memory:" in out and "export: hf" in out
    assert not out_dir.exists()


def test_dry_run_counts_a_tied_head_once(tmp_path):
    """stories260K ties its LM head to the embeddings: the plan's count is the loaded model's."""
    from transformers import AutoModelForCausalLM

    rc, out, err = invoke("run", QUICKSTART, "--model", STORIES260K, "--output", tmp_path / "o", "--dry-run",
                          "--json")
    assert rc == 0, err
    loaded = AutoModelForCausalLM.from_pretrained(STORIES260K)
    assert loaded.config.tie_word_embeddings
    assert json.loads(out)["parameters"] == sum(p.numel() for p in loaded.parameters())


@pytest.mark.parametrize("final_block,rc", [("lfq", 1), ("hard_ce", 1), ("auto", 0), ("same", 0)])
def test_dry_run_refuses_a_final_block_objective_on_an_encoder(tmp_path, final_block, rc):
    """Checked at plan time, before any weight is loaded; `auto` is plain AutoRound on an encoder."""
    from tiny import tiny_bert

    tiny_bert().save_pretrained(tmp_path / "bert")
    recipe = tmp_path / "r.yaml"
    text = QUICKSTART.read_text().replace("seqlen: 128", "seqlen: 64").replace("group_size: 128", "group_size: 32")
    recipe.write_text(text.replace("    sym: true", f"    sym: true\n    final_block: {final_block}"))
    got, out, err = invoke("run", recipe, "--model", tmp_path / "bert", "-o", tmp_path / "o", "--dry-run",
                           "--eval-data", TEXT / "sst2" / "dev.tsv")  # an encoder evaluates labeled TSVs
    assert got == rc, err
    if rc:
        assert f"`final_block: {final_block}` needs a causal LM with an LM head; `bert` has none" in err
    else:
        assert "00-quantize-autoround:" in out and "last block" not in out


def test_dry_run_json(tmp_path):
    out_dir = tmp_path / "out"
    rc, out, err = invoke("run", QUICKSTART, "--model", STORIES1M, "-o", out_dir, "--dry-run", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["blocks"] == 4 and plan["model_type"] == "llama"
    assert [(s["key"], s["layers"]) for s in plan["stages"]] == [("00-quantize-autoround", 28)]
    assert plan["stages"][0]["config"]["group_size"] == 128  # hidden 128: group 128 fits every layer
    assert plan["estimated_peak_memory_mb"] > 0
    assert plan["export"] == ["hf"]
    assert not out_dir.exists()


# -- a real short run ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """The quickstart recipe on stories-llama-1m with tiny settings, `--json`: (output dir, stdout report)."""
    out_dir = tmp_path_factory.mktemp("cli") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        root = logging.getLogger()
        handlers = list(root.handlers)
        rc, out, err = invoke("run", QUICKSTART, "--model", STORIES1M, "--output", out_dir, "--json", *SMALL,
                              *WIKITEXT)
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:] = handlers
    assert rc == 0, err
    return out_dir, json.loads(out)


def test_run_json_report(short_run):
    out_dir, report = short_run
    # inputs by name and content hash, not by the path typed (which means nothing on another machine)
    assert report["model"] == STORIES1M.name and len(report["inputs"]["model"]["sha256"]) == 64
    assert set(report["inputs"]["eval"]) == {WIKI.name} and str(STORIES1M) not in json.dumps(report)
    config = json.loads((out_dir / "hf" / "config.json").read_text())
    assert config["compress"]["meta"]["model"] == STORIES1M.name and str(STORIES1M) not in json.dumps(config)
    assert len(report["recipe_sha256"]) == 64
    names = [s["name"] for s in report["stages"]]
    assert "quantize" in names and "export" in names and "eval" in names
    for s in report["stages"]:
        assert {"name", "method", "seconds", "peak_rss_mb", "rss_mb"} <= set(s)
        assert s["seconds"] >= 0 and report["peak_rss_mb"] >= s["peak_rss_mb"] > 0 and s["rss_mb"] > 0
    q = next(s for s in report["stages"] if s["name"] == "quantize")
    assert q["method"] == "autoround" and q["resumed"] is False
    ev = report["eval"][WIKI.name]
    assert {"fp_ppl", "ppl", "ppl_ratio", "kl", "top1"} <= set(ev)
    assert 1 < ev["fp_ppl"] < 1000 and ev["ppl_ratio"] == pytest.approx(ev["ppl"] / ev["fp_ppl"], rel=1e-4)
    assert 0 <= ev["kl"] < 1 and 0.5 < ev["top1"] <= 1 and ev["tokens"] == 2048
    size = report["size"]
    assert {"fp_bytes", "bytes", "effective_bits"} <= set(size)
    assert size["bytes"] < size["fp_bytes"] / 2
    assert size["effective_bits"] == pytest.approx(4.125)  # 4 bits + fp16 scale per 128 weights
    assert json.loads((out_dir / "report.json").read_text()) == report


def test_run_output_directory(short_run):
    from compress.recipe import load_recipe

    out_dir, report = short_run
    for name in ("hf", "manifest.json", "report.json", "report.md", "run.log"):
        assert (out_dir / name).exists(), name
    assert (out_dir / "hf" / "config.json").exists() and (out_dir / "hf" / "model.safetensors").exists()
    assert not [p for p in out_dir.rglob("*") if p.name.endswith(".tmp")]
    manifest = json.loads((out_dir / "manifest.json").read_text())
    expected = load_recipe(QUICKSTART, overrides=SMALL[1::2], model=str(STORIES1M), calibration=WIKITEXT[1:2],
                           eval_data=WIKITEXT[3:4])
    assert manifest["recipe"] == expected.resolved
    assert manifest["recipe_sha256"] == expected.sha256 == report["recipe_sha256"]
    (key, st), = manifest["stages"].items()
    assert key == "00-quantize-autoround"
    assert st["status"] == "done" and len(st["inputs_hash"]) == 64
    assert st["seconds"] > 0 and st["peak_rss_mb"] > 0
    assert sorted(p.name for p in (out_dir / "stages" / key).iterdir()) == [  # its hand-off: QuantizedWeights
        *[f"block_{i:04d}.safetensors" for i in range(4)], "weights.json", "weights.safetensors"]
    md = (out_dir / "report.md").read_text()
    assert report["recipe_sha256"] in md and WIKI.name in md
    log = (out_dir / "run.log").read_text()  # the whole run, not only the stages
    assert "stage 00-quantize-autoround" in log and f"evaluation: {WIKI.name}" in log
    assert "export hf: " in log and "summary: size: " in log and "report.json" in log


def _in_memory_quantized(out_dir: Path):
    """The run's in-memory model, rebuilt: the FP model with every block checkpoint's weights applied."""
    from transformers import AutoModelForCausalLM

    from compress.driver import set_weight
    from compress.workspace import Workspace

    model = AutoModelForCausalLM.from_pretrained(STORIES1M, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    qweights = {}
    with Workspace(out_dir, resume=True) as ws:
        for i in range(model.config.num_hidden_layers):
            block = ws.load_block("00-quantize-autoround", i)
            for name, qw in block.items():
                set_weight(modules[name], qw)
            qweights.update(block)
    return model, qweights


def test_hf_export_loads_and_matches_the_in_memory_model(short_run):
    from transformers import AutoModelForCausalLM

    from compress.export.hf import read_quantized

    out_dir, _ = short_run
    ref, qweights = _in_memory_quantized(out_dir)
    loaded = AutoModelForCausalLM.from_pretrained(out_dir / "hf")
    loaded = torch.nn.Module.float(loaded).eval()  # auto-round forces fp16 on CPU
    _, exported = read_quantized(out_dir / "hf")
    assert sorted(exported) == sorted(qweights)
    for name, qw in qweights.items():
        assert torch.equal(exported[name].codes, qw.codes), name
        assert torch.allclose(exported[name].scales.float(), qw.scales.float(), rtol=1e-3, atol=1e-7), name
    ids = torch.tensor([[1, 15, 200, 33, 417, 9, 68, 305, 12, 99, 250, 3]])
    with torch.no_grad():
        a, b = ref(ids).logits, loaded(ids).logits
    assert (a - b).abs().max() < 2e-3 * a.abs().max()  # measured ~3e-4: fp16 scales and norms
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_inspect_reports_bits_and_group_sizes(short_run):
    out_dir, _ = short_run
    rc, out, err = invoke("inspect", out_dir / "hf")
    assert rc == 0, err
    assert "quantized layers: 28, effective bits 4.125" in out
    assert "bits  4 group  128" in out
    rc, out, err = invoke("inspect", out_dir / "hf", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["quantized_layers"] == 28
    assert {(r["bits"], r["group_size"], r["sym"]) for r in info["layers"]} == {(4, 128, True)}
    rc, whole, err = invoke("inspect", out_dir, "--json")  # the run's output directory stands for its export
    assert rc == 0 and json.loads(whole)["layers"] == info["layers"], err


def test_eval_of_the_export_agrees_with_the_report(short_run):
    out_dir, report = short_run
    rc, out, err = invoke("eval", out_dir / "hf", "--reference", STORIES1M, "--data", WIKI,
                          "--max-tokens", 2048, "--json")
    assert rc == 0, err
    res = json.loads(out)[WIKI.name]
    ev = report["eval"][WIKI.name]
    assert res["fp_ppl"] == pytest.approx(ev["fp_ppl"], rel=1e-4)
    assert res["top1"] == pytest.approx(ev["top1"], abs=0.01)
    assert res["ppl"] == pytest.approx(ev["ppl"], rel=0.01)
    rc, out, err = invoke("eval", out_dir / "hf", "--data", WIKI, "--max-tokens", 512)
    assert rc == 0, err
    assert out.startswith(f"{WIKI.name}: ppl ")


# -- bad input: exit 1, one line, no traceback, nothing written -----------------------------------
def _gpt2_dir(tmp: Path) -> Path:
    d = tmp / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return d


def _corrupt_dir(tmp: Path) -> Path:
    d = tmp / "corrupt"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(STORIES260K / name, d / name)
    (d / "model.safetensors").write_bytes(b"\x17garbage, not a safetensors header" * 100)
    return d


def _empty_file(tmp: Path) -> Path:
    p = tmp / "empty.txt"
    p.write_text("")
    return p


G32 = ["--set", "stages.0.group_size=32"]  # stories260K: hidden 64, so the recipe's 128 does not fit
BAD = {
    "missing model": (lambda t: ["--model", t / "no-such-model"], "does not exist"),
    "unsupported arch": (lambda t: ["--model", _gpt2_dir(t)], "unsupported architecture `gpt2`; supported: "),
    "corrupt safetensors": (lambda t: ["--model", _corrupt_dir(t), *G32], "corrupt"),
    "empty calibration": (lambda t: ["--model", STORIES260K, *G32, "--calibration", _empty_file(t)], "empty"),
    "seqlen too long": (lambda t: ["--model", STORIES260K, *G32, "--set", "calibration.seqlen=1024"],
                        "calibration.seqlen 1024 exceeds the model's maximum of 512 positions"),
    "bits 9": (lambda t: ["--model", STORIES260K, *G32, "--set", "stages.0.bits=9"], "less than or equal to 8"),
    "bits 1": (lambda t: ["--model", STORIES260K, *G32, "--set", "stages.0.bits=1"], "greater than or equal to 2"),
    "group too large, strict": (lambda t: ["--model", STORIES260K, "--set", "stages.0.group_size=256",
                                           "--set", "stages.0.strict_groups=true"],
                                "layer `model.layers.0.self_attn.q_proj`: in_features 64 < group_size 256"),
    "unknown stage": (lambda t: ["--model", STORIES260K, *G32, "--set", "stages.0.stage=quantise"],
                      "unknown stage `quantise`"),
    "unknown method": (lambda t: ["--model", STORIES260K, *G32, "--set", "stages.0.method=gtpq"],
                       "unknown method `gtpq` for stage `quantize` in --set stages.0.method=gtpq, did you mean `gptq`?"),
    "unknown key": (lambda t: ["--model", STORIES260K, *G32, "--set", "calibration.nsample=8"],
                    "unknown key `nsample` in --set calibration.nsample=8, did you mean `nsamples`?"),
    "unknown option": (lambda t: ["--model", STORIES260K, "--no-such-option"], "No such option: --no-such-option"),
}


def _assert_bad_input(rc: int, err: str, expected: str) -> None:
    assert rc == 1, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err  # --quiet: the error and nothing else
    assert lines[0].startswith("error: ") and expected in lines[0], err


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case, tmp_path):
    make_args, expected = BAD[case]
    out_dir = tmp_path / "out"
    rc, out, err = invoke("run", QUICKSTART, *SMALL, *make_args(tmp_path), "--output", out_dir, "--quiet")
    _assert_bad_input(rc, err, expected)
    assert not out_dir.exists(), sorted(out_dir.rglob("*"))


@pytest.mark.parametrize("where", ["/proc/compress-out", "/sys/compress-out"])
def test_read_only_output_path(where):
    assert not Path(where).exists()
    rc, _, err = invoke("run", QUICKSTART, "--model", STORIES260K, *G32, "--output", where, "--quiet", *SMALL)
    _assert_bad_input(rc, err, f"cannot create output directory `{where}`")
    assert not Path(where).exists()


def test_non_empty_output_needs_resume_or_force(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    rc, _, err = invoke("run", QUICKSTART, "--model", STORIES260K, *G32, "--output", out_dir, "--quiet", *SMALL)
    _assert_bad_input(rc, err, "is not empty; pass --resume")
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"] and (out_dir / "keep.txt").read_text() == "mine"


def test_bad_input_on_eval_and_inspect(tmp_path):
    rc, _, err = invoke("inspect", tmp_path)
    _assert_bad_input(rc, err, "is not a checkpoint directory")
    rc, _, err = invoke("eval", tmp_path / "nope", "--data", WIKI)
    _assert_bad_input(rc, err, "does not exist")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, where):
    args = ["run", QUICKSTART, "--model", tmp_path / "no-such-model", "-o", tmp_path / "o"]
    rc, _, err = invoke(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert rc == 1
    assert "Traceback" in err and "BadInput" in err
    assert err.rstrip().splitlines()[-1].startswith("error: model path")


def test_report_md_keeps_the_digits_of_a_ratio_near_1():
    from compress.eval.report import _fmt

    assert _fmt(1.000206) == "1.00021" and _fmt(0.99987) == "0.99987"
    assert _fmt(1.0) == "1" and _fmt(158.4312) == "158.4" and _fmt(1.5) == "1.5"


def test_kernel_cache_is_keyed_on_the_torch_installation(tmp_path, monkeypatch):
    from compress.kernels import cpu

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    here = cpu._build_dir().name
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert cpu._build_dir().name != here


def test_no_arguments_prints_help_and_exits_1():
    rc, out, err = invoke()
    assert rc == 1
    assert "Usage" in out + err and "Example" in out + err


def test_help_shows_flags_without_a_type():
    """A flag takes no value: `--dry-run`, not `--dry-run <bool>` (typer prints every option's type)."""
    rc, out, _ = invoke("run", "--help")
    assert rc == 0 and "--dry-run" in out and "--output" in out
    assert "<bool>" not in out and "<path>" in out


@pytest.mark.slow  # a measured run (~40 s)
def test_dry_run_memory_estimate_is_within_a_third_of_the_measured_peak(tmp_path):
    """The plan's estimate counts the process and the libraries a run imports, not only the model (it said
    76 MB for a run that peaked at 1182 MB). Both measured in fresh processes."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "compress.cli", "run", str(QUICKSTART), "--model", str(STORIES1M), "-o",
            str(tmp_path / "o"), "--json", "--set", "calibration.nsamples=8", "--set", "stages.0.iters=2",
            "--set", "eval.max_tokens=2048"]
    plan = json.loads(subprocess.run(base + ["--dry-run"], capture_output=True, text=True, check=True).stdout)
    report = json.loads(subprocess.run(base, capture_output=True, text=True, check=True).stdout)
    est, peak = plan["estimated_peak_memory_mb"], report["peak_rss_mb"]
    assert 0.67 * peak <= est <= 1.5 * peak, (est, peak)
