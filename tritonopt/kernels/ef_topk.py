"""Blockwise Top-k with error feedback (EFCP, Modoranu et al. 2024, sec. 3.1 and Alg. 1).

Math, per row ``b`` of ``[num_blocks, block_size]``::

    a      = error[b] + grad[b]                    (fp32)
    S      = the k positions of largest |a|, ties to the lower position
    idx[b] = S in ascending order                  (int32, block-relative)
    val[b] = a[idx[b]]                             (fp32)
    error[b] = a with a[S] = 0                     (in place)

so that ``densify(idx, val) + error_new == error_old + grad`` exactly.

Ordering key. ``|a|`` is ranked through the bit pattern of ``abs(a)`` read as an
int32, which is monotone in the magnitude for non-negative floats (``-0.0`` and
``+0.0`` share the key 0). NaN (any sign or payload) gets the key just above
``+inf``: non-finite entries rank above every finite one (NaN first, then
``±inf``, by position among equals). They therefore leave the error buffer as
early as the budget ``k`` allows and appear in ``val``.

GPU design. Rows up to ``MAX_RESIDENT`` entries: one program owns one row. The
k-th largest key ``tau`` is found by bisection on the integer key range (about
30 counting passes over the keys held in registers); then every entry with
key > tau is selected, plus the first ``k - count(key > tau)`` entries equal to
tau in index order (a prefix sum), and an exclusive prefix sum over the
selection mask gives each selected entry its output slot, which keeps ``idx``
ascending. Up to ``MAX_TILE`` the whole row (values and keys) stays in
registers (the row kernel); up to ``MAX_RESIDENT`` (SparseMFAC's default
16384) only the keys do: the first pass writes ``a`` into ``error`` and a
final pass re-reads it tile by tile to select (the resident kernel).

Longer rows, up to a whole model's gradient as one block, are split over many
programs, ``SPLIT_CHUNK`` entries each, so that one row is not left to one
streaming multiprocessor. ``tau`` is found by a radix select on the key bits,
``RADIX_BITS`` at a time from the top: each of ``RADIX_PASSES`` passes adds
every program's histogram of the next digit, among the entries whose higher
digits match the prefix chosen so far, into one histogram per row (integer
atomics), and the next launch reads off the digit holding the k-th largest
key. A count pass then records each chunk's entries above and at ``tau``, and
the selection pass starts each chunk's prefix sums from the counts of the
chunks before it. That is five reads of the row whatever its length, and the
same bits as the single-program kernels. ``tl.topk``/``tl.sort`` are avoided:
they are slow on large blocks and need power-of-two ``k``.
"""

from __future__ import annotations

import contextlib

import torch

from tritonopt._runtime import autotune, cdiv, jit, next_power_of_2, tl, triton
from tritonopt.kernels._alignment import alignment, assume_multiple

# Largest row kept whole in registers (values and keys) by the row kernel.
MAX_TILE = 8192
# Largest row whose keys stay in registers through the bisection (the resident
# kernel); its values are re-read once, tile by tile, for the selection.
MAX_RESIDENT = 16384
# Tile of the resident kernel's final pass and of the split kernels: small,
# so that the scans of the final pass add few registers to what is live.
PASS_TILE = 2048
# Entries of a row each program of the split path reads (a multiple of PASS_TILE).
SPLIT_CHUNK = 32768
# Smallest tile of the split path: one entry or more per thread at 8 warps. On an H100 the
# histograms of 8-entry tiles (smaller than a warp: entries replicated over lanes) miscounted,
# likely each entry once per lane holding it; tiles of 32 to 2048 entries counted right.
SPLIT_MIN_TILE = 256
# The split path's radix select: 3 digits of 11 bits cover the 31 bits of a key.
RADIX_BITS = 11
RADIX_BINS = 1 << RADIX_BITS
RADIX_PASSES = 3
_TOP_DIGIT_SHIFT = RADIX_BITS * (RADIX_PASSES - 1)
# Earlier chunks' counts summed per step by a program of the selection pass.
_COUNTS_TILE = 1024
# int32 bit pattern of +inf; NaN is ranked one above it.
_INF_KEY = 0x7F800000
_NAN_KEY = _INF_KEY + 1
# Register tensors wider than this many 32-bit elements per thread (per live
# row-sized tensor) spill on sm_90: the row kernel keeps about four of them
# live (a, key, and the scans), the resident kernel one (key) in its loop.
_ROW_ELEMENTS_PER_THREAD = 32
_RESIDENT_KEYS_PER_THREAD = 64


def _ef_topk_configs():
    return [triton.Config({}, num_warps=w) for w in (8, 4, 16)]


def _resident_configs():
    return [triton.Config({}, num_warps=w) for w in (16, 8)]


def _split_configs():
    # 16 warps leave a PASS_TILE of 4 elements per thread and spill on sm_90.
    return [triton.Config({}, num_warps=w) for w in (8, 4)]


def _split_tile_fits(configs, key_args):
    """Prune: a split-path tile spans every thread at most ``_ROW_ELEMENTS_PER_THREAD`` times and
    at least once (no entry replicated over threads, which tl.histogram would count twice)."""
    return [c for c in configs if 32 * c.num_warps <= key_args["TILE"] <= _ROW_ELEMENTS_PER_THREAD * 32 * c.num_warps]


def _fits_per_thread(block_name: str, limit: int):
    """Prune: keep the configs whose threads hold at most ``limit`` elements of a ``block_name`` row."""

    def prune(configs, key_args):
        return [c for c in configs if key_args[block_name] <= limit * 32 * c.num_warps]

    return prune


@jit
def _magnitude_key(a):
    key = tl.abs(a).to(tl.int32, bitcast=True)
    return tl.where(a != a, 0x7F800001, key)


@jit
def _kth_largest_key(key, k):
    """``(tau, count(key > tau))`` with ``tau`` the k-th largest of ``key`` (entries < 0 are padding).

    Bisection on the integer key range under the invariant
    ``count(key >= lo) >= k > count(key >= hi) = n_above_hi``; integer counts
    make the result independent of the reduction order.
    """
    hi = tl.max(key, axis=0) + 1
    lo = hi * 0
    n_above_hi = hi * 0
    while lo + 1 < hi:
        mid = lo + (hi - lo) // 2
        count = tl.sum((key >= mid).to(tl.int32), axis=0)
        lo, n_above_hi, hi = _bisect(lo, n_above_hi, hi, mid, count, k)
    return lo, n_above_hi


@jit
def _bisect(lo, n_above_hi, hi, mid, count, k):
    """``(lo, n_above_hi, hi)`` after one bisection step at ``mid``, ``count = count(key >= mid)``."""
    enough = count >= k
    return tl.where(enough, mid, lo), tl.where(enough, n_above_hi, count), tl.where(enough, hi, mid)


@jit
def _accumulator(grad_ptr, error_ptr, base, offs, in_row):
    """``a = error + grad`` in float32 at ``offs`` of the row that starts at ``base``."""
    g = tl.load(grad_ptr + base + offs, mask=in_row, other=0.0).to(tl.float32)
    e = tl.load(error_ptr + base + offs, mask=in_row, other=0.0)
    return e + g


@jit
def _stored_tile(error_ptr, base, start, lanes, block_size):
    """``(offs, in_row, a, key)``: the tile of ``a`` (held in ``error``) at ``start + lanes`` of the row
    that starts at ``base``, its mask and its ranking keys (-1 outside the row)."""
    offs = start + lanes
    in_row = offs < block_size
    a = tl.load(error_ptr + base + offs, mask=in_row, other=0.0)
    return offs, in_row, a, tl.where(in_row, _magnitude_key(a), -1)


@jit
def _write_selected(error_ptr, idx_ptr, val_ptr, row, base, k, offs, in_row, a, selected, slot):
    """Writes the ``selected`` entries of ``a`` at their output ``slot`` and clears them from the error."""
    out = row * k + slot
    tl.store(idx_ptr + out, offs, mask=selected)
    tl.store(val_ptr + out, a, mask=selected)
    tl.store(error_ptr + base + offs, tl.where(selected, 0.0, a), mask=in_row)


@jit
def _select_tiles(error_ptr, idx_ptr, val_ptr, row, base, block_size, k, tau, ties_wanted,
                  start, ties_before, selected_before, TILE: tl.constexpr, NUM_TILES: tl.constexpr):
    """Final pass over ``NUM_TILES`` tiles of ``a`` (held in ``error``) from position ``start``:
    select, compact, clear the selected entries.

    Entries with key > tau are selected, plus the first ``ties_wanted`` equal to
    tau in index order; the prefix sums start from the row's ``ties_before``
    entries at tau and ``selected_before`` selected ones ahead of ``start``, and
    carry across the tiles.
    """
    lanes = tl.arange(0, TILE)
    for t in range(NUM_TILES):
        offs, in_row, a, key = _stored_tile(error_ptr, base, start + t * TILE, lanes, block_size)
        at_tau = key == tau
        rank_at_tau = ties_before + tl.cumsum(at_tau.to(tl.int32), axis=0)
        selected = (key > tau) | (at_tau & (rank_at_tau <= ties_wanted))
        slot = selected_before + tl.cumsum(selected.to(tl.int32), axis=0) - 1
        _write_selected(error_ptr, idx_ptr, val_ptr, row, base, k, offs, in_row, a, selected, slot)
        ties_before += tl.sum(at_tau.to(tl.int32), axis=0)
        selected_before += tl.sum(selected.to(tl.int32), axis=0)


@autotune(_ef_topk_configs, key=["BLOCK", "rows_bucket"], restore_value=["error_ptr"],
          prune=_fits_per_thread("BLOCK", _ROW_ELEMENTS_PER_THREAD))
@jit
def _ef_topk_row_kernel(
    grad_ptr,  # [num_blocks, block_size] fp32/fp16/bf16, contiguous
    error_ptr,  # [num_blocks, block_size] fp32, updated in place
    idx_ptr,  # [num_blocks, k] int32, output
    val_ptr,  # [num_blocks, k] fp32, output
    block_size,  # row length
    k,  # entries kept per row, 1 <= k <= block_size
    rows_bucket,  # next power of two of num_blocks: autotune key only
    BLOCK: tl.constexpr,  # next power of two >= block_size
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    in_row = offs < block_size
    base = row * block_size
    a = _accumulator(grad_ptr, error_ptr, base, offs, in_row)
    key = tl.where(in_row, _magnitude_key(a), -1)
    tau, n_above_tau = _kth_largest_key(key, k)

    at_tau = key == tau
    rank_at_tau = tl.cumsum(at_tau.to(tl.int32), axis=0)
    selected = (key > tau) | (at_tau & (rank_at_tau <= k - n_above_tau))
    slot = tl.cumsum(selected.to(tl.int32), axis=0) - 1
    _write_selected(error_ptr, idx_ptr, val_ptr, row, base, k, offs, in_row, a, selected, slot)


@autotune(_resident_configs, key=["BLOCK", "TILE", "rows_bucket"], restore_value=["error_ptr"],
          prune=_fits_per_thread("BLOCK", _RESIDENT_KEYS_PER_THREAD))
@jit
def _ef_topk_resident_kernel(
    grad_ptr, error_ptr, idx_ptr, val_ptr,  # as the row kernel's; error holds `a` mid-kernel
    block_size, k, rows_bucket,  # as the row kernel's
    BLOCK: tl.constexpr,  # next power of two >= block_size: the register-resident keys
    TILE: tl.constexpr,  # elements per tile of the final pass (power of two)
    NUM_TILES: tl.constexpr,  # cdiv(block_size, TILE)
):
    # Reads the row twice: once to form `a` (kept as keys only), once to select.
    row = tl.program_id(0).to(tl.int64)
    base = row * block_size
    offs = tl.arange(0, BLOCK)
    in_row = offs < block_size
    a = _accumulator(grad_ptr, error_ptr, base, offs, in_row)
    tl.store(error_ptr + base + offs, a, mask=in_row)
    key = tl.where(in_row, _magnitude_key(a), -1)
    tau, n_above_tau = _kth_largest_key(key, k)
    tl.debug_barrier()  # make `a` visible to every thread of the program
    _select_tiles(error_ptr, idx_ptr, val_ptr, row, base, block_size, k, tau, k - n_above_tau,
                  0, tau * 0, tau * 0, TILE, NUM_TILES)


@jit
def _radix_threshold(hist_ptr, row, num_blocks, k, PASSES: tl.constexpr, BINS: tl.constexpr,
                     BITS: tl.constexpr, TOP_SHIFT: tl.constexpr):
    """``(prefix, wanted)`` after the first ``PASSES`` digits of the radix select of ``row``.

    ``prefix`` holds the digits found so far (the k-th largest key's, lower bits 0);
    ``wanted`` is how many of the k still come from the keys that share them:
    ``k - count(keys above every key with that prefix)``. After every digit, ``prefix``
    is ``tau`` and ``wanted`` the number of entries at ``tau`` to select.
    """
    prefix = tl.program_id(0) * 0  # an int32 scalar, whatever Triton made of k
    wanted = prefix + k
    descending = BINS - 1 - tl.arange(0, BINS)
    for p in tl.static_range(PASSES):
        counts = tl.load(hist_ptr + (p * num_blocks + row) * BINS + descending)
        at_or_above = tl.cumsum(counts, axis=0)  # entries whose digit is >= BINS - 1 - i
        short = at_or_above < wanted
        digit = BINS - 1 - tl.sum(short.to(tl.int32), axis=0)
        wanted -= tl.sum(tl.where(short, counts, 0), axis=0)
        prefix += digit << (TOP_SHIFT - p * BITS)
    return prefix, wanted


@jit
def _split_position(num_chunks):
    """``(row, chunk)`` of this program of the split path (one flat grid: rows may outnumber 65535)."""
    program = tl.program_id(0).to(tl.int64)
    return program // num_chunks, program % num_chunks


@autotune(_split_configs, key=["TILE", "CHUNK_TILES", "PASS", "programs_bucket"],
          restore_value=["error_ptr", "hist_ptr"], prune=_split_tile_fits)
@jit
def _split_histogram_kernel(
    grad_ptr, error_ptr,  # as the row kernel's; pass 0 writes `a` into error
    hist_ptr,  # [RADIX_PASSES, num_blocks, BINS] int32, zeroed before pass 0; pass PASS adds its digit's counts
    num_blocks, block_size, k, num_chunks,  # rows, row length, entries kept per row, programs per row
    programs_bucket,  # next power of two of num_blocks * num_chunks: autotune key only
    PASS: tl.constexpr,  # which digit, 0 the most significant
    TILE: tl.constexpr, CHUNK_TILES: tl.constexpr,  # a program reads CHUNK_TILES tiles of TILE entries
    BINS: tl.constexpr, BITS: tl.constexpr, TOP_SHIFT: tl.constexpr,  # the radix: BINS = 2^BITS
    ROW_ALIGN: tl.constexpr,  # a power of two dividing block_size: rows start aligned, loads are vectors
):
    block_size = assume_multiple(block_size, ROW_ALIGN)
    row, chunk = _split_position(num_chunks)
    base = row * block_size
    prefix, _ = _radix_threshold(hist_ptr, row, num_blocks, k, PASS, BINS, BITS, TOP_SHIFT)
    shift = TOP_SHIFT - PASS * BITS
    lanes = tl.arange(0, TILE)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for t in range(CHUNK_TILES):
        offs = (chunk * CHUNK_TILES + t) * TILE + lanes
        in_row = offs < block_size
        if PASS == 0:
            a = _accumulator(grad_ptr, error_ptr, base, offs, in_row)
            tl.store(error_ptr + base + offs, a, mask=in_row)
            counted = in_row
        else:
            a = tl.load(error_ptr + base + offs, mask=in_row, other=0.0)
            counted = in_row & ((_magnitude_key(a) >> (shift + BITS)) == (prefix >> (shift + BITS)))
        counts += tl.histogram((_magnitude_key(a) >> shift) & (BINS - 1), BINS, mask=counted)
    bins = tl.arange(0, BINS)
    tl.atomic_add(hist_ptr + (PASS * num_blocks + row) * BINS + bins, counts, mask=counts > 0, sem="relaxed")


@autotune(_split_configs, key=["TILE", "CHUNK_TILES", "programs_bucket"],
          prune=_split_tile_fits)
@jit
def _split_count_kernel(
    error_ptr, hist_ptr,  # `a` and the finished histograms
    counts_ptr,  # [2, num_blocks * num_chunks] int32, output: each chunk's entries above tau, then at tau
    num_blocks, block_size, k, num_chunks, programs_bucket,  # as the histogram kernel's
    TILE: tl.constexpr, CHUNK_TILES: tl.constexpr, BINS: tl.constexpr, BITS: tl.constexpr,
    TOP_SHIFT: tl.constexpr, PASSES: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    block_size = assume_multiple(block_size, ROW_ALIGN)
    row, chunk = _split_position(num_chunks)
    base = row * block_size
    tau, ties_wanted = _radix_threshold(hist_ptr, row, num_blocks, k, PASSES, BINS, BITS, TOP_SHIFT)
    lanes = tl.arange(0, TILE)
    above = tau * 0
    at_tau = tau * 0
    for t in range(CHUNK_TILES):
        offs, in_row, a, key = _stored_tile(error_ptr, base, (chunk * CHUNK_TILES + t) * TILE, lanes, block_size)
        above += tl.sum((key > tau).to(tl.int32), axis=0)
        at_tau += tl.sum((key == tau).to(tl.int32), axis=0)
    program = row * num_chunks + chunk
    tl.store(counts_ptr + program, above)
    tl.store(counts_ptr + num_blocks * num_chunks + program, at_tau)


@autotune(_split_configs, key=["TILE", "CHUNK_TILES", "programs_bucket"], restore_value=["error_ptr"],
          prune=_split_tile_fits)
@jit
def _split_select_kernel(
    error_ptr, idx_ptr, val_ptr,  # as the row kernel's; error holds `a`
    hist_ptr, counts_ptr,  # the finished histograms and the count pass's counts
    num_blocks, block_size, k, num_chunks, programs_bucket,  # as the histogram kernel's
    TILE: tl.constexpr, CHUNK_TILES: tl.constexpr, BINS: tl.constexpr, BITS: tl.constexpr,
    TOP_SHIFT: tl.constexpr, PASSES: tl.constexpr, ROW_ALIGN: tl.constexpr,
    COUNTS_TILE: tl.constexpr,  # earlier chunks' counts summed per step
):
    block_size = assume_multiple(block_size, ROW_ALIGN)
    row, chunk = _split_position(num_chunks)
    tau, ties_wanted = _radix_threshold(hist_ptr, row, num_blocks, k, PASSES, BINS, BITS, TOP_SHIFT)
    # The row's entries above and at tau ahead of this chunk.
    above_before = tau * 0
    ties_before = tau * 0
    first = row * num_chunks
    lanes = tl.arange(0, COUNTS_TILE)
    for earlier in range(0, chunk, COUNTS_TILE):
        ahead = earlier + lanes < chunk
        above_before += tl.sum(tl.load(counts_ptr + first + earlier + lanes, mask=ahead, other=0), axis=0)
        ties_before += tl.sum(tl.load(counts_ptr + num_blocks * num_chunks + first + earlier + lanes,
                                      mask=ahead, other=0), axis=0)
    selected_before = above_before + tl.minimum(ties_before, ties_wanted)
    _select_tiles(error_ptr, idx_ptr, val_ptr, row, row * block_size, block_size, k, tau, ties_wanted,
                  chunk * (CHUNK_TILES * TILE), ties_before, selected_before, TILE, CHUNK_TILES)


def ef_topk_triton(
    grad: torch.Tensor, error: torch.Tensor, k: int, *, max_tile: int = MAX_TILE,
    max_resident: int = MAX_RESIDENT, split_chunk: int = SPLIT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Triton kernels. Arguments must already be validated (see ``tritonopt.ops``).

    ``max_tile`` (a power of two) is the longest row kept whole in registers
    (the row kernel) and caps the tile of the others (the split path's at no less
    than ``SPLIT_MIN_TILE``); rows up to ``max_resident`` keep their keys in
    registers (read twice); longer rows are split over programs of
    ``split_chunk`` entries (rounded to whole tiles).
    """
    num_blocks, block_size = grad.shape
    indices = torch.empty((num_blocks, k), dtype=torch.int32, device=grad.device)
    values = torch.empty((num_blocks, k), dtype=torch.float32, device=grad.device)
    if num_blocks == 0:
        return indices, values
    rows_bucket = next_power_of_2(num_blocks)
    args = (grad, error, indices, values, block_size, k, rows_bucket)
    with torch.cuda.device(grad.device) if grad.is_cuda else contextlib.nullcontext():
        if block_size <= max_tile:
            _ef_topk_row_kernel[(num_blocks,)](*args, BLOCK=next_power_of_2(block_size))
        elif block_size <= max_resident:
            tile = min(max_tile, PASS_TILE)
            _ef_topk_resident_kernel[(num_blocks,)](
                *args, BLOCK=next_power_of_2(block_size), TILE=tile, NUM_TILES=cdiv(block_size, tile),
            )
        else:
            _split_rows(grad, error, indices, values, k, tile=max(SPLIT_MIN_TILE, min(max_tile, PASS_TILE)),
                        chunk=split_chunk)
    return indices, values


def _split_rows(grad, error, indices, values, k, *, tile: int, chunk: int) -> None:
    """The split path: each row over ``cdiv(block_size, chunk)`` programs (see the module's notes)."""
    num_blocks, block_size = grad.shape
    chunk_tiles = max(1, chunk // tile)
    num_chunks = cdiv(block_size, chunk_tiles * tile)
    programs = num_blocks * num_chunks
    histograms = torch.zeros((RADIX_PASSES, num_blocks, RADIX_BINS), dtype=torch.int32, device=grad.device)
    counts = torch.empty((2, programs), dtype=torch.int32, device=grad.device)
    shape = (num_blocks, block_size, k, num_chunks, next_power_of_2(programs))
    radix = dict(TILE=tile, CHUNK_TILES=chunk_tiles, BINS=RADIX_BINS, BITS=RADIX_BITS, TOP_SHIFT=_TOP_DIGIT_SHIFT,
                 ROW_ALIGN=alignment(block_size))
    for digit in range(RADIX_PASSES):
        _split_histogram_kernel[(programs,)](grad, error, histograms, *shape, PASS=digit, **radix)
    _split_count_kernel[(programs,)](error, histograms, counts, *shape, PASSES=RADIX_PASSES, **radix)
    _split_select_kernel[(programs,)](error, indices, values, histograms, counts, *shape, PASSES=RADIX_PASSES,
                                      COUNTS_TILE=_COUNTS_TILE, **radix)


def magnitude_key(a: torch.Tensor) -> torch.Tensor:
    """The int32 ranking key of ``|a|`` used by both paths (NaN above ``inf``)."""
    key = a.abs().view(torch.int32)
    return torch.where(torch.isnan(a), torch.full_like(key, _NAN_KEY), key)


def ef_topk_reference(
    grad: torch.Tensor, error: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch blockwise Top-k with error feedback; same contract as the kernel."""
    a = error + grad.to(torch.float32)
    block_size = a.shape[1]
    position = torch.arange(block_size, device=a.device, dtype=torch.int64)
    # Larger key first, then lower position: one int64 sort key makes the order total.
    order = (magnitude_key(a).to(torch.int64) << 32) - position
    top = torch.topk(order, k, dim=1, sorted=False).indices
    indices = top.sort(dim=1).values
    values = a.gather(1, indices)
    error.copy_(a.scatter(1, indices, 0.0))
    return indices.to(torch.int32), values
