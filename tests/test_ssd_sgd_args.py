"""SSDSGD rejects bad arguments with a named error before touching the process group or the parameters."""

import pytest
import torch
from torch import nn

from tritonopt.dist import SSDSGD


def params():
    torch.manual_seed(0)
    return list(nn.Linear(3, 2).parameters())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(delay_steps=0), ValueError, "delay_steps must be an int >= 1"),
        (dict(delay_steps=2.0), TypeError, "delay_steps must be an int"),
        (dict(warmup_steps=-1), ValueError, "warmup_steps must be an int >= 0"),
        (dict(lr=float("nan")), ValueError, "lr must be a finite number"),
        (dict(lr=-0.1), ValueError, "lr must be >= 0"),
        (dict(lr=torch.tensor(0.1)), TypeError, "tensor lr is not supported"),
        (dict(momentum=1.0), ValueError, "momentum must be < 1"),
        (dict(momentum=float("inf")), ValueError, "momentum must be a finite number"),
        (dict(weight_decay=-1e-4), ValueError, "weight_decay must be >= 0"),
        (dict(glu_alpha=float("nan")), ValueError, "glu_alpha must be a finite number"),
        (dict(glu_beta=float("-inf")), ValueError, "glu_beta must be a finite number"),
        (dict(local_lr_mult=-4.0), ValueError, "local_lr_mult must be >= 0"),
        (dict(local_weight_decay=float("nan")), ValueError, "local_weight_decay must be a finite number"),
        (dict(comm="accumulate"), ValueError, "comm must be one of"),
        (dict(on_nonfinite="ignore"), ValueError, "on_nonfinite must be one of"),
        (dict(communicator=object()), TypeError, "communicator must be"),
    ],
)
def test_bad_hyperparameters_are_named(kwargs, error, match):
    ps = params()
    before = [p.detach().clone() for p in ps]
    args = dict(lr=0.1)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        SSDSGD(ps, **args)
    assert all(torch.equal(a, b) for a, b in zip(before, ps))


def test_bad_groups_and_parameters_are_named():
    ps = params()
    with pytest.raises(ValueError, match="'delay_steps' is not a per-group setting"):
        SSDSGD([dict(params=ps, delay_steps=3)], lr=0.1)
    with pytest.raises(ValueError, match="momentum must be < 1"):
        SSDSGD([dict(params=ps[:1]), dict(params=ps[1:], momentum=1.5)], lr=0.1)
    with pytest.raises(ValueError, match="one dtype"):
        SSDSGD([ps[0], nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=0.1)
    with pytest.raises(ValueError, match="does not support complex parameters"):
        SSDSGD([nn.Parameter(torch.zeros(2, dtype=torch.complex64))], lr=0.1)
    with pytest.raises(TypeError, match="iterable of tensors"):
        SSDSGD(ps, lr=0.1, sync_buffers=torch.zeros(3))
    with pytest.raises(ValueError, match="use comm='shadow'"):
        SSDSGD(ps, lr=0.1, comm="per_step", sync_buffers=[torch.zeros(3)])


def test_a_process_group_is_required():
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        SSDSGD(params(), lr=0.1)
