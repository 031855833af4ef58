"""Overlapped recompute for a DSP stage (paper sec. 3.3; ``recompute="overlap"``).

Between the forward of batch ``t`` and the backward that follows it (of ``t - m_k``) the
stage takes no step, so the recomputation of ``t - m_k`` can run while ``t`` is forwarded:
on the CPU in a worker thread, on CUDA on a side stream. The results are the serial ones,
bit for bit: the recomputation runs on a *shadow* of the block (the same parameters and
hooks, its own copies of the buffers, taken before the forward of ``t``), draws its random
numbers from a private generator started at the stored RNG state (a dispatch mode in the
worker hands it to every RNG op; on CUDA the host replays the state as the serial path
does), and builds its graph in the caller's grad mode and autocast state. Under
``bn_policy="recompute"`` the shadow's buffers are copied into the block afterwards; under
``"forward"`` they are dropped.

A recomputation that would not equal the serial one runs serially instead: when the
forward of ``t`` changed a buffer the recomputation reads (any buffer other than the
running statistics of a normalisation layer in training mode, which it only writes), when
the parameters changed in between, or when an RNG op offers no generator argument.
:class:`OverlappedRecompute` is what :class:`~tritonopt.dist.dsp_core.StageCompute` holds
for it; the queue, the serial path and the step stay there.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import TorchDispatchMode

from tritonopt._runtime import nvtx_range

__all__ = ["OverlappedRecompute"]

# replay_rng(rng_state, devices): a context in which the RNG streams start at rng_state and
# after which they continue where they were (the serial recomputation's replay).
ReplayRng = Callable[[object, Sequence[torch.device]], ContextManager[None]]


class _NeedsSerial(Exception):
    """The overlapped recomputation cannot equal the serial one; the stage recomputes serially."""


class _PrivateGenerator(TorchDispatchMode):
    """Hands ``generator`` to every RNG op of the thread that enters it (dispatch modes are per thread).

    Ops whose schema has no generator argument are called through their ``generator``
    overload (``rand.default`` -> ``rand.generator``); an op with neither raises
    :class:`_NeedsSerial` before it draws, so the process's default generator is never touched.
    """

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if torch.Tag.nondeterministic_seeded in func.tags:
            func, args, kwargs = self._seeded(func, tuple(args), kwargs)
        return func(*args, **kwargs)

    def _seeded(self, func, args: tuple, kwargs: dict):
        names = [a.name for a in func._schema.arguments]
        if "generator" not in names:
            overload = "generator" if func._overloadname == "default" else f"{func._overloadname}_generator"
            sibling = getattr(func.overloadpacket, overload, None)
            if sibling is None or [a.name for a in sibling._schema.arguments if a.name != "generator"] != names:
                raise _NeedsSerial(f"{func} draws random numbers but takes no generator")
            func, names = sibling, [a.name for a in sibling._schema.arguments]
        index = names.index("generator")
        if index < len(args) and not func._schema.arguments[index].kwarg_only:
            if args[index] is None:
                args = args[:index] + (self.generator,) + args[index + 1:]
        elif kwargs.get("generator") is None:
            kwargs["generator"] = self.generator
        return func, args, kwargs


def _shadow(module: nn.Module, memo: Optional[dict] = None) -> nn.Module:
    """A copy of ``module`` sharing its parameters, hooks and attributes, with buffers of its own.

    Each submodule is copied shallowly (so hooks registered on the block also run on the
    shadow) and given fresh clones of its buffers; attributes a forward pass sets (for
    example a weight-norm pre-hook's) land on the shadow, not on the block.
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    copy = object.__new__(type(module))
    copy.__dict__.update(module.__dict__)
    memo[id(module)] = copy
    buffers = {}
    for name, b in module._buffers.items():
        if b is not None and id(b) not in memo:  # a buffer shared by two submodules stays shared
            memo[id(b)] = b.detach().clone()
        buffers[name] = None if b is None else memo[id(b)]
    copy.__dict__["_buffers"] = buffers
    copy.__dict__["_modules"] = {
        name: None if child is None else _shadow(child, memo) for name, child in module._modules.items()
    }
    return copy


def _write_only_buffers(module: nn.Module) -> set[int]:
    """Ids of the buffers a forward pass writes but whose output does not read them.

    The running statistics of a normalisation layer in training mode: its output uses the
    batch's statistics.
    """
    ids = set()
    for sub in module.modules():
        if isinstance(sub, _NormBase) and sub.training:
            ids.update(id(b) for b in sub.buffers(recurse=False))
    return ids


def _versions(tensors) -> list[tuple[int, int]]:
    return [(id(t), t._version) for t in tensors]


def _read_buffers(module: nn.Module) -> list[tuple[int, int]]:
    """Identity and version of every buffer the block's output may read."""
    write_only = _write_only_buffers(module)
    return _versions(b for b in module.buffers() if id(b) not in write_only)


def _autocast_devices() -> list[tuple[str, torch.dtype]]:
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


def _thread_local_modes() -> Callable[[], contextlib.ExitStack]:
    """The caller's grad mode and autocast states, as a context to enter in another thread.

    Autocast's weight cache is not carried over (each thread has its own); the overlap
    runs only where the caller disabled it.
    """
    grad_enabled = torch.is_grad_enabled()
    autocast = _autocast_devices()

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad_enabled))
        for device_type, dtype in autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
        return stack

    return enter


@dataclass(eq=False)
class _Prefetch:
    """A recomputation started beside the forward of the batch before its backward."""

    batch: int
    shadow: nn.Module
    parameter_versions: list[tuple[int, int]]
    read_buffer_versions: Optional[list[tuple[int, int]]]  # checked under bn_policy="forward"
    thread: Optional[threading.Thread] = None
    cuda_done: Optional[object] = None  # a torch.cuda.Event on the side stream
    output: Optional[torch.Tensor] = None
    error: Optional[BaseException] = None


def _wait_for_side_stream(prefetch: _Prefetch) -> None:
    """The caller's stream waits for a recomputation on the side stream, used or dropped.

    Its shadow buffers and output were allocated on the caller's stream; dropped without the
    wait, the caching allocator could hand their memory to the caller's next kernels while the
    side stream still writes it.
    """
    if prefetch.cuda_done is not None:
        torch.cuda.current_stream(prefetch.output.device).wait_event(prefetch.cuda_done)


@dataclass(eq=False)
class OverlappedRecompute:
    """One stage's recomputation of the next backward's input, run beside its forward.

    Args:
        module: the stage's block.
        bn_policy: the stage's ``"forward"`` or ``"recompute"``: whether the recomputation's
            buffer update is dropped or copied into the block.
        needs_input_grad: whether the recomputed graph must reach the block's input (every
            stage but the first).
        replay_rng: the stage's serial RNG replay, used on CUDA where the host replays the state.

    :meth:`start` is called from the stage's ``forward`` and :meth:`take` from its ``backward``,
    directly: the fallback warning names the stage's line (``stacklevel``).
    """

    module: nn.Module
    bn_policy: str
    needs_input_grad: bool
    replay_rng: ReplayRng
    # Why the stage recomputes serially from now on (None: it overlaps).
    off_reason: Optional[str] = field(default=None, init=False)
    _running: Optional[_Prefetch] = field(default=None, init=False, repr=False)
    _side_stream: Optional[object] = field(default=None, init=False, repr=False)

    def start(self, batch: int, inputs: torch.Tensor, rng_state) -> None:
        """Start recomputing ``batch`` from ``inputs`` on a shadow of the block, beside the forward about to run."""
        if _autocast_devices() and torch.is_autocast_cache_enabled():
            # The serial recomputation may use weights cast (and cached) before the last updates.
            self._turn_off(
                "autocast caches weight casts per thread; pass cache_enabled=False to torch.autocast to overlap"
            )
            return
        if self.needs_input_grad:
            inputs.requires_grad_(True)
        prefetch = _Prefetch(
            batch, _shadow(self.module), _versions(self.module.parameters()),
            _read_buffers(self.module) if self.bn_policy == "forward" else None,
        )
        modes = _thread_local_modes()
        if inputs.device.type == "cuda":
            # One host thread: the RNG state is replayed and restored before the forward draws,
            # as in the serial path; the side stream gives the overlap.
            device = inputs.device
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device)
            side = self._side_stream
            side.wait_stream(torch.cuda.current_stream(device))  # the weights and the buffer copies
            with nvtx_range("tritonopt/dsp/recompute"), torch.cuda.stream(side), modes(), self.replay_rng(
                rng_state, [device]
            ):
                inputs.record_stream(side)
                prefetch.output = prefetch.shadow(inputs)
            prefetch.cuda_done = torch.cuda.Event()
            prefetch.cuda_done.record(side)
        else:
            generator = torch.Generator()
            generator.set_state(rng_state[0])

            def recompute() -> None:
                try:
                    with nvtx_range("tritonopt/dsp/recompute"), modes(), _PrivateGenerator(generator):
                        prefetch.output = prefetch.shadow(inputs)
                except BaseException as exc:  # re-raised on the stage's thread by take()
                    prefetch.error = exc

            prefetch.thread = threading.Thread(
                target=recompute, name=f"tritonopt-dsp-recompute-batch-{batch}", daemon=True
            )
            prefetch.thread.start()
        self._running = prefetch

    def take(self, batch: int) -> Optional[torch.Tensor]:
        """The overlapped recomputation of ``batch``, or ``None`` where it must run serially."""
        prefetch, self._running = self._running, None
        if prefetch is None:
            return None
        if prefetch.thread is not None:
            with nvtx_range("tritonopt/dsp/wait_recompute"):
                prefetch.thread.join()
        _wait_for_side_stream(prefetch)
        if prefetch.batch != batch:
            return None
        if prefetch.error is not None:
            if isinstance(prefetch.error, _NeedsSerial):
                self._turn_off(str(prefetch.error))
                return None
            raise RuntimeError(
                f"the overlapped recomputation of batch {batch} failed in its worker thread: "
                f"{type(prefetch.error).__name__}: {prefetch.error}"
            ) from prefetch.error
        if _versions(self.module.parameters()) != prefetch.parameter_versions:
            return None  # the weights moved in between: recompute at the current ones
        if prefetch.read_buffer_versions is not None and _read_buffers(self.module) != prefetch.read_buffer_versions:
            self._turn_off(
                "the forward pass changed a buffer that the block's output reads, so the recomputation "
                "must follow it"
            )
            return None
        if self.bn_policy == "recompute":  # the recomputation's buffer update is the one kept
            with torch.no_grad():
                for kept, recomputed in zip(self.module.buffers(), prefetch.shadow.buffers()):
                    kept.copy_(recomputed)
        return prefetch.output

    def discard(self) -> None:
        """Wait for a recomputation still running and drop it (after an error); no worker thread stays."""
        prefetch, self._running = self._running, None
        if prefetch is not None and prefetch.thread is not None:
            prefetch.thread.join()
        if prefetch is not None:
            _wait_for_side_stream(prefetch)

    def _turn_off(self, reason: str) -> None:
        self.off_reason = reason
        # stacklevel 3: the stage's forward or backward, which called start() or take().
        warnings.warn(f"DSP stage: recompute='overlap' recomputes serially from now on: {reason}", RuntimeWarning,
                      stacklevel=3)
