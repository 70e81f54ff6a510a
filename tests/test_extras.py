"""Optional dependencies are found missing at plan time (compress/extras.py): `validate`, `run --dry-run` and
`run` refuse with exit 1 and the install command before any model is loaded; `eval` refuses before loading."""

import pytest
from conftest import CAL, STORIES260K, invoke

import compress.extras as extras


@pytest.fixture
def hide(monkeypatch):
    """hide(*modules): find_spec answers None for them, as in an environment without the extra."""
    real = extras.find_spec

    def _hide(*modules):
        monkeypatch.setattr(extras, "find_spec", lambda m: None if m in modules else real(m))

    return _hide


@pytest.mark.parametrize("recipe,module,needs,extra", [
    ("recipes/w4-onnx.yaml", "onnx", "export `onnx` needs onnx", "export"),
    ("recipes/w4-openvino.yaml", "openvino", "export `openvino` needs openvino", "export"),
    ("recipes/select-probscale.yaml", "sklearn", "stage `select: probscale` needs scikit-learn", "select"),
])
def test_a_recipe_needing_a_missing_extra_is_refused_by_validate_and_dry_run(hide, recipe, module, needs, extra):
    hide(module)
    rc, _, err = invoke("validate", recipe)
    assert rc == 1 and needs in err and f"pip install 'compress-llm[{extra}]'" in err, err
    rc, out, err = invoke("run", recipe, "--dry-run", "--model", STORIES260K, "--calibration", CAL)
    assert rc == 1 and needs in err and f"pip install 'compress-llm[{extra}]'" in err and not out, err


def test_run_refuses_before_writing_anything(hide, tmp_path):
    hide("onnx")
    out = tmp_path / "o"
    rc, _, err = invoke("run", "recipes/w4-onnx.yaml", "--model", STORIES260K, "--calibration", CAL, "--output", out)
    assert rc == 1 and "compress-llm[export]" in err and not out.exists()


def test_several_missing_modules_are_named_together(hide):
    hide("openvino", "onnx")
    rc, _, err = invoke("validate", "recipes/w4-openvino.yaml")
    assert rc == 1 and "needs openvino, onnx, which is not installed: pip install 'compress-llm[export]'" in err


def test_eval_task_and_triton_backend_refuse_before_loading(hide, tmp_path):
    hide("sklearn", "triton")
    missing = tmp_path / "no-such-model"  # refused before the model is looked for
    rc, _, err = invoke("eval", missing, "--task", "sst2")
    assert rc == 1 and "compress eval --task needs scikit-learn" in err and "compress-llm[select]" in err, err
    rc, _, err = invoke("eval", missing, "--backend", "triton", "--data", CAL)
    assert rc == 1 and "--backend triton needs triton" in err and "compress-llm[gpu]" in err, err


def test_every_registered_requirement_has_an_extra():
    from compress import registry

    registry.load_all()
    needed = {m for e in registry._REGISTRY.values() for m in e.requires}
    assert needed and needed <= set(extras.EXTRAS)
