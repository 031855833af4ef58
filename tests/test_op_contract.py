"""The contract every op keeps, checked for each entry of ``_op_table.OPS``.

Bad input raises a ``TypeError`` or ``ValueError`` that names the argument, with
every input left bit for bit as it was: a non-tensor or a complex tensor where a
tensor is expected, a tensor on another device, a buffer written in place that
is not contiguous, requires grad or shares memory with another argument, and
each op's own cases. Meta tensors give meta outputs of the real outputs' shapes,
and ``torch.library.opcheck`` passes on both backends.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import BACKENDS
from _op_table import OPS
from conftest import backend_device

import tritonopt


def _cases(info) -> list:
    """The generic bad inputs of an op, derived from its sample, then its own."""
    sample = info.sample()
    tensors = [name for name, value in sample.items() if isinstance(value, torch.Tensor)]
    cases = []
    for position, name in enumerate(tensors):
        value = sample[name]
        cases.append((f"{name} not a tensor", {name: value.tolist()}, TypeError, name))
        cases.append((f"{name} complex", {name: value.to(torch.complex64)}, TypeError, name))
        cases.append((f"{name} 0-d", {name: torch.tensor(1.0, dtype=value.dtype)}, (TypeError, ValueError), name))
        if position > 0:  # the first tensor is the one the others are compared with
            cases.append((f"{name} on another device", {name: value.to("meta")}, ValueError, name))
    for name in info.updated:
        value = sample[name]
        if value.dim() >= 2 and min(value.shape) > 1:
            cases.append((f"{name} not contiguous", {name: value.mT.contiguous().mT}, ValueError, name))
        if value.is_floating_point():
            cases.append((f"{name} requires grad", {name: value.clone().requires_grad_()}, ValueError, name))
        for other in tensors:
            twin = sample[other]
            if other != name and twin.shape == value.shape and twin.dtype == value.dtype:
                cases.append((f"{name} is {other}", {other: "alias", name: "alias"}, ValueError, "share memory"))
    return cases + list(info.bad)


def _moved(value: torch.Tensor, target) -> torch.Tensor:
    """``value`` on ``target`` with its sizes and strides, so a bad layout reaches the op as written.

    ``.to`` keeps a dense layout (a transpose) but makes a view with gaps (``x[::2]``) contiguous:
    such a view is rebuilt on ``target`` from its whole storage instead.
    """
    moved = value.to(target)
    if moved.stride() == value.stride():
        return moved
    with torch.no_grad():
        storage = value.as_strided((value.untyped_storage().nbytes() // value.element_size(),), (1,), 0)
        moved = storage.to(target, copy=True).as_strided(value.size(), value.stride(), value.storage_offset())
    return moved.requires_grad_(value.requires_grad)


def _on(backend: str, call: dict) -> dict:
    """The call's CPU tensors moved, layout and all, to where ``backend`` runs (meta tensors stay on meta)."""
    target = backend_device(backend)
    return {name: _moved(value, target) if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value
            for name, value in call.items()}


BAD_CASES = [
    pytest.param(info, description, changes, exception, word, id=f"{info.name}-{description}")
    for info in OPS
    for description, changes, exception, word in _cases(info)
]


STRIDED_CASE_TENSORS = [
    pytest.param(value, id=f"{info.name}-{description}-{name}")
    for info in OPS
    for description, changes, _, _ in _cases(info)
    if isinstance(changes, dict)
    for name, value in changes.items()
    if isinstance(value, torch.Tensor) and not value.is_contiguous()
]


@pytest.mark.parametrize("value", STRIDED_CASE_TENSORS)
def test_a_case_moved_to_another_device_keeps_its_layout(value):
    # On a GPU the Triton cases run on CUDA copies; "meta" is another device on every machine.
    moved = _moved(value, "meta")
    assert moved.device.type == "meta"
    assert (moved.shape, moved.stride(), moved.dtype) == (value.shape, value.stride(), value.dtype)
    assert not moved.is_contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("info, description, changes, exception, word", BAD_CASES)
def test_bad_input_is_named_and_changes_nothing(backend, info, description, changes, exception, word):
    call = _on(backend, info.sample())
    if callable(changes):
        changes(call)
    else:
        if "alias" in changes.values():
            shared = call[next(name for name in changes if name in info.updated)]
            changes = {name: shared for name in changes}
        call.update(_on(backend, changes))
    before = {name: value.clone() for name, value in call.items()
              if isinstance(value, torch.Tensor) and value.device.type != "meta"}
    with tritonopt.use_backend(backend), pytest.raises(exception, match=word):
        info.op(**call)
    for name, value in before.items():
        assert torch.equal(call[name].detach(), value), f"{name} changed"


def _outputs(result) -> list:
    if result is None:
        return []
    return list(result) if isinstance(result, (tuple, list)) else [result]


@pytest.mark.parametrize("info", OPS, ids=lambda info: info.name)
def test_meta_inputs_give_meta_outputs_of_the_real_shapes(info):
    real = _outputs(info.op(**info.sample()))
    meta_call = {name: _moved(value, "meta") if isinstance(value, torch.Tensor) else value
                 for name, value in info.sample().items()}
    fake = _outputs(info.op(**meta_call))
    assert [t.shape for t in fake] == [t.shape for t in real]
    assert [t.dtype for t in fake] == [t.dtype for t in real]
    assert all(t.device.type == "meta" for t in fake)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("info", [info for info in OPS if info.empty is not None], ids=lambda info: info.name)
def test_an_empty_call_runs_and_returns_empty_or_unchanged_results(backend, info):
    # A launch grid of zero programs, or a reduction over nothing, must not fail.
    with tritonopt.use_backend("reference"):
        expected = _outputs(info.op(**info.empty()))
    with tritonopt.use_backend(backend):
        got = _outputs(info.op(**_on(backend, info.empty())))
    assert [t.shape for t in got] == [t.shape for t in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.cpu(), b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("info", [info for info in OPS if info.op.custom_op is not None], ids=lambda info: info.name)
def test_opcheck(backend, info):
    with tritonopt.use_backend(backend):
        torch.library.opcheck(info.op.custom_op, info.op.dispatcher_arguments(**_on(backend, info.sample())))
