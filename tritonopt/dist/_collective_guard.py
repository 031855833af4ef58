"""Timeouts, clear errors for failed collectives, and the start-up check that ranks agree.

* :func:`resolve_timeout` and :func:`timed_group`: a layer's ``timeout`` (a
  ``datetime.timedelta`` or seconds) applies to every process group it creates;
  ``None`` inherits the timeout of the group it builds on.
* :class:`GuardedCommunicator`: the collectives of a
  :class:`~tritonopt.dist._comm.CountingCommunicator`, with the backend's error
  (gloo: "Connection reset by peer", "Timed out waiting ...") re-raised as a
  :class:`CollectiveFailure` that names the layer, the collective and the ranks.
* :func:`check_agreement`: one ``all_gather`` of one 8-byte digest per setting;
  every rank raises ``ValueError`` naming the settings on which ranks differ.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from tritonopt._validation import check_float

__all__ = ["CollectiveFailure", "GuardedCommunicator", "check_agreement", "resolve_timeout", "timed_group"]


class CollectiveFailure(RuntimeError):
    """A collective did not complete: a rank died, stalled past the timeout, or left the group."""


def group_timeout(group: Optional[dist.ProcessGroup]) -> datetime.timedelta:
    """The timeout ``group`` (None: the world) was created with, or torch's default if it cannot be read."""
    group = dist.group.WORLD if group is None else group
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout


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


def timed_group(ranks: Sequence[int], timeout: datetime.timedelta, *, layer: str, local: bool = False):
    """``dist.new_group(ranks, timeout=timeout)``; ``local``: only the members call it.

    Raises:
        CollectiveFailure: a member did not join within the timeout.
    """
    began = time.monotonic()
    try:
        return dist.new_group(sorted(ranks), timeout=timeout, use_local_synchronization=local)
    except RuntimeError as exc:
        raise CollectiveFailure(
            f"{layer}: creating the process group of ranks {sorted(ranks)} failed after "
            f"{time.monotonic() - began:.1f} s (timeout {timeout.total_seconds():g} s): a rank did not "
            f"join (it died or stalled before constructing {layer}). Backend error: {exc}"
        ) from exc


class GuardedCommunicator:
    """The collectives of ``comm`` (which keeps counting them), with clear errors on failure."""

    COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_to_all_single")

    def __init__(self, comm, *, layer: str, timeout: datetime.timedelta):
        self.comm = comm
        self.layer = layer
        self.timeout = timeout

    def __getattr__(self, name: str):
        if name in ("comm", "layer", "timeout") or name.startswith("__"):
            raise AttributeError(name)
        method = getattr(self.comm, name)
        if name not in self.COLLECTIVES:
            return method

        def guarded(*args, label: str, group=None, **kwargs):
            began = time.monotonic()
            try:
                return method(*args, label=label, group=group, **kwargs)
            except RuntimeError as exc:
                target = group if group is not None else self.comm.group
                ranks = dist.get_process_group_ranks(target if target is not None else dist.group.WORLD)
                raise CollectiveFailure(
                    f"{self.layer}: the collective {label!r} ({name}) among ranks {ranks} failed on rank "
                    f"{dist.get_rank()} after {time.monotonic() - began:.1f} s (timeout "
                    f"{self.timeout.total_seconds():g} s): another rank died, stalled or left. "
                    f"Backend error: {exc}"
                ) from exc

        return guarded


def _digest(value) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def check_agreement(settings: dict, *, comm, group, layer: str, device: torch.device) -> None:
    """Every rank of ``group`` holds the same ``settings`` (same names on every rank), or all raise.

    One ``all_gather`` of ``len(settings)`` int64 digests ("configuration_check").

    Raises:
        ValueError: naming each setting that differs, which ranks hold which
            value class, and this rank's values.
    """
    names = sorted(settings)
    mine = torch.tensor([_digest(settings[name]) for name in names], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    everyone = torch.empty(world * len(names), dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(everyone, mine, label="configuration_check", group=group)
    table = everyone.view(world, len(names)).cpu()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    differing = []
    for j, name in enumerate(names):
        column = table[:, j].tolist()
        if len(set(column)) > 1:
            classes: dict[int, list[int]] = {}
            for rank, value in zip(ranks, column):
                classes.setdefault(value, []).append(rank)
            differing.append((name, " vs ".join(str(members) for members in classes.values())))
    if differing:
        me = dist.get_rank()
        raise ValueError(
            f"{layer}: the ranks' configurations disagree on "
            + "; ".join(f"{name!r} (ranks {split})" for name, split in differing)
            + f". Rank {me} has " + ", ".join(f"{name}={settings[name]!r}" for name, _ in differing)
            + ". Every rank must build the same model and pass the same arguments."
        )
