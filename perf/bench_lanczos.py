"""Benchmark the FOSI / DHO2 ops (Lanczos Gram-Schmidt projection, fused FOSI step) against their floors.

Two ops, each against the fastest eager-PyTorch composite of the same math and
against its memory floor (the bytes it cannot avoid moving divided by the
measured copy bandwidth of the device):

``gram_schmidt_project`` (one Lanczos iteration's re-orthogonalisation, Gu et
al. Alg. 1 line 8 / Alg. 2 lines 9-12), basis ``D: [m, n]``, all ``m`` rows
taking part (the last and most expensive iteration), ``passes`` rounds
(2 = CGS2, the default, as in Lanczos)::

    per pass:  coef = D @ h ;  h = h - D^T coef          then  sq = h . h

* ``triton``: the public op :func:`tritonopt.ops.gram_schmidt_project` with the
  Triton backend (argument checks and dispatch included, as users call it);
* ``torch``: :func:`gram_schmidt_composite` (``mv`` + ``addmv`` per pass, cuBLAS);
* ``floor``: ``passes * (2 m + 3) * n * itemsize`` bytes. Within a pass the
  subtraction needs every coefficient, which needs all of ``h``: a grid-wide
  dependency, so ``D`` is read twice per pass; ``h`` is read by both halves and
  the result written once (``3 n``). The ``m``-sized coefficient traffic is
  left out. When ``m n itemsize`` fits in the GPU's L2 cache the second read
  can hit it and the op can beat this floor.

``fosi_step`` (one FOSI-Adam update of a flat parameter vector, Gu et al. eqs.
11-12), basis ``V: [r, n]`` with ``r = k + l`` orthonormal-ish rows::

    c = V g ; g2 = g - V^T c ; u = Adam(g2) ; e = V u ; w += b u - V^T (s c + b e)

* ``triton``: the public op :func:`tritonopt.ops.fosi_step` (three passes over ``V``);
* ``torch``: :func:`fosi_step_composite`, unfused eager ops (four reads of ``V``);
* ``floor``: ``(3 r + 10) * n * 4`` bytes. ``e`` needs ``u``, which needs
  ``c`` (a reduction over all of ``n``), and the last correction needs all of
  ``e``: two grid-wide dependencies, so ``V`` is read three times. Vector
  traffic: ``g`` read twice (for ``c`` and for ``g2``), Adam's two moments read
  and written (``4 n``), ``w`` (or a stored ``u``) read and written twice (``4 n``).

Every op is timed on the same buffers call after call (the FOSI step keeps
updating ``w`` and the moments; the work per call does not change).

Without a CUDA device the script says so, times the plain-PyTorch reference
(provider ``reference``, the same public ops with the reference backend) and the
``torch`` composites on small sizes only, and labels the results ``cpu``. Those
numbers say nothing about GPU speed.

Results: tables on stdout, ``lanczos.csv`` (both ops, long form, column ``op``),
``lanczos_gram_schmidt.png`` and ``lanczos_fosi_step.png`` (GB/s on the floor's
bytes against ``n``) in ``perf/results/<device>/`` or ``--out DIR``.

Run from the repository root::

    python perf/bench_lanczos.py [--smoke] [--nvtx] [--dtypes fp32 fp64] [--passes 2]
                                 [--elements 1000000 50000000] [--out DIR]
    nsys profile -t nvtx,cuda python perf/bench_lanczos.py --nvtx
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
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
from tritonopt.kernels.fosi_step import adam_scalars

CSV_STEM = "lanczos"
GS_OP = "gram_schmidt_project"
FOSI_OP = "fosi_step"
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}

GPU_ELEMENTS = (1_000_000, 5_000_000, 10_000_000, 50_000_000)
GPU_BASIS_ROWS = (24, 48, 96)  # m: Lanczos iterations (4 (k + l) with k + l up to 24)
GPU_RANKS = (8, 24)  # r = k + l
# The CPU paths are slow and not the subject: keep the CPU sweep short.
CPU_ELEMENTS = (100_000, 1_000_000)
CPU_BASIS_ROWS = (24,)
CPU_RANKS = (8, 24)
SMOKE_ELEMENTS = (20_000,)
SMOKE_BASIS_ROWS = (8,)
SMOKE_RANKS = (4,)
SMOKE_REPS = 3
CPU_REPS = 10

# Adam hyperparameters of the FOSI step (the values do not change the work).
LR, BETA1, BETA2, EPS, ADAM_STEP, ALPHA = 1e-3, 0.9, 0.999, 1e-8, 10, 0.1

NO_CUDA_MESSAGE = (
    "no CUDA device: timing the reference path only (not representative of GPU speed)"
)


# --------------------------------------------------------------------------- composites


def gram_schmidt_composite(
    basis: torch.Tensor, h: torch.Tensor, num_rows: int, passes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager-PyTorch classical Gram-Schmidt, ``passes`` rounds: the speed baseline.

    Returns ``(h_orth, coefficients summed over the passes, ||h_orth||^2)`` like the op.
    """
    rows = basis[:num_rows]
    coef_total = None
    for _ in range(passes):
        coef = rows @ h
        h = torch.addmv(h, rows.t(), coef, alpha=-1.0)
        coef_total = coef if coef_total is None else coef_total + coef
    return h, coef_total, torch.dot(h, h)


def fosi_step_composite(
    param: torch.Tensor,
    grad: torch.Tensor,
    basis: torch.Tensor,
    newton_scale: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    base_scale: float = 1.0,
) -> None:
    """Eager-PyTorch FOSI-Adam step, in place: the speed baseline (four reads of ``basis``).

    ``w += b u - V^T (s c + b e)`` with ``c = V g``, ``u = Adam(g - V^T c)``, ``e = V u``.
    """
    coef = basis @ grad
    g2 = torch.addmv(grad, basis.t(), coef, alpha=-1.0)
    exp_avg.lerp_(g2, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g2, g2, value=1.0 - beta2)
    step_size, bc2_sqrt = adam_scalars(lr, beta1, beta2, step)
    update = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps)  # the denominator, reused as u's buffer
    torch.div(exp_avg, update, out=update).mul_(-step_size)
    projection = basis @ update
    param.add_(update, alpha=base_scale)
    param.addmv_(basis.t(), newton_scale * coef + base_scale * projection, alpha=-1.0)


# --------------------------------------------------------------------------- floors


def gram_schmidt_floor_bytes(n: int, num_rows: int, passes: int, itemsize: int) -> int:
    """Bytes the projection cannot avoid: per pass, D read twice, h read twice, h_orth written."""
    return passes * (2 * num_rows + 3) * n * itemsize


def fosi_step_floor_bytes(n: int, rank: int, itemsize: int = 4) -> int:
    """Bytes a FOSI-Adam step cannot avoid: V read three times, g twice, moments and w (or u) 4n each."""
    return (3 * rank + 10) * n * itemsize


# --------------------------------------------------------------------------- inputs


def random_basis(rows: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rows ~ N(0, I / n): unit length and mutually orthogonal up to O(1/sqrt(n)), like a Lanczos basis.

    An exactly orthonormal basis (QR) would cost more than the benchmark at n = 5e7
    and changes nothing in the work done.
    """
    basis = torch.randn(rows, n, dtype=dtype, device=device)
    return basis.mul_(1.0 / math.sqrt(n))


def with_range(name: str, fn: Callable[[], object], use_nvtx: bool) -> Callable[[], object]:
    if not use_nvtx:
        return fn

    def call():
        with nvtx_range(name):
            return fn()

    return call


def backend_for(provider: str, primary: str):
    """The public op runs the primary provider's backend (forced, whatever TRITON_INTERPRET says)."""
    return tritonopt.use_backend(primary) if provider == primary else contextlib.nullcontext()


def result_row(op, provider, timing, moved, floor_ms, torch_ms, **shape) -> dict[str, object]:
    return {
        "op": op,
        "provider": provider,
        **shape,
        "ms_p50": timing.p50,
        "ms_p20": timing.p20,
        "ms_p80": timing.p80,
        "floor_bytes": moved,
        # Effective bandwidth on the floor's bytes: comparable across providers.
        "gbps": moved / (timing.p50 * 1e-3) / 1e9,
        "floor_ms": floor_ms,
        "pct_of_floor": 100.0 * floor_ms / timing.p50,
        "speedup_vs_torch": torch_ms / timing.p50,
    }


# --------------------------------------------------------------------------- measuring


def measure_gram_schmidt(
    n: int, num_rows: int, dtype: torch.dtype, passes: int, device: torch.device, primary: str,
    *, bandwidth_gbps: float, cpu_reps: int, use_nvtx: bool,
) -> list[dict[str, object]]:
    basis = random_basis(num_rows, n, dtype, device)
    h = torch.randn(n, dtype=dtype, device=device)
    moved = gram_schmidt_floor_bytes(n, num_rows, passes, basis.element_size())
    floor_ms = moved / (bandwidth_gbps * 1e9) * 1e3
    calls = {
        primary: lambda: tritonopt.ops.gram_schmidt_project(basis, h, num_rows, passes),
        "torch": lambda: gram_schmidt_composite(basis, h, num_rows, passes),
    }
    timings = {}
    for provider, fn in calls.items():
        call = with_range(f"tritonopt/bench/{GS_OP}/{provider}", fn, use_nvtx)
        with backend_for(provider, primary):
            timings[provider] = bench.time_ms(call, device, cpu_reps=cpu_reps)
    timings["floor"] = bench.Timing(p50=floor_ms, p20=floor_ms, p80=floor_ms)
    shape = dict(n=n, rows=num_rows, dtype=str(dtype).removeprefix("torch."), passes=passes)
    return [result_row(GS_OP, p, t, moved, floor_ms, timings["torch"].p50, **shape) for p, t in timings.items()]


def measure_fosi_step(
    n: int, rank: int, device: torch.device, primary: str,
    *, bandwidth_gbps: float, cpu_reps: int, use_nvtx: bool,
) -> list[dict[str, object]]:
    basis = random_basis(rank, n, torch.float32, device)
    grad = torch.randn(n, device=device)
    newton_scale = ALPHA / (1.0 + torch.rand(rank, device=device))
    moved = fosi_step_floor_bytes(n, rank)
    floor_ms = moved / (bandwidth_gbps * 1e9) * 1e3
    hyper = dict(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, step=ADAM_STEP)

    def buffers():
        return torch.zeros(n, device=device), torch.zeros(n, device=device), torch.full((n,), 1e-4, device=device)

    timings = {}
    for provider in (primary, "torch"):
        param, exp_avg, exp_avg_sq = buffers()
        if provider == primary:
            def fn():
                tritonopt.ops.fosi_step(param, grad, basis, newton_scale, base="adam",
                                        state_a=exp_avg, state_b=exp_avg_sq, **hyper)
        else:
            def fn():
                fosi_step_composite(param, grad, basis, newton_scale, exp_avg, exp_avg_sq, **hyper)
        call = with_range(f"tritonopt/bench/{FOSI_OP}/{provider}", fn, use_nvtx)
        with backend_for(provider, primary):
            timings[provider] = bench.time_ms(call, device, cpu_reps=cpu_reps)
        del param, exp_avg, exp_avg_sq
    timings["floor"] = bench.Timing(p50=floor_ms, p20=floor_ms, p80=floor_ms)
    shape = dict(n=n, rows=rank, dtype="float32", passes="")
    return [result_row(FOSI_OP, p, t, moved, floor_ms, timings["torch"].p50, **shape) for p, t in timings.items()]


# --------------------------------------------------------------------------- reporting


def op_table(rows: list[dict[str, object]], op: str, primary: str, rows_label: str) -> str:
    """One line per shape: time per provider, then the primary provider vs the floor and torch."""
    mine = [r for r in rows if r["op"] == op]
    providers = list(dict.fromkeys(str(r["provider"]) for r in mine))
    by_shape: dict[tuple, dict[str, dict[str, object]]] = {}
    for row in mine:
        by_shape.setdefault((row["n"], row["rows"], row["dtype"]), {})[str(row["provider"])] = row
    headers = ["n", rows_label, "dtype"] + [f"{p} ms" for p in providers]
    headers += [f"{primary} GB/s", "% of floor bw", "torch % of floor bw", f"{primary} vs torch"]
    lines = []
    for shape, per_provider in by_shape.items():
        lead = per_provider[primary]
        lines.append(
            [*shape]
            + [per_provider[p]["ms_p50"] for p in providers]
            + [lead["gbps"], lead["pct_of_floor"], per_provider["torch"]["pct_of_floor"],
               f"{lead['speedup_vs_torch']:.2f}x"]
        )
    return bench.format_table(headers, lines)


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time tritonopt's gram_schmidt_project and fosi_step against plain-torch "
        "composites and their memory floors.",
    )
    parser.add_argument(
        "--elements", type=bench.positive_int, nargs="+", default=None, metavar="N",
        help="vector lengths n to sweep (default: 1e6 5e6 1e7 5e7 on a GPU, 1e5 1e6 on the CPU)",
    )
    parser.add_argument(
        "--dtypes", choices=sorted(DTYPES), nargs="+", default=["fp32", "fp64"],
        help="basis dtypes of the Gram-Schmidt projection (default: fp32 fp64); the FOSI step is fp32",
    )
    parser.add_argument(
        "--passes", type=int, choices=(1, 2, 3), default=2,
        help="Gram-Schmidt rounds per projection: 1 = CGS (paper), 2 = CGS2 (default, as Lanczos runs)",
    )
    parser.add_argument(
        "--nvtx", action="store_true",
        help="wrap each measured call in an NVTX range tritonopt/bench/<op>/<provider>",
    )
    parser.add_argument(
        "--smoke", action="store_true",
        help=f"tiny sizes (n = {SMOKE_ELEMENTS[0]}, m = {SMOKE_BASIS_ROWS[0]}, r = {SMOKE_RANKS[0]}), "
        f"{SMOKE_REPS} CPU repetitions: checks the script runs, in seconds",
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="results folder (default: perf/results/<device>/)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = bench.cuda_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 against fp32

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
        elements, basis_rows, ranks, cpu_reps = SMOKE_ELEMENTS, SMOKE_BASIS_ROWS, SMOKE_RANKS, SMOKE_REPS
    elif on_gpu:
        elements, basis_rows, ranks, cpu_reps = GPU_ELEMENTS, GPU_BASIS_ROWS, GPU_RANKS, CPU_REPS
    else:
        elements, basis_rows, ranks, cpu_reps = CPU_ELEMENTS, CPU_BASIS_ROWS, CPU_RANKS, CPU_REPS
    if args.elements is not None and not args.smoke:
        elements = tuple(args.elements)

    bandwidth = bench.measure_bandwidth_gbps(device, cpu_reps=cpu_reps)
    print(f"{GS_OP} and {FOSI_OP}, device: {bench.device_name()}")
    print(f"measured copy bandwidth: {bandwidth:.1f} GB/s (floor = minimal bytes / this)")
    print(f"{GS_OP} floor bytes = passes * (2 m + 3) * n * itemsize  (passes = {args.passes})")
    print(f"{FOSI_OP} floor bytes = (3 r + 10) * n * 4  (Adam base, fp32)")

    common = dict(bandwidth_gbps=bandwidth, cpu_reps=cpu_reps, use_nvtx=args.nvtx)
    jobs: list[tuple[str, Callable[[], list[dict[str, object]]]]] = []
    for n in elements:
        for dtype_name in args.dtypes:
            for m in basis_rows:
                jobs.append((f"{GS_OP} n={n} m={m} {dtype_name}",
                             lambda n=n, m=m, d=DTYPES[dtype_name]: measure_gram_schmidt(
                                 n, m, d, args.passes, device, primary, **common)))
        for r in ranks:
            jobs.append((f"{FOSI_OP} n={n} r={r}",
                         lambda n=n, r=r: measure_fosi_step(n, r, device, primary, **common)))

    rows: list[dict[str, object]] = []
    for label, job in jobs:
        try:
            rows += job()
        except torch.cuda.OutOfMemoryError:
            print(f"skipped {label}: out of GPU memory")
        if on_gpu:
            torch.cuda.empty_cache()

    print()
    print(f"{GS_OP} (D: [m, n], all m rows, {args.passes} pass(es))")
    print(op_table(rows, GS_OP, primary, "m"))
    print()
    print(f"{FOSI_OP} (V: [r, n], Adam base)")
    print(op_table(rows, FOSI_OP, primary, "r"))
    print()

    out_dir = args.out if args.out is not None else bench.default_results_dir()
    csv_path = bench.write_results(rows, out_dir, CSV_STEM)
    print(f"wrote {csv_path}")
    suffix = "" if on_gpu else "\nCPU reference path: not representative of GPU speed"
    plots = (
        (GS_OP, "lanczos_gram_schmidt.png", ("provider", "rows", "dtype"),
         f"{GS_OP}, {args.passes} pass(es), {bench.device_name()}"),
        (FOSI_OP, "lanczos_fosi_step.png", ("provider", "rows"), f"{FOSI_OP} (Adam), {bench.device_name()}"),
    )
    for op, filename, series, title in plots:
        op_rows = [r for r in rows if r["op"] == op]
        if not op_rows:
            continue
        if bench.save_plot(
            op_rows, Path(out_dir) / filename, x="n", y="gbps", series=series,
            title=title + suffix, xlabel="n (vector length)", ylabel="GB/s on the floor's bytes",
        ) is None:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
