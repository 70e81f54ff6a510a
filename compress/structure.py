"""Structural edits of a loaded model: keep some FFN channels, KV groups or blocks, and say so in its config.

The edits slice weights in place (`nn.Linear` rows/columns, `nn.ModuleList` entries) and then bring the
Hugging Face config to the new shapes where one value can say them (`sync_config`): `intermediate_size`
when every block has the same FFN width, `num_attention_heads` / `num_key_value_heads` (with `head_dim`
written explicitly, since `hidden_size // heads` no longer gives it), `num_hidden_layers` and the per-layer
lists (`layer_types`). transformers' attention reads its head count from the projections' shapes (`view(...,
-1, head_dim)`), so a model with fewer heads runs unchanged; a removed block's successors get their new
`layer_idx` (the KV cache is indexed by it). `compress.handoff.ModelSpec` records what was kept, in source
indices, and replays these edits on `--resume`.
"""

from __future__ import annotations

import torch
from torch import nn


def slice_linear(lin: nn.Linear, rows=None, cols=None) -> None:
    """Keep output rows `rows` and input columns `cols` (index tensors) of `lin`, in place."""
    with torch.no_grad():
        w = lin.weight.data
        w = w[rows] if rows is not None else w
        w = w[:, cols] if cols is not None else w
        lin.weight = nn.Parameter(w.contiguous(), requires_grad=False)
        if rows is not None and lin.bias is not None:
            lin.bias = nn.Parameter(lin.bias.data[rows].contiguous(), requires_grad=False)
        lin.out_features, lin.in_features = lin.weight.shape


def keep_ffn(adapter, i: int, keep: list[int]) -> None:
    """Keep FFN channels `keep` (positions in block i's current MLP) of block i's dense MLP."""
    idx = torch.tensor(keep, dtype=torch.long)
    for role in ("mlp_gate", "mlp_up"):
        if adapter.role(i, role) is not None:
            slice_linear(adapter.role(i, role), rows=idx)
    slice_linear(adapter.role(i, "mlp_down"), cols=idx)


def keep_kv_groups(adapter, i: int, keep: list[int]) -> None:
    """Keep KV heads `keep` (positions among block i's current KV heads) and the query heads that read them."""
    heads, kv = block_heads(adapter, i)
    _, _, hd = adapter.attention_shape()
    per = heads // kv
    q_heads = [g * per + j for g in keep for j in range(per)]
    q_idx = torch.tensor([h * hd + d for h in q_heads for d in range(hd)], dtype=torch.long)
    kv_idx = torch.tensor([g * hd + d for g in keep for d in range(hd)], dtype=torch.long)
    slice_linear(adapter.role(i, "q"), rows=q_idx)
    slice_linear(adapter.role(i, "k"), rows=kv_idx)
    slice_linear(adapter.role(i, "v"), rows=kv_idx)
    slice_linear(adapter.role(i, "o"), cols=q_idx)


def block_heads(adapter, i: int) -> tuple[int, int]:
    """(query heads, KV heads) of block i as its projections are now."""
    _, _, hd = adapter.attention_shape()
    return adapter.role(i, "q").out_features // hd, adapter.role(i, "k").out_features // hd


def keep_blocks(adapter, keep: list[int]) -> None:
    """Keep blocks `keep` (positions in the current block list, increasing) and renumber their attention."""
    blocks = adapter.blocks
    kept = [blocks[j] for j in keep]
    while len(blocks):
        del blocks[len(blocks) - 1]
    for j, blk in enumerate(kept):
        blocks.append(blk)
        for m in blk.modules():
            if hasattr(m, "layer_idx"):
                m.layer_idx = j
    types = getattr(adapter.model.config, "layer_types", None)
    if types is not None:
        adapter.model.config.layer_types = [types[j] for j in keep]


def sync_config(adapter) -> None:
    """Write the model's current shapes into its config where one value holds them (module docstring)."""
    c = adapter.model.config
    n = len(adapter.blocks)
    c.num_hidden_layers = n
    _, _, hd = adapter.attention_shape()
    heads = {block_heads(adapter, i) for i in range(n)}
    if len(heads) == 1:
        (q, kv), = heads
        c.head_dim = hd
        c.num_attention_heads, c.num_key_value_heads = q, kv
    widths = {adapter.role(i, "mlp_up").out_features for i in range(n) if adapter.role(i, "mlp_up") is not None}
    if len(widths) == 1:
        c.intermediate_size = widths.pop()
