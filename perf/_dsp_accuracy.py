"""The DSP experiment's accuracy part: a learning-rate sweep over seeds, in one process per run.

DSP's arithmetic is a pure function of the staleness, the data order, the seeds
and the intra-op thread count: :class:`tritonopt.dist.DSPSimulator` runs it in
one process and equals a gloo run of the same stages bit for bit
(``tests/test_dsp_distributed.py``). So accuracy does not need the ranks, and
it does not depend on the machine's load: each run trains in a process of its
own with one thread, ``workers`` at a time.

BP is ordinary back-propagation of the whole model; BP-K equals it bit for bit
(the timing part checks that), and DDP, GPipe and 1F1B compute BP's gradient up
to float rounding, so none of them is trained again here.

The sweep: every mode (BP and DSP at each staleness) at every learning rate and
seed trains ``sweep_epochs`` epochs, with the test accuracy after each epoch.
Each mode's learning rate is chosen by a rule fixed here before any run: the
highest mean test accuracy over the seeds after ``sweep_epochs`` epochs, the
smaller learning rate on a tie. The chosen runs then continue to ``epochs``
epochs (constant learning rate: a continued run equals one trained from the
start, bit for bit).

The claim, per DSP configuration, two-sided: the mean over seeds of its final
test accuracy minus BP's (each at its own learning rate, paired by seed: same
initial weights and batch order) is within ``X`` of zero, where ``X`` is the
paper's largest gap below BP (1.07 points) plus two standard errors of that
mean difference.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from perf import _harness as harness
from perf._stats import mean_se
from perf._dsp_setup import (
    BP,
    Sizes,
    dsp_name,
    epoch_batches,
    make_data,
    make_model,
    stages_of,
    staleness_origin,
    test_accuracy,
)
from tritonopt.dist import DSPSimulator

# The paper's largest gap below BP (Table 1, ResNet-164 on CIFAR-10, DSP(3,3,3,0;15,10,5,0): 93.34 vs 94.41 %).
PAPER_LARGEST_GAP = 0.0107
STANDARD_ERRORS = 2  # the parity margin's noise allowance, in standard errors of the mean difference


@dataclass
class AccuracySetup:
    sizes: Sizes = field(default_factory=Sizes)
    lrs: tuple = (0.005, 0.01, 0.02, 0.04)
    seeds: tuple = (0, 1, 2)
    staleness: tuple = (1, 2, 4)
    sweep_epochs: int = 3
    epochs: int = 6
    workers: int = 2
    smoke: bool = False

    def __post_init__(self):
        if not self.lrs or any(not (isinstance(lr, float) and lr > 0) for lr in self.lrs):
            raise ValueError(f"lrs must be positive floats, got {self.lrs!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds!r}")
        if not 1 <= self.sweep_epochs <= self.epochs:
            raise ValueError(f"need 1 <= sweep_epochs <= epochs, got {self.sweep_epochs} and {self.epochs}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    @property
    def modes(self) -> list[str]:
        return [BP] + [dsp_name(m) for m in self.staleness]

    def staleness_of(self, mode: str):
        """``None`` for BP, else rank 0's staleness."""
        return None if mode == BP else self.staleness[self.modes.index(mode) - 1]


# --------------------------------------------------------------------------- one run


def _to_bytes(value) -> bytes:
    # Results cross processes as bytes: tensors sent through a pool as shared-memory handles could
    # vanish with the worker that made them.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def train_run(sizes: Sizes, staleness, lr: float, seed: int, first_epoch: int, last_epoch: int,
              state: bytes | None = None) -> tuple[list[dict], bytes]:
    """Train epochs ``first_epoch .. last_epoch - 1`` of one run; (one row per epoch, the state to continue from).

    ``staleness``: ``None`` for BP (the whole model in one block), else rank 0's ``m`` of a
    two-stage DSP pipeline, simulated in this process. ``state``: what an earlier call returned.
    """
    x_train, y_train, _, _ = make_data(sizes)
    model = make_model(sizes, seed)
    blocks = [model] if staleness is None else stages_of(model, sizes)
    optimizers = [torch.optim.SGD(block.parameters(), lr=lr, momentum=sizes.momentum) for block in blocks]
    if state is not None:
        saved = torch.load(io.BytesIO(state), weights_only=True)
        model.load_state_dict(saved["model"])
        for optimizer, optimizer_state in zip(optimizers, saved["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
    simulator = None if staleness is None else DSPSimulator(blocks, optimizers, (staleness, 0),
                                                            nn.functional.cross_entropy, flush="epoch")
    rows = []
    for epoch in range(first_epoch, last_epoch):
        batches = epoch_batches(x_train, y_train, sizes, epoch, seed)
        if simulator is None:
            losses = []
            for x, y in batches:
                optimizers[0].zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizers[0].step()
                losses.append(loss.detach())
            losses = torch.stack(losses)
        else:
            losses = simulator.train(batches)
        rows.append({"epoch": epoch + 1, "test_accuracy": test_accuracy(model, sizes),
                     "train_loss": losses.mean().item()})
    state = _to_bytes({"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers]})
    return rows, state


def _init_worker() -> None:
    torch.set_num_threads(1)


def _job(args):
    sizes, mode, staleness, lr, seed, first_epoch, last_epoch, state = args
    began = time.perf_counter()
    rows, state = train_run(sizes, staleness, lr, seed, first_epoch, last_epoch, state)
    for row in rows:
        row.update(mode=mode, lr=lr, seed=seed, run_seconds=time.perf_counter() - began)
    return rows, state


def _run_jobs(setup: AccuracySetup, pool, jobs: list[tuple]) -> list[tuple[list[dict], bytes]]:
    """Every job's result, in the jobs' order; ``pool``: a process pool, or ``None`` to run them here."""
    results = [None] * len(jobs)
    done_jobs = (map(_indexed_job, enumerate(jobs)) if pool is None
                 else pool.imap_unordered(_indexed_job, list(enumerate(jobs))))
    for done, (index, result) in enumerate(done_jobs, 1):
        results[index] = result
        rows = result[0]
        print(f"[accuracy] {done}/{len(jobs)}  {rows[0]['mode']:<10} lr {rows[0]['lr']:<6} seed "
              f"{rows[0]['seed']}  epochs {rows[0]['epoch']}-{rows[-1]['epoch']}  test accuracy "
              f"{100 * rows[-1]['test_accuracy']:.1f} %", flush=True)
    return results


def _indexed_job(indexed):
    index, job = indexed
    return index, _job(job)


# --------------------------------------------------------------------------- the sweep


def choose_lr(setup: AccuracySetup, rows: list[dict], mode: str) -> float:
    """The rule fixed before any run: the highest mean test accuracy over the seeds after
    ``sweep_epochs`` epochs; on a tie the smaller learning rate."""
    def mean_accuracy(lr):
        values = [r["test_accuracy"] for r in rows
                  if r["mode"] == mode and r["lr"] == lr and r["epoch"] == setup.sweep_epochs]
        if len(values) != len(setup.seeds):
            raise ValueError(f"{mode} at lr {lr}: {len(values)} runs after epoch {setup.sweep_epochs}, "
                             f"expected one per seed ({len(setup.seeds)})")
        return statistics.mean(values)

    return max(sorted(setup.lrs), key=lambda lr: (mean_accuracy(lr), -lr))


def run_accuracy(setup: AccuracySetup) -> dict:
    """The sweep and the chosen runs' continuation: every row, and each mode's chosen learning rate."""
    if setup.workers == 1:
        _init_worker()
        return _sweep_and_continue(setup, None)
    with multiprocessing.get_context("spawn").Pool(setup.workers, initializer=_init_worker) as pool:
        return _sweep_and_continue(setup, pool)


def _sweep_and_continue(setup: AccuracySetup, pool) -> dict:
    sweep_jobs = [(setup.sizes, mode, setup.staleness_of(mode), lr, seed, 0, setup.sweep_epochs, None)
                  for seed in setup.seeds for lr in setup.lrs for mode in setup.modes]
    results = _run_jobs(setup, pool, sweep_jobs)
    rows = [row for result, _ in results for row in result]
    for row in rows:
        row["stage"] = "sweep"
    chosen = {mode: choose_lr(setup, rows, mode) for mode in setup.modes}
    states = {(job[1], job[3], job[4]): state for job, (_, state) in zip(sweep_jobs, results)}
    if setup.epochs > setup.sweep_epochs:
        continued = [(setup.sizes, mode, setup.staleness_of(mode), chosen[mode], seed, setup.sweep_epochs,
                      setup.epochs, states[mode, chosen[mode], seed])
                     for seed in setup.seeds for mode in setup.modes]
        for result, _ in _run_jobs(setup, pool, continued):
            for row in result:
                row["stage"] = "continued"
                rows.append(row)
    return {"rows": rows, "chosen": chosen}


def final_accuracies(setup: AccuracySetup, outcome: dict, mode: str, epoch: int | None = None) -> dict[int, float]:
    """``{seed: test accuracy}`` of ``mode`` at its chosen learning rate after ``epoch`` (default: the last)."""
    epoch = setup.epochs if epoch is None else epoch
    lr = outcome["chosen"][mode]
    return {r["seed"]: r["test_accuracy"] for r in outcome["rows"]
            if r["mode"] == mode and r["lr"] == lr and r["epoch"] == epoch}


def parity(setup: AccuracySetup, outcome: dict, m: int) -> dict:
    """DSP m's final accuracy minus BP's, paired by seed: the differences, their mean and SE, the margin X."""
    dsp = final_accuracies(setup, outcome, dsp_name(m))
    bp = final_accuracies(setup, outcome, BP)
    if sorted(dsp) != sorted(bp) or len(dsp) != len(setup.seeds):
        raise ValueError(f"DSP m={m} and BP need one final accuracy per seed, got seeds {sorted(dsp)} and {sorted(bp)}")
    differences = [dsp[seed] - bp[seed] for seed in sorted(bp)]
    mean, se = mean_se(differences)
    margin = PAPER_LARGEST_GAP + STANDARD_ERRORS * se
    return {"differences": differences, "mean": mean, "se": se, "margin": margin,
            "holds": not math.isnan(margin) and abs(mean) <= margin}


def claims(setup: AccuracySetup, outcome: dict) -> list[harness.Claim]:
    checks = []
    for m in setup.staleness:
        p = parity(setup, outcome, m)
        checks.append(harness.Claim(
            f"{dsp_name(m)} ({staleness_origin(m)}) ends within X of BP's test accuracy, both ways "
            f"(X = {100 * PAPER_LARGEST_GAP:.2f} points + {STANDARD_ERRORS} SE)",
            p["holds"],
            f"DSP - BP = {100 * p['mean']:+.2f} +- {100 * p['se']:.2f} points over {len(p['differences'])} seeds, "
            f"X = {100 * p['margin']:.2f} points; per seed "
            + ", ".join(f"{100 * d:+.1f}" for d in p["differences"])))
    return checks


# --------------------------------------------------------------------------- outputs


def _percent(values) -> str:
    mean, se = mean_se(values)
    return f"{100 * mean:.2f} +- {100 * se:.2f}" if not math.isnan(se) else f"{100 * mean:.2f}"


def markdown(setup: AccuracySetup, outcome: dict, command: str, seconds: float) -> str:
    rows, chosen = outcome["rows"], outcome["chosen"]
    s = setup.sizes
    lines = [
        "## Accuracy (a learning-rate sweep over seeds)", "",
        f"Command: `{command}` ({seconds:.0f} s; torch {torch.__version__}, {harness.cpu_model()}, "
        f"{os.cpu_count()} CPUs, {setup.workers} runs at a time, one thread each; load average at the end "
        f"{os.getloadavg()[0]:.1f}).", "",
        f"Residual CNN ({s.channels} channels, {s.units} units; DSP cut after unit {s.split}), {s.train_size} "
        f"synthetic training images, batches of {s.batch}, SGD momentum {s.momentum}; seeds "
        f"{', '.join(map(str, setup.seeds))} (initial weights and batch order; the data set is the same). "
        f"Test accuracy on {s.test_size} images, mean +- standard error over the seeds, in %. DSP runs in "
        "one process (`DSPSimulator`, the gloo stages' arithmetic bit for bit). BP-K is BP bit for bit; DDP, "
        "GPipe and 1F1B compute BP's gradient up to rounding and are not trained again.", "",
        f"Sweep: every mode at every learning rate for {setup.sweep_epochs} epochs; each mode's learning rate "
        f"is the highest mean test accuracy after epoch {setup.sweep_epochs} (rule fixed in the script; "
        f"**bold**: chosen). The chosen runs continue to {setup.epochs} epochs.", "",
        "| mode | " + " | ".join(f"lr {lr}" for lr in setup.lrs) + " |",
        "|---|" + "---|" * len(setup.lrs),
    ]
    for mode in setup.modes:
        cells = []
        for lr in setup.lrs:
            values = [r["test_accuracy"] for r in rows
                      if r["mode"] == mode and r["lr"] == lr and r["epoch"] == setup.sweep_epochs]
            cell = _percent(values)
            cells.append(f"**{cell}**" if lr == chosen[mode] else cell)
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    edge = [mode for mode in setup.modes if len(setup.lrs) > 1 and chosen[mode] in (min(setup.lrs), max(setup.lrs))]
    if edge:
        lines += ["", "Chosen at the grid's edge (a wider grid might do better): "
                  + ", ".join(f"{mode} (lr {chosen[mode]})" for mode in edge) + "."]
    epochs = range(1, setup.epochs + 1)
    lines += ["", "Test accuracy after each epoch, each mode at its own learning rate:", "",
              "| mode | lr | configuration | " + " | ".join(f"epoch {e}" for e in epochs) + " |",
              "|---|---|---|" + "---|" * len(epochs)]
    for mode in setup.modes:
        m = setup.staleness_of(mode)
        origin = "-" if m is None else staleness_origin(m)
        cells = [_percent(final_accuracies(setup, outcome, mode, e).values()) for e in epochs]
        lines.append(f"| {mode} | {chosen[mode]} | {origin} | " + " | ".join(cells) + " |")
    lines += ["", f"DSP minus BP after epoch {setup.epochs}, paired by seed, in points "
              f"(X = {100 * PAPER_LARGEST_GAP:.2f} + {STANDARD_ERRORS} SE):", "",
              "| mode | per seed | mean +- SE | X |", "|---|---|---|---|"]
    for m in setup.staleness:
        p = parity(setup, outcome, m)
        lines.append(f"| {dsp_name(m)} | {', '.join(f'{100 * d:+.1f}' for d in p['differences'])} | "
                     f"{100 * p['mean']:+.2f} +- {100 * p['se']:.2f} | {100 * p['margin']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(setup: AccuracySetup, outcome: dict, path) -> None:
    try:
        plt = harness.pyplot()
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, axis = plt.subplots(figsize=(7, 4.5))
    epochs = list(range(1, setup.epochs + 1))
    for mode in setup.modes:
        stats = [mean_se(final_accuracies(setup, outcome, mode, e).values()) for e in epochs]
        axis.errorbar(epochs, [100 * mean for mean, _ in stats],
                      yerr=[0 if math.isnan(se) else 100 * se for _, se in stats], marker="o", capsize=3,
                      label=f"{mode} (lr {outcome['chosen'][mode]})")
    axis.set_xlabel("epoch")
    axis.set_ylabel("test accuracy % (mean +- SE over seeds)")
    axis.set_title("DSP and BP, each at its own learning rate")
    axis.grid(True, alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
