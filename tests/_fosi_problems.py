"""Small models, losses and loops shared by the FOSI and DHO2 tests."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one intra-op thread is several times faster than two on a busy machine.

    Import it into a test module to use it there; the previous count is restored after the module.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class CrossEntropyOn:
    """A picklable curvature loss: cross-entropy of ``model`` on a fixed batch."""

    def __init__(self, model, x, y):
        self.model, self.x, self.y = model, x, y

    def __call__(self):
        return torch.nn.functional.cross_entropy(self.model(self.x), self.y)


def make_problem(seed=0, dtype=torch.float32, sizes=(6, 12, 3), batch=64):
    """An MLP (Linear, Tanh, Linear) and a :class:`CrossEntropyOn` loss on a fixed batch."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.Tanh(),
                                torch.nn.Linear(sizes[1], sizes[2])).to(dtype)
    x = torch.randn(batch, sizes[0], generator=gen, dtype=dtype)
    y = torch.randint(0, sizes[2], (batch,), generator=gen)
    return model, CrossEntropyOn(model, x, y)


def train(model, opt, loss_fn, steps, scheduler=None):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_grads(model, loss_fn):
    for p in model.parameters():
        p.grad = None
    loss_fn().backward()


class HostReads(TorchFunctionMode):
    """Counts every read of tensor data into Python (an upper bound of device synchronisations)."""

    READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))
