"""FlatSGD: torch.optim.SGD's steps over one flat buffer per group, on both backends, and as a DSP stage optimizer.

Hyperparameter checks, closures, parameter groups, the non-finite policy, copies and resumed
checkpoints: tests/test_optimizer_contract.py (entry in tests/_optim_table.py).
"""

import copy
import warnings

import pytest
import torch
from _helpers import BACKENDS, flat, gradient_stream, make_params, set_grads
from conftest import to_backend_device
from torch import nn

import tritonopt
from tritonopt.dist import simulate_dsp, split_stages
from tritonopt.optim import FlatSGD
from tritonopt.optim.functional import flat_sgd

UNIT_ROUNDOFF = 2.0**-24
SETTINGS = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
    dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    dict(lr=0.02, momentum=0.5, dampening=0.3),
]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 33), nn.Tanh(), nn.Linear(33, 7), nn.ReLU(), nn.Linear(7, 3))


def batches(count=4):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(9, 5, generator=gen), torch.randint(0, 3, (9,), generator=gen)) for _ in range(count)]


def one_step(model, optimizer, x, y):
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_flat_steps_match_torch_sgd_over_a_run(backend, settings):
    """Several steps on the same gradients: every weight within the accumulated rounding bound.

    Per step each side rounds at most 9 times on the way to a weight and 5 to
    the buffer (tests/test_sgd_momentum.py), so one step differs by at most
    ``18 u W`` and ``10 u B``; earlier differences carry forward through weight
    decay and the momentum buffer:
    ``E_b' = m E_b + (1 - dampening) wd E_w + 10 u B``,
    ``E_w' = E_w + lr E_d + 18 u W`` with ``E_d = E_b'`` (heavy ball),
    ``wd E_w + m E_b'`` (Nesterov) or ``wd E_w`` (no momentum).
    """
    gen = torch.Generator().manual_seed(2)
    shapes = [(4, 3), (7,), (2, 2, 5)]
    initial = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    torch_params = [nn.Parameter(w.clone()) for w in initial]
    flat_params = to_backend_device(backend, [nn.Parameter(w.clone()) for w in initial])
    torch_opt = torch.optim.SGD(torch_params, foreach=False, **settings)
    flat_opt = FlatSGD(flat_params, **settings)
    lr, momentum = settings["lr"], settings.get("momentum", 0.0)
    wd, dampening, nesterov = settings.get("weight_decay", 0.0), settings.get("dampening", 0.0), settings.get("nesterov", False)
    error_w = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    error_b = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    with tritonopt.use_backend(backend):
        for step, step_grads in enumerate(grads):
            before = [p.detach().double().abs() for p in torch_params]
            for p, g in zip(torch_params, step_grads):
                p.grad = g.clone()
            torch_opt.step()
            flat_opt.zero_grad()
            for p, g in zip(flat_params, to_backend_device(backend, step_grads)):
                p.grad.copy_(g)
            flat_opt.step()
            for i, p in enumerate(torch_params):
                a = step_grads[i].double().abs() + wd * before[i]
                if momentum:
                    buf = torch_opt.state[p]["momentum_buffer"].double().abs()
                    b = buf + a  # covers m |buf_old| + (1 - dampening) |a| and the first step's |a|
                    error_b[i] = momentum * error_b[i] + (1 - dampening) * wd * error_w[i] + 10 * UNIT_ROUNDOFF * b
                    d = a + momentum * b if nesterov else b
                    error_d = wd * error_w[i] + momentum * error_b[i] if nesterov else error_b[i]
                else:
                    d, error_d = a, wd * error_w[i]
                error_w[i] = error_w[i] + lr * error_d + 18 * UNIT_ROUNDOFF * (before[i] + lr * d)
    for tp, fp, bound in zip(torch_params, flat_params, error_w):
        assert ((tp.detach().double() - fp.detach().cpu().double()).abs() <= bound).all()


def storage_offsets(tensors) -> list[tuple[int, int]]:
    """(storage address, element offset) of each tensor."""
    return [(t.untyped_storage().data_ptr(), t.storage_offset()) for t in tensors]


def assert_laid_end_to_end(tensors):
    """One storage, each tensor starting where the previous one ends."""
    places = storage_offsets(tensors)
    assert len({storage for storage, _ in places}) == 1
    expected = 0
    for t, (_, offset) in zip(tensors, places):
        assert offset == expected and t.is_contiguous()
        expected += t.numel()


def test_parameters_gradients_and_momentum_are_views_of_one_buffer_each():
    model = make_model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = FlatSGD(params, lr=0.1, momentum=0.9)
    assert all(torch.equal(p, w) for p, w in zip(params, before))  # the values moved with them
    assert_laid_end_to_end(params)
    assert_laid_end_to_end([p.grad for p in params])
    x, y = batches(1)[0]
    one_step(model, opt, x, y)
    assert_laid_end_to_end([opt.state[p]["momentum_buffer"] for p in params])
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for p in params)
    assert opt.state[params[0]]["step"] == 1


def test_replaced_and_cleared_gradients_are_gathered():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    opt = FlatSGD(params, lr=0.5)
    params[0].grad = torch.full((3,), 2.0)  # replaced, not accumulated
    params[1].grad = None  # cleared: stepped with a zero gradient
    opt.step()
    assert torch.equal(params[0].detach(), torch.zeros(3))
    assert torch.equal(params[1].detach(), torch.ones(2))
    assert_laid_end_to_end([p.grad for p in params])  # re-attached
    params[0].grad = torch.ones(3)
    opt.zero_grad()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    assert_laid_end_to_end([p.grad for p in params])


def test_replaced_parameter_data_is_moved_into_a_fresh_buffer():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    opt = FlatSGD(params, lr=0.5, momentum=0.5)
    set_grads(params, [torch.ones(3), torch.ones(2)])
    opt.step()
    params[1].data = torch.full((2,), 4.0)  # e.g. a module moved or reloaded by assignment
    set_grads(params, [torch.ones(3), torch.ones(2)])
    opt.step()
    assert torch.equal(params[1].detach(), torch.full((2,), 4.0 - 0.5 * 1.5))  # buf = 0.5 * 1 + 1
    assert_laid_end_to_end(params)


def test_each_group_is_its_own_flat_buffer_with_its_own_hyperparameters():
    stream = gradient_stream(steps=4)
    settings = [dict(lr=0.1, momentum=0.9, nesterov=True), dict(lr=0.02, weight_decay=0.1, maximize=True)]
    together = make_params()
    grouped = FlatSGD([{"params": together[:2], **settings[0]}, {"params": together[2:], **settings[1]}], lr=1.0)
    apart = make_params()
    separate = [FlatSGD(apart[:2], **settings[0]), FlatSGD(apart[2:], **settings[1])]
    for grads in stream:
        set_grads(together, grads)
        grouped.step()
        set_grads(apart, grads)
        for opt in separate:
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(together, apart))
    assert_laid_end_to_end(together[:2])
    assert_laid_end_to_end(together[2:])
    assert together[1].untyped_storage().data_ptr() != together[2].untyped_storage().data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_parameters_are_stepped_in_float32_and_rounded_once(backend, dtype):
    """The op on a float32 copy of the flat parameters, rounded to their dtype after each step."""
    params = to_backend_device(backend, make_params(dtype=dtype))
    stream = to_backend_device(backend, gradient_stream(steps=3, dtype=dtype))
    wide = to_backend_device(backend, flat(make_params(dtype=dtype)).detach().float())
    buffer = torch.zeros_like(wide)
    opt = FlatSGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2)
    with tritonopt.use_backend(backend):
        for step, grads in enumerate(stream):
            set_grads(params, grads)
            opt.step()
            tritonopt.ops.sgd_momentum_step(wide, flat(grads), buffer, lr=0.1, momentum=0.9, weight_decay=1e-2,
                                            first_step=step == 0)
            wide.copy_(wide.to(dtype))  # the parameters hold the rounded values between steps
    assert all(p.dtype == dtype for p in params)
    assert torch.equal(flat(params).detach(), wide.to(dtype))
    buffers = [opt.state[p]["momentum_buffer"] for p in params]
    assert all(b.dtype == torch.float32 for b in buffers) and torch.equal(flat(buffers), buffer)


def test_parameters_it_cannot_step_are_refused_and_left_alone():
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        FlatSGD([nn.Parameter(torch.ones(2, dtype=torch.float64))], lr=0.1)
    with pytest.raises(TypeError, match="one dtype"):
        FlatSGD([p, nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], lr=0.1)
    with pytest.raises(ValueError, match="twice"):
        FlatSGD([p, p], lr=0.1)
    assert torch.equal(p.detach(), torch.ones(2)) and p.grad is None


def _snapshot(params, optimizer):
    return flat(params), copy.deepcopy(optimizer.state_dict())


def _assert_unchanged(params, optimizer, snapshot):
    weights, state = snapshot
    assert torch.equal(flat(params), weights)
    after = optimizer.state_dict()
    assert after["state"].keys() == state["state"].keys()
    for pid, entry in state["state"].items():
        assert after["state"][pid].keys() == entry.keys()
        for name, value in entry.items():
            assert torch.equal(after["state"][pid][name], value) if isinstance(value, torch.Tensor) else (
                after["state"][pid][name] == value)


def test_a_gradient_of_1e38_step_after_step_never_makes_the_parameters_nonfinite():
    # The momentum grows by 1e38 a step: the fourth step would reach -inf.
    params = make_params([(4,)])
    opt = FlatSGD(params, lr=0.1, momentum=0.9)
    for i in range(4):
        snapshot = _snapshot(params, opt)
        set_grads(params, [torch.full((4,), 1e38)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
        assert bool(torch.isfinite(flat(params)).all())
        assert bool(torch.isfinite(opt.state[params[0]]["momentum_buffer"]).all())
        if i < 3:
            assert opt.skipped_steps == 0 and opt.state[params[0]]["step"] == i + 1
    assert opt.skipped_steps == 1
    _assert_unchanged(params, opt, snapshot)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_step_that_would_overflow_is_skipped_or_raises_and_changes_nothing(momentum):
    params = make_params([(4,), (2, 3)])
    opt = FlatSGD(params, lr=10.0, momentum=momentum)
    for i in range(3):  # the first step overflows too: a momentum buffer it made is dropped again
        snapshot = _snapshot(params, opt)
        set_grads(params, [torch.full((4,), 1e38), torch.full((2, 3), -1e38)])
        with pytest.warns(RuntimeWarning, match="overflowed"):
            opt.step()
        _assert_unchanged(params, opt, snapshot)
        assert opt.skipped_steps == i + 1
    assert not opt.state
    # The policy "raise" raises instead, also before anything changes.
    strict = FlatSGD(params, lr=10.0, momentum=momentum, on_nonfinite="raise")
    snapshot = _snapshot(params, strict)
    with pytest.raises(FloatingPointError, match="overflowed"):
        strict.step()
    _assert_unchanged(params, strict, snapshot)
    # A finite gradient after them steps as usual.
    set_grads(params, gradient_stream([(4,), (2, 3)], 1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert bool(torch.isfinite(flat(params)).all()) and opt.state[params[0]]["step"] == 1


def test_an_overflow_in_one_group_undoes_the_step_of_every_group():
    small, large = make_params([(3,)]), make_params([(2,)], seed=1)
    opt = FlatSGD([{"params": small}, {"params": large, "lr": 10.0}], lr=0.1, momentum=0.9)
    set_grads(small + large, [torch.ones(3), torch.ones(2)])
    opt.step()
    snapshot = _snapshot(small + large, opt)
    set_grads(small + large, [torch.ones(3), torch.full((2,), 3e38)])
    with pytest.warns(RuntimeWarning, match="overflowed"):
        opt.step()
    _assert_unchanged(small + large, opt, snapshot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checked_step_that_stays_finite_is_the_ordinary_step(dtype):
    # A gradient of 1e38 makes the step's bound pass a quarter of float32's range, so the step
    # is checked; with a small lr its result is finite, and it is the fused op's step bit for bit.
    shapes, hyper = [(5,), (3, 2)], dict(lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=1e-2)
    params = make_params(shapes, dtype=dtype)
    opt = FlatSGD(params, **hyper)
    weights, momentum = flat(params).view(1, -1), torch.zeros(1, 11)
    for i, grads in enumerate(gradient_stream(shapes, 3)):
        if i == 1:
            grads = [g / g.abs().max() * 1e38 for g in grads]
        set_grads(params, grads)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        flat_sgd(weights, flat(g.to(dtype) for g in grads).view(1, -1), momentum, first_step=i == 0,
                 nesterov=False, maximize=False, **hyper)
    assert opt.skipped_steps == 0
    assert torch.equal(flat(params), weights.view(-1))


def test_a_group_of_only_empty_parameters_is_refused_and_leaves_the_optimizer_as_it_was():
    params = make_params([(3,)])
    opt = FlatSGD(params, lr=0.1, momentum=0.9)
    set_grads(params, [torch.ones(3)])
    opt.step()
    snapshot = _snapshot(params, opt)
    with pytest.raises(ValueError, match="at least one element"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(2, 0))]})
    assert len(opt.param_groups) == 1
    _assert_unchanged(params, opt, snapshot)
    opt.step()  # every later step works
    assert opt.state[params[0]]["step"] == 2


def test_as_the_stage_optimizer_of_a_dsp_pipeline():
    """Zero staleness with FlatSGD per stage is backprop with FlatSGD per block-sized buffer."""
    data = batches(8)
    model = make_model()
    stages = split_stages(model, boundaries=[2])
    losses = simulate_dsp(stages, [FlatSGD(s.parameters(), lr=0.05, momentum=0.9) for s in stages], data, [0, 0],
                          nn.functional.cross_entropy)
    reference = make_model()
    blocks = split_stages(reference, boundaries=[2])
    optimizers = [FlatSGD(b.parameters(), lr=0.05, momentum=0.9) for b in blocks]
    expected = []
    for x, y in data:
        for o in optimizers:
            o.zero_grad()
        loss = nn.functional.cross_entropy(reference(x), y)
        loss.backward()
        for o in optimizers:
            o.step()
        expected.append(loss.detach())
    assert torch.equal(losses, torch.stack(expected))
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    stale = make_model()
    stale_stages = split_stages(stale, boundaries=[2])
    stale_losses = simulate_dsp(stale_stages, [FlatSGD(s.parameters(), lr=0.05, momentum=0.9) for s in stale_stages],
                                batches(30), [2, 0], nn.functional.cross_entropy)
    assert stale_losses[-5:].mean() < stale_losses[:5].mean()
