"""Benchmark the fused SSD-SGD step (GLU local update + shadow-server momentum step) against its floor.

One iteration of SSD-SGD's steps-delay stage over flat buffers of ``n``
float32 elements (Xu et al. Eq. 8 and the MXNet momentum-SGD server; see
:func:`tritonopt.ops.ssd_sgd_step`), three providers:

* ``triton`` (on a GPU): the public op, one pass;
* ``torch``: :func:`ssd_sgd_step_composite`, the same math as eager
  ``torch._foreach_*`` ops over a list of parameter-sized tensors (the
  fastest eager form: 7 ops, 19 element accesses instead of 8);
* ``floor``: ``32 n`` bytes for the common step (read ``p, g, pre, sw, smom``;
  write ``p, sw, smom``), divided by the measured copy bandwidth.

The step right after a pull (one in ``k``; ``p`` is not read, ``pre`` and the
synchronised momentum are written: ``36 n`` bytes) is timed for the op
against its floor as ``ssd_sgd_step_pulled``.

Targets on an H100: at least 80 % of the bandwidth on the floor's bytes, and
at least 2x the composite. Without a GPU the script says so, times the
reference path and the composite on small sizes, and labels the results
``cpu``. Results: ``perf/results/<device>/ssd_sgd.csv`` and ``ssd_sgd.png``
(GB/s on the floor's bytes against ``n``).

    python perf/bench_ssd_sgd.py [--smoke] [--nvtx] [--elements 1e6 25557032] [--tensors 161] [--out DIR]
    nsys profile -t nvtx,cuda python perf/bench_ssd_sgd.py --nvtx
"""

from __future__ import annotations

import argparse
import contextlib
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
import tritonopt
from tritonopt._runtime import HAS_TRITON, nvtx_range

CSV_STEM = "ssd_sgd"
STEP_OP = "ssd_sgd_step"
PULLED_OP = "ssd_sgd_step_pulled"
GPU_ELEMENTS = (1_000_000, 5_000_000, 25_557_032, 100_000_000)  # 25.6 M: ResNet-50
CPU_ELEMENTS = (100_000, 1_000_000)
SMOKE_ELEMENTS = (20_000,)
SMOKE_REPS = 3
CPU_REPS = 10
TENSORS = 161  # the composite's list length: ResNet-50 has 161 parameter tensors
STEP_FLOOR_BYTES, PULLED_FLOOR_BYTES = 32, 36  # per float32 element

# The paper's setting (sec. 4.1): lr 0.4, m 0.9, wd 1e-4, loc_lr = 4 lr, alpha 2, beta 0.5, k 5.
HYPER = dict(lr=0.4, momentum=0.9, weight_decay=1e-4, local_lr=1.6, local_weight_decay=1e-4,
             glu_alpha=2.0, glu_beta=0.5, sync_coef=(1 - 0.9) / (0.4 * 5))

NO_CUDA_MESSAGE = "no CUDA device: timing the reference path only (not representative of GPU speed)"


def ssd_sgd_step_composite(params, grads, pre, sw, smom, *, lr, momentum, weight_decay, local_lr,
                           local_weight_decay, glu_alpha, glu_beta, sync_coef) -> None:
    """Eager foreach SSD-SGD step (the common, non-pulled one), in place: the speed baseline.

    Shadow server ``smom = m smom - lr (g + wd sw); sw += smom``, then GLU in its
    closed form ``p = (1 - L wd_loc + L beta c) p - L alpha g - L beta c pre``.
    """
    torch._foreach_mul_(smom, momentum)
    torch._foreach_add_(smom, grads, alpha=-lr)
    torch._foreach_add_(smom, sw, alpha=-lr * weight_decay)
    torch._foreach_add_(sw, smom)
    big_l, c = local_lr, sync_coef
    torch._foreach_mul_(params, 1.0 - big_l * local_weight_decay + big_l * glu_beta * c)
    torch._foreach_add_(params, grads, alpha=-big_l * glu_alpha)
    torch._foreach_add_(params, pre, alpha=-big_l * glu_beta * c)


def split(flat: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """Views of ``flat`` as ``pieces`` tensors of nearly equal size (a parameter list)."""
    return list(torch.tensor_split(flat, min(pieces, flat.numel())))


def with_range(name: str, fn: Callable[[], object], use_nvtx: bool) -> Callable[[], object]:
    if not use_nvtx:
        return fn

    def call():
        with nvtx_range(name):
            return fn()

    return call


def backend_for(provider: str, primary: str):
    return tritonopt.use_backend(primary) if provider == primary else contextlib.nullcontext()


def result_row(op, provider, timing, moved, floor_ms, torch_ms, n) -> dict[str, object]:
    return {
        "op": op, "provider": provider, "n": n, "dtype": "float32",
        "ms_p50": timing.p50, "ms_p20": timing.p20, "ms_p80": timing.p80,
        "floor_bytes": moved,
        "gbps": moved / (timing.p50 * 1e-3) / 1e9,  # on the floor's bytes: comparable across providers
        "floor_ms": floor_ms,
        "pct_of_floor": 100.0 * floor_ms / timing.p50,
        "speedup_vs_torch": torch_ms / timing.p50 if torch_ms is not None else float("nan"),
    }


def buffers(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda scale: torch.randn(n, device=device, generator=gen) * scale  # noqa: E731
    return dict(param=make(1.0), grad=make(1.0), pre=make(1.0), sw=make(1.0), smom=make(0.01),
                sync_mom=torch.zeros(n, device=device))


def measure(n: int, device: torch.device, primary: str, *, tensors: int, bandwidth_gbps: float,
            cpu_reps: int, use_nvtx: bool) -> list[dict[str, object]]:
    rows = []
    timings = {}
    for provider in (primary, "torch"):
        b = buffers(n, device)
        if provider == primary:
            def fn(b=b):
                tritonopt.ops.ssd_sgd_step(b["param"], b["grad"], b["pre"], shadow_weight=b["sw"],
                                           shadow_momentum=b["smom"], **HYPER)
        else:
            lists = {k: split(v, tensors) for k, v in b.items()}

            def fn(lists=lists):
                ssd_sgd_step_composite(lists["param"], lists["grad"], lists["pre"], lists["sw"],
                                       lists["smom"], **HYPER)
        call = with_range(f"tritonopt/bench/{STEP_OP}/{provider}", fn, use_nvtx)
        with backend_for(provider, primary):
            timings[provider] = bench.time_ms(call, device, cpu_reps=cpu_reps)
        del b
    moved = STEP_FLOOR_BYTES * n
    floor_ms = moved / (bandwidth_gbps * 1e9) * 1e3
    timings["floor"] = bench.Timing(floor_ms, floor_ms, floor_ms)
    rows += [result_row(STEP_OP, p, t, moved, floor_ms, timings["torch"].p50, n) for p, t in timings.items()]

    b = buffers(n, device)

    def pulled():
        # The sums stay finite under repetition: the scale 1/4 only shrinks them.
        tritonopt.ops.ssd_sgd_step(b["param"], b["grad"], b["pre"], shadow_weight=b["sw"],
                                   shadow_momentum=b["smom"], sync_momentum=b["sync_mom"], pulled=True,
                                   shadow_scale=0.25, **HYPER)
    with backend_for(primary, primary):
        timing = bench.time_ms(with_range(f"tritonopt/bench/{PULLED_OP}/{primary}", pulled, use_nvtx),
                               device, cpu_reps=cpu_reps)
    moved = PULLED_FLOOR_BYTES * n
    floor_ms = moved / (bandwidth_gbps * 1e9) * 1e3
    rows.append(result_row(PULLED_OP, primary, timing, moved, floor_ms, None, n))
    rows.append(result_row(PULLED_OP, "floor", bench.Timing(floor_ms, floor_ms, floor_ms), moved, floor_ms,
                           None, n))
    return rows


def table(rows: list[dict[str, object]], primary: str) -> str:
    by_n: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_n.setdefault(row["n"], {})[f"{row['op']}/{row['provider']}"] = row
    headers = ["n", f"{primary} ms", "torch ms", "floor ms", f"{primary} % of floor bw",
               "torch % of floor bw", f"{primary} vs torch", f"pulled {primary} % of floor bw"]
    lines = []
    for n, r in by_n.items():
        lead, comp = r[f"{STEP_OP}/{primary}"], r[f"{STEP_OP}/torch"]
        lines.append([n, lead["ms_p50"], comp["ms_p50"], lead["floor_ms"], lead["pct_of_floor"],
                      comp["pct_of_floor"], f"{lead['speedup_vs_torch']:.2f}x",
                      r[f"{PULLED_OP}/{primary}"]["pct_of_floor"]])
    return bench.format_table(headers, lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Time tritonopt's fused SSD-SGD step against a foreach composite and its memory floor.")
    parser.add_argument("--elements", type=bench.positive_int, nargs="+", default=None, metavar="N",
                        help="flat buffer lengths (default: 1e6 5e6 25557032 1e8 on a GPU, 1e5 1e6 on the CPU)")
    parser.add_argument("--tensors", type=bench.positive_int, default=TENSORS,
                        help=f"tensors in the composite's parameter list (default {TENSORS}, ResNet-50's count)")
    parser.add_argument("--nvtx", action="store_true",
                        help="wrap each measured call in an NVTX range tritonopt/bench/<op>/<provider>")
    parser.add_argument("--smoke", action="store_true",
                        help=f"n = {SMOKE_ELEMENTS[0]}, {SMOKE_REPS} CPU repetitions: checks the script runs")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="results folder (default: perf/results/<device>/)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = bench.cuda_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu and HAS_TRITON:
        primary = "triton"
    elif on_gpu:
        primary = "reference"
        print("Triton is not importable: timing the reference path on the GPU instead")
    else:
        primary = "reference"
        print(NO_CUDA_MESSAGE)
    if args.nvtx and importlib.util.find_spec("nvtx") is None:
        print("--nvtx: the nvtx package is not installed, so no ranges will be emitted")

    if args.smoke:
        elements, cpu_reps = SMOKE_ELEMENTS, SMOKE_REPS
    else:
        elements, cpu_reps = (GPU_ELEMENTS if on_gpu else CPU_ELEMENTS), CPU_REPS
        if args.elements is not None:
            elements = tuple(args.elements)

    bandwidth = bench.measure_bandwidth_gbps(device, cpu_reps=cpu_reps)
    print(f"{STEP_OP}, device: {bench.device_name()}")
    print(f"measured copy bandwidth: {bandwidth:.1f} GB/s (floor = minimal bytes / this)")
    print(f"floor bytes: {STEP_FLOOR_BYTES} n (common step), {PULLED_FLOOR_BYTES} n (after a pull), float32")

    rows: list[dict[str, object]] = []
    for n in elements:
        try:
            rows += measure(n, device, primary, tensors=args.tensors, bandwidth_gbps=bandwidth,
                            cpu_reps=cpu_reps, use_nvtx=args.nvtx)
        except torch.cuda.OutOfMemoryError:
            print(f"skipped n={n}: out of GPU memory")
        if on_gpu:
            torch.cuda.empty_cache()
    print()
    print(table(rows, primary))
    print()
    out_dir = args.out if args.out is not None else bench.default_results_dir()
    print(f"wrote {bench.write_results(rows, out_dir, CSV_STEM)}")
    suffix = "" if on_gpu else "\nCPU reference path: not representative of GPU speed"
    bench.save_plot(rows, Path(out_dir) / f"{CSV_STEM}.png", x="n", y="gbps", series=("op", "provider"),
                    title=f"SSD-SGD step, {bench.device_name()}" + suffix, xlabel="n (elements)",
                    ylabel="GB/s on the floor's bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
