"""A benchmark as a list of cases: each provider timed on the same inputs against the case's floor,
one table, one CSV and one plot (:func:`run_benchmark`).

Part of the perf harness; scripts reach it through ``perf._harness``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

import tritonopt
from perf._cli import nvtx_enabled, with_range
from perf._device import (
    CPU_PLOT_NOTE,
    announce_primary,
    default_device,
    device_name,
    device_results_dir,
    output_dir,
    primary_backend,
)
from perf._records import format_table, save_plot, write_results
from perf._timing import Timing, Yardsticks, time_ms

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


