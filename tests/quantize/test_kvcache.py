"""`kv_cache:` (compress/quantize/kvcache.py, docs/formats.md#quantized-kv-cache): the KV cache quantized with
compressed-tensors' arithmetic, calibrated, evaluated, exported as `kv_cache_scheme` + `k_scale` / `v_scale`, read
back by `compress eval`, and refused where it cannot be carried."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MODELS, invoke

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
ct = pytest.importorskip("compressed_tensors", reason="the `export` extra (CI installs it)")

MODEL = MODELS / "stories-llama-1m"


def recipe(tmp_path, quantize: str, extra: str = "", fmt="{format: compressed-tensors, dtype: float32}"):
    p = tmp_path / "r.yaml"
    p.write_text(f"""
version: 1
model: {{path: {MODEL}, dtype: float32{extra}}}
calibration: {{sources: [bundled:botchan-calibration], nsamples: 8, seqlen: 64}}
stages:
  - {{stage: quantize, method: rtn, {quantize}}}
eval: {{data: [bundled:botchan-eval], max_tokens: 1024, generation: {{prompts: 0}}}}
export: {{formats: [{fmt}]}}
""")
    return p


@pytest.mark.parametrize("typ", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("scales", ["tensor", "head", "dynamic"])
def test_fake_quant_is_compressed_tensors_arithmetic(typ, scales):
    """Keys (batch, kv_heads, seq, head_dim) through compress's KV quantizer and through compressed-tensors'
    `fake_quantize` with the same `kv_cache_scheme` arguments (static scales: the same values; dynamic: its own
    `compute_dynamic_scales_and_zp`): bit for bit; and the grid is really applied (few distinct levels)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from compress.quantize.kvcache import KVCache, fake_quant

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 16, generator=g) * torch.tensor([1.0, 4.0, 0.5]).reshape(1, 3, 1, 1)
    x[0, 1, 2, 5] = 30.0  # an outlier
    kv = KVCache(typ, scales, head_dim=16)
    args = QuantizationArgs(**kv.as_compressed_tensors())
    if scales == "dynamic":
        scale, zp = compute_dynamic_scales_and_zp(x, args, torch.nn.Module())
        ours = fake_quant(x, kv.grid, None)
    else:
        m = x.abs().amax() if scales == "tensor" else x.abs().amax(dim=(0, 2, 3))
        scale = (m / kv.grid.half).reshape(1) if scales == "tensor" else (m / kv.grid.half).reshape(-1, 1, 1)
        zp = None
        ours = fake_quant(x, kv.grid, scale)
    theirs = fake_quantize(x, scale, zp, args)
    assert torch.equal(ours, theirs), float((ours - theirs).abs().max())
    assert not torch.equal(ours, x)
    if typ == "int4" and scales == "tensor":
        assert ours.unique().numel() <= 16


def test_kv_cache_fields_are_validated(tmp_path):
    rc, _, err = invoke("run", recipe(tmp_path, "bits: 8, group_size: -1, kv_cache: fp8", fmt="hf"), "--dry-run")
    assert rc != 0 and "`kv_cache` is written by the compressed-tensors export" in err, err
    rc, _, err = invoke("run", recipe(tmp_path, "scheme: fp8, kv_scales: head"), "--dry-run")
    assert rc != 0 and "give `kv_cache`" in err, err
    rc, _, err = invoke("run", recipe(tmp_path, "scheme: fp8, kv_cache: fp16"), "--dry-run")
    assert rc != 0 and "kv_cache" in err, err
    rc, out, err = invoke("run", recipe(tmp_path, "scheme: fp8, kv_cache: fp8", fmt="compressed-tensors"),
                          "--dry-run", "--json")
    assert rc == 0, err
    serving = json.loads(out)["serving"]
    assert serving["vllm"] == [] and serving["vllm-cpu"], serving  # W8A8 FP8: vLLM's CPU build has no kernel
    rc, out, err = invoke("run", recipe(tmp_path, "scheme: w8a8-int8, kv_cache: int8", fmt="compressed-tensors"),
                          "--dry-run")
    assert rc == 0 and "layers, scheme w8a8-int8, KV cache int8 (tensor scales)" in out, out + err
    rc, out, err = invoke("run", recipe(tmp_path, "scheme: w8a8-int8, kv_cache: int8", fmt="compressed-tensors"),
                          "--dry-run", "--json")
    assert rc == 0, err
    serving = json.loads(out)["serving"]
    assert "FP8 KV cache" in json.dumps(serving["vllm"]) and "FP8 KV cache" in json.dumps(serving["vllm-cpu"])


@pytest.mark.parametrize("typ,scales", [("int4", "tensor"), ("fp8", "head"), ("int8", "dynamic")])
def test_the_run_evaluates_exports_and_reads_back_its_kv_cache(tmp_path, typ, scales):
    """The run evaluates with its KV cache quantized, writes `kv_cache_scheme` with calibrated `k_scale` /
    `v_scale` (none for dynamic), and `compress eval` of the export gives the run's KL: transformers' load of it with the KV cache applied (by compressed-tensors where it
    hooks this transformers' attention, else by compress's hooks from the stored scales)."""
    from transformers import AutoModelForCausalLM

    from compress.export.hf import load_tensors
    from compress.quantize import kvcache

    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe(tmp_path, f"scheme: w8a8-int8, kv_cache: {typ}, kv_scales: {scales}"),
                             "-o", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["kv_cache"]["layers"] == 4 and report["kv_cache"]["type"] == typ
    assert f"- KV cache: {typ} keys (after RoPE)" in (out / "report.md").read_text()
    assert "does not hook" in report["serving"]["transformers"][0]  # transformers 5.2x: compressed-tensors skips it
    export = out / "compressed-tensors"
    scheme = json.loads((export / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme == kvcache.KVCache(typ, scales, head_dim=32).as_compressed_tensors()
    tensors = load_tensors(export)
    shape = {"tensor": (1,), "head": (2, 1, 1), "dynamic": None}[scales]  # 2 KV heads
    for i in range(4):
        k = tensors.get(f"model.layers.{i}.self_attn.k_scale")
        assert (k is None) if shape is None else (k.shape == shape and bool((k > 0).all()))

    kl = report["eval"]["botchan-eval.txt"]["kl"]
    rc, stdout, err = invoke("eval", export, "--reference", MODEL, "--data", "bundled:botchan-eval", "--max-tokens",
                             "1024", "--gen-prompts", "0", "--json")
    assert rc == 0, err
    assert json.loads(stdout)["botchan-eval.txt"]["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        assert kvcache.from_checkpoint(model, export) in ("compress", "compressed-tensors")
        hooked = model(ids).logits
    assert (plain - hooked).abs().max() > 1e-3  # the stored KV setting changes what the export computes


def test_a_latent_attention_is_refused_at_plan_time(tmp_path):
    from compress.models.adapters import ModelAdapter
    from compress.quantize.kvcache import attention_modules

    class Arch:
        kind, roles = "causal", {"kv_a": "self_attn.kv_a_proj_with_mqa", "o": "self_attn.o_proj"}

    fake = ModelAdapter.__new__(ModelAdapter)
    fake.arch, fake.model_type = Arch, "deepseek_v3"
    with pytest.raises(ValueError, match="compressed latent"):
        attention_modules(fake)
