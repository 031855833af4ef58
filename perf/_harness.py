"""The one harness of the ``perf/`` scripts: command line, device, timing, floors, providers,
NVTX, results (CSV, plot, table) and the claims the experiments check.

A benchmark (``perf/bench_<op>.py``) describes only its cases: for each shape, the inputs, the
providers that compute the op and the floor, the bytes or flops the op cannot avoid. It hands
them to :func:`run_benchmark`, which times every provider on the same inputs, divides the floor
by the device's measured bandwidth or matrix throughput, prints one table, and writes one CSV and
one plot through :func:`write_results` and :func:`save_plot`, the writers every script uses.

Providers, per case (the ones a case declares):

* ``triton``: the Triton launcher of the kernel alone (on a CUDA device with Triton);
* ``reference``: the plain-PyTorch reference of the op (everywhere else);
* ``op/<backend>``: the public op, ``tritonopt.ops.<op>``, run under
  ``tritonopt.use_backend(<backend>)``, argument checks and dispatch included, as users call it;
* ``torch``: the fastest eager-PyTorch composite of the same math, the baseline of the speed-ups;
* ``floor``: the floor's time, a lower bound on any provider's.

Nothing here queries CUDA at import time, and matplotlib is imported only to plot, so this
module imports on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib.util
import math
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

import tritonopt

PERF_DIR = Path(__file__).resolve().parent
REPO_ROOT = PERF_DIR.parent
RESULTS_DIR = PERF_DIR / "results"
# Untracked (perf/.gitignore): the demo's default output and every smoke run.
LOCAL_RESULTS_DIR = RESULTS_DIR / "local"

# Columns describing where and with what a result was taken; appended to every CSV row.
ENVIRONMENT_COLUMNS = ("device", "torch_version", "triton_version", "git_sha", "timestamp")

NO_CUDA_MESSAGE = (
    "no CUDA device: timing the reference path only (not representative of GPU speed)"
)
CPU_PLOT_NOTE = "\nCPU reference path: not representative of GPU speed"


# --------------------------------------------------------------------------- device


def cuda_available() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cuda" if cuda_available() else "cpu")


def device_name() -> str:
    """Human-readable name of the machine the numbers come from."""
    if cuda_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine() or 'unknown arch'}, {torch.get_num_threads()} threads)"


def cpu_model() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), or the architecture where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown processor"


def device_label() -> str:
    """Filesystem-safe results folder name: the slugified CUDA device name, else ``"cpu"``."""
    if not cuda_available():
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return slug or "cuda"


def primary_backend(device: torch.device) -> str:
    """``"triton"`` where the Triton kernels run natively (a CUDA device), else ``"reference"``.

    The CPU never counts as Triton here, even under ``TRITON_INTERPRET=1``: interpreted
    kernels are a correctness tool, their times say nothing.
    """
    if device.type != "cuda":
        return "reference"
    return tritonopt.select_backend(device)


def announce_primary(device: torch.device, primary: str) -> None:
    if device.type != "cuda":
        print(NO_CUDA_MESSAGE)
    elif primary != "triton":
        print("the Triton backend is unavailable on this GPU: timing the reference path instead")


def training_step_device() -> tuple[torch.device, str]:
    """The device and primary backend of the optimizer-step benchmarks, announced.

    On the CPU they run on one thread: their models are small, and more threads only add
    synchronisation, and noise.
    """
    device = default_device()
    if device.type == "cpu":
        torch.set_num_threads(1)
    primary = primary_backend(device)
    announce_primary(device, primary)
    return device, primary


def entries_per_block(density: float, block_size: int) -> int:
    """``k = ceil(density * block_size)``, at least 1: the entries a blockwise Top-k keeps.

    The same rule as the optimizers' ``density`` argument (rounded first, so that 0.07 * 100
    keeps 7, not 8).
    """
    return max(1, math.ceil(round(density * block_size, 9)))


# --------------------------------------------------------------------------- output folders


def output_dir(out: Optional[Path], default: Path, *, smoke: bool, name: str) -> Path:
    """Where a script writes: ``--out`` if given; a smoke run under ``perf/results/local/smoke/<name>/``
    (so that it never overwrites real results); else ``default``."""
    if out is not None:
        return Path(out)
    if smoke:
        return LOCAL_RESULTS_DIR / "smoke" / name
    return default


def device_results_dir() -> Path:
    """Benchmarks' default folder: ``perf/results/<device_label()>/``."""
    return RESULTS_DIR / device_label()


# --------------------------------------------------------------------------- command line


def positive_int(text: str) -> int:
    """``argparse`` type: a positive integer, also written as ``1e6``."""
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def fraction(text: str) -> float:
    """``argparse`` type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def script_parser(description: str, *, smoke_help: str, default_out: str) -> argparse.ArgumentParser:
    """The arguments every perf script takes: ``--smoke`` and ``--out``.

    Help strings go through ``%`` formatting: write a literal percent sign as ``%%``.
    """
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help=f"results folder (default: {default_out}; with --smoke: "
        "perf/results/local/smoke/<script>/, never committed)",
    )
    return parser


def bench_parser(description: str, *, smoke_help: str) -> argparse.ArgumentParser:
    """:func:`script_parser` plus ``--nvtx``, for the benchmarks."""
    parser = script_parser(description, smoke_help=smoke_help, default_out="perf/results/<device>/")
    parser.add_argument(
        "--nvtx", action="store_true",
        help="wrap each measured call in an NVTX range tritonopt/bench/<op>/<provider> "
        "(for nsys profile -t nvtx,cuda)",
    )
    return parser


# --------------------------------------------------------------------------- NVTX


def nvtx_enabled(requested: bool, device: torch.device) -> bool:
    """Whether ``--nvtx`` ranges will be emitted; says why not, or what they cover, when asked for."""
    if not requested:
        return False
    if importlib.util.find_spec("nvtx") is None:
        print("--nvtx: the nvtx package is not installed (pip install nvtx): no ranges will be emitted")
        return False
    if device.type != "cuda":
        print("--nvtx: no CUDA device: the ranges mark the CPU reference path, and only a profiler "
              "attached to this process (nsys profile -t nvtx) records them")
    return True


def with_range(name: str, fn: Callable[[], object], enabled: bool) -> Callable[[], object]:
    """``fn`` wrapped in the NVTX range ``name`` when ``enabled``."""
    if not enabled:
        return fn

    def call():
        with tritonopt.nvtx_range(name):
            return fn()

    return call


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """Run time of one call in milliseconds: median and the 20th/80th percentiles."""

    p50: float
    p20: float
    p80: float

    @classmethod
    def constant(cls, ms: float) -> "Timing":
        return cls(ms, ms, ms)


def _last_level_cache_bytes() -> int:
    """The CPU's largest cache, from sysfs; 32 MiB where it cannot be read."""
    largest = 0
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            largest = max(largest, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return largest or (32 << 20)


class _CacheFlush:
    """Writes a buffer twice the size of the last-level cache, evicting what the last call left there.

    On the CPU this plays the part of ``do_bench``'s L2 flush: every timed call starts with
    its operands in memory, as the memory floors assume.
    """

    _buffer: Optional[torch.Tensor] = None

    def __call__(self) -> None:
        if _CacheFlush._buffer is None:
            _CacheFlush._buffer = torch.empty(2 * _last_level_cache_bytes(), dtype=torch.uint8)
        _CacheFlush._buffer.fill_(1)


def time_ms(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    cpu_reps: int = 10,
    cpu_warmup: int = 2,
    flush_cache: bool = True,
) -> Timing:
    """Time ``fn()`` on ``device``.

    CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each run).
    CPU: a ``perf_counter`` loop of ``cpu_reps`` calls after ``cpu_warmup`` calls, the
    caches flushed before each timed call (untimed) unless ``flush_cache`` is False.

    ``fn`` is called repeatedly on the same buffers. For ops that update a buffer in place
    (an error-feedback accumulator, optimizer state) this is deliberate: the work per call
    does not depend on the values accumulated, so no per-repetition reset is needed and none
    is timed by mistake.
    """
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench  # only needed (and only usable) on a GPU

        p50, p20, p80 = do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        return Timing(p50=p50, p20=p20, p80=p80)

    if cpu_reps < 1 or cpu_warmup < 0:
        raise ValueError(f"need cpu_reps >= 1 and cpu_warmup >= 0, got {cpu_reps}, {cpu_warmup}")
    flush = _CacheFlush() if flush_cache else (lambda: None)
    for _ in range(cpu_warmup):
        fn()
    samples = []
    for _ in range(cpu_reps):
        flush()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    p50, p20, p80 = np.percentile(samples, [50, 20, 80])
    return Timing(p50=float(p50), p20=float(p20), p80=float(p80))


# --------------------------------------------------------------------------- floors


def measure_bandwidth_gbps(
    device: torch.device | str, *, nbytes: Optional[int] = None, cpu_reps: int = 10
) -> float:
    """The device's streaming bandwidth in GB/s (1e9 bytes): the faster of a copy and a read.

    The copy ``dst.copy_(src)`` moves ``2 * nbytes``; the read is a matrix-vector product
    over the same bytes viewed as ``[64, nbytes / 256]`` (BLAS gemv, the fastest read-only
    stream torch offers), ``nbytes``. A CPU's copy also reads every line it writes
    (write-allocate), a stream its count leaves out, so a read-mostly op built from gemv can
    move its bytes faster than the copy's rate: on such ops a floor on the copy's rate alone
    is no lower bound, and taking the faster of the two keeps it one. The buffers defeat
    caches: 1 GiB on CUDA, 64 MiB on the CPU (twice the largest cache where that is more).
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else max(64 << 20, 2 * _last_level_cache_bytes())
    numel = nbytes // 4 // 64 * 64
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    rows = src.view(64, -1)
    vector = torch.ones(rows.shape[1], dtype=torch.float32, device=device)
    copy = time_ms(lambda: dst.copy_(src), device, cpu_reps=cpu_reps, flush_cache=False)
    read = time_ms(lambda: rows @ vector, device, cpu_reps=cpu_reps, flush_cache=False)
    del src, dst, rows, vector
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return max(2 * numel * 4 / (copy.p50 * 1e-3), numel * 4 / (read.p50 * 1e-3)) / 1e9


def measure_matmul_tflops(device: torch.device, precision: str, reps: int) -> float:
    """Measured matrix throughput (``a @ b``, fp32) in TFLOP/s at a K-FAC kernel precision.

    ``tf32`` and ``tf32x3`` run with TF32 on, ``ieee`` with it off; ``tf32x3`` issues three
    TF32 products per product, so its throughput is a third (GPU only; the CPU has no TF32).
    """
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision != "ieee"
    try:
        timing = time_ms(lambda: a @ b, device, cpu_reps=reps, flush_cache=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    tflops = 2 * n**3 / (timing.p50 * 1e-3) / 1e12
    return tflops / 3 if precision == "tf32x3" and device.type == "cuda" else tflops


class Yardsticks:
    """The device's measured bandwidth and matrix throughput, each measured once, when first needed."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps
        self._tflops: dict[str, float] = {}

    @cached_property
    def bandwidth_gbps(self) -> float:
        value = measure_bandwidth_gbps(self.device, cpu_reps=self.reps)
        print(f"measured streaming bandwidth: {value:.1f} GB/s (the faster of a copy and a gemv read; "
              "memory floor = minimal bytes / this)")
        return value

    def tflops(self, precision: str) -> float:
        if precision not in self._tflops:
            self._tflops[precision] = measure_matmul_tflops(self.device, precision, self.reps)
            print(f"measured matrix throughput ({precision}): {self._tflops[precision]:.2f} TFLOP/s "
                  "(flop floor = flops / this)")
        return self._tflops[precision]


# --------------------------------------------------------------------------- benchmark cases

# Allocates a provider's inputs and returns the call to time (inputs freed with it).
Builder = Callable[[], Callable[[], object]]


@dataclass
class Case:
    """One op at one shape: its providers and its floor (bytes, or flops at ``precision``)."""

    op: str
    shape: dict[str, object]
    floor_bytes: Optional[int] = None
    floor_flops: Optional[float] = None
    precision: Optional[str] = None  # matrix precision of a flop floor
    triton: Optional[Builder] = None  # the Triton launcher
    reference: Optional[Builder] = None  # the plain-PyTorch reference
    public: Optional[Builder] = None  # tritonopt.ops.<op>, timed under use_backend(primary)
    torch: Optional[Builder] = None  # the eager composite: the baseline
    extra: dict[str, Builder] = field(default_factory=dict)  # e.g. a dense alternative

    def providers(self, primary: str) -> list[tuple[str, Builder, Optional[str]]]:
        """(name, builder, backend to force) in timing order; the primary's own provider first."""
        own = self.triton if primary == "triton" else self.reference
        chosen: list[tuple[str, Optional[Builder], Optional[str]]] = [
            (primary, own, None),
            (f"op/{primary}", self.public, primary),
            ("torch", self.torch, None),
        ]
        chosen += [(name, builder, None) for name, builder in self.extra.items()]
        return [(name, builder, backend) for name, builder, backend in chosen if builder is not None]


@dataclass
class BenchContext:
    """What a benchmark's ``cases`` function may consult."""

    device: torch.device
    primary: str
    smoke: bool
    reps: int
    nvtx: bool
    yardsticks: Yardsticks

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def measure_case(case: Case, context: BenchContext) -> list[dict[str, object]]:
    """One row per provider, and one for the floor: times, the rate on the floor's work,
    the percentage of the floor's speed reached and the speed-up over ``torch``."""
    if case.floor_bytes is not None:
        floor_ms = case.floor_bytes / (context.yardsticks.bandwidth_gbps * 1e9) * 1e3
        work, unit, rate_key = case.floor_bytes, 1e9, "gbps"
    elif case.floor_flops is not None:
        floor_ms = case.floor_flops / (context.yardsticks.tflops(case.precision) * 1e12) * 1e3
        work, unit, rate_key = case.floor_flops, 1e12, "tflops"
    else:
        raise ValueError(f"case {case.op} {case.shape} has no floor")

    timings: dict[str, Timing] = {}
    for name, builder, backend in case.providers(context.primary):
        call = with_range(f"tritonopt/bench/{case.op}/{name}", builder(), context.nvtx)
        forced = tritonopt.use_backend(backend) if backend else contextlib.nullcontext()
        with forced:
            timings[name] = time_ms(call, context.device, cpu_reps=context.reps)
        del call
    timings["floor"] = Timing.constant(floor_ms)
    torch_ms = timings["torch"].p50 if "torch" in timings else math.nan
    rows = []
    for name, timing in timings.items():
        row: dict[str, object] = {"op": case.op, "provider": name, **case.shape}
        if case.precision is not None:
            row["precision"] = case.precision
        row.update({
            "ms_p50": timing.p50, "ms_p20": timing.p20, "ms_p80": timing.p80,
            "floor_bytes" if rate_key == "gbps" else "floor_flops": work,
            # The rate on the floor's work: comparable across providers.
            rate_key: work / (timing.p50 * 1e-3) / unit,
            "floor_ms": floor_ms,
            "pct_of_floor": 100.0 * floor_ms / timing.p50,
            "speedup_vs_torch": torch_ms / timing.p50,
        })
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Plot:
    """A line plot of ``y`` against ``x`` over the rows of ``ops``, one line per ``series`` value.

    ``title`` is formatted with the parsed arguments (``"{dtype}"``); the device is appended.
    """

    filename: str
    ops: tuple[str, ...]
    x: str
    y: str
    series: tuple[str, ...]
    title: str
    xlabel: str
    ylabel: str


def run_benchmark(
    *,
    name: str,
    parser: argparse.ArgumentParser,
    cases: Callable[[argparse.Namespace, BenchContext], Iterable[Callable[[], Case | list[Case]]]],
    shape_columns: Sequence[str],
    plots: Sequence[Plot],
    argv: Optional[Sequence[str]] = None,
    preamble: Callable[[argparse.Namespace, BenchContext], Sequence[str]] = lambda args, ctx: (),
    extra_rows: Callable[[argparse.Namespace, BenchContext], list[dict]] = lambda args, ctx: [],
    smoke_reps: int = 3,
    reps: int = 10,
) -> int:
    """A benchmark's whole main: parse, announce, measure every case, print, write, plot.

    ``cases`` yields, per shape, a function that allocates the inputs and returns the
    :class:`Case` (or the cases sharing those inputs); it may read the parsed arguments and
    the context: device, primary provider, smoke mode. Allocating in the harness's loop keeps
    one shape's inputs alive at a time, and a shape that runs out of GPU memory is skipped
    with a message. ``extra_rows`` adds measurements that are not op cases (a training
    step); they go to the CSV and a second table.
    """
    args = parser.parse_args(argv)
    device = default_device()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 against fp32, unless a case says
    primary = primary_backend(device)
    announce_primary(device, primary)
    reps = smoke_reps if args.smoke else reps
    context = BenchContext(device, primary, args.smoke, reps, nvtx_enabled(args.nvtx, device),
                           Yardsticks(device, reps))
    print(f"{name}: device {device_name()}")
    for line in preamble(args, context):
        print(line)

    rows: list[dict[str, object]] = []
    for make in cases(args, context):
        try:
            # Allocated here, inside the try, and freed before the next: one case's inputs at a time.
            made = make()
            for case in made if isinstance(made, list) else [made]:
                rows += measure_case(case, context)
        except torch.cuda.OutOfMemoryError:
            what = getattr(make, "func", make)
            print(f"skipped {what.__name__}{tuple(getattr(make, 'args', ()))}: out of GPU memory")
        made = case = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    extra = extra_rows(args, context)

    for op in dict.fromkeys(str(r["op"]) for r in rows):
        print()
        print(op)
        print(summary_table([r for r in rows if r["op"] == op], shape_columns, primary))
    if extra:
        print()
        print(format_table(list(extra[0]), [list(r.values()) for r in extra]))
    print()

    out_dir = output_dir(args.out, device_results_dir(), smoke=args.smoke, name=name)
    print(f"wrote {write_results(rows + extra, out_dir, name)}")
    note = "" if context.on_gpu else CPU_PLOT_NOTE
    for plot in plots:
        plotted = [r for r in rows if r["op"] in plot.ops]
        if not plotted:
            continue
        if save_plot(plotted, out_dir / plot.filename, x=plot.x, y=plot.y, series=plot.series,
                     title=f"{plot.title.format(**vars(args))}, {device_name()}{note}", xlabel=plot.xlabel,
                     ylabel=plot.ylabel) is None:
            break
    return 0


def summary_table(rows: Sequence[Mapping[str, object]], shape_columns: Sequence[str], primary: str) -> str:
    """One line per shape: time per provider, then the primary provider's rate, its and torch's
    percentage of the floor's speed, and its speed-up over torch."""
    providers = list(dict.fromkeys(str(r["provider"]) for r in rows))
    by_shape: dict[tuple, dict[str, Mapping[str, object]]] = {}
    for row in rows:
        key = tuple(row.get(c, "") for c in shape_columns)
        by_shape.setdefault(key, {})[str(row["provider"])] = row
    rate_key = "gbps" if "gbps" in rows[0] else "tflops"
    rate_label = "GB/s" if rate_key == "gbps" else "TFLOP/s"
    # An op without a launcher of its own is led by the public op on the primary backend.
    lead_name = primary if primary in providers else f"op/{primary}"
    headers = list(shape_columns) + [f"{p} ms" for p in providers]
    headers += [f"{lead_name} {rate_label}", f"{lead_name} % of floor", "torch % of floor",
                f"{lead_name} vs torch"]
    lines = []
    for shape, per_provider in by_shape.items():
        lead = per_provider.get(lead_name, {})
        baseline = per_provider.get("torch", {})
        lines.append(
            [*shape]
            + [per_provider[p]["ms_p50"] if p in per_provider else math.nan for p in providers]
            + [lead.get(rate_key, math.nan), lead.get("pct_of_floor", math.nan),
               baseline.get("pct_of_floor", math.nan),
               f"{lead.get('speedup_vs_torch', math.nan):.2f}x"]
        )
    return format_table(headers, lines)


# --------------------------------------------------------------------------- recording


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "absent"
    return getattr(triton, "__version__", "unknown")


def git_sha(repo_root: Path = REPO_ROOT) -> str:
    """Short commit hash of the checkout the numbers come from, ``"unknown"`` if there is none.

    ``TRITONOPT_GIT_SHA`` names it where the tree was copied without its ``.git``.
    """
    if os.environ.get("TRITONOPT_GIT_SHA"):
        return os.environ["TRITONOPT_GIT_SHA"].strip()
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=repo_root, capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = result.stdout.strip()
    return sha if result.returncode == 0 and sha else "unknown"


def environment_fields() -> dict[str, str]:
    return {
        "device": device_name(),
        "torch_version": torch.__version__,
        "triton_version": triton_version(),
        "git_sha": git_sha(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(rows: Sequence[Mapping[str, object]], out_dir: Path | str, stem: str) -> Path:
    """Write ``rows`` (one dict per measurement) to ``out_dir/<stem>.csv``; return the path.

    The one CSV writer of ``perf/``. Long form: one line per measurement. Columns follow the
    rows' own keys in first-seen order (a row without a column leaves it empty), then the
    environment columns (device, torch/triton versions, git sha, UTC timestamp), the same on
    every line.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    environment = environment_fields()
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns and key not in environment)
    columns += list(ENVIRONMENT_COLUMNS)
    path = out_dir / f"{stem}.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **environment})
    return path


def format_value(value: object, digits: int = 4) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A right-aligned plain-text table."""
    cells = [[format_value(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt

    return plt


def plot_series(
    rows: Sequence[Mapping[str, object]],
    path: Path | str,
    *,
    x: str,
    y: str,
    series: Sequence[str],
    title: str,
    xlabel: Optional[str] = None,
    ylabel: Optional[str] = None,
    log2_x: bool = True,
) -> Path:
    """Save a line plot of ``y`` against ``x``, one line per distinct value of the ``series`` keys.

    Lines are labelled ``<first key's value>, <key>=<value>, ...``.
    """
    plt = pyplot()
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        first, *rest = series
        label = ", ".join([str(row[first])] + [f"{key}={row[key]}" for key in rest])
        lines.setdefault(label, []).append((float(row[x]), float(row[y])))

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in lines.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if log2_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_plot(rows: Sequence[Mapping[str, object]], path: Path | str, **kwargs) -> Optional[Path]:
    """:func:`plot_series`, saying where the plot went, or that matplotlib is missing (then ``None``)."""
    try:
        written = plot_series(rows, path, **kwargs)
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return None
    print(f"wrote {written}")
    return written


def progress(total: int, description: str, unit: str = "step"):
    """A tqdm progress bar, or a silent stand-in without tqdm (``update``, ``set_description``, ``close``)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    # Whatever answers to the name may be no tqdm (a stand-in module left in sys.modules):
    # only a class with a bar's methods is used, so that callers can rely on them.
    is_a_bar = isinstance(tqdm, type) and all(
        callable(getattr(tqdm, method, None)) for method in _PROGRESS_METHODS)
    if not is_a_bar:
        return _NoProgress()
    return tqdm(total=total, desc=description, unit=unit)


_PROGRESS_METHODS = ("update", "set_description", "close", "__enter__", "__exit__")


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


# --------------------------------------------------------------------------- claims


@dataclass(frozen=True)
class Claim:
    """A claim an experiment checks: ``holds`` is the measured verdict.

    ``smoke_scale``: whether a smoke run (a few steps) can decide it (a state size, an exact
    reproduction), or only a full run can (a training result).
    """

    text: str
    holds: bool
    detail: str = ""
    smoke_scale: bool = False


def report_claims(claims: Sequence[Claim], *, smoke: bool) -> int:
    """Print each claim's verdict; the exit status: 1 when a checked claim fails, else 0.

    A smoke run checks only the claims it can decide; the others are reported as not checked.
    """
    status = 0
    if claims:
        print("Claims:")
    for claim in claims:
        detail = f" ({claim.detail})" if claim.detail else ""
        if smoke and not claim.smoke_scale:
            print(f"  not checked (smoke run): {claim.text}{detail}")
            continue
        print(f"  {'PASS' if claim.holds else 'FAIL'}: {claim.text}{detail}")
        if not claim.holds:
            status = 1
    if status:
        print("a claim failed: exit status 1")
    return status
