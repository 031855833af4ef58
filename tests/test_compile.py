"""The custom ops trace into a graph: torch.compile (fullgraph, aot_eager) gives the eager results."""

import pytest
import torch

import tritonopt


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def test_ef_topk_and_densify_compile():
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(4, 256, generator=gen)
    error_eager = torch.randn(4, 256, generator=gen)
    error_compiled = error_eager.clone()

    def fn(grad, error):
        indices, values = tritonopt.ops.ef_topk(grad, error, 8)
        return tritonopt.ops.densify_blocks(indices, values, 256)

    expected = fn(grad, error_eager)
    result = compiled(fn)(grad, error_compiled)
    assert torch.equal(result, expected)
    assert torch.equal(error_compiled, error_eager)  # the in-place update survives compilation


def test_sparse_ring_ops_compile():
    gen = torch.Generator().manual_seed(1)
    num_blocks, m, k, block_size = 3, 4, 5, 64
    indices = torch.stack([torch.randperm(block_size, generator=gen)[:k].sort().values
                           for _ in range(num_blocks * m)]).view(num_blocks, m, k).to(torch.int32)
    values = torch.randn(num_blocks, m, k, generator=gen)
    x = torch.randn(num_blocks, block_size, generator=gen)
    weights = torch.randn(m, generator=gen)

    def fn(indices, values, x, weights):
        return tritonopt.ops.sparse_sp(indices, values, x), tritonopt.ops.sparse_lcg(indices, values, weights, block_size)

    expected = fn(indices, values, x, weights)
    result = compiled(fn)(indices, values, x, weights)
    for got, want in zip(result, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("precision", ["ieee"])
def test_eigenbasis_precondition_compiles(precision):
    gen = torch.Generator().manual_seed(2)
    g_dim, a_dim = 6, 9
    qa = torch.linalg.qr(torch.randn(a_dim, a_dim, generator=gen)).Q.contiguous()
    qg = torch.linalg.qr(torch.randn(g_dim, g_dim, generator=gen)).Q.contiguous()
    da, dg = torch.rand(a_dim, generator=gen), torch.rand(g_dim, generator=gen)
    grad = torch.randn(g_dim, a_dim, generator=gen)

    def fn(grad, qa, da, qg, dg):
        return tritonopt.ops.eigenbasis_precondition(grad, qa, da, qg, dg, 0.1, precision=precision)

    expected = fn(grad, qa, da, qg, dg)
    assert torch.equal(compiled(fn)(grad, qa, da, qg, dg), expected)


# The optimizers' compiled steps: tests/test_optimizer_compile.py.
