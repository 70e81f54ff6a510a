"""Evaluation-only research modes of `rotate/walsh` (docs/walsh.md): exact in full precision and evaluated in
memory, but each leaves a run-time operator that no exporter writes, so the walsh registration declares them
`evaluation_only` and the bind step refuses a recipe that also exports.

* `mode: spectral` (docs/walsh.md#spectral-mode, the paper's headline mode; `fused: false` only): every block linear
  `W` (d_out, d_in) becomes `WalshInput -> Linear(d_pad, d_out)` with `d_pad = next_pow2(d_in)`,
  `x~ = pad(x) Q D^-1` computed at run time and `W~ = pad(W) Q D`, `D = diag(s)` from the energy of
  `pad(x) Q` over all d_pad coordinates (the paper's definition). Exact in full precision and evaluated
  in memory, but **not exportable**: no exporter here writes the run-time transform, so a recipe with
  `mode: spectral` and any `export.formats` is refused at plan time. As in the published code, models
  with q_norm/k_norm (Qwen3) keep their attention linears untransformed in this mode (docs/walsh.md#pitfalls).
  It is the one mode that also runs on post-LayerNorm encoders (BERT/MiniLM): it touches no norm.
  The padded weight is what gets rounded and stored: `d_pad - d_in` more columns (stories260K's down_proj
  172 -> 256, +12% of the model's rounded weights). `pad: none` transforms at `d_pad = d_in` with a K * 2^m
  Hadamard instead (no growth).

* `head_pca: true` (docs/walsh.md#head-pca, the paper's `spectral_pca` when layered on `no_rotation`; Qwen3's
  q_norm/k_norm): per q (and k) head, the eigenvectors `U_h` of the head's output covariance on the
  calibration data (det +1, largest first) rotate its rows `W_h <- U_h^T W_h`, and q_norm/k_norm become
  `MatrixGammaRMSNorm` with `Gamma_h = diag(gamma) U_h` (the asymmetric form: RoPE then sees vanilla
  q/k). The matrix norm is a run-time module no exporter writes: evaluation only, refused with export
  formats at plan time (the paper de-rotates to FP16 for deployment, which saves nothing).
"""

from __future__ import annotations

import torch
from torch import nn

from compress.calibration import collect_energy
from compress.models.adapters import get_module
from compress.rotation.hadamard import hadamard_transform
from compress.rotation.pca import principal_axes, qk_covariances, rotate_head_rows
from compress.rotation.scaling import Scaler, pad_to, pow2
from compress.rotation.surgery import set_param


# -- head_pca: matrix-gamma q_norm/k_norm --------------------------------------------------------------
class MatrixGammaRMSNorm(nn.Module):
    """Per-head RMSNorm whose weight is a matrix: out_h = Gamma_h x_h / RMS(x_h), Gamma_h = diag(gamma) U_h.

    Replaces Qwen3's q_norm/k_norm after the head's rows were rotated by U_h^T, so that
    Gamma_h (U_h^T y_h) / RMS(U_h^T y_h) = gamma * y_h / RMS(y_h) exactly (docs/walsh.md#head-pca)."""

    def __init__(self, gamma: torch.Tensor, U: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("gamma", (gamma[None, :, None] * U).to(gamma.dtype))  # (n, hd, hd)
        self.eps = eps

    def forward(self, x):  # x (..., n, hd)
        y = x.double() if x.dtype == torch.float64 else x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return torch.einsum("nij,...nj->...ni", self.gamma.to(y.dtype), y).to(x.dtype)


def apply_head_pca(adapter, tokens: torch.Tensor) -> dict:
    """Qwen3: per head, rotate q/k rows onto the principal axes of the head's output covariance and turn
    q_norm/k_norm into a MatrixGammaRMSNorm (a run-time module: evaluation only)."""
    for role, norm_role in (("q", "q_norm"), ("k", "k_norm")):
        covs = qk_covariances(adapter, tokens, role)
        for i, cov in covs.items():
            U = principal_axes(cov)
            rotate_head_rows(adapter.role(i, role), U)
            norm = adapter.role(i, norm_role)
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
            new = MatrixGammaRMSNorm(norm.weight.detach().double(), U, eps).to(norm.weight.dtype)
            parent, _, leaf = adapter.arch.roles[norm_role].rpartition(".")
            setattr(get_module(adapter.blocks[i], parent) if parent else adapter.blocks[i], leaf, new)
    return {"head_pca_layers": len(adapter.blocks)}


# -- mode spectral: run-time input transform per linear (not exportable) ----------------------------
class WalshInput(nn.Module):
    """x (..., d_in) -> pad(x) Q / s (..., d_pad): the input side of a `spectral` linear."""

    def __init__(self, d_in: int, s: torch.Tensor):
        super().__init__()
        self.d_in = d_in
        self.register_buffer("inv_s", 1.0 / s)

    def forward(self, x):
        return hadamard_transform(pad_to(x, self.inv_s.numel())) * self.inv_s.to(x.dtype)


def spectral_targets(adapter) -> dict[str, nn.Linear]:
    """Block linears transformed in mode spectral: all quantizable ones, minus attention when q_norm exists."""
    out = {}
    for i in range(len(adapter.blocks)):
        attn = {id(adapter.role(i, r)) for r in ("q", "k", "v", "o")} if "q_norm" in adapter.arch.roles else set()
        out.update({n: m for n, m in adapter.block_linears(i).items() if id(m) not in attn})
    return out


def apply_spectral(adapter, tokens: torch.Tensor, scaler: Scaler, pad: str = "pow2") -> dict:
    targets = spectral_targets(adapter)
    size = pow2 if pad == "pow2" else (lambda n: n)
    energy = collect_energy(adapter.model, tokens, {n: (m, "input") for n, m in targets.items()},
                            lambda x: hadamard_transform(pad_to(x, size(x.shape[-1]))))
    stored = 0
    for name, lin in targets.items():
        e = energy.get(name)
        d_pad = size(lin.in_features)
        W = hadamard_transform(pad_to(lin.weight.detach().double(), d_pad))
        s = torch.ones(d_pad, dtype=torch.float64) if e is None or float(e.sum()) == 0 else scaler(e, [W])
        new = nn.Linear(d_pad, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype,
                        device=lin.weight.device)
        set_param(new.weight, W * s)
        stored += (d_pad - lin.in_features) * lin.out_features
        if lin.bias is not None:
            set_param(new.bias, lin.bias.double())
        parent, _, leaf = name.rpartition(".")
        setattr(adapter.model.get_submodule(parent), leaf,
                nn.Sequential(WalshInput(lin.in_features, s.to(lin.weight.dtype)), new))
    return {"spectral_linears": len(targets), "padded_weights": stored}
