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
* checkpoints (:class:`~tritonopt.optim._packed_checkpoints.PackedCheckpoints`,
  a base of :class:`PackedOptimizer`): saved dtypes kept, ``skipped_steps`` and
  the parameter layout carried, a state dict checked whole before anything is
  loaded;
* copies: ``copy.deepcopy`` and ``pickle`` keep every attribute; the flat
  buffers are rebuilt from the per-parameter state at the next step;
* :meth:`PackedOptimizer.state_bytes`: the bytes of the state and the work buffers;
* :func:`available_memory`: what a device can still hold, to refuse an optimizer
  whose state cannot fit before it allocates anything;
* sharded parameters (DTensors of FSDP2's ``fully_shard`` on a 1-D mesh or a
  2-D HSDP one, see :mod:`~tritonopt.optim._sharding`): an optimizer that sets
  ``SHARDING_REFUSAL = None`` packs each rank's local shards and keeps its state
  per rank; every other one refuses DTensors at construction, saying why. The
  ranks (every rank of the mesh) check at construction that they were given
  the same settings (their checkpoints: :mod:`~tritonopt.optim._packed_checkpoints`).
"""

from __future__ import annotations

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
from tritonopt.optim._checkpoints import CheckpointSpec  # noqa: F401  (public here)
from tritonopt.optim._packed_checkpoints import PackedCheckpoints
from tritonopt.optim._sharding import ShardGroup, refuse_sharded, shard_spec

NONFINITE_POLICIES = ("skip", "raise")


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


class PackedOptimizer(PackedCheckpoints, Optimizer):
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
        "MFAC, SparseMFAC, GGT, SparseGGT, LowRankMFAC, FlatSGD and FOSI"
    )

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
        return ShardGroup(spec, owner=name)

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

    # ------------------------------------------------------------------ copies

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
