"""perf/bench_sharded.py: its checks fail the run when a byte count or a rank's state is off; the smoke run covers
every (model, W, optimizer). The checks are tested in-process on made-up rank results (no ranks spawned)."""

import pytest

from _perf import output_of, perf_module, read_csv, smoke_run

SHAPES = [(13, 5), (3, 13), (7,)]  # uneven rows: rank 0 of 2 holds 7 + 2 + 4 rows, 65 of the 111 entries
REPLICATED = 8 * 8 * 8 + 4 * len(SHAPES)  # MFAC, m = 8: the Gram matrix and the step counters
PER_ENTRY = 40  # bytes of window and buffers per column


@pytest.fixture(scope="module")
def bench():
    return perf_module("bench_sharded")


def _row(world, state_bytes, bytes_all_reduced, calls, name="MFAC", steps=3):
    return {"model": "mlp", "optimizer": name, "world": world, "parameters": 111, "num_params": len(SHAPES),
            "shapes": SHAPES, "steps": steps, "state_bytes": state_bytes, "step_ms": [1.0] * world,
            "bytes_all_reduced": bytes_all_reduced, "all_reduce_calls": calls}


def _runs(state_on_two_ranks=None, bytes_on_two_ranks=None, calls=6):
    """W = 1 and W = 2 rows of MFAC over SHAPES, as they should be unless told otherwise (3 steps)."""
    unsharded = REPLICATED + 111 * PER_ENTRY
    share = REPLICATED + 65 * PER_ENTRY  # every rank pads to rank 0's 65 entries
    return [_row(1, [unsharded], [0], [0]),
            _row(2, state_on_two_ranks or [share, share], bytes_on_two_ranks or [3 * 68, 3 * 68], [calls, calls])]


def test_rank_columns_cut_rows_as_fsdp2(bench):
    assert bench.rank_columns(SHAPES, 1, 0) == 111
    assert [bench.rank_columns(SHAPES, 2, rank) for rank in (0, 1)] == [65, 46]
    # one row each for three ranks, none for the fourth
    assert [bench.rank_columns([(3, 13)], 4, rank) for rank in range(4)] == [13, 13, 13, 0]
    assert bench.rank_columns(SHAPES, 2, 0, block_size=16) == 80  # whole blocks


def test_runs_as_predicted_pass(bench):
    checks = bench.claims(bench.summarise(_runs()))
    assert len(checks) == 2 and all(claim.holds for claim in checks), checks


@pytest.mark.parametrize("case", ["bytes", "one rank's bytes", "calls", "unsharded state", "state too small"])
def test_a_count_or_a_state_off_the_formula_fails(bench, case):
    share = REPLICATED + 65 * PER_ENTRY
    rows = {
        "bytes": _runs(bytes_on_two_ranks=[3 * 76, 3 * 76]),  # a float64 too many per step
        "one rank's bytes": _runs(bytes_on_two_ranks=[3 * 68, 3 * 68 + 4]),
        "calls": _runs(calls=9),
        "unsharded state": _runs(state_on_two_ranks=[share, REPLICATED + 111 * PER_ENTRY]),
        "state too small": _runs(state_on_two_ranks=[share, REPLICATED + 40 * PER_ENTRY]),
    }[case]
    checks = bench.claims(bench.summarise(rows))
    failed = [claim.text for claim in checks if not claim.holds]
    assert len(failed) == 1, failed
    assert ("all-reduces" in failed[0]) == (case in ("bytes", "one rank's bytes", "calls"))


def test_the_script_exits_1_when_a_check_fails(bench, monkeypatch, tmp_path):
    rows = _runs(bytes_on_two_ranks=[3 * 76, 3 * 76])
    monkeypatch.setattr(bench, "run_world", lambda world, config: [r for r in rows if r["world"] == world])
    assert bench.main(["--worlds", "1", "2", "--only", "MFAC", "--steps", "3", "--out", str(tmp_path)]) == 1
    assert "FAIL: W=2: every rank all-reduces" in (tmp_path / "sharded.md").read_text()
    rows[:] = _runs()
    assert bench.main(["--worlds", "1", "2", "--only", "MFAC", "--steps", "3", "--out", str(tmp_path)]) == 0


def test_the_state_check_needs_w_equal_1(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--worlds", "2", "4"])
    assert exit_info.value.code == 2
    assert "--worlds must include 1" in capsys.readouterr().err


@pytest.mark.smoke
def test_smoke_run_covers_every_model_world_and_optimizer(bench):
    result, out = smoke_run("bench_sharded")
    assert result.returncode == 0, output_of(result)
    rows = read_csv(out / "sharded.csv")
    assert {(r["model"], r["world"], r["optimizer"]) for r in rows} == {
        (model, str(world), name) for model in ("resnet18", "transformer") for world in (1, 2)
        for name in bench.OPTIMIZERS if model in bench.ONLY_ON.get(name, (model,))}
    assert any(r["optimizer"] == "KAISA" for r in rows)
    for row in rows:
        if row["world"] == "2" and row["optimizer"] != "Adam":
            assert float(row["bytes_all_reduced_per_step"]) == float(row["expected_bytes_per_step"]) > 0, row
        assert int(row["state_bytes_per_rank"]) > 0


def test_adam_ranks_hold_their_own_rows(bench):
    # Adam keeps no padding: on uneven rows rank 1 of 2 holds 6 + 1 + 3 rows, 46 of the 111 entries.
    replicated = 4 * len(SHAPES)
    per_entry = 8  # exp_avg and exp_avg_sq
    rows = [_row(1, [replicated + 111 * per_entry], [0], [0], name="Adam"),
            _row(2, [replicated + 65 * per_entry, replicated + 46 * per_entry], [0, 0], [0, 0], name="Adam")]
    checks = bench.claims(bench.summarise(rows))
    assert all(claim.holds for claim in checks), checks
    rows[1]["state_bytes"][1] = replicated + 40 * per_entry
    assert [claim.holds for claim in bench.claims(bench.summarise(rows))] == [True, False]


def _kaisa_runs(kfac_on_two_ranks=None, gathered_on_two_ranks=None):
    """KAISA over SHAPES at W = 1 and 2 (3 steps), as they should be unless told otherwise: K-FAC's memory whole
    on every rank, SGD's momentum (4 bytes an entry) each rank's own rows, the gather the formula's bytes."""
    kfac = 10_000
    per_step = 4 * (7 * 5 + 2 * 13 + 4)  # rank 0's chunks of each Shard(0) parameter, received from rank 1
    one = _row(1, [kfac + 4 * 111], [0], [0], name="KAISA")
    two = _row(2, [(kfac_on_two_ranks or kfac) + 4 * 65, kfac + 4 * 46],
               gathered_on_two_ranks or [3 * per_step, 3 * per_step], [3, 3], name="KAISA")
    for row in (one, two):
        row["kfac_expected_bytes"] = kfac
    one["expected_bytes_per_step"], two["expected_bytes_per_step"] = 0, per_step
    return [one, two]


@pytest.mark.parametrize("case", ["as predicted", "gather bytes", "K-FAC memory"])
def test_kaisa_rows_are_checked_against_the_gather_formula_and_its_expected_memory(bench, case):
    rows = {"as predicted": _kaisa_runs(),
            "gather bytes": _kaisa_runs(gathered_on_two_ranks=[3 * 260 + 4, 3 * 260 + 4]),
            "K-FAC memory": _kaisa_runs(kfac_on_two_ranks=10_400)}[case]
    holds = [claim.holds for claim in bench.claims(bench.summarise(rows))]
    assert holds == {"as predicted": [True, True], "gather bytes": [False, True], "K-FAC memory": [True, False]}[case]
