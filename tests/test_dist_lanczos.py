"""Distributed Lanczos (Algorithm 2) and the row-to-column reconstruction on 2 and 4 gloo ranks."""

import math


import pytest
import torch
import torch.distributed as dist
from _distributed import run_on_ranks

import tritonopt
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist.lanczos import distributed_lanczos, reconstruct_columns, shard_size
from tritonopt.optim.lanczos import lanczos, ritz_vectors, select_ritz

WORLD = 4
N = 203  # not a multiple of 2 or 4: padding is exercised
M = 24


def quadratic(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    spectrum = torch.cat([torch.linspace(0.01, 1.0, n - 4, dtype=torch.float64),
                          torch.tensor([4.0, 6.0, 9.0, 12.0], dtype=torch.float64)])
    return (q * spectrum) @ q.T


def scenarios(rank, world):
    a = quadratic(N)
    hvp = lambda v: (a @ v.double()).to(v.dtype)  # noqa: E731
    out = {}
    with tritonopt.use_backend("reference"):
        for size in (2, 4):
            group = dist.new_group(list(range(size)))
            if rank >= size:
                continue
            comm = CountingCommunicator(group)
            for dtype in (torch.float64, torch.float32):
                res = distributed_lanczos(hvp, N, M, comm=comm, group=group, dtype=dtype, seed=7)
                gathered = torch.empty(size * res.basis.numel(), dtype=dtype)
                dist.all_gather_into_tensor(gathered, res.basis.contiguous().view(-1), group=group)
                full = gathered.view(size, M, -1).permute(1, 0, 2).reshape(M, -1)
                out[(size, dtype, "B")] = res.tridiag
                out[(size, dtype, "D")] = full
                out[(size, dtype, "shard_numel")] = res.basis.numel()
            _, u_sel = select_ritz(res.tridiag, 5, 0)
            rows = ritz_vectors(res.basis, u_sel)  # [5, n_c]
            cols, start = reconstruct_columns(rows, N, comm=comm, group=group)
            out[(size, "cols")] = (cols, start)
            gathered = torch.empty(size * rows.numel())
            dist.all_gather_into_tensor(gathered, rows.view(-1), group=group)
            out[(size, "full_v")] = gathered.view(size, 5, -1).permute(1, 0, 2).reshape(5, -1)[:, :N]
            out[(size, "stats")] = {k: vars(v) for k, v in comm.stats().items()}
        out["disagreement"] = disagreement(rank)
    return out


def disagreement(rank):
    """Ranks called differently (or one refusing its own arguments): what each rank raised (None: nothing)."""
    def on_rank_1(usual, other):
        return other if rank == 1 else usual

    cases = {
        "n": dict(n=on_rank_1(37, 38)),
        "num_iters": dict(num_iters=on_rank_1(6, 7)),
        "dtype": dict(dtype=on_rank_1(torch.float64, torch.float32)),
        "seed": dict(seed=rank),
        "passes": dict(passes=on_rank_1(2, 1)),
        "own_argument": dict(num_iters=on_rank_1(6, 0)),
        "agree": {},
    }
    raised = {}
    for name, change in cases.items():
        arguments = {"n": 37, "num_iters": 6, **change}
        size = arguments.pop("n")
        try:
            distributed_lanczos(lambda v: v * torch.arange(1, size + 1, dtype=v.dtype), size, **arguments)
            raised[name] = None
        except ValueError as error:
            raised[name] = str(error)
    return raised


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, scenarios, timeout=240)


@pytest.fixture(scope="module")
def single():
    a = quadratic(N)
    hvp = lambda v: (a @ v.double()).to(v.dtype)  # noqa: E731
    with tritonopt.use_backend("reference"):
        return {dtype: lanczos(hvp, N, M, dtype=dtype, seed=7) for dtype in (torch.float64, torch.float32)}


@pytest.mark.parametrize("size", [2, 4])
def test_distributed_equals_single_process(results, single, size):
    for rank in range(size):
        out = results[rank]
        ref64, ref32 = single[torch.float64], single[torch.float32]
        assert torch.allclose(out[(size, torch.float64, "B")], ref64.tridiag, rtol=1e-12, atol=1e-12)
        assert torch.allclose(out[(size, torch.float64, "D")][:, :N], ref64.basis, atol=1e-11)
        assert torch.allclose(out[(size, torch.float32, "B")], ref32.tridiag, rtol=1e-5, atol=1e-5)
        # Padding rows of D stay exactly zero.
        assert torch.all(out[(size, torch.float64, "D")][:, N:] == 0)


@pytest.mark.parametrize("size", [2, 4])
def test_d_shard_is_m_times_ceil_n_over_c(results, size):
    for rank in range(size):
        assert results[rank][(size, torch.float64, "shard_numel")] == M * math.ceil(N / size)
    assert results[0][(2, torch.float64, "shard_numel")] > results[0][(4, torch.float64, "shard_numel")]


@pytest.mark.parametrize("size", [2, 4])
def test_reconstruction_is_a_bitwise_permutation(results, size):
    pieces = []
    for rank in range(size):
        cols, start = results[rank][(size, "cols")]
        full = results[rank][(size, "full_v")]
        assert torch.equal(cols, full[start : start + cols.shape[0]])
        pieces.append(cols)
    assert torch.equal(torch.cat(pieces), results[0][(size, "full_v")])  # uneven split 5 = 3 + 2 / 2+1+1+1


@pytest.mark.parametrize("size", [2, 4])
def test_collective_bytes_follow_algorithm_2(results, size):
    stats = results[0][(size, "stats")]
    n_c = shard_size(N, size)
    # Two Lanczos runs (fp64 then fp32), M all_gathers each.
    assert stats["lanczos_all_gather"]["calls"] == 2 * M
    assert stats["lanczos_all_gather"]["bytes_sent"] == M * n_c * (8 + 4)
    # CGS2: two coefficient all_reduces per iteration but the last; i + 1 entries at iteration i.
    assert stats["lanczos_coef"]["calls"] == 2 * 2 * (M - 1)
    assert stats["lanczos_coef"]["bytes_sent"] == 2 * sum(i + 1 for i in range(M - 1)) * (8 + 4)
    assert stats["lanczos_norm"]["calls"] == 2 * (M - 1)
    # The start-up agreement, under its own label: 8 bytes, then 9 digests of 8 bytes, per run.
    assert stats["lanczos_config_check"] == dict(calls=2 * 2, bytes_sent=2 * (8 + 9 * 8),
                                                 bytes_received=2 * (size - 1) * (8 + 9 * 8))


@pytest.mark.parametrize("setting, values", [
    ("n", "rank 0: 37, rank 1: 38, rank 2: 37, rank 3: 37"),
    ("num_iters", "rank 0: 6, rank 1: 7, rank 2: 6, rank 3: 6"),
    ("dtype", "rank 0: 'torch.float64', rank 1: 'torch.float32'"),
    ("seed", "rank 0: 0, rank 1: 1, rank 2: 2, rank 3: 3"),
    ("passes", "rank 0: 2, rank 1: 1, rank 2: 2, rank 3: 2"),
])
def test_ranks_called_differently_all_raise_naming_the_setting(results, setting, values):
    for rank in range(WORLD):
        message = results[rank]["disagreement"][setting]
        assert message is not None and "distributed_lanczos: the ranks were configured differently (" in message
        assert f"{setting}: {values}" in message


def test_an_argument_one_rank_refuses_is_raised_on_every_rank(results):
    assert results[1]["disagreement"]["own_argument"] == "num_iters must be an int >= 1, got 0"
    for rank in (0, 2, 3):
        assert ("distributed_lanczos: rank 1 refused at start-up: ValueError: num_iters must be an int >= 1, got 0"
                in results[rank]["disagreement"]["own_argument"])
    assert all(results[rank]["disagreement"]["agree"] is None for rank in range(WORLD))
