"""The digits task shared by the demo and the paper experiments.

scikit-learn ships the data (1,797 8x8 images; nothing is downloaded). A fixed
permutation gives 1,437 training and 360 test images, standardised with the
training statistics. The model is a 64-256-256-10 ReLU MLP (85,002 parameters).

An optimizer enters a comparison as a *builder*: ``build(model, steps_per_epoch)
-> TrainStep``, where a ``TrainStep`` is called as ``step(x, y, loss_fn) ->
float`` (forward, backward and update; returns the batch loss) and has
``state_bytes() -> int``. :class:`OptimizerStep` adapts any ``torch.optim``
optimizer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

try:
    import tritonopt  # noqa: F401
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tritonopt.optim import optimizer_state_bytes  # noqa: E402

TRAIN_SIZE = 1437


class TrainStep(Protocol):
    def __call__(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> float: ...

    def state_bytes(self) -> int: ...


class OptimizerStep:
    """A ``TrainStep`` for any ``torch.optim.Optimizer`` over ``model``'s parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def __call__(self, x, y, loss_fn) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)


@dataclass
class Digits:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits_split(train_size: int = TRAIN_SIZE) -> Digits:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    x_train, x_test = x[:train_size], x[train_size:]
    mean, std = x_train.mean(0), x_train.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))  # constant border pixels
    return Digits((x_train - mean) / std, y[:train_size], (x_test - mean) / std, y[train_size:])


def make_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
