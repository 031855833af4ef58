"""KAISA on 4 gloo ranks (one spawn for the module) and its pure-Python assignment logic."""

import copy
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from _distributed import run_on_ranks
from torch import nn

import tritonopt
from tritonopt.dist.kaisa import (
    KAISAAssignment,
    KAISAPreconditioner,
    Strategy,
    expected_bytes_per_rank,
    expected_memory_per_rank,
    resolve_grad_worker_fraction,
    valid_grad_worker_fractions,
)
from tritonopt.optim.kfac import KFACPreconditioner

WORLD = 4
GLOBAL_BATCH = 16
STEPS = 6
FACTOR_STEPS, INV_STEPS = 2, 4  # cached factors and eigen data are exercised
KFAC_ARGS = dict(
    factor_update_steps=FACTOR_STEPS, inv_update_steps=INV_STEPS, damping=0.03,
    kl_clip=0.01, lr=0.1, g_batch_scale=True,
)
SCENARIOS = [  # (name, grad_worker_fraction, extra KAISA arguments)
    ("mem", 0.25, {}),
    ("hybrid", 0.5, {}),
    ("hybrid_strided", 0.5, {"layout": "strided"}),
    ("comm", 1.0, {}),
    ("hybrid_triangle", 0.5, {"symmetry_aware": True}),
    ("hybrid_no_prediv", 0.5, {"prediv": False}),
    ("mem_triangle_fp16", 0.25, {"symmetry_aware": True, "factor_comm_dtype": torch.float16}),
    ("hybrid_per_factor", 0.5, {"colocate_factors": False}),
    ("mem_inverse", 0.25, {"compute_method": "inverse"}),
    ("hybrid_inverse_per_factor", 0.5, {"compute_method": "inverse", "colocate_factors": False}),
    ("hybrid_sync", 0.5, {"bucket_cap_mb": None}),
    ("hybrid_small_buckets", 0.5, {"bucket_cap_mb": 0.0}),
    ("mem_bf16", 0.25, {"factor_dtype": torch.bfloat16, "inv_dtype": torch.bfloat16}),
]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, bias=False), nn.ReLU(), nn.Flatten(),
        nn.Linear(6 * 3 * 3, 12), nn.ReLU(), nn.Linear(12, 5),
    )


def make_data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, GLOBAL_BATCH, 1, 8, 8, generator=gen)
    y = torch.randint(0, 5, (STEPS, GLOBAL_BATCH), generator=gen)
    return x, y


def train(model, precond, optimizer, x, y, steps, shard=None, average_grads=False, started=None):
    for t in steps:
        xb, yb = x[t], y[t]
        if shard is not None:
            xb, yb = xb[shard], yb[shard]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        if started is not None and getattr(precond, "reducer", None) is not None:
            started.append(precond.reducer.started_buckets)  # buckets under way before step()
        if average_grads:  # what DDP does during backward
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
        precond.step()
        optimizer.step()


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def scenarios(rank, world):
    tritonopt_backend = tritonopt.use_backend("reference")  # the kernels are tested elsewhere
    tritonopt_backend.__enter__()
    x, y = make_data()
    per_rank = GLOBAL_BATCH // world
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    out = {}
    for name, fraction, extra in SCENARIOS:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        precond = KAISAPreconditioner(model, grad_worker_fraction=fraction, **{**KFAC_ARGS, **extra})
        started = []
        train(model, precond, optimizer, x, y, range(STEPS), shard, average_grads=True, started=started)
        out[name] = {
            "started_before_step": started,
            "buckets": len(precond.reducer.buckets),
            "params": flat_params(model),
            "stats": {k: vars(v) for k, v in precond.communicator.stats().items()},
            "memory": precond.memory_usage(),
            "expected_memory": precond.expected_memory(),
            "dims": precond.layer_dims,
            "inv_worker": list(precond.assignment.inv_worker),
            "strategy": precond.strategy,
            "symmetric": all(
                torch.equal(f, f.T) for l in precond.layers for f in (l.a_factor, l.g_factor)
            ),
        }

    # Checkpoint mid-run: a resumed run equals the uninterrupted one, bit for bit.
    for include_eigen in (True, False):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        precond = KAISAPreconditioner(model, grad_worker_fraction=0.5, **KFAC_ARGS)
        train(model, precond, optimizer, x, y, range(2), shard, average_grads=True)
        saved = (
            {k: v.clone() for k, v in model.state_dict().items()},
            copy.deepcopy(optimizer.state_dict()),  # its buffers are live references
            precond.state_dict(include_eigen=include_eigen),
        )
        # The usual checkpoint pattern: rank 0 saves, every rank loads rank 0's file.
        # (A copy: loading an optimizer state dict aliases its tensors.)
        shared = [copy.deepcopy(saved) if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        train(model, precond, optimizer, x, y, range(2, STEPS), shard, average_grads=True)
        resumed_model = make_model()
        resumed_model.load_state_dict(saved[0])
        resumed_opt = torch.optim.SGD(resumed_model.parameters(), lr=0.1, momentum=0.9)
        resumed_opt.load_state_dict(saved[1])
        resumed = KAISAPreconditioner(resumed_model, grad_worker_fraction=0.5, **KFAC_ARGS)
        resumed.load_state_dict(saved[2])
        train(resumed_model, resumed, resumed_opt, x, y, range(2, STEPS), shard, average_grads=True)
        out[f"resume_{include_eigen}"] = (flat_params(model), flat_params(resumed_model))
        if include_eigen:
            # Eigen data are per rank (HYBRID-OPT: rank 0 holds only its worker group's).
            from_rank0 = make_model()
            from_rank0.load_state_dict(shared[0][0])
            from_rank0_opt = torch.optim.SGD(from_rank0.parameters(), lr=0.1, momentum=0.9)
            from_rank0_opt.load_state_dict(shared[0][1])
            from_rank0_precond = KAISAPreconditioner(from_rank0, grad_worker_fraction=0.5, **KFAC_ARGS)
            from_rank0_precond.load_state_dict(shared[0][2])
            train(from_rank0, from_rank0_precond, from_rank0_opt, x, y, range(2, STEPS), shard,
                  average_grads=True)
            out["resume_from_rank0"] = (flat_params(model), flat_params(from_rank0))

    try:
        KAISAPreconditioner(make_model(), grad_worker_fraction=0.3)
    except ValueError as exc:
        out["bad_fraction"] = str(exc)

    # Ranks that disagree: every rank raises at construction, naming what differs.
    disagreements = {
        "damping": lambda: KAISAPreconditioner(make_model(), damping=0.01 if rank == 3 else 0.03),
        "grad_worker_fraction": lambda: KAISAPreconditioner(make_model(), grad_worker_fraction=0.5 if rank == 1 else 1.0),
        "layers": lambda: KAISAPreconditioner(make_model() if rank != 2 else nn.Sequential(nn.Linear(3, 4))),
        "weights": lambda: KAISAPreconditioner(make_model() if rank != 1 else nn.Sequential(*make_model()).apply(
            lambda m: nn.init.zeros_(m.weight) if isinstance(m, nn.Linear) else None)),
    }
    out["disagreements"] = {}
    for field, build in disagreements.items():
        try:
            build()
            out["disagreements"][field] = None
        except ValueError as exc:
            out["disagreements"][field] = str(exc)

    # More passes per step than accumulation_steps: a clear error on every rank.
    model = make_model()
    precond = KAISAPreconditioner(model, **KFAC_ARGS)
    for half in (slice(0, 2), slice(2, 4)):
        nn.functional.cross_entropy(model(x[0][shard][half]), y[0][shard][half]).backward()
    try:
        precond.step()
        out["too_many_passes"] = None
    except ValueError as exc:
        out["too_many_passes"] = str(exc)

    # The single-process preconditioner refuses a multi-rank world.
    try:
        KFACPreconditioner(make_model())
        out["kfac_refused"] = None
    except RuntimeError as exc:
        out["kfac_refused"] = str(exc)
    KFACPreconditioner(make_model(), independent_ranks=True)
    tritonopt_backend.__exit__(None, None, None)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, scenarios, timeout=300)


@pytest.fixture(scope="module")
def single_process():
    """The same training on the global batch in one process, per compute method."""
    x, y = make_data()
    out = {}
    with tritonopt.use_backend("reference"):
        for method in ("eigen", "inverse"):
            model = make_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            precond = KFACPreconditioner(model, compute_method=method, **KFAC_ARGS)
            train(model, precond, optimizer, x, y, range(STEPS))
            out[method] = flat_params(model)
    return out


def test_every_rank_holds_the_same_parameters(results):
    for name, _, _ in SCENARIOS:
        for rank in range(1, WORLD):
            assert torch.equal(results[rank][name]["params"], results[0][name]["params"]), (name, rank)


def test_factors_stay_symmetric_to_the_last_bit(results):
    for rank in range(WORLD):
        for name, _, _ in SCENARIOS:
            assert results[rank][name]["symmetric"], (name, rank)


def test_every_fraction_gives_the_same_parameters(results):
    # Same arithmetic on every path: eigen data and preconditioned gradients are moved, not recomputed.
    reference = results[0]["comm"]["params"]
    for name in ("mem", "hybrid", "hybrid_strided", "hybrid_per_factor", "hybrid_sync"):
        assert torch.equal(results[0][name]["params"], reference), name
    assert torch.equal(results[0]["mem_inverse"]["params"], results[0]["hybrid_inverse_per_factor"]["params"])


def test_factor_all_reduce_overlaps_backward_in_buckets(results):
    factor_steps = len(range(0, STEPS, FACTOR_STEPS))
    layers = len(results[0]["hybrid"]["dims"])
    for rank in range(WORLD):
        one, many, sync = (results[rank][n] for n in ("hybrid", "hybrid_small_buckets", "hybrid_sync"))
        # Started from the backward hooks: on factor steps every bucket is under way before step().
        assert one["started_before_step"] == [1, 0] * (STEPS // 2)
        assert many["buckets"] == layers
        assert many["started_before_step"] == [layers, 0] * (STEPS // 2)
        assert sync["started_before_step"] == [0] * STEPS
        calls = {n: results[rank][n]["stats"]["factor_allreduce"]["calls"] for n in ("hybrid", "hybrid_small_buckets", "hybrid_sync")}
        assert calls == {"hybrid": factor_steps, "hybrid_small_buckets": layers * factor_steps, "hybrid_sync": factor_steps}
        bytes_moved = {results[rank][n]["stats"]["factor_allreduce"]["bytes_sent"] for n in ("hybrid", "hybrid_small_buckets", "hybrid_sync")}
        assert len(bytes_moved) == 1
    # One bucket per layer sums each element over the ranks as one buffer does: the same bits
    # here; at most a reordering of a 4-term float32 sum in general.
    diff = (results[0]["hybrid_small_buckets"]["params"] - results[0]["hybrid"]["params"]).abs().max()
    assert diff <= 2e-5 * results[0]["hybrid"]["params"].abs().max()


def test_narrow_storage_stays_close(results):
    # bf16 factors and eigen data: relative errors of a few 1e-3 per step (test_kfac_precision).
    wide, narrow = results[0]["mem"]["params"], results[0]["mem_bf16"]["params"]
    assert 0 < (narrow - wide).abs().max() <= 0.05 * wide.abs().max()
    for rank in range(WORLD):
        assert results[rank]["mem_bf16"]["memory"] == results[rank]["mem_bf16"]["expected_memory"]
        assert results[rank]["mem_bf16"]["memory"]["factors"] * 2 == results[rank]["mem"]["memory"]["factors"]


def test_disagreeing_ranks_fail_at_construction_naming_the_difference(results):
    for rank in range(WORLD):
        for field, message in results[rank]["disagreements"].items():
            assert message is not None, (rank, field)
            assert "configured differently" in message and f"{field}: rank 0:" in message, (rank, field, message)
        assert "damping: rank 0: 0.03, rank 1: 0.03, rank 2: 0.03, rank 3: 0.01" in results[rank]["disagreements"]["damping"]


def test_too_many_passes_and_a_multi_rank_kfac_are_clear_errors(results):
    for rank in range(WORLD):
        assert "accumulation_steps" in results[rank]["too_many_passes"]
        assert "KAISAPreconditioner" in results[rank]["kfac_refused"]


def test_distributed_run_equals_the_single_process_global_batch(results, single_process):
    # g_batch_scale makes G independent of the batch size; the remaining difference is
    # summation order (per-rank means, then a mean over ranks).
    for name, _, extra in SCENARIOS:
        if name == "mem_bf16":
            continue  # bf16 storage: see test_narrow_storage_stays_close
        reference = single_process[extra.get("compute_method", "eigen")]
        diff = (results[0][name]["params"] - reference).abs().max()
        assert diff <= 2e-5 * reference.abs().max(), (name, float(diff))


def test_triangle_communication_changes_nothing_but_the_bytes(results):
    assert torch.allclose(
        results[0]["hybrid_triangle"]["params"], results[0]["hybrid"]["params"], rtol=0, atol=1e-6
    )
    # Half-precision factor communication: close, not equal (about 1e-3 relative per factor).
    diff = (results[0]["mem_triangle_fp16"]["params"] - results[0]["mem"]["params"]).abs().max()
    assert 0 < diff <= 1e-2


def test_strategies_and_their_collectives(results):
    for rank in range(WORLD):
        assert results[rank]["mem"]["strategy"] is Strategy.MEM_OPT
        assert results[rank]["comm"]["strategy"] is Strategy.COMM_OPT
        assert results[rank]["hybrid"]["strategy"] is Strategy.HYBRID_OPT
        assert "eigen_broadcast" not in results[rank]["mem"]["stats"]
        assert "grad_broadcast" not in results[rank]["comm"]["stats"]


@pytest.mark.parametrize("name,fraction,extra", SCENARIOS)
def test_bytes_match_the_formulas(results, name, fraction, extra):
    factor_steps = len(range(0, STEPS, FACTOR_STEPS))
    eigen_steps = len(range(0, STEPS, INV_STEPS))
    for rank in range(WORLD):
        out = results[rank][name]
        gw = round(fraction * WORLD)
        costs = [(a**3, g**3) for a, g in out["dims"]]
        assignment = KAISAAssignment(costs, WORLD, gw, extra.get("layout", "paper"),
                                     colocate_factors=extra.get("colocate_factors", True))
        assert assignment.inv_worker == out["inv_worker"]
        factor_dtype = extra.get("factor_dtype", torch.float32)
        expected = expected_bytes_per_rank(
            out["dims"], assignment, rank, factor_steps=factor_steps, eigen_steps=eigen_steps,
            steps=STEPS, prediv=extra.get("prediv", True), compute_method=extra.get("compute_method", "eigen"),
            symmetry_aware=extra.get("symmetry_aware", False),
            factor_element_size=extra.get("factor_comm_dtype", factor_dtype).itemsize,
            eigen_element_size=extra.get("inv_dtype", torch.float32).itemsize,
        )
        for label, counts in expected.items():
            measured = out["stats"].get(label, {"bytes_sent": 0, "bytes_received": 0})
            assert measured["bytes_sent"] == counts["sent"], (label, rank)
            assert measured["bytes_received"] == counts["received"], (label, rank)


def test_memory_report_matches_the_formula_for_every_scenario(results):
    for name, _, _ in SCENARIOS:
        for rank in range(WORLD):
            assert results[rank][name]["memory"] == results[rank][name]["expected_memory"], (name, rank)


def test_memory_report_matches_the_formula_and_is_linear_in_the_fraction(results):
    mean_eigen = {}
    for name, fraction in (("mem", 0.25), ("hybrid", 0.5), ("comm", 1.0)):
        for rank in range(WORLD):
            assert results[rank][name]["memory"] == results[rank][name]["expected_memory"], (name, rank)
        mean_eigen[fraction] = sum(results[r][name]["memory"]["eigen"] for r in range(WORLD)) / WORLD
        factors = {results[r][name]["memory"]["factors"] for r in range(WORLD)}
        assert len(factors) == 1, "every rank holds all factors"
    dims = results[0]["comm"]["dims"]
    total_eigen = 4 * sum(a * a + g * g + a * g for a, g in dims)
    for fraction, value in mean_eigen.items():
        assert value == pytest.approx(fraction * total_eigen, rel=1e-12)


def test_resume_equals_uninterrupted_run(results):
    for rank in range(WORLD):
        uninterrupted, resumed = results[rank]["resume_True"]
        assert torch.equal(uninterrupted, resumed)
        # Without eigen data the resumed run recomputes them from the saved factors. The
        # save point (after steps 0 and 1) has factors last changed at step 0, the last
        # eigen step, so the recomputed eigen data, and the run, are the same bits.
        uninterrupted, resumed = results[rank]["resume_False"]
        assert torch.equal(uninterrupted, resumed)


def test_resume_from_another_ranks_state_dict_equals_uninterrupted_run(results):
    # Rank 0's state dict lacks the eigen data of the layers ranks 2 and 3 work on;
    # loading it everywhere must recompute them rather than skip preconditioning.
    for rank in range(WORLD):
        uninterrupted, resumed = results[rank]["resume_from_rank0"]
        assert torch.equal(uninterrupted, resumed), rank


def test_invalid_fraction_lists_the_valid_ones(results):
    message = results[0]["bad_fraction"]
    assert "grad_worker_fraction" in message and "1/4, 1/2, 1" in message


# --------------------------------------------------------------------------- pure Python


def test_partition_grids():
    strided = KAISAAssignment([1.0], 16, 4, "strided")
    assert strided.worker_groups[0] == (0, 4, 8, 12)
    assert strided.receiver_groups[0] == (0, 1, 2, 3)
    paper = KAISAAssignment([1.0], 8, 4, "paper")  # the paper's Fig. 4
    assert paper.worker_groups == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert (0, 4) in paper.receiver_groups
    mem = KAISAAssignment([1.0], 8, 1, "paper")
    assert mem.worker_groups == [(r,) for r in range(8)]
    assert mem.receiver_groups == [tuple(range(8))]
    for layout in ("paper", "strided"):
        a = KAISAAssignment([1.0], 8, 2, layout)
        for w in a.worker_groups:
            for r in a.receiver_groups:
                assert len(set(w) & set(r)) == 1


def test_fraction_resolution():
    assert resolve_grad_worker_fraction(0, 4) == (0.25, 1)
    assert resolve_grad_worker_fraction(Strategy.COMM_OPT, 8) == (1.0, 8)
    assert resolve_grad_worker_fraction(Strategy.HYBRID_OPT, 8) == (0.5, 4)
    assert resolve_grad_worker_fraction(Strategy.MEM_OPT, 8) == (0.125, 1)
    assert valid_grad_worker_fractions(4) == [Fraction(1, 4), Fraction(1, 2), Fraction(1)]
    for bad in (0.33, 1.5, -0.25, 0.375):
        with pytest.raises(ValueError, match="grad_worker_fraction"):
            resolve_grad_worker_fraction(bad, 8)
    with pytest.raises(ValueError, match="1/6, 1/3, 1/2, 1"):
        resolve_grad_worker_fraction(0.25, 6)
    with pytest.raises(TypeError, match="grad_worker_fraction"):
        resolve_grad_worker_fraction("half", 4)


def test_longest_job_first_assignment():
    costs = [5.0, 9.0, 1.0, 7.0, 3.0, 2.0, 8.0]
    a = KAISAAssignment(costs, 4, 2, "paper")
    assert sorted(set(range(4)) | set(a.inv_worker)) == [0, 1, 2, 3]
    assert a.inv_worker == KAISAAssignment(costs, 4, 2, "paper").inv_worker  # deterministic
    assert max(a.loads) <= 1.5 * max(sum(costs) / 4, max(costs))
    for layer in range(len(costs)):
        assert a.inv_worker[layer] in a.workers(layer)
        for rank in range(4):
            src = a.src(layer, rank)
            assert src in a.workers(layer) and src in a.receiver_group_of(rank)
            if a.is_grad_worker(layer, rank):
                assert src == rank
    # MEM-OPT: singleton worker groups, the biggest job alone on one rank.
    mem = KAISAAssignment([10.0, 1.0, 1.0, 1.0, 1.0], 4, 1)
    assert mem.inv_worker[0] not in mem.inv_worker[1:]
    assert mem.broadcast_gradients() and not mem.broadcast_inverses()
    comm = KAISAAssignment(costs, 4, 4)
    assert comm.broadcast_inverses() and not comm.broadcast_gradients()


def test_formulas_on_a_hand_example():
    dims = [(3, 2), (5, 4)]
    a = KAISAAssignment([3**3 + 2**3, 5**3 + 4**3], 2, 1)  # MEM-OPT on 2 ranks: one layer each
    assert a.inv_worker == [1, 0]
    mem0 = expected_memory_per_rank(dims, a, 0)
    assert mem0["factors"] == 4 * (9 + 4 + 25 + 16)
    assert mem0["eigen"] == 4 * (25 + 16 + 20)
    b = expected_bytes_per_rank(dims, a, 0, factor_steps=1, eigen_steps=1, steps=3)
    assert b["grad_broadcast"] == {"sent": 4 * 20 * 3, "received": 4 * 6 * 3}
    assert b["eigen_broadcast"] == {"sent": 0, "received": 0}
    tri = expected_bytes_per_rank(dims, a, 0, factor_steps=2, eigen_steps=1, steps=3, symmetry_aware=True)
    assert tri["factor_allreduce"]["sent"] == 2 * 4 * (6 + 3 + 15 + 10 + 2)  # + one count per layer


def test_runs_in_one_process_without_torch_distributed():
    with tritonopt.use_backend("reference"):
        kaisa = KAISAPreconditioner(make_model(), grad_worker_fraction=Strategy.MEM_OPT)
        assert (kaisa.world_size, kaisa.rank, kaisa.strategy) == (1, 0, Strategy.COMM_OPT)
        x, y = make_data()
        nn.functional.cross_entropy(kaisa.model(x[0]), y[0]).backward()
        assert kaisa.step() is True
        assert kaisa.communicator.stats() == {}
