"""Runtime services shared by every op: backend choice, autotuning, NVTX ranges.

Nothing here queries a device at import time, so ``import tritonopt`` works on a
machine without a GPU, without CUDA, and without Triton.

Backends
--------
An op runs either its Triton kernel or its plain-PyTorch reference:

* ``"triton"`` for CUDA tensors, and for CPU tensors when the Triton interpreter
  is on (``TRITON_INTERPRET=1`` in the environment when tritonopt is imported:
  Triton reads the variable when it decorates a kernel, so later changes have
  no effect on kernels already defined);
* ``"reference"`` otherwise.

``TRITONOPT_BACKEND=triton|reference`` (read at every call) or the
:func:`use_backend` context manager forces one; forcing ``"triton"`` where it
cannot run raises :class:`BackendUnavailableError` with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Callable, Iterator, Sequence

import torch

try:  # Triton is a Linux-only dependency; the reference path serves elsewhere.
    import triton
    import triton.language as tl

    HAS_TRITON = True
    _TRITON_IMPORT_ERROR: str | None = None
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess test
    triton = None
    HAS_TRITON = False
    _TRITON_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

    class _MissingTritonLanguage:
        """Stands in for ``triton.language`` so kernel signatures still parse."""

        def __getattr__(self, name: str) -> object:
            return object()

    tl = _MissingTritonLanguage()

BACKENDS = ("triton", "reference")
_BACKEND_ENV = "TRITONOPT_BACKEND"
_AUTOTUNE_ENV = "TRITONOPT_AUTOTUNE"
_NVTX_ENV = "TRITONOPT_NVTX"

# Captured once: kernels are decorated at import, so this is what they were built for.
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"

_forced = threading.local()


class BackendUnavailableError(RuntimeError):
    """A backend was forced where it cannot run."""


def interpreter_enabled() -> bool:
    """True when Triton kernels were defined under ``TRITON_INTERPRET=1``."""
    return INTERPRETER and HAS_TRITON


def _requested_backend() -> str:
    forced = getattr(_forced, "backend", None)
    if forced is not None:
        return forced
    value = os.environ.get(_BACKEND_ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value not in BACKENDS:
        raise ValueError(
            f"{_BACKEND_ENV}={value!r} is not a backend; use one of 'auto', 'triton', 'reference'"
        )
    return value


def _triton_unavailable_reason(device: torch.device) -> str | None:
    """Why Triton cannot run on ``device``, or None when it can."""
    if not HAS_TRITON:
        return f"Triton is not importable ({_TRITON_IMPORT_ERROR})"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if INTERPRETER:
            return None
        return (
            "the tensors are on the CPU and the Triton interpreter is off "
            "(set TRITON_INTERPRET=1 before importing tritonopt)"
        )
    return f"tritonopt has no Triton kernels for device type {device.type!r}"


def select_backend(device: torch.device) -> str:
    """The backend an op on tensors of ``device`` runs: ``"triton"`` or ``"reference"``."""
    requested = _requested_backend()
    reason = _triton_unavailable_reason(device)
    if requested == "reference":
        return "reference"
    if requested == "triton":
        if reason is not None:
            raise BackendUnavailableError(f"the Triton backend was forced but {reason}")
        return "triton"
    return "reference" if reason is not None else "triton"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``"triton"``, ``"reference"`` or ``"auto"`` inside a ``with`` block (this thread).

    Takes precedence over ``TRITONOPT_BACKEND``.
    """
    if name not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {name!r}")
    previous = getattr(_forced, "backend", None)
    _forced.backend = None if name == "auto" else name
    try:
        yield
    finally:
        _forced.backend = previous


# --------------------------------------------------------------------------- autotune


def autotune_enabled() -> bool:
    """Multi-config autotuning needs a GPU driver; the interpreter has none."""
    return (
        HAS_TRITON
        and not INTERPRETER
        and os.environ.get(_AUTOTUNE_ENV, "1").strip() not in ("0", "false", "off")
    )


def autotune(
    configs: Callable[[], Sequence["triton.Config"]],
    key: Sequence[str],
    *,
    restore_value: Sequence[str] = (),
    reset_to_zero: Sequence[str] = (),
) -> Callable:
    """``triton.autotune`` with tritonopt's rules.

    ``configs`` is a function so nothing Triton-specific runs where Triton is
    missing. Keys should name power-of-two buckets (constexpr block sizes or
    explicit ``*_bucket`` arguments) so new shapes rarely trigger a re-tune.
    Kernels that update a buffer in place must list it in ``restore_value``
    (each candidate config runs the kernel once). Under the interpreter or with
    ``TRITONOPT_AUTOTUNE=0`` (read at import) only the first config is kept.
    """

    def decorate(kernel):
        if not HAS_TRITON:
            return kernel
        candidates = list(configs())
        if not candidates:
            raise ValueError("autotune needs at least one config")
        if not autotune_enabled():
            candidates = candidates[:1]
        return triton.autotune(
            configs=candidates,
            key=list(key),
            restore_value=list(restore_value),
            reset_to_zero=list(reset_to_zero),
        )(kernel)

    return decorate


def jit(fn):
    """``triton.jit`` where Triton exists; the undecorated function otherwise."""
    return triton.jit(fn) if HAS_TRITON else fn


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- NVTX


@functools.cache
def _nvtx_module():
    if os.environ.get(_NVTX_ENV, "1").strip() in ("0", "false", "off"):
        return None
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx


def nvtx_range(name: str) -> contextlib.AbstractContextManager:
    """A named NVTX range (``tritonopt/<algo>/<phase>``) or a no-op without the ``nvtx`` package.

    ``torch.cuda.nvtx`` is not used: it raises on CPU builds of torch. While
    ``torch.compile`` traces, no range is opened: it would not be part of the graph.
    """
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    nvtx = _nvtx_module()
    if nvtx is None:
        return contextlib.nullcontext()
    return nvtx.annotate(name, domain="tritonopt")
