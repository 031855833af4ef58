"""The table of distributed layers the contract tests run through (``tests/test_dist_contract.py``).

Each entry says how to build the layer on a rank of a 2-rank gloo world (a
*run*: the layer, its model and a deterministic stream of data), with given
overrides of its arguments, a ``timeout`` and an optional ``stall``: a function
the run calls on the rank that is to stop participating, at a point in the
middle of a step (inside one of its collectives). A run steps (``step(i)``:
one training step, or one epoch, or one pipeline pass), saves and loads its
state (``save()`` / ``load(saved)``: the state dicts of the layer, the model
and any outer optimizer) and reports its weights, and which of them the
layer keeps identical on every rank (``replicated``). The entry also names a
setting a differently configured rank may hold (``differing``), an argument
a rank may refuse (``bad_argument``) and how to spoil a saved state so that
the layer refuses it (``spoiled_state``), each with the word its error must name.
A new distributed layer joins every contract test by adding an entry here.
"""

from __future__ import annotations

import datetime
import io
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from tritonopt.dist import EFTopKState, LowRankState, ef_topk_hook, lowrank_ef_hook
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

    def replicated(self) -> list[torch.Tensor]:
        """What the layer's contract keeps identical, bit for bit, on every rank: by default the weights."""
        return self.weights()


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
            self.epoch_start = self.weights()
        if mr.is_worker:
            x, y = _batch(self.rank, i)
            for p in self.model.parameters():
                p.grad = None
            nn.functional.cross_entropy(self.model(x), y).backward()
            mr.step()
        if i % 2 == 1:
            mr.end_epoch()

    def replicated(self) -> list[torch.Tensor]:
        # Accelerators do not train: every rank holds the weights the epoch began with.
        return self.epoch_start

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

    def replicated(self) -> list[torch.Tensor]:
        return []  # each rank holds its own block

    # The stage holds nothing of its own between passes (flush="epoch" drains the pipeline):
    # its state is the block's and the optimizer's.
    def save(self) -> dict:
        return _round_trip({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load(self, saved: dict) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])


# --------------------------------------------------------------------------- SSD-SGD


class SSDSGDRun(Run):
    """SSD-SGD on each rank's own batches (no DDP): one warm-up step, then the delay stage with a pull every 2
    steps. Step 2 ends with a pull in flight; a save after it flushes that pull, and step 3 consumes it."""

    COMM = "shadow"
    STALL_LABEL = "shadow_sync_allreduce"

    def __init__(self, rank: int, world: int, *, timeout, stall: Stall = None, **overrides):
        from tritonopt.dist import SSDSGD

        self.rank = rank
        self.model = _mlp()
        comm = StallingCommunicator(self.STALL_LABEL, 1, stall)
        kwargs = dict(lr=0.05, momentum=0.9, delay_steps=2, warmup_steps=1, comm=self.COMM, communicator=comm,
                      timeout=timeout)
        self.optimizer = SSDSGD(self.model.parameters(), **{**kwargs, **overrides})

    def step(self, i: int) -> None:
        x, y = _batch(self.rank, i)
        self.optimizer.zero_grad()
        nn.functional.cross_entropy(self.model(x), y).backward()
        self.optimizer.step()

    def replicated(self) -> list[torch.Tensor]:
        # Each rank trains its own local weights; the global (server) weights are the same on every rank.
        self.optimizer.finalize()
        return self.optimizer.global_parameters()

    def save(self) -> dict:
        return _round_trip({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load(self, saved: dict) -> None:
        self.optimizer.load_state_dict(saved["optimizer"])  # the layer first: if it refuses, nothing changed
        self.model.load_state_dict(saved["model"])


class SSDSGDPerStepRun(SSDSGDRun):
    """The same with ``comm="per_step"``: every delay step's gradient is all-reduced into a server replica."""

    COMM = "per_step"
    STALL_LABEL = "per_step_grad_allreduce"


# --------------------------------------------------------------------------- compressed DDP comm hooks


class HookRun(Run):
    """The MLP in DDP (each rank its own batches) with a compressed comm hook, SGD outside. The first
    iteration is averaged uncompressed (the warm-up); DDP rebuilds its buckets after it. The stalled rank
    stops after step 1's forward, so the other waits in the hook's compressed collective."""

    STATE: type
    HOOK: Callable
    SETTINGS: dict

    def __init__(self, rank: int, world: int, *, timeout, stall: Stall = None, **overrides):
        self.rank, self.stall = rank, stall
        self.model = _mlp()
        self.ddp = nn.parallel.DistributedDataParallel(self.model)
        self.state = self.STATE(**{**self.SETTINGS, "warmup_iters": 1, "timeout": timeout, **overrides})
        self.ddp.register_comm_hook(self.state, self.HOOK)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def step(self, i: int) -> None:
        x, y = _batch(self.rank, i)
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.ddp(x), y)
        if self.stall is not None and i == 1:
            self.stall()
        loss.backward()
        self.optimizer.step()

    def save(self) -> dict:
        return _round_trip({"model": self.model.state_dict(), "hook": self.state.state_dict(),
                            "optimizer": self.optimizer.state_dict()})

    def load(self, saved: dict) -> None:
        self.state.load_state_dict(saved["hook"])  # the layer first: if it refuses, nothing changed
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])


class EFTopKRun(HookRun):
    """Top-k with error feedback: blocks of 32, a quarter of each sent."""

    STATE, HOOK, SETTINGS = EFTopKState, staticmethod(ef_topk_hook), dict(density=0.25, block_size=32)


class LowRankRun(HookRun):
    """Rank-2 compression of both weight matrices (8 x 6 and 3 x 8: compressed at a rate of 1), biases plain."""

    STATE, HOOK, SETTINGS = LowRankState, staticmethod(lowrank_ef_hook), dict(rank=2, min_compression_rate=1.0)


# --------------------------------------------------------------------------- distributed Lanczos


class LanczosRun(Run):
    """``distributed_lanczos`` on the Hessian of the MLP's loss on one batch, the same on both ranks; a step
    is one call (8 iterations, seeded by the step). It holds no state between calls, and creates no group:
    it runs on a group of its own, created with the timeout, which bounds its waits."""

    def __init__(self, rank: int, world: int, *, timeout, stall: Stall = None, **overrides):
        self.model = _mlp()
        self.params = list(self.model.parameters())
        self.n = sum(p.numel() for p in self.params)
        self.curvature_batch = _batch(-1, rows=32)
        # A group of its own: a stalled run leaves collectives posted on it, which no later run may meet.
        self.group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout))
        self.comm = StallingCommunicator("lanczos_coef", 1, stall, self.group)
        self.overrides = overrides
        self.result = None

    def hvp(self, v: torch.Tensor) -> torch.Tensor:
        x, y = self.curvature_batch
        grads = torch.autograd.grad(nn.functional.cross_entropy(self.model(x), y), self.params, create_graph=True)
        flat = torch.cat([g.reshape(-1) for g in grads])
        products = torch.autograd.grad(flat @ v.to(flat.dtype), self.params)
        return torch.cat([h.reshape(-1) for h in products]).to(v.dtype)

    def step(self, i: int) -> None:
        from tritonopt.dist import distributed_lanczos

        arguments = {"num_iters": 8, "seed": i, **self.overrides}
        self.result = distributed_lanczos(self.hvp, self.n, comm=self.comm, group=self.group, **arguments)

    def weights(self) -> list[torch.Tensor]:
        """What the last call computed: the tridiagonal matrix and this rank's rows of the basis."""
        return [] if self.result is None else [self.result.tridiag.clone(), self.result.basis.clone()]

    def replicated(self) -> list[torch.Tensor]:
        return [self.result.tridiag.clone()]  # the basis is sharded by rows, the tridiagonal matrix replicated


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class DistLayerInfo:
    """One distributed layer: how to build a run, and what the agreement and start-up cases change.

    ``differing``: overrides rank 1 builds with, and the setting's name every rank's error names;
    ``bad_argument``: overrides only rank 1 builds with, which it refuses, and the word its error names;
    ``spoiled_state``: a function spoiling what ``Run.save`` returned, and the word the refusal
    names; None for a layer that holds no state of its own (its model's and optimizer's are torch's);
    ``steps``: the length of the resumed run, saved after ``save_after`` steps;
    ``layer``: the name the layer's errors begin with (None: ``name``);
    ``checkpoints``: False for a layer that holds nothing between calls (no save, load or resume);
    ``failure_through_ddp``: the layer runs inside DDP's backward, which re-raises its
    ``CollectiveFailure`` as a ``RuntimeError`` carrying the failure's message.
    """

    name: str
    make_run: Callable[..., Run]
    differing: tuple[dict, str]
    bad_argument: tuple[dict, str]
    spoiled_state: Optional[tuple[Callable[[dict], None], str]]
    steps: int = 4
    save_after: int = 2
    layer: Optional[str] = None
    checkpoints: bool = True
    failure_through_ddp: bool = False

    @property
    def error_prefix(self) -> str:
        return self.layer or self.name


def _drop_a_kaisa_layer(saved: dict) -> None:
    saved["kaisa"]["layers"].pop(next(iter(saved["kaisa"]["layers"])))


def _drop_fosi_entry(saved: dict) -> None:
    saved["optimizer"].pop("fosi")
    saved["optimizer"]["param_groups"][0].pop("fosi")  # and its copy for torch.distributed.checkpoint


def _claim_another_rank(saved: dict) -> None:
    saved["layer"]["rank"] = 1 - saved["layer"]["rank"]


def _claim_another_ssd_rank(saved: dict) -> None:
    saved["optimizer"]["ssd_sgd"]["rank"] = 1 - saved["optimizer"]["ssd_sgd"]["rank"]


def _claim_another_hook_rank(saved: dict) -> None:
    saved["hook"]["process_rank"] = 1 - saved["hook"]["process_rank"]


LAYERS = [
    DistLayerInfo("KAISAPreconditioner", KAISARun, ({"damping": 0.01}, "damping"), ({"damping": -1.0}, "damping"),
                  (_drop_a_kaisa_layer, "layers")),
    DistLayerInfo("DHO2", DHO2Run, ({"lr": 2e-2}, "lr"), ({"lr": -1.0}, "lr"), (_drop_fosi_entry, "fosi")),
    DistLayerInfo("MRDHO2", MRDHO2Run, ({"accumulated_gradient": "mean"}, "accumulated_gradient"),
                  ({"lr": -1.0}, "lr"), (_claim_another_rank, "saved on rank"), steps=6, save_after=3),
    DistLayerInfo("DSPStage", DSPRun, ({"flush": "never"}, "flush"), ({"bn_policy": "sideways"}, "bn_policy"),
                  None),
    # Saved after step 2, whose pull is in flight: the save flushes it and the resumed step 3 consumes it.
    DistLayerInfo("SSDSGD", SSDSGDRun, ({"delay_steps": 3}, "delay_steps"), ({"lr": -1.0}, "lr"),
                  (_claim_another_ssd_rank, "rank=0"), save_after=3),
    DistLayerInfo("SSDSGD(comm=per_step)", SSDSGDPerStepRun, ({"glu_beta": 0.25}, "glu_beta"),
                  ({"delay_steps": 0}, "delay_steps"), (_claim_another_ssd_rank, "rank=0"), save_after=3,
                  layer="SSDSGD"),
    DistLayerInfo("EFTopKState", EFTopKRun, ({"density": 0.5}, "density"), ({"block_size": 0}, "block_size"),
                  (_claim_another_hook_rank, "process_rank"), failure_through_ddp=True),
    DistLayerInfo("LowRankState", LowRankRun, ({"min_compression_rate": 0.5}, "min_compression_rate"),
                  ({"seed": -1}, "seed"), (_claim_another_hook_rank, "process_rank"), failure_through_ddp=True),
    DistLayerInfo("distributed_lanczos", LanczosRun, ({"passes": 1}, "passes"), ({"num_iters": 0}, "num_iters"),
                  None, steps=2, checkpoints=False),
]
