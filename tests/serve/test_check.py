"""`compress serve-check` (compress/serve/check.py) with the engine that lives in our own environment
(transformers, through auto-round's loader) and the parts every engine shares: the comparison, the reference, the
directories, the guard that a check writes nothing, and the error when an engine's environment is missing."""

import json

import pytest
import torch
import yaml
from conftest import CAL, MODELS, invoke

from compress.serve.check import reference_model
from compress.serve.decoded import Decoded, compare

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """stories260K, RTN W4 g32 sym (its 172-wide MLP stays dense): an `auto_round:auto_gptq` hf export."""
    tmp = tmp_path_factory.mktemp("serve")
    doc = {"version": 1, "model": {"path": str(MODELS / "stories260K"), "dtype": "float32"},
           "calibration": {"sources": [str(CAL)], "nsamples": 4, "seqlen": 32},
           "stages": [{"stage": "quantize", "method": "rtn", "bits": 4, "group_size": 32, "sym": True}],
           "eval": {"enabled": False}, "export": {"formats": ["hf"]}}
    (tmp / "r.yaml").write_text(yaml.safe_dump(doc))
    rc, _, err = invoke("run", tmp / "r.yaml", "--output", tmp / "out", "--json")
    assert rc == 0, err
    return tmp / "out"


def test_transformers_agrees_and_writes_nothing(run):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (run / "hf").iterdir())
    rc, out, err = invoke("serve-check", run, "--engine", "transformers", "--json", "--perplexity",
                          str(CAL), "--max-tokens", "256")
    assert rc == 0, err
    res = json.loads(out)
    assert res["tokens"] == {"equal": 128, "total": 128} and res["agree"] and res["loaded_dtype"] == "float16"
    assert res["top5_overlap"] > 0.95 and res["max_dlogprob"] < 0.05  # auto-round runs it in fp16 on CPU
    p = res["perplexity"]
    assert abs(p["ratio"] - 1) < 1e-4 and p["ratio"] == round(p["transformers_fp32"] / p["compress"], 4)  # same weights
    assert abs(p["transformers_float16"] / p["compress"] - 1) < 0.01  # as auto-round's loader computes (fp16)
    assert sorted((q.name, q.stat().st_mtime_ns) for q in (run / "hf").iterdir()) == before
    rc, out, _ = invoke("serve-check", run / "hf", "--engine", "transformers", "--tokens", "4")
    assert rc == 0 and "16/16 greedy tokens equal" in out  # an export directory given directly


def test_reference_model_holds_the_exports_weights(run):
    from compress.export.hf import read_quantized

    model = reference_model(run / "hf", torch.float32)
    _, qweights = read_quantized(run / "hf")
    for name, qw in qweights.items():
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize())


def test_missing_engine_environment_and_bad_inputs(run, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_ENGINES", str(tmp_path / "none"))
    monkeypatch.setattr("compress.serve.check.cpu_isa", lambda: "AVX-512")  # where vLLM runs int4 (test below)
    rc, _, err = invoke("serve-check", run, "--engine", "vllm")
    assert rc == 1 and "compress serve-env vllm" in err
    rc, _, err = invoke("serve-check", run, "--engine", "vllm", "--dtype", "float32")  # auto-round: not in float32
    assert rc == 1 and "refuses float32 for auto-round checkpoints" in err
    rc, _, err = invoke("serve-check", run, "--engine", "openvino-genai")
    assert rc == 1 and "no `openvino` export" in err
    rc, _, err = invoke("serve-check", run, "--engine", "tensorrt")
    assert rc == 1 and "unknown engine" in err
    rc, _, err = invoke("serve-env", "tensorrt")
    assert rc == 1 and "unknown engine environment" in err


def test_vllm_refuses_int4_weight_only_without_avx512_before_anything_runs(run, monkeypatch):
    """vLLM's AVX2 library has no `cpu_gemm_wna16`: on such a CPU serve-check says so before loading anything (was: vLLM
    started, loaded the checkpoint and died at its first forward), and `compress bench serve` before exporting."""
    import time

    from compress.errors import RunFailure
    from compress.serve import bench
    from compress.serve.check import NO_WNA16_KERNEL, serve_check

    monkeypatch.setattr("compress.serve.check.cpu_isa", lambda: "AVX2")
    monkeypatch.setattr("compress.serve.check.reference_model", None)  # reaching it would fail with a TypeError
    t0 = time.time()
    with pytest.raises(RunFailure, match="cpu_gemm_wna16") as e:
        serve_check(run, "vllm")
    assert "(this CPU: AVX2)" in str(e.value) and "was not run" in str(e.value)
    with pytest.raises(RunFailure) as e:
        bench.run(str(MODELS / "stories260K"), engine="vllm")
    assert str(e.value).startswith(NO_WNA16_KERNEL) and "nothing was exported" in str(e.value)
    assert time.time() - t0 < 5


def test_compare_counts_ties_apart_from_disagreements():
    ref = Decoded([[1, 2, 3], [4, 5, 6]], [[{1: -0.1, 9: -2.0}, {2: -0.5, 7: -0.51}, {3: -0.1}],
                                          [{4: -0.1}, {5: -0.2, 8: -3.0}, {6: -0.1}]])
    got = Decoded([[1, 7, 0], [4, 8, 0]], [[{1: -0.11, 9: -2.0}, {7: -0.49, 2: -0.52}, {}],
                                          [{4: -0.1}, {8: -0.1, 5: -0.3}, {}]])
    c = compare(ref, got)
    assert (c["equal"], c["total"]) == (2, 6)
    assert c["divergences"] == [{"prompt": 0, "position": 1, "margin": 0.01}, {"prompt": 1, "position": 1,
                                                                               "margin": 2.8}]
    assert c["ties"] == 1 and c["max_dlogprob"] == 0.1
