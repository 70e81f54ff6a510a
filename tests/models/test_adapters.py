import pytest
import torch

from compress.driver import LayerSpec, run_blockwise
from compress.errors import BadInput
from compress.models.adapters import ModelAdapter
from compress.quantize.autoround import AutoRound, AutoRoundConfig
from compress.quantize.rtn import RTN, RTNConfig
from tests.tiny import configs, tiny_bert, tiny_causal

SPEC = LayerSpec(bits=4, group_size=32, sym=False)


def quantize(model, quantizer, tokens):
    ad = ModelAdapter(model)
    return ad, run_blockwise(model=model, blocks=ad.blocks, block_linears=ad.block_linears,
                             specs=lambda n, l: SPEC, quantizer=quantizer, tokens=tokens,
                             load_block=lambda i: None, save_block=lambda i, q: None)


@pytest.mark.parametrize("model_type", sorted(configs()))
def test_roles_and_rtn_on_every_causal_family(model_type):
    model = tiny_causal(model_type)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    ad = ModelAdapter(model)
    assert torch.allclose(model(ids).logits, before, atol=1e-6)  # linearized experts are exact
    attention = {"phi3": "qkv", "deepseek_v3": "q_a"}.get(model_type, "q")  # fused q/k/v; latent attention
    assert ad.role(0, attention) is not None and ad.role(0, "o") is not None
    assert ad.embeddings() is not None and ad.final_norm() is not None and ad.lm_head()[1] is not None
    names = list(ad.block_linears(0))
    assert all(n.startswith("model.layers.0.") for n in names)
    if model_type == "qwen3":
        assert ad.role(0, "q_norm") is not None
    if model_type in ("qwen2_moe", "mixtral"):
        assert ad.experts(0) is not None and any(".experts.3." in n for n in names)
        assert not any(n.endswith("shared_expert_gate") for n in names)
    _, qw = quantize(model, RTN(RTNConfig()), None)
    assert len(qw) == sum(len(ad.block_linears(i)) for i in range(len(ad.blocks)))
    if model_type != "deepseek_v3":  # its first block is dense, the second MoE
        assert len(qw) == 2 * len(names)
    after = model(ids).logits
    assert 0 < (after - before).abs().max() < 0.5 * before.abs().max()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen2_moe"])
def test_autoround_runs_through_driver(model_type):
    model = tiny_causal(model_type)
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    _, qw = quantize(model, AutoRound(AutoRoundConfig(bits=4, group_size=32, iters=4, batch_size=2, final_block="same")), tokens)
    assert len(qw) > 0 and all(q.bits == 4 for q in qw.values())


def test_bert_encoder_adapter():
    model = tiny_bert()
    ad = ModelAdapter(model)
    assert ad.kind == "encoder" and len(ad.blocks) == 2
    assert set(ad.block_linears(0)) == {f"encoder.layer.0.{n}" for n in
                                        ("attention.self.query", "attention.self.key", "attention.self.value",
                                         "attention.output.dense", "intermediate.dense", "output.dense")}
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    _, qw = quantize(model, AutoRound(AutoRoundConfig(bits=4, group_size=32, iters=2, batch_size=2, final_block="same")), tokens)
    assert len(qw) == 12


def test_unsupported_architecture_names_supported():
    import transformers as T

    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(BadInput, match="unsupported architecture `gpt2`.*llama"):
        ModelAdapter(model)
