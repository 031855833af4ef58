import copy
import math
"""Dense M-FAC and S-MFAC: the IHVP against an explicit inverse, the literal recursion, the
density-100 % reduction, backends, checkpoints and bad input."""


import pytest
import torch
from _helpers import (BACKENDS, flat, gradient_stream, make_params, needs_triton, regression_losses, run_steps,
                      set_grads)
from conftest import to_backend_device

import tritonopt
from tritonopt.ops import densify_ring
from tritonopt.optim import MFAC, SparseGGT, SparseMFAC
from tritonopt.optim.functional import mfac_coefficients

SHAPES = [(5, 7), (3,), (2, 3, 4)]  # 62 elements


def explicit_ihvp(window_rows, x, damp, m):
    """solve(damp * I + (1/m) sum_i g_i g_i^T, x) with an explicit d x d matrix, float64."""
    d = x.numel()
    fisher = damp * torch.eye(d, dtype=torch.float64)
    for g in window_rows:
        fisher += torch.outer(g, g) / m
    return torch.linalg.solve(fisher, x)


@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("damp", [1e-4, 1e-2, 1.0])
def test_mfac_step_is_the_inverse_fisher_times_the_gradient(m, damp):
    # lr = 1 and float64 parameters: theta_before - theta_after is the IHVP u itself.
    shapes = [(6, 5), (4,)]
    params = make_params(shapes, dtype=torch.float64)
    opt = MFAC(params, lr=1.0, ngrads=m, damp=damp)
    history = []
    for step, grads in enumerate(gradient_stream(shapes, m + 7, dtype=torch.float64)):
        before = flat(params).detach().clone()
        set_grads(params, grads)
        opt.step()
        u = before - flat(params).detach()
        g = flat(grads)
        history.append(g)
        expected = explicit_ihvp(history[-m:], g, damp, m)  # only the last m count, over m
        torch.testing.assert_close(u, expected, rtol=1e-9, atol=1e-9 * float(expected.abs().max()))
        if step == 1:
            # Normalising by the number of rows written instead would be clearly different.
            by_count = explicit_ihvp(history, g, damp, len(history))
            assert float((by_count - expected).abs().max()) > 1e-6 * float(expected.abs().max())


def test_repeated_and_zero_gradients():
    params = make_params([(10,)], dtype=torch.float64)
    opt = MFAC(params, lr=1.0, ngrads=4, damp=0.1)
    g = torch.randn(10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    history = []
    for grads in ([g], [g], [torch.zeros(10, dtype=torch.float64)], [g]):
        before = params[0].detach().clone()
        set_grads(params, grads)
        opt.step()
        history.append(grads[0])
        expected = explicit_ihvp(history, grads[0], 0.1, 4)
        torch.testing.assert_close(before - params[0].detach(), expected, rtol=1e-10, atol=1e-12)


def literal_mfac_coefficients(window, x, damp):
    """The dynamic algorithm of M-FAC as published: no-pivot LU, B recursion, forward substitution.

    Written from the paper's description, in float64, independent of the Cholesky closed form.
    """
    m = window.shape[0]
    inv_damp = 1.0 / damp
    a = inv_damp * (window @ window.T) + m * torch.eye(m, dtype=torch.float64)
    upper = a.clone()  # Gaussian elimination without pivoting
    for i in range(m):
        for r in range(i + 1, m):
            upper[r] -= upper[r, i] / upper[i, i] * upper[i]
    upper = torch.triu(upper)
    giHig = torch.triu(upper - m * torch.eye(m, dtype=torch.float64))
    denom = m + torch.diagonal(giHig)
    tmp = -giHig.T / denom.view(1, -1)
    coef = inv_damp * torch.eye(m, dtype=torch.float64)
    for i in range(1, m):
        coef[i, :i] = tmp[i, :i] @ coef[:i, :i]
    q = inv_damp * (window @ x)
    for i in range(1, m):
        q[i:] -= giHig[i - 1, i:] * q[i - 1] / denom[i - 1]
    return (q / denom) @ coef


def naive_woodbury_inverse(window, damp):
    """F_i^{-1} = F_{i-1}^{-1} - (F^{-1} g)(F^{-1} g)^T / (m + g^T F^{-1} g), F_0^{-1} = I / damp."""
    m, d = window.shape
    inverse = torch.eye(d, dtype=torch.float64) / damp
    for g in window:
        v = inverse @ g
        inverse -= torch.outer(v, v) / (m + g @ v)
    return inverse


@pytest.mark.parametrize("damp", [1e-3, 0.1, 10.0])
def test_literal_recursion_equals_the_closed_form(damp):
    gen = torch.Generator().manual_seed(4)
    m, d = 8, 40
    window = torch.randn(m, d, generator=gen, dtype=torch.float64)
    window[5] = 0  # a row not yet written
    x = torch.randn(d, generator=gen, dtype=torch.float64)
    closed = mfac_coefficients(window @ window.T, window @ x, damp)
    literal = literal_mfac_coefficients(window, x, damp)
    torch.testing.assert_close(closed, literal, rtol=1e-10, atol=1e-12 * float(literal.abs().max()))
    ihvp = x / damp - closed @ window
    torch.testing.assert_close(ihvp, naive_woodbury_inverse(window, damp) @ x, rtol=1e-9, atol=1e-9)


def test_gram_matrix_indefinite_by_rounding_still_gives_a_finite_solve():
    # Rows 0 and 1 are equal, so the exact Gram matrix is singular; an error of
    # -1e-3 along its null direction makes damp * m + dots indefinite for a small damp.
    gen = torch.Generator().manual_seed(9)
    window = torch.randn(4, 30, generator=gen, dtype=torch.float64)
    window[1] = window[0]
    dots = window @ window.T
    direction = torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64) / 2**0.5
    dots -= 1e-3 * torch.outer(direction, direction)
    damp, m = 1e-6, 4
    assert torch.linalg.cholesky_ex(dots + damp * m * torch.eye(m, dtype=torch.float64)).info != 0
    products = window @ torch.randn(30, generator=gen, dtype=torch.float64)
    w = mfac_coefficients(dots, products, damp)
    assert torch.isfinite(w).all()
    # Clamping the spectrum at damp * m restores the exact system, whose Gram matrix is
    # singular along `direction` only; `products` has no component there.
    exact = window @ window.T + damp * m * torch.eye(m, dtype=torch.float64)
    expected = torch.linalg.solve(exact, products) / damp
    torch.testing.assert_close(w, expected, rtol=1e-8, atol=1e-8 * float(expected.abs().max()))


# --------------------------------------------------------------------------- S-MFAC


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_mfac_at_full_density_is_dense_mfac(backend):
    m = 4
    hyper = dict(lr=0.05, ngrads=m, damp=0.1, momentum=0.5, weight_decay=0.1)
    params_d, params_s = to_backend_device(backend, (make_params(SHAPES), make_params(SHAPES)))
    dense = MFAC(params_d, **hyper)
    sparse = SparseMFAC(params_s, density=1.0, block_size=16, **hyper)
    with tritonopt.use_backend(backend):
        for grads in to_backend_device(backend, gradient_stream(SHAPES, m + 5)):
            set_grads(params_d, grads)
            set_grads(params_s, grads)
            dense.step()
            sparse.step()
            for pd, ps in zip(params_d, params_s):
                torch.testing.assert_close(ps, pd, rtol=1e-5, atol=1e-5)
                assert not bool(sparse.state[ps]["error"].any())
    torch.testing.assert_close(
        sparse.state[params_s[0]]["dots"], dense.state[params_d[0]]["dots"], rtol=1e-5, atol=1e-5
    )


def test_sparse_mfac_preconditions_the_compressed_accumulator():
    """One oracle step: EF + blockwise Top-k (ties to the lower position, the same density in the
    partial last block), then the explicit inverse."""
    m, damp, k, block = 3, 0.2, 2, 8
    params = make_params([(20,)])
    opt = SparseMFAC(params, lr=1.0, ngrads=m, damp=damp, density=k / block, block_size=block)
    error = torch.zeros(24)
    rows = []
    for grads in gradient_stream([(20,)], m + 2, seed=5):
        before = params[0].detach().clone()
        set_grads(params, grads)
        opt.step()
        a = error.clone()
        a[:20] += grads[0]
        c = torch.zeros(24)
        for start in range(0, 24, block):
            blk = a[start : start + block]
            kept = math.ceil(k / block * min(block, 20 - start))  # the partial last block keeps fewer
            keep = torch.sort(-blk.abs(), stable=True).indices[:kept]
            c[start + keep] = blk[keep]
        error = a - c
        rows.append(c.double())
        expected = explicit_ihvp(rows[-m:], c.double(), damp, m)[:20]
        torch.testing.assert_close((before - params[0].detach()).double(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(opt.state[params[0]]["error"], error[:20], rtol=0, atol=0)


def test_error_feedback_invariant_holds_bitwise():
    params = make_params(SHAPES)
    opt = SparseMFAC(params, lr=0.01, ngrads=3, damp=0.1, density=0.25, block_size=16)
    for grads in gradient_stream(SHAPES, 5):
        error_before = flat([opt.state[p]["error"] for p in params]) if opt.state else torch.zeros(62)
        set_grads(params, grads)
        opt.step()
        ring = opt.state[params[0]]
        slot = (ring["ring_slot"] - 1) % 3
        row = densify_ring(ring["ring_indices"], ring["ring_values"], 16)[slot][:62]
        error_after = flat([opt.state[p]["error"] for p in params])
        assert torch.equal(row + error_after, error_before + flat(grads))


@pytest.mark.usefixtures("on_reference")
def test_without_error_feedback_the_error_stays_zero_and_the_steps_differ():
    hyper = dict(lr=0.05, ngrads=4, damp=0.1, density=0.1, block_size=16)
    params_ef, params_plain = make_params(SHAPES), make_params(SHAPES)
    with_ef = SparseMFAC(params_ef, **hyper)
    plain = SparseMFAC(params_plain, error_feedback=False, **hyper)
    stream = gradient_stream(SHAPES, 4)
    run_steps(params_ef, with_ef, stream)
    run_steps(params_plain, plain, stream)
    assert all(not bool(plain.state[p]["error"].any()) for p in params_plain)
    assert not torch.allclose(flat(params_ef), flat(params_plain))


@needs_triton
def test_triton_and_reference_paths_agree_step_by_step():
    hyper = dict(lr=0.05, ngrads=4, damp=0.1, density=0.2, block_size=16, momentum=0.9)
    params_t, params_r = to_backend_device("triton", make_params(SHAPES)), make_params(SHAPES)
    opt_t, opt_r = SparseMFAC(params_t, **hyper), SparseMFAC(params_r, **hyper)
    for grads in gradient_stream(SHAPES, 7):
        set_grads(params_t, to_backend_device("triton", grads))
        set_grads(params_r, grads)
        with tritonopt.use_backend("triton"):
            opt_t.step()
        with tritonopt.use_backend("reference"):
            opt_r.step()
        for pt, pr in zip(params_t, params_r):
            torch.testing.assert_close(pt.cpu(), pr, rtol=1e-5, atol=1e-6)
            for name in ("error", "momentum_buffer"):
                torch.testing.assert_close(opt_t.state[pt][name].cpu(), opt_r.state[pr][name], rtol=1e-5, atol=1e-6)
        ring_t, ring_r = opt_t.state[params_t[0]], opt_r.state[params_r[0]]
        assert torch.equal(ring_t["ring_indices"].cpu(), ring_r["ring_indices"])
        torch.testing.assert_close(ring_t["ring_values"].cpu(), ring_r["ring_values"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ring_t["dots"].cpu(), ring_r["dots"], rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("on_reference")
def test_parameters_without_grad_keep_their_value_and_state():
    params = make_params(SHAPES)
    opt = SparseMFAC(params, lr=0.1, ngrads=3, damp=0.1, density=0.25, block_size=16, momentum=0.5)
    stream = gradient_stream(SHAPES, 6)
    run_steps(params, opt, stream[:2])
    frozen = params[1].detach().clone()
    frozen_state = {n: opt.state[params[1]][n].clone() for n in ("error", "momentum_buffer", "step")}
    for grads in stream[2:]:
        set_grads(params, [grads[0], None, grads[2]])
        opt.step()
    assert torch.equal(params[1].detach(), frozen)
    for name, value in frozen_state.items():
        assert torch.equal(opt.state[params[1]][name], value), name
    assert int(opt.state[params[0]]["step"]) == 6
    # The frozen parameter's coordinates of the stored rows are zero.
    ring = opt.state[params[0]]
    rows = densify_ring(ring["ring_indices"], ring["ring_values"], 16)
    assert not bool(rows[:, 35:38].any())


def test_per_group_windows_give_each_group_its_own_hyperparameters():
    first, second = make_params([(12,)], seed=1), make_params([(20,)], seed=2)
    opt = SparseMFAC(
        [{"params": first}, {"params": second, "lr": 0.0, "ngrads": 2}],
        lr=0.1, ngrads=3, damp=0.1, density=0.5, block_size=8, per_group_windows=True,
    )
    before = second[0].detach().clone()
    run_steps(first + second, opt, gradient_stream([(12,), (20,)], 3))
    assert torch.equal(second[0].detach(), before)
    assert opt.state[first[0]]["dots"].shape == (3, 3)
    assert opt.state[second[0]]["dots"].shape == (2, 2)


@pytest.mark.parametrize("cls, hyper", [
    (MFAC, dict(ngrads=3, damp=0.1)),
    (SparseMFAC, dict(ngrads=3, damp=0.1, density=0.25, block_size=16)),
], ids=["mfac", "sparse"])
@pytest.mark.usefixtures("on_reference")
def test_groups_that_differ_only_in_step_rules_share_one_fisher(cls, hyper):
    # The common "no weight decay on biases" split: the curvature is the whole model's, so
    # with equal step rules the two groups step exactly like one group.
    stream = gradient_stream(SHAPES, 6)
    single = make_params(SHAPES)
    single_opt = cls(single, lr=0.05, momentum=0.5, **hyper)
    run_steps(single, single_opt, stream)
    split = make_params(SHAPES)
    opt = cls([{"params": split[:1]}, {"params": split[1:]}], lr=0.05, momentum=0.5, **hyper)
    run_steps(split, opt, stream)
    for a, b in zip(single, split):
        assert torch.equal(a, b)
    assert "dots" in opt.state[split[0]] and "dots" not in opt.state[split[1]]
    # With other step rules per group the window stays shared; a group with lr 0 does not move.
    frozen = make_params(SHAPES)
    opt = cls([{"params": frozen[:1]}, {"params": frozen[1:], "lr": 0.0, "weight_decay": 0.0}],
              lr=0.05, momentum=0.5, weight_decay=0.1, **hyper)
    before = [p.detach().clone() for p in frozen[1:]]
    run_steps(frozen, opt, stream)
    assert all(torch.equal(p, b) for p, b in zip(frozen[1:], before))
    # The window holds the gradients only, so it is the single group's, bit for bit.
    assert torch.equal(opt.state[frozen[0]]["dots"], single_opt.state[single[0]]["dots"])


def test_groups_must_agree_on_the_window_unless_each_has_its_own():
    opt = SparseMFAC(make_params([(8,)]), ngrads=4, density=0.5, block_size=8)
    with pytest.raises(ValueError, match="ngrads"):
        opt.add_param_group({"params": make_params([(4,)], seed=3), "ngrads": 2})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="density"):
        SparseMFAC([{"params": make_params([(8,)])}, {"params": make_params([(4,)], seed=3), "density": 0.1}])


def test_state_bytes_follow_the_layout():
    m = 4
    params = make_params(SHAPES)  # 62 elements, blocks of 16: 4 blocks, k = 4
    sparse = SparseMFAC(params, lr=0.1, ngrads=m, damp=0.1, density=0.25, block_size=16)
    run_steps(params, sparse, gradient_stream(SHAPES, 1))
    steps = 4 * len(params)
    # ring (int16 + float32), error and the packed-gradient scratch (padded to 64), Gram matrix
    assert sparse.state_bytes() == 4 * m * 4 * (2 + 4) + 2 * 4 * 64 + 8 * m * m + steps
    assert sparse.expected_state_bytes() == sparse.state_bytes()
    params_d = make_params(SHAPES)
    dense = MFAC(params_d, lr=0.1, ngrads=m, damp=0.1, momentum=0.9)
    expected = dense.expected_state_bytes()  # known before the first step
    run_steps(params_d, dense, gradient_stream(SHAPES, 1))
    assert dense.state_bytes() == 4 * m * 62 + 2 * 4 * 62 + 8 * m * m + steps == expected


def test_a_window_that_cannot_fit_is_refused_before_anything_is_allocated(monkeypatch):
    import tritonopt.optim.windowed as windowed

    params = make_params(SHAPES)
    needed = MFAC(params, ngrads=1024, damp=0.1).expected_state_bytes()
    monkeypatch.setattr(windowed, "available_memory", lambda device: needed - 1)
    with pytest.raises(MemoryError, match="GiB"):
        MFAC(params, ngrads=1024, damp=0.1)
    monkeypatch.setattr(windowed, "available_memory", lambda device: needed)
    opt = MFAC(params, ngrads=1024, damp=0.1)
    assert not opt.state
    monkeypatch.setattr(windowed, "available_memory", lambda device: needed + 100)
    with pytest.raises(MemoryError):
        opt.add_param_group({"params": make_params([(50,)], seed=4)})
    assert len(opt.param_groups) == 1


def test_trains_a_small_regression():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1)
    for opt_cls, kw in ((MFAC, {}), (SparseMFAC, dict(density=0.5, block_size=8))):
        with tritonopt.use_backend("reference"):
            losses = train_regression(opt_cls, kw, x, y)
        assert losses[-1] < 1e-3 * losses[0], opt_cls.__name__


def train_regression(opt_cls, kw, x, y):
    model = torch.nn.Linear(8, 1)
    return regression_losses(model, opt_cls(model.parameters(), lr=0.2, ngrads=8, damp=1.0, **kw), x, y)


@pytest.mark.gpu
def test_gpu_sparse_mfac_matches_reference_at_size():
    torch.manual_seed(0)
    shapes = [(1024, 1024), (1024,)]
    hyper = dict(lr=1e-3, ngrads=64, damp=1e-4, density=0.01, block_size=16384)
    params_t = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    params_r = [torch.nn.Parameter(p.detach().clone()) for p in params_t]
    opt_t, opt_r = SparseMFAC(params_t, **hyper), SparseMFAC(params_r, **hyper)
    for _ in range(70):
        grads = [torch.randn(s, device="cuda") for s in shapes]
        set_grads(params_t, grads)
        set_grads(params_r, grads)
        with tritonopt.use_backend("triton"):
            opt_t.step()
        with tritonopt.use_backend("reference"):
            opt_r.step()
    for pt, pr in zip(params_t, params_r):
        torch.testing.assert_close(pt, pr, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [SparseMFAC, SparseGGT])
def test_bf16_values_keep_dots_the_gram_matrix_of_the_stored_rows(backend, cls):
    # Nearly collinear gradients and a tiny damp: dots must be the (PSD) Gram matrix of
    # the rows the ring holds, or the Cholesky factorisation fails.
    hyper = dict(damp=1e-6) if cls is SparseMFAC else dict(eps=1e-3)
    params = to_backend_device(backend, make_params([(256,)]))
    opt = cls(params, lr=1e-3, ngrads=8, density=0.25, block_size=64,
              values_dtype=torch.bfloat16, **hyper)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(256, generator=gen)
    with tritonopt.use_backend(backend):
        for _ in range(10):
            error_before = (opt.state[params[0]]["error"].clone() if opt.state
                            else torch.zeros(256, device=params[0].device))
            g = to_backend_device(backend, base + 1e-3 * torch.randn(256, generator=gen))
            set_grads(params, [g])
            opt.step()
            ring = opt.state[params[0]]
            stored = densify_ring(ring["ring_indices"], ring["ring_values"], 64)
            slot = (ring["ring_slot"] - 1) % 8
            # The bf16 rounding residual is fed back: a == stored row + e, bitwise.
            assert torch.equal(stored[slot] + ring["error"], error_before + g)
    gram = stored.double() @ stored.double().T
    torch.testing.assert_close(ring["dots"], gram, rtol=1e-5, atol=1e-5 * float(gram.abs().max()))
    assert bool(torch.isfinite(params[0]).all())


@pytest.mark.parametrize(
    "cls, hyper",
    [(SparseMFAC, dict(density=0.5, block_size=8)), (MFAC, {})],
    ids=["sparse", "dense-mixed-group"],
)
def test_float64_parameters_keep_their_precision(cls, hyper):
    # The update is computed in float32 here; a float64 parameter must not be rounded to it.
    wide = torch.nn.Parameter(torch.tensor([1.0 + 1e-12, 2.0 - 1e-13, 3.0], dtype=torch.float64))
    narrow = torch.nn.Parameter(torch.zeros(3))
    opt = cls([wide, narrow], lr=0.0, ngrads=2, damp=0.1, **hyper)
    before = wide.detach().clone()
    for _ in range(2):
        set_grads([wide, narrow], [torch.ones(3, dtype=torch.float64), torch.ones(3)])
        opt.step()
    assert torch.equal(wide.detach(), before)



@pytest.mark.parametrize("damp", [1e-4, 1e-6, 1e-7])
def test_a_tiny_damp_does_not_cancel_the_update_away(damp):
    # u = x / damp - w @ G subtracts two float32 vectors of size ~1/damp; folding x / damp
    # into the float64 weights (x is the newest row of G) leaves only float32 rounding of
    # eight terms, about 1e-6 relative. The subtraction form was off by 1e-1 to 1e2 here.
    gen = torch.Generator().manual_seed(0)
    d, m = 2000, 8
    p = torch.nn.Parameter(torch.zeros(d))
    opt = MFAC([p], lr=1.0, ngrads=m, damp=damp)
    rows = []
    for _ in range(m + 3):
        g = torch.randn(d, generator=gen)
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        rows = (rows + [g.double()])[-m:]
    window = torch.stack(rows)
    exact = torch.linalg.solve(damp * torch.eye(d, dtype=torch.float64) + window.T @ window / m, g.double())
    update = (before - p.detach()).double()
    assert float((update - exact).norm() / exact.norm()) < 1e-5


@pytest.mark.usefixtures("on_reference")
def test_max_update_norm_clips_the_preconditioned_update():
    # The window holds gradients only, so both runs precondition the same vectors: each
    # clipped step is the free one shortened to the limit, or left alone below it.
    limit, moves = 0.4, {}
    for clip in (None, limit):
        params = make_params(SHAPES)
        opt = SparseMFAC(params, lr=1.0, ngrads=3, damp=1e-3, density=0.25, block_size=16, max_update_norm=clip)
        moves[clip] = []
        for grads in gradient_stream(SHAPES, 4):
            before = flat([p.detach() for p in params])
            set_grads(params, grads)
            opt.step()
            moves[clip].append(float((flat([p.detach() for p in params]) - before).norm()))
    assert min(moves[None]) < limit < max(moves[None])
    for free, clipped in zip(moves[None], moves[limit]):
        assert clipped == pytest.approx(min(free, limit), rel=1e-5)


def test_error_norm_ratio_is_what_compression_left_out():
    params = make_params(SHAPES)
    opt = SparseMFAC(params, lr=0.1, ngrads=3, damp=0.1, density=0.25, block_size=16, track_error_norm=True)
    assert opt.error_norm_ratios() == [None]
    grads = gradient_stream(SHAPES, 1)[0]
    set_grads(params, grads)
    opt.step()
    error = flat([opt.state[p]["error"] for p in params])
    assert opt.error_norm_ratios()[0] == pytest.approx(float(error.norm() / flat(grads).norm()), rel=1e-6)
    assert MFAC(params, track_error_norm=True).error_norm_ratios() == [None]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bfloat16_error_loses_only_the_rounding_of_each_residual(backend):
    params = to_backend_device(backend, make_params(SHAPES))
    opt = SparseMFAC(params, lr=0.05, ngrads=3, damp=0.1, density=0.25, block_size=16, error_dtype=torch.bfloat16)
    exact = SparseMFAC(to_backend_device(backend, make_params(SHAPES)), lr=0.05, ngrads=3, damp=0.1, density=0.25,
                       block_size=16)
    stream = to_backend_device(backend, gradient_stream(SHAPES, 4))
    with tritonopt.use_backend(backend):
        for grads in stream:
            previous = flat([opt.state[p]["error"].float() for p in params]) if opt.state else torch.zeros(
                62, device=params[0].device)
            set_grads(params, grads)
            opt.step()
            ring = opt.state[params[0]]
            slot = (ring["ring_slot"] - 1) % 3
            stored = densify_ring(ring["ring_indices"], ring["ring_values"], 16)[slot][:62]
            error = flat([opt.state[p]["error"] for p in params])
            assert error.dtype == torch.bfloat16
            residual = previous + flat(grads) - stored  # what float32 storage would keep
            assert torch.equal(error, residual.to(torch.bfloat16))  # rounded once, nothing else lost
        set_grads(exact.param_groups[0]["params"], stream[0])
        exact.step()
    assert opt.state_bytes() == opt.expected_state_bytes() < exact.expected_state_bytes()


@pytest.mark.parametrize("saved_shapes, loaded_shapes", [
    ([(3,), (5,)], [(5,), (3,)]),  # the same window width, the parameters in another order
    ([(2, 3)], [(3, 2)]),  # transposed
    ([(4,)], [(4,)]),  # the same shapes, another dtype (below)
])
def test_a_checkpoint_saved_for_other_parameters_is_refused(saved_shapes, loaded_shapes):
    # Without momentum the per-parameter state is only `step` and the window is [m, total]:
    # no entry's shape tells the parameters apart, only the layout the checkpoint names.
    dtype = torch.bfloat16 if saved_shapes == loaded_shapes else torch.float32
    saved_params = make_params(saved_shapes)
    saved = MFAC(saved_params, lr=0.1, ngrads=2, damp=0.1)
    run_steps(saved_params, saved, gradient_stream(saved_shapes, 3))
    params = make_params(loaded_shapes, seed=1, dtype=dtype)
    opt = MFAC(params, lr=0.1, ngrads=2, damp=0.1)
    run_steps(params, opt, gradient_stream(loaded_shapes, 1, seed=2))
    before = [flat(params), copy.deepcopy(opt.state_dict())]
    with pytest.raises(ValueError, match="param_layout"):
        opt.load_state_dict(saved.state_dict())
    assert torch.equal(flat(params), before[0])
    after = opt.state_dict()
    assert after["state"].keys() == before[1]["state"].keys()
    for pid, entry in before[1]["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][pid][name], value) if isinstance(value, torch.Tensor) else (
                after["state"][pid][name] == value)


def test_a_checkpoint_whose_sparse_ring_is_not_as_top_k_writes_it_is_refused():
    # The ring's rows are Top-k results, ascending: the sparse combination of a long block relies on it.
    params = make_params(SHAPES)
    opt = SparseMFAC(params, lr=0.1, ngrads=3, damp=0.1, density=0.25, block_size=16)
    run_steps(params, opt, gradient_stream(SHAPES, 2))
    saved = copy.deepcopy(opt.state_dict())
    ring = next(entry for entry in saved["state"].values() if "ring_indices" in entry)
    ring["ring_indices"][0, 0] = ring["ring_indices"][0, 0].flip(0)
    before = flat(params)
    with pytest.raises(ValueError, match="ring_indices.*ascending"):
        opt.load_state_dict(saved)
    unwritten = copy.deepcopy(opt.state_dict())  # row 2 was never written: zeros at position 0
    ring = next(entry for entry in unwritten["state"].values() if "ring_values" in entry)
    ring["ring_values"][0, 2, 0] = 1.0
    with pytest.raises(ValueError, match="ring_values.*all 0"):
        opt.load_state_dict(unwritten)
    assert torch.equal(flat(params), before)
    opt.load_state_dict(opt.state_dict())  # the optimizer's own rows are ascending


def test_a_bfloat16_error_stays_frozen_where_a_parameter_has_no_gradient():
    params = make_params(SHAPES)
    opt = SparseMFAC(params, lr=0.1, ngrads=3, damp=0.1, density=0.25, block_size=16, error_dtype=torch.bfloat16)
    stream = gradient_stream(SHAPES, 4)
    run_steps(params, opt, stream[:2])
    frozen, frozen_error = params[1].detach().clone(), opt.state[params[1]]["error"].clone()
    for grads in stream[2:]:
        set_grads(params, [grads[0], None, grads[2]])
        opt.step()
    assert torch.equal(params[1].detach(), frozen)
    assert torch.equal(opt.state[params[1]]["error"], frozen_error)
    assert int(opt.state[params[0]]["step"]) == 4


def test_a_refused_gradient_in_a_later_window_leaves_every_window_untouched():
    params = make_params(SHAPES)
    opt = SparseMFAC([{"params": params[:2]}, {"params": params[2:]}], lr=0.1, ngrads=3, damp=0.1, density=0.25,
                     block_size=16, per_group_windows=True)
    set_grads(params, gradient_stream(SHAPES, 1)[0])
    params[2].grad = params[2].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.state_dict()["state"] == {}
