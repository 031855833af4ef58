"""DSP on ``torch.distributed``: one pipeline stage per rank, layer-wise staleness, no global clock.

Paper: Xu, Huo and Huang, "On the Acceleration of Deep Learning Model
Parallelism with Staleness" (CVPR 2020), sec. 3. Rank ``k`` of ``group`` holds
block ``k`` and its optimizer, and runs the stage loop::

    for each action of stage_actions(m_k, ...):           # batch-id driven, deterministic
        forward t          : x = inputs[t] (rank 0) or the activation of t from rank k - 1
                             h = f_k(x) at the current weights, no graph; queue (t, x, RNG state)
                             isend h to rank k + 1
        backward t - m_k   : wait for delta_k of batch t - m_k from rank k + 1; recompute f_k on
                             the queued input at the current weights; backward; optimizer step;
                             isend delta_(k-1) to rank k - 1
        forward_backward t : (last rank) loss(f_K(x), targets[t]); backward; step; isend delta

The arithmetic is in :mod:`tritonopt.dist.dsp_core` (shared with the
single-process :mod:`~tritonopt.dist.dsp_sim`); this module moves tensors. It is
a pure function of the staleness vector, the data order, the seeds and the
intra-op thread count: a rank that is slow (a straggler) changes when things
happen, never what is computed.

Communication. Only neighbours talk, with ``isend``/``irecv`` through a
:class:`~tritonopt.dist._comm.CountingCommunicator`: rank ``k -> k+1`` carries
activations (label ``"activation"``, ``B * s_out * b`` bytes per batch), rank
``k+1 -> k`` error gradients (label ``"gradient"``, the same size); each
ordered pair of ranks is one FIFO stream per stage. Every stage built on the
same ranks gets tags of its own (the ranks check that they agree on its
index), so stages that stream batches across calls can take turns on the same
ranks (on gloo; NCCL ignores tags, so there give each such stage its own group). The receive for the next message of
each kind is posted before the current one is used (activations into a fresh
buffer, which the input queue keeps; gradients into a ring of two buffers).
Shapes and dtypes are found once, by a dry run of every block on the first
batch's shape, passed up the pipeline (label ``"setup"``). Start-up: one
all-gather of each rank's staleness and of whether its arguments were valid
(label ``"setup"``), then :func:`~tritonopt.dist._agreement.check_ranks_agree`
on the flush mode and the number of stages built before on these ranks (label
``"config_check"``, 8 bytes per setting); one all-gather of the batch count per
:meth:`DSPStage.train` call (``"setup"``).

Failures. Every wait carries ``timeout`` (default: the group's own timeout), so
a rank that dies or stalls surfaces on its neighbours as :class:`DSPPeerError`
(a :class:`~tritonopt.dist.CollectiveFailure`) within it, naming the stage, the
ranks, the seconds waited and the timeout (a rank that exits is usually noticed
at once, by the closed connection). Configuration errors found at start-up are
raised on every rank at once, the others naming the refusing rank.

NVTX ranges: ``tritonopt/dsp/forward``, ``/backward`` and ``/forward_backward`` per
compute phase (``/recompute``, ``/autograd`` and ``/update`` inside; with
``recompute="overlap"``, ``/recompute`` in the worker and ``/wait_recompute`` for it), ``/send``,
``/wait_activation`` and ``/wait_gradient``.

Memory per rank (:meth:`DSPStage.memory_report`): one copy of the
block's weights, gradients and optimizer state; the input queue, ``m_k`` inputs
of ``B * s_in * b`` bytes between steps (one more during a step), and their RNG
states; one receive buffer for the next activation and two for gradients.
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections.abc import Sized
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from tritonopt._runtime import nvtx_range
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import (
    CollectiveFailure,
    GuardedCommunicator,
    failure_message,
    group_timeout,
    resolve_timeout,
)
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist.dsp_core import (
    PhaseHook,
    StageCompute,
    check_modes,
    check_staleness,
    stage_actions,
)

__all__ = ["DSPConfigurationError", "DSPPeerError", "DSPStage"]

# Dtypes an activation may have on the wire, by code in the shape message.
_WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_DIMS = 8
_MESSAGE_BYTES = 512  # of an error message shared at start-up
_TAGS_PER_STAGE = 3  # activation, gradient, shape
# DSP stages built so far in this process on each tuple of global ranks (their tags differ).
_STAGES_BUILT: dict[tuple[int, ...], int] = {}


class DSPPeerError(CollectiveFailure):
    """A neighbouring stage died, stalled past the timeout, or the transport failed."""


class DSPConfigurationError(ValueError):
    """Another stage rejected its configuration or its batches at start-up."""


def _spec(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape), t.dtype


class DSPStage:
    """One DSP pipeline stage on this rank; the stage index is the rank in ``group``.

    Args:
        module: this stage's block; maps one tensor to one tensor (see :func:`split_stages`).
        optimizer: any optimizer over the block's parameters (``torch.optim`` or tritonopt);
            ``zero_grad()`` and ``step()`` run once per back-propagated batch.
        staleness: this stage's ``m_k``. Across ranks: non-increasing, last stage 0
            (checked at start-up, on every rank). ``m_k = 0`` everywhere is sequential
            model-parallel back-propagation (BP-K), which keeps the forward graph and
            does not recompute.
        loss_fn: ``loss_fn(output, targets) -> scalar``; required on the last stage.
        group: the process group of the pipeline (default: the world).
        bn_policy: ``"forward"`` (buffers such as BatchNorm running statistics are
            updated by the forward pass, and restored after the recomputation) or
            ``"recompute"`` (the other way round).
        recompute: ``"serial"``: the stored input is recomputed inside the backward;
            ``"overlap"``: while the stage forwards batch ``t`` it recomputes the input of the
            backward that follows (paper sec. 3.3), in a worker thread on the CPU, on a side
            stream on CUDA. The same numbers either way; ranks may differ in this setting.
        flush: ``"epoch"``: each :meth:`train` call drains the pipeline (batch ids
            restart at 0); ``"never"``: batches stream across calls, :meth:`flush` drains.
            The same on every rank.
        timeout: seconds (or a ``timedelta``) any wait may take before raising
            :class:`DSPPeerError`; ``None``: the group's own timeout.
        record_events: keep ``events``: ``(kind, batch, version)`` per phase, ``version``
            being the number of optimizer steps taken before it.
        phase_hook: ``phase_hook(phase, batch, seconds)`` after each compute phase
            (profiling, or delays injected to study stragglers).

    Raises ``RuntimeError`` without an initialised process group; configuration
    errors (of this or any other rank) raise on every rank.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer,
        *,
        staleness: int,
        loss_fn: Optional[Callable] = None,
        group: Optional[dist.ProcessGroup] = None,
        bn_policy: str = "forward",
        recompute: str = "serial",
        flush: str = "epoch",
        timeout: Union[None, float, datetime.timedelta] = None,
        record_events: bool = False,
        phase_hook: Optional[PhaseHook] = None,
    ):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DSPStage needs torch.distributed: call init_process_group first")
        self.group = group
        self.stage = dist.get_rank(group)
        if self.stage < 0:
            raise ValueError("this process is not a member of `group`")
        self.num_stages = dist.get_world_size(group)
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.num_stages - 1
        self.communicator = CountingCommunicator(group)
        self._setup_device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        self.timeout = group_timeout(group)
        problem: Optional[Exception] = None
        try:
            self.timeout = resolve_timeout(timeout, group)
            self._check_arguments(module, optimizer, staleness, loss_fn, bn_policy, recompute, flush, phase_hook)
        except (TypeError, ValueError) as exc:
            problem = exc
        members = tuple(self._global_rank(k) for k in range(self.num_stages))
        instance = _STAGES_BUILT.get(members, 0)
        _STAGES_BUILT[members] = instance + 1
        rows = self._agree([staleness if problem is None else -1], problem)
        check_ranks_agree(
            "DSPStage", {"flush": flush, "DSP stages built on these ranks before this one": instance},
            comm=GuardedCommunicator(self.communicator, layer="DSPStage", timeout=self.timeout), group=group,
            device=self._setup_device,
        )
        # Tags of their own: messages still in flight for this stage (streaming) are never taken
        # by another stage on the same ranks (gloo matches tags; NCCL ignores them, so there two
        # stages that stream at the same time need groups of their own).
        self._tags = {kind: _TAGS_PER_STAGE * instance + i for i, kind in enumerate(("activation", "gradient", "shape"))}
        self.staleness_vector = check_staleness([row[0] for row in rows])

        self.staleness = staleness
        self.flush_mode = flush
        self.module = module
        self.optimizer = optimizer
        self._compute = StageCompute(
            module, optimizer, staleness, is_first=self.is_first, is_last=self.is_last,
            loss_fn=loss_fn, bn_policy=bn_policy, recompute=recompute, record_events=record_events,
            phase_hook=phase_hook,
        )
        self._prev = None if self.is_first else self._global_rank(self.stage - 1)
        self._next = None if self.is_last else self._global_rank(self.stage + 1)
        self._input_spec: Optional[tuple[tuple[int, ...], torch.dtype]] = None
        self._output_spec: Optional[tuple[tuple[int, ...], torch.dtype]] = None
        self._device: Optional[torch.device] = None
        self._sends: list[tuple[object, torch.Tensor]] = []
        self._grad_ring: list[torch.Tensor] = []
        self._grad_slot = 0
        self._next_batch = 0  # global id of the next batch (streaming)

    # ------------------------------------------------------------ validation

    def _check_arguments(self, module, optimizer, staleness, loss_fn, bn_policy, recompute, flush,
                         phase_hook) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
            raise TypeError(f"optimizer must have step() and zero_grad(), got {type(optimizer).__name__}")
        owned = {id(p) for p in module.parameters()}
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                if id(p) not in owned:
                    raise ValueError(
                        f"the optimizer of stage {self.stage} holds a parameter (shape {tuple(p.shape)}) "
                        "that is not in this stage's module"
                    )
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
        if self.is_last and not callable(loss_fn):
            raise TypeError(f"the last stage needs a callable loss_fn, got {type(loss_fn).__name__}")
        check_modes(bn_policy=bn_policy, recompute=recompute, flush=flush)
        if phase_hook is not None and not callable(phase_hook):
            raise TypeError(f"phase_hook must be callable, got {type(phase_hook).__name__}")

    # ------------------------------------------------------------ communication

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _peer_error(self, what: str, began: float, exc: Exception) -> DSPPeerError:
        ranks = [self._global_rank(k) for k in range(self.num_stages)]
        return DSPPeerError(failure_message(f"DSPStage (stage {self.stage})", what, ranks=ranks,
                                            seconds=time.monotonic() - began, timeout=self.timeout, cause=exc))

    def _wait(self, work, what: str) -> None:
        began = time.monotonic()
        try:
            work.wait(self.timeout)
        except Exception as exc:  # the backend's error type varies (RuntimeError, DistBackendError)
            raise self._peer_error(what, began, exc) from exc

    def _agree(self, values: list[int], problem: Optional[Exception]) -> list[list[int]]:
        """All-gather ``values`` from every rank; raise everywhere if some rank reports a problem."""
        row = torch.tensor([0 if problem is None else 1, *values], dtype=torch.int64, device=self._setup_device)
        table = torch.empty(self.num_stages * row.numel(), dtype=torch.int64, device=self._setup_device)
        work = self._post(
            "the start-up exchange",
            lambda: self.communicator.all_gather_into_tensor(table, row, label="setup", async_op=True),
        )
        self._wait(work, "the start-up exchange")
        rows = table.view(self.num_stages, -1).tolist()
        failed = [k for k, r in enumerate(rows) if r[0]]
        if failed:
            text = "" if problem is None else f"{type(problem).__name__}: {problem}"
            encoded = text.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
            mine = torch.tensor(list(encoded), dtype=torch.uint8, device=self._setup_device)
            everyone = torch.empty(self.num_stages * _MESSAGE_BYTES, dtype=torch.uint8, device=self._setup_device)
            work = self._post(
                "sharing a start-up error",
                lambda: self.communicator.all_gather_into_tensor(everyone, mine, label="setup", async_op=True),
            )
            self._wait(work, "sharing a start-up error")
            if problem is not None:
                raise problem
            k = failed[0]
            message = bytes(everyone.view(self.num_stages, -1)[k].tolist()).rstrip(b"\0").decode(errors="replace")
            raise DSPConfigurationError(
                f"DSPStage: rank {self._global_rank(k)} (DSP stage {k}) refused at start-up: {message}"
            )
        return [r[1:] for r in rows]

    def _post(self, what: str, post: Callable[[], object]):
        """Issue an isend/irecv; a transport failure (e.g. a peer gone) becomes DSPPeerError."""
        began = time.monotonic()
        try:
            return post()
        except Exception as exc:
            raise self._peer_error(what, began, exc) from exc

    def _send(self, tensor: torch.Tensor, dst: int, label: str, tag: int) -> None:
        tensor = tensor.contiguous()
        with nvtx_range("tritonopt/dsp/send"):
            work = self._post(
                f"sending the {label} to rank {dst}",
                lambda: self.communicator.isend(tensor, dst, label=label, tag=tag),
            )
        self._sends.append((work, tensor))  # the tensor must outlive the send
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            self._wait(work, "completing a send")
        self._sends = []

    def _post_activation(self):
        shape, dtype = self._input_spec
        buffer = torch.empty(shape, dtype=dtype, device=self._device)
        work = self._post(
            f"posting a receive from stage {self.stage - 1}",
            lambda: self.communicator.irecv(
                buffer, self._prev, label="activation", tag=self._tags["activation"]
            ),
        )
        return work, buffer

    def _post_gradient(self):
        buffer = self._grad_ring[self._grad_slot]
        self._grad_slot ^= 1
        work = self._post(
            f"posting a receive from stage {self.stage + 1}",
            lambda: self.communicator.irecv(
                buffer, self._next, label="gradient", tag=self._tags["gradient"]
            ),
        )
        return work, buffer

    # ------------------------------------------------------------ shape discovery

    def _discover_shapes(self, first_inputs: Optional[torch.Tensor], first_targets) -> None:
        """Dry-run every block on the first batch's shape, up the pipeline; collective."""
        message = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=self._setup_device)
        x = None
        upstream_failed = False
        if self.is_first:
            x = first_inputs
        else:
            work = self._post(
                "posting the shape receive",
                lambda: self.communicator.irecv(
                    message, self._prev, label="setup", tag=self._tags["shape"]
                ),
            )
            self._wait(work, f"receiving the activation shape from stage {self.stage - 1}")
            status, dtype_code, ndim, *dims = message.tolist()
            upstream_failed = status != 0
            if not upstream_failed:
                self._device = self._block_device(None)
                x = torch.zeros(dims[:ndim], dtype=_WIRE_DTYPES[dtype_code], device=self._device)
        problem: Optional[Exception] = None
        output = None
        if x is not None:
            try:
                output = self._compute.dry_run(x, first_targets)
                if not self.is_last and output.dtype not in _WIRE_DTYPES:
                    raise TypeError(f"stage outputs must be one of {_WIRE_DTYPES}, got {output.dtype}")
                if not self.is_last and output.dim() > _MAX_DIMS:
                    raise ValueError(f"stage outputs may have at most {_MAX_DIMS} dims, got {output.dim()}")
            except Exception as exc:
                problem = exc
        if not self.is_last:
            ok = problem is None and not upstream_failed
            header = [0 if ok else 1, _WIRE_DTYPES.index(output.dtype) if ok else 0, output.dim() if ok else 0]
            dims = list(output.shape) if ok else []
            message = torch.tensor(
                header + dims + [0] * (_MAX_DIMS - len(dims)), dtype=torch.int64, device=self._setup_device
            )
            work = self._post(
                "sending the shape",
                lambda: self.communicator.isend(
                    message, self._next, label="setup", tag=self._tags["shape"]
                ),
            )
            self._wait(work, f"sending the activation shape to stage {self.stage + 1}")
        # The failing stage raises its own exception, every other one a DSPConfigurationError naming it.
        self._agree([], problem)
        self._input_spec = _spec(x)
        if self._device is None:
            self._device = self._block_device(x)
        if not self.is_last:
            self._output_spec = _spec(output)
            self._grad_ring = [torch.empty(output.shape, dtype=output.dtype, device=self._device) for _ in range(2)]

    def _block_device(self, x: Optional[torch.Tensor]) -> torch.device:
        for p in self.module.parameters():
            return p.device
        return x.device if x is not None else self._setup_device

    # ------------------------------------------------------------ training

    def train(self, batches: Iterable) -> Optional[torch.Tensor]:
        """Run the stage loop over ``batches``, ``(inputs, targets)`` pairs built identically on every rank.

        Rank 0 uses the inputs, the last rank the targets; every batch's inputs
        must have the first one's shape and dtype. Sized iterables (lists,
        DataLoaders) are iterated once, lazily; others are first collected into
        a list to count them. Returns the last stage's losses (a 1-D tensor, in
        batch order) on the last rank and ``None`` on the others.
        """
        problem: Optional[Exception] = None
        items, count, first = iter(()), 0, None
        try:
            if not isinstance(batches, Sized):
                batches = list(batches)
            count = len(batches)
            items = iter(batches)
            if count and (self.is_first or self.is_last):
                first = self._checked_item(next(items), 0)
                items = itertools.chain([first], items)
                if self.is_first and isinstance(batches, (list, tuple)):
                    for i, item in enumerate(batches):  # cheap: shapes only
                        self._checked_item(item, i, reference=first[0])
                if self.is_first and self._input_spec is not None and _spec(first[0]) != self._input_spec:
                    raise ValueError(
                        f"inputs of shape {tuple(first[0].shape)} and dtype {first[0].dtype} differ from "
                        f"the earlier batches' {self._input_spec[0]} {self._input_spec[1]}"
                    )
        except (TypeError, ValueError) as exc:
            problem = exc
        rows = self._agree([count], problem)
        counts = [r[0] for r in rows]
        if len(set(counts)) > 1:
            listing = ", ".join(f"stage {k}: {c}" for k, c in enumerate(counts))
            raise ValueError(f"every stage must get the same number of batches, got {listing}")
        if count == 0:
            return torch.empty(0) if self.is_last else None
        if self._input_spec is None:
            self._discover_shapes(first[0] if first else None, first[1] if first else None)

        first_batch = self._next_batch if self.flush_mode == "never" else 0
        losses = self._run(items, first_batch, count)
        if self.flush_mode == "never":
            self._next_batch += count
        else:
            self._run(iter(()), first_batch + count, 0)
            self._wait_sends()
        return torch.stack(losses) if self.is_last else None

    def flush(self) -> None:
        """Back-propagate every batch still queued and wait for every send (``flush="never"``)."""
        if self._input_spec is not None:
            self._run(iter(()), self._next_batch, 0)
        self._wait_sends()

    def _checked_item(self, item, index: int, reference: Optional[torch.Tensor] = None):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"batch {index} must be an (inputs, targets) pair, got {type(item).__name__}")
        if self.is_first:
            inputs = item[0]
            if not isinstance(inputs, torch.Tensor):
                raise TypeError(f"batch {index}: inputs must be a tensor, got {type(inputs).__name__}")
            if reference is not None and _spec(inputs) != _spec(reference):
                raise ValueError(
                    f"batch {index}: inputs have shape {tuple(inputs.shape)} and dtype {inputs.dtype}, but "
                    f"batch 0 has {tuple(reference.shape)} {reference.dtype}; every batch needs the same "
                    "(drop the last, smaller batch)"
                )
        return item

    def _run(self, items, first_batch: int, count: int) -> list[torch.Tensor]:
        try:
            return self._run_actions(items, first_batch, count)
        except BaseException:
            self._compute.discard_prefetch()  # no recomputation thread outlives a failed run
            raise

    def _run_actions(self, items, first_batch: int, count: int) -> list[torch.Tensor]:
        compute = self._compute
        actions = list(stage_actions(self.staleness, self.is_last, first_batch, count, compute.pending))
        activations_left = count if not self.is_first else 0
        gradients_left = sum(1 for kind, _ in actions if kind == "backward")
        activation = self._post_activation() if activations_left else None
        gradient = self._post_gradient() if gradients_left else None
        losses = []
        for kind, batch in actions:
            if kind == "backward":
                work, grad_output = gradient
                with nvtx_range("tritonopt/dsp/wait_gradient"):
                    self._wait(work, f"receiving the gradient of batch {batch} from stage {self.stage + 1}")
                gradients_left -= 1
                gradient = self._post_gradient() if gradients_left else None
                grad_input = compute.backward(batch, grad_output)
                if not self.is_first:
                    self._send(grad_input, self._prev, "gradient", self._tags["gradient"])
                continue
            inputs, targets = next(items) if (self.is_first or self.is_last) else (None, None)
            if self.is_first:
                if _spec(inputs) != self._input_spec:
                    raise ValueError(
                        f"batch {batch}: inputs have shape {tuple(inputs.shape)} and dtype {inputs.dtype}, "
                        f"but the pipeline was set up for {self._input_spec[0]} {self._input_spec[1]}"
                    )
            else:
                work, inputs = activation
                with nvtx_range("tritonopt/dsp/wait_activation"):
                    self._wait(work, f"receiving the activation of batch {batch} from stage {self.stage - 1}")
                activations_left -= 1
                activation = self._post_activation() if activations_left else None
            if kind == "forward":
                output = compute.forward(batch, inputs)
                if _spec(output) != self._output_spec:
                    raise ValueError(
                        f"batch {batch}: this stage's output has shape {tuple(output.shape)} and dtype "
                        f"{output.dtype}, but the pipeline was set up for {self._output_spec}"
                    )
                self._send(output, self._next, "activation", self._tags["activation"])
            else:
                loss, grad_input = compute.forward_backward(batch, inputs, targets)
                losses.append(loss)
                if not self.is_first:
                    self._send(grad_input, self._prev, "gradient", self._tags["gradient"])
        return losses

    # ------------------------------------------------------------ reports

    @property
    def events(self) -> Optional[list[tuple[str, int, int]]]:
        """``(kind, batch, version)`` per phase when ``record_events`` was set, else ``None``."""
        return self._compute.events

    @property
    def version(self) -> int:
        """Optimizer steps this stage has taken."""
        return self._compute.version

    def memory_report(self) -> dict[str, int]:
        """What this stage holds, in bytes.

        ``queue_bytes`` (the stored inputs now), ``peak_queue_bytes`` (their most
        between steps) and ``expected_queue_bytes`` (``m_k * B * s_in * b``);
        ``rng_state_bytes`` (saved with the queued inputs); ``receive_buffer_bytes``;
        ``parameter_bytes``, ``gradient_bytes``, ``optimizer_state_bytes``.
        """
        input_bytes = 0
        if self._input_spec is not None:
            shape, dtype = self._input_spec
            input_bytes = torch.Size(shape).numel() * dtype.itemsize
        receive = 0
        if self._input_spec is not None and not self.is_first:
            receive += input_bytes
        receive += sum(t.numel() * t.element_size() for t in self._grad_ring)
        params = list(self.module.parameters())
        state_bytes = 0
        for state in getattr(self.optimizer, "state", {}).values():
            for value in state.values() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor):
                    state_bytes += value.numel() * value.element_size()
        return {
            "staleness": self.staleness,
            "queue_entries": len(self._compute.pending),
            "queue_bytes": self._compute.queue_bytes(),
            "peak_queue_entries": self._compute.peak_queue_entries,
            "peak_queue_bytes": self._compute.peak_queue_bytes,
            "expected_queue_bytes": self.staleness * input_bytes,
            "rng_state_bytes": self._compute.rng_state_bytes(),
            "receive_buffer_bytes": receive,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "gradient_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer_state_bytes": state_bytes,
        }

    def expected_traffic(self, num_batches: int) -> dict[str, tuple[int, int]]:
        """``{label: (bytes sent, bytes received)}`` that ``num_batches`` batches move on this rank.

        Activations ``k -> k+1`` and gradients ``k+1 -> k``, one tensor per batch
        each: the block's output size (to/from the next stage) and its input
        size (from/to the previous stage).
        """
        if self._input_spec is None:
            raise RuntimeError("the shapes are known after the first train() call")

        def size(spec):
            shape, dtype = spec
            return torch.Size(shape).numel() * dtype.itemsize
        out_bytes = 0 if self.is_last else size(self._output_spec)
        in_bytes = 0 if self.is_first else size(self._input_spec)
        return {
            "activation": (num_batches * out_bytes, num_batches * in_bytes),
            "gradient": (num_batches * in_bytes, num_batches * out_bytes),
        }

