"""perf._ranks, the one launcher of the experiments and the distributed tests: a rank that dies says so at once;
the fault scenarios' collector delivers what each rank sent, its exit code, its error, or gives up on a stall."""

import os
import time

import pytest
from _perf import perf_module

ranks = perf_module("_ranks")


def _rank_one_dies(rank, world_size):
    if rank == 1:
        os._exit(3)  # as a crash would: no result, no traceback
    return rank


@pytest.mark.smoke
def test_a_rank_that_dies_before_reporting_fails_the_run_at_once():
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3 before reporting"):
        ranks.run_on_ranks(2, _rank_one_dies, timeout=120)
    assert time.monotonic() - began < 60  # long before the timeout


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="world_size"):
        ranks.run_on_ranks(0, _rank_one_dies)
    with pytest.raises(TypeError, match="fn must be callable"):
        ranks.run_on_ranks(2, "not a function")


def _report_then_end(rank, world_size, channel, how):
    channel.put("started", rank)
    if rank == 1 and how == "exit":
        channel.exit(5)  # what was put arrives, then the process ends with its own code
    if rank == 1 and how == "raise":
        raise ValueError("rank 1 refuses")
    if rank == 1 and how == "stall":
        time.sleep(120)
    channel.put("finished", rank)


@pytest.mark.smoke
def test_collect_from_ranks_delivers_reports_exit_codes_errors_and_stalls():
    reports, codes = ranks.collect_from_ranks(2, _report_then_end, "exit", timeout=120, grace=10,
                                              done=lambda got: {r[:2] for r in got} >= {(0, "finished"), (1, "started")})
    assert {(rank, key): value for rank, key, value in reports}[(1, "started")] == 1
    assert codes == {0: 0, 1: 5}
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*ValueError: rank 1 refuses"):
        ranks.collect_from_ranks(2, _report_then_end, "raise", timeout=120, done=lambda got: False)
    began = time.monotonic()
    reports, codes = ranks.collect_from_ranks(2, _report_then_end, "stall", timeout=8, on_timeout="return",
                                              done=lambda got: False)
    assert {r[:2] for r in reports} == {(0, "started"), (0, "finished"), (1, "started")}
    assert codes[1] == -9 and time.monotonic() - began < 60  # the stalled rank was killed, not waited for
    with pytest.raises(RuntimeError, match="timed out after 8 s"):
        ranks.collect_from_ranks(2, _report_then_end, "stall", timeout=8, done=lambda got: False)


def test_collect_from_ranks_names_a_bad_timeout_policy():
    with pytest.raises(ValueError, match="on_timeout"):
        ranks.collect_from_ranks(2, _report_then_end, "exit", timeout=1, on_timeout="wait", done=lambda got: True)
