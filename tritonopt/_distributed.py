"""What every layer shares about ``torch.distributed``: the error of a failed collective and the mesh of DTensors.

* :class:`CollectiveFailure`, the one error a failed collective raises in every
  layer (a rank died, stalled past the timeout, or left the group), and
  :func:`failure_message`, its one wording;
* :func:`group_timeout`: the timeout a process group was created with;
* :func:`is_dtensor` and :func:`common_mesh`: whether a parameter is a DTensor
  (sharded, e.g. by FSDP2's ``fully_shard``), and the one device mesh of a list
  of them, refusing DTensors mixed with plain tensors or spread over meshes.
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without DTensor: no parameter can be one
    DTensor = None

__all__ = ["CollectiveFailure", "common_mesh", "failure_message", "group_timeout", "is_dtensor"]


class CollectiveFailure(RuntimeError):
    """A collective did not complete: a rank died, stalled past the timeout, or left the group."""


def failure_message(layer: str, what: str, *, ranks: Sequence[int], seconds: float, timeout: datetime.timedelta,
                    cause: BaseException, detail: str = "") -> str:
    """``"<layer>: <what> among ranks [..] failed on rank r after s s (timeout t s): ..."``, with the cause."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra = f" {detail}" if detail else ""
    return (f"{layer}: {what} among ranks {list(ranks)} failed on rank {rank} after {seconds:.1f} s (timeout "
            f"{timeout.total_seconds():g} s): another rank died, stalled or left.{extra} Backend error: {cause}")


def group_timeout(group: Optional[dist.ProcessGroup]) -> datetime.timedelta:
    """The timeout ``group`` (None: the world) was created with, or torch's default if it cannot be read."""
    group = dist.group.WORLD if group is None else group
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def common_mesh(owner: str, params: Sequence[torch.Tensor]):
    """The one device mesh of ``params`` (all DTensors), None when none is a DTensor.

    ``ValueError`` for DTensors mixed with plain tensors, or on several meshes.
    """
    sharded = [p for p in params if is_dtensor(p)]
    if not sharded:
        return None
    if len(sharded) != len(params):
        raise ValueError(
            f"{owner} got DTensor parameters mixed with plain tensors: shard the whole model (fully_shard the "
            "root module too) or none of it, so that every rank steps the same vector"
        )
    mesh = sharded[0].device_mesh
    for p in sharded:
        if p.device_mesh != mesh:
            raise ValueError(f"{owner} needs all DTensor parameters on one device mesh, found {mesh} and "
                             f"{p.device_mesh}")
    return mesh
