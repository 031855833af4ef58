"""What both communication hooks' states share, and the steps every hook call takes.

:class:`HookState` holds the group and its timeout, the byte counters, the
warm-up and the iteration count, the start-up agreement (construction is a
collective), the numbering of parameters that checkpoints use, and the parts of
``state_dict`` and ``load_state_dict`` both states share.
:func:`begin_hook_call` checks a hook's arguments and numbers the bucket's
parameters; :func:`raise_if_failed` and :func:`autocast_off` serve the hooks'
callbacks. What the hooks compute and send: :mod:`tritonopt.dist.comm_hooks`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from tritonopt._validation import FLOAT_DTYPES, check_tensor
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import GuardedCommunicator, group_timeout, resolve_timeout, timed_group
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist._startup import agreement_device
from tritonopt.dist.comm_hooks_checkpoint import (
    STATE_DICT_VERSION,
    StateDictChecks,
    check_header,
    check_parameters,
    describe_parameters,
)

__all__ = ["HookState", "autocast_off", "begin_hook_call", "raise_if_failed"]


class HookState:
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
                          comm=self._collectives, group=group, device=agreement_device(group), problem=problem)

    def _world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _in_warmup(self) -> bool:
        return self.iteration < self.warmup_iters

    def _warmup_average(self, bucket, buffer: torch.Tensor) -> torch.futures.Future:
        """A warm-up iteration's bucket: its plain mean over the ranks (``warmup_allreduce``)."""
        self._end_bucket(bucket)
        # Divided before the sum, as DDP's own all-reduce does (no overflow in half precision).
        buffer.div_(self._world_size())
        work = self._collectives.all_reduce(buffer, label="warmup_allreduce", async_op=True)

        def done(fut) -> torch.Tensor:
            raise_if_failed(fut, work)
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

    def _common_state(self) -> dict:
        layout = [(p.shape, p.dtype) for p in self._parameters] or self._loaded_parameters or []
        return {
            "format": type(self).__name__, "version": STATE_DICT_VERSION, "settings": self._settings(),
            "world_size": self._world_size(), "process_rank": dist.get_rank(self.process_group),
            "iteration": self.iteration, "parameters": describe_parameters(layout),
        }

    def _check_common(self, check: StateDictChecks, state_dict, own_fields) -> tuple[int, list]:
        """The fields both states hold: ``(iteration, [(shape, dtype)] per parameter number)``."""
        iteration = check_header(check, state_dict, own_fields, format_name=type(self).__name__,
                                 settings=self._settings(), world_size=self._world_size(),
                                 process_rank=dist.get_rank(self.process_group))
        layout = check_parameters(check, state_dict["parameters"])
        if self._parameters and layout:  # this process has met its parameters already: they must be the saved ones
            found = [(tuple(p.shape), p.dtype) for p in self._parameters]
            if found != layout:
                check.fail("parameters", f"describe {len(layout)} parameters {layout}, but this model's are "
                                         f"{len(found)} parameters {found}")
        return iteration, layout

    def _load_checked(self, state_dict, own_fields, check_own: Callable) -> object:
        """What both ``load_state_dict`` do: every rank checks its state dict (the shared fields, then
        ``check_own(check, state_dict, iteration, layout)``) and every rank raises if any rank refused its
        own or the ranks were saved at other iterations; else the iteration and the saved model are
        restored and ``check_own``'s result returned, for the state to restore the rest."""
        self._require_between_iterations("load_state_dict")
        check, problem, iteration, layout, own = StateDictChecks(self.LAYER), None, None, [], None
        try:
            iteration, layout = self._check_common(check, state_dict, own_fields)
            own = check_own(check, state_dict, iteration, layout)
        except ValueError as exc:
            problem = exc
        self._agree_on_load(iteration, layout, problem)
        self.iteration = iteration
        self._loaded_parameters = layout or None  # saved before the first iteration: nothing to match
        return own

    def _agree_on_load(self, iteration: Optional[int], layout, problem: Optional[Exception]) -> None:
        """Every rank raises if one refused its state dict or the ranks were saved at other iterations."""
        settings = None if problem is not None else {
            "iteration": iteration, "parameters (shapes, dtypes)": [(s, str(d)) for s, d in layout]}
        check_ranks_agree(f"{self.LAYER}.load_state_dict", settings, comm=self._collectives,
                          group=self.communicator.group, device=agreement_device(self.communicator.group),
                          label="load_state_dict", problem=problem, stage="while loading its state")


def raise_if_failed(fut, work) -> None:
    """Re-raise a failed collective's error as the guarded work's ``CollectiveFailure`` (naming the state,
    the collective and the ranks). Built from the work's failure, not by ``work.wait()``, which blocks
    when called from the future's own callback."""
    try:
        fut.value()
    except RuntimeError as exc:
        raise work._failure(exc) from exc


def autocast_off(buffer: torch.Tensor):
    """No autocast for the hook's products. A backward run under autocast would otherwise round them to
    half precision on the thread that calls the hook, but not on the thread that completes a collective
    and runs its callback: ranks whose collectives finish at other moments would average differently."""
    return torch.autocast(buffer.device.type, enabled=False)


def begin_hook_call(state, state_class, bucket) -> tuple[torch.Tensor, list, tuple[int, ...]]:
    """The checked ``(buffer, parameters, parameter numbers)`` of a hook's bucket; the bucket is begun
    (:meth:`HookState._begin_bucket`) only once the arguments passed."""
    if not isinstance(state, state_class):
        raise TypeError(f"state must be an instance of {state_class.__name__}, got {type(state).__name__}")
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(f"bucket must be a torch.distributed.GradBucket, got {type(bucket).__name__}")
    buffer = bucket.buffer()
    check_tensor("the bucket's gradient", buffer, dtypes=FLOAT_DTYPES, contiguous=True)
    parameters = bucket.parameters()
    return buffer, parameters, state._begin_bucket(bucket, parameters)
