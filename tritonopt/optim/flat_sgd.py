"""``torch.optim.SGD`` over parameters that live in one flat buffer per group: one fused op per step.

Every DSP stage updates its block right after its own backward (Xu, Huo and
Huang, CVPR 2020, sec. 3.3), with momentum SGD in the paper's experiments
(sec. 5); :class:`FlatSGD` is that update, usable with any model.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from tritonopt._validation import check_bool, check_float
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._packed import CheckpointSpec, PackedGroup, PackedOptimizer, StepWork, bind_flat_state
from tritonopt.optim._sharding import is_sharded, local_tensor
from tritonopt.optim.functional import flat_sgd

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_STEPS = 2**62
_HYPERPARAMETERS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
# A step whose bound on any value it computes stays below this fraction of the largest finite
# value (float32 inside the fused op, the parameters' dtype once rounded) cannot overflow:
# the bound is a sum of products of rounded magnitudes, far within a factor of 4 of exact.
_SAFE_FRACTION = 0.25
_SAFE_FLOAT32 = _SAFE_FRACTION * torch.finfo(torch.float32).max


class _FlatGroup(PackedGroup):
    """A group whose parameters and gradients are views of two flat ``[1, total]`` buffers.

    ``weights`` and ``grad`` are the parameters and their gradients themselves (not copies);
    ``state`` holds the flat momentum buffer once it exists, ``work`` the float32 copy of
    narrower weights. ``bounds`` are upper bounds on ``max|weights|`` and ``max|momentum|``
    that the steps keep up to date (None until the next step measures them).

    ``sharded``: the parameters are DTensors, whose storage FSDP2 owns, so ``weights`` and
    ``grad`` are copies of the rank's local shards instead (also in ``work``, so that they
    count in the optimizer's bytes), packed before each step and the weights written back
    after it.
    """

    def __init__(self, layout: BlockLayout, weights: torch.Tensor, grad: torch.Tensor, *, sharded: bool = False):
        work = {} if weights.dtype == torch.float32 else {"weights32": layout.zeros(torch.float32)}
        if sharded:
            work.update(shard_weights=weights, shard_grad=grad)
        super().__init__(layout, {}, work)
        self.weights = weights
        self.grad = grad
        self.sharded = sharded
        self.bounds: Optional[tuple[float, float]] = None

    def holds(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` are still this group's tensors, each still the view of its slice (sharded: each
        local shard still the tensor the group was built for)."""
        if self.sharded:
            return self.layout.matches(params) and all(
                now.dtype == then.dtype and now.shape == then.shape and now.data_ptr() == then.data_ptr()
                for now, then in zip((local_tensor(p) for p in params), self.layout.locals)
            )
        return self.layout.matches(params) and all(
            p.dtype == view.dtype and p.data_ptr() == view.data_ptr()
            for p, view in zip(params, self.layout.views(self.weights))
        )

    def write_back(self) -> None:
        """Sharded: the stepped weights into the parameters' local shards."""
        for local, view in zip(self.layout.locals, self.layout.views(self.weights)):
            local.copy_(view)


class FlatSGD(PackedOptimizer):
    r"""Momentum SGD (``torch.optim.SGD``'s arithmetic) over one flat buffer per group, one fused op per step.

    Per group, per element, exactly ``torch.optim.SGD``::

        d   = -g if maximize else g
        d   = d + weight_decay * w                       (L2 decay, in the gradient)
        buf = d  (first step)  or  momentum * buf + (1 - dampening) * d
        d   = d + momentum * buf  (nesterov)  or  buf     (with momentum)
        w   = w - lr * d

    A group's parameters are moved into one contiguous ``[1, total]`` buffer when
    the group is added (each parameter becomes a view of its slice and keeps its
    values), and their gradients into a second one that autograd accumulates into
    in place, so a step is one call of :func:`tritonopt.ops.sgd_momentum_step`
    per group: ``w``, ``g`` and the momentum buffer read once, ``w`` and the
    buffer written once (20 bytes per float32 element). float16 and bfloat16
    parameters are stepped in a float32 copy and rounded once to their dtype.

    Args:
        params: parameters or parameter groups; float32, float16 or bfloat16, one
            dtype and one device per group. Groups may override every
            hyperparameter below except ``on_nonfinite``.
        lr, momentum, dampening, weight_decay, nesterov, maximize: as ``torch.optim.SGD``.
        on_nonfinite: a step whose gradients hold NaN or inf changes nothing:
            ``"skip"`` (default) warns and counts it in :attr:`skipped_steps`,
            ``"raise"`` raises ``FloatingPointError``. Checking costs one
            reduction of the gradients and one device-to-host synchronisation
            per step. A finite gradient large enough that the step could
            overflow (a bound on every value the step computes, from the
            gradients' largest entry and bounds on the weights and the
            momentum, passes a quarter of the largest finite value) makes the
            step copy the weights and the momentum first and check the result
            (a second synchronisation); if it is not finite the step is undone
            and counted like a non-finite gradient. The bounds are measured when
            the flat buffers are (re)built and after such a checked step, and
            carried forward by every other step; values written into the
            parameters in place between steps are not seen by them.

    State (per parameter): ``momentum_buffer``, float32, shaped like the
    parameter (a view of the group's flat buffer; created at the first step
    with momentum, as torch's). The first parameter of each group also holds
    ``step``, the group's number of steps.

    Differences from ``torch.optim.SGD``: float64 parameters are refused (the
    fused op computes in float32); ``zero_grad`` always zeroes the flat
    gradients in place (``set_to_none`` is ignored, so the views stay
    attached); a parameter whose ``.grad`` is ``None`` is stepped with a zero
    gradient (weight decay and momentum still move it) instead of being
    skipped. A gradient tensor that was replaced, not accumulated into, is
    copied into the flat buffer before the step. Replacing a parameter's
    ``.data`` (or copying, unpickling or loading the optimizer) is noticed at
    the next step, which moves the parameters into a fresh flat buffer.

    Sharded parameters (DTensors of FSDP2's ``fully_shard``: ``Shard(0)`` or
    ``Replicate()`` on a 1-D mesh, or along the shard dimension of a 2-D HSDP
    mesh, replicated along its replicate one) stay where FSDP2 keeps them: each step
    copies the rank's local shards and their gradients into the group's flat
    buffers, steps them and writes the weights back, and ``zero_grad`` is
    ``torch.optim.Optimizer``'s (``set_to_none`` honoured). The update is
    elementwise, so it equals the unsharded optimizer's bit for bit; the
    momentum is the rank's part. The ranks decide alike: each step all-reduces
    (max, over the shard dimension's ranks: the replicas hold the same
    values) one float32 per group, its largest gradient entry (4 more bytes for
    the weights and 4 for the momentum, per group, at a step that measures the
    bounds), so every rank skips or raises on a non-finite gradient anywhere and
    computes the same bounds; a step that could overflow all-reduces its
    measured bounds (8 bytes per group) and is undone on every rank when any
    rank's result is not finite. The ranks must rebuild their buffers together
    (they do: the first step, a load, a refused step that created state). A
    checkpoint of ``torch.distributed.checkpoint`` resumes on any number of
    ranks and any mesh shape (1-D or HSDP): each coordinate's momentum is what
    was saved, and the run goes on as an uninterrupted one on the new ranks would;
    so does a plain FlatSGD loading it in one process. Its flat gradients are
    attached from construction, so torch's ``get_optimizer_state_dict`` does not
    take its initialising step: step once at ``lr = 0`` before building the
    template, or the template holds no momentum to load.
    """

    ALGO = "flat_sgd"
    SHARDING_REFUSAL = None
    LIKE_PARAM_ENTRIES = frozenset({"momentum_buffer"})
    RESHARDABLE = True  # the momentum is per coordinate, the step counter the same on every rank

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        on_nonfinite: str = "skip",
    ):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, on_nonfinite)

    # ------------------------------------------------------------------ checks

    def _check_group(self, group: dict) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            check_float(name, group[name], low=0.0)
        check_bool("nesterov", group["nesterov"])
        check_bool("maximize", group["maximize"])
        if group["nesterov"] and (group["momentum"] == 0 or group["dampening"] != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")

    def _check_params(self, params: Sequence[torch.Tensor]) -> None:
        super()._check_params(params)
        if sum(p.numel() for p in params) == 0:
            raise ValueError("a FlatSGD group needs at least one element: its parameters are all empty, and an "
                             "empty group has no flat buffer to step")
        for p in params:
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(
                    f"FlatSGD steps float32, float16 or bfloat16 parameters (the fused op computes in float32), "
                    f"got {p.dtype}"
                )
            if p.dtype != params[0].dtype:
                raise TypeError(f"a group's parameters share one flat buffer: one dtype, found {params[0].dtype} "
                                f"and {p.dtype}")
            if p.is_sparse:
                raise ValueError("FlatSGD needs dense parameters")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in a group")

    def _check_grads(self, params: Sequence[torch.Tensor]) -> None:
        super()._check_grads(params)
        for p in params:
            if is_sharded(p) and not (is_sharded(p.grad) and p.grad.placements == p.placements
                                      and local_tensor(p.grad).shape == local_tensor(p).shape):
                placements = getattr(p.grad, "placements", None)
                raise RuntimeError(
                    f"the gradient of a DTensor parameter with placement {tuple(p.placements)} must be a DTensor "
                    f"laid out like it, got {'a plain tensor' if placements is None else tuple(placements)}"
                )

    def _checkpoint_spec(self, index: int, group: dict, params) -> CheckpointSpec:
        return CheckpointSpec(per_param=frozenset(), like_param=frozenset({"momentum_buffer"}),
                              optional=frozenset({"momentum_buffer"}), group_counters={"step": _MAX_STEPS},
                              dtypes={"momentum_buffer": torch.float32})

    # ------------------------------------------------------------------ the flat buffers

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._packed_group(index, self.param_groups[index:], self.param_groups[index]["params"])
        except Exception:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            self._packed.pop(index, None)
            raise

    def _packed_group(self, index: int, groups: list[dict], params: list[torch.Tensor]) -> _FlatGroup:
        """The group's flat buffers; the parameters are moved into fresh ones when they are not views of them."""
        packed = self._packed.get(index)
        if packed is not None and packed.holds(params):
            return packed
        self._check_params(params)  # their dtype or device may have changed with their data
        if self._shards is not None:
            # One block of the rank's local elements; a rank holding none of the group's rows keeps one padding
            # element, so that it still takes part in every collective of the step.
            local_total = sum(local_tensor(p).numel() for p in params)
            layout = BlockLayout(params, max(local_total, 1), span=max(local_total, 1))
            dtype = params[0].dtype
            packed = _FlatGroup(layout, layout.zeros(dtype), layout.zeros(dtype), sharded=True)
            self._packed[index] = packed
            return packed
        layout = BlockLayout(params, sum(p.numel() for p in params))
        weights, grad = layout.zeros(params[0].dtype), layout.zeros(params[0].dtype)
        with torch.no_grad():
            layout.pack(params, weights)
            for p, weight_view, grad_view in zip(params, layout.views(weights), layout.views(grad)):
                if p.grad is not None:
                    grad_view.copy_(p.grad)
                p.data = weight_view
                p.grad = grad_view
        packed = _FlatGroup(layout, weights, grad)
        self._packed[index] = packed
        return packed

    def _gather_gradients(self, packed: _FlatGroup) -> None:
        """Re-attach gradients that were replaced or cleared, so the flat buffer holds every one."""
        for p, view in zip(packed.layout.tensors, packed.layout.views(packed.grad)):
            if p.grad is not None and p.grad.data_ptr() == view.data_ptr() and p.grad.shape == p.shape:
                continue
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view

    def _pack_shards(self, packed: _FlatGroup) -> None:
        """Sharded: the local shards and their gradients (zero where None) into the group's flat buffers."""
        packed.layout.pack(packed.layout.tensors, packed.weights)
        for p, view in zip(packed.layout.tensors, packed.layout.views(packed.grad)):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(local_tensor(p.grad))

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002  (the views must stay)
        if self._shards is not None:  # FSDP2 owns the gradients: nothing of ours is attached to them
            super().zero_grad(set_to_none)
            return
        for index, group in enumerate(self.param_groups):
            packed = self._packed_group(index, [group], group["params"])
            packed.grad.zero_()
            for p, view in zip(packed.layout.tensors, packed.layout.views(packed.grad)):
                p.grad = view

    # ------------------------------------------------------------------ step

    def _prepare(self, index: int, groups: list[dict]) -> StepWork:
        packed = self._packed_group(index, groups, groups[0]["params"])
        if packed.sharded:
            self._pack_shards(packed)
        else:
            self._gather_gradients(packed)
        # The group's largest gradient entry and, where the flat buffers were just built, the bounds'
        # first measure: its weights' and momentum's largest entries.
        largest_grad = packed.grad.abs().amax().float()
        measures = [largest_grad]
        if packed.bounds is None:
            measures += [packed.weights.abs().amax().float(), self._largest_momentum(packed)]
        return StepWork(index, groups, list(packed.layout.tensors), packed, largest_grad, measures=measures)

    def _read(self, work: list[StepWork]) -> float:
        if self._shards is None:
            return super()._read(work)
        # Every rank reads the largest value over the ranks of each measure (the group's largest gradient entry
        # first), in one all-reduce; NaN anywhere is inf everywhere, so the ranks skip and bound alike.
        readings = self._largest_over_ranks([value for unit in work for value in unit.measures])
        for unit in work:
            unit.readings, readings = readings[:len(unit.measures)], readings[len(unit.measures):]
        return max(unit.readings[0] for unit in work)

    def _largest_over_ranks(self, values: list[torch.Tensor]) -> list[float]:
        """Each 0-d ``value``'s largest over the ranks, in one all-reduce (NaN taken as inf)."""
        # posinf too: nan_to_num's default would turn inf into the largest finite float.
        stacked = torch.nan_to_num(torch.stack(values).to(torch.float32), nan=math.inf, posinf=math.inf)
        return self._shards.all_reduce(stacked, dist.ReduceOp.MAX).tolist()

    def _update(self, work: list[StepWork], stateless) -> None:
        bounds, risky = [], False
        for unit in work:
            group, packed = unit.groups[0], unit.packed
            largest_grad, *measured = unit.readings
            if packed.bounds is None:
                packed.bounds = tuple(measured)
            first_step = group["momentum"] != 0 and not any(
                "momentum_buffer" in self.state.get(p, {}) for p in packed.layout.tensors)
            after, group_risky = _step_bounds(group, largest_grad, packed.bounds, first_step, packed.weights.dtype)
            bounds.append(after)
            risky = risky or group_risky

        # A step that could overflow keeps what it may have to restore.
        saved = [self._keep(unit.packed) for unit in work] if risky else None
        for unit in work:
            group, packed = unit.groups[0], unit.packed
            first_step = False
            if group["momentum"] != 0 and "momentum_buffer" not in packed.state:
                first_step = not any("momentum_buffer" in self.state[p] for p in unit.params)
                packed.state.update(bind_flat_state(self.state, packed.layout, ["momentum_buffer"], torch.float32))
            hyperparameters = {name: group[name] for name in _HYPERPARAMETERS}
            flat_sgd(packed.weights, packed.grad, packed.state.get("momentum_buffer"), first_step=first_step,
                     work=packed.work.get("weights32"), **hyperparameters)
        if risky:
            # One read: every group's largest weight and momentum entry (NaN and inf propagate), over the
            # ranks where sharded, so that all undo the step when any rank's result is not finite.
            measured = [value for unit in work for value in
                        (unit.packed.weights.abs().amax().float(), self._largest_momentum(unit.packed))]
            measured = (torch.stack(measured).tolist() if self._shards is None
                        else self._largest_over_ranks(measured))
            if not all(math.isfinite(value) for value in measured):
                for unit, kept in zip(work, saved):
                    self._restore(unit.packed, kept)
                self._refuse_step("the update overflowed to NaN or inf (a finite but huge gradient); the step "
                                  "was undone")
                return
            bounds = list(zip(measured[0::2], measured[1::2]))
        for unit, after in zip(work, bounds):
            if unit.packed.sharded:
                unit.packed.write_back()
            unit.packed.bounds = after
            counter = self.state[unit.packed.layout.tensors[0]]
            counter["step"] = counter.get("step", 0) + 1

    def _largest_momentum(self, packed: _FlatGroup) -> torch.Tensor:
        """``max|momentum|`` of the group as a 0-d float32 tensor (0 without a momentum buffer)."""
        if "momentum_buffer" in packed.state:
            return packed.state["momentum_buffer"].abs().amax().float()
        # .get: reading the state must not create entries for parameters without any.
        buffers = [self.state[p]["momentum_buffer"] for p in packed.layout.tensors
                   if "momentum_buffer" in self.state.get(p, {}) and self.state[p]["momentum_buffer"].numel()]
        if not buffers:
            return packed.weights.new_zeros((), dtype=torch.float32)
        return torch.stack([b.abs().amax().float().to(packed.weights.device) for b in buffers]).amax()

    def _keep(self, packed: _FlatGroup) -> tuple:
        """What :meth:`_restore` needs to undo this step on ``packed``: copies of the weights and the
        momentum, or the per-parameter momentum entries the step will replace with views."""
        bound = packed.state.get("momentum_buffer")
        entries = {p: self.state.get(p, {}).get("momentum_buffer") for p in packed.layout.tensors}
        return packed.weights.clone(), None if bound is None else bound.clone(), entries

    def _restore(self, packed: _FlatGroup, kept: tuple) -> None:
        weights, momentum, entries = kept
        packed.weights.copy_(weights)
        if momentum is not None:
            packed.state["momentum_buffer"].copy_(momentum)
            return
        if packed.state.pop("momentum_buffer", None) is None:
            return
        # The buffer was made by this step: the parameters get back what they held before it.
        for p, entry in entries.items():
            if entry is not None:
                self.state[p]["momentum_buffer"] = entry
            elif self.state[p].pop("momentum_buffer", None) is not None and not self.state[p]:
                del self.state[p]


def _step_bounds(group: dict, largest_grad: float, bounds: tuple[float, float], first_step: bool,
                 dtype: torch.dtype) -> tuple[tuple[float, float], bool]:
    """Bounds on ``max|weights|`` and ``max|momentum|`` after one step of ``group``, and whether the step
    could overflow: ``torch.optim.SGD``'s update (see :class:`FlatSGD`) with every term at its bound."""
    weights, momentum = bounds
    mu = group["momentum"]
    direction = largest_grad + group["weight_decay"] * weights
    values = [direction]
    if mu != 0:
        momentum = direction if first_step else mu * momentum + abs(1.0 - group["dampening"]) * direction
        direction = direction + mu * momentum if group["nesterov"] else momentum
        values += [momentum, direction]
    values.append(group["lr"] * direction)
    weights = weights + values[-1]
    risky = not (max(values) < _SAFE_FLOAT32 and weights < _SAFE_FRACTION * torch.finfo(dtype).max)
    return (weights, momentum), risky
