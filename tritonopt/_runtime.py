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

An op may declare that on CUDA tensors its reference runs by default (``cuda_default``):
the K-FAC matrix products and the low-rank compression, whose cuBLAS path was measured
faster than their kernels on an H100. Forcing ``"triton"`` still runs the kernel.

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


def select_backend(device: torch.device, *, cuda_default: str = "triton") -> str:
    """The backend an op on tensors of ``device`` runs: ``"triton"`` or ``"reference"``.

    ``cuda_default`` is what an op runs on CUDA tensors when nothing is forced: ``"reference"``
    for the ops whose PyTorch path (cuBLAS) was measured faster than their kernel on a GPU.
    """
    if cuda_default not in BACKENDS:
        raise ValueError(f"cuda_default must be 'triton' or 'reference', got {cuda_default!r}")
    requested = _requested_backend()
    reason = _triton_unavailable_reason(device)
    if requested == "reference":
        return "reference"
    if requested == "triton":
        if reason is not None:
            raise BackendUnavailableError(f"the Triton backend was forced but {reason}")
        return "triton"
    if reason is not None:
        return "reference"
    return cuda_default if device.type == "cuda" else "triton"


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

# TRITONOPT_AUTOTUNE values: "1" (default) times the configs of kernels whose
# result does not depend on the config and pins the others; "all" times every
# kernel; "0" pins every kernel.
_AUTOTUNE_MODES = {"1": "default", "true": "default", "on": "default", "default": "default",
                   "all": "all", "0": "off", "false": "off", "off": "off"}


def autotune_mode() -> str:
    """``"default"``, ``"all"`` or ``"off"`` from ``TRITONOPT_AUTOTUNE`` (read at import of each kernel)."""
    value = os.environ.get(_AUTOTUNE_ENV, "1").strip().lower()
    if value not in _AUTOTUNE_MODES:
        raise ValueError(f"{_AUTOTUNE_ENV}={value!r} is not a mode; use 1 (default), all or 0")
    return _AUTOTUNE_MODES[value]


def autotune_enabled() -> bool:
    """Timing configs needs a GPU driver (the interpreter has none) and ``TRITONOPT_AUTOTUNE`` != 0."""
    return HAS_TRITON and not INTERPRETER and autotune_mode() != "off"


class TuningSpace:
    """The configs a kernel may run with, and how one is picked for a launch.

    ``configs`` is the declared space in order of preference. ``prune(configs,
    key_args)`` (optional) drops the configs that do not fit a shape (they spill,
    or need more shared memory than a GPU has); it sees only the autotune key's
    arguments, so the configs left are a function of the key. ``pinned`` marks a
    kernel whose floating-point reduction order depends on the config: it runs the
    first launchable config of its key, never the fastest by timing, so two
    processes given the same inputs compute the same bits.
    """

    def __init__(self, configs, key, arg_names, prune, pinned):
        self.configs = tuple(configs)
        self.key = tuple(key)
        self.arg_names = tuple(arg_names)
        self.prune = prune
        self.pinned = pinned

    def key_arguments(self, args: Sequence, kwargs: dict) -> dict:
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        return {name: named[name] for name in self.key}

    def launchable(self, key_args: dict) -> list:
        configs = list(self.configs)
        if self.prune is not None:
            configs = list(self.prune(configs, dict(key_args)))
        if not configs:
            raise ValueError(f"no config fits the key {key_args}")
        return configs

    def choose(self, key_args: dict):
        """The config a launch runs with when configs are not timed: the first launchable one."""
        return self.launchable(key_args)[0]


def tuning_space(kernel) -> TuningSpace | None:
    """The :class:`TuningSpace` of a kernel decorated with :func:`autotune` (None for a plain kernel)."""
    return getattr(kernel, "tuning_space", None)


if HAS_TRITON:
    from triton.runtime.jit import KernelInterface as _KernelInterface
else:  # pragma: no cover - no kernels are built without Triton
    _KernelInterface = object


class PinnedKernel(_KernelInterface):
    """A kernel that runs, for each key, the config :meth:`TuningSpace.choose` names.

    ``cache`` maps each key met (the key's values, then the dtypes of the tensor
    arguments, as Triton's autotuner keys them) to the config it ran with, so the
    choices can be recorded next to the timed ones.
    """

    def __init__(self, fn, space: TuningSpace):
        self.fn = fn
        self.tuning_space = space
        self.configs = list(space.configs)
        self.keys = list(space.key)
        self.arg_names = list(space.arg_names)
        self.cache: dict = {}

    def run(self, *args, **kwargs):
        key_args = self.tuning_space.key_arguments(args, kwargs)
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        key = tuple(key_args.values()) + tuple(
            str(v.dtype) for name, v in named.items() if name in self.arg_names and hasattr(v, "dtype")
        )
        config = self.cache.get(key)
        if config is None:
            config = self.cache[key] = self.tuning_space.choose(key_args)
        return self.fn.run(*args, **kwargs, **config.all_kwargs())


def candidate_configs(kernel, key_args: dict) -> list:
    """The configs a launch of ``kernel`` at these key values may run with (one when pinned).

    Launchers size buffers that depend on the config (per-program partial sums) from it.
    """
    space = tuning_space(kernel)
    if isinstance(kernel, PinnedKernel):
        return [space.choose(key_args)]
    return space.launchable(key_args)


def autotune(
    configs: Callable[[], Sequence["triton.Config"]],
    key: Sequence[str],
    *,
    prune: Callable[[list, dict], list] | None = None,
    pinned: bool = False,
    restore_value: Sequence[str] = (),
    reset_to_zero: Sequence[str] = (),
) -> Callable:
    """Decorate a kernel with a config space, following tritonopt's rules.

    ``configs`` is a function so nothing Triton-specific runs where Triton is
    missing. Keys should name power-of-two buckets (constexpr block sizes or
    explicit ``*_bucket`` arguments) so new shapes rarely trigger a re-tune.
    ``prune`` drops the configs unfit for a key (see :class:`TuningSpace`).

    ``pinned=True`` declares that the kernel's floating-point reduction order
    depends on the config: the kernel then runs the first launchable config of
    each key (:class:`PinnedKernel`) instead of the fastest one by timing, which
    would be chosen anew in every process. Kernels whose result is the same bits
    under every config (integer reductions, one writer per element) are timed by
    Triton's autotuner on a GPU; those that update a buffer in place must list it
    in ``restore_value`` (each candidate config runs the kernel once).

    ``TRITONOPT_AUTOTUNE=0`` pins every kernel, ``all`` times every kernel
    (pinned ones too: faster, but reproducible across processes only while
    Triton's on-disk autotune cache, ``TRITON_CACHE_AUTOTUNING=1``, is kept).
    Under the interpreter every kernel is pinned.
    """

    def decorate(kernel):
        if not HAS_TRITON:
            return kernel
        candidates = list(configs())
        if not candidates:
            raise ValueError("autotune needs at least one config")
        space = TuningSpace(candidates, key, kernel.arg_names, prune, pinned)
        timed = autotune_enabled() and (autotune_mode() == "all" or not pinned)
        if not timed or len(candidates) == 1:
            return PinnedKernel(kernel, space)

        def early_config_prune(configs_, named_args, **kwargs):
            return space.launchable(space.key_arguments((), {**named_args, **kwargs}))

        tuner = triton.autotune(
            configs=candidates,
            key=list(key),
            prune_configs_by={"early_config_prune": early_config_prune},
            restore_value=list(restore_value),
            reset_to_zero=list(reset_to_zero),
        )(kernel)
        tuner.tuning_space = space
        return tuner

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
