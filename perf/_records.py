"""What a perf script leaves behind: CSV files with the environment they were measured in, tables,
plots, and the progress bar while it runs.

Part of the perf harness; scripts reach it through ``perf._harness``.
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import subprocess
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import torch

from perf._device import ENVIRONMENT_COLUMNS, REPO_ROOT, device_name

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


