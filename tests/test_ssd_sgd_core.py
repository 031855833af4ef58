"""SSD-SGD's communication-free core, alone: K cores in one process against the float64 oracle.

The all-reduces the transports issue are written out here as sums over the
cores (:class:`SimulatedRanks`), so every phase of both servers runs without a
process group: warm-up, local steps, pulls, discarded windows and the
checkpoint state. The oracle (Algorithms 1 and 2 with the parameter server) and
the model, batches and hyperparameters are those of ``test_ssd_sgd_dist.py``.
"""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from _helpers import flat
from test_ssd_sgd_dist import EXACT, GROUP0, GROUP1, WARMUP, batch, loss_of, lr_at, make_model, oracle, param_groups

from tritonopt.dist import ssd_sgd_core
from tritonopt.dist.ssd_sgd_check import check_digit_bits
from tritonopt.dist.ssd_sgd_core import (
    DiscardedWindow,
    FlatParameters,
    ReplicaServerCore,
    ShadowServerCore,
)
from tritonopt.optim.functional import ssd_sgd_step_scalars

SERVERS = {"shadow": ShadowServerCore, "replica": ReplicaServerCore}


def scalars_at(t, k, lr_scale=1.0):
    """Each group's op scalars at iteration t, as SSDSGD resolves them from GROUP0 and GROUP1."""
    return [ssd_sgd_step_scalars(lr=lr_at(t, g["lr"]) * lr_scale, momentum=g["momentum"],
                                 weight_decay=g["weight_decay"], local_lr_mult=g.get("local_lr_mult", 4.0),
                                 local_weight_decay=g.get("local_weight_decay"), glu_alpha=g.get("glu_alpha", 2.0),
                                 glu_beta=g.get("glu_beta", 0.5), delay_steps=k)
            for g in (GROUP0, GROUP1)]


class SimulatedRanks:
    """``world`` cores, one per virtual rank; each all-reduce is the sum of the cores' buffers.

    The shadow server's synchronisation is summed when launched and judged at the
    next step (or at :meth:`flush`), as :class:`~tritonopt.dist.ssd_sgd_sync.ShadowSync`
    waits for it; the replica's gradients are summed at once and applied when a
    pull is due (or at :meth:`flush`), as :class:`~tritonopt.dist.ssd_sgd_sync.PerStepSync` does.
    """

    def __init__(self, server, world, k, wp1, seed=0):
        self.server, self.k = server, k
        self.models = [make_model(seed=seed) for _ in range(world)]
        bits = check_digit_bits(world, torch.float64)
        self.cores = [SERVERS[server](FlatParameters(param_groups(m)), [], world_size=world, delay_steps=k,
                                      warmup_steps=wp1, check_bits=bits) for m in self.models]
        self.pending = [[] for _ in range(world)]  # replica: (summed gradient, scalars) not yet applied
        self.discarded = []  # what each core reported when a pull consumed a bad window

    def step(self, t, *, nan_on=None, lr_scales=None):
        """Iteration ``t`` on every core (batch ``t`` of each rank); returns the warm-up's problems, if any.

        ``nan_on``: the rank whose gradient gets a NaN; ``lr_scales``: a factor on each rank's lr.
        """
        scalars = [scalars_at(t, self.k, lr_scales[r] if lr_scales else 1.0) for r in range(len(self.cores))]
        for rank, (model, core) in enumerate(zip(self.models, self.cores)):
            model.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            if rank == nan_on:
                model[0].weight.grad[0, 0] = float("nan")
            core.flat.pack_grads(core.grad)
        with torch.no_grad():
            if self.cores[0].in_warmup:
                summed = torch.stack([c.prepare_warmup(s).clone() for c, s in zip(self.cores, scalars)]).sum(0)
                problems = []
                for core, s in zip(self.cores, scalars):
                    core.grad.copy_(summed)
                    problems.append(core.apply_warmup(s))
                return problems
            for core in self.cores:
                if not core.window.delay_ready:
                    core.enter_delay_stage()
            (self._shadow_step if self.server == "shadow" else self._replica_step)(scalars)
        return None

    def _shadow_step(self, scalars):
        due = []
        for core, s in zip(self.cores, scalars):
            if core.sync_in_flight:
                core.judge_sync()
            pulled = core.sync_ready
            if pulled:
                self.discarded.append(core.consume_sync())
            due.append(core.local_step(s, pulled=pulled))
        assert len(set(due)) == 1
        if due[0]:
            summed = torch.stack([core.prepare_sync().clone() for core in self.cores]).sum(0)
            for core in self.cores:
                core.sync.copy_(summed)
                core.sync_launched()

    def _replica_step(self, scalars):
        sent = []
        for rank, (core, s) in enumerate(zip(self.cores, scalars)):
            pulled = core.window.pull_due
            if pulled:
                self._drain(rank)
                self.discarded.append(core.discard_bad_window())
                core.pull()
            sent.append(core.local_step(s, pulled=pulled))
        summed = torch.stack(sent).sum(0)
        for rank, (core, s) in enumerate(zip(self.cores, scalars)):
            self.pending[rank].append((summed.clone(), s))
            core.advance()

    def _drain(self, rank):
        core, applied = self.cores[rank], False
        while self.pending[rank]:
            summed, s = self.pending[rank].pop(0)
            applied = core.apply_to_replica(summed, s) or applied
        core.judge_replica(applied)

    def flush(self):
        """What ``finalize`` and ``state_dict`` wait for: the shadow sum judged, the replica's gradients applied."""
        with torch.no_grad():
            for rank, core in enumerate(self.cores):
                if self.server == "shadow":
                    if core.sync_in_flight:
                        core.judge_sync()
                else:
                    self._drain(rank)


def max_abs(a, b):
    return float((a - b).abs().max())


# --------------------------------------------------------------------------- against the oracle


@pytest.mark.parametrize("server, k, wp1", [("shadow", 1, WARMUP), ("shadow", 3, WARMUP), ("shadow", 3, 0),
                                            ("replica", 3, WARMUP), ("replica", 2, 0)])
def test_k_cores_run_the_papers_algorithm(server, k, wp1):
    world, steps = 3, wp1 + 3 * k + 2
    sim = SimulatedRanks(server, world, k, wp1)
    expected = oracle(world, steps, k, wp1)
    syncs = globals_checked = 0
    for t, want in enumerate(expected):
        assert sim.step(t) in (None, [None] * world)
        done = sim.cores[0].window.steps - wp1
        check_global = done <= 0
        if done > 0 and done % k == 0:
            syncs += 1
            # The shadow sum of every other synchronisation is judged only by the next step.
            if server == "replica" or syncs % 2 == 0:
                sim.flush()
                check_global = True
        for rank, (model, core) in enumerate(zip(sim.models, sim.cores)):
            assert max_abs(flat(model.parameters()), want["dev"][rank]) <= EXACT, (t, rank, "device")
            if check_global:
                globals_checked += 1
                global_ = core.global_weights()
                assert max_abs(global_, want["global_"]) <= EXACT, (t, rank, "global")
                assert max_abs(global_, want["local"][rank]) <= EXACT, (t, rank, "local")  # a pull arrived
                assert torch.equal(global_, sim.cores[0].global_weights()), "global state differs across cores"
            elif t >= wp1 and (t + 1 - wp1) % k:
                assert max_abs(flat(model.parameters()), want["local"][rank]) <= EXACT, (t, rank, "local")
    assert globals_checked >= world * (wp1 + 1)
    assert not any(sim.discarded)


def test_the_core_issues_no_collective():
    """The core and the check encoding import nothing of torch.distributed (the transports do the talking)."""
    for module in ("ssd_sgd_core.py", "ssd_sgd_check.py"):
        tree = ast.parse((Path(ssd_sgd_core.__file__).parent / module).read_text())
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
        assert not [name for name in imported if "distributed" in name or name.endswith("_comm")], module


# --------------------------------------------------------------------------- bad windows


def synchronised_start(server, k, wp1):
    """Cores that ran the warm-up and entered the delay stage: the state a discarded first window returns to."""
    sim = SimulatedRanks(server, 2, k, wp1)
    for t in range(wp1):
        sim.step(t)
    for core in sim.cores:
        core.enter_delay_stage()
    return sim


@pytest.mark.parametrize("server", ["shadow", "replica"])
def test_a_nonfinite_update_discards_its_window_on_every_core(server):
    k, wp1, bad = 3, 3, 4  # the window of steps 3..5 holds the bad step
    sim = SimulatedRanks(server, 2, k, wp1)
    for t in range(wp1 + k):
        sim.step(t, nan_on=1 if t == bad else None)
    assert not any(sim.discarded)
    sim.flush()  # the window's synchronisation arrived: judged, acted on by the next pull
    start = synchronised_start(server, k, wp1).cores
    for core, clean in zip(sim.cores, start):
        discarded = core.consume_sync() if server == "shadow" else core.discard_bad_window()
        assert discarded == DiscardedWindow("nonfinite", wp1, wp1 + k)
        assert core.window.steps == wp1 and core.window.verdict is None
        for name in ("pre", "server_weight", "server_momentum", "sync_momentum"):
            assert torch.equal(getattr(core, name), getattr(clean, name)), name
        assert torch.equal(core.flat.buffer, clean.flat.buffer)
    sim.step(wp1 + k)  # the next step starts a window from there
    assert not any(sim.discarded)
    for core in sim.cores:
        assert core.window.steps == wp1 + 1 and torch.isfinite(core.flat.buffer).all()
    assert torch.equal(sim.cores[0].pre, sim.cores[1].pre)


@pytest.mark.parametrize("server", ["shadow", "replica"])
def test_cores_that_ran_different_steps_discard_the_window(server):
    k, wp1 = 2, 1
    sim = SimulatedRanks(server, 2, k, wp1)
    sim.step(0)
    sim.step(1, lr_scales=[1.0, 1.4])  # one rank's lr differs inside the window of steps 1..2
    sim.step(2)
    assert not any(sim.discarded)
    sim.step(3)
    assert sim.discarded == [DiscardedWindow("mismatch", wp1, wp1 + k)] * 2


def test_a_warmup_step_whose_ranks_differ_raises_and_changes_nothing():
    sim = SimulatedRanks("shadow", 2, 2, 3)
    sim.step(0)
    before = [flat(m.parameters()) for m in sim.models]
    momentum = [c.server_momentum.clone() for c in sim.cores]
    scalars = [scalars_at(1, 2), scalars_at(1, 2, lr_scale=1.5)]
    summed = torch.stack([c.prepare_warmup(s).clone() for c, s in zip(sim.cores, scalars)]).sum(0)
    for rank, (core, s) in enumerate(zip(sim.cores, scalars)):
        core.grad.copy_(summed)
        with pytest.raises(ValueError, match="differed during step 1"):
            core.apply_warmup(s)
        assert core.window.steps == 1 and torch.equal(flat(sim.models[rank].parameters()), before[rank])
        assert torch.equal(core.server_momentum, momentum[rank])


def test_a_nonfinite_warmup_step_is_refused_and_changes_nothing():
    sim = SimulatedRanks("shadow", 2, 2, 3)
    sim.step(0)
    before = [flat(m.parameters()) for m in sim.models]
    problems = sim.step(1, nan_on=0)
    assert problems == ["the averaged gradient or the update at step 1 is not finite"] * 2
    for core, model, weights in zip(sim.cores, sim.models, before):
        assert core.window.steps == 1 and torch.equal(flat(model.parameters()), weights)


# --------------------------------------------------------------------------- the checkpoint state


def saved(core):
    """What a checkpoint keeps of a core: its counters and copies of its buffers."""
    d = core.flat.numel
    return dict(window=dataclasses.replace(core.window), pre=core.pre.clone(),
                sync_momentum=core.sync_momentum.clone(), server=core.sync[: 2 * d].clone(),
                trailer=core.trailer.clone(), local=core.flat.buffer.clone(), sync_buffers=[])


@pytest.mark.parametrize("server, checkpoint_at", [("shadow", 6), ("shadow", 7), ("shadow", 2), ("replica", 6),
                                                   ("replica", 7)])
def test_cores_restored_from_their_checkpoint_state_go_on_bit_for_bit(server, checkpoint_at):
    k, wp1, steps = 3, 3, 12
    straight = SimulatedRanks(server, 2, k, wp1)
    for t in range(steps):
        straight.step(t)
    straight.flush()

    first = SimulatedRanks(server, 2, k, wp1)
    for t in range(checkpoint_at):
        first.step(t)
    first.flush()  # as state_dict() does
    states = [saved(core) for core in first.cores]
    resumed = SimulatedRanks(server, 2, k, wp1, seed=1)  # other weights: the checkpoint must restore them
    for core, state in zip(resumed.cores, states):
        core.restore(state.pop("window"), **state)
    for t in range(checkpoint_at, steps):
        resumed.step(t)
    resumed.flush()
    for a, b in zip(straight.cores, resumed.cores):
        assert a.window == b.window
        assert torch.equal(a.flat.buffer, b.flat.buffer) and torch.equal(a.global_weights(), b.global_weights())
        assert torch.equal(a.pre, b.pre) and torch.equal(a.sync, b.sync)


def test_the_window_state_is_what_a_checkpoint_saves_of_the_counters():
    from tritonopt.dist.ssd_sgd_checkpoint import _SAVED_FIELDS

    counters = set(ssd_sgd_core.WindowState().saved())
    settings = {"rank", "world_size", "comm", "delay_steps", "warmup_steps", "layout", "trailer", "sync_buffers"}
    assert counters | settings == _SAVED_FIELDS and not counters & settings


# --------------------------------------------------------------------------- misuse


def test_phases_called_out_of_order_are_refused_without_changing_anything():
    shadow = SimulatedRanks("shadow", 2, 2, 1)
    core = shadow.cores[0]
    with pytest.raises(RuntimeError, match="enter_delay_stage once, after the warm-up"):
        core.enter_delay_stage()
    shadow.step(0)
    with pytest.raises(RuntimeError, match="prepare_warmup after the warm-up"):
        core.prepare_warmup(scalars_at(1, 2))
    core.enter_delay_stage()
    before = core.flat.buffer.clone()
    with pytest.raises(RuntimeError, match="pulled=True exactly when"):
        core.local_step(scalars_at(1, 2), pulled=True)
    with pytest.raises(RuntimeError, match="judge_sync without a synchronisation launched"):
        core.judge_sync()
    with pytest.raises(RuntimeError, match="consume_sync without a synchronisation ready"):
        core.consume_sync()
    with pytest.raises(ValueError, match="one dict per parameter group"):
        core.local_step(scalars_at(1, 2)[:1], pulled=False)
    assert torch.equal(core.flat.buffer, before) and core.window.steps == 1

    replica = SimulatedRanks("replica", 2, 1, 0)
    replica.step(0)  # k = 1: a pull is due at once
    core = replica.cores[0]
    with pytest.raises(RuntimeError, match="pull\\(\\) first when a pull is due"):
        core.local_step(scalars_at(1, 1), pulled=False)
    with pytest.raises(ValueError, match="summed must be a gradient buffer"):
        core.apply_to_replica(torch.zeros(3, dtype=torch.float64), scalars_at(0, 1))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(world_size=0), ValueError, "world_size must be an int >= 1"),
    (dict(delay_steps=0), ValueError, "delay_steps must be an int >= 1"),
    (dict(warmup_steps=-1), ValueError, "warmup_steps must be an int >= 0"),
    (dict(check_bits=2), ValueError, "check_bits must satisfy 3 <= check_bits <= 16"),
    (dict(sync_buffers=[torch.zeros(2, dtype=torch.int64)]), ValueError, "floating-point tensors"),
    (dict(flat="weights"), TypeError, "flat must be a FlatParameters"),
])
def test_bad_core_arguments_are_named(kwargs, error, match):
    model = make_model()
    args = dict(flat=FlatParameters(param_groups(model)), sync_buffers=[], world_size=2, delay_steps=2,
                warmup_steps=1, check_bits=16)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ShadowServerCore(args.pop("flat"), args.pop("sync_buffers"), **args)
