"""Output-side rotations of q/k onto principal axes (docs/walsh.md#pair-pca, #head-pca): `pair_pca` inside each
RoPE plane (deployable as plain weights) and the helpers `head_pca` (compress/rotation/research.py) uses."""

from __future__ import annotations

import torch
from torch import nn

from compress.calibration import collect_moments, head_covariance
from compress.rotation.surgery import map_rows


def principal_axes(cov: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of (..., d, d) covariances as columns, largest eigenvalue first, det forced to +1."""
    _, U = torch.linalg.eigh(cov)
    U = U.flip(-1).clone()
    U[..., :, -1] *= torch.linalg.det(U).sign().unsqueeze(-1)
    return U


def qk_covariances(adapter, tokens: torch.Tensor, role: str) -> dict:
    heads, kv, _ = adapter.attention_shape()
    n = kv if role == "k" else heads
    taps = {i: (adapter.role(i, role), "output") for i in range(len(adapter.blocks))}
    return collect_moments(adapter.model, tokens, taps, head_covariance(n))


def rotate_head_rows(m: nn.Module, R: torch.Tensor) -> None:
    """Rows of head h of `m` (and bias) <- R[h]^T rows: the head's output y_h becomes R[h]^T y_h."""
    n, hd, _ = R.shape
    map_rows(m, lambda x: torch.einsum("nji,...nj->...ni", R, x.reshape(*x.shape[:-1], n, hd)).reshape(x.shape))


def plane_rotations(cov: torch.Tensor) -> torch.Tensor:
    """(n, hd, hd) block rotations: inside each RoPE plane (c, c + hd/2) (transformers' rotate_half layout),
    the 2x2 principal axes of the head's covariance `cov` (n, hd, hd), det +1."""
    n, hd, _ = cov.shape
    half = hd // 2
    c = torch.arange(half)
    idx = torch.stack([c, c + half], -1)  # (half, 2)
    planes = cov[:, idx[:, :, None], idx[:, None, :]]  # (n, half, 2, 2)
    U = principal_axes(planes)
    R = torch.zeros(n, hd, hd, dtype=cov.dtype)
    R[:, idx[:, :, None], idx[:, None, :]] = U
    return R


def apply_pair_pca(adapter, tokens: torch.Tensor) -> dict:
    """Rows of every q/k head: y <- R^T y with R the plane rotations of its KV head's k covariance (query
    heads share their KV head's R); RoPE rotates each plane, rotations of one plane commute, so q.k after
    RoPE is unchanged."""
    heads, kv, _ = adapter.attention_shape()
    for i, cov in qk_covariances(adapter, tokens, "k").items():
        R = plane_rotations(cov)
        rotate_head_rows(adapter.role(i, "k"), R)
        rotate_head_rows(adapter.role(i, "q"), R.repeat_interleave(heads // kv, 0))
    return {"pair_pca_layers": len(adapter.blocks)}
