"""The perf scripts' command line (shared parsers and argument types) and their NVTX ranges.

Part of the perf harness; scripts reach it through ``perf._harness``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Callable

import torch

import tritonopt

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


