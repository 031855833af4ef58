"""Checking at start-up that every rank was configured alike, with one small collective.

Ranks that disagree (another model, another learning rate, another world
layout) otherwise run on until a collective of mismatched sizes aborts, or,
worse, run silently apart. :func:`check_ranks_agree` all-gathers a digest per
setting (8 bytes of BLAKE2b each); only when digests differ does it gather the
values themselves, to name every setting that differs and what each rank holds.

A rank that refused its own arguments (a bad learning rate, a checkpoint for
another rank) passes its exception as ``problem``: the first exchange (each rank's
number of settings) carries it as -1, and when any rank raised, every rank raises that error (its type
and message, naming the rank) at once, instead of the others waiting on a
collective the refusing rank never joins.
"""

from __future__ import annotations

import builtins
import hashlib
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from tritonopt.dist._comm import CountingCommunicator

MESSAGE_BYTES = 1024  # of a start-up error shared with the other ranks

# Exception types a peer's error is re-raised as on the other ranks; anything else becomes RuntimeError.
_SHAREABLE = ("ValueError", "TypeError", "RuntimeError", "FloatingPointError", "KeyError", "IndexError",
              "NotImplementedError", "MemoryError")


def _digest(value: object) -> int:
    # repr is stable across processes for the numbers, strings, tuples and dtypes settings are made of;
    # Python's hash() is salted per process.
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _raise_shared_problem(layer: str, flags: list[int], problem: Optional[BaseException], *,
                          comm: CountingCommunicator, group, device, label: str, stage: str) -> None:
    """Every rank gathers each refusing rank's error text; a rank raises its own, the others the first one."""
    world = len(flags)
    text = "" if problem is None else f"{type(problem).__name__}\0{problem}"
    encoded = text.encode()[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0")
    mine = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(device)
    everyone = torch.empty(world * MESSAGE_BYTES, dtype=torch.uint8, device=device)
    comm.all_gather_into_tensor(everyone, mine, label=label, group=group)
    if problem is not None:
        raise problem
    failed = [rank for rank, flag in enumerate(flags) if flag]
    first = failed[0]
    raw = bytes(everyone.view(world, -1)[first].cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    kind, _, message = raw.partition("\0")
    error_type = getattr(builtins, kind) if kind in _SHAREABLE else RuntimeError
    others = f" (ranks {failed} refused)" if len(failed) > 1 else ""
    raise error_type(f"{layer}: rank {first} refused {stage}{others}: {kind}: {message}")


def check_ranks_agree(
    layer: str,
    settings: Optional[Mapping[str, object]],
    *,
    comm: CountingCommunicator,
    group: Optional[dist.ProcessGroup] = None,
    device: torch.device | str = "cpu",
    label: str = "config_check",
    problem: Optional[BaseException] = None,
    stage: str = "at start-up",
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all hold equal ``settings``.

    ``settings`` maps a name to a value whose ``repr`` identifies it (numbers,
    strings, tuples of shapes, dtypes). The message names each setting that
    differs with every rank's value. A collective: every rank must call it;
    ``comm`` counts its all-gathers under ``label``.

    ``problem``: the exception this rank's own checks raised (``settings`` may
    then be None). Every rank then raises: this rank ``problem`` itself, the
    others an exception of the same built-in type whose message names the
    refusing rank and carries its message. ``stage`` says when, in that message
    (``"at start-up"``, ``"while loading its state"``).
    """
    if problem is None and settings is None:
        raise TypeError("check_ranks_agree needs settings unless this rank reports a problem")
    names = sorted(settings) if problem is None else []
    local = torch.tensor([_digest(names)] + [_digest(settings[name]) for name in names], dtype=torch.int64,
                         device=device)
    world = dist.get_world_size(group)
    # One int64 per rank: the number of digests, or -1 from a rank that refused its arguments.
    width = torch.tensor([local.numel() if problem is None else -1], dtype=torch.int64, device=device)
    widths = torch.empty(world, dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(widths, width, label=label, group=group)
    flags = [int(w < 0) for w in widths.tolist()]
    if any(flags):
        _raise_shared_problem(layer, flags, problem, comm=comm, group=group, device=device, label=label,
                              stage=stage)
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
