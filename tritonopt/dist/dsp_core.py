"""The arithmetic of one DSP stage, shared by the multi-process stage and the simulator.

DSP (Diversely Stale Parameters; Xu, Huo and Huang, CVPR 2020, sec. 3) cuts a
network into ``K`` consecutive blocks ``f_k(h_{k-1}; w_k)``, one per stage, and
gives block ``k`` a preset **layer-wise staleness** ``m_k`` with
``m_0 >= m_1 >= ... >= m_{K-1} = 0``. Each stage keeps one copy of its weights,
a FIFO ``M_k`` of the inputs it forwarded, and alternates, batch id by batch id
(the order is :func:`stage_actions`)::

    forward  t      : h = f_k(x_t; w_k)              no graph (m_k > 0); x_t, RNG state -> M_k
    backward t - m_k: pop (t - m_k, x, rng) from M_k; recompute out = f_k(x; w_k) at the
                      CURRENT weights with the stored RNG state; out.backward(delta_k);
                      optimizer step now; send x.grad (= delta_{k-1}) to stage k - 1

This is the paper's DSP gradient, eq. (5): the Jacobians of block ``k`` are
taken at its backward-time weights around its forward-time input. The forward
of batch ``t`` at stage ``k`` therefore sees the weights after exactly the
updates of batches ``< t - m_k``, and between the forward and the backward of a
batch the stage takes ``m_k`` optimizer steps (paper sec. 3.1).

Two cases need no recomputation, so none is done: the last stage forwards and
back-propagates each batch at once (loss, backward, step), and a non-last stage
with ``m_k = 0`` (sequential model-parallel back-propagation, "BP-K") keeps the
forward's graph for the one batch in flight. Both give the same numbers a
recomputation would, without its cost.

Stochastic layers. The RNG state (CPU, and the CUDA device's when
the input is on CUDA) is saved before each graph-free forward and restored for
its recomputation, so dropout draws the same masks and the recomputed graph is
the one whose output went to the next stage. The caller's RNG stream continues
as if the recomputation had not drawn.

Buffers such as BatchNorm's running statistics are written once per batch:
``bn_policy="forward"`` keeps the forward pass's update and restores every
buffer of the block after the recomputation; ``"recompute"`` restores them after
the forward and keeps the recomputation's update (at the backward-time
weights). Both recompute in the module's current mode (training mode: batch
statistics of the stored input).

Overlapped recompute (paper sec. 3.3; ``recompute="overlap"``): the recomputation of
``t - m_k`` runs beside the forward of ``t``, with the serial results bit for bit, or runs
serially where it could differ; :mod:`tritonopt.dist.dsp_overlap` holds it.

Memory. Between steps ``M_k`` holds ``m_k`` inputs, so the
queue costs ``m_k * B * s_in * b`` bytes (batch ``B``, ``s_in`` elements per
sample of the block's input, ``b`` bytes per element); within a step it briefly
holds one more (the forward of ``t`` precedes the backward of ``t - m_k``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from tritonopt._runtime import nvtx_range
from tritonopt.dist.dsp_overlap import OverlappedRecompute

__all__ = [
    "BN_POLICIES",
    "FLUSH_MODES",
    "RECOMPUTE_MODES",
    "StageCompute",
    "check_modes",
    "check_staleness",
    "stage_actions",
]

BN_POLICIES = ("forward", "recompute")
FLUSH_MODES = ("epoch", "never")
RECOMPUTE_MODES = ("serial", "overlap")
# Each mode argument of a stage or pipeline, by name, and the values it takes.
_MODE_CHOICES = {"bn_policy": BN_POLICIES, "recompute": RECOMPUTE_MODES, "flush": FLUSH_MODES}

# An action of a stage's schedule: ("forward" | "backward" | "forward_backward", batch id).
Action = tuple[str, int]
# phase_hook(phase, batch_id, seconds): called after each compute phase when given.
PhaseHook = Callable[[str, int, float], None]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_modes(**modes: str) -> None:
    """Validate mode arguments by name (``bn_policy``, ``recompute``, ``flush``), in the order given."""
    for name, value in modes.items():
        if name not in _MODE_CHOICES:
            raise TypeError(f"check_modes got an unknown mode {name!r}; it knows {list(_MODE_CHOICES)}")
        if value not in _MODE_CHOICES[name]:
            raise ValueError(f"{name} must be one of {_MODE_CHOICES[name]}, got {value!r}")


def check_staleness(staleness: Sequence[int]) -> tuple[int, ...]:
    """Validate a pipeline's staleness vector ``(m_0, ..., m_{K-1})`` and return it as a tuple.

    Rules (paper sec. 3.1-3.3): every ``m_k`` an int ``>= 0``, non-increasing
    (``m_k >= m_{k+1}``, otherwise the stage loop deadlocks), and ``m_{K-1} = 0``
    (the last stage forwards and back-propagates a batch together).
    """
    values = tuple(staleness)
    if not values:
        raise ValueError("staleness must name one value per stage, got an empty sequence")
    for k, m in enumerate(values):
        if not _is_int(m) or m < 0:
            raise ValueError(f"staleness of stage {k} must be an int >= 0, got {m!r}")
    for k in range(len(values) - 1):
        if values[k] < values[k + 1]:
            raise ValueError(
                f"staleness must be non-increasing (m_k >= m_(k+1)), but stage {k} has "
                f"{values[k]} and stage {k + 1} has {values[k + 1]}: full vector {values}"
            )
    if values[-1] != 0:
        raise ValueError(
            f"the last stage (stage {len(values) - 1}) must have staleness 0, got {values[-1]}: "
            f"it forwards and back-propagates each batch together"
        )
    return values


def stage_actions(
    staleness: int, is_last: bool, first_batch: int, num_batches: int, pending: Sequence[int] = ()
) -> Iterator[Action]:
    """The order in which one stage processes batches ``first_batch .. first_batch + num_batches - 1``.

    ``pending`` lists the batch ids already forwarded but not yet back-propagated
    (streaming across calls). Non-last stage: ``forward t`` then, when ``t - m``
    has been forwarded, ``backward t - m``. Last stage: ``forward_backward t``.
    A drain (``num_batches = 0``) back-propagates every pending batch in order.
    """
    if is_last:
        for t in range(first_batch, first_batch + num_batches):
            yield ("forward_backward", t)
        return
    waiting = deque(pending)
    for t in range(first_batch, first_batch + num_batches):
        yield ("forward", t)
        waiting.append(t)
        if waiting and waiting[0] <= t - staleness:
            yield ("backward", waiting.popleft())
    if num_batches == 0:
        while waiting:
            yield ("backward", waiting.popleft())


# --------------------------------------------------------------------------- state helpers


def _rng_devices(x: torch.Tensor) -> list[torch.device]:
    return [x.device] if x.device.type == "cuda" else []


def capture_rng(devices: Sequence[torch.device]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The CPU RNG state and the states of the given CUDA devices."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def set_rng(state: tuple[torch.Tensor, list[torch.Tensor]], devices: Sequence[torch.device]) -> None:
    cpu_state, cuda_states = state
    torch.set_rng_state(cpu_state)
    for device, cuda_state in zip(devices, cuda_states):
        torch.cuda.set_rng_state(cuda_state, device)


@contextlib.contextmanager
def _rng_replayed(state, devices: Sequence[torch.device]) -> Iterator[None]:
    """Run the block from ``state``; afterwards the RNG streams continue where they were."""
    saved = capture_rng(devices)
    set_rng(state, devices)
    try:
        yield
    finally:
        set_rng(saved, devices)


@contextlib.contextmanager
def _buffers_unchanged(module: nn.Module) -> Iterator[None]:
    """Restore every buffer of ``module`` (e.g. BatchNorm running statistics) on exit."""
    buffers = [b for b in module.buffers() if b is not None]
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Queued:
    batch: int
    inputs: torch.Tensor
    rng_state: Optional[tuple[torch.Tensor, list[torch.Tensor]]]
    output: Optional[torch.Tensor]  # the forward's graph, kept only when staleness == 0


# --------------------------------------------------------------------------- the stage


@dataclass(eq=False)
class StageCompute:
    """One stage's block, optimizer and input queue; no communication.

    ``forward``/``backward`` (non-last stage) and ``forward_backward`` (last
    stage) implement the module docstring's arithmetic; the caller moves the
    tensors between stages and calls them in :func:`stage_actions` order.

    Args:
        module: the block ``f_k``; maps one tensor to one tensor.
        optimizer: steps the block's parameters; ``zero_grad()`` and ``step()`` are called
            once per backward.
        staleness: ``m_k``.
        is_first, is_last: the stage's position (stage 0 does not need its input's gradient).
        loss_fn: ``loss_fn(output, targets) -> scalar`` (last stage only).
        bn_policy: ``"forward"`` or ``"recompute"``: which pass updates buffers.
        recompute: ``"serial"`` (the recomputation runs inside :meth:`backward`) or
            ``"overlap"`` (it runs beside the forward that precedes that backward); the
            same results either way.
        record_events: keep ``events``, a list of ``(kind, batch, version)`` where
            ``version`` is the number of optimizer steps taken before the event.
        phase_hook: ``phase_hook(phase, batch, seconds)`` after each compute phase
            (``"forward"``, ``"backward"``, ``"forward_backward"``), host wall time.
    """

    module: nn.Module
    optimizer: object
    staleness: int
    _: KW_ONLY
    is_first: bool
    is_last: bool
    loss_fn: Optional[Callable] = None
    bn_policy: str = "forward"
    recompute: str = "serial"
    record_events: InitVar[bool] = False
    phase_hook: Optional[PhaseHook] = None
    version: int = field(default=0, init=False)
    events: Optional[list[tuple[str, int, int]]] = field(default=None, init=False)
    peak_queue_bytes: int = field(default=0, init=False)
    peak_queue_entries: int = field(default=0, init=False)
    _queue: deque = field(default_factory=deque, init=False, repr=False)
    _overlap: Optional[OverlappedRecompute] = field(default=None, init=False, repr=False)

    def __post_init__(self, record_events: bool) -> None:
        check_modes(bn_policy=self.bn_policy, recompute=self.recompute)
        self.events = [] if record_events else None
        if self.recompute == "overlap":
            self._overlap = OverlappedRecompute(
                self.module, self.bn_policy, needs_input_grad=not self.is_first, replay_rng=_rng_replayed
            )

    @property
    def overlap_off_reason(self) -> Optional[str]:
        """Why this stage recomputes serially although ``recompute="overlap"`` (``None``: it overlaps)."""
        return None if self._overlap is None else self._overlap.off_reason

    # ------------------------------------------------------------ bookkeeping

    @property
    def pending(self) -> list[int]:
        """Batch ids forwarded and not yet back-propagated, oldest first."""
        return [entry.batch for entry in self._queue]

    def queue_bytes(self) -> int:
        """Bytes of the stored inputs (the queue ``M_k``), without RNG states."""
        return sum(_nbytes(entry.inputs) for entry in self._queue)

    def rng_state_bytes(self) -> int:
        total = 0
        for entry in self._queue:
            if entry.rng_state is not None:
                cpu, cuda = entry.rng_state
                total += _nbytes(cpu) + sum(_nbytes(c) for c in cuda)
        return total

    def _note_queue(self) -> None:
        """Record the queue's size at a step boundary (after the step's backward)."""
        self.peak_queue_entries = max(self.peak_queue_entries, len(self._queue))
        self.peak_queue_bytes = max(self.peak_queue_bytes, self.queue_bytes())

    def _event(self, kind: str, batch: int) -> None:
        if self.events is not None:
            self.events.append((kind, batch, self.version))

    @contextlib.contextmanager
    def _phase(self, phase: str, batch: int) -> Iterator[None]:
        with nvtx_range(f"tritonopt/dsp/{phase}"):
            if self.phase_hook is None:
                yield
                return
            began = time.perf_counter()
            yield
            self.phase_hook(phase, batch, time.perf_counter() - began)

    def _step(self, backward: Callable[[], None]) -> None:
        self.optimizer.zero_grad()
        with nvtx_range("tritonopt/dsp/autograd"):
            backward()
        with nvtx_range("tritonopt/dsp/update"):
            self.optimizer.step()
        self.version += 1

    # ------------------------------------------------------------ shape discovery

    def dry_run(self, inputs: torch.Tensor, targets=None) -> torch.Tensor:
        """The block's output for ``inputs`` (and the loss check on the last stage).

        Leaves no trace: no graph, every buffer restored, the RNG streams as before.
        """
        with torch.no_grad(), _buffers_unchanged(self.module), torch.random.fork_rng(
            devices=_rng_devices(inputs)
        ):
            output = self.module(inputs)
            if not isinstance(output, torch.Tensor):
                raise TypeError(
                    f"a DSP stage module must return one tensor, got {type(output).__name__}"
                )
            if self.is_last:
                loss = self.loss_fn(output, targets)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(
                        "loss_fn(output, targets) must return a one-element tensor, got "
                        f"{type(loss).__name__}"
                        + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                    )
            elif not output.is_floating_point():
                raise TypeError(
                    f"a non-last stage must output a floating-point tensor (its gradient comes "
                    f"back), got {output.dtype}"
                )
        return output

    # ------------------------------------------------------------ the three phases

    def forward(self, batch: int, inputs: torch.Tensor) -> torch.Tensor:
        """Forward ``batch`` at the current weights and queue its input; returns the output."""
        if self.is_last:
            raise RuntimeError("the last stage runs forward_backward, not forward")
        self._event("forward", batch)
        with self._phase("forward", batch):
            if self.staleness == 0:
                # BP-K: the backward follows at these same weights; keep the graph.
                if not self.is_first:
                    inputs.requires_grad_(True)
                output = self.module(inputs)
                self._queue.append(_Queued(batch, inputs, None, output))
                return output.detach()
            rng_state = capture_rng(_rng_devices(inputs))
            if (
                self._overlap is not None and self._overlap.off_reason is None
                and self._queue and self._queue[0].batch <= batch - self.staleness
            ):
                oldest = self._queue[0]  # the input the backward after this forward pops
                self._overlap.start(oldest.batch, oldest.inputs, oldest.rng_state)
            keep_buffers = (
                _buffers_unchanged(self.module) if self.bn_policy == "recompute" else contextlib.nullcontext()
            )
            try:
                with torch.no_grad(), keep_buffers:
                    output = self.module(inputs)
            except BaseException:
                self.discard_prefetch()
                raise
            self._queue.append(_Queued(batch, inputs, rng_state, None))
        if self._queue[0].batch > batch - self.staleness:
            self._note_queue()  # no backward follows in this step (warm-up)
        return output

    def backward(self, batch: int, grad_output: torch.Tensor) -> Optional[torch.Tensor]:
        """Back-propagate ``batch`` with ``grad_output`` (= delta_k), step, return delta_(k-1).

        Returns ``None`` on the first stage (its input needs no gradient).
        """
        if self.is_last:
            raise RuntimeError("the last stage runs forward_backward, not backward")
        if not self._queue:
            raise RuntimeError(f"stage queue is empty but the gradient of batch {batch} arrived")
        entry = self._queue[0]
        if entry.batch != batch:
            raise RuntimeError(
                f"the gradient of batch {batch} arrived but the oldest queued input is batch {entry.batch}"
            )
        self._queue.popleft()
        self._event("backward", batch)
        with self._phase("backward", batch), contextlib.ExitStack() as stack:
            output = entry.output
            if output is None and self._overlap is not None:
                output = self._overlap.take(batch)  # called here directly: its warning names this line
            if output is None:
                inputs = entry.inputs
                if not self.is_first:
                    inputs.requires_grad_(True)
                if self.bn_policy == "forward":
                    # Restored after the backward: the graph saved these buffers at their version.
                    stack.enter_context(_buffers_unchanged(self.module))
                with nvtx_range("tritonopt/dsp/recompute"), _rng_replayed(entry.rng_state, _rng_devices(inputs)):
                    output = self.module(inputs)
            if output.shape != grad_output.shape:
                raise ValueError(
                    f"batch {batch}: the gradient from the next stage has shape "
                    f"{tuple(grad_output.shape)} but this stage's output has {tuple(output.shape)}"
                )
            self._step(lambda: output.backward(grad_output))
        self._note_queue()
        return None if self.is_first else entry.inputs.grad

    def discard_prefetch(self) -> None:
        """Wait for an overlapped recomputation still running and drop it (after an error).

        Leaves no worker thread behind; the queued input stays for a serial recomputation.
        """
        if self._overlap is not None:
            self._overlap.discard()

    def forward_backward(self, batch: int, inputs: torch.Tensor, targets) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Last stage: loss of ``batch``, backward and step; returns ``(loss, delta_(k-1))``."""
        if not self.is_last:
            raise RuntimeError("only the last stage runs forward_backward")
        self._event("forward_backward", batch)
        with self._phase("forward_backward", batch):
            if not self.is_first:
                inputs.requires_grad_(True)
            loss = self.loss_fn(self.module(inputs), targets)
            self._step(loss.backward)
        return loss.detach(), None if self.is_first else inputs.grad
