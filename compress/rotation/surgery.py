"""Exact weight surgery of the fused Walsh rotation (docs/walsh.md#fused-rotation): untie the embeddings, fold
RMSNorm weights into their readers, rotate the residual stream and each value head. Computed in float64 and
written back in the weight's dtype."""

from __future__ import annotations

import torch
from torch import nn

from compress.rotation.hadamard import hadamard_transform


def set_param(p: nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(value.to(p.dtype))


def map_columns(m: nn.Module, fn) -> None:
    """W <- fn(W) acting on the input (last) dimension."""
    set_param(m.weight, fn(m.weight.double()))


def map_rows(m: nn.Module, fn) -> None:
    """W <- fn(W^T)^T and b <- fn(b): acting on the output dimension."""
    set_param(m.weight, fn(m.weight.double().T).T)
    if getattr(m, "bias", None) is not None:
        set_param(m.bias, fn(m.bias.double()))


def untie_embeddings(adapter) -> bool:
    _, head = adapter.lm_head()
    emb = adapter.embeddings()
    if head is None or head.weight is not emb.weight:
        return False
    head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
    adapter.model.config.tie_word_embeddings = False
    return True


def _norm_groups(adapter):
    """(norm, readers) for every RMSNorm of the residual stream, final norm last."""
    for i in range(len(adapter.blocks)):
        for role in ("input_norm", "post_attn_norm"):
            yield adapter.role(i, role), adapter.norm_readers(i, role)
    yield adapter.final_norm(), [adapter.lm_head()[1]]


def fuse_norms(adapter) -> None:
    for norm, readers in _norm_groups(adapter):
        g = norm.weight.double()
        for m in readers:
            map_columns(m, lambda W: W * g)
        set_param(norm.weight, torch.ones_like(g))


def rotate_residual(adapter, Q: torch.Tensor | None = None) -> None:
    """The residual stream in the basis `x Q` (Q orthogonal, (hidden, hidden); None: the Walsh-Hadamard matrix):
    embeddings and every reader `W <- W Q`, every writer `W <- Q^T W`."""
    transform = hadamard_transform if Q is None else (lambda x: x @ Q.to(x))
    map_columns(adapter.embeddings(), transform)
    for norm, readers in _norm_groups(adapter):
        for m in readers:
            map_columns(m, transform)
    for i in range(len(adapter.blocks)):
        for m in adapter.residual_writers(i):
            map_rows(m, transform)


def rotate_value_heads(adapter, matrices: list[torch.Tensor] | None = None) -> None:
    """Each value head in the basis `v Q_j` (`matrices[i]`: block i's (kv, hd, hd) orthogonal matrices, query head
    h reading KV head h // (heads / kv); None: the Walsh-Hadamard matrix for every head): v_proj rows `<- Q_j^T W`,
    o_proj columns `<- W Q_j` per query head."""
    heads, kv, hd = adapter.attention_shape()

    def per_head(q):  # x (..., n * hd): each head's hd-slice times its matrix
        if q is None:
            return lambda x: hadamard_transform(x.reshape(*x.shape[:-1], -1, hd)).reshape(x.shape)
        return lambda x: torch.einsum("...nh,nhk->...nk", x.reshape(*x.shape[:-1], -1, hd), q.to(x)).reshape(x.shape)

    for i in range(len(adapter.blocks)):
        q = None if matrices is None else matrices[i]
        map_rows(adapter.role(i, "v"), per_head(q))
        map_columns(adapter.role(i, "o"), per_head(None if q is None else q.repeat_interleave(heads // kv, 0)))
