"""KAISA on FSDP2 models over 4 gloo ranks: a 1-D mesh (13 rows cut 4, 4, 4, 1; 3 rows 1, 1, 1, 0) and a
2x2 HSDP mesh (replicas of 2 shards), each strategy against KAISA on the unsharded model, bit for bit.

The scenarios are tests/_kaisa_fsdp2.py's (one spawn for the module); marked ``multirank``
(``make test-multirank``): 4 ranks on 2 cores take about a minute.
"""

from __future__ import annotations

import pytest

from _distributed import run_on_ranks
from _kaisa_fsdp2 import KAISA_STEPS, checkpoint, compare

pytestmark = pytest.mark.multirank

WORLD = 4
STRATEGIES = {
    "1d": {"comm_opt": dict(grad_worker_fraction=1.0), "hybrid_opt": dict(grad_worker_fraction=0.5),
           "mem_opt": dict(grad_worker_fraction=0.25, colocate_factors=False)},
    "hsdp": {"comm_opt": dict(grad_worker_fraction=1.0), "hybrid_opt": dict(grad_worker_fraction=0.5)},
}
MESHES = {"1d": (WORLD,), "hsdp": (2, 2)}


def _scenario(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh

    import tritonopt

    out = {}
    for name, shape in MESHES.items():
        names = ("replicate", "shard") if len(shape) == 2 else None
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with tritonopt.use_backend("reference"):  # the sharding is under test, not the ops (see _kaisa_fsdp2)
            out[name] = {case: compare(rank, mesh, kaisa) for case, kaisa in STRATEGIES[name].items()}
            out[name]["checkpoint"] = checkpoint(rank, mesh, f"{directory}/{name}", STRATEGIES[name]["hybrid_opt"])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(WORLD, _scenario, str(tmp_path_factory.mktemp("dcp")), timeout=400)


CASES = [(mesh, case) for mesh, cases in STRATEGIES.items() for case in cases]


@pytest.mark.parametrize("mesh,case", CASES)
def test_kaisa_on_four_sharded_ranks_equals_kaisa_unsharded_bit_for_bit(ranks, mesh, case):
    for result in ranks:
        seen = result[mesh][case]
        assert seen["stepped"] and seen["preconditioned"] and seen["exact"]
    # MEM-OPT and HYBRID-OPT broadcast P to the ranks that are not its layer's gradient workers.
    assert all(result[mesh][case]["grad_broadcast"] == (case != "comm_opt") for result in ranks)


def test_the_shards_are_uneven_and_one_is_empty(ranks):
    assert [result["1d"]["comm_opt"]["local_rows"] for result in ranks] == [
        [4, 4, 1, 1], [4, 4, 1, 1], [4, 4, 1, 1], [1, 1, 0, 0]]
    # HSDP: rows cut over the 2 ranks of a replica (mesh rows [0, 1] and [2, 3]).
    assert [result["hsdp"]["comm_opt"]["local_rows"] for result in ranks] == [
        [7, 7, 2, 2], [6, 6, 1, 1], [7, 7, 2, 2], [6, 6, 1, 1]]


@pytest.mark.parametrize("mesh,shards", [("1d", 4), ("hsdp", 2)])
def test_kaisa_gathers_over_the_shard_dimension_only(ranks, mesh, shards):
    from tritonopt.dist.kaisa_sharded import expected_gather_bytes

    per_step = expected_gather_bytes([(13, 5), (13, 1), (3, 13), (3, 1)], shards)
    for result in ranks:
        assert result[mesh]["comm_opt"]["gather"] == (KAISA_STEPS, KAISA_STEPS * per_step["sent"],
                                                      KAISA_STEPS * per_step["received"])


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("source", ["own", "rank0"])
def test_kaisa_on_four_sharded_ranks_resumes_bit_for_bit(ranks, mesh, source):
    assert all(result[mesh]["checkpoint"][source] for result in ranks)
