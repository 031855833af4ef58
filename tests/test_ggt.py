"""GGT against a dense d x d eigendecomposition; S-GGT at full density equals GGT."""


import pytest
import torch
from _helpers import BACKENDS, flat, gradient_stream, make_params, set_grads
from conftest import to_backend_device

import tritonopt
from tritonopt.optim import GGT, SparseGGT

SHAPES = [(4, 6), (5,)]  # 29 elements


def dense_ggt(rows, x, eps):
    """((sum_i g_i g_i^T)^{1/2} + eps I)^{-1} x through an eigh of the d x d matrix, float64."""
    d = x.numel()
    outer = sum((torch.outer(g, g) for g in rows), torch.zeros(d, d, dtype=torch.float64))
    lam, vec = torch.linalg.eigh(outer)
    root = vec @ torch.diag(lam.clamp_min(0).sqrt()) @ vec.T
    return torch.linalg.solve(root + eps * torch.eye(d, dtype=torch.float64), x)


@pytest.mark.parametrize("eps", [1e-3, 0.1, 1.0])
def test_ggt_step_matches_a_dense_eigendecomposition(eps):
    m = 5
    params = make_params(SHAPES, dtype=torch.float64)
    opt = GGT(params, lr=1.0, ngrads=m, eps=eps)
    history = []
    for grads in gradient_stream(SHAPES, m + 4, dtype=torch.float64):  # wraps around
        before = flat(params).detach().clone()
        set_grads(params, grads)
        opt.step()
        g = flat(grads)
        history.append(g)
        expected = dense_ggt(history[-m:], g, eps)
        scale = float(expected.abs().max())
        torch.testing.assert_close(before - flat(params).detach(), expected, rtol=1e-7, atol=1e-8 * scale)


def test_ggt_with_rank_deficient_window():
    # The same gradient three times: G G^T has rank 1; the zero directions must not blow up.
    params = make_params([(12,)], dtype=torch.float64)
    opt = GGT(params, lr=1.0, ngrads=4, eps=1e-2)
    g = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        before = params[0].detach().clone()
        set_grads(params, [g])
        opt.step()
    expected = dense_ggt([g, g, g], g, 1e-2)
    torch.testing.assert_close(before - params[0].detach(), expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_ggt_at_full_density_is_ggt(backend):
    hyper = dict(lr=0.01, ngrads=3, eps=0.5, momentum=0.5, weight_decay=0.1)
    params_d, params_s = to_backend_device(backend, (make_params(SHAPES), make_params(SHAPES)))
    dense = GGT(params_d, **hyper)
    sparse = SparseGGT(params_s, density=1.0, block_size=8, **hyper)
    with tritonopt.use_backend(backend):
        for grads in to_backend_device(backend, gradient_stream(SHAPES, 6)):
            set_grads(params_d, grads)
            set_grads(params_s, grads)
            dense.step()
            sparse.step()
            for pd, ps in zip(params_d, params_s):
                torch.testing.assert_close(ps, pd, rtol=1e-5, atol=1e-5)


def test_sparse_ggt_preconditions_the_compressed_accumulator():
    m, eps, k, block = 3, 0.3, 2, 8
    params = make_params([(16,)])
    opt = SparseGGT(params, lr=1.0, ngrads=m, eps=eps, density=k / block, block_size=block)
    error, rows = torch.zeros(16), []
    for grads in gradient_stream([(16,)], m + 2, seed=5):
        before = params[0].detach().clone()
        set_grads(params, grads)
        opt.step()
        a = error + grads[0]
        c = torch.zeros(16)
        for start in range(0, 16, block):
            keep = torch.sort(-a[start : start + block].abs(), stable=True).indices[:k]
            c[start + keep] = a[start + keep]
        error = a - c
        rows.append(c.double())
        expected = dense_ggt(rows[-m:], c.double(), eps)
        torch.testing.assert_close((before - params[0].detach()).double(), expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(opt.state[params[0]]["error"], error)


def test_state_bytes():
    params = make_params(SHAPES)  # 29 elements, blocks of 8: 4 blocks, k = 2
    opt = SparseGGT(params, ngrads=3, density=0.25, block_size=8)
    set_grads(params, gradient_stream(SHAPES, 1)[0])
    with tritonopt.use_backend("reference"):
        opt.step()
    # ring (int16 indices, float32 values), error and packed-gradient scratch (29 padded to 32), Gram matrix, step counters
    assert opt.state_bytes() == 4 * 3 * 2 * (2 + 4) + 2 * 4 * 32 + 8 * 9 + 4 * len(params)
    assert opt.state_bytes() == opt.expected_state_bytes()


@pytest.mark.parametrize("saved_shapes, loaded_shapes", [
    ([(3,), (5,)], [(5,), (3,)]),  # the same window width, the parameters in another order
    ([(2, 3)], [(3, 2)]),  # transposed
])
def test_a_checkpoint_saved_for_other_parameter_shapes_is_refused(saved_shapes, loaded_shapes):
    # Without momentum the state holds no entry shaped like a parameter: the layout decides.
    saved_params = make_params(saved_shapes)
    saved = GGT(saved_params, lr=0.1, ngrads=2, eps=0.1)
    for grads in gradient_stream(saved_shapes, 3):
        set_grads(saved_params, grads)
        saved.step()
    params = make_params(loaded_shapes, seed=1)
    opt = GGT(params, lr=0.1, ngrads=2, eps=0.1)
    set_grads(params, gradient_stream(loaded_shapes, 1, seed=2)[0])
    opt.step()
    weights, ring = flat(params), opt.state[params[0]]["ring_grads"].clone()
    with pytest.raises(ValueError, match="param_layout"):
        opt.load_state_dict(saved.state_dict())
    assert torch.equal(flat(params), weights) and torch.equal(opt.state[params[0]]["ring_grads"], ring)
    # The optimizer steps on from its own state.
    set_grads(params, gradient_stream(loaded_shapes, 1, seed=3)[0])
    opt.step()
    assert int(opt.state[params[0]]["step"]) == 2
