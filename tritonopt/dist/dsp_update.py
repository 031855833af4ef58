"""The DSP stage update in one fused pass: momentum SGD over a stage's parameters held in one flat buffer.

Every DSP stage updates its block right after its own backward (Xu et al.
2020, sec. 3.3), with momentum SGD in the paper's experiments (sec. 5).
:class:`FlatSGD` is ``torch.optim.SGD`` for that use: at construction the
block's parameters are moved into one contiguous float32 buffer (each parameter
becomes a view of it, keeping its values) and their gradients into a second one,
which autograd accumulates into in place; a step is then a single call of
:func:`tritonopt.ops.sgd_momentum_step` over the whole block (one kernel launch
reading ``w, g, buf`` and writing ``w, buf`` once) instead of a pass per
parameter and per operation.

Differences from ``torch.optim.SGD``: one parameter group; all parameters
float32, dense, on one device; ``zero_grad`` always zeroes the flat gradient in
place (``set_to_none`` is ignored, so the views stay attached); a parameter
whose ``.grad`` was set to ``None`` is stepped with a zero gradient (weight decay
and momentum still move it) instead of being skipped. A gradient tensor that
was replaced (not accumulated) is copied into the flat buffer before the step.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch

from tritonopt.ops import sgd_momentum_step

__all__ = ["FlatSGD"]


class FlatSGD(torch.optim.Optimizer):
    """Momentum SGD (``torch.optim.SGD``'s arithmetic) over one flat buffer, one fused op per step.

    Args:
        params: the stage's parameters (one group; float32, one device).
        lr, momentum, dampening, weight_decay, nesterov, maximize: as ``torch.optim.SGD``.

    State: ``state[first parameter]["momentum_buffer"]``, the flat float32
    momentum buffer (absent before the first step or without momentum).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ):
        params = list(params)
        for name, value in (("lr", lr), ("momentum", momentum), ("dampening", dampening),
                            ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if nesterov and (momentum == 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        if not params:
            raise ValueError("FlatSGD got an empty parameter list")
        if any(isinstance(p, dict) for p in params):
            raise TypeError("FlatSGD takes one parameter group: pass the parameters, not group dicts")
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] must be a tensor, got {type(p).__name__}")
            if p.dtype != torch.float32 or p.is_sparse:
                raise TypeError(f"params[{i}] must be a dense float32 tensor, got {p.dtype}")
            if p.device != params[0].device:
                raise ValueError(f"params[{i}] is on {p.device} but params[0] is on {params[0].device}")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice")
        self._building = True
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize))
        self._building = False

        total = sum(p.numel() for p in params)
        self._flat = torch.empty(total, dtype=torch.float32, device=params[0].device)
        self._flat_grad = torch.zeros_like(self._flat)
        self._slices: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self._flat[offset:offset + n].copy_(p.reshape(-1))
                p.data = self._flat[offset:offset + n].view_as(p)
                if p.grad is not None:
                    self._flat_grad[offset:offset + n].copy_(p.grad.reshape(-1))
                p.grad = self._flat_grad[offset:offset + n].view_as(p)
                self._slices.append((p, offset, n))
                offset += n

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_building", False):
            raise ValueError("FlatSGD holds one flat parameter group; it cannot take another")
        super().add_param_group(param_group)

    def _gather_gradients(self) -> None:
        """Re-attach gradients that were replaced or cleared, so the flat buffer holds every one."""
        for p, offset, n in self._slices:
            view = self._flat_grad[offset:offset + n]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr() or p.grad.shape != p.shape:
                view.copy_(p.grad.reshape(-1))
            else:
                continue
            p.grad = view.view_as(p)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002  (the views must stay)
        self._flat_grad.zero_()
        self._gather_gradients()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._gather_gradients()
        group = self.param_groups[0]
        momentum = group["momentum"]
        buffer, first_step = None, False
        if momentum != 0:
            state = self.state[self._slices[0][0]]
            buffer = state.get("momentum_buffer")
            if buffer is None:
                buffer = state["momentum_buffer"] = torch.empty_like(self._flat)
                first_step = True
        sgd_momentum_step(
            self._flat, self._flat_grad, buffer, lr=group["lr"], momentum=momentum, dampening=group["dampening"],
            weight_decay=group["weight_decay"], nesterov=group["nesterov"], maximize=group["maximize"],
            first_step=first_step,
        )
        return loss
