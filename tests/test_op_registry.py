"""The op registry's argument completion: every call shape reaches the backend as one full
argument list (positional parameters by position, keyword-only ones by name, defaults filled,
ints of float parameters made floats), the first call of a shape and the later ones alike."""

import pytest
import torch

from tritonopt._ops._registry import define_op

received = []


@define_op("registry_call_shapes_probe", composite=True)
def probe(x: torch.Tensor, scale: float, shift: float = 0.5, *, power: int = 1, tag: str = "t") -> torch.Tensor:
    """A probe op: records how its backend was called."""


def record(*args, **kwargs):
    received.append((args[1:], kwargs))
    return args[0]


probe.register_backends(reference=record)

X = torch.zeros(2)
CALLS = [
    ((X, 2), {}, ((2.0, 0.5), {"power": 1, "tag": "t"})),
    ((X, 2, 1), {}, ((2.0, 1.0), {"power": 1, "tag": "t"})),
    ((X,), {"scale": 3.0}, ((3.0, 0.5), {"power": 1, "tag": "t"})),
    ((X, 2.5), {"power": 3}, ((2.5, 0.5), {"power": 3, "tag": "t"})),
    ((), {"tag": "u", "shift": 1.5, "scale": 4, "x": X}, ((4.0, 1.5), {"power": 1, "tag": "u"})),
]


@pytest.mark.parametrize("args, kwargs, expected", CALLS)
def test_every_call_shape_reaches_the_backend_complete(args, kwargs, expected):
    for _ in range(3):  # the first call plans the shape, the others reuse the plan
        received.clear()
        probe(*args, **kwargs)
        (positional, keyword), = received
        assert (positional, keyword) == expected
        assert all(type(v) is float for v in positional)


def test_the_same_shape_with_other_values_gets_those_values():
    received.clear()
    probe(X, 1.0, power=2)
    probe(X, 7.0, power=5)
    assert [r[0][0] for r in received] == [1.0, 7.0] and [r[1]["power"] for r in received] == [2, 5]


def test_a_wrong_call_shape_is_a_type_error_every_time():
    for _ in range(2):
        with pytest.raises(TypeError):
            probe(X)
        with pytest.raises(TypeError):
            probe(X, 1.0, colour="red")


def test_the_dispatcher_schema_declares_no_defaults_and_gets_every_argument():
    # torch up to 2.12 drops trailing arguments equal to their schema defaults when a custom op
    # redispatches, then looks up each mutated argument by its position and fails (IndexError) on
    # one left at its default: ssd_sgd_step's and fosi_step's optional buffers on meta tensors, in
    # opcheck and under torch.compile. With no defaults in the schema nothing can be dropped.
    from tritonopt import ops

    for name in ops.__all__:
        op = getattr(ops, name)
        if getattr(op, "custom_op", None) is None:
            continue
        schema = op.custom_op._opoverload._schema
        assert all(not argument.has_default_value() for argument in schema.arguments), (name, str(schema))
    full = ops.ssd_sgd_step.dispatcher_arguments(
        X, X, X, lr=0.1, momentum=0.9, weight_decay=0.0, local_lr=0.1, local_weight_decay=0.0,
        glu_alpha=1.0, glu_beta=0.0, sync_coef=1.0)
    assert len(full) == len(ops.ssd_sgd_step.custom_op._opoverload._schema.arguments)
    assert full[-5:-2] == (None, None, None) and full[-2:] == (False, 1.0)


def test_a_prepared_op_completes_calls_as_the_op_does_and_skips_its_contract():
    checked = []

    @define_op("registry_prepared_probe", composite=True)
    def prepared_probe(x: torch.Tensor, scale: float, *, power: int = 1) -> torch.Tensor:
        """A probe op whose contract records that it ran."""
        checked.append(True)

    prepared_probe.register_backends(reference=record)
    call = prepared_probe.prepared(X.device)
    received.clear()
    call(X, 2, power=3)
    call(X, scale=1)
    assert received == [((2.0,), {"power": 3}), ((1.0,), {"power": 1})]
    assert all(type(r[0][0]) is float for r in received)
    assert checked == []  # the caller made its arguments: no contract per call
    prepared_probe(X, 2)
    assert checked == [True]


def test_a_prepared_op_is_the_op_itself_where_calls_must_reach_the_dispatcher():
    from tritonopt import ops

    assert ops.eigenbasis_precondition_prediv.prepared(torch.device("meta")) is ops.eigenbasis_precondition_prediv

    seen = []

    def traced(grad, qa, qg, inv):
        seen.append(ops.eigenbasis_precondition_prediv.prepared(grad.device))
        return ops.eigenbasis_precondition_prediv(grad, qa, qg, inv)

    args = (torch.randn(3, 4), torch.eye(4), torch.eye(3), torch.rand(3, 4))
    compiled = torch.compile(traced, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), traced(*args))
    assert seen[0] is ops.eigenbasis_precondition_prediv  # while tracing
    assert seen[1] is not ops.eigenbasis_precondition_prediv  # eagerly
    eager = seen[1](*args)
    assert torch.equal(eager, ops.eigenbasis_precondition_prediv(*args))
