"""Fast Walsh-Hadamard transform for n = K * 2^m against explicit matrices, in float64."""

import math

import pytest
import torch

from compress.errors import BadInput
from compress.rotation.hadamard import (
    factor,
    hadamard_matrix,
    hadamard_transform,
    supported_orders,
)


def sylvester(n):
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


@pytest.mark.parametrize("n", [1, 2, 8, 12, 20, 28, 36, 40, 44, 64, 76 * 2, 96, 172, 172 * 4, 256])
def test_matrix_is_hadamard_and_transform_matches_it(n):
    H = hadamard_matrix(n)
    assert H.shape == (n, n) and set(H.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(H @ H.T, n * torch.eye(n, dtype=torch.float64))
    x = torch.randn(3, 5, n, dtype=torch.float64)
    y = hadamard_transform(x)
    torch.testing.assert_close(y, x @ H / math.sqrt(n), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)  # orthonormal
    torch.testing.assert_close(hadamard_transform(y, inverse=True), x, rtol=1e-12, atol=1e-12)


def test_powers_of_two_are_sylvester():
    for n in (1, 2, 4, 64, 128):
        assert factor(n) == (1, n)
        assert torch.equal(hadamard_matrix(n), sylvester(n))


def test_kronecker_layout():
    H = hadamard_matrix(12 * 64)
    assert factor(12 * 64) == (12, 64)
    assert torch.equal(H, torch.kron(hadamard_matrix(12), sylvester(64)))


def test_supported_orders_contain_the_quarot_paley_family():
    orders = supported_orders()
    assert {1, 12, 20, 28, 36, 44, 60, 76, 108, 140}.issubset(orders)
    assert 172 in orders and 52 not in orders
    assert factor(11008) == (172, 64)  # Llama-2-7B's intermediate size
    assert factor(384) == (12, 32)  # 3 * 128 is reached through K = 12


@pytest.mark.parametrize("n", [3, 6, 52, 43])
def test_unsupported_sizes_raise_naming_supported_orders(n):
    with pytest.raises(BadInput, match=r"supported sizes are K \* 2\^m with K in \[1, 12, 20"):
        hadamard_transform(torch.zeros(2, n))


def test_williamson_172_is_a_williamson_array_of_symmetric_circulants():
    from compress.rotation.hadamard import WILLIAMSON, _circulant

    mats = [_circulant(r) for r in WILLIAMSON[43]]
    for M in mats:
        assert torch.equal(M, M.T)  # symmetric circulants, as Williamson matrices are
    assert torch.equal(sum(M @ M.T for M in mats), 4 * 43 * torch.eye(43, dtype=torch.float64))
    H = hadamard_matrix(172)
    assert torch.equal(H[:43, :43], mats[0]) and torch.equal(H[43:86, :43], -mats[1])


def test_float32_and_batch_shapes():
    x = torch.randn(4, 2, 20 * 8)
    y = hadamard_transform(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, x @ hadamard_matrix(160, torch.float32) / math.sqrt(160), rtol=1e-5, atol=1e-5)
