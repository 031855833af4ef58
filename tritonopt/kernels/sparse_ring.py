"""Sparse ring buffer of blockwise Top-k rows: insertion, SP and LCG (EFCP, Modoranu et al. 2024, sec. 3.1).

The buffer holds ``m`` rows; each row is one :func:`tritonopt.ops.ef_topk` result
over a vector of ``num_blocks * block_size`` entries cut into ``num_blocks``
blocks, ``k`` entries kept per block.

Layout (block-major)::

    indices : [num_blocks, m, k]  int16 (block_size <= 32768) or int32, positions within the block
    values  : [num_blocks, m, k]  float32 or bfloat16

Row ``r`` of the buffer is the dense vector ``G[r]`` of length
``num_blocks * block_size`` with ``G[r][b * block_size + indices[b, r, j]] = values[b, r, j]``.
Block-major keeps everything one d-block needs (its ``m x k`` slice) contiguous,
so one program reads its slice once and a d-block of ``x`` (SP) or of the output
(LCG) stays on chip; inserting a row is a strided write of ``num_blocks`` chunks
of ``k`` entries, ``O(k)`` work per step. Rows never written are all zero
(index 0, value 0) and contribute nothing.

Contract: within one block of one row, the positions are distinct, except that
entries of value 0 may repeat (true of every ``ef_topk`` row, of all-zero rows
and of rows padded with zeros). An entry whose index lies outside
``[0, block_size)`` contributes nothing, on both backends: it never touches
memory outside its block.

Math::

    SP(x)[r]  = sum_{b, j} values[b, r, j] * x[b, indices[b, r, j]]        (= G @ x,  [m])
    LCG(w)[b, i] = sum_r w[r] * sum_{j : indices[b, r, j] = i} values[b, r, j]   (= w @ G)

GPU design.

* SP: one program per (d-block, tile of ``ROWS`` rows), the row tiles of one
  d-block adjacent on the grid so that they run together; each streams its
  rows' indices and values (coalesced), gathers ``x`` inside one d-block
  (L1/L2 resident) and writes one partial sum per row to
  ``partial[num_blocks, m]``, summed over blocks afterwards by ``torch.sum`` in
  a fixed order: no atomics, and the config is pinned per key, so the result
  is the same bits in every process. The partials add ``4 * num_blocks * m`` bytes, about 1 % of the
  buffer's traffic at the paper's sizes.
* LCG: one program per d-block. It zeroes its output block, then adds the rows
  in slot order, ``out[I[b, r, :]] += w[r] * V[b, r, :]`` as a load and a store,
  with a barrier between rows, the next row's indices and values loaded ahead.
  The indices of one row are distinct, so no two lanes of one row touch the
  same address, and the barrier orders the rows, as the paper's shared-memory
  kernel does; compiled without FMA contraction, each addition is the
  reference's: the result is the same bits as the CPU reference.
  The output block (at most a few tens of KB) stays in L1/L2, so HBM sees one
  write of ``4 * block_size`` bytes per block.
* LCG over few long blocks (a whole model as one block, as a global Top-k makes
  it): one program per block would leave the GPU idle, so when the caller
  promises that every row lists its positions in ascending order (as
  ``ef_topk`` writes them), each block is cut into slices of ``LCG_SLICE``
  positions, one program each. A first kernel finds, by a binary search of
  every row, where each slice's entries start; each slice's program then adds
  its part of every row in slot order, as above. Each output element sees the
  same additions in the same order: the same bits. A row never written (all its
  entries zeros at position 0) falls wholly into the first slice; with a finite
  weight it adds only zeros, so that slice skips it rather than wait on it.
* Values are upcast to float32 right after the load; everything accumulates in
  float32.
* Rows are ``k`` entries apart: the launchers pass the largest power of two
  dividing ``k`` (up to 16), so that e.g. rows of ``k = 164`` load in 16-byte
  vectors (Triton itself only knows whether ``k`` is a multiple of 16).
"""

from __future__ import annotations

import contextlib

import torch

from tritonopt._runtime import autotune, cdiv, jit, next_power_of_2, tl, triton
from tritonopt.kernels._alignment import alignment, assume_multiple

# Longest chunk of one row's k entries handled per loop iteration.
MAX_BLOCK_K = 1024
# Tile used to zero an output block in LCG.
ZERO_TILE = 1024
# Positions per program of the sliced LCG, and the shortest block it is used for.
LCG_SLICE = 16384
SLICED_LCG_MIN_BLOCK = 4 * LCG_SLICE
# Rows searched together by the slice-bounds kernel.
_BOUNDS_ROWS = 128


def _sp_configs():
    return [triton.Config({"ROWS": r}, num_warps=w) for r, w in ((8, 4), (4, 4), (16, 8), (2, 4))]


def _lcg_configs():
    return [triton.Config({}, num_warps=w) for w in (4, 8, 2)]


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@jit
def _load_entries(idx_ptr, val_ptr, offs, mask):
    """``(idx, val)``: the ring's indices and its values upcast to float32 at ``offs``, zero where masked."""
    idx = tl.load(idx_ptr + offs, mask=mask, other=0)
    return idx, tl.load(val_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@jit
def _entries_in_block(idx, mask, block_size):
    """The loaded entries whose index lies in the block (others are skipped, as the reference does)."""
    return mask & (idx >= 0) & (idx < block_size)


# The partial sum of a row covers its k entries in a [ROWS, BLOCK_K] tile whose
# reduction order depends on the config: pinned per key.
@autotune(_sp_configs, key=["m_bucket", "BLOCK_K"], pinned=True)  # writes every partial
@jit
def _sparse_sp_kernel(
    idx_ptr,  # [num_blocks, m, k] int16 / int32
    val_ptr,  # [num_blocks, m, k] fp32 / bf16
    x_ptr,  # [num_blocks, block_size] fp32
    partial_ptr,  # [num_blocks, m] fp32, output
    m, k, block_size,  # rows, entries per row, coordinates per block
    m_bucket,  # autotune key only
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ALIGN: tl.constexpr,  # a power of two dividing k
):
    k = assume_multiple(k, K_ALIGN)  # rows start K_ALIGN-aligned: vector loads of indices and values
    # Row tiles vary fastest over the flat grid: the programs running together
    # share one d-block, so its slice of x (4 * block_size bytes) stays in L1/L2.
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(m, ROWS)
    blk = (pid // row_tiles).to(tl.int64)
    rows = (pid % row_tiles) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < m
    cols = tl.arange(0, BLOCK_K)
    row_base = (blk * m + rows.to(tl.int64)) * k
    x_base = x_ptr + blk * block_size
    acc = tl.zeros([ROWS], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        c = k0 + cols
        mask = row_ok[:, None] & (c[None, :] < k)
        offs = row_base[:, None] + c[None, :]
        idx, val = _load_entries(idx_ptr, val_ptr, offs, mask)
        x = tl.load(x_base + idx, mask=_entries_in_block(idx, mask, block_size), other=0.0)
        acc += tl.sum(val * x, axis=1)
    tl.store(partial_ptr + blk * m + rows, acc, mask=row_ok)


# One writer per output element and a fixed row order: the same bits under every config.
@autotune(_lcg_configs, key=["m_bucket", "BLOCK_K"])  # rewrites the whole output
@jit
def _sparse_lcg_kernel(
    idx_ptr, val_ptr,  # the ring, as the SP kernel's
    w_ptr,  # [m] fp32
    out_ptr,  # [num_blocks, block_size] fp32, output (fully written)
    m, k, block_size,  # as the SP kernel's
    m_bucket,  # autotune key only
    BLOCK_K: tl.constexpr, ZERO: tl.constexpr,  # entries per chunk of a row, the tile that zeroes the output
    K_ALIGN: tl.constexpr,  # a power of two dividing k
):
    k = assume_multiple(k, K_ALIGN)  # rows start K_ALIGN-aligned: vector loads of indices and values
    blk = tl.program_id(0).to(tl.int64)
    out_base = out_ptr + blk * block_size
    lanes = tl.arange(0, ZERO)
    for z0 in range(0, block_size, ZERO):
        tl.store(out_base + z0 + lanes, tl.zeros([ZERO], dtype=tl.float32),
                 mask=z0 + lanes < block_size)
    cols = tl.arange(0, BLOCK_K)
    # Steps walk (row, chunk of BLOCK_K entries) in order; the loads of step
    # i + 1 are issued before step i's read-modify-write, so their latency
    # overlaps it (the barrier would otherwise expose it at every row).
    chunks = tl.cdiv(k, BLOCK_K)
    steps = m * chunks
    c = cols
    mask = c < k
    base = blk * m * k
    idx, val = _load_entries(idx_ptr + base, val_ptr + base, c, mask)
    w = tl.load(w_ptr)
    tl.debug_barrier()
    for step in range(0, steps):
        # The step after the last re-reads the last chunk (in bounds, never used).
        nxt = tl.minimum(step + 1, steps - 1)
        r_next = nxt // chunks
        c_next = (nxt % chunks) * BLOCK_K + cols
        mask_next = c_next < k
        offs_next = (blk * m + r_next) * k + c_next
        idx_next, val_next = _load_entries(idx_ptr, val_ptr, offs_next, mask_next)
        w_next = tl.load(w_ptr + r_next)
        in_block = _entries_in_block(idx, mask, block_size)
        current = tl.load(out_base + idx, mask=in_block, other=0.0)
        # Launched without FMA contraction: w * val is rounded before the add, as in the reference.
        tl.store(out_base + idx, current + w * val, mask=in_block)
        tl.debug_barrier()  # the next row may touch the same positions
        idx, val, w, mask = idx_next, val_next, w_next, mask_next


@jit
def _lcg_slice_bounds_kernel(
    idx_ptr,  # [num_blocks, m, k] int16 / int32, each row ascending within each block
    bounds_ptr,  # [num_blocks, num_slices + 1, m] int32, output: first entry of each row at or past the slice start
    m, k, block_size, num_slices,
    SLICE: tl.constexpr,  # positions per slice
    ROWS: tl.constexpr,  # rows searched together
    SEARCH_STEPS: tl.constexpr,  # bit length of k: enough halvings to pin the bound
):
    program = tl.program_id(0).to(tl.int64)
    blk = program // (num_slices + 1)
    edge = program % (num_slices + 1)
    target = tl.minimum(edge * SLICE, block_size).to(tl.int32)  # the last edge is the block's end
    lanes = tl.arange(0, ROWS)
    for r0 in range(0, m, ROWS):
        rows = r0 + lanes
        row_ok = rows < m
        row_base = (blk * m + rows.to(tl.int64)) * k
        lo = tl.zeros([ROWS], dtype=tl.int32)
        hi = tl.zeros([ROWS], dtype=tl.int32) + k
        for _ in tl.static_range(SEARCH_STEPS):  # lower bound of target in the row
            open_ = lo < hi
            mid = (lo + hi) // 2
            below = tl.load(idx_ptr + row_base + mid, mask=row_ok & open_, other=0).to(tl.int32) < target
            lo = tl.where(open_ & below, mid + 1, lo)
            hi = tl.where(open_ & ~below, mid, hi)
        tl.store(bounds_ptr + (blk * (num_slices + 1) + edge) * m + rows, lo, mask=row_ok)


# One writer per output element and a fixed row order: the same bits under every config.
@autotune(_lcg_configs, key=["m_bucket", "BLOCK_K"])  # rewrites its slice of the output
@jit
def _sliced_lcg_kernel(
    idx_ptr, val_ptr,  # the ring, each row ascending within each block
    w_ptr,  # [m] fp32
    bounds_ptr,  # the slice-bounds kernel's output
    out_ptr,  # [num_blocks, block_size] fp32, output (each program writes its slice)
    m, k, block_size, num_slices,
    m_bucket,  # autotune key only
    SLICE: tl.constexpr, BLOCK_K: tl.constexpr,  # positions per program, entries per step of a row
    ZERO: tl.constexpr,  # the tile that zeroes the slice
):
    program = tl.program_id(0).to(tl.int64)
    blk = program // num_slices
    piece = program % num_slices
    out_base = out_ptr + blk * block_size
    start = piece * SLICE
    lanes = tl.arange(0, ZERO)
    for z0 in range(0, SLICE, ZERO):
        tl.store(out_base + start + z0 + lanes, tl.zeros([ZERO], dtype=tl.float32),
                 mask=start + z0 + lanes < block_size)
    firsts = bounds_ptr + (blk * (num_slices + 1) + piece) * m  # row r's entries in the slice: [firsts[r], ends[r])
    ends = firsts + m
    cols = tl.arange(0, BLOCK_K)
    first, end, w = tl.load(firsts), tl.load(ends), tl.load(w_ptr)
    last = tl.load(idx_ptr + blk * m * k + k - 1)
    tl.debug_barrier()
    for r in range(0, m):
        # The next row's bounds, weight and last position are loaded ahead, so that their latency overlaps
        # this row.
        r_next = tl.minimum(r + 1, m - 1)
        first_next, end_next, w_next = tl.load(firsts + r_next), tl.load(ends + r_next), tl.load(w_ptr + r_next)
        last_next = tl.load(idx_ptr + (blk * m + r_next) * k + k - 1)
        row_base = (blk * m + r) * k
        # A row never written (k >= 2 entries, all at position 0: zeros, by the ascending promise) would put
        # all its k entries in the first slice; with a finite weight it adds +-0 there, which changes nothing.
        if (k > 1) & (last == 0) & (w * 0.0 == 0.0):
            end = first
        for c0 in range(first, end, BLOCK_K):
            c = c0 + cols
            mask = c < end
            idx, val = _load_entries(idx_ptr + row_base, val_ptr + row_base, c, mask)
            current = tl.load(out_base + idx, mask=mask, other=0.0)
            # Launched without FMA contraction: w * val is rounded before the add, as in the reference.
            tl.store(out_base + idx, current + w * val, mask=mask)
        tl.debug_barrier()  # the next row may touch the same positions
        first, end, w, last = first_next, end_next, w_next, last_next


# No restore_value: the insert is idempotent (a rerun writes the same row), and
# restoring would clone the whole ring buffer on every tuning run.
@autotune(_lcg_configs, key=["BLOCK_K"])
@jit
def _ring_insert_kernel(
    idx_ptr,  # [num_blocks, m, k] int16 / int32, updated in place
    val_ptr,  # [num_blocks, m, k] fp32 / bf16, updated in place
    new_idx_ptr,  # [num_blocks, k] int32
    new_val_ptr,  # [num_blocks, k] fp32
    slot,
    m,
    k,
    BLOCK_K: tl.constexpr,
    K_ALIGN: tl.constexpr,  # a power of two dividing k
):
    k = assume_multiple(k, K_ALIGN)  # rows start K_ALIGN-aligned: vector loads and stores
    blk = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    dst = (blk * m + slot) * k
    src = blk * k
    for k0 in range(0, k, BLOCK_K):
        c = k0 + cols
        mask = c < k
        idx = tl.load(new_idx_ptr + src + c, mask=mask, other=0)
        val = tl.load(new_val_ptr + src + c, mask=mask, other=0.0)
        tl.store(idx_ptr + dst + c, idx.to(idx_ptr.dtype.element_ty), mask=mask)
        tl.store(val_ptr + dst + c, val.to(val_ptr.dtype.element_ty), mask=mask)


def _block_k(k: int) -> int:
    return min(MAX_BLOCK_K, max(16, next_power_of_2(k)))


# --------------------------------------------------------------------------- launchers


def sparse_sp_triton(indices: torch.Tensor, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Launch SP. Arguments must already be validated (see ``tritonopt.ops``)."""
    num_blocks, m, k = indices.shape
    block_size = x.shape[1]
    partial = torch.zeros((num_blocks, m), dtype=torch.float32, device=x.device)
    if num_blocks == 0 or m == 0 or k == 0:
        return partial.sum(dim=0)
    block_k = _block_k(k)

    def grid(meta):
        return (num_blocks * cdiv(m, meta["ROWS"]),)

    with _device_guard(x):
        _sparse_sp_kernel[grid](
            indices, values, x, partial, m, k, block_size, next_power_of_2(m), BLOCK_K=block_k,
            K_ALIGN=alignment(k),
        )
    return partial.sum(dim=0)


def sparse_lcg_triton(
    indices: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, block_size: int, ascending: bool = False,
    *, slice_size: int = LCG_SLICE, sliced_from: int = SLICED_LCG_MIN_BLOCK,
) -> torch.Tensor:
    """Launch LCG. Arguments must already be validated; ``weights`` is float32.

    Blocks of at least ``sliced_from`` positions whose rows are ``ascending`` are cut
    into slices of ``slice_size`` positions (a power of two), one program each.
    """
    num_blocks, m, k = indices.shape
    out = torch.empty((num_blocks, block_size), dtype=torch.float32, device=values.device)
    if num_blocks == 0 or block_size == 0:
        return out
    if m == 0 or k == 0:
        return out.zero_()
    with _device_guard(values):
        if ascending and block_size >= sliced_from:
            num_slices = cdiv(block_size, slice_size)
            bounds = torch.empty((num_blocks, num_slices + 1, m), dtype=torch.int32, device=values.device)
            _lcg_slice_bounds_kernel[(num_blocks * (num_slices + 1),)](
                indices, bounds, m, k, block_size, num_slices, SLICE=slice_size, ROWS=_BOUNDS_ROWS,
                SEARCH_STEPS=k.bit_length(),
            )
            _sliced_lcg_kernel[(num_blocks * num_slices,)](
                indices, values, weights, bounds, out, m, k, block_size, num_slices, next_power_of_2(m),
                SLICE=slice_size, BLOCK_K=_block_k(min(k, slice_size)), ZERO=min(ZERO_TILE, slice_size),
                enable_fp_fusion=False,
            )
        else:
            _sparse_lcg_kernel[(num_blocks,)](
                indices, values, weights, out, m, k, block_size, next_power_of_2(m),
                BLOCK_K=_block_k(k), ZERO=min(ZERO_TILE, next_power_of_2(block_size)), K_ALIGN=alignment(k),
                enable_fp_fusion=False,
            )
    return out


def sparse_ring_insert_triton(
    indices: torch.Tensor, values: torch.Tensor, slot: int, new_indices: torch.Tensor, new_values: torch.Tensor
) -> None:
    """Write row ``slot``. Arguments must already be validated."""
    num_blocks, m, k = indices.shape
    if num_blocks == 0 or k == 0:
        return
    with _device_guard(values):
        _ring_insert_kernel[(num_blocks,)](
            indices, values, new_indices, new_values, slot, m, k, BLOCK_K=_block_k(k), K_ALIGN=alignment(k)
        )


# --------------------------------------------------------------------------- references


def _absolute_indices(indices: torch.Tensor, block_size: int) -> torch.Tensor:
    num_blocks = indices.shape[0]
    starts = torch.arange(num_blocks, device=indices.device, dtype=torch.int64) * block_size
    return indices.long() + starts.view(num_blocks, 1, 1)


def _in_block(indices: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices with those outside ``[0, block_size)`` moved to 0, and which ones are inside."""
    inside = (indices >= 0) & (indices < block_size)
    return torch.where(inside, indices, torch.zeros_like(indices)), inside


def sparse_sp_reference(indices: torch.Tensor, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch SP: ``gather`` then a sum over blocks and entries, in x's dtype (>= float32)."""
    num_blocks, m, k = indices.shape
    dtype = torch.promote_types(x.dtype, torch.float32)
    flat_x = x.reshape(-1).to(dtype)
    safe, inside = _in_block(indices, x.shape[1])
    gathered = flat_x[_absolute_indices(safe, x.shape[1])]
    return (values.to(dtype) * inside * gathered).sum(dim=(0, 2)) if num_blocks else flat_x.new_zeros(m)


def sparse_lcg_reference(
    indices: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, block_size: int, ascending: bool = False
) -> torch.Tensor:
    """Plain-PyTorch LCG: ``index_add_`` of ``w[r] * V[b, r, :]`` into the dense blocks (in any row order,
    so ``ascending`` changes nothing here).

    On the CPU the entries are added in (block, row, entry) order, the kernel's
    order; on CUDA ``index_add_`` uses atomics and is not bitwise reproducible.
    """
    num_blocks = indices.shape[0]
    dtype = torch.promote_types(weights.dtype, torch.float32)
    out = torch.zeros(num_blocks * block_size, dtype=dtype, device=values.device)
    safe, inside = _in_block(indices, block_size)
    contributions = weights.to(dtype).view(1, -1, 1) * values.to(dtype) * inside
    out.index_add_(0, _absolute_indices(safe, block_size).reshape(-1), contributions.reshape(-1))
    return out.view(num_blocks, block_size)


def sparse_ring_insert_reference(
    indices: torch.Tensor, values: torch.Tensor, slot: int, new_indices: torch.Tensor, new_values: torch.Tensor
) -> None:
    """Plain-PyTorch insert of row ``slot``; same contract as the kernel."""
    indices[:, slot].copy_(new_indices)
    values[:, slot].copy_(new_values)


def densify_ring(indices: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The dense ``[m, num_blocks * block_size]`` matrix ``G`` the buffer stands for (float32 or wider)."""
    num_blocks, m, k = indices.shape
    dtype = torch.promote_types(values.dtype, torch.float32)
    dense = torch.zeros((m, num_blocks, block_size), dtype=dtype, device=values.device)
    dense.scatter_add_(2, indices.long().permute(1, 0, 2), values.to(dtype).permute(1, 0, 2))
    return dense.reshape(m, num_blocks * block_size)
