"""Benchmark the fused momentum-SGD stage update (``tritonopt.ops.sgd_momentum_step``) against torch.

What is measured, per flat buffer of ``n`` elements (2^16 to 2^26; a ResNet-164
block at K = 4 holds about 2^19 parameters, a ResNet-50 block at K = 3 about
2^23), momentum 0.9, weight decay 1e-4, float32:

* ``triton``: the launcher ``sgd_momentum_step_triton`` (one pass: read ``w``,
  ``g``, ``buf``; write ``w``, ``buf``);
* ``torch``: the composite, ``sgd_momentum_step_reference`` (the operations of
  ``torch.optim.SGD``'s single-tensor step on the flat buffer, one pass each);
* ``torch_sgd_foreach`` and, on CUDA, ``torch_sgd_fused``: ``torch.optim.SGD``
  with ``foreach=True`` / ``fused=True`` stepping the same buffer as one
  parameter (what a user gets from torch);
* ``floor``: ``n * (16 + sizeof(g))`` bytes divided by the measured copy bandwidth.

Without a CUDA device the script says so and times the reference and
``torch.optim.SGD`` (``foreach=False``) on the CPU at up to 2^22 elements; those
numbers say nothing about GPU speed.

Results: a table on stdout, ``sgd_momentum.csv`` and ``sgd_momentum.png`` in
``perf/results/<device>/`` or ``--out DIR``.

    python perf/bench_sgd_momentum.py [--smoke] [--nvtx] [--grad-dtype fp32|fp16|bf16] [--out DIR]
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
from tritonopt.kernels.sgd_momentum import sgd_momentum_step_reference, sgd_momentum_step_triton

OP = "sgd_momentum"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LOG2_RANGE = (16, 26)
CPU_MAX_LOG2 = 22
SMOKE_N = 1 << 12
SMOKE_REPS = 3
CPU_REPS = 10
LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 1e-4
NO_CUDA_MESSAGE = "no CUDA device: timing the reference path only (not representative of GPU speed)"


def floor_bytes(n: int, grad_bytes: int) -> int:
    """Read w, g, buf and write w, buf: ``n * (4 + g + 4 + 4 + 4)``."""
    return n * (16 + grad_bytes)


def op_call(fn: Callable, w: torch.Tensor, g: torch.Tensor, buf: torch.Tensor) -> Callable[[], None]:
    """A step of ``fn`` (launcher or reference) with the benchmark's hyperparameters, after the first step."""
    return lambda: fn(w, g, buf, LR, MOMENTUM, 0.0, WEIGHT_DECAY, False, False, False)


def torch_sgd_call(w: torch.Tensor, g: torch.Tensor, **impl) -> Callable[[], None]:
    param = torch.nn.Parameter(w)
    param.grad = g if g.dtype == w.dtype else g.to(w.dtype)
    opt = torch.optim.SGD([param], lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, **impl)
    opt.step()  # creates the momentum buffer: the timed steps are all "later" steps
    return opt.step


def providers_for(device: torch.device) -> dict[str, Callable]:
    """name -> builder(w, g, buf) of the timed call."""
    if device.type == "cuda":
        providers = {}
        if HAS_TRITON:
            providers["triton"] = lambda w, g, buf: op_call(sgd_momentum_step_triton, w, g, buf)
        providers["torch"] = lambda w, g, buf: op_call(sgd_momentum_step_reference, w, g, buf)
        providers["torch_sgd_foreach"] = lambda w, g, buf: torch_sgd_call(w, g, foreach=True)
        providers["torch_sgd_fused"] = lambda w, g, buf: torch_sgd_call(w, g, fused=True)
        return providers
    return {
        "reference": lambda w, g, buf: op_call(sgd_momentum_step_reference, w, g, buf),
        "torch_sgd": lambda w, g, buf: torch_sgd_call(w, g, foreach=False),
    }


def measure(n, grad_dtype, device, providers, *, bandwidth_gbps, cpu_reps, use_nvtx) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(n, generator=gen).to(device)
    g = (torch.randn(n, generator=gen) * 1e-3).to(device=device, dtype=grad_dtype)
    moved = floor_bytes(n, g.element_size())
    floor_ms = moved / (bandwidth_gbps * 1e9) * 1e3
    timings = {}
    for name, build in providers.items():
        call = build(w0.clone(), g, torch.zeros_like(w0))
        if use_nvtx:
            inner, range_name = call, f"tritonopt/bench/{OP}/{name}"

            def call(inner=inner, range_name=range_name):
                with nvtx_range(range_name):
                    inner()

        timings[name] = bench.time_ms(call, device, cpu_reps=cpu_reps)
    timings["floor"] = bench.Timing(p50=floor_ms, p20=floor_ms, p80=floor_ms)
    baseline = timings["torch" if "torch" in timings else "torch_sgd"].p50
    return [
        {
            "op": OP, "provider": name, "elements": n, "grad_dtype": str(grad_dtype).removeprefix("torch."),
            "ms_p50": t.p50, "ms_p20": t.p20, "ms_p80": t.p80,
            "gbps": moved / (t.p50 * 1e-3) / 1e9, "floor_ms": floor_ms,
            "pct_of_floor": 100.0 * floor_ms / t.p50, "speedup_vs_torch": baseline / t.p50,
        }
        for name, t in timings.items()
    ]


def table(rows: list[dict], primary: str) -> str:
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    by_n: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_n.setdefault(r["elements"], {})[r["provider"]] = r
    headers = ["elements"] + [f"{p} ms" for p in providers] + [f"{primary} GB/s", "% of bw", f"{primary} vs torch"]
    lines = []
    for n, per in by_n.items():
        lead = per[primary]
        lines.append([n] + [per[p]["ms_p50"] for p in providers]
                     + [lead["gbps"], lead["pct_of_floor"], f"{lead['speedup_vs_torch']:.2f}x"])
    return bench.format_table(headers, lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Time tritonopt's fused momentum-SGD step against torch.optim.SGD and the memory floor."
    )
    parser.add_argument("--grad-dtype", choices=sorted(DTYPES), default="fp32", help="gradient dtype (default fp32)")
    parser.add_argument("--nvtx", action="store_true", help=f"wrap each call in an NVTX range tritonopt/bench/{OP}/<provider>")
    parser.add_argument("--smoke", action="store_true", help=f"one size ({SMOKE_N}), {SMOKE_REPS} CPU repetitions")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results folder (default perf/results/<device>/)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    grad_dtype = DTYPES[args.grad_dtype]
    on_gpu = bench.cuda_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if not on_gpu:
        print(NO_CUDA_MESSAGE)
    elif not HAS_TRITON:
        print("Triton is not importable: timing the torch paths only")
    if args.nvtx and importlib.util.find_spec("nvtx") is None:
        print("--nvtx: the nvtx package is not installed, so no ranges will be emitted")
    providers = providers_for(device)
    primary = next(iter(providers))
    if args.smoke:
        sizes, cpu_reps = [SMOKE_N], SMOKE_REPS
    else:
        top = LOG2_RANGE[1] if on_gpu else CPU_MAX_LOG2
        sizes, cpu_reps = [1 << k for k in range(LOG2_RANGE[0], top + 1, 2)], CPU_REPS
    bandwidth = bench.measure_bandwidth_gbps(device, cpu_reps=cpu_reps)
    print(f"{OP}: momentum {MOMENTUM}, weight decay {WEIGHT_DECAY}, grad {args.grad_dtype}, device: {bench.device_name()}")
    print(f"measured copy bandwidth: {bandwidth:.1f} GB/s (floor = minimal bytes / this)")
    rows = []
    for n in sizes:
        rows += measure(n, grad_dtype, device, providers, bandwidth_gbps=bandwidth, cpu_reps=cpu_reps,
                        use_nvtx=args.nvtx)
        if on_gpu:
            torch.cuda.empty_cache()
    print()
    print(table(rows, primary))
    print()
    out_dir = args.out if args.out is not None else bench.default_results_dir()
    print(f"wrote {bench.write_results(rows, out_dir, OP)}")
    title = f"{OP}, grad {args.grad_dtype}, {bench.device_name()}"
    if not on_gpu:
        title += "\nCPU reference path: not representative of GPU speed"
    bench.save_plot(rows, Path(out_dir) / f"{OP}.png", x="elements", y="gbps", series=("provider",), title=title,
                    xlabel="elements", ylabel="GB/s on the floor's bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
