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

Start-up agreement. Constructing a state is a collective over ``process_group``
when ``torch.distributed`` is initialized (DDP needs it anyway): every rank builds
its state, its own argument checks run, then
:func:`~tritonopt.dist._agreement.check_ranks_agree` (label ``config_check``: two
all-gathers of a few int64) compares the settings that must match (Top-k:
``density``, ``block_size``, ``warmup_iters``; low-rank: ``rank``,
``warmup_iters``, ``min_compression_rate``; both: the group's ranks). A rank that
differs, or that refused its own arguments, makes every rank raise at once,
naming the setting (or the refusing rank), instead of failing later inside a
DDP callback. ``seed`` may differ: each rank's warm start is its own. A state
built before ``init_process_group`` checks nothing and is refused by its hook.

Timeout. ``timeout`` (a ``timedelta`` or seconds) gives the hook a process group
of its own with that timeout (the same ranks); ``None`` uses ``process_group``
as it is, with its timeout. When a peer dies or stalls, the collective fails
with :class:`~tritonopt.dist._collective_guard.CollectiveFailure`, naming the
state, the collective and the ranks; DDP re-raises it from ``backward()`` as a
``RuntimeError`` that carries that message.

Checkpoints. ``state.state_dict()`` (between iterations) holds the iteration,
each rank's errors and warm starts, and the layout they belong to: the
parameters' shapes and dtypes numbered in the order the hook first meets them
(DDP's first-iteration buckets, which are the same in every process for the
same model), the buckets of the last iteration as lists of those numbers, the
world size and the rank. It loads with ``torch.load(weights_only=True)``; every
rank saves its own and loads it back with ``load_state_dict`` (a collective,
label ``load_state_dict``), which refuses a state saved for other settings,
another rank or world size, or with a malformed field, with a ``ValueError``
naming the field, before changing anything. A state that has not met its model
yet (a new process) checks the model at the first hook call after loading: a
parameter whose shape or dtype differs from the saved one raises ``ValueError``
there (from ``backward()``), before the hook compresses anything. Restarted from such a checkpoint
(with the model and the optimizer), a run continues bit for bit as it would
have: in its first iteration DDP uses its initial buckets again, and the Top-k
hook compresses them in the saved buckets' blocks (each saved bucket lying
inside one of DDP's), the low-rank hook draws any new warm starts in the saved
order. This holds for checkpoints taken after DDP's bucket rebuild, i.e. from
the second iteration on.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations as objects.
import datetime
import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import FLOAT_DTYPES, check_float, check_int, check_tensor
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import GuardedCommunicator, group_timeout, resolve_timeout, timed_group
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.ops import densify_blocks, ef_topk, lowrank_ef

__all__ = ["EFTopKState", "LowRankState", "ef_topk_hook", "lowrank_ef_hook"]

# Positions inside a block this long or shorter fit in an int16.
_INT16_BLOCK_LIMIT = 32768
_STATE_DICT_VERSION = 1
_DTYPES_BY_NAME = {str(d).removeprefix("torch."): d for d in FLOAT_DTYPES}


def _entries_per_block(density: float, length: int) -> int:
    # round() first so that 0.07 * 100 = 7.000000000000001 keeps 7, not 8 (the optimizers' rule).
    return max(1, math.ceil(round(density * length, 9)))


def _setup_device(group) -> torch.device:
    # The agreement's small tensors must live where the group's backend can move them.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Field:
    """Checks of one loaded state dict, each raising ``ValueError`` that names the field."""

    def __init__(self, layer: str):
        self.layer = layer

    def fail(self, field: str, message: str):
        raise ValueError(f"{self.layer}.load_state_dict: {field} {message}")

    def int(self, field: str, value, low: int = 0, high: Optional[int] = None) -> int:
        if not _is_int(value) or value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            self.fail(field, f"must be an int {bound}, got {value!r}")
        return value

    def mapping(self, field: str, value, keys) -> dict:
        if not isinstance(value, dict):
            self.fail(field, f"must be a dict, got {type(value).__name__}")
        if set(value) != set(keys):
            self.fail(field, f"must hold exactly the keys {sorted(keys)}, got {sorted(map(str, value))}")
        return value

    def sequence(self, field: str, value) -> list:
        if not isinstance(value, (list, tuple)):
            self.fail(field, f"must be a list, got {type(value).__name__}")
        return list(value)

    def tensor(self, field: str, value, shape: tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            self.fail(field, f"must be a tensor, got {type(value).__name__}")
        if value.dtype != dtype or tuple(value.shape) != tuple(shape):
            self.fail(field, f"must be a {dtype} tensor of shape {tuple(shape)}, got {value.dtype} "
                             f"{tuple(value.shape)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            self.fail(field, "holds a NaN or an infinity (errors and warm starts are always finite)")
        return value

    def same(self, field: str, value, expected) -> None:
        if type(value) is not type(expected) or value != expected:
            self.fail(field, f"is {value!r} but this state has {expected!r}")


class _HookState:
    """What both hooks share: the group, the byte counters, the warm-up, the iteration count, the
    start-up agreement and the numbering of parameters that checkpoints use."""

    LAYER = "hook state"

    def __init__(self, process_group, timeout, check_arguments: Callable[[], None],
                 settings: Callable[[], dict]):
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None (the world), "
                f"got {type(process_group).__name__}"
            )
        self.process_group = process_group
        self._attached = dist.is_available() and dist.is_initialized()
        if not self._attached:  # no peer to tell: an error is this process's alone, and nothing to agree on
            check_arguments()
            self.timeout = resolve_timeout(timeout, process_group)
            self.communicator = CountingCommunicator(process_group)
            self._collectives = GuardedCommunicator(self.communicator, layer=self.LAYER, timeout=self.timeout)
        else:
            self._start(process_group, timeout, check_arguments, settings)
        # Iterations completed (an iteration ends with its last bucket).
        self.iteration = 0
        # Parameters numbered in the order the hook first meets them; the list keeps them alive, so an id
        # is never reused while it is a key here.
        self._keys: dict[int, int] = {}
        self._parameters: list[torch.Tensor] = []
        # Each bucket's parameter numbers, this iteration and the last one.
        self._layout_now: dict[int, tuple[int, ...]] = {}
        self._layout_last: dict[int, tuple[int, ...]] = {}
        # (shape, dtype) per number, of a loaded state; the model must match it.
        self._loaded_parameters: Optional[list[tuple[tuple[int, ...], torch.dtype]]] = None
        self._mid_iteration = False

    def _start(self, process_group, timeout, check_arguments, settings) -> None:
        """This rank's checks, the group with the timeout, then the agreement, which tells every rank of a
        refused argument instead of leaving the others waiting in a collective."""
        problem = None
        self.timeout = group_timeout(process_group)
        try:
            check_arguments()
            self.timeout = resolve_timeout(timeout, process_group)
        except (TypeError, ValueError) as exc:
            problem = exc
        group = process_group
        members = dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD)
        if timeout is not None:  # created on every rank that passed one, even a refused value (then untimed)
            group = timed_group(members, self.timeout, layer=self.LAYER, local=True)
        self.communicator = CountingCommunicator(group)
        self._collectives = GuardedCommunicator(self.communicator, layer=self.LAYER, timeout=self.timeout)
        check_ranks_agree(self.LAYER, None if problem is not None else {**settings(), "ranks": members},
                          comm=self._collectives, group=group, device=_setup_device(group), problem=problem)

    def _world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _in_warmup(self) -> bool:
        return self.iteration < self.warmup_iters

    def _allreduce_mean(self, buffer: torch.Tensor, label: str) -> torch.futures.Future:
        # Divided before the sum, as DDP's own all-reduce does (no overflow in half precision).
        buffer.div_(self._world_size())
        work = self._collectives.all_reduce(buffer, label=label, async_op=True)

        def done(fut) -> torch.Tensor:
            _raise_if_failed(fut, work)
            return buffer

        return work.get_future().then(done)

    # ------------------------------------------------------------ parameter numbering

    def _begin_bucket(self, bucket, parameters) -> tuple[int, ...]:
        """Number the bucket's parameters (checked against a loaded state first) and note the layout."""
        if not self._attached:
            raise RuntimeError(f"{self.LAYER} was built before torch.distributed was initialized: build it "
                               f"after init_process_group, on every rank")
        new, seen = [], set()
        for parameter in parameters:
            if id(parameter) not in self._keys and id(parameter) not in seen:
                seen.add(id(parameter))
                new.append(parameter)
        loaded = self._loaded_parameters
        if loaded is not None:
            for offset, parameter in enumerate(new):
                key = len(self._parameters) + offset
                found = (tuple(parameter.shape), parameter.dtype)
                if key >= len(loaded):
                    raise ValueError(f"{self.LAYER}: the loaded state was saved for a model of {len(loaded)} "
                                     f"parameters; this one has more (parameter {key}: {found})")
                if found != loaded[key]:
                    raise ValueError(f"{self.LAYER}: parameter {key} (in the order the hook first meets them) has "
                                     f"shape {found[0]} and dtype {found[1]}, but the loaded state was saved for "
                                     f"{loaded[key][0]} and {loaded[key][1]}")
            if bucket.is_last() and len(self._parameters) + len(new) < len(loaded):
                raise ValueError(f"{self.LAYER}: the loaded state was saved for a model of {len(loaded)} parameters; "
                                 f"this one has {len(self._parameters) + len(new)}")
        for parameter in new:
            self._keys[id(parameter)] = len(self._parameters)
            self._parameters.append(parameter)
        keys = tuple(self._keys[id(p)] for p in parameters)
        self._layout_now[bucket.index()] = keys
        return keys

    def _end_bucket(self, bucket) -> None:
        if bucket.is_last():
            self.iteration += 1
            self._layout_last, self._layout_now = self._layout_now, {}
            self._mid_iteration = False
        else:
            self._mid_iteration = True

    # ------------------------------------------------------------ checkpoints

    def _settings(self) -> dict:
        raise NotImplementedError

    def _require_between_iterations(self, action: str) -> None:
        if not self._attached:
            raise RuntimeError(f"{self.LAYER}.{action}: the state was built before torch.distributed was "
                               f"initialized")
        if self._mid_iteration:
            raise RuntimeError(f"{self.LAYER}.{action} during a backward pass (some buckets of this iteration "
                               f"are done, others not): call it between iterations")

    def _parameter_layout(self) -> list:
        if self._parameters:
            return [[list(p.shape), str(p.dtype).removeprefix("torch.")] for p in self._parameters]
        return [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in self._loaded_parameters or []]

    def _common_state(self) -> dict:
        return {
            "format": type(self).__name__, "version": _STATE_DICT_VERSION, "settings": self._settings(),
            "world_size": self._world_size(), "process_rank": dist.get_rank(self.process_group),
            "iteration": self.iteration, "parameters": self._parameter_layout(),
        }

    def _check_common(self, check: _Field, state_dict, extra_keys) -> tuple[int, list]:
        """The fields both states hold: ``(iteration, [(shape, dtype)] per parameter number)``."""
        check.mapping("the state dict", state_dict, ["format", "version", "settings", "world_size", "process_rank",
                                                     "iteration", "parameters", *extra_keys])
        check.same("format", state_dict["format"], type(self).__name__)
        check.same("version", state_dict["version"], _STATE_DICT_VERSION)
        settings = check.mapping("settings", state_dict["settings"], self._settings())
        for name, value in self._settings().items():
            check.same(f"settings.{name}", settings[name], value)
        check.same("world_size", state_dict["world_size"], self._world_size())
        check.same("process_rank", state_dict["process_rank"], dist.get_rank(self.process_group))
        iteration = check.int("iteration", state_dict["iteration"])
        layout = []
        for key, entry in enumerate(check.sequence("parameters", state_dict["parameters"])):
            entry = check.sequence(f"parameters[{key}]", entry)
            if len(entry) != 2:
                check.fail(f"parameters[{key}]", f"must be [shape, dtype name], got {entry!r}")
            shape = check.sequence(f"parameters[{key}] shape", entry[0])
            for size in shape:
                check.int(f"parameters[{key}] shape", size)
            if entry[1] not in _DTYPES_BY_NAME:
                check.fail(f"parameters[{key}] dtype", f"must be one of {sorted(_DTYPES_BY_NAME)}, got {entry[1]!r}")
            layout.append((tuple(shape), _DTYPES_BY_NAME[entry[1]]))
        if self._parameters and layout:  # this process has met its parameters already: they must be the saved ones
            found = [(tuple(p.shape), p.dtype) for p in self._parameters]
            if found != layout:
                check.fail("parameters", f"describe {len(layout)} parameters {layout}, but this model's are "
                                         f"{len(found)} parameters {found}")
        return iteration, layout

    def _check_buckets(self, check: _Field, field: str, buckets, layout) -> list[tuple[int, tuple[int, ...], object]]:
        """``[(index, keys, entry)]`` of a list of buckets, each parameter number in exactly one of them."""
        out, indices, owner = [], set(), {}
        for position, entry in enumerate(check.sequence(field, buckets)):
            if not isinstance(entry, dict) or "index" not in entry or "keys" not in entry:
                check.fail(f"{field}[{position}]", "must be a dict with an index and keys")
            index = check.int(f"{field}[{position}].index", entry["index"])
            if index in indices:
                check.fail(f"{field}[{position}].index", f"repeats bucket {index}")
            indices.add(index)
            keys = []
            for key in check.sequence(f"{field}[{position}].keys", entry["keys"]):
                check.int(f"{field}[{position}].keys", key, 0, len(layout) - 1)
                if key in owner:
                    check.fail(f"{field}[{position}].keys", f"repeat parameter {key} (also in bucket {owner[key]})")
                owner[key] = index
                keys.append(key)
            out.append((index, tuple(keys), entry))
        if out and len(owner) != len(layout):
            check.fail(field, f"cover {len(owner)} of the {len(layout)} parameters; a saved iteration covers all")
        return sorted(out, key=lambda item: item[0])

    def _agree_on_load(self, iteration: Optional[int], layout, problem: Optional[Exception]) -> None:
        """Every rank raises if one refused its state dict or the ranks were saved at other iterations."""
        settings = None if problem is not None else {
            "iteration": iteration, "parameters (shapes, dtypes)": [(s, str(d)) for s, d in layout]}
        check_ranks_agree(f"{self.LAYER}.load_state_dict", settings, comm=self._collectives,
                          group=self.communicator.group, device=_setup_device(self.communicator.group),
                          label="load_state_dict", problem=problem, stage="while loading its state")


def _raise_if_failed(fut, work) -> None:
    """Re-raise a failed collective's error as the guarded work's ``CollectiveFailure`` (naming the state,
    the collective and the ranks). Built from the work's failure, not by ``work.wait()``, which blocks
    when called from the future's own callback."""
    try:
        fut.value()
    except RuntimeError as exc:
        raise work._failure(exc) from exc


def _autocast_off(buffer: torch.Tensor):
    """No autocast for the hook's products. A backward run under autocast would otherwise round them to
    half precision on the thread that calls the hook, but not on the thread that completes a collective
    and runs its callback: ranks whose collectives finish at other moments would average differently."""
    return torch.autocast(buffer.device.type, enabled=False)


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


class EFTopKState(_HookState):
    """State of :func:`ef_topk_hook`: settings, one error buffer per bucket, byte counters.

    Construction is a collective over ``process_group`` (the start-up agreement, module docstring).

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
            ``communicator.stats()`` has calls and bytes per label (module docstring).
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
        """This rank's iteration, errors and their layout (module docstring), loadable with
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
        self._require_between_iterations("load_state_dict")
        check, problem, iteration, layout, pending = _Field(self.LAYER), None, None, [], []
        try:
            iteration, layout = self._check_common(check, state_dict, ["buckets"])
            for index, keys, entry in self._check_buckets(check, "buckets", state_dict["buckets"], layout):
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
        except ValueError as exc:
            problem = exc
        self._agree_on_load(iteration, layout, problem)
        self.iteration = iteration
        self._loaded_parameters = layout or None  # saved before the first iteration: nothing to match
        self._buckets, self._retired, self._used = {}, [], set()
        self._pending = pending
        self._layout_last = {s.index: s.keys for s in pending}

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
    is ``(1/W) sum_j c_j`` on every rank (the same bits). See the module
    docstring for warm-up, bytes, timeouts, checkpoints and the non-finite policy.

    Returns:
        a future of the bucket's buffer, holding the average, as DDP expects.
    """
    buffer = _check_call(state, EFTopKState, bucket)
    parameters = bucket.parameters()
    keys = state._begin_bucket(bucket, parameters)
    if state._in_warmup():
        state._end_bucket(bucket)
        return state._allreduce_mean(buffer, "warmup_allreduce")
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
        _raise_if_failed(fut, work)
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


# --------------------------------------------------------------------------- low rank


@dataclass
class _LowRankTensor:
    """The error (``[n, m]``) and warm starts (``[m, r]``) of one compressed parameter, float32."""

    parameter: Optional[torch.Tensor]  # None while loaded and not yet met
    error: torch.Tensor
    q: torch.Tensor
    initial_q: torch.Tensor


class LowRankState(_HookState):
    """State of :func:`lowrank_ef_hook`: settings, per-parameter error and warm start, byte counters.

    Construction is a collective over ``process_group`` (the start-up agreement, module docstring).

    Args:
        process_group: the group DDP averages over (``None``: the world).
        rank: approximation rank ``r`` (capped at ``min(n, m)`` per tensor), ``>= 1``.
        warmup_iters: iterations averaged uncompressed before compression starts.
        min_compression_rate: a tensor is compressed only when
            ``r (n + m) * min_compression_rate < n m`` (torch's ``powerSGD_hook`` rule; ``0``
            compresses every tensor with two or more dimensions).
        seed: seeds the initial warm starts, ``randn(m, r)`` per tensor.
        timeout: a ``datetime.timedelta`` or seconds: the hook's collectives run in a group of the
            same ranks with this timeout; ``None``: ``process_group`` and its timeout.

    Attributes:
        communicator: the :class:`~tritonopt.dist._comm.CountingCommunicator`;
            ``communicator.stats()`` has calls and bytes per label (module docstring).
        iteration: iterations completed.
    """

    LAYER = "LowRankState"

    def __init__(self, process_group=None, *, rank: int = 4, warmup_iters: int = 0,
                 min_compression_rate: float = 2.0, seed: int = 0,
                 timeout: Union[None, float, datetime.timedelta] = None):
        def check_arguments():
            check_int("rank", rank, low=1)
            check_float("min_compression_rate", min_compression_rate, low=0.0)
            check_int("seed", seed, low=0)
            check_int("warmup_iters", warmup_iters, low=0)

        super().__init__(process_group, timeout, check_arguments, lambda: {
            "rank": rank, "warmup_iters": warmup_iters, "min_compression_rate": float(min_compression_rate)})
        self.rank = rank
        self.warmup_iters = warmup_iters
        self.min_compression_rate = float(min_compression_rate)
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._tensors: dict[int, _LowRankTensor] = {}  # id(parameter) -> its state
        # Loaded states by parameter number, until the hook meets their parameters.
        self._loaded: dict[int, _LowRankTensor] = {}
        # The saved layout of a loaded state, until the first iteration after loading.
        self._loaded_layout: Optional[dict[int, tuple[int, ...]]] = None

    def _settings(self) -> dict:
        return {"rank": self.rank, "warmup_iters": self.warmup_iters,
                "min_compression_rate": self.min_compression_rate, "seed": self.seed}

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

    def _tensor_state(self, parameter: torch.Tensor, key: int, n: int, m: int, r: int, device) -> _LowRankTensor:
        state = self._tensors.get(id(parameter))
        if state is None or state.parameter is not parameter or state.error.shape != (n, m) or state.q.shape[1] != r:
            loaded = self._loaded.pop(key, None)
            if loaded is not None:  # shapes checked when loaded
                state = _LowRankTensor(parameter, loaded.error.to(device), loaded.q.to(device),
                                       loaded.initial_q.to(device))
            else:
                initial_q = torch.randn((m, r), generator=self._generator, dtype=torch.float32).to(device)
                state = _LowRankTensor(parameter, torch.zeros((n, m), dtype=torch.float32, device=device),
                                       initial_q.clone(), initial_q)
            self._tensors[id(parameter)] = state
        return state

    def _draw_in_saved_order(self) -> None:
        """First compressed iteration after loading: draw the missing warm starts in the saved buckets'
        order, as the run that saved would have (DDP's first buckets after a restart have another order)."""
        layout, self._loaded_layout = self._loaded_layout, None
        for index in sorted(layout):
            for key in layout[index]:
                shape = self.compressed_shape(self._loaded_parameters[key][0])
                met = key < len(self._parameters) and id(self._parameters[key]) in self._tensors
                if shape is None or key in self._loaded or met:
                    continue
                n, m, r = shape
                initial_q = torch.randn((m, r), generator=self._generator, dtype=torch.float32)
                self._loaded[key] = _LowRankTensor(None, torch.zeros((n, m), dtype=torch.float32), initial_q.clone(),
                                                   initial_q)

    def _end_bucket(self, bucket) -> None:
        if bucket.is_last():
            self._loaded_layout = None
        super()._end_bucket(bucket)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """This rank's iteration, errors, warm starts, generator and their layout (module docstring),
        loadable with ``torch.load(weights_only=True)``. Call it between iterations."""
        self._require_between_iterations("state_dict")
        tensors = {key: state for key, state in self._loaded.items()}
        for state in self._tensors.values():
            tensors[self._keys[id(state.parameter)]] = state
        layout = self._loaded_layout if self._loaded_layout is not None else self._layout_last
        return {
            **self._common_state(),
            "layout": [{"index": i, "keys": list(keys)} for i, keys in sorted(layout.items())],
            "generator": self._generator.get_state(),
            "tensors": [{"key": key, "error": s.error.detach().to("cpu", copy=True),
                         "q": s.q.detach().to("cpu", copy=True), "initial_q": s.initial_q.detach().to("cpu", copy=True)}
                        for key, s in sorted(tensors.items())],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` of this rank (a collective: every rank loads its own).

        Raises:
            ValueError: on every rank, naming the field, if any rank's state dict does not fit (other
                settings, rank, world size or model; a malformed or out-of-range field) or the ranks were
                saved at different iterations. Nothing changes then.
        """
        self._require_between_iterations("load_state_dict")
        check, problem, iteration, layout = _Field(self.LAYER), None, None, []
        buckets, loaded, generator = {}, {}, None
        try:
            iteration, layout = self._check_common(check, state_dict, ["layout", "generator", "tensors"])
            for index, keys, entry in self._check_buckets(check, "layout", state_dict["layout"], layout):
                check.mapping(f"layout bucket {index}", entry, ["index", "keys"])
                buckets[index] = keys
            generator = state_dict["generator"]
            if not isinstance(generator, torch.Tensor) or generator.dtype != torch.uint8 or generator.dim() != 1:
                check.fail("generator", "must be a 1-D uint8 tensor (torch.Generator.get_state())")
            try:
                torch.Generator().set_state(generator)  # a scratch generator: this state's is untouched
            except RuntimeError as exc:
                check.fail("generator", f"is not a CPU generator's state: {exc}")
            tensors = check.sequence("tensors", state_dict["tensors"])
            if tensors and iteration <= self.warmup_iters:
                check.fail("tensors", f"exist at iteration {iteration}, but no iteration up to warmup_iters = "
                                      f"{self.warmup_iters} compresses")
            for position, entry in enumerate(tensors):
                entry = check.mapping(f"tensors[{position}]", entry, ["key", "error", "q", "initial_q"])
                key = check.int(f"tensors[{position}].key", entry["key"], 0, len(layout) - 1)
                if key in loaded:
                    check.fail(f"tensors[{position}].key", f"repeats parameter {key}")
                shape = self.compressed_shape(layout[key][0])
                if shape is None:
                    check.fail(f"tensors[{position}].key", f"names parameter {key} of shape {layout[key][0]}, "
                                                           f"which this state does not compress")
                n, m, r = shape
                loaded[key] = _LowRankTensor(
                    None,
                    check.tensor(f"tensors[{position}].error", entry["error"], (n, m)).detach().to("cpu", copy=True),
                    check.tensor(f"tensors[{position}].q", entry["q"], (m, r)).detach().to("cpu", copy=True),
                    check.tensor(f"tensors[{position}].initial_q", entry["initial_q"], (m, r)).detach().to(
                        "cpu", copy=True))
        except ValueError as exc:
            problem = exc
        self._agree_on_load(iteration, layout, problem)
        self.iteration = iteration
        self._loaded_parameters = layout or None  # saved before the first iteration: nothing to match
        self._generator.set_state(generator)
        self._tensors, self._loaded = {}, loaded
        self._loaded_layout = buckets
        self._layout_last = dict(buckets)


def lowrank_ef_hook(state: LowRankState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks from each rank's error-feedback rank-``r`` compression.

    Per rank and compressed tensor (unfolded to ``A = error + grad``, ``[n, m]``):
    ``(P, Q) = lowrank_ef(grad, error, q)``, so ``P Q^T`` approximates ``A`` and
    ``error = A - P Q^T``; ``Q`` is the next step's warm start. The factors of every
    rank are all-gathered and the tensor's result is ``(1/W) sum_j P_j Q_j^T`` on
    every rank; the other tensors are all-reduced and averaged. See the module
    docstring for why the factors are gathered, warm-up, bytes, timeouts and checkpoints.

    Returns:
        a future of the bucket's buffer, holding the average, as DDP expects.
    """
    buffer = _check_call(state, LowRankState, bucket)
    parameters = bucket.parameters()
    keys = state._begin_bucket(bucket, parameters)
    if state._in_warmup():
        state._end_bucket(bucket)
        return state._allreduce_mean(buffer, "warmup_allreduce")
    if state._loaded_layout is not None:
        state._draw_in_saved_order()
    world = state._world_size()
    compressed, plain = [], []  # (gradient view, n, m, r) and gradient views
    factors = []
    with nvtx_range("tritonopt/lowrank_hook/compress"), _autocast_off(buffer):
        for parameter, key, grad in zip(parameters, keys, bucket.gradients()):
            shape = state.compressed_shape(grad.shape)
            if shape is None:
                plain.append(grad)
                continue
            n, m, r = shape
            tensor_state = state._tensor_state(parameter, key, n, m, r, grad.device)
            matrix = grad.reshape(n, m)
            matrix = matrix if matrix.is_contiguous() else matrix.contiguous()
            finite = torch.isfinite(matrix).all()
            p, q = lowrank_ef(matrix, tensor_state.error, tensor_state.q)
            # A non-finite gradient is sent (the average shows it) but not remembered.
            tensor_state.error.masked_fill_(~finite, 0.0)
            tensor_state.q = torch.where(finite, q, tensor_state.initial_q)
            factors += [p.reshape(-1), q.reshape(-1)]
            compressed.append((grad, n, m, r))
    works = []
    if compressed:
        payload = torch.cat(factors)
        gathered = torch.empty(world * payload.numel(), dtype=torch.float32, device=buffer.device)
        works.append(state._collectives.all_gather_into_tensor(gathered, payload, label="lowrank_allgather",
                                                               async_op=True))
    if plain:
        flat = torch.cat([g.reshape(-1) for g in plain]).div_(world)
        works.append(state._collectives.all_reduce(flat, label="uncompressed_allreduce", async_op=True))
    state._end_bucket(bucket)
    futures = [work.get_future() for work in works]

    def average(fut) -> torch.Tensor:
        for future, work in zip(futures, works):
            _raise_if_failed(future, work)
        with nvtx_range("tritonopt/lowrank_hook/average"), _autocast_off(buffer):
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
