"""Checking at start-up that every rank was configured alike, with one small collective.

Ranks that disagree (another model, another learning rate, another world
layout) otherwise run on until a collective of mismatched sizes aborts, or,
worse, run silently apart. :func:`check_ranks_agree` all-gathers a digest per
setting (8 bytes each); only when digests differ does it gather the values
themselves, to name every setting that differs and what each rank holds.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from tritonopt.dist._comm import CountingCommunicator


def _digest(value: object) -> int:
    # repr is stable across processes for the numbers, strings, tuples and dtypes settings are made of;
    # Python's hash() is salted per process.
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def check_ranks_agree(
    layer: str,
    settings: Mapping[str, object],
    *,
    comm: CountingCommunicator,
    group: Optional[dist.ProcessGroup] = None,
    device: torch.device | str = "cpu",
    label: str = "config_check",
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all hold equal ``settings``.

    ``settings`` maps a name to a value whose ``repr`` identifies it (numbers,
    strings, tuples of shapes, dtypes). The message names each setting that
    differs with every rank's value. A collective: every rank must call it;
    ``comm`` counts its two all-gathers under ``label``.
    """
    names = sorted(settings)
    local = torch.tensor([_digest(names)] + [_digest(settings[name]) for name in names], dtype=torch.int64,
                         device=device)
    world = dist.get_world_size(group)
    width = torch.tensor([local.numel()], dtype=torch.int64, device=device)
    widths = torch.empty(world, dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(widths, width, label=label, group=group)
    same_width = bool((widths == widths[0]).all())
    if same_width:
        gathered = torch.empty(world * local.numel(), dtype=torch.int64, device=device)
        comm.all_gather_into_tensor(gathered, local, label=label, group=group)
        if bool((gathered.view(world, -1) == local).all()):
            return
    every = [None] * world
    dist.all_gather_object(every, {name: repr(settings[name]) for name in names}, group=group)
    differing = sorted({name for ranks in every for name in ranks
                        if any(other.get(name) != ranks[name] for other in every)})
    details = "; ".join(f"{name}: " + ", ".join(f"rank {r}: {every[r].get(name, 'absent')}" for r in range(world))
                        for name in differing)
    raise ValueError(f"{layer}: the ranks were configured differently ({details})")
