"""Benchmark blockwise Top-k with error feedback (``tritonopt.ops.ef_topk``) against its floors.

What is measured, per shape ``[num_blocks, block_size]`` (``num_blocks * block_size``
from 2^20 to 2^26 elements, ``k = ceil(density * block_size)``, 1 % by default):

* ``triton``: the Triton launcher ``ef_topk_triton`` (kernel time, without the
  argument checks and dispatch of the public op);
* ``torch``: ``torch_composite`` below, the fastest eager-PyTorch version
  (``torch.topk`` + ``gather`` + ``scatter_``). It does not apply the exact
  tie rule nor sort the indices, so it is a speed baseline only;
* ``floor``: the memory floor, the bytes the op must move (read grad and error,
  write error, write k indices and values per block) divided by the measured
  copy bandwidth of the device.

Each op is timed on the same buffers call after call; the error buffer keeps
accumulating, which does not change the work per call.

Without a CUDA device the Triton kernel cannot be timed meaningfully: the script
says so, times the plain-PyTorch reference (provider ``reference``) and the
``torch`` composite on shapes of at most 2^20 elements, and labels the results
``cpu``. Those numbers say nothing about GPU speed.

Results: a table on stdout, and ``ef_topk.csv`` / ``ef_topk.png`` (GB/s against
elements per provider) in ``perf/results/<device>/`` or ``--out DIR``.

Run from the repository root::

    python perf/bench_ef_topk.py [--smoke] [--nvtx] [--dtype fp32|fp16|bf16]
                                 [--block-sizes 4096 16384] [--density 0.01] [--out DIR]
    nsys profile -t nvtx,cuda python perf/bench_ef_topk.py --nvtx
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Callable

try:
    import tritonopt  # noqa: F401  (normally installed in editable mode)
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import _bench_common as bench
from tritonopt._runtime import HAS_TRITON, nvtx_range
from tritonopt.kernels.ef_topk import ef_topk_reference, ef_topk_triton
from tritonopt.optim._blocks import kept_per_block

OP = "ef_topk"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_BLOCK_SIZES = (4096, 16384)
DEFAULT_DENSITY = 0.01
ELEMENTS_LOG2_RANGE = (20, 26)
# The CPU paths are slow and not the subject: keep the CPU sweep short.
CPU_MAX_ELEMENTS_LOG2 = 20
SMOKE_SHAPE = (4, 1024)
SMOKE_REPS = 3
CPU_REPS = 10
NO_CUDA_MESSAGE = (
    "no CUDA device: timing the reference path only (not representative of GPU speed)"
)

Op = Callable[[torch.Tensor, torch.Tensor, int], object]


def torch_composite(
    grad: torch.Tensor, error: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
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


# --------------------------------------------------------------------------- shapes


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


# --------------------------------------------------------------------------- measuring


def timed_call(provider: str, op: Op, grad, error, k: int, use_nvtx: bool) -> Callable[[], None]:
    if not use_nvtx:
        return lambda: op(grad, error, k)
    range_name = f"tritonopt/bench/{OP}/{provider}"

    def call() -> None:
        with nvtx_range(range_name):
            op(grad, error, k)

    return call


def measure_shape(
    num_blocks: int,
    block_size: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    providers: dict[str, Op],
    *,
    bandwidth_gbps: float,
    cpu_reps: int,
    use_nvtx: bool,
) -> list[dict[str, object]]:
    """One CSV row per provider (and one for the floor) for this shape."""
    grad = torch.randn(num_blocks, block_size, device=device).to(dtype)
    moved = floor_bytes(num_blocks, block_size, k, grad.element_size())
    floor_ms = moved / (bandwidth_gbps * 1e9) * 1e3

    timings: dict[str, bench.Timing] = {}
    for provider, op in providers.items():
        error = torch.zeros(num_blocks, block_size, dtype=torch.float32, device=device)
        call = timed_call(provider, op, grad, error, k, use_nvtx)
        timings[provider] = bench.time_ms(call, device, cpu_reps=cpu_reps)
        del error
    timings["floor"] = bench.Timing(p50=floor_ms, p20=floor_ms, p80=floor_ms)

    torch_ms = timings["torch"].p50
    rows = []
    for provider, timing in timings.items():
        rows.append(
            {
                "op": OP,
                "provider": provider,
                "num_blocks": num_blocks,
                "block_size": block_size,
                "k": k,
                "elements": num_blocks * block_size,
                "dtype": str(dtype).removeprefix("torch."),
                "ms_p50": timing.p50,
                "ms_p20": timing.p20,
                "ms_p80": timing.p80,
                # Effective bandwidth on the floor's bytes: comparable across providers.
                "gbps": moved / (timing.p50 * 1e-3) / 1e9,
                "floor_ms": floor_ms,
                "pct_of_floor": 100.0 * floor_ms / timing.p50,
                "speedup_vs_torch": torch_ms / timing.p50,
            }
        )
    return rows


# --------------------------------------------------------------------------- reporting


def shape_table(rows: list[dict[str, object]], primary: str) -> str:
    """One line per shape: time per provider, then the primary provider vs the floor and torch."""
    providers = list(dict.fromkeys(str(r["provider"]) for r in rows))
    by_shape: dict[tuple, dict[str, dict[str, object]]] = {}
    for row in rows:
        shape = (row["num_blocks"], row["block_size"], row["k"], row["elements"])
        by_shape.setdefault(shape, {})[str(row["provider"])] = row
    headers = ["blocks", "block_size", "k", "elements"]
    headers += [f"{p} ms" for p in providers]
    headers += [f"{primary} GB/s", "% of bw", f"{primary} vs torch"]
    lines = []
    for shape, per_provider in by_shape.items():
        lead = per_provider[primary]
        lines.append(
            [*shape]
            + [per_provider[p]["ms_p50"] for p in providers]
            + [lead["gbps"], lead["pct_of_floor"], f"{lead['speedup_vs_torch']:.2f}x"]
        )
    return bench.format_table(headers, lines)


# --------------------------------------------------------------------------- CLI


def density_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time tritonopt's ef_topk against a plain-torch composite and the "
        "memory floor.",
    )
    parser.add_argument(
        "--block-sizes", type=bench.positive_int, nargs="+", default=list(DEFAULT_BLOCK_SIZES),
        metavar="N", help="row lengths to sweep (default: %(default)s)",
    )
    parser.add_argument(
        "--density", type=density_fraction, default=DEFAULT_DENSITY,
        help="fraction of each block kept, k = ceil(density * block_size) (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="gradient dtype (default: fp32)",
    )
    parser.add_argument(
        "--nvtx", action="store_true",
        help=f"wrap each measured call in an NVTX range tritonopt/bench/{OP}/<provider>",
    )
    parser.add_argument(
        "--smoke", action="store_true",
        help=f"one tiny shape ({SMOKE_SHAPE[0]} blocks of {SMOKE_SHAPE[1]}), {SMOKE_REPS} CPU "
        "repetitions: checks the script runs, in seconds",
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="results folder (default: perf/results/<device>/)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    on_gpu = bench.cuda_available()
    device = torch.device("cuda" if on_gpu else "cpu")

    if on_gpu and HAS_TRITON:
        primary, primary_op = "triton", ef_topk_triton
    elif on_gpu:
        primary, primary_op = "reference", ef_topk_reference
        print("Triton is not importable: timing the reference path on the GPU instead")
    else:
        primary, primary_op = "reference", ef_topk_reference
        print(NO_CUDA_MESSAGE)
    providers: dict[str, Op] = {primary: primary_op, "torch": torch_composite}

    if args.nvtx and importlib.util.find_spec("nvtx") is None:
        print("--nvtx: the nvtx package is not installed, so no ranges will be emitted")

    if args.smoke:
        shapes = [SMOKE_SHAPE]
        cpu_reps = SMOKE_REPS
    else:
        max_log2 = ELEMENTS_LOG2_RANGE[1] if on_gpu else CPU_MAX_ELEMENTS_LOG2
        shapes = sweep_shapes(args.block_sizes, max_log2)
        cpu_reps = CPU_REPS

    bandwidth = bench.measure_bandwidth_gbps(device, cpu_reps=cpu_reps)
    print(
        f"{OP}: grad {args.dtype}, density {args.density:g} (k = ceil(density * block_size)), "
        f"device: {bench.device_name()}"
    )
    print(f"measured copy bandwidth: {bandwidth:.1f} GB/s (floor = minimal bytes / this)")

    rows: list[dict[str, object]] = []
    for num_blocks, block_size in shapes:
        k = kept_per_block(args.density, None, block_size)
        rows += measure_shape(
            num_blocks, block_size, k, dtype, device, providers,
            bandwidth_gbps=bandwidth, cpu_reps=cpu_reps, use_nvtx=args.nvtx,
        )
        if on_gpu:
            torch.cuda.empty_cache()

    print()
    print(shape_table(rows, primary))
    print()

    out_dir = args.out if args.out is not None else bench.default_results_dir()
    csv_path = bench.write_results(rows, out_dir, OP)
    print(f"wrote {csv_path}")
    title = f"{OP}, grad {args.dtype}, density {args.density:g}, {bench.device_name()}"
    if not on_gpu:
        title += "\nCPU reference path: not representative of GPU speed"
    bench.save_plot(
        rows, Path(out_dir) / f"{OP}.png", x="elements", y="gbps",
        series=("provider", "block_size"), title=title,
        xlabel="elements (num_blocks * block_size)", ylabel="GB/s on the floor's bytes",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
