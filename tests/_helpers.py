"""Helpers shared by the test modules: parameters, gradient streams, backends, comparisons."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_runs_here

needs_triton = pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]
SHAPES = [(5, 7), (3,), (2, 3, 4)]  # 62 elements: a matrix, a vector and a 3-D tensor


def make_params(shapes=SHAPES, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def gradient_stream(shapes=SHAPES, steps: int = 1, seed: int = 1, dtype: torch.dtype = torch.float32):
    """``steps`` lists of gradients shaped like ``shapes``, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]


def set_grads(params, grads) -> None:
    """``p.grad`` becomes a copy of each gradient (``None`` leaves the parameter without one)."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone().to(p.dtype)


def run_steps(params, opt, stream) -> None:
    for grads in stream:
        set_grads(params, grads)
        opt.step()


def regression_losses(model: torch.nn.Module, opt, x: torch.Tensor, y: torch.Tensor, steps: int = 60) -> list[float]:
    """Each step's mean-squared-error loss while ``opt`` fits ``model(x)`` to ``y``."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def flat(tensors) -> torch.Tensor:
    """The tensors' values end to end in one new 1-D tensor (detached from autograd)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def state_tensors(state_dict: dict, ignore: tuple = ()) -> list:
    """Every value of an optimizer's state dict, in a fixed order, tensors cloned (for bitwise comparisons).

    Entries whose key is in ``ignore`` (at any depth) are left out.
    """
    values = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            values.append(value.detach().clone())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                if key in ignore:
                    continue
                values.append(("key", str(key)))
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        else:
            values.append(value)

    walk(state_dict)
    return values


def assert_bitwise_equal(first: list, second: list) -> None:
    """Two :func:`state_tensors`-style lists hold the same values, tensors equal bit for bit and in dtype."""
    assert len(first) == len(second)
    for a, b in zip(first, second):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                         and torch.equal(a.nan_to_num(), b.nan_to_num()))
        else:
            assert a == b
