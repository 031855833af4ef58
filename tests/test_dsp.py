"""DSP's arithmetic in one process: the simulator against backprop, the paper's eq. (5) and its own rules."""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
import threading
import warnings
from typing import NamedTuple

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import pipe_split

from tritonopt.dist import DSPSimulator, simulate_dsp, split_stages
from tritonopt.dist.dsp_core import StageCompute, check_modes, check_staleness, stage_actions

LOSS = nn.functional.cross_entropy


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models are tiny: one intra-op thread avoids thread hand-off costs on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_mlp(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(dropout), nn.ReLU(),
        nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3),
    )


MLP_CUTS = {1: [], 2: [3], 3: [2, 5], 4: [2, 5, 7]}


def make_cnn() -> nn.Sequential:
    """BatchNorm and dropout in the first block (cut at child 4)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.3),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3),
    )


def mlp_batches(count=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(count)]


def cnn_batches(count=8, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 3, 5, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)) for _ in range(count)]


def sgd(params, lr=0.1):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-3)


def state(module):
    return [t.detach().clone() for t in module.state_dict().values()]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x.float() - y.float()).abs().max()


def backprop(model, batches, make_optimizer):
    optimizer = make_optimizer(model.parameters())
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = LOSS(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


# --------------------------------------------------------------------------- zero staleness is backprop


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("make_optimizer", [sgd, lambda p: torch.optim.Adam(p, lr=1e-2)], ids=["sgd", "adam"])
def test_zero_staleness_is_backprop_bit_for_bit(num_stages, make_optimizer):
    batches = mlp_batches()
    reference = make_mlp(dropout=0.2)
    torch.manual_seed(7)
    expected = backprop(reference, batches, make_optimizer)

    model = make_mlp(dropout=0.2)
    stages = split_stages(model, boundaries=MLP_CUTS[num_stages])
    torch.manual_seed(7)  # the stages share this stream, drawn in backprop's order
    losses = simulate_dsp(stages, [make_optimizer(s.parameters()) for s in stages], batches, [0] * num_stages, LOSS)
    assert torch.equal(losses, expected)
    assert_same(state(model), state(reference))


@pytest.mark.parametrize("bn_policy", ["forward", "recompute"])
def test_zero_staleness_is_backprop_with_batchnorm_and_dropout(bn_policy):
    batches = cnn_batches()
    reference = make_cnn()
    torch.manual_seed(3)
    expected = backprop(reference, batches, sgd)
    model = make_cnn()
    stages = split_stages(model, boundaries=[4])
    torch.manual_seed(3)
    losses = simulate_dsp(stages, [sgd(s.parameters()) for s in stages], batches, [0, 0], LOSS, bn_policy=bn_policy)
    assert torch.equal(losses, expected)
    assert_same(state(model), state(reference))  # running statistics included


# --------------------------------------------------------------------------- staleness semantics


STALENESS_VECTORS = [(1, 0), (4, 0), (2, 2, 0), (4, 2, 0), (6, 4, 2, 0), (3, 1, 1, 0)]


@pytest.mark.parametrize("staleness", STALENESS_VECTORS)
def test_forward_of_t_sees_the_updates_of_batches_before_t_minus_m(staleness):
    num_stages, n = len(staleness), 12
    stages = split_stages(make_mlp(), boundaries=MLP_CUTS[num_stages])
    sim = DSPSimulator(stages, [sgd(s.parameters()) for s in stages], staleness, LOSS, record_events=True)
    sim.train(mlp_batches(n))
    for k, m in enumerate(staleness):
        events = sim.stages[k].events
        last = k == num_stages - 1
        forwards = [(b, v) for kind, b, v in events if kind == ("forward_backward" if last else "forward")]
        backwards = [(b, v) for kind, b, v in events if kind in ("backward", "forward_backward")]
        # version = optimizer steps taken before the event; updates happen in batch order
        assert forwards == [(t, max(0, t - m)) for t in range(n)]
        assert backwards == [(j, j) for j in range(n)]
        # steady state: exactly m_k updates between the forward and the backward of a batch
        for t in range(m, n):
            assert dict(backwards)[t] - dict(forwards)[t] == m


def test_stage_actions_order():
    assert list(stage_actions(2, False, 0, 4)) == [
        ("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0), ("forward", 3), ("backward", 1),
    ]
    assert list(stage_actions(2, False, 4, 0, pending=[2, 3])) == [("backward", 2), ("backward", 3)]
    assert list(stage_actions(0, True, 5, 2)) == [("forward_backward", 5), ("forward_backward", 6)]


def _recorder(optimizer, module):
    """Weights after every update (index = version) and the gradient each update used."""
    weights = [[p.detach().clone() for p in module.parameters()]]
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in module.parameters()]))
    optimizer.register_step_post_hook(
        lambda *_: weights.append([p.detach().clone() for p in module.parameters()])
    )
    return weights, grads


def _at(module, params):
    clone = copy.deepcopy(module)
    with torch.no_grad():
        for p, w in zip(clone.parameters(), params):
            p.copy_(w)
    return clone


@pytest.mark.parametrize("staleness", [(4, 2, 0), (2, 1, 0), (0, 0, 0)])
def test_gradients_are_the_dsp_gradient_of_equation_5(staleness):
    """Paper eq. (5): block k's Jacobians at its backward-time weights, around its forward-time input.

    Rebuilt from recorded weights alone: the input of block k is computed with
    every lower block j at its forward-time version ``max(0, i - m_j)``; the
    error gradient then flows down through every block at its version before the
    update of batch ``i`` (version ``i``).
    """
    batches = mlp_batches(10)
    stages = split_stages(make_mlp(), boundaries=MLP_CUTS[3])
    pristine = copy.deepcopy(stages)
    optimizers = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.5) for s in stages]
    records = [_recorder(o, s) for o, s in zip(optimizers, stages)]
    simulate_dsp(stages, optimizers, batches, staleness, LOSS)

    for i, (x, y) in enumerate(batches):
        inputs = [x]
        for j in range(2):
            forward_weights = records[j][0][max(0, i - staleness[j])]
            with torch.no_grad():
                inputs.append(_at(pristine[j], forward_weights)(inputs[-1]))
        delta = None
        for j in (2, 1, 0):
            block = _at(pristine[j], records[j][0][i])
            h = inputs[j].clone().requires_grad_(j > 0)
            out = block(h)
            (LOSS(out, y) if j == 2 else out).backward(None if j == 2 else delta)
            for g_recorded, p in zip(records[j][1][i], block.parameters()):
                assert torch.equal(g_recorded, p.grad), (i, j, (g_recorded - p.grad).abs().max())
            delta = h.grad


# --------------------------------------------------------------------------- BatchNorm, dropout, memory


def test_recompute_replays_the_forwards_dropout_masks():
    stages = split_stages(make_cnn(), boundaries=[4])
    outputs = {True: [], False: []}  # by grad mode: the recompute runs with a graph
    stages[0].register_forward_hook(lambda mod, args, out: outputs[torch.is_grad_enabled()].append(out.detach()))
    optimizers = [torch.optim.SGD(s.parameters(), lr=0.0) for s in stages]  # weights stay put
    torch.manual_seed(5)
    simulate_dsp(stages, optimizers, cnn_batches(), [3, 0], LOSS)
    assert len(outputs[False]) == len(outputs[True]) == 8
    for forward, recomputed in zip(outputs[False], outputs[True]):
        assert torch.equal(forward, recomputed)
    # ...and the masks do vary from batch to batch (the check is not vacuous)
    zeros = [(o == 0).float().mean().item() for o in outputs[False]]
    assert min(zeros) > 0 and len(set(zeros)) > 1


@pytest.mark.parametrize("bn_policy", ["forward", "recompute"])
def test_running_statistics_are_updated_once_per_batch(bn_policy):
    batches = cnn_batches()
    reference = make_cnn()
    backprop(reference, batches, lambda p: torch.optim.SGD(p, lr=0.0))
    model = make_cnn()
    stages = split_stages(model, boundaries=[4])
    simulate_dsp(stages, [torch.optim.SGD(s.parameters(), lr=0.0) for s in stages], batches, [3, 0], LOSS,
                 bn_policy=bn_policy)
    # with constant weights every pass sees the same statistics: exactly backprop's, counted once per batch
    bn, bn_reference = model[1], reference[1]
    assert int(bn.num_batches_tracked) == len(batches)
    assert torch.equal(bn.running_mean, bn_reference.running_mean)
    assert torch.equal(bn.running_var, bn_reference.running_var)


def test_the_policies_differ_once_weights_move():
    results = {}
    for policy in ("forward", "recompute"):
        model = make_cnn()
        stages = split_stages(model, boundaries=[4])
        torch.manual_seed(0)
        simulate_dsp(stages, [sgd(s.parameters()) for s in stages], cnn_batches(), [3, 0], LOSS, bn_policy=policy)
        results[policy] = model[1].running_mean.clone()
        assert int(model[1].num_batches_tracked) == 8
    assert not torch.equal(results["forward"], results["recompute"])


@pytest.mark.parametrize("staleness", [(0, 0), (1, 0), (3, 0), (5, 2, 0)])
def test_queue_memory_equals_the_formula(staleness):
    num_stages = len(staleness)
    stages = split_stages(make_mlp(), boundaries=MLP_CUTS[num_stages])
    sim = DSPSimulator(stages, [sgd(s.parameters()) for s in stages], staleness, LOSS)
    sim.train(mlp_batches(10))
    input_bytes = [8 * 6 * 4, 8 * 16 * 4, 8 * 16 * 4] if num_stages == 3 else [8 * 6 * 4, 8 * 16 * 4]
    for k, report in enumerate(sim.memory_report()):
        assert report["expected_queue_bytes"] == staleness[k] * input_bytes[k]
        assert report["peak_queue_bytes"] == report["expected_queue_bytes"]
        assert report["peak_queue_entries"] == staleness[k]
        assert report["queue_bytes"] == 0  # drained


# --------------------------------------------------------------------------- order independence, streaming


@pytest.mark.parametrize("staleness", [(4, 2, 0), (6, 4, 2, 0), (3, 3, 1, 0)])
def test_any_interleaving_of_the_stages_gives_the_same_result(staleness):
    num_stages = len(staleness)
    runs = []
    for interleaving in (None, 0, 1, 2):
        model = make_mlp(dropout=0.3)
        stages = split_stages(model, boundaries=MLP_CUTS[num_stages])
        sim = DSPSimulator(stages, [sgd(s.parameters()) for s in stages], staleness, LOSS, seeds=[11, 12, 13, 14][:num_stages])
        losses = sim.train(mlp_batches(), interleaving_seed=interleaving)
        runs.append((losses, state(model)))
    for losses, params in runs[1:]:
        assert torch.equal(losses, runs[0][0])
        assert_same(params, runs[0][1])


def test_own_seeds_leave_the_callers_stream_alone():
    stages = split_stages(make_mlp(dropout=0.3), boundaries=[3])
    torch.manual_seed(9)
    expected = torch.rand(3)
    torch.manual_seed(9)
    simulate_dsp(stages, [sgd(s.parameters()) for s in stages], mlp_batches(), [2, 0], LOSS, seeds=[1, 2])
    assert torch.equal(torch.rand(3), expected)


def test_streaming_then_flush_equals_one_long_epoch():
    batches = mlp_batches(13)
    streamed_model, epoch_model = make_mlp(), make_mlp()
    streamed = split_stages(streamed_model, boundaries=MLP_CUTS[3])
    sim = DSPSimulator(streamed, [sgd(s.parameters()) for s in streamed], (4, 2, 0), LOSS, flush="never")
    first = sim.train(batches[:10])
    assert [len(s.pending) for s in sim.stages] == [4, 2, 0]
    second = sim.train(batches[10:])
    sim.flush()
    assert [len(s.pending) for s in sim.stages] == [0, 0, 0]
    whole = split_stages(epoch_model, boundaries=MLP_CUTS[3])
    losses = simulate_dsp(whole, [sgd(s.parameters()) for s in whole], batches, (4, 2, 0), LOSS)
    assert torch.equal(torch.cat([first, second]), losses)
    assert_same(state(streamed_model), state(epoch_model))


def test_staleness_trains_close_to_backprop():
    """Small staleness changes the trajectory, not the outcome, on an easy task."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 3, generator=gen)
    batches = []
    for _ in range(60):
        x = torch.randn(16, 6, generator=gen)
        batches.append((x, (x @ w).argmax(1)))
    final = {}
    for staleness in [(0, 0, 0), (2, 1, 0)]:
        stages = split_stages(make_mlp(), boundaries=MLP_CUTS[3])
        losses = simulate_dsp(stages, [torch.optim.SGD(s.parameters(), lr=0.05, momentum=0.9) for s in stages],
                              batches, staleness, LOSS)
        final[staleness] = losses[-20:].mean().item()
    assert final[(2, 1, 0)] < 0.5 * 1.0986  # well below chance level, ln 3
    assert abs(final[(2, 1, 0)] - final[(0, 0, 0)]) < 0.25 * final[(0, 0, 0)] + 0.05


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "staleness, message",
    [
        ((0, 1), "non-increasing"),
        ((2, 3, 0), "non-increasing"),
        ((2, 1), "must have staleness 0"),
        ((-1, 0), "int >= 0"),
        ((1.0, 0), "int >= 0"),
        ((), "empty"),
    ],
)
def test_bad_staleness_is_rejected(staleness, message):
    with pytest.raises(ValueError, match=message):
        check_staleness(staleness)


def test_bad_simulator_arguments_are_rejected_before_anything_changes():
    model = make_mlp()
    stages = split_stages(model, boundaries=[3])
    optimizers = [sgd(s.parameters()) for s in stages]
    before = state(model)
    with pytest.raises(ValueError, match="one optimizer per block"):
        simulate_dsp(stages, optimizers[:1], mlp_batches(), [1, 0], LOSS)
    with pytest.raises(ValueError, match="one staleness per block"):
        simulate_dsp(stages, optimizers, mlp_batches(), [1, 1, 0], LOSS)
    with pytest.raises(ValueError, match="non-increasing"):
        simulate_dsp(stages, optimizers, mlp_batches(), [0, 1], LOSS)
    with pytest.raises(ValueError, match="bn_policy"):
        simulate_dsp(stages, optimizers, mlp_batches(), [1, 0], LOSS, bn_policy="never")
    with pytest.raises(ValueError, match="seeds"):
        simulate_dsp(stages, optimizers, mlp_batches(), [1, 0], LOSS, seeds=[1])
    with pytest.raises(TypeError, match="loss_fn"):
        simulate_dsp(stages, optimizers, mlp_batches(), [1, 0], None)
    ragged = mlp_batches(5) + [(torch.randn(3, 6), torch.zeros(3, dtype=torch.long))]
    with pytest.raises(ValueError, match="batch 5"):
        simulate_dsp(stages, optimizers, ragged, [1, 0], LOSS)
    with pytest.raises(TypeError, match="pair"):
        simulate_dsp(stages, optimizers, [torch.randn(8, 6)], [1, 0], LOSS)
    assert_same(state(model), before)
    assert all(not o.state for o in optimizers)


# --------------------------------------------------------------------------- splitting


def test_split_sequential_shares_the_models_modules():
    model = make_mlp()
    stages = split_stages(model, boundaries=[2, 5])
    assert [len(s) for s in stages] == [2, 3, 3]
    assert stages[1][0] is model[2]
    assert [len(s) for s in split_stages(model, 4)] == [2, 2, 2, 2]
    x = torch.randn(4, 6)
    h = x
    for s in stages:
        h = s(h)
    assert torch.equal(h, model(x))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(boundaries=[0, 3]), ValueError, "increase strictly"),
        (dict(boundaries=[3, 3]), ValueError, "increase strictly"),
        (dict(boundaries=[3, 8]), ValueError, "increase strictly"),
        (dict(num_stages=9), ValueError, "non-empty"),
        (dict(num_stages=3, boundaries=[3]), ValueError, "num_stages=3"),
        (dict(), ValueError, "num_stages or boundaries"),
        (dict(boundaries=[2.5]), TypeError, "ints"),
    ],
)
def test_bad_splits_are_rejected(kwargs, error, message):
    with pytest.raises(error, match=message):
        split_stages(make_mlp(), **kwargs)


class MarkedNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 16)
        self.second = nn.Linear(16, 3)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        pipe_split()
        return self.second(x)


def test_split_at_pipe_split_markers():
    model = MarkedNet()
    x = torch.randn(4, 6)
    stages = split_stages(model, 2, example_args=(x,))
    assert len(stages) == 2
    assert torch.equal(stages[1](stages[0](x)), model(x))
    assert stages[0].first.weight.data_ptr() == model.first.weight.data_ptr()  # shared, not copied
    with pytest.raises(ValueError, match="make 2 stages"):
        split_stages(model, 3, example_args=(x,))
    with pytest.raises(TypeError, match="pipe_split"):
        split_stages(model, 2)


def test_a_tritonopt_optimizer_per_stage():
    """Any optimizer with zero_grad() and step(): here tritonopt's SparseAdaGrad (reference backend)."""
    import tritonopt
    from tritonopt.optim import SparseAdaGrad

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 3, generator=gen)
    data = []
    for _ in range(40):
        x = torch.randn(16, 6, generator=gen)
        data.append((x, (x @ w).argmax(1)))
    stages = split_stages(make_mlp(), boundaries=MLP_CUTS[2])
    optimizers = [SparseAdaGrad(s.parameters(), lr=0.05, density=0.5, block_size=64) for s in stages]
    with tritonopt.use_backend("reference"):
        losses = simulate_dsp(stages, optimizers, data, [2, 0], LOSS)
    assert losses[-10:].mean() < 0.7 * losses[:10].mean()


# --------------------------------------------------------------------------- overlapped recompute


class _Recomputations(NamedTuple):
    """Where ``module`` ran with a graph (its recomputations), one entry per run, in order."""

    threads: list[str]  # the thread's name
    streams: list  # the current CUDA stream (on CUDA only)


def _recomputations(module, device: torch.device) -> _Recomputations:
    seen = _Recomputations([], [])

    def note(mod, args, out):
        if torch.is_grad_enabled():
            seen.threads.append(threading.current_thread().name)
            if device.type == "cuda":
                seen.streams.append(torch.cuda.current_stream(device))

    module.register_forward_hook(note)
    return seen


class _Run(NamedTuple):
    losses: torch.Tensor
    state: list[torch.Tensor]  # parameters and buffers
    rng_after: torch.Tensor  # the caller's next draws: CPU, and on CUDA the device's too
    threads: list[str]
    streams: list


def _run_with(recompute, make_model, cuts, batches, staleness, device=torch.device("cpu"), **options) -> _Run:
    model = make_model().to(device)
    stages = split_stages(model, boundaries=cuts)
    seen = _recomputations(stages[0], device)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    torch.manual_seed(21)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stage falls back to serial
        losses = simulate_dsp(stages, [sgd(s.parameters()) for s in stages], batches, staleness, LOSS,
                              recompute=recompute, **options)
    rng_after = torch.rand(4)
    if device.type == "cuda":
        rng_after = torch.stack([rng_after, torch.rand(4, device=device).cpu()])
    return _Run(losses, state(model), rng_after, seen.threads, seen.streams)


def _overlap_scenario(model):
    """(make_model, cuts, batches, staleness): BatchNorm and dropout in a cnn, dropout in a 3-stage mlp."""
    return {
        "cnn": (make_cnn, [4], cnn_batches(), [3, 0]),
        "mlp": (lambda: make_mlp(dropout=0.3), MLP_CUTS[3], mlp_batches(), [4, 2, 0]),
    }[model]


@pytest.mark.parametrize("bn_policy", ["forward", "recompute"])
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_overlapped_recompute_equals_serial_bit_for_bit(model, bn_policy):
    """Dropout masks, running statistics, weights and the caller's RNG stream: the same bits."""
    make, cuts, batches, staleness = _overlap_scenario(model)
    serial = _run_with("serial", make, cuts, batches, staleness, bn_policy=bn_policy)
    overlap = _run_with("overlap", make, cuts, batches, staleness, bn_policy=bn_policy)
    assert torch.equal(serial[0], overlap[0])
    assert_same(serial[1], overlap[1])  # parameters and buffers
    assert torch.equal(serial[2], overlap[2])  # the caller's stream continues alike
    # Every recomputation but the drain's (no forward left to overlap) ran in a worker thread.
    assert set(serial[3]) == {"MainThread"}
    workers = [name for name in overlap[3] if name != "MainThread"]
    assert len(workers) == len(batches) - staleness[0] and len(overlap[3]) == len(batches)
    assert not [t for t in threading.enumerate() if t.name.startswith("tritonopt-dsp-recompute")]


@contextlib.contextmanager
def _deterministic_cudnn():
    """cuDNN's default convolution backward may use atomics: then two serial runs differ already."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


@pytest.mark.gpu
@pytest.mark.parametrize("bn_policy", ["forward", "recompute"])
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_overlapped_recompute_on_cuda_runs_on_a_side_stream_and_equals_serial_bit_for_bit(model, bn_policy):
    """On CUDA the overlap is a side stream driven by the stage's own thread, with the serial bits.

    The model, batches and error gradients live on the GPU; the caller's CPU and CUDA RNG
    streams must continue alike. A second serial run first shows that the kernels themselves
    repeat bit for bit, so a difference is the overlap's.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    caller_stream = torch.cuda.current_stream(device)
    make, cuts, batches, staleness = _overlap_scenario(model)
    with _deterministic_cudnn():
        serial, serial_again, overlap = (
            _run_with(mode, make, cuts, batches, staleness, device=device, bn_policy=bn_policy)
            for mode in ("serial", "serial", "overlap")
        )
    assert overlap.losses.device == device and overlap.state[0].device == device
    assert torch.equal(serial.losses, serial_again.losses), "two serial runs differ: the kernels do not repeat"
    assert_same(serial.state, serial_again.state)
    assert torch.equal(serial.losses, overlap.losses)
    assert_same(serial.state, overlap.state)  # parameters and buffers
    assert torch.equal(serial.rng_after, overlap.rng_after)  # the caller's CPU and CUDA streams continue alike
    # No worker thread: the stage's thread queues the recomputation on one side stream, except
    # the drain's (no forward left to overlap), which runs serially on the caller's stream.
    assert set(serial.threads) == set(overlap.threads) == {"MainThread"}
    assert not [t for t in threading.enumerate() if t.name.startswith("tritonopt-dsp-recompute")]
    assert set(serial.streams) == {caller_stream} and len(serial.streams) == len(batches)
    side_streams = [stream for stream in overlap.streams if stream != caller_stream]
    assert len(side_streams) == len(batches) - staleness[0] and len(overlap.streams) == len(batches)
    assert len(set(side_streams)) == 1
    assert torch.cuda.current_stream(device) == caller_stream


def test_overlapped_recompute_with_own_seeds_streaming_and_any_interleaving():
    batches = mlp_batches(13)
    runs = []
    for recompute, interleaving in (("serial", None), ("overlap", None), ("overlap", 3)):
        model = make_mlp(dropout=0.3)
        stages = split_stages(model, boundaries=MLP_CUTS[3])
        sim = DSPSimulator(stages, [sgd(s.parameters()) for s in stages], (4, 2, 0), LOSS, seeds=[5, 6, 7],
                           flush="never", recompute=recompute)
        losses = [sim.train(batches[:9], interleaving_seed=interleaving), sim.train(batches[9:])]
        sim.flush()
        runs.append((torch.cat(losses), state(model)))
    for losses, params in runs[1:]:
        assert torch.equal(losses, runs[0][0])
        assert_same(params, runs[0][1])


@pytest.mark.parametrize("cache_enabled", [False, True])
def test_overlapped_recompute_keeps_the_callers_autocast_and_grad_mode(cache_enabled):
    """Grad mode and autocast are per thread: the worker builds its graph under the caller's.

    Autocast's weight cache is per thread too, and may hold casts from before the last
    updates: with it enabled the stage recomputes serially, and says so.
    """
    dtypes = []
    results = {}
    for recompute in ("serial", "overlap"):
        stages = split_stages(make_mlp(), boundaries=MLP_CUTS[2])
        stages[0].register_forward_hook(
            lambda mod, args, out: dtypes.append((recompute, threading.current_thread().name, out.dtype))
            if out.requires_grad else None
        )
        with warnings.catch_warnings(record=True) as caught, torch.autocast(
            "cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled
        ):
            warnings.simplefilter("always")
            losses = simulate_dsp(stages, [sgd(s.parameters()) for s in stages], mlp_batches(), [2, 0], LOSS,
                                  recompute=recompute)
        results[recompute] = (losses, [p.detach().clone() for s in stages for p in s.parameters()],
                              [str(w.message) for w in caught if "recomputes serially" in str(w.message)])
    assert {dtype for _, _, dtype in dtypes} == {torch.bfloat16}
    in_workers = [name for mode, name, _ in dtypes if mode == "overlap" and name != "MainThread"]
    assert len(in_workers) == (0 if cache_enabled else len(mlp_batches()) - 2)
    assert len(results["overlap"][2]) == (1 if cache_enabled else 0)
    assert torch.equal(results["serial"][0], results["overlap"][0])
    assert_same(results["serial"][1], results["overlap"][1])


class RandomNoise(nn.Module):
    """Adds noise drawn by ``draw`` (a tensor-shaped RNG call) in training mode."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw

    def forward(self, x):
        return x + 0.1 * self.draw(x) if self.training else x


class RunningShift(nn.Module):
    """A buffer its forward both reads and writes: the recomputation must see the forward's update."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.zeros(()))

    def forward(self, x):
        if not torch.is_grad_enabled():
            self.shift += 0.5
        return x + self.shift


@pytest.mark.parametrize(
    "layer, falls_back",
    [
        (lambda: RandomNoise(lambda x: torch.rand(x.shape)), False),  # rand.default -> rand.generator
        (lambda: RandomNoise(lambda x: torch.empty_like(x).normal_()), False),
        (lambda: RandomNoise(torch.rand_like), False),  # rand_like.default -> rand_like.generator
        (lambda: RandomNoise(lambda x: torch.native_dropout(x, 0.5, True)[0]), True),  # no generator: serial
        (RunningShift, True),
    ],
    ids=["rand", "normal_", "rand_like", "native_dropout", "buffer_read_after_write"],
)
def test_overlap_equals_serial_or_falls_back_to_serial(layer, falls_back):
    results = {}
    for recompute in ("serial", "overlap"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), layer(), nn.Tanh(), nn.Linear(16, 3))
        stages = split_stages(model, boundaries=[3])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(4)
            losses = simulate_dsp(stages, [sgd(s.parameters()) for s in stages], mlp_batches(), [3, 0], LOSS,
                                  recompute=recompute)
        results[recompute] = (losses, state(model), [str(w.message) for w in caught])
    assert torch.equal(results["serial"][0], results["overlap"][0])
    assert_same(results["serial"][1], results["overlap"][1])
    fell_back = [m for m in results["overlap"][2] if "recomputes serially" in m]
    assert len(fell_back) == (1 if falls_back else 0), results["overlap"][2]


class FailsWithGraph(nn.Module):
    """Forwards fine without a graph; its recomputations (with one) raise from batch ``bad`` on."""

    def __init__(self, bad: int):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.recomputations, self.bad = itertools.count(), bad  # shared with the shadow copies

    def forward(self, x):
        if torch.is_grad_enabled() and next(self.recomputations) >= self.bad:
            raise ValueError("the block cannot take this input")
        return self.linear(x)


def test_an_error_in_the_overlapped_recompute_reaches_the_caller_and_leaves_no_thread():
    stages = [FailsWithGraph(bad=2), nn.Linear(6, 3)]
    optimizers = [sgd(s.parameters()) for s in stages]
    with pytest.raises(RuntimeError, match=r"overlapped recomputation of batch 2 failed in its worker thread: "
                                           r"ValueError: the block cannot take this input") as info:
        simulate_dsp(stages, optimizers, mlp_batches(), [2, 0], LOSS, recompute="overlap")
    assert isinstance(info.value.__cause__, ValueError)
    assert not [t for t in threading.enumerate() if t.name.startswith("tritonopt-dsp-recompute")]


def test_an_error_in_the_forward_waits_for_the_running_recompute():
    class FailsAtBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.forwards = nn.Linear(6, 6), 0

        def forward(self, x):
            if not torch.is_grad_enabled():
                self.forwards += 1
                if self.forwards == 5:
                    raise ValueError("bad batch")
            return self.linear(x)

    stages = [FailsAtBatch(), nn.Linear(6, 3)]
    with pytest.raises(ValueError, match="bad batch"):
        simulate_dsp(stages, [sgd(s.parameters()) for s in stages], mlp_batches(), [2, 0], LOSS, recompute="overlap")
    assert not [t for t in threading.enumerate() if t.name.startswith("tritonopt-dsp-recompute")]


def test_a_bad_recompute_mode_is_rejected_before_anything_changes():
    model = make_mlp()
    stages = split_stages(model, boundaries=[3])
    optimizers = [sgd(s.parameters()) for s in stages]
    before = state(model)
    with pytest.raises(ValueError, match=r"recompute must be one of \('serial', 'overlap'\), got 'parallel'"):
        simulate_dsp(stages, optimizers, mlp_batches(), [1, 0], LOSS, recompute="parallel")
    with pytest.raises(ValueError, match="recompute must be one of"):
        StageCompute(stages[0], optimizers[0], 1, is_first=True, is_last=False, recompute=None)
    assert_same(state(model), before)
    assert all(not o.state for o in optimizers)


@pytest.mark.parametrize("bad", ["bn_policy", "flush"])
def test_a_bad_bn_policy_or_flush_is_named_and_rejected_before_anything_changes(bad):
    model = make_mlp()
    stages = split_stages(model, boundaries=[3])
    optimizers = [sgd(s.parameters()) for s in stages]
    before = state(model)
    choices = {"bn_policy": "('forward', 'recompute')", "flush": "('epoch', 'never')"}[bad]
    with pytest.raises(ValueError, match=re.escape(f"{bad} must be one of {choices}, got 'sometimes'")):
        simulate_dsp(stages, optimizers, mlp_batches(), [1, 0], LOSS, **{bad: "sometimes"})
    if bad == "bn_policy":
        with pytest.raises(ValueError, match="bn_policy must be one of"):
            StageCompute(stages[0], optimizers[0], 1, is_first=True, is_last=False, bn_policy="sometimes")
    assert_same(state(model), before)
    assert all(not o.state for o in optimizers)


def test_the_first_bad_mode_is_the_one_named():
    with pytest.raises(ValueError, match="^bn_policy must"):
        check_modes(bn_policy="x", recompute="y", flush="z")
    with pytest.raises(ValueError, match="^recompute must"):
        check_modes(bn_policy="forward", recompute="y", flush="z")
    check_modes(bn_policy="recompute", recompute="overlap", flush="never")
    with pytest.raises(TypeError, match="unknown mode 'staleness'"):
        check_modes(staleness=1)


def test_a_recomputation_on_the_side_stream_is_waited_for_when_it_is_dropped_too(monkeypatch):
    # On CUDA the recomputation's shadow buffers and output live on memory the caller's stream
    # allocated: every exit of take() and discard() must order the caller's stream after the
    # side stream, or the allocator could reuse that memory while the side stream writes it.
    # Here a stand-in stream records the waits (the CUDA run is in the gpu-marked test above).
    from tritonopt.dist.dsp_overlap import OverlappedRecompute, _Prefetch

    waited = []

    class Stream:
        def wait_event(self, event):
            waited.append(event)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    module = nn.Linear(2, 2)
    overlap = OverlappedRecompute(module, "forward", needs_input_grad=True, replay_rng=None)
    exits = {
        "another batch": lambda: overlap.take(4),
        "the weights moved": lambda: overlap.take(3),  # versions recorded as [] never match
        "discarded": overlap.discard,
    }
    for reason, leave in exits.items():
        done = object()
        overlap._running = _Prefetch(3, module, [], None, cuda_done=done, output=torch.zeros(1))
        assert leave() is None, reason
        assert waited and waited[-1] is done, reason
        waited.clear()
