"""Group sizes fitted to each layer at plan time, and what every export stores for odd widths
(docs/quantize.md#group-size-adaptation, docs/formats.md#short-groups)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import CAL, STORIES260K, invoke
from helpers import ort_logits, rel_err, run_ir
from safetensors import safe_open
from tiny import save_tiny
from transformers import AutoModelForCausalLM

from compress.export.hf import read_quantized
from compress.kernels.backends import quantize_model
from compress.quantize.spine import fit_group

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("d_in,group,got", [
    (4096, 128, 128), (96, -1, -1), (96, 32, 32),  # fits: kept
    (96, 128, -1), (64, 128, -1),  # narrower than the group: per-channel
    (96, 64, 32), (2880, 128, 64), (64, 48, 32),  # the nearest power of two dividing the width
    (192, 128, 64), (160, 128, -1),  # 160 is nearer to 128 than 32 is
    (172, 64, 64), (172, 128, 128),  # no loader packs a width that is not a multiple of 32: short last group kept
    (172, 48, 32), (172, 96, 64),  # ... but a kernel group (a power of two >= 32)
])
def test_fit_group(d_in, group, got):
    fitted, why = fit_group(d_in, group)
    assert fitted == got and (why is None) == (got == group)
    assert fitted == -1 or fitted & (fitted - 1) == 0 or fitted == group  # kernels take powers of two
    if d_in % 32 == 0 and fitted != -1:
        assert d_in % fitted == 0  # no short last group where a loader could read the layer packed


@pytest.fixture(scope="module")
def qwen3_96(tmp_path_factory):
    """A Qwen3-architecture model whose attention and gate/up layers are 96 wide (issue: quickstart on it)."""
    return save_tiny("qwen3", tmp_path_factory.mktemp("m") / "qwen3-96", hidden_size=96, intermediate_size=256,
                     max_position_embeddings=512)


def test_quickstart_plan_adapts_and_lists_the_layers(qwen3_96, tmp_path):
    rc, stdout, err = invoke("run", "recipes/quickstart.yaml", "--model", qwen3_96, "--output", tmp_path / "o",
                             "--dry-run", "--json")
    assert rc == 0, err
    adapted = json.loads(stdout)["stages"][0]["adapted_groups"]
    # q/k/v, gate/up (96 wide) and o_proj (64 wide) are narrower than 128: per-channel; down_proj (256) keeps 128
    assert len(adapted) == 12 and set(map(tuple, adapted.values())) == {(128, -1)}
    assert not any("down_proj" in n for n in adapted)
    rc, stdout, err = invoke("run", "recipes/quickstart.yaml", "--model", qwen3_96, "--output", tmp_path / "o",
                             "--dry-run")
    assert rc == 0, err
    assert "group_size adapted to 12 layers" in stdout and "model.layers.0.self_attn.q_proj: 128 -> -1" in stdout
    rc, stdout, err = invoke("run", "recipes/quickstart.yaml", "--model", qwen3_96, "--output", tmp_path / "o",
                             "--dry-run", "--set", "stages.0.strict_groups=true")
    assert rc == 1 and "strict_groups: true" in err and "in_features 96 < group_size 128" in err, err


# packing auto_round: plain transformers loads it; the asymmetric default (auto_awq) needs auto-round-lib
RECIPE = """version: 1
model: {{path: {model}, dtype: float32}}
calibration: {{sources: [{cal}], nsamples: 4, seqlen: 32}}
stages:
  - {{stage: quantize, method: rtn, bits: {bits}, group_size: 64, sym: false}}
eval: {{enabled: false}}
export: {{formats: [{{format: hf, packing: auto_round}}, onnx, openvino]}}
"""


def _tensor_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensors (the file less its JSON header)."""
    with open(path, "rb") as f:
        return path.stat().st_size - 8 - int.from_bytes(f.read(8), "little")


def _in_memory(model_dir, hf: Path):
    """The quantized model as the run held it: every quantized layer's W_hat (packed ones decoded from the hf
    export, dense ones as stored), everything else as loaded."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _, qweights = read_quantized(hf)
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith("model.layers.") and key.endswith("proj.weight"):
                model.get_submodule(key[: -len(".weight")]).weight.data = f.get_tensor(key).float()
    for name, qw in qweights.items():
        model.get_submodule(name).weight.data = qw.dequantize()
    return model, qweights


@pytest.mark.parametrize("which,bits,dense", [("llama-96", 2, 0),
                                              pytest.param("stories260K", 4, 15, marks=pytest.mark.slow)])
def test_odd_widths_export_packed_and_match_everywhere(which, bits, dense, tmp_path):
    """96-wide layers get group 32 and are packed; stories260K's 172-wide MLP (gate/up out, down in) is stored
    dense by hf only (no loader reads it packed) and packed with a short last group by onnx and openvino."""
    if which == "stories260K":
        model_dir = STORIES260K
    else:
        model_dir = save_tiny("llama", tmp_path / which, hidden_size=96, intermediate_size=256, num_attention_heads=3,
                              num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=256)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model=model_dir, cal=CAL, bits=bits))
    out = tmp_path / "out"
    rc, stdout, err = invoke("run", recipe, "--output", out, "--json")
    assert rc == 0, err
    report = json.loads(stdout)
    size, stored = report["size"], report["size"]["stored"]
    assert stored["hf"]["dense_layers"] == dense and stored["onnx"]["dense_layers"] == 0
    assert stored["openvino"]["dense_layers"] == 0
    on_disk = _tensor_bytes(out / "hf" / "model.safetensors")
    assert abs(on_disk / stored["hf"]["tensor_bytes"] - 1) < 0.01
    if not dense:  # every layer packed (asymmetric: hf stores exactly the zero points the bits count)
        assert abs(on_disk / size["packed_bytes"] - 1) < 0.01
        assert len(report["adapted_groups"]) == 12 and "Group sizes adapted" in (out / "report.md").read_text()
    else:
        assert all("multiples of 32" in why for why in stored["hf"]["dense"].values())
    ref, qweights = _in_memory(model_dir, out / "hf")
    ids = torch.randint(0, ref.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expect = ref(ids).logits.numpy()
        loaded = AutoModelForCausalLM.from_pretrained(out / "hf")  # transformers + auto-round's loader
        torch.nn.Module.float(loaded)
        assert rel_err(loaded(ids).logits.numpy(), expect) < 1e-3
        ours = quantize_model(ref, qweights)(ids).logits.numpy()  # our CPU kernels on the packed layers
        assert rel_err(ours, expect) < 1e-3
    assert rel_err(ort_logits(out / "onnx" / "model.onnx", ids), expect) < 1e-3
    assert rel_err(run_ir(out / "openvino" / "openvino_model.xml", ids)[0], expect) < 1e-3


@pytest.mark.e2e
def test_the_quickstart_runs_on_a_96_wide_model_and_reports_the_adapted_layers(qwen3_96, tmp_path):
    """recipes/quickstart.yaml as written (shrunk), on the 96-wide Qwen3: it runs, packs every layer and says
    which ones got another group."""
    import yaml
    from conftest import REPO
    from helpers import WIKITEXT, shrink

    recipe = REPO / "recipes" / "quickstart.yaml"
    rc, stdout, err = invoke("run", recipe, "--model", qwen3_96, "--output", tmp_path / "o", "--json",
                             *shrink(yaml.safe_load(recipe.read_text())), *WIKITEXT)
    assert rc == 0, err
    report = json.loads(stdout)
    assert len(report["adapted_groups"]) == 12 and report["size"]["stored"]["hf"]["dense_layers"] == 0
    assert "## Group sizes adapted" in (tmp_path / "o" / "report.md").read_text()
    assert report["eval"]["wiki.test.raw"]["ppl_ratio"] < 1.1


@pytest.mark.parametrize("d_in,group", [(256, 32), (100, 32), (96, -1), (130, 64)])
@pytest.mark.parametrize("sym", [True, False])
def test_codes_and_dequantize_broadcast_per_group_equal_the_per_column_formula(d_in, group, sym):
    """quantize_codes and dequantize broadcast qparams over group views (one fp32 temporary); a short last group
    takes the per-column path. Both equal `round(W / s[:, g]) + z[:, g]` and `s[:, g] * (c - z[:, g])` bit for bit."""
    from compress.primitives import choose_qparams, quantize_codes, rtn

    W = torch.randn(17, d_in, generator=torch.Generator().manual_seed(d_in))
    s, z = choose_qparams(W, 3, group, sym)
    g = torch.arange(d_in) // (d_in if group == -1 else group)
    assert torch.equal(quantize_codes(W, s, z, 3, group), (torch.round(W / s[:, g]) + z[:, g]).clamp(0, 7).to(torch.uint8))
    qw = rtn(W, 3, group, sym)
    assert torch.equal(qw.dequantize(), qw.scales[:, g] * (qw.codes.float() - qw.zeros.float()[:, g]))


@pytest.mark.parametrize("d_in,group", [(256, 32), (100, 32), (96, -1)])
def test_one_bit_is_the_published_sign_rule(d_in, group):
    """1 bit (MC-MoE / GEMQ's binary rule): codes are the signs, the scale is mean |w| over the group's real
    columns (a short last group too), W_hat = s (2c - 1); no zero point is counted; GPTQ keeps the rule and
    lowers the H-weighted error below RTN's."""
    from compress.primitives import rtn
    from compress.quantize.gptq import gptq
    from compress.qweight import QuantizedWeight, unit_storage_bits

    W = torch.randn(24, d_in, generator=torch.Generator().manual_seed(d_in))
    g = d_in if group == -1 else group
    cols = torch.arange(d_in) // g
    mean_abs = torch.stack([W[:, cols == k].abs().mean(1) for k in range(cols.max() + 1)], 1)
    for sym in (True, False):
        qw = rtn(W, 1, group, sym)
        assert torch.equal(qw.codes, (W >= 0).to(torch.uint8))
        assert torch.equal(qw.scales, mean_abs.half().float())
        assert torch.equal(qw.dequantize(), qw.scales[:, cols] * (2 * qw.codes.float() - 1))
        n_groups = -(-d_in // g)
        assert qw.storage_bits() == 24 * d_in + 24 * n_groups * 16 == unit_storage_bits(24, d_in, g, 1, sym)
    with pytest.raises(ValueError, match="uniform"):
        QuantizedWeight(qw.codes, qw.scales, qw.zeros, 1, group, True, chunk_size=g * (n_groups or 1),
                        chunk_bits=(1,))
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(512, d_in, generator=gen) @ torch.randn(d_in, d_in, generator=gen)  # correlated inputs
    H = X.T @ X / 512
    q, _ = gptq(W.clone(), H.clone(), bits=1, group_size=group, sym=False)
    assert set(q.codes.unique().tolist()) <= {0, 1} and q.bits == 1

    def err(Wh):
        return float(torch.trace((Wh - W) @ H @ (Wh - W).T))

    assert err(q.dequantize()) < 0.9 * err(rtn(W, 1, group, False).dequantize())
