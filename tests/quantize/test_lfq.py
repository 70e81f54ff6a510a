"""LFQ (logit-aware final block): the loss, its chunking, what it touches, and that it runs through
AutoRound and GPTQ on a tiny model and on stories260K."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_causal
from torch import nn

from compress.driver import run_blockwise
from compress.models.adapters import ModelAdapter
from compress.models.head import LogitHead
from compress.quantize.autoround import AutoRound, AutoRoundConfig
from compress.quantize.gptq import GPTQ, GPTQConfig
from compress.quantize.lfq import kl_per_token, logit_loss_backward, shifted_labels
from compress.quantize.spine import FinalBlock, layer_spec


def test_soft_ce_minus_entropy_is_kl_and_zero_at_teacher():
    torch.manual_seed(0)
    zt, zq = torch.randn(7, 50), torch.randn(7, 50)
    pt = zt.softmax(-1)
    soft_ce = -(pt * zq.log_softmax(-1)).sum(-1)
    entropy = -(pt * zt.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(soft_ce - entropy, kl_per_token(zt, zq))
    assert (kl_per_token(zt, zq) > 0).all()
    assert kl_per_token(zt, zt).abs().max() < 1e-6


def test_shifted_labels_ignore_the_last_position():
    t = torch.tensor([[5, 6, 7], [1, 2, 3]])
    assert shifted_labels(t).tolist() == [[6, 7, -100], [2, 3, -100]]


class _Head(LogitHead):
    def __init__(self):
        torch.manual_seed(1)
        super().__init__(nn.LayerNorm(16), nn.Linear(16, 40, bias=False))
        self.requires_grad_(False)


@pytest.mark.parametrize("mode", ["lfq", "hard_ce"])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_loss_and_gradient_equal_the_unchunked_ones(mode, chunk):
    """The chunked, detached-hidden computation gives the loss and block gradient of the plain one."""
    head = _Head()
    torch.manual_seed(2)
    x, fp_out = torch.randn(3, 6, 16), torch.randn(3, 6, 16)
    tokens = torch.randint(0, 40, (3, 6))
    w1 = torch.randn(16, 16, requires_grad=True)
    loss = logit_loss_backward(x @ w1, fp_out, head, mode, tokens, chunk_tokens=chunk)
    w2 = w1.detach().clone().requires_grad_(True)
    zq = head((x @ w2).reshape(-1, 16))
    if mode == "lfq":
        ref = kl_per_token(head(fp_out.reshape(-1, 16)), zq).mean()
    else:
        ref = F.cross_entropy(zq, shifted_labels(tokens).reshape(-1), ignore_index=-100)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-6)


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode() + v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _quantize(model, quantizer, cfg, tokens):
    """The quantize spine's path: the method wrapped in the final-block objective, through the driver."""
    quantizer = FinalBlock(quantizer, cfg)
    ad = ModelAdapter(model)
    head = LogitHead.of(ad) if quantizer.needs_head else None
    seen = []
    orig = quantizer.quantize_block

    def spy(data):
        seen.append((data.index, data.head is not None) + ((bool(data.hessians),) if quantizer.needs_hessian else ()))
        return orig(data)

    quantizer.quantize_block = spy
    q = run_blockwise(model=model, blocks=ad.blocks, block_linears=ad.block_linears,
                      specs=lambda n, lin: layer_spec(n, lin, cfg), quantizer=quantizer, tokens=tokens,
                      load_block=lambda i: None, save_block=lambda i, qw: None, head=head)
    return q, seen


@pytest.mark.parametrize("mode", ["lfq", "hard_ce"])
def test_autoround_lfq_touches_only_the_last_block_and_leaves_the_head_frozen(mode):
    """Blocks before the last are bit-identical to plain AutoRound; the final norm and LM head are
    unchanged; only the last block's quantization differs."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (8, 32))
    kw = dict(bits=2, group_size=32, sym=False, iters=20, batch_size=4)
    plain_model, lfq_model = tiny_causal("llama"), tiny_causal("llama")
    head_before = _digest(lfq_model.lm_head) + _digest(lfq_model.model.norm)
    plain_cfg = AutoRoundConfig(**kw, final_block="same")
    plain, seen_plain = _quantize(plain_model, AutoRound(plain_cfg), plain_cfg, tokens)
    cfg = AutoRoundConfig(**kw, final_block=mode)
    lfq, seen = _quantize(lfq_model, AutoRound(cfg), cfg, tokens)
    assert seen == [(0, False), (1, True)] and seen_plain == [(0, False), (1, False)]
    assert _digest(lfq_model.lm_head) + _digest(lfq_model.model.norm) == head_before
    assert all(p.grad is None for p in lfq_model.parameters())
    for name in plain:
        same = torch.equal(plain[name].codes, lfq[name].codes) and torch.equal(plain[name].scales, lfq[name].scales)
        assert same == name.startswith("model.layers.0."), name


def test_gptq_final_block_lfq_tunes_the_last_block_with_autoround():
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (8, 32))
    cfg = GPTQConfig(bits=3, group_size=32, sym=False, final_block="lfq", final_iters=10)
    plain_cfg = GPTQConfig(bits=3, group_size=32, sym=False)
    lfq, seen = _quantize(tiny_causal("llama"), GPTQ(cfg), cfg, tokens)
    plain, seen_plain = _quantize(tiny_causal("llama"), GPTQ(plain_cfg), plain_cfg, tokens)
    assert seen == [(0, False, True), (1, True, False)]  # (block, head, hessians): no Hessians for the tuned block
    assert seen_plain == [(0, False, True), (1, False, True)]
    diff = {n for n in plain if not torch.equal(plain[n].codes, lfq[n].codes)}
    assert diff and all(n.startswith("model.layers.1.") for n in diff)


def test_final_block_objective_needs_a_causal_lm():
    from tiny import tiny_bert

    from compress.errors import BadInput

    with pytest.raises(BadInput, match="needs a causal LM"):
        LogitHead.of(ModelAdapter(tiny_bert()))


@pytest.mark.parametrize("method", ["autoround", "gptq", "rtn"])
def test_final_block_auto_is_lfq_on_causal_lms_and_same_on_encoders(method):
    """`final_block` is a property of the quantize spine, for every quantizer: `auto` (AutoRound's default)
    resolves per model at plan time; an explicit value is kept; the spine handed an unresolved `auto`
    refuses instead of guessing."""
    from tiny import tiny_bert

    from compress.quantize.spine import QUANTIZERS, FinalBlock
    from compress.registry import get

    entry = get("quantize", method)
    Config = entry.config
    assert Config(bits=4).final_block == ("auto" if method == "autoround" else "same")
    for model, explicit, expected in [(tiny_causal("llama"), "auto", "lfq"), (tiny_bert(), "auto", "same"),
                                      (tiny_causal("llama"), "same", "same"), (tiny_causal("llama"), "hard_ce", "hard_ce")]:
        cfg = entry.check(ModelAdapter(model), Config(bits=4, final_block=explicit), None)
        q = FinalBlock(QUANTIZERS[Config](cfg), cfg)
        assert cfg.final_block == expected and q.needs_head == (expected != "same")
        assert q.needs_data == (q.inner.needs_data or expected != "same")
    auto = Config(bits=4, final_block="auto")
    with pytest.raises(ValueError, match="resolve"):
        FinalBlock(QUANTIZERS[Config](auto), auto)
