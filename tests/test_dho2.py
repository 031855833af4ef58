"""DHO2 against single-process FOSI, MR-DHO2's final update against its formula, and the start-up
checks of both (gloo, one spawn of 4 ranks)."""

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
from _distributed import run_on_ranks

import tritonopt
from tritonopt.dist._collective_guard import group_timeout
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist.dho2 import DHO2, MRDHO2, final_update_reference
from tritonopt.optim.fosi import FOSI

WORLD = 4
STEPS = 24
FOSI_KW = dict(lr=3e-3, k=4, l=0, alpha=0.1, warmup_steps=4, curvature_update_every=8, num_lanczos_iters=16)
# The reference code's options, parameter groups and a scheduler: three ESEs (before updates 7, 15, 23).
FEATURES_KW = dict(base="heavy_ball", k=4, l=1, alpha=0.1, g1_momentum=0.9, learning_rate_clip=3.0,
                   warmup_steps=None, curvature_update_every=8, num_lanczos_iters=20)


def problem(dtype=torch.float32, hidden=16):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4)).to(dtype)
    x = torch.randn(64, 8, generator=gen, dtype=dtype)
    y = torch.randint(0, 4, (64,), generator=gen)
    return model, x, y


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def feature_groups(model):
    params = list(model.parameters())
    return [{"params": params[:2], "lr": 2e-2, "weight_decay": 0.05}, {"params": params[2:], "lr": 1e-2}]


def feature_scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.97 ** t)


def train(model, opt, loss, steps, scheduler=None):
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def run_dho2(rank, size, group, variant, *, dtype=torch.float32, features=False):
    model, x, y = problem(dtype)
    ese = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731  (same ESE batch everywhere)
    comm = CountingCommunicator(group)
    if features:
        opt = DHO2(feature_groups(model), variant=variant, comm=comm, group=group, curvature_loss_fn=ese,
                   timeout=60, **FEATURES_KW)
        scheduler = feature_scheduler(opt)
    else:
        opt = DHO2(model.parameters(), variant=variant, comm=comm, group=group, curvature_loss_fn=ese, **FOSI_KW)
        scheduler = None
    xs, ys = x[rank::size], y[rank::size]
    train(model, opt, lambda: torch.nn.functional.cross_entropy(model(xs), ys), STEPS, scheduler)
    out = {"w": flat(model), "stats": {k: vars(v) for k, v in comm.stats().items()},
           "memory": opt.memory, "rows": opt.eigenvalues.numel(), "ese_count": opt.ese_count,
           "timeout": group_timeout(opt.group).total_seconds()}
    if variant == "fused" and dtype == torch.float32 and not features:
        # Checkpoints are per rank: a rank's own state loads, rank 0's on every rank is refused.
        own = copy.deepcopy(opt.state_dict())  # state_dict() returns live buffers
        opt.load_state_dict(own)
        # This rank's rows of V as held (the state dict pads them with zero rows to k + l).
        out["own_vectors"] = torch.cat([s["eigenvectors"].reshape(-1) for s in opt.state.values()]).clone()
        shared = [own if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0, group=group)
        out["foreign_load"] = load_error(opt, shared[0])
        out["after_foreign_load"] = torch.cat([s["eigenvectors"].reshape(-1) for s in opt.state.values()])
        # A state dict that is malformed on rank 1 only: every rank refuses, nothing changes.
        tampered = copy.deepcopy(own)
        if rank == 1:
            del tampered["fosi"]["base_step"]
        out["tampered_load"] = load_error(opt, tampered)
        out["after_tampered_load"] = flat(model), opt.base_step
    return out


def load_error(opt, state_dict):
    try:
        opt.load_state_dict(state_dict)
        return None
    except ValueError as exc:
        return str(exc)


def construction_error(build):
    try:
        build()
        return None
    except ValueError as exc:
        return str(exc)


def mismatches(rank, pair):
    """DHO2 on the pair, each time with one setting that rank 1 sets differently."""
    out = {}
    cases = {
        "lr": dict(lr=2e-3),
        "seed": dict(seed=1),
        "num_lanczos_iters": dict(num_lanczos_iters=12),
        "data_parallel_hvp": dict(data_parallel_hvp=True),
        "model": dict(hidden=17),
    }
    for name, differs in cases.items():
        mine = differs if rank == 1 else {}
        kwargs = {**FOSI_KW, **{k: v for k, v in mine.items() if k != "hidden"}}
        model, _, _ = problem(hidden=mine.get("hidden", 16))
        out[name] = construction_error(lambda: DHO2(model.parameters(), group=pair, **kwargs))
    return out


def scenarios(rank, world):
    out = {}
    with tritonopt.use_backend("reference"):
        pair = dist.new_group([0, 1])
        if rank < 2:
            for variant in ("fused", "algorithm3"):
                out[("dho2", variant)] = run_dho2(rank, 2, pair, variant)
            out[("dho2", "float64")] = run_dho2(rank, 2, pair, "fused", dtype=torch.float64)
            out[("dho2", "features")] = run_dho2(rank, 2, pair, "fused", features=True)
            out["mismatch"] = mismatches(rank, pair)
        # MR-DHO2: ranks 0, 1 accelerators; 2, 3 workers; once per way of accumulating the gradient.
        for mode in ("sum", "mean"):
            model, x, y = problem()
            mr = MRDHO2(model.parameters(), num_accelerators=2, lr=3e-3, k=4, alpha=0.1, num_lanczos_iters=16,
                        accumulated_gradient=mode, timeout=datetime.timedelta(seconds=50))
            ese = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
            for epoch in range(2):
                mr.begin_epoch(ese if not mr.is_worker else None)
                if mr.is_worker:
                    c = flat(model)
                    xs, ys = x[rank - 2 :: 2], y[rank - 2 :: 2]
                    for _ in range(5):
                        for p in model.parameters():
                            p.grad = None
                        torch.nn.functional.cross_entropy(model(xs), ys).backward()
                        mr.step()
                    before = (c, flat(model), mr._accumulated.clone(), mr._epoch_steps)
                mr.end_epoch()
                if mr.is_worker:
                    out[("mr", mode, epoch)] = {"c": before[0], "w_first_order": before[1], "p": before[2],
                                                "steps": before[3], "w_new": flat(model)}
                else:
                    out[("mr_v", mode, epoch)] = (mr._rows_shard, mr._ritz.values, mr._ritz.scale)
        out["mr_memory"] = mr.memory
        out["mr_timeouts"] = [group_timeout(g).total_seconds() for g in
                              (mr.world_group, mr.worker_group if mr.is_worker else mr.accelerator_group)]
        model, _, _ = problem()
        layout = 1 if rank == 2 else 2
        mode = "mean" if rank == 3 else "sum"
        out["mr_mismatch"] = construction_error(lambda: MRDHO2(
            model.parameters(), num_accelerators=layout, accumulated_gradient=mode, k=4))
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, scenarios, timeout=300)


def single_process(dtype=torch.float32, features=False):
    model, x, y = problem(dtype)
    loss = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
    if features:
        opt = FOSI(feature_groups(model), curvature_loss_fn=loss, **FEATURES_KW)
        scheduler = feature_scheduler(opt)
    else:
        opt = FOSI(model.parameters(), curvature_loss_fn=loss, **FOSI_KW)
        scheduler = None
    w0 = flat(model)
    with tritonopt.use_backend("reference"):
        train(model, opt, loss, STEPS, scheduler)
    return flat(model), w0


@pytest.fixture(scope="module")
def single():
    return {"plain": single_process(), "float64": single_process(torch.float64),
            "features": single_process(features=True)}


@pytest.mark.parametrize("run, reference, rtol", [("fused", "plain", 1e-5), ("algorithm3", "plain", 1e-5),
                                                  ("features", "features", 1e-5), ("float64", "float64", 1e-12)])
def test_dho2_training_equals_single_process_fosi(results, single, run, reference, rtol):
    # Ranks average half-batch gradients; FOSI takes the whole batch: the same math, other rounding
    # (float64: every sum is exact to ~1e-16, so the runs agree to ~1e-14 of the distance travelled).
    w_single, w0 = single[reference]
    for rank in range(2):
        w = results[rank][("dho2", run)]["w"]
        assert (w - w_single).norm() <= rtol * (w_single - w0).norm()
    assert torch.equal(results[0][("dho2", run)]["w"], results[1][("dho2", run)]["w"])


def test_dho2_takes_the_reference_options_and_its_timeout(results):
    out = results[0][("dho2", "features")]
    assert out["ese_count"] == 3 and out["rows"] == 3  # k + l = 5 split 3 + 2
    assert out["stats"]["velocity_all_reduce"]["calls"] == 2  # velocity carried at the 2nd and 3rd ESE
    assert out["timeout"] == 60.0  # its own group, created with the timeout


def test_fused_variant_uses_three_n_sized_all_reduces_per_step(results):
    n = results[0][("dho2", "fused")]["w"].numel()
    fused = results[0][("dho2", "fused")]["stats"]
    alg3 = results[0][("dho2", "algorithm3")]["stats"]
    hybrid_steps = STEPS - FOSI_KW["warmup_steps"]
    assert fused["grad_all_reduce"]["calls"] == STEPS
    assert fused["g1_all_reduce"]["calls"] == fused["update_all_reduce"]["calls"] == hybrid_steps
    assert "delta1_all_reduce" not in fused
    assert alg3["delta1_all_reduce"]["calls"] == alg3["projection_all_reduce"]["calls"] == hybrid_steps
    assert fused["update_all_reduce"]["bytes_sent"] == hybrid_steps * n * 4
    assert fused["config_check"]["calls"] == 2  # the number of settings, then their digests


def test_dho2_state_dicts_are_per_rank_and_checked_on_every_rank(results):
    for rank in range(2):
        out = results[rank][("dho2", "fused")]
        assert out["foreign_load"] is not None and "per rank" in out["foreign_load"], rank
        assert torch.equal(out["after_foreign_load"], out["own_vectors"]), "nothing changed"
        w, base_step = out["after_tampered_load"]
        assert torch.equal(w, out["w"]) and base_step == STEPS
    assert "lacks ['base_step']" in results[1][("dho2", "fused")]["tampered_load"]
    assert "another rank's state dict was refused" in results[0][("dho2", "fused")]["tampered_load"]
    # The two ranks really hold different directions.
    assert not torch.equal(results[0][("dho2", "fused")]["own_vectors"], results[1][("dho2", "fused")]["own_vectors"])


def test_dho2_d_shard_halves_and_columns_split(results):
    for rank in range(2):
        memory = results[rank][("dho2", "fused")]["memory"]
        assert memory["d_shard_numel"] == memory["expected_numel"]
        assert results[rank][("dho2", "fused")]["rows"] == 2  # k = 4 split over 2 ranks


@pytest.mark.parametrize("setting, named", [
    ("lr", "lr: rank 0: [0.003], rank 1: [0.002]"), ("seed", "seed: rank 0: 0, rank 1: 1"),
    ("num_lanczos_iters", "num_lanczos_iters: rank 0: 16, rank 1: 12"),
    ("data_parallel_hvp", "data_parallel_hvp: rank 0: False, rank 1: True"),
    ("model", "model (shapes, dtypes): rank 0: [((16, 8), 'torch.float32')"),
])
def test_ranks_that_disagree_are_told_what_differs(results, setting, named):
    for rank in range(2):
        message = results[rank]["mismatch"][setting]
        assert message is not None and message.startswith("DHO2: the ranks were configured differently"), message
        assert named in message, (rank, message)


def test_mrdho2_ranks_that_disagree_and_its_timeout(results):
    for rank in range(WORLD):
        message = results[rank]["mr_mismatch"]
        assert "accumulated_gradient: rank 0: 'sum', rank 1: 'sum', rank 2: 'sum', rank 3: 'mean'" in message
        assert "world layout: rank 0: (4, 2), rank 1: (4, 2), rank 2: (4, 1), rank 3: (4, 2)" in message
        assert results[rank]["mr_timeouts"] == [50.0, 50.0]


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_mrdho2_final_update_equals_single_process_formula(results, mode):
    for epoch in range(2):
        shards = [results[a][("mr_v", mode, epoch)] for a in range(2)]
        values, ritz_scale = shards[0][1], shards[0][2]
        n = results[2][("mr", mode, epoch)]["c"].numel()
        v = torch.cat([s[0] for s in shards], dim=1)[:, :n]
        scale = (0.1 / values.abs().clamp_min(1e-3 * ritz_scale)).float()
        for worker in (2, 3):
            r = results[worker][("mr", mode, epoch)]
            expected = final_update_reference(v, scale, r["c"], r["w_first_order"], r["p"], r["steps"], mode=mode)
            assert torch.allclose(r["w_new"], expected, atol=1e-6)
            # The geometry: V (w_new - c) = -s * V p~ (p~ = p, or p / I for the mean),
            # and (I - P)(w_new - c) = (I - P) o.
            p_used = r["p"].double() / (r["steps"] if mode == "mean" else 1)
            d = (r["w_new"] - r["c"]).double()
            vd = v.double()
            assert torch.allclose(vd @ d, -(scale.double() * (vd @ p_used)), atol=1e-5)
            o = (r["w_first_order"] - r["c"]).double()
            assert torch.allclose(d - vd.T @ (vd @ d), o - vd.T @ (vd @ o), atol=1e-5)
        assert torch.equal(results[2][("mr", mode, epoch)]["w_new"], results[3][("mr", mode, epoch)]["w_new"])
    memory = results[0]["mr_memory"]
    assert memory["d_shard_numel"] == memory["expected_numel"]
