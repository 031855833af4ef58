"""Where a windowed preconditioner keeps its last ``m`` gradients: dense rows, a sparse ring, low-rank factors.

A window holds ``G`` (``[m, d]``) and its Gram matrix ``dots = G G^T`` (float64),
in the state of the group's first parameter, with ``ring_slot`` (the next row
to overwrite) and ``ring_filled``. Each step it

1. stores the step's vector ``x`` in row ``slot`` (``insert``) and returns the
   products ``s = G x``;
2. after the preconditioner has turned ``dots`` and ``s`` into the weights
   ``z`` of ``u = x / scale + z @ G``, forms ``u = w @ G`` with ``w = z + e_slot /
   scale`` (``combine``): ``x`` is row ``slot`` of ``G``, so folding its term into
   the float64 weights avoids the cancellation of two float32 vectors of size
   ``1 / scale`` (a relative error of 1e-2 at ``damp = 1e-6`` otherwise).

The arithmetic is in :mod:`tritonopt.optim.functional`, as functions of the
window's tensors (``dense_window_products``, ``sparse_window_compress``,
``lowrank_window_combine``, ...); a window class here says which state entries
hold those tensors, with what shapes, and names each phase's NVTX range.

``state_layout`` gives every entry a window keeps, with shapes and dtypes: the
group's (in the first parameter's state) and each parameter's own. Checkpoints
are checked against it and the memory a window will need is computed from it.
For sharded parameters it is given the local tensors and the padded ``span``
of every rank's part (the layout's ``span``); ``insert`` returns this rank's
part of ``s``, with a replicated parameter's coordinates weighted by the
packed group's ``column_weights``, and the optimizer sums the ranks' parts.

=================  ==========================================  ==================
window             ``x``                                       ``w @ G``
=================  ==========================================  ==================
``DenseWindow``    the packed gradient                         a GEMV
``SparseWindow``   error feedback + blockwise Top-k of it      ``sparse_lcg``
                   (EFCP Alg. 1), stored as ``ef_topk`` rows
``LowRankWindow``  per tensor, ``lowrank_ef``'s ``P Q^T``       one GEMM per tensor
                   (EFCP App. I)
=================  ==========================================  ==================
"""

from __future__ import annotations

from typing import Sequence

import torch

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_bool, check_int
from tritonopt.ops import DEPENDENT_TOLERANCE, GRAM_SCHMIDT_EPS, sparse_ring_insert
from tritonopt.optim._blocks import BlockLayout, kept_per_block
from tritonopt.optim._packed import PackedGroup
from tritonopt.optim._sharding import is_row_sharded
from tritonopt.optim._window_algebra import unfolded_shape
from tritonopt.optim.functional import (
    dense_window_combine,
    dense_window_products,
    lowrank_window_combine,
    lowrank_window_compress,
    lowrank_window_products,
    sparse_window_combine,
    sparse_window_compress,
    sparse_window_products,
)

VALUE_DTYPES = (torch.float32, torch.bfloat16)


def _no_entries(p: torch.Tensor) -> dict:
    return {}


def _gram_state(m: int, device: torch.device) -> dict:
    return {"dots": torch.zeros((m, m), dtype=torch.float64, device=device), "ring_slot": 0, "ring_filled": 0}


class DenseWindow:
    """``m`` full gradients as the rows of ``ring_grads`` (``[m, d]``, float32; float64 for float64 models).

    A checkpoint shows the window as each parameter's ``ring_rows`` (``[m, *p.shape]``, see
    :meth:`rows_of` and :meth:`window_of`): its columns of every row, unpadded, laid out like
    the parameter, so that a sharded one reshards.
    """

    BLOCKWISE = False
    ERROR_FEEDBACK = False
    KEEPS_FLOAT64 = True  # float64 parameters keep float64 rows (to check the algebra exactly)
    # Why a checkpoint cannot resume on another number of ranks; None: it can.
    RESHARD_REFUSAL = None

    @staticmethod
    def rows_of(window: torch.Tensor, locals_: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``window`` (``[m, span]``) shaped ``[m, *t.shape]``: each tensor's columns of every row."""
        rows, start = [], 0
        for t in locals_:
            rows.append(window[:, start : start + t.numel()].view(window.shape[0], *t.shape))
            start += t.numel()
        return rows

    @staticmethod
    def window_of(rows: Sequence, locals_: Sequence[torch.Tensor], span: int) -> torch.Tensor:
        """The ``[m, span]`` window whose columns are ``rows`` (each ``[m, *t.shape]``, one dtype), zero beyond
        them; ``ValueError`` naming the first row tensor that does not fit."""
        if not rows or len(rows) != len(locals_):
            raise ValueError(f"a window needs one 'ring_rows' per parameter ({len(locals_)}), got {len(rows)}")
        first = rows[0]
        for position, (r, t) in enumerate(zip(rows, locals_)):
            if not isinstance(r, torch.Tensor) or r.dim() != t.dim() + 1 or tuple(r.shape[1:]) != tuple(t.shape) \
                    or r.shape[0] != first.shape[0] or r.dtype != first.dtype:
                got = f"{r.dtype} {tuple(r.shape)}" if isinstance(r, torch.Tensor) else type(r).__name__
                raise ValueError(
                    f"saved state 'ring_rows' of the window's parameter {position} is {got}, expected "
                    f"{first.dtype if isinstance(first, torch.Tensor) else 'a tensor'} of shape [m, "
                    f"{', '.join(map(str, t.shape))}] (m rows of its columns, as every parameter of the window)"
                )
        window = torch.zeros((first.shape[0], span), dtype=first.dtype, device=first.device)
        for view, r in zip(DenseWindow.rows_of(window, locals_), rows):
            view.copy_(r)
        return window

    @staticmethod
    def error_dtype(group: dict) -> torch.dtype:
        return torch.float32

    @staticmethod
    def check_group(group: dict) -> None:
        pass

    @staticmethod
    def initial_state(state: dict, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        m = group["ngrads"]
        return {"ring_grads": torch.zeros((m, layout.span), dtype=dtype, device=layout.device),
                **_gram_state(m, layout.device)}

    @staticmethod
    def state_layout(group: dict, params: Sequence[torch.Tensor], dtype: torch.dtype, *, span=None):
        m = group["ngrads"]
        total = max(sum(p.numel() for p in params), span or 0)
        return {"ring_grads": ((m, total), dtype), "dots": ((m, m), torch.float64)}, _no_entries

    @staticmethod
    def insert(algo: str, state: dict, group: dict, packed: PackedGroup, active: Sequence[bool], slot: int):
        window, g = state[packed.layout.tensors[0]]["ring_grads"], packed.grad.view(-1)
        with nvtx_range(f"tritonopt/{algo}/insert"):
            window[slot].copy_(g)
        with nvtx_range(f"tritonopt/{algo}/sp"):
            return dense_window_products(window, g, packed.work.get("column_weights"))

    @staticmethod
    def combine(state: dict, group: dict, packed: PackedGroup, weights: torch.Tensor):
        return dense_window_combine(state[packed.layout.tensors[0]]["ring_grads"], weights).view_as(packed.grad)


class SparseWindow:
    """Error-feedback Top-k rows in the block-major sparse ring ``ring_indices``/``ring_values`` (``[num_blocks, m, k]``).

    ``x = c``, the compressed accumulator exactly as the ring stores it: with
    bfloat16 values the selected entries are rounded first and the rounding
    residual joins the error (``a == stored row + e``), so ``dots`` stays the
    Gram matrix of the stored rows. ``error_feedback=False`` keeps ``e = 0``.
    With ``error_dtype=torch.bfloat16`` the error is stored in bfloat16 (half the
    memory): ``a = g + e`` is formed in float32 and the new residual is rounded
    once when stored, so the feedback loses that rounding (about 2^-9 of ``e``).

    Every block keeps ``ceil(density * its length)`` entries: the last block,
    when the vector does not fill it, keeps fewer than the others, and its
    unused slots in the ring hold value 0 at distinct positions of its padding
    (never selected, so they add nothing). Indices are int16 for blocks of at
    most 32768 entries (the ring is a third smaller), int32 above.
    """

    BLOCKWISE = True
    ERROR_FEEDBACK = True
    KEEPS_FLOAT64 = False
    RESHARD_REFUSAL = (
        "cuts its Top-k blocks from each rank's shard and keeps them in a sparse ring, block by block (the "
        "blocks, and below density 1 the entries each kept, are the ranks' own), so it cannot reshard the ring"
    )

    @staticmethod
    def error_dtype(group: dict) -> torch.dtype:
        return group["error_dtype"]

    @staticmethod
    def check_group(group: dict) -> None:
        density = group["density"]
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        check_int("block_size", group["block_size"], low=1)
        check_bool("error_feedback", group["error_feedback"])
        for name in ("values_dtype", "error_dtype"):
            if group[name] not in VALUE_DTYPES:
                raise ValueError(f"{name} must be torch.float32 or torch.bfloat16, got {group[name]!r}")

    @staticmethod
    def index_dtype(block_size: int) -> torch.dtype:
        return torch.int16 if block_size <= 32768 else torch.int32

    @staticmethod
    def initial_state(state: dict, group: dict, layout: BlockLayout, dtype: torch.dtype) -> dict:
        m = group["ngrads"]
        k = kept_per_block(group["density"], None, layout.block_size)
        shape = (layout.num_blocks, m, k)
        return {
            "ring_indices": torch.zeros(shape, dtype=SparseWindow.index_dtype(layout.block_size), device=layout.device),
            "ring_values": torch.zeros(shape, dtype=group["values_dtype"], device=layout.device),
            **_gram_state(m, layout.device),
        }

    @staticmethod
    def state_layout(group: dict, params: Sequence[torch.Tensor], dtype: torch.dtype, *, span=None):
        m, total = group["ngrads"], max(sum(p.numel() for p in params), span or 0)
        block_size = min(group["block_size"], total)
        shape = (-(-total // block_size), m, kept_per_block(group["density"], None, block_size))
        return {"ring_indices": (shape, SparseWindow.index_dtype(block_size)),
                "ring_values": (shape, group["values_dtype"]),
                "dots": ((m, m), torch.float64)}, _no_entries

    @staticmethod
    def insert(algo: str, state: dict, group: dict, packed: PackedGroup, active: Sequence[bool], slot: int):
        ring = state[packed.layout.tensors[0]]
        indices_ring, values_ring = ring["ring_indices"], ring["ring_values"]
        with nvtx_range(f"tritonopt/{algo}/compress"):
            indices, values, compressed, residual = sparse_window_compress(
                packed.grad, packed.error if group["error_feedback"] else None, density=group["density"],
                length=packed.layout.span, values_dtype=values_ring.dtype)
        with nvtx_range(f"tritonopt/{algo}/insert"):
            sparse_ring_insert(indices_ring, values_ring, slot, indices.to(indices_ring.dtype), values)
        with nvtx_range(f"tritonopt/{algo}/sp"):
            products = sparse_window_products(indices_ring, values_ring, compressed, packed.work.get("column_weights"))
        packed.stats["error_norm"] = residual.norm()  # what this step left out (kept for the next with feedback)
        return products

    @staticmethod
    def combine(state: dict, group: dict, packed: PackedGroup, weights: torch.Tensor):
        ring = state[packed.layout.tensors[0]]
        return sparse_window_combine(ring["ring_indices"], ring["ring_values"], weights, packed.layout.block_size)


class LowRankWindow:
    """Per tensor ``l`` (unfolded to ``[n_l, p_l]``), rank-``r`` factors ``ring_p`` ``[m, n_l, r]`` and
    ``ring_q`` ``[m, p_l, r]`` of each stored gradient, and the warm start ``lowrank_q``.

    The products add the per-tensor Frobenius products, so the preconditioner
    sees the whole compressed gradient (EFCP's "global" LR-MFAC). 1-D tensors
    are stored exactly, with no error feedback (EFCP App. I).

    Sharded (``packed.shards`` set): a ``Shard(0)`` tensor's rows of ``E``,
    ``P`` and ``ring_p`` are the rank's rows, while ``Q``, ``lowrank_q`` and
    ``ring_q`` are whole on every rank (PowerSGD's distributed pattern, see
    :meth:`compress_row_sharded`). ``P_j^T P`` is a sum over rows, so each
    rank's part of ``s`` uses its own rows, and the optimizer's one all-reduce
    of ``s`` sums them; a ``Replicate()`` tensor's part counts ``1 / world``.
    On a 2-D (HSDP) mesh "rows" and "ranks" are the shard dimension's: every
    all-reduce here runs over it, and the ranks of a replica group compute alike.
    1-D and replicated tensors are compressed locally, as unsharded.
    """

    BLOCKWISE = False
    ERROR_FEEDBACK = True
    KEEPS_FLOAT64 = False
    # Each Shard(0) tensor's rows of ring_p show as a DTensor laid out by the parameter's rows (LowRankMFAC's
    # state_dict); Q, ring_q and the Gram matrix are the same on every rank; E is per coordinate.
    RESHARD_REFUSAL = None

    @staticmethod
    def error_dtype(group: dict) -> torch.dtype:
        return torch.float32

    @staticmethod
    def check_group(group: dict) -> None:
        check_int("rank", group["rank"], low=1)

    @staticmethod
    def initial_state(state: dict, group: dict, layout: BlockLayout, dtype: torch.dtype, *, seed: int = 0) -> dict:
        m, rank = group["ngrads"], group["rank"]
        gen = torch.Generator().manual_seed(seed)
        for p, local in zip(layout.tensors, layout.locals):
            entry = state[p]
            n, cols = unfolded_shape(local)  # a Shard(0) tensor keeps its own rows of P
            compressed = p.dim() >= 2
            if "lowrank_q" not in entry:
                f32 = dict(dtype=torch.float32)  # whatever torch's default dtype is
                q = torch.randn((cols, rank), generator=gen, **f32) if compressed else torch.zeros((1, rank), **f32)
                entry["lowrank_q"] = q.to(p.device)
                entry["ring_p"] = torch.zeros((m, n, rank), device=p.device, **f32)
                entry["ring_q"] = torch.zeros((m, cols if compressed else 1, rank), device=p.device, **f32)
            expected = (m, n, rank)
            if tuple(entry["ring_p"].shape) != expected:
                raise ValueError(
                    f"state 'ring_p' has shape {tuple(entry['ring_p'].shape)}, expected {expected}; "
                    "were ngrads or rank changed?"
                )
        return _gram_state(m, layout.device)

    @staticmethod
    def state_layout(group: dict, params: Sequence[torch.Tensor], dtype: torch.dtype, *, span=None):
        m, rank = group["ngrads"], group["rank"]

        def factors(p):
            n, cols = unfolded_shape(p)
            width = cols if p.dim() >= 2 else 1
            f32 = torch.float32
            return {"lowrank_q": ((width, rank), f32), "ring_p": ((m, n, rank), f32),
                    "ring_q": ((m, width, rank), f32)}

        return {"dots": ((m, m), torch.float64)}, factors

    @staticmethod
    def insert(algo: str, state: dict, group: dict, packed: PackedGroup, active: Sequence[bool], slot: int):
        layout = packed.layout
        entries = [state[p] for p in layout.tensors]
        ring_ps, ring_qs = [e["ring_p"] for e in entries], [e["ring_q"] for e in entries]
        shards = getattr(packed, "shards", None)
        tensors = (layout.views(packed.grad), layout.views(packed.error), [e["lowrank_q"] for e in entries],
                   ring_ps, ring_qs)
        with nvtx_range(f"tritonopt/{algo}/compress"):
            if shards is None:
                lowrank_window_compress(*tensors, slot, active)
            else:  # a Shard(0) matrix is compressed over the ranks' rows; the rest locally, as unsharded
                split = [is_row_sharded(p) and p.dim() >= 2 for p in layout.tensors]
                local = [i for i, s in enumerate(split) if not s]
                rows = [i for i, s in enumerate(split) if s]
                lowrank_window_compress(*([x[i] for i in local] for x in tensors), slot, [active[i] for i in local])
                LowRankWindow.compress_row_sharded(shards, *([x[i] for i in rows] for x in tensors),
                                                   [active[i] for i in rows], slot)
            packed.stats["error_norm"] = packed.error.norm()
        with nvtx_range(f"tritonopt/{algo}/sp"):
            if shards is None:
                return lowrank_window_products(ring_ps, ring_qs, slot)
            # This rank's part of s: its rows of each Shard(0) tensor, 1 / world of each replicated one.
            products = torch.zeros(ring_ps[0].shape[0], dtype=torch.float64, device=ring_ps[0].device)
            for p, ring_p, ring_q in zip(layout.tensors, ring_ps, ring_qs):
                part = lowrank_window_products([ring_p], [ring_q], slot)
                products += part if is_row_sharded(p) else part / shards.spec.world
            return products

    @staticmethod
    def compress_row_sharded(shards, grads: Sequence[torch.Tensor], errors: Sequence[torch.Tensor],
                             warm_starts: Sequence[torch.Tensor], ring_ps: Sequence[torch.Tensor],
                             ring_qs: Sequence[torch.Tensor], active: Sequence[bool], slot: int) -> None:
        """``lowrank_ef`` of ``Shard(0)`` tensors of two or more dimensions, over the ranks' rows together.

        Each rank holds its rows of ``A = E + G`` (``[n_a, p]``) and the whole warm
        start ``Q``. ``Y = A Q`` is local. The Gram-Schmidt is
        :func:`~tritonopt.kernels.lowrank.gram_schmidt_`'s, step by step, with every
        sum over rows (the column norms, then each column's inner products with
        the later ones) formed per rank and all-reduced in float32, so its
        arithmetic equals the unsharded one's up to the order of those sums:
        ``2 r - 1`` all-reduces (``r + r (r - 1) / 2 + (r - 1)`` floats per
        tensor), each one for all tensors. ``Q = A^T P`` is one more
        (``p r`` floats per tensor), then ``E = A - P Q^T`` on the local rows.
        Where the all-reduced Gram-Schmidt dropped a column (the same decision on
        every rank), ``Q`` keeps the warm start's column. A tensor without a
        gradient takes part with zeros, stores a zero row and keeps its error
        and warm start, so every rank makes the same calls.
        """
        if not grads:
            return
        rank = warm_starts[0].shape[1]
        factors, sources = [], []
        for g, e, warm, is_active in zip(grads, errors, warm_starts, active):
            n, cols = unfolded_shape(g)
            if is_active:
                a = e.view(n, cols).add_(g.view(n, cols).to(torch.float32))
                factors.append(a @ warm)
            else:
                a = None
                factors.append(torch.zeros((n, rank), dtype=torch.float32, device=g.device))
            sources.append(a)
        squares = shards.all_reduce(torch.stack([y.square().sum(dim=0) for y in factors]))  # [T, r]
        original = squares.sqrt()
        norms = original[:, 0]
        kept = []
        for i in range(rank):
            keep = norms > DEPENDENT_TOLERANCE * original[:, i]
            kept.append(keep)
            scales = torch.where(keep, 1.0 / (norms + GRAM_SCHMIDT_EPS), torch.zeros_like(norms))
            for y, scale in zip(factors, scales):
                y[:, i : i + 1].mul_(scale)
            if i + 1 == rank:
                break
            inner = shards.all_reduce(torch.cat([(y[:, i : i + 1].T @ y[:, i + 1 :]).view(-1) for y in factors]))
            for y, projections in zip(factors, inner.view(len(factors), rank - i - 1)):
                y[:, i + 1 :].sub_(y[:, i : i + 1] * projections.view(1, -1))
            norms = shards.all_reduce(torch.stack([y[:, i + 1].square().sum() for y in factors])).sqrt()
        alive = torch.stack(kept, dim=1)  # [T, r]
        partial = [a.T @ y if a is not None else torch.zeros_like(warm)
                   for a, y, warm in zip(sources, factors, warm_starts)]
        backs = shards.all_reduce(torch.cat([q.view(-1) for q in partial])).split([q.numel() for q in partial])
        for a, y, back, warm, ring_p, ring_q, living in zip(sources, factors, backs, warm_starts, ring_ps, ring_qs,
                                                            alive):
            if a is None:
                ring_p[slot].zero_()
                ring_q[slot].zero_()
                continue
            q = back.view_as(warm)
            a.sub_(y @ q.T)
            warm.copy_(torch.where(living, q, warm))
            ring_p[slot].copy_(y)
            ring_q[slot].copy_(warm)

    @staticmethod
    def combine(state: dict, group: dict, packed: PackedGroup, weights: torch.Tensor):
        entries = [state[p] for p in packed.layout.tensors]
        direction = torch.zeros_like(packed.grad)
        lowrank_window_combine([e["ring_p"] for e in entries], [e["ring_q"] for e in entries], weights,
                               packed.layout.views(direction))
        return direction
