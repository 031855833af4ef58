"""SSD-SGD's claims at CPU scale: fewer bytes, faster on a slow link, SSGD's accuracy, GLU over plain SGD.

The paper (Xu et al., SSD-SGD, sec. 4) trains ResNets on 4 machines and reports
that several-steps delay keeps SSGD's test accuracy for small ``k``, that GLU
beats a plain-SGD local updater (Fig. 5), and that pulling the weights every
``k`` iterations speeds communication-bound training up (Figs. 6-7). This
script reproduces those claims on 4 gloo processes on the CPU:

* task: a teacher-student classification problem generated in-process
  (24,000 samples of 32 features; labels ``argmax(3 tanh(X W1) W2 + 0.3 eps)``
  of a fixed random teacher; 20,000 for training, split into 4 shards, 4,000
  for testing), an MLP 32-256-256-10 (76,810 parameters), batch 32 per rank,
  cross-entropy, server lr 0.05, momentum 0.9, weight decay 1e-4;
* 101 warm-up (SSGD) iterations (``wp = 100``; the paper uses 500), then 600
  iterations (4.5 epochs in all), a multiple of every ``k`` so the global
  model is exact at the end;
* runs: SSGD (SSDSGD that never leaves the warm-up), SSD-SGD ``k`` = 2, 3, 5,
  8 with GLU (alpha 2, beta 0.5, local lr 4 lr), SSD-SGD ``k`` = 5 with the
  plain-SGD local updater (alpha 1, beta 0, local lr = lr), and torch's post-local
  SGD (``PostLocalSGDOptimizer`` over momentum SGD with a
  ``PeriodicModelAverager`` of period 5 after the same warm-up, whose gradients
  are all-reduced), each on 3 seeds (model initialisation and batch order);
* every collective travels over an emulated link (design note sec. 7.3): it
  is issued at once as a real asynchronous gloo collective, and waiting for it
  returns at the later of the real completion and the modeled end of the
  transfer, which starts when it is issued (or when the previous transfer ends:
  one link) and lasts ``latency + bytes_on_wire / bandwidth``, with
  ``bytes_on_wire = 2 (N - 1) / N`` times the payload (a ring all-reduce);
  5 MB/s and 1 ms by default. SSGD's all-reduce then takes about 93 ms against
  roughly 10-60 ms of compute per step on a shared 2-core machine, the
  communication-bound regime the paper targets. Until it waits, a rank keeps
  computing, which is the overlap SSD-SGD relies on. torch's averager calls
  ``dist.all_reduce`` itself (blocking); its modeled transfer is waited out
  after each averaging.

Measured per run: wall-clock of the training loop (slowest rank; summarised by
the median over the seeds, as every timing of this project, since other jobs
share the machine), payload bytes
each rank sent, test accuracy of the global model (SSD-SGD: ``finalize()`` then
``global_parameters()``; post-local SGD: the average of the ranks' final
models) and of rank 0's local model. The exact mapping is deterministic, so
accuracy does not depend on the emulated link; only wall-clock does.

Claims checked (the script exits with status 1 if one fails; the comparison with
post-local SGD is reported, not judged):

1. SSD-SGD ``k`` = 5 moves at least 2x fewer bytes than SSGD;
2. it runs at least 1.5x faster than SSGD on the emulated link (median wall-clock of the seeds);
3. its global model's test accuracy is at most 1 point below SSGD's (mean);
4. GLU beats the plain-SGD local updater at ``k`` = 5 (mean test accuracy).

Results (``--out``, default ``perf/results/ssd_sgd/``; ``--smoke``: under
``perf/results/local/smoke/``): ``ssd_sgd_runs.csv`` (one line per run and seed),
``ssd_sgd_summary.md`` (table and claim checks), ``ssd_sgd.png`` (accuracy against
wall-clock, and rank 0's training loss).

    python -m perf.ssd_sgd_experiment [--seeds 0 1 2] [--bandwidth-mbps 5] [--latency-ms 1] [--out DIR]
    python -m perf.ssd_sgd_experiment --smoke     # short runs, no emulation: only claim 1 is judged
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/ssd_sgd_experiment.py
    import _as_module

    _as_module.run(__file__)

import datetime
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from perf import _harness as harness
from perf import _ranks as ranks
from tritonopt.dist import SSDSGD, CountingCommunicator

NAME = "ssd_sgd"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
WORLD = 4
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
SSGD, POST_LOCAL = "SSGD", "post-local SGD k=5"


@dataclass(frozen=True)
class Setup:
    samples: int = 24_000
    train: int = 20_000
    features: int = 32
    teacher_hidden: int = 128
    classes: int = 10
    hidden: int = 256
    batch: int = 32  # per rank
    warmup_steps: int = 101  # the paper's wp + 1
    delay_iterations: int = 600  # a multiple of every k below
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    bandwidth_mbps: float = 5.0
    latency_ms: float = 1.0
    data_seed: int = 1234
    seeds: tuple = (0, 1, 2)

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.delay_iterations


@dataclass(frozen=True)
class Run:
    name: str
    kind: str  # "ssd" | "post_local"
    k: int = 1
    glu: dict = field(default_factory=dict)


def runs() -> list[Run]:
    """The runs in the order they execute: SSGD and SSD-SGD k = 5 back to back, as their times are compared."""
    return [
        Run(SSGD, "ssd", 1, dict(ssgd=True)),
        Run("SSD-SGD k=5", "ssd", 5),
        Run("SSD-SGD k=5, SGD local updater", "ssd", 5, dict(glu_alpha=1.0, glu_beta=0.0, local_lr_mult=1.0)),
        *[Run(f"SSD-SGD k={k}", "ssd", k) for k in (2, 3, 8)],
        Run(POST_LOCAL, "post_local", 5),
    ]


TABLE_ORDER = (SSGD, "SSD-SGD k=2", "SSD-SGD k=3", "SSD-SGD k=5", "SSD-SGD k=8", "SSD-SGD k=5, SGD local updater",
               POST_LOCAL)


# --------------------------------------------------------------------------- data and model


def make_data(setup: Setup):
    """The teacher-student task: deterministic, identical on every rank."""
    gen = torch.Generator().manual_seed(setup.data_seed)
    x = torch.randn(setup.samples, setup.features, generator=gen)
    w1 = torch.randn(setup.features, setup.teacher_hidden, generator=gen) / math.sqrt(setup.features)
    w2 = torch.randn(setup.teacher_hidden, setup.classes, generator=gen) / math.sqrt(setup.teacher_hidden)
    noise = torch.randn(setup.samples, setup.classes, generator=gen)
    y = (3 * torch.tanh(x @ w1) @ w2 + 0.3 * noise).argmax(dim=1)
    return x[: setup.train], y[: setup.train], x[setup.train :], y[setup.train :]


def make_mlp(setup: Setup, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(setup.features, setup.hidden), nn.ReLU(),
                         nn.Linear(setup.hidden, setup.hidden), nn.ReLU(),
                         nn.Linear(setup.hidden, setup.classes))


class ShardBatches:
    """Batches of one rank's shard: a fresh permutation each epoch, seeded by (seed, rank, epoch)."""

    def __init__(self, x, y, rank: int, world: int, batch: int, seed: int):
        shard = x.shape[0] // world
        self.x, self.y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        self.batch, self.seed, self.rank = batch, seed, rank
        self.per_epoch = shard // batch
        self._epoch, self._order = -1, None

    def __call__(self, step: int):
        epoch, position = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(1_000_003 * self.seed + 1_009 * self.rank + epoch)
            self._order, self._epoch = torch.randperm(self.x.shape[0], generator=gen), epoch
        index = self._order[position * self.batch : (position + 1) * self.batch]
        return self.x[index], self.y[index]


def accuracy(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean()) * 100


# --------------------------------------------------------------------------- the emulated link


class LinkTime:
    """Seconds a ring all-reduce of ``nbytes`` takes per rank on the emulated link."""

    def __init__(self, bandwidth_mbps: float, latency_ms: float, world: int):
        self.bandwidth = bandwidth_mbps * 1e6
        self.latency = latency_ms * 1e-3
        self.world = world

    def __call__(self, nbytes: int) -> float:
        if self.bandwidth <= 0:
            return 0.0
        return self.latency + 2 * (self.world - 1) / self.world * nbytes / self.bandwidth


class _LinkHandle:
    """A real gloo work handle whose ``wait`` also lasts until the modeled end of the transfer."""

    def __init__(self, work, done_at: float):
        self.work, self.done_at = work, done_at

    def wait(self):
        self.work.wait()
        remaining = self.done_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return True


class EmulatedLinkCommunicator(CountingCommunicator):
    """Collectives over a modeled link: each one ends at the later of the real gloo call's end and its modeled end.

    A collective issued at time ``t`` starts its transfer at ``max(t, end of the
    previous transfer)`` (one link, transfers in order) and ends ``link(bytes)``
    seconds later. The real collective is issued at once, asynchronously (gloo's
    own threads), so the caller keeps computing until it waits, as with a real
    network; waiting returns when both the real collective and the modeled
    transfer are done.
    """

    def __init__(self, link: LinkTime, group=None):
        super().__init__(group)
        self.link = link
        self.link_seconds = 0.0
        self._free_at = 0.0

    def schedule(self, nbytes: int) -> float:
        """The modeled end of a transfer of ``nbytes`` issued now."""
        seconds = self.link(nbytes)
        self.link_seconds += seconds
        self._free_at = max(time.perf_counter(), self._free_at) + seconds
        return self._free_at

    def _issue(self, work, nbytes: int, async_op: bool):
        handle = _LinkHandle(work, self.schedule(nbytes))
        if async_op:
            return handle
        handle.wait()
        return None

    def all_reduce(self, tensor, *, label, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = super().all_reduce(tensor, label=label, op=op, group=group, async_op=True)
        return self._issue(work, tensor.numel() * tensor.element_size(), async_op)

    def broadcast(self, tensor, src, *, label, group=None, async_op=False):
        work = super().broadcast(tensor, src, label=label, group=group, async_op=True)
        return self._issue(work, tensor.numel() * tensor.element_size(), async_op)


# --------------------------------------------------------------------------- one run on one rank


def train_ssd(rank, setup, run, seed, data, link) -> dict:
    x_train, y_train, x_test, y_test = data
    model = make_mlp(setup, seed)
    comm = EmulatedLinkCommunicator(link)
    warmup = setup.steps if run.glu.get("ssgd") else setup.warmup_steps
    glu = {k: v for k, v in run.glu.items() if k != "ssgd"}
    opt = SSDSGD(model.parameters(), lr=setup.lr, momentum=setup.momentum, weight_decay=setup.weight_decay,
                 delay_steps=run.k, warmup_steps=warmup, communicator=comm, **glu)
    comm.reset()  # count the training's collectives only (not the set-up check and broadcast)
    batches = ShardBatches(x_train, y_train, rank, WORLD, setup.batch, seed)
    losses = []
    dist.barrier()
    start = time.perf_counter()
    for t in range(setup.steps):
        x, y = batches(t)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    opt.finalize()
    seconds = time.perf_counter() - start
    local_acc = accuracy(model, x_test, y_test)
    with torch.no_grad():
        for p, g in zip(model.parameters(), opt.global_parameters()):
            p.copy_(g)
    return dict(seconds=seconds, bytes_sent=comm.total_bytes("sent"), link_seconds=comm.link_seconds,
                collectives=sum(s.calls for s in comm.stats().values()),
                global_acc=accuracy(model, x_test, y_test), local_acc=local_acc, losses=losses)


def train_post_local(rank, setup, run, seed, data, link) -> dict:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    x_train, y_train, x_test, y_test = data
    model = make_mlp(setup, seed)
    params = list(model.parameters())
    comm = EmulatedLinkCommunicator(link)
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in params])
        comm.broadcast(flat, 0, label="initial_broadcast")
        torch.nn.utils.vector_to_parameters(flat, params)
    comm.reset()
    local = torch.optim.SGD(params, lr=setup.lr, momentum=setup.momentum, weight_decay=setup.weight_decay)
    averager = PeriodicModelAverager(period=run.k, warmup_steps=setup.warmup_steps)
    opt = PostLocalSGDOptimizer(optim=local, averager=averager)
    batches = ShardBatches(x_train, y_train, rank, WORLD, setup.batch, seed)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    averaged_bytes = 0
    losses = []
    dist.barrier()
    start = time.perf_counter()
    for t in range(setup.steps):
        x, y = batches(t)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if t < setup.warmup_steps:  # synchronous SGD: average the gradients, as DDP would
            grads = torch.cat([p.grad.reshape(-1) for p in params])
            comm.all_reduce(grads, label="warmup_grad_allreduce")
            grads /= WORLD
            torch.nn.utils.vector_to_parameters(grads, [p.grad for p in params])
        step = averager.step
        averages = step >= averager.warmup_steps and (step - averager.warmup_steps) % averager.period == 0
        done_at = comm.schedule(param_bytes) if averages else 0.0  # torch's averaging: issued in step()
        opt.step()
        if averages:  # its blocking all_reduce is done; wait out the modeled transfer too
            averaged_bytes += param_bytes
            time.sleep(max(0.0, done_at - time.perf_counter()))
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    local_acc = accuracy(model, x_test, y_test)
    with torch.no_grad():  # the global model: the average of the ranks' (not timed, not counted)
        flat = torch.cat([p.reshape(-1) for p in params])
        dist.all_reduce(flat)
        torch.nn.utils.vector_to_parameters(flat / WORLD, params)
    return dict(seconds=seconds, bytes_sent=comm.total_bytes("sent") + averaged_bytes,
                link_seconds=comm.link_seconds,
                collectives=sum(s.calls for s in comm.stats().values()) + averaged_bytes // param_bytes,
                global_acc=accuracy(model, x_test, y_test), local_acc=local_acc, losses=losses)


def rank_main(rank: int, world: int, setup: Setup) -> list[dict]:
    """One rank's runs (every seed and method), on the process group :func:`run_all` set up."""
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    data = make_data(setup)
    link = LinkTime(setup.bandwidth_mbps, setup.latency_ms, world)
    results = []
    for seed in setup.seeds:
        for run in runs():
            train = train_ssd if run.kind == "ssd" else train_post_local
            result = train(rank, setup, run, seed, data, link)
            results.append(dict(run=run.name, seed=seed, **result))
            if rank == 0:
                print(f"  seed {seed} {run.name:<32} {result['seconds']:6.1f} s  "
                      f"global acc {result['global_acc']:.2f} %", flush=True)
    return results


def run_all(setup: Setup) -> list[list[dict]]:
    # One thread per rank (4 ranks on 2 cores); CPU tensors take the reference path.
    return ranks.run_on_ranks(WORLD, rank_main, setup, timeout=None, env={"TRITON_INTERPRET": None},
                              group_timeout=COLLECTIVE_TIMEOUT.total_seconds(), weights_only=True)


# --------------------------------------------------------------------------- summary


def combine(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (run, seed): the slowest rank's time, rank 0's bytes, accuracies and losses."""
    rows = []
    for entries in zip(*per_rank):
        first = entries[0]
        assert all(e["run"] == first["run"] and e["seed"] == first["seed"] for e in entries)
        assert all(e["global_acc"] == first["global_acc"] for e in entries), "ranks disagree on the global model"
        rows.append(dict(run=first["run"], seed=first["seed"], seconds=max(e["seconds"] for e in entries),
                         mb_sent=first["bytes_sent"] / 1e6, collectives=first["collectives"],
                         link_seconds=first["link_seconds"], global_acc=first["global_acc"],
                         local_acc=first["local_acc"], final_loss=statistics.fmean(first["losses"][-100:]),
                         losses=first["losses"]))
    return rows


def mean_of(rows, name, key) -> float:
    return statistics.fmean(r[key] for r in rows if r["run"] == name)


def median_of(rows, name, key) -> float:
    return statistics.median(r[key] for r in rows if r["run"] == name)


def claims(rows: list[dict]) -> list[harness.Claim]:
    """The four claims, judged on the means (accuracy, bytes) and medians (wall-clock) over the seeds."""
    ssd5, plain = "SSD-SGD k=5", "SSD-SGD k=5, SGD local updater"
    bytes_ratio = mean_of(rows, SSGD, "mb_sent") / mean_of(rows, ssd5, "mb_sent")
    speedup = median_of(rows, SSGD, "seconds") / median_of(rows, ssd5, "seconds")
    acc_gap = mean_of(rows, ssd5, "global_acc") - mean_of(rows, SSGD, "global_acc")
    glu_gain = mean_of(rows, ssd5, "global_acc") - mean_of(rows, plain, "global_acc")
    return [
        harness.Claim("SSD-SGD k = 5 moves at least 2x fewer bytes than SSGD", bytes_ratio >= 2.0,
                      f"{bytes_ratio:.2f}x", smoke_scale=True),
        harness.Claim("SSD-SGD k = 5 runs at least 1.5x faster than SSGD on the emulated link", speedup >= 1.5,
                      f"{speedup:.2f}x"),
        harness.Claim("SSD-SGD k = 5's global test accuracy is at most 1 point below SSGD's", acc_gap >= -1.0,
                      f"{acc_gap:+.2f} points"),
        harness.Claim("GLU beats the plain-SGD local updater at k = 5", glu_gain > 0, f"{glu_gain:+.2f} points"),
    ]


def summarize(rows: list[dict], setup: Setup, smoke: bool, seconds: float) -> tuple[list[str], list[harness.Claim]]:
    """The summary's lines (table, per-seed table, claim verdicts, the post-local comparison) and the claims."""
    present = {r["run"] for r in rows}
    names = [n for n in TABLE_ORDER if n in present]
    link = (f"link {setup.bandwidth_mbps:g} MB/s + {setup.latency_ms:g} ms per collective"
            if setup.bandwidth_mbps > 0 else "no link emulation (raw gloo on loopback)")
    lines = [
        "# SSD-SGD at CPU scale: 4 gloo ranks, emulated link", "",
        f"Teacher-student task, MLP {setup.features}-{setup.hidden}-{setup.hidden}-{setup.classes} "
        f"(76,810 parameters), batch {setup.batch} per rank, {setup.warmup_steps} warm-up + "
        f"{setup.delay_iterations} iterations, lr {setup.lr:g}, momentum {setup.momentum:g}, "
        f"weight decay {setup.weight_decay:g}; {link}; seeds {', '.join(map(str, setup.seeds))}. "
        "Wall-clock: median of the seeds; the rest: means.", "",
        "| run | wall-clock (s) | speed-up vs SSGD | MB sent per rank | bytes vs SSGD | collectives "
        "| test acc. global (%) | test acc. rank-0 local (%) | final train loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base_s, base_mb = median_of(rows, SSGD, "seconds"), mean_of(rows, SSGD, "mb_sent")
    for name in names:
        s, mb = median_of(rows, name, "seconds"), mean_of(rows, name, "mb_sent")
        lines.append(
            f"| {name} | {s:.1f} | {base_s / s:.2f}x | {mb:.1f} | {base_mb / mb:.2f}x fewer | "
            f"{mean_of(rows, name, 'collectives'):.0f} | {mean_of(rows, name, 'global_acc'):.2f} | "
            f"{mean_of(rows, name, 'local_acc'):.2f} | {mean_of(rows, name, 'final_loss'):.4f} |")
    per_seed = ["", "Per seed: test accuracy of the global model (%) / wall-clock (s):", "",
                "| run | " + " | ".join(f"seed {s}" for s in setup.seeds) + " |",
                "| --- |" + " --- |" * len(setup.seeds)]
    for name in names:
        cells = [f"{r['global_acc']:.2f} / {r['seconds']:.1f}" for s in setup.seeds for r in rows
                 if r["run"] == name and r["seed"] == s]
        per_seed.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += per_seed

    checks = claims(rows)
    lines += ["", "## Claim checks", ""]
    for i, claim in enumerate(checks, 1):
        verdict = "not checked (smoke run)" if smoke and not claim.smoke_scale else ("PASS" if claim.holds else "FAIL")
        lines.append(f"{i}. {verdict}: {claim.text} ({claim.detail}).")
    ssd5 = "SSD-SGD k=5"
    post_gap = mean_of(rows, ssd5, "global_acc") - mean_of(rows, POST_LOCAL, "global_acc")
    post_speed = median_of(rows, POST_LOCAL, "seconds") / median_of(rows, ssd5, "seconds")
    lines += [
        f"{len(checks) + 1}. Against torch's post-local SGD (period 5, same warm-up; reported, not judged): "
        f"SSD-SGD k = 5's global model is {post_gap:+.2f} points {'above' if post_gap >= 0 else 'below'} it, and "
        f"post-local SGD takes {post_speed:.2f}x SSD-SGD's wall-clock while moving "
        f"{mean_of(rows, POST_LOCAL, 'mb_sent'):.1f} MB against {mean_of(rows, ssd5, 'mb_sent'):.1f} MB (it "
        "averages d weights per period, SSD-SGD all-reduces 2d: the shadow weights and momenta).",
        "",
        "Wall-clock is the slowest rank's training loop on a shared 2-core machine (4 processes, one thread "
        "each); bytes are the payload each rank sent (the link charges 2 (N-1)/N of it). Accuracy does not "
        "depend on the link: the shadow-server mapping is exact and deterministic.",
        "",
        f"Command: `python -m perf.ssd_sgd_experiment{' --smoke' if smoke else ''}` ({seconds:.0f} s in all, "
        f"torch {torch.__version__}).",
    ]
    return lines, checks


def plot(rows: list[dict], setup: Setup, path: Path) -> None:
    try:
        plt = harness.pyplot()
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return

    present = {r["run"] for r in rows}
    names = [n for n in TABLE_ORDER if n in present]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for i, name in enumerate(names):
        mine = [r for r in rows if r["run"] == name]
        color = f"C{i}"
        left.scatter([r["seconds"] for r in mine], [r["global_acc"] for r in mine], color=color, alpha=0.5)
        left.errorbar([median_of(rows, name, "seconds")], [mean_of(rows, name, "global_acc")], fmt="o",
                      color=color, markersize=9, label=name)
        first = mine[0]["losses"]
        window = max(1, min(100, len(first) // 10))
        smooth = [statistics.fmean(first[max(0, t - window + 1) : t + 1]) for t in range(len(first))]
        right.plot(range(1, len(first) + 1), smooth, color=color, label=name)
    left.set_xlabel("wall-clock of training (s), emulated link")
    left.set_ylabel("test accuracy of the global model (%)")
    left.set_title(f"{setup.bandwidth_mbps:g} MB/s + {setup.latency_ms:g} ms; dots: seeds, "
                   "large: median time, mean accuracy")
    left.grid(alpha=0.3)
    left.legend(fontsize="small")
    right.axvline(setup.warmup_steps, color="gray", linestyle=":", label="end of warm-up")
    right.set_xlabel("iteration")
    right.set_ylabel(f"rank 0 training loss (running mean), seed {setup.seeds[0]}")
    right.set_yscale("log")
    right.grid(alpha=0.3)
    right.legend(fontsize="small")
    fig.suptitle("SSD-SGD on 4 gloo ranks, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


CSV_COLUMNS = ("run", "seed", "seconds", "mb_sent", "collectives", "link_seconds", "global_acc", "local_acc",
               "final_loss")


def parse_args(argv):
    parser = harness.script_parser(
        __doc__.splitlines()[0], default_out="perf/results/ssd_sgd/",
        smoke_help="seconds: 5 warm-up + 40 iterations, one seed, no link emulation; only the byte claim is judged",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2)")
    parser.add_argument("--bandwidth-mbps", type=float, default=None,
                        help="emulated link bandwidth in MB/s (default 5; 0 turns emulation off)")
    parser.add_argument("--latency-ms", type=float, default=None, help="per-collective latency (default 1)")
    args = parser.parse_args(argv)
    if (args.bandwidth_mbps or 0) < 0 or (args.latency_ms or 0) < 0:
        parser.error("--bandwidth-mbps and --latency-ms must be >= 0")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    setup = Setup()
    if args.smoke:
        setup = replace(setup, warmup_steps=5, delay_iterations=40, seeds=(0,), bandwidth_mbps=0.0)
    if args.seeds is not None:
        setup = replace(setup, seeds=tuple(args.seeds))
    if args.bandwidth_mbps is not None:
        setup = replace(setup, bandwidth_mbps=args.bandwidth_mbps)
    if args.latency_ms is not None:
        setup = replace(setup, latency_ms=args.latency_ms)
    out_dir = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)

    began = time.perf_counter()
    print(f"SSD-SGD experiment: {len(runs())} runs x {len(setup.seeds)} seeds on {WORLD} gloo ranks "
          f"({setup.steps} iterations each)", flush=True)
    rows = combine(run_all(setup))
    lines, checks = summarize(rows, setup, args.smoke, time.perf_counter() - began)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_rows = [{**{c: r[c] for c in CSV_COLUMNS}, "bandwidth_mbps": setup.bandwidth_mbps,
                 "latency_ms": setup.latency_ms} for r in rows]
    print(f"wrote {harness.write_results(csv_rows, out_dir, 'ssd_sgd_runs')}")
    (out_dir / "ssd_sgd_summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out_dir / 'ssd_sgd_summary.md'}")
    plot(rows, setup, out_dir / "ssd_sgd.png")
    print("\n".join(lines))
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
