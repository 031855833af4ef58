"""``sgd_momentum_step``: declaration (kernel and reference: :mod:`tritonopt.kernels.sgd_momentum`)."""

from __future__ import annotations

from typing import Optional

import torch

from tritonopt._ops._registry import define_op
from tritonopt._validation import (FLOAT_DTYPES, check_bool, check_disjoint, check_float, check_same_device,
                                   check_tensor)
from tritonopt.kernels import sgd_momentum as _kernels

__all__ = ["sgd_momentum_step"]


def _check_like_param(name: str, t, param: torch.Tensor, *, dtypes, updated: bool = False) -> None:
    check_tensor(name, t, dtypes=dtypes)
    if t.shape != param.shape:
        raise ValueError(f"{name} must have param's shape {tuple(param.shape)}, got {tuple(t.shape)}")
    check_same_device("param", param, **{name: t})
    check_tensor(name, t, contiguous=True, updated_in_place=updated)


@define_op("sgd_momentum_step", mutates_args=("param", "momentum_buffer"), nvtx="tritonopt/sgd_momentum/update")
def sgd_momentum_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor] = None,
    *,
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first_step: bool = False,
) -> None:
    """One ``torch.optim.SGD`` step of a parameter buffer in one fused pass, in place.

    ``d = g (+ weight_decay w)``; with momentum ``buf = d`` on the first step,
    else ``buf = momentum buf + (1 - dampening) d``; ``d = buf`` (or
    ``d + momentum buf`` with Nesterov); ``w = w - lr d``. ``maximize`` negates
    ``g``. The DSP stage update (Xu et al. 2020, sec. 3.3).

    Args:
        param: float32, contiguous, any shape (read flat); updated in place.
        grad: float32, float16 or bfloat16, param's shape, contiguous; not modified.
        momentum_buffer: float32, param's shape, contiguous; updated in place.
            Required when ``momentum != 0``, ignored otherwise.
        lr, momentum, dampening, weight_decay: finite, ``>= 0`` (``lr`` defaults to
            ``torch.optim.SGD``'s 1e-3).
        nesterov: needs ``momentum > 0`` and ``dampening = 0``.
        first_step: the buffer is initialised with ``d`` (its content is not read).

    Non-finite values propagate as in ``torch.optim.SGD``; nothing is raised on them.

    Raises:
        TypeError / ValueError: naming the offending argument, before anything is modified.
    """
    check_tensor("param", param, dtypes=(torch.float32,))
    check_tensor("param", param, updated_in_place=True)
    _check_like_param("grad", grad, param, dtypes=FLOAT_DTYPES)
    check_float("lr", lr, low=0.0)
    check_float("momentum", momentum, low=0.0)
    check_float("dampening", dampening, low=0.0)
    check_float("weight_decay", weight_decay, low=0.0)
    check_bool("nesterov", nesterov)
    check_bool("maximize", maximize)
    check_bool("first_step", first_step)
    if nesterov and (momentum == 0 or dampening != 0):
        raise ValueError("nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")
    if momentum == 0:
        check_disjoint({"param": param, "grad": grad}, updated=("param",))
        return
    if momentum_buffer is None:
        raise ValueError("momentum_buffer is required when momentum != 0")
    _check_like_param("momentum_buffer", momentum_buffer, param, dtypes=(torch.float32,), updated=True)
    check_disjoint({"param": param, "grad": grad, "momentum_buffer": momentum_buffer},
                   updated=("param", "momentum_buffer"))


@sgd_momentum_step.register_fake
def _(param, grad, momentum_buffer=None, **hyperparameters):
    return None


sgd_momentum_step.register_backends(
    triton=_kernels.sgd_momentum_step_triton, reference=_kernels.sgd_momentum_step_reference
)
