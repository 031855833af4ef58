"""DHO2 against single-process FOSI, and MR-DHO2's final update against its formula (gloo, one spawn)."""

import copy

import pytest
import torch
import torch.distributed as dist
from _distributed import run_on_ranks

import tritonopt
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist.dho2 import DHO2, MRDHO2, final_update_reference
from tritonopt.optim.fosi import FOSI

WORLD = 4
STEPS = 24
FOSI_KW = dict(lr=3e-3, k=4, l=0, alpha=0.1, warmup_steps=4, curvature_update_every=8, num_lanczos_iters=16)


def problem():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(64, 8, generator=gen)
    y = torch.randint(0, 4, (64,), generator=gen)
    return model, x, y


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_dho2(rank, size, group, variant):
    model, x, y = problem()
    ese = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731  (same ESE batch everywhere)
    comm = CountingCommunicator(group)
    opt = DHO2(model.parameters(), variant=variant, comm=comm, group=group, curvature_loss_fn=ese, **FOSI_KW)
    xs, ys = x[rank::size], y[rank::size]
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
    out = {"w": flat(model), "stats": {k: vars(v) for k, v in comm.stats().items()},
           "memory": opt.memory, "rows": opt.eigenvalues.numel()}
    if variant == "fused":
        # Checkpoints are per rank: a rank's own state loads, rank 0's on every rank is refused.
        own = copy.deepcopy(opt.state_dict())  # state_dict() returns live buffers
        opt.load_state_dict(own)
        shared = [own if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0, group=group)
        try:
            opt.load_state_dict(shared[0])
            out["foreign_load"] = None
        except ValueError as exc:
            out["foreign_load"] = str(exc)
        out["after_foreign_load"] = torch.cat([s["eigenvectors"].reshape(-1) for s in opt.state.values()])
        out["own_vectors"] = torch.cat([s["eigenvectors"].reshape(-1) for s in own["state"].values()])
    return out


def scenarios(rank, world):
    out = {}
    with tritonopt.use_backend("reference"):
        pair = dist.new_group([0, 1])
        if rank < 2:
            for variant in ("fused", "algorithm3"):
                out[("dho2", variant)] = run_dho2(rank, 2, pair, variant)
        # MR-DHO2: ranks 0, 1 accelerators; 2, 3 workers; once per way of accumulating the gradient.
        for mode in ("sum", "mean"):
            model, x, y = problem()
            mr = MRDHO2(model.parameters(), num_accelerators=2, lr=3e-3, k=4, alpha=0.1, num_lanczos_iters=16,
                        accumulated_gradient=mode)
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
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, scenarios, timeout=300)


@pytest.fixture(scope="module")
def single():
    model, x, y = problem()
    loss = lambda: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
    opt = FOSI(model.parameters(), curvature_loss_fn=loss, **FOSI_KW)
    w0 = flat(model)
    with tritonopt.use_backend("reference"):
        for _ in range(STEPS):
            opt.zero_grad()
            loss().backward()
            opt.step()
    return flat(model), w0


@pytest.mark.parametrize("variant", ["fused", "algorithm3"])
def test_dho2_training_equals_single_process_fosi(results, single, variant):
    w_single, w0 = single
    for rank in range(2):
        w = results[rank][("dho2", variant)]["w"]
        assert (w - w_single).norm() <= 1e-5 * (w_single - w0).norm()
    assert torch.equal(results[0][("dho2", variant)]["w"], results[1][("dho2", variant)]["w"])


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


def test_dho2_state_dicts_are_per_rank(results):
    for rank in range(2):
        out = results[rank][("dho2", "fused")]
        assert out["foreign_load"] is not None and "per rank" in out["foreign_load"], rank
        assert torch.equal(out["after_foreign_load"], out["own_vectors"]), "nothing changed"
    # The two ranks really hold different directions.
    assert not torch.equal(results[0][("dho2", "fused")]["own_vectors"], results[1][("dho2", "fused")]["own_vectors"])


def test_dho2_d_shard_halves_and_columns_split(results):
    for rank in range(2):
        memory = results[rank][("dho2", "fused")]["memory"]
        assert memory["d_shard_numel"] == memory["expected_numel"]
        assert results[rank][("dho2", "fused")]["rows"] == 2  # k = 4 split over 2 ranks


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
