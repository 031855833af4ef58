"""The DSP experiment runs end to end in smoke mode, writes its tables and plots, and judges its claims by its rules."""

import importlib.util

import pytest

from _perf import output_of, perf_module, read_csv, run_script, smoke_run

TIMED_MODES = {"BP (1 process)", "BP-K", "DDP", "GPipe 2 mb", "GPipe 4 mb", "GPipe 8 mb", "1F1B 2 mb", "1F1B 4 mb",
               "1F1B 8 mb", "DSP m=1", "DSP m=2", "DSP m=4"}
STRAGGLED = {"BP-K", "DSP m=1", "DSP m=2", "DSP m=4"}
TRAINED_MODES = {"BP (1 process)", "DSP m=1", "DSP m=2", "DSP m=4"}


@pytest.mark.smoke
def test_smoke_run_writes_every_result():
    result, out = smoke_run("dsp_experiment")
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(out / "dsp_summary.csv")
    assert {row["mode"] for row in rows if row["part"] == "A"} == TIMED_MODES
    assert all(float(row["median_seconds"]) > 0 for row in rows)
    assert {row["mode"] for row in rows if row["part"] == "B"} == STRAGGLED
    runs = read_csv(out / "dsp_runs.csv")
    # DSP stages report their compute time; both ranks worked in every DSP run
    assert all(float(r["compute_seconds_rank0"]) > 0 and float(r["compute_seconds_rank1"]) > 0
               for r in runs if r["mode"].startswith("DSP"))
    # BP-K is back-propagation split over two ranks: the same weights, which a smoke run checks
    assert "PASS: BP-K ends with BP's weights, bit for bit" in output
    # the sweep: every trained mode at every learning rate and seed, then the chosen runs continue
    accuracy_runs = read_csv(out / "dsp_accuracy_runs.csv")
    swept = {(r["mode"], r["lr"], r["seed"]) for r in accuracy_runs if r["stage"] == "sweep"}
    assert swept == {(mode, lr, seed) for mode in TRAINED_MODES for lr in ("0.01", "0.02") for seed in ("0", "1")}
    continued = [r for r in accuracy_runs if r["stage"] == "continued"]
    assert {(r["mode"], r["seed"], r["epoch"]) for r in continued} == {
        (mode, seed, "2") for mode in TRAINED_MODES for seed in ("0", "1")}
    assert all(r["lr"] == r["chosen_lr"] for r in continued)
    summary = (out / "dsp_summary.md").read_text()
    assert "## Accuracy" in summary and "## Throughput and stragglers" in summary
    assert "DSP m=1 (this library's own, not the paper's)" in summary
    assert "not checked (smoke run): DSP m=2 (the paper's) has >= 1.3x the throughput of BP-K" in summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "dsp_accuracy.png").exists() and (out / "dsp_timing.png").exists()


def _timing_runs(setup, epoch_seconds, straggled_seconds):
    """Rows as merge_runs writes them: part A from ``epoch_seconds[mode]`` (one per epoch), part B from
    ``straggled_seconds[mode, level]`` (one per repetition)."""
    runs = [{"part": "A", "mode": mode, "rep": rep, "level": 0.0, "seconds": seconds}
            for mode, values in epoch_seconds.items() for rep, seconds in enumerate(values)]
    runs += [{"part": "B", "mode": mode, "rep": rep, "level": level, "seconds": seconds}
             for (mode, level), values in straggled_seconds.items() for rep, seconds in enumerate(values)]
    return runs


def test_the_timing_claims_follow_their_rules():
    experiment = perf_module("_dsp_timing")
    torch = experiment.torch
    setup = experiment.TimingSetup(epochs=3, straggler_reps=3)
    epoch_seconds = {mode: [10.0, 10.0, 10.0] for mode in setup.modes}
    epoch_seconds["DSP m=1"] = [10 / 1.35, 10 / 1.35, 10 / 1.1]  # median of the paired ratios 1.35x: holds
    epoch_seconds["DSP m=2"] = [10 / 1.25, 10 / 1.5, 10 / 1.25]  # median 1.25x: fails, whatever one epoch did
    straggled = {(mode, level): [10.0, 10.0, 10.0] for mode in setup.straggled for level in setup.straggler_levels}
    for level, bpk in zip(setup.straggler_levels[1:], (11.0, 12.0, 13.0)):
        straggled["BP-K", level] = [bpk] * 3  # +10 %, +20 %, +30 %
    straggled["DSP m=1", 0.5] = [10.5, 10.6, 10.4]  # +5 %, less than BP-K's +10 %: holds
    straggled["DSP m=2", 0.5] = [12.0, 11.0, 11.5]  # +15 %: more than BP-K's: fails
    straggled["DSP m=4", 0.5] = [9.0, 10.1, 10.2]  # +1 % by the median, but one run beat its clean pair: undecided
    straggled["DSP m=1", 1.0] = [10.5, 10.5, 10.5]
    straggled["BP-K", 1.5] = [13.0, 9.5, 13.0]  # BP-K itself beat its clean pair once: no DSP claim decides
    straggled["DSP m=1", 1.5] = [10.5, 10.5, 10.5]
    summary = experiment.summarise(setup, _timing_runs(setup, epoch_seconds, straggled))
    states = {"BP (1 process)": {"0.weight": torch.ones(2), "4.weight": torch.ones(3)},
              "BP-K": {"0.weight": torch.ones(2)}}
    per_rank = [{"states": states}, {"states": {"BP-K": {"4.weight": torch.ones(3)}}}]
    verdicts = {claim.text: claim.holds for claim in experiment.claims(setup, summary, per_rank)}
    assert len(verdicts) == 1 + len(setup.staleness) * len(setup.straggler_levels)
    assert verdicts["BP-K ends with BP's weights, bit for bit"]
    assert verdicts["DSP m=1 (this library's own, not the paper's) has >= 1.3x the throughput of BP-K"]
    assert not verdicts["DSP m=2 (the paper's) has >= 1.3x the throughput of BP-K"]
    assert not verdicts["DSP m=4 (the paper's) has >= 1.3x the throughput of BP-K"]  # 1.00x
    assert verdicts["+50% stragglers slow DSP m=1 less than BP-K (relative slow-down)"]
    assert not verdicts["+50% stragglers slow DSP m=2 less than BP-K (relative slow-down)"]
    assert not verdicts["+50% stragglers slow DSP m=4 less than BP-K (relative slow-down)"]
    assert verdicts["+100% stragglers slow DSP m=1 less than BP-K (relative slow-down)"]
    assert not verdicts["+150% stragglers slow DSP m=1 less than BP-K (relative slow-down)"]
    ratio = summary["ratios"]["DSP m=2", "DDP"]
    assert ratio["median"] == pytest.approx(1.25) and ratio["max"] == pytest.approx(1.5)
    per_rank[1]["states"]["BP-K"]["4.weight"] = torch.full((3,), 1.0 + 2**-20)
    assert not experiment.claims(setup, summary, per_rank)[0].holds


def _accuracy_outcome(experiment, setup, final):
    """An outcome with every mode at lr 0.01 and ``final[mode]`` (one accuracy per seed) after the last epoch."""
    rows = [{"mode": mode, "lr": 0.01, "seed": seed, "epoch": setup.epochs, "test_accuracy": accuracy}
            for mode, values in final.items() for seed, accuracy in zip(setup.seeds, values)]
    return {"rows": rows, "chosen": dict.fromkeys(setup.modes, 0.01)}


def test_the_parity_claim_is_two_sided():
    experiment = perf_module("_dsp_accuracy")
    setup = experiment.AccuracySetup()
    bp = [0.970, 0.972, 0.968]
    final = {"BP (1 process)": bp,
             "DSP m=1": [a + 0.005 for a in bp],  # 0.5 points above, no spread: within 1.07
             "DSP m=2": [a + 0.03 for a in bp],  # 3 points above: as far off as below, fails
             "DSP m=4": [a - 0.03 for a in bp]}  # 3 points below: fails
    verdicts = [claim.holds for claim in experiment.claims(setup, _accuracy_outcome(experiment, setup, final))]
    assert verdicts == [True, False, False]
    # the margin widens by 2 standard errors of the per-seed differences: +-2 points of spread around +1.2
    final["DSP m=1"] = [bp[0] + 0.032, bp[1] + 0.012, bp[2] - 0.008]
    p = experiment.parity(setup, _accuracy_outcome(experiment, setup, final), 1)
    assert p["mean"] == pytest.approx(0.012) and p["se"] == pytest.approx(0.02 / 3**0.5)
    assert p["margin"] == pytest.approx(0.0107 + 2 * 0.02 / 3**0.5) and p["holds"]
    # one seed has no standard error: the claim cannot be decided, so it fails
    one_seed = experiment.AccuracySetup(seeds=(0,))
    outcome = _accuracy_outcome(experiment, one_seed, {mode: [0.97] for mode in one_seed.modes})
    assert not any(claim.holds for claim in experiment.claims(one_seed, outcome))


def test_each_mode_gets_its_own_learning_rate_by_the_fixed_rule():
    experiment = perf_module("_dsp_accuracy")
    setup = experiment.AccuracySetup(lrs=(0.01, 0.02, 0.04), seeds=(0, 1), sweep_epochs=2, epochs=3)
    # means 0.875, 0.90625, 0.90625 (exact in binary): a tie of the two larger rates
    table = {0.01: [0.875, 0.875], 0.02: [0.9375, 0.875], 0.04: [0.90625, 0.90625]}
    rows = [{"mode": "DSP m=2", "lr": lr, "seed": seed, "epoch": epoch, "test_accuracy": accuracy + (epoch == 1)}
            for lr, values in table.items() for seed, accuracy in zip(setup.seeds, values) for epoch in (1, 2)]
    assert experiment.choose_lr(setup, rows, "DSP m=2") == 0.02  # the tie goes to the smaller rate; epoch 1 ignored
    with pytest.raises(ValueError, match="expected one per seed"):
        experiment.choose_lr(setup, rows[:-1], "DSP m=2")  # lr 0.04 lacks seed 1


def test_a_continued_run_equals_one_trained_from_the_start():
    experiment = perf_module("_dsp_accuracy")
    sizes = perf_module("_dsp_setup").Sizes(train_size=128, test_size=64, channels=4, units=2, split=1,
                                            pipeline_split=1)
    torch = experiment.torch
    experiment.torch.set_num_threads(1)
    for staleness in (None, 2):
        whole, whole_state = experiment.train_run(sizes, staleness, 0.02, 1, 0, 2)
        first, state = experiment.train_run(sizes, staleness, 0.02, 1, 0, 1)
        second, continued_state = experiment.train_run(sizes, staleness, 0.02, 1, 1, 2, state)
        assert first + second == whole
        load = lambda payload: torch.load(experiment.io.BytesIO(payload), weights_only=True)["model"]  # noqa: E731
        assert all(torch.equal(a, b) for a, b in zip(load(whole_state).values(), load(continued_state).values()))


@pytest.mark.smoke
def test_help_and_bad_arguments():
    result = run_script("dsp_experiment", "--help", timeout=60)
    assert result.returncode == 0 and "--smoke" in result.stdout and "--part" in result.stdout
    result = run_script("dsp_experiment", "--split", "6", "--out", "/nonexistent", timeout=60)
    assert result.returncode == 2 and "--split" in result.stderr
    result = run_script("dsp_experiment", "--sweep-epochs", "4", "--epochs", "3", "--out", "/nonexistent", timeout=60)
    assert result.returncode == 2 and "--sweep-epochs (4) must be at most --epochs (3)" in result.stderr
    result = run_script("dsp_experiment", "--part", "speed", "--out", "/nonexistent", timeout=60)
    assert result.returncode == 2 and "--part" in result.stderr
