"""FlatSGD: torch.optim.SGD's steps over one flat buffer, on both backends, and as a DSP stage optimizer."""

import pytest
import torch
from conftest import triton_runs_here
from torch import nn

import tritonopt
from tritonopt.dist import simulate_dsp, split_stages
from tritonopt.dist.dsp_update import FlatSGD

BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")),
]
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
    flat_params = [nn.Parameter(w.clone()) for w in initial]
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
            for p, g in zip(flat_params, step_grads):
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
        assert ((tp.detach().double() - fp.detach().double()).abs() <= bound).all()


def test_parameters_become_views_of_one_buffer_and_keep_their_values():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = FlatSGD(model.parameters(), lr=0.1, momentum=0.9)
    flat = opt._flat
    for p, w in zip(model.parameters(), before):
        assert torch.equal(p, w)
        assert flat.data_ptr() <= p.data_ptr() < flat.data_ptr() + flat.numel() * 4
    x, y = batches(1)[0]
    one_step(model, opt, x, y)
    assert opt.state[next(iter(model.parameters()))]["momentum_buffer"].shape == flat.shape


def test_replaced_and_cleared_gradients_are_gathered():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    opt = FlatSGD(params, lr=0.5)
    params[0].grad = torch.full((3,), 2.0)  # replaced, not accumulated
    params[1].grad = None  # cleared: stepped with a zero gradient
    opt.step()
    assert torch.equal(params[0].detach(), torch.zeros(3))
    assert torch.equal(params[1].detach(), torch.ones(2))
    assert params[0].grad.data_ptr() == opt._flat_grad.data_ptr()  # re-attached


def test_state_dict_round_trip_resumes_exactly():
    data = batches(6)
    straight = make_model()
    opt = FlatSGD(straight.parameters(), lr=0.05, momentum=0.9)
    for x, y in data:
        one_step(straight, opt, x, y)
    resumed = make_model()
    first = FlatSGD(resumed.parameters(), lr=0.05, momentum=0.9)
    for x, y in data[:3]:
        one_step(resumed, first, x, y)
    saved = {"model": resumed.state_dict(), "opt": first.state_dict()}
    again = make_model()
    second = FlatSGD(again.parameters(), lr=0.05, momentum=0.9)
    again.load_state_dict(saved["model"])
    second.load_state_dict(saved["opt"])
    for x, y in data[3:]:
        one_step(again, second, x, y)
    for a, b in zip(straight.parameters(), again.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(lr=-0.1), ValueError, "lr"),
        (dict(lr=0.1, momentum=float("nan")), ValueError, "momentum"),
        (dict(lr=0.1, nesterov=True), ValueError, "nesterov"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, error, message):
    with pytest.raises(error, match=message):
        FlatSGD(make_model().parameters(), **kwargs)


def test_bad_parameters_are_rejected_and_left_alone():
    with pytest.raises(TypeError, match="float32"):
        FlatSGD([nn.Parameter(torch.ones(2, dtype=torch.float64))], lr=0.1)
    with pytest.raises(ValueError, match="empty"):
        FlatSGD([], lr=0.1)
    with pytest.raises(TypeError, match="one parameter group"):
        FlatSGD([{"params": [nn.Parameter(torch.ones(2))]}], lr=0.1)
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="twice"):
        FlatSGD([p, p], lr=0.1)
    opt = FlatSGD([p], lr=0.1)
    with pytest.raises(ValueError, match="cannot take another"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})


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
