"""The compile contract: every optimizer of the contract table steps under ``torch.compile(opt.step)``
as it does eagerly, a skipped non-finite step included.

With backend ``aot_eager`` the compiled step runs the same aten ops in the same order as
the eager one, so the runs agree bit for bit. Inductor generates its own kernels: it may
fuse and reorder float32 arithmetic, so its parameters are held to a bound derived from
the rounding of the dtypes the run keeps (:func:`assert_within_rounding`); it is slow on the
CPU (a C++ build of every graph), so it runs with ``-m slow``, as do the optimizers whose
traces take longest.

None of the steps compiles with ``fullgraph=True``: each decides on the host whether a
step may happen (the non-finite policy), and that read is a graph break.
"""

import math
import warnings

import pytest
import torch

import tritonopt
from tritonopt.optim.windowed import MAX_GRADIENT_NORM
from _helpers import SHAPES, gradient_stream, make_params, set_grads
from _optim_table import OPTIMIZERS, known_defect_marks

# One optimizer of each kind of step in the default suite (a flat buffer, the windowed
# sparse ring, FOSI's eager update with its curvature estimates); the rest with -m slow.
DEFAULT_SUITE = {"FlatSGD", "SparseMFAC", "FOSI"}
POISONED_STEP = 2  # a NaN gradient: both runs skip it, count it and change nothing


def compile_steps(run, backend: str) -> None:
    """Every optimizer of ``run`` steps through ``torch.compile`` (the run calls ``optimizer.step()``)."""
    for optimizer in run.optimizers:
        optimizer.step = torch.compile(optimizer.step, backend=backend)


def poison(grads) -> None:
    grads[0].view(-1)[1] = math.nan


def run_side_by_side(info, backend: str):
    """An eager and a compiled run of ``info`` through two more steps than fill its window, one poisoned."""
    torch._dynamo.reset()
    eager, compiled = info.make_run(), info.make_run()
    compile_steps(compiled, backend)
    with tritonopt.use_backend("reference"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning, checked by the contract module
        for i in range(info.steps_to_wrap + 2):
            for run in (eager, compiled):
                run.step(i, poison if i == POISONED_STEP else None)
    return eager, compiled


def assert_within_rounding(eager, compiled, steps: int, name: str) -> None:
    """Each parameter: ``|compiled - eager| <= steps * 2 * u * max|eager|``, with ``u`` the unit roundoff
    (``eps / 2``: ``2^-24`` for float32, ``2^-8`` for bfloat16) of the least precise dtype the run keeps.

    A compiled step computes the same values as the eager one, in another order or with
    fused operations. Either result of a step is within ``u`` (relative) of the same exact
    value, so the two differ by at most ``2 u`` of the magnitudes involved, the parameter's
    largest entry bounding them; the differences of ``steps`` steps add up. State is not
    compared: where its input moves by one rounding, it may take another, equivalent value
    (the sign of an eigenvector, which of two tied entries Top-k keeps).
    """
    kept = [t for t in eager.snapshot() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    unit_roundoff = max(torch.finfo(t.dtype).eps / 2 for t in kept)
    for index, (want, got) in enumerate(zip(eager.params, compiled.params)):
        bound = steps * 2 * unit_roundoff * float(want.detach().double().abs().max())
        difference = float((got.detach().double() - want.detach().double()).abs().max())
        assert difference <= bound, (f"{name}: parameter {index} differs by {difference:.3g} between the compiled "
                                     f"and the eager run, over the rounding bound {bound:.3g}")


def compare(eager, compiled, info, exact: bool) -> None:
    assert [o.skipped_steps for o in compiled.optimizers if hasattr(o, "skipped_steps")] == \
        [o.skipped_steps for o in eager.optimizers if hasattr(o, "skipped_steps")]
    if not exact:
        assert_within_rounding(eager, compiled, info.steps_to_wrap + 2, info.name)
        return
    expected, actual = eager.snapshot(), compiled.snapshot()
    assert len(actual) == len(expected)
    for index, (want, got) in enumerate(zip(expected, actual)):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), f"{info.name}: entry {index} of the snapshot differs"
        else:
            assert got == want


def compile_cases(test: str, slow_unless_default: bool) -> list:
    """Every optimizer of the table for ``test``, with its known-defect marks; slow outside ``DEFAULT_SUITE``."""
    return [pytest.param(info, id=info.name, marks=known_defect_marks(info, test) + (
                [pytest.mark.slow] if slow_unless_default and info.name not in DEFAULT_SUITE else []))
            for info in OPTIMIZERS]


@pytest.mark.parametrize("info", compile_cases("test_the_compiled_step_equals_the_eager_step", True))
def test_the_compiled_step_equals_the_eager_step(info):
    eager, compiled = run_side_by_side(info, "aot_eager")
    compare(eager, compiled, info, exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("info", compile_cases("test_the_inductor_step_is_within_rounding_of_the_eager_step", False))
def test_the_inductor_step_is_within_rounding_of_the_eager_step(info):
    eager, compiled = run_side_by_side(info, "inductor")
    compare(eager, compiled, info, exact=False)


def test_fullgraph_stops_at_the_host_decision_of_the_nonfinite_policy():
    torch._dynamo.reset()
    params = make_params()
    opt = tritonopt.optim.SparseMFAC(params, lr=0.05, ngrads=3, damp=0.1, density=0.25, block_size=16)
    set_grads(params, gradient_stream(SHAPES, 1)[0])
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)) as failure:
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    # Dynamo names the host read (.item()) or, when it captures scalar outputs, the guard on the threshold itself.
    message = str(failure.value)
    assert "MAX_GRADIENT_NORM" in message or "item" in message or f"< {MAX_GRADIENT_NORM:.1e}" in message, message


def test_fosi_runs_its_update_eagerly_under_fullgraph_it_is_a_graph_break():
    torch._dynamo.reset()
    params = make_params()
    opt = tritonopt.optim.FOSI(params, lr=1e-2, k=2)
    set_grads(params, gradient_stream(SHAPES, 1)[0])
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    assert opt.step_count == 0 and all(not opt.state[p] for p in params)  # nothing ran


# --------------------------------------------------------------------------- FOSI with a compiled model


def _fosi_on(model: torch.nn.Module, forward, compile_step: bool) -> list[torch.Tensor]:
    """Parameters after three FOSI steps (two curvature estimates) with ``forward`` as the model's call."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    opt = tritonopt.optim.FOSI(model.parameters(), lr=1e-2, k=2, l=1, num_lanczos_iters=8, curvature_update_every=2,
                               curvature_loss_fn=lambda: torch.nn.functional.cross_entropy(forward(x), y))
    if compile_step:
        opt.step = torch.compile(opt.step, backend="aot_eager")
    for i in range(3):
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(forward(x[i::2]), y[i::2]).backward()
        opt.step()
    assert opt.ese_count == 2 and opt.eigenvalues.numel() == 3
    return [p.detach().clone() for p in model.parameters()]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("compile_step", [False, True], ids=["eager-step", "compiled-step"])
def test_fosi_estimates_curvature_through_a_compiled_model(compile_step):
    """A compiled model's backward cannot be differentiated again (torch refuses create_graph
    on it); the estimate runs the model's own code, so the run equals the eager model's."""
    torch._dynamo.reset()
    eager_model, compiled_model = _model(), _model()
    expected = _fosi_on(eager_model, eager_model, compile_step=False)
    actual = _fosi_on(compiled_model, torch.compile(compiled_model, backend="aot_eager"), compile_step)
    for want, got in zip(expected, actual):
        assert torch.equal(got, want)
