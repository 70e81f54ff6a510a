"""Hub push, model card, quality gates and CI mode, against a Hub on loopback (tests/hub_server.py).

One stories260K run (W4 RTN, exports hf + onnx + openvino, evaluation, passing gates, `push:` in the recipe) is
pushed to the loopback Hub through huggingface_hub; the tests check what arrived byte for byte, load it back
with `from_pretrained` through huggingface_hub's download path (HF_ENDPOINT), run the card's snippets verbatim,
and check the errors, the planted token, the gates' exit codes, JUnit file and the JSON-lines log.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from conftest import CAL, REPO, STORIES260K, invoke, recipe
from hub_server import HubServer

TOKEN = "hf_PLANTEDtokenDoNotLeak0123456789"
REPO_ID = "org/stories260k-w4"
GATES = ["eval.tinystories.ppl_ratio <= 1.5", "size.effective_bits <= 4.6", "eval.*.top1 >= 0.5"]


@pytest.fixture(scope="module")
def hub():
    """The loopback Hub, huggingface_hub pointed at it (online, LFS uploads), a planted token in HF_TOKEN."""
    import huggingface_hub.constants as C

    with HubServer(token=TOKEN) as server, pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "ENDPOINT", server.url)
        mp.setattr(C, "HF_HUB_OFFLINE", False)
        mp.setattr(C, "HF_HUB_DISABLE_XET", True)
        mp.setenv("HF_TOKEN", TOKEN)
        yield server


def _recipe(tmp: Path, *, gates=GATES, push=None, formats=("hf",), generation=False) -> Path:
    path = recipe(tmp, formats=formats, eval_data=[CAL])
    doc = yaml.safe_load(path.read_text())
    doc["gates"] = list(gates)
    if generation:
        doc["eval"]["generation"] = {"prompts": 2, "prompt_tokens": 8, "new_tokens": 8}
    if push:
        doc["push"] = push
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def pushed(hub, tmp_path_factory):
    """A run whose recipe pushes to the loopback Hub after its gates passed: (output, stderr)."""
    tmp = tmp_path_factory.mktemp("pushed")
    path = _recipe(tmp, push={"repo": REPO_ID}, formats=("hf", "onnx", "openvino"), generation=True)
    rc, out, err = invoke("run", path, "-o", tmp / "out", "--ci")
    assert rc == 0, err
    return tmp / "out", out + err


def _env(hub) -> dict:
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
            "HF_TOKEN": TOKEN, "HF_HOME": str(Path(hub.home)), "OMP_NUM_THREADS": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


@pytest.fixture(scope="module")
def hub_home(hub, tmp_path_factory):
    hub.home = tmp_path_factory.mktemp("hf-home")  # huggingface_hub's cache for the downloads
    return hub


def test_the_push_arrives_byte_identical_in_one_commit_and_loads_back(pushed, hub_home):
    out, log = pushed
    hub = hub_home
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["push"]["repo"] == REPO_ID and manifest["push"]["changed"]
    files = hub.files(REPO_ID)
    local = {**{p.relative_to(out / "hf").as_posix(): p for p in (out / "hf").rglob("*") if p.is_file()},
             **{p.relative_to(out).as_posix(): p for d in ("onnx", "openvino") for p in (out / d).rglob("*")
                if p.is_file()},
             **{f"compress/{n}": out / n for n in ("report.json", "report.md", "gates.xml")}}
    for rel, p in local.items():
        assert files[rel] == p.read_bytes(), rel
    assert set(files) == set(local) | {"README.md", "compress/recipe.yaml"}
    assert yaml.safe_load(files["compress/recipe.yaml"]) == manifest["recipe"]
    # one commit on top of the repository's initial one; large files went through LFS
    commits = hub.repos[REPO_ID].commits
    assert len(commits) == 2
    assert hub.routes().count("commit") == 1 and hub.routes().count("upload") >= 3
    assert all(e.lfs for p, e in commits[hub.repos[REPO_ID].refs["main"]]["files"].items()
               if p.endswith((".safetensors", ".onnx", ".bin")))
    # from_pretrained through huggingface_hub's download path gives the local export's logits
    code = f"""
import torch
from transformers import AutoModelForCausalLM
ids = torch.tensor([[1, 300, 20, 77, 5, 9]])
remote = AutoModelForCausalLM.from_pretrained("{REPO_ID}").eval()
local = AutoModelForCausalLM.from_pretrained("{out / 'hf'}").eval()
with torch.no_grad():
    a, b = remote(ids).logits, local(ids).logits
print("DIFF", float((a - b).abs().max()), remote.config._name_or_path)
"""
    res = subprocess.run([sys.executable, "-c", code], env=_env(hub), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    diff = float(re.search(r"DIFF (\S+)", res.stdout).group(1))
    assert diff == 0.0
    assert any(r["route"] == "resolve" and r["path"].endswith("model.safetensors") for r in hub.requests)


@pytest.mark.e2e  # three interpreters loading torch, transformers, onnxruntime and OpenVINO (~40 s)
def test_the_card_has_metadata_metrics_recipe_and_snippets_that_run(pushed, hub_home):
    out, _ = pushed
    hub = hub_home
    card = hub.files(REPO_ID)["README.md"].decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"compress", "rtn", "4-bit", "onnx", "openvino"} <= set(meta["tags"])
    report = json.loads((out / "report.json").read_text())
    metrics = {m["type"]: m["value"] for m in meta["model-index"][0]["results"][0]["metrics"]}
    ev = report["eval"]["tinystories_val.txt"]
    assert metrics["ppl_ratio"] == ev["ppl_ratio"] and metrics["kl"] == ev["kl"] and metrics["top1"] == ev["top1"]
    assert "base_model" not in meta  # a local model: no Hub id to link
    assert hub.cards and hub.cards[-1]["model-index"]  # the Hub validated the front matter
    assert str(report["size"]["effective_bits"]) in card and "## Recipe" in card
    for gate in GATES:
        assert f"`{gate}`" in card
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)
    assert len(blocks) == 3  # transformers, onnxruntime, OpenVINO
    for code in blocks:  # verbatim, against the pushed repository
        res = subprocess.run([sys.executable, "-c", code], env=_env(hub), capture_output=True, text=True,
                             timeout=300, cwd=out.parent)
        assert res.returncode == 0, code + res.stderr[-3000:]
        assert res.stdout.strip(), code


def test_the_token_is_written_nowhere(pushed):
    out, log = pushed
    assert TOKEN not in log
    for p in out.rglob("*"):
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes(), p


def test_a_second_push_of_an_unchanged_run_uploads_nothing(pushed, hub):
    out, _ = pushed
    head = hub.repos[REPO_ID].refs["main"]
    start = len(hub.requests)
    rc, stdout, err = invoke("push", out, "--repo", REPO_ID)
    assert rc == 0, err
    assert "nothing changed" in stdout
    routes = hub.routes()[start:]
    assert "upload" not in routes and "commit" not in routes
    assert hub.repos[REPO_ID].refs["main"] == head


def test_revision_and_pull_request(pushed, hub):
    out, _ = pushed
    rc, stdout, err = invoke("push", out, "--repo", "org/branched", "--revision", "w4", "--private")
    assert rc == 0, err
    repo = hub.repos["org/branched"]
    assert repo.private and set(hub.files("org/branched", "w4")) >= {"README.md", "model.safetensors"}
    assert hub.files("org/branched", "main") == {}
    main = repo.refs["main"]
    rc, stdout, err = invoke("push", out, "--repo", "org/pr", "--create-pr")
    assert rc == 0, err
    assert "pull request:" in stdout and hub.repos["org/pr"].refs["refs/pr/1"]
    assert hub.files("org/pr", "main") == {}  # the PR's commit is not on main
    assert repo.refs["main"] == main


def test_dry_run_lists_files_sizes_and_the_card_without_contacting_anything(pushed, monkeypatch):
    import huggingface_hub.constants as C

    out, _ = pushed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(C, "ENDPOINT", f"http://127.0.0.1:{port}")  # nothing listens there
    rc, stdout, err = invoke("push", out, "--repo", "org/dry", "--dry-run")
    assert rc == 0, err
    assert "model.safetensors" in stdout and "onnx/model.onnx" in stdout and "--- README.md ---" in stdout
    size = (out / "hf" / "model.safetensors").stat().st_size
    assert re.search(rf"{size:,}\s+model.safetensors", stdout)


@pytest.mark.parametrize("case", ["401", "403", "404", "upload-403", "503-retried", "503-persistent", "refused"])
def test_push_errors_exit_2_with_a_clear_message_and_leave_no_half_pushed_revision(pushed, hub, monkeypatch, case):
    import huggingface_hub.constants as C

    out, _ = pushed
    repo = f"org/errors-{case}"
    if case == "401":
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    elif case == "403":
        repo = "someone-else/model"
    elif case == "404":
        hub.fail("preupload", 404)
    elif case == "upload-403":  # a large file's upload refused (huggingface_hub wraps it in a RuntimeError)
        hub.fail("upload", 403, times=10)
    elif case == "503-retried":
        hub.fail("commit", 503, times=1)
    elif case == "503-persistent":
        hub.fail("commit", 503, times=3)
    elif case == "refused":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setattr(C, "ENDPOINT", f"http://127.0.0.1:{port}")
    rc, stdout, err = invoke("push", out, "--repo", repo)
    hub.failures.clear()
    if case == "503-retried":
        assert rc == 0, err
        assert len(hub.files(repo)) > 5
        return
    assert rc == 2, err
    expected = {"401": "authentication failed: set HF_TOKEN", "403": "no write access to `someone-else/model`",
                "404": "was not found", "upload-403": "no write access to `org/errors-upload-403`",
                "503-persistent": "answered 503 after 3 attempts",
                "refused": "cannot reach http://127.0.0.1"}[case]
    assert expected in err and "nothing was committed" in err and "Traceback" not in err
    assert TOKEN not in err
    if repo in hub.repos:  # created, but no commit beyond the initial one
        assert hub.files(repo) == {}


def test_a_run_that_failed_its_gates_exits_3_marks_them_and_does_not_push(hub, tmp_path):
    gates = ["eval.tinystories_val.ppl_ratio <= 1.0001", "size.effective_bits <= 4.6"]
    path = _recipe(tmp_path, gates=gates, push={"repo": "org/never"})
    rc, stdout, err = invoke("run", path, "-o", tmp_path / "out", "--quiet")
    assert rc == 3, err
    assert "1 of 2 gates failed" in err and "eval.tinystories_val.ppl_ratio <= 1.0001: measured" in err
    assert "margin -" in err and "org/never" not in hub.repos
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    failed, passed = report["gates"]
    assert not failed["passed"] and failed["margin"] < 0 and failed["value"] == report["eval"]["tinystories_val.txt"]["ppl_ratio"]
    assert passed["passed"] and passed["margin"] == pytest.approx(4.6 - report["size"]["effective_bits"])
    suite = ET.parse(tmp_path / "out" / "gates.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")
    cases = suite.findall("testcase")
    assert cases[0].find("failure") is not None and cases[1].find("failure") is None
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Gates" in md and "| FAIL | `eval.tinystories_val.ppl_ratio <= 1.0001`" in md
    rc, _, err = invoke("push", tmp_path / "out", "--repo", "org/never")  # push refuses such a run
    assert rc == 1 and "gates failed" in err
    assert invoke("verify", tmp_path / "out")[0] == 0


@pytest.mark.parametrize("gate, message", [
    ("eval.wikitext.ppl_ratio <= 1.05", "no evaluation file `wikitext`; the recipe evaluates tinystories_val.txt"),
    ("eval.tinystories.perplexity <= 5", "has no `perplexity`; it has fp_ppl, ppl, ppl_ratio"),
    ("size.bits <= 4", "`size` has no `bits`"),
    ("speed.tokens_per_s >= 10", "the report has no section `speed`"),
    ("eval.tinystories.gen_agree >= 0.9", "has no `gen_agree`"),  # generation is off in this recipe
])
def test_gates_are_checked_against_the_report_keys_at_plan_time(tmp_path, gate, message):
    path = _recipe(tmp_path, gates=[gate])
    rc, _, err = invoke("run", path, "-o", tmp_path / "out", "--dry-run")
    assert rc == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gate", ["ppl_ratio < ", "eval.x.ppl_ratio ~ 1", "eval.x.ppl_ratio <= one"])
def test_a_malformed_gate_is_a_recipe_error(tmp_path, gate):
    rc, _, err = invoke("validate", _recipe(tmp_path, gates=[gate]))
    assert rc == 1 and "write `PATH OP NUMBER`" in err


def test_ci_mode_logs_json_lines_and_writes_checksums_and_a_summary(tmp_path, monkeypatch):
    step = tmp_path / "step-summary.md"
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    rc, stdout, err = invoke("run", _recipe(tmp_path), "-o", tmp_path / "out")
    assert rc == 0, err
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert any(r["message"].startswith("report:") for r in records)
    assert "\r" not in err and "it/s" not in err  # no progress bars
    out = tmp_path / "out"
    sums = (out / "SHA256SUMS").read_text()
    assert "hf/model.safetensors" in sums and "stages/" not in sums and "report.json" in sums
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    summary = (out / "summary.md").read_text()
    assert summary in stdout and step.read_text() == summary and len(summary.splitlines()) < 40
    assert "**gates: 3 of 3 passed**" in summary
    assert invoke("verify", out)[0] == 0  # SHA256SUMS and summary.md are not foreign files


def test_report_paths_name_exactly_what_a_run_reports(pushed):
    """The gates' plan-time schema and report.json agree (both ways) for eval (with generation) and size."""
    from compress.gates import report_paths
    from compress.recipe import load_recipe

    out, _ = pushed
    report = json.loads((out / "report.json").read_text())
    numeric = set()

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict) and k != "dense":
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                numeric.add(f"{prefix}{k}")

    walk({k: report[k] for k in ("eval", "size", "seconds", "peak_rss_mb")}, "")
    numeric -= {"eval.tinystories_val.txt.gen_prompts", "eval.tinystories_val.txt.gen_new_tokens",
                "size.stored.hf.tensor_bytes"}  # settings echoed and a layout detail: not gated on
    paths = report_paths(load_recipe(next(out.parent.glob("recipe-*.yaml"))).recipe, "causal", ["hf", "onnx", "openvino"])
    schema = {f"{s}.{m}".lstrip(".") for s, ms in paths.items() for m in ms}
    assert schema == numeric


def test_the_bundled_gates_recipe_validates():
    rc, out, err = invoke("validate", REPO / "recipes" / "ci-w4-gates.yaml")
    assert rc == 0, err


def test_a_hub_model_path_is_the_cards_base_model():
    from compress.publish.card import looks_like_hub_id

    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M")
    assert not looks_like_hub_id(str(STORIES260K)) and not looks_like_hub_id("./a/b") and not looks_like_hub_id("a/b/c")


@pytest.mark.e2e  # GPTQ on ref-llama-7m and five interpreters (~90 s)
def test_the_example_workflows_commands_run(hub, tmp_path):
    """examples/ci/compress.yml, step by step: its `run` commands in bash with the job's environment, the base model
    downloaded from (and the result pushed to) the loopback Hub; only the install step is left out."""
    from conftest import MODELS, TEXT
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url)
    api.create_repo("org/base", exist_ok=True)
    api.upload_folder(folder_path=str(MODELS / "ref-llama-7m"), repo_id="org/base")
    wf = yaml.safe_load((REPO / "examples" / "ci" / "compress.yml").read_text())
    job = wf["jobs"]["compress"]
    github = {"${{ vars.HUB_REPO }}": "org/from-ci", "${{ github.workspace }}": str(tmp_path),
              "${{ secrets.HF_TOKEN }}": TOKEN}

    def expand(value: str) -> str:
        for k, v in github.items():
            value = value.replace(k, v)
        assert "${{" not in value, value
        return value

    env = {**os.environ, **{k: expand(str(v)) for k, v in job["env"].items()}, "HF_ENDPOINT": hub.url,
           "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", "MODEL": "org/base", "OUT": str(tmp_path / "out"),
           "CALIBRATION": str(TEXT / "wikitext-2" / "valid.txt"),
           "EVAL_DATA": str(TEXT / "wikitext-2-raw" / "wiki.test.raw")}
    env.pop("HF_TOKEN", None)  # only the push step gets it, from its own env
    assert env["HF_HOME"] == expand(next(s for s in job["steps"] if "cache" in s.get("name", ""))["with"]["path"])
    ran = []
    for step in job["steps"]:
        if "run" not in step or step["name"] == "install":  # the packages are installed here already
            continue
        step_env = {**env, **{k: expand(str(v)) for k, v in (step.get("env") or {}).items()}}
        res = subprocess.run(["bash", "-e", "-c", step["run"]], env=step_env, cwd=REPO, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, f"{step['name']}: {res.stdout[-2000:]}{res.stderr[-3000:]}"
        ran.append(step["name"])
        if step["name"].startswith("compress,"):
            assert "**gates: 3 of 3 passed**" in res.stdout and all(json.loads(x) for x in res.stderr.splitlines()
                                                                   if x.startswith("{"))
    assert len(ran) == 4
    assert any(r["route"] == "resolve" and r["path"].startswith("/org/base/") for r in hub.requests)
    files = hub.files("org/from-ci")
    out = tmp_path / "out"
    assert files["model.safetensors"] == (out / "hf" / "model.safetensors").read_bytes()
    assert ET.parse(out / "gates.xml").getroot().find("testsuite").get("failures") == "0"
    card = yaml.safe_load(files["README.md"].decode().split("---")[1])
    assert card["base_model"] == "org/base"  # a Hub id: the card links it


def test_the_card_copies_the_base_models_license_and_links_a_hub_base(tmp_path):
    from compress.publish.card import render

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# base\n")
    manifest = {"recipe": {"model": {"path": str(base)}, "stages": [{"stage": "quantize", "method": "gptq", "bits": 3}]},
                "exports": {"hf": {"directory": "hf"}}}
    report = {"model": "base", "eval": {"wiki.test.raw": {"ppl_ratio": 1.01, "kl": 0.002, "top1": 0.97}},
              "size": {"effective_bits": 3.125, "bytes": 2**20, "fp_bytes": 2**22, "quantized_layers": 7}}
    meta = yaml.safe_load(render(manifest, report, "org/m", {"hf": ""}).split("---")[1])
    assert meta["license"] == "apache-2.0" and "base_model" not in meta and {"gptq", "3-bit"} <= set(meta["tags"])
    meta = yaml.safe_load(render(manifest, report, "org/m", {"hf": ""}, base_model="meta-llama/Llama-3.2-1B")
                          .split("---")[1])
    assert meta["base_model"] == "meta-llama/Llama-3.2-1B"
    (base / "README.md").write_text("no front matter")
    assert "license" not in yaml.safe_load(render(manifest, report, "org/m", {"hf": ""}).split("---")[1])


def test_an_encoders_card_says_feature_extraction_and_its_snippet_runs(tmp_path):
    """An encoder run (a tiny BERT with stories260K's tokenizer, RTN W4): the card's transformers snippet, pointed at
    the local export instead of the Hub, embeds a sentence."""
    import shutil

    import transformers as T

    from compress.publish.hub import plan

    bert = tmp_path / "bert"
    T.BertModel(T.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=512, max_position_embeddings=128)).save_pretrained(bert)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(STORIES260K / f, bert)
    rc, _, err = invoke("run", recipe(tmp_path), "--model", bert, "-o", tmp_path / "out", "--quiet")
    assert rc == 0, err
    _, card = plan(tmp_path / "out", "org/enc")
    assert yaml.safe_load(card.split("---")[1])["pipeline_tag"] == "feature-extraction"
    (code,) = re.findall(r"```python\n(.*?)```", card, re.S)
    res = subprocess.run([sys.executable, "-c", code.replace('"org/enc"', repr(str(tmp_path / "out" / "hf")))],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "embedding: (1, 64)" in res.stdout
