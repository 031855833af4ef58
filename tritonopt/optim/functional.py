"""The optimizers' arithmetic as functions on flat buffers, as ``torch.optim``'s functional forms.

Each function takes the buffers an optimizer class keeps (one flat vector per
parameter group, see :mod:`tritonopt.optim._packed`), updates the state
buffers it is given in place and returns what the class applies. The classes
call these, and so do the distributed layers, which compose them with their
collectives instead of reaching into a class.

Shapes: ``[num_blocks, block_size]`` for the blockwise (EFCP) buffers, ``[d]``
or ``[m, d]`` for windows, as each function states. K-FAC's functions work on
one layer's factors (``[a, a]``, ``[g, g]``) and gradient (``[g, a]``); they are
defined in :mod:`tritonopt.optim.kfac_functional`.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional, Sequence

import torch

from tritonopt._runtime import nvtx_range
from tritonopt.ops import ef_topk, fosi_step, lowrank_ef, lowrank_frobenius_products, sgd_momentum_step
from tritonopt.ops import sparse_lcg, sparse_sp
from tritonopt.optim._blocks import kept_per_block
from tritonopt.optim._window_algebra import (fold_new_row, ggt_weights, mfac_coefficients, mfac_weights,
                                             unfolded_shape, update_gram)
from tritonopt.optim import kfac_functional as _kfac_functional
from tritonopt.optim.kfac_functional import (all_finite, kfac_accumulate_statistic, kfac_eigen_data,
                                             kfac_eigendecompose, kfac_inner_products,
                                             kfac_inner_products_float32, kfac_inverses, kfac_kl_clip_scale,
                                             kfac_precondition, kfac_precondition_layers, kfac_running_average,
                                             kfac_running_averages, kfac_scale_preconditioned, kl_clip_scale_of_sum)

__all__ = sorted([
    *_kfac_functional.LAYER_FUNCTIONS,
    "apply_decoupled_update",
    "dense_window_combine",
    "dense_window_products",
    "flat_sgd",
    "fold_new_row",
    "ggt_weights",
    "heavy_ball_momentum",
    "kept_per_block",
    "lowrank_window_combine",
    "lowrank_window_compress",
    "lowrank_window_products",
    "mfac_coefficients",
    "mfac_weights",
    "sparse_adagrad",
    "sparse_window_combine",
    "sparse_window_compress",
    "sparse_window_products",
    "update_gram",
    "window_weights",
])


def sparse_adagrad(
    grad: torch.Tensor,
    error: torch.Tensor,
    sum_sq: torch.Tensor,
    update: torch.Tensor,
    *,
    k: int,
    eps: float,
) -> torch.Tensor:
    """EFCP Algorithm 7 on one packed group: returns ``update`` holding ``c / (sqrt(H) + eps)``.

    ``a = error + grad``; ``c`` keeps the ``k`` entries of largest ``|a|`` per block
    (:func:`tritonopt.ops.ef_topk`), ``error = a - c``; ``H += c ** 2`` on the kept
    entries; the other entries of ``update`` are 0. ``grad`` is
    ``[num_blocks, block_size]``; ``error``, ``sum_sq`` (``H``) and ``update`` are
    float32 of that shape; all but ``grad`` are written in place. The caller
    applies ``theta -= lr * update``.
    """
    indices, values = ef_topk(grad, error, k)
    indices = indices.long()
    kept_sum_sq = sum_sq.gather(1, indices).addcmul_(values, values)
    sum_sq.scatter_(1, indices, kept_sum_sq)
    return update.zero_().scatter_(1, indices, values / (kept_sum_sq.sqrt_() + eps))


def heavy_ball_momentum(buffer: torch.Tensor, direction: torch.Tensor, momentum: float) -> torch.Tensor:
    """``v = momentum * v + u`` in place (no dampening); returns ``v``."""
    return buffer.mul_(momentum).add_(direction)


def apply_decoupled_update(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    lr: float,
    weight_decay: float,
    active: Optional[Sequence[bool]] = None,
) -> None:
    """``p = (1 - lr * weight_decay) * p - lr * update`` for each active parameter, rounded once.

    ``updates`` are views shaped like the parameters (possibly wider dtypes);
    a parameter narrower than its update is computed in the wider dtype and
    rounded once to its own.
    """
    for i, (p, update) in enumerate(zip(params, updates)):
        if active is not None and not active[i]:
            continue
        wide = torch.promote_types(p.dtype, update.dtype)
        if p.dtype == wide:
            if weight_decay:
                p.mul_(1 - lr * weight_decay)
            p.sub_(update, alpha=lr)
        else:
            p_wide = p.to(wide)
            if weight_decay:
                p_wide.mul_(1 - lr * weight_decay)
            p.copy_(p_wide.sub_(update, alpha=lr))


def flat_sgd(
    weights: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    *,
    work: Optional[torch.Tensor] = None,
    **hyperparameters,
) -> None:
    """``torch.optim.SGD``'s step of one flat buffer, in place, by :func:`tritonopt.ops.sgd_momentum_step`.

    ``weights`` (float32, float16 or bfloat16) and ``grad`` (its shape, float32,
    float16 or bfloat16) are contiguous; ``momentum_buffer`` is float32 of that
    shape (or None without momentum); ``hyperparameters`` are the op's (``lr``,
    ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``maximize``,
    ``first_step``). float32 weights are updated by the fused op in one pass;
    narrower ones are copied into ``work`` (float32, allocated when None),
    stepped there and rounded once.
    """
    if weights.dtype == torch.float32:
        sgd_momentum_step(weights, grad, momentum_buffer, **hyperparameters)
        return
    wide = weights.to(torch.float32) if work is None else work.copy_(weights)
    sgd_momentum_step(wide, grad, momentum_buffer, **hyperparameters)
    weights.copy_(wide)


# --------------------------------------------------------------------------- windows
#
# The windowed preconditioners (M-FAC, GGT) keep the last ``m`` stored vectors ``G``
# (``[m, d]``) and their float64 Gram matrix ``dots = G G^T``. A step stores its vector
# ``x`` in row ``slot``, takes the products ``s = G x`` (``*_window_products``), sets row and
# column ``slot`` of ``dots`` to ``s`` and turns both into the float64 weights ``w``
# (:func:`window_weights`), then forms ``u = w @ G`` (``*_window_combine``). ``G`` is stored
# dense (``rows``), as a sparse ring (``ring_indices``/``ring_values``, ``[num_blocks, m, k]``)
# or as per-tensor low-rank factors (``ring_p`` ``[m, n, r]``, ``ring_q`` ``[m, p, r]``).
# ``column_weights`` (``[d]`` or None) weight each coordinate in the products: a sharded
# window counts a replicated parameter's coordinates ``1 / world`` on each rank.


def window_weights(dots: torch.Tensor, slot: int, products: torch.Tensor, weights, scale: float) -> torch.Tensor:
    """Row and column ``slot`` of ``dots`` become ``products``; returns ``w = z + e_slot / scale`` (float64).

    ``weights`` is :func:`mfac_weights` (``scale`` = damp) or :func:`ggt_weights`
    (``scale`` = eps), giving ``z`` of ``u = x / scale + z @ G``.
    """
    update_gram(dots, slot, products)
    return fold_new_row(weights(dots, products, scale), slot, scale)


def dense_window_products(rows: torch.Tensor, x: torch.Tensor,
                          column_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``s = G x`` of a dense window ``rows`` (``[m, d]``) and ``x`` (``[d]``), in ``rows``' dtype."""
    return rows @ (x if column_weights is None else x * column_weights.view(-1))


def dense_window_combine(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``u = w @ G`` (``[d]``) of a dense window, computed in ``rows``' dtype."""
    return weights.to(rows.dtype) @ rows


def sparse_window_compress(
    grad: torch.Tensor,
    error: Optional[torch.Tensor],
    *,
    density: float,
    length: int,
    values_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EFCP Alg. 1's compression of one step's vector: ``a = grad + error``, ``c`` = its blockwise Top-k.

    ``grad`` (float32, ``[num_blocks, block_size]``) holds the vector of ``length``
    entries (the rest is padding); ``error`` is the feedback, float32 or bfloat16
    of that shape, or None without error feedback. Every full block keeps
    ``ceil(density * block_size)`` entries, a partial last block
    ``ceil(density * its length)``, padded with value 0 at distinct positions of
    its padding (never selected). With ``values_dtype`` bfloat16 the kept values
    are rounded as the ring stores them and the rounding residual joins the error.
    Returns ``(indices, values, compressed, residual)``: the kept entries as the
    ring stores them, ``c`` densely, and ``a - c`` (the new error, written into
    ``error`` when given; a bfloat16 ``error`` takes it rounded once). ``grad`` is
    used as scratch.
    """
    k = kept_per_block(density, None, grad.shape[1])
    narrow_error = error is not None and error.dtype != torch.float32
    if narrow_error:  # a = g + e in float32, in the gradient's scratch; the residual starts from 0
        grad.add_(error)
    residual = error if error is not None and not narrow_error else torch.zeros_like(grad)
    indices, values = _ef_topk_with_partial_block(grad, residual, density, length, k)
    if values_dtype != torch.float32:
        stored = values.to(values_dtype).to(torch.float32)
        residual.scatter_(1, indices.long(), values - stored)
        values = stored
    if narrow_error:
        error.copy_(residual)
    compressed = torch.zeros_like(grad).scatter_(1, indices.long(), values)
    return indices, values, compressed, residual


def _ef_topk_with_partial_block(grad: torch.Tensor, error: torch.Tensor, density: float, length: int, k: int):
    """``ef_topk`` with ``k`` per full block and ``ceil(density * length)`` in a partial last block.

    The last block's row is padded to ``k`` with value 0 at its padding's
    first positions, which the selection never takes (they hold zeros and
    ties go to the lower position), so all positions in the row stay distinct.
    """
    last_length = length - (grad.shape[0] - 1) * grad.shape[1]
    k_last = kept_per_block(density, None, last_length)
    if k_last >= k:
        return ef_topk(grad, error, k)
    head_indices, head_values = ef_topk(grad[:-1], error[:-1], k)
    last_indices, last_values = ef_topk(grad[-1:], error[-1:], k_last)
    padding = torch.arange(last_length, last_length + k - k_last, dtype=torch.int32, device=grad.device)
    indices = torch.cat([head_indices, torch.cat([last_indices, padding.view(1, -1)], dim=1)])
    values = torch.cat([head_values, torch.cat([last_values, last_values.new_zeros(1, k - k_last)], dim=1)])
    return indices, values


def sparse_window_products(ring_indices: torch.Tensor, ring_values: torch.Tensor, compressed: torch.Tensor,
                           column_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``s = G c`` of a sparse ring and the dense ``compressed`` vector (``[num_blocks, block_size]``)."""
    return sparse_sp(ring_indices, ring_values, compressed if column_weights is None else compressed * column_weights)


def sparse_window_combine(ring_indices: torch.Tensor, ring_values: torch.Tensor, weights: torch.Tensor,
                          block_size: int) -> torch.Tensor:
    """``u = w @ G`` of a sparse ring, as ``[num_blocks, block_size]`` float32."""
    return sparse_lcg(ring_indices, ring_values, weights.to(torch.float32), block_size, ascending=True)


def lowrank_window_compress(
    grads: Sequence[torch.Tensor],
    errors: Sequence[torch.Tensor],
    warm_starts: Sequence[torch.Tensor],
    ring_ps: Sequence[torch.Tensor],
    ring_qs: Sequence[torch.Tensor],
    slot: int,
    active: Sequence[bool],
) -> None:
    """Store each tensor's ``lowrank_ef`` factors of ``grad + error`` as row ``slot`` of its ring (EFCP App. I).

    Per tensor ``l`` (unfolded to ``[n, p]``, a 1-D tensor to ``[n, 1]``): ``(P, Q)
    = lowrank_ef(g, e, Q_warm)``, ``error`` keeps what they leave out and a tensor
    of two or more dimensions keeps ``Q`` as its next warm start. A tensor that
    is not ``active`` stores a zero row and keeps its error and warm start.
    """
    for g, e, warm, ring_p, ring_q, is_active in zip(grads, errors, warm_starts, ring_ps, ring_qs, active):
        if not is_active:
            ring_p[slot].zero_()
            ring_q[slot].zero_()
            continue
        n, cols = unfolded_shape(g)
        if g.dim() >= 2:
            factor_p, factor_q = lowrank_ef(g.view(n, cols), e.view(n, cols), warm)
            warm.copy_(factor_q)
        else:
            factor_p, factor_q = lowrank_ef(g.reshape(-1), e.reshape(-1), warm)
        ring_p[slot].copy_(factor_p)
        ring_q[slot].copy_(factor_q)


def lowrank_window_products(ring_ps: Sequence[torch.Tensor], ring_qs: Sequence[torch.Tensor],
                            slot: int) -> torch.Tensor:
    """``s = G x`` with ``x`` row ``slot``: the per-tensor Frobenius products, summed in float64."""
    products = torch.zeros(ring_ps[0].shape[0], dtype=torch.float64, device=ring_ps[0].device)
    for ring_p, ring_q in zip(ring_ps, ring_qs):
        products += lowrank_frobenius_products(ring_p, ring_q, ring_p[slot], ring_q[slot]).double()
    return products


def lowrank_window_combine(ring_ps: Sequence[torch.Tensor], ring_qs: Sequence[torch.Tensor], weights: torch.Tensor,
                           outs: Sequence[torch.Tensor]) -> None:
    """``u_l = sum_j w_j P_{l,j} Q_{l,j}^T`` into each tensor's ``out`` (shaped like the tensor), float32."""
    weights = weights.to(torch.float32)
    m = weights.shape[0]
    for ring_p, ring_q, out in zip(ring_ps, ring_qs, outs):
        n, rank = ring_p.shape[1], ring_p.shape[2]
        # one GEMM over the concatenated factors [n, m r] x [m r, p]
        left = (ring_p * weights.view(m, 1, 1)).permute(1, 0, 2).reshape(n, m * rank)
        right = ring_q.permute(1, 0, 2).reshape(ring_q.shape[1], m * rank)
        out.view(n, right.shape[0]).copy_(left @ right.T)


# --------------------------------------------------------------------------- FOSI
#
# FOSI (Sivan et al., ICLR 2024; Gu et al. sec. II-B, eqs. 11-12) on one flat
# vector of length n: ``V`` is ``[r, n]`` with orthonormal rows (the Ritz
# vectors), ``s`` (``[r]``) the Newton scale, ``O`` the base optimizer's step
# (sign and rate included):
#
#     c = V g,  g2 = g - V^T c,  w <- w - V^T (s * q) + b (I - V^T V) O(g2)
#
# with ``q = c``, or a coefficient-space velocity ``z <- g1_decay z + g1_gain c``.
# float32 buffers run the fused op (tritonopt.ops.fosi_step); float64 buffers
# the same formulas in torch, in float64.

FOSI_BASES = ("sgd", "heavy_ball", "adam")


class FOSIHyper(NamedTuple):
    """The hyperparameters of one slice ``[previous stop, stop)`` of the flat vector.

    ``lr``, ``beta1`` (heavy-ball momentum or Adam's first beta), ``beta2`` and
    ``eps`` are the base optimizer's; ``weight_decay`` is decoupled
    (``w <- (1 - lr * weight_decay) w`` before the update) and ``newton_factor``
    multiplies the Newton step on the slice.
    """

    stop: int
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    newton_factor: float = 1.0


def fosi_newton_scale(
    eigenvalues: torch.Tensor,
    alpha: float,
    *,
    floor: float = 1e-3,
    ritz_scale: Optional[float] = None,
    signed: bool = False,
) -> torch.Tensor:
    """``s_j = alpha / max(|lambda_j|, floor * ritz_scale)``, times ``sign(lambda_j)`` when ``signed``.

    The floor is relative to ``ritz_scale``, the largest ``|Ritz value|`` of the
    estimate (default: the largest ``|eigenvalues|``), so scaling the loss by
    ``c`` scales every ``s_j`` by ``1 / c``. ``signed=True`` is eq. (11) as
    printed (``alpha / lambda``); the FOSI reference code uses ``|lambda|`` (a
    negative Ritz value would otherwise turn the Newton step uphill). Returns
    ``eigenvalues``' dtype and device.
    """
    magnitude = eigenvalues.abs()
    if ritz_scale is None:
        ritz_scale = float(magnitude.max()) if magnitude.numel() else 0.0
    magnitude = magnitude.clamp_min(floor * ritz_scale)
    return alpha / (torch.sign(eigenvalues) * magnitude if signed else magnitude)


def fosi_base_scale(eigenvalues: torch.Tensor, k: int, learning_rate_clip: float) -> float:
    """``b = clip(lambda_max / lambda_(k), 1, learning_rate_clip)`` over the ``k`` largest of ``eigenvalues``.

    ``eigenvalues`` are ascending (``l`` smallest, then ``k`` largest); 1 when
    the clip is off (``<= 1``), ``k = 0``, or ``lambda_(k) <= 0``. The FOSI
    reference code scales its heavy-ball and SGD base steps by this (clip 3).
    """
    if learning_rate_clip <= 1.0 or k == 0 or eigenvalues.numel() == 0:
        return 1.0
    largest = eigenvalues[-min(k, eigenvalues.numel()) :]
    smallest_kept, top = float(largest[0]), float(largest[-1])
    if smallest_kept <= 0:
        return 1.0
    return min(max(top / smallest_kept, 1.0), learning_rate_clip)


def _wide_base_step(grad, first_moment, second_moment, base, lr, beta1, beta2, eps, step) -> torch.Tensor:
    """The base step in the buffers' own (wider than float32) dtype."""
    if base == "sgd":
        return grad * -lr
    if base == "heavy_ball":
        return first_moment.mul_(beta1).add_(grad) * -lr
    first_moment.lerp_(grad, 1.0 - beta1)
    second_moment.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denominator = second_moment.sqrt().div_(math.sqrt(1.0 - beta2**step)).add_(eps)
    return first_moment.div(denominator).mul_(-lr / (1.0 - beta1**step))


def fosi_base_step(
    grad: torch.Tensor,
    first_moment: Optional[torch.Tensor],
    second_moment: Optional[torch.Tensor],
    *,
    base: str,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    step: int = 1,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The base optimizer's step ``u = O(grad)`` on a flat ``[n]`` buffer; its state is updated in place.

    * ``sgd``: ``u = -lr g``;
    * ``heavy_ball``: ``a = beta1 a + g``, ``u = -lr a`` (``first_moment`` = ``a``,
      the momentum buffer);
    * ``adam``: ``a = beta1 a + (1 - beta1) g``, ``b2 = beta2 b2 + (1 - beta2) g^2``,
      ``u = -(lr / (1 - beta1^step)) a / (sqrt(b2 / (1 - beta2^step)) + eps)``
      (``first_moment`` = ``a``, ``second_moment`` = ``b2``).

    float32 buffers: :func:`tritonopt.ops.fosi_step` with an empty basis on a
    zeroed ``out`` (allocated when None), which is exactly its base step;
    float64 buffers: the same formulas in float64. ``step`` counts this step.
    """
    if grad.dtype == torch.float64:
        return _wide_base_step(grad, first_moment, second_moment, base, lr, beta1, beta2, eps, step)
    out = torch.zeros(grad.shape[0], dtype=torch.float32, device=grad.device) if out is None else out.zero_()
    fosi_step(out, grad, grad.new_zeros((0, grad.shape[0]), dtype=torch.float32),
              grad.new_zeros(0, dtype=torch.float32), base=base, state_a=first_moment, state_b=second_moment,
              lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step)
    return out


def fosi_segment_bounds(segments: Sequence[FOSIHyper]) -> list[tuple[int, int, FOSIHyper]]:
    """``[(start, stop, hyper)]`` for consecutive ``segments``."""
    bounds, start = [], 0
    for hyper in segments:
        bounds.append((start, hyper.stop, hyper))
        start = hyper.stop
    return bounds


def fosi_base_steps(
    grad: torch.Tensor,
    first_moment: Optional[torch.Tensor],
    second_moment: Optional[torch.Tensor],
    *,
    base: str,
    segments: Sequence[FOSIHyper],
    step: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`fosi_base_step` with each slice's own hyperparameters (``segments`` cover ``[0, n)``)."""
    if len(segments) == 1:
        h = segments[0]
        return fosi_base_step(grad, first_moment, second_moment, base=base, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                              eps=h.eps, step=step, out=out)
    out = torch.empty_like(grad) if out is None else out
    for start, stop, h in fosi_segment_bounds(segments):
        piece = fosi_base_step(
            grad[start:stop], None if first_moment is None else first_moment[start:stop],
            None if second_moment is None else second_moment[start:stop], base=base, lr=h.lr, beta1=h.beta1,
            beta2=h.beta2, eps=h.eps, step=step, out=out[start:stop] if grad.dtype != torch.float64 else None)
        if piece.data_ptr() != out[start:stop].data_ptr():
            out[start:stop].copy_(piece)
    return out


def fosi_apply_weight_decay(weights: torch.Tensor, segments: Sequence[FOSIHyper]) -> None:
    """``w <- (1 - lr * weight_decay) w`` on every slice with a weight decay."""
    for start, stop, h in fosi_segment_bounds(segments):
        if h.weight_decay:
            weights[start:stop].mul_(1.0 - h.lr * h.weight_decay)


def fosi_scale_segments(vector: torch.Tensor, segments: Sequence[FOSIHyper]) -> torch.Tensor:
    """``vector`` with each slice multiplied by its ``newton_factor`` (in place; returned)."""
    for start, stop, h in fosi_segment_bounds(segments):
        if h.newton_factor != 1.0:
            vector[start:stop].mul_(h.newton_factor)
    return vector


def fosi_uniform(segments: Sequence[FOSIHyper]) -> bool:
    """Whether every slice shares the base hyperparameters and Newton factor (weight decay may differ)."""
    return all(h[1:5] == segments[0][1:5] and h.newton_factor == segments[0].newton_factor for h in segments)


def fosi_update(
    weights: torch.Tensor,
    grad: torch.Tensor,
    basis: torch.Tensor,
    newton_scale: torch.Tensor,
    *,
    base: str,
    segments: Sequence[FOSIHyper],
    step: int,
    first_moment: Optional[torch.Tensor] = None,
    second_moment: Optional[torch.Tensor] = None,
    base_scale: float = 1.0,
    g1_velocity: Optional[torch.Tensor] = None,
    g1_decay: float = 0.0,
    g1_gain: float = 1.0,
    prepared: bool = False,
) -> None:
    """One FOSI update of the flat ``weights`` (``[n]``), in place: see the section comment above.

    ``basis`` ``[r, n]`` and ``newton_scale`` ``[r]`` in ``weights``' dtype
    (``r = 0``: exactly the base optimizer's step); ``grad``, ``first_moment``,
    ``second_moment`` ``[n]`` (the base optimizer's state, as :func:`fosi_base_step`);
    ``g1_velocity`` ``[r]`` or None (updated in place);
    ``segments`` the slices' hyperparameters (:class:`FOSIHyper`, covering
    ``[0, n)``); ``step`` the base optimizer's step count including this one.
    Decoupled weight decay is applied first. float32 weights with uniform
    slices run the fused op in one call; otherwise the same arithmetic runs in
    torch, slice by slice for the base step. ``prepared``: for a caller whose buffers are its
    own, checked when it built them (an optimizer's step), the fused op runs prepared
    (:meth:`~tritonopt._ops._registry.Op.prepared`): no argument checks, the same arithmetic.
    """
    fosi_apply_weight_decay(weights, segments)
    if weights.dtype == torch.float32 and fosi_uniform(segments):
        h = segments[0]
        scale = newton_scale if h.newton_factor == 1.0 else newton_scale * h.newton_factor
        step_op = fosi_step.prepared(weights.device) if prepared else fosi_step
        with nvtx_range("tritonopt/fosi/update") if prepared else contextlib.nullcontext():
            step_op(weights, grad, basis, scale, base=base, state_a=first_moment, state_b=second_moment, lr=h.lr,
                    beta1=h.beta1, beta2=h.beta2, eps=h.eps, step=step, base_scale=base_scale,
                    g1_velocity=g1_velocity, g1_decay=g1_decay, g1_gain=g1_gain)
        return
    g = grad.to(weights.dtype)
    coef = basis @ g
    q = coef if g1_velocity is None else g1_velocity.mul_(g1_decay).add_(coef, alpha=g1_gain)
    newton = fosi_scale_segments((newton_scale * q) @ basis, segments)
    u = fosi_base_steps(g - coef @ basis, first_moment, second_moment, base=base, segments=segments, step=step)
    weights.add_(base_scale * (u - (basis @ u) @ basis) - newton)


__all__ += [
    "FOSIHyper",
    "FOSI_BASES",
    "fosi_apply_weight_decay",
    "fosi_base_scale",
    "fosi_base_step",
    "fosi_base_steps",
    "fosi_newton_scale",
    "fosi_scale_segments",
    "fosi_segment_bounds",
    "fosi_uniform",
    "fosi_update",
]


# --------------------------------------------------------------------------- SSD-SGD
#
# SSD-SGD (Xu et al., sec. 3): the parameter server applies momentum SGD in MXNet's
# convention (``sgd_mom_update``) to the mean of the workers' gradients; in the delay
# stage each worker's step is the GLU update of Eq. 8 fused with that server rule on
# the worker's own shadow copy of the server (tritonopt.ops.ssd_sgd_step), whose
# scalars :func:`ssd_sgd_step_scalars` derives from the hyperparameters.


def server_momentum_sgd(
    weight: torch.Tensor,
    momentum_buffer: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the server's momentum SGD, out of place: returns ``(w', mom')``::

        mom' = momentum * mom - lr * (grad + weight_decay * w)
        w'   = w + mom'

    computed in ``momentum_buffer``'s dtype (``weight`` is widened to it, and ``w'``
    rounded back to ``weight``'s dtype once). Nothing is modified, so a caller can
    check the result before it commits it. Tensors of one shape (SSD-SGD: ``[d]``
    slices of its flat buffers).
    """
    wide = weight.to(momentum_buffer.dtype)
    new_momentum = momentum_buffer * momentum - lr * (grad + weight_decay * wide)
    return (wide + new_momentum).to(weight.dtype), new_momentum


def ssd_sgd_step_scalars(
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    local_lr_mult: float,
    local_weight_decay: Optional[float],
    glu_alpha: float,
    glu_beta: float,
    delay_steps: int,
) -> dict[str, float]:
    """The scalar arguments of :func:`tritonopt.ops.ssd_sgd_step` for one parameter group.

    ``local_lr = local_lr_mult * lr``; ``local_weight_decay`` is ``weight_decay``
    when None; ``sync_coef = (1 - momentum) / (lr * delay_steps)``, the factor that
    turns two pulled weights into ``grad_sync`` (sec. 3.2.1), and 0 when ``lr`` is 0
    (a zero learning rate moves nothing to estimate from).
    """
    lr, momentum = float(lr), float(momentum)
    return dict(
        lr=lr, momentum=momentum, weight_decay=float(weight_decay), local_lr=float(local_lr_mult) * lr,
        local_weight_decay=float(weight_decay if local_weight_decay is None else local_weight_decay),
        glu_alpha=float(glu_alpha), glu_beta=float(glu_beta),
        sync_coef=(1.0 - momentum) / (lr * delay_steps) if lr > 0 else 0.0,
    )


__all__ += ["server_momentum_sgd", "ssd_sgd_step_scalars"]
