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


# --------------------------------------------------------------------------- optimizer steps
#
# Every optimizer's step traces under torch.compile and gives the eager result bit for bit.
# None of them compiles with fullgraph=True: the non-finite policy decides on the host
# whether a step may happen (skip or raise, with nothing modified), and reading that one
# scalar is a graph break. Everything before and after it traces.

from _helpers import SHAPES, gradient_stream, make_params, set_grads  # noqa: E402
from _optim_table import PARAMS_OPTIMIZERS  # noqa: E402

COMPILE_CASES = [
    pytest.param(info, id=info.name, marks=[] if info.name == "SparseMFAC" else [pytest.mark.slow])
    for info in PARAMS_OPTIMIZERS
]


@pytest.mark.parametrize("info", COMPILE_CASES)
def test_the_compiled_step_equals_the_eager_step(info):
    torch._dynamo.reset()
    eager_params, compiled_params = make_params(), make_params()
    eager, compiled = info.build(eager_params), info.build(compiled_params)
    step = torch.compile(compiled.step, backend="aot_eager")
    with tritonopt.use_backend("reference"):
        for grads in gradient_stream(SHAPES, 5):  # past the window's wrap
            set_grads(eager_params, grads)
            eager.step()
            set_grads(compiled_params, grads)
            step()
    for a, b in zip(eager_params, compiled_params):
        assert torch.equal(a, b)


def test_fullgraph_stops_at_the_host_decision_of_the_nonfinite_policy():
    torch._dynamo.reset()
    params = make_params()
    opt = tritonopt.optim.SparseMFAC(params, lr=0.05, ngrads=3, damp=0.1, density=0.25, block_size=16)
    set_grads(params, gradient_stream(SHAPES, 1)[0])
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)) as failure:
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    assert "MAX_GRADIENT_NORM" in str(failure.value) or "item" in str(failure.value)
