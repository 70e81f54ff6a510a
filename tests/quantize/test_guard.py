"""FlipGuard (`guard: flipguard`): the weight move before rounding, the recipe option, and (slow tier) a
quantization-conditioned backdoor on stories260K that it removes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import STORIES260K, invoke, recipe
from safetensors.torch import load_file

from compress.config import GuardConfig
from compress.primitives import choose_qparams, rtn
from compress.quantize.guard import boundary_distance, flipguard

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group", [32, -1])
def test_moved_weights_change_code_and_nothing_else(sym, group):
    torch.manual_seed(0)
    W = torch.randn(48, 100)  # 100 = 3 x 32 + a short last group of 4
    W2, moved = flipguard(W, 4, group, sym, rule="flip", d_max=0.15, rho=0.5, eps=0.1)
    assert moved > 0
    s1, z1 = choose_qparams(W, 4, group, sym)
    s2, z2 = choose_qparams(W2, 4, group, sym)
    assert torch.equal(s1, s2) and torch.equal(z1, z2)  # every other code keeps its grid
    a, b = rtn(W, 4, group, sym), rtn(W2, 4, group, sym)
    changed = W2 != W
    assert int(changed.sum()) == moved
    assert int((a.codes != b.codes).sum()) >= 0.99 * moved and ((a.codes.int() - b.codes.int()).abs() <= 1).all()
    step = s1.abs().repeat_interleave(100 if group == -1 else 32, dim=1)[:, :100]
    assert ((W2 - W).abs() <= (0.15 + 0.1 + 1e-3) * step).all()  # under a quantization step
    _, d, _, _ = boundary_distance(W, 4, group, sym)
    assert (d.reshape(48, -1)[:, :100][changed] < 0.15).all()


def test_rho_and_d_max_set_how_many_move_and_it_is_deterministic():
    torch.manual_seed(1)
    W = torch.randn(64, 64)
    counts = [flipguard(W, 4, 32, False, rule="flip", d_max=d, rho=r)[1] for d, r in ((0.05, 0.5), (0.15, 0.5), (0.15, 1.0))]
    assert counts[0] < counts[1] < counts[2]
    assert torch.equal(flipguard(W, 4, 32, False, rule="flip")[0], flipguard(W, 4, 32, False, rule="flip")[0])


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group", [32, -1])
@pytest.mark.parametrize("shrink", [1.0, 2.5])
def test_clip_moves_only_the_outermost_weights_and_shrinks_every_groups_grid(sym, group, shrink):
    torch.manual_seed(2)
    W = torch.randn(48, 100)
    W2, moved = flipguard(W, 4, group, sym, shrink=shrink)  # the default rule
    f = 1 - shrink / 15
    s1, _ = choose_qparams(W, 4, group, sym)
    s2, _ = choose_qparams(W2, 4, group, sym)
    assert torch.allclose(s2, s1 * f, rtol=2e-3)  # every group's step shrinks (fp16 scales)
    plain = rtn(W, 4, group, sym, min_scale=f, max_scale=f)  # auto-round's range factors, as the attack cannot know
    if not sym:
        assert torch.equal(rtn(W2, 4, group, sym).codes, plain.codes)
    changed = W2 != W
    assert int(changed.sum()) == moved
    g = 100 if group == -1 else 32
    groups = -(-100 // g)
    assert groups * 48 <= moved <= 2 * groups * 48 * (1 + shrink)  # a group's outermost weight or few
    lo = torch.stack([W[:, i * g:(i + 1) * g].amin(1).clamp(max=0) for i in range(groups)], 1).repeat_interleave(g, 1)[:, :100]
    hi = torch.stack([W[:, i * g:(i + 1) * g].amax(1).clamp(min=0) for i in range(groups)], 1).repeat_interleave(g, 1)[:, :100]
    assert ((W[changed] < f * lo[changed] + 1e-6) | (W[changed] > f * hi[changed] - 1e-6)).all()
    step = s1.abs().repeat_interleave(g, dim=1)[:, :100]
    assert ((W2 - W).abs() <= shrink * step * 1.002).all()  # at most `shrink` steps (fp16 scales)


def test_guard_option_parses_a_name_or_a_mapping():
    from compress.quantize.rtn import RTNConfig

    assert RTNConfig(guard="flipguard").guard == GuardConfig() and GuardConfig().rule == "clip"
    assert RTNConfig(guard={"method": "flipguard", "rule": "flip", "rho": 1.0}).guard.rho == 1.0
    with pytest.raises(ValueError):
        RTNConfig(guard={"method": "flipguard", "rule": "noise"})
    with pytest.raises(ValueError):
        RTNConfig(guard="noise")
    with pytest.raises(ValueError):
        RTNConfig(guard={"method": "flipguard", "eps": 0.7})


def test_a_recipe_with_the_guard_rounds_the_moved_weights(tmp_path):
    out, plain = tmp_path / "guarded", tmp_path / "plain"
    rc, stdout, err = invoke("run", recipe(tmp_path), "--output", out, "--set", "stages.0.guard=flipguard", "--json")
    assert rc == 0, err
    moved = json.loads((out / "manifest.json").read_text())["stages"]["00-quantize-rtn"]["metrics"]["guard_moved"]
    assert moved > 1000
    assert invoke("run", recipe(tmp_path), "--output", plain, "--quiet")[0] == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float32)
    name = "model.layers.2.self_attn.q_proj"
    expected = rtn(flipguard(model.get_submodule(name).weight.data, 4, 32, True)[0], 4, 32, True)
    tensors = load_file(str(out / "hf" / "model.safetensors"))
    from compress.kernels.packing import gptq_pack

    packed = gptq_pack(expected, False)
    assert torch.equal(tensors[f"{name}.qweight"], packed["qweight"])
    assert not torch.equal(tensors[f"{name}.qweight"], load_file(str(plain / "hf" / "model.safetensors"))[f"{name}.qweight"])


@pytest.mark.slow
def test_flipguard_removes_a_quantization_conditioned_backdoor():
    """A smaller attack than the benchmark's (the bench row is the measurement): the RTN int4 model is
    malicious and the full-precision one is not; FlipGuard brings the attack under 10%."""
    from bench import flipguard as fg

    cfg = {"inject_steps": 150, "repair_steps": 300, "batch": 32, "asr_prompts": 128, "ppl_windows": 64}
    text = fg.read_text(fg.TEXT / "tinystories" / "tinystories_val.txt")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES260K)
    train, test = fg.token_stream(tok, text[: len(text) // 2]), fg.token_stream(tok, text[int(len(text) * 0.8):])
    clean = fg._load(STORIES260K)
    attacked = fg.attack(clean, train, cfg)
    assert fg.asr(attacked, test, 128) < 0.1
    assert fg.asr(fg.defended_quantized(attacked, None)[0], test, 128) > 0.8
    assert fg.asr(fg.defended_quantized(attacked, fg.DEFENCES["flipguard"])[0], test, 128) < 0.1
