"""vLLM CPU serves the hf exports users deploy (engine tier: `pytest -m engine`, after `compress serve-env vllm`).

On ref-llama-7m, `compress bench serve`'s schemes (W4 g128 sym and asym, a 3/4-bit mixed plan in 4-bit containers,
sym and asym) load in vLLM 0.32.0's CPU build and greedy-decode 4 prompts x 32 tokens as transformers does on the
same weights, max |dlogprob| <= 0.02 in fp16; the mixed export rewritten without re-centred zeros must disagree
(vLLM never reads a symmetric layer's zeros), which proves the check sees them. On an AVX2-only CPU vLLM has no
int4 kernel at all (its AVX2 library lacks `cpu_gemm_wna16`): there the check must say so, not fail obscurely."""

import pytest
from conftest import MODELS

from compress.errors import RunFailure
from compress.serve.bench import UNSHIFTED, run
from compress.serve.check import NO_WNA16_KERNEL, cpu_isa

pytestmark = [pytest.mark.engine, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]


def test_vllm_cpu_serves_every_layout_and_sees_ignored_zeros():
    if not cpu_isa().startswith("AVX-512"):
        with pytest.raises(RunFailure) as e:
            run(str(MODELS / "ref-llama-7m"), engine="vllm")
        assert NO_WNA16_KERNEL in str(e.value) and cpu_isa() in str(e.value)
        return
    res = run(str(MODELS / "ref-llama-7m"), engine="vllm")
    rows = {r["scheme"]: r for r in res["rows"]}
    for name, r in rows.items():
        if name == UNSHIFTED:
            assert not r["agree"] and r["tokens"]["equal"] < 64, r
        else:
            assert r["agree"] and r["max_dlogprob"] <= 0.02, r
            assert r["kernels"] and all("CPUWNA16" in k or "ARK" in k for k in r["kernels"]), r
    assert rows["W4 g128 asym"]["packing"] == "auto_round:auto_awq"
    assert rows["W4 g128 sym"]["packing"] == "auto_round:auto_gptq"


def test_vllm_cpu_serves_the_w8a8_int8_export(tmp_path):
    """The compressed-tensors W8A8 export loads in vLLM's CPU build, every quantized linear on its int8 scaled-mm
    kernel; the reference is transformers' own loading of the export. Where the CPU has no VNNI, the check says that
    vLLM's int8 GEMM saturates there (docs/serving.md); the agreement is recorded in docs/formats.md, not asserted:
    vLLM's per-token scale is max|x| / 127, compressed-tensors' / 127.5, which alone moves this tiny model's greedy
    tokens (bench: 102/128 in float32)."""
    from conftest import invoke

    from compress.serve.check import INT8_WITHOUT_VNNI, has_vnni, serve_check

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""
version: 1
model: {{path: {MODELS / 'ref-llama-7m'}, dtype: float32}}
calibration: {{sources: [bundled:botchan-calibration], nsamples: 8, seqlen: 64}}
stages: [{{stage: quantize, method: rtn, scheme: w8a8-int8}}]
eval: {{enabled: false}}
export: {{formats: [compressed-tensors]}}
""")
    rc, _, err = invoke("run", recipe, "--output", tmp_path / "o")
    assert rc == 0, err
    res = serve_check(tmp_path / "o", "vllm", floor=True)
    assert res["kernels"] == ["CPUInt8ScaledMMLinearKernel"], res
    assert res["top5_overlap"] > 0.9 and res["tokens"]["equal"] >= 16, res
    assert (res.get("warning") == INT8_WITHOUT_VNNI) == (not has_vnni())
