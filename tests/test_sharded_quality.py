"""perf/sharded_quality.py: the lr rule and the two-sided margin claim, on made-up runs (no ranks spawned)."""

import pytest

from _perf import perf_module


@pytest.fixture(scope="module")
def experiment():
    return perf_module("sharded_quality")


def _rows(unsharded, sharded, lr=0.1, name="SparseMFAC"):
    return ([{"optimizer": name, "variant": "unsharded", "lr": lr, "seed": s, "loss": v} for s, v in enumerate(unsharded)]
            + [{"optimizer": name, "variant": "sharded", "lr": lr, "seed": s, "loss": v} for s, v in enumerate(sharded)])


def test_each_variant_takes_the_lr_of_its_lowest_mean_loss(experiment):
    rows = _rows([1.0, 1.2, 1.1], [1.0, 1.2, 1.1], lr=0.1) + _rows([0.5, 0.6, 0.7], [0.9, 0.9, 0.9], lr=0.3)
    assert experiment.best_lr(rows, "SparseMFAC", "unsharded") == 0.3
    assert experiment.best_lr(rows, "SparseMFAC", "sharded") == 0.3
    rows += _rows([0.4, 0.4, 0.4], [1.5, 1.5, 1.5], lr=1.0)
    assert experiment.best_lr(rows, "SparseMFAC", "unsharded") == 1.0
    assert experiment.best_lr(rows, "SparseMFAC", "sharded") == 0.3


@pytest.mark.parametrize("sharded,holds", [
    ([1.01, 0.99, 1.02, 0.98], True),     # small difference, small noise
    ([1.2, 1.19, 1.21, 1.2], False),      # a clear 20 % difference
    ([1.0, 1.15, 0.85, 1.0], False),      # no difference shown, but the interval is wider than the margin
    ([float("inf"), 1.0, 1.0, 1.0], False),  # a diverged seed decides nothing
])
def test_the_claim_needs_the_whole_interval_inside_the_margin(experiment, sharded, holds):
    results = experiment.compare(_rows([1.0, 1.0, 1.0, 1.0], sharded), ["SparseMFAC"])
    assert results[0]["within_margin"] is holds
    assert [claim.holds for claim in experiment.claims(results)] == [holds]


def test_fewer_than_three_seeds_are_refused(experiment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        experiment.parse_args(["--seeds", "0", "1"])
    assert exit_info.value.code == 2
    assert "at least 3" in capsys.readouterr().err
