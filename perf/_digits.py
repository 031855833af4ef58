"""The digits task shared by the demo and the paper experiments: data, model and training loop.

scikit-learn ships the data (1,797 8x8 images; nothing is downloaded). A fixed
permutation gives 1,437 training and 360 test images, standardised with the
training statistics. The model is a 64-256-256-10 ReLU MLP (85,002 parameters).
:func:`train` runs shuffled epochs of a ``TrainStep`` (see ``perf/_optimizers.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

TRAIN_SIZE = 1437
BATCH_SIZE = 32


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


def steps_per_epoch(data: Digits, batch_size: int = BATCH_SIZE) -> int:
    return -(-len(data.y_train) // batch_size)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Digits) -> tuple[float, float]:
    """(cross-entropy over the whole training set, test accuracy as a fraction)."""
    loss = torch.nn.functional.cross_entropy(model(data.x_train), data.y_train)
    accuracy = (model(data.x_test).argmax(1) == data.y_test).float().mean()
    return float(loss), float(accuracy)


@dataclass
class TrainRun:
    """What :func:`train` records; per-epoch lists have one entry per epoch run."""

    initial_train_loss: float = float("nan")  # whole training set, before the first step
    batch_losses: list[list[float]] = field(default_factory=list)  # every step's batch loss
    train_losses: list[float] = field(default_factory=list)  # whole training set, after each epoch
    test_accuracies: list[float] = field(default_factory=list)  # fraction, after each epoch
    train_seconds: list[float] = field(default_factory=list)  # time in the steps, at each epoch's end
    wall_seconds: float = 0.0  # the whole run, evaluations included
    steps: int = 0

    @property
    def mean_batch_losses(self) -> list[float]:
        return [float(np.mean(losses)) for losses in self.batch_losses]

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.train_seconds[-1] / max(1, self.steps)


def train(
    model: torch.nn.Module,
    step: Callable[[torch.Tensor, torch.Tensor, Callable], Optional[float]],
    data: Digits,
    *,
    seed: int,
    epochs: int,
    batch_size: int = BATCH_SIZE,
    max_steps: Optional[int] = None,
    on_step: Callable[[], None] = lambda: None,
    on_epoch: Callable[[int, TrainRun], None] = lambda epoch, run: None,
) -> TrainRun:
    """Shuffled epochs of ``step(x, y, loss_fn)`` over the training set; evaluate after each epoch.

    Batch order: a generator seeded with ``1000 + seed`` draws one permutation per epoch,
    cut into batches of ``batch_size`` (the last one shorter). ``max_steps`` stops early (the
    epoch in progress is evaluated). The evaluations run without autograd, so they leave the
    optimizers' state (K-FAC's statistics included) untouched. ``on_epoch(epoch, run)`` is
    called after each evaluation, epochs counted from 1.
    """
    loss_fn = torch.nn.functional.cross_entropy
    shuffle = torch.Generator().manual_seed(1000 + seed)
    run = TrainRun(initial_train_loss=evaluate(model, data)[0])
    seconds = 0.0
    began = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(data.y_train), generator=shuffle)
        losses = []
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            started = time.perf_counter()
            losses.append(step(data.x_train[batch], data.y_train[batch], loss_fn))
            seconds += time.perf_counter() - started
            run.steps += 1
            on_step()
            if max_steps is not None and run.steps >= max_steps:
                break
        run.batch_losses.append(losses)
        run.train_seconds.append(seconds)
        loss, accuracy = evaluate(model, data)
        run.train_losses.append(loss)
        run.test_accuracies.append(accuracy)
        on_epoch(epoch, run)
        if max_steps is not None and run.steps >= max_steps:
            break
    run.wall_seconds = time.perf_counter() - began
    return run
