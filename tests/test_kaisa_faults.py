"""KAISA with a rank that stalls or dies (gloo, loopback): the others raise a clear error within the timeout.

Faults are injected through the communicator every KAISA collective goes
through: at a given collective label the faulty rank sleeps past the timeout
(a stall) or exits (a death); or it stalls before building KAISA at all. Stalls
inside KAISA leave every process alive and in step, so one spawn runs several
of them in turn (each KAISA builds fresh groups) and ends with a death; the
faults that end a run get a spawn each and are marked slow. A stall in the
factor all-reduce of 2 ranks is one of the cases of ``tests/test_dist_contract.py``.
"""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from _distributed import collect_from_ranks
from torch import nn

TIMEOUT = 3.0  # seconds: KAISA's groups
HARNESS_TIMEOUT = 60.0  # seconds: the default group, used only between scenarios
# A survivor must raise within KAISA's timeout of the fault; this much more covers a step's own
# compute on a loaded 2-core machine. Without a timeout on its groups KAISA would wait 30 minutes.
SLACK = 20.0
WORLD = 4


class InjectedStall(Exception):
    """Raised by the stalled rank when it wakes up (it never enters the collective)."""


def make_communicator(label: str, action: str):
    from tritonopt.dist._comm import CountingCommunicator

    class FaultyCommunicator(CountingCommunicator):
        def _fault(self, this_label):
            if this_label != label:
                return
            if action == "kill":
                os._exit(17)
            time.sleep(TIMEOUT + 3.0)
            raise InjectedStall(label)

        def all_reduce(self, tensor, *, label, **kwargs):
            self._fault(label)
            return super().all_reduce(tensor, label=label, **kwargs)

        def broadcast(self, tensor, src, *, label, **kwargs):
            self._fault(label)
            return super().broadcast(tensor, src, label=label, **kwargs)

        def all_gather_into_tensor(self, output, input, *, label, **kwargs):
            self._fault(label)
            return super().all_gather_into_tensor(output, input, label=label, **kwargs)

    return FaultyCommunicator()


def make_model(sharded: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))
    if sharded:  # FSDP2 over the world: KAISA gathers each layer's gradient over KAISA's own group
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def run_scenario(rank, point, action, faulty):
    """One fault: returns ``(outcome, seconds from the fault's step to the error, message)``."""
    from tritonopt.dist.kaisa import KAISAPreconditioner

    label = {"construction": "config_check", "factor_allreduce": "factor_allreduce",
             "grad_broadcast": "grad_broadcast", "grad_allgather": "grad_allgather", "before_construction": None}[point]
    communicator = make_communicator(label, action) if rank == faulty and label else None
    model = make_model(sharded=point == "grad_allgather")
    gen = torch.Generator().manual_seed(rank)
    dist.barrier()
    began = time.time()
    try:
        if rank == faulty and point == "before_construction":
            if action == "kill":
                os._exit(17)
            time.sleep(TIMEOUT + 3.0)
            raise InjectedStall(point)
        kaisa = KAISAPreconditioner(model, grad_worker_fraction=0.5, timeout=TIMEOUT, communicator=communicator,
                                    factor_update_steps=1, inv_update_steps=1)
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(4, 6, generator=gen)).sum().backward()
            for p in model.parameters():  # stands in for DDP's average; every rank has the same here
                p.grad.fill_(0.01)
            kaisa.step()
        return ("finished", time.time() - began, "")
    except InjectedStall:
        return ("stalled", time.time() - began, "")
    except Exception as exc:  # noqa: BLE001 - the test looks at the type and message
        return (type(exc).__name__, time.time() - began, str(exc))


def worker(rank, world, channel, plan):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=channel.init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=HARNESS_TIMEOUT))
    import tritonopt
    from tritonopt.dist.kaisa import KAISAPreconditioner

    with tritonopt.use_backend("reference"):
        channel.put("inherited", KAISAPreconditioner(make_model()).timeout.total_seconds())
        for point, action, faulty in plan:
            channel.put((point, action), run_scenario(rank, point, action, faulty))
    channel.put("done")


def run_plan(plan, deadline=240.0):
    """Run ``plan`` (a list of ``(point, action, faulty rank)``) on WORLD ranks; what each survivor reported."""
    expected_done = WORLD - sum(action == "kill" for _, action, _ in plan)
    reports, _ = collect_from_ranks(WORLD, worker, plan, timeout=deadline,
                                    done=lambda got: sum(key == "done" for _, key, _ in got) == expected_done)
    by_rank = {r: {} for r in range(WORLD)}
    for rank, key, value in reports:
        by_rank[rank][key] = value
    return by_rank


def check_survivors(reports, point, action, faulty, collectives):
    """Every other rank raised KAISACollectiveError naming one of ``collectives``, within the timeout.

    ``collectives``: the labels of the collectives a survivor may have been waiting on, or what it was doing.
    """
    for rank, report in reports.items():
        if rank == faulty:
            if action == "stall":
                assert report[(point, action)][0] == "stalled"
            continue
        outcome, seconds, message = report[(point, action)]
        assert outcome == "KAISACollectiveError", (rank, outcome, message)
        assert message.startswith("KAISAPreconditioner: "), (rank, message)
        assert any(what in message for what in collectives), (rank, message)
        assert f"(timeout {TIMEOUT:g} s)" in message and f"failed on rank {rank} after" in message, (rank, message)
        assert seconds <= TIMEOUT + SLACK, (rank, seconds)


@pytest.fixture(scope="module")
def stall_then_kill():
    plan = [
        ("construction", "stall", 1),
        ("grad_broadcast", "stall", 1),
        ("grad_allgather", "stall", 3),
        ("grad_broadcast", "kill", 2),
    ]
    return run_plan(plan)


def test_kaisa_inherits_the_default_group_timeout(stall_then_kill):
    assert all(report["inherited"] == HARNESS_TIMEOUT for report in stall_then_kill.values())


def test_kaisa_failures_are_collective_failures_and_still_dist_errors():
    from tritonopt.dist import CollectiveFailure, KAISACollectiveError

    assert issubclass(KAISACollectiveError, CollectiveFailure) and issubclass(KAISACollectiveError, dist.DistError)


# Ranks outside the faulty rank's broadcast group finish that step and meet it at the next
# factor all-reduce.
AFTER_GRAD_BROADCAST = ("the collective 'grad_broadcast' (broadcast)", "the collective 'factor_allreduce' (all_reduce)")


@pytest.mark.parametrize("point,faulty,collectives", [
    ("construction", 1, ("the collective 'config_check' (all_gather_into_tensor)",)),
    ("grad_broadcast", 1, AFTER_GRAD_BROADCAST),
    ("grad_allgather", 3, ("the collective 'grad_allgather' (all_gather_into_tensor)",)),
])
def test_a_stalled_rank_makes_the_others_raise_within_the_timeout(stall_then_kill, point, faulty, collectives):
    check_survivors(stall_then_kill, point, "stall", faulty, collectives)


def test_a_dead_rank_makes_the_others_raise(stall_then_kill):
    survivors = {r: v for r, v in stall_then_kill.items() if r != 2}
    check_survivors(survivors, "grad_broadcast", "kill", 2, AFTER_GRAD_BROADCAST)


@pytest.mark.slow
@pytest.mark.parametrize("point,action,collectives", [
    ("construction", "kill", ("the collective 'config_check' (all_gather_into_tensor)",)),
    ("factor_allreduce", "kill", ("the collective 'factor_allreduce' (all_reduce)",)),
    # Last in its spawn: a rank that skipped a group creation is out of step for the next ones.
    ("before_construction", "stall", ("creating the process group of ranks [0, 1, 2, 3]",)),
])
def test_faults_that_end_a_run(point, action, collectives):
    reports = run_plan([(point, action, 3)])
    survivors = reports if action == "stall" else {r: v for r, v in reports.items() if r != 3}
    check_survivors(survivors, point, action, 3, collectives)
