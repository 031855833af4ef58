"""The ``tritonopt::fosi_step`` custom op: validation, registration and dispatch.

Kernels and the reference live in :mod:`tritonopt.kernels.fosi_step`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tritonopt._runtime import nvtx_range, select_backend
from tritonopt.kernels import fosi_step as _kernels
from tritonopt.kernels.fosi_step import BASES, MAX_RANK

__all__ = ["fosi_step"]

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_vector(name: str, t, n: int, device, *, dtype=torch.float32) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must be 1-D with {n} entries, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but param is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_scalar(name: str, value, *, low: float = -math.inf, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value!r}")


def _check_fosi_args(
    param, grad, basis, newton_scale, state_a, state_b, g1_velocity,
    base, lr, beta1, beta2, eps, step, base_scale, g1_decay, g1_gain,
) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    if param.dim() != 1 or param.dtype != torch.float32:
        raise ValueError(f"param must be a 1-D float32 buffer, got {param.dtype} {tuple(param.shape)}")
    if not param.is_contiguous():
        raise ValueError("param must be contiguous: it is updated in place")
    if param.requires_grad:
        raise ValueError("param must not require grad: it is updated in place")
    n, device = param.shape[0], param.device
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"grad must be float32, float16 or bfloat16, got {grad.dtype}")
    _check_vector("grad", grad, n, device, dtype=grad.dtype)
    if not isinstance(basis, torch.Tensor):
        raise TypeError(f"basis must be a torch.Tensor, got {type(basis).__name__}")
    if basis.dim() != 2 or basis.shape[1] != n:
        raise ValueError(f"basis must be [r, {n}], got shape {tuple(basis.shape)}")
    if basis.dtype != torch.float32:
        raise TypeError(f"basis must be float32, got {basis.dtype}")
    if basis.device != device:
        raise ValueError(f"basis is on {basis.device} but param is on {device}")
    if not basis.is_contiguous():
        raise ValueError("basis must be contiguous (one basis vector per row)")
    r = basis.shape[0]
    if r > MAX_RANK:
        raise ValueError(f"basis may have at most {MAX_RANK} rows (k + l), got {r}")
    _check_vector("newton_scale", newton_scale, r, device)
    if base not in BASES:
        raise ValueError(f"base must be one of {BASES}, got {base!r}")
    if base in ("heavy_ball", "adam"):
        if state_a is None:
            raise ValueError(f"state_a is required for base={base!r}")
        _check_vector("state_a", state_a, n, device)
    if base == "adam":
        if state_b is None:
            raise ValueError("state_b is required for base='adam'")
        _check_vector("state_b", state_b, n, device)
    if g1_velocity is not None:
        _check_vector("g1_velocity", g1_velocity, r, device)
    _check_scalar("lr", lr, low=0.0)
    _check_scalar("beta1", beta1, low=0.0, high=1.0)
    _check_scalar("beta2", beta2, low=0.0, high=1.0)
    _check_scalar("eps", eps, low=0.0)
    _check_scalar("base_scale", base_scale)
    _check_scalar("g1_decay", g1_decay)
    _check_scalar("g1_gain", g1_gain)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the base optimizer's step count), got {step!r}")
    if base == "adam" and (beta1 >= 1.0 or beta2 >= 1.0):
        raise ValueError("beta1 and beta2 must be < 1 for base='adam'")
    buffers = [("param", param), ("grad", grad), ("basis", basis), ("state_a", state_a), ("state_b", state_b),
               ("newton_scale", newton_scale), ("g1_velocity", g1_velocity)]
    spans = [
        (name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for name, t in buffers
        if t is not None and t.numel() and t.device.type != "meta"
    ] if not torch.compiler.is_compiling() else []  # traced tensors have no address; re-checked at run time
    for i, (name_i, start_i, end_i) in enumerate(spans):
        for name_j, start_j, end_j in spans[i + 1 :]:
            if start_i < end_j and start_j < end_i:
                raise ValueError(f"{name_i} and {name_j} must not share memory")


@torch.library.custom_op(
    "tritonopt::fosi_step", mutates_args=("param", "state_a", "state_b", "g1_velocity")
)
def _fosi_step_op(
    param: torch.Tensor,
    grad: torch.Tensor,
    basis: torch.Tensor,
    newton_scale: torch.Tensor,
    state_a: Optional[torch.Tensor],
    state_b: Optional[torch.Tensor],
    g1_velocity: Optional[torch.Tensor],
    base: str,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    base_scale: float,
    g1_decay: float,
    g1_gain: float,
) -> None:
    args = (param, grad, basis, newton_scale, state_a, state_b, g1_velocity,
            base, lr, beta1, beta2, eps, step, base_scale, g1_decay, g1_gain)
    _check_fosi_args(*args)
    with nvtx_range("tritonopt/fosi/update"):
        if select_backend(param.device) == "triton":
            _kernels.fosi_step_triton(*args)
        else:
            _kernels.fosi_step_reference(*args)


@_fosi_step_op.register_fake
def _fosi_step_fake(*args):
    return None


def fosi_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    basis: torch.Tensor,
    newton_scale: torch.Tensor,
    *,
    base: str = "adam",
    state_a: Optional[torch.Tensor] = None,
    state_b: Optional[torch.Tensor] = None,
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    step: int = 1,
    base_scale: float = 1.0,
    g1_velocity: Optional[torch.Tensor] = None,
    g1_decay: float = 0.0,
    g1_gain: float = 1.0,
) -> None:
    """One FOSI update of a flat parameter buffer, in place (Gu et al. eqs. 11-12; FOSI sec. 3).

    ``w <- w - V^T (s * q) + b (I - V^T V) O(g - V^T V g)`` with ``q = V g`` (or
    the coefficient-space velocity, below) and ``O`` the base optimizer.

    Args:
        param: ``[n]`` float32, contiguous; the parameters, updated in place.
        grad: ``[n]`` float32/float16/bfloat16, contiguous; not modified.
        basis: ``[r, n]`` float32, contiguous, orthonormal rows (``r = k + l <= 64``;
            ``r = 0`` gives exactly the base optimizer's step).
        newton_scale: ``[r]`` float32: ``s_j = alpha / lambda_j`` (paper) or
            ``alpha / |lambda_j|`` (FOSI reference code).
        base: ``"adam"``, ``"heavy_ball"`` or ``"sgd"``.
        state_a: ``[n]`` float32: the momentum buffer (heavy_ball) or Adam's
            first moment; updated in place.
        state_b: ``[n]`` float32: Adam's second moment; updated in place.
        lr, beta1, beta2, eps: base-optimizer hyperparameters (``beta1`` is the
            heavy-ball momentum).
        step: the base optimizer's step count including this step (Adam's bias correction).
        base_scale: ``b``, the scale of the projected base step (1 in the paper).
        g1_velocity: optional ``[r]`` float32 coefficient-space momentum on
            ``g1`` (FOSI reference code): ``z <- g1_decay z + g1_gain V g``,
            then ``q = z``; updated in place.

    Raises:
        TypeError / ValueError: naming the offending argument, before anything is modified.
    """
    _check_fosi_args(param, grad, basis, newton_scale, state_a, state_b, g1_velocity,
                     base, lr, beta1, beta2, eps, step, base_scale, g1_decay, g1_gain)
    args = (param, grad, basis, newton_scale, state_a, state_b, g1_velocity,
            base, float(lr), float(beta1), float(beta2), float(eps), step,
            float(base_scale), float(g1_decay), float(g1_gain))
    torch.ops.tritonopt.fosi_step(*args)
