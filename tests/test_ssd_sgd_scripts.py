"""The SSD-SGD benchmark and experiment: what their smoke runs write, the composite's math, the link
model, the learning-rate rule, and the claim verdicts' exit status (``--help`` and plain smoke runs:
``test_perf_scripts.py``)."""

import importlib.util
import time

import pytest
import torch
from _perf import output_of, perf_module, read_csv, smoke_run

import tritonopt


@pytest.mark.smoke
def test_benchmark_smoke_times_both_steps_against_their_floors():
    result, out = smoke_run("bench_ssd_sgd")
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(out / "ssd_sgd.csv")
    pairs = {(r["op"], r["provider"]) for r in rows}
    assert {("ssd_sgd_step", "torch"), ("ssd_sgd_step", "floor"), ("ssd_sgd_step_pulled", "floor")} <= pairs
    assert ("ssd_sgd_step_pulled", "torch") not in pairs
    assert all(float(r["ms_p50"]) > 0 for r in rows)
    for op, per_element in (("ssd_sgd_step", 32), ("ssd_sgd_step_pulled", 36)):
        floor = next(r for r in rows if r["op"] == op and r["provider"] == "floor")
        assert int(floor["floor_bytes"]) == per_element * int(floor["n"])
    if not torch.cuda.is_available():
        assert "no CUDA device" in output
        assert {r["provider"] for r in rows} == {"reference", "op/reference", "torch", "floor"}, \
            "CPU numbers labelled as Triton"


@pytest.mark.parametrize("pulled", [False, True])
def test_benchmark_providers_compute_the_same_step(pulled):
    bench = perf_module("bench_ssd_sgd")
    b = bench.buffers(5000, torch.device("cpu"))
    ours = {k: v.clone() for k, v in b.items()}
    with tritonopt.use_backend("reference"):
        bench._public(ours, pulled=pulled)
    launched = {k: v.clone() for k, v in b.items()}
    bench._launcher(bench.ssd_sgd_step_reference, pulled=pulled)(launched)
    for name in ("param", "pre", "sw", "smom", "sync_mom"):
        assert torch.equal(ours[name], launched[name]), name
    if not pulled:  # the composite is the common step's baseline
        bench._composite(b, 7)()
        for name in ("param", "sw", "smom"):
            assert torch.allclose(ours[name], b[name], rtol=1e-5, atol=1e-6), name


def experiment_rows(report, *, ssd_acc=73.0, beta0_acc=73.0, plain_acc=72.0, ssd_seconds=4.0, seeds=(0, 1, 2)):
    """Sweep and timing rows of every method at lrs 0.025 and 0.05 (0.05 the better), seed spread 0.2 points."""
    accuracy = {report.SSGD: 73.0, report.POST_LOCAL: 72.5, report.POWERSGD: 72.8, report.TOPK: 72.6,
                report.SSD5: ssd_acc, report.BETA0: beta0_acc, report.PLAIN: plain_acc}
    seconds = {report.SSGD: 10.0, report.POST_LOCAL: 3.0, report.POWERSGD: 5.0, report.TOPK: 5.0,
               report.SSD5: ssd_seconds}
    d, delay = 76_810, 120
    window_bytes = {report.SSGD: 4 * (d + 8) * delay, report.SSD5: 4 * (2 * d + 8) * (delay // 5)}
    rows = []
    for run, acc in accuracy.items():
        for lr, shift in ((0.025, -1.0), (0.05, 0.0)):
            for i, seed in enumerate(seeds):
                rows.append(dict(phase="sweep", run=run, lr=lr, seed=seed, global_acc=acc + shift + 0.2 * (i - 1),
                                 local_acc=acc, final_loss=0.5, window_seconds=1.0, blocked_seconds=0.0,
                                 modeled_seconds=0.0, window_bytes=0, window_calls=0, run_bytes=0))
        if run in seconds:
            for i, seed in enumerate(seeds):
                rows.append(dict(phase="timing", run=run, lr=0.05, seed=seed, global_acc=acc + 0.2 * (i - 1),
                                 local_acc=acc, final_loss=0.5, window_seconds=seconds[run] + 0.1 * i,
                                 blocked_seconds=0.5 * seconds[run], modeled_seconds=0.5 * seconds[run],
                                 window_bytes=window_bytes.get(run, 1000), window_calls=1, run_bytes=1))
    return rows


def summary_of(experiment, rows):
    report = perf_module("_ssd_sgd_report")
    setup = experiment.Setup(delay_iterations=120, seeds=tuple(sorted({r["seed"] for r in rows})))
    best = {m.name: report.best_lr(rows, m.name) for m in experiment.sweep_methods()}
    return report.summarize(rows, best, setup, d=76_810, extra=8, world=4, smoke=False, seconds=1.0,
                            command="python -m perf.ssd_sgd_experiment", sweep_order=list(best))


def test_the_claims_pass_fail_and_set_the_exit_status(capsys):
    experiment, report = perf_module("ssd_sgd_experiment"), perf_module("_ssd_sgd_report")
    harness = perf_module("_harness")
    lines, claims = summary_of(experiment, experiment_rows(report))
    assert len(claims) == 7 and all(c.holds for c in claims), [c for c in claims if not c.holds]
    assert harness.report_claims(claims, smoke=False) == 0
    assert "| SSGD | 72.00 ± 0.12 | **73.00 ± 0.12** |" in lines  # the sweep table, best lr in bold
    # Parity is two-sided: SSD-SGD far above SSGD fails it too.
    _, claims = summary_of(experiment, experiment_rows(report, ssd_acc=75.0))
    parity = next(c for c in claims if "within 1.5 points" in c.text)
    assert not parity.holds and "+" not in parity.detail and parity.detail.startswith("2.00")
    assert harness.report_claims(claims, smoke=False) == 1
    assert harness.report_claims(claims, smoke=True) == 0  # a smoke run does not judge accuracy
    _, claims = summary_of(experiment, experiment_rows(report, ssd_acc=71.0))
    assert not next(c for c in claims if "within 1.5 points" in c.text).holds
    # Only 10 / 8 = 1.25x faster: the speed claim fails.
    _, claims = summary_of(experiment, experiment_rows(report, ssd_seconds=8.0))
    assert [c.holds for c in claims].count(False) == 1 and "1.5x faster" in next(c for c in claims if not c.holds).text
    capsys.readouterr()


def test_glu_is_judged_not_worse_by_2_standard_errors_and_its_direction_reported():
    experiment, report = perf_module("ssd_sgd_experiment"), perf_module("_ssd_sgd_report")
    # 0.2 points below the ablation, seeds spread 0.2 (SE of the difference 0.16): within 2 SE, no direction.
    lines, claims = summary_of(experiment, experiment_rows(report, beta0_acc=73.2))
    beta0 = next(c for c in claims if "glu_beta=0" in c.text)
    assert beta0.holds and "no direction resolved" in beta0.detail
    plain = next(c for c in claims if "lr/4" in c.text)
    assert plain.holds and plain.detail.endswith("better")  # 1 point above at 0.16 SE
    # 1 point below: worse by more than 2 SE, the claim fails.
    _, claims = summary_of(experiment, experiment_rows(report, beta0_acc=74.0))
    beta0 = next(c for c in claims if "glu_beta=0" in c.text)
    assert not beta0.holds and beta0.detail.endswith("worse")


def test_one_seed_decides_no_glu_claim():
    experiment, report = perf_module("ssd_sgd_experiment"), perf_module("_ssd_sgd_report")
    lines, claims = summary_of(experiment, experiment_rows(report, seeds=(0,)))
    glu = [c for c in claims if c.text.startswith("GLU")]
    assert len(glu) == 2 and not any(c.holds for c in glu) and all("one seed" in c.detail for c in glu)
    assert any("Fewer than 3 seeds" in line for line in lines)


def test_the_lr_rule_takes_the_highest_mean_the_smaller_on_a_tie_and_widens_at_the_edge():
    experiment, report = perf_module("ssd_sgd_experiment"), perf_module("_ssd_sgd_report")
    rows = [dict(phase="sweep", run="m", lr=lr, seed=s, global_acc=acc)
            for lr, accs in ((0.025, (70.0, 72.0)), (0.05, (71.0, 71.0)), (0.1, (69.0, 73.0)))
            for s, acc in enumerate(accs)]
    assert report.best_lr(rows, "m") == 0.025  # three means of 71: the smallest lr
    rows.append(dict(phase="sweep", run="m", lr=0.1, seed=2, global_acc=75.0))
    assert report.best_lr(rows, "m") == 0.1
    assert experiment.widened([0.0125, 0.025, 0.05, 0.1], 0.1) == 0.2
    assert experiment.widened([0.0125, 0.025, 0.05, 0.1], 0.0125) == 0.00625
    assert experiment.widened([0.0125, 0.025, 0.05, 0.1], 0.05) is None


def test_the_link_model_charges_each_collective_on_one_link():
    experiment = perf_module("ssd_sgd_experiment")
    link = experiment.LinkTime(bandwidth_mbps=20.0, latency_ms=1.0, world=4)
    assert link(0) == pytest.approx(1e-3)
    assert link(2_000_000) == pytest.approx(1e-3 + 1.5 * 2_000_000 / 20e6)  # ring all-reduce
    assert link(1_000_000, "all_gather") == pytest.approx(1e-3 + 3 * 1_000_000 / 20e6)
    assert experiment.LinkTime(0.0, 1.0, 4)(10**6) == 0.0
    with pytest.raises(ValueError, match="bandwidth_mbps"):
        experiment.LinkTime(-1.0, 1.0, 4)


def test_a_wait_lasts_until_the_modeled_end_and_counts_as_blocked():
    link_module = perf_module("_ssd_sgd_link")
    link = link_module.Link(link_module.LinkTime(bandwidth_mbps=1.0, latency_ms=0.0, world=2))

    class Done:
        def wait(self):
            return True

    all_reduce = link._wrap("all_reduce", lambda tensor, async_op=False: Done())
    tensor = torch.zeros(10_000)  # 40 kB: 40 ms on the 1 MB/s link (2 (N - 1) / N = 1)
    all_reduce(tensor)  # disabled: counted, not charged
    assert (link.bytes_sent, link.modeled_seconds, link.blocked_seconds) == (40_000, 0.0, 0.0)
    link.enabled = True
    began = time.perf_counter()
    work = all_reduce(tensor, async_op=True)
    all_reduce(tensor, async_op=True).wait()  # the second transfer queues behind the first: 80 ms in all
    assert time.perf_counter() - began >= 0.08
    work.wait()
    assert link.modeled_seconds == pytest.approx(0.08)
    assert 0.08 <= link.blocked_seconds < 0.2 and link.calls == 3


@pytest.mark.slow
def test_experiment_smoke_writes_table_plot_and_runs():
    result, out = smoke_run("ssd_sgd_experiment")
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(out / "ssd_sgd_runs.csv")
    assert {(r["phase"], r["run"]) for r in rows} >= {
        ("sweep", "SSGD"), ("sweep", "post-local SGD, period 5"), ("sweep", "DDP + PowerSGD r4"),
        ("sweep", "DDP + EF Top-k 1%"), ("sweep", "SSD-SGD k=5"), ("sweep", "SSD-SGD k=5, glu_beta=0"),
        ("sweep", "SSD-SGD k=5, SGD local updater at lr/4"), ("k", "SSD-SGD k=2"), ("k", "SSD-SGD k=8"),
        ("timing", "SSGD"), ("timing", "SSD-SGD k=5"), ("timing", "DDP + PowerSGD r4")}
    assert {r["lr"] for r in rows if r["phase"] == "sweep"} == {"0.025", "0.05"}
    assert "PASS: SSD-SGD k=5 sends at least 2x fewer bytes per delay-stage iteration than SSGD" in output
    assert "PASS: the bytes sent equal the formulas" in output
    assert "PASS: the link model does not change what a run computes" in output
    assert "not checked (smoke run): GLU is not worse than" in output
    summary = (out / "ssd_sgd_summary.md").read_text()
    assert "## Learning-rate sweep" in summary and "hidden (%)" in summary and "parameter server" in summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "ssd_sgd.png").exists()
