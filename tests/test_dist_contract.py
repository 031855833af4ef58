"""The contract every distributed layer keeps, checked for each entry of ``_dist_table.LAYERS`` on 2 gloo ranks.

* agreement: a rank configured differently makes every rank raise ``ValueError``
  naming the setting;
* a shared start-up error: a bad argument on one rank makes every rank raise
  at once (well within the timeout), the refusing rank its own error and the
  others an error naming that rank and the argument;
* a stall: a rank that stops in the middle of a step makes the other raise
  :class:`~tritonopt.dist.CollectiveFailure` within the layer's ``timeout``,
  naming the layer, the ranks and the timeout;
* a refused state: a state dict one rank refuses makes every rank raise at
  once, and changes nothing on any rank;
* resume: a run saved mid-way (through ``torch.save`` / ``torch.load(weights_only=True)``),
  rebuilt and loaded, continues bit for bit like the uninterrupted run;
* autocast: steps under ``torch.autocast("cpu", dtype=torch.bfloat16)`` raise nothing,
  move the parameters and keep them float32 and finite, and what the layer keeps
  identical on every rank (``Run.replicated``) is identical bit for bit.

The state cases (a refused state, resume) skip a layer that holds nothing between
calls (``distributed_lanczos``), and the refused state a layer whose state is all
torch's (DSP).

One spawn runs every entry and case on both ranks (``scenarios``); the tests
assert on what each rank recorded.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist
from _dist_table import LAYERS, DistLayerInfo
from _distributed import run_on_ranks

WORLD = 2
ODD_RANK = 1  # the rank configured differently, refusing an argument, or stalling (rank 0 hosts the store)
TIMEOUT = 3.0  # seconds: the layers' timeout in the stall case
# The other cases: a layer that left a rank waiting would raise only after this long; sharing
# an error takes a collective or two.
PATIENT = 30.0
PROMPT = 10.0  # "well within" PATIENT: a start-up error must reach every rank within this
SLACK = 10.0  # a survivor raises within TIMEOUT of the stall, plus this for a loaded 2-core machine
STALL = TIMEOUT + 2.0  # how long the stalled rank sleeps before it gives up the step


class InjectedStall(Exception):
    """Raised by the stalled rank when it wakes up (it never enters the collective it stopped at)."""


def _outcome(action) -> dict:
    """Run ``action``; what it raised (type, whether a CollectiveFailure, message) and when."""
    from tritonopt.dist import CollectiveFailure

    began = time.time()
    try:
        action()
        kind, failure, message = "returned", False, ""
    except InjectedStall:
        kind, failure, message = "stalled", False, ""
    except Exception as exc:  # noqa: BLE001 - the result is what each rank raised
        kind, failure, message = type(exc).__name__, isinstance(exc, CollectiveFailure), str(exc)
        if isinstance(exc, (ValueError, TypeError)):
            kind = f"{kind} (a {'ValueError' if isinstance(exc, ValueError) else 'TypeError'})"
    return {"kind": kind, "collective_failure": failure, "message": message, "began": began, "ended": time.time()}


def _build_and_step(info: DistLayerInfo, rank: int, world: int, overrides: dict) -> None:
    """Build the run, then take one step: a function such as ``distributed_lanczos`` checks at its call."""
    info.make_run(rank, world, timeout=PATIENT, **overrides).step(0)


def _agreement(info: DistLayerInfo, rank: int, world: int) -> dict:
    overrides = info.differing[0] if rank == ODD_RANK else {}
    return _outcome(lambda: _build_and_step(info, rank, world, overrides))


def _startup_error(info: DistLayerInfo, rank: int, world: int) -> dict:
    overrides = info.bad_argument[0] if rank == ODD_RANK else {}
    return _outcome(lambda: _build_and_step(info, rank, world, overrides))


def _stall(info: DistLayerInfo, rank: int, world: int) -> dict:
    stalled_at = []

    def stall():
        stalled_at.append(time.time())
        time.sleep(STALL)
        raise InjectedStall()

    def run():
        layer = info.make_run(rank, world, timeout=TIMEOUT, stall=stall if rank == ODD_RANK else None)
        for i in range(info.steps):
            layer.step(i)

    outcome = _outcome(run)
    outcome["stalled_at"] = stalled_at[0] if stalled_at else None
    return outcome


def _resume(info: DistLayerInfo, rank: int, world: int) -> dict:
    if not info.checkpoints:
        return {}
    straight = info.make_run(rank, world, timeout=PATIENT)
    initial = straight.weights()
    for i in range(info.steps):
        straight.step(i)
    first = info.make_run(rank, world, timeout=PATIENT)
    for i in range(info.save_after):
        first.step(i)
    saved = first.save()
    resumed = info.make_run(rank, world, timeout=PATIENT)
    resumed.load(saved)
    for i in range(info.save_after, info.steps):
        resumed.step(i)
    return {"initial": initial, "straight": straight.weights(), "resumed": resumed.weights()}


def _refused_state(info: DistLayerInfo, rank: int, world: int) -> dict:
    if info.spoiled_state is None or not info.checkpoints:
        return {}
    run = info.make_run(rank, world, timeout=PATIENT)
    for i in range(info.save_after):
        run.step(i)
    saved = run.save()
    if rank == ODD_RANK:
        info.spoiled_state[0](saved)
    run.step(info.save_after)  # so that loading the checkpoint on any rank would change something
    before = run.save()
    outcome = _outcome(lambda: run.load(saved))
    outcome["unchanged"] = _same(before, run.save())
    return outcome


def _autocast(info: DistLayerInfo, rank: int, world: int) -> dict:
    run = info.make_run(rank, world, timeout=PATIENT)
    initial = run.weights()
    # The whole step (forward, backward and the layer's own work) runs under autocast, as a training loop may.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(info.steps):
            run.step(i)
    return {"initial": initial, "weights": run.weights(), "replicated": run.replicated()}


def _same(a, b) -> bool:
    """Equal structure, and tensors equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


CASES = {"agreement": _agreement, "startup_error": _startup_error, "stall": _stall,
         "refused_state": _refused_state, "resume": _resume, "autocast": _autocast}


def scenarios(rank: int, world: int) -> dict:
    import tritonopt

    results = {}
    with tritonopt.use_backend("reference"):
        for info in LAYERS:
            for case, scenario in CASES.items():
                dist.barrier()  # every case starts together (the stalled rank wakes after the others raised)
                # Shown with a failed run: where each rank was when a case left the ranks out of step.
                print(f"rank {rank}: {info.name}, {case}", file=sys.stderr, flush=True)
                try:
                    results[(info.name, case)] = scenario(info, rank, world)
                except Exception as exc:  # noqa: BLE001 - reported by the test of this case, not the spawn
                    results[(info.name, case)] = {"crashed": f"{type(exc).__name__}: {exc}"}
    return results


@pytest.fixture(scope="module")
def results():
    # No teardown: the stall cases leave groups with work the stalled rank never joined.
    return run_on_ranks(WORLD, scenarios, timeout=240.0, teardown=False)


def _per_rank(results, info, case) -> list[dict]:
    outcomes = [r[(info.name, case)] for r in results]
    for rank, outcome in enumerate(outcomes):
        assert "crashed" not in outcome, (rank, outcome)
    return outcomes


LAYER_PARAMS = [pytest.param(info, id=info.name) for info in LAYERS]


@pytest.mark.parametrize("info", LAYER_PARAMS)
def test_a_rank_configured_differently_makes_every_rank_name_the_setting(results, info):
    setting = info.differing[1]
    for rank, outcome in enumerate(_per_rank(results, info, "agreement")):
        assert "a ValueError" in outcome["kind"], (rank, outcome)
        assert setting in outcome["message"] and "configured differently" in outcome["message"], (rank, outcome)
        assert outcome["ended"] - outcome["began"] < PROMPT, (rank, outcome)


@pytest.mark.parametrize("info", LAYER_PARAMS)
def test_a_bad_argument_on_one_rank_makes_every_rank_raise_at_once(results, info):
    word = info.bad_argument[1]
    outcomes = _per_rank(results, info, "startup_error")
    for rank, outcome in enumerate(outcomes):
        assert "a ValueError" in outcome["kind"] or "a TypeError" in outcome["kind"], (rank, outcome)
        assert word in outcome["message"], (rank, outcome)
        assert outcome["ended"] - outcome["began"] < PROMPT, (rank, outcome)
        if rank != ODD_RANK:
            assert f"rank {ODD_RANK}" in outcome["message"] and "refused at start-up" in outcome["message"], outcome


@pytest.mark.parametrize("info", LAYER_PARAMS)
def test_a_stalled_rank_makes_the_other_raise_a_collective_failure_within_the_timeout(results, info):
    outcomes = _per_rank(results, info, "stall")
    stalled = outcomes[ODD_RANK]
    assert stalled["kind"] == "stalled" and stalled["stalled_at"] is not None, stalled
    for rank, outcome in enumerate(outcomes):
        if rank == ODD_RANK:
            continue
        message = outcome["message"]
        if info.failure_through_ddp:  # DDP re-raises the hook's failure from backward(), its message inside
            assert outcome["kind"] == "RuntimeError", (rank, outcome)
            assert f"CollectiveFailure: {info.error_prefix}: " in message, message
            message = message[message.index(f"{info.error_prefix}: "):]
        else:
            assert outcome["collective_failure"], (rank, outcome)
        assert message.startswith(info.error_prefix) and f"timeout {TIMEOUT:g} s" in message, message
        assert "[0, 1]" in message and f"on rank {rank}" in message, message
        waited = outcome["ended"] - stalled["stalled_at"]
        assert waited <= TIMEOUT + SLACK, (rank, waited, message)


@pytest.mark.parametrize("info", [pytest.param(info, id=info.name) for info in LAYERS
                                  if info.spoiled_state and info.checkpoints])
def test_a_state_dict_refused_on_one_rank_is_refused_on_every_rank_and_changes_nothing(results, info):
    word = info.spoiled_state[1]
    for rank, outcome in enumerate(_per_rank(results, info, "refused_state")):
        assert "a ValueError" in outcome["kind"] or "a TypeError" in outcome["kind"], (rank, outcome)
        assert outcome["ended"] - outcome["began"] < PROMPT, (rank, outcome)
        assert outcome["unchanged"], (rank, outcome)
        if rank == ODD_RANK:
            assert word in outcome["message"], outcome
        else:
            assert "refused" in outcome["message"], outcome


@pytest.mark.parametrize("info", [pytest.param(info, id=info.name) for info in LAYERS if info.checkpoints])
def test_a_run_resumed_from_a_checkpoint_continues_bit_for_bit(results, info):
    for rank, outcome in enumerate(_per_rank(results, info, "resume")):
        straight, resumed = outcome["straight"], outcome["resumed"]
        assert len(straight) == len(resumed) > 0
        assert any(not torch.equal(a, b) for a, b in zip(outcome["initial"], straight)), "the run never moved"
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b), (rank, (a - b).abs().max())


@pytest.mark.parametrize("info", LAYER_PARAMS)
def test_steps_under_bfloat16_autocast_keep_finite_float32_parameters_and_the_replicas_identical(results, info):
    outcomes = _per_rank(results, info, "autocast")
    for rank, outcome in enumerate(outcomes):
        initial, weights = outcome["initial"], outcome["weights"]
        assert weights and all(w.dtype in (torch.float32, torch.float64) for w in weights), (rank, weights)
        assert all(bool(torch.isfinite(w).all()) for w in weights), (rank, weights)
        if initial:  # a layer that trains: the parameters moved and stayed float32
            assert [w.dtype for w in weights] == [w.dtype for w in initial] == [torch.float32] * len(initial)
            assert any(not torch.equal(a, b) for a, b in zip(initial, weights)), (rank, "the run never moved")
    replicas = [outcome["replicated"] for outcome in outcomes]
    for rank, replica in enumerate(replicas[1:], start=1):
        assert len(replica) == len(replicas[0]), rank
        for a, b in zip(replicas[0], replica):
            assert bool(torch.isfinite(a).all()) and torch.equal(a, b), (rank, (a - b).abs().max())
