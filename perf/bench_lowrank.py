"""Benchmark low-rank compression with error feedback (``lowrank_ef``) against torch and the floor.

Per tensor shape ``[n, p]`` and rank ``r``:

* ``triton``: :func:`tritonopt.kernels.lowrank.lowrank_ef_triton` (three Triton
  passes around a torch Gram-Schmidt);
* ``torch``: the eager composite ``e += g; P = GS(e @ Q); Q = e.T @ P; e -= P @ Q.T``
  (cuBLAS GEMMs, fp32 without TF32);
* ``floor``: ``24 n p`` bytes (read g and e, write A, read A twice, write e) over
  the measured copy bandwidth.

Without a CUDA device the script says so, times the reference path on small
shapes, labels it ``reference`` and exits 0.

    python perf/bench_lowrank.py [--smoke] [--nvtx] [--rank 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import tritonopt  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import _bench_common as bench
from tritonopt._runtime import HAS_TRITON, nvtx_range
from tritonopt.kernels.lowrank import gram_schmidt_, lowrank_ef_reference, lowrank_ef_triton

OP = "lowrank"
NO_CUDA_MESSAGE = "no CUDA device: timing the reference path only (not representative of GPU speed)"
GPU_SHAPES = [(512, 4608), (1024, 1024), (2048, 2048), (4096, 4096), (4096, 11008)]
CPU_SHAPES = [(256, 256), (512, 1152)]


def torch_composite(grad, error, q):
    error.add_(grad)
    p = gram_schmidt_(error @ q)
    q_new = error.T @ p
    error.sub_(p @ q_new.T)
    return p, q_new


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Time lowrank_ef against torch and the memory floor.")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--nvtx", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape, a few repetitions")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = bench.cuda_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # the comparison is fp32 against fp32
    if not on_gpu:
        print(NO_CUDA_MESSAGE)
    primary, primary_op = ("triton", lowrank_ef_triton) if on_gpu and HAS_TRITON else (
        "reference", lowrank_ef_reference)
    shapes, reps = ([(64, 96)], 3) if args.smoke else ((GPU_SHAPES if on_gpu else CPU_SHAPES), 10)
    bandwidth = bench.measure_bandwidth_gbps(device, cpu_reps=reps)
    print(f"{OP}: rank {args.rank}, device: {bench.device_name()}; copy bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for n, cols in shapes:
        grad = torch.randn((n, cols), device=device)
        q = torch.randn((cols, args.rank), device=device)
        moved = 24 * n * cols
        floor_ms = moved / (bandwidth * 1e9) * 1e3
        timings = {}
        for provider, op in ((primary, primary_op), ("torch", torch_composite)):
            error = torch.zeros_like(grad)

            def call(op=op, error=error, provider=provider):
                if args.nvtx:
                    with nvtx_range(f"tritonopt/bench/{OP}/{provider}"):
                        op(grad, error, q)
                else:
                    op(grad, error, q)

            timings[provider] = bench.time_ms(call, device, cpu_reps=reps)
        timings["floor"] = bench.Timing(floor_ms, floor_ms, floor_ms)
        for provider, timing in timings.items():
            rows.append({
                "op": OP, "provider": provider, "n": n, "p": cols, "rank": args.rank,
                "elements": n * cols, "ms_p50": timing.p50, "ms_p20": timing.p20,
                "ms_p80": timing.p80, "gbps": moved / (timing.p50 * 1e-3) / 1e9,
                "floor_ms": floor_ms, "pct_of_floor": 100.0 * floor_ms / timing.p50,
                "speedup_vs_torch": timings["torch"].p50 / timing.p50,
            })
    print(bench.format_table(
        ["provider", "n", "p", "ms", "GB/s", "% of floor", "vs torch"],
        [[r["provider"], r["n"], r["p"], r["ms_p50"], r["gbps"], r["pct_of_floor"],
          r["speedup_vs_torch"]] for r in rows],
    ))
    out_dir = args.out if args.out is not None else bench.default_results_dir()
    print(f"wrote {bench.write_results(rows, out_dir, OP)}")
    bench.save_plot(
        rows, Path(out_dir) / f"{OP}.png", x="elements", y="gbps", series=("provider",),
        title=f"lowrank_ef, rank {args.rank}, {bench.device_name()}"
        + ("" if on_gpu else "\nCPU reference path: not representative of GPU speed"),
        xlabel="elements (n * p)", ylabel="GB/s on the floor's bytes",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
