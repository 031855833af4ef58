"""check_ranks_agree: ranks configured alike pass; otherwise every rank raises, naming what differs."""

import pytest
import torch
from _distributed import run_on_ranks

from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._comm import CountingCommunicator


def scenarios(rank, world_size):
    comm = CountingCommunicator()
    results = {}
    check_ranks_agree("layer", {"lr": 0.1, "shapes": ((3, 4), (4,)), "dtype": torch.float32}, comm=comm)
    results["agree"] = comm.stats()["config_check"].bytes_sent
    for name, settings in {
        "value": {"lr": 0.1 * (rank + 1), "seed": 0},
        "key": {"lr": 0.1, **({"seed": 0} if rank == 0 else {"momentum": 0.9})},
    }.items():
        try:
            check_ranks_agree("layer", settings, comm=comm)
            results[name] = None
        except ValueError as error:
            results[name] = str(error)
    return results


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(2, scenarios)


def test_ranks_configured_alike_pass_with_a_few_bytes(results):
    assert all(r["agree"] == 8 + 4 * 8 for r in results)  # the width, then 4 digests of 8 bytes


def test_every_rank_names_the_setting_that_differs_and_each_value(results):
    for r in results:
        assert "lr: rank 0: 0.1, rank 1: 0.2" in r["value"]
        assert "seed" not in r["value"]
        assert "momentum: rank 0: absent, rank 1: 0.9" in r["key"] and "seed: rank 0: 0, rank 1: absent" in r["key"]
