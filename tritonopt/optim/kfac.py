"""K-FAC with eigenbasis preconditioning in one process (KAISA, Pauloski et al. SC '21, sec. 2-4).

Usage::

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kfac = KFACPreconditioner(model, lr=lambda step: optimizer.param_groups[0]["lr"])
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if kfac.step():      # replaces the Linear/Conv2d gradients by preconditioned ones
            optimizer.step() # False: the step was refused and the gradients are not usable

Per step ``k`` (counted from 0 by :meth:`KFACPreconditioner.step`), with the
functions of :mod:`tritonopt.optim.kfac_functional`:

1. **Factors** (``k % factor_update_steps == 0``). Hooks on every registered layer
   capture, in training mode with autograd on, the layer input (forward) and the
   gradient w.r.t. its output (backward, divided by the loss scale of a
   ``grad_scaler``), and average ``X^T X / n`` over the step's forward/backward
   passes (:func:`kfac_accumulate_statistic`). ``step()`` folds them into the
   running average ``F <- decay F + (1 - decay) F_batch`` (``F = I`` before the first
   update; paper sec. 2.1.2; :func:`kfac_running_average`, one ``lerp`` per factor).
2. **Eigendecompositions** (``k % inv_update_steps == 0``): ``torch.linalg.eigh`` in
   fp32, batched over layers whose factors have one size, eigenvalues clamped at 0;
   with ``prediv`` the reciprocal ``D = 1 / (dG dA^T + damping)`` is computed once
   here (paper sec. 4.4), else ``dA, dG`` are kept and the current damping used.
   ``compute_method="inverse"`` keeps ``(A + damping I)^-1`` and ``(G + damping I)^-1``
   instead (Cholesky, with an eigendecomposition fallback).
3. **Preconditioning** (every step): ``P = QG [(QG^T grad QA) / (dG dA^T + damping)] QA^T``
   = ``(A (x) G + damping I)^-1 grad`` (paper Eq. 15-17), or
   ``(G + damping I)^-1 grad (A + damping I)^-1`` (Eq. 14), :func:`kfac_precondition`.
4. **KL clip**: ``nu = min(1, sqrt(kl_clip / |lr^2 sum_l <P_l, grad_l>|))`` (``nu = 1``
   when the sum is 0, no clipping when ``kl_clip`` is None). As in kfac-pytorch, each
   ``<P_l, grad_l>`` is a float32 dot product and ``nu P`` is taken in float32; where
   finite entries overflow float32's products the sum is taken in float64 instead, and
   where ``nu`` lies below float32's normal range ``nu P`` too, so a huge but finite
   gradient gets a tiny ``nu``, not NaN or 0 (:func:`kfac_scale_preconditioned`).

Non-finite values. ``step()`` returns True when it wrote preconditioned
gradients. A step whose gradients or fresh factor statistics hold NaN/inf, or
whose preconditioned gradient overflows float32 (a finite gradient too large to
precondition), is refused and changes nothing: ``on_nonfinite="skip"`` (default)
warns, leaves every gradient, factor and counter as it was (the step counter does
not advance), counts :attr:`skipped_steps` and returns False, so the loop above
does not apply the unusable gradients; ``"raise"`` raises ``FloatingPointError``.
Stored factors that are non-finite (e.g. loaded from a corrupt checkpoint) or
whose decomposition fails: the eigen update of that layer is skipped with a
warning and its previous eigenbasis is kept (a layer that never had one passes
its gradient through unpreconditioned); ``"raise"`` raises.

One process only. A model wrapped in ``DistributedDataParallel`` or
``DataParallel``, or a ``torch.distributed`` world of more than one rank, is
refused: every rank would fold only its own statistics and the ranks would drift
apart. Use :class:`tritonopt.dist.KAISAPreconditioner` (same arguments; it also
runs in one process), or pass ``independent_ranks=True`` when each rank trains a
model of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tritonopt._validation import check_bool
from tritonopt.optim._kfac_layers import KFACLayer, UnsupportedLayerError
from tritonopt.optim._sharding import refuse_sharded
from tritonopt.optim.kfac_base import BaseKFACPreconditioner
from tritonopt.optim.kfac_functional import kfac_precondition_layers

__all__ = ["BaseKFACPreconditioner", "KFACLayer", "KFACPreconditioner", "UnsupportedLayerError"]

_DATA_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)
# An FSDP2 model is trained on several ranks, whose factor statistics must be averaged.
_SHARDED_MODEL = (
    "it runs in one process, and a sharded model is trained on several ranks whose factor statistics must be "
    "averaged; use tritonopt.dist.KAISAPreconditioner (same arguments), which steps FSDP2 models"
)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class KFACPreconditioner(BaseKFACPreconditioner):
    """K-FAC preconditioner for the ``nn.Linear`` and ``nn.Conv2d`` layers of a model, in one process.

    Call :meth:`step` after ``loss.backward()`` and before the optimizer's
    ``step()``; it rewrites the registered layers' ``.grad`` in place (other
    parameters are untouched), so any ``torch.optim`` optimizer applies the
    preconditioned update. Takes every argument of
    :class:`~tritonopt.optim.kfac_base.BaseKFACPreconditioner`, and:

    Args:
        independent_ranks: allow a ``torch.distributed`` world of several ranks in
            which each rank trains its own model (nothing is averaged across ranks).

    Raises:
        ValueError: a ``DistributedDataParallel``/``DataParallel`` model.
        RuntimeError: a multi-rank ``torch.distributed`` world without ``independent_ranks``.
        (and those of the base class: bad arguments, unsupported layers or dtypes)
    """

    def __init__(self, model: nn.Module, *, independent_ranks: bool = False, **kwargs):
        check_bool("independent_ranks", independent_ranks)
        if not isinstance(model, nn.Module):  # before anything reads its parameters
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        refuse_sharded(type(self).__name__, list(model.parameters()), _SHARDED_MODEL)
        if isinstance(model, _DATA_PARALLEL):
            raise ValueError(
                f"KFACPreconditioner got a {type(model).__name__} model: each rank would fold only its own "
                "factor statistics and the ranks would drift apart. Use tritonopt.dist.KAISAPreconditioner, "
                "which all-reduces the factors (same arguments)"
            )
        world = _world_size()
        if world > 1 and not independent_ranks:
            raise RuntimeError(
                f"KFACPreconditioner runs in one process, but torch.distributed has {world} ranks: for "
                "data-parallel training use tritonopt.dist.KAISAPreconditioner (same arguments), or pass "
                "independent_ranks=True if each rank trains a model of its own"
            )
        super().__init__(model, **kwargs)
        self.independent_ranks = independent_ranks

    @torch.no_grad()
    def step(self) -> bool:
        """Fold factor statistics, refresh eigendecompositions, precondition the gradients.

        Returns True when the gradients were replaced by preconditioned ones, False
        when the step was refused (``on_nonfinite="skip"``; nothing changed, the
        gradients are not usable: skip the optimizer's step).
        """
        try:
            hyper = self.step_hyperparameters()
            grads = self.read_gradients()
            self.check_capture(grads)
            return self.run_step(hyper, grads, self.pending_statistics(), eigen_update=self._eigen_update,
                                 precondition=self._precondition)
        finally:
            self.end_capture()

    def _eigen_update(self, folded: dict, damping: float) -> dict:
        return self.eigen_update(range(len(self.layers)), folded, damping)

    def _precondition(self, grads: dict, eigen: dict, damping: float) -> dict:
        return kfac_precondition_layers(grads, {i: eigen.get(i, self.layers[i].eigen) for i in grads},
                                        damping=damping, precision=self.precision)
