"""Benchmark every tritonopt optimizer's step against torch's SGD, Adam and Adagrad, in one run.

Each optimizer trains a model on one fixed random batch: ``zero_grad``, forward, backward,
the update. Two times per optimizer, each the mean over whole periods of its schedule, so
that the periodic work is amortised (K-FAC's eigendecompositions every ``inv_update_steps``,
FOSI's extreme-eigenspace estimate every ``curvature_update_every``):

* ``step ms``: the update alone (``optimizer.step()``; K-FAC: ``preconditioner.step()`` and
  the SGD step; FOSI: its step, the ESE included);
* ``iteration ms``: the whole training iteration. K-FAC also works inside forward and
  backward (its hooks fold the layers' inputs and output gradients into the factor
  statistics): only this time includes that.

Ratios are against the closest torch optimizer (``vs closest``: Adagrad for SparseAdaGrad,
SGD-momentum for K-FAC over SGD, Adam for the others, all adaptive methods that replace it)
and against Adam, all measured in the same run. The optimizer state is
``optimizer_state_bytes`` (K-FAC: plus its factors and eigenbases); on a GPU the peak
memory allocated during the optimizer's iterations is recorded too.

Sizes:

* ``demo``: the demo's 64-256-256-10 MLP (85,002 parameters), batches of 32, the demo's
  hyperparameters (``perf/_optimizers.py``; GGT and S-GGT: M-FAC's window and density, lr 1e-3);
* ``cnn``: a small ResNet (``perf/_models.py``: a stem and three BasicBlocks of 8, 16 and 32
  channels, 19,954 parameters) on 32x32 images, batches of 32: a CIFAR-size convolutional
  model that one CPU thread trains, where K-FAC's factors come from unfolded patches (up to
  288 x 288) and the convolutions, not the optimizer's fixed cost, dominate the iteration;
  windows of 128 gradients at 1 % in blocks of 16384, K-FAC eigendecompositions every 10
  steps, FOSI's ESE (k = 4) every 50;
* ``resnet18``: ResNet-18 (11,689,512 parameters, ``perf/_models.py``) on 224x224 images,
  batches of 32 (GPU only): windows of m = 1024 gradients, 1 % density in blocks of 16384,
  rank 4, K-FAC eigendecompositions every 10 steps, FOSI's ESE every 100;
* ``shrunk`` (``--smoke``): ResNet-18 at width 4 on 16x16 images, windows of 8: checks
  the script in seconds.

Without a CUDA device the script runs the ``demo`` size on the reference path, one thread
(``--smoke``: the ``shrunk`` size); those numbers say nothing about GPU speed. Results:
``optimizer_step.csv`` and ``optimizer_step.png`` in ``perf/results/<device>/``.

    python -m perf.bench_optimizer_step [--smoke] [--nvtx] [--sizes demo resnet18]
                                        [--only SGD MFAC ...] [--out DIR]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_optimizer_step.py
    import _as_module

    _as_module.run(__file__)

import contextlib
import gc
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import tritonopt
from perf import _harness as harness
from perf import _optimizers as optimizers
from perf._digits import make_mlp
from perf._models import resnet18, small_resnet
from tritonopt.optim import GGT, MFAC, LowRankMFAC, SparseAdaGrad, SparseGGT, SparseMFAC

NAME = "optimizer_step"
DEMO_STEPS_PER_EPOCH = 45  # 1,437 digits in batches of 32: the period of the demo's FOSI


@dataclass(frozen=True)
class Size:
    """A model, its batch, and the optimizers' settings at that size."""

    name: str
    make_model: Callable[[], torch.nn.Module]
    batch: int
    input_shape: tuple[int, ...]
    classes: int
    window: int  # m of the windowed preconditioners
    block_size: int  # of the sparse ones
    kfac_inv_every: int
    fosi: dict  # FOSI's schedule and Lanczos settings


SIZES = {
    "demo": Size("demo", lambda: make_mlp(0), 32, (64,), 10, window=128, block_size=optimizers.SPARSE_BLOCK,
                 kfac_inv_every=optimizers.KFAC_SETTINGS["inv_update_steps"],
                 fosi=optimizers.fosi_hyperparameters(DEMO_STEPS_PER_EPOCH)),
    "cnn": Size("cnn", lambda: small_resnet(8), 32, (3, 32, 32), 10, window=128, block_size=16384,
                kfac_inv_every=10,
                fosi=dict(lr=1e-3, base="adam", k=4, l=0, alpha=0.1, curvature_update_every=50)),
    "resnet18": Size("resnet18", lambda: resnet18(), 32, (3, 224, 224), 1000, window=1024, block_size=16384,
                     kfac_inv_every=10,
                     fosi=dict(lr=1e-3, base="adam", k=10, l=0, alpha=0.1, curvature_update_every=100)),
    "shrunk": Size("shrunk", lambda: resnet18(num_classes=10, width=4), 2, (3, 16, 16), 10, window=8,
                   block_size=1024, kfac_inv_every=2,
                   fosi=dict(lr=1e-3, base="adam", k=2, l=0, alpha=0.1, num_lanczos_iters=6,
                             curvature_update_every=2)),
}


# --------------------------------------------------------------------------- the optimizers


@dataclass(frozen=True)
class Entry:
    name: str
    closest: str  # the torch optimizer it is compared with
    build: Callable[[torch.nn.Module, Size], optimizers.OptimizerStep]
    period: Callable[[Size], int] = lambda size: 1  # steps between its periodic work

    def is_torch(self) -> bool:
        return self.closest == self.name


def demo_or(builder, at_scale):
    """The demo's builder at the demo size, ``at_scale(model, size)`` elsewhere."""
    return lambda model, size: (builder(model, DEMO_STEPS_PER_EPOCH) if size.name == "demo"
                                else at_scale(model, size))


def plain(make):
    return lambda model, size: optimizers.OptimizerStep(model, make(model, size))


ENTRIES = [
    Entry("SGD", "SGD", demo_or(optimizers.build_sgd, plain(
        lambda model, size: torch.optim.SGD(model.parameters(), lr=0.01, momentum=optimizers.SGD_MOMENTUM)))),
    Entry("Adam", "Adam", demo_or(optimizers.build_adam, plain(
        lambda model, size: torch.optim.Adam(model.parameters(), lr=1e-3)))),
    Entry("Adagrad", "Adagrad", plain(lambda model, size: torch.optim.Adagrad(model.parameters(), lr=0.01))),
    Entry("SparseAdaGrad", "Adagrad", demo_or(optimizers.build_sparse_adagrad, plain(
        lambda model, size: SparseAdaGrad(model.parameters(), lr=0.01, density=0.01)))),
    Entry("MFAC", "Adam", demo_or(optimizers.build_mfac, plain(
        lambda model, size: MFAC(model.parameters(), lr=1e-3, ngrads=size.window, damp=1e-4)))),
    Entry("SparseMFAC", "Adam", demo_or(optimizers.build_sparse_mfac, plain(
        lambda model, size: SparseMFAC(model.parameters(), lr=1e-3, ngrads=size.window, damp=1e-4,
                                       density=0.01, block_size=size.block_size)))),
    Entry("GGT", "Adam", plain(
        lambda model, size: GGT(model.parameters(), lr=1e-3, ngrads=size.window))),
    Entry("SparseGGT", "Adam", plain(
        lambda model, size: SparseGGT(model.parameters(), lr=1e-3, ngrads=size.window, density=0.01,
                                      block_size=size.block_size))),
    Entry("LowRankMFAC", "Adam", demo_or(optimizers.build_lowrank_mfac, plain(
        lambda model, size: LowRankMFAC(model.parameters(), lr=1e-3, ngrads=size.window, damp=1e-4, rank=4)))),
    Entry("KFAC+SGD", "SGD",
          demo_or(optimizers.build_kfac, lambda model, size: optimizers.KFACStep(
              model, lr=0.01, inv_update_steps=size.kfac_inv_every, damping=0.003)),
          period=lambda size: size.kfac_inv_every),
    Entry("FOSI-Adam", "Adam",
          demo_or(optimizers.build_fosi, lambda model, size: optimizers.FosiStep(model, size.fosi, ese_batches=1)),
          period=lambda size: size.fosi["curvature_update_every"]),
]


# --------------------------------------------------------------------------- timing


class Clock:
    """Sums the time spent in the ``with`` blocks it hands out: CUDA events on a GPU, else perf_counter."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pairs: list = []
        self.seconds = 0.0

    @contextlib.contextmanager
    def __call__(self):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pairs.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - began

    def total_ms(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in self.pairs)
        return 1e3 * self.seconds


def measure(entry: Entry, size: Size, device: torch.device, *, min_iterations: int, use_nvtx: bool) -> dict:
    """Mean step and iteration time over whole periods of ``entry``'s schedule, after one period's warm-up."""
    torch.manual_seed(0)
    model = size.make_model().to(device)
    x = torch.randn(size.batch, *size.input_shape, device=device)
    y = torch.randint(0, size.classes, (size.batch,), device=device)
    step = entry.build(model, size)
    loss_fn = torch.nn.functional.cross_entropy
    period = entry.period(size)
    # Past FOSI's warm-up and the first ESE or eigendecomposition: every window of `period`
    # steps from here holds exactly one of them.
    for _ in range(step.warmup_steps + 2):
        step(x, y, loss_fn)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    iterations = period * max(1, math.ceil(min_iterations / period))
    update_clock, iteration_clock = Clock(device), Clock(device)
    step.update_timer = update_clock
    for _ in range(iterations):
        marked = tritonopt.nvtx_range(f"tritonopt/bench/{NAME}/{entry.name}") if use_nvtx else contextlib.nullcontext()
        with iteration_clock(), marked:
            step(x, y, loss_fn)
    row = {
        "size": size.name, "optimizer": entry.name, "closest": entry.closest,
        "parameters": sum(p.numel() for p in model.parameters()), "period": period, "iterations": iterations,
        "step_ms": update_clock.total_ms() / iterations,
        "iteration_ms": iteration_clock.total_ms() / iterations,
        "state_bytes": step.state_bytes(),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else "",
    }
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row's times over its closest torch optimizer's and over Adam's, at the same size."""
    by_key = {(r["size"], r["optimizer"]): r for r in rows}
    for row in rows:
        for label, baseline in (("closest", row["closest"]), ("adam", "Adam")):
            base = by_key.get((row["size"], baseline))
            for metric in ("step", "iteration"):
                row[f"{metric}_vs_{label}"] = (row[f"{metric}_ms"] / base[f"{metric}_ms"]) if base else math.nan


def plot(rows: list[dict], path, title: str) -> None:
    plt = harness.pyplot()
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        mine = [r for r in rows if r["size"] == size]
        names = [r["optimizer"] for r in mine]
        positions = range(len(mine))
        ax.barh([p - 0.2 for p in positions], [r["step_ms"] for r in mine], height=0.4, label="step")
        ax.barh([p + 0.2 for p in positions], [r["iteration_ms"] for r in mine], height=0.4, label="iteration")
        ax.set_yticks(list(positions), names)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms (mean over whole periods)")
        ax.set_title(f"{size}: {mine[0]['parameters']:,} parameters")
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser():
    p = harness.bench_parser(__doc__.split("\n\n")[0],
                             smoke_help="the shrunk size only, a few iterations: checks the script in seconds")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None,
                   help="default: demo and resnet18 on a GPU, demo on the CPU")
    p.add_argument("--only", nargs="+", metavar="NAME", default=None,
                   help="optimizers to run, of: %(choices)s (the torch ones are always run)",
                   choices=[e.name for e in ENTRIES])
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    device, primary = harness.training_step_device()
    use_nvtx = harness.nvtx_enabled(args.nvtx, device)
    if args.smoke:
        sizes = ["shrunk"]
    else:
        sizes = args.sizes or (["demo", "resnet18"] if device.type == "cuda" else ["demo"])
    entries = [e for e in ENTRIES if e.is_torch() or args.only is None or e.name in args.only]
    min_iterations = 3 if args.smoke else (20 if device.type == "cuda" else 10)
    print(f"{NAME}: device {harness.device_name()}, tritonopt backend {primary}")
    rows = []
    with harness.progress(len(sizes) * len(entries), "optimizers", unit="optimizer") as bar:
        for size_name in sizes:
            for entry in entries:
                bar.set_description(f"{size_name}: {entry.name}")
                try:
                    rows.append(measure(entry, SIZES[size_name], device, min_iterations=min_iterations,
                                        use_nvtx=use_nvtx))
                except torch.cuda.OutOfMemoryError:
                    print(f"skipped {entry.name} at {size_name}: out of GPU memory")
                # Here, not in the except block: the traceback held the model and state until now.
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                bar.update(1)
    add_ratios(rows)
    for size_name in sizes:
        mine = [r for r in rows if r["size"] == size_name]
        if not mine:
            continue
        print(f"\n{size_name}: {mine[0]['parameters']:,} parameters")
        print(harness.format_table(
            ["optimizer", "closest", "step ms", "iteration ms", "step vs closest", "iteration vs closest",
             "step vs Adam", "state MiB"],
            [[r["optimizer"], r["closest"], r["step_ms"], r["iteration_ms"], f"{r['step_vs_closest']:.2f}x",
              f"{r['iteration_vs_closest']:.2f}x", f"{r['step_vs_adam']:.2f}x", r["state_bytes"] / 2**20]
             for r in mine]))
    print()
    out_dir = harness.output_dir(args.out, harness.device_results_dir(), smoke=args.smoke, name=NAME)
    print(f"wrote {harness.write_results(rows, out_dir, NAME)}")
    note = "" if device.type == "cuda" else harness.CPU_PLOT_NOTE
    try:
        plot(rows, out_dir / f"{NAME}.png", f"optimizer step and training iteration, {harness.device_name()}{note}")
        print(f"wrote {out_dir / f'{NAME}.png'}")
    except ImportError:
        print("matplotlib is not installed: no plot written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
