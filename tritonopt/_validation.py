"""Argument checks shared by every op and optimizer, with messages that name the argument.

The conventions, so that a caller can rely on the exception class:

* ``TypeError``: a value of the wrong kind (not a tensor, wrong dtype, a float
  where an int is needed, a bool where a number is needed);
* ``ValueError``: the right kind with a wrong value (shape, range, device,
  layout, non-finite numbers, shared memory, an unknown choice).

Every message starts with the argument's name. The checks never modify their
arguments, so an op or optimizer that runs them first changes nothing when one
fails. Checks that would read tensor data or addresses are skipped while
``torch.compile`` traces (the tensors are fake then); the op re-runs them when
the compiled code executes.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    """``"float32, float16 or bfloat16"`` for a message."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_tensor(
    name: str,
    value,
    *,
    ndim: Optional[int | Sequence[int]] = None,
    shape: Optional[Sequence[int]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    contiguous: bool = False,
    updated_in_place: bool = False,
) -> None:
    """``value`` is a tensor with the given rank, shape and dtype (any when ``None``).

    ``updated_in_place`` also requires it contiguous and not requiring grad,
    with a message saying why.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            wanted = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name} must be {wanted}, got shape {tuple(value.shape)}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must be {dtype_names(dtypes)}, got {value.dtype}")
    if updated_in_place:
        if not value.is_contiguous():
            raise ValueError(f"{name} must be contiguous: it is updated in place")
        if value.requires_grad:
            raise ValueError(f"{name} must not require grad: it is updated in place")
    elif contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def check_row_major(name: str, value: torch.Tensor, *, updated_in_place: bool = False) -> None:
    """A 2-D tensor whose rows are contiguous; rows may be padded (``stride(0) >= shape[1]``).

    Buffers allocated as ``[m, ceil16(n)]`` and passed as their ``[:, :n]`` view
    keep every row aligned for vector loads.
    """
    if value.dim() != 2 or (value.numel() and (value.stride(1) != 1 or value.stride(0) < value.shape[1])):
        raise ValueError(
            f"{name} must be row-major (contiguous rows, padding after each row allowed), got strides "
            f"{tuple(value.stride())}"
        )
    if updated_in_place and value.requires_grad:
        raise ValueError(f"{name} must not require grad: it is updated in place")


def check_same_device(reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Every tensor in ``others`` (``None`` ones skipped) is on ``reference``'s device."""
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


def _is_int(value) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, torch.SymInt)


def check_int(name: str, value, *, low: Optional[int] = None, high: Optional[int] = None) -> None:
    """``value`` is an int (not a bool) with ``low <= value <= high``.

    A ``torch.SymInt`` (an int that ``torch.compile`` traces symbolically) is accepted
    and its range is left to the run-time check.
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, torch.SymInt):
        return
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            raise ValueError(f"{name} must be an int >= {low}, got {value}")
        if low is None:
            raise ValueError(f"{name} must be an int <= {high}, got {value}")
        raise ValueError(f"{name} must satisfy {low} <= {name} <= {high}, got {value}")


def check_float(
    name: str,
    value,
    *,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """``value`` is a finite real number (int or float, not a bool or a tensor) in the range."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float (a tensor {name} is not supported)")
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def _memory_span(t: torch.Tensor) -> Optional[tuple[torch.device, int, int]]:
    """``(device, first byte, one past the last byte)`` that ``t`` can touch, or None without storage."""
    # Tensor subclasses (fake tensors while tracing, wrappers) do not expose the memory they use.
    if t.numel() == 0 or t.device.type == "meta" or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    start = t.data_ptr()
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return t.device, start, start + extent * t.element_size()


def check_disjoint(tensors: dict[str, Optional[torch.Tensor]], updated: Sequence[str]) -> None:
    """No tensor named in ``updated`` (written in place) shares memory with another of ``tensors``.

    ``tensors`` maps argument names to tensors (``None`` skipped), in the op's
    argument order, which the message follows. Tensors that are only read may
    share memory among themselves. Skipped while ``torch.compile`` traces and
    for tensors without storage.
    """
    if torch.compiler.is_compiling():
        return
    spans = [(n, _memory_span(t)) for n, t in tensors.items() if t is not None]
    spans = [(n, span) for n, span in spans if span is not None]
    for i, (a, (a_device, a_start, a_end)) in enumerate(spans):
        for b, (b_device, b_start, b_end) in spans[i + 1 :]:
            if (a in updated or b in updated) and a_device == b_device and a_start < b_end and b_start < a_end:
                written = a if a in updated else b
                raise ValueError(f"{a} and {b} must not share memory: {written} is updated in place")
