"""K-FAC's constructor arguments: the six hyperparameters (constants or schedules) and their checks."""

from __future__ import annotations

from typing import Callable, Union

import torch

from tritonopt._validation import check_float, check_int
from tritonopt.ops import eigenbasis_precondition_prediv

__all__ = ["HYPERPARAMETERS", "Schedule", "check_grad_scaler", "check_hyperparameter", "check_precision"]

Schedule = Union[float, int, Callable[[int], float]]
HYPERPARAMETERS = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")


def check_hyperparameter(name: str, value) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is valid for it."""
    if name in ("factor_update_steps", "inv_update_steps"):
        check_int(name, value, low=1)
    elif name == "damping":
        check_float(name, value, low=0.0, low_open=True)
    elif name == "factor_decay":
        check_float(name, value, low=0.0, high=1.0, low_open=True)
    elif name == "kl_clip":
        if value is not None:
            check_float(name, value, low=0.0, low_open=True)
    elif name == "lr":
        check_float(name, value, low=0.0)
    else:
        raise ValueError(f"unknown K-FAC hyperparameter {name!r}")


def check_precision(precision) -> None:
    """Raise naming ``precision`` unless the kernels know it."""
    # The preconditioning op owns the list of precisions: run its argument checks on meta tensors.
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a str, got {type(precision).__name__}")
    probe = torch.empty((1, 1), device="meta")
    eigenbasis_precondition_prediv(probe, probe, probe, probe, precision=precision)


def check_grad_scaler(grad_scaler) -> None:
    """Raise ``TypeError`` unless ``grad_scaler`` is a GradScaler, a function or None."""
    if grad_scaler is None or isinstance(grad_scaler, torch.amp.GradScaler) or callable(grad_scaler):
        return
    raise TypeError(
        "grad_scaler must be a torch.amp.GradScaler, a function returning the current loss scale, or None; "
        f"got {type(grad_scaler).__name__}"
    )
