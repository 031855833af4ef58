"""The windowed preconditioners (M-FAC, GGT; dense, sparse and low-rank windows): one class, two choices.

A windowed preconditioner keeps the last ``m`` gradients ``G`` of a parameter
group (in a :mod:`window <tritonopt.optim._windows>`) and applies
``u = x / scale + z @ G`` to the step's vector ``x``, with the weights ``z``
from the ``m x m`` Gram matrix (:mod:`~tritonopt.optim._window_algebra`):

=====================  ===============  =====================================
class                  window           weights (``scale``)
=====================  ===============  =====================================
``MFAC``               dense            :func:`mfac_weights` (``damp``)
``SparseMFAC``         sparse ring      :func:`mfac_weights` (``damp``)
``LowRankMFAC``        low-rank         :func:`mfac_weights` (``damp``)
``GGT``                dense            :func:`ggt_weights` (``eps``)
``SparseGGT``          sparse ring      :func:`ggt_weights` (``eps``)
=====================  ===============  =====================================

All parameters, of every group, form one vector (one empirical Fisher over the
whole model, as the paper argues: a "no weight decay on biases" group must not
split the curvature): the parameters, flattened in group order and laid end to
end, whether or not they have a gradient this step, so that the rows of the
window always mean the same coordinates. Groups keep their own ``lr``,
``momentum`` and ``weight_decay``; the window's hyperparameters (``ngrads``, the
scale, ``density``, ``block_size``, ...) are shared and must agree.
``per_group_windows=True`` gives each group its own window instead. A step::

    s = window.insert(g)                 # g: the gradients, zero where missing
    dots[slot, :] = dots[:, slot] = s
    u = (weights(dots, s) + e_slot / scale) @ G        # = x / scale + z @ G
    u *= min(1, max_update_norm / ||u||)               # only with max_update_norm
    v = momentum * v + u                 # per group, only when momentum > 0 (no dampening)
    theta = (1 - lr * weight_decay) * theta - lr * v   # per group, decoupled weight decay

The decay is AdamW-style, ``1 - lr * weight_decay`` (the ISTA-DASLab
convention); the EFCP repository's ``(1 - gamma) * theta`` is
``weight_decay = gamma / lr``. Gradients never include the decay, so the
stored gradients stay an empirical Fisher (EFCP sec. 2.2).

Parameters without a gradient are not updated and their per-parameter state
(``error``, ``momentum_buffer``, ``step``) does not change; they contribute zeros
to the row stored this step. State layout:

* per parameter: ``step`` (float32 scalar), and, as views of one flat group
  buffer, ``error`` (error feedback, sparse and low-rank windows) and
  ``momentum_buffer`` (created at the first step with ``momentum > 0``);
* per window, in the state of its first parameter: the window, ``dots``
  (float64 ``[m, m]`` Gram matrix of the rows), ``ring_slot`` (the next row to
  overwrite) and ``ring_filled`` (rows written so far, at most ``m``).

Before it allocates anything, the constructor refuses a window whose state would
not fit in the memory its device has left (:meth:`expected_state_bytes`).

Sharded parameters (DTensors of FSDP2's ``fully_shard``, ``Shard(0)`` or
``Replicate()`` on a 1-D mesh, or ``(Replicate(), Shard(0))`` and
``(Replicate(), Replicate())`` on a 2-D HSDP mesh; dense and sparse windows):
each rank keeps its shards' columns of the window, laid end to end and padded
with zeros to the length of the fullest rank's (rank 0's), so that every rank's
window has one shape; a sparse window cuts each rank's part into its own blocks.
Every entry of ``s = G x`` (and so of ``dots``) is a sum over coordinates: each
rank computes its part and one all-reduce of ``m`` float64 values over the
shard dimension's ranks sums them (a replicated parameter's coordinates count
``1 / world`` on each rank, ``world`` the shard dimension's size). The ``m x m``
algebra is then the same on every rank, and the combination ``w @ G`` is
local; on an HSDP mesh the ranks of one replica group hold the same columns and
compute alike. The gradient-norm check takes one all-reduce of one float per window
(``max_update_norm`` one more), so ranks skip a step together. Per rank the
window is ``1 / world`` of the unsharded one (up to the uneven rows), and
``dots`` is replicated. At ``density = 1`` the result equals the unsharded
optimizer's up to the order of the float32 sums. The low-rank window keeps a
``Shard(0)`` tensor's rows of its factors instead and all-reduces its power
iteration's sums over rows (see ``LowRankWindow``); ``track_error_norm`` is
refused on DTensors.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

import torch

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_bool, check_float, check_int
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._packed import (
    CheckpointSpec,
    PackedGroup,
    PackedOptimizer,
    StepWork,
    available_memory,
    bind_flat_state,
)
from tritonopt.optim._checkpoints import LAYOUT_KEY, check_param_layout
from tritonopt.optim._sharding import is_row_sharded, is_sharded, like_param_rows, local_tensor
from tritonopt.optim._windows import DenseWindow
from tritonopt.optim.functional import apply_decoupled_update, heavy_ball_momentum, window_weights

# Gradients are stored and multiplied in float32 (or bfloat16): with a gradient norm
# below this bound, every scalar product of two stored gradients stays far from overflow.
MAX_GRADIENT_NORM = 1e17
# What one window of a model shares across its groups (the rest is per group).
WINDOW_KEYS = ("ngrads", "damp", "eps", "density", "block_size", "error_feedback", "values_dtype", "error_dtype",
               "rank", "max_update_norm")


class WindowedPreconditioner(PackedOptimizer):
    """Base of the windowed preconditioners: subclasses set the class attributes below.

    ``ALGO`` names the NVTX ranges (``tritonopt/<ALGO>/<phase>``), ``WINDOW`` is
    a window class of :mod:`tritonopt.optim._windows`, ``WEIGHTS`` the weight
    function of :mod:`tritonopt.optim._window_algebra` (a ``staticmethod``) and
    ``SCALE`` the name of the hyperparameter that divides ``x`` (``"damp"`` or
    ``"eps"``).
    """

    ALGO: str
    WINDOW: type
    WEIGHTS: Callable
    SCALE: str
    # Blockwise compressors see a zero accumulator where a parameter has no gradient.
    FREEZE_BY_ZERO_ACCUMULATOR = True
    SHARDING_REFUSAL = None
    LIKE_PARAM_ENTRIES = frozenset({"error", "momentum_buffer"})
    RANK_STACKED_ENTRIES = frozenset({"ring_indices", "ring_values"})
    LIKE_PARAM_ROWS_ENTRIES = frozenset({"ring_rows"})  # a dense window's rows, as its state_dict shows them

    def __init__(self, params: Iterable, defaults: dict, on_nonfinite: str, *,
                 per_group_windows: bool = False, track_error_norm: bool = False):
        check_bool("per_group_windows", per_group_windows)
        check_bool("track_error_norm", track_error_norm)
        self.per_group_windows = per_group_windows
        self.track_error_norm = track_error_norm
        super().__init__(params, {"max_update_norm": None, **defaults}, on_nonfinite)
        self._check_fits()

    def _check_sharding(self):
        shards = super()._check_sharding()
        if shards is not None and self.track_error_norm:
            raise ValueError(f"{type(self).__name__}: track_error_norm is not supported with DTensor (sharded) "
                             "parameters: the norms it keeps would be each rank's shard's, not the model's")
        return shards

    def _agreement_settings(self) -> dict:
        return {**super()._agreement_settings(), "per_group_windows": self.per_group_windows}

    def _span(self, params: Sequence[torch.Tensor]) -> Optional[int]:
        """The length every rank's part of a sharded window is padded to (None for plain tensors)."""
        return None if self._shards is None else self._shards.spec.largest_local_numel(params)

    # ------------------------------------------------------------------ checks

    def _check_group(self, group: dict) -> None:
        check_float("lr", group["lr"], low=0.0)
        check_float("momentum", group["momentum"], low=0.0, high=1.0, high_open=True)
        check_float("weight_decay", group["weight_decay"], low=0.0)
        check_int("ngrads", group["ngrads"], low=1)
        check_float(self.SCALE, group[self.SCALE], low=0.0, low_open=True)
        if group.get("max_update_norm") is not None:
            check_float("max_update_norm", group["max_update_norm"], low=0.0, low_open=True)
        self.WINDOW.check_group(group)

    def _check_group_set(self, groups: Sequence[dict]) -> None:
        if self.per_group_windows:
            return
        for key in WINDOW_KEYS:
            values = [group.get(key) for group in groups]
            if any(value != values[0] for value in values):
                raise ValueError(
                    f"all parameter groups share one window, so they must agree on {key} (got "
                    f"{values}); pass per_group_windows=True for one window per group"
                )

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_fits_checked", False):  # groups added after construction
            try:
                self._check_fits()
            except MemoryError:
                self.param_groups.pop()
                raise

    # ------------------------------------------------------------------ windows and their memory

    def _windows(self) -> list[list[dict]]:
        """The groups of each window: one window over all groups, or one per group."""
        groups = self.param_groups
        return [[group] for group in groups] if self.per_group_windows else [list(groups)]

    def _block_size(self, group: dict) -> int:
        return group["block_size"] if self.WINDOW.BLOCKWISE else 1 << 62

    def _work_dtype(self, params: Sequence[torch.Tensor]) -> torch.dtype:
        if self.WINDOW.KEEPS_FLOAT64 and all(p.dtype == torch.float64 for p in params):
            return torch.float64
        return torch.float32

    def expected_state_bytes(self) -> int:
        """Bytes of state and work buffers the optimizer holds once every parameter has stepped.

        Equals :meth:`state_bytes` then (with ``momentum_buffer`` when some group
        has ``momentum > 0``); computed from the shapes alone, nothing is allocated.
        """
        total = 0
        for groups in self._windows():
            params = [p for group in groups for p in group["params"]]
            if not params:
                continue
            dtype = self._work_dtype(params)
            span = self._span(params)
            locals_ = [local_tensor(p) for p in params]
            group_entries, param_entries = self.WINDOW.state_layout(groups[0], locals_, dtype, span=span)
            entries = list(group_entries.values())
            for p in locals_:
                entries += list(param_entries(p).values())
            total += sum(math.prod(shape) * torch.empty((), dtype=d).element_size() for shape, d in entries)
            layout_numel = _padded_numel(locals_, self._block_size(groups[0]), span)
            flat = [dtype]  # the packed-gradient scratch
            if self.WINDOW.ERROR_FEEDBACK:
                flat.append(self.WINDOW.error_dtype(groups[0]))
            if any(g["momentum"] > 0 for g in groups):
                flat.append(dtype)
            if span is not None and self._shards.spec.world > 1 and not all(is_row_sharded(p) for p in params):
                flat.append(dtype)  # the replicated parameters' column weights
            total += sum(layout_numel * torch.empty((), dtype=d).element_size() for d in flat)
            total += 4 * len(params)  # the float32 step counters
        return total

    def _check_fits(self) -> None:
        self._fits_checked = True
        devices = {p.device for group in self.param_groups for p in group["params"]}
        if len(devices) != 1:
            return
        available = available_memory(devices.pop())
        needed = self.expected_state_bytes()
        if available is not None and needed > available:
            raise MemoryError(
                f"{type(self).__name__} needs {needed / 2**30:.2f} GiB for its state, and the device has "
                f"{available / 2**30:.2f} GiB left; lower ngrads (or density) or use a compressed window"
            )

    def _checkpoint_spec(self, index: int, group: dict, params) -> CheckpointSpec:
        if self.per_group_windows:
            window_params, first = params, True
        else:
            window_params = [p for g in self.param_groups for p in g["params"]]
            first = index == 0
        dtype = self._work_dtype(window_params)
        group_entries, param_entries = self.WINDOW.state_layout(
            group, [local_tensor(p) for p in window_params], dtype, span=self._span(window_params))
        error = {"error"} if self.WINDOW.ERROR_FEEDBACK else set()
        dtypes = {"momentum_buffer": dtype, "error": self.WINDOW.error_dtype(group)}
        for p in window_params[:1]:  # every parameter's own entries share their dtypes
            dtypes.update({name: entry_dtype for name, (_, entry_dtype) in param_entries(local_tensor(p)).items()})
        if first:
            dtypes.update({name: entry_dtype for name, (_, entry_dtype) in group_entries.items()})
        return CheckpointSpec(
            per_param=frozenset({"step"} | error),
            like_param=frozenset(error | {"momentum_buffer"}),
            optional=frozenset({"momentum_buffer"}),
            param_shapes=lambda p: {name: shape for name, (shape, _) in param_entries(p).items()},
            group_shapes={name: shape for name, (shape, _) in group_entries.items()} if first else {},
            group_counters={"ring_slot": group["ngrads"] - 1, "ring_filled": group["ngrads"]} if first else {},
            dtypes=dtypes,
            step_counters=frozenset({"step"}),
            group_rule=_check_ring if first else None,
        )

    # ------------------------------------------------------------------ checkpoints of a dense window

    def _reshard_refusal(self) -> Optional[str]:
        return self.WINDOW.RESHARD_REFUSAL

    def _window_keys(self, groups: Sequence[dict]) -> list[list[int]]:
        """The state dict keys (positions) of each window's parameters, for ``groups`` (this optimizer's or a
        state dict's, by position)."""
        starts, start = [], 0
        for group in groups:
            starts.append(start)
            start += len(group["params"])
        if self.per_group_windows:
            return [list(range(first, first + len(group["params"]))) for first, group in zip(starts, groups)]
        return [list(range(start))]

    def state_dict(self) -> dict:
        """As :class:`PackedOptimizer`'s, with a dense window shown as each parameter's ``ring_rows``
        (``[m, *p.shape]``: its columns of every row, unpadded; on shards a DTensor laid out like ``p`` along
        dimension 1) instead of the first parameter's ``ring_grads``, so that ``torch.distributed.checkpoint``
        reshards it and an unsharded optimizer loads it. Unsharded, the rows are views of the window."""
        state = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        shown = state["state"]
        for keys in self._window_keys(self.param_groups):
            first = shown.get(keys[0]) if keys else None
            if not isinstance(first, dict) or "ring_grads" not in first:
                continue
            window_params = [params[key] for key in keys]
            rows = DenseWindow.rows_of(first["ring_grads"], [local_tensor(p) for p in window_params])
            for key, p, r in zip(keys, window_params, rows):
                entry = dict(shown.get(key, {}))
                entry.pop("ring_grads", None)
                entry["ring_rows"] = like_param_rows(r, p) if is_sharded(p) else r
                shown[key] = entry
        return state

    def _local_state_dict(self, state_dict: dict) -> dict:
        """As :class:`PackedOptimizer`'s, with each window's ``ring_rows`` (this rank's columns, once DTensors are
        local) put back into the first parameter's ``ring_grads``, padded to this optimizer's span."""
        out = super()._local_state_dict(state_dict)
        if not isinstance(out, dict) or not isinstance(out.get("state"), dict) or not isinstance(
                out.get("param_groups"), list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                          for g in out["param_groups"]):
            return out
        saved_groups = out["param_groups"]
        saved_state = out["state"]
        if not any(isinstance(entry, dict) and "ring_rows" in entry for entry in saved_state.values()):
            return out
        try:
            check_param_layout(out.get(LAYOUT_KEY), self.param_groups)
        except ValueError:
            return out  # check_state_dict names the problem: the rows are another layout's
        saved_ids = [pid for g in saved_groups for pid in g["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        local_state = dict(saved_state)
        for keys in self._window_keys(self.param_groups):
            entries = [saved_state.get(saved_ids[key]) for key in keys]
            held = [isinstance(entry, dict) and "ring_rows" in entry for entry in entries]
            if not any(held):
                continue
            if not all(held):
                missing = [saved_ids[key] for key, h in zip(keys, held) if not h]
                raise ValueError(f"saved state 'ring_rows' is missing for parameters {missing} of a window whose "
                                 "other parameters hold theirs: every parameter of a window holds its rows")
            if "ring_grads" in entries[0]:
                raise ValueError("the saved state holds both 'ring_grads' and 'ring_rows' for one window")
            window_params = [params[key] for key in keys]
            locals_ = [local_tensor(p) for p in window_params]
            for entry, p, t in zip(entries, window_params, locals_):
                rows = entry["ring_rows"]
                if isinstance(rows, torch.Tensor) and tuple(rows.shape[1:]) == tuple(p.shape) != tuple(t.shape):
                    raise ValueError(
                        f"saved state 'ring_rows' of shape {tuple(rows.shape)} holds the whole parameter's columns, "
                        f"and this optimizer holds its shard {tuple(t.shape)}: a whole state loads into sharded "
                        "parameters through torch.distributed.checkpoint (dcp.load into this optimizer's "
                        "get_optimizer_state_dict, then set_optimizer_state_dict)"
                    )
            span = max(self._span(window_params) or 0, sum(t.numel() for t in locals_))
            window = DenseWindow.window_of([entry["ring_rows"] for entry in entries], locals_, span)
            for index, (key, entry) in enumerate(zip(keys, entries)):
                entry = {name: value for name, value in entry.items() if name != "ring_rows"}
                if index == 0:
                    entry["ring_grads"] = window
                local_state[saved_ids[key]] = entry
        return {**out, "state": local_state}

    def error_norm_ratios(self) -> list[Optional[float]]:
        """``||e|| / ||g||`` of each window's last step (what compression left out), with ``track_error_norm``.

        ``None`` for a window that keeps uncompressed rows or has not stepped.
        Reading it synchronises with the device.
        """
        ratios = []
        for index in range(len(self._windows())):
            stats = getattr(self._packed.get(index), "stats", {})
            ratios.append(float(stats["error_norm"] / stats["grad_norm"]) if "error_norm" in stats else None)
        return ratios

    # ------------------------------------------------------------------ packing

    def _initial_window(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        return self.WINDOW.initial_state(self.state, group, layout, dtype)

    def _packed_group(self, index: int, groups: list[dict], params: list[torch.Tensor]) -> PackedGroup:
        """Window ``index``'s flat buffers for these parameters, rebuilt when the parameters or the window changed."""
        group = groups[0]
        packed = self._packed.get(index)
        if (
            packed is not None
            and packed.layout.matches(params)
            and packed.layout.block_size == min(self._block_size(group), packed.layout.span)
            and self.state[params[0]]["dots"].shape[0] == group["ngrads"]
        ):
            return packed
        layout = BlockLayout(params, self._block_size(group), span=self._span(params))
        dtype = self._work_dtype(params)
        for p in params:
            self.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))
        buffers = {}
        if self.WINDOW.ERROR_FEEDBACK:
            buffers.update(bind_flat_state(self.state, layout, ["error"], self.WINDOW.error_dtype(group)))
        if any("momentum_buffer" in self.state[p] for p in params) or any(g["momentum"] > 0 for g in groups):
            buffers.update(bind_flat_state(self.state, layout, ["momentum_buffer"], dtype))
        ring = self.state[params[0]]
        for name, value in self._initial_window(group, layout, dtype).items():
            if name not in ring:
                ring[name] = value
            elif isinstance(value, torch.Tensor) and (
                not isinstance(ring[name], torch.Tensor) or ring[name].shape != value.shape
            ):
                raise ValueError(
                    f"state {name!r} does not match this window's layout (expected shape "
                    f"{tuple(value.shape)}); were ngrads, block_size or the parameters changed?"
                )
        work = {"grad": layout.zeros(dtype)}
        if self._shards is not None and self._shards.spec.world > 1 and any(not is_row_sharded(p) for p in params):
            # A replicated parameter's coordinates are on every rank: each counts them 1 / world in the sums.
            weights = layout.zeros(dtype).fill_(1.0)
            for p, view in zip(params, layout.views(weights)):
                if not is_row_sharded(p):
                    view.fill_(1.0 / self._shards.spec.world)
            work["column_weights"] = weights
        packed = PackedGroup(layout, buffers, work)
        self._packed[index] = packed
        return packed

    # ------------------------------------------------------------------ step

    def _step_units(self) -> list[tuple[int, list[dict]]]:
        return list(enumerate(self._windows()))

    def _prepare(self, index: int, groups: list[dict]) -> Optional[StepWork]:
        params = [p for group in groups for p in group["params"]]
        active = [p.grad is not None for p in params]
        if not any(active):
            return None
        packed = self._packed_group(index, groups, params)
        sources = [p.grad if a else torch.zeros_like(p) for p, a in zip(params, active)]
        packed.layout.pack(sources, packed.grad)
        # max|g| * sqrt(d) bounds the norm (on shards: the model's largest entry and length, so every
        # rank skips alike).
        if self._shards is None:
            probe = packed.grad.abs().amax() * math.sqrt(packed.layout.total)
        else:
            probe = packed.grad.abs().amax().float() * math.sqrt(sum(p.numel() for p in params))
        return StepWork(index, groups, params, packed, probe, active=active)

    def _gradient_problem(self, largest: float) -> Optional[str]:
        if largest < MAX_GRADIENT_NORM:  # NaN and inf fail it too
            return None
        too_large = f"a gradient is too large to precondition in float32 (norm up to {largest:.3g})"
        return super()._gradient_problem(largest) or too_large

    def _update(self, work: list[StepWork], stateless) -> None:
        for unit in work:
            self._update_window(unit.groups, unit.params, unit.active, unit.packed)

    def _direction(self, group: dict, packed: PackedGroup, active: list[bool]) -> torch.Tensor:
        """``u = w @ G`` after storing this step's ``x`` in the window, ``w = weights(dots, G x) + e_slot / scale``."""
        ring = self.state[packed.layout.tensors[0]]
        slot = self._advance(ring)
        products = self.WINDOW.insert(self.ALGO, self.state, group, packed, active, slot)
        if self._shards is not None:  # each rank summed its own coordinates
            products = self._shards.all_reduce(products.to(torch.float64))
        scale = group[self.SCALE]
        with nvtx_range(f"tritonopt/{self.ALGO}/solve"):
            weights = window_weights(ring["dots"], slot, products, self.WEIGHTS, scale)
        with nvtx_range(f"tritonopt/{self.ALGO}/lcg"):
            return self.WINDOW.combine(self.state, group, packed, weights)

    def _update_window(self, groups: list[dict], params: list[torch.Tensor], active: list[bool],
                       packed: PackedGroup) -> None:
        layout = packed.layout
        if self.track_error_norm:
            packed.stats["grad_norm"] = packed.grad.norm()
        frozen_error = None
        if self.WINDOW.ERROR_FEEDBACK and not all(active) and self.FREEZE_BY_ZERO_ACCUMULATOR:
            # Parameters without a gradient: accumulator exactly 0 there, error restored after.
            frozen_error = []
            for a, g_view, e_view in zip(active, layout.views(packed.grad), layout.views(packed.error)):
                if not a:
                    frozen_error.append((e_view, e_view.clone()))
                    g_view.copy_(e_view).neg_()  # the error may be narrower than the scratch
        direction = self._direction(groups[0], packed, active)
        if frozen_error is not None:
            for view, saved in frozen_error:
                view.copy_(saved)
        if not self.track_error_norm:
            packed.stats.pop("error_norm", None)
        limit = groups[0]["max_update_norm"]
        if limit is not None and self._shards is not None:
            weights = packed.work.get("column_weights")
            squares = direction.square() if weights is None else direction.square() * weights
            norm = self._shards.all_reduce(squares.sum(dtype=torch.float64).reshape(1)).sqrt().to(direction.dtype)[0]
            direction.mul_(torch.clamp(limit / norm.clamp_min(torch.finfo(norm.dtype).tiny), max=1.0))
        elif limit is not None:
            norm = direction.norm()
            direction.mul_(torch.clamp(limit / norm.clamp_min(torch.finfo(norm.dtype).tiny), max=1.0))

        with nvtx_range(f"tritonopt/{self.ALGO}/update"):
            if any(g["momentum"] > 0 for g in groups) and "momentum_buffer" not in packed.state:
                packed.state.update(bind_flat_state(self.state, layout, ["momentum_buffer"], packed.grad.dtype))
            directions = layout.views(direction)
            momenta = layout.views(packed.momentum_buffer) if "momentum_buffer" in packed.state else None
            start = 0
            for group in groups:
                end = start + len(group["params"])
                updates = directions[start:end]
                if group["momentum"] > 0:
                    updates = self._momentum(group["momentum"], layout, start, end, momenta, direction,
                                             packed.momentum_buffer, active)
                apply_decoupled_update(layout.locals[start:end], updates, group["lr"], group["weight_decay"],
                                       active[start:end])
                start = end
            for p, a in zip(params, active):
                if a:
                    self.state[p]["step"] += 1

    @staticmethod
    def _momentum(mu, layout, start, end, momenta, direction, buffer, active) -> list[torch.Tensor]:
        """``v = mu v + u`` on one group's tensors; those without a gradient keep their ``v``."""
        if all(active[start:end]):
            first, last = layout.offsets[start], layout.offsets[end - 1] + layout.numels[end - 1]
            heavy_ball_momentum(buffer.view(-1)[first:last], direction.view(-1)[first:last], mu)
            return momenta[start:end]
        updates = []
        for v, u, a in zip(momenta[start:end], layout.views(direction)[start:end], active[start:end]):
            blended = v * mu + u
            if a:
                v.copy_(blended)
            updates.append(blended)
        return updates

    @staticmethod
    def _advance(ring: dict) -> int:
        """The slot to write this step; moves the ring on."""
        slot = ring["ring_slot"]
        m = ring["dots"].shape[0]
        ring["ring_slot"] = (slot + 1) % m
        ring["ring_filled"] = min(ring["ring_filled"] + 1, m)
        return slot


def _check_ring(ring: dict) -> None:
    """While a window fills, the next row to write is the first unwritten one (``ring_slot == ring_filled``).

    A sparse ring's rows are as Top-k writes them, which the sparse linear combination relies on to
    spread a long block over many programs: positions in ascending order, and a row whose positions
    are all 0 (a row never written) holding zeros.
    """
    m = ring["dots"].shape[0]
    if ring["ring_filled"] < m and ring["ring_slot"] != ring["ring_filled"]:
        raise ValueError(
            f"saved state 'ring_slot' is {ring['ring_slot']} but 'ring_filled' is {ring['ring_filled']} < {m}: "
            "while a window fills, ring_slot must equal ring_filled"
        )
    indices, values = ring.get("ring_indices"), ring.get("ring_values")
    if indices is None or indices.shape[-1] < 2:
        return
    if not bool((indices[..., 1:] >= indices[..., :-1]).all()):
        raise ValueError("saved state 'ring_indices' has a row whose positions are not in ascending order; "
                         "every row the optimizer writes is")
    at_zero_only = indices[..., -1] == 0
    if values is not None and bool((values[at_zero_only] != 0).any()):
        raise ValueError("saved state 'ring_values' has nonzero values in a row whose positions are all 0; "
                         "such a row is one never written, which holds zeros")


def _padded_numel(params: Sequence[torch.Tensor], block_size: int, span: Optional[int] = None) -> int:
    total = max(sum(p.numel() for p in params), span or 0)
    block = max(1, min(block_size, total))
    return -(-total // block) * block
