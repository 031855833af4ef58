"""Every optimizer of the contract table (``_optim_table.OPTIMIZERS``, and KAISA in one process)
trains a small classifier with its forward under ``torch.autocast("cpu", dtype)`` for bfloat16 and
float16, and with a ``torch.amp.GradScaler`` where its stepping optimizer is a ``torch.optim.Optimizer``.

Each run must raise nothing, keep every parameter finite, lower the float32 loss of its batch,
and take a first step close to the float32 run's (see ``FIRST_UPDATE_TOLERANCE``).
"""

from __future__ import annotations

import pytest
import torch
from _optim_table import OPTIMIZERS, KFACRun, ModelRun, OptimizerInfo
from torch import nn

import tritonopt
from tritonopt.dist.kaisa import KAISAPreconditioner
from tritonopt.optim.kfac_base import BaseKFACPreconditioner

STEPS = 5
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The relative distance allowed between the first update under bfloat16 autocast and the float32
# run's. The forward rounds the input, the weights and each activation to bfloat16 (u = 2^-8; float16's
# u = 2^-11 is finer, so the bound covers it too) and
# the backward rounds each gradient product again, so the gradient is off by about u relative; the
# optimizers map it to their first update with a gain near one (normalised, damped or clipped):
# 4.3e-3 at most measured here, 1.1 u. 2^-5 is eight bfloat16 units; an update computed from a
# loss-scaled gradient, from half-precision curvature that lost its damping, or from garbage is
# far outside.
FIRST_UPDATE_TOLERANCE = 2.0**-5


def _kfac_over_sgd(preconditioner_class):
    def build(run, **kwargs):
        sgd = torch.optim.SGD(run.model.parameters(), lr=0.05, momentum=0.9)
        return [preconditioner_class(run.model, factor_update_steps=1, inv_update_steps=2, damping=0.1,
                                     lr=0.05, **kwargs), sgd]
    return build


def _fosi(run, **kwargs):
    return [tritonopt.optim.FOSI(run.model.parameters(), lr=1e-2, k=2, l=1, num_lanczos_iters=8,
                                 curvature_update_every=3, curvature_loss_fn=run.curvature_loss, **kwargs)]


# The model-driven optimizers this module covers even where the table does not list them.
_REQUIRED = [
    OptimizerInfo("KFACPreconditioner", KFACRun, build_for_model=_kfac_over_sgd(tritonopt.optim.KFACPreconditioner)),
    OptimizerInfo("KAISAPreconditioner", KFACRun, build_for_model=_kfac_over_sgd(KAISAPreconditioner)),
    OptimizerInfo("FOSI", ModelRun, build_for_model=_fosi),
]
INFOS = OPTIMIZERS + [info for info in _REQUIRED if info.name not in {o.name for o in OPTIMIZERS}]


@pytest.fixture(autouse=True)
def reference_backend():
    # Autocast reaches the ops' references (plain torch); the Triton kernels ignore it.
    with tritonopt.use_backend("reference"):
        yield


class Training:
    """A small classifier on one fixed batch, stepped by ``info``'s optimizer(s).

    Table entries that consume ``.grad`` get the classifier's parameters; model-driven entries
    bring their own run (model and optimizers). A K-FAC-style preconditioner gets the scaler as
    ``grad_scaler=`` and goes first; the last optimizer is the one a ``GradScaler`` steps.
    """

    def __init__(self, info: OptimizerInfo, scaler: torch.amp.GradScaler | None = None):
        self.scaler = scaler
        if not issubclass(info.run, ModelRun):
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            self.optimizers = [info.build(list(self.model.parameters()))]
        else:
            run = info.make_run()
            if scaler is not None and isinstance(run.optimizers[0], BaseKFACPreconditioner):
                run.optimizers[0].remove_hooks()
                run.optimizers = info.build_for_model(run, grad_scaler=scaler)
            self.model, self.optimizers = run.model, run.optimizers
        self.preconditioner = self.optimizers[0] if isinstance(self.optimizers[0], BaseKFACPreconditioner) else None
        self.optimizer = self.optimizers[-1]
        gen = torch.Generator().manual_seed(2)
        self.x = torch.randn(32, self.model[0].in_features, generator=gen)
        self.y = torch.randint(0, self.model[-1].out_features, (32,), generator=gen)

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])

    def loss(self) -> float:
        with torch.no_grad():
            return nn.functional.cross_entropy(self.model(self.x), self.y).item()

    def step(self, dtype: torch.dtype | None) -> None:
        for optimizer in self.optimizers:
            if isinstance(optimizer, torch.optim.Optimizer):
                optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        if self.scaler is None:
            loss.backward()
            if self.preconditioner is None or self.preconditioner.step():
                self.optimizer.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if self.preconditioner is None or self.preconditioner.step():
            self.scaler.step(self.optimizer)
        self.scaler.update()


_FLOAT32_FIRST_UPDATES: dict[str, torch.Tensor] = {}


def float32_first_update(info: OptimizerInfo) -> torch.Tensor:
    """The first update of the same training without autocast (computed once per optimizer)."""
    if info.name not in _FLOAT32_FIRST_UPDATES:
        training = Training(info)
        before = training.params()
        training.step(None)
        _FLOAT32_FIRST_UPDATES[info.name] = training.params() - before
    return _FLOAT32_FIRST_UPDATES[info.name]


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", list(AUTOCAST_DTYPES.values()), ids=list(AUTOCAST_DTYPES))
@pytest.mark.parametrize("scaled", [False, True], ids=["autocast", "autocast_grad_scaler"])
@pytest.mark.parametrize("info", [pytest.param(info, id=info.name) for info in INFOS])
def test_trains_under_autocast(info, scaled, dtype):
    training = Training(info, torch.amp.GradScaler("cpu") if scaled else None)
    if scaled and not isinstance(training.optimizer, torch.optim.Optimizer):
        pytest.skip(f"{info.name} is not stepped by a torch.optim.Optimizer, which a GradScaler steps")
    initial_loss, before = training.loss(), training.params()
    training.step(dtype)
    first = training.params() - before
    for _ in range(STEPS - 1):
        assert training.params().isfinite().all()
        training.step(dtype)
    assert training.params().isfinite().all()
    assert training.loss() < initial_loss
    assert relative_distance(first, float32_first_update(info)) <= FIRST_UPDATE_TOLERANCE
