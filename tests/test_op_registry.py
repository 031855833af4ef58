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
