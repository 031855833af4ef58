"""The DSP experiment's timing part: throughput of every mode, and the slow-down under random stragglers.

Two gloo processes, one thread each, each in a session of its own (so that on a
shared machine with the kernel's autogroup scheduling the two ranks compete for
CPU as two devices, not as one). Every mode trains seed 0's model at one
learning rate (``lr``: the arithmetic's cost does not depend on it).

Modes: **BP** (one process, the whole model), **BP-K** (the DSP stage loop with
staleness 0 everywhere: sequential model-parallel back-propagation, no
recomputation), **DDP** (``DistributedDataParallel`` on the same two processes,
each rank half of every batch, gradients all-reduced), **GPipe** and **1F1B**
(``torch.distributed.pipelining`` ``ScheduleGPipe`` and ``Schedule1F1B`` at each
micro-batch count, one update per batch), **DSP m** (rank 0 staleness m, rank 1
staleness 0).

Part A, throughput: every mode trains ``epochs`` epochs on the same batches. The
modes take turns every ``chunk`` batches, so a drifting machine load slows them
alike; each epoch's time (the sum of its turns, the pipeline drained at its end)
is one repetition. The DSP stages stream across turns (``flush="never"``) and
drain at each epoch's end, which computes exactly what a drained epoch computes.

Part B, stragglers: each compute phase of each DSP stage (BP-K included) is, with
probability ``straggler_probability``, followed by a sleep of a level's fraction
of its own duration (the paper's "slow down each GPU by a percentage with a
probability"). BP-K and every DSP configuration run ``straggler_steps`` batches
at each level in the steady state (no drain), every (level, mode) taking its turn
within each chunk; ``straggler_reps`` repetitions. The paper's metric, per
repetition: straggled time / the paired clean run's time - 1.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from perf import _harness as harness
from perf import _ranks as ranks
from perf._stats import mean_se
from perf._dsp_setup import (
    BP,
    BPK,
    DDP,
    Sizes,
    dsp_name,
    epoch_batches,
    gpipe_name,
    make_data,
    make_model,
    one_f_one_b_name,
    spread,
    stages_of,
    staleness_origin,
)
from tritonopt.dist import DSPStage

WORLD = 2
SPEEDUP_CLAIM = 1.3


@dataclass
class TimingSetup:
    sizes: Sizes = field(default_factory=Sizes)
    lr: float = 0.01
    epochs: int = 5
    microbatches: tuple = (2, 4, 8)
    staleness: tuple = (1, 2, 4)
    straggler_probability: float = 0.25
    straggler_levels: tuple = (0.0, 0.5, 1.0, 1.5)
    straggler_steps: int = 48
    straggler_reps: int = 3
    chunk: int = 16  # batches per turn: the modes are interleaved at this grain
    smoke: bool = False

    def __post_init__(self):
        if any(self.sizes.batch % n for n in self.microbatches) or any(n < WORLD for n in self.microbatches):
            raise ValueError(f"every micro-batch count must divide the batch ({self.sizes.batch}) and be at least "
                             f"the number of stages ({WORLD}), got {self.microbatches}")
        if self.sizes.batch % WORLD:
            raise ValueError(f"DDP splits each batch over {WORLD} ranks: the batch ({self.sizes.batch}) must divide")
        if not 1 <= self.straggler_steps <= self.sizes.steps_per_epoch:
            raise ValueError(f"straggler_steps must be in 1..{self.sizes.steps_per_epoch} (the batches of one "
                             f"epoch), got {self.straggler_steps}")
        if not self.straggler_levels or self.straggler_levels[0] != 0.0:
            raise ValueError(f"the first straggler level must be 0 (the clean runs), got {self.straggler_levels}")

    @property
    def modes(self) -> list[str]:
        return ([BP, BPK, DDP] + [gpipe_name(n) for n in self.microbatches]
                + [one_f_one_b_name(n) for n in self.microbatches] + [dsp_name(m) for m in self.staleness])

    @property
    def straggled(self) -> list[str]:
        return [BPK] + [dsp_name(m) for m in self.staleness]


# --------------------------------------------------------------------------- stragglers


class Straggler:
    """A DSP phase hook: sums compute time and, at random, sleeps ``slowdown`` times a phase's duration."""

    def __init__(self):
        self.configure(0.0, 0.0, 0)

    def configure(self, probability: float, slowdown: float, seed: int) -> None:
        self.probability, self.slowdown = probability, slowdown
        self.chooser = random.Random(seed)
        self.compute_seconds = 0.0

    def __call__(self, phase: str, batch: int, seconds: float) -> None:
        self.compute_seconds += seconds
        if self.slowdown and self.chooser.random() < self.probability:
            time.sleep(self.slowdown * seconds)


# --------------------------------------------------------------------------- the modes, per rank


class Mode:
    """One mode's model piece, optimizer and driver on this rank."""

    def __init__(self, name: str, rank: int, setup: TimingSetup):
        self.name, self.rank = name, rank
        sizes = setup.sizes
        model = make_model(sizes, seed=0)
        self.hook = Straggler()
        loss_fn = nn.functional.cross_entropy
        self.kind = name.split(" ")[0]
        if name == BP:
            self.module = model if rank == 0 else None
            if self.module is not None:
                self.optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr, momentum=sizes.momentum)
            return
        if name == DDP:
            self.module = model
            self.ddp = nn.parallel.DistributedDataParallel(model)
            self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=setup.lr, momentum=sizes.momentum)
            self.half = sizes.batch // WORLD
            return
        pipeline = self.kind in ("GPipe", "1F1B")
        self.module = stages_of(model, sizes, pipeline=pipeline)[rank]
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=setup.lr, momentum=sizes.momentum)
        if pipeline:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            schedule = ScheduleGPipe if self.kind == "GPipe" else Schedule1F1B
            microbatches = int(name.split(" ")[1])
            stage = PipelineStage(self.module, rank, WORLD, torch.device("cpu"))
            self.schedule = schedule(stage, n_microbatches=microbatches, loss_fn=loss_fn)
            return
        staleness = 0 if name == BPK else int(name.split("=")[1])
        # Streaming: the pipeline stays full across the chunks the modes take turns with.
        self.stage = DSPStage(self.module, self.optimizer, staleness=staleness if rank == 0 else 0,
                              loss_fn=loss_fn, flush="never", phase_hook=self.hook)

    def train(self, batches) -> None:
        if self.name == BP:
            if self.module is None:
                return
            for x, y in batches:
                self.optimizer.zero_grad()
                nn.functional.cross_entropy(self.module(x), y).backward()
                self.optimizer.step()
        elif self.name == DDP:
            mine = slice(self.rank * self.half, (self.rank + 1) * self.half)
            for x, y in batches:
                self.optimizer.zero_grad()
                # each rank's mean over its half; DDP averages the two: the whole batch's mean gradient
                nn.functional.cross_entropy(self.ddp(x[mine]), y[mine]).backward()
                self.optimizer.step()
        elif self.kind in ("GPipe", "1F1B"):
            for x, y in batches:
                self.optimizer.zero_grad()
                if self.rank == 0:
                    self.schedule.step(x)
                else:
                    self.schedule.step(target=y, losses=[])
                self.optimizer.step()
        else:
            self.stage.train(batches)

    def drain(self) -> None:
        """End of an epoch: back-propagate every batch still in the pipeline."""
        if hasattr(self, "stage"):
            self.stage.flush()

    def state(self):
        return None if self.module is None else {k: v.clone() for k, v in self.module.state_dict().items()}


def timed(mode: Mode, batches, end_of_epoch: bool) -> float:
    dist.barrier()
    began = time.perf_counter()
    mode.train(batches)
    if end_of_epoch:
        mode.drain()
    dist.barrier()
    return time.perf_counter() - began


def chunked(batches: list, size: int) -> list[list]:
    return [batches[i:i + size] for i in range(0, len(batches), size)]


def run_rank(rank: int, world: int, setup: TimingSetup) -> dict:
    sizes = setup.sizes
    x_train, y_train, _, _ = make_data(sizes)
    modes = {name: Mode(name, rank, setup) for name in setup.modes}
    warmup = epoch_batches(x_train, y_train, sizes, epoch=-1, steps=2)
    for mode in modes.values():  # first-call costs (allocator, shape discovery, buckets) stay out of the timings
        timed(mode, warmup, end_of_epoch=True)
    runs = []
    for epoch in range(setup.epochs):
        chunks = chunked(epoch_batches(x_train, y_train, sizes, epoch), setup.chunk)
        seconds = dict.fromkeys(modes, 0.0)
        compute = dict.fromkeys(modes, 0.0)
        for c, chunk in enumerate(chunks):  # the modes take turns chunk by chunk
            for name, mode in modes.items():
                mode.hook.configure(0.0, 0.0, 0)
                seconds[name] += timed(mode, chunk, end_of_epoch=c == len(chunks) - 1)
                compute[name] += mode.hook.compute_seconds
        for name in modes:
            runs.append({"part": "A", "mode": name, "rep": epoch, "level": 0.0, "steps": sizes.steps_per_epoch,
                         "rank": rank, "seconds": seconds[name], "compute_seconds": compute[name]})
            if rank == 0:
                print(f"[timing A] epoch {epoch + 1}/{setup.epochs}  {name:<16} {seconds[name]:6.2f} s", flush=True)
    states = {name: modes[name].state() for name in (BP, BPK)}  # part A's outcome, before part B trains further
    straggled = setup.straggled
    refill = epoch_batches(x_train, y_train, sizes, epoch=10_001, steps=min(setup.chunk, sizes.steps_per_epoch))
    for name in straggled:  # untimed: the queues fill before the first clean run is timed
        modes[name].hook.configure(0.0, 0.0, 0)
        modes[name].train(refill)
    chunks = chunked(epoch_batches(x_train, y_train, sizes, epoch=10_000, steps=setup.straggler_steps), setup.chunk)
    for rep in range(setup.straggler_reps):
        seconds = {(name, level): 0.0 for level in setup.straggler_levels for name in straggled}
        compute = dict.fromkeys(seconds, 0.0)
        for c, chunk in enumerate(chunks):  # every (level, mode) takes its turn within each chunk
            for li, level in enumerate(setup.straggler_levels):
                for mi, name in enumerate(straggled):
                    mode = modes[name]
                    mode.hook.configure(setup.straggler_probability, level, seed=hash((rep, c, li, mi, rank)) % 2**31)
                    seconds[name, level] += timed(mode, chunk, end_of_epoch=False)  # steady state: no drain
                    compute[name, level] += mode.hook.compute_seconds
        for (name, level), value in seconds.items():
            runs.append({"part": "B", "mode": name, "rep": rep, "level": level, "steps": setup.straggler_steps,
                         "rank": rank, "seconds": value, "compute_seconds": compute[name, level]})
        if rank == 0:
            print(f"[timing B] rep {rep + 1}/{setup.straggler_reps}  "
                  + "  ".join(f"{name} +{level:.0%} {seconds[name, level]:.2f} s" for name, level in seconds),
                  flush=True)
    for mode in modes.values():
        mode.drain()
    return {"runs": runs, "states": states}


def run_ranks(setup: TimingSetup, timeout: float = 3600.0) -> list[dict]:
    # Each rank in a session of its own: with the kernel's autogroup scheduling
    # (sched_autogroup_enabled), the processes of one session share one slice of a busy machine,
    # which would make the two ranks one device. Each rank stands for a device of its own, as in
    # the paper; on an idle machine this changes nothing.
    return ranks.run_on_ranks(WORLD, run_rank, setup, timeout=timeout, own_session=True, weights_only=True)


# --------------------------------------------------------------------------- analysis


def merge_runs(per_rank: list[dict]) -> list[dict]:
    """One row per run: the wall time of the slower rank, each rank's compute time."""
    rows = []
    for r0, r1 in zip(per_rank[0]["runs"], per_rank[1]["runs"]):
        assert (r0["part"], r0["mode"], r0["rep"], r0["level"]) == (r1["part"], r1["mode"], r1["rep"], r1["level"])
        row = {k: r0[k] for k in ("part", "mode", "rep", "level", "steps")}
        row["seconds"] = max(r0["seconds"], r1["seconds"])
        row["compute_seconds_rank0"] = r0["compute_seconds"]
        row["compute_seconds_rank1"] = r1["compute_seconds"]
        rows.append(row)
    return rows


def _times(runs: list[dict], part: str, mode: str, level: float = 0.0) -> dict[int, float]:
    return {r["rep"]: r["seconds"] for r in runs if r["part"] == part and r["mode"] == mode and r["level"] == level}


def summarise(setup: TimingSetup, runs: list[dict]) -> dict:
    """Part A: each mode's epoch times; every DSP mode's paired speed ratio to every other mode.
    Part B: each (mode, level)'s times and paired relative slow-downs."""
    summary = {"throughput": {}, "ratios": {}, "stragglers": {}}
    for name in setup.modes:
        times = _times(runs, "A", name)
        median, low, high = spread(times.values())
        summary["throughput"][name] = {"runs": [times[rep] for rep in sorted(times)], "seconds": median,
                                       "min": low, "max": high,
                                       "samples_per_s": setup.sizes.steps_per_epoch * setup.sizes.batch / median}
    for m in setup.staleness:
        dsp = _times(runs, "A", dsp_name(m))
        for other in setup.modes:
            baseline = _times(runs, "A", other)
            # paired: each epoch's baseline time over the DSP time of the same epoch (they took turns)
            ratios = [baseline[rep] / dsp[rep] for rep in sorted(dsp)]
            median, low, high = spread(ratios)
            summary["ratios"][dsp_name(m), other] = {"ratios": ratios, "median": median, "min": low, "max": high}
    for name in setup.straggled:
        clean = _times(runs, "B", name)
        for level in setup.straggler_levels:
            times = _times(runs, "B", name, level)
            relative = [times[rep] / clean[rep] - 1.0 for rep in sorted(times)]
            summary["stragglers"][name, level] = {
                "runs": [times[rep] for rep in sorted(times)], "seconds": statistics.median(times.values()),
                "relative": relative, "slowdown": statistics.median(relative),
            }
    return summary


def same_weights(per_rank: list[dict], name: str) -> bool:
    """Whether mode ``name``'s stages (both ranks) hold exactly BP's weights after part A."""
    whole = per_rank[0]["states"][BP]
    split = {**per_rank[0]["states"][name], **per_rank[1]["states"][name]}
    return split.keys() == whole.keys() and all(torch.equal(split[key], whole[key]) for key in whole)


def straggler_claim(setup: TimingSetup, summary: dict, m: int, level: float) -> harness.Claim:
    """DSP m is slowed less than BP-K at ``level`` (the paper's relative metric, medians over the
    repetitions); undecided, so failing, when any straggled run of either was faster than its clean pair."""
    dsp, bpk = summary["stragglers"][dsp_name(m), level], summary["stragglers"][BPK, level]
    noisy = [name for name, s in ((dsp_name(m), dsp), (BPK, bpk)) if min(s["relative"]) < 0]
    detail = f"{dsp['slowdown']:+.1%} vs BP-K {bpk['slowdown']:+.1%}"
    if noisy:
        detail += (f"; a straggled run of {' and '.join(noisy)} was faster than its clean pair: noise, the "
                   "measurement cannot decide")
    return harness.Claim(f"+{level:.0%} stragglers slow {dsp_name(m)} less than BP-K (relative slow-down)",
                         not noisy and dsp["slowdown"] < bpk["slowdown"], detail)


def claims(setup: TimingSetup, summary: dict, per_rank: list[dict]) -> list[harness.Claim]:
    checks = [harness.Claim("BP-K ends with BP's weights, bit for bit", same_weights(per_rank, BPK),
                            smoke_scale=True)]
    for m in setup.staleness:
        ratio = summary["ratios"][dsp_name(m), BPK]
        checks.append(harness.Claim(
            f"{dsp_name(m)} ({staleness_origin(m)}) has >= {SPEEDUP_CLAIM}x the throughput of BP-K",
            ratio["median"] >= SPEEDUP_CLAIM,
            f"median of the paired epochs {ratio['median']:.2f}x, min {ratio['min']:.2f}x, max {ratio['max']:.2f}x, "
            "mean +- SE {:.2f} +- {:.2f}x".format(*mean_se(ratio["ratios"]))))
    for m in setup.staleness:
        for level in setup.straggler_levels[1:]:
            checks.append(straggler_claim(setup, summary, m, level))
    return checks


# --------------------------------------------------------------------------- outputs


def _range(median: float, low: float, high: float, fmt: str = ".2f", unit: str = "") -> str:
    return f"{median:{fmt}}{unit} ({low:{fmt}}-{high:{fmt}})"


def markdown(setup: TimingSetup, summary: dict, runs: list[dict], command: str, seconds: float) -> str:
    s = setup.sizes
    lines = [
        "## Throughput and stragglers (2 gloo processes, one thread each)", "",
        f"Command: `{command}` ({seconds:.0f} s; torch {torch.__version__}, {harness.cpu_model()}, "
        f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f}).", "",
        f"Residual CNN ({s.channels} channels, {s.units} units; BP-K and DSP cut after unit {s.split}, GPipe and "
        f"1F1B after unit {s.pipeline_split}), batches of {s.batch}, SGD lr {setup.lr} momentum {s.momentum}. "
        f"Median epoch time of {setup.epochs} interleaved epochs of {s.steps_per_epoch} batches (min-max).", "",
        "| mode | median epoch s (min-max) | samples/s | BP-K / mode, paired (min-max) "
        "| stage compute s (rank 0 / 1) |",
        "|---|---|---|---|---|",
    ]
    bpk = _times(runs, "A", BPK)
    for name in setup.modes:
        t = summary["throughput"][name]
        mine = _times(runs, "A", name)
        ratio = spread([bpk[rep] / mine[rep] for rep in sorted(mine)])
        part = [r for r in runs if r["part"] == "A" and r["mode"] == name]
        c0 = statistics.median(r["compute_seconds_rank0"] for r in part)
        c1 = statistics.median(r["compute_seconds_rank1"] for r in part)
        stage_compute = f"{c0:.2f} / {c1:.2f}" if c0 or c1 else "-"
        lines.append(f"| {name} | {_range(t['seconds'], t['min'], t['max'])} | {t['samples_per_s']:.0f} | "
                     f"{_range(*ratio, unit='x')} | {stage_compute} |")
    lines += ["", "DSP's speed against every mode: the other mode's epoch time over DSP's, paired by epoch, "
              "median (min-max); above 1: DSP faster. m = 1 is this library's own configuration, not the "
              "paper's (whose queues give m >= 2 with two stages).", "",
              "| DSP | " + " | ".join(name for name in setup.modes if not name.startswith("DSP")) + " |",
              "|---|" + "---|" * sum(not name.startswith("DSP") for name in setup.modes)]
    for m in setup.staleness:
        cells = [summary["ratios"][dsp_name(m), other] for other in setup.modes if not other.startswith("DSP")]
        lines.append(f"| m={m} | " + " | ".join(_range(c["median"], c["min"], c["max"], unit="x") for c in cells)
                     + " |")
    lines += [
        "", f"Stragglers: each compute phase slowed with probability {setup.straggler_probability} by the level "
        f"(a sleep of that fraction of its duration); {setup.straggler_steps} batches per run, "
        f"{setup.straggler_reps} interleaved repetitions. Relative slow-down (the paper's metric): straggled / "
        "clean time of the same repetition - 1, median and each repetition; clean: median seconds.", "",
        "| mode | " + " | ".join(f"+{level:.0%}" for level in setup.straggler_levels) + " |",
        "|---|" + "---|" * len(setup.straggler_levels),
    ]
    for name in setup.straggled:
        cells = []
        for level in setup.straggler_levels:
            st = summary["stragglers"][name, level]
            cells.append(f"{st['seconds']:.2f} s" if level == 0 else
                         f"{st['slowdown']:+.1%} [{' '.join(f'{v:+.1%}' for v in st['relative'])}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(setup: TimingSetup, summary: dict, path) -> None:
    try:
        plt = harness.pyplot()
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = setup.modes
    medians = [summary["throughput"][n]["seconds"] for n in names]
    errors = [[m - summary["throughput"][n]["min"] for n, m in zip(names, medians)],
              [summary["throughput"][n]["max"] - m for n, m in zip(names, medians)]]
    left.bar(range(len(names)), medians, yerr=errors, capsize=3, color="tab:blue")
    left.set_xticks(range(len(names)), names, rotation=35, ha="right")
    left.set_ylabel("epoch seconds (median, min-max)")
    left.set_title("throughput, 2 processes")
    levels = [100 * level for level in setup.straggler_levels]
    for name in setup.straggled:
        right.plot(levels, [100 * summary["stragglers"][name, level]["slowdown"] for level in setup.straggler_levels],
                   marker="o", label=name)
    right.set_xlabel(f"straggler slow-down % (probability {setup.straggler_probability})")
    right.set_ylabel("relative slow-down % (median)")
    right.set_title("random stragglers")
    right.grid(True, alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
