"""Recipe loading: schema, file:line errors with suggestions, interpolation, overrides, hashing, paths."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from compress.errors import BadInput
from compress.quantize.autoround import AutoRoundConfig
from compress.quantize.rtn import RTNConfig
from compress.recipe import LoadedRecipe, Recipe, describe, load_recipe, validate_paths

VALID = """\
version: 1
description: "AutoRound W4 g128 on SmolLM2"
model:
  path: HuggingFaceTB/SmolLM2-135M
  dtype: float32
calibration:
  sources: [calib.txt]
  nsamples: 128
  seqlen: 512
  seed: 0
stages:
  - stage: quantize
    method: autoround
    bits: 4
    group_size: 128
    sym: true
    iters: 50
eval:
  data: [test.raw]
  window: 256
  max_tokens: 20000
  text_slice: [0.0, 0.5]
export:
  formats: [hf, {format: fake}]
"""


def write(tmp_path, text: str, name: str = "recipe.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def error_of(path, **kw) -> str:
    with pytest.raises(BadInput) as ei:
        load_recipe(path, **kw)
    return str(ei.value)


def edit(line_no: int, new: str) -> str:
    """VALID with 1-based line `line_no` replaced by `new`."""
    lines = VALID.splitlines()
    lines[line_no - 1] = new
    return "\n".join(lines) + "\n"


# -- valid recipes ---------------------------------------------------------------------------------
def test_valid_recipe_round_trip(tmp_path):
    p = write(tmp_path, VALID)
    loaded = load_recipe(p)
    r = loaded.recipe
    assert isinstance(loaded, LoadedRecipe) and isinstance(r, Recipe) and loaded.path == p
    assert r.model.path == "HuggingFaceTB/SmolLM2-135M" and r.model.dtype == "float32"
    assert r.calibration.sources == ["calib.txt"] and r.calibration.text_field == "text"
    [cfg] = r.stage_configs
    assert isinstance(cfg, AutoRoundConfig) and (cfg.bits, cfg.group_size, cfg.iters) == (4, 128, 50)
    assert r.eval.text_slice == (0.0, 0.5) and r.eval.max_tokens == 20000 and r.eval.enabled
    assert r.export.names() == ["hf", "fake"]
    # resolved: JSON-serialisable, defaults filled in, paths kept as written
    json.dumps(loaded.resolved)
    assert loaded.resolved["stages"][0]["lr"] is None  # an AutoRound default
    assert loaded.resolved["calibration"]["sources"] == ["calib.txt"]
    assert len(loaded.sha256) == 64
    # writing the resolved recipe back and loading it gives the same recipe and hash
    again = load_recipe(write(tmp_path, yaml.safe_dump(loaded.resolved), "resolved.yaml"))
    assert again.resolved == loaded.resolved and again.sha256 == loaded.sha256


def test_minimal_recipe_defaults(tmp_path):
    p = write(tmp_path, """\
        version: 1
        model: {path: org/name}
        stages: [{stage: quantize, method: rtn}]
    """)
    r = load_recipe(p).recipe
    assert isinstance(r.stage_configs[0], RTNConfig)
    assert r.calibration.nsamples == 128 and r.eval.data == [] and r.export.formats == []
    assert r.description == ""


def test_recipe_model_validate_standalone_uses_registry():
    r = Recipe.model_validate({"version": 1, "model": {"path": "a/b"},
                               "stages": [{"stage": "quantize", "method": "rtn", "bits": 3}]})
    assert isinstance(r.stage_configs[0], RTNConfig) and r.stage_configs[0].bits == 3
    with pytest.raises(ValueError, match="did you mean `gptq`"):
        Recipe.model_validate({"version": 1, "model": {"path": "a/b"},
                               "stages": [{"stage": "quantize", "method": "gpq"}]})


def test_describe(tmp_path):
    assert describe(write(tmp_path, VALID)) == "AutoRound W4 g128 on SmolLM2"
    # no full validation: a recipe with an unknown key still describes itself
    assert describe(write(tmp_path, "version: 1\ndescription: hi\nbogus: 1\n", "b.yaml")) == "hi"
    assert describe(write(tmp_path, "version: 1\n", "c.yaml")) == ""


# -- errors name file:line:key and suggest -----------------------------------------------------------
@pytest.mark.parametrize("line, text, key, suggestion", [
    (15, "    group_sise: 128", "group_sise", "group_size"),  # stage config
    (6, "calibraton:", "calibraton", "calibration"),  # top level
    (20, "  windw: 256", "windw", "window"),  # nested section
])
def test_unknown_key_names_line_and_suggests(tmp_path, line, text, key, suggestion):
    p = write(tmp_path, edit(line, text))
    assert f"unknown key `{key}` at {p}:{line}, did you mean `{suggestion}`?" in error_of(p)


def test_wrong_value(tmp_path):
    p = write(tmp_path, edit(14, "    bits: 9"))
    assert error_of(p) == f"`bits` at {p}:14: Input should be less than or equal to 8"
    p = write(tmp_path, edit(5, "  dtype: bfloat61"))
    msg = error_of(p)
    assert msg.startswith(f"`dtype` at {p}:5: Input should be") and "did you mean `bfloat16`?" in msg
    p = write(tmp_path, edit(22, "  text_slice: [0.5, 0.2]"))
    assert error_of(p) == f"`text_slice` at {p}:22: must be [start, end] with 0 <= start < end <= 1"


def test_unknown_stage_and_method(tmp_path):
    p = write(tmp_path, edit(12, "  - stage: quantise"))
    assert error_of(p) == f"unknown stage `quantise` at {p}:12, did you mean `quantize`? (known: allocate, finetune, heal, prune, quantize, rotate, select, smooth)"
    p = write(tmp_path, edit(13, "    method: autorund"))
    msg = error_of(p)
    assert msg.startswith(f"unknown method `autorund` for stage `quantize` at {p}:13, did you mean `autoround`?")
    assert "(known: autoround, gptq, rtn" in msg
    p = write(tmp_path, edit(24, "  formats: [hf, onx]"))
    assert error_of(p) == (f"unknown export format `onx` at {p}:24, did you mean `onnx`? "
                           "(known: compressed-tensors, fake, gguf, hf, onnx, openvino)")


def test_missing_required_keys(tmp_path):
    p = write(tmp_path, edit(4, "  gguf_file: null"))
    assert error_of(p) == f"missing required key `path` in `model` at {p}:3"
    p = write(tmp_path, edit(13, "    mode: x"))
    assert f"missing required key `method` in `stages.0` at {p}:12" in error_of(p)
    p = write(tmp_path, VALID.replace("version: 1\n", "# no version\n"))
    assert error_of(p).startswith(f"missing required key `version` at {p}:2")


def test_bad_yaml_syntax(tmp_path):
    p = write(tmp_path, edit(14, "    bits: [4"))
    assert error_of(p) == (f"bad YAML at {p}:15: expected ',' or ']', but got ':' "
                           "(while parsing a flow sequence started at line 14)")
    p = write(tmp_path, "version: 1\nmodel:\n  path: a/b\n   dtype: x: y\n")
    assert error_of(p).startswith(f"bad YAML at {p}:4: ")


def test_non_mapping_top_level_and_empty(tmp_path):
    p = write(tmp_path, "- version: 1\n")
    assert error_of(p) == f"the top level of a recipe must be a mapping, got a list at {p}:1"
    p = write(tmp_path, "# nothing\n")
    assert "is empty" in error_of(p)
    assert "does not exist" in error_of(tmp_path / "nope.yaml")


def test_unsupported_version(tmp_path):
    p = write(tmp_path, VALID.replace("version: 1", "version: 2"))
    assert error_of(p) == f"unsupported recipe version `2` at {p}:1; this compress reads version 1"


def test_duplicate_key(tmp_path):
    p = write(tmp_path, edit(16, "    bits: 3"))
    assert error_of(p) == f"duplicate key `bits` at {p}:16 (first at line 14)"


def test_multiple_errors_one_per_line_in_file_order(tmp_path):
    text = edit(20, "  windw: 256").replace("    bits: 4", "    bits: 1").replace("dtype: float32", "dtipe: x")
    p = write(tmp_path, text)
    assert error_of(p).splitlines() == [
        f"unknown key `dtipe` at {p}:5, did you mean `dtype`?",
        f"`bits` at {p}:14: Input should be greater than or equal to 2",
        f"unknown key `windw` at {p}:20, did you mean `window`?",
    ]


# -- ${ENV} interpolation -------------------------------------------------------------------------------
def test_env_interpolation(tmp_path, monkeypatch):
    monkeypatch.setenv("CMP_MODEL", "org/from-env")
    monkeypatch.setenv("CMP_BITS", "3")
    monkeypatch.delenv("CMP_UNSET", raising=False)
    text = (edit(4, "  path: ${CMP_MODEL}").replace("    bits: 4", "    bits: ${CMP_BITS}")
            .replace("[calib.txt]", "['${CMP_UNSET:-data}/calib.txt', '$${LITERAL}']"))
    loaded = load_recipe(write(tmp_path, text))
    assert loaded.recipe.model.path == "org/from-env"
    assert loaded.recipe.stage_configs[0].bits == 3 and loaded.resolved["stages"][0]["bits"] == 3
    assert loaded.recipe.calibration.sources == ["data/calib.txt", "${LITERAL}"]


def test_env_unset_is_an_error_naming_variable_file_and_line(tmp_path, monkeypatch):
    monkeypatch.delenv("CMP_UNSET", raising=False)
    p = write(tmp_path, edit(4, "  path: ${CMP_UNSET}/model"))
    msg = error_of(p)
    assert msg.startswith(f"environment variable `CMP_UNSET` is not set (used by `model.path` at {p}:4)")
    monkeypatch.setenv("CMP_EMPTY", "")
    assert load_recipe(write(tmp_path, edit(4, "  path: ${CMP_EMPTY:-a/b}"))).recipe.model.path == "a/b"
    assert "malformed `${1X}`" in error_of(write(tmp_path, edit(4, "  path: ${1X}")))


# -- --set overrides ------------------------------------------------------------------------------------
def test_set_overrides(tmp_path):
    p = write(tmp_path, VALID)
    loaded = load_recipe(p, overrides=["stages.0.bits=3", "calibration.nsamples=16", "eval.enabled=false",
                                       "eval.data.0=other.raw", "model.gguf_file=", "description=x: y z"])
    r = loaded.recipe
    assert r.stage_configs[0].bits == 3 and r.calibration.nsamples == 16 and r.eval.enabled is False
    assert r.eval.data == ["other.raw"] and r.model.gguf_file is None
    assert loaded.resolved["stages"][0]["bits"] == 3 and loaded.recipe.description == "x: y z"


def test_set_switching_method_revalidates(tmp_path):
    text = VALID.replace("    iters: 50\n", "")
    r = load_recipe(write(tmp_path, text), overrides=["stages.-1.method=rtn"]).recipe
    assert isinstance(r.stage_configs[0], RTNConfig)
    p = write(tmp_path, VALID)
    assert error_of(p, overrides=["stages.0.method=rtn"]).startswith(f"unknown key `iters` at {p}:17")
    assert error_of(p, overrides=["stages.0.method=rtn", "stages.0.foo=1"]).splitlines()[1] == (
        "unknown key `foo` in --set stages.0.foo=1 (valid keys: " + ", ".join(RTNConfig.model_fields) + ")")


def test_set_bad_key_suggests(tmp_path):
    p = write(tmp_path, VALID)
    assert error_of(p, overrides=["stages.0.group_sise=64"]) == (
        "unknown key `group_sise` in --set stages.0.group_sise=64, did you mean `group_size`?")
    assert error_of(p, overrides=["calibraton.nsamples=16"]) == (
        "unknown key `calibraton` in --set calibraton.nsamples=16, did you mean `calibration`?")
    assert error_of(p, overrides=["stages.0.bits=9"]) == (
        "`bits` in --set stages.0.bits=9: Input should be less than or equal to 8")


def test_set_malformed(tmp_path):
    p = write(tmp_path, VALID)
    assert "index 3 is out of range for `stages` (1 items)" in error_of(p, overrides=["stages.3.bits=3"])
    assert "`stages` is a list; index it" in error_of(p, overrides=["stages.bits=3"])
    assert "expects dotted.key=value" in error_of(p, overrides=["stages.0.bits"])
    assert "expects dotted.key=value" in error_of(p, overrides=["stages..bits=3"])
    assert "`model.path` is a str" in error_of(p, overrides=["model.path.x=1"])


# -- CLI replacements ----------------------------------------------------------------------------------
def test_cli_replacements(tmp_path):
    p = write(tmp_path, VALID)
    loaded = load_recipe(p, model="local/dir", calibration=["a.txt", "hf:wikitext:train"],
                         eval_data=["e.raw"], seed=7, overrides=["calibration.seed=3"])
    r = loaded.recipe
    assert r.model.path == "local/dir" and r.calibration.sources == ["a.txt", "hf:wikitext:train"]
    assert r.eval.data == ["e.raw"] and r.calibration.seed == 7  # the dedicated flag wins over --set
    assert loaded.resolved["model"]["path"] == "local/dir"
    # a section missing from the file is created
    q = write(tmp_path, "version: 1\nmodel: {path: a/b}\nstages: [{stage: quantize, method: rtn}]\n", "q.yaml")
    assert load_recipe(q, eval_data=["x.raw"]).recipe.eval.data == ["x.raw"]
    assert error_of(p, seed=-1) == "`seed` in --seed: Input should be greater than or equal to 0"


# -- hashing ---------------------------------------------------------------------------------------------
def test_sha256_stable_across_key_order_and_changes_with_values(tmp_path):
    a = load_recipe(write(tmp_path, VALID, "a.yaml"))
    reordered = yaml.safe_dump(yaml.safe_load(VALID), sort_keys=True)
    assert reordered != VALID
    b = load_recipe(write(tmp_path, reordered, "b.yaml"))
    assert a.sha256 == b.sha256
    assert load_recipe(write(tmp_path, VALID, "c.yaml")).sha256 == a.sha256
    assert load_recipe(write(tmp_path, VALID.replace("bits: 4", "bits: 3"), "d.yaml")).sha256 != a.sha256
    assert load_recipe(write(tmp_path, VALID, "e.yaml"), seed=1).sha256 != a.sha256
    # writing a default explicitly does not change the recipe
    explicit = VALID.replace("  dtype: float32\n", "  dtype: float32\n  gguf_file: null\n")
    assert load_recipe(write(tmp_path, explicit, "f.yaml")).sha256 == a.sha256


# -- paths -------------------------------------------------------------------------------------------------
def test_validate_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths are taken from the working directory
    (tmp_path / "calib.txt").write_text("hello")
    (tmp_path / "test.raw").write_text("world")
    loaded = load_recipe(write(tmp_path, VALID))
    validate_paths(loaded)  # Hub id model, existing local files
    validate_paths(loaded.recipe)
    validate_paths(load_recipe(write(tmp_path, VALID), calibration=["hf:wikitext:train", "."]))

    p = write(tmp_path, VALID, "r2.yaml")
    with pytest.raises(BadInput) as ei:
        validate_paths(load_recipe(p, model="./missing-model", eval_data=["test.raw", "gone.raw"],
                                   overrides=["calibration.sources.0=nope.txt"]))
    lines = str(ei.value).splitlines()
    assert lines[0].startswith("model path `./missing-model` does not exist")
    assert lines[0].endswith("(`model.path` in --model)")
    assert lines[1] == ("calibration source `nope.txt` does not exist "
                        "(`calibration.sources.0` in --set calibration.sources.0=nope.txt)")
    assert lines[2] == "eval file `gone.raw` does not exist (`eval.data.1` in --eval-data)"

    (tmp_path / "calib.txt").unlink()
    with pytest.raises(BadInput, match=r"calibration source `calib.txt` does not exist \(`calibration.sources.0` "
                                        r"at .*recipe.yaml:7\)"):
        validate_paths(load_recipe(tmp_path / "recipe.yaml"))


def test_validate_paths_local_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    base = "version: 1\nmodel: {path: %s}\nstages: [{stage: quantize, method: rtn}]\n"
    with pytest.raises(BadInput, match="has no config.json"):
        validate_paths(load_recipe(write(tmp_path, base % "m")))
    (tmp_path / "m" / "config.json").write_text("{}")
    validate_paths(load_recipe(write(tmp_path, base % "m")))
    with pytest.raises(BadInput, match="GGUF file `w.gguf` is not in model directory `m`"):
        validate_paths(load_recipe(write(tmp_path, "version: 1\nmodel: {path: m, gguf_file: w.gguf}\nstages: [{stage: quantize, method: rtn}]\n")))
    with pytest.raises(BadInput, match="model file `x/y.gguf` does not exist"):
        validate_paths(load_recipe(write(tmp_path, base % "x/y.gguf")))
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    validate_paths(load_recipe(write(tmp_path, base % "w.gguf")))
