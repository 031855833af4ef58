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

Each parameter group is one vector: all the group's parameters, flattened in
group order and laid end to end, whether or not they have a gradient this step,
so that the rows of the window always mean the same coordinates. A step::

    x, s = window.insert(g)              # g: the group's gradients, zero where missing
    dots[slot, :] = dots[:, slot] = s
    u = x / scale + weights(dots, s) @ G
    v = momentum * v + u                 # only when momentum > 0 (no dampening)
    theta = (1 - lr * weight_decay) * theta - lr * v      # decoupled weight decay

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
* per group, in the state of the group's first parameter: the window,
  ``dots`` (float64 ``[m, m]`` Gram matrix of the rows), ``ring_slot`` (the next
  row to overwrite) and ``ring_filled`` (rows written so far, at most ``m``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_float, check_int
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._packed import CheckpointSpec, PackedGroup, PackedOptimizer, bind_flat_state
from tritonopt.optim.functional import apply_decoupled_update, heavy_ball_momentum
from tritonopt.optim._window_algebra import update_gram

# Gradients are stored and multiplied in float32 (or bfloat16): with a group gradient norm
# below this bound, every scalar product of two stored gradients stays far from overflow.
MAX_GRADIENT_NORM = 1e17


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

    def __init__(self, params: Iterable, defaults: dict, on_nonfinite: str):
        super().__init__(params, defaults, on_nonfinite)

    def _check_group(self, group: dict) -> None:
        check_float("lr", group["lr"], low=0.0)
        check_float("momentum", group["momentum"], low=0.0, high=1.0, high_open=True)
        check_float("weight_decay", group["weight_decay"], low=0.0)
        check_int("ngrads", group["ngrads"], low=1)
        check_float(self.SCALE, group[self.SCALE], low=0.0, low_open=True)
        self.WINDOW.check_group(group)

    def _checkpoint_spec(self, group: dict, params) -> CheckpointSpec:
        group_shapes, param_shapes = self.WINDOW.saved_shapes(group, params)
        error = {"error"} if self.WINDOW.ERROR_FEEDBACK else set()
        return CheckpointSpec(
            per_param=frozenset({"step"} | error),
            like_param=frozenset(error | {"momentum_buffer"}),
            optional=frozenset({"momentum_buffer"}),
            param_shapes=param_shapes,
            group_shapes=group_shapes,
            group_counters={"ring_slot": group["ngrads"] - 1, "ring_filled": group["ngrads"]},
        )

    # ------------------------------------------------------------------ packing

    def _block_size(self, group: dict) -> int:
        return group["block_size"] if self.WINDOW.BLOCKWISE else 1 << 62

    def _work_dtype(self, params: list[torch.Tensor]) -> torch.dtype:
        if self.WINDOW.KEEPS_FLOAT64 and all(p.dtype == torch.float64 for p in params):
            return torch.float64
        return torch.float32

    def _initial_window(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        return self.WINDOW.initial_state(self.state, group, layout, dtype)

    def _packed_group(self, index: int, group: dict) -> PackedGroup:
        params = group["params"]
        packed = self._packed.get(index)
        if (
            packed is not None
            and packed.layout.matches(params)
            and packed.layout.block_size == min(self._block_size(group), packed.layout.total)
            and self.state[params[0]]["dots"].shape[0] == group["ngrads"]
        ):
            return packed
        layout = BlockLayout(params, self._block_size(group))
        dtype = self._work_dtype(params)
        names = ["error"] if self.WINDOW.ERROR_FEEDBACK else []
        if any("momentum_buffer" in self.state[p] for p in params) or group["momentum"] > 0:
            names.append("momentum_buffer")
        for p in params:
            self.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))
        buffers = bind_flat_state(self.state, layout, names, dtype)
        ring = self.state[params[0]]
        for name, value in self._initial_window(group, layout, dtype).items():
            if name not in ring:
                ring[name] = value
            elif isinstance(value, torch.Tensor) and (
                not isinstance(ring[name], torch.Tensor) or ring[name].shape != value.shape
            ):
                raise ValueError(
                    f"state {name!r} does not match this group's layout (expected shape "
                    f"{tuple(value.shape)}); were ngrads, block_size or the parameters changed?"
                )
        packed = PackedGroup(layout, buffers, {"grad": layout.zeros(dtype)})
        self._packed[index] = packed
        return packed

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimization step; ``closure`` (optional) re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Validate and pack every group before any parameter or state changes.
        stateless = self._stateless_params()
        work = []
        with nvtx_range(f"tritonopt/{self.ALGO}/pack"):
            for index, group in enumerate(self.param_groups):
                params = group["params"]
                active = [p.grad is not None for p in params]
                if not any(active):
                    continue
                self._check_grads([p for p, a in zip(params, active) if a])
                packed = self._packed_group(index, group)
                sources = [p.grad if a else torch.zeros_like(p) for p, a in zip(params, active)]
                packed.layout.pack(sources, packed.grad)
                work.append((group, params, active, packed))
        if not work:
            return loss
        # max|g| * sqrt(d) bounds the norm; NaN and inf propagate into it (one host sync).
        bounds = torch.stack([packed.grad.abs().amax() * math.sqrt(packed.layout.total) for *_, packed in work])
        largest = float(bounds.max())
        if not largest < MAX_GRADIENT_NORM:
            self._refuse_step("a gradient holds NaN or inf" if not math.isfinite(largest) else
                              f"a gradient is too large to precondition in float32 (norm up to {largest:.3g})",
                              stateless)
            return loss

        for group, params, active, packed in work:
            self._update_group(group, params, active, packed)
        return loss

    def _direction(self, group: dict, packed: PackedGroup, active: list[bool]) -> torch.Tensor:
        """``u = x / scale + weights(dots, G x) @ G`` after storing this step's ``x`` in the window."""
        ring = self.state[packed.layout.tensors[0]]
        slot = self._advance(ring)
        x, products = self.WINDOW.insert(self.ALGO, self.state, group, packed, active, slot)
        scale = group[self.SCALE]
        with nvtx_range(f"tritonopt/{self.ALGO}/solve"):
            update_gram(ring["dots"], slot, products)
            weights = self.WEIGHTS(ring["dots"], products, scale)
        with nvtx_range(f"tritonopt/{self.ALGO}/lcg"):
            return self.WINDOW.combine(self.state, group, packed, x, weights, scale, slot)

    def _update_group(self, group, params, active, packed: PackedGroup) -> None:
        layout = packed.layout
        frozen_error = None
        if self.WINDOW.ERROR_FEEDBACK and not all(active) and self.FREEZE_BY_ZERO_ACCUMULATOR:
            # Parameters without a gradient: accumulator exactly 0 there, error restored after.
            frozen_error = []
            for a, g_view, e_view in zip(active, layout.views(packed.grad), layout.views(packed.error)):
                if not a:
                    frozen_error.append((e_view, e_view.clone()))
                    torch.neg(e_view, out=g_view)
        direction = self._direction(group, packed, active)
        if frozen_error is not None:
            for view, saved in frozen_error:
                view.copy_(saved)

        mu = group["momentum"]
        with nvtx_range(f"tritonopt/{self.ALGO}/update"):
            if mu > 0 and "momentum_buffer" not in packed.state:
                packed.state.update(bind_flat_state(self.state, layout, ["momentum_buffer"], packed.grad.dtype))
            if "momentum_buffer" in packed.state and mu > 0:
                direction = heavy_ball_momentum(packed.momentum_buffer, direction, mu, layout=layout, active=active)
            apply_decoupled_update(params, layout.views(direction), group["lr"], group["weight_decay"], active)
            for p, a in zip(params, active):
                if a:
                    self.state[p]["step"] += 1

    @staticmethod
    def _advance(ring: dict) -> int:
        """The slot to write this step; moves the ring on."""
        slot = ring["ring_slot"]
        m = ring["dots"].shape[0]
        ring["ring_slot"] = (slot + 1) % m
        ring["ring_filled"] = min(ring["ring_filled"] + 1, m)
        return slot
