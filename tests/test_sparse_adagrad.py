"""SparseAdaGrad against a literal Algorithm 7, across backends, checkpoints and bad input."""

import copy

import pytest
import torch
from _helpers import gradient_stream, make_params, needs_triton, regression_losses, run_steps, set_grads
from conftest import to_backend_device

import tritonopt
from tritonopt.optim import SparseAdaGrad, optimizer_state_bytes
from tritonopt.optim.functional import kept_per_block



class Algorithm7:
    """EFCP Algorithm 7 written out on one flat float32 vector, block by block.

    ``a = e + g; c = TopK(a) per block (ties to the lower position); e = a - c;
    H += c^2; theta = (1 - lr*wd) * theta - lr * c / (sqrt(H) + eps)``. A last,
    shorter block keeps ``min(k, its length)`` entries.
    """

    def __init__(self, sizes, block_size, k, lr, eps=1e-10, weight_decay=0.0):
        total = sum(sizes)
        self.sizes, self.block_size, self.k = sizes, min(block_size, total), k
        self.lr, self.eps, self.wd = lr, eps, weight_decay
        self.error = torch.zeros(total)
        self.sum_sq = torch.zeros(total)

    def step(self, params, grads):
        a = self.error + torch.cat([g.reshape(-1).float() for g in grads])
        c = torch.zeros_like(a)
        for start in range(0, a.numel(), self.block_size):
            block = a[start : start + self.block_size]
            keep = min(self.k, block.numel())
            order = torch.sort(-block.abs(), stable=True).indices[:keep]
            c[start + order] = block[order]
        self.error = a - c
        self.sum_sq = self.sum_sq + c * c
        update = c / (self.sum_sq.sqrt() + self.eps)
        flat = torch.cat([p.reshape(-1) for p in params])
        flat = flat * (1 - self.lr * self.wd) - self.lr * update if self.wd else flat - self.lr * update
        return list(torch.split(flat, self.sizes))


SHAPES = [(5, 7), (3,), (2, 3, 4)]  # 62 elements: blocks of 16 leave a partial last block


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_algorithm_7(backend, weight_decay):
    params = make_params(SHAPES)
    sizes = [p.numel() for p in params]
    oracle = Algorithm7(sizes, block_size=16, k=3, lr=0.05, weight_decay=weight_decay)  # on the CPU
    expected = [p.detach().clone() for p in params]
    params = to_backend_device(backend, params)
    opt = SparseAdaGrad(params, lr=0.05, k=3, block_size=16, weight_decay=weight_decay)
    with tritonopt.use_backend(backend):
        for grads in gradient_stream(SHAPES, 12):
            set_grads(params, to_backend_device(backend, grads))
            opt.step()
            expected = [e.view(p.shape) for e, p in zip(oracle.step(expected, grads), params)]
            for p, e in zip(params, expected):
                torch.testing.assert_close(p.detach().cpu(), e, rtol=1e-6, atol=1e-7)
    error = torch.cat([opt.state[p]["error"].reshape(-1) for p in params]).cpu()
    sum_sq = torch.cat([opt.state[p]["sum_sq"].reshape(-1) for p in params]).cpu()
    torch.testing.assert_close(error, oracle.error, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sum_sq, oracle.sum_sq, rtol=1e-6, atol=1e-7)
    assert all(int(opt.state[p]["step"]) == 12 for p in params)


@needs_triton
def test_triton_and_reference_paths_agree_bitwise_step_by_step():
    params_t, params_r = to_backend_device("triton", make_params(SHAPES)), make_params(SHAPES)
    opt_t = SparseAdaGrad(params_t, lr=0.1, density=0.2, block_size=16)
    opt_r = SparseAdaGrad(params_r, lr=0.1, density=0.2, block_size=16)
    for grads in gradient_stream(SHAPES, 8):
        set_grads(params_t, to_backend_device("triton", grads))
        set_grads(params_r, grads)
        with tritonopt.use_backend("triton"):
            opt_t.step()
        with tritonopt.use_backend("reference"):
            opt_r.step()
        for pt, pr in zip(params_t, params_r):
            assert torch.equal(pt.cpu(), pr)
            for name in ("error", "sum_sq"):
                assert torch.equal(opt_t.state[pt][name].cpu(), opt_r.state[pr][name])


def test_param_groups_use_their_own_hyperparameters():
    first, second = make_params([(4, 5)], seed=1), make_params([(30,)], seed=2)
    opt = SparseAdaGrad(
        [{"params": first}, {"params": second, "lr": 0.5, "k": 2, "block_size": 8}],
        lr=0.01,
        density=0.1,
        block_size=8,
    )
    assert opt.param_groups[1]["density"] is None and opt.param_groups[0]["k"] is None
    oracle_first = Algorithm7([20], block_size=8, k=1, lr=0.01)
    oracle_second = Algorithm7([30], block_size=8, k=2, lr=0.5)
    expected_first, expected_second = [first[0].detach().clone()], [second[0].detach().clone()]
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        g1, g2 = torch.randn(4, 5, generator=gen), torch.randn(30, generator=gen)
        set_grads(first + second, [g1, g2])
        opt.step()
        expected_first = [oracle_first.step(expected_first, [g1])[0].view(4, 5)]
        expected_second = oracle_second.step(expected_second, [g2])
        torch.testing.assert_close(first[0].detach(), expected_first[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(second[0].detach(), expected_second[0], rtol=1e-6, atol=1e-7)


def test_parameters_without_grad_are_skipped():
    params = make_params(SHAPES)
    opt = SparseAdaGrad(params, lr=0.1, density=0.25, block_size=16)
    stream = gradient_stream(SHAPES, 6)
    run_steps(params, opt, stream[:2])
    frozen = params[1].detach().clone()
    frozen_state = {name: opt.state[params[1]][name].clone() for name in ("error", "sum_sq", "step")}
    # The blocks are formed over the parameters that have a gradient this step.
    active = [params[0], params[2]]
    oracle = Algorithm7([p.numel() for p in active], block_size=16, k=4, lr=0.1)
    oracle.error = torch.cat([opt.state[p]["error"].reshape(-1) for p in active])
    oracle.sum_sq = torch.cat([opt.state[p]["sum_sq"].reshape(-1) for p in active])
    expected = [p.detach().clone() for p in active]
    for grads in stream[2:]:
        set_grads(params, [grads[0], None, grads[2]])
        opt.step()
        expected = [
            e.view(p.shape)
            for e, p in zip(oracle.step(expected, [grads[0], grads[2]]), active)
        ]
        for p, e in zip(active, expected):
            torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
    assert torch.equal(params[1].detach(), frozen)
    for name, value in frozen_state.items():
        assert torch.equal(opt.state[params[1]][name], value)
    # All gradients back: the group's layout is rebuilt from the per-parameter state.
    set_grads(params, stream[0])
    opt.step()
    assert int(opt.state[params[1]]["step"]) == 3


def test_padding_never_reaches_parameters():
    params = make_params([(10,)])
    opt = SparseAdaGrad(params, lr=1.0, k=3, block_size=4)  # blocks 4 + 4 + 2 (padded)
    oracle = Algorithm7([10], block_size=4, k=3, lr=1.0)
    expected = [params[0].detach().clone()]
    for grads in gradient_stream([(10,)], 5):
        set_grads(params, grads)
        opt.step()
        expected = oracle.step(expected, grads)
        torch.testing.assert_close(params[0].detach(), expected[0], rtol=1e-6, atol=1e-7)
    packed = opt._packed[0]
    assert packed.error.shape == (3, 4)
    assert not bool(packed.error.view(-1)[10:].any()) and not bool(packed.sum_sq.view(-1)[10:].any())


def test_state_bytes_follow_the_layout():
    params = make_params(SHAPES)  # 62 elements, blocks of 16: 4 blocks, 64 slots
    opt = SparseAdaGrad(params, lr=0.1, density=0.25, block_size=16)
    run_steps(params, opt, gradient_stream(SHAPES, 1))
    assert optimizer_state_bytes(opt) == 2 * 4 * 64 + 4 * len(params)


def test_kept_per_block_rounds_density_up():
    assert kept_per_block(0.01, None, 4096) == 41
    assert kept_per_block(0.07, None, 100) == 7
    assert kept_per_block(1e-6, None, 16) == 1
    assert kept_per_block(None, 50, 16) == 16


def test_trains_a_small_regression():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1)
    model = torch.nn.Linear(8, 1)
    opt = SparseAdaGrad(model.parameters(), lr=0.3, density=0.25, block_size=8)
    # The algorithm's convergence, on the reference path: the kernels equal it bit for bit
    # (test_triton_and_reference_paths_agree_bitwise_step_by_step), 50x slower in the interpreter.
    with tritonopt.use_backend("reference"):
        losses = regression_losses(model, opt, x, y)
    assert losses[-1] < 0.05 * losses[0]


def test_a_state_dict_without_step_counters_is_refused_before_anything_changes():
    params = make_params(SHAPES)
    opt = SparseAdaGrad(params, lr=0.05, density=0.25, block_size=16)
    run_steps(params, opt, gradient_stream(SHAPES, 2))
    saved = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state's dicts
    for entry in saved["state"].values():
        del entry["step"]
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="step"):
        opt.load_state_dict(saved)
    run_steps(params, opt, gradient_stream(SHAPES, 1, seed=4))
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


def test_a_refused_gradient_in_a_later_group_leaves_every_group_untouched():
    params = make_params(SHAPES)
    opt = SparseAdaGrad([{"params": params[:2]}, {"params": params[2:]}], lr=0.05, density=0.25, block_size=16)
    set_grads(params, gradient_stream(SHAPES, 1)[0])
    params[2].grad = params[2].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.state_dict()["state"] == {}
