"""Benchmark the sparse ring-buffer ops (SP, LCG, insertion) against torch and the memory floor.

Per shape (``d = num_blocks * block_size`` from 2^20 to 2^24, ``m`` rows, ``k`` kept per
block at the given density) and op (``sparse_sp``, ``sparse_lcg``, ``sparse_ring_insert``),
the providers of ``perf/_harness.py``: the launchers of :mod:`tritonopt.kernels.sparse_ring`
(or, without a GPU, their references), the public ops, and

* ``torch``: the best eager composite with the same inputs: absolute int64 indices
  precomputed (as the EFCP code stores them) and ``torch.take`` + sum for SP,
  ``index_add_`` for LCG, ``index_copy_``-style assignment for insertion;
* ``dense``: ``G @ x`` / ``w @ G`` on a dense float32 ``[m, d]`` buffer (what dense M-FAC
  pays), where it fits in memory.

Floor: ``m * k_total * (4 + 4) + 4 d`` bytes (SP and LCG; int32 indices, fp32 values) or
``2 * k_total * (4 + 4)`` (insertion) over the measured bandwidth. ``SparseMFAC.step()`` and
``MFAC.step()`` at ResNet-18 size are timed by ``perf/bench_optimizer_step.py``.

``--block-size 16777216`` times one block as long as a whole model's gradient (a global
Top-k), which LCG spreads over slices of the block.

Without a CUDA device the script says so and times the reference path on small shapes
(m = 32, d <= 2^20). Results: ``sparse_ring.csv`` and ``sparse_ring.png``.

    python -m perf.bench_sparse_ring [--smoke] [--nvtx] [--m 1024] [--density 0.01]
                                     [--block-size 16384] [--out DIR]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_sparse_ring.py
    import _as_module

    _as_module.run(__file__)

import sys
from functools import partial

import torch

import tritonopt
from perf import _harness as harness
from tritonopt.kernels import sparse_ring as kernels

NAME = "sparse_ring"
DENSE_LIMIT_BYTES = {"cuda": 8 << 30, "cpu": 1 << 28}
INSERT_SLOT = 3


def make_ring(num_blocks, m, k, block_size, device):
    gen = torch.Generator(device=device).manual_seed(0)
    # Distinct sorted positions per (block, row), as ef_topk produces them.
    starts = torch.randint(0, block_size - k + 1, (num_blocks, m, 1), device=device, generator=gen)
    stride = max(1, (block_size - 1) // max(1, k))
    positions = torch.arange(k, device=device) * stride
    indices = ((starts + positions) % block_size).sort(dim=2).values.to(torch.int32)
    values = torch.randn((num_blocks, m, k), device=device, generator=gen)
    return indices, values


def absolute_indices(indices: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-relative int32 indices ``[num_blocks, m, k]`` to flat int64 positions in ``[0, d)``."""
    starts = torch.arange(indices.shape[0], device=indices.device, dtype=torch.int64) * block_size
    return indices.long() + starts.view(-1, 1, 1)


def floor_bytes(op: str, m: int, k_total: int, d: int) -> int:
    """SP / LCG: read every stored (int32, fp32) pair and the dense vector; insertion: rewrite one row."""
    return 2 * k_total * 8 if op == "sparse_ring_insert" else m * k_total * 8 + 4 * d


def shape_cases(num_blocks, m, k, block_size, device) -> list[harness.Case]:
    """The three ops on one ring (SP, LCG, insertion), sharing its inputs."""
    d = num_blocks * block_size
    indices, values = make_ring(num_blocks, m, k, block_size, device)
    absolute = absolute_indices(indices, block_size)  # [num_blocks, m, k] int64
    absolute_rows = absolute.permute(1, 0, 2).reshape(m, -1).contiguous()
    values_rows = values.permute(1, 0, 2).reshape(m, -1).contiguous()
    x = torch.randn((num_blocks, block_size), device=device)
    w = torch.randn(m, device=device)
    new_i, new_v = indices[:, 0].clone(), values[:, 0].clone()  # copies even of one block's row
    flat_x = x.view(-1)

    def torch_sp():
        return (values_rows * flat_x.take(absolute_rows)).sum(dim=1)

    def torch_lcg():
        out = torch.zeros(d, device=device)
        return out.index_add_(0, absolute_rows.view(-1), (w.view(-1, 1) * values_rows).view(-1))

    def torch_insert():
        absolute_rows[INSERT_SLOT] = absolute[:, 0].reshape(-1)
        values_rows[INSERT_SLOT] = new_v.view(-1)

    def ready(fn):  # the inputs above are shared; nothing to allocate per provider
        return lambda: fn

    ops = {
        "sparse_sp": dict(
            triton=ready(lambda: kernels.sparse_sp_triton(indices, values, x)),
            reference=ready(lambda: kernels.sparse_sp_reference(indices, values, x)),
            public=ready(lambda: tritonopt.ops.sparse_sp(indices, values, x)),
            torch=ready(torch_sp)),
        "sparse_lcg": dict(
            # The rows are ascending, as the optimizers' rings are and promise (long blocks are sliced).
            triton=ready(lambda: kernels.sparse_lcg_triton(indices, values, w, block_size, True)),
            reference=ready(lambda: kernels.sparse_lcg_reference(indices, values, w, block_size, True)),
            public=ready(lambda: tritonopt.ops.sparse_lcg(indices, values, w, block_size, ascending=True)),
            torch=ready(torch_lcg)),
        "sparse_ring_insert": dict(
            triton=ready(lambda: kernels.sparse_ring_insert_triton(indices, values, INSERT_SLOT, new_i, new_v)),
            reference=ready(lambda: kernels.sparse_ring_insert_reference(indices, values, INSERT_SLOT, new_i, new_v)),
            public=ready(lambda: tritonopt.ops.sparse_ring_insert(indices, values, INSERT_SLOT, new_i, new_v)),
            torch=ready(torch_insert)),
    }
    dense = {}
    if 4 * m * d <= DENSE_LIMIT_BYTES[device.type]:
        window = torch.randn((m, d), device=device)
        dense = {"sparse_sp": ready(lambda: window @ flat_x), "sparse_lcg": ready(lambda: w @ window)}

    k_total = num_blocks * k
    shape = dict(m=m, d=d, num_blocks=num_blocks, block_size=block_size, k_per_block=k)
    return [harness.Case(op=op, shape=shape, floor_bytes=floor_bytes(op, m, k_total, d),
                         extra={"dense": dense[op]} if op in dense else {}, **providers)
            for op, providers in ops.items()]


def cases(args, context: harness.BenchContext):
    if args.smoke:
        shapes, m, block_size = [(4, 1024)], 8, 1024
    else:
        m = args.m or (1024 if context.on_gpu else 32)
        block_size = args.block_size
        top = 24 if context.on_gpu else 20
        # A block longer than 2^20 (a whole model as one block) gives one shape more than once.
        shapes = list(dict.fromkeys((max(1, (1 << e) // block_size), block_size) for e in range(20, top + 1, 2)))
    k = harness.entries_per_block(args.density, block_size)
    print(f"m = {m}, density {args.density:g} (k = {k} per block of {block_size}); floor bytes = "
          "m * k_total * 8 + 4 d (SP, LCG), 2 * k_total * 8 (insertion)")
    for num_blocks, bs in shapes:
        yield partial(shape_cases, num_blocks, m, k, bs, context.device)


def parser():
    p = harness.bench_parser(__doc__.split("\n\n")[0], smoke_help="one tiny shape, a few repetitions")
    p.add_argument("--m", type=harness.positive_int, default=None, help="rows (default: 1024 on GPU, 32 on CPU)")
    p.add_argument("--density", type=harness.fraction, default=0.01, help="kept fraction (default: %(default)s)")
    p.add_argument("--block-size", type=harness.positive_int, default=16384, help="(default: %(default)s)")
    return p


def main(argv=None) -> int:
    return harness.run_benchmark(
        name=NAME, parser=parser(), cases=cases, argv=argv, shape_columns=("m", "d", "block_size"),
        plots=[harness.Plot(f"{NAME}.png", ("sparse_sp", "sparse_lcg"), x="d", y="gbps",
                            series=("provider", "op"), title="sparse ring SP / LCG",
                            xlabel="d (vector length)", ylabel="GB/s on the floor's bytes")],
    )


if __name__ == "__main__":
    sys.exit(main())
