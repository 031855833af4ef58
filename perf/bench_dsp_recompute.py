"""Throughput of one DSP stage with its recomputation serial or overlapped with the next forward.

A middle stage of a DSP pipeline (staleness ``m = 2``, neither first nor last: it returns
its input's gradient) runs the stage loop on its own: forward batch ``t``, then backward
batch ``t - 2`` with a fixed error gradient from the next stage, recomputation and
``torch.optim.SGD`` step included. Two blocks, one torch thread each by default (one
rank per core):

* ``mlp``: Linear-ReLU-Dropout(0.1)-Linear-ReLU-Linear, width 1024, batches of 128;
* ``cnn``: Conv-BatchNorm-ReLU twice, 32 channels, 16x16 images, batches of 32.

``recompute="serial"`` recomputes the stored input inside the backward;
``recompute="overlap"`` recomputes it beside the forward before that backward (paper
sec. 3.3: a worker thread on the CPU, a side stream on CUDA). ``--device`` picks where the
block, its inputs and error gradients live (``auto``: CUDA where there is a device); on
CUDA each window's clock is read after ``torch.cuda.synchronize``, and cuDNN runs its
deterministic algorithms, without which two serial runs already differ. The two stages, started
from the same weights, alternate windows of ``--batches`` batches with the same seeds,
so each window's times are taken under the same load; per batch, the median over the
windows. Results: ``dsp_recompute.csv`` (column ``stage_device``: where the stages ran) and
the ratio serial time / overlap time (above 1: the overlap helps). The run fails (exit
status 1) unless both end with the same weights and buffers, bit for bit.

    python -m perf.bench_dsp_recompute [--smoke] [--device auto] [--threads 1] [--batches 16] [--windows 7]
                                       [--out DIR]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_dsp_recompute.py
    import _as_module

    _as_module.run(__file__)

import contextlib
import copy
import statistics
import sys
import time

import torch
from torch import nn

from perf import _harness as harness
from tritonopt.dist.dsp_core import RECOMPUTE_MODES, StageCompute, stage_actions

NAME = "dsp_recompute"
STALENESS = 2
WINDOWS, SMOKE_WINDOWS = 7, 2
BATCHES, SMOKE_BATCHES = 16, 4
DEVICES = ("auto", "cpu", "cuda")


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width))


def cnn(channels: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                         nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())


def blocks(smoke: bool) -> dict[str, tuple[nn.Module, tuple[int, ...], dict[str, int]]]:
    """Per case: the block, one batch's input shape and the sizes that describe it."""
    width, batch = (64, 8) if smoke else (1024, 128)
    channels, images, side = (4, 4, 8) if smoke else (32, 32, 16)
    torch.manual_seed(0)
    return {
        "mlp": (mlp(width), (batch, width), dict(width=width, batch=batch)),
        "cnn": (cnn(channels), (images, channels, side, side), dict(width=channels, batch=images)),
    }


class Stage:
    """A middle stage fed its own inputs and error gradients, in the DSP stage loop's order."""

    def __init__(self, module: nn.Module, recompute: str, input_shape: tuple[int, ...], device: torch.device):
        self.module = module.to(device)
        self.device = device
        # Small steps: the error gradient is the same every batch, so the weights drift one way.
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-4, momentum=0.9)
        self.compute = StageCompute(module, optimizer, STALENESS, is_first=False, is_last=False,
                                    recompute=recompute)
        gen = torch.Generator().manual_seed(1)
        # Drawn on the CPU: the same values on every device.
        self.inputs = [torch.randn(input_shape, generator=gen).to(device) for _ in range(4)]
        with torch.no_grad():
            output_shape = copy.deepcopy(module)(self.inputs[0]).shape
        self.grad_output = (torch.randn(output_shape, generator=gen) * 1e-3).to(device)
        self.next_batch = 0

    def window(self, count: int, seed: int) -> float:
        """Seconds for ``count`` batches (forward and the backward after it), the queue kept full."""
        torch.manual_seed(seed)
        synchronize(self.device)  # the previous window's kernels are not this one's
        began = time.perf_counter()
        for kind, batch in stage_actions(STALENESS, False, self.next_batch, count, self.compute.pending):
            if kind == "forward":
                # A fresh tensor per batch, as a receive buffer would be: the queue keeps it.
                self.compute.forward(batch, self.inputs[batch % len(self.inputs)].clone())
            else:
                self.compute.backward(batch, self.grad_output)
        synchronize(self.device)  # the window ends when its kernels (both streams) have run
        self.next_batch += count
        return time.perf_counter() - began


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(requested: str) -> torch.device:
    """``--device``: ``auto`` is CUDA where a device is available, else the CPU."""
    if requested not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not harness.cuda_available()):
        return torch.device("cpu")
    if not harness.cuda_available():
        raise ValueError("--device cuda: no CUDA device is available here (use --device auto or cpu)")
    return torch.device("cuda", torch.cuda.current_device())


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({harness.cpu_model()})"


@contextlib.contextmanager
def deterministic_cudnn(device: torch.device):
    """On CUDA, cuDNN's deterministic algorithms for the run (its default backward may use atomics)."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, and finite (a NaN would compare unequal to itself, an overflow hide a difference)."""
    return bool(torch.equal(a, b) and (not a.is_floating_point() or a.isfinite().all()))


def measure(case: str, block: nn.Module, input_shape, sizes: dict, threads: int, windows: int,
            count: int, device: torch.device) -> tuple[list[dict], bool]:
    stages = {mode: Stage(copy.deepcopy(block), mode, input_shape, device) for mode in RECOMPUTE_MODES}
    for mode in RECOMPUTE_MODES:
        stages[mode].window(STALENESS + 1, seed=0)  # warm-up: the queue fills, the first steps allocate
    seconds = {mode: [] for mode in RECOMPUTE_MODES}
    for w in range(windows):
        order = RECOMPUTE_MODES if w % 2 == 0 else RECOMPUTE_MODES[::-1]  # neither always goes first
        for mode in order:
            seconds[mode].append(stages[mode].window(count, seed=1 + w))
    same = all(bit_identical(a, b) for a, b in zip(stages["serial"].module.state_dict().values(),
                                                   stages["overlap"].module.state_dict().values()))
    ms = {mode: 1e3 * statistics.median(seconds[mode]) / count for mode in RECOMPUTE_MODES}
    rows = []
    for mode in RECOMPUTE_MODES:
        rows.append({"case": case, "recompute": mode, **sizes, "threads": threads, "staleness": STALENESS,
                     "batches_per_window": count, "windows": windows, "ms_per_batch_p50": ms[mode],
                     "ms_per_batch_min": 1e3 * min(seconds[mode]) / count,
                     "serial_over_overlap": ms["serial"] / ms["overlap"], "bit_identical": same,
                     "stage_device": str(device)})
    return rows, same


def parser():
    p = harness.script_parser(__doc__.split("\n\n")[0], smoke_help="tiny blocks, two short windows: checks the "
                              "script runs and the two modes agree", default_out="perf/results/<device>/")
    p.add_argument("--threads", type=harness.positive_int, default=1,
                   help="torch intra-op threads (default: %(default)s, one rank per core)")
    p.add_argument("--batches", type=harness.positive_int, default=None,
                   help=f"batches per timed window (default: {BATCHES}; smoke: {SMOKE_BATCHES})")
    p.add_argument("--windows", type=harness.positive_int, default=None,
                   help=f"timed windows per mode (default: {WINDOWS}; smoke: {SMOKE_WINDOWS})")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the stages run: auto (CUDA where available, else the CPU), cpu or cuda "
                   "(default: %(default)s)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        p.error(str(error))
    windows = args.windows or (SMOKE_WINDOWS if args.smoke else WINDOWS)
    count = args.batches or (SMOKE_BATCHES if args.smoke else BATCHES)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    print(f"{NAME}: device {describe(device)}, {args.threads} torch thread(s), staleness {STALENESS}, "
          f"{windows} windows of {count} batches per mode")
    rows, failures = [], []
    try:
        with deterministic_cudnn(device):
            for case, (block, input_shape, sizes) in blocks(args.smoke).items():
                case_rows, same = measure(case, block, input_shape, sizes, args.threads, windows, count, device)
                rows += case_rows
                if not same:
                    failures.append(case)
    finally:
        torch.set_num_threads(threads)
    headers = ["case", "recompute", "width", "batch", "ms_per_batch_p50", "ms_per_batch_min", "serial_over_overlap",
               "bit_identical"]
    print(harness.format_table(headers, [[row[h] for h in headers] for row in rows]))
    out_dir = harness.output_dir(args.out, harness.device_results_dir(), smoke=args.smoke, name=NAME)
    print(f"wrote {harness.write_results(rows, out_dir, NAME)}")
    if failures:
        print(f"FAILED: serial and overlapped recomputation differ for {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
