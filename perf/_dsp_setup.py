"""What the DSP experiment's two parts share: sizes, data, model, the stage cut, the batch order, statistics.

The data: 10 classes of synthetic 3x32x32 images, a fixed random 8x8 prototype
per class upsampled to 32x32 plus Gaussian noise (sigma 5), standardised with
the training set's statistics; seeded, nothing downloaded. The data set is the
same for every seed; a seed sets the model's initial weights and the batch
order (seed 0: the order and weights this experiment always used).

The model: conv 3->C (stride 2) + ReLU, ``units`` residual units
``x + relu(conv3x3(x))`` at C channels and 16x16, 4x4 average pool, linear;
Kaiming-normal x0.5 init, the classifier at zero (initial loss ln 10).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn

from tritonopt.dist import split_stages

# Mode names, as the tables and CSV files spell them.
BP, BPK, DDP = "BP (1 process)", "BP-K", "DDP"
# The paper's queues put at least 2 batches of staleness on each stage boundary, so with two
# stages its configurations have m >= 2; m = 1 is this library's own, reported beside them.
PAPER_MIN_STALENESS = 2
# Each seed's batch order: far apart from another seed's (an epoch index never reaches it).
ORDER_SEED_STRIDE = 1_000_000


def dsp_name(m: int) -> str:
    return f"DSP m={m}"


def staleness_origin(m: int) -> str:
    return "the paper's" if m >= PAPER_MIN_STALENESS else "this library's own, not the paper's"


def gpipe_name(microbatches: int) -> str:
    return f"GPipe {microbatches} mb"


def one_f_one_b_name(microbatches: int) -> str:
    return f"1F1B {microbatches} mb"


@dataclass
class Sizes:
    """Data and model sizes, the cut and the optimizer's momentum: the same in both parts."""

    train_size: int = 4096
    test_size: int = 1024
    batch: int = 64
    channels: int = 32
    units: int = 6
    split: int = 2  # residual units on rank 0 (after the stem) for BP-K and DSP (rank 0 also recomputes)
    pipeline_split: int = 3  # ... for GPipe and 1F1B, whose ranks both run forward + backward
    momentum: float = 0.9

    @property
    def steps_per_epoch(self) -> int:
        return self.train_size // self.batch


_DATA_CACHE: dict = {}


def make_data(sizes: Sizes):
    """Class prototypes (8x8, upsampled) plus noise; the same tensors in every process and for every seed."""
    key = (sizes.train_size, sizes.test_size)
    if key not in _DATA_CACHE:
        gen = torch.Generator().manual_seed(0)
        prototypes = nn.functional.interpolate(torch.randn(10, 3, 8, 8, generator=gen), size=32, mode="bilinear",
                                               align_corners=False)

        def draw(n):
            labels = torch.randint(0, 10, (n,), generator=gen)
            return prototypes[labels] + 5.0 * torch.randn(n, 3, 32, 32, generator=gen), labels

        x_train, y_train = draw(sizes.train_size)
        x_test, y_test = draw(sizes.test_size)
        scale = x_train.std()  # standardised with the training set's statistics
        _DATA_CACHE[key] = (x_train / scale, y_train, x_test / scale, y_test)
    return _DATA_CACHE[key]


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


def make_model(sizes: Sizes, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    c = sizes.channels
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, stride=2, padding=1), nn.ReLU(),
        *[Residual(c) for _ in range(sizes.units)],
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(c * 16, 10),
    )
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)
                module.weight.mul_(0.5)
                nn.init.zeros_(module.bias)
        model[-1].weight.zero_()  # the classifier starts at zero: initial loss ln 10
    return model


def stages_of(model: nn.Sequential, sizes: Sizes, pipeline: bool = False) -> list[nn.Module]:
    """The two stages: cut after ``split`` units (BP-K, DSP) or ``pipeline_split`` (GPipe, 1F1B)."""
    units = sizes.pipeline_split if pipeline else sizes.split
    return split_stages(model, boundaries=[2 + units])


def epoch_batches(x, y, sizes: Sizes, epoch: int, seed: int = 0, steps: int | None = None):
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1000 + epoch + ORDER_SEED_STRIDE * seed))
    count = len(y) // sizes.batch if steps is None else steps
    b = sizes.batch
    return [(x[order[i * b:(i + 1) * b]], y[order[i * b:(i + 1) * b]]) for i in range(count)]


def test_accuracy(model: nn.Module, sizes: Sizes) -> float:
    _, _, x_test, y_test = make_data(sizes)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        predictions = torch.cat([model(x).argmax(1) for x in x_test.split(256)])
    model.train(was_training)
    return (predictions == y_test).float().mean().item()


test_accuracy.__test__ = False  # not a pytest test, though its name starts with "test"



def spread(values) -> tuple[float, float, float]:
    """Median, minimum and maximum."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("spread needs at least one value")
    return statistics.median(values), min(values), max(values)
