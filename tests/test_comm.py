"""The byte-counting communicator on real gloo ranks."""

import pytest
import torch
from _distributed import run_on_ranks

from tritonopt.dist._comm import CountingCommunicator

WORLD = 3


def scenarios(rank, world):
    comm = CountingCommunicator()
    out = {}
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t, label="reduce")
    out["all_reduce"] = t.clone()

    b = torch.full((5,), float(rank))
    comm.broadcast(b, src=1, label="bcast")
    out["broadcast"] = b.clone()

    gathered = torch.empty(world * 2, dtype=torch.float64)
    comm.all_gather_into_tensor(gathered, torch.full((2,), float(rank), dtype=torch.float64), label="gather")
    out["all_gather"] = gathered

    # Rank r sends r + 1 + dest rows of width 2 to each destination.
    send_splits = [rank + 1 + dest for dest in range(world)]
    recv_splits = [src + 1 + rank for src in range(world)]
    send = torch.cat([torch.full((n, 2), float(10 * rank + dest)) for dest, n in enumerate(send_splits)])
    recv = torch.empty(sum(recv_splits), 2)
    comm.all_to_all_single(recv, send, recv_splits, send_splits, label="a2a")
    out["all_to_all"] = recv
    out["send_splits"], out["recv_splits"] = send_splits, recv_splits

    try:
        comm.all_reduce(torch.zeros(4, 4).t(), label="bad")
    except ValueError as exc:
        out["non_contiguous"] = str(exc)
    out["stats"] = {label: vars(s) for label, s in comm.stats().items()}
    out["total_received"] = comm.total_bytes("received")
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, scenarios)


def test_collectives_compute_the_right_values(results):
    for rank, out in enumerate(results):
        assert torch.equal(out["all_reduce"], torch.full((4,), 6.0))
        assert torch.equal(out["broadcast"], torch.full((5,), 1.0))
        assert out["all_gather"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        expected = torch.cat([torch.full((n, 2), float(10 * src + rank)) for src, n in enumerate(out["recv_splits"])])
        assert torch.equal(out["all_to_all"], expected)


def test_bytes_follow_the_documented_convention(results):
    for rank, out in enumerate(results):
        stats = out["stats"]
        assert stats["reduce"] == {"calls": 1, "bytes_sent": 16, "bytes_received": 16}
        on_source = rank == 1
        assert stats["bcast"] == {
            "calls": 1,
            "bytes_sent": 20 if on_source else 0,
            "bytes_received": 0 if on_source else 20,
        }
        assert stats["gather"] == {"calls": 1, "bytes_sent": 16, "bytes_received": 32}
        row = 2 * 4
        sent = sum(n for dest, n in enumerate(out["send_splits"]) if dest != rank) * row
        received = sum(n for src, n in enumerate(out["recv_splits"]) if src != rank) * row
        assert stats["a2a"] == {"calls": 1, "bytes_sent": sent, "bytes_received": received}
        assert out["total_received"] == sum(s["bytes_received"] for s in stats.values())


def test_non_contiguous_tensors_are_refused_before_the_collective(results):
    for out in results:
        assert "contiguous" in out["non_contiguous"]
        assert "bad" not in out["stats"]
