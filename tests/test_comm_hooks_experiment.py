"""The comm-hooks experiment runs end to end (smoke mode), and its claims decide its exit status."""

import importlib.util

import pytest

from _perf import output_of, perf_module, read_csv, smoke_run

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")


@needs_sklearn
@pytest.mark.smoke
def test_smoke_run_compares_the_four_hooks_and_counts_their_bytes():
    result, out = smoke_run("comm_hooks_experiment")
    output = output_of(result)
    assert result.returncode == 0, output
    experiment = perf_module("comm_hooks_experiment")
    rows = read_csv(out / "comm_hooks.csv")
    assert {(row["run"], row["rank"]) for row in rows} == {(run, str(r)) for run in experiment.RUNS for r in (0, 1)}
    assert all(row["ranks_identical"] == "True" for row in rows)
    by_run = {row["run"]: row for row in rows if row["rank"] == "0"}
    steps, warmup = experiment.SMOKE_STEPS, experiment.SMOKE_WARMUP
    parameters = 85_002  # 64-256-256-10: one DDP bucket
    uncompressed = 4 * parameters
    assert int(by_run["no compression"]["bytes_sent"]) == steps * uncompressed
    # Top-k 1 % in blocks of 16384: 5 full blocks keep 164 entries, the last (3,082 elements) 31;
    # 4 bytes per value, 2 per int16 position, the positions padded to 4 bytes.
    entries = 5 * 164 + 31
    topk = 4 * entries + 4 * -(-2 * entries // 4)
    assert int(by_run["EF Top-k 1%"]["bytes_sent"]) == warmup * uncompressed + (steps - warmup) * topk
    # Rank 4: the three weight matrices as 4 r (n + m) bytes each, the 522 biases uncompressed, the
    # same for torch's PowerSGD and ours.
    low_rank = 4 * 4 * ((256 + 64) + (256 + 256) + (10 + 256)) + 4 * 522
    for run in ("EF low-rank r4", "torch PowerSGD r4"):
        assert int(by_run[run]["bytes_sent"]) == warmup * uncompressed + (steps - warmup) * low_rank, run
    assert "PASS: tritonopt's hooks count the bytes that reached torch.distributed" in output
    assert "not checked (smoke run): EF Top-k 1% test accuracy within 1 pt of no compression" in output
    assert "| EF low-rank r4 |" in (out / "comm_hooks.md").read_text()


def test_a_failed_claim_fails_the_experiment(capsys):
    experiment = perf_module("comm_hooks_experiment")
    harness = perf_module("_harness")

    def row(run, rank, accuracy, sent, identical=True):
        return dict(run=run, seed=0, rank=rank, steps=10, warmup_steps=2, test_accuracy=accuracy,
                    final_train_loss=0.1, bytes_sent=sent, bytes_sent_warmup=2 * 1000,
                    hook_counted_bytes=sent if run in experiment.OURS else "", ranks_identical=identical,
                    ms_per_step=1.0, epoch_losses=[0.1], epoch_accuracies=[accuracy], epoch_bytes=[sent])

    def verdict(rows, smoke=False):
        return harness.report_claims(experiment.claims(rows, experiment.summarise(rows)), smoke=smoke)

    good = [row(run, rank, 97.0, 20_000 if run == "no compression" else 2_080)
            for run in experiment.RUNS for rank in (0, 1)]
    assert verdict(good) == 0
    worse = [dict(r, test_accuracy=95.5) if r["run"] == "EF Top-k 1%" else r for r in good]
    assert verdict(worse) == 1
    assert "FAIL: EF Top-k 1% test accuracy within 1 pt of no compression (95.50 vs 97.00)" in capsys.readouterr().out
    assert verdict(worse, smoke=True) == 0  # a smoke run cannot decide accuracy
    apart = [dict(r, ranks_identical=r["rank"] == 0) for r in good]
    assert verdict(apart, smoke=True) == 1
    miscounted = [dict(r, hook_counted_bytes=1) if r["run"] == "EF low-rank r4" else r for r in good]
    assert verdict(miscounted, smoke=True) == 1
