"""The SSD-SGD experiment's task and its runs: one (method, learning rate, seed) on one rank.

Every method trains the same MLP on the same shards for the same iterations, after
the same ``warmup_steps`` iterations of synchronous momentum SGD (the averaged
gradient), and is timed on the same window: the iterations after that warm-up
(the delay stage), which is where the methods differ. The link model
(:mod:`perf._ssd_sgd_link`) is charged only inside that window, and only in the
timing runs: the numbers a run computes do not depend on it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from perf._ssd_sgd_link import Link, linked_hook
from tritonopt.dist import SSDSGD, EFTopKState, ef_topk_hook

POWERSGD_RANK = 4
TOPK_DENSITY, TOPK_BLOCK = 0.01, 16384


@dataclass(frozen=True)
class Method:
    """One training method: ``kind`` picks the loop, ``options`` its extra settings."""

    name: str
    kind: str  # "ssgd" | "ssd" | "post_local" | "powersgd" | "topk"
    k: int = 1  # SSD-SGD's delay steps, post-local SGD's averaging period
    options: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- data and model


def make_data(setup):
    """The teacher-student task: deterministic, identical on every rank."""
    gen = torch.Generator().manual_seed(setup.data_seed)
    x = torch.randn(setup.samples, setup.features, generator=gen)
    w1 = torch.randn(setup.features, setup.teacher_hidden, generator=gen) / math.sqrt(setup.features)
    w2 = torch.randn(setup.teacher_hidden, setup.classes, generator=gen) / math.sqrt(setup.teacher_hidden)
    noise = torch.randn(setup.samples, setup.classes, generator=gen)
    y = (3 * torch.tanh(x @ w1) @ w2 + 0.3 * noise).argmax(dim=1)
    return x[: setup.train], y[: setup.train], x[setup.train :], y[setup.train :]


def make_mlp(setup, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(setup.features, setup.hidden), nn.ReLU(),
                         nn.Linear(setup.hidden, setup.hidden), nn.ReLU(),
                         nn.Linear(setup.hidden, setup.classes))


class ShardBatches:
    """Batches of one rank's shard: a fresh permutation each epoch, seeded by (seed, rank, epoch)."""

    def __init__(self, x, y, rank: int, world: int, batch: int, seed: int):
        shard = x.shape[0] // world
        self.x, self.y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        self.batch, self.seed, self.rank = batch, seed, rank
        self.per_epoch = shard // batch
        self._epoch, self._order = -1, None

    def __call__(self, step: int):
        epoch, position = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(1_000_003 * self.seed + 1_009 * self.rank + epoch)
            self._order, self._epoch = torch.randperm(self.x.shape[0], generator=gen), epoch
        index = self._order[position * self.batch : (position + 1) * self.batch]
        return self.x[index], self.y[index]


def accuracy(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean()) * 100


# --------------------------------------------------------------------------- one run on one rank


class _Window:
    """The timed delay stage: a barrier, then the link charged (timing runs), wall-clock and counters."""

    def __init__(self, link: Link, timed: bool):
        self.link, self.timed = link, timed
        self.began = self.seconds = 0.0
        self.before = self.after = None

    def open(self) -> None:
        dist.barrier()
        self.before = self.link.counters()
        self.link.enabled = self.timed
        self.began = time.perf_counter()

    def close(self) -> None:
        self.seconds = time.perf_counter() - self.began
        self.link.enabled = False
        self.after = self.link.counters()

    def result(self) -> dict:
        delta = {key: self.after[key] - self.before[key] for key in self.before}
        return dict(window_seconds=self.seconds, window_bytes=delta["bytes_sent"], window_calls=delta["calls"],
                    modeled_seconds=delta["modeled_seconds"], blocked_seconds=delta["blocked_seconds"],
                    run_bytes=self.after["bytes_sent"])


def _build(method: Method, setup, lr: float, seed: int, link: Link, world: int):
    """The model and a ``step`` callable (gradients in, update applied) for ``method``; plus what to finish with."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    model = make_mlp(setup, seed)
    if method.kind in ("ssgd", "ssd"):
        warmup = setup.steps if method.kind == "ssgd" else setup.warmup_steps
        opt = SSDSGD(model.parameters(), lr=lr, momentum=setup.momentum, weight_decay=setup.weight_decay,
                     delay_steps=method.k, warmup_steps=warmup, **method.options)
        return model, model, opt, opt.finalize, opt
    if method.kind == "post_local":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        params = list(model.parameters())
        with torch.no_grad():  # start from rank 0's weights, as DDP and SSDSGD do
            flat = torch.cat([p.reshape(-1) for p in params])
            dist.broadcast(flat, 0)
            torch.nn.utils.vector_to_parameters(flat, params)
        local = torch.optim.SGD(params, lr=lr, momentum=setup.momentum, weight_decay=setup.weight_decay)
        averager = PeriodicModelAverager(period=method.k, warmup_steps=setup.warmup_steps)
        return model, model, PostLocalSGDOptimizer(optim=local, averager=averager), None, None
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if method.kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=setup.warmup_steps, random_seed=seed)
        ddp.register_comm_hook(state, linked_hook(link, powerSGD_hook.powerSGD_hook))
    elif method.kind == "topk":
        state = EFTopKState(density=TOPK_DENSITY, block_size=TOPK_BLOCK, warmup_iters=setup.warmup_steps)
        ddp.register_comm_hook(state, linked_hook(link, ef_topk_hook))
    else:
        raise ValueError(f"unknown method kind {method.kind!r}")
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=setup.momentum, weight_decay=setup.weight_decay)
    return model, ddp, opt, None, None


def train_run(rank: int, world: int, setup, method: Method, lr: float, seed: int, data, link: Link,
              timed: bool, keep_losses: bool = False) -> dict:
    """One run on this rank: train, time the delay stage, test the global model and this rank's own."""
    x_train, y_train, x_test, y_test = data
    model, forward, opt, finish, ssd = _build(method, setup, lr, seed, link, world)
    batches = ShardBatches(x_train, y_train, rank, world, setup.batch, seed)
    window = _Window(link, timed)
    link.reset()  # the training's collectives only (not the set-up's checks and broadcasts)
    losses = []
    for t in range(setup.steps):
        if t == setup.warmup_steps:
            window.open()
        x, y = batches(t)
        opt.zero_grad()
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        if method.kind == "post_local" and t < setup.warmup_steps:  # synchronous SGD, as DDP would average
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(grads)
            torch.nn.utils.vector_to_parameters(grads / world, [p.grad for p in model.parameters()])
        opt.step()
        losses.append(loss.item())
    if finish is not None:
        finish()
    window.close()
    local_acc = accuracy(model, x_test, y_test)
    with torch.no_grad():  # the global model (outside the window and the counters)
        if ssd is not None:
            for p, g in zip(model.parameters(), ssd.global_parameters()):
                p.copy_(g)
        elif method.kind == "post_local":
            params = list(model.parameters())
            flat = torch.cat([p.reshape(-1) for p in params])
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat / world, params)
    result = dict(global_acc=accuracy(model, x_test, y_test), local_acc=local_acc,
                  final_loss=statistics.fmean(losses[-100:]), **window.result())
    if keep_losses:
        result["losses"] = losses
    return result
