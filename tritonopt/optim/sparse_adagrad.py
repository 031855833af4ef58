"""Diagonal AdaGrad fed by error-feedback blockwise Top-k (EFCP, Modoranu et al. 2024, Alg. 7)."""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from tritonopt._runtime import nvtx_range
from tritonopt.ops import ef_topk
from tritonopt.optim._blocks import BlockLayout, kept_per_block

_NONFINITE_POLICIES = ("skip", "raise")
_FLOAT32_STATE = ("error", "sum_sq")


@dataclass
class _PackedGroup:
    """Flat buffers of one parameter group; the per-parameter state entries are views of them."""

    layout: BlockLayout
    error: torch.Tensor
    sum_sq: torch.Tensor
    grad: torch.Tensor
    update: torch.Tensor


def _check_hyperparameters(group: dict) -> None:
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    density, k, block_size = group["density"], group["k"], group["block_size"]
    if isinstance(lr, torch.Tensor):
        raise TypeError("lr must be a float (a tensor lr is not supported)")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (isinstance(wd, (int, float)) and math.isfinite(wd) and wd >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {wd!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if density is not None and k is not None:
        raise ValueError("give density or k, not both")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= block_size:
            raise ValueError(f"k must be an int with 1 <= k <= block_size={block_size}, got {k!r}")
    elif not (isinstance(density, (int, float)) and 0 < density <= 1):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")


# Squares of entries below this, summed over many steps, stay far from float32's 3.4e38.
_MAX_GRADIENT_ENTRY = 1e17


class SparseAdaGrad(Optimizer):
    r"""Diagonal AdaGrad on an error-feedback, blockwise Top-k compressed gradient.

    Each parameter group is one vector (its parameters that have a gradient,
    flattened in group order), cut into blocks of ``block_size``. Every step::

        a = e + g                        # error feedback
        c = TopK_per_block(a)            # k entries of largest |a| per block
        e = a - c
        H += c ** 2
        theta = (1 - lr * weight_decay) * theta - lr * c / (sqrt(H) + eps)

    Only the selected entries change ``H`` and the parameters. This is
    Algorithm 7 of EFCP (Modoranu et al., 2024) with an optional decoupled
    (AdamW-style) weight decay; ``weight_decay=0`` gives the algorithm exactly.

    Args:
        params: parameters or parameter groups. Groups may override every
            hyperparameter below except ``on_nonfinite``.
        lr: learning rate.
        density: fraction of each block kept, ``k = ceil(density * block_size)``
            (default 0.01 when neither ``density`` nor ``k`` is given).
        k: entries kept per block, instead of ``density``.
        block_size: Top-k block length. A group with fewer elements forms one
            block of its own size (``k`` is then capped at that size); the last
            block of a group is zero-padded, and padding never reaches a parameter.
        eps: added to ``sqrt(H)``.
        weight_decay: decoupled weight decay ``theta *= 1 - lr * weight_decay``.
        on_nonfinite: what a step does when a gradient holds NaN or inf:
            ``"skip"`` (default) leaves every parameter and all state untouched,
            warns, and counts the step in :attr:`skipped_steps`; ``"raise"``
            raises ``FloatingPointError``, also before anything is modified.
            Checking costs one device-to-host synchronisation per step.

    State (per parameter, all float32 and shaped like the parameter, whatever
    its dtype): ``error`` (e), ``sum_sq`` (H), and ``step``.
    Parameters whose ``.grad`` is None are skipped: neither they nor their
    state change. Sparse and complex gradients are rejected.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        *,
        density: Optional[float] = None,
        k: Optional[int] = None,
        block_size: int = 4096,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        on_nonfinite: str = "skip",
    ):
        if on_nonfinite not in _NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
        if density is None and k is None:
            density = 0.01
        defaults = dict(
            lr=lr, density=density, k=k, block_size=block_size, eps=eps, weight_decay=weight_decay
        )
        _check_hyperparameters(defaults)
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self._packed: dict[int, _PackedGroup] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        if "k" in param_group and "density" not in param_group:
            param_group = {**param_group, "density": None}
        elif "density" in param_group and "k" not in param_group:
            param_group = {**param_group, "k": None}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group)
        for p in group["params"]:
            if p.is_complex():
                raise ValueError("SparseAdaGrad does not support complex parameters")
            if not p.is_floating_point():
                raise ValueError(f"SparseAdaGrad needs floating-point parameters, got {p.dtype}")

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        skipped = state_dict.pop("skipped_steps", 0)
        saved_state = state_dict["state"]
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for group in state_dict["param_groups"]:
            _check_hyperparameters({"density": None, "k": None, **group})
        super().load_state_dict(state_dict)
        # The base class casts state to each parameter's dtype; the buffers stay float32.
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            if saved_id not in saved_state:
                continue
            for name in _FLOAT32_STATE:
                value = saved_state[saved_id][name]
                if value.shape != p.shape:
                    raise ValueError(
                        f"state {name!r} has shape {tuple(value.shape)} but its parameter has "
                        f"shape {tuple(p.shape)}"
                    )
                self.state[p][name] = value.to(device=p.device, dtype=torch.float32, copy=True)
        self.skipped_steps = int(skipped)
        self._packed.clear()

    def _packed_group(self, index: int, group: dict, params: list[torch.Tensor]) -> _PackedGroup:
        """The group's flat buffers for this set of parameters, rebuilt when the set changes."""
        grad_dtypes = {p.grad.dtype for p in params}
        grad_dtype = grad_dtypes.pop() if len(grad_dtypes) == 1 else torch.float32
        if grad_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            grad_dtype = torch.float32
        packed = self._packed.get(index)
        if (
            packed is not None
            and packed.layout.matches(params)
            and packed.layout.block_size == min(group["block_size"], packed.layout.total)
        ):
            if packed.grad.dtype != grad_dtype:
                packed.grad = packed.layout.zeros(grad_dtype)
            return packed
        layout = BlockLayout(params, group["block_size"])
        error, sum_sq = layout.zeros(), layout.zeros()
        for p, error_view, sum_sq_view in zip(params, layout.views(error), layout.views(sum_sq)):
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
            else:
                error_view.copy_(state["error"])
                sum_sq_view.copy_(state["sum_sq"])
            state["error"], state["sum_sq"] = error_view, sum_sq_view
        packed = _PackedGroup(layout, error, sum_sq, layout.zeros(grad_dtype), layout.zeros())
        self._packed[index] = packed
        return packed

    # ------------------------------------------------------------------ step

    def _params_with_grad(self, group: dict) -> list[torch.Tensor]:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("SparseAdaGrad does not support sparse gradients")
            if p.grad.is_complex():
                raise RuntimeError("SparseAdaGrad does not support complex gradients")
            if p.grad.shape != p.shape:
                raise RuntimeError(
                    f"a gradient has shape {tuple(p.grad.shape)} but its parameter has "
                    f"shape {tuple(p.shape)}"
                )
            if p.device != params[0].device:
                raise ValueError(
                    "all parameters of a group must be on one device, found "
                    f"{params[0].device} and {p.device}"
                )
        return params

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Validate and pack every group before any parameter or state changes.
        work = []
        with nvtx_range("tritonopt/sparse_adagrad/pack"):
            for index, group in enumerate(self.param_groups):
                params = self._params_with_grad(group)
                if not params:
                    continue
                packed = self._packed_group(index, group, params)
                packed.layout.pack([p.grad for p in params], packed.grad)
                work.append((group, params, packed))
        if not work:
            return loss
        # NaN and inf propagate into the maximum (one host sync). Above _MAX_GRADIENT_ENTRY
        # the squares summed into the AdaGrad state could overflow float32.
        largest = float(torch.stack([packed.grad.abs().amax() for _, _, packed in work]).max())
        if not largest < _MAX_GRADIENT_ENTRY:
            problem = ("a gradient holds NaN or inf" if not math.isfinite(largest) else
                       f"a gradient entry of {largest:.3g} is too large for the float32 state")
            if self.on_nonfinite == "raise":
                raise FloatingPointError(f"SparseAdaGrad: {problem}; nothing was modified")
            self.skipped_steps += 1
            warnings.warn(
                f"SparseAdaGrad: {problem}; the step was skipped and parameters and state "
                "are unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
            return loss

        for group, params, packed in work:
            self._update_group(group, params, packed)
        return loss

    def _update_group(self, group: dict, params: list[torch.Tensor], packed: _PackedGroup) -> None:
        layout = packed.layout
        k = kept_per_block(group["density"], group["k"], layout.block_size)
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        with nvtx_range("tritonopt/sparse_adagrad/compress"):
            indices, values = ef_topk(packed.grad, packed.error, k)
        with nvtx_range("tritonopt/sparse_adagrad/update"):
            indices = indices.long()
            sum_sq = packed.sum_sq.gather(1, indices).addcmul_(values, values)
            packed.sum_sq.scatter_(1, indices, sum_sq)
            packed.update.zero_().scatter_(1, indices, values / (sum_sq.sqrt_() + eps))
            for p, update in zip(params, layout.views(packed.update)):
                if p.dtype == torch.float32:
                    if wd:
                        p.mul_(1 - lr * wd)
                    p.sub_(update, alpha=lr)
                else:  # one rounding to the parameter's dtype
                    p32 = p.to(torch.float32)
                    if wd:
                        p32.mul_(1 - lr * wd)
                    p.copy_(p32.sub_(update, alpha=lr))
                self.state[p]["step"] += 1
