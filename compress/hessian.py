"""Storage for GPTQ's Hessians `H = 2/n X^T X`: accumulated during calibration, then factored in place.

Two stores with one interface (`add_gram_`, `add_`, `scale_`, `diag`, `set_diag_`, `factor_`, `inverse_`, `upper_rows`):

* `PackedSym` (CPU): the upper triangle in LAPACK's *rectangular full packed* format (RFP, TRANSR='T',
  UPLO='U'): `n (n + 1) / 2` floats, half a dense matrix, with BLAS-3 speed. The rank-k update is `ssfrk`, the
  Cholesky factor `spftrf`, the inverse from it `spftri`, all in the same storage (docs/quantize.md#gptq).
  At Llama-3.1-8B shapes `down_proj`'s Hessian is 14336^2: 392 MiB packed instead of 784.
* `DenseSym` (accelerators): a dense tensor and torch.linalg (temporaries of its size).

A factorisation that fails (fp32 round-off on an ill-conditioned H) leaves the storage overwritten; GPTQ
keeps a copy with `spill()` (a temporary file under TMPDIR: disk, not memory) and `restore()`s it for the next,
larger damping.
"""
from __future__ import annotations

import tempfile

import numpy as np
import torch
from scipy.linalg import lapack


def gram_store(n: int, device: torch.device | str = "cpu"):
    """An all-zero Hessian store of order n for inputs on `device`."""
    return PackedSym.zeros(n) if torch.device(device).type == "cpu" else DenseSym(torch.zeros(n, n, device=device))


def as_store(H, *, copy: bool):
    """A store from a dense symmetric tensor or a store (`copy`: never the caller's storage)."""
    if isinstance(H, (PackedSym, DenseSym)):
        return H.clone() if copy else H
    H = H.detach().float()
    if H.device.type == "cpu":
        return PackedSym.from_dense(H)
    return DenseSym(H.clone() if copy else H)


class PackedSym:
    """A symmetric fp32 matrix of order n on the CPU, its upper triangle U in RFP (TRANSR='T', UPLO='U').

    With n1 = n // 2 and n2 = n - n1 the storage, seen row-major as (n + 1 - n % 2, n2), holds
    `U[i, n1 + c] = R[i, c]` (i < n1), `U[i, j] = R[i, j - n1]` (n1 <= i <= j) and `U[i, j] = R[n1 + 1 + j, i]`
    (i <= j < n1); `tests/quantize/test_hessian.py` checks it against LAPACK's own conversion."""

    def __init__(self, n: int, data: torch.Tensor):
        self.n, self.data = n, data
        self.n1 = n // 2
        self.n2 = n - self.n1
        self.R = data.view(n + 1 - n % 2, self.n2) if n else data.view(0, 0)
        self.device = data.device

    @classmethod
    def zeros(cls, n: int) -> PackedSym:
        return cls(n, torch.zeros(n * (n + 1) // 2, dtype=torch.float32, device="cpu"))

    @classmethod
    def from_dense(cls, H: torch.Tensor) -> PackedSym:
        n = H.shape[0]
        if n == 0:
            return cls.zeros(0)
        arf, info = lapack.strttf(H.float().numpy(), transr="T", uplo="U")  # H's upper triangle (f2py: a copy)
        _check(info, "strttf")
        return cls(n, torch.from_numpy(arf))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.n)

    def clone(self) -> PackedSym:
        return PackedSym(self.n, self.data.clone())

    def to_dense(self) -> torch.Tensor:
        """The full symmetric matrix (a new (n, n) tensor)."""
        U = self.upper_rows(0, self.n)
        return U + U.triu(1).mT

    def _lapack(self, routine, *args, **kw) -> int:
        a = self.data.numpy()
        out = routine(*args, **kw)
        res = out[0] if isinstance(out, tuple) else out
        if not np.shares_memory(res, a):  # f2py copies silently when the layout does not fit
            raise RuntimeError(f"LAPACK {routine.__name__} did not work in place")
        return out[1] if isinstance(out, tuple) else 0

    def add_gram_(self, x: torch.Tensor, alpha: float) -> None:
        """H += alpha x^T x for rows x (m, n), in place (`ssfrk`)."""
        x = x.detach().float().contiguous()
        if x.shape[0] and self.n:
            self._lapack(lapack.ssfrk, self.n, x.shape[0], alpha, x.numpy().T, 1.0, self.data.numpy(),
                         transr="T", uplo="U", trans="N", overwrite_c=1)

    def scale_(self, a: float) -> None:
        self.data.mul_(a)

    def add_(self, other) -> None:
        """self += other (another store of the same order, on any device: the sum of data-parallel shards)."""
        o = other if isinstance(other, PackedSym) else PackedSym.from_dense(other.to_dense().cpu())
        self.data.add_(o.data)

    def _diag_index(self) -> torch.Tensor:
        i = torch.arange(self.n, device="cpu")
        return torch.where(i < self.n1, (self.n1 + 1 + i) * self.n2 + i, i * self.n2 + (i - self.n1))

    def diag(self) -> torch.Tensor:
        return self.data[self._diag_index()]

    def set_diag_(self, v: torch.Tensor) -> None:
        self.data[self._diag_index()] = v.float()

    def finite(self) -> bool:
        return _finite(self.data)

    def factor_(self) -> bool:
        """The storage becomes U with H = U^T U (torch's `cholesky(upper=True)`); False if not positive definite."""
        return self.n == 0 or self._lapack(lapack.spftrf, self.n, self.data.numpy(), transr="T", uplo="U",
                                           overwrite_a=1) == 0

    def inverse_(self) -> bool:
        """From the factor U, the storage becomes (U^T U)^-1; False on failure."""
        return self.n == 0 or self._lapack(lapack.spftri, self.n, self.data.numpy(), transr="T", uplo="U",
                                           overwrite_a=1) == 0

    def upper_rows(self, i1: int, i2: int) -> torch.Tensor:
        """`triu(H)[i1:i2, i1:]` as a new dense (i2 - i1, n - i1) tensor."""
        n, n1, R = self.n, self.n1, self.R
        out = torch.zeros(i2 - i1, n - i1, device="cpu")
        a = min(i2, n1)
        if i1 < a:  # rows in the first half: columns i1..n1 from R's lower rows (transposed), n1.. from R[i]
            out[: a - i1, n1 - i1:] = R[i1:a]
            out[: a - i1, : n1 - i1] = R[n1 + 1 + i1 : n1 + 1 + n1, i1:a].mT.triu()
        c = max(i1, n1)
        if c < i2:  # rows in the second half: U[i, j] = R[i, j - n1]
            out[c - i1 :, c - i1 :] = R[c:i2, c - n1 :].triu()
        return out

    def spill(self):
        f = tempfile.TemporaryFile(prefix="compress-hessian-")
        f.write(memoryview(self.data.numpy()).cast("B"))
        return f

    def restore(self, f) -> None:
        f.seek(0)
        f.readinto(memoryview(self.data.numpy()).cast("B"))


class DenseSym:
    """A symmetric matrix as a dense tensor (on an accelerator); the steps use torch.linalg, not in place."""

    def __init__(self, H: torch.Tensor):
        self.H, self.n, self.device = H, H.shape[0], H.device

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.n)

    def clone(self) -> DenseSym:
        return DenseSym(self.H.clone())

    def to_dense(self) -> torch.Tensor:
        return self.H.triu() + self.H.triu(1).mT

    def add_gram_(self, x: torch.Tensor, alpha: float) -> None:
        x = x.detach().float()
        self.H.addmm_(x.T, x, alpha=alpha)  # in place: no (n, n) temporary

    def scale_(self, a: float) -> None:
        self.H.mul_(a)

    def add_(self, other) -> None:
        """self += other (another store of the same order, on any device: the sum of data-parallel shards)."""
        self.H.add_(other.to_dense().to(self.device))

    def diag(self) -> torch.Tensor:
        return torch.diag(self.H).clone()

    def set_diag_(self, v: torch.Tensor) -> None:
        self.H.diagonal().copy_(v)

    def finite(self) -> bool:
        return _finite(self.H)

    def factor_(self) -> bool:
        U, info = torch.linalg.cholesky_ex(self.to_dense(), upper=True)
        self.H = U
        return info == 0

    def inverse_(self) -> bool:
        self.H = torch.cholesky_inverse(self.H.triu(), upper=True)
        return _finite(self.H)

    def upper_rows(self, i1: int, i2: int) -> torch.Tensor:
        return self.H[i1:i2, i1:].triu()

    def spill(self):
        return self.to_dense()

    def restore(self, saved) -> None:
        self.H = saved.clone()


def _finite(A: torch.Tensor) -> bool:
    """No NaN/inf in A, from its min and max (NaN propagates): no mask of A's size."""
    return A.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(A))).all())


def _check(info: int, name: str) -> None:
    if info:
        raise RuntimeError(f"LAPACK {name} failed (info={info})")
