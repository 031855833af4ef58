"""The sharded optimizers on 4 gloo ranks: a 1-D mesh of 4 and a 2x2 HSDP mesh (``replicate``, ``shard``).

One spawn runs every case (:func:`_scenario`) and returns what each rank saw; the
module is kept out of the default run (``-m multirank``, ``make test-multirank``).
The shapes are uneven on purpose: 13 rows on 4 ranks are 4, 4, 4 and 1, and 3 rows
are 1, 1, 1 and 0 (rank 3 holds no row of the second layer); on the 2x2 mesh the
rows are cut over the 2 ranks of the shard dimension (7 and 6; 2 and 1) and the 2
replicas of each shard hold the same rows.

As in ``tests/test_fsdp2.py`` (whose helpers and bounds this module imports), each
sharded run is compared with the same optimizer on plain tensors given the very
same gradients (the sharded run's, gathered): elementwise updates (SparseAdaGrad
keeping every entry, FlatSGD) must be equal bit for bit, the windows stay within
``_window_bound`` (LowRankMFAC ``_lowrank_bound``, FOSI ``_fosi_replay.fosi_bound``),
each derived there. On the HSDP mesh every sum over coordinates is the shard
dimension's, so the windows' spans, the bytes all-reduced and the replicated
coordinates' weights are those of 2 ranks, not 4; a check that the ranks agree
covers the replicas too.

Every rank runs the optimizers' PyTorch references (``use_backend("reference")``),
the sharded run and its plain twin alike: the Triton interpreter would make 4
ranks on 2 cores take minutes, and what is tested here is the sharding (the 2-rank
module runs the kernels).
"""

from __future__ import annotations

import io

import pytest
import torch

import test_fsdp2 as two
from _distributed import refusals_of, run_on_ranks

pytestmark = pytest.mark.multirank

WORLD = 4
HSDP_SHAPE = (2, 2)  # (replicate, shard)
MESHES = ("flat4", "hsdp")
STEPS, NGRADS, U32 = two.STEPS, two.NGRADS, two.U32
CASES = two.CASES
# The checkpoint cases: test_fsdp2's settings (a selection below density 1, momentum, FOSI's estimates).
CHECKPOINT_SETTINGS = two.CHECKPOINT_SETTINGS
RESHARDABLE = two.RESHARDABLE
FOSI_KW, FOSI_STEPS = two.FOSI_KW, two.FOSI_STEPS


# ---------------------------------------------------------------------- the ranks' side


def _attempt(fn, *args):
    """``fn(*args)``, or what it raised as ``{"raised": text}``, so that one refused case (every rank refuses alike,
    at construction) fails its own tests, not the whole module's."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001  (reported by the test that reads the case)
        return {"raised": f"{type(error).__name__}: {error}"}


def _placements(mesh, rows: bool) -> list:
    """``Shard(0)`` (rows) or ``Replicate()`` along the shard dimension, replicated along the replicate one."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate()] * (mesh.ndim - 1) + [Shard(0) if rows else Replicate()]


def _explicit(rank, mesh, name):
    """Two Shard(0) matrices (13 x 5, 3 x 13) and a replicated vector set by hand, beside plain tensors with the same
    gradients: the 2-rank module's scenario on this mesh."""
    placements = [_placements(mesh, True), _placements(mesh, True), _placements(mesh, False)]
    return two._explicit_dtensors(rank, mesh, name, placements, src_data_rank=None)


def _lowrank(rank, mesh):
    """LowRankMFAC on the same three parameters (the replicated vector stored exactly), beside the plain run."""
    placements = [_placements(mesh, True), _placements(mesh, True), _placements(mesh, False)]
    return two._lowrank_explicit(rank, mesh, placements, src_data_rank=None)


def _fosi_explicit(rank, mesh):
    """FOSI on three Shard(0) parameters and a replicated one (13 x 5, 13, 3 x 13; 3), whose loss is DTensor
    arithmetic, beside FOSI on plain tensors with the same gradients and central-difference products, and Adam."""
    from torch.distributed.tensor import distribute_tensor

    import tritonopt

    torch.manual_seed(1)
    fulls = [torch.randn(13, 5, dtype=torch.float64), torch.randn(13, dtype=torch.float64),
             torch.randn(3, 13, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    placements = [_placements(mesh, True)] * 3 + [_placements(mesh, False)]
    params = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, pl)) for f, pl in zip(fulls, placements)]
    plain = [torch.nn.Parameter(f.clone()) for f in fulls]
    base_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt = tritonopt.optim.FOSI(params, curvature_loss_fn=two._CurvatureLoss(params=params), **FOSI_KW)
    ref_opt = tritonopt.optim.FOSI(plain, curvature_loss_fn=two._CurvatureLoss(params=plain),
                                   hvp="central_difference", **FOSI_KW)
    base = torch.optim.Adam(base_params, lr=FOSI_KW["lr"])
    grads = []
    for step in range(FOSI_STEPS):
        gen = torch.Generator().manual_seed(step)
        grads.append([0.1 * torch.randn(f.shape, generator=gen, dtype=torch.float64) for f in fulls])
        for p, q, b, g, pl in zip(params, plain, base_params, grads[-1], placements):
            p.grad = distribute_tensor(g.clone(), mesh, pl, src_data_rank=None)
            q.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        base.step()
    return {"sharded": two._flat(params), "plain": two._flat(plain), "base": two._flat(base_params),
            "theta0": torch.cat([f.reshape(-1) for f in fulls]), "grads": grads,
            "bytes": opt.shard_group.bytes_all_reduced, "calls": opt.shard_group.all_reduce_calls,
            "d_shape": opt.last_lanczos["basis_shape"]}


def _refusals(rank, hsdp):
    """What no optimizer here steps on a 2-D mesh (or beyond), and DHO2 and track_error_norm on an HSDP model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import tritonopt

    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("outer", "replicate", "shard"))
    weight = torch.randn(13, 5)

    def on(mesh, placements):
        return lambda: tritonopt.optim.MFAC([torch.nn.Parameter(distribute_tensor(weight, mesh, placements))],
                                            ngrads=NGRADS)

    model = two._sharded_model(hsdp)

    def unsharded_into_hsdp():
        plain_model = two._model()
        plain = tritonopt.optim.MFAC(plain_model.parameters(), ngrads=NGRADS)
        two._backward(plain_model, 0, 0)
        plain.step()
        tritonopt.optim.MFAC(model.parameters(), ngrads=NGRADS).load_state_dict(plain.state_dict())

    attempts = {
        "three_d": on(cube, [Replicate(), Replicate(), Shard(0)]),
        "shard_on_replicate": on(hsdp, [Shard(0), Replicate()]),
        "shard_on_both": on(hsdp, [Shard(0), Shard(0)]),
        "shard_columns": on(hsdp, [Replicate(), Shard(1)]),
        "DHO2": lambda: tritonopt.dist.DHO2(model.parameters(), lr=0.1),
        "track_error_norm": lambda: tritonopt.optim.SparseMFAC(model.parameters(), track_error_norm=True),
        # Both ranks of replica 1 (ranks 2 and 3, one shard group) agree with each other, not with replica 0.
        "replica_disagrees": lambda: tritonopt.optim.MFAC(model.parameters(), lr=0.2 if rank >= 2 else 0.1,
                                                          ngrads=NGRADS),
        "fosi_disagrees": lambda: tritonopt.optim.FOSI(model.parameters(), k=3 if rank == 3 else 2, hvp_eps=1e-3),
        "unsharded_into_hsdp": unsharded_into_hsdp,
    }
    return refusals_of(attempts)


def _disagree_flat(rank, mesh):
    """On the 1-D mesh of 4, rank 3 alone asks for another lr."""
    import tritonopt

    model = two._sharded_model(mesh)
    try:
        tritonopt.optim.MFAC(model.parameters(), lr=0.3 if rank == 3 else 0.1, ngrads=NGRADS)
    except ValueError as error:
        return str(error)
    return None


def _state_of(opt, params) -> dict:
    """Each parameter's local state (copies), by position."""
    return {i: {name: value.clone() if isinstance(value, torch.Tensor) else value
                for name, value in opt.state[p].items()} for i, p in enumerate(params) if opt.state.get(p)}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(
            (torch.equal(x, b[i][name]) and x.dtype == b[i][name].dtype) if isinstance(x, torch.Tensor)
            else x == b[i][name] for name, x in a[i].items())
        for i in a)


def _checkpoints(rank, hsdp, flat4, directory):
    """Each of CHECKPOINT_SETTINGS' optimizers through :func:`_checkpoint_case`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    pair = dist.new_group([0, 1])  # every rank takes part in making it
    pair_mesh = DeviceMesh.from_group(pair, "cpu") if rank < 2 else None
    return {name: _attempt(_checkpoint_case, rank, hsdp, flat4, pair, pair_mesh, directory, name, kwargs)
            for name, kwargs in CHECKPOINT_SETTINGS.items()}


def _checkpoint_case(rank, hsdp, flat4, pair, pair_mesh, directory, name, kwargs):
    """3 steps on the 2x2 mesh, a torch.distributed.checkpoint and each rank's state_dict, 2 more steps; then the
    checkpoint resumed on the 2x2 mesh (both ways), on a 1-D mesh of 2 ranks (the same shard dimension: ranks 0
    and 1) and on the 1-D mesh of 4, each resumed run given the uninterrupted run's gradients."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = two._sharded_model(hsdp)
    opt = two._model_optimizer(name, model, **kwargs)
    two._run(model, opt, rank, range(3))
    path = f"{directory}/{name}"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    buffer = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in model.parameters()], "optim": opt.state_dict()}, buffer)
    saved_state = _state_of(opt, list(model.parameters()))
    saved_whole = two._whole_state(opt) if name in RESHARDABLE else None  # (gloo gathers no int16 ring)
    gradients = []
    uninterrupted = two._run(model, opt, rank, range(3, STEPS), gradients)

    model2 = two._sharded_model(hsdp)
    opt2 = two._model_optimizer(name, model2, **kwargs)
    refused = two._load_dcp(model2, opt2, path, None)
    via_dcp = two._run(model2, opt2, rank, range(3, STEPS)) if refused is None else None

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model3 = two._sharded_model(hsdp)
    opt3 = two._model_optimizer(name, model3, **kwargs)
    with torch.no_grad():
        for p, value in zip(model3.parameters(), saved["model"]):
            p.copy_(value)
    opt3.load_state_dict(saved["optim"])
    via_state_dict = two._run(model3, opt3, rank, range(3, STEPS))
    try:
        two._model_optimizer(name, two._model(), **kwargs).load_state_dict(saved["optim"])
        unsharded_refused = None
    except ValueError as error:
        unsharded_refused = str(error)

    seen = {"dcp_refused": refused, "dcp": via_dcp is not None and torch.equal(via_dcp, uninterrupted),
            "state_dict": torch.equal(via_state_dict, uninterrupted), "unsharded_refused": unsharded_refused}
    if rank < 2:
        seen["pair"] = _resume_elsewhere(rank, pair_mesh, pair, name, kwargs, path, saved_state, saved_whole,
                                         gradients, uninterrupted)
    seen["flat4"] = _resume_elsewhere(rank, flat4, None, name, kwargs, path, None, saved_whole, gradients,
                                      uninterrupted)
    if name in RESHARDABLE:  # and the other way: 3 steps on the 1-D mesh of 4, resumed on the 2x2 mesh
        model4 = two._sharded_model(flat4)
        opt4 = two._model_optimizer(name, model4, **kwargs)
        two._run(model4, opt4, rank, range(3))
        saved_whole4 = two._whole_state(opt4)
        dcp.save({"model": get_model_state_dict(model4), "optim": get_optimizer_state_dict(model4, opt4)},
                 checkpoint_id=f"{path}-flat4")
        gradients4 = []
        uninterrupted4 = two._run(model4, opt4, rank, range(3, STEPS), gradients4)
        seen["flat4_to_hsdp"] = _resume_elsewhere(rank, hsdp, None, name, kwargs, f"{path}-flat4", None,
                                                  saved_whole4, gradients4, uninterrupted4)
    return seen


def _resume_elsewhere(rank, mesh, group, name, kwargs, path, saved_state, saved_whole, gradients, uninterrupted):
    """The checkpoint at ``path`` loaded on ``mesh`` through torch.distributed.checkpoint; where it loads, its state
    against ``saved_state`` (this rank's part as saved, when the shard dimension is the same) and ``saved_whole``
    (every entry gathered whole), and the steps after it, with the uninterrupted run's gradients, against that
    run."""
    from torch.distributed.tensor import distribute_tensor

    model = two._sharded_model(mesh)
    opt = two._model_optimizer(name, model, **kwargs)
    seen = {"refused": two._load_dcp(model, opt, path, group)}
    if seen["refused"] is not None:
        return seen
    params = list(model.parameters())
    if saved_state is not None:
        seen["state_equal"] = _same_state(_state_of(opt, params), saved_state)
    # The checkpoint loaded into a plain model in this one process, given the same gradients (the optimizers that
    # reshard; the 2-rank module checks that the others refuse it).
    plain_model = two._model()
    plain = two._plain_template_optimizer(name, plain_model, **kwargs)
    seen["plain_refused"] = (two._load_dcp(plain_model, plain, path, None, no_dist=True) if name in RESHARDABLE
                             else "not tried")
    if name == "FOSI" or (name in two.SHARDED_TWIN_COMPARED and saved_state is None):
        # FOSI's next step runs an estimate through this mesh's model; on another shard count LowRankMFAC's power
        # iteration sums over other ranks' rows, with no bound derived here: the state compared, not the steps.
        seen["whole_state_equal"] = two.same_whole_state(two._whole_state(opt), saved_whole)
        seen["plain_whole_state_equal"] = seen["plain_refused"] is None and two.same_whole_state(
            two._whole_state(plain), saved_whole)
        return seen
    kind = CASES[name][2] if name in CASES else None
    budget = torch.zeros(())
    for step_gradients in gradients:
        for p, q, whole in zip(params, plain_model.parameters(), step_gradients):
            p.grad = distribute_tensor(whole.clone(), mesh, p.placements, src_data_rank=None)
            q.grad = whole.clone()
        opt.step()
        if seen["plain_refused"] is None:
            plain.step()
            if name in two.SUMS_OVER_COORDINATES:  # as in two._compare_fsdp: lr * du, and theta's own rounding
                theta = torch.cat([q.detach().reshape(-1) for q in plain_model.parameters()]).double()
                budget = budget + (CASES[name][1]["lr"] * two._window_bound(plain, CASES[name][1][kind[1]], kind[0])
                                   + 2 * U32 * theta.abs())
    resumed = two._whole(model)
    seen["equals_uninterrupted"] = torch.equal(resumed, uninterrupted)
    if seen["plain_refused"] is None:
        plain_params = torch.cat([q.detach().reshape(-1) for q in plain_model.parameters()])
        seen["plain_equals_uninterrupted"] = torch.equal(plain_params, uninterrupted)
        if name in two.SUMS_OVER_COORDINATES:
            seen["gap_over_bound"] = float(((resumed.double() - uninterrupted.double()).abs() / budget).max())
            seen["plain_gap_over_bound"] = float(((plain_params.double() - uninterrupted.double()).abs()
                                                  / budget).max())
    return seen


def _scenario(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh

    from tritonopt._runtime import use_backend

    torch.set_num_threads(1)
    torch.manual_seed(0)
    meshes = {"flat4": init_device_mesh("cpu", (world,)),
              "hsdp": init_device_mesh("cpu", HSDP_SHAPE, mesh_dim_names=("replicate", "shard"))}
    out = {"fsdp": {}, "explicit": {}, "lowrank": {}, "fosi_fsdp": {}, "fosi_explicit": {}, "local_rows": {}}
    with use_backend("reference"):
        for mesh_name, mesh in meshes.items():
            out["fsdp"][mesh_name] = {name: _attempt(two._compare_fsdp, rank, mesh, name) for name in CASES}
            out["explicit"][mesh_name] = {name: _attempt(_explicit, rank, mesh, name) for name in CASES}
            out["lowrank"][mesh_name] = _attempt(_lowrank, rank, mesh)
            out["fosi_fsdp"][mesh_name] = _attempt(two._fosi_fsdp, rank, mesh)
            out["fosi_explicit"][mesh_name] = _attempt(_fosi_explicit, rank, mesh)
            out["local_rows"][mesh_name] = [p.to_local().shape[0] for p in two._sharded_model(mesh).parameters()]
        out["refusals"] = _refusals(rank, meshes["hsdp"])
        out["disagree_flat"] = _disagree_flat(rank, meshes["flat4"])
        out["checkpoints"] = _checkpoints(rank, meshes["hsdp"], meshes["flat4"], directory)
    return out


# ---------------------------------------------------------------------- the tests


def _seen(result, *keys):
    """``result[keys[0]][keys[1]]...``, failing with what the case raised where it raised."""
    value = result
    for key in keys:
        value = value[key]
    assert not (isinstance(value, dict) and "raised" in value), f"{'/'.join(keys)}: {value.get('raised')}"
    return value


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(WORLD, _scenario, str(tmp_path_factory.mktemp("dcp4")), timeout=400)


def test_shapes_are_uneven_and_hsdp_shards_over_its_shard_dimension(ranks):
    # 1-D mesh of 4: 13 rows as 4, 4, 4, 1 and 3 rows as 1, 1, 1, 0. 2x2 mesh: (replicate, shard) = rank // 2, rank % 2.
    assert [r["local_rows"]["flat4"] for r in ranks] == [[4, 4, 1, 1]] * 3 + [[1, 1, 0, 0]]
    assert [r["local_rows"]["hsdp"] for r in ranks] == [[7, 7, 2, 2], [6, 6, 1, 1]] * 2
    # (world, rank) along the shard dimension, (replicas, replica) along the replicate one.
    specs = {mesh: [_seen(result, "explicit", mesh, "MFAC")["spec"] for result in ranks] for mesh in MESHES}
    assert specs["hsdp"] == [(2, 0, 2, 0), (2, 1, 2, 0), (2, 0, 2, 1), (2, 1, 2, 1)]
    assert specs["flat4"] == [(4, rank, 1, 0) for rank in range(WORLD)]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", list(CASES))
def test_fully_sharded_model_equals_unsharded(ranks, mesh, name):
    for result in ranks:
        seen = _seen(result, "fsdp", mesh, name)
        if CASES[name][2] is None:  # every entry kept: elementwise, so bit for bit
            assert seen["exact"], seen
        else:
            assert seen["gap_over_bound"] <= 1.0, seen
        assert seen["lr"] == pytest.approx(CASES[name][1]["lr"] * 0.5 ** (STEPS // 2))
        assert seen["grads_none"]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", list(CASES))
def test_shard_and_replicate_placements_equal_unsharded(ranks, mesh, name):
    for result in ranks:
        seen = _seen(result, "explicit", mesh, name)
        if CASES[name][2] is None:
            assert seen["gap"] == 0.0
        else:
            assert seen["gap"] <= 1.0, seen


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["MFAC", "SparseMFAC", "GGT", "SparseGGT"])
def test_windows_all_reduce_over_the_shard_dimension_only(ranks, mesh, name):
    # Per step the m float64 products and one float32 for the shared gradient check, on either mesh: the replicas
    # add nothing (their ranks compute the same sums).
    for result in ranks:
        seen = _seen(result, "explicit", mesh, name)
        assert seen["bytes"] == STEPS * (8 * NGRADS + 4) and seen["calls"] == 2 * STEPS, seen


@pytest.mark.parametrize("name", ["MFAC", "GGT"])
def test_each_rank_keeps_its_shards_share_of_the_window(ranks, name):
    # The window is padded to shard rank 0's part: 4 + 1 rows on the 1-D mesh of 4, 7 + 2 rows on the 2x2 mesh (its
    # shard dimension has 2 ranks), with the replicated vector whole.
    spans = {"flat4": 4 * 5 + 1 * 13 + 7, "hsdp": 7 * 5 + 2 * 13 + 7}
    for mesh, span in spans.items():
        for result in ranks:
            seen = _seen(result, "explicit", mesh, name)
            assert seen["window_shape"] == (NGRADS, span)
            assert seen["state_bytes"] == seen["expected_state_bytes"]


@pytest.mark.parametrize("name", list(CASES))
def test_the_replicas_of_a_shard_hold_the_same_state(ranks, name):
    # Ranks 0 and 2 (shard 0) and ranks 1 and 3 (shard 1) of the 2x2 mesh: every local state tensor equal bit for bit.
    for a, b in ((0, 2), (1, 3)):
        mine = _seen(ranks[a], "explicit", "hsdp", name)["local_state"]
        other = _seen(ranks[b], "explicit", "hsdp", name)["local_state"]
        assert mine.keys() == other.keys() and mine
        assert all(torch.equal(mine[key], other[key]) for key in mine), name


@pytest.fixture(scope="module")
def lowrank_bounds(ranks):
    seen = _seen(ranks[0], "lowrank", "flat4")  # the same parameters and gradients on both meshes
    _, kwargs, _ = two.LOWRANK
    return two._lowrank_bound(seen["fulls"], seen["grads"], kwargs["lr"], kwargs["rank"], kwargs["ngrads"],
                              kwargs["damp"], checked={0, STEPS - 1})


@pytest.mark.parametrize("mesh", MESHES)
def test_lowrank_mfac_equals_unsharded_within_the_rounding_bound(ranks, lowrank_bounds, mesh):
    for result in ranks:
        seen = _seen(result, "lowrank", mesh)
        sharded, reference = seen["sharded"], seen["reference"]
        gaps = [float(((sharded[k].double() - reference[k].double()).abs() / bound).max())
                for k, bound in lowrank_bounds.items()]
        assert max(gaps) <= 1.0, gaps


def test_lowrank_mfac_keeps_each_shard_ranks_rows_and_all_reduces_over_the_shard_dimension(ranks):
    # ring_p holds the rank's rows of each Shard(0) matrix, the replicated vector's whole (its 7 entries as 7 rows).
    rows = {"flat4": [[4, 1, 7]] * 3 + [[1, 0, 7]], "hsdp": [[7, 2, 7], [6, 1, 7]] * 2}
    r, tensors, columns = 2, 2, 5 + 13
    per_step = 4 * tensors * (r + r * (r - 1) // 2 + r - 1) + 4 * r * columns + 8 * NGRADS + 4
    for mesh, expected in rows.items():
        for result, want in zip(ranks, expected):
            seen = _seen(result, "lowrank", mesh)
            assert [shape[1] for shape in seen["local_rows"]] == want
            assert seen["bytes"] == STEPS * per_step and seen["calls"] == STEPS * (2 * r + 2)


@pytest.fixture(scope="module")
def fosi_bounds(ranks):
    return {(case, mesh): two._fosi_bound(ranks[0][case][mesh])
            for case in ("fosi_fsdp", "fosi_explicit") for mesh in MESHES if "raised" not in ranks[0][case][mesh]}


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("case", ["fosi_fsdp", "fosi_explicit"])
def test_fosi_equals_unsharded_within_the_rounding_bound(ranks, fosi_bounds, case, mesh):
    for result in ranks:
        _seen(result, case, mesh)
    replayed, bound = fosi_bounds[(case, mesh)]
    for result in ranks:
        seen = result[case][mesh]
        assert float(((seen["sharded"] - seen["plain"]).abs() / bound).max()) <= 1.0
        assert torch.equal(seen["sharded"], ranks[0][case][mesh]["sharded"])  # every rank holds the same model
    assert float(((replayed - ranks[0][case][mesh]["plain"]).abs() / bound).max()) <= 1.0
    # Adam alone, given the same gradients, ends outside the bound: the equality holds for FOSI's Newton step.
    assert bool(((ranks[0][case][mesh]["base"] - ranks[0][case][mesh]["plain"]).abs() > bound).all())


def test_fosi_keeps_each_shard_ranks_coordinates_and_all_reduces_over_the_shard_dimension(ranks):
    # 70 and 50 coordinates on the 2 shard ranks of the 2x2 mesh (as on a 1-D mesh of 2); on the 1-D mesh of 4,
    # 4 + 4 rows of the first layer and 1 + 1 of the second (38 coordinates), rank 3 1 + 1 and none (6).
    m, passes, r = FOSI_KW["num_lanczos_iters"], 2, FOSI_KW["k"]
    ese = 8 * passes * m * (m - 1) // 2 + 32 * (m - 1) + 8 + 8
    steps = FOSI_STEPS * (2 * 8 * r + 8) + 8
    assert [_seen(result, "fosi_fsdp", "hsdp")["d_shape"][1] for result in ranks] == [70, 50, 70, 50]
    assert [_seen(result, "fosi_fsdp", "flat4")["d_shape"][1] for result in ranks] == [38, 38, 38, 6]
    for result in ranks:
        for mesh in MESHES:
            for case in ("fosi_fsdp", "fosi_explicit"):
                seen = _seen(result, case, mesh)
                assert seen["bytes"] == ese + steps, (case, mesh)
                assert seen["calls"] == passes * (m - 1) + m + 1 + FOSI_STEPS * 3, (case, mesh)


@pytest.mark.parametrize("attempt,says", [
    ("three_d", ["3-D mesh (1, 2, 2)", "('outer', 'replicate', 'shard')"]),
    ("shard_on_replicate", ["replicated along its first (replicate) dimension", "placements (S(0), R)"]),
    ("shard_on_both", ["replicated along its first (replicate) dimension", "placements (S(0), S(0))"]),
    ("shard_columns", ["sharded along their first dimension", "placements (R, S(1))"]),
    ("DHO2", ["does not support DTensor"]),
    ("track_error_norm", ["track_error_norm is not supported"]),
    # A dense window's state saved unsharded, loaded whole by load_state_dict: it reshards through
    # torch.distributed.checkpoint only, which the refusal names.
    ("unsharded_into_hsdp", ["'ring_rows' of shape (4, 13, 5) holds the whole parameter's columns",
                             "this optimizer holds its shard", "through torch.distributed.checkpoint"]),
])
def test_what_is_not_supported_is_refused_naming_it(ranks, attempt, says):
    for result in ranks:
        message = result["refusals"][attempt]
        assert message is not None and message.startswith("ValueError"), message
        for words in says:
            assert words in message, message


def test_a_replica_group_with_other_settings_fails_on_every_rank_naming_it(ranks):
    # Replica 1 (ranks 2 and 3) agrees within its shard group: only the check over the replicas sees it.
    for result in ranks:
        message = result["refusals"]["replica_disagrees"]
        assert message is not None and "param_groups[0].lr" in message, message
        assert ("rank 0 (replicate 0, shard 0) has 0.1, rank 1 (replicate 0, shard 1) has 0.1, "
                "rank 2 (replicate 1, shard 0) has 0.2, rank 3 (replicate 1, shard 1) has 0.2") in message, message
        message = result["refusals"]["fosi_disagrees"]
        assert message is not None and "k: rank 0 (replicate 0, shard 0) has 2" in message, message
        assert "rank 3 (replicate 1, shard 1) has 3" in message, message


def test_one_rank_of_four_with_other_settings_fails_on_every_rank_naming_it(ranks):
    for result in ranks:
        message = result["disagree_flat"]
        assert message is not None and "param_groups[0].lr" in message, message
        assert "rank 0 has 0.1, rank 1 has 0.1, rank 2 has 0.1, rank 3 has 0.3" in message, message


@pytest.mark.parametrize("name", list(CHECKPOINT_SETTINGS))
def test_hsdp_checkpoints_resume_bit_for_bit(ranks, name):
    for result in ranks:
        seen = _seen(result, "checkpoints", name)
        assert seen["dcp_refused"] is None and seen["dcp"], seen
        assert seen["state_dict"], seen
        assert seen["unsharded_refused"] is not None and "cannot reshard" in seen["unsharded_refused"], seen


@pytest.mark.parametrize("name", list(CHECKPOINT_SETTINGS))
def test_an_hsdp_checkpoint_resumes_on_a_1d_mesh_of_its_shard_dimension(ranks, name):
    # The 2x2 checkpoint on ranks 0 and 1 as a 1-D mesh of 2: each shard rank's state as saved, and (but FOSI, whose
    # next step runs a curvature estimate through the other mesh's model) the uninterrupted run's next steps.
    for result in ranks[:2]:
        seen = _seen(result, "checkpoints", name)["pair"]
        assert seen["refused"] is None and seen["state_equal"], seen
        if name != "FOSI":
            assert seen["equals_uninterrupted"], seen


def _assert_resumed(seen: dict, name: str, side: str = "") -> None:
    """What a reshardable optimizer's checkpoint resumed elsewhere must show (``side``: ``""`` for the sharded run,
    ``"plain_"`` for the plain model): loaded; then FOSI's and LowRankMFAC's whole state as saved, a dense window
    within _window_bound of the uninterrupted run, FlatSGD that run bit for bit, SparseAdaGrad (blocks cut from
    other shards) another run."""
    assert seen[f"{side}refused"] is None, seen
    if name in two.SHARDED_TWIN_COMPARED:
        assert seen[f"{side}whole_state_equal"], seen
    elif name in two.SUMS_OVER_COORDINATES:
        assert seen[f"{side}gap_over_bound"] <= 1.0, seen
    else:
        assert seen[f"{side}equals_uninterrupted"] == (name == "FlatSGD"), seen


@pytest.mark.parametrize("name", list(CHECKPOINT_SETTINGS))
def test_an_hsdp_checkpoint_on_another_shard_dimension_reshards_or_is_refused(ranks, name):
    # On the 1-D mesh of 4: FlatSGD and SparseAdaGrad (per-coordinate state) reshard; FlatSGD then goes on as the
    # uninterrupted run (elementwise), SparseAdaGrad cuts its Top-k blocks from 4 shards instead of 2. FOSI's and
    # LowRankMFAC's state (per coordinate, by the parameters' rows, or the same on every rank) loads as saved. The
    # sparse windows are refused, naming both shard counts (SparseMFAC by DCP itself: its window's blocks change shape).
    for result in ranks:
        seen = _seen(result, "checkpoints", name)["flat4"]
        if name in RESHARDABLE:
            # A dense window's rows and Gram matrix load exactly; the resumed steps' products sum over 4 ranks'
            # coordinates instead of 2's: the uninterrupted run within _window_bound.
            _assert_resumed(seen, name)
        elif name == "SparseMFAC":
            assert seen["refused"] is not None and "ring_indices" in seen["refused"], seen
        else:
            assert seen["refused"] is not None, seen
            assert "saved for sharded over 2 ranks, this optimizer has sharded over 4 ranks" in seen["refused"], seen


@pytest.mark.parametrize("name", RESHARDABLE)
def test_a_checkpoint_of_four_ranks_resumes_on_the_hsdp_mesh(ranks, name):
    # 4 -> 2: saved on the 1-D mesh of 4, resumed on the 2x2 mesh (2 shard ranks), given the uninterrupted run's
    # gradients. FlatSGD is elementwise: bit for bit. A dense window: within _window_bound (the products' sums over
    # 2 ranks' coordinates instead of 4's). SparseAdaGrad: Top-k blocks cut from 2 shards instead of 4. FOSI and
    # LowRankMFAC: their state as saved (their next steps sum over other ranks' rows, with no bound derived here).
    for result in ranks:
        _assert_resumed(_seen(result, "checkpoints", name)["flat4_to_hsdp"], name)


@pytest.mark.parametrize("source", ["flat4", "flat4_to_hsdp"])
@pytest.mark.parametrize("name", RESHARDABLE)
def test_a_checkpoint_of_two_or_four_shard_ranks_loads_into_a_plain_model(ranks, name, source):
    # The checkpoint of the 2x2 mesh (2 shard ranks) and of the 1-D mesh of 4, loaded into the optimizer over a plain
    # model in one process (dcp.load with no_dist=True into get_optimizer_state_dict's template, then
    # set_optimizer_state_dict), given the uninterrupted run's gradients: FlatSGD bit for bit, a dense window within
    # _window_bound (one sum over every coordinate), SparseAdaGrad with one rank's blocks, FOSI and LowRankMFAC with
    # their state as saved.
    for result in ranks:
        _assert_resumed(_seen(result, "checkpoints", name)[source], name, side="plain_")
