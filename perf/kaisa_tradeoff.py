"""KAISA's memory/communication trade-off across grad_worker_fraction on 4 gloo ranks.

The paper (Pauloski et al. SC '21, sec. 3.1, 5.5, Table 5, Fig. 6-8) varies the
fraction of ranks that hold each layer's eigendecomposition: more gradient
workers cost memory (eigen data replicated ``gw`` times) and save the per-step
broadcast of preconditioned gradients. This script measures both on CPU:

* 4 processes (gloo, one thread each) train the small CNN
  ``Conv(1,16,3,p1)-ReLU-Conv(16,32,3,s2,p1)-ReLU-Linear(512,64)-ReLU-Linear(64,10)``
  on scikit-learn digits (8x8), global batch 32 (8 per rank), factor update every
  step, eigendecomposition every 3 steps, for each fraction ``1/4, 1/2, 1``;
* per rank: K-FAC memory held (factors, batch buffers, eigen data; measured from
  the tensors) and bytes sent/received per collective, next to the formulas of
  :mod:`tritonopt.dist.kaisa`, and seconds per step.

Timings with 4 processes on a 2-core machine measure oversubscription, not
KAISA: read the volumes and the memory. The claim checked (a smoke run checks it too; exit
status 1 if it fails): every measured memory and received-byte count equals its formula.
Results (``--out``, default ``perf/results/kaisa/``): ``kaisa_tradeoff.csv``,
``kaisa_tradeoff.md``, ``kaisa_tradeoff.png``.

    python -m perf.kaisa_tradeoff [--steps 9] [--out DIR] [--smoke]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/kaisa_tradeoff.py
    import _as_module

    _as_module.run(__file__)

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from perf import _harness as harness
from perf import _ranks as ranks
from tritonopt.dist import KAISAAssignment, KAISAPreconditioner
from tritonopt.dist.kaisa import expected_bytes_per_rank, expected_memory_per_rank

NAME = "kaisa"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
WORLD = 4
FRACTIONS = (0.25, 0.5, 1.0)
GLOBAL_BATCH = 32
FACTOR_STEPS, INV_STEPS = 1, 3
PAPER_INV_STEPS = 500  # Table 2, ResNet-50
LABELS = ("factor_allreduce", "eigen_broadcast", "grad_broadcast")


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def load_images():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(data.target, dtype=torch.int64)


def run_rank(rank: int, world: int, steps: int) -> list[dict]:
    x_all, y_all = load_images()
    per_rank = GLOBAL_BATCH // world
    rows = []
    for fraction in FRACTIONS:
        model = make_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        precond = KAISAPreconditioner(
            model, grad_worker_fraction=fraction, factor_update_steps=FACTOR_STEPS,
            inv_update_steps=INV_STEPS, damping=0.03, lr=0.05, g_batch_scale=True,
        )
        seconds = []
        for t in range(steps):
            start = t * GLOBAL_BATCH + rank * per_rank
            xb, yb = x_all[start : start + per_rank], y_all[start : start + per_rank]
            dist.barrier()
            began = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            for p in model.parameters():  # data-parallel gradient average (DDP's job)
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            precond.step()
            optimizer.step()
            seconds.append(time.perf_counter() - began)
        stats = precond.communicator.stats()
        dims = precond.layer_dims
        costs = [a**3 + g**3 for a, g in dims]
        assignment = KAISAAssignment(costs, world, precond.grad_workers, "paper")
        expected = expected_bytes_per_rank(
            dims, assignment, rank, factor_steps=len(range(0, steps, FACTOR_STEPS)),
            eigen_steps=len(range(0, steps, INV_STEPS)), steps=steps,
        )
        memory = precond.memory_usage()
        formula = expected_memory_per_rank(dims, assignment, rank)
        row = {
            "fraction": fraction, "grad_workers": precond.grad_workers,
            "strategy": precond.strategy.value, "rank": rank, "steps": steps,
            "factor_bytes": memory["factors"], "batch_bytes": memory["batch"],
            "eigen_bytes": memory["eigen"], "eigen_bytes_formula": formula["eigen"],
            "kfac_bytes": memory["total"], "kfac_bytes_formula": formula["total"],
            "ms_per_step": 1e3 * statistics.median(seconds),
        }
        for label in LABELS:
            s = stats.get(label)
            row[f"{label}_sent"] = s.bytes_sent if s else 0
            row[f"{label}_received"] = s.bytes_received if s else 0
            row[f"{label}_sent_formula"] = expected[label]["sent"]
            row[f"{label}_received_formula"] = expected[label]["received"]
        row["layer_dims"] = " ".join(f"{a}x{g}" for a, g in dims)
        rows.append(row)
    return rows


def run_all(steps: int, timeout: float = 300.0) -> list[dict]:
    rows = [row for rank_rows in ranks.run_on_ranks(WORLD, run_rank, steps, timeout=timeout) for row in rank_rows]
    return sorted(rows, key=lambda r: (r["fraction"], r["rank"]))


def kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def markdown(rows: list[dict], steps: int) -> str:
    eigen_steps = len(range(0, steps, INV_STEPS))
    lines = [
        f"# KAISA trade-off, {WORLD} gloo ranks, {steps} steps (factor update every {FACTOR_STEPS}, "
        f"eigen every {INV_STEPS})",
        "",
        f"Layers (a x g): {rows[0]['layer_dims']}. KiB, measured / formula. Eigen broadcast per eigen step "
        f"({eigen_steps} in the run), gradient broadcast and factor all-reduce per step.",
        "",
        "| gwf | strategy | rank | K-FAC memory | eigen data held | factor all-reduce /step | "
        "eigen bcast recv /eigen step | grad bcast recv /step | grad bcast sent /step | ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fa = r["factor_allreduce_received"] / steps
        fa_f = r["factor_allreduce_received_formula"] / steps
        lines.append(
            f"| {r['fraction']:g} | {r['strategy']} | {r['rank']} | {kib(r['kfac_bytes'])} / {kib(r['kfac_bytes_formula'])} "
            f"| {kib(r['eigen_bytes'])} / {kib(r['eigen_bytes_formula'])} | {kib(fa)} / {kib(fa_f)} "
            f"| {kib(r['eigen_broadcast_received'] / eigen_steps)} / {kib(r['eigen_broadcast_received_formula'] / eigen_steps)} "
            f"| {kib(r['grad_broadcast_received'] / steps)} / {kib(r['grad_broadcast_received_formula'] / steps)} "
            f"| {kib(r['grad_broadcast_sent'] / steps)} / {kib(r['grad_broadcast_sent_formula'] / steps)} "
            f"| {r['ms_per_step']:.1f} |"
        )
    lines += ["", "Mean over ranks (the paper's Table 5 / Fig. 6 quantities):", "",
              "| gwf | strategy | mean K-FAC memory KiB | mean eigen KiB | extra KiB received per step, "
              f"this run (eigen every {INV_STEPS}) | extra KiB received per step with eigen every "
              f"{PAPER_INV_STEPS} (paper's ResNet-50 K_freq) |", "|---|---|---|---|---|---|"]
    for fraction in FRACTIONS:
        sub = [r for r in rows if r["fraction"] == fraction]
        mem = statistics.mean(r["kfac_bytes"] for r in sub)
        eig = statistics.mean(r["eigen_bytes"] for r in sub)
        extra = statistics.mean(
            (r["eigen_broadcast_received"] + r["grad_broadcast_received"]) / steps for r in sub
        )
        eigen_steps = len(range(0, steps, INV_STEPS))
        projected = statistics.mean(
            r["eigen_broadcast_received"] / eigen_steps / PAPER_INV_STEPS + r["grad_broadcast_received"] / steps
            for r in sub
        )
        lines.append(
            f"| {fraction:g} | {sub[0]['strategy']} | {kib(mem)} | {kib(eig)} | {kib(extra)} | {kib(projected)} |"
        )
    lines += ["", "Wall time per step with 4 processes on a 2-core machine is oversubscription, not KAISA."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], steps: int, path: Path) -> None:
    plt = harness.pyplot()
    eigen_steps = len(range(0, steps, INV_STEPS))

    def per_fraction(fn, reduce=statistics.mean):
        return [reduce(fn(r) for r in rows if r["fraction"] == f) for f in FRACTIONS]

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(FRACTIONS, per_fraction(lambda r: r["kfac_bytes"] / 1024), "o-", label="mean over ranks")
    left.plot(FRACTIONS, per_fraction(lambda r: r["kfac_bytes"] / 1024, max), "^--", label="largest rank")
    left.plot(FRACTIONS, per_fraction(lambda r: r["kfac_bytes_formula"] / 1024), "x:", label="formula (mean)")
    left.set_title("K-FAC memory per rank")
    left.set_xlabel("grad_worker_fraction")
    left.set_ylabel("KiB")
    left.legend()
    right.plot(FRACTIONS, per_fraction(lambda r: (r["eigen_broadcast_received"] + r["grad_broadcast_received"])
                                        / steps / 1024), "o-", label=f"this run (eigen every {INV_STEPS})")
    right.plot(FRACTIONS, per_fraction(lambda r: (r["eigen_broadcast_received"] / eigen_steps / PAPER_INV_STEPS
                                                  + r["grad_broadcast_received"] / steps) / 1024),
               "s--", label=f"eigen every {PAPER_INV_STEPS} (projected)")
    right.set_title("extra bytes received per step (mean over ranks)")
    right.set_xlabel("grad_worker_fraction")
    right.set_ylabel("KiB / step")
    right.legend()
    fig.suptitle(f"KAISA on {WORLD} gloo ranks (factor all-reduce, the same for every fraction, not shown)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def claim(rows: list[dict]) -> harness.Claim:
    """Every rank's K-FAC memory and every collective's received bytes equal the formulas."""
    mismatches = [
        f"fraction {r['fraction']:g} rank {r['rank']} {key}"
        for r in rows
        for key in ("kfac_bytes", *(f"{label}_received" for label in LABELS))
        if r[key] != r[f"{key}_formula"]
    ]
    return harness.Claim("measured K-FAC memory and bytes received equal the formulas", not mismatches,
                         "; ".join(mismatches) or f"{len(rows)} rank-fraction pairs", smoke_scale=True)


def main(argv=None) -> int:
    parser = harness.script_parser(__doc__.split("\n")[0], default_out="perf/results/kaisa/",
                                   smoke_help="3 steps")
    parser.add_argument("--steps", type=harness.positive_int, default=9, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    steps = 3 if args.smoke else args.steps
    out = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    os.environ.setdefault("TRITONOPT_BACKEND", "reference")  # CPU: the torch references
    print(f"KAISA on {WORLD} gloo ranks, {steps} steps per grad_worker_fraction {FRACTIONS}", flush=True)
    rows = run_all(steps)
    harness.write_results(rows, out, "kaisa_tradeoff")
    text = markdown(rows, steps)
    (out / "kaisa_tradeoff.md").write_text(text)
    print(text)
    try:
        plot(rows, steps, out / "kaisa_tradeoff.png")
    except ImportError:
        print("matplotlib is not installed: no plot written")
    print(f"wrote {out}/kaisa_tradeoff.{{csv,md,png}}")
    return harness.report_claims([claim(rows)], smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
