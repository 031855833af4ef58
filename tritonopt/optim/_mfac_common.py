"""What the windowed preconditioners (M-FAC, S-MFAC, GGT, S-GGT) share.

Each parameter group is one vector: all the group's parameters, flattened in
group order and laid end to end (:class:`~tritonopt.optim._blocks.BlockLayout`),
whether or not they have a gradient this step, so that the rows of the ring
buffer always mean the same coordinates. A step::

    g  = the group's gradients (zero where a parameter has no gradient)
    u  = direction(g)                     # the subclass: preconditioned (compressed) gradient
    v  = momentum * v + u                 # only when momentum > 0 (no dampening)
    theta = (1 - lr * weight_decay) * theta - lr * v      # decoupled weight decay

The decay is AdamW-style, ``1 - lr * weight_decay`` (the ISTA-DASLab
convention); the EFCP repository's ``(1 - gamma) * theta`` is
``weight_decay = gamma / lr``. Gradients never include the decay, so the
stored gradients stay an empirical Fisher (EFCP sec. 2.2).

Parameters without a gradient are not updated and their per-parameter state
(``error``, ``momentum_buffer``, ``step``) does not change; they contribute zeros
to the row stored this step. State layout:

* per parameter: ``step`` (float32 scalar), and, as views of one flat group
  buffer, ``error`` (error feedback, sparse variants) and ``momentum_buffer``
  (created at the first step with ``momentum > 0``), shaped like the parameter;
* per group, in the state of the group's first parameter: the ring buffer,
  ``dots`` (float64 ``[m, m]`` Gram matrix of the rows), ``ring_slot`` (the next
  row to overwrite) and ``ring_filled`` (rows written so far, at most ``m``).

``state_dict``/``load_state_dict`` keep every tensor's dtype (the base class
would cast float state to the parameter dtype), so a resumed run equals an
uninterrupted one bit for bit.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from tritonopt._runtime import nvtx_range
from tritonopt.optim._accounting import optimizer_state_bytes
from tritonopt.optim._blocks import BlockLayout

_NONFINITE_POLICIES = ("skip", "raise")
# Gradients are stored and multiplied in float32 (or bfloat16): with a group gradient norm
# below this bound, every scalar product of two stored gradients stays far from overflow.
_MAX_GRADIENT_NORM = 1e17


@dataclass
class PackedGroup:
    """Flat buffers of one group; per-parameter state entries are views of them."""

    layout: BlockLayout
    grad: torch.Tensor  # [num_blocks, block_size] scratch: the packed gradient
    error: Optional[torch.Tensor]  # error feedback, or None
    momentum: Optional[torch.Tensor]  # momentum buffer, or None until needed
    active: tuple = ()  # per parameter: has a gradient this step


def check_number(name: str, value, *, low: float = 0.0, low_open: bool = False,
                 high: Optional[float] = None, high_open: bool = False) -> None:
    """Raise a ValueError/TypeError naming ``name`` unless ``value`` is a finite number in range."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float (a tensor {name} is not supported)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (low_open and value == low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")


def check_int(name: str, value, *, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


class WindowedPreconditioner(Optimizer):
    """Base class: packing, validation, non-finite policy, momentum, decay and checkpoints.

    Subclasses set ``ALGO`` (the NVTX name), ``BLOCKWISE`` (pack into
    ``block_size`` blocks rather than one row) and ``ERROR_FEEDBACK``, and
    implement ``_check_group``, ``_init_ring`` and ``_direction``.
    """

    ALGO = "windowed"
    BLOCKWISE = False
    ERROR_FEEDBACK = False
    # Blockwise compressors see a zero accumulator where a parameter has no gradient.
    FREEZE_BY_ZERO_ACCUMULATOR = True

    def __init__(self, params: Iterable, defaults: dict, on_nonfinite: str):
        if on_nonfinite not in _NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
        self._check_group(defaults)
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self._packed: dict[int, PackedGroup] = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ hooks

    def _check_group(self, group: dict) -> None:
        check_number("lr", group["lr"])
        check_number("momentum", group["momentum"], high=1.0, high_open=True)
        check_number("weight_decay", group["weight_decay"])
        check_int("ngrads", group["ngrads"])

    def _init_ring(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        raise NotImplementedError

    def _direction(self, group: dict, packed: PackedGroup, ring: dict) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_new_group(group)
        except Exception:
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise

    def _check_new_group(self, group: dict) -> None:
        self._check_group(group)
        name = type(self).__name__
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(f"{name} does not support complex parameters")
            if not p.is_floating_point():
                raise ValueError(f"{name} needs floating-point parameters, got {p.dtype}")
            if p.device != group["params"][0].device:
                raise ValueError(
                    "all parameters of a group must be on one device, found "
                    f"{group['params'][0].device} and {p.device}"
                )

    def _block_size(self, group: dict) -> int:
        return group["block_size"] if self.BLOCKWISE else 1 << 62

    def _work_dtype(self, params: list[torch.Tensor]) -> torch.dtype:
        # float64 parameters keep float64 dense rows (used to check the algebra exactly).
        if not self.BLOCKWISE and all(p.dtype == torch.float64 for p in params):
            return torch.float64
        return torch.float32

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
        error = layout.zeros(dtype) if self.ERROR_FEEDBACK else None
        momentum = None
        if any("momentum_buffer" in self.state[p] for p in params) or group["momentum"] > 0:
            momentum = layout.zeros(dtype)
        for i, p in enumerate(params):
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
            for name, buffer in (("error", error), ("momentum_buffer", momentum)):
                if buffer is None:
                    continue
                view = layout.views(buffer)[i]
                if name in state:
                    if state[name].shape != p.shape:
                        raise ValueError(
                            f"state {name!r} has shape {tuple(state[name].shape)} but its "
                            f"parameter has shape {tuple(p.shape)}"
                        )
                    view.copy_(state[name])
                state[name] = view
        ring = self.state[params[0]]
        expected = self._init_ring(group, layout, dtype)
        for name, value in expected.items():
            if name not in ring:
                ring[name] = value
            elif isinstance(value, torch.Tensor) and (
                not isinstance(ring[name], torch.Tensor) or ring[name].shape != value.shape
            ):
                raise ValueError(
                    f"state {name!r} does not match this group's layout (expected shape "
                    f"{tuple(value.shape)}); were ngrads, block_size or the parameters changed?"
                )
        packed = PackedGroup(layout, layout.zeros(dtype), error, momentum)
        self._packed[index] = packed
        return packed

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        skipped = state_dict.pop("skipped_steps", 0)
        saved_state = state_dict["state"]
        for group in state_dict["param_groups"]:
            self._check_group({**self.defaults, **group})
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        # The base class casts float state to the parameter's dtype; keep the saved dtypes.
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            if saved_id not in saved_state:
                continue
            for name, value in saved_state[saved_id].items():
                if isinstance(value, torch.Tensor):
                    device = value.device if name == "step" else p.device
                    self.state[p][name] = value.to(device=device, copy=True)
        self.skipped_steps = int(skipped)
        self._packed.clear()

    def state_bytes(self) -> int:
        """Bytes of the optimizer's state tensors (ring buffers, Gram matrix, error, momentum)."""
        return optimizer_state_bytes(self)

    # ------------------------------------------------------------------ step

    def _check_grads(self, params: list[torch.Tensor]) -> None:
        name = type(self).__name__
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            if p.grad.is_complex():
                raise RuntimeError(f"{name} does not support complex gradients")
            if p.grad.shape != p.shape:
                raise RuntimeError(
                    f"a gradient has shape {tuple(p.grad.shape)} but its parameter has "
                    f"shape {tuple(p.shape)}"
                )

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimization step; ``closure`` (optional) re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Validate and pack every group before any parameter or state changes.
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
        if not largest < _MAX_GRADIENT_NORM:
            name = type(self).__name__
            problem = ("a gradient holds NaN or inf" if not math.isfinite(largest) else
                       f"a gradient is too large to precondition in float32 (norm up to {largest:.3g})")
            if self.on_nonfinite == "raise":
                raise FloatingPointError(f"{name}: {problem}; nothing was modified")
            self.skipped_steps += 1
            warnings.warn(
                f"{name}: {problem}; the step was skipped and parameters and state are unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
            return loss

        for group, params, active, packed in work:
            self._update_group(group, params, active, packed)
        return loss

    def _update_group(self, group, params, active, packed: PackedGroup) -> None:
        layout = packed.layout
        ring = self.state[params[0]]
        packed.active = tuple(active)
        frozen_error = None
        if packed.error is not None and not all(active) and self.FREEZE_BY_ZERO_ACCUMULATOR:
            # Parameters without a gradient: accumulator exactly 0 there, error restored after.
            frozen_error = []
            for p, a, g_view, e_view in zip(
                params, active, layout.views(packed.grad), layout.views(packed.error)
            ):
                if not a:
                    frozen_error.append((e_view, e_view.clone()))
                    torch.neg(e_view, out=g_view)
        direction = self._direction(group, packed, ring)
        if frozen_error is not None:
            for view, saved in frozen_error:
                view.copy_(saved)

        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        with nvtx_range(f"tritonopt/{self.ALGO}/update"):
            if mu > 0 and packed.momentum is None:
                packed.momentum = layout.zeros(packed.grad.dtype)
                for p, view in zip(params, layout.views(packed.momentum)):
                    self.state[p]["momentum_buffer"] = view
            if packed.momentum is not None and mu > 0:
                if all(active):
                    direction = packed.momentum.mul_(mu).add_(direction)
                else:
                    blended = packed.momentum * mu + direction
                    for a, m_view, b_view in zip(
                        active, layout.views(packed.momentum), layout.views(blended)
                    ):
                        if a:
                            m_view.copy_(b_view)
                    direction = blended
            for p, a, update in zip(params, active, layout.views(direction)):
                if not a:
                    continue
                wide = torch.promote_types(p.dtype, update.dtype)
                if p.dtype == wide:
                    if wd:
                        p.mul_(1 - lr * wd)
                    p.sub_(update, alpha=lr)
                else:  # one rounding to the parameter's dtype
                    p_wide = p.to(wide)
                    if wd:
                        p_wide.mul_(1 - lr * wd)
                    p.copy_(p_wide.sub_(update, alpha=lr))
                self.state[p]["step"] += 1

    @staticmethod
    def _advance(ring: dict) -> int:
        """The slot to write this step; moves the ring on."""
        slot = ring["ring_slot"]
        m = ring["dots"].shape[0]
        ring["ring_slot"] = (slot + 1) % m
        ring["ring_filled"] = min(ring["ring_filled"] + 1, m)
        return slot
