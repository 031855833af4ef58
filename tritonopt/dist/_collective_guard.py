"""Timeouts for the groups a layer creates, and clear errors when a collective fails.

* :func:`resolve_timeout` and :func:`timed_group`: a layer's ``timeout`` (a
  ``datetime.timedelta`` or seconds) applies to every process group it creates;
  ``None`` inherits the timeout of the group it builds on.
* :class:`GuardedCommunicator`: the collectives of a
  :class:`~tritonopt.dist._comm.CountingCommunicator`, with the backend's error
  (gloo: "Connection reset by peer", "Timed out waiting ...") re-raised as a
  :class:`CollectiveFailure` that names the layer, the collective and the ranks,
  whether it fails when issued or, for an asynchronous one, when waited on.
* :func:`failure_message`: the one wording of such an error (layer, what failed,
  the ranks, this rank, the seconds it waited, the timeout, the backend's error),
  for a layer that waits on its own work handles (DSP's point-to-point streams).

Every layer raises :class:`CollectiveFailure` or a subclass of it (KAISA's
``KAISACollectiveError``, DSP's ``DSPPeerError``), so one ``except`` catches a
failed collective of any layer.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from tritonopt._distributed import CollectiveFailure, failure_message, group_timeout
from tritonopt._validation import check_float

__all__ = ["CollectiveFailure", "GuardedCommunicator", "failure_message", "group_timeout", "resolve_timeout",
           "timed_group"]


def _check_error_class(error) -> None:
    if not (isinstance(error, type) and issubclass(error, CollectiveFailure)):
        raise TypeError(f"error must be CollectiveFailure or a subclass of it, got {error!r}")


def resolve_timeout(timeout, group: Optional[dist.ProcessGroup] = None) -> datetime.timedelta:
    """``timeout`` as a ``timedelta`` (seconds accepted); ``None``: ``group``'s own timeout."""
    if timeout is None:
        return group_timeout(group)
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        check_float("timeout", timeout, low=0.0, low_open=True)
        seconds = float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return datetime.timedelta(seconds=seconds)


def timed_group(ranks: Sequence[int], timeout: datetime.timedelta, *, layer: str, local: bool = False,
                error: type = CollectiveFailure):
    """``dist.new_group(ranks, timeout=timeout)``; ``local``: only the members call it.

    Raises:
        CollectiveFailure: (``error``, a subclass of it) a member did not join within the timeout.
    """
    _check_error_class(error)
    began = time.monotonic()
    try:
        return dist.new_group(sorted(ranks), timeout=timeout, use_local_synchronization=local)
    except RuntimeError as exc:
        raise error(
            f"{layer}: creating the process group of ranks {sorted(ranks)} failed on rank {dist.get_rank()} after "
            f"{time.monotonic() - began:.1f} s (timeout {timeout.total_seconds():g} s): a rank did not "
            f"join (it died or stalled before constructing {layer}). Backend error: {exc}"
        ) from exc


class GuardedCommunicator:
    """The collectives of ``comm`` (which keeps counting them), with clear errors on failure.

    ``error``: the class raised, :class:`CollectiveFailure` or a subclass; ``detail``:
    a function whose text ends the message (what the layer was doing, what to do next).
    """

    COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_to_all_single")
    _OWN = ("comm", "layer", "timeout", "error", "detail")

    def __init__(self, comm, *, layer: str, timeout: datetime.timedelta, error: type = CollectiveFailure,
                 detail: Optional[Callable[[], str]] = None):
        _check_error_class(error)
        if detail is not None and not callable(detail):
            raise TypeError(f"detail must be a function returning text, got {type(detail).__name__}")
        self.comm = comm
        self.layer = layer
        self.timeout = timeout
        self.error = error
        self.detail = detail

    def __getattr__(self, name: str):
        if name in self._OWN or name.startswith("__"):
            raise AttributeError(name)
        method = getattr(self.comm, name)
        if name not in self.COLLECTIVES:
            return method

        def guarded(*args, label: str, group=None, **kwargs):
            began = time.monotonic()

            def failure(exc: RuntimeError) -> CollectiveFailure:
                target = group if group is not None else self.comm.group
                ranks = dist.get_process_group_ranks(target if target is not None else dist.group.WORLD)
                return self.error(failure_message(
                    self.layer, f"the collective {label!r} ({name})", ranks=ranks,
                    seconds=time.monotonic() - began, timeout=self.timeout, cause=exc,
                    detail=self.detail() if self.detail is not None else "",
                ))

            try:
                work = method(*args, label=label, group=group, **kwargs)
            except RuntimeError as exc:
                raise failure(exc) from exc
            return _GuardedWork(work, failure) if kwargs.get("async_op") else work

        return guarded


class _GuardedWork:
    """The work handle of an asynchronous collective, whose ``wait`` raises :class:`CollectiveFailure`."""

    def __init__(self, work, failure):
        self._work = work
        self._failure = failure

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except RuntimeError as exc:
            raise self._failure(exc) from exc

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_work", "_failure"):
            raise AttributeError(name)
        return getattr(self._work, name)
