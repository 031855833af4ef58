"""SSDSGD rejects bad arguments with a named error before touching the process group or the parameters;
its agreement check sees every bit of its digest."""

import datetime
import random

import pytest
import torch
from torch import nn

from tritonopt.dist import SSDSGD
from tritonopt.dist import ssd_sgd_check


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
        (dict(timeout=0), ValueError, "timeout must be > 0"),
        (dict(timeout="60"), TypeError, "timeout must be a float"),
        (dict(timeout=datetime.timedelta(seconds=-1)), ValueError, "timeout must be positive"),
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


@pytest.mark.parametrize("world_size, dtype", [(2, torch.float32), (3, torch.float32), (256, torch.float32),
                                               (2047, torch.float32), (5, torch.float64)])
def test_the_agreement_check_sees_every_bit_of_the_digest(world_size, dtype):
    """Summed over the ranks in the state dtype, the check tells equal 64-bit digests from any one bit flipped."""
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    bits = ssd_sgd_check.check_digit_bits(world_size, dtype)

    def values(digest):
        out = torch.empty(SSDSGD.CHECK_ELEMENTS, dtype=state_dtype)
        ssd_sgd_check.write_check(out, digest, bits)
        return out

    def agrees(summed):
        return ssd_sgd_check.check_agrees(summed, bits, world_size)

    rng = random.Random(world_size)
    for _ in range(3):
        digest = rng.getrandbits(ssd_sgd_check.DIGEST_BITS)
        same = values(digest)
        # (K - 1) copies of one rank's values plus another rank's: integers below 2^24, so exact.
        assert agrees(same * world_size)
        for bit in range(ssd_sgd_check.DIGEST_BITS):
            differing = same * (world_size - 1) + values(digest ^ (1 << bit))
            assert not agrees(differing), bit
    # One rank above the others and one below: the digits' sums alone would agree.
    assert not agrees(values(5) + values(3) + values(4) * (world_size - 2))
