"""A run never destroys what it did not create (hardening items 1-5).

- the output may not be or contain an input; `--force` only replaces an earlier run's directory;
- export directories stay inside the output, each in its own directory;
- one run at a time holds an output directory (an exclusive lock naming its pid);
- `--resume` is keyed on the content of the model and calibration files, not their paths;
- every data file is read at plan time, and a failure after a finished stage keeps that stage.

Runs are in-process (`invoke`) on stories260K with RTN or GPTQ g32 and no evaluation: a second each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import CAL, STORIES260K, held_lock, invoke, recipe, run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")



def snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file below `root`."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def export_bytes(out: Path) -> bytes:
    return (out / "hf" / "model.safetensors").read_bytes()


# -- 1. --force and inputs ---------------------------------------------------------------------------------
def test_force_never_clears_the_input_model(tmp_path):
    model = tmp_path / "v"
    shutil.copytree(STORIES260K, model)
    before = snapshot(model)
    rc, err = run(recipe(tmp_path), "--model", model, "--output", model, "--force")
    assert rc == 1 and f"output directory `{model}` is the model" in err, err
    assert snapshot(model) == before


def test_output_may_not_contain_an_input(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    cal = data / "cal.txt"
    shutil.copy(CAL, cal)
    before = snapshot(tmp_path)
    rc, err = run(recipe(data, cal=cal), "--output", tmp_path, "--force")  # the recipe and cal.txt live below
    assert rc == 1 and "contains the" in err and "choose another --output" in err, err
    assert "recipe-0.yaml" not in before and snapshot(tmp_path) == {**before, **snapshot(tmp_path)}
    assert cal.read_bytes() == CAL.read_bytes()


@pytest.mark.parametrize("flag", ["--force", "--resume"])
def test_force_and_resume_take_only_a_directory_a_run_wrote(tmp_path, flag):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "manifest.json").write_text('{"written by": "another tool"}')
    before = snapshot(out)
    rc, err = run(recipe(tmp_path), "--output", out, flag)
    assert rc == 1 and "holds files that no compress run wrote" in err, err
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["manifest.json", "notes.txt"]


def test_force_replaces_an_earlier_runs_directory(tmp_path):
    out = tmp_path / "out"
    r = recipe(tmp_path)
    assert run(r, "--output", out)[0] == 0
    (out / "stale.txt").write_text("left by the earlier run's user")
    rc, err = run(r, "--output", out, "--force")
    assert rc == 0, err
    assert not (out / "stale.txt").exists() and (out / "hf" / "config.json").is_file()
    assert not (out / ".compress.lock").exists()  # the lock goes with the run


# -- 2. export directories ------------------------------------------------------------------------------
@pytest.mark.parametrize("directory, expected", [
    ("../outside", "must be a relative path inside the output directory"),
    ("/tmp/outside", "must be a relative path inside the output directory"),
    (".", "must be a relative path inside the output directory"),
    ("a/../../b", "must be a relative path inside the output directory"),
    ("stages", "is a name the run itself uses"),
    ("hf", "each export needs a directory of its own"),
    ("hf/onnx", "each export needs a directory of its own"),
])
def test_export_directories_stay_inside_the_output_each_its_own(tmp_path, directory, expected):
    r = recipe(tmp_path, formats=("hf", {"format": "onnx", "directory": directory}))
    rc, _, err = invoke("validate", r)
    assert rc == 1 and expected in err, err
    out = tmp_path / "out"
    rc, err = run(r, "--output", out)
    assert rc == 1 and expected in err, err
    assert not out.exists()


def test_an_export_path_that_leads_outside_through_a_symlink_is_refused(tmp_path):
    victim = tmp_path / "victim"
    shutil.copytree(STORIES260K, victim)
    before = snapshot(victim)
    out = tmp_path / "out"
    r = recipe(tmp_path)
    assert run(r, "--output", out)[0] == 0
    shutil.rmtree(out / "hf")
    (out / "hf").symlink_to(victim, target_is_directory=True)
    rc, err = run(r, "--output", out, "--resume")
    assert rc == 1 and "leads outside the output directory" in err, err
    assert snapshot(victim) == before


# -- 3. one run per output directory ----------------------------------------------------------------------
def test_a_second_run_on_a_held_output_exits_1_naming_the_holder_and_touches_nothing(tmp_path):
    out = tmp_path / "out"
    r = recipe(tmp_path)
    assert run(r, "--output", out)[0] == 0
    before = snapshot(out)
    with held_lock(out / ".compress.lock") as holder:
        for flags in ([], ["--force"], ["--resume"]):
            rc, err = run(r, "--output", out, *flags)
            assert rc == 1 and f"is in use by another compress run (pid {holder})" in err, (flags, err)
            assert snapshot(out) == {**before, ".compress.lock": snapshot(out)[".compress.lock"]}
        fresh = tmp_path / "fresh"  # a lock in an otherwise empty directory: the loser cleans nothing up
        fresh.mkdir()
        with held_lock(fresh / ".compress.lock") as other:
            rc, err = run(r, "--output", fresh)
            assert rc == 1 and f"pid {other}" in err, err
            assert [p.name for p in fresh.iterdir()] == [".compress.lock"]
    rc, err = run(r, "--output", out, "--resume")  # a dead holder's lock file holds nothing
    assert rc == 0, err


def test_the_lock_is_released_however_the_run_ends(tmp_path):
    from compress.workspace import LOCK, Workspace

    with Workspace(tmp_path / "out"):
        with pytest.raises(Exception, match=f"in use by another compress run \\(pid {os.getpid()}\\)"):
            Workspace(tmp_path / "out", resume=True)
    assert not (tmp_path / "out" / LOCK).exists()
    with pytest.raises(RuntimeError):
        with Workspace(tmp_path / "out", resume=True):
            raise RuntimeError("a run that fails")
    with Workspace(tmp_path / "out", resume=True) as ws:
        assert (tmp_path / "out" / LOCK).read_text() == f"{os.getpid()}\n" and ws.manifest["format"]


# -- 4. resume keyed on content ----------------------------------------------------------------------------
def test_resume_recomputes_when_the_calibration_content_changes(tmp_path):
    cal = tmp_path / "cal.txt"
    text = CAL.read_text()
    cal.write_text(text)
    r = recipe(tmp_path, method="gptq", cal=cal)
    first, clean = tmp_path / "first", tmp_path / "clean"
    assert run(r, "--output", first)[0] == 0
    old = export_bytes(first)
    cal.write_text(text[len(text) // 2:])  # same path, other content
    assert run(r, "--output", clean)[0] == 0
    rc, err = run(r, "--output", first, "--resume")
    assert rc == 0, err
    assert export_bytes(first) == export_bytes(clean) != old
    log = (first / "run.log").read_text()
    assert "calibration `" in log and "cal.txt`: content changed" in log and "every stage is recomputed" in log
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["inputs"]["calibration"][str(cal)] == hashlib.sha256(cal.read_bytes()).hexdigest()
    assert set(manifest["inputs"]["model"]) >= {"model.safetensors", "config.json", "tokenizer.model"}


def test_resume_recomputes_when_the_model_weights_change(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(STORIES260K, model)
    r = recipe(tmp_path)
    out = tmp_path / "out"
    assert run(r, "--model", model, "--output", out)[0] == 0
    old = export_bytes(out)
    tensors = load_file(str(model / "model.safetensors"))
    tensors = {k: (v * 1.5 if k.endswith("mlp.up_proj.weight") else v) for k, v in tensors.items()}
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    rc, err = run(r, "--model", model, "--output", out, "--resume")
    assert rc == 0, err
    assert export_bytes(out) != old
    assert "model `model.safetensors`: content changed" in (out / "run.log").read_text()
    assert torch.equal(load_file(str(model / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"],
                       tensors["model.layers.0.mlp.up_proj.weight"])


def test_resume_refuses_calibration_that_tokenizes_differently(tmp_path):
    r = recipe(tmp_path, method="gptq")
    out = tmp_path / "out"
    assert run(r, "--output", out)[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["inputs"]["calibration_tokens_sha256"]) == 64
    manifest["inputs"]["calibration_tokens_sha256"] = "0" * 64  # as another tokenizer version would give
    manifest["stages"]["00-quantize-gptq"]["status"] = "running"
    (out / "manifest.json").write_text(json.dumps(manifest))
    rc, err = run(r, "--output", out, "--resume")
    assert rc == 1 and "the tokenized calibration differs from the earlier run's" in err, err
    assert (out / "stages").is_dir() and (out / "manifest.json").is_file()


# -- 5. inputs at plan time; finished stages are kept -----------------------------------------------------
@pytest.mark.parametrize("content, expected", [
    (b"\xff\xfe\x00binary\x00" * 50, "cannot read as UTF-8 text"),
    (b"   \n\n", "the file is empty"),
], ids=["binary", "blank"])
def test_a_bad_eval_file_fails_before_any_work(tmp_path, content, expected):
    bad = tmp_path / "eval.txt"
    bad.write_bytes(content)
    r = recipe(tmp_path, eval_data=[bad])
    out = tmp_path / "out"
    for flags in (["--dry-run"], []):
        t0 = time.time()
        rc, err = run(r, "--output", out, *flags)
        assert rc == 1 and expected in err and "eval.data.0" in err, err
        assert not out.exists()
        assert time.time() - t0 < 30


def test_a_bad_calibration_jsonl_fails_at_plan_time(tmp_path):
    cal = tmp_path / "cal.jsonl"
    cal.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    rc, err = run(recipe(tmp_path, cal=cal), "--output", tmp_path / "out", "--dry-run")
    assert rc == 1 and "cal.jsonl:2: expected an object with a string field 'text'" in err, err


def test_a_bad_input_after_a_finished_stage_keeps_it_for_resume(tmp_path, monkeypatch):
    from typing import Literal

    from compress import registry
    from compress.config import StrictModel
    from compress.errors import BadInput

    def fail(ctx, cfg):
        raise BadInput("an input went bad after the first stage")

    class QFail(StrictModel):
        stage: Literal["fail-test"] = "fail-test"
        method: Literal["after"] = "after"

    monkeypatch.setitem(registry._REGISTRY, ("fail-test", "after"), registry.Entry("fail-test", "after", QFail, fail))
    r = recipe(tmp_path, method="gptq", extra_stages=[{"stage": "fail-test", "method": "after"}])
    out = tmp_path / "out"
    rc, err = run(r, "--output", out)
    assert rc == 1 and "an input went bad after the first stage" in err, err
    assert "the finished stages are kept" in err and "--resume" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"]["00-quantize-gptq"]["status"] == "done"
    blocks = sorted((out / "stages" / "00-quantize-gptq").glob("block_*.safetensors"))
    assert len(blocks) == 5
    stamp = {p.name: p.stat().st_mtime_ns for p in blocks}
    rc, err = run(recipe(tmp_path, method="gptq"), "--output", out, "--resume")  # the input fixed
    assert rc == 0, err
    assert {p.name: p.stat().st_mtime_ns for p in blocks} == stamp  # loaded, not recomputed
    assert "finished earlier" in (out / "run.log").read_text()


# -- 11. checksums ----------------------------------------------------------------------------------------
def _flip(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_artifact_is_checksummed_and_flipped_bytes_are_caught(tmp_path):
    out = tmp_path / "out"
    assert run(recipe(tmp_path, method="gptq"), "--output", out)[0] == 0
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert {"hf/model.safetensors", "hf/config.json", "report.json", "report.md",
            "stages/00-quantize-gptq/block_0000.safetensors"} <= set(files)
    assert all(hashlib.sha256((out / rel).read_bytes()).hexdigest() == sha for rel, sha in files.items())
    rc, stdout, err = invoke("verify", out)
    assert rc == 0 and f"ok: {len(files)} files match" in stdout, err
    _flip(out / "hf" / "model.safetensors")
    (out / "hf" / "extra.bin").write_bytes(b"x")
    rc, _, err = invoke("verify", out)
    assert rc == 1 and "bad hf/model.safetensors: content changed" in err and "hf/extra.bin: not written" in err
    for command in (["inspect", out / "hf"], ["eval", out / "hf", "--data", CAL, "--max-tokens", 256]):
        rc, _, err = invoke(*command)
        assert rc == 1 and "does not match the checksums" in err and "hf/model.safetensors" in err, (command, err)


def test_a_corrupt_stage_checkpoint_is_recomputed_on_resume(tmp_path):
    r = recipe(tmp_path, method="gptq")
    out, clean = tmp_path / "out", tmp_path / "clean"
    assert run(r, "--output", out)[0] == 0
    assert run(r, "--output", clean)[0] == 0
    block = out / "stages" / "00-quantize-gptq" / "block_0002.safetensors"
    _flip(block, at=-8)
    others = {p.name: p.stat().st_mtime_ns for p in block.parent.iterdir() if p != block}
    rc, err = run(r, "--output", out, "--resume")
    assert rc == 0, err
    assert "block_0002.safetensors` does not match the sha256 recorded" in (out / "run.log").read_text()
    assert export_bytes(out) == export_bytes(clean)
    assert {p.name: p.stat().st_mtime_ns for p in block.parent.iterdir() if p != block} == others
    assert invoke("verify", out)[0] == 0


def test_a_clean_up_that_cannot_remove_a_file_never_hides_the_runs_error(tmp_path, monkeypatch, caplog):
    from compress import workspace
    from compress.workspace import Workspace

    ws = Workspace(tmp_path / "out")
    (tmp_path / "out" / "stages").mkdir()

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(workspace.shutil, "rmtree", refuse)
    with caplog.at_level("WARNING"):
        ws.discard()  # logs, never raises over the run's own error
    assert "could not remove" in caplog.text and (tmp_path / "out" / "stages").is_dir()
    assert not (tmp_path / "out" / ".compress.lock").exists()
