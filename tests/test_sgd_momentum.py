"""The fused momentum-SGD step: reference == torch.optim.SGD bit for bit, Triton == reference to rounding.

Bad arguments, meta tensors, empty calls and ``opcheck``: tests/test_op_contract.py (entries in
tests/_op_table.py).
"""

import itertools

import pytest
import torch
from _helpers import BACKENDS
from conftest import backend_device, run_on_backend, to_backend_device, triton_runs_here
from hypothesis import given
from hypothesis import strategies as st

import tritonopt
from tritonopt.ops import sgd_momentum_step

UNIT_ROUNDOFF = 2.0**-24  # float32

OPTIONS = [  # (momentum, dampening, weight_decay, nesterov, maximize)
    (0.0, 0.0, 0.0, False, False),
    (0.0, 0.0, 1e-2, False, True),
    (0.9, 0.0, 0.0, False, False),
    (0.9, 0.1, 5e-4, False, False),
    (0.9, 0.0, 1e-2, True, False),
    (0.5, 0.0, 0.0, True, True),
]


def torch_sgd_steps(w0, grads, lr, momentum, dampening, weight_decay, nesterov, maximize):
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                          nesterov=nesterov, maximize=maximize, foreach=False)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    buf = opt.state[w].get("momentum_buffer") if momentum else None
    return w.detach(), buf


def op_steps(backend, w0, grads, lr, momentum, dampening, weight_decay, nesterov, maximize):
    """The op's steps on ``backend``'s device; the weights and buffer come back on the CPU."""
    w, grads = to_backend_device(backend, (w0.clone(), grads))
    buf = torch.zeros_like(w)
    with tritonopt.use_backend(backend):
        for step, g in enumerate(grads):
            sgd_momentum_step(w, g, buf, lr=lr, momentum=momentum, dampening=dampening,
                              weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                              first_step=step == 0)
    return w.cpu(), (buf.cpu() if momentum else None)


@pytest.mark.parametrize("options", OPTIONS)
def test_reference_is_torch_sgd_bit_for_bit(options):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(3001, generator=gen)
    grads = [torch.randn(3001, generator=gen) for _ in range(4)]
    expected_w, expected_buf = torch_sgd_steps(w0, grads, 0.05, *options)
    w, buf = op_steps("reference", w0, grads, 0.05, *options)
    assert torch.equal(w, expected_w)
    if expected_buf is not None:
        assert torch.equal(buf, expected_buf)


def rounding_bounds(w, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step):
    """Bounds on |triton - reference| for one step, from float32 rounding (float64 magnitudes).

    Along the chain to ``w`` each implementation rounds at most 9 times (weight
    decay product and sum, momentum product, scaled gradient and sum, Nesterov
    product and sum, lr product and difference), each error at most ``u`` times
    the magnitudes that enter it, so they differ by at most ``18 u W``, with ``W``
    the sum of magnitudes below; the buffer's chain has 5 roundings: ``10 u B``.
    """
    w, g, buf = w.double().abs(), g.double().abs(), buf.double().abs()
    a = g + weight_decay * w
    b = a if first_step else momentum * buf + (1 - dampening) * a
    d = (a + momentum * b if nesterov else b) if momentum else a
    return 18 * UNIT_ROUNDOFF * (w + lr * d), 10 * UNIT_ROUNDOFF * b


@given(
    n=st.sampled_from([0, 1, 7, 1023, 1025, 4099]),
    options=st.sampled_from(OPTIONS),
    first_step=st.booleans(),
    grad_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    lr=st.sampled_from([1e-3, 0.1, 3.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_matches_reference_to_rounding(n, options, first_step, grad_dtype, lr, seed):
    if not triton_runs_here():
        pytest.skip("Triton cannot run here")
    momentum, dampening, weight_decay, nesterov, maximize = options
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 4).to(grad_dtype)
    buf0 = torch.randn(n, generator=gen)
    out = {}
    for backend in ("reference", "triton"):
        w, buf = w0.clone(), buf0.clone()
        run_on_backend(backend, sgd_momentum_step, w, g, buf, lr=lr, momentum=momentum, dampening=dampening,
                       weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, first_step=first_step)
        out[backend] = (w, buf)
    tol_w, tol_buf = rounding_bounds(w0, g.float(), buf0, lr, momentum, dampening, weight_decay, nesterov, first_step)
    assert ((out["triton"][0].double() - out["reference"][0].double()).abs() <= tol_w).all()
    if momentum:
        assert ((out["triton"][1].double() - out["reference"][1].double()).abs() <= tol_buf).all()
    else:
        assert torch.equal(out["triton"][1], buf0) and torch.equal(out["reference"][1], buf0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_values_propagate_like_torch(backend):
    w0 = torch.tensor([1.0, float("inf"), 2.0, -3.0, 0.5])
    g = torch.tensor([float("nan"), 1.0, float("inf"), 0.0, -0.0])
    for momentum, weight_decay in itertools.product([0.0, 0.9], [0.0, 0.1]):
        expected, _ = torch_sgd_steps(w0, [g], 0.1, momentum, 0.0, weight_decay, False, False)
        w, _ = op_steps(backend, w0, [g], 0.1, momentum, 0.0, weight_decay, False, False)
        assert torch.equal(torch.isnan(w), torch.isnan(expected))
        finite = ~torch.isnan(expected)
        assert torch.equal(w[finite], expected[finite])


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_momentum_the_buffer_is_optional_and_untouched(backend):
    device = backend_device(backend)
    w, g = torch.ones(10, device=device), torch.full((10,), 2.0, device=device)
    with tritonopt.use_backend(backend):
        sgd_momentum_step(w, g, lr=0.25)
        assert torch.equal(w.cpu(), torch.full((10,), 0.5))
        buf = torch.full((10,), 7.0, device=device)
        sgd_momentum_step(w, g, buf, lr=0.25, momentum=0.0)
    assert torch.equal(buf.cpu(), torch.full((10,), 7.0))


def test_compiles_into_a_graph():
    gen = torch.Generator().manual_seed(4)
    w, g, b = torch.randn(64, generator=gen), torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    w_compiled, b_compiled = w.clone(), b.clone()

    def step(w, g, b):
        sgd_momentum_step(w, g, b, lr=0.1, momentum=0.9, weight_decay=1e-4)
        return w * 1.0

    expected = step(w, g, b)
    torch._dynamo.reset()
    result = torch.compile(step, backend="aot_eager", fullgraph=True)(w_compiled, g, b_compiled)
    assert torch.equal(result, expected) and torch.equal(b_compiled, b)
