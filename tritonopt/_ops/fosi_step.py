"""``fosi_step``: declaration (kernels and reference: :mod:`tritonopt.kernels.fosi_step`)."""

from __future__ import annotations

from typing import Optional

import torch

from tritonopt._ops._registry import define_op
from tritonopt._validation import (FLOAT_DTYPES, check_choice, check_disjoint, check_float, check_int,
                                   check_row_major, check_same_device, check_tensor)
from tritonopt.kernels import fosi_step as _kernels
from tritonopt.kernels.fosi_step import BASES, MAX_RANK

__all__ = ["fosi_step"]


def _check_vector(name: str, t, n: int, param: torch.Tensor, *, dtypes=(torch.float32,), updated=False) -> None:
    check_tensor(name, t)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must be 1-D with {n} entries, got shape {tuple(t.shape)}")
    check_tensor(name, t, dtypes=dtypes)
    check_same_device("param", param, **{name: t})
    check_tensor(name, t, contiguous=True, updated_in_place=updated)


@define_op("fosi_step", mutates_args=("param", "state_a", "state_b", "g1_velocity"), nvtx="tritonopt/fosi/update")
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
        basis: ``[r, n]`` float32, row-major (rows may be padded), orthonormal rows (``r = k + l <= 64``;
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
    check_tensor("param", param, dtypes=(torch.float32,))
    if param.dim() != 1:
        raise ValueError(f"param must be a 1-D float32 buffer, got shape {tuple(param.shape)}")
    check_tensor("param", param, updated_in_place=True)
    n = param.shape[0]
    _check_vector("grad", grad, n, param, dtypes=FLOAT_DTYPES)
    check_tensor("basis", basis)
    if basis.dim() != 2 or basis.shape[1] != n:
        raise ValueError(f"basis must be [r, {n}], got shape {tuple(basis.shape)}")
    check_tensor("basis", basis, dtypes=(torch.float32,))
    check_same_device("param", param, basis=basis)
    check_row_major("basis", basis)
    r = basis.shape[0]
    if r > MAX_RANK:
        raise ValueError(f"basis may have at most {MAX_RANK} rows (k + l), got {r}")
    _check_vector("newton_scale", newton_scale, r, param)
    check_choice("base", base, BASES)
    if base in ("heavy_ball", "adam"):
        if state_a is None:
            raise ValueError(f"state_a is required for base={base!r}")
        _check_vector("state_a", state_a, n, param, updated=True)
    if base == "adam":
        if state_b is None:
            raise ValueError("state_b is required for base='adam'")
        _check_vector("state_b", state_b, n, param, updated=True)
    if g1_velocity is not None:
        _check_vector("g1_velocity", g1_velocity, r, param, updated=True)
    check_float("lr", lr, low=0.0)
    check_float("beta1", beta1, low=0.0, high=1.0)
    check_float("beta2", beta2, low=0.0, high=1.0)
    check_float("eps", eps, low=0.0)
    check_float("base_scale", base_scale)
    check_float("g1_decay", g1_decay)
    check_float("g1_gain", g1_gain)
    check_int("step", step, low=1)
    if base == "adam" and (beta1 >= 1.0 or beta2 >= 1.0):
        raise ValueError("beta1 and beta2 must be < 1 for base='adam'")
    check_disjoint(
        {"param": param, "grad": grad, "basis": basis, "newton_scale": newton_scale,
         "state_a": state_a, "state_b": state_b, "g1_velocity": g1_velocity},
        updated=("param", "state_a", "state_b", "g1_velocity"),
    )


@fosi_step.register_fake
def _(param, grad, basis, newton_scale, *args, **kwargs):
    return None


def _keyword_call(launcher):
    """Adapts a launcher taking every argument positionally (the kernels' order)."""

    def run(param, grad, basis, newton_scale, *, base="adam", state_a=None, state_b=None, lr=1e-3,
            beta1=0.9, beta2=0.999, eps=1e-8, step=1, base_scale=1.0, g1_velocity=None, g1_decay=0.0,
            g1_gain=1.0):
        launcher(param, grad, basis, newton_scale, state_a, state_b, g1_velocity,
                 base, lr, beta1, beta2, eps, step, base_scale, g1_decay, g1_gain)

    return run


fosi_step.register_backends(
    triton=_keyword_call(_kernels.fosi_step_triton), reference=_keyword_call(_kernels.fosi_step_reference)
)
