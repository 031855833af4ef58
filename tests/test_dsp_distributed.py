"""DSPStage on gloo ranks against the single-process simulator, bit for bit, and its failure modes.

One spawn of 4 ranks for the module: ranks 0 and 1 first run every 2-stage
scenario in their own group (results, stragglers, memory, traffic, start-up
errors, a stalled stage), then all 4 run the 4-stage scenarios, and last rank 1
exits in the middle of a 2-stage run. The simulator runs in the parent with one
intra-op thread, as the ranks do, so the comparisons are exact.
"""

from __future__ import annotations

import contextlib
import datetime
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _distributed import collect_from_ranks
from torch import nn

from tritonopt.dist import DSPSimulator, DSPStage, split_stages

WORLD = 4
BATCHES = 10
SEEDS = (100, 101, 102, 103)  # per-stage RNG seeds (dropout)
LR = 0.05


def make_cnn() -> nn.Sequential:
    """Two blocks with BatchNorm and dropout in the first, cut at child 5."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.25),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
    )


def make_mlp() -> nn.Sequential:
    """Four blocks (cut at 2, 4, 6), dropout in the second."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Dropout(0.2), nn.Linear(12, 10), nn.ReLU(),
        nn.Linear(10, 3),
    )


def make_plain() -> nn.Sequential:
    """No stochastic layer: two stages (cut at 2) whose results do not depend on a shared RNG stream."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3))


CNN_BOUNDARIES, MLP_BOUNDARIES, PLAIN_BOUNDARIES = [5], [2, 4, 6], [2]
INTERLEAVED_CHUNKS = [(0, 4), (4, 8), (8, 10)]


def cnn_batches(count=BATCHES, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 6, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)) for _ in range(count)]


def mlp_batches(count=BATCHES, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(count)]


def make_optimizer(module):
    return torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)


def stage_state(module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in module.state_dict().values()]


def straggler_hook(rank: int, probability: float = 0.3, max_seconds: float = 0.01):
    """Sleep a random time after some compute phases: changes timing, not arithmetic."""
    chooser = random.Random(1000 + rank)

    def hook(phase, batch, seconds):
        if chooser.random() < probability:
            time.sleep(chooser.uniform(0.0, max_seconds))

    return hook


def train_stage(rank, make_model, boundaries, batches, staleness, *, hook=None, group=None, **options):
    stages = split_stages(make_model(), boundaries=boundaries)
    module = stages[rank]
    stage = DSPStage(
        module, make_optimizer(module), staleness=staleness[rank], loss_fn=nn.functional.cross_entropy,
        group=group, record_events=True, phase_hook=hook, **options,
    )
    torch.manual_seed(SEEDS[rank])
    losses = stage.train(batches)
    if stage.flush_mode == "never":
        losses = [losses, stage.train(batches[:3])]
        stage.flush()
    stats = {label: (s.bytes_sent, s.bytes_received) for label, s in stage.communicator.stats().items()}
    return {
        "losses": losses, "state": stage_state(module), "events": stage.events,
        "memory": stage.memory_report(), "traffic": stats, "expected": stage.expected_traffic(len(batches)),
    }


def expect_error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001  (the type is part of what is checked)
        return type(exc).__name__, str(exc)
    return None


# --------------------------------------------------------------------------- 2 ranks


TWO_STAGE_STALENESS = [(0, 0), (1, 0), (2, 0), (4, 0)]


def two_rank_scenarios(rank, groups):
    pair = groups["pair"]
    out = {}
    batches = cnn_batches()
    for staleness in TWO_STAGE_STALENESS:
        out[staleness] = train_stage(rank, make_cnn, CNN_BOUNDARIES, batches, staleness, group=pair)
    out["stragglers"] = train_stage(
        rank, make_cnn, CNN_BOUNDARIES, batches, (2, 0), group=pair, hook=straggler_hook(rank)
    )
    out["recompute_policy"] = train_stage(
        rank, make_cnn, CNN_BOUNDARIES, batches, (2, 0), group=pair, bn_policy="recompute"
    )
    out["streaming"] = train_stage(rank, make_cnn, CNN_BOUNDARIES, batches, (2, 0), group=pair, flush="never")
    out["overlap"] = train_stage(
        rank, make_cnn, CNN_BOUNDARIES, batches, (2, 0), group=pair, hook=straggler_hook(rank), recompute="overlap"
    )
    out["overlap_streaming"] = train_stage(
        rank, make_cnn, CNN_BOUNDARIES, batches, (2, 0), group=pair, flush="never", bn_policy="recompute",
        recompute="overlap",
    )

    # Two streaming pipelines on the same ranks take turns: each keeps its own messages.
    streams = [(mlp_batches(seed=3), (2, 0)), (mlp_batches(seed=4), (1, 0))]
    modules = [split_stages(make_plain(), boundaries=PLAIN_BOUNDARIES)[rank] for _ in streams]
    stages = [
        DSPStage(m, make_optimizer(m), staleness=st[rank], loss_fn=nn.functional.cross_entropy, group=pair,
                 flush="never")
        for m, (_, st) in zip(modules, streams)
    ]
    for lo, hi in INTERLEAVED_CHUNKS:
        for stage, (data, _) in zip(stages, streams):
            stage.train(data[lo:hi])
    for stage in stages:
        stage.flush()
    out["interleaved"] = [stage_state(m) for m in modules]

    module = split_stages(make_cnn(), boundaries=CNN_BOUNDARIES)[rank]
    loss = nn.functional.cross_entropy

    def build(staleness, **kw):
        return DSPStage(module, make_optimizer(module), staleness=staleness, loss_fn=loss, group=pair, **kw)

    out["increasing"] = expect_error(lambda: build([0, 1][rank]))
    out["last_stale"] = expect_error(lambda: build([2, 1][rank]))
    out["bad_policy"] = expect_error(lambda: build([1, 0][rank], bn_policy=["forward", "sometimes"][rank]))
    out["flush_mismatch"] = expect_error(lambda: build([1, 0][rank], flush=["epoch", "never"][rank]))
    out["bad_recompute"] = expect_error(lambda: build([1, 0][rank], recompute=["overlap", "eager"][rank]))
    before = stage_state(module)
    out["count_mismatch"] = expect_error(lambda: build([1, 0][rank]).train(batches[: [10, 9][rank]]))
    other = module if rank == 0 else nn.Sequential(nn.Flatten(), nn.Linear(100, 5))  # wrong input size
    out["shape_mismatch"] = expect_error(
        lambda: DSPStage(other, make_optimizer(other), staleness=[1, 0][rank], loss_fn=loss, group=pair).train(
            batches
        )
    )
    ragged = batches[:4] + [(batches[4][0][:5], batches[4][1][:5])]
    out["ragged"] = expect_error(lambda: build([1, 0][rank]).train(ragged))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, stage_state(module)))

    # A stalled stage: rank 1 sleeps past a 1 s timeout; rank 0 must raise in about 1 s.

    def stall(phase, batch, seconds):
        if rank == 1 and batch == 3:
            time.sleep(2.5)

    began = time.monotonic()
    out["stall"] = expect_error(
        lambda: DSPStage(module, make_optimizer(module), staleness=[1, 0][rank], loss_fn=loss, group=groups["stall"],
                         timeout=1, phase_hook=stall, recompute="overlap").train(batches)
    )
    out["stall_seconds"] = time.monotonic() - began
    out["recompute_threads_left"] = [t.name for t in threading.enumerate() if "dsp-recompute" in t.name]
    return out


def two_rank_death(rank, groups, channel):
    """After every other scenario: rank 1 exits in the middle of training; rank 0 must raise."""
    module = split_stages(make_cnn(), boundaries=CNN_BOUNDARIES)[rank]

    def die(phase, batch, seconds):
        if rank == 1 and batch == 3:
            channel.put("dying")
            channel.exit(3)

    began = time.monotonic()
    error = expect_error(
        lambda: DSPStage(module, make_optimizer(module), staleness=[2, 0][rank], loss_fn=nn.functional.cross_entropy,
                         group=groups["death"], timeout=60, phase_hook=die).train(cnn_batches())
    )
    return {"error": error, "seconds": time.monotonic() - began}


def _worker(rank, world, channel):
    dist.init_process_group("gloo", init_method=channel.init_method, rank=rank, world_size=world)
    # new_group is collective over the world: every rank creates every group, in one order.
    groups = {
        "pair": dist.new_group([0, 1]),
        "stall": dist.new_group([0, 1]),
        "death": dist.new_group([0, 1]),
        "all": dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=300)),
    }
    out = two_rank_scenarios(rank, groups) if rank < 2 else {}
    out.update(four_rank_scenarios(rank, groups["all"]))
    channel.put("ok", out)
    if rank < 2:
        channel.put("death", two_rank_death(rank, groups, channel))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned():
    """Each rank's results, rank 0's death-scenario result, and rank 1's exit code."""
    expected = {(r, "ok") for r in range(WORLD)} | {(1, "dying"), (0, "death")}
    reports, exit_codes = collect_from_ranks(WORLD, _worker, done=lambda got: {r[:2] for r in got} >= expected,
                                             timeout=400, grace=10)
    by_key = {(rank, key): value for rank, key, value in reports}
    return [by_key[(r, "ok")] for r in range(WORLD)], by_key[(0, "death")], exit_codes[1]


@pytest.fixture(scope="module")
def two_ranks(spawned):
    ranks, death, exitcode = spawned
    return ranks[:2], death, exitcode


@pytest.fixture(scope="module")
def four_ranks(spawned):
    return spawned[0]


@contextlib.contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def simulate(make_model, boundaries, batches, staleness, *, streaming=False, **options):
    stages = split_stages(make_model(), boundaries=boundaries)
    with one_thread():
        sim = DSPSimulator(
            stages, [make_optimizer(s) for s in stages], staleness, nn.functional.cross_entropy,
            seeds=SEEDS[: len(stages)], record_events=True, flush="never" if streaming else "epoch", **options,
        )
        losses = sim.train(batches)
        if streaming:
            losses = [losses, sim.train(batches[:3])]
            sim.flush()
    return losses, [stage_state(s) for s in stages], sim


def assert_equal_states(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("staleness", TWO_STAGE_STALENESS)
def test_two_ranks_equal_the_simulator_bit_for_bit(two_ranks, staleness):
    ranks, _, _ = two_ranks
    losses, states, sim = simulate(make_cnn, CNN_BOUNDARIES, cnn_batches(), staleness)
    for rank in range(2):
        assert_equal_states(ranks[rank][staleness]["state"], states[rank])
        assert ranks[rank][staleness]["events"] == sim.stages[rank].events
    assert torch.equal(ranks[1][staleness]["losses"], losses)
    assert ranks[0][staleness]["losses"] is None


def test_stragglers_change_nothing(two_ranks):
    ranks, _, _ = two_ranks
    for out in ranks:
        assert_equal_states(out["stragglers"]["state"], out[(2, 0)]["state"])
        assert out["stragglers"]["events"] == out[(2, 0)]["events"]
    assert torch.equal(ranks[1]["stragglers"]["losses"], ranks[1][(2, 0)]["losses"])


def test_recompute_policy_and_streaming_equal_the_simulator(two_ranks):
    ranks, _, _ = two_ranks
    _, recompute_states, _ = simulate(make_cnn, CNN_BOUNDARIES, cnn_batches(), (2, 0), bn_policy="recompute")
    _, streaming_states, _ = simulate(make_cnn, CNN_BOUNDARIES, cnn_batches(), (2, 0), streaming=True)
    for rank in range(2):
        assert_equal_states(ranks[rank]["recompute_policy"]["state"], recompute_states[rank])
        assert_equal_states(ranks[rank]["streaming"]["state"], streaming_states[rank])
    # The two policies update BatchNorm statistics at different weights: they must differ.
    out = ranks[0]
    assert not all(torch.equal(a, b) for a, b in zip(out["recompute_policy"]["state"], out[(2, 0)]["state"]))


def test_overlapped_recompute_equals_the_serial_ranks_and_the_simulator(two_ranks):
    ranks, _, _ = two_ranks
    _, streaming_states, _ = simulate(make_cnn, CNN_BOUNDARIES, cnn_batches(), (2, 0), streaming=True,
                                      bn_policy="recompute")
    for out in ranks:
        assert_equal_states(out["overlap"]["state"], out[(2, 0)]["state"])
        assert out["overlap"]["events"] == out[(2, 0)]["events"]
    assert torch.equal(ranks[1]["overlap"]["losses"], ranks[1][(2, 0)]["losses"])
    for rank in range(2):
        assert_equal_states(ranks[rank]["overlap_streaming"]["state"], streaming_states[rank])


def test_streaming_pipelines_on_the_same_ranks_keep_their_messages_apart(two_ranks):
    ranks, _, _ = two_ranks
    for index, (seed, staleness) in enumerate([(3, (2, 0)), (4, (1, 0))]):
        stages = split_stages(make_plain(), boundaries=PLAIN_BOUNDARIES)
        data = mlp_batches(seed=seed)
        with one_thread():
            sim = DSPSimulator(stages, [make_optimizer(s) for s in stages], staleness, nn.functional.cross_entropy,
                               flush="never")
            for lo, hi in INTERLEAVED_CHUNKS:
                sim.train(data[lo:hi])
            sim.flush()
        for rank in range(2):
            assert_equal_states(ranks[rank]["interleaved"][index], stage_state(stages[rank]))


@pytest.mark.parametrize("staleness", TWO_STAGE_STALENESS)
def test_queue_memory_equals_the_formula(two_ranks, staleness):
    ranks, _, _ = two_ranks
    memory = ranks[0][staleness]["memory"]
    batch_input_bytes = 8 * 3 * 6 * 6 * 4  # rank 0's input, float32
    assert memory["peak_queue_bytes"] == memory["expected_queue_bytes"] == staleness[0] * batch_input_bytes
    assert memory["peak_queue_entries"] == staleness[0]
    assert memory["queue_bytes"] == 0 and memory["queue_entries"] == 0  # drained
    last = ranks[1][staleness]["memory"]
    assert last["peak_queue_bytes"] == last["expected_queue_bytes"] == 0


def test_p2p_byte_counters_equal_the_traffic_formula(two_ranks):
    ranks, _, _ = two_ranks
    boundary_bytes = BATCHES * 8 * 4 * 6 * 6 * 4  # rank 0's outputs, float32
    for staleness in TWO_STAGE_STALENESS:
        first, last = ranks[0][staleness], ranks[1][staleness]
        assert first["traffic"]["activation"] == first["expected"]["activation"] == (boundary_bytes, 0)
        assert first["traffic"]["gradient"] == first["expected"]["gradient"] == (0, boundary_bytes)
        assert last["traffic"]["activation"] == last["expected"]["activation"] == (0, boundary_bytes)
        assert last["traffic"]["gradient"] == last["expected"]["gradient"] == (boundary_bytes, 0)


def test_start_up_errors_are_raised_on_every_rank(two_ranks):
    (out, last), _, _ = two_ranks
    assert out["increasing"][0] == "ValueError" and "non-increasing" in out["increasing"][1]
    assert out["last_stale"][0] == "ValueError" and "must have staleness 0" in out["last_stale"][1]
    # Rank 1 rejected its bn_policy; rank 0 (reported here) names it.
    assert out["bad_policy"][0] == "DSPConfigurationError" and "stage 1" in out["bad_policy"][1]
    assert "bn_policy" in out["bad_policy"][1]
    assert out["flush_mismatch"][0] == "ValueError" and "flush" in out["flush_mismatch"][1]
    assert out["bad_recompute"][0] == "DSPConfigurationError" and "recompute must be one of" in out["bad_recompute"][1]
    assert last["bad_recompute"][0] == "ValueError" and "'eager'" in last["bad_recompute"][1]
    assert out["count_mismatch"][0] == "ValueError"
    assert "stage 0: 10, stage 1: 9" in out["count_mismatch"][1]
    assert out["shape_mismatch"][0] == "DSPConfigurationError" and "stage 1" in out["shape_mismatch"][1]
    assert out["ragged"][0] == "ValueError" and "batch 4" in out["ragged"][1]
    assert out["untouched"] and last["untouched"], "a rejected run changed a stage's parameters or buffers"
    # The other rank's view of the same errors.
    assert last["increasing"][0] == "ValueError" and last["last_stale"][0] == "ValueError"
    assert last["bad_policy"][0] == "ValueError" and "bn_policy" in last["bad_policy"][1]
    assert last["shape_mismatch"][0] == "RuntimeError"  # its own block rejected the input
    assert last["ragged"][0] == "DSPConfigurationError" and "stage 0" in last["ragged"][1]


def test_a_stalled_stage_raises_within_the_timeout(two_ranks):
    (out, last), _, _ = two_ranks
    assert out["stall"][0] == "DSPPeerError", out["stall"]
    assert "batch" in out["stall"][1]
    assert 1.0 < out["stall_seconds"] < 1.0 + 10.0  # the 1 s timeout, plus start-up and scheduling
    assert last["stall"][0] == "DSPPeerError", last["stall"]  # after waking, it times out waiting for rank 0
    assert out["recompute_threads_left"] == [], "a failed run left its recomputation thread running"


def test_a_dead_stage_raises_instead_of_hanging(two_ranks):
    _, death, exitcode = two_ranks
    assert exitcode == 3
    assert death["error"][0] == "DSPPeerError", death
    assert death["seconds"] < 60  # inside its 60 s timeout: the closed connection is noticed at once


# --------------------------------------------------------------------------- 4 ranks


FOUR_STAGE_STALENESS = [(0, 0, 0, 0), (3, 2, 1, 0), (6, 4, 2, 0)]


def four_rank_scenarios(rank, group):
    batches = mlp_batches()
    out = {}
    for staleness in FOUR_STAGE_STALENESS:
        out[staleness] = train_stage(rank, make_mlp, MLP_BOUNDARIES, batches, staleness, group=group)
    out["mlp_stragglers"] = train_stage(
        rank, make_mlp, MLP_BOUNDARIES, batches, (6, 4, 2, 0), group=group, hook=straggler_hook(rank)
    )
    out["mlp_overlap"] = train_stage(rank, make_mlp, MLP_BOUNDARIES, batches, (6, 4, 2, 0), group=group,
                                     recompute="overlap")
    return out


@pytest.mark.parametrize("staleness", FOUR_STAGE_STALENESS)
def test_four_ranks_equal_the_simulator_bit_for_bit(four_ranks, staleness):
    losses, states, sim = simulate(make_mlp, MLP_BOUNDARIES, mlp_batches(), staleness)
    for rank in range(4):
        assert_equal_states(four_ranks[rank][staleness]["state"], states[rank])
        assert four_ranks[rank][staleness]["events"] == sim.stages[rank].events
    assert torch.equal(four_ranks[3][staleness]["losses"], losses)
    for rank in range(3):
        assert four_ranks[rank][staleness]["losses"] is None


def test_four_ranks_with_stragglers_equal_the_simulator(four_ranks):
    _, states, _ = simulate(make_mlp, MLP_BOUNDARIES, mlp_batches(), (6, 4, 2, 0))
    for rank in range(4):
        assert_equal_states(four_ranks[rank]["mlp_stragglers"]["state"], states[rank])
        assert_equal_states(four_ranks[rank]["mlp_overlap"]["state"], states[rank])
