"""The ``tritonopt::sgd_momentum_step`` custom op: validation, registration and dispatch.

Kernel and reference live in :mod:`tritonopt.kernels.sgd_momentum`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tritonopt._runtime import nvtx_range, select_backend
from tritonopt.kernels import sgd_momentum as _kernels

__all__ = ["sgd_momentum_step"]

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_scalar(name: str, value, *, low: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value >= low):
        raise ValueError(f"{name} must be a finite number >= {low}, got {value!r}")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_sgd_args(
    param, grad, momentum_buffer, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step,
) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    if param.dtype != torch.float32:
        raise TypeError(f"param must be float32, got {param.dtype}")
    if not param.is_contiguous():
        raise ValueError("param must be contiguous: it is updated in place")
    if param.requires_grad:
        raise ValueError("param must not require grad: it is updated in place (pass param.detach())")
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"grad must be float32, float16 or bfloat16, got {grad.dtype}")
    if grad.shape != param.shape:
        raise ValueError(f"grad must have param's shape {tuple(param.shape)}, got {tuple(grad.shape)}")
    if grad.device != param.device:
        raise ValueError(f"grad is on {grad.device} but param is on {param.device}")
    if not grad.is_contiguous():
        raise ValueError("grad must be contiguous")
    _check_scalar("lr", lr)
    _check_scalar("momentum", momentum)
    _check_scalar("dampening", dampening)
    _check_scalar("weight_decay", weight_decay)
    _check_flag("nesterov", nesterov)
    _check_flag("maximize", maximize)
    _check_flag("first_step", first_step)
    if nesterov and (momentum == 0 or dampening != 0):
        raise ValueError("nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError("momentum_buffer is required when momentum != 0")
        if not isinstance(momentum_buffer, torch.Tensor):
            raise TypeError(f"momentum_buffer must be a torch.Tensor, got {type(momentum_buffer).__name__}")
        if momentum_buffer.dtype != torch.float32:
            raise TypeError(f"momentum_buffer must be float32, got {momentum_buffer.dtype}")
        if momentum_buffer.shape != param.shape:
            raise ValueError(
                f"momentum_buffer must have param's shape {tuple(param.shape)}, got {tuple(momentum_buffer.shape)}"
            )
        if momentum_buffer.device != param.device:
            raise ValueError(f"momentum_buffer is on {momentum_buffer.device} but param is on {param.device}")
        if not momentum_buffer.is_contiguous():
            raise ValueError("momentum_buffer must be contiguous: it is updated in place")
        if momentum_buffer.requires_grad:
            raise ValueError("momentum_buffer must not require grad: it is updated in place")
    buffers = [("param", param), ("grad", grad), ("momentum_buffer", momentum_buffer if momentum != 0 else None)]
    # While torch.compile traces, tensors are fake and have no address; the op re-checks at run time.
    if torch.compiler.is_compiling():
        return
    spans = [
        (name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for name, t in buffers
        if t is not None and t.numel() and t.device.type != "meta"
    ]
    for i, (name_i, start_i, end_i) in enumerate(spans):
        for name_j, start_j, end_j in spans[i + 1 :]:
            if start_i < end_j and start_j < end_i:
                raise ValueError(f"{name_i} and {name_j} must not share memory")


@torch.library.custom_op("tritonopt::sgd_momentum_step", mutates_args=("param", "momentum_buffer"))
def _sgd_momentum_step_op(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
) -> None:
    args = (param, grad, momentum_buffer, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step)
    _check_sgd_args(*args)
    with nvtx_range("tritonopt/sgd_momentum/update"):
        if select_backend(param.device) == "triton":
            _kernels.sgd_momentum_step_triton(*args)
        else:
            _kernels.sgd_momentum_step_reference(*args)


@_sgd_momentum_step_op.register_fake
def _sgd_momentum_step_fake(*args):
    return None


def sgd_momentum_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor] = None,
    *,
    lr: float,
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
        lr, momentum, dampening, weight_decay: finite, ``>= 0``.
        nesterov: needs ``momentum > 0`` and ``dampening = 0``.
        first_step: the buffer is initialised with ``d`` (its content is not read).

    Non-finite values propagate as in ``torch.optim.SGD``; nothing is raised on them.

    Raises:
        TypeError / ValueError: naming the offending argument, before anything is modified.
    """
    _check_sgd_args(
        param, grad, momentum_buffer, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step
    )
    torch.ops.tritonopt.sgd_momentum_step(
        param, grad, momentum_buffer if momentum != 0 else None, float(lr), float(momentum), float(dampening),
        float(weight_decay), nesterov, maximize, first_step,
    )
