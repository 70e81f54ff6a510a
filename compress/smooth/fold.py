"""What every `smooth` method shares: the groups of linears that read one input (and the operation before them that
can absorb a per-channel scale), the fold of a scale vector into them, and the per-block files that make an
interrupted stage continue and a finished one replay bit-identically.

A group's scale s divides its input channels and multiplies its readers' columns, so `(x / s) (W diag(s))^T = x W^T`
exactly in real arithmetic:

  attn_in   input_norm -> q/k/v (q_a, kv_a, qkv): the norm's weight / s (Gemma's `1 + w` norms: 1 + w' = (1 + w) / s)
  mlp_in    post_attn_norm -> gate/up (every expert, the router, shared experts and their gate): the same
  up_down   up's rows (and bias) / s, down's columns * s, for every gated MLP (every expert)
  v_o       v's rows / s_kv, o's columns * s, s tied across the query heads of one KV group (exact under GQA)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compress.errors import BadInput
from compress.primitives import fake_quantize, group_round, group_view, resolve_group
from compress.rotation.surgery import map_columns, map_rows, set_param

GROUPS = ("attn_in", "mlp_in", "up_down", "v_o")


@dataclass
class Group:
    key: str  # "attn_in", "mlp_in", "up_down.J", "v_o"
    source: nn.Module  # the norm (attn_in, mlp_in), up (up_down) or v (v_o)
    readers: list  # every module whose input columns take s (quantized or not: routers, scalar gates)
    tap: tuple  # (module, "output" | "input"): where the readers' input is seen
    tie: tuple | None = None  # v_o: (heads, kv, head_dim)

    @property
    def kind(self) -> str:
        return self.key.split(".")[0]


def groups(adapter, i: int) -> list[Group]:
    """Every group block i has."""
    out = []
    for key, role in (("attn_in", "input_norm"), ("mlp_in", "post_attn_norm")):
        norm = adapter.role(i, role)
        if norm is not None:
            out.append(Group(key, norm, adapter.norm_readers(i, role), (norm, "output")))
    for j, (up, down) in enumerate(adapter.up_down_pairs(i)):
        out.append(Group(f"up_down.{j}", up, [down], (down, "input")))
    v, o = adapter.role(i, "v"), adapter.role(i, "o")
    if v is not None and o is not None:
        out.append(Group("v_o", v, [o], (o, "input"), adapter.attention_shape()))
    return out


def available(adapter) -> set[str]:
    """The groups this architecture's adapter names (block 0; DeepSeek's dense first blocks have them all)."""
    roles = adapter.arch.roles
    have = {k for k, r in (("attn_in", "input_norm"), ("mlp_in", "post_attn_norm")) if r in roles}
    if any(up in roles for up in ("mlp_up", "shared_up")) or adapter.arch.experts:
        have.add("up_down")
    if "v" in roles and "o" in roles:
        have.add("v_o")
    return have


def check_foldable(adapter, method: str) -> set[str]:
    """The groups a `smooth` method can fold into on this model; refuses (at plan time) a model it cannot."""
    if adapter.kind != "causal":
        raise BadInput(f"smooth/{method} folds scales into the pre-norms of a decoder; `{adapter.model_type}` is a "
                       "post-LayerNorm encoder (its norms' outputs are the residual stream)")
    have = available(adapter)
    if not {"attn_in", "mlp_in"} & have:
        raise BadInput(f"smooth/{method} folds scales into the norms before the attention and MLP inputs; "
                       f"`{adapter.model_type}`'s adapter names none (it normalises branch outputs only)")
    return have


def watch(adapter, i: int, taps: list, acts, kwargs) -> None:
    """One pass of the calibration activations through block i, `fn(x)` called with what each tap sees: `taps` are
    (module, "output" | "input", fn)."""
    from compress.driver import block_forward

    hooks = []
    try:
        for m, where, fn in taps:
            if where == "output":
                hooks.append(m.register_forward_hook(lambda _m, _a, out, fn=fn: fn(out)))
            else:
                hooks.append(m.register_forward_pre_hook(lambda _m, args, fn=fn: fn(args[0])))
        with torch.no_grad():
            for x, kw in zip(acts, kwargs):
                block_forward(adapter.blocks[i], x, kw)
    finally:
        for h in hooks:
            h.remove()


def tied(v: torch.Tensor, tie) -> torch.Tensor:
    """A per-channel vector of o's input averaged over the query heads that share one KV head."""
    if tie is None:
        return v
    heads, kv, hd = tie
    return v.reshape(kv, heads // kv, hd).mean(1).reshape(-1)


def spread(s: torch.Tensor, tie) -> torch.Tensor:
    """A scale of v's rows (one per KV channel) as the scale of o's columns (every query head of the KV group)."""
    if tie is None:
        return s
    heads, kv, hd = tie
    return s.reshape(kv, 1, hd).expand(kv, heads // kv, hd).reshape(-1)


def apply_scales(adapter, groups: list[Group], scales: dict) -> None:
    """Fold {group key: s} into block's weights (float64 arithmetic, cast back to each parameter's dtype)."""
    offset = adapter.arch.norm_offset
    for g in groups:
        s = scales.get(g.key)
        if s is None:
            continue
        cols = spread(s, g.tie)
        if g.kind in ("attn_in", "mlp_in"):
            norm = g.source
            set_param(norm.weight, (norm.weight.double() + offset) / s - offset)
            if getattr(norm, "bias", None) is not None:
                set_param(norm.bias, norm.bias.double() / s)
        else:
            map_rows(g.source, lambda W: W / s)
        for m in g.readers:
            map_columns(m, lambda W: W * cols)


def rounded(W: torch.Tensor, spec) -> torch.Tensor:
    """What the next quantize stage's round-to-nearest makes of W (fp32)."""
    if spec.ggml:
        from compress.quantize import ggml_grid

        return ggml_grid.rtn(W, spec.ggml).dequantize(torch.float32)
    if getattr(spec, "fp", None) is not None:
        from compress.quantize import floatgrid

        return floatgrid.rtn(W, spec.group_size, spec.fp).dequantize(torch.float32)
    if spec.bits < 2:
        return fake_quantize(W, spec.bits, spec.group_size, spec.sym)
    d_out, d_in = W.shape
    Wg = group_view(W, resolve_group(d_in, spec.group_size))  # primitives.rtn's arithmetic, without its codes
    return group_round(Wg, spec.bits, spec.sym)[2].reshape(d_out, -1)[:, :d_in]


def apply_checked(adapter, i: int, groups: list[Group], scales: dict, x: torch.Tensor, kw: dict) -> float:
    """`apply_scales`, and the relative change of block i's output on one calibration batch (round-off only)."""
    from compress.driver import block_forward

    with torch.no_grad():
        ref = block_forward(adapter.blocks[i], x, kw)
        apply_scales(adapter, groups, scales)
        out = block_forward(adapter.blocks[i], x, kw)
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def save_block(ctx, filename: str, tensors: dict) -> None:
    """A block's fold in the stage directory, its sha256 in the manifest (a resumed stage trusts only such files)."""
    ws = getattr(ctx, "workspace", None)
    if ws is None:
        return
    from safetensors.torch import save

    ws.write_bytes(f"stages/{ctx.key}/{filename}", save({k: v.contiguous() for k, v in tensors.items()}))
    ws.save_manifest()


def load_block(ctx, filename: str) -> dict | None:
    ws = getattr(ctx, "workspace", None)
    if ws is None:
        return None
    path = ws.verified(f"stages/{ctx.key}/{filename}")
    if path is None:
        return None
    from safetensors.torch import load_file

    return load_file(str(path))
