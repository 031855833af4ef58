"""The error-feedback low-rank DDP communication hook: :func:`lowrank_ef_hook` and its :class:`LowRankState`.

The state keeps, per compressed parameter, its error and its power iteration's
warm starts, drawn from one seeded generator in the order the hook meets the
parameters (the saved order after loading a checkpoint); the hook compresses
each tensor of two or more dimensions that compression shrinks, all-gathers the
factors, all-reduces the other tensors and averages both. What it sends, why it
gathers factors, warm-up, timeouts and checkpoints: :mod:`tritonopt.dist.comm_hooks`.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations as objects.
import datetime
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_float, check_int, check_tensor
from tritonopt.dist.comm_hooks_checkpoint import StateDictChecks, check_buckets
from tritonopt.dist.comm_hooks_state import HookState, autocast_off, begin_hook_call, raise_if_failed
from tritonopt.ops import lowrank_ef

__all__ = ["LowRankState", "lowrank_ef_hook"]


@dataclass
class _LowRankTensor:
    """The error (``[n, m]``) and warm starts (``[m, r]``) of one compressed parameter, float32."""

    parameter: Optional[torch.Tensor]  # None while loaded and not yet met
    error: torch.Tensor
    q: torch.Tensor
    initial_q: torch.Tensor


class LowRankState(HookState):
    """State of :func:`lowrank_ef_hook`: settings, per-parameter error and warm start, byte counters.

    Construction is a collective over ``process_group`` (the start-up agreement, :mod:`tritonopt.dist.comm_hooks`).

    Args:
        process_group: the group DDP averages over (``None``: the world).
        rank: approximation rank ``r`` (capped at ``min(n, m)`` per tensor), ``>= 1``.
        warmup_iters: iterations averaged uncompressed before compression starts.
        min_compression_rate: a tensor is compressed only when
            ``r (n + m) * min_compression_rate < n m`` (torch's ``powerSGD_hook`` rule; ``0``
            compresses every tensor with two or more dimensions).
        seed: seeds the initial warm starts, ``randn(m, r)`` per tensor.
        timeout: as :class:`~tritonopt.dist.EFTopKState`'s (the collectives' group and timeout).

    Attributes:
        communicator, iteration: as :class:`~tritonopt.dist.EFTopKState`'s (the byte counters,
            the iterations completed).
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
        """This rank's iteration, errors, warm starts, generator and their layout (:mod:`tritonopt.dist.comm_hooks`),
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
        buckets, loaded, generator = self._load_checked(state_dict, ["layout", "generator", "tensors"],
                                                        self._check_saved_tensors)
        self._generator.set_state(generator)
        self._tensors, self._loaded = {}, loaded
        self._loaded_layout = buckets
        self._layout_last = dict(buckets)

    def _check_saved_tensors(self, check: StateDictChecks, state_dict, iteration: int,
                             layout) -> tuple[dict, dict, torch.Tensor]:
        """The saved buckets' parameter numbers, each compressed parameter's state and the generator's,
        checked against the saved parameters."""
        buckets, loaded = {}, {}
        for index, keys, entry in check_buckets(check, "layout", state_dict["layout"], layout):
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
        return buckets, loaded, generator

def lowrank_ef_hook(state: LowRankState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks from each rank's error-feedback rank-``r`` compression.

    Per rank and compressed tensor (unfolded to ``A = error + grad``, ``[n, m]``):
    ``(P, Q) = lowrank_ef(grad, error, q)``, so ``P Q^T`` approximates ``A`` and
    ``error = A - P Q^T``; ``Q`` is the next step's warm start. The factors of every
    rank are all-gathered and the tensor's result is ``(1/W) sum_j P_j Q_j^T`` on
    every rank; the other tensors are all-reduced and averaged. See
    :mod:`tritonopt.dist.comm_hooks` for why the factors are gathered, warm-up, bytes,
    timeouts and checkpoints.

    Returns:
        a future of the bucket's buffer, holding the average, as DDP expects.
    """
    buffer, parameters, keys = begin_hook_call(state, LowRankState, bucket)
    if state._in_warmup():
        return state._warmup_average(bucket, buffer)
    if state._loaded_layout is not None:
        state._draw_in_saved_order()
    world = state._world_size()
    compressed, plain = [], []  # (gradient view, n, m, r) and gradient views
    factors = []
    with nvtx_range("tritonopt/lowrank_hook/compress"), autocast_off(buffer):
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
            raise_if_failed(future, work)
        with nvtx_range("tritonopt/lowrank_hook/average"), autocast_off(buffer):
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
