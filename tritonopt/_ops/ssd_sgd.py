"""The ``tritonopt::ssd_sgd_step`` custom op: validation, registration and dispatch.

Kernels and the reference live in :mod:`tritonopt.kernels.ssd_sgd`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tritonopt._runtime import nvtx_range, select_backend
from tritonopt.kernels import ssd_sgd as _kernels

__all__ = ["ssd_sgd_step"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_STATE_DTYPES = (torch.float32, torch.float64)
_SCALARS = (
    "lr", "momentum", "weight_decay", "local_lr", "local_weight_decay",
    "glu_alpha", "glu_beta", "sync_coef", "shadow_scale",
)


def _check_buffer(name: str, t, n: int, device, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must be 1-D with {n} entries (param's length), got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be one of {names}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but param is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_ssd_sgd_args(
    param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum, scalars: dict, pulled,
    *, check_overlap: bool = True,
) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    if param.dim() != 1:
        raise ValueError(f"param must be a 1-D flat buffer, got shape {tuple(param.shape)}")
    n, device = param.shape[0], param.device
    _check_buffer("param", param, n, device, _PARAM_DTYPES)
    if param.requires_grad:
        raise ValueError("param must not require grad: it is updated in place (pass param.detach())")
    _check_buffer("grad", grad, n, device, _PARAM_DTYPES)
    _check_buffer("pre_weight", pre_weight, n, device, _STATE_DTYPES)
    state_dtype = pre_weight.dtype
    if (shadow_weight is None) != (shadow_momentum is None):
        raise ValueError("shadow_weight and shadow_momentum must be given together (or both left out)")
    state = [("shadow_weight", shadow_weight), ("shadow_momentum", shadow_momentum),
             ("sync_momentum", sync_momentum)]
    for name, t in state:
        if t is not None:
            _check_buffer(name, t, n, device, _STATE_DTYPES)
            if t.dtype != state_dtype:
                raise TypeError(f"{name} must have pre_weight's dtype {state_dtype}, got {t.dtype}")
    if sync_momentum is not None and (shadow_weight is None or not pulled):
        raise ValueError("sync_momentum is written only on a pulled step with shadow buffers")
    if (state_dtype == torch.float64) != (param.dtype == torch.float64):
        raise TypeError(
            f"param and the state must both be float64 or neither, got {param.dtype} and {state_dtype}"
        )
    if not isinstance(pulled, bool):
        raise TypeError(f"pulled must be a bool, got {type(pulled).__name__}")
    for name in _SCALARS:
        value = scalars[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
    for name in ("lr", "local_lr", "weight_decay", "local_weight_decay"):
        if scalars[name] < 0:
            raise ValueError(f"{name} must be >= 0, got {scalars[name]!r}")
    if not 0.0 <= scalars["momentum"] < 1.0:
        raise ValueError(f"momentum must lie in [0, 1), got {scalars['momentum']!r}")
    if scalars["shadow_scale"] <= 0:
        raise ValueError(f"shadow_scale must be > 0, got {scalars['shadow_scale']!r}")
    if scalars["shadow_scale"] != 1.0 and not (pulled and shadow_weight is not None):
        raise ValueError("shadow_scale applies to a pulled step with shadow buffers; pass 1.0")
    # While torch.compile traces, tensors are fake and have no address; the op re-checks at run time.
    if not check_overlap or torch.compiler.is_compiling():
        return
    buffers = [("param", param), ("grad", grad), ("pre_weight", pre_weight)] + state
    spans = [
        (name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for name, t in buffers
        if t is not None and t.numel() and t.device.type != "meta"
    ]
    for i, (name_i, start_i, end_i) in enumerate(spans):
        for name_j, start_j, end_j in spans[i + 1 :]:
            if start_i < end_j and start_j < end_i:
                raise ValueError(f"{name_i} and {name_j} must not share memory")


@torch.library.custom_op(
    "tritonopt::ssd_sgd_step",
    mutates_args=("param", "pre_weight", "shadow_weight", "shadow_momentum", "sync_momentum"),
)
def _ssd_sgd_step_op(
    param: torch.Tensor,
    grad: torch.Tensor,
    pre_weight: torch.Tensor,
    shadow_weight: Optional[torch.Tensor],
    shadow_momentum: Optional[torch.Tensor],
    sync_momentum: Optional[torch.Tensor],
    lr: float,
    momentum: float,
    weight_decay: float,
    local_lr: float,
    local_weight_decay: float,
    glu_alpha: float,
    glu_beta: float,
    sync_coef: float,
    shadow_scale: float,
    pulled: bool,
) -> torch.Tensor:
    scalars = dict(zip(_SCALARS, (lr, momentum, weight_decay, local_lr, local_weight_decay,
                                  glu_alpha, glu_beta, sync_coef, shadow_scale)))
    _check_ssd_sgd_args(param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum,
                        scalars, pulled)
    args = (param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum,
            lr, momentum, weight_decay, local_lr, local_weight_decay, glu_alpha, glu_beta,
            sync_coef, shadow_scale, pulled)
    with nvtx_range("tritonopt/ssd_sgd/fused_step"):
        # The kernel computes in float32: float64 state takes the reference on every device.
        if select_backend(param.device) == "triton" and pre_weight.dtype != torch.float64:
            return _kernels.ssd_sgd_step_triton(*args)
        return _kernels.ssd_sgd_step_reference(*args)


@_ssd_sgd_step_op.register_fake
def _ssd_sgd_step_fake(param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum,
                       lr, momentum, weight_decay, local_lr, local_weight_decay, glu_alpha, glu_beta,
                       sync_coef, shadow_scale, pulled):
    scalars = dict(zip(_SCALARS, (lr, momentum, weight_decay, local_lr, local_weight_decay,
                                  glu_alpha, glu_beta, sync_coef, shadow_scale)))
    _check_ssd_sgd_args(param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum,
                        scalars, pulled, check_overlap=False)  # fake tensors have no storage
    return param.new_empty((), dtype=torch.int64)


def ssd_sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    pre_weight: torch.Tensor,
    *,
    shadow_weight: Optional[torch.Tensor] = None,
    shadow_momentum: Optional[torch.Tensor] = None,
    sync_momentum: Optional[torch.Tensor] = None,
    lr: float,
    momentum: float,
    weight_decay: float,
    local_lr: float,
    local_weight_decay: float,
    glu_alpha: float,
    glu_beta: float,
    sync_coef: float,
    pulled: bool = False,
    shadow_scale: float = 1.0,
) -> torch.Tensor:
    """One SSD-SGD iteration over flat buffers, in place: GLU local update plus shadow-server step.

    SSD-SGD (Xu et al.) Eq. 8 (descent sign) and Algorithm 2, fused with one
    step of the parameter server's momentum SGD (MXNet convention) applied to
    this worker's shadow copy of the server state::

        w_src = shadow_scale * shadow_weight   if pulled and shadow buffers are given, else param
        grad_sync = sync_coef * (pre_weight - w_src)                 # c = (1 - m) / (lr k)
        pre_weight = w_src                                           # if pulled
        param = w_src - local_lr * (glu_alpha * grad + local_weight_decay * w_src + glu_beta * grad_sync)
        sync_momentum = shadow_scale * shadow_momentum               # if given (pulled only)
        shadow_momentum = momentum * mom - lr * (grad + weight_decay * sw)
        shadow_weight = sw + shadow_momentum

    where ``sw``, ``mom`` are the shadow buffers, scaled by ``shadow_scale``
    on a pulled step (they then hold the sum over ranks).

    Args:
        param: ``[n]`` float32/float16/bfloat16 (or float64), contiguous; updated in place.
        grad: ``[n]``, any of those dtypes; this worker's own gradient; not modified.
        pre_weight: ``[n]`` float32 (float64 with a float64 ``param``): the last pulled
            global weight; overwritten with ``w_src`` when ``pulled``.
        shadow_weight, shadow_momentum: ``[n]``, ``pre_weight``'s dtype, together or not
            at all; the shadow server state, updated in place.
        sync_momentum: ``[n]``, optional, pulled steps with shadow buffers only:
            receives the pulled global momentum.
        lr, momentum, weight_decay: the server's momentum SGD (``0 <= momentum < 1``).
        local_lr, local_weight_decay, glu_alpha, glu_beta: Eq. 8.
        sync_coef: ``(1 - momentum) / (lr * k)`` (0 when ``lr`` is 0).
        pulled: this is the first local update after a pull.
        shadow_scale: ``1 / K`` when the shadow buffers hold the sum of ``K`` ranks'
            shadows (pulled steps only), else 1.

    Returns:
        A 0-d int64 tensor: the number of elements whose new ``param`` was NaN or
        +-inf. Those elements keep ``w_src``, and their ``shadow_weight`` becomes
        NaN, so the event reaches every rank with the next all-reduce.

    Float64 state runs the PyTorch reference on every device.

    Raises:
        TypeError / ValueError: naming the offending argument, before anything is modified.
    """
    scalars = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, local_lr=local_lr,
                   local_weight_decay=local_weight_decay, glu_alpha=glu_alpha, glu_beta=glu_beta,
                   sync_coef=sync_coef, shadow_scale=shadow_scale)
    _check_ssd_sgd_args(param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum,
                        scalars, pulled)
    return torch.ops.tritonopt.ssd_sgd_step(
        param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum,
        *(float(scalars[name]) for name in _SCALARS), pulled,
    )
