"""The error-feedback blockwise Top-k DDP communication hook: :func:`ef_topk_hook` and its :class:`EFTopKState`.

The state keeps one error buffer per bucket, cut in blocks of ``block_size``, and
carries each parameter's error over when DDP rebuilds its buckets or when a
loaded checkpoint's buckets lie otherwise than DDP's; the hook compresses each
bucket per block, packs every rank's values and positions into one all-gather
and averages what it receives. What it sends, warm-up, timeouts and checkpoints:
:mod:`tritonopt.dist.comm_hooks`.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations as objects.
import datetime
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_float, check_int
from tritonopt.dist.comm_hooks_checkpoint import StateDictChecks, check_buckets
from tritonopt.dist.comm_hooks_state import HookState, begin_hook_call, raise_if_failed
from tritonopt.ops import densify_blocks, ef_topk

__all__ = ["EFTopKState", "ef_topk_hook"]

# Positions inside a block this long or shorter fit in an int16.
_INT16_BLOCK_LIMIT = 32768


def _entries_per_block(density: float, length: int) -> int:
    # round() first so that 0.07 * 100 = 7.000000000000001 keeps 7, not 8 (the optimizers' rule).
    return max(1, math.ceil(round(density * length, 9)))


@dataclass
class _TopKBucket:
    """One bucket's layout and error: ``error`` is ``[num_blocks, block_size]`` float32, the
    bucket's ``numel`` elements first and zeros after them."""

    parameters: tuple[torch.Tensor, ...]
    keys: tuple[int, ...]
    offsets: dict[int, int]  # id(parameter) -> first element of its gradient in the bucket
    numel: int
    block_size: int
    k: int
    k_last: int
    error: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.error.shape[0]

    @property
    def flat_error(self) -> torch.Tensor:
        return self.error.view(-1)[: self.numel]

    def holds(self, parameters) -> bool:
        return len(parameters) == len(self.parameters) and all(a is b for a, b in zip(parameters, self.parameters))


@dataclass
class _SavedTopKBucket:
    """A loaded bucket, not yet bound to this process's parameters: its numbers, and its flat error
    (float32, on the CPU) or None (saved before compression started: zeros)."""

    index: int
    keys: tuple[int, ...]
    offsets: dict[int, int]  # parameter number -> first element in the bucket
    numel: int
    error: Optional[torch.Tensor]


class EFTopKState(HookState):
    """State of :func:`ef_topk_hook`: settings, one error buffer per bucket, byte counters.

    Construction is a collective over ``process_group`` (the start-up agreement, :mod:`tritonopt.dist.comm_hooks`).

    Args:
        process_group: the group DDP averages over (``None``: the world).
        density: fraction of each block sent, ``0 < density <= 1``;
            ``k = ceil(density * block_size)`` entries per block. ``1`` sends
            everything: the plain all-reduce average, error zero.
        block_size: Top-k block length; a bucket shorter than one block is one block.
        warmup_iters: iterations averaged uncompressed before compression starts.
        timeout: a ``datetime.timedelta`` or seconds: the hook's collectives run in a group of the
            same ranks with this timeout; ``None``: ``process_group`` and its timeout.

    Attributes:
        communicator: the :class:`~tritonopt.dist._comm.CountingCommunicator`;
            ``communicator.stats()`` has calls and bytes per label (:mod:`tritonopt.dist.comm_hooks`).
        iteration: iterations completed.
    """

    LAYER = "EFTopKState"

    def __init__(self, process_group=None, *, density: float = 0.01, block_size: int = 16384, warmup_iters: int = 0,
                 timeout: Union[None, float, datetime.timedelta] = None):
        def check_arguments():
            check_float("density", density, low=0.0, high=1.0, low_open=True)
            check_int("block_size", block_size, low=1)
            check_int("warmup_iters", warmup_iters, low=0)

        super().__init__(process_group, timeout, check_arguments,
                         lambda: {"density": float(density), "block_size": block_size, "warmup_iters": warmup_iters})
        self.density = float(density)
        self.block_size = block_size
        self.warmup_iters = warmup_iters
        self._buckets: dict[int, _TopKBucket] = {}
        # Buckets replaced during a rebuild, read until the iteration's last bucket has carried their errors over.
        self._retired: list[_TopKBucket] = []
        # Buckets of a loaded state, until the first iteration after loading has bound them.
        self._pending: Optional[list[_SavedTopKBucket]] = None
        self._used: set[int] = set()  # record indices this iteration

    def _settings(self) -> dict:
        return {"density": self.density, "block_size": self.block_size, "warmup_iters": self.warmup_iters}

    def bucket_error(self, index: int) -> Optional[torch.Tensor]:
        """A copy of bucket ``index``'s error (flat, the bucket's length; float32), or None before its first
        compressed step."""
        check_int("index", index, low=0)
        record = self._buckets.get(index)
        return None if record is None else record.flat_error.clone()

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """This rank's iteration, errors and their layout (:mod:`tritonopt.dist.comm_hooks`), loadable with
        ``torch.load(weights_only=True)``. Call it between iterations."""
        self._require_between_iterations("state_dict")
        if self._pending is not None:
            buckets = [(s.index, s.keys, None if s.error is None else s.error.clone()) for s in self._pending]
        elif self._buckets:
            buckets = [(i, record.keys, record.flat_error.detach().to("cpu", copy=True))
                       for i, record in sorted(self._buckets.items())]
        else:
            buckets = [(i, keys, None) for i, keys in sorted(self._layout_last.items())]
        return {**self._common_state(),
                "buckets": [{"index": i, "keys": list(keys), "error": error} for i, keys, error in buckets]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` of this rank (a collective: every rank loads its own).

        Raises:
            ValueError: on every rank, naming the field, if any rank's state dict does not fit (other
                settings, rank, world size or model; a malformed or out-of-range field) or the ranks were
                saved at different iterations. Nothing changes then.
        """
        pending = self._load_checked(state_dict, ["buckets"], self._check_saved_buckets)
        self._buckets, self._retired, self._used = {}, [], set()
        self._pending = pending
        self._layout_last = {s.index: s.keys for s in pending}

    def _check_saved_buckets(self, check: StateDictChecks, state_dict, iteration: int,
                             layout) -> list[_SavedTopKBucket]:
        """The saved ``buckets``, checked against the saved parameters: each bucket's numbers and error."""
        pending = []
        for index, keys, entry in check_buckets(check, "buckets", state_dict["buckets"], layout):
            check.mapping(f"bucket {index}", entry, ["index", "keys", "error"])
            offsets, numel = {}, 0
            for key in keys:
                offsets[key] = numel
                numel += math.prod(layout[key][0])
            error = entry["error"]
            if error is not None:
                if iteration <= self.warmup_iters:
                    check.fail(f"bucket {index} error", f"exists at iteration {iteration}, but no iteration "
                                                        f"up to warmup_iters = {self.warmup_iters} compresses")
                error = check.tensor(f"bucket {index} error", error, (numel,)).detach().to("cpu", copy=True)
            pending.append(_SavedTopKBucket(index, keys, offsets, numel, error))
        return pending

    # ------------------------------------------------------------ records

    def _new_record(self, parameters, keys, numel: int, device, index: int) -> _TopKBucket:
        block_size = min(self.block_size, max(numel, 1))
        num_blocks = -(-numel // block_size)
        last_length = numel - (num_blocks - 1) * block_size
        offsets, offset = {}, 0
        for parameter in parameters:
            offsets[id(parameter)] = offset
            offset += parameter.numel()
        if offset != numel:
            raise ValueError(f"bucket {index}: its parameters hold {offset} elements but its buffer {numel}")
        return _TopKBucket(
            tuple(parameters), tuple(keys), offsets, numel, block_size,
            k=_entries_per_block(self.density, block_size),
            k_last=_entries_per_block(self.density, last_length),
            error=torch.zeros((num_blocks, block_size), dtype=torch.float32, device=device),
        )

    def _record_for(self, bucket, parameters, keys, buffer: torch.Tensor) -> _TopKBucket:
        """The bucket's record; a bucket whose parameters changed gets a new one holding their errors."""
        index = bucket.index()
        record = self._buckets.get(index)
        if record is not None and record.holds(parameters) and record.numel == buffer.numel():
            return record
        new = self._new_record(parameters, keys, buffer.numel(), buffer.device, index)
        previous = [*self._retired, *self._buckets.values()]
        for parameter, key in zip(parameters, keys):
            begin, length = new.offsets[id(parameter)], parameter.numel()
            for old in previous:
                start = old.offsets.get(id(parameter))
                if start is not None and any(p is parameter for p in old.parameters):
                    new.flat_error[begin : begin + length] = old.flat_error[start : start + length]
                    break
            else:  # a loaded bucket laid out otherwise than DDP's: the parameter's error, moved over
                for saved in self._pending or ():
                    start = saved.offsets.get(key)
                    if start is not None and saved.error is not None:
                        new.flat_error[begin : begin + length] = saved.error[start : start + length]
                        break
        if record is not None:
            self._retired.append(record)
        self._buckets[index] = new
        return new

    def _records_for(self, bucket, parameters, keys, buffer: torch.Tensor) -> list:
        """``[(record, placement)]`` covering the bucket: one record of the bucket itself (placement None), or,
        in the first iteration after loading, the saved buckets that lie inside this one, each with
        ``[(offset in the record, offset in the bucket, length)]`` per parameter, so that the blocks are the
        saved ones."""
        parts = self._saved_parts(parameters, keys, buffer) if self._pending is not None else None
        if parts is None:
            record = self._record_for(bucket, parameters, keys, buffer)
            self._used.add(bucket.index())
            return [(record, None)]
        return parts

    def _saved_parts(self, parameters, keys, buffer: torch.Tensor) -> Optional[list]:
        position = {key: i for i, key in enumerate(keys)}
        inside = [s for s in self._pending if s.keys and all(k in position for k in s.keys)]
        if sum(len(s.keys) for s in inside) != len(keys):
            return None  # a saved bucket straddles DDP's buckets: errors move per parameter instead
        starts, offset = [], 0
        for parameter in parameters:
            starts.append(offset)
            offset += parameter.numel()
        parts = []
        for saved in inside:
            members = [parameters[position[k]] for k in saved.keys]
            record = self._new_record(members, saved.keys, saved.numel, buffer.device, saved.index)
            if saved.error is not None:
                record.flat_error.copy_(saved.error)
            same = saved.keys == keys
            placement = None if same else [(saved.offsets[k], starts[position[k]], parameters[position[k]].numel())
                                           for k in saved.keys]
            self._buckets[saved.index] = record
            self._used.add(saved.index)
            parts.append((record, placement))
        return parts

    def _end_bucket(self, bucket) -> None:
        if bucket.is_last():
            self._retired.clear()
            if self._used:  # a compressed iteration: records no bucket used are stale
                for stale in [i for i in self._buckets if i not in self._used]:
                    del self._buckets[stale]
            self._used = set()
            self._pending = None
        super()._end_bucket(bucket)


def _compress_topk(record: _TopKBucket, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)``, flat over the bucket's blocks (full blocks first, then the last one)."""
    padded = record.num_blocks * record.block_size
    if padded == record.numel:
        blocks = buffer.view(record.num_blocks, record.block_size)
    else:
        blocks = buffer.new_zeros(padded)
        blocks[: record.numel] = buffer
        blocks = blocks.view(record.num_blocks, record.block_size)
    finite = torch.isfinite(buffer).all()
    if record.k_last == record.k:
        indices, values = ef_topk(blocks, record.error, record.k)
        indices, values = indices.view(-1), values.view(-1)
    else:
        head_indices, head_values = ef_topk(blocks[:-1], record.error[:-1], record.k)
        last_indices, last_values = ef_topk(blocks[-1:], record.error[-1:], record.k_last)
        indices = torch.cat([head_indices.view(-1), last_indices.view(-1)])
        values = torch.cat([head_values.view(-1), last_values.view(-1)])
    # A non-finite gradient is sent (the average shows it) but not remembered.
    record.error.masked_fill_(~finite, 0.0)
    return indices, values


def _index_dtype(block_size: int) -> torch.dtype:
    return torch.int16 if block_size <= _INT16_BLOCK_LIMIT else torch.int32


@dataclass(frozen=True)
class _TopKPayload:
    """One rank's message as bytes: ``entries`` float32 values, then their indices, zero-padded to 4 bytes."""

    entries: int
    index_dtype: torch.dtype

    @classmethod
    def of(cls, record: _TopKBucket) -> "_TopKPayload":
        return cls((record.num_blocks - 1) * record.k + record.k_last, _index_dtype(record.block_size))

    @property
    def index_bytes(self) -> int:
        return self.entries * (2 if self.index_dtype == torch.int16 else 4)

    @property
    def nbytes(self) -> int:
        return 4 * self.entries + 4 * (-(-self.index_bytes // 4))

    def pack(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        payload = torch.zeros(self.nbytes, dtype=torch.uint8, device=values.device)
        payload[: 4 * self.entries] = values.view(torch.uint8)
        payload[4 * self.entries : 4 * self.entries + self.index_bytes] = indices.to(self.index_dtype).view(torch.uint8)
        return payload

    def unpack(self, segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices as int32, values)`` of one rank's ``segment``."""
        values = segment[: 4 * self.entries].view(torch.float32)
        indices = segment[4 * self.entries : 4 * self.entries + self.index_bytes].view(self.index_dtype)
        return indices.to(torch.int32), values


def _average_topk(record: _TopKBucket, layout: _TopKPayload, segments: torch.Tensor, world: int) -> torch.Tensor:
    """``(1/W) sum_j c_j`` over the ranks' ``segments`` (``[W, nbytes]``), ``[num_blocks, block_size]``."""
    full = (record.num_blocks - 1) * record.k
    total = None
    for segment in segments:
        received_indices, received_values = layout.unpack(segment)
        received_values = received_values.div(world)
        if record.k_last == record.k:
            dense = densify_blocks(received_indices.view(-1, record.k), received_values.view(-1, record.k),
                                   record.block_size)
        else:
            dense = torch.cat([
                densify_blocks(received_indices[:full].view(-1, record.k),
                               received_values[:full].view(-1, record.k), record.block_size),
                densify_blocks(received_indices[full:].view(1, -1), received_values[full:].view(1, -1),
                               record.block_size),
            ])
        total = dense if total is None else total.add_(dense)
    return total


def ef_topk_hook(state: EFTopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks from each rank's error-feedback blockwise Top-k.

    Per rank: ``a = error + grad`` (the bucket's flat gradient, in blocks of
    ``state.block_size``), ``c`` = the ``k`` largest ``|a|`` of every block,
    ``error = a - c``. Every rank's ``c`` is all-gathered and the hook's result
    is ``(1/W) sum_j c_j`` on every rank (the same bits). See
    :mod:`tritonopt.dist.comm_hooks` for warm-up, bytes, timeouts, checkpoints and
    the non-finite policy.

    Returns:
        a future of the bucket's buffer, holding the average, as DDP expects.
    """
    buffer, parameters, keys = begin_hook_call(state, EFTopKState, bucket)
    if state._in_warmup():
        return state._warmup_average(bucket, buffer)
    world = state._world_size()
    with nvtx_range("tritonopt/ef_topk_hook/compress"):
        parts = state._records_for(bucket, parameters, keys, buffer)
        layouts, payloads = [], []
        for record, placement in parts:
            local = buffer if placement is None else torch.cat([buffer[b : b + n] for _, b, n in placement])
            indices, values = _compress_topk(record, local)
            layouts.append(_TopKPayload.of(record))
            payloads.append(layouts[-1].pack(indices, values))
        payload = payloads[0] if len(payloads) == 1 else torch.cat(payloads)
    nbytes = payload.numel()
    gathered = torch.empty(world * nbytes, dtype=torch.uint8, device=buffer.device)
    work = state._collectives.all_gather_into_tensor(gathered, payload, label="topk_allgather", async_op=True)
    state._end_bucket(bucket)

    def average(fut) -> torch.Tensor:
        raise_if_failed(fut, work)
        with nvtx_range("tritonopt/ef_topk_hook/average"):
            per_rank = gathered.view(world, nbytes)
            offset = 0
            for (record, placement), layout in zip(parts, layouts):
                total = _average_topk(record, layout, per_rank[:, offset : offset + layout.nbytes], world)
                offset += layout.nbytes
                flat = total.view(-1)[: record.numel]
                if placement is None:
                    buffer.copy_(flat)
                else:
                    for start, begin, length in placement:
                        buffer[begin : begin + length].copy_(flat[start : start + length])
        return buffer

    return work.get_future().then(average)
