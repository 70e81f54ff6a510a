"""`rotate` stage, `method: walsh`: Walsh-Hadamard rotation and BBT-spectral energy scaling (docs/walsh.md).

Every mode is an exact re-parametrisation of the full-precision model (float64 tests: tests/rotation/test_rotate.py).
`fused` and `no_rotation` land in ordinary weights of the same architecture, so the quantizer that
follows rounds the transformed weights and every exporter writes them unchanged (deployable at full
compression); `spectral` adds a run-time transform and is evaluation-only:

* `fused: true` (docs/walsh.md#fused-rotation, QuaRot R1 + SpinQuant R2, zero run-time cost):
  1. tied input/output embeddings are untied (`config.tie_word_embeddings = False`), because the
     LM head receives the final norm's weight and the embedding does not;
  2. every RMSNorm weight is folded into the columns of the modules that read it (q/k/v; gate/up,
     router, every expert, shared expert and its gate; lm_head) and set to 1;
  3. the residual stream is rotated by `Q = H_hidden / sqrt(hidden)` (`hadamard.py`, K * 2^m):
     embeddings `E <- E Q`, readers `W <- W Q`, writers (o, down, experts' down) `W <- Q^T W`, `b <- b Q`;
  4. per value head, `v_proj` rows `<- Q_hd^T W` (and bias) and the matching `o_proj` columns `<- W Q_hd`;
     q/k are never rotated on their output side, so RoPE and Qwen3's q_norm/k_norm see vanilla q/k.
  There is no R4 (online Hadamard on the down_proj input): it would need a run-time operator.
* `mode: no_rotation` (docs/walsh.md#no-rotation-scaling, the published norm-absorbed BBT scaling): per-coordinate
  activation energy `e` of each input group on the calibration data, `rho = e / sum(e)`,
  `s = clamp((1 + n rho) ** alpha, min=1e-2)`; then
  group 1: `input_norm.weight /= s`, q/k/v columns `*= s`; group 2: `post_attn_norm.weight /= s`,
  every MLP reader's columns (router and experts included) `*= s`; group 3: each up_proj's rows (and
  bias) `/= s`, its down_proj columns `*= s`; group 4: v_proj rows `/= s`, o_proj columns `*= s`, with
  `s` tied across the query heads of one KV group (exact under GQA; the published code skips GQA).
  Energies are measured on the model being quantized, after the fused rotation when there is one.
  `influence_basis`: `wht` (paper-code faithful: energy of `pad(x) H / sqrt(d_pad)`, tail dropped,
  renormalised, used to scale raw channel l) or `channel` (`E[x_l^2]`, basis-consistent). With
  `fused: true` the stream is already in the Walsh basis, so the energy is always per channel.
  `mode: none` only rotates (the `alpha = 0` ablation).

  The scaled weights `W diag(s)` are what the block-wise quantizer (AutoRound, GPTQ, RTN) rounds, so
  high-energy input coordinates are boosted before per-group rounding, as in the paper.
* `mode: spectral` and `head_pca: true`: evaluation-only research modes (run-time operators no exporter
  writes), in compress/rotation/research.py; the registration declares them so (`evaluation_only`).
* `alpha: auto` (any scaling mode): per scale vector, the alpha of `alpha_grid` whose energy-weighted
  round-to-nearest error at the next quantize stage's bits, group size and symmetry is least (`Scaler`).

* `pair_pca: true` (docs/walsh.md#pair-pca, the paper's `spectral_pca_2d` when layered on `no_rotation`): per
  KV head and RoPE plane `(c, c + hd/2)` (transformers' `rotate_half` layout), the 2x2 covariance of
  `k_proj`'s output on the calibration data gives principal axes `U` (det forced to +1); the plane's
  rows of `k_proj` and of every query head of that KV group (weights and biases) become `U^T rows`.
  RoPE rotates each plane and plane rotations commute, so `q.k` after RoPE is unchanged: deployable as
  plain weights. Refused with q_norm/k_norm (their per-channel weights do not commute) and partial RoPE.

"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

import torch
from pydantic import Field, model_validator
from torch import nn

from compress.calibration import collect_energy
from compress.config import StrictModel
from compress.errors import BadInput
from compress.registry import register
from compress.rotation.hadamard import factor, hadamard_transform
from compress.rotation.pca import apply_pair_pca
from compress.rotation.research import apply_head_pca, apply_spectral, spectral_targets
from compress.rotation.scaling import Scaler, pad_pow2
from compress.rotation.surgery import (
    fuse_norms,
    map_columns,
    map_rows,
    rotate_residual,
    rotate_value_heads,
    set_param,
    untie_embeddings,
)


class WalshConfig(StrictModel):
    stage: Literal["rotate"] = "rotate"
    method: Literal["walsh"] = "walsh"
    fused: bool = Field(True, description="rotate the residual stream and value heads by Walsh-Hadamard matrices, "
                                          "absorbed into the weights (zero run-time cost)")
    mode: Literal["no_rotation", "spectral", "none"] = Field(
        "no_rotation", description="no_rotation: published norm-absorbed BBT energy scaling (deployable); "
                                   "spectral: published per-linear input WHT + scaling (in memory only, not exportable); "
                                   "none: rotation only")
    alpha: Union[Annotated[float, Field(ge=0, le=2)], Literal["auto"]] = Field(
        0.5, description="energy exponent: s = (1 + n rho) ** alpha; auto: per scaling group (per linear in mode "
                         "spectral), the alpha of alpha_grid whose round-to-nearest error at the next quantize "
                         "stage's bits, weighted by the input energy, is least")
    alpha_grid: list[Annotated[float, Field(ge=0, le=2)]] = Field(
        [0.0, 0.25, 0.5, 0.75, 1.0], min_length=1, description="candidates of alpha: auto")
    pad: Literal["pow2", "none"] = Field(
        "pow2", description="mode spectral: pow2 pads each linear's input to the next power of two, as published (the "
                            "rounded weight grows, e.g. 172 -> 256 columns); none transforms at the input's own size "
                            "K * 2^m (no growth; sizes without a Walsh-Hadamard matrix are refused)")
    influence_basis: Optional[Literal["wht", "channel"]] = Field(
        None, description="energy basis without fusion: wht (paper code, default) or channel; fused: channel")
    pair_pca: bool = Field(False, description="also rotate each RoPE plane of q/k by the SO(2) principal axes of k "
                                              "(docs/walsh.md#pair-pca; the paper's spectral_pca_2d layers it on "
                                              "no_rotation)")
    head_pca: bool = Field(False, description="Qwen3 (q_norm/k_norm): rotate each q/k head onto its principal axes and "
                                              "make q_norm/k_norm matrix-gamma norms (docs/walsh.md#head-pca; "
                                              "evaluation only)")

    @model_validator(mode="after")
    def _check(self):
        if self.fused and self.influence_basis == "wht":
            raise ValueError("fused: true measures energy in the rotated (Walsh) stream; use influence_basis: channel "
                             "or leave it unset")
        if self.mode == "spectral" and (self.fused or self.influence_basis == "channel"):
            raise ValueError("mode: spectral is the unfused per-linear Walsh transform: set fused: false and leave "
                             "influence_basis unset (it is always the Walsh basis)")
        if self.pad != "pow2" and self.mode != "spectral":
            raise ValueError("pad applies to mode: spectral (the per-linear transform) only")
        if self.mode == "none" and not self.fused and not self.pair_pca:
            raise ValueError("mode: none with fused: false changes nothing")
        if self.pair_pca and self.head_pca:
            raise ValueError("pair_pca is for RoPE models without q_norm, head_pca for those with it: choose one")
        if self.pair_pca and self.mode == "spectral":
            raise ValueError("pair_pca rotates q/k output rows of plain linears: use it with mode no_rotation or none")
        return self

    @property
    def basis(self) -> str:
        return "channel" if self.fused else (self.influence_basis or "wht")


# -- checks ------------------------------------------------------------------------------------------
def evaluation_only(cfg: WalshConfig) -> str | None:
    """Why this configuration cannot be exported (registered with the stage; the bind step refuses exports)."""
    if cfg.mode == "spectral":
        return ("uses `mode: spectral`, a run-time input transform (pad + Walsh-Hadamard + 1/s; use the deployable "
                "`fused: true` or `mode: no_rotation`)")
    if cfg.head_pca:
        return "uses `head_pca: true`, which makes q_norm/k_norm matrix-gamma norms (set `head_pca: false`)"
    return None


def check(adapter, cfg: WalshConfig, facts=None) -> None:
    """Refuse what the rotation cannot handle exactly, before anything is changed. `facts` (the bind step's):
    the rounding of the next quantize stage, which `alpha: auto` needs."""
    if cfg.alpha == "auto" and facts is not None and facts.rounding is None:
        raise BadInput("rotate/walsh `alpha: auto` picks alpha against the rounding of the next `quantize` stage; "
                       "add one after the rotation or give a number")
    if cfg.mode == "spectral":

        if cfg.pad == "none":
            for name, lin in spectral_targets(adapter).items():
                try:
                    factor(lin.in_features)
                except BadInput as e:
                    raise BadInput(f"rotate/walsh `pad: none`: {name}: {e}; use `pad: pow2`") from None
        return  # a per-linear input transform: exact for any linear layer, no norm surgery (encoders too)
    adapter.refuse("rotate", f"rotate/walsh `mode: {cfg.mode}`")
    if adapter.kind != "causal":
        raise BadInput(f"rotate/walsh `mode: {cfg.mode}` absorbs scales and rotations into pre-norm RMSNorm layers; "
                       f"`{adapter.model_type}` is a post-LayerNorm encoder: use `fused: false, mode: spectral` "
                       "(per-linear transform, evaluation only)")
    norms = [adapter.final_norm()] + [adapter.role(i, r) for i in range(len(adapter.blocks))
                                     for r in ("input_norm", "post_attn_norm")]
    for n in norms:
        if n is None or getattr(n, "bias", None) is not None or "RMSNorm" not in type(n).__name__:
            raise BadInput(f"rotate/walsh needs RMSNorm layers without bias; found {type(n).__name__}")
    if cfg.fused:
        factor(adapter.model.config.hidden_size)  # BadInput naming the supported sizes
        factor(adapter.attention_shape()[2])
    if cfg.head_pca:
        if "q_norm" not in adapter.arch.roles:
            raise BadInput(f"head_pca replaces q_norm/k_norm, which `{adapter.model_type}` does not have; use "
                           "`pair_pca: true` for RoPE models without them")
    if cfg.pair_pca:
        c = adapter.model.config
        if "q_norm" in adapter.arch.roles:
            raise BadInput("pair_pca: per-head q_norm/k_norm weights do not commute with rotations inside RoPE planes "
                           f"(`{adapter.model_type}`); set `pair_pca: false`")
        if getattr(c, "partial_rotary_factor", 1.0) != 1.0 or adapter.attention_shape()[2] % 2:
            raise BadInput("pair_pca needs RoPE over the whole (even) head dimension; set `pair_pca: false`")


# -- energy statistics and scaling ------------------------------------------------------------------
def measure(adapter, tokens: torch.Tensor, basis: str) -> dict:
    """Energy of every scaling group's input on the calibration tokens (calibration.collect_energy)."""
    taps = {}
    for i in range(len(adapter.blocks)):
        for role in ("input_norm", "post_attn_norm"):
            taps[(i, role)] = (adapter.role(i, role), "output")
        taps[(i, "o")] = (adapter.role(i, "o"), "input")
        for j, (_, down) in enumerate(adapter.up_down_pairs(i)):
            taps[(i, "down", j)] = (down, "input")
    transform = (lambda x: hadamard_transform(pad_pow2(x))) if basis == "wht" else None
    return collect_energy(adapter.model, tokens, taps, transform)


def _first(energy: dict, key, d: int) -> torch.Tensor | None:
    """The first d coordinates (tail of a zero-padded WHT dropped), or None when nothing reached the tap."""
    e = energy.get(key)
    return None if e is None or float(e[:d].sum()) == 0.0 else e[:d]


def apply_scaling(adapter, energy: dict, scaler: Scaler, actual: dict | None = None) -> dict:
    """Groups 1-4 of docs/walsh.md#no-rotation-scaling; returns how many scale vectors were applied per group.
    `actual`: the channel-basis energies when `energy` is in another basis (only `alpha: auto` reads them)."""
    heads, kv, hd = adapter.attention_shape()
    done = {"norm": 0, "up_down": 0, "v_o": 0}
    hidden = adapter.model.config.hidden_size
    actual = actual or energy
    for i in range(len(adapter.blocks)):
        quantized = {id(m) for m in adapter.block_linears(i).values()}
        for role in ("input_norm", "post_attn_norm"):
            e = _first(energy, (i, role), hidden)
            if e is None:
                continue
            readers = adapter.norm_readers(i, role)
            s = scaler(e, [m.weight for m in readers if id(m) in quantized], _first(actual, (i, role), hidden))
            norm = adapter.role(i, role)
            set_param(norm.weight, norm.weight.double() / s)
            for m in readers:
                map_columns(m, lambda W: W * s)
            done["norm"] += 1
        for j, (up, down) in enumerate(adapter.up_down_pairs(i)):
            e = _first(energy, (i, "down", j), down.in_features)
            if e is None:  # an expert no calibration token was routed to
                continue
            s = scaler(e, [down.weight], _first(actual, (i, "down", j), down.in_features))
            map_rows(up, lambda W: W / s)
            map_columns(down, lambda W: W * s)
            done["up_down"] += 1
        e = _first(energy, (i, "o"), heads * hd)
        if e is not None:  # tie across the query heads sharing one KV head, then spread back
            def spread(s_kv):
                return s_kv.reshape(kv, 1, hd).expand(kv, heads // kv, hd).reshape(-1)

            s_kv = scaler(e.reshape(kv, heads // kv, hd).mean(1).reshape(-1), [adapter.role(i, "o").weight],
                          _first(actual, (i, "o"), heads * hd), spread)
            s_o = spread(s_kv)
            map_rows(adapter.role(i, "v"), lambda W: W / s_kv)
            map_columns(adapter.role(i, "o"), lambda W: W * s_o)
            done["v_o"] += 1
    return done


def _spectrum_taps(adapter) -> dict:
    """(layer, kind) -> the linear whose input the quantizer rounds against: attention (q) and MLP down."""
    taps = {}
    for i in range(len(adapter.blocks)):
        pairs = adapter.up_down_pairs(i)
        for kind, m in (("attention", adapter.role(i, "q")), ("mlp down", pairs[0][1] if pairs else None)):
            if m is not None:
                taps[(i, kind)] = (m[-1] if isinstance(m, nn.Sequential) else m, "input")
    return taps


@register("rotate", "walsh", WalshConfig,
          "Walsh-Hadamard rotation + BBT-spectral energy scaling, absorbed into the weights", check=check, replay=True,
          evaluation_only=evaluation_only)
def apply(ctx, cfg: WalshConfig) -> dict:
    """Rotate and scale. On --resume a finished rotation replays (it rewrites the weights in place) without
    its figure, whose two calibration passes only feed report.md."""
    adapter = ctx.adapter
    check(adapter, cfg)
    workspace = getattr(ctx, "workspace", None)
    figure = workspace is not None and not getattr(ctx, "replaying", False)
    before = _energy(ctx, adapter, "before") if figure else None
    metrics = _apply(ctx, adapter, cfg)
    if figure:  # the per-layer energy spectrum the quantizer sees, before and after (report.md)
        from compress.eval.figures import energy_spectrum, save_png

        after = _energy(ctx, adapter, "after")
        title = f"rotate/walsh fused={cfg.fused} mode={cfg.mode}: input energy of the rounded weights"
        rel = save_png(energy_spectrum(before, after, title), workspace, f"figures/{ctx.key}-energy.png")
        metrics["figures"] = {"activation energy spectrum before/after rotation": rel}
    return metrics


def _energy(ctx, adapter, when: str) -> dict:
    """One calibration pass collecting the activation energy at the rounded layers' inputs, with a progress bar."""
    tokens, batch = ctx.calibration_tokens(), 8
    bar = ctx.progress(total=-(-tokens.shape[0] // batch), desc=f"{ctx.key} energy {when} rotation (report figure)",
                       unit="batch")
    try:
        return collect_energy(adapter.model, tokens, _spectrum_taps(adapter), batch_size=batch, progress=bar.update)
    finally:
        bar.close()


def _apply(ctx, adapter, cfg: WalshConfig) -> dict:
    metrics = {"fused": cfg.fused, "mode": cfg.mode, "untied_embeddings": False}
    if cfg.fused:
        metrics["untied_embeddings"] = untie_embeddings(adapter)
        fuse_norms(adapter)
        rotate_residual(adapter)
        rotate_value_heads(adapter)
    scaler = Scaler(cfg.alpha, cfg.alpha_grid, ctx.facts.rounding if cfg.alpha == "auto" else None)
    if cfg.mode == "no_rotation":
        tokens = ctx.calibration_tokens()
        actual = measure(adapter, tokens, "channel") if cfg.alpha == "auto" and cfg.basis != "channel" else None
        metrics.update(apply_scaling(adapter, measure(adapter, tokens, cfg.basis), scaler, actual))
        metrics["calibration_tokens"] = tokens.numel()
    elif cfg.mode == "spectral":
        tokens = ctx.calibration_tokens()

        metrics.update(apply_spectral(adapter, tokens, scaler, cfg.pad))
        metrics["calibration_tokens"] = tokens.numel()
    metrics.update(scaler.summary())
    if cfg.pair_pca:
        metrics.update(apply_pair_pca(adapter, ctx.calibration_tokens()))
    if cfg.head_pca:

        metrics.update(apply_head_pca(adapter, ctx.calibration_tokens()))
    return metrics
