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
    # Rank 1 refused its own arguments: both ranks raise its error at once, each as a ValueError.
    for name, problem in {
        "one_refuses": ValueError("lr must be positive, got -1") if rank == 1 else None,
        "both_refuse": TypeError(f"bad argument on rank {rank}"),
        "other_type": KeyboardInterrupt() if rank == 0 else None,
    }.items():
        try:
            check_ranks_agree("layer", None if problem else {"lr": 0.1}, comm=comm, problem=problem)
            results[name] = None
        except BaseException as error:  # noqa: B036 - the test records what each rank raised
            results[name] = (type(error).__name__, str(error), error is problem)
    try:
        check_ranks_agree("layer.load_state_dict", None if rank == 1 else {"step": 3}, comm=comm,
                          problem=ValueError("saved for rank 0") if rank == 1 else None,
                          stage="while loading its state")
    except ValueError as error:
        results["loading"] = str(error)
    check_ranks_agree("layer", {"lr": 0.1}, comm=comm)  # the group is still usable afterwards
    results["after"] = True
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


def test_an_error_on_one_rank_reaches_every_rank_as_that_error(results):
    own, peer = results[1]["one_refuses"], results[0]["one_refuses"]
    assert own == ("ValueError", "lr must be positive, got -1", True)
    assert peer[0] == "ValueError" and not peer[2]
    assert "layer: rank 1 refused at start-up: ValueError: lr must be positive, got -1" in peer[1]


def test_each_rank_that_refused_raises_its_own_error(results):
    for rank, r in enumerate(results):
        assert r["both_refuse"] == ("TypeError", f"bad argument on rank {rank}", True)


def test_an_unshareable_error_type_reaches_peers_as_runtime_error(results):
    assert results[0]["other_type"][0] == "KeyboardInterrupt" and results[0]["other_type"][2]
    assert results[1]["other_type"][0] == "RuntimeError"
    assert "rank 0 refused at start-up: KeyboardInterrupt" in results[1]["other_type"][1]
    assert all(r["after"] for r in results)


def test_the_message_says_when_the_rank_refused(results):
    assert results[0]["loading"] == ("layer.load_state_dict: rank 1 refused while loading its state: "
                                     "ValueError: saved for rank 0")
    assert results[1]["loading"] == "saved for rank 0"
