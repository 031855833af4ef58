"""Compressed-gradient communication hooks for ``DistributedDataParallel``.

Register one with ``ddp_model.register_comm_hook(state, hook)``. DDP calls the
hook once per gradient bucket (one flat buffer holding several parameters'
gradients) in every backward pass; the hook returns a ``torch.futures.Future``
of the bucket's buffer holding the averaged gradient, and every rank gets the
same bits. Both hooks compress with error feedback (EFCP, Modoranu et al. 2024,
sec. 3; Karimireddy et al. 2019): each rank compresses ``a = error + grad``,
sends the compressed message ``c``, and keeps ``error = a - c`` for the next
step, so nothing a rank leaves out is lost, only delayed.

``ef_topk_hook`` (:class:`EFTopKState`)
    The bucket is cut into blocks of ``block_size`` (the last block is
    partial); per block, :func:`tritonopt.ops.ef_topk` keeps the
    ``k = ceil(density * block_size)`` entries of largest ``|a|``
    (``ceil(density * length)`` in a partial last block). One all-gather moves
    every rank's values (float32) and block-relative positions (int16 for
    blocks up to 32768, else int32); each rank densifies every rank's message
    with :func:`tritonopt.ops.densify_blocks` and averages them.

``lowrank_ef_hook`` (:class:`LowRankState`)
    Each gradient with two or more dimensions, unfolded to ``[n, m]``
    (``n = shape[0]``), is compressed to rank ``r`` by
    :func:`tritonopt.ops.lowrank_ef`, one power iteration warm-started at the
    previous step's ``Q`` (PowerSGD's compressor, Vogels et al. 2019, as EFCP
    sec. 3.2 uses it): ``P`` (``[n, r]``, orthonormal columns) and
    ``Q = a^T P`` (``[m, r]``). One all-gather moves every rank's factors;
    each rank forms ``(1/W) sum_j P_j Q_j^T``. Tensors that compression would
    not shrink by ``min_compression_rate`` (``r (n + m) * rate >= n m``, as in
    torch's ``powerSGD_hook``) and 1-D tensors (biases, norm scales) are
    averaged uncompressed by one all-reduce, with no error feedback.

Why the low-rank hook all-gathers factors instead of all-reducing ``P`` then
``Q`` as torch's ``powerSGD_hook`` does: PowerSGD's all-reduce needs every rank
to project onto one shared ``P``, orthogonalised *after* the sum of the ranks'
``a Q``. :func:`~tritonopt.ops.lowrank_ef` fuses the error-feedback
accumulation, both products, the orthogonalisation and the error update on
one rank's ``a``, so the factors it returns are local (``P_j`` differs per
rank) and only the product ``P_j Q_j^T`` may be averaged. The hook therefore
gathers the factors, as the Top-k hook gathers its entries: the bytes sent per
rank are PowerSGD's (``4 r (n + m)`` per tensor), the bytes received grow with
the world size, and the average keeps rank ``W r`` instead of ``r``. Each rank
keeps its own error and warm start, so the invariant
``P_j Q_j^T + error_new = error_old + grad`` holds per rank.

Warm-up. For the first ``warmup_iters`` iterations (counted at each
iteration's last bucket) the hooks average buckets uncompressed, like
``start_powerSGD_iter``. DDP rebuilds its buckets after the first iteration
(different parameters per bucket index); the Top-k hook carries each
parameter's error over to its new bucket, and the low-rank hook keeps its
state per parameter, so compression may start at the first iteration
(``warmup_iters=0``).

Collectives (through ``state.communicator``, a
:class:`~tritonopt.dist._comm.CountingCommunicator` on ``process_group``),
bytes per rank per bucket per iteration, ``W`` the group size:

==========================  ========================  ==============================================
label                       hook                      bytes sent (received: ``W - 1`` times that for
                                                      an all-gather, the same for an all-reduce)
==========================  ========================  ==============================================
``warmup_allreduce``        both, warm-up iterations  ``s N`` (``N`` elements, ``s`` bytes each)
``topk_allgather``          Top-k                     ``4 E + 4 ceil(i E / 4)``: ``E`` entries kept in
                                                      the bucket, ``i`` bytes per index
``lowrank_allgather``       low-rank                  ``4 sum r (n + m)`` over the compressed tensors
``uncompressed_allreduce``  low-rank                  ``s`` times the other tensors' elements
==========================  ========================  ==============================================

Memory per rank: the Top-k error, float32, one block-padded buffer per bucket;
the low-rank error (``n m``) and two warm starts (``m r``, the current one and
the initial one) per compressed tensor, float32.

Non-finite gradients: a bucket (Top-k) or tensor (low-rank) whose local
gradient holds a NaN or an infinity is still sent, so the averaged gradient
shows it (``torch.amp.GradScaler`` then skips the step), and its error (and
warm start) restarts from zero (from the initial warm start) instead of
carrying the non-finite value into every later step. This costs no
synchronisation with the host.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations as objects.
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import FLOAT_DTYPES, check_float, check_int, check_tensor
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.ops import densify_blocks, ef_topk, lowrank_ef

__all__ = ["EFTopKState", "LowRankState", "ef_topk_hook", "lowrank_ef_hook"]

# Positions inside a block this long or shorter fit in an int16.
_INT16_BLOCK_LIMIT = 32768


def _entries_per_block(density: float, length: int) -> int:
    # round() first so that 0.07 * 100 = 7.000000000000001 keeps 7, not 8 (the optimizers' rule).
    return max(1, math.ceil(round(density * length, 9)))


class _HookState:
    """What both hooks share: the group, the byte counters, the warm-up and the iteration count."""

    def __init__(self, process_group, warmup_iters: int):
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None (the world), "
                f"got {type(process_group).__name__}"
            )
        check_int("warmup_iters", warmup_iters, low=0)
        self.process_group = process_group
        self.warmup_iters = warmup_iters
        self.communicator = CountingCommunicator(process_group)
        # Iterations completed (an iteration ends with its last bucket).
        self.iteration = 0

    def _world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _in_warmup(self) -> bool:
        return self.iteration < self.warmup_iters

    def _allreduce_mean(self, buffer: torch.Tensor, label: str) -> torch.futures.Future:
        # Divided before the sum, as DDP's own all-reduce does (no overflow in half precision).
        buffer.div_(self._world_size())
        work = self.communicator.all_reduce(buffer, label=label, async_op=True)
        return work.get_future().then(lambda fut: buffer)

    def _end_bucket(self, bucket) -> None:
        if bucket.is_last():
            self.iteration += 1


def _check_call(state, state_class, bucket) -> torch.Tensor:
    if not isinstance(state, state_class):
        raise TypeError(f"state must be an instance of {state_class.__name__}, got {type(state).__name__}")
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(f"bucket must be a torch.distributed.GradBucket, got {type(bucket).__name__}")
    buffer = bucket.buffer()
    check_tensor("the bucket's gradient", buffer, dtypes=FLOAT_DTYPES, contiguous=True)
    return buffer


# --------------------------------------------------------------------------- Top-k


@dataclass
class _TopKBucket:
    """One bucket's layout and error: ``error`` is ``[num_blocks, block_size]`` float32, the
    bucket's ``numel`` elements first and zeros after them."""

    parameters: tuple[torch.Tensor, ...]
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


class EFTopKState(_HookState):
    """State of :func:`ef_topk_hook`: settings, one error buffer per bucket, byte counters.

    Args:
        process_group: the group DDP averages over (``None``: the world).
        density: fraction of each block sent, ``0 < density <= 1``;
            ``k = ceil(density * block_size)`` entries per block. ``1`` sends
            everything: the plain all-reduce average, error zero.
        block_size: Top-k block length; a bucket shorter than one block is one block.
        warmup_iters: iterations averaged uncompressed before compression starts.

    Attributes:
        communicator: the :class:`~tritonopt.dist._comm.CountingCommunicator`;
            ``communicator.stats()`` has calls and bytes per label (module docstring).
        iteration: iterations completed.
    """

    def __init__(self, process_group=None, *, density: float = 0.01, block_size: int = 16384, warmup_iters: int = 0):
        check_float("density", density, low=0.0, high=1.0, low_open=True)
        check_int("block_size", block_size, low=1)
        super().__init__(process_group, warmup_iters)
        self.density = float(density)
        self.block_size = block_size
        self._buckets: dict[int, _TopKBucket] = {}
        # Buckets replaced during a rebuild, read until the iteration's last bucket has carried their errors over.
        self._retired: list[_TopKBucket] = []

    def bucket_error(self, index: int) -> Optional[torch.Tensor]:
        """A copy of bucket ``index``'s error (flat, the bucket's length; float32), or None before its first
        compressed step."""
        check_int("index", index, low=0)
        record = self._buckets.get(index)
        return None if record is None else record.flat_error.clone()

    def _record_for(self, bucket, buffer: torch.Tensor) -> _TopKBucket:
        """The bucket's record; a bucket whose parameters changed gets a new one holding their errors."""
        index = bucket.index()
        parameters = tuple(bucket.parameters())
        record = self._buckets.get(index)
        if record is not None and record.holds(parameters) and record.numel == buffer.numel():
            return record
        numel = buffer.numel()
        block_size = min(self.block_size, max(numel, 1))
        num_blocks = -(-numel // block_size)
        last_length = numel - (num_blocks - 1) * block_size
        offsets, offset = {}, 0
        for parameter in parameters:
            offsets[id(parameter)] = offset
            offset += parameter.numel()
        if offset != numel:
            raise ValueError(f"bucket {index}: its parameters hold {offset} elements but its buffer {numel}")
        new = _TopKBucket(
            parameters, offsets, numel, block_size,
            k=_entries_per_block(self.density, block_size),
            k_last=_entries_per_block(self.density, last_length),
            error=torch.zeros((num_blocks, block_size), dtype=torch.float32, device=buffer.device),
        )
        previous = [*self._retired, *self._buckets.values()]
        for parameter in parameters:
            for old in previous:
                start = old.offsets.get(id(parameter))
                if start is not None and any(p is parameter for p in old.parameters):
                    begin = offsets[id(parameter)]
                    new.flat_error[begin : begin + parameter.numel()] = old.flat_error[start : start + parameter.numel()]
                    break
        if record is not None:
            self._retired.append(record)
        self._buckets[index] = new
        return new

    def _end_bucket(self, bucket) -> None:
        if bucket.is_last():
            self._retired.clear()
            for stale in [i for i in self._buckets if i > bucket.index()]:
                del self._buckets[stale]
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


def ef_topk_hook(state: EFTopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks from each rank's error-feedback blockwise Top-k.

    Per rank: ``a = error + grad`` (the bucket's flat gradient, in blocks of
    ``state.block_size``), ``c`` = the ``k`` largest ``|a|`` of every block,
    ``error = a - c``. Every rank's ``c`` is all-gathered and the hook's result
    is ``(1/W) sum_j c_j`` on every rank (the same bits). See the module
    docstring for warm-up, bytes and the non-finite policy.

    Returns:
        a future of the bucket's buffer, holding the average, as DDP expects.
    """
    buffer = _check_call(state, EFTopKState, bucket)
    if state._in_warmup():
        state._end_bucket(bucket)
        return state._allreduce_mean(buffer, "warmup_allreduce")
    world = state._world_size()
    with nvtx_range("tritonopt/ef_topk_hook/compress"):
        record = state._record_for(bucket, buffer)
        indices, values = _compress_topk(record, buffer)
        layout = _TopKPayload.of(record)
        payload = layout.pack(indices, values)
    gathered = torch.empty(world * layout.nbytes, dtype=torch.uint8, device=buffer.device)
    work = state.communicator.all_gather_into_tensor(gathered, payload, label="topk_allgather", async_op=True)
    state._end_bucket(bucket)

    def average(fut) -> torch.Tensor:
        with nvtx_range("tritonopt/ef_topk_hook/average"):
            full = (record.num_blocks - 1) * record.k
            total = None
            for segment in gathered.view(world, layout.nbytes):
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
            buffer.copy_(total.view(-1)[: record.numel])
        return buffer

    return work.get_future().then(average)


# --------------------------------------------------------------------------- low rank


@dataclass
class _LowRankTensor:
    """The error (``[n, m]``) and warm starts (``[m, r]``) of one compressed parameter, float32."""

    parameter: torch.Tensor
    error: torch.Tensor
    q: torch.Tensor
    initial_q: torch.Tensor


class LowRankState(_HookState):
    """State of :func:`lowrank_ef_hook`: settings, per-parameter error and warm start, byte counters.

    Args:
        process_group: the group DDP averages over (``None``: the world).
        rank: approximation rank ``r`` (capped at ``min(n, m)`` per tensor), ``>= 1``.
        warmup_iters: iterations averaged uncompressed before compression starts.
        min_compression_rate: a tensor is compressed only when
            ``r (n + m) * min_compression_rate < n m`` (torch's ``powerSGD_hook`` rule; ``0``
            compresses every tensor with two or more dimensions).
        seed: seeds the initial warm starts, ``randn(m, r)`` per tensor.

    Attributes:
        communicator: the :class:`~tritonopt.dist._comm.CountingCommunicator`;
            ``communicator.stats()`` has calls and bytes per label (module docstring).
        iteration: iterations completed.
    """

    def __init__(self, process_group=None, *, rank: int = 4, warmup_iters: int = 0,
                 min_compression_rate: float = 2.0, seed: int = 0):
        check_int("rank", rank, low=1)
        check_float("min_compression_rate", min_compression_rate, low=0.0)
        check_int("seed", seed, low=0)
        super().__init__(process_group, warmup_iters)
        self.rank = rank
        self.min_compression_rate = float(min_compression_rate)
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._tensors: dict[int, _LowRankTensor] = {}  # id(parameter) -> its state

    def compressed_shape(self, shape) -> Optional[tuple[int, int, int]]:
        """``(n, m, r)`` for a gradient of ``shape`` that this state compresses, else None."""
        shape = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"shape must be a sequence of non-negative ints, got {shape}")
        if len(shape) < 2:
            return None
        n = shape[0]
        m = math.prod(shape[1:])
        r = min(self.rank, n, m)
        if r * (n + m) * self.min_compression_rate >= n * m:
            return None
        return n, m, r

    def parameter_error(self, parameter: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of ``parameter``'s error (``[n, m]`` float32), or None if it was never compressed."""
        check_tensor("parameter", parameter)
        state = self._tensors.get(id(parameter))
        return None if state is None or state.parameter is not parameter else state.error.clone()

    def _tensor_state(self, parameter: torch.Tensor, n: int, m: int, r: int, device) -> _LowRankTensor:
        state = self._tensors.get(id(parameter))
        if state is None or state.parameter is not parameter or state.error.shape != (n, m) or state.q.shape[1] != r:
            initial_q = torch.randn((m, r), generator=self._generator, dtype=torch.float32).to(device)
            state = _LowRankTensor(parameter, torch.zeros((n, m), dtype=torch.float32, device=device),
                                   initial_q.clone(), initial_q)
            self._tensors[id(parameter)] = state
        return state


def lowrank_ef_hook(state: LowRankState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks from each rank's error-feedback rank-``r`` compression.

    Per rank and compressed tensor (unfolded to ``A = error + grad``, ``[n, m]``):
    ``(P, Q) = lowrank_ef(grad, error, q)``, so ``P Q^T`` approximates ``A`` and
    ``error = A - P Q^T``; ``Q`` is the next step's warm start. The factors of every
    rank are all-gathered and the tensor's result is ``(1/W) sum_j P_j Q_j^T`` on
    every rank; the other tensors are all-reduced and averaged. See the module
    docstring for why the factors are gathered, warm-up and bytes.

    Returns:
        a future of the bucket's buffer, holding the average, as DDP expects.
    """
    buffer = _check_call(state, LowRankState, bucket)
    if state._in_warmup():
        state._end_bucket(bucket)
        return state._allreduce_mean(buffer, "warmup_allreduce")
    world = state._world_size()
    compressed, plain = [], []  # (gradient view, n, m, r) and gradient views
    factors = []
    with nvtx_range("tritonopt/lowrank_hook/compress"):
        for parameter, grad in zip(bucket.parameters(), bucket.gradients()):
            shape = state.compressed_shape(grad.shape)
            if shape is None:
                plain.append(grad)
                continue
            n, m, r = shape
            tensor_state = state._tensor_state(parameter, n, m, r, grad.device)
            matrix = grad.reshape(n, m)
            matrix = matrix if matrix.is_contiguous() else matrix.contiguous()
            finite = torch.isfinite(matrix).all()
            p, q = lowrank_ef(matrix, tensor_state.error, tensor_state.q)
            # A non-finite gradient is sent (the average shows it) but not remembered.
            tensor_state.error.masked_fill_(~finite, 0.0)
            tensor_state.q = torch.where(finite, q, tensor_state.initial_q)
            factors += [p.reshape(-1), q.reshape(-1)]
            compressed.append((grad, n, m, r))
    futures = []
    if compressed:
        payload = torch.cat(factors)
        gathered = torch.empty(world * payload.numel(), dtype=torch.float32, device=buffer.device)
        futures.append(state.communicator.all_gather_into_tensor(
            gathered, payload, label="lowrank_allgather", async_op=True).get_future())
    if plain:
        flat = torch.cat([g.reshape(-1) for g in plain]).div_(world)
        futures.append(state.communicator.all_reduce(flat, label="uncompressed_allreduce", async_op=True).get_future())
    state._end_bucket(bucket)

    def average(fut) -> torch.Tensor:
        with nvtx_range("tritonopt/lowrank_hook/average"):
            if compressed:
                per_rank = gathered.view(world, -1)
                offset = 0
                for grad, n, m, r in compressed:
                    p_all = per_rank[:, offset : offset + n * r].reshape(world, n, r)
                    q_all = per_rank[:, offset + n * r : offset + (n + m) * r].reshape(world, m, r)
                    offset += (n + m) * r
                    # sum_j P_j Q_j^T as one product of the ranks' factors side by side.
                    p_cat = p_all.permute(1, 0, 2).reshape(n, world * r)
                    q_cat = q_all.permute(1, 0, 2).reshape(m, world * r)
                    grad.copy_((p_cat @ q_cat.T).div_(world).view(grad.shape))
            if plain:
                offset = 0
                for grad in plain:
                    grad.copy_(flat[offset : offset + grad.numel()].view(grad.shape))
                    offset += grad.numel()
        return buffer

    if not futures:
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
    return torch.futures.collect_all(futures).then(average)
