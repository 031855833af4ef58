"""Timing a call with cold caches, and the device's measured bandwidth and matrix throughput (the floors).

Part of the perf harness; scripts reach it through ``perf._harness``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

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


