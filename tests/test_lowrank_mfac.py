"""LowRankMFAC: exactly-low-rank gradients give dense M-FAC; checkpoints; frozen parameters."""


import pytest
import torch
from _helpers import BACKENDS, make_params, set_grads
from conftest import to_backend_device

import tritonopt
from tritonopt.optim import MFAC, LowRankMFAC

SHAPES = [(6, 8), (6,), (3, 2, 5)]


def low_rank_stream(shapes, steps, rank, seed=1):
    """Gradients of rank <= ``rank`` per tensor (1-D tensors arbitrary)."""
    gen = torch.Generator().manual_seed(seed)
    stream = []
    for _ in range(steps):
        grads = []
        for s in shapes:
            if len(s) == 1:
                grads.append(torch.randn(s, generator=gen))
            else:
                n, cols = s[0], int(torch.tensor(s[1:]).prod())
                grads.append((torch.randn(n, rank, generator=gen) @ torch.randn(rank, cols, generator=gen)).view(s))
        stream.append(grads)
    return stream


@pytest.mark.parametrize("backend", BACKENDS)
def test_exactly_low_rank_gradients_give_dense_mfac(backend):
    # Multi-layer: the scalar products add per-tensor Frobenius products (cross-layer, "global").
    hyper = dict(lr=0.05, ngrads=4, damp=0.5, momentum=0.5, weight_decay=0.1)
    params_l, params_d = to_backend_device(backend, (make_params(SHAPES), make_params(SHAPES)))
    lowrank = LowRankMFAC(params_l, rank=2, **hyper)
    dense = MFAC(params_d, **hyper)
    with tritonopt.use_backend(backend):
        for grads in to_backend_device(backend, low_rank_stream(SHAPES, 7, rank=2)):
            set_grads(params_l, grads)
            set_grads(params_d, grads)
            lowrank.step()
            dense.step()
            for pl, pd in zip(params_l, params_d):
                torch.testing.assert_close(pl, pd, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        lowrank.state[params_l[0]]["dots"], dense.state[params_d[0]]["dots"], rtol=1e-3, atol=1e-3
    )


def test_compression_error_is_fed_back():
    params = make_params([(8, 9)])
    opt = LowRankMFAC(params, lr=0.01, rank=1, ngrads=3, damp=1.0)
    state = opt.state[params[0]]
    error = torch.zeros(8, 9)
    for slot, grads in enumerate(low_rank_stream([(8, 9)], 3, rank=4)):
        set_grads(params, grads)
        opt.step()
        # The stored row compresses error + gradient, and the new error is what it missed.
        reconstruction = state["ring_p"][slot] @ state["ring_q"][slot].T
        torch.testing.assert_close(reconstruction + state["error"], error + grads[0], rtol=1e-5, atol=1e-5)
        assert float(state["error"].norm()) > 0.1
        error = state["error"].clone()


@pytest.mark.parametrize("first", ["zero", "rank-one"])
def test_rank_survives_a_zero_or_rank_one_gradient(first):
    # A zero gradient (zero_grad(set_to_none=False) on an unused layer) or a rank-1 one
    # (batch size 1) must not lower the rank of every later compression.
    params = make_params([(10, 12)])
    opt = LowRankMFAC(params, lr=0.0, rank=3, ngrads=4, damp=1.0)
    gen = torch.Generator().manual_seed(3)
    g0 = torch.zeros(10, 12)
    if first == "rank-one":
        g0 = torch.outer(torch.randn(10, generator=gen), torch.randn(12, generator=gen))
    set_grads(params, [g0])
    opt.step()
    for _ in range(3):
        set_grads(params, [torch.randn(10, 12, generator=gen)])
        opt.step()
    state = opt.state[params[0]]
    p = state["ring_p"][3]
    torch.testing.assert_close(p.T @ p, torch.eye(3), rtol=0, atol=1e-5)
    assert bool(state["lowrank_q"].norm(dim=0).gt(0).all())


def test_state_is_float32_whatever_the_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        params = [torch.nn.Parameter(torch.randn(4, 5, dtype=torch.float32)),
                  torch.nn.Parameter(torch.randn(4, dtype=torch.float32))]
        opt = LowRankMFAC(params, lr=0.1, rank=2, ngrads=2, damp=1.0)
        set_grads(params, [torch.randn(4, 5, dtype=torch.float32), torch.randn(4, dtype=torch.float32)])
        opt.step()
    finally:
        torch.set_default_dtype(previous)
    for p in params:
        for name in ("lowrank_q", "ring_p", "ring_q", "error"):
            assert opt.state[p][name].dtype == torch.float32, name


def test_parameters_without_grad_keep_their_state():
    params = make_params(SHAPES)
    opt = LowRankMFAC(params, lr=0.05, rank=2, ngrads=3, damp=0.5)
    stream = low_rank_stream(SHAPES, 4, rank=3)
    set_grads(params, stream[0])
    opt.step()
    frozen = {k: v.clone() for k, v in opt.state[params[2]].items() if k in ("error", "lowrank_q", "step")}
    value = params[2].detach().clone()
    for grads in stream[1:]:
        set_grads(params, [grads[0], grads[1], None])
        opt.step()
    assert torch.equal(params[2].detach(), value)
    for name, saved in frozen.items():
        assert torch.equal(opt.state[params[2]][name], saved), name


def test_state_bytes_follow_the_factor_sizes():
    m, rank = 3, 2
    params = make_params(SHAPES)
    opt = LowRankMFAC(params, lr=0.05, rank=rank, ngrads=m, damp=0.5)
    set_grads(params, low_rank_stream(SHAPES, 1, rank=2)[0])
    opt.step()
    ring = 4 * m * rank * ((6 + 8) + (6 + 1) + (3 + 10))
    warm = 4 * rank * (8 + 1 + 10)
    error_and_scratch = 2 * 4 * (48 + 6 + 30)
    assert opt.state_bytes() == ring + warm + error_and_scratch + 8 * m * m + 4 * len(params)
    assert opt.state_bytes() == opt.expected_state_bytes()



def test_an_empty_matrix_parameter_is_carried_along():
    # A [0, 3] parameter (an empty layer) has nothing to compress and must not stop the others.
    empty, weight = torch.nn.Parameter(torch.zeros(0, 3)), torch.nn.Parameter(torch.randn(4, 3))
    opt = LowRankMFAC([empty, weight], lr=0.1, ngrads=2, damp=0.1, rank=2)
    before = weight.detach().clone()
    for step in range(3):
        set_grads([empty, weight], [torch.zeros(0, 3), torch.randn(4, 3, generator=torch.Generator().manual_seed(step))])
        opt.step()
    assert empty.shape == (0, 3) and not torch.equal(weight.detach(), before)
    assert opt.state[empty]["ring_p"].shape == (2, 0, 2)
