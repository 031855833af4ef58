"""perf._ranks, the one launcher of the experiments and the distributed tests: a rank that dies says so at once."""

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
