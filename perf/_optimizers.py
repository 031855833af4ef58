"""The optimizers the demo, the experiments and the step benchmark train with, as train steps.

An optimizer enters a comparison as a *builder*: ``build(model, steps_per_epoch) ->
TrainStep``. A ``TrainStep`` is called as ``step(x, y, loss_fn) -> float`` (forward,
backward and update; returns the batch loss) and has ``state_bytes() -> int``. The update
runs inside ``step.update_timer()`` (a no-op context by default), so that a benchmark can time
the optimizer's share of a training step.

The hyperparameters are those the digits experiments tuned (``perf/efcp_experiment.py``,
``perf/kfac_experiment.py``, ``perf/fosi_experiment.py``); the demo uses the same builders.
The SGD and M-FAC-family builders take a keyword-only ``lr`` (default: the one below), so that
an experiment can sweep it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Protocol

import torch

from tritonopt.optim import (
    FOSI,
    MFAC,
    KFACPreconditioner,
    LowRankMFAC,
    SparseAdaGrad,
    SparseMFAC,
    optimizer_state_bytes,
)

# M-FAC family on the digits MLP: hyperparameters that train it well within a few epochs.
MFAC_HYPER = dict(lr=0.01, ngrads=128, damp=0.03)
SPARSE_BLOCK = 4096
LOWRANK_HYPER = dict(lr=0.01, ngrads=128, damp=0.03, rank=4)
SGD_MOMENTUM = 0.9
SGD_LR = 0.05
# K-FAC on the digits classifier (damping 0.3: with 0.003 it reaches low losses early, then
# diverges; with a mean-reduced loss G is tiny, so the step is close to grad / damping).
KFAC_SETTINGS = dict(factor_update_steps=1, inv_update_steps=5, damping=0.3, factor_decay=0.95, kl_clip=1e-3)


class TrainStep(Protocol):
    def __call__(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> float: ...

    def state_bytes(self) -> int: ...


class OptimizerStep:
    """A ``TrainStep`` for any ``torch.optim.Optimizer`` over ``model``'s parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.update_timer: Callable[[], ContextManager] = contextlib.nullcontext

    @property
    def warmup_steps(self) -> int:
        """Steps before the optimizer's first periodic work (FOSI's first ESE); 0 for the others."""
        return getattr(getattr(self.optimizer, "config", None), "first_curvature_step", 0)

    def update(self) -> None:
        self.optimizer.step()

    def __call__(self, x, y, loss_fn) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.model(x), y)
        loss.backward()
        with self.update_timer():
            self.update()
        return loss.item()

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)


class KFACStep(OptimizerStep):
    """SGD-momentum on K-FAC-preconditioned gradients.

    K-FAC also works inside forward and backward (its hooks fold each layer's inputs and
    output gradients into the factor statistics); only :meth:`update` runs in the timer.
    """

    def __init__(self, model: torch.nn.Module, lr: float = 0.1, momentum: float = SGD_MOMENTUM,
                 **kfac_settings):
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
        settings = {**KFAC_SETTINGS, **kfac_settings}
        # The KL clip needs the learning rate actually applied, so read it from the optimizer.
        self.preconditioner = KFACPreconditioner(
            model, lr=lambda step: self.optimizer.param_groups[0]["lr"], **settings
        )

    def update(self) -> None:
        self.preconditioner.step()
        self.optimizer.step()

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer) + self.preconditioner.memory_usage()["total"]


class FosiStep(OptimizerStep):
    """FOSI-Adam (or DHO2) whose ESE uses the last ``ese_batches`` training batches.

    One 32-sample batch gives a Hessian estimate too noisy for the Newton step
    (its small Ritz values over-scale directions that are steeper on other
    batches, and training diverged); 8 batches (256 samples, a usual ESE
    batch size) are stable.

    With ``world > 1`` (DHO2), this rank's gradient comes from rows
    ``rank::world`` of the batch, its summed loss scaled by ``world / batch``:
    the optimizer's mean over ranks is then the whole batch's mean gradient.
    ``split_batch = C`` (one process) adds up the gradients of the ``C`` slices
    ``c::C``, each scaled by ``1 / batch``: DHO2's arithmetic for the gradient,
    the same math as the plain mean with other rounding. The ESE always uses
    whole batches, the same on every rank.
    """

    def __init__(self, model, optimizer_kwargs, ese_batches: int = 8, *, optimizer_class=FOSI,
                 rank: int = 0, world: int = 1, split_batch: int = 1):
        self.recent: list = []
        self.ese_batches = ese_batches
        self.loss_fn: Optional[Callable] = None
        self.rank, self.world = rank, world
        self.split_batch = world if world > 1 else split_batch
        super().__init__(model, optimizer_class(model.parameters(), curvature_loss_fn=self.ese_loss,
                                                **optimizer_kwargs))

    def ese_loss(self) -> torch.Tensor:
        """The loss on the recent batches: what the ESE differentiates twice."""
        x = torch.cat([b[0] for b in self.recent])
        y = torch.cat([b[1] for b in self.recent])
        return self.loss_fn(self.model(x), y)

    def __call__(self, x, y, loss_fn) -> float:
        self.loss_fn = loss_fn
        self.recent = (self.recent + [(x, y)])[-self.ese_batches :]
        self.optimizer.zero_grad(set_to_none=True)
        if self.split_batch == 1:
            loss = loss_fn(self.model(x), y)
            loss.backward()
            loss = loss.detach()
        else:
            slices = [self.rank] if self.world > 1 else range(self.split_batch)
            loss = 0.0
            for s in slices:
                rows = slice(s, None, self.split_batch)
                part = loss_fn(self.model(x[rows]), y[rows], reduction="sum") * (self.world / len(y))
                part.backward()
                loss = loss + part.detach()
        with self.update_timer():
            self.update()
        return float(loss)


def fosi_hyperparameters(steps_per_epoch: int, *, lr: float = 1e-3, k: int = 10, alpha: float = 0.1,
                         lanczos_iters: int = 40) -> dict:
    """FOSI-Adam's settings for the digits runs: ESE at every epoch start after a one-epoch warm-up."""
    return dict(lr=lr, base="adam", k=k, l=0, alpha=alpha, num_lanczos_iters=lanczos_iters,
                warmup_steps=steps_per_epoch, curvature_update_every=steps_per_epoch)


# --------------------------------------------------------------------------- builders


def build_sgd(model: torch.nn.Module, steps_per_epoch: int, *, lr: float = SGD_LR) -> OptimizerStep:
    """SGD, lr 0.05 unless given, momentum 0.9."""
    return OptimizerStep(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=SGD_MOMENTUM))


def build_adam(model: torch.nn.Module, steps_per_epoch: int) -> OptimizerStep:
    """Adam, lr 1e-3."""
    return OptimizerStep(model, torch.optim.Adam(model.parameters(), lr=1e-3))


def build_sparse_adagrad(model: torch.nn.Module, steps_per_epoch: int) -> OptimizerStep:
    """SparseAdaGrad: 1 % of each block of 4096 per step, lr 0.05."""
    return OptimizerStep(model, SparseAdaGrad(model.parameters(), lr=0.05, density=0.01, block_size=4096))


def build_mfac(model: torch.nn.Module, steps_per_epoch: int, *, lr: float = MFAC_HYPER["lr"]) -> OptimizerStep:
    """Dense M-FAC, window 128, damp 0.03, lr 0.01 unless given."""
    return OptimizerStep(model, MFAC(model.parameters(), **{**MFAC_HYPER, "lr": lr}))


def build_sparse_mfac(
    model: torch.nn.Module, steps_per_epoch: int, *, density: float = 0.01,
    error_feedback: bool = True, lr: float = MFAC_HYPER["lr"],
) -> OptimizerStep:
    """S-MFAC at 1 % density (blocks of 4096), error feedback, same m / damp / lr as M-FAC unless given."""
    optimizer = SparseMFAC(
        model.parameters(), density=density, block_size=SPARSE_BLOCK,
        error_feedback=error_feedback, **{**MFAC_HYPER, "lr": lr},
    )
    return OptimizerStep(model, optimizer)


def build_sparse_mfac_no_ef(model: torch.nn.Module, steps_per_epoch: int, *,
                            lr: float = MFAC_HYPER["lr"]) -> OptimizerStep:
    """S-MFAC at 1 % without error feedback."""
    return build_sparse_mfac(model, steps_per_epoch, error_feedback=False, lr=lr)


def build_sparse_mfac_01(model: torch.nn.Module, steps_per_epoch: int, *,
                         lr: float = MFAC_HYPER["lr"]) -> OptimizerStep:
    """S-MFAC at 0.1 %, error feedback."""
    return build_sparse_mfac(model, steps_per_epoch, density=0.001, lr=lr)


def build_lowrank_mfac(model: torch.nn.Module, steps_per_epoch: int, *,
                       lr: float = LOWRANK_HYPER["lr"]) -> OptimizerStep:
    """LR-MFAC: rank-4 power-iteration compression with error feedback, same m / damp / lr unless given."""
    return OptimizerStep(model, LowRankMFAC(model.parameters(), **{**LOWRANK_HYPER, "lr": lr}))


def build_kfac(model: torch.nn.Module, steps_per_epoch: int) -> KFACStep:
    """SGD (lr 0.1, momentum 0.9) + K-FAC (damping 0.3, eigen every 5 steps, KL clip 1e-3)."""
    return KFACStep(model, lr=0.1)


def build_fosi(model: torch.nn.Module, steps_per_epoch: int) -> FosiStep:
    """FOSI-Adam: lr 1e-3, k = 10, alpha = 0.1, ESE each epoch after a 1-epoch warm-up."""
    return FosiStep(model, fosi_hyperparameters(steps_per_epoch))
