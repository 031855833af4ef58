"""Dense M-FAC and sparse M-FAC with error feedback (EFCP, Modoranu et al. 2024, sec. 2.2, 3.1, Alg. 1)."""

from __future__ import annotations

from typing import Iterable

import torch

from tritonopt._ops.sparse_ring import sparse_lcg, sparse_ring_insert, sparse_sp
from tritonopt._runtime import nvtx_range
from tritonopt.ops import ef_topk
from tritonopt.optim._blocks import BlockLayout, kept_per_block
from tritonopt.optim._mfac_common import PackedGroup, WindowedPreconditioner, check_int, check_number
from tritonopt.optim._mfac_core import mfac_coefficients, update_dots

__all__ = ["MFAC", "SparseMFAC"]

_VALUE_DTYPES = (torch.float32, torch.bfloat16)


class MFAC(WindowedPreconditioner):
    r"""Dense M-FAC: the inverse empirical Fisher of the last ``ngrads`` gradients, applied to the gradient.

    With the window ``G`` (``[m, d]``, ``m = ngrads``, rows not yet written are
    zero) and ``F = damp * I + (1/m) G^T G`` (EFCP eq. 2; ``1/m`` also while the
    window fills, as published), every step::

        G[slot] = g;  slot = (slot + 1) % m          # ring buffer, oldest row replaced
        s = G g                                       # SP
        dots[slot, :] = dots[:, slot] = s             # Gram matrix G G^T, float64
        w = (damp * m * I + dots)^{-1} s / damp       # Cholesky solve, float64
        u = g / damp - w @ G                          # LCG:  u = F^{-1} g
        theta = (1 - lr * weight_decay) * theta - lr * (momentum * v + u)

    The state holds ``4 * m * d`` bytes for the window (float32; float64 when every
    parameter of the group is float64).

    Args:
        params: parameters or parameter groups (groups may override every
            hyperparameter but ``on_nonfinite``).
        lr: learning rate. Large ``damp`` makes the step SGD with rate ``lr / damp``.
        ngrads: window size ``m``.
        damp: dampening ``lambda > 0``. If training diverges, increase it.
        momentum: ``v = momentum * v + u`` (no dampening), in ``[0, 1)``.
        weight_decay: decoupled, ``theta *= 1 - lr * weight_decay``.
        on_nonfinite: ``"skip"`` (warn, change nothing, count in
            :attr:`skipped_steps`) or ``"raise"`` (``FloatingPointError``) when a
            gradient holds NaN or inf.
    """

    ALGO = "mfac"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        ngrads: int = 1024,
        damp: float = 1e-5,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        on_nonfinite: str = "skip",
    ):
        defaults = dict(lr=lr, ngrads=ngrads, damp=damp, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults, on_nonfinite)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_number("damp", group["damp"], low_open=True)

    def _init_ring(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        return dense_ring_state(group, layout, dtype)

    def _direction(self, group: dict, packed: PackedGroup, ring: dict) -> torch.Tensor:
        damp = group["damp"]
        g = packed.grad.view(-1)
        window = ring["ring_grads"]
        products = insert_dense(self.ALGO, ring, self._advance(ring), g)
        with nvtx_range("tritonopt/mfac/solve"):
            weights = mfac_coefficients(ring["dots"], products, damp)
        with nvtx_range("tritonopt/mfac/lcg"):
            update = (g / damp).sub_(weights.to(window.dtype) @ window)
        return update.view_as(packed.grad)


class SparseMFAC(WindowedPreconditioner):
    r"""Sparse M-FAC (S-MFAC): error feedback + blockwise Top-k + M-FAC on a sparse ring buffer.

    EFCP Algorithm 1 with the M-FAC preconditioner (sec. 3.1). Each group is one
    vector cut into blocks of ``block_size`` (the last one zero-padded); every step::

        a = e + g                                  # error feedback
        c = TopK_per_block(a)                      # k = ceil(density * block_size) per block
        e = a - c
        ring[slot] = c                             # sparse_ring_insert, O(k)
        s = SP(c);  dots[slot, :] = dots[:, slot] = s
        w = (damp * m * I + dots)^{-1} s / damp    # float64
        u = c / damp - LCG(w)                      # = F^{-1} c, F built from the compressed rows
        theta = (1 - lr * weight_decay) * theta - lr * (momentum * v + u)

    The compressed accumulator ``c``, not ``g``, is preconditioned (as in the
    paper's code). At ``density=1`` the error stays zero and the optimizer is
    dense :class:`MFAC`. ``error_feedback=False`` keeps ``e = 0`` (plain Top-k,
    the ablation the paper reports as much worse).

    State: indices (int32) and values (``values_dtype``) ``[num_blocks, m, k]``,
    the error ``e`` (float32, ``4 * d_padded`` bytes), ``dots`` (``8 m^2``), and a
    momentum buffer when ``momentum > 0``: about ``m * k * 8 + 4 d`` bytes
    against dense M-FAC's ``4 m d``.

    Args:
        lr, ngrads, damp, momentum, weight_decay, on_nonfinite: as :class:`MFAC`.
        density: fraction of each block kept, in ``(0, 1]``.
        block_size: Top-k block length (a group smaller than one block is one block).
        error_feedback: keep the compression error and feed it back (default True).
        values_dtype: ``torch.float32`` or ``torch.bfloat16`` for the stored values
            (with bfloat16, ``c`` is the rounded row and the rounding error joins ``e``).
    """

    ALGO = "sparse_mfac"
    BLOCKWISE = True
    ERROR_FEEDBACK = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        density: float = 0.01,
        ngrads: int = 1024,
        damp: float = 1e-5,
        block_size: int = 16384,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        error_feedback: bool = True,
        values_dtype: torch.dtype = torch.float32,
        on_nonfinite: str = "skip",
    ):
        defaults = dict(
            lr=lr, density=density, ngrads=ngrads, damp=damp, block_size=block_size,
            momentum=momentum, weight_decay=weight_decay, error_feedback=error_feedback,
            values_dtype=values_dtype,
        )
        super().__init__(params, defaults, on_nonfinite)

    def _check_group(self, group: dict) -> None:
        super()._check_group(group)
        check_number("damp", group["damp"], low_open=True)
        check_sparse_group(group)

    def _init_ring(self, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        return sparse_ring_state(group, layout)

    def _direction(self, group: dict, packed: PackedGroup, ring: dict) -> torch.Tensor:
        damp = group["damp"]
        compressed = compress_into_ring(self.ALGO, group, packed, ring, self._advance(ring))
        with nvtx_range("tritonopt/sparse_mfac/sp"):
            products = sparse_sp(ring["ring_indices"], ring["ring_values"], compressed.dense)
        with nvtx_range("tritonopt/sparse_mfac/solve"):
            update_dots(ring["dots"], compressed.slot, products)
            weights = mfac_coefficients(ring["dots"], products, damp)
        with nvtx_range("tritonopt/sparse_mfac/lcg"):
            combination = sparse_lcg(
                ring["ring_indices"], ring["ring_values"], weights.to(torch.float32),
                packed.layout.block_size,
            )
            return (compressed.dense / damp).sub_(combination)


# --------------------------------------------------------------------------- shared with S-GGT


def dense_ring_state(group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
    """The dense window of M-FAC/GGT: ``m`` full gradients, their float64 Gram matrix, the ring position."""
    m = group["ngrads"]
    return {
        "ring_grads": torch.zeros((m, layout.total), dtype=dtype, device=layout.device),
        "dots": torch.zeros((m, m), dtype=torch.float64, device=layout.device),
        "ring_slot": 0,
        "ring_filled": 0,
    }


def insert_dense(algo: str, ring: dict, slot: int, g: torch.Tensor) -> torch.Tensor:
    """Writes ``g`` into row ``slot`` of the dense window; returns ``window @ g`` with the Gram matrix updated."""
    window = ring["ring_grads"]
    with nvtx_range(f"tritonopt/{algo}/insert"):
        window[slot].copy_(g)
    with nvtx_range(f"tritonopt/{algo}/sp"):
        products = window @ g
        update_dots(ring["dots"], slot, products)
    return products


def check_sparse_group(group: dict) -> None:
    density, block_size = group["density"], group["block_size"]
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    check_int("block_size", block_size)
    if not isinstance(group["error_feedback"], bool):
        raise TypeError(f"error_feedback must be a bool, got {group['error_feedback']!r}")
    if group["values_dtype"] not in _VALUE_DTYPES:
        raise ValueError(
            f"values_dtype must be torch.float32 or torch.bfloat16, got {group['values_dtype']!r}"
        )


def sparse_ring_state(group: dict, layout: BlockLayout) -> dict:
    m = group["ngrads"]
    k = kept_per_block(group["density"], None, layout.block_size)
    shape = (layout.num_blocks, m, k)
    return {
        "ring_indices": torch.zeros(shape, dtype=torch.int32, device=layout.device),
        "ring_values": torch.zeros(shape, dtype=group["values_dtype"], device=layout.device),
        "dots": torch.zeros((m, m), dtype=torch.float64, device=layout.device),
        "ring_slot": 0,
        "ring_filled": 0,
    }


class Compressed:
    """The compressed accumulator of one step: dense ``[num_blocks, block_size]`` and its ring slot."""

    def __init__(self, dense: torch.Tensor, slot: int):
        self.dense, self.slot = dense, slot


def compress_into_ring(algo: str, group: dict, packed: PackedGroup, ring: dict, slot: int) -> Compressed:
    """Error feedback + blockwise Top-k of the packed gradient, written into row ``slot``.

    The compressed vector is the row exactly as the ring stores it. With bfloat16
    values the selected entries are rounded first and the rounding residual joins
    the error (``a == stored row + e``), so ``dots`` stays the Gram matrix of the
    stored rows and the preconditioned vector is the one the window holds.
    """
    indices_ring, values_ring = ring["ring_indices"], ring["ring_values"]
    k = indices_ring.shape[2]
    with nvtx_range(f"tritonopt/{algo}/compress"):
        error = packed.error if group["error_feedback"] else torch.zeros_like(packed.grad)
        indices, values = ef_topk(packed.grad, error, k)
        if values_ring.dtype != torch.float32:
            stored = values.to(values_ring.dtype).to(torch.float32)
            error.scatter_(1, indices.long(), values - stored)
            values = stored
        dense = torch.zeros_like(packed.grad).scatter_(1, indices.long(), values)
    with nvtx_range(f"tritonopt/{algo}/insert"):
        sparse_ring_insert(indices_ring, values_ring, slot, indices, values)
    return Compressed(dense, slot)
