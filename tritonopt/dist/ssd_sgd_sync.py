"""SSD-SGD's communication, one strategy per ``comm`` mode, around the core of :mod:`~tritonopt.dist.ssd_sgd_core`.

A strategy owns the collectives of its mode and nothing else: it all-reduces
the buffers the core prepares, waits for them when the algorithm needs the sum,
and hands the sum back to the core. :class:`~tritonopt.dist.SSDSGD` picks one
at construction:

* :class:`ShadowSync` (``comm="shadow"``): one asynchronous all-reduce of the
  shadow servers every ``k`` delay steps (``shadow_sync_allreduce``), waited on
  at the start of the next step;
* :class:`PerStepSync` (``comm="per_step"``): one asynchronous all-reduce of each
  delay step's gradient (``per_step_grad_allreduce``), applied to the replica in
  order when a pull is due or the caller flushes.

Both run the warm-up's blocking gradient all-reduce (``warmup_grad_allreduce``).
Every collective goes through a :class:`~tritonopt.dist._collective_guard.GuardedCommunicator`,
so a rank that died or stalled surfaces as a ``CollectiveFailure``.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

from tritonopt._runtime import nvtx_range
from tritonopt.dist.ssd_sgd_core import NVTX_PREFIX, DiscardedWindow, ReplicaServerCore, ShadowServerCore

__all__ = ["PerStepSync", "ShadowSync"]

# What a strategy does with a window every rank discarded: raise, or count and warn (the owner's on_nonfinite).
ReportDiscarded = Callable[[DiscardedWindow], None]


class _Sync:
    """What both strategies share: the core, the guarded collectives, the group, the discard report."""

    AVERAGES_SYNC_BUFFERS = False

    def __init__(self, core, collectives, group, report_discarded: ReportDiscarded):
        self.core = core
        self.collectives = collectives
        self.group = group
        self.report_discarded = report_discarded

    def warmup_step(self, scalars: list[dict]) -> Optional[str]:
        """One synchronous SGD step; returns what was not finite (nothing modified), or None once applied."""
        summed = self.core.prepare_warmup(scalars)
        self.collectives.all_reduce(summed, label="warmup_grad_allreduce", group=self.group, async_op=True).wait()
        return self.core.apply_warmup(scalars)

    def _report(self, discarded: Optional[DiscardedWindow]) -> None:
        if discarded is not None:
            self.report_discarded(discarded)


class ShadowSync(_Sync):
    """``comm="shadow"``: the shadow servers' sum every ``k`` steps, overlapping the next forward and backward."""

    AVERAGES_SYNC_BUFFERS = True

    def __init__(self, core: ShadowServerCore, collectives, group, report_discarded: ReportDiscarded):
        super().__init__(core, collectives, group, report_discarded)
        self._work = None

    def delay_step(self, scalars: list[dict]) -> None:
        core = self.core
        if core.sync_in_flight:
            self._complete()
        pulled = core.sync_ready
        if pulled:
            self._report(core.consume_sync())
        if core.local_step(scalars, pulled=pulled):
            self._launch()

    def _launch(self) -> None:
        with nvtx_range(f"{NVTX_PREFIX}/sync_launch"):
            summed = self.core.prepare_sync()
            self._work = self.collectives.all_reduce(summed, label="shadow_sync_allreduce", group=self.group,
                                                     async_op=True)
        self.core.sync_launched()

    def _complete(self) -> None:
        with nvtx_range(f"{NVTX_PREFIX}/sync_wait"):
            work, self._work = self._work, None
            work.wait()
        self.core.judge_sync()

    def flush(self) -> None:
        """Wait for an in-flight synchronisation (it stays to be consumed by the next step)."""
        if self.core.sync_in_flight:
            self._complete()

    def finalize(self) -> None:
        self.flush()
        self.core.show_synchronised_buffers()

    def forget(self) -> None:
        """Drop the handle of a synchronisation a loaded checkpoint replaces."""
        self._work = None


class PerStepSync(_Sync):
    """``comm="per_step"``: each delay step's gradient summed asynchronously, applied to the replica in order."""

    def __init__(self, core: ReplicaServerCore, collectives, group, report_discarded: ReportDiscarded):
        super().__init__(core, collectives, group, report_discarded)
        self._pending: collections.deque = collections.deque()  # (summed buffer, work, scalars)

    def delay_step(self, scalars: list[dict]) -> None:
        core = self.core
        pulled = core.window.pull_due
        if pulled:
            self._drain()
            self._report(core.discard_bad_window())
            core.pull()
        summed = core.local_step(scalars, pulled=pulled)
        work = self.collectives.all_reduce(summed, label="per_step_grad_allreduce", group=self.group, async_op=True)
        self._pending.append((summed, work, scalars))
        core.advance()

    def _drain(self) -> None:
        """Wait for every pending gradient all-reduce and apply them, in order, to the replica."""
        applied = False
        with nvtx_range(f"{NVTX_PREFIX}/server_replica"):
            while self._pending:
                summed, work, scalars = self._pending.popleft()
                work.wait()
                applied = self.core.apply_to_replica(summed, scalars) or applied
        self.core.judge_replica(applied)

    def flush(self) -> None:
        """Apply every pending gradient to the replica."""
        self._drain()

    def finalize(self) -> None:
        self._drain()

    def forget(self) -> None:
        """Drop the gradients in flight that a loaded checkpoint replaces."""
        self._pending.clear()
