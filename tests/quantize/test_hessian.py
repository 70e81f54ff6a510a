"""GPTQ's Hessian stores: the packed (RFP) layout against LAPACK's own conversion, in-place updates, spills."""

import pytest
import torch
from scipy.linalg import lapack

from compress.hessian import DenseSym, PackedSym, as_store, gram_store

ORDERS = [1, 2, 3, 4, 5, 6, 7, 16, 17, 130, 131]


def sym(n: int, seed: int = 0) -> torch.Tensor:
    X = torch.randn(2 * n + 3, n, generator=torch.Generator().manual_seed(seed))
    return X.T @ X


@pytest.mark.parametrize("n", ORDERS)
def test_layout_matches_lapack_and_every_row_block_reads_back(n):
    H = sym(n, n)
    P = PackedSym.from_dense(H)
    assert P.data.numel() == n * (n + 1) // 2
    full, info = lapack.stfttr(n, P.data.numpy(), transr="T", uplo="U")  # LAPACK's own reading of the storage
    assert info == 0 and torch.equal(torch.from_numpy(full).triu(), H.triu())
    assert torch.equal(P.to_dense(), H.triu() + H.triu(1).T)
    assert torch.equal(P.diag(), torch.diag(H))
    for i1 in range(n):
        for i2 in range(i1 + 1, n + 1, max(1, n // 7)):
            assert torch.equal(P.upper_rows(i1, i2), H.triu()[i1:i2, i1:]), (i1, i2)


@pytest.mark.parametrize("n", [5, 64, 131])
def test_rank_k_updates_accumulate_in_place(n):
    X = torch.randn(300, n, generator=torch.Generator().manual_seed(n))
    P = PackedSym.zeros(n)
    ptr = P.data.data_ptr()
    for chunk in X.split(64):
        P.add_gram_(chunk, 2.0)
    P.add_gram_(X[:0], 2.0)  # no rows: nothing
    P.scale_(1 / 300)
    assert P.data.data_ptr() == ptr
    torch.testing.assert_close(P.to_dense(), 2 * X.T @ X / 300, rtol=1e-4, atol=1e-5)


def test_factor_and_inverse_match_torch_and_report_failure():
    H = sym(40, 1) + 40 * torch.eye(40)
    P = PackedSym.from_dense(H)
    assert P.factor_()
    torch.testing.assert_close(P.upper_rows(0, 40), torch.linalg.cholesky(H, upper=True), rtol=1e-4, atol=1e-4)
    assert P.inverse_()
    torch.testing.assert_close(P.to_dense(), torch.linalg.inv(H), rtol=1e-3, atol=1e-6)
    assert not PackedSym.from_dense(torch.tensor([[1.0, 2.0], [2.0, 1.0]])).factor_()  # indefinite


@pytest.mark.parametrize("make", [PackedSym.from_dense, DenseSym])
def test_spill_restores_the_exact_values_and_set_diag(make):
    H = sym(9, 2)
    S = make(H.clone())
    saved = S.spill()
    S.set_diag_(torch.arange(9.0))
    assert torch.equal(S.diag(), torch.arange(9.0))
    S.factor_()
    S.restore(saved)
    assert torch.equal(S.to_dense(), H.triu() + H.triu(1).T)


def test_stores_by_device_and_copy_semantics():
    assert isinstance(gram_store(4), PackedSym) and gram_store(4).shape == (4, 4)
    H = sym(6)
    P = as_store(H, copy=False)
    assert isinstance(P, PackedSym) and as_store(P, copy=False) is P and as_store(P, copy=True) is not P
    D = DenseSym(H)
    assert as_store(D, copy=False) is D and as_store(D, copy=True).H.data_ptr() != H.data_ptr()
