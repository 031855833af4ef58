"""A rank of DHO2 or MR-DHO2 dies or stalls: every survivor raises a clear error within the timeout.

Each scenario runs fresh gloo ranks (loopback) whose process group has a long
timeout (60 s); the layer is given ``TIMEOUT``, so a prompt error shows that
the layer's own groups carry it. A fault is injected on one rank at start-up
(before the layer is constructed), during Lanczos (at a Gram-Schmidt
all_reduce) or at the update's all_reduce: the rank exits (kill) or sleeps
past the timeout (stall). Ranks start from a forkserver that has imported
torch and tritonopt once, so a scenario costs about a second plus the stall.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from _distributed import collect_from_ranks

import tritonopt
from tritonopt.dist._comm import CountingCommunicator

TIMEOUT = 4.0  # seconds: the layers' timeout
SLACK = 4.0  # scheduling delays on a busy 2-core machine
COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_to_all_single")


class FaultAt:
    """A communicator that faults on the ``nth`` call of the collective ``label`` (else delegates)."""

    def __init__(self, comm, label, nth, fault):
        self.comm, self.label, self.nth, self.fault, self.calls = comm, label, nth, fault, 0

    def __getattr__(self, name):
        if name in ("comm", "label", "nth", "fault", "calls") or name.startswith("__"):
            raise AttributeError(name)
        method = getattr(self.comm, name)
        if name not in COLLECTIVES:
            return method

        def call(*args, label, **kwargs):
            if label == self.label:
                self.calls += 1
                if self.calls == self.nth:
                    self.fault()
            return method(*args, label=label, **kwargs)

        return call


def problem():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.randn(32, 8, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def dho2_run(rank, world, phase, fault, faulty):
    from tritonopt.dist import DHO2

    model, x, y = problem()
    loss = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
    if phase == "startup" and rank == faulty:
        fault()
    label, nth = {"startup": (None, 0), "lanczos": ("lanczos_coef", 3), "update": ("update_all_reduce", 2)}[phase]
    comm = CountingCommunicator()
    if rank == faulty and label:
        comm = FaultAt(comm, label, nth, fault)
    opt = DHO2(model.parameters(), lr=1e-2, k=2, num_lanczos_iters=8, warmup_steps=1, curvature_update_every=100,
               curvature_loss_fn=loss, comm=comm, timeout=TIMEOUT)
    for _ in range(6):
        opt.zero_grad()
        loss().backward()
        opt.step()


def mrdho2_run(rank, world, phase, fault, faulty):
    from tritonopt.dist import MRDHO2

    model, x, y = problem()
    loss = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
    if phase == "startup" and rank == faulty:
        fault()
    label, nth = {"startup": (None, 0), "lanczos": ("lanczos_coef", 3),
                  "update": ("final_newton_and_projection", 1)}[phase]
    comm = CountingCommunicator()
    if rank == faulty and label:
        comm = FaultAt(comm, label, nth, fault)
    mr = MRDHO2(model.parameters(), num_accelerators=2, lr=1e-2, k=2, num_lanczos_iters=8, comm=comm,
                timeout=TIMEOUT)
    for _ in range(3):
        mr.begin_epoch(None if mr.is_worker else loss)
        if mr.is_worker:
            for _ in range(3):
                for p in model.parameters():
                    p.grad = None
                loss().backward()
                mr.step()
        mr.end_epoch()


LAYERS = {"DHO2": (dho2_run, 2), "MRDHO2": (mrdho2_run, 4)}
# The faulty rank: never rank 0 (it hosts the rendezvous store); an accelerator of MR-DHO2 for
# Lanczos, a worker for its final update.
FAULTY = {("DHO2", "startup"): 1, ("DHO2", "lanczos"): 1, ("DHO2", "update"): 1,
          ("MRDHO2", "startup"): 2, ("MRDHO2", "lanczos"): 1, ("MRDHO2", "update"): 3}


def _rank_main(rank, world, channel, layer, phase, kind):
    faulty = FAULTY[(layer, phase)]

    def fault():
        channel.put("fault", (kind, "", time.monotonic()))
        if kind == "kill":
            channel.exit(1)
        time.sleep(TIMEOUT + 2 * SLACK)
        channel.exit(0)

    try:
        dist.init_process_group("gloo", init_method=channel.init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        with tritonopt.use_backend("reference"):
            LAYERS[layer][0](rank, world, phase, fault, faulty)
        channel.put("returned", ("", time.monotonic()))
    except BaseException as exc:  # noqa: BLE001  (what a survivor saw is the result)
        channel.put(type(exc).__name__, (str(exc), time.monotonic()))


def run_fault(layer, phase, kind):
    """``(fault time, {survivor rank: (exception name, message, time)})``."""
    world, faulty = LAYERS[layer][1], FAULTY[(layer, phase)]

    def seen_enough(reports):
        survivors = {rank for rank, key, _ in reports if key != "fault" and rank != faulty}
        return len(survivors) >= world - 1 and any(key == "fault" for _, key, _ in reports)

    # torch._dynamo: torch.optim imports it at the first add_param_group (seconds on a busy machine).
    reports, _ = collect_from_ranks(world, _rank_main, layer, phase, kind, done=seen_enough,
                                    timeout=60 + TIMEOUT + 2 * SLACK, on_timeout="return",
                                    start_method="forkserver", preload=["torch", "torch._dynamo", "tritonopt.dist.dho2"])
    fault_time = next((value[2] for _, key, value in reports if key == "fault"), None)
    survivors = {rank: (key, *value) for rank, key, value in reports if key != "fault" and rank != faulty}
    return fault_time, survivors


FAST = {("DHO2", "update", "kill"), ("DHO2", "lanczos", "stall"), ("MRDHO2", "lanczos", "kill"),
        ("MRDHO2", "startup", "stall")}
CASES = [pytest.param(layer, phase, kind, marks=() if (layer, phase, kind) in FAST else pytest.mark.slow,
                      id=f"{layer}-{kind}-at-{phase}")
         for layer in LAYERS for phase in ("startup", "lanczos", "update") for kind in ("kill", "stall")]


@pytest.mark.parametrize("layer, phase, kind", CASES)
def test_survivors_raise_a_clear_error_within_the_timeout(layer, phase, kind):
    fault_time, reports = run_fault(layer, phase, kind)
    world = LAYERS[layer][1]
    assert fault_time is not None, "the fault was never injected"
    assert sorted(reports) == sorted(set(range(world)) - {FAULTY[(layer, phase)]}), reports
    for rank, (what, message, when) in reports.items():
        assert what == "CollectiveFailure", (rank, what, message)
        assert message.startswith(f"{layer}:") and f"timeout {TIMEOUT:g} s" in message, message
        assert "failed" in message and ("died" in message or "did not join" in message), message
        assert when - fault_time <= TIMEOUT + SLACK, (rank, when - fault_time, message)
