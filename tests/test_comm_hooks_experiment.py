"""The comm-hooks experiment runs end to end (smoke mode), picks each hook's own best lr by its fixed
rule, reports mean ± standard error, and its claims decide its exit status."""

import importlib.util
import math

import pytest

from _perf import output_of, perf_module, read_csv, smoke_run

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")


@needs_sklearn
@pytest.mark.smoke
def test_smoke_run_sweeps_the_four_hooks_and_counts_their_bytes():
    result, out = smoke_run("comm_hooks_experiment")
    output = output_of(result)
    assert result.returncode == 0, output
    experiment = perf_module("comm_hooks_experiment")
    rows = read_csv(out / "comm_hooks.csv")
    for run in experiment.RUNS:
        lrs = {float(row["lr"]) for row in rows if row["run"] == run}
        assert set(experiment.SMOKE_LRS) <= lrs and len(lrs) <= len(experiment.SMOKE_LRS) + 1, (run, lrs)
        for lr in lrs:
            assert {row["rank"] for row in rows if row["run"] == run and float(row["lr"]) == lr} == {"0", "1"}
    assert all(row["ranks_identical"] == "True" for row in rows)
    steps, warmup = experiment.SMOKE_STEPS, experiment.SMOKE_WARMUP
    parameters = 85_002  # 64-256-256-10: one DDP bucket
    uncompressed = 4 * parameters
    # Top-k 1 % in blocks of 16384: 5 full blocks keep 164 entries, the last (3,082 elements) 31;
    # 4 bytes per value, 2 per int16 position, the positions padded to 4 bytes.
    entries = 5 * 164 + 31
    topk = 4 * entries + 4 * -(-2 * entries // 4)
    # Rank 4: the three weight matrices as 4 r (n + m) bytes each, the 522 biases uncompressed, the
    # same for torch's PowerSGD and ours.
    low_rank = 4 * 4 * ((256 + 64) + (256 + 256) + (10 + 256)) + 4 * 522
    expected = {"no compression": steps * uncompressed,
                "EF Top-k 1%": warmup * uncompressed + (steps - warmup) * topk,
                "EF low-rank r4": warmup * uncompressed + (steps - warmup) * low_rank,
                "torch PowerSGD r4": warmup * uncompressed + (steps - warmup) * low_rank}
    for row in rows:  # the bytes depend on neither the lr nor the rank
        assert int(row["bytes_sent"]) == expected[row["run"]], row
    assert "PASS: tritonopt's hooks count the bytes that reached torch.distributed" in output
    assert "not checked (smoke run): EF Top-k 1% test accuracy within 1 pt of no compression" in output
    summary = (out / "comm_hooks.md").read_text()
    assert "## Learning-rate sweep" in summary and "| EF low-rank r4 |" in summary


def _row(run, accuracy, sent=None, lr=0.05, seed=0, rank=0, identical=True):
    sent = sent if sent is not None else (20_000 if run == "no compression" else 2_080)
    return dict(run=run, lr=lr, seed=seed, rank=rank, steps=10, warmup_steps=2, test_accuracy=accuracy,
                final_train_loss=0.1, bytes_sent=sent, bytes_sent_warmup=2 * 1000,
                hook_counted_bytes=sent if run in ("EF Top-k 1%", "EF low-rank r4") else "",
                ranks_identical=identical, ms_per_step=1.0 + seed, epoch_losses=[0.1],
                epoch_accuracies=[accuracy], epoch_bytes=[sent])


def _rows(accuracy_of, lrs=(0.05,), seeds=(0, 1, 2), runs=None):
    """Rows for every (run, lr, seed) on both ranks; ``accuracy_of(run, lr, seed)`` gives the accuracy."""
    runs = runs or perf_module("_comm_hooks_report").RUNS
    return [_row(run, accuracy_of(run, lr, seed), lr=lr, seed=seed, rank=rank)
            for run in runs for lr in lrs for seed in seeds for rank in (0, 1)]


def _verdict(rows, smoke=False):
    report, harness = perf_module("_comm_hooks_report"), perf_module("_harness")
    return harness.report_claims(report.claims(rows, report.summarise(rows)), smoke=smoke)


def test_a_failed_claim_fails_the_experiment(capsys):
    good = _rows(lambda run, lr, seed: 97.0 + 0.1 * seed)
    assert _verdict(good) == 0
    worse = [dict(r, test_accuracy=95.5) if r["run"] == "EF Top-k 1%" else r for r in good]
    assert _verdict(worse) == 1
    assert "FAIL: EF Top-k 1% test accuracy within 1 pt of no compression, either way" in capsys.readouterr().out
    assert _verdict(worse, smoke=True) == 0  # a smoke run cannot decide accuracy
    apart = [dict(r, ranks_identical=r["rank"] == 0) for r in good]
    assert _verdict(apart, smoke=True) == 1
    miscounted = [dict(r, hook_counted_bytes=1) if r["run"] == "EF low-rank r4" else r for r in good]
    assert _verdict(miscounted, smoke=True) == 1
    heavy = [dict(r, bytes_sent=5_000) if r["run"] == "torch PowerSGD r4" else r for r in good]
    assert _verdict(heavy) == 1  # 4x fewer bytes: below the 5x the claim needs


def test_parity_fails_far_above_as_well_as_far_below():
    """Parity is two-sided: a compressed hook 1.5 points above uncompressed is no parity either."""
    better = _rows(lambda run, lr, seed: (98.5 if run == "EF low-rank r4" else 97.0) + 0.1 * seed)
    assert _verdict(better) == 1
    close = _rows(lambda run, lr, seed: (97.9 if run == "EF low-rank r4" else 97.0) + 0.1 * seed)
    assert _verdict(close) == 0
    report = perf_module("_comm_hooks_report")
    details = {c.text: c.detail for c in report.claims(better, report.summarise(better))}
    assert details["EF low-rank r4 test accuracy within 1 pt of no compression, either way"].endswith(
        ": +1.50 ± 0.08 points")


def test_each_hook_is_judged_at_its_own_best_learning_rate():
    # Uncompressed is best at lr 0.1 (98), Top-k at lr 0.025 (97.6): 0.4 points apart, parity. At one
    # shared lr (0.05: 98 - 1.6 = 96.4 against 97.9 elsewhere) they would be 1.6 apart.
    table = {"no compression": {0.025: 96.0, 0.05: 97.9, 0.1: 98.0},
             "EF Top-k 1%": {0.025: 97.6, 0.05: 96.4, 0.1: 90.0}}
    rows = _rows(lambda run, lr, seed: table.get(run, table["no compression"])[lr] + 0.1 * (seed - 1),
                 lrs=(0.025, 0.05, 0.1))
    report = perf_module("_comm_hooks_report")
    summary = report.summarise(rows)
    assert summary["no compression"]["best_lr"] == 0.1 and summary["EF Top-k 1%"]["best_lr"] == 0.025
    assert summary["EF Top-k 1%"]["test_accuracy"][0] == pytest.approx(97.6)
    assert _verdict(rows) == 0


def test_best_lr_takes_the_highest_mean_and_the_smaller_lr_on_a_tie():
    report = perf_module("_comm_hooks_report")
    means = {0.025: 97.0, 0.05: 97.5, 0.1: 97.5}
    rows = _rows(lambda run, lr, seed: means[lr] + (seed - 1), lrs=tuple(means), runs=("no compression",))
    assert report.best_lr(rows, "no compression") == 0.05
    # One seed far higher does not win over a higher mean.
    skewed = [dict(r, test_accuracy=99.9) if r["lr"] == 0.025 and r["seed"] == 2 else r for r in rows]
    assert report.best_lr(skewed, "no compression") == 0.025  # (96 + 97 + 99.9) / 3 = 97.63 > 97.5
    # A rank process decides from its own rows.
    assert report.best_lr([r for r in rows if r["rank"] == 1], "no compression", rank=1) == 0.05
    with pytest.raises(ValueError, match="no rows of 'EF Top-k 1%'"):
        report.best_lr(rows, "EF Top-k 1%")


def test_the_grid_widens_only_from_its_edges():
    report = perf_module("_comm_hooks_report")
    grid = [0.0125, 0.025, 0.05, 0.1]
    assert report.widened(grid, 0.1) == 0.2
    assert report.widened(grid, 0.0125) == 0.00625
    assert report.widened(grid, 0.05) is None


def test_figures_are_means_with_standard_errors_over_the_seeds():
    report = perf_module("_comm_hooks_report")
    accuracy = {0: 96.0, 1: 97.0, 2: 98.5}
    rows = _rows(lambda run, lr, seed: accuracy[seed])
    s = report.summarise(rows)["EF Top-k 1%"]
    mean, se = s["test_accuracy"]
    assert mean == pytest.approx(97.1666667)
    sd = math.sqrt(((96 - mean) ** 2 + (97 - mean) ** 2 + (98.5 - mean) ** 2) / 2)
    assert se == pytest.approx(sd / math.sqrt(3))
    assert s["ms_per_step"][0] == pytest.approx(2.0)  # 1, 2, 3 ms on the three seeds
    assert s["bytes_sent"] == (2_080, 0.0)
    text = "\n".join(report.result_lines(report.summarise(rows)))
    assert f"{mean:.2f} ± {se:.2f}" in text
    assert report.mean_se([1.0])[1] != report.mean_se([1.0])[1]  # one value: no error (NaN)
    with pytest.raises(ValueError, match="at least one value"):
        report.mean_se([])


def test_fewer_than_three_seeds_cannot_pass_an_accuracy_claim(capsys):
    two = _rows(lambda run, lr, seed: 97.0 + 0.1 * seed, seeds=(0, 1))
    assert _verdict(two) == 1
    assert "fewer than the 3 a claim needs" in capsys.readouterr().out


def test_the_sweep_table_reports_every_configuration_and_bolds_the_pick():
    report = perf_module("_comm_hooks_report")
    rows = _rows(lambda run, lr, seed: {0.025: 96.0, 0.05: 97.0}[lr] + seed, lrs=(0.025, 0.05))
    rows += [_row("EF Top-k 1%", 90.0, lr=0.1, seed=seed, rank=rank) for seed in (0, 1, 2) for rank in (0, 1)]
    lines = report.sweep_lines(report.summarise(rows))
    assert lines[0] == "| hook | lr 0.025 | lr 0.05 | lr 0.1 |"
    topk = next(line for line in lines if line.startswith("| EF Top-k 1% |"))
    assert topk == "| EF Top-k 1% | 97.00 ± 0.58 | **98.00 ± 0.58** | 90.00 ± 0.00 |"
    uncompressed = next(line for line in lines if line.startswith("| no compression |"))
    assert uncompressed.endswith("| - |")


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0", "0", "1"], "--seeds must be distinct"),
    (["--lrs", "0.05", "0"], "must be positive"),
    (["--lrs", "nan"], "must be positive"),
    (["--lrs", "fast"], "is not a number"),
    (["--warmup", "1"], "at least 2"),
])
def test_the_command_line_refuses_what_it_cannot_run(argv, message, capsys):
    experiment = perf_module("comm_hooks_experiment")
    with pytest.raises(SystemExit) as exit_info:
        experiment.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_best_lr_left_on_the_grids_edge_is_flagged():
    report = perf_module("_comm_hooks_report")
    rows = _rows(lambda run, lr, seed: (lr if run == "EF Top-k 1%" else -abs(lr - 0.05)) + seed,
                 lrs=(0.025, 0.05, 0.1))
    summary = report.summarise(rows)
    assert summary["EF Top-k 1%"]["best_lr_on_edge"] and not summary["no compression"]["best_lr_on_edge"]
    text = "\n".join(report.markdown(summary, [], smoke=False, command="c", header="h", seconds=1.0))
    assert "after the widening: EF Top-k 1% (lr 0.1)." in text
