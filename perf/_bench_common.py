"""Shared measuring and recording helpers for the ``perf/bench_*.py`` scripts.

Timing, measured copy bandwidth (the yardstick for memory-bound kernels), and
writing results (long-form CSV, a PNG, a text table) into
``perf/results/<device_label()>/``.

Nothing here queries CUDA at import time, and matplotlib/Triton are imported
only inside the functions that need them, so this module imports on any machine.
"""

from __future__ import annotations

import argparse

import csv
import datetime
import math
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

PERF_DIR = Path(__file__).resolve().parent
REPO_ROOT = PERF_DIR.parent
RESULTS_DIR = PERF_DIR / "results"

# Columns describing where and with what a result was taken; appended to every row.
ENVIRONMENT_COLUMNS = (
    "device",
    "torch_version",
    "triton_version",
    "git_sha",
    "timestamp",
)


# --------------------------------------------------------------------------- device


def cuda_available() -> bool:
    return torch.cuda.is_available()


def device_name() -> str:
    """Human-readable name of the machine the numbers come from."""
    if cuda_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine() or 'unknown arch'}, {torch.get_num_threads()} threads)"


def device_label() -> str:
    """Filesystem-safe results folder name: the slugified CUDA device name, else ``"cpu"``."""
    if not cuda_available():
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return slug or "cuda"


def default_results_dir() -> Path:
    return RESULTS_DIR / device_label()


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """Run time of one call in milliseconds: median and the 20th/80th percentiles."""

    p50: float
    p20: float
    p80: float


def time_ms(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    cpu_reps: int = 10,
    cpu_warmup: int = 2,
) -> Timing:
    """Time ``fn()`` on ``device``.

    CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each run).
    CPU: a ``perf_counter`` loop of ``cpu_reps`` calls after ``cpu_warmup`` calls.

    ``fn`` is called repeatedly on the same buffers. For ops that update a
    buffer in place (an error-feedback accumulator, optimizer state) this is
    deliberate: the work per call does not depend on the values accumulated, so
    no per-repetition reset is needed and none is timed by mistake.
    """
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench  # only needed (and only usable) on a GPU

        p50, p20, p80 = do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        return Timing(p50=p50, p20=p20, p80=p80)

    if cpu_reps < 1 or cpu_warmup < 0:
        raise ValueError(f"need cpu_reps >= 1 and cpu_warmup >= 0, got {cpu_reps}, {cpu_warmup}")
    for _ in range(cpu_warmup):
        fn()
    samples = []
    for _ in range(cpu_reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    p50, p20, p80 = np.percentile(samples, [50, 20, 80])
    return Timing(p50=float(p50), p20=float(p20), p80=float(p80))


def measure_bandwidth_gbps(
    device: torch.device | str, *, nbytes: int | None = None, cpu_reps: int = 10
) -> float:
    """Measured copy bandwidth of ``device`` in GB/s (1e9 bytes), from ``dst.copy_(src)``.

    A copy reads and writes each byte once, so it moves ``2 * nbytes``. The
    buffer is large enough to defeat caches: 1 GiB on CUDA, 64 MiB on the CPU.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    numel = nbytes // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timing = time_ms(lambda: dst.copy_(src), device, cpu_reps=cpu_reps)
    moved = 2 * numel * 4
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return moved / (timing.p50 * 1e-3) / 1e9


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
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=10,
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


def _ordered_columns(rows: Sequence[Mapping[str, object]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    return columns


def write_results(rows: Sequence[Mapping[str, object]], out_dir: Path | str, stem: str) -> Path:
    """Write ``rows`` (one dict per measurement) to ``out_dir/<stem>.csv``; return the path.

    Long form: one line per (op, provider, shape). Columns follow the rows' own
    keys in first-seen order, then the environment columns
    (device, torch/triton versions, git sha, UTC timestamp), the same on every line.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    environment = environment_fields()
    columns = [c for c in _ordered_columns(rows) if c not in environment]
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


def plot_series(
    rows: Sequence[Mapping[str, object]],
    path: Path | str,
    *,
    x: str,
    y: str,
    series: Sequence[str],
    title: str,
    xlabel: str | None = None,
    ylabel: str | None = None,
    log2_x: bool = True,
) -> Path:
    """Save a line plot of ``y`` against ``x``, one line per distinct value of the ``series`` keys.

    Lines are labelled ``<first key's value>, <key>=<value>, ...``.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt

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


def save_plot(rows: Sequence[Mapping[str, object]], path: Path | str, **kwargs) -> Path | None:
    """:func:`plot_series`, saying where the plot went, or that matplotlib is missing (then ``None``)."""
    try:
        written = plot_series(rows, path, **kwargs)
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return None
    print(f"wrote {written}")
    return written


def positive_int(text: str) -> int:
    """``argparse`` type: a positive integer, also written as ``1e6``."""
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value
