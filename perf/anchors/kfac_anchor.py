"""K-FAC over SGD: tritonopt's ``KFACPreconditioner`` beside gpauloski/kfac-pytorch's.

Both precondition with the eigenbasis method (paper eq. 15-17), the damping added to the
products of eigenvalues precomputed at each eigen update (kfac-pytorch's
``compute_eigenvalue_outer_product=True``, tritonopt's ``prediv=True``), the KL clip reading
the SGD's learning rate, and SGD with momentum 0.9 applying the preconditioned gradients.
At the demo size the settings are the digits experiment's (``perf/_optimizers.py``:
damping 0.3, eigendecompositions every 5 steps, KL clip 1e-3, lr 0.1); elsewhere those of
``perf.bench_optimizer_step`` at that size (damping 0.003, lr 0.01).

kfac-pytorch is read from a checkout (``<anchors>/kfac-pytorch``, pure Python); run on one
process it keeps every layer's factors and eigendecompositions locally, like tritonopt's.

Two pairs: kfac-pytorch as it comes (``update_factors_in_hook=True``: it folds each batch's
factor statistics into the running averages in its backward hooks, so that work counts in its
iteration but not its step), and kfac-pytorch folding them in ``step()``, as tritonopt does (so
that a refused step leaves them untouched): there the two steps do the same work.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import torch

from perf import _optimizers as optimizers
from perf.anchors import AnchorBroken, AnchorPair, broken, checkout, importable, installed_as

FOLDER = "kfac-pytorch"
DISTRIBUTION = "kfac-pytorch"
SGD_MOMENTUM = optimizers.SGD_MOMENTUM


def settings_at(size) -> tuple[float, dict]:
    """The SGD learning rate and the K-FAC settings both sides use at ``size``."""
    if size.name == "demo":
        return 0.1, dict(optimizers.KFAC_SETTINGS)
    return 0.01, dict(factor_update_steps=1, inv_update_steps=size.kfac_inv_every, damping=0.003,
                      factor_decay=0.95, kl_clip=1e-3)


class KFACPytorchStep(optimizers.OptimizerStep):
    """SGD-momentum on kfac-pytorch's preconditioned gradients; its hooks run in forward/backward."""

    def __init__(self, model: torch.nn.Module, kfac_module, lr: float, settings: dict, *, fold_in_hooks: bool = True):
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=SGD_MOMENTUM))
        self.preconditioner = kfac_module.KFACPreconditioner(
            model, lr=lambda step: self.optimizer.param_groups[0]["lr"],
            compute_method="eigen", compute_eigenvalue_outer_product=True, update_factors_in_hook=fold_in_hooks,
            **settings,
        )

    def update(self) -> None:
        self.preconditioner.step()
        self.optimizer.step()

    def state_bytes(self) -> int:
        return optimizers.optimizer_state_bytes(self.optimizer) + self.preconditioner.memory_usage()["total"]


def load(anchors_dir: Path):
    """kfac-pytorch's ``kfac.preconditioner`` module, from its checkout.

    The package asks for its installed version at import (``importlib.metadata``); a clone is
    not installed, so while it imports its metadata is answered from its ``pyproject.toml``.
    """
    root = checkout(anchors_dir, FOLDER)
    with importable(root), installed_as(root, DISTRIBUTION), warnings.catch_warnings():
        # It notes at import that NVIDIA Apex is absent and torch's flatten is used instead.
        warnings.filterwarnings("ignore", message="NVIDIA Apex", category=UserWarning)
        try:
            module = importlib.import_module("kfac.preconditioner")
        except Exception as error:  # any import-time failure of the checkout
            raise broken(root, "kfac.preconditioner", error) from error
    if not Path(module.__file__).resolve().is_relative_to(root.resolve()):
        raise AnchorBroken(f"another `kfac` package ({module.__file__}) shadows the checkout"
                           f" at {root}: uninstall it, or import it nowhere before the benchmark")
    return module


def pairs(anchors_dir: Path, size) -> list[AnchorPair]:
    """K-FAC + SGD-momentum, tritonopt's and kfac-pytorch's (folding in its hooks, and in its step), at
    ``size``'s settings.

    Agreement (lockstep, at the demo's size, 15 steps: 3 eigen periods). Each update is a
    product of eigenbases from ``eigh`` of 256 x 256 float32 factors: LAPACK's backward error is
    about ``n u = 256 * 2**-24 = 1.5e-5`` of the factor's norm, and with the damping (0.3)
    larger than the spread of the eigenvalue products that moves the preconditioned gradient
    by at most that relative amount, so the bound is ``rtol = 2e-5`` with the GEMMs' rounding.
    """
    module = load(anchors_dir)
    lr, settings = settings_at(size)
    period = settings["inv_update_steps"]
    return [
        AnchorPair(
            name="KFAC+SGD", anchor=anchor,
            build_tritonopt=lambda model: optimizers.KFACStep(model, lr=lr, momentum=SGD_MOMENTUM, **settings),
            build_anchor=lambda model, fold_in_hooks=fold_in_hooks: KFACPytorchStep(
                model, module, lr, settings, fold_in_hooks=fold_in_hooks),
            period=period, agreement_steps=3 * period, rtol=2e-5, settings=dict(lr=lr, **settings),
        )
        for anchor, fold_in_hooks in (("gpauloski/kfac-pytorch", True),
                                      ("gpauloski/kfac-pytorch, folding in step()", False))
    ]
