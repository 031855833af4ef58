"""Benchmark low-rank compression with error feedback (``tritonopt.ops.lowrank_ef``) against its floor.

Per tensor shape ``[n, p]`` and rank ``r``, the providers of ``perf/_harness.py``: the
launcher ``lowrank_ef_triton`` (three Triton passes around a torch Gram-Schmidt; without a
GPU, the reference ``lowrank_ef_reference``), the public op, and the eager composite
``e += g; P = GS(e @ Q); Q = e.T @ P; e -= P @ Q.T`` (cuBLAS GEMMs, fp32 without TF32).

Floor: ``24 n p`` bytes (read g and e, write A, read A twice, write e) over the measured
bandwidth. Without a CUDA device the script says so and times the reference path on small
shapes. Results: ``lowrank.csv`` and ``lowrank.png``.

    python -m perf.bench_lowrank [--smoke] [--nvtx] [--rank 4] [--out DIR]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_lowrank.py
    import _as_module

    _as_module.run(__file__)

import sys
from functools import partial

import torch

import tritonopt
from perf import _harness as harness
from tritonopt.kernels.lowrank import gram_schmidt_, lowrank_ef_reference, lowrank_ef_triton

OP = "lowrank"
GPU_SHAPES = [(512, 4608), (1024, 1024), (2048, 2048), (4096, 4096), (4096, 11008)]
CPU_SHAPES = [(256, 256), (512, 1152)]
SMOKE_SHAPES = [(64, 96)]


def torch_composite(grad, error, q):
    error.add_(grad)
    p = gram_schmidt_(error @ q)
    q_new = error.T @ p
    error.sub_(p @ q_new.T)
    return p, q_new


def floor_bytes(n: int, p: int) -> int:
    """Read g and e, write A = e + g, read A for both products, write e: 6 passes of 4 bytes."""
    return 24 * n * p


def case(n: int, cols: int, rank: int, device: torch.device) -> harness.Case:
    grad = torch.randn((n, cols), device=device)
    q = torch.randn((cols, rank), device=device)

    def provider(fn):
        def build():
            error = torch.zeros_like(grad)
            return lambda: fn(grad, error, q)

        return build

    return harness.Case(
        op=OP, shape=dict(n=n, p=cols, rank=rank, elements=n * cols), floor_bytes=floor_bytes(n, cols),
        triton=provider(lowrank_ef_triton), reference=provider(lowrank_ef_reference),
        public=provider(tritonopt.ops.lowrank_ef), torch=provider(torch_composite),
    )


def cases(args, context: harness.BenchContext):
    shapes = SMOKE_SHAPES if args.smoke else (GPU_SHAPES if context.on_gpu else CPU_SHAPES)
    for n, cols in shapes:
        yield partial(case, n, cols, args.rank, context.device)


def parser():
    p = harness.bench_parser(__doc__.split("\n\n")[0], smoke_help="one tiny shape, a few repetitions")
    p.add_argument("--rank", type=harness.positive_int, default=4, help="compression rank (default: %(default)s)")
    return p


def main(argv=None) -> int:
    return harness.run_benchmark(
        name=OP, parser=parser(), cases=cases, argv=argv, shape_columns=("n", "p", "rank"),
        preamble=lambda args, ctx: ["floor bytes = 24 n p"],
        plots=[harness.Plot(f"{OP}.png", (OP,), x="elements", y="gbps", series=("provider",),
                            title="lowrank_ef", xlabel="elements (n * p)",
                            ylabel="GB/s on the floor's bytes")],
    )


if __name__ == "__main__":
    sys.exit(main())
