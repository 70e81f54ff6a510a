"""Random QuantizedWeights and the closeness rule shared by the kernel tests (torch only, so the GPU
check can import it on a machine without transformers)."""

import torch

from compress.qweight import QuantizedWeight


def rand_qw(n, k, bits, group, sym, seed=0):
    g = torch.Generator().manual_seed(seed)
    ng = -(-k // (k if group == -1 else group))
    scales = (torch.randn(n, ng, generator=g) * 0.02).half().float()  # negative too (full-range sym)
    zeros = (torch.full((n, ng), 2 ** (bits - 1), dtype=torch.uint8) if sym
             else torch.randint(0, 2**bits, (n, ng), dtype=torch.uint8, generator=g))
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits, group_size=group, sym=sym)


def assert_close_to_reference(y, ref):
    err = (y - ref).abs().max().item()
    assert err <= 2e-5 * ref.abs().max().item() + 1e-7, f"max error {err} vs range {ref.abs().max().item()}"
