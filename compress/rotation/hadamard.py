"""Orthonormal Walsh-Hadamard transforms for n = K * 2^m (docs/walsh.md#fast-walsh-hadamard-transform).

`hadamard_matrix(n)` is `H_K (x) H_{2^m}` (Kronecker product) with `H_{2^m}` the Sylvester matrix
and `H_K` a Paley matrix built from a prime `q`:

* Paley I, `q = 3 (mod 4)`, order `K = q + 1` (4, 8, 12, 20, 24, 32, 44, 48, 60, ...);
* Paley II, `q = 1 (mod 4)`, order `K = 2 (q + 1)` (12, 28, 36, 60, 76, 84, 108, ...).

* Williamson, order `K = 4 n` from four symmetric circulant +-1 matrices `A, B, C, D` of order `n`
  with `A A^T + B B^T + C C^T + D D^T = 4 n I`, laid out in the Williamson array. Only n = 43
  (K = 172, the order QuaRot hard-codes for e.g. 11008 = 172 * 64 intermediate sizes) is stored:
  its four first rows are published data (M. Hall, *Combinatorial Theory*, 2nd ed. 1986, table of
  Williamson matrices, from Baumert and Hall 1965), checked to give `H H^T = K I` when built.

K = 1 (pure powers of two) needs no base matrix. Any n with an odd factor not covered (e.g. 3*2^m,
or 52 = 2*(25+1), which needs a prime-power field) raises `BadInput` naming the supported K.

`hadamard_transform(x)` computes `x @ hadamard_matrix(n) / sqrt(n)` over the last dimension in
O(n log n + n K) without building the matrix: butterflies on the 2^m axis, a K x K matmul on the
K axis. The transform is orthogonal; its inverse is `hadamard_transform(y, inverse=True)`
(`y @ H^T / sqrt(n)`; Paley matrices are not symmetric, Sylvester ones are).
"""

from __future__ import annotations

import functools
import math

import torch

from compress.errors import BadInput

MAX_K = 256


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i) with chi the quadratic character of GF(q), q prime."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley(K: int) -> torch.Tensor | None:
    q = K - 1
    if q % 4 == 3 and _is_prime(q):  # Paley I: H = I + S, S skew with S S^T = q I
        S = torch.zeros(K, K, dtype=torch.float64)
        S[0, 1:], S[1:, 0] = 1.0, -1.0
        S[1:, 1:] = _jacobsthal(q)
        return torch.eye(K, dtype=torch.float64) + S
    if K % 2 == 0:
        q = K // 2 - 1
        if q % 4 == 1 and _is_prime(q):  # Paley II: conference matrix C (symmetric)
            C = torch.zeros(K // 2, K // 2, dtype=torch.float64)
            C[0, 1:], C[1:, 0] = 1.0, 1.0
            C[1:, 1:] = _jacobsthal(q)
            A = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            B = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
            return torch.kron(C, A) + torch.kron(torch.eye(K // 2, dtype=torch.float64), B)
    return None


# first rows of the Williamson circulants A, B, C, D, keyed by their order n (K = 4 n)
WILLIAMSON = {
    43: ("++---++++-+--+--++--------++--+--+-++++---+", "+++-+-++--+-+-++++-+----+-++++-+-+--++-+-++",
         "++-++++++----+-+--++-++-++--+-+----++++++-+", "+---++--++++-+-+++-++--++-+++-+-++++--++---"),
}


def _circulant(row: str) -> torch.Tensor:
    r = torch.tensor([1.0 if c == "+" else -1.0 for c in row], dtype=torch.float64)
    n = r.numel()
    return r[(torch.arange(n)[None, :] - torch.arange(n)[:, None]) % n]


def _williamson(K: int) -> torch.Tensor | None:
    if K % 4 or K // 4 not in WILLIAMSON:
        return None
    A, B, C, D = (_circulant(r) for r in WILLIAMSON[K // 4])
    H = torch.cat([torch.cat(row, 1) for row in ([A, B, C, D], [-B, A, -D, C], [-C, D, A, -B], [-D, -C, B, A])], 0)
    if not torch.equal(H @ H.T, K * torch.eye(K, dtype=torch.float64)):  # guards the stored table
        raise AssertionError(f"Williamson table for K = {K} does not give a Hadamard matrix")
    return H


@functools.lru_cache(maxsize=None)
def _base(K: int) -> torch.Tensor | None:
    """A +-1 Hadamard matrix of order K (float64), or None when not constructible here."""
    if K == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    H = _paley(K)
    return H if H is not None else _williamson(K)


def supported_orders(limit: int = MAX_K) -> list[int]:
    """The odd-part orders K (K not a power of two, plus 1) this module can build, up to `limit`."""
    return [1] + [K for K in range(3, limit + 1) if K & (K - 1) and _base(K) is not None]


def factor(n: int) -> tuple[int, int]:
    """(K, 2^m) with n = K * 2^m and H_K constructible, preferring the smallest K; else BadInput."""
    if n < 1:
        raise BadInput(f"Hadamard size must be positive, got {n}")
    p = n & -n  # largest power of two dividing n
    while p >= 1:
        K = n // p
        if K <= MAX_K and _base(K) is not None:
            return K, p
        p //= 2
    raise BadInput(
        f"no Walsh-Hadamard matrix of size {n} (= {n // (n & -n)} * {n & -n}): supported sizes are K * 2^m "
        f"with K in {supported_orders()} (Paley constructions and the Williamson order 172)")


def is_supported(n: int) -> bool:
    try:
        factor(n)
        return True
    except BadInput:
        return False


def hadamard_matrix(n: int, dtype=torch.float64) -> torch.Tensor:
    """The +-1 matrix `H_K (x) Sylvester(2^m)` (unnormalised) with H H^T = n I."""
    K, p = factor(n)
    H = _base(K)
    S = torch.ones(1, 1, dtype=torch.float64)
    while S.shape[0] < p:
        S = torch.cat([torch.cat([S, S], 1), torch.cat([S, -S], 1)], 0)
    return torch.kron(H, S).to(dtype)


def _fwht_pow2(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Sylvester transform over the last dim (a power of two)."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        x = x.reshape(*lead, n // (2 * h), 2, h)
        x = torch.stack((x[..., 0, :] + x[..., 1, :], x[..., 0, :] - x[..., 1, :]), dim=-2)
        h *= 2
    return x.reshape(*lead, n)


def hadamard_transform(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`x @ H / sqrt(n)` (or `x @ H^T / sqrt(n)` with inverse) over the last dim, H = hadamard_matrix(n)."""
    n = x.shape[-1]
    K, p = factor(n)
    lead = x.shape[:-1]
    y = _fwht_pow2(x.reshape(*lead, K, p))
    if K > 1:
        HK = _base(K).to(dtype=x.dtype, device=x.device)
        y = torch.einsum("...kp,kl->...lp", y, HK.T if inverse else HK)
    return y.reshape(*lead, n) / math.sqrt(n)
