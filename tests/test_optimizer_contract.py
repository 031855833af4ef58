"""The contract every optimizer keeps, checked for each entry of ``_optim_table.OPTIMIZERS``.

Bad hyperparameters are named; a rejected group changes nothing; a closure runs
with gradients enabled; a run resumed from a checkpoint (``torch.save`` and
``torch.load(weights_only=True)``), a deep copy or a pickle continues bit for bit
like the original; a non-finite gradient at the first step, while the window
fills or after it wraps changes nothing (``skip``: a warning and a counted step;
``raise``: ``FloatingPointError``); a huge finite gradient never makes anything
non-finite, also step after step; sparse gradients are refused before anything changes (torch
itself refuses a complex gradient for a real parameter); a group of only empty parameters is
refused without a trace or stepped like the others; a tampered state dict, one saved for
other parameters (permuted or transposed shapes, another dtype) or holding an out-of-range
or wrong-typed scalar is refused with a ``ValueError`` before anything changes.
"""

from __future__ import annotations

import copy
import io
import math
import os
import pickle
import re
import warnings

import pytest
import torch
from _helpers import assert_bitwise_equal, make_params, state_tensors
from _optim_table import OPTIMIZERS, PARAMS_OPTIMIZERS, ParamsRun, cases, known_defect_marks

import tritonopt


@pytest.fixture(autouse=True)
def reference_backend():
    # The contract is about the optimizers' bookkeeping; the backends are compared elsewhere.
    with tritonopt.use_backend("reference"):
        yield


def steps(run, indices, poison=None):
    for i in indices:
        run.step(i, poison)


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize("info", cases("test_bad_hyperparameters_are_named", None))
def test_bad_hyperparameters_are_named(info):
    for kwargs, word in info.bad_hyperparameters:
        with pytest.raises((TypeError, ValueError), match=word):
            if info.run is ParamsRun:
                info.build(make_params(), **kwargs)
            else:
                info.make_run(**kwargs)


@pytest.mark.parametrize(
    "info", cases("test_a_rejected_param_group_leaves_the_optimizer_unchanged", PARAMS_OPTIMIZERS)
)
def test_a_rejected_param_group_leaves_the_optimizer_unchanged(info):
    run = info.make_run()
    steps(run, range(2))
    before = run.snapshot()
    groups = len(run.optimizer.param_groups)
    with pytest.raises((TypeError, ValueError)):
        run.optimizer.add_param_group({"params": make_params([(4,)], seed=5), **info.bad_group})
    assert len(run.optimizer.param_groups) == groups
    assert_bitwise_equal(run.snapshot(), before)


@pytest.mark.parametrize("info", cases("test_a_group_of_empty_parameters_is_refused_or_stepped_alike", None))
def test_a_group_of_empty_parameters_is_refused_or_stepped_alike(info):
    if not info.param_groups:
        pytest.skip(f"{info.name} has no parameter groups (it preconditions the model's layers)")
    run = info.make_run()
    steps(run, range(2))
    untouched = copy.deepcopy(run)
    before = run.snapshot()
    groups = len(run.optimizer.param_groups)
    empty = torch.nn.Parameter(torch.zeros(0, 3, dtype=run.params[0].dtype))
    empty.grad = torch.zeros_like(empty)
    try:
        run.optimizer.add_param_group({"params": [empty]})
    except (TypeError, ValueError):
        assert len(run.optimizer.param_groups) == groups
        assert_bitwise_equal(run.snapshot(), before)
    # Refused or accepted, the optimizer steps on exactly as one that never saw the group.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps(run, range(2, 4 + info.steps_to_wrap))
    steps(untouched, range(2, 4 + info.steps_to_wrap))
    assert_bitwise_equal([p.detach().clone() for p in run.params], [p.detach().clone() for p in untouched.params])
    assert run.optimizer.skipped_steps == untouched.optimizer.skipped_steps == 0


@pytest.mark.parametrize(
    "info", cases("test_the_closure_runs_with_gradients_enabled_and_its_loss_is_returned", PARAMS_OPTIMIZERS)
)
def test_the_closure_runs_with_gradients_enabled_and_its_loss_is_returned(info):
    run = info.make_run()

    def closure():
        run.optimizer.zero_grad()
        loss = sum((p ** 2).sum() for p in run.params)
        loss.backward()
        return loss

    assert run.optimizer.step(closure).item() > 0


# --------------------------------------------------------------------------- copies and checkpoints


def _continue_equals_original(info, make_copy, **run_options):
    original = info.make_run(**run_options)
    steps(original, range(3))
    duplicate = make_copy(original)
    steps(original, range(3, 3 + info.steps_to_wrap + 2))
    steps(duplicate, range(3, 3 + info.steps_to_wrap + 2))
    assert_bitwise_equal(duplicate.snapshot(), original.snapshot())


@pytest.mark.parametrize("info", cases("test_a_resumed_checkpoint_continues_bit_for_bit", None))
def test_a_resumed_checkpoint_continues_bit_for_bit(info):
    def resume(run):
        buffer = io.BytesIO()
        torch.save(run.checkpoint(), buffer)
        buffer.seek(0)
        fresh = info.make_run(seed=7)  # other initial values: everything must come from the checkpoint
        fresh.restore(torch.load(buffer, weights_only=True))
        return fresh

    _continue_equals_original(info, resume)


@pytest.mark.parametrize(
    "info", cases("test_bfloat16_parameters_resume_bit_for_bit", PARAMS_OPTIMIZERS)
)
def test_bfloat16_parameters_resume_bit_for_bit(info):
    def resume(run):
        fresh = info.make_run(seed=7, dtype=torch.bfloat16)
        fresh.restore(copy.deepcopy(run.checkpoint()))
        return fresh

    _continue_equals_original(info, resume, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "info", cases("test_loading_a_state_dict_does_not_alias_it", PARAMS_OPTIMIZERS)
)
def test_loading_a_state_dict_does_not_alias_it(info):
    run = info.make_run()
    steps(run, range(2))
    saved = copy.deepcopy(run.optimizer.state_dict())
    untouched = copy.deepcopy(saved)
    run.optimizer.load_state_dict(saved)
    steps(run, range(2, 4))
    assert_bitwise_equal(state_tensors(saved), state_tensors(untouched))


@pytest.mark.parametrize("info", cases("test_a_deep_copy_continues_bit_for_bit", None))
def test_a_deep_copy_continues_bit_for_bit(info):
    _continue_equals_original(info, copy.deepcopy)


@pytest.mark.parametrize("info", cases("test_a_pickled_copy_continues_bit_for_bit", None))
def test_a_pickled_copy_continues_bit_for_bit(info):
    _continue_equals_original(info, lambda run: pickle.loads(pickle.dumps(run)))


@pytest.mark.parametrize("info", cases("test_a_copy_keeps_the_hyperparameters", None))
def test_a_copy_keeps_the_hyperparameters(info):
    run = info.make_run(on_nonfinite="raise")
    steps(run, range(2))
    duplicate = copy.deepcopy(run)
    assert duplicate.optimizer.on_nonfinite == "raise"
    assert duplicate.optimizer.skipped_steps == run.optimizer.skipped_steps
    public = {k: v for k, v in vars(run.optimizer).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}
    assert {k: getattr(duplicate.optimizer, k, None) for k in public} == public


# --------------------------------------------------------------------------- bad gradients


def poison_with(value):
    def poison(grads):
        grads[0].view(-1)[1] = value
    return poison


NONFINITE_CASES = [
    pytest.param(
        info, when, value, policy,
        marks=known_defect_marks(info, "test_a_nonfinite_gradient_changes_nothing", f"{policy} {when}"),
        id=f"{info.name}-{policy}-{'nan' if math.isnan(value) else 'inf'}-{when.replace(' ', '_')}",
    )
    for info in OPTIMIZERS
    for when in ("first step", "window filling", "after wrapping")
    for value in (math.nan, -math.inf)
    for policy in ("skip", "raise")
]


@pytest.mark.parametrize("info, when, value, policy", NONFINITE_CASES)
def test_a_nonfinite_gradient_changes_nothing(info, when, value, policy):
    run = info.make_run(on_nonfinite=policy)
    done = {"first step": 0, "window filling": 2, "after wrapping": info.steps_to_wrap + 1}[when]
    steps(run, range(done))
    before = run.snapshot(ignore=("skipped_steps",))
    skipped = run.optimizer.skipped_steps
    if policy == "skip":
        with pytest.warns(RuntimeWarning, match="NaN or inf") as record:
            run.step(done, poison_with(value))
        assert run.optimizer.skipped_steps == skipped + 1
        # The warning names the caller's line, not a frame inside tritonopt or torch.
        libraries = (os.path.dirname(tritonopt.__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)
        assert not any(w.filename.startswith(libraries) for w in record if "NaN or inf" in str(w.message))
    else:
        with pytest.raises(FloatingPointError, match="NaN or inf"):
            run.step(done, poison_with(value))
    assert_bitwise_equal(run.snapshot(ignore=("skipped_steps",)), before)
    # A clean step afterwards raises nothing and warns nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.step(done + 1)
    assert all(bool(torch.isfinite(p).all()) for p in run.params)


@pytest.mark.parametrize(
    "info", cases("test_a_huge_finite_gradient_never_makes_anything_nonfinite", None)
)
def test_a_huge_finite_gradient_never_makes_anything_nonfinite(info):
    run = info.make_run()
    steps(run, range(2))
    before = run.snapshot(ignore=("skipped_steps",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # refusing the step is allowed; corrupting is not
        run.step(2, poison_with(1e25))
    after = run.snapshot(ignore=("skipped_steps",))
    for value in after:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert bool(torch.isfinite(value).all())
    if run.optimizer.skipped_steps:
        assert_bitwise_equal(after, before)


@pytest.mark.parametrize(
    "info", cases("test_a_huge_finite_gradient_step_after_step_never_makes_anything_nonfinite", None)
)
def test_a_huge_finite_gradient_step_after_step_never_makes_anything_nonfinite(info):
    run = info.make_run()
    steps(run, range(2))

    def huge(grads):
        grads[0].fill_(1e38)

    for i in range(2, 6):
        before = run.snapshot(ignore=("skipped_steps",))
        skipped = run.optimizer.skipped_steps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # refusing the step is allowed; corrupting is not
            run.step(i, huge)
        after = run.snapshot(ignore=("skipped_steps",))
        for value in after:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert bool(torch.isfinite(value).all()), f"step {i}"
        if run.optimizer.skipped_steps != skipped:
            assert run.optimizer.skipped_steps == skipped + 1
            assert_bitwise_equal(after, before)


@pytest.mark.parametrize(
    "info", cases("test_complex_and_integer_parameters_are_refused", PARAMS_OPTIMIZERS)
)
def test_complex_and_integer_parameters_are_refused(info):
    with pytest.raises(ValueError, match="complex"):
        info.build([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="floating-point"):
        info.build([torch.zeros(3, dtype=torch.int64)])


@pytest.mark.parametrize(
    "info", cases("test_sparse_gradients_are_refused_before_anything_changes", PARAMS_OPTIMIZERS)
)
def test_sparse_gradients_are_refused_before_anything_changes(info):
    run = info.make_run()
    steps(run, range(2))
    before = run.snapshot()
    grads = run.gradients(2)
    for p, g in zip(run.params, grads):
        p.grad = g.clone()
    run.params[1].grad = run.params[1].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        run.optimizer.step()
    assert_bitwise_equal(run.snapshot(), before)


# --------------------------------------------------------------------------- tampered state


def _tamper_cases(info):
    def drop_key(state):
        entry = next(v for v in state["state"].values() if len(v) > 1)
        entry.pop(sorted(entry)[-1])

    def wrong_shape(state):
        for entry in state["state"].values():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and name != "step":
                    entry[name] = torch.zeros(value.shape[0] + 1, *value.shape[1:], dtype=value.dtype)
                    return

    def foreign(state):
        other = torch.optim.Adam(make_params(), lr=0.1) if info.run is ParamsRun else None
        if other is None:
            state["state"] = {k: {"exp_avg": torch.zeros(1)} for k in state["state"]}
            return
        params = other.param_groups[0]["params"]
        for p in params:
            p.grad = torch.ones_like(p)
        other.step()
        adam = other.state_dict()
        state["state"] = adam["state"]

    return {"missing key": drop_key, "wrong shape": wrong_shape, "another optimizer's state": foreign}


@pytest.mark.parametrize("case", ["missing key", "wrong shape", "another optimizer's state"])
@pytest.mark.parametrize(
    "info", cases("test_a_tampered_state_dict_is_refused_before_anything_changes", PARAMS_OPTIMIZERS)
)
def test_a_tampered_state_dict_is_refused_before_anything_changes(info, case):
    source = info.make_run()
    steps(source, range(info.steps_to_wrap + 1))
    state = copy.deepcopy(source.optimizer.state_dict())
    _tamper_cases(info)[case](state)
    target = info.make_run(seed=3)
    steps(target, range(2))
    before = target.snapshot()
    with pytest.raises((ValueError, KeyError, TypeError)):
        target.optimizer.load_state_dict(state)
    assert_bitwise_equal(target.snapshot(), before)
    untouched = copy.deepcopy(target)
    steps(target, range(2, 4))
    steps(untouched, range(2, 4))
    assert_bitwise_equal(target.snapshot(), untouched.snapshot())


def _refused_before_anything_changes(info, state, match, **target_options):
    """Loading ``state`` into a stepped run raises a ``ValueError`` matching ``match``; the run is as before."""
    target = info.make_run(seed=3, **target_options)
    steps(target, range(2))
    before = target.snapshot()
    with pytest.raises(ValueError, match=match):
        target.optimizer.load_state_dict(state)
    assert_bitwise_equal(target.snapshot(), before)


LAYOUT_CASES = [
    pytest.param(info, layout, marks=known_defect_marks(info, "test_a_checkpoint_of_other_parameters_is_refused",
                                                        layout),
                 id=f"{info.name}-{layout.replace(' ', '_')}")
    for info in OPTIMIZERS
    for layout in ("permuted shapes", "transposed shapes", "another dtype")
]


@pytest.mark.parametrize("info, layout", LAYOUT_CASES)
def test_a_checkpoint_of_other_parameters_is_refused(info, layout):
    source = info.make_run()
    steps(source, range(info.steps_to_wrap + 1))
    state = copy.deepcopy(source.optimizer.state_dict())
    # Named by the layout, before any entry's shape could tell (M-FAC's and GGT's often cannot).
    _refused_before_anything_changes(info, state, "param_layout", **info.other_layouts[layout])


def _scalar_fields(state: dict) -> list:
    """``(path, name)`` of every scalar a state dict holds: numbers, bools and 0-d tensors at any
    depth of its dicts (``betas``-like pairs of numbers too), leaving out parameter ids and layouts."""
    fields = []

    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                if key not in ("params", "param_layout"):
                    walk(item, path + (key,))
        elif isinstance(value, (list, tuple)) and path[-1] != "param_groups":
            if value and all(isinstance(item, float) for item in value):
                fields.extend((path + (index,), path[-1]) for index in range(len(value)))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, path + (index,))
        elif isinstance(value, (bool, int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
            fields.append((path, path[-1]))

    walk(state, ())
    return fields


def _bad_values(value) -> list:
    """Values of the wrong kind or out of range for a scalar that holds ``value``."""
    if isinstance(value, bool):
        return ["yes"]
    if isinstance(value, int):
        return [-1, True, float(value)]
    if isinstance(value, float):
        return [math.nan, -1.0, True]
    return [torch.tensor(-1.0), torch.tensor(0.5), torch.tensor(math.nan), torch.tensor(1, dtype=torch.int64)]


def _replaced(state: dict, path: tuple, new) -> dict:
    """A copy of ``state`` whose entry at ``path`` is ``new``."""

    def put(container, keys):
        if isinstance(container, tuple):  # a pair such as betas
            return tuple(put(list(container), keys))
        container[keys[0]] = new if len(keys) == 1 else put(container[keys[0]], keys[1:])
        return container

    return put(copy.deepcopy(state), path)


@pytest.mark.parametrize("info", cases("test_out_of_range_or_wrong_typed_scalars_are_refused_by_name", None))
def test_out_of_range_or_wrong_typed_scalars_are_refused_by_name(info):
    source = info.make_run()
    steps(source, range(info.steps_to_wrap + 1))
    good = source.optimizer.state_dict()
    target = info.make_run(seed=3)
    steps(target, range(2))
    before = target.snapshot()
    tried = 0
    for path, name in _scalar_fields({"": good}):
        path = path[1:]
        holder = good
        for key in path:
            holder = holder[key]
        for bad in _bad_values(holder):
            state = _replaced(good, path, bad)
            with pytest.raises(ValueError, match=re.escape(str(name))):
                target.optimizer.load_state_dict(state)
            tried += 1
    assert tried >= 6  # skipped_steps, a step counter and a hyperparameter at least
    assert_bitwise_equal(target.snapshot(), before)
    target.optimizer.load_state_dict(good)
