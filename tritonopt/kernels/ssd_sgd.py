"""One SSD-SGD iteration of the steps-delay stage over flat buffers (Xu et al., SSD-SGD, sec. 3.2-3.4).

Math, per element, in the compute dtype (float32; float64 for float64 state).
``p`` is the worker's device weight, ``g`` its own (un-averaged) gradient,
``pre`` the previously pulled global weight, ``(sw, smom)`` the worker's shadow
copy of the parameter server's momentum-SGD state::

    w_src = s * sw                        if pulled and shadow   (the freshly pulled global weight)
            p                             otherwise
    mom   = s * smom                      if pulled, else smom
    gs    = c * (pre - w_src)             grad_sync, Alg. 2 line 3, c = (1 - m) / (lr k)
    pre   = w_src                         if pulled                (Alg. 2 lines 4-5)
    p     = w_src - L (alpha g + wd_loc w_src + beta gs)            (Eq. 8, descent sign)
    sync_mom = mom                        if pulled and asked       (for discarding a window)
    smom  = m mom - lr (g + wd w_src_shadow)     with w_src_shadow = s * sw if pulled, else sw
    sw    = w_src_shadow + smom                                     (MXNet sgd_mom_update)

``s`` (``shadow_scale``) is ``1/K`` when ``(sw, smom)`` hold the sum of the K
ranks' shadows (the all-reduce of the shadow-server mapping), 1 otherwise.
Without shadow buffers (``shadow=False``) only the GLU part runs and ``w_src``
is ``p`` (the caller copies the pulled weight into ``p`` first).

Non-finite results. An element whose new ``p`` (after rounding to the
parameter's dtype) is NaN or +-inf keeps ``w_src`` and, when there are shadow
buffers, its new ``sw`` is set to NaN, so the event travels with the next
all-reduce to every rank. The number of such elements is returned.

Layout: every buffer is 1-D, contiguous, of one length ``n``. ``param`` and
``grad`` may be float16, bfloat16 or float32 (``grad`` any of them); the state
(``pre``, ``sw``, ``smom``, ``sync_mom``) is float32. Float64 buffers run the
reference (the kernel computes in float32 and takes float32 scalars).

Traffic per element at float32: 32 bytes for the common step (read p, g, pre,
sw, smom; write p, sw, smom), 36 after a pull (p is not read; pre and
sync_mom are written). One program per ``BLOCK`` elements, masked tail,
int64 offsets; the scalars are runtime arguments, so a learning-rate schedule
never recompiles. The launcher passes the largest power of two dividing ``n``
(``N_ALIGN``), so that the masked loads are vectors for a length such as
ResNet-18's 11,689,512 parameters, which Triton's own specialisation (on
multiples of 16) does not see.
"""

from __future__ import annotations

import contextlib
import math

import torch

from tritonopt._runtime import autotune, cdiv, jit, next_power_of_2, tl, triton
from tritonopt.kernels._alignment import aligned_block, alignment


def _ssd_sgd_configs():
    return [triton.Config({"BLOCK": block}, num_warps=w) for block, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8))]


@autotune(
    _ssd_sgd_configs,
    key=["n_bucket", "PULLED", "SHADOW", "SAVE_SYNC_MOM"],
    restore_value=["param_ptr", "pre_ptr", "sw_ptr", "smom_ptr", "sync_mom_ptr"],
    reset_to_zero=["count_ptr"],
)
@jit
def _ssd_sgd_step_kernel(
    param_ptr,  # [n] fp32/fp16/bf16, updated
    grad_ptr,  # [n] fp32/fp16/bf16
    pre_ptr,  # [n] fp32, written when PULLED
    sw_ptr,  # [n] fp32 shadow weight (SHADOW), updated
    smom_ptr,  # [n] fp32 shadow momentum (SHADOW), updated
    sync_mom_ptr,  # [n] fp32, written when SAVE_SYNC_MOM
    count_ptr,  # int32 scalar: non-finite elements, accumulated
    n,
    lr,
    momentum,
    weight_decay,
    local_lr,
    local_weight_decay,
    glu_alpha,
    glu_beta,
    sync_coef,
    shadow_scale,
    n_bucket,  # autotune key only
    PULLED: tl.constexpr, SHADOW: tl.constexpr, SAVE_SYNC_MOM: tl.constexpr,
    N_ALIGN: tl.constexpr,  # a power of two dividing n
    BLOCK: tl.constexpr,
):
    offs, mask = aligned_block(n, N_ALIGN, BLOCK)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + offs, mask=mask, other=0.0)
    if SHADOW:
        sw = tl.load(sw_ptr + offs, mask=mask, other=0.0)
        smom = tl.load(smom_ptr + offs, mask=mask, other=0.0)
        if PULLED:
            sw = sw * shadow_scale
            smom = smom * shadow_scale
            w_src = sw
        else:
            w_src = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        w_src = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    grad_sync = sync_coef * (pre - w_src)
    update = w_src - local_lr * (glu_alpha * g + local_weight_decay * w_src + glu_beta * grad_sync)
    stored = update.to(param_ptr.dtype.element_ty)
    # |x| <= the largest finite float32 is false exactly for NaN and +-inf. (A literal: a kernel
    # compiled for a GPU reads no module global that is not a constexpr.)
    bad = ~(tl.abs(stored.to(tl.float32)) <= 3.4028234663852886e38)
    new_p = tl.where(bad, w_src.to(param_ptr.dtype.element_ty), stored)
    tl.store(param_ptr + offs, new_p, mask=mask)
    if PULLED:
        tl.store(pre_ptr + offs, w_src, mask=mask)
    if SHADOW:
        if SAVE_SYNC_MOM:
            tl.store(sync_mom_ptr + offs, smom, mask=mask)
        smom = momentum * smom - lr * (g + weight_decay * sw)
        sw = tl.where(bad, float("nan"), sw + smom)
        tl.store(sw_ptr + offs, sw, mask=mask)
        tl.store(smom_ptr + offs, smom, mask=mask)
    bad_here = tl.sum((bad & mask).to(tl.int32), axis=0)
    if bad_here > 0:
        tl.atomic_add(count_ptr, bad_here)


def ssd_sgd_step_triton(
    param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum,
    lr, momentum, weight_decay, local_lr, local_weight_decay, glu_alpha, glu_beta, sync_coef, shadow_scale, pulled,
) -> torch.Tensor:
    """Launch the kernel. Arguments must already be validated (see ``tritonopt._ops.ssd_sgd``, whose
    ``ssd_sgd_step`` documents them; here every one is positional, in this order)."""
    n = param.numel()
    count = torch.zeros((), dtype=torch.int32, device=param.device)
    if n == 0:
        return count.to(torch.int64)
    shadow = shadow_weight is not None
    # Unused pointers are never dereferenced (constexpr branches); any valid tensor will do.
    sw = shadow_weight if shadow else pre_weight
    smom = shadow_momentum if shadow else pre_weight
    sync_mom = sync_momentum if sync_momentum is not None else pre_weight
    grid = lambda meta: (cdiv(n, meta["BLOCK"]),)  # noqa: E731
    with torch.cuda.device(param.device) if param.is_cuda else contextlib.nullcontext():
        _ssd_sgd_step_kernel[grid](
            param, grad, pre_weight, sw, smom, sync_mom, count, n,
            lr, momentum, weight_decay, local_lr, local_weight_decay,
            glu_alpha, glu_beta, sync_coef, shadow_scale, next_power_of_2(n),
            PULLED=pulled, SHADOW=shadow, SAVE_SYNC_MOM=sync_momentum is not None, N_ALIGN=alignment(n),
        )
    return count.to(torch.int64)


def ssd_sgd_step_reference(
    param, grad, pre_weight, shadow_weight, shadow_momentum, sync_momentum,
    lr, momentum, weight_decay, local_lr, local_weight_decay, glu_alpha, glu_beta, sync_coef, shadow_scale, pulled,
) -> torch.Tensor:
    """Plain-PyTorch SSD-SGD step; same contract as the kernel.

    Computes in float64 when the state is float64, else in float32. Eq. 8 is
    evaluated in its closed form: ``grad_sync = c (pre - w_src)`` (sec. 3.2.1)
    substituted, the terms gathered per input::

        p = (1 - L wd_loc + L beta c) w_src - L alpha g - L beta c pre

    which equals the kernel's three-term form up to rounding, in fewer passes.
    """
    compute = torch.float64 if pre_weight.dtype == torch.float64 else torch.float32
    g = grad.to(compute)
    shadow = shadow_weight is not None
    if shadow and pulled:  # the pulled global state: the mean of the ranks' shadows
        sw = shadow_weight.to(compute) * shadow_scale
        smom = shadow_momentum.to(compute) * shadow_scale
        w_src = sw
    else:
        w_src = param.to(compute)

    keep = 1.0 - local_lr * local_weight_decay + local_lr * glu_beta * sync_coef
    update = w_src * keep
    update.add_(g, alpha=-local_lr * glu_alpha).add_(pre_weight, alpha=-local_lr * glu_beta * sync_coef)
    stored = update.to(param.dtype)
    # One reduction decides the common case: a NaN or inf element makes the sum non-finite (a
    # finite sum that overflows merely takes the exact path below).
    any_bad = not math.isfinite(float(stored.sum(dtype=compute)))
    count = torch.zeros((), dtype=torch.int64, device=param.device)
    if any_bad:
        bad = ~torch.isfinite(stored)
        count = bad.sum()
        any_bad = bool(count)
    if any_bad:  # those elements keep w_src; their shadow weight is poisoned below
        stored = torch.where(bad, w_src.to(param.dtype), stored)
    if pulled:
        pre_weight.copy_(w_src)
    if shadow:
        if pulled:
            if sync_momentum is not None:
                sync_momentum.copy_(smom)
            shadow_weight.copy_(sw)
            shadow_momentum.copy_(smom)
        # The server's rule on this rank's shadow: mom = m mom - lr (g + wd w); w += mom.
        shadow_momentum.mul_(momentum).add_(g, alpha=-lr).add_(shadow_weight, alpha=-lr * weight_decay)
        shadow_weight.add_(shadow_momentum)
        if any_bad:
            shadow_weight.masked_fill_(bad, float("nan"))
    param.copy_(stored)
    return count
