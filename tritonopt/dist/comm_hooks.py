"""Compressed-gradient communication hooks for ``DistributedDataParallel``: what they do, send and keep.

This module describes both hooks and holds their public names. The code lives in
:mod:`~tritonopt.dist.comm_hooks_topk` and :mod:`~tritonopt.dist.comm_hooks_lowrank`,
what their states share in :mod:`~tritonopt.dist.comm_hooks_state`, and the
checks of a loaded checkpoint in :mod:`~tritonopt.dist.comm_hooks_checkpoint`.

Register one with ``ddp_model.register_comm_hook(state, hook)``. DDP calls the
hook once per gradient bucket (one flat buffer holding several parameters'
gradients) in every backward pass; the hook returns a ``torch.futures.Future``
of the bucket's buffer holding the averaged gradient, and every rank gets the
same bits. Both hooks compress with error feedback (EFCP, Modoranu et al. 2024,
sec. 3; Karimireddy et al. 2019): each rank compresses ``a = error + grad``,
sends the compressed message ``c``, and keeps ``error = a - c`` for the next
step, so nothing a rank leaves out is lost, only delayed.

``ef_topk_hook`` (:class:`EFTopKState`)
    The bucket is cut into blocks of ``block_size`` (the last block is
    partial); per block, :func:`tritonopt.ops.ef_topk` keeps the
    ``k = ceil(density * block_size)`` entries of largest ``|a|``
    (``ceil(density * length)`` in a partial last block). One all-gather moves
    every rank's values (float32) and block-relative positions (int16 for
    blocks up to 32768, else int32); each rank densifies every rank's message
    with :func:`tritonopt.ops.densify_blocks` and averages them.

``lowrank_ef_hook`` (:class:`LowRankState`)
    Each gradient with two or more dimensions, unfolded to ``[n, m]``
    (``n = shape[0]``), is compressed to rank ``r`` by
    :func:`tritonopt.ops.lowrank_ef`, one power iteration warm-started at the
    previous step's ``Q`` (PowerSGD's compressor, Vogels et al. 2019, as EFCP
    sec. 3.2 uses it): ``P`` (``[n, r]``, orthonormal columns) and
    ``Q = a^T P`` (``[m, r]``). One all-gather moves every rank's factors;
    each rank forms ``(1/W) sum_j P_j Q_j^T``. Tensors that compression would
    not shrink by ``min_compression_rate`` (``r (n + m) * rate >= n m``, as in
    torch's ``powerSGD_hook``) and 1-D tensors (biases, norm scales) are
    averaged uncompressed by one all-reduce, with no error feedback.

Why the low-rank hook all-gathers factors instead of all-reducing ``P`` then
``Q`` as torch's ``powerSGD_hook`` does: PowerSGD's all-reduce needs every rank
to project onto one shared ``P``, orthogonalised *after* the sum of the ranks'
``a Q``. :func:`~tritonopt.ops.lowrank_ef` fuses the error-feedback
accumulation, both products, the orthogonalisation and the error update on
one rank's ``a``, so the factors it returns are local (``P_j`` differs per
rank) and only the product ``P_j Q_j^T`` may be averaged. The hook therefore
gathers the factors, as the Top-k hook gathers its entries: the bytes sent per
rank are PowerSGD's (``4 r (n + m)`` per tensor), the bytes received grow with
the world size, and the average keeps rank ``W r`` instead of ``r``. Each rank
keeps its own error and warm start, so the invariant
``P_j Q_j^T + error_new = error_old + grad`` holds per rank.

Warm-up. For the first ``warmup_iters`` iterations (counted at each
iteration's last bucket) the hooks average buckets uncompressed, like
``start_powerSGD_iter``. DDP rebuilds its buckets after the first iteration
(different parameters per bucket index); the Top-k hook carries each
parameter's error over to its new bucket, and the low-rank hook keeps its
state per parameter, so compression may start at the first iteration
(``warmup_iters=0``).

Collectives (through ``state.communicator``, a
:class:`~tritonopt.dist._comm.CountingCommunicator` on ``process_group``),
bytes per rank per bucket per iteration, ``W`` the group size:

==========================  ========================  ==============================================
label                       hook                      bytes sent (received: ``W - 1`` times that for
                                                      an all-gather, the same for an all-reduce)
==========================  ========================  ==============================================
``warmup_allreduce``        both, warm-up iterations  ``s N`` (``N`` elements, ``s`` bytes each)
``topk_allgather``          Top-k                     ``4 E + 4 ceil(i E / 4)``: ``E`` entries kept in
                                                      the bucket, ``i`` bytes per index
``lowrank_allgather``       low-rank                  ``4 sum r (n + m)`` over the compressed tensors
``uncompressed_allreduce``  low-rank                  ``s`` times the other tensors' elements
==========================  ========================  ==============================================

Memory per rank: the Top-k error, float32, one block-padded buffer per bucket;
the low-rank error (``n m``) and two warm starts (``m r``, the current one and
the initial one) per compressed tensor, float32.

Non-finite gradients: a bucket (Top-k) or tensor (low-rank) whose local
gradient holds a NaN or an infinity is still sent, so the averaged gradient
shows it (``torch.amp.GradScaler`` then skips the step), and its error (and
warm start) restarts from zero (from the initial warm start) instead of
carrying the non-finite value into every later step. This costs no
synchronisation with the host.

Start-up agreement. Constructing a state is a collective over ``process_group``
when ``torch.distributed`` is initialized (DDP needs it anyway): every rank builds
its state, its own argument checks run, then
:func:`~tritonopt.dist._agreement.check_ranks_agree` (label ``config_check``: two
all-gathers of a few int64) compares the settings that must match (Top-k:
``density``, ``block_size``, ``warmup_iters``; low-rank: ``rank``,
``warmup_iters``, ``min_compression_rate``; both: the group's ranks). A rank that
differs, or that refused its own arguments, makes every rank raise at once,
naming the setting (or the refusing rank), instead of failing later inside a
DDP callback. ``seed`` may differ: each rank's warm start is its own. A state
built before ``init_process_group`` checks nothing and is refused by its hook.

Timeout. ``timeout`` (a ``timedelta`` or seconds) gives the hook a process group
of its own with that timeout (the same ranks); ``None`` uses ``process_group``
as it is, with its timeout. When a peer dies or stalls, the collective fails
with :class:`~tritonopt.dist._collective_guard.CollectiveFailure`, naming the
state, the collective and the ranks; DDP re-raises it from ``backward()`` as a
``RuntimeError`` that carries that message.

Checkpoints. ``state.state_dict()`` (between iterations) holds the iteration,
each rank's errors and warm starts, and the layout they belong to: the
parameters' shapes and dtypes numbered in the order the hook first meets them
(DDP's first-iteration buckets, which are the same in every process for the
same model), the buckets of the last iteration as lists of those numbers, the
world size and the rank. It loads with ``torch.load(weights_only=True)``; every
rank saves its own and loads it back with ``load_state_dict`` (a collective,
label ``load_state_dict``), which refuses a state saved for other settings,
another rank or world size, or with a malformed field, with a ``ValueError``
naming the field, before changing anything. A state that has not met its model
yet (a new process) checks the model at the first hook call after loading: a
parameter whose shape or dtype differs from the saved one raises ``ValueError``
there (from ``backward()``), before the hook compresses anything. Restarted from such a checkpoint
(with the model and the optimizer), a run continues bit for bit as it would
have: in its first iteration DDP uses its initial buckets again, and the Top-k
hook compresses them in the saved buckets' blocks (each saved bucket lying
inside one of DDP's), the low-rank hook draws any new warm starts in the saved
order. This holds for checkpoints taken after DDP's bucket rebuild, i.e. from
the second iteration on.
"""

from tritonopt.dist.comm_hooks_lowrank import LowRankState, lowrank_ef_hook
from tritonopt.dist.comm_hooks_topk import EFTopKState, ef_topk_hook

__all__ = ["EFTopKState", "LowRankState", "ef_topk_hook", "lowrank_ef_hook"]
