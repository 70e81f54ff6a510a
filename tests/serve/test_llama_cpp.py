"""llama.cpp judges GGUF files (compress/serve/check.py, engines/llamacpp.py and its worker).

Engine tier (`pytest -m engine`, after `compress serve-env llama.cpp`): llama.cpp's own convert_hf_to_gguf.py
writes stories260K and ref-llama-7m as F32 and F16, the worker's `quantize` makes Q8_0 and Q4_K_M of them; on each
file llama.cpp's greedy tokens equal compress's reading of the same file (transformers' GGUF loader, float32),
or that reading with llama.cpp's activation rounding, but at reference ties, and its perplexity on compress's own
windows is within 0.5% of compress's. The default tier checks the errors (the environment missing, with the
command that builds it; which .gguf a check reads) and the emulated activation rounding."""

import json
import math

import pytest
from conftest import MODELS, TEXT, invoke

from compress.errors import BadInput
from compress.serve import envs
from compress.serve.check import gguf_file

STORIES_GGUF = MODELS / "stories260K" / "stories260K-f32.gguf"


# -- default tier: the errors ---------------------------------------------------------------------------

def test_missing_environment_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_ENGINES", str(tmp_path))
    from compress.serve.engines import llamacpp

    with pytest.raises(BadInput, match="compress serve-env llama.cpp"):
        llamacpp.decode(STORIES_GGUF, [[1]], 1, set())
    with pytest.raises(BadInput, match="compress serve-env llama.cpp"):
        llamacpp.quantize(STORIES_GGUF, tmp_path / "q.gguf", "Q8_0")
    with pytest.raises(BadInput, match="compress serve-env llama.cpp"):
        envs.tool_of("llama.cpp", "llama-imatrix")
    rc, _, err = invoke("serve-check", STORIES_GGUF, "--engine", "llama.cpp")
    assert rc == 1 and "compress serve-env llama.cpp" in err and str(tmp_path) in err
    assert not list(tmp_path.iterdir())  # nothing built or half-built by asking


def test_which_gguf_a_check_reads(tmp_path):
    assert gguf_file(STORIES_GGUF) == STORIES_GGUF
    (tmp_path / "gguf").mkdir()
    one = tmp_path / "gguf" / "model-Q8_0.gguf"
    one.write_bytes(b"GGUF")
    assert gguf_file(tmp_path) == one  # a run's gguf/ directory
    assert gguf_file(tmp_path / "gguf") == one
    (tmp_path / "gguf" / "model-F16.gguf").write_bytes(b"GGUF")
    with pytest.raises(BadInput, match="2 .gguf files"):
        gguf_file(tmp_path / "gguf")
    with pytest.raises(BadInput, match="not a .gguf"):
        gguf_file(MODELS / "stories260K" / "config.json")
    (tmp_path / "manifest.json").write_text(json.dumps({"exports": {"hf": {"directory": "hf"}}}))
    with pytest.raises(BadInput, match="no `gguf` export"):
        gguf_file(tmp_path)


def test_activation_rounding_is_ggmls():
    import torch

    from compress.serve.engines.llamacpp import ACTIVATIONS, emulate_activations, q8_blocks

    x = torch.linspace(-1, 2, 64).reshape(1, 64)
    q = q8_blocks(x, 32, True)
    for block in (x[0, :32], x[0, 32:]):  # one fp16 scale amax/127 per 32 values, codes round(x * 127/amax)
        d = torch.tensor(float(block.abs().max()) / 127).half().float()
        codes = torch.round(block * 127 / block.abs().max())
        assert codes.abs().max() == 127
    assert torch.equal(q[0, 32:], codes * d)
    k = q8_blocks(x.repeat(1, 4), 256, False)  # Q8_K: one float32 scale per 256
    assert torch.allclose(k, x.repeat(1, 4), atol=2 / 127 / 2 + 1e-6)
    assert ACTIVATIONS["Q4_K"](x.repeat(1, 4)).equal(k) and ACTIVATIONS["F16"](x).equal(x.half().float())
    from compress.models.loading import load_model

    model, _ = load_model(str(STORIES_GGUF))
    handles, types = emulate_activations(model, STORIES_GGUF)
    assert not handles and set(types.values()) == {"F32"} and "lm_head" in types  # float32 weights: nothing rounded


def test_serve_env_knows_llama_cpp(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_ENGINES", str(tmp_path))
    assert envs.path_of("llama.cpp") == tmp_path / "llama-cpp-0.3.36"
    rc, _, err = invoke("serve-env", "llama-cpp")
    assert rc == 1 and "llama.cpp" in err  # the known names


def test_an_environment_built_with_amx_is_stale(tmp_path, monkeypatch):
    """The llama.cpp build keeps ggml's AMX kernels out on x86 (they crash on AMX VMs); an environment whose
    ready.json records other cmake settings (any built before that) is refused with the command that rebuilds it."""
    import platform

    monkeypatch.setenv("COMPRESS_ENGINES", str(tmp_path))
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert f"-DCMAKE_CXX_FLAGS={envs.NO_AMX}" in envs.LLAMA_CPP_CMAKE and "-mno-amx-int8" in envs.NO_AMX
    d = envs.path_of("llama.cpp")
    d.mkdir()
    old = [f for f in envs.LLAMA_CPP_CMAKE if "amx" not in f]
    (d / "ready.json").write_text(json.dumps({"llama_cpp": {"cmake": old}}))
    if old != envs.LLAMA_CPP_CMAKE:
        with pytest.raises(BadInput, match="stale .*-mno-amx-int8.*compress serve-env llama.cpp"):
            envs.python_of("llama.cpp")
    (d / "ready.json").write_text(json.dumps({"llama_cpp": {"cmake": envs.LLAMA_CPP_CMAKE}}))
    assert envs.python_of("llama.cpp") == d / "bin" / "python"
    assert envs.stale("vllm", {}) == ""


# -- engine tier: llama.cpp against compress on the same files ------------------------------------------

# ref-llama-7m's byte-level BPE (GPT-2's regex) is not in convert_hf_to_gguf.py's table of known pre-tokenizers
PRE_TOKENIZERS = {"stories260K": None, "ref-llama-7m": "gpt-2"}
TEXTS = {"stories260K": TEXT / "tinystories" / "tinystories_val.txt",
         "ref-llama-7m": TEXT / "wikitext-2-raw" / "wiki.test.raw"}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """{(model, type): path}: F32 and F16 by llama.cpp's convert_hf_to_gguf.py, Q8_0 and Q4_K_M by `quantize`."""
    from compress.serve.engines import llamacpp

    envs.python_of("llama.cpp")
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for model, pre in PRE_TOKENIZERS.items():
        for outtype in ("f32", "f16"):
            path = root / f"{model}-{outtype.upper()}.gguf"
            files[model, outtype.upper()] = llamacpp.convert(MODELS / model, path, outtype, pre_tokenizer=pre)
        for qtype in ("Q8_0", "Q4_K_M"):
            files[model, qtype] = root / f"{model}-{qtype}.gguf"
            llamacpp.quantize(files[model, "F16"], files[model, qtype], qtype)
    return files


@pytest.mark.engine
@pytest.mark.parametrize("model", list(TEXTS))
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_K_M"])
def test_llama_cpp_reads_the_file_as_compress_does(ggufs, model, qtype):
    from compress.serve.check import serve_check

    gguf = ggufs[model, qtype]
    before = sorted((p.name, p.stat().st_mtime_ns) for p in gguf.parent.iterdir())
    res = serve_check(gguf, "llama.cpp", dtype="float32", perplexity=str(TEXTS[model]), max_tokens=4096)
    print(model, qtype, json.dumps({k: res[k] for k in ("tokens", "top5_overlap", "max_dlogprob", "divergences",
                                                         "emulated", "weight_types", "perplexity")}))
    emulated = res["emulated"]
    assert res["agree"] and res["tokens"]["total"] == emulated["tokens"]["total"] == 128
    if qtype in ("F32", "F16"):  # llama.cpp computes F32 exactly as torch does, F16 with fp16 activations
        assert res["tokens"]["equal"] == 128 and res["max_dlogprob"] < (1e-3 if qtype == "F32" else 0.01)
    else:  # its Q8_0/Q8_K activations: stories260K Q8_0 leaves the float32 reading at a 0.033-nat margin, not this
        assert max(res["tokens"]["equal"], emulated["tokens"]["equal"]) >= 120 and res["max_dlogprob"] < 0.2
        assert emulated["max_dlogprob"] < 0.1 and res["top5_overlap"] > 0.95
    assert abs(res["perplexity"]["ratio"] - 1) < 0.005, res["perplexity"]
    assert res["perplexity"]["tokens"] >= 4000 and res["metadata"]["general.architecture"] == "llama"
    assert sorted((p.name, p.stat().st_mtime_ns) for p in gguf.parent.iterdir()) == before


@pytest.mark.engine
def test_score_starts_each_window_from_an_empty_cache(ggufs):
    import torch

    from compress.eval.metrics import Window
    from compress.serve.engines import llamacpp

    ids = torch.arange(3, 40)
    a, b, c = llamacpp.score(ggufs["stories260K", "F32"], [Window(ids, 0), Window(ids[5:], 0), Window(ids, 0)],
                              dtype="float32")
    assert len(a) == len(ids) - 1 and a == c  # the third window does not see the first two
    assert all(math.isfinite(x) and x > 0 for x in a + b)


@pytest.mark.engine
def test_imatrix_then_quantize_with_it(ggufs, tmp_path):
    from compress.serve.engines import llamacpp

    f16 = ggufs["ref-llama-7m", "F16"]
    text = tmp_path / "calibration.txt"
    text.write_text(TEXTS["ref-llama-7m"].read_text()[:60_000])
    for suffix in (".gguf", ".dat"):
        im = llamacpp.imatrix(f16, text, tmp_path / f"imatrix{suffix}", chunk_size=128, chunks=8)
        assert (tmp_path / f"imatrix{suffix}").stat().st_size == im["bytes"] > 0
    plain = llamacpp.quantize(f16, tmp_path / "plain.gguf", "Q4_K_M")
    weighted = llamacpp.quantize(f16, tmp_path / "weighted.gguf", "Q4_K_M", imatrix=tmp_path / "imatrix.gguf")
    assert weighted["bytes"] > 0 and (tmp_path / "plain.gguf").read_bytes() != (tmp_path / "weighted.gguf").read_bytes()
    assert plain["type"] == weighted["type"] == "Q4_K_M"
    with pytest.raises(RuntimeError, match="unknown llama.cpp quantization type"):
        llamacpp.quantize(f16, tmp_path / "x.gguf", "Q4_7")
