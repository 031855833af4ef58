"""The table of distributed layers the contract tests run through (``tests/test_dist_contract.py``).

Each entry says how to build the layer on a rank of a 2-rank gloo world (a
*run*: the layer, its model and a deterministic stream of data), with given
overrides of its arguments, a ``timeout`` and an optional ``stall``: a function
the run calls on the rank that is to stop participating, at a point in the
middle of a step (inside one of its collectives). A run steps (``step(i)``:
one training step, or one epoch, or one pipeline pass), saves and loads its
state (``save()`` / ``load(saved)``: the state dicts of the layer, the model
and any outer optimizer) and reports its weights. The entry also names a
setting a differently configured rank may hold (``differing``), an argument
a rank may refuse (``bad_argument``) and how to spoil a saved state so that
the layer refuses it (``spoiled_state``), each with the word its error must name.
A new distributed layer joins every contract test by adding an entry here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from tritonopt.dist._comm import CountingCommunicator

Stall = Optional[Callable[[], None]]


class StallingCommunicator(CountingCommunicator):
    """Counts and issues every collective, but calls ``stall`` on the ``nth`` one labelled ``label``."""

    def __init__(self, label: str, nth: int, stall: Stall, group=None):
        super().__init__(group)
        self.stall_label, self.nth, self.stall, self.calls = label, nth, stall, 0

    def _maybe_stall(self, label: str) -> None:
        if self.stall is not None and label == self.stall_label:
            self.calls += 1
            if self.calls == self.nth:
                self.stall()

    def all_reduce(self, tensor, *, label, **kwargs):
        self._maybe_stall(label)
        return super().all_reduce(tensor, label=label, **kwargs)

    def broadcast(self, tensor, src, *, label, **kwargs):
        self._maybe_stall(label)
        return super().broadcast(tensor, src, label=label, **kwargs)

    def all_gather_into_tensor(self, output, input, *, label, **kwargs):
        self._maybe_stall(label)
        return super().all_gather_into_tensor(output, input, label=label, **kwargs)

    def all_to_all_single(self, output, input, *args, label, **kwargs):
        self._maybe_stall(label)
        return super().all_to_all_single(output, input, *args, label=label, **kwargs)


def _batch(*seed: int, rows: int = 16, features: int = 6, classes: int = 3):
    gen = torch.Generator().manual_seed(sum((s + 7) * 1009**k for k, s in enumerate(seed)))
    return torch.randn(rows, features, generator=gen), torch.randint(0, classes, (rows,), generator=gen)


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # every rank (and every rebuild) starts from the same weights
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _round_trip(state: dict) -> dict:
    """What ``torch.save`` then ``torch.load(weights_only=True)`` gives back: a checkpoint on disk."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class Run:
    """A layer built on this rank; subclasses set ``model`` and define ``step``, ``save`` and ``load``."""

    model: nn.Module

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


# --------------------------------------------------------------------------- KAISA


class KAISARun(Run):
    """K-FAC over both ranks (MEM-OPT: each layer's gradient worker broadcasts its gradient), SGD outside."""

    def __init__(self, rank: int, world: int, *, timeout, stall: Stall = None, **overrides):
        from tritonopt.dist import KAISAPreconditioner

        self.model = _mlp()
        comm = StallingCommunicator("factor_allreduce", 1, stall)
        kwargs = dict(grad_worker_fraction=0.5, factor_update_steps=1, inv_update_steps=2, damping=0.003, lr=0.1,
                      timeout=timeout, communicator=comm)
        self.kaisa = KAISAPreconditioner(self.model, **{**kwargs, **overrides})
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def step(self, i: int) -> None:
        x, y = _batch(i)  # the same on every rank: stands in for DDP's averaged gradients
        self.optimizer.zero_grad()
        nn.functional.cross_entropy(self.model(x), y).backward()
        if self.kaisa.step():
            self.optimizer.step()

    def save(self) -> dict:
        return _round_trip({"model": self.model.state_dict(), "kaisa": self.kaisa.state_dict(),
                            "optimizer": self.optimizer.state_dict()})

    def load(self, saved: dict) -> None:
        self.kaisa.load_state_dict(saved["kaisa"])  # the layer first: if it refuses, nothing changed
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])


# --------------------------------------------------------------------------- DHO2


class DHO2Run(Run):
    """Data-parallel FOSI: each rank its own batches, the same curvature batch; curvature every 2 steps."""

    def __init__(self, rank: int, world: int, *, timeout, stall: Stall = None, **overrides):
        from tritonopt.dist import DHO2

        self.rank = rank
        self.model = _mlp()
        curvature_x, curvature_y = _batch(-1, rows=32)
        loss = lambda: nn.functional.cross_entropy(self.model(curvature_x), curvature_y)  # noqa: E731
        comm = StallingCommunicator("update_all_reduce", 1, stall)
        kwargs = dict(lr=1e-2, k=2, num_lanczos_iters=8, warmup_steps=1, curvature_update_every=2,
                      curvature_loss_fn=loss, comm=comm, timeout=timeout)
        self.optimizer = DHO2(self.model.parameters(), **{**kwargs, **overrides})

    def step(self, i: int) -> None:
        x, y = _batch(self.rank, i)
        self.optimizer.zero_grad()
        nn.functional.cross_entropy(self.model(x), y).backward()
        self.optimizer.step()

    def save(self) -> dict:
        return _round_trip({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load(self, saved: dict) -> None:
        self.optimizer.load_state_dict(saved["optimizer"])  # the layer first: if it refuses, nothing changed
        self.model.load_state_dict(saved["model"])


# --------------------------------------------------------------------------- MR-DHO2


class MRDHO2Run(Run):
    """Rank 0 the accelerator, rank 1 the worker. Step ``2e``: epoch ``e`` begins and the worker takes
    one step; step ``2e + 1``: one more step and the epoch ends. A save after an even step is mid-epoch."""

    def __init__(self, rank: int, world: int, *, timeout, stall: Stall = None, **overrides):
        from tritonopt.dist import MRDHO2

        self.rank = rank
        self.model = _mlp()
        curvature_x, curvature_y = _batch(-1, rows=32)
        self.curvature_loss = lambda: nn.functional.cross_entropy(self.model(curvature_x), curvature_y)
        comm = StallingCommunicator("ritz_scatter", 1, stall)
        kwargs = dict(num_accelerators=1, lr=1e-2, k=2, num_lanczos_iters=8, comm=comm, timeout=timeout)
        self.layer = MRDHO2(self.model.parameters(), **{**kwargs, **overrides})

    def step(self, i: int) -> None:
        mr = self.layer
        if i % 2 == 0:
            mr.begin_epoch(None if mr.is_worker else self.curvature_loss)
        if mr.is_worker:
            x, y = _batch(self.rank, i)
            for p in self.model.parameters():
                p.grad = None
            nn.functional.cross_entropy(self.model(x), y).backward()
            mr.step()
        if i % 2 == 1:
            mr.end_epoch()

    def save(self) -> dict:
        return _round_trip({"model": self.model.state_dict(), "layer": self.layer.state_dict()})

    def load(self, saved: dict) -> None:
        self.layer.load_state_dict(saved["layer"])  # the layer first: if it refuses, nothing changed
        self.model.load_state_dict(saved["model"])


# --------------------------------------------------------------------------- DSP


class DSPRun(Run):
    """A two-stage pipeline on a group of its own (rank 0 staleness 1, rank 1 the loss); 3 batches a pass."""

    def __init__(self, rank: int, world: int, *, timeout, stall: Stall = None, **overrides):
        from tritonopt.dist import DSPStage

        full = _mlp()
        self.model = full[:2] if rank == 0 else full[2:]
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

        def hook(phase, batch, seconds):
            if stall is not None and phase == "forward_backward" and batch == 0:
                stall()

        # A group of its own: a stalled run leaves receives posted on it, which no later run may meet.
        group = dist.new_group([0, 1])
        kwargs = dict(staleness=1 if rank == 0 else 0, loss_fn=nn.functional.cross_entropy, group=group,
                      timeout=timeout, phase_hook=hook)
        self.stage = DSPStage(self.model, self.optimizer, **{**kwargs, **overrides})

    def step(self, i: int) -> None:
        self.stage.train([_batch(i, b) for b in range(3)])

    # The stage holds nothing of its own between passes (flush="epoch" drains the pipeline):
    # its state is the block's and the optimizer's.
    def save(self) -> dict:
        return _round_trip({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load(self, saved: dict) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class DistLayerInfo:
    """One distributed layer: how to build a run, and what the agreement and start-up cases change.

    ``differing``: overrides rank 1 builds with, and the setting's name every rank's error names;
    ``bad_argument``: overrides only rank 1 builds with, which it refuses, and the word its error names;
    ``spoiled_state``: a function spoiling what ``Run.save`` returned, and the word the refusal
    names; None for a layer that holds no state of its own (its model's and optimizer's are torch's);
    ``steps``: the length of the resumed run, saved after ``save_after`` steps.
    """

    name: str
    make_run: Callable[..., Run]
    differing: tuple[dict, str]
    bad_argument: tuple[dict, str]
    spoiled_state: Optional[tuple[Callable[[dict], None], str]]
    steps: int = 4
    save_after: int = 2


def _drop_a_kaisa_layer(saved: dict) -> None:
    saved["kaisa"]["layers"].pop(next(iter(saved["kaisa"]["layers"])))


def _drop_fosi_entry(saved: dict) -> None:
    saved["optimizer"].pop("fosi")


def _claim_another_rank(saved: dict) -> None:
    saved["layer"]["rank"] = 1 - saved["layer"]["rank"]


LAYERS = [
    DistLayerInfo("KAISAPreconditioner", KAISARun, ({"damping": 0.01}, "damping"), ({"damping": -1.0}, "damping"),
                  (_drop_a_kaisa_layer, "layers")),
    DistLayerInfo("DHO2", DHO2Run, ({"lr": 2e-2}, "lr"), ({"lr": -1.0}, "lr"), (_drop_fosi_entry, "fosi")),
    DistLayerInfo("MRDHO2", MRDHO2Run, ({"accumulated_gradient": "mean"}, "accumulated_gradient"),
                  ({"lr": -1.0}, "lr"), (_claim_another_rank, "saved on rank"), steps=6, save_after=3),
    DistLayerInfo("DSPStage", DSPRun, ({"flush": "never"}, "flush"), ({"bn_policy": "sideways"}, "bn_policy"),
                  None),
]
