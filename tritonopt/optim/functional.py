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

from typing import Optional, Sequence

import torch

from tritonopt.ops import ef_topk
from tritonopt.optim._blocks import kept_per_block
from tritonopt.optim._window_algebra import ggt_weights, mfac_coefficients, mfac_weights, update_gram
from tritonopt.optim.kfac_functional import (all_finite, kfac_accumulate_statistic, kfac_eigen_data,
                                             kfac_eigendecompose, kfac_inner_products, kfac_inverses,
                                             kfac_kl_clip_scale, kfac_precondition, kfac_running_average)

__all__ = [
    "all_finite",
    "apply_decoupled_update",
    "ggt_weights",
    "heavy_ball_momentum",
    "kept_per_block",
    "kfac_accumulate_statistic",
    "kfac_eigen_data",
    "kfac_eigendecompose",
    "kfac_inner_products",
    "kfac_inverses",
    "kfac_kl_clip_scale",
    "kfac_precondition",
    "kfac_running_average",
    "mfac_coefficients",
    "mfac_weights",
    "sparse_adagrad",
    "update_gram",
]


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
