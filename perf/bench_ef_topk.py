"""Benchmark blockwise Top-k with error feedback (``tritonopt.ops.ef_topk``) against its floors.

Per shape ``[num_blocks, block_size]`` (``num_blocks * block_size`` from 2^20 to 2^26
elements, ``k = ceil(density * block_size)``, 1 % by default), the providers of
``perf/_harness.py``: the Triton launcher ``ef_topk_triton`` (or, without a GPU, the
reference ``ef_topk_reference``), the public op, and ``torch_composite`` below, the fastest
eager-PyTorch version (``torch.topk`` + ``gather`` + ``scatter_``; it neither applies the
exact tie rule nor sorts the indices, so it is a speed baseline only).

Floor: the bytes the op must move (read grad and error, write error, write k int32 indices
and fp32 values per block) over the measured bandwidth. Each op is timed on the same buffers
call after call; the error buffer keeps accumulating, which does not change the work per call.

Without a CUDA device the script says so and times the reference path on shapes of at most
2^20 elements. Results: ``ef_topk.csv`` and ``ef_topk.png`` (GB/s against elements).

    python -m perf.bench_ef_topk [--smoke] [--nvtx] [--dtype fp32|fp16|bf16]
                                 [--block-sizes 4096 16384 1048576] [--density 0.01] [--out DIR]
    nsys profile -t nvtx,cuda python -m perf.bench_ef_topk --nvtx
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_ef_topk.py
    import _as_module

    _as_module.run(__file__)

import sys
from functools import partial

import torch

import tritonopt
from perf import _harness as harness
from tritonopt.kernels.ef_topk import ef_topk_reference, ef_topk_triton

OP = "ef_topk"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_BLOCK_SIZES = (4096, 16384, 1 << 20)  # the last: one block per million entries, the split path
ELEMENTS_LOG2_RANGE = (20, 26)
CPU_MAX_ELEMENTS_LOG2 = 20  # the CPU paths are slow and not the subject
SMOKE_SHAPE = (4, 1024)


def torch_composite(grad: torch.Tensor, error: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager-PyTorch Top-k with error feedback: the speed baseline.

    Same work as the op, but ties are broken however ``torch.topk`` likes and the
    indices (int64) come unsorted, so it is not a correct replacement.
    """
    a = error + grad.float()
    indices = torch.topk(a.abs(), k, dim=1, sorted=False).indices
    values = a.gather(1, indices)
    a.scatter_(1, indices, 0.0)
    error.copy_(a)
    return indices, values


def sweep_shapes(block_sizes: list[int], max_elements_log2: int) -> list[tuple[int, int]]:
    """(num_blocks, block_size) pairs with num_blocks * block_size = 2^20 .. 2^max, deduplicated."""
    low, _ = ELEMENTS_LOG2_RANGE
    shapes: list[tuple[int, int]] = []
    for block_size in block_sizes:
        for log2 in range(low, max_elements_log2 + 1):
            shape = (max(1, (1 << log2) // block_size), block_size)
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def floor_bytes(num_blocks: int, block_size: int, k: int, grad_bytes: int) -> int:
    """Bytes the op cannot avoid moving: read grad and error, write error, write k (int32, fp32)."""
    elements = num_blocks * block_size
    return elements * (grad_bytes + 4 + 4) + num_blocks * k * (4 + 4)


def case(num_blocks: int, block_size: int, k: int, dtype: torch.dtype, device: torch.device) -> harness.Case:
    grad = torch.randn(num_blocks, block_size, device=device).to(dtype)

    def provider(fn):
        def build():
            error = torch.zeros(num_blocks, block_size, dtype=torch.float32, device=device)
            return lambda: fn(grad, error, k)

        return build

    return harness.Case(
        op=OP,
        shape=dict(num_blocks=num_blocks, block_size=block_size, k=k, elements=num_blocks * block_size,
                   dtype=str(dtype).removeprefix("torch.")),
        floor_bytes=floor_bytes(num_blocks, block_size, k, grad.element_size()),
        triton=provider(ef_topk_triton),
        reference=provider(ef_topk_reference),
        public=provider(tritonopt.ops.ef_topk),
        torch=provider(torch_composite),
    )


def cases(args, context: harness.BenchContext):
    dtype = DTYPES[args.dtype]
    if args.smoke:
        shapes = [SMOKE_SHAPE]
    else:
        shapes = sweep_shapes(args.block_sizes, ELEMENTS_LOG2_RANGE[1] if context.on_gpu else CPU_MAX_ELEMENTS_LOG2)
    for num_blocks, block_size in shapes:
        yield partial(case, num_blocks, block_size, harness.entries_per_block(args.density, block_size), dtype,
                      context.device)


def parser():
    p = harness.bench_parser(
        __doc__.split("\n\n")[0],
        smoke_help=f"one tiny shape ({SMOKE_SHAPE[0]} blocks of {SMOKE_SHAPE[1]}), a few repetitions: "
        "checks the script runs, in seconds",
    )
    p.add_argument("--block-sizes", type=harness.positive_int, nargs="+", default=list(DEFAULT_BLOCK_SIZES),
                   metavar="N", help="row lengths to sweep (default: %(default)s)")
    p.add_argument("--density", type=harness.fraction, default=0.01,
                   help="fraction of each block kept, k = ceil(density * block_size) (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="gradient dtype (default: fp32)")
    return p


def main(argv=None) -> int:
    return harness.run_benchmark(
        name=OP, parser=parser(), cases=cases, argv=argv,
        shape_columns=("num_blocks", "block_size", "k", "dtype"),
        preamble=lambda args, ctx: [f"grad {args.dtype}, density {args.density:g} "
                                    "(k = ceil(density * block_size)); floor bytes = "
                                    "elements * (grad itemsize + 8) + blocks * k * 8"],
        plots=[harness.Plot(f"{OP}.png", (OP,), x="elements", y="gbps", series=("provider", "block_size"),
                            title=OP + ", grad {dtype}, density {density:g}",
                            xlabel="elements (num_blocks * block_size)", ylabel="GB/s on the floor's bytes")],
    )


if __name__ == "__main__":
    sys.exit(main())
