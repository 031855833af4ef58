"""DSP's claims at CPU scale: throughput against sequential model-parallel BP and GPipe, accuracy, stragglers.

The paper (Xu, Huo and Huang, CVPR 2020, sec. 5) trains ResNets cut into K = 3-4
blocks on GPUs and reports: speed-ups of x1.5-x4.8 over BP / model-parallel BP
(Table 3, with GPipe at x2.2 on ResNet-101), test accuracy at or close to BP's
(Tables 1 and 4), and a smaller slow-down than its baselines when GPUs are
randomly slowed (Table 2). This script measures the same three things on 2 gloo
processes, one thread each, on a 2-core CPU (spec sec. 8):

* data: 10 classes of synthetic 3x32x32 images, a fixed random 8x8 prototype per
  class upsampled to 32x32 plus Gaussian noise (sigma 5), standardised; 4,096
  training and 1,024 test images, seeded, nothing downloaded;
* model (the spec's, at 32 channels instead of 48 to keep the run short): conv
  3->32 (stride 2) + ReLU, six residual units ``x + relu(conv3x3(x))`` at 32
  channels and 16x16, 4x4 average pool, linear; Kaiming-normal x0.5 init, the
  classifier at zero (without the standardisation and the zero classifier the
  spec's setting starts at a loss near 11 and, at 32 channels, BP stalls near
  chance for epochs);
  cut into 2 stages where each method's work balances (spec sec. 2.7): after
  the second unit for BP-K and DSP (rank 0 runs forward + recompute + backward,
  rank 1 forward + backward; ``--split``), after the third for GPipe (both
  ranks run forward + backward); per-stage
  ``torch.optim.SGD(lr=0.01, momentum=0.9)``, batches of 64;
* modes: **BP** (one process, the whole model), **BP-K** (the DSP stage loop with
  staleness 0 everywhere: sequential model-parallel back-propagation, no
  recomputation), **GPipe** (``torch.distributed.pipelining.ScheduleGPipe``, 4
  micro-batches of 16, gradients averaged, one update per batch), **DSP m** (rank
  0 staleness m in {1, 2, 4}, rank 1 staleness 0);
* part A, throughput and accuracy: every mode trains ``--epochs`` epochs (same
  data order for all). The modes take turns every 16 batches, so that a
  machine whose load drifts slows them alike; each epoch's time (the sum of its
  turns, the pipeline drained at its end) is one repetition of the throughput
  measurement; test accuracy after the last epoch. The DSP stages stream across
  turns (``flush="never"``) and drain at each epoch's end, which computes
  exactly what a drained epoch computes;
* part B, stragglers: each compute phase of each stage is, with probability
  0.25, followed by a sleep of +50 / +100 / +150 % of its own duration (the
  paper's "slow down each GPU by a percentage with a probability"); BP-K and
  DSP m in {1, 2, 4} run ``--straggler-steps`` batches at each level in the
  steady state (no drain), taking turns every 16 batches, levels interleaved,
  ``--straggler-reps`` repetitions.

Each rank runs in a session of its own, so that on a shared machine with the
kernel's autogroup scheduling the two ranks compete for CPU as two devices,
not as one.

Claims checked (each printed PASS or FAIL; the script exits with status 1 if
one fails; ``--smoke`` runs a few batches and checks only claim 0, which a few
batches decide):

0. BP-K ends part A with BP's weights, bit for bit (the DSP loop at staleness 0
   is back-propagation, only split over two ranks);
1. every DSP configuration has at least 1.3x the throughput of BP-K (median
   epoch time);
2. DSP at m = 1 and m = 2 ends close to BP's test accuracy: at most the
   paper's largest gap below BP (1.07 points, Table 1) plus 2 standard errors
   of the difference of two accuracies on our test set (2 * sqrt(2 p (1 - p) / n));
3. under stragglers DSP is slowed less than BP-K: at every level, the seconds
   the stragglers add to the best DSP configuration (the paper's Table 2
   reading: longer queues absorb more) are fewer than they add to BP-K; each
   repetition's straggled run is paired with the clean run that took turns
   with it, and the median of the differences is compared. The relative
   slow-downs are reported too but not claimed: when every compute phase is
   slowed independently, each pipeline loses about ``p * pct`` of the time of
   its critical path, which DSP shortens but does not remove.

Outputs (``--out``, default ``perf/results/dsp/``; with ``--smoke``
``perf/results/local/smoke/dsp/``): ``dsp_runs.csv`` (every timed run),
``dsp_summary.csv`` (one row per mode and level), ``dsp_summary.md`` (the tables
and the claims) and ``dsp.png``.

    python -m perf.dsp_experiment [--smoke] [--epochs 4] [--straggler-reps 3] [--out DIR]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/dsp_experiment.py
    import _as_module

    _as_module.run(__file__)

import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from perf import _harness as harness
from perf import _ranks as ranks
from tritonopt.dist import DSPStage, split_stages

NAME = "dsp"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
WORLD = 2
BP, BPK, GPIPE = "BP (1 process)", "BP-K", "GPipe"
SPEEDUP_CLAIM = 1.3
# The paper's largest gap below BP (Table 1, ResNet-164 on CIFAR-10, DSP(3,3,3,0;15,10,5,0): 93.34 vs 94.41 %).
PAPER_LARGEST_GAP = 0.0107


def dsp_name(m: int) -> str:
    return f"DSP m={m}"


@dataclass
class Setup:
    train_size: int = 4096
    test_size: int = 1024
    batch: int = 64
    epochs: int = 4
    channels: int = 32
    units: int = 6
    split: int = 2  # residual units on rank 0 (after the stem) for BP-K and DSP
    gpipe_split: int = 3  # ... for GPipe, whose ranks both run forward + backward
    lr: float = 0.01
    momentum: float = 0.9
    microbatches: int = 4
    staleness: tuple = (1, 2, 4)
    straggler_probability: float = 0.25
    straggler_levels: tuple = (0.0, 0.5, 1.0, 1.5)
    straggler_steps: int = 32
    chunk: int = 16  # batches per turn: the modes are interleaved at this grain
    straggler_reps: int = 3
    straggler_staleness: tuple = (1, 2, 4)
    accuracy_staleness: tuple = (1, 2)  # "small m" for claim 2
    smoke: bool = False
    modes: list = field(default_factory=list)

    def __post_init__(self):
        self.modes = [BP, BPK, GPIPE] + [dsp_name(m) for m in self.staleness]

    @property
    def steps_per_epoch(self) -> int:
        return self.train_size // self.batch


# --------------------------------------------------------------------------- data and model


def make_data(setup: Setup):
    """Class prototypes (8x8, upsampled) plus noise; the same tensors on every rank."""
    gen = torch.Generator().manual_seed(0)
    prototypes = nn.functional.interpolate(torch.randn(10, 3, 8, 8, generator=gen), size=32, mode="bilinear",
                                           align_corners=False)

    def draw(n):
        labels = torch.randint(0, 10, (n,), generator=gen)
        return prototypes[labels] + 5.0 * torch.randn(n, 3, 32, 32, generator=gen), labels

    x_train, y_train = draw(setup.train_size)
    x_test, y_test = draw(setup.test_size)
    scale = x_train.std()  # standardised with the training set's statistics
    return x_train / scale, y_train, x_test / scale, y_test


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


def make_model(setup: Setup) -> nn.Sequential:
    torch.manual_seed(0)
    c = setup.channels
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, stride=2, padding=1), nn.ReLU(),
        *[Residual(c) for _ in range(setup.units)],
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(c * 16, 10),
    )
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)
                module.weight.mul_(0.5)
                nn.init.zeros_(module.bias)
        model[-1].weight.zero_()  # the classifier starts at zero: initial loss ln 10
    return model


def stages_of(model: nn.Sequential, setup: Setup, name: str) -> list[nn.Module]:
    units = setup.gpipe_split if name == GPIPE else setup.split
    return split_stages(model, boundaries=[2 + units])


def epoch_batches(x, y, setup: Setup, epoch: int, steps: int | None = None):
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1000 + epoch))
    count = len(y) // setup.batch if steps is None else steps
    return [(x[order[i * setup.batch:(i + 1) * setup.batch]], y[order[i * setup.batch:(i + 1) * setup.batch]])
            for i in range(count)]


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

    def __init__(self, name: str, rank: int, setup: Setup):
        self.name, self.rank = name, rank
        model = make_model(setup)
        self.hook = Straggler()
        self.losses: list[float] = []
        loss_fn = nn.functional.cross_entropy
        if name == BP:
            self.module = model if rank == 0 else None
            if self.module is not None:
                self.optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr, momentum=setup.momentum)
            return
        self.module = stages_of(model, setup, name)[rank]
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=setup.lr, momentum=setup.momentum)
        if name == GPIPE:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            stage = PipelineStage(self.module, rank, WORLD, torch.device("cpu"))
            self.schedule = ScheduleGPipe(stage, n_microbatches=setup.microbatches, loss_fn=loss_fn)
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
                loss = nn.functional.cross_entropy(self.module(x), y)
                loss.backward()
                self.optimizer.step()
                self.losses.append(loss.item())
        elif self.name == GPIPE:
            for x, y in batches:
                self.optimizer.zero_grad()
                if self.rank == 0:
                    self.schedule.step(x)
                else:
                    losses = []
                    self.schedule.step(target=y, losses=losses)
                    self.losses.append(sum(float(v.detach()) for v in losses) / len(losses))
                self.optimizer.step()
        else:
            losses = self.stage.train(batches)
            if losses is not None:
                self.losses += losses.tolist()

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


def run_rank(rank: int, setup: Setup) -> dict:
    x_train, y_train, _, _ = make_data(setup)
    modes = {name: Mode(name, rank, setup) for name in setup.modes}
    warmup = epoch_batches(x_train, y_train, setup, epoch=-1, steps=2)
    for mode in modes.values():  # first-call costs (allocator, dry runs) stay out of the timings
        timed(mode, warmup, end_of_epoch=True)
    runs = []
    for epoch in range(setup.epochs):
        chunks = chunked(epoch_batches(x_train, y_train, setup, epoch), setup.chunk)
        seconds = dict.fromkeys(modes, 0.0)
        compute = dict.fromkeys(modes, 0.0)
        for c, chunk in enumerate(chunks):  # the modes take turns chunk by chunk
            for name, mode in modes.items():
                mode.hook.configure(0.0, 0.0, 0)
                seconds[name] += timed(mode, chunk, end_of_epoch=c == len(chunks) - 1)
                compute[name] += mode.hook.compute_seconds
        for name in modes:
            runs.append({"part": "A", "mode": name, "rep": epoch, "level": 0.0, "steps": setup.steps_per_epoch,
                         "rank": rank, "seconds": seconds[name], "compute_seconds": compute[name]})
            if rank == 0:
                print(f"[A] epoch {epoch + 1}/{setup.epochs}  {name:<16} {seconds[name]:6.2f} s", flush=True)
    # Part A's outcome, before part B trains further.
    losses = {name: list(modes[name].losses) for name in setup.modes}
    states = {name: modes[name].state() for name in setup.modes}
    straggled = [BPK] + [dsp_name(m) for m in setup.straggler_staleness]
    chunks = chunked(epoch_batches(x_train, y_train, setup, epoch=10_000, steps=setup.straggler_steps), setup.chunk)
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
            print(f"[B] rep {rep + 1}/{setup.straggler_reps}  "
                  + "  ".join(f"{name} +{level:.0%} {seconds[name, level]:.2f} s" for name, level in seconds),
                  flush=True)
    for mode in modes.values():
        mode.drain()
    return {"runs": runs, "losses": losses, "states": states}


def _rank_main(rank: int, world: int, setup: Setup) -> dict:
    return run_rank(rank, setup)


def run_ranks(setup: Setup, timeout: float = 3600.0) -> list[dict]:
    # Each rank in a session of its own: with the kernel's autogroup scheduling
    # (sched_autogroup_enabled), the processes of one session share one slice of a busy machine,
    # which would make the two ranks one device. Each rank stands for a device of its own, as in
    # the paper; on an idle machine this changes nothing.
    return ranks.run_on_ranks(WORLD, _rank_main, setup, timeout=timeout, own_session=True, weights_only=True)


# --------------------------------------------------------------------------- analysis


def test_accuracy(setup: Setup, name: str, per_rank: list[dict]) -> float:
    _, _, x_test, y_test = make_data(setup)
    model = make_model(setup)
    if name == BP:
        model.load_state_dict(per_rank[0]["states"][name])
    else:
        for stage, result in zip(stages_of(model, setup, name), per_rank):
            stage.load_state_dict(result["states"][name])
    model.eval()
    with torch.no_grad():
        predictions = torch.cat([model(x).argmax(1) for x in x_test.split(256)])
    return (predictions == y_test).float().mean().item()


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


def summarise(setup: Setup, runs: list[dict], per_rank: list[dict]) -> dict:
    summary = {"throughput": {}, "accuracy": {}, "stragglers": {}}
    for name in setup.modes:
        times = [r["seconds"] for r in runs if r["part"] == "A" and r["mode"] == name]
        median = statistics.median(times)
        steps = next(r["steps"] for r in runs if r["part"] == "A" and r["mode"] == name)
        summary["throughput"][name] = {"seconds": median, "runs": times,
                                       "samples_per_s": steps * setup.batch / median}
        last = per_rank[0]["losses"][name] or per_rank[1]["losses"][name]
        steps_per_epoch = setup.train_size // setup.batch
        summary["accuracy"][name] = {"test_accuracy": test_accuracy(setup, name, per_rank),
                                     "final_train_loss": statistics.mean(last[-steps_per_epoch:])}
    for name in [BPK] + [dsp_name(m) for m in setup.straggler_staleness]:
        part = [r for r in runs if r["part"] == "B" and r["mode"] == name]
        clean = {r["rep"]: r["seconds"] for r in part if r["level"] == 0.0}
        for level in setup.straggler_levels:
            times = {r["rep"]: r["seconds"] for r in part if r["level"] == level}
            # paired: each repetition's run against the clean run that took turns with it
            added = [times[rep] - clean[rep] for rep in sorted(times)]
            relative = [times[rep] / clean[rep] - 1.0 for rep in sorted(times)]
            summary["stragglers"][(name, level)] = {
                "seconds": statistics.median(times.values()), "runs": [times[rep] for rep in sorted(times)],
                "added_seconds": statistics.median(added), "slowdown": statistics.median(relative),
            }
    return summary


def same_weights(per_rank: list[dict], name: str) -> bool:
    """Whether mode ``name``'s stages (both ranks) hold exactly BP's weights after part A."""
    whole = per_rank[0]["states"][BP]
    split = {**per_rank[0]["states"][name], **per_rank[1]["states"][name]}
    return split.keys() == whole.keys() and all(torch.equal(split[key], whole[key]) for key in whole)


def claims(setup: Setup, summary: dict, per_rank: list[dict]) -> list[harness.Claim]:
    checks = [harness.Claim("BP-K ends with BP's weights, bit for bit", same_weights(per_rank, BPK),
                            smoke_scale=True)]
    bpk = summary["throughput"][BPK]["seconds"]
    for m in setup.staleness:
        speedup = bpk / summary["throughput"][dsp_name(m)]["seconds"]
        checks.append(harness.Claim(f"{dsp_name(m)} has >= {SPEEDUP_CLAIM}x the throughput of BP-K",
                                    speedup >= SPEEDUP_CLAIM, f"{speedup:.2f}x"))
    bp = summary["accuracy"][BP]["test_accuracy"]
    tolerance = PAPER_LARGEST_GAP + 2 * math.sqrt(2 * bp * (1 - bp) / setup.test_size)
    for m in setup.accuracy_staleness:
        acc = summary["accuracy"][dsp_name(m)]["test_accuracy"]
        checks.append(harness.Claim(f"{dsp_name(m)} test accuracy at most {100 * tolerance:.1f} points below BP's",
                                    acc >= bp - tolerance, f"{100 * acc:.1f} % vs BP {100 * bp:.1f} %"))
    for level in setup.straggler_levels[1:]:
        bpk_added = summary["stragglers"][(BPK, level)]["added_seconds"]
        added = {m: summary["stragglers"][(dsp_name(m), level)]["added_seconds"] for m in setup.straggler_staleness}
        best = min(added, key=added.get)
        checks.append(harness.Claim(
            f"+{level:.0%} stragglers add fewer seconds to DSP (best queue, m={best}) than to BP-K",
            added[best] < bpk_added, f"{added[best]:+.2f} s vs {bpk_added:+.2f} s"))
    return checks


# --------------------------------------------------------------------------- outputs


def markdown(setup: Setup, summary: dict, checks, command: str, seconds: float, runs: list[dict]) -> str:
    bpk = summary["throughput"][BPK]["seconds"]
    compute = {}
    for name in setup.modes:
        part = [r for r in runs if r["part"] == "A" and r["mode"] == name]
        compute[name] = (statistics.median(r["compute_seconds_rank0"] for r in part),
                         statistics.median(r["compute_seconds_rank1"] for r in part))
    lines = [
        "# DSP on 2 gloo processes (CPU, one thread each)", "",
        f"Command: `{command}` ({seconds:.0f} s in all; torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average at the end {os.getloadavg()[0]:.1f}).", "",
        f"Residual CNN ({setup.channels} channels, {setup.units} units, cut after unit {setup.split}), "
        f"{setup.train_size} synthetic training images, batches of {setup.batch}, SGD lr {setup.lr} momentum "
        f"{setup.momentum}. Throughput: median epoch time over {setup.epochs} interleaved epochs. "
        f"Accuracy: {setup.test_size} test images after {setup.epochs} epochs.", "",
        "| mode | median epoch s | epochs (s) | samples/s | vs BP-K | stage compute s (rank 0 / 1) "
        "| test accuracy | final train loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in setup.modes:
        t, a = summary["throughput"][name], summary["accuracy"][name]
        c0, c1 = compute[name]
        stage_compute = f"{c0:.2f} / {c1:.2f}" if c0 or c1 else "-"
        lines.append(
            f"| {name} | {t['seconds']:.2f} | {' '.join(f'{v:.2f}' for v in t['runs'])} | "
            f"{t['samples_per_s']:.0f} | {bpk / t['seconds']:.2f}x | {stage_compute} | "
            f"{100 * a['test_accuracy']:.1f} % | {a['final_train_loss']:.3f} |"
        )
    lines += [
        "", f"Stragglers: each compute phase slowed with probability {setup.straggler_probability} by the level "
        f"(a sleep of that fraction of its duration); {setup.straggler_steps} batches per run, median of "
        f"{setup.straggler_reps} interleaved repetitions; added seconds and relative slow-down against the same "
        "mode without stragglers.", "",
        "| mode | " + " | ".join(f"+{level:.0%}" for level in setup.straggler_levels) + " |",
        "|---|" + "---|" * len(setup.straggler_levels),
    ]
    for name in [BPK] + [dsp_name(m) for m in setup.straggler_staleness]:
        cells = []
        for level in setup.straggler_levels:
            s = summary["stragglers"][(name, level)]
            runs_text = " ".join(f"{v:.2f}" for v in s["runs"])
            cells.append(f"{s['seconds']:.2f} s [{runs_text}]" if level == 0 else
                         f"{s['seconds']:.2f} s, {s['added_seconds']:+.2f} s ({s['slowdown']:+.0%}) [{runs_text}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if not checks:
        return "\n".join(lines) + "\n"
    lines += ["", "Claims:", ""]
    for claim in checks:
        verdict = "not checked (smoke run)" if setup.smoke and not claim.smoke_scale else (
            "PASS" if claim.holds else "FAIL")
        lines.append(f"- {verdict}: {claim.text}" + (f" ({claim.detail})" if claim.detail else ""))
    return "\n".join(lines) + "\n"


def plot(setup: Setup, summary: dict, path) -> None:
    try:
        plt = harness.pyplot()
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    names = setup.modes
    left.bar(range(len(names)), [summary["throughput"][n]["samples_per_s"] for n in names], color="tab:blue")
    left.set_xticks(range(len(names)), names, rotation=30, ha="right")
    left.set_ylabel("training samples / s (median epoch)")
    left.set_title("throughput, 2 processes")
    middle.bar(range(len(names)), [100 * summary["accuracy"][n]["test_accuracy"] for n in names], color="tab:green")
    middle.set_xticks(range(len(names)), names, rotation=30, ha="right")
    middle.set_ylabel(f"test accuracy % after {setup.epochs} epochs")
    middle.set_ylim(0, 100)
    middle.set_title("accuracy")
    levels = [100 * level for level in setup.straggler_levels]
    for name in [BPK] + [dsp_name(m) for m in setup.straggler_staleness]:
        right.plot(levels, [summary["stragglers"][(name, level)]["seconds"] for level in setup.straggler_levels],
                   marker="o", label=name)
    right.set_xlabel(f"straggler slow-down % (probability {setup.straggler_probability})")
    right.set_ylabel(f"seconds for {setup.straggler_steps} batches (median)")
    right.set_title("random stragglers")
    right.grid(True, alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def parse_args(argv):
    parser = harness.script_parser(
        __doc__.split("\n\n")[0], default_out="perf/results/dsp/",
        smoke_help="seconds: 256 training images, 8 channels, 1 epoch, 4 straggler batches, one repetition; "
        "checks the plumbing and the BP-K reproduction only",
    )
    parser.add_argument("--epochs", type=harness.positive_int, default=4,
                        help="epochs of part A (>= 3 for a median of 3 or more; default: %(default)s)")
    parser.add_argument("--straggler-reps", type=harness.positive_int, default=3,
                        help="repetitions of part B (default: %(default)s)")
    parser.add_argument("--straggler-steps", type=harness.positive_int, default=32,
                        help="batches per straggler run (default: %(default)s)")
    parser.add_argument("--split", type=int, default=2,
                        help="residual units on rank 0 for BP-K and DSP (1..5; GPipe's cut stays after unit 3)")
    args = parser.parse_args(argv)
    if not 1 <= args.split < Setup.units:
        parser.error(f"--split must be in 1..{Setup.units - 1}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        setup = Setup(train_size=256, test_size=128, channels=8, epochs=1, straggler_steps=4, straggler_reps=1,
                      straggler_levels=(0.0, 1.0), split=args.split, smoke=True)
    else:
        setup = Setup(epochs=args.epochs, straggler_reps=args.straggler_reps, straggler_steps=args.straggler_steps,
                      split=args.split)
    out_dir = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    os.environ.setdefault("TRITONOPT_BACKEND", "reference")
    torch.set_num_threads(1)
    began = time.perf_counter()
    per_rank = run_ranks(setup)
    runs = merge_runs(per_rank)
    summary = summarise(setup, runs, per_rank)
    checks = claims(setup, summary, per_rank)
    command = "python -m perf.dsp_experiment" + (" --smoke" if args.smoke else "") + "".join(
        f" --{flag} {value}" for flag, value, default in [
            ("epochs", args.epochs, 4), ("straggler-reps", args.straggler_reps, 3),
            ("straggler-steps", args.straggler_steps, 32), ("split", args.split, 2)]
        if value != default and not args.smoke)
    seconds = time.perf_counter() - began
    text = markdown(setup, summary, checks, command, seconds, runs)
    summary_rows = [
        {"part": "A", "mode": name, "level": 0.0, "median_seconds": summary["throughput"][name]["seconds"],
         "samples_per_s": summary["throughput"][name]["samples_per_s"],
         "test_accuracy": summary["accuracy"][name]["test_accuracy"],
         "final_train_loss": summary["accuracy"][name]["final_train_loss"]}
        for name in setup.modes
    ] + [
        {"part": "B", "mode": name, "level": level, "median_seconds": s["seconds"], "added_seconds": s["added_seconds"],
         "slowdown": s["slowdown"]}
        for (name, level), s in summary["stragglers"].items()
    ]
    written = [harness.write_results(runs, out_dir, "dsp_runs"), harness.write_results(summary_rows, out_dir,
                                                                                        "dsp_summary")]
    (out_dir / "dsp_summary.md").write_text(text)
    print(markdown(setup, summary, [], command, seconds, runs))  # the claims are printed last, with the verdict
    plot(setup, summary, out_dir / "dsp.png")
    print("wrote " + ", ".join(str(path) for path in written + [out_dir / "dsp_summary.md"]))
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
