"""The packed-group core that every tritonopt optimizer stands on.

Optimizers here see a parameter group as one flat vector: the group's tensors,
flattened in order, laid end to end and cut into blocks
(:class:`~tritonopt.optim._blocks.BlockLayout`). Their state lives in a few
flat buffers of that layout, and each parameter's ``optimizer.state`` entries
are views of its slice, so the kernels run once per group while
``state_dict()`` stays per parameter, as ``torch.optim`` expects.

:class:`PackedOptimizer` holds what the optimizers share around that:

* the step (:meth:`PackedOptimizer.step`), one template for every optimizer:
  run the closure, check the gradients, pack them into each unit's flat buffer
  (a unit is a parameter group, or the groups that share one window), read on
  the host once, then refuse the step (the non-finite policy) or update. A
  subclass fills in :meth:`~PackedOptimizer._prepare` (get or rebuild the
  unit's packed group, pack, say what to read) and
  :meth:`~PackedOptimizer._update` (the arithmetic);
* the non-finite policy: ``on_nonfinite="skip"`` warns, changes nothing and
  counts the step in ``skipped_steps``; ``"raise"`` raises
  ``FloatingPointError``, also before anything changes;
* argument checks of parameters and gradients, run before any state changes;
* checkpoints that keep every tensor's saved dtype (the base class would cast
  float state to the parameter's dtype), carry ``skipped_steps`` and name the
  layout they were saved for (``param_layout``: each parameter's shape and dtype,
  in order, per group); a state dict is checked whole (layout, hyperparameters,
  counters, every entry's shape and dtype) before anything is loaded;
* copies: ``copy.deepcopy`` and ``pickle`` keep every attribute; the flat
  buffers are rebuilt from the per-parameter state at the next step;
* :meth:`PackedOptimizer.state_bytes`: the bytes of the state and the work buffers;
* :func:`available_memory`: what a device can still hold, to refuse an optimizer
  whose state cannot fit before it allocates anything;
* sharded parameters (DTensors of FSDP2's ``fully_shard``, see
  :mod:`~tritonopt.optim._sharding`): an optimizer that sets
  ``SHARDING_REFUSAL = None`` packs each rank's local shards and keeps its state
  per rank; every other one refuses DTensors at construction, saying why. The
  ranks check at construction that they were given the same settings, and a
  sharded ``state_dict`` shows the per-rank state as DTensors (so that
  ``torch.distributed.checkpoint`` saves every rank's part) and carries its
  layout and world size in each parameter group as well (``get_optimizer_state_dict``
  keeps only ``state`` and ``param_groups``). A checkpoint resumes on as many ranks
  as saved it, or on any number where the whole state is per coordinate
  (``RESHARDABLE``): ``torch.distributed.checkpoint`` reshards it exactly.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch.optim import Optimizer

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_choice
from tritonopt.optim._accounting import optimizer_state_bytes
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._checkpoints import (  # noqa: F401  (CheckpointSpec is public here)
    LAYOUT_KEY,
    SHARD_WORLD_KEY,
    SKIPPED_KEY,
    CheckpointSpec,
    check_param_layout,
    param_layout,
)
from tritonopt.optim._sharding import (
    ShardGroup,
    is_sharded,
    like_param,
    local_tensor,
    rank_stacked,
    refuse_sharded,
    shard_spec,
)

NONFINITE_POLICIES = ("skip", "raise")
# Kept in every saved parameter group of a sharded optimizer too: torch.distributed.checkpoint's
# get_optimizer_state_dict passes on only "state" and "param_groups".
_GROUP_METADATA = (LAYOUT_KEY, SHARD_WORLD_KEY, SKIPPED_KEY)


class PackedGroup:
    """One group's flat buffers: ``state`` ones (per-parameter views live in the optimizer's state)
    and ``work`` ones (scratch, such as the packed gradient). Read either as an attribute.

    ``stats`` holds 0-d device tensors the last step measured (no host synchronisation).
    """

    def __init__(self, layout: BlockLayout, state: dict[str, torch.Tensor], work: dict[str, torch.Tensor]):
        self.layout = layout
        self.state = state
        self.work = work
        self.stats: dict[str, torch.Tensor] = {}

    def work_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.work.values())

    def __getattr__(self, name: str) -> torch.Tensor:
        for buffers in (self.__dict__.get("state", {}), self.__dict__.get("work", {})):
            if name in buffers:
                return buffers[name]
        raise AttributeError(f"the packed group has no buffer {name!r}")


def bind_flat_state(
    state: dict, layout: BlockLayout, names: Sequence[str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One zeroed flat buffer per name; each parameter's ``state[p][name]`` becomes a view of its slice.

    A parameter that already holds ``name`` (a loaded checkpoint, a copied
    optimizer) has it copied into the buffer first; its shape must be the
    parameter's.
    """
    buffers = {name: layout.zeros(dtype) for name in names}
    for name, buffer in buffers.items():
        for p, local, view in zip(layout.tensors, layout.locals, layout.views(buffer)):
            entry = state[p]
            if name in entry:
                if not isinstance(entry[name], torch.Tensor) or entry[name].shape != local.shape:
                    shape = getattr(entry[name], "shape", None)
                    raise ValueError(
                        f"state {name!r} has shape {tuple(shape) if shape is not None else type(entry[name]).__name__} "
                        f"but its parameter has shape {tuple(local.shape)}"
                    )
                view.copy_(entry[name])
            entry[name] = view
    return buffers


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes the device can still allocate (free GPU memory, or the host's available memory), None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return None


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside tritonopt and torch.

    ``step`` is reached through torch's ``no_grad`` and optimizer-hook wrappers,
    so a fixed level would name one of those instead of the user's line.
    """
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back
    return level


_LIBRARY_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,  # torch/
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # tritonopt/
)


def apply_nonfinite_policy(owner, problem: str, unchanged: str) -> None:
    """``owner.on_nonfinite`` for a step that must not happen and has modified nothing.

    ``"raise"`` raises ``FloatingPointError``; ``"skip"`` counts the step in
    ``owner.skipped_steps`` and warns at the user's call, saying what ``unchanged`` names.
    """
    name = type(owner).__name__
    if owner.on_nonfinite == "raise":
        raise FloatingPointError(f"{name}: {problem}; nothing was modified")
    owner.skipped_steps += 1
    warnings.warn(f"{name}: {problem}; the step was skipped and {unchanged}", RuntimeWarning,
                  stacklevel=_caller_stacklevel())


@dataclass
class StepWork:
    """One unit of a step (a parameter group, or the groups of one window), packed and ready to update.

    ``probe`` is a 0-d tensor bounding the unit's gradient, into which NaN and inf
    propagate; ``measures`` are more 0-d tensors its update needs on the host,
    read in the same synchronisation into ``readings``. ``active`` says which of
    ``params`` have a gradient this step (None: all of them).
    """

    index: int
    groups: list
    params: list
    packed: PackedGroup
    probe: torch.Tensor
    active: Optional[list] = None
    measures: list = field(default_factory=list)
    readings: list = field(default_factory=list)


class PackedOptimizer(Optimizer):
    """Base class of the tritonopt optimizers (see the module docstring).

    Subclasses implement :meth:`_check_group` (hyperparameters of one group,
    also run on a loaded state dict), :meth:`_prepare` and :meth:`_update` (the
    two halves of :meth:`step` around its host decision), and keep their flat
    buffers in ``self._packed`` (a dict, by unit index; cleared whenever the
    per-parameter state is replaced), each got or rebuilt by ``_packed_group``.
    """

    # Names the NVTX ranges of a step: tritonopt/<ALGO>/<phase>.
    ALGO: str = "packed"

    # Why DTensor parameters are refused; None where the subclass steps them (see _sharding).
    SHARDING_REFUSAL: Optional[str] = (
        "its state and update are computed over the whole parameter vector, and on shards each rank would "
        "compute them from its own shard only; the optimizers that step sharded parameters are SparseAdaGrad, "
        "MFAC, SparseMFAC, GGT, SparseGGT, LowRankMFAC and FlatSGD"
    )
    # State entries shaped like the parameter's local part, and per-rank window entries (the same shape
    # on every rank): a sharded state_dict shows them as DTensors laid out like the parameter, or stacked
    # over the ranks along their first dimension.
    LIKE_PARAM_ENTRIES: frozenset = frozenset()
    RANK_STACKED_ENTRIES: frozenset = frozenset()
    # True where a sharded checkpoint may resume on another number of ranks: the whole state is per coordinate
    # and laid out like the parameter (LIKE_PARAM_ENTRIES) or the same on every rank (counters), so what
    # torch.distributed.checkpoint reshards onto this optimizer's parameters is each coordinate's saved state.
    RESHARDABLE: bool = False

    def __init__(self, params: Iterable, defaults: dict, on_nonfinite: str = "skip"):
        check_choice("on_nonfinite", on_nonfinite, NONFINITE_POLICIES)
        self._check_group(defaults)
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self._packed: dict = {}
        self._shards: Optional[ShardGroup] = None
        super().__init__(params, defaults)
        if self._shards is not None:
            self._shards.check_agree(type(self).__name__, self._agreement_settings())
        self._constructed = True

    # ------------------------------------------------------------------ checks

    def _check_group(self, group: dict) -> None:
        raise NotImplementedError

    def _checkpoint_spec(self, index: int, group: dict, params: Sequence[torch.Tensor]) -> Optional[CheckpointSpec]:
        """What a checkpoint of group ``index`` (``group``: its saved hyperparameters) must hold; None checks nothing."""
        return None

    def _check_group_set(self, groups: Sequence[dict]) -> None:
        """Checks across groups (run on the optimizer's groups, and on a state dict's before loading)."""

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            self._check_params(group["params"])
            self._check_group_set(self.param_groups)
            shards = self._check_sharding()
            if shards is not None and getattr(self, "_constructed", False):
                shards.check_agree(type(self).__name__, self._agreement_settings())
        except Exception:
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise
        self._shards = shards

    # ------------------------------------------------------------------ sharded parameters

    def _check_sharding(self) -> Optional[ShardGroup]:
        """The collectives over the parameters' mesh (None for plain tensors); refuses what cannot be stepped."""
        params = [p for group in self.param_groups for p in group["params"]]
        name = type(self).__name__
        if self.SHARDING_REFUSAL is not None:
            refuse_sharded(name, params, self.SHARDING_REFUSAL)
            return None
        spec = shard_spec(name, params)
        if spec is None:
            return None
        if self._shards is not None and self._shards.spec.mesh == spec.mesh:
            return self._shards
        if self._shards is not None:
            raise ValueError(f"{name}: a new parameter group lives on another device mesh than the others")
        return ShardGroup(spec)

    def _agreement_settings(self) -> dict:
        """What every rank of a sharded optimizer must agree on: its class, each group's hyperparameters and
        parameter layout (global shapes, dtypes, placements)."""
        settings = {"optimizer": type(self).__name__, "on_nonfinite": self.on_nonfinite}
        for index, group in enumerate(self.param_groups):
            for key, value in group.items():
                if key != "params":
                    settings[f"param_groups[{index}].{key}"] = value
            settings[f"param_groups[{index}].params"] = [
                (tuple(p.shape), p.dtype, tuple(str(x) for x in getattr(p, "placements", ()))) for p in group["params"]
            ]
        return settings

    @property
    def shard_group(self) -> Optional[ShardGroup]:
        """The collectives over the sharded parameters' mesh, with the bytes they moved; None for plain tensors."""
        return self._shards

    def _check_params(self, params: Sequence[torch.Tensor]) -> None:
        name = type(self).__name__
        for p in params:
            if self.SHARDING_REFUSAL is not None:
                refuse_sharded(name, [p], self.SHARDING_REFUSAL)
            if p.is_complex():
                raise ValueError(f"{name} does not support complex parameters")
            if not p.is_floating_point():
                raise ValueError(f"{name} needs floating-point parameters, got {p.dtype}")
            if p.device != params[0].device:
                raise ValueError(
                    f"all parameters of a group must be on one device, found {params[0].device} and {p.device}"
                )

    def _check_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Gradients the optimizer can use: dense, real, shaped like their parameter."""
        name = type(self).__name__
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            if p.grad.is_complex():
                raise RuntimeError(f"{name} does not support complex gradients")
            if p.grad.shape != p.shape:
                raise RuntimeError(
                    f"a gradient has shape {tuple(p.grad.shape)} but its parameter has shape {tuple(p.shape)}"
                )

    @staticmethod
    def _evaluate_closure(closure: Optional[Callable[[], float]]):
        """``closure()`` with gradients enabled (``step`` runs under ``no_grad``); None without a closure."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimization step; ``closure`` (optional) re-evaluates the model and returns the loss."""
        loss = self._evaluate_closure(closure)
        self._step_packed()
        return loss

    def _step_packed(self) -> None:
        """The step after the closure: check, pack every unit, read on the host once, refuse or update.

        Before the verdict nothing changes but the state created for parameters
        that had none, which a refused step drops again.
        """
        self._check_step()
        stateless = self._stateless_params()
        with nvtx_range(f"tritonopt/{self.ALGO}/pack"):
            work = [unit for index, groups in self._step_units() if (unit := self._prepare(index, groups)) is not None]
        if not work and (self._shards is None or not self._has_gradients()):
            return
        problem = self._gradient_problem(self._read(work))
        if problem is not None:
            self._refuse_step(problem, stateless)
            return
        self._update(work, stateless)

    def _check_step(self) -> None:
        """The step's input, checked before anything is packed: the groups together, and the gradients."""
        self._check_group_set(self.param_groups)
        for group in self.param_groups:
            self._check_grads([p for p in group["params"] if p.grad is not None])

    def _step_units(self) -> list[tuple[int, list[dict]]]:
        """``(index, groups)`` of each unit the step packs and updates apart: here one per parameter group."""
        return [(index, [group]) for index, group in enumerate(self.param_groups)]

    def _prepare(self, index: int, groups: list[dict]) -> Optional[StepWork]:
        """Get or rebuild unit ``index``'s packed group and pack its gradients; None when it has nothing to step.

        May create state for parameters without any, and nothing else.
        """
        raise NotImplementedError

    def _update(self, work: list[StepWork], stateless: Sequence[torch.Tensor]) -> None:
        """The update of every prepared unit, once the step may happen. ``stateless``: for a step that finds
        it must be undone after all (:meth:`_refuse_step`)."""
        raise NotImplementedError

    def _gradient_problem(self, largest: float) -> Optional[str]:
        """Why the step must not happen, from the largest gradient probe; None when it may."""
        return None if math.isfinite(largest) else "a gradient holds NaN or inf"

    def _has_gradients(self) -> bool:
        return any(p.grad is not None for group in self.param_groups for p in group["params"])

    def _read(self, work: list[StepWork]) -> float:
        """The step's one host synchronisation: the largest probe, and each unit's ``measures`` into its ``readings``.

        On shards every rank takes part, holding a shard or not, and reads the
        largest probe over the ranks (NaN anywhere is inf everywhere), so all
        decide alike. (FlatSGD, which reads ``measures``, reads them over the ranks itself.)
        """
        largest = torch.stack([unit.probe for unit in work] or [torch.zeros(())]).max()
        if self._shards is not None:
            return self._shards.largest(largest)
        measures = [value for unit in work for value in unit.measures]
        if not measures:
            return float(largest)
        values = iter(torch.stack([largest, *measures]).tolist())
        largest = next(values)
        for unit in work:
            unit.readings = [next(values) for _ in unit.measures]
        return largest

    # ------------------------------------------------------------------ the non-finite policy

    def _stateless_params(self) -> list[torch.Tensor]:
        """Parameters without state: a refused step forgets any state it created for them."""
        return [p for group in self.param_groups for p in group["params"] if not self.state.get(p)]

    def _refuse_step(self, problem: str, stateless: Sequence[torch.Tensor] = ()) -> None:
        """Apply ``on_nonfinite`` to a step that must not happen; nothing has been modified.

        ``stateless``: the parameters that had no state when the step began
        (:meth:`_stateless_params`); state created for them since is dropped,
        and with it the packed groups that held it.
        """
        created = False
        for p in stateless:
            created = bool(self.state.pop(p, None)) or created
        if created:
            self._packed.clear()
        apply_nonfinite_policy(self, problem, "parameters and state are unchanged")

    # ------------------------------------------------------------------ checkpoints and copies

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        state[LAYOUT_KEY] = param_layout(self.param_groups)
        if self._shards is not None:
            state[SHARD_WORLD_KEY] = self._shards.spec.world
            state["state"] = self._sharded_state(state["state"])
            for saved, layout in zip(state["param_groups"], state[LAYOUT_KEY]):
                saved.update({LAYOUT_KEY: layout, SHARD_WORLD_KEY: self._shards.spec.world,
                              SKIPPED_KEY: self.skipped_steps})
        return state

    def _sharded_state(self, saved_state: dict) -> dict:
        """The per-parameter state with each rank's tensors as DTensors (new dicts; the live state is not touched)."""
        params = list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        spec = self._shards.spec
        shown = {}
        for key, entry in saved_state.items():
            p = params[key]
            entry = dict(entry)
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if name in self.LIKE_PARAM_ENTRIES and value.shape == local_tensor(p).shape:
                    entry[name] = like_param(value, p)
                elif name in self.RANK_STACKED_ENTRIES:
                    entry[name] = rank_stacked(value, spec)
            shown[key] = entry
        return shown

    def _local_state_dict(self, state_dict: dict) -> dict:
        """``state_dict`` with DTensor entries as this rank's local tensors and the layout, world size and
        skipped steps at the top (from its groups when only those carry them); the groups lose those keys.

        A DTensor saved on a mesh of another size than this optimizer's is refused.
        """
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
            state_dict.get("param_groups"), (list, tuple)
        ):
            return state_dict  # check_state_dict names the problem
        out = dict(state_dict)
        groups = []
        for saved in state_dict["param_groups"]:
            if isinstance(saved, dict) and any(key in saved for key in _GROUP_METADATA):
                saved = dict(saved)
                metadata = {key: saved.pop(key) for key in _GROUP_METADATA if key in saved}
                if LAYOUT_KEY not in state_dict:
                    out.setdefault(LAYOUT_KEY, []).append(metadata.get(LAYOUT_KEY))
                for key in (SHARD_WORLD_KEY, SKIPPED_KEY):
                    if key in metadata and key not in state_dict:
                        out.setdefault(key, metadata[key])
            groups.append(saved)
        out["param_groups"] = groups
        world = self._shards.spec.world if self._shards is not None else None
        local_state = {}
        for key, entry in state_dict["state"].items():
            if isinstance(entry, dict) and any(is_sharded(v) for v in entry.values()):
                entry = dict(entry)
                for name, value in entry.items():
                    if is_sharded(value):
                        if value.device_mesh.size() != world:
                            reshard = (" (torch.distributed.checkpoint reshards it: dcp.load into this "
                                       "optimizer's get_optimizer_state_dict, then set_optimizer_state_dict)"
                                       if self.RESHARDABLE else "")
                            raise ValueError(
                                f"saved state {name!r} is sharded over {value.device_mesh.size()} ranks, and this "
                                f"optimizer's parameters over {world or 1}; {type(self).__name__} keeps each "
                                "rank's part of its state and cannot reshard it: resume on as many ranks"
                                + reshard
                            )
                        entry[name] = value.to_local()
            local_state[key] = entry
        out["state"] = local_state
        return out

    def check_state_dict(self, state_dict) -> None:
        """Raise ``ValueError`` naming the first problem unless :meth:`load_state_dict` can load ``state_dict``.

        Checks, without modifying anything: the parameter layout it was saved for
        (``param_layout``), every group's hyperparameters, ``skipped_steps``, that
        the state belongs to listed parameters, and every entry's names, shapes,
        dtypes, counters and finiteness (:meth:`_checkpoint_spec`).
        """
        as_given = state_dict
        state_dict = self._local_state_dict(state_dict)
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
            state_dict.get("param_groups"), (list, tuple)
        ):
            raise ValueError("state_dict must be a dict with 'state' (a dict) and 'param_groups' (a list), "
                             "as state_dict() returns")
        self._check_shard_world(state_dict.get(SHARD_WORLD_KEY))
        saved_state, saved_groups = state_dict["state"], state_dict["param_groups"]
        if not all(isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) for g in saved_groups):
            raise ValueError("each of the state dict's param_groups must be a dict with a 'params' list")
        if len(saved_groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"]) for saved, group in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("the state dict's parameter groups do not match the optimizer's (count or sizes)")
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in saved_groups))
        if len(set(saved_ids)) != len(saved_ids):
            raise ValueError("the state dict's param_groups list a parameter id more than once")
        strays = sorted(set(saved_state) - set(saved_ids), key=str)
        if strays:
            raise ValueError(f"the state dict holds state for parameter ids {strays} that no parameter group lists")
        check_param_layout(state_dict.get(LAYOUT_KEY), self.param_groups)
        self._check_resharded(as_given["state"], saved_groups, state_dict.get(SHARD_WORLD_KEY))
        skipped = state_dict.get("skipped_steps", 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"skipped_steps must be an int >= 0, got {skipped!r}")
        hypers = [{**self.defaults, **{k: v for k, v in saved.items() if k != "params"}} for saved in saved_groups]
        for index, hyper in enumerate(hypers):
            try:
                self._check_group(hyper)
            except TypeError as error:  # a checkpoint's field of the wrong kind is a bad value of the state dict
                raise ValueError(f"param_groups[{index}]: {error}") from error
        self._check_group_set(hypers)
        for index, (saved, group, hyper) in enumerate(zip(saved_groups, self.param_groups, hypers)):
            spec = self._checkpoint_spec(index, hyper, group["params"])
            if spec is not None:
                spec.check(type(self).__name__, [local_tensor(p) for p in group["params"]],
                           [saved_state.get(i) for i in saved["params"]])

    def _check_shard_world(self, saved) -> None:
        """A checkpoint resumes on as many ranks as saved it (None: unsharded), else ``ValueError``; a
        ``RESHARDABLE`` optimizer's on any number, its entries checked by :meth:`_check_resharded`."""
        world = self._shards.spec.world if self._shards is not None else None
        if saved == world:
            return
        if saved is not None and (isinstance(saved, bool) or not isinstance(saved, int) or saved < 1):
            raise ValueError(f"{SHARD_WORLD_KEY} must be an int >= 1, got {saved!r}")
        if self.RESHARDABLE:
            return
        saved_text, mine_text = self._world_texts(saved)
        raise ValueError(
            f"{SHARD_WORLD_KEY}: the state dict was saved for {saved_text}, this optimizer has {mine_text}; "
            f"{type(self).__name__} keeps each rank's part of its state (its shards' columns of the window, "
            "its blocks) and cannot reshard it: resume with the same number of ranks"
        )

    def _world_texts(self, saved) -> tuple[str, str]:
        world = self._shards.spec.world if self._shards is not None else None
        return (f"sharded over {saved} ranks" if saved is not None else "unsharded parameters",
                f"sharded over {world} ranks" if world is not None else "unsharded parameters")

    def _check_resharded(self, saved_state: dict, saved_groups: Sequence[dict], saved_world) -> None:
        """A checkpoint saved on another number of ranks holds every per-coordinate entry laid out for this
        optimizer's parameters (``ValueError`` otherwise): a DTensor laid out like its parameter (what
        ``torch.distributed.checkpoint`` loads into this optimizer's ``get_optimizer_state_dict``), or a
        tensor of the parameter's whole shape. A rank's part saved on another count of ranks is refused:
        nothing tells which of the parameter's rows it holds.
        """
        world = self._shards.spec.world if self._shards is not None else None
        if saved_world == world:
            return
        saved_ids = itertools.chain.from_iterable(g["params"] for g in saved_groups)
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            entry = saved_state.get(saved_id)
            if not isinstance(entry, dict):
                continue  # CheckpointSpec names the problem
            for name, value in entry.items():
                if name not in self.LIKE_PARAM_ENTRIES or not isinstance(value, torch.Tensor):
                    continue
                if is_sharded(value):
                    laid_out_here = value.shape == p.shape and value.placements == getattr(p, "placements", None)
                else:
                    laid_out_here = value.shape == p.shape
                if not laid_out_here:
                    saved_text, mine_text = self._world_texts(saved_world)
                    raise ValueError(
                        f"{SHARD_WORLD_KEY}: the state dict was saved for {saved_text}, this optimizer has "
                        f"{mine_text}, and its state {name!r} of shape {tuple(value.shape)} is not laid out like "
                        f"its parameter of shape {tuple(p.shape)}: a rank's part saved on another number of ranks "
                        "cannot be resharded; load a torch.distributed.checkpoint instead (dcp.load into this "
                        "optimizer's get_optimizer_state_dict, then set_optimizer_state_dict)"
                    )

    def load_state_dict(self, state_dict: dict) -> None:
        self.check_state_dict(state_dict)
        state_dict = self._local_state_dict(state_dict)
        skipped = state_dict.pop("skipped_steps", 0)
        state_dict.pop(LAYOUT_KEY)
        state_dict.pop(SHARD_WORLD_KEY, None)
        saved_state = state_dict["state"]
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        # The base class casts float state to the parameter's dtype; keep the saved dtypes.
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            for name, value in saved_state.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    device = value.device if name == "step" else p.device
                    self.state[p][name] = value.to(device=device, copy=True)
        self.skipped_steps = int(skipped)
        self._packed.clear()

    def __getstate__(self) -> dict:
        # torch's Optimizer keeps only defaults, state and param_groups; every attribute is
        # kept here, and the flat buffers are dropped: the per-parameter state has them.
        state = dict(self.__dict__)
        state["_packed"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._packed = {}

    def state_bytes(self) -> int:
        """Bytes the optimizer holds: its state tensors (each storage once) and its work buffers."""
        work = sum(p.work_bytes() for p in self._packed.values() if isinstance(p, PackedGroup))
        return optimizer_state_bytes(self) + work
