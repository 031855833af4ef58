"""``ssd_sgd_step``: declaration (kernel and reference: :mod:`tritonopt.kernels.ssd_sgd`)."""

from __future__ import annotations

from typing import Optional

import torch

from tritonopt._ops._registry import define_op
from tritonopt._validation import (FLOAT_DTYPES, check_bool, check_disjoint, check_float, check_same_device,
                                   check_tensor)
from tritonopt.kernels import ssd_sgd as _kernels

__all__ = ["ssd_sgd_step"]

_PARAM_DTYPES = (*FLOAT_DTYPES, torch.float64)
_STATE_DTYPES = (torch.float32, torch.float64)
_UPDATED = ("param", "pre_weight", "shadow_weight", "shadow_momentum", "sync_momentum")


@define_op("ssd_sgd_step", mutates_args=_UPDATED, nvtx="tritonopt/ssd_sgd/fused_step")
def ssd_sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    pre_weight: torch.Tensor,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    local_lr: float,
    local_weight_decay: float,
    glu_alpha: float,
    glu_beta: float,
    sync_coef: float,
    shadow_weight: Optional[torch.Tensor] = None,
    shadow_momentum: Optional[torch.Tensor] = None,
    sync_momentum: Optional[torch.Tensor] = None,
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
        grad: ``[n]``, any of those dtypes, contiguous; this worker's own gradient; not modified.
        pre_weight: ``[n]`` float32 (float64 with a float64 ``param``): the last pulled
            global weight; overwritten with ``w_src`` when ``pulled``.
        lr, momentum, weight_decay: the server's momentum SGD (``0 <= momentum < 1``).
        local_lr, local_weight_decay, glu_alpha, glu_beta: Eq. 8.
        sync_coef: ``(1 - momentum) / (lr * k)`` (0 when ``lr`` is 0).
        shadow_weight, shadow_momentum: ``[n]``, ``pre_weight``'s dtype, together or not
            at all; the shadow server state, updated in place.
        sync_momentum: ``[n]``, optional, pulled steps with shadow buffers only:
            receives the pulled global momentum.
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
    check_tensor("param", param, ndim=1, dtypes=_PARAM_DTYPES, updated_in_place=True)
    check_tensor("grad", grad, shape=param.shape, dtypes=_PARAM_DTYPES, contiguous=True)
    check_tensor("pre_weight", pre_weight, shape=param.shape, dtypes=_STATE_DTYPES, updated_in_place=True)
    if (pre_weight.dtype == torch.float64) != (param.dtype == torch.float64):
        raise TypeError(
            f"param and the state must both be float64 or neither, got {param.dtype} and {pre_weight.dtype}"
        )
    if (shadow_weight is None) != (shadow_momentum is None):
        raise ValueError("shadow_weight and shadow_momentum must be given together (or both left out)")
    state = {"shadow_weight": shadow_weight, "shadow_momentum": shadow_momentum, "sync_momentum": sync_momentum}
    for name, t in state.items():
        if t is None:
            continue
        check_tensor(name, t, shape=param.shape)
        if t.dtype != pre_weight.dtype:
            raise TypeError(f"{name} must have pre_weight's dtype {pre_weight.dtype}, got {t.dtype}")
        check_tensor(name, t, updated_in_place=True)
    check_same_device("param", param, grad=grad, pre_weight=pre_weight, **state)
    check_bool("pulled", pulled)
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("local_lr", local_lr),
                        ("local_weight_decay", local_weight_decay)):
        check_float(name, value, low=0.0)
    check_float("momentum", momentum, low=0.0, high=1.0, high_open=True)
    check_float("glu_alpha", glu_alpha)
    check_float("glu_beta", glu_beta)
    check_float("sync_coef", sync_coef)
    check_float("shadow_scale", shadow_scale, low=0.0, low_open=True)
    if sync_momentum is not None and (shadow_weight is None or not pulled):
        raise ValueError("sync_momentum is written only on a pulled step with shadow buffers")
    if shadow_scale != 1.0 and not (pulled and shadow_weight is not None):
        raise ValueError("shadow_scale applies to a pulled step with shadow buffers; pass 1.0")
    check_disjoint({"param": param, "grad": grad, "pre_weight": pre_weight, **state}, updated=_UPDATED)


@ssd_sgd_step.register_fake
def _(param, grad, pre_weight, *args, **kwargs):
    return param.new_empty((), dtype=torch.int64)


def _keyword_call(choose_launcher):
    """Adapts a launcher taking every argument positionally (the kernels' order)."""

    def run(param, grad, pre_weight, *, lr, momentum, weight_decay, local_lr, local_weight_decay, glu_alpha,
            glu_beta, sync_coef, shadow_weight=None, shadow_momentum=None, sync_momentum=None, pulled=False,
            shadow_scale=1.0):
        return choose_launcher(pre_weight)(
            param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum, lr, momentum, weight_decay,
            local_lr, local_weight_decay, glu_alpha, glu_beta, sync_coef, shadow_scale, pulled,
        )

    return run


def _triton_launcher(pre_weight: torch.Tensor):
    # The kernel computes in float32: float64 state takes the reference on every device.
    return _kernels.ssd_sgd_step_reference if pre_weight.dtype == torch.float64 else _kernels.ssd_sgd_step_triton


ssd_sgd_step.register_backends(
    triton=_keyword_call(_triton_launcher), reference=_keyword_call(lambda pre_weight: _kernels.ssd_sgd_step_reference)
)
