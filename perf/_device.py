"""Where the perf scripts run and write: the device, its name and backend, and the results folders.

Part of the perf harness; scripts reach it through ``perf._harness``.
"""

from __future__ import annotations

import math
import platform
import re
from pathlib import Path
from typing import Optional

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


