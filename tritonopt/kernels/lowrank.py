"""Low-rank compression with error feedback by one warm-started power iteration (EFCP sec. 3.2, App. I).

Math, for one tensor unfolded to ``A`` of shape ``[n, p]`` (``n = shape[0]``,
``p`` = the product of the other dimensions) and a warm start ``Q`` (``[p, r]``)::

    A = error + grad                                   (fp32; written into error)
    P = A Q                                            [n, r]
    P = GramSchmidt(P):  for i < r:  P_i /= (||P_i|| + 1e-8);  P_{i+1:} -= P_i (P_i^T P_{i+1:})
        (a column left with under 1e-4 of its norm is dependent and set to zero)
    Q = A^T P                                          [p, r], the next step's warm start
    error = A - P Q^T                                  (in place)

so ``P Q^T + error_new == error_old + grad`` up to rounding, and ``P`` has
orthonormal columns (or zero columns where ``A Q`` has none to give). Where a
column of ``P`` is zero, the returned ``Q`` keeps the warm start's column: it
adds nothing to ``P Q^T``, and a zero column of ``Q`` would stay zero in every
later iteration (one zero or rank-1 gradient would lower the rank for good).
This is PowerSGD's compressor (Vogels et al. 2019) as EFCP uses it. A 1-D tensor is not
compressed and gets no error feedback: ``P = [g, 0, ..., 0]`` (``[n, r]``),
``Q = [[1, 0, ..., 0]]`` (``[1, r]``), and ``error`` is left as it is.

GPU design. ``r`` is small (1-8), so the two products are bandwidth-bound
(``2 r`` flops per 4-byte element) and run as Triton reductions over register
tiles rather than tensor-core GEMMs (which also sidesteps TF32):

1. one program per (tile of rows, segment of columns): ``A = error + grad`` is
   written back into ``error`` and the segment's part of ``P = A Q``
   accumulated in the same pass;
2. Gram-Schmidt on the ``n x r`` ``P`` in torch (``r`` sequential column steps on
   a tiny matrix; a kernel does not pay);
3. one program per (tile of columns, segment of rows): ``Q = A^T P`` (``A``
   re-read from ``error``);
4. one program per 2-D tile: ``error = A - P Q^T`` (the fused epilogue).

The segments of steps 1 and 3 give a 512 x 4608 layer about ``TARGET_PROGRAMS``
programs instead of 16 and 72; their partial products (``segments x n x r``
floats, a few hundred KB) are summed by ``torch.sum`` in a fixed order. Every
kernel runs one config per key (pinned), so the result is the same bits in
every process.

Traffic: read grad and error, write A, read A twice, write error: about
``24 n p`` bytes, the floor of a 3-pass algorithm (the second product needs all
of ``P``).
"""

from __future__ import annotations

import contextlib

import torch

from tritonopt._runtime import autotune, cdiv, jit, next_power_of_2, tl, triton
from tritonopt.kernels._alignment import alignment, assume_multiple
from tritonopt.kernels._tiles import load_tile, store_tile

GRAM_SCHMIDT_EPS = 1e-8
# Relative norm below which a column counts as dependent on the previous ones.
DEPENDENT_TOLERANCE = 1e-4
TILE_ROWS = 32
TILE_COLS = 64
# The two products split their reduction dimension into segments until the grid
# has about this many programs (an H100 has 132 SMs); the segments' partial
# products are summed afterwards in a fixed order. The split depends on the
# shape only, never on the launch config.
TARGET_PROGRAMS = 1024


def _configs():
    return [triton.Config({}, num_warps=w) for w in (4, 8)]


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@jit
def _segment_range(segment, segment_len, length):
    """``(start, stop)``: the range of the reduction dimension (``length`` long) that ``segment`` sums."""
    start = segment * segment_len
    return start, tl.minimum(start + segment_len, length)


# The sums over a tile run in a layout that depends on num_warps: every kernel
# here is pinned per key.
@autotune(_configs, key=["R", "BLOCK_N", "BLOCK_P"], pinned=True, restore_value=["error_ptr"])
@jit
def _accumulate_project_kernel(
    grad_ptr,  # [n, p] fp32/bf16/fp16
    error_ptr,  # [n, p] fp32, becomes A = error + grad
    q_ptr,  # [p, r] fp32
    out_p_ptr,  # [segments, n, r] fp32, output: partial P = A Q over each column segment
    n, p, r,  # A is [n, p], the factors have r columns
    segment_cols,  # columns per segment, a multiple of BLOCK_P
    R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    P_ALIGN: tl.constexpr,  # a power of two dividing p
):
    p = assume_multiple(p, P_ALIGN)  # rows start P_ALIGN-aligned: vector loads
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    segment = tl.program_id(1)
    row_ok = rows < n
    ranks = tl.arange(0, R)
    rank_ok = ranks < r
    acc = tl.zeros([BLOCK_N, R], dtype=tl.float32)
    start, stop = _segment_range(segment, segment_cols, p)
    for c0 in range(start, stop, BLOCK_P):
        cols = c0 + tl.arange(0, BLOCK_P)
        col_ok = cols < p
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * p + cols[None, :]
        a = tl.load(error_ptr + offs, mask=mask, other=0.0) + tl.load(
            grad_ptr + offs, mask=mask, other=0.0
        ).to(tl.float32)
        tl.store(error_ptr + offs, a, mask=mask)
        q = load_tile(q_ptr, cols, col_ok, ranks, rank_ok, r)
        acc += tl.sum(a[:, :, None] * q[None, :, :], axis=1)
    store_tile(out_p_ptr + segment.to(tl.int64) * n * r, rows.to(tl.int64), row_ok, ranks, rank_ok, r, acc)


@autotune(_configs, key=["R", "BLOCK_N", "BLOCK_P"], pinned=True)
@jit
def _back_project_kernel(
    a_ptr,  # [n, p] fp32 (A)
    p_ptr,  # [n, r] fp32 (orthonormalised P)
    out_q_ptr,  # [segments, p, r] fp32, output: partial Q = A^T P over each row segment
    n, p, r,  # A is [n, p], the factors have r columns
    segment_rows,  # rows per segment, a multiple of BLOCK_N
    R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    P_ALIGN: tl.constexpr,  # a power of two dividing p
):
    p = assume_multiple(p, P_ALIGN)  # rows start P_ALIGN-aligned: vector loads
    cols = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    segment = tl.program_id(1)
    col_ok = cols < p
    ranks = tl.arange(0, R)
    rank_ok = ranks < r
    acc = tl.zeros([BLOCK_P, R], dtype=tl.float32)
    start, stop = _segment_range(segment, segment_rows, n)
    for r0 in range(start, stop, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        a = load_tile(a_ptr, rows.to(tl.int64), row_ok, cols, col_ok, p)
        pr = load_tile(p_ptr, rows.to(tl.int64), row_ok, ranks, rank_ok, r)
        acc += tl.sum(a[:, :, None] * pr[:, None, :], axis=0)
    store_tile(out_q_ptr + segment.to(tl.int64) * p * r, cols, col_ok, ranks, rank_ok, r, acc)


@autotune(_configs, key=["R", "BLOCK_N", "BLOCK_P"], pinned=True, restore_value=["error_ptr"])
@jit
def _residual_kernel(
    error_ptr,  # [n, p] fp32: A in, A - P Q^T out
    p_ptr,  # [n, r]
    q_ptr,  # [p, r]
    n, p, r,  # A is [n, p], the factors have r columns
    R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    P_ALIGN: tl.constexpr,  # a power of two dividing p
):
    p = assume_multiple(p, P_ALIGN)  # rows start P_ALIGN-aligned: vector loads
    # One flat grid axis: the second axis is limited to 65535 programs on CUDA.
    pid = tl.program_id(0)
    col_tiles = (p + BLOCK_P - 1) // BLOCK_P
    rows = (pid // col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (pid % col_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    ranks = tl.arange(0, R)
    row_ok, col_ok, rank_ok = rows < n, cols < p, ranks < r
    pr = load_tile(p_ptr, rows.to(tl.int64), row_ok, ranks, rank_ok, r)
    q = load_tile(q_ptr, cols, col_ok, ranks, rank_ok, r)
    approx = tl.sum(pr[:, None, :] * q[None, :, :], axis=2)
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * p + cols[None, :]
    a = tl.load(error_ptr + offs, mask=mask, other=0.0)
    tl.store(error_ptr + offs, a - approx, mask=mask)


def gram_schmidt_(p: torch.Tensor, eps: float = GRAM_SCHMIDT_EPS) -> torch.Tensor:
    """Orthonormalise the columns of ``p`` in place, left to right (modified Gram-Schmidt).

    ``P_i /= (||P_i|| + eps)`` then ``P_{i+1:} -= P_i (P_i^T P_{i+1:})``, as in
    PowerSGD. A column that loses all but ``DEPENDENT_TOLERANCE`` of its original
    norm to the projections is linearly dependent on the previous ones up to
    rounding (e.g. ``r > min(n, p)``): it is set to zero rather than normalising
    the rounding noise into a spurious direction. No host synchronisation.
    """
    rank = p.shape[1]
    original = p.norm(dim=0)
    for i in range(rank):
        column = p[:, i : i + 1]
        norm = column.norm()
        keep = norm > DEPENDENT_TOLERANCE * original[i]
        column.mul_(torch.where(keep, 1.0 / (norm + eps), torch.zeros_like(norm)))
        if i + 1 < rank:
            rest = p[:, i + 1 :]
            rest.sub_(column * (column.T @ rest))
    return p


def residual_grid(n: int, cols: int, block_n: int, block_p: int) -> tuple[int]:
    """Launch grid of the residual kernel: every (row tile, column tile) on one axis."""
    return (cdiv(n, block_n) * cdiv(cols, block_p),)


def split_reduction(tiles: int, other_tiles: int) -> tuple[int, int]:
    """``(segments, tiles per segment)``: split ``tiles`` of a reduction so ``other_tiles * segments``
    programs come near ``TARGET_PROGRAMS`` (a function of the shape only)."""
    segments = max(1, min(tiles, cdiv(TARGET_PROGRAMS, max(other_tiles, 1))))
    per_segment = cdiv(tiles, segments)
    return cdiv(tiles, per_segment), per_segment


def _keep_warm_start(p: torch.Tensor, q_in: torch.Tensor, q_new: torch.Tensor) -> torch.Tensor:
    """``q_new`` with the warm start's column wherever ``p``'s column is zero (no host sync)."""
    alive = (p != 0).any(dim=0)
    return torch.where(alive, q_new, q_in)


def _passthrough(grad: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.zeros((grad.shape[0], rank), dtype=torch.float32, device=grad.device)
    p[:, 0] = grad
    q = torch.zeros((1, rank), dtype=torch.float32, device=grad.device)
    q[0, 0] = 1.0
    return p, q


def lowrank_ef_triton(
    grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the three kernels around a torch Gram-Schmidt. Arguments already validated."""
    rank = q.shape[1]
    if grad.dim() == 1:
        return _passthrough(grad, rank)
    n, cols = grad.shape
    out_p = torch.empty((n, rank), dtype=torch.float32, device=grad.device)
    out_q = torch.empty((cols, rank), dtype=torch.float32, device=grad.device)
    if n == 0 or cols == 0:
        out_p.zero_()
        return out_p, _keep_warm_start(out_p, q, out_q.zero_())
    meta = dict(R=max(2, next_power_of_2(rank)), BLOCK_N=min(TILE_ROWS, max(2, next_power_of_2(n))),
                BLOCK_P=min(TILE_COLS, max(2, next_power_of_2(cols))), P_ALIGN=alignment(cols))
    row_tiles, col_tiles = cdiv(n, meta["BLOCK_N"]), cdiv(cols, meta["BLOCK_P"])
    col_segments, col_tiles_per_segment = split_reduction(col_tiles, row_tiles)
    row_segments, row_tiles_per_segment = split_reduction(row_tiles, col_tiles)
    partial_p = torch.empty((col_segments, n, rank), dtype=torch.float32, device=grad.device)
    partial_q = torch.empty((row_segments, cols, rank), dtype=torch.float32, device=grad.device)
    with _device_guard(grad):
        _accumulate_project_kernel[(row_tiles, col_segments)](
            grad, error, q, partial_p, n, cols, rank, col_tiles_per_segment * meta["BLOCK_P"], **meta
        )
        torch.sum(partial_p, dim=0, out=out_p)
        gram_schmidt_(out_p)
        _back_project_kernel[(col_tiles, row_segments)](
            error, out_p, partial_q, n, cols, rank, row_tiles_per_segment * meta["BLOCK_N"], **meta
        )
        torch.sum(partial_q, dim=0, out=out_q)
        _residual_kernel[residual_grid(n, cols, meta["BLOCK_N"], meta["BLOCK_P"])](
            error, out_p, out_q, n, cols, rank, **meta
        )
    return out_p, _keep_warm_start(out_p, q, out_q)


def lowrank_ef_reference(
    grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch power iteration with error feedback; same contract as the kernels."""
    rank = q.shape[1]
    if grad.dim() == 1:
        return _passthrough(grad, rank)
    a = error.add_(grad.to(torch.float32))
    p = gram_schmidt_(a @ q)
    q_new = a.T @ p
    error.sub_(p @ q_new.T)
    return p, _keep_warm_start(p, q, q_new)
