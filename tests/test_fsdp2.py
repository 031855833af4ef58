"""tritonopt's optimizers on sharded parameters (DTensors, FSDP2's ``fully_shard``) on 2 gloo ranks.

One spawn runs every case (:func:`_scenario`) and returns what each rank saw. The
shapes are uneven on purpose (13 rows on 2 ranks: 7 and 6; 3 rows: 2 and 1).

Each sharded run is compared with the same optimizer on plain tensors that get the
very same gradients (the sharded run's, gathered), so the only difference is how the
sums over coordinates are formed. Elementwise updates (SparseAdaGrad keeping every
entry, FlatSGD) are then equal bit for bit: each coordinate sees the same float32
operations on the same values, so no tolerance is allowed. For the windows the bound is
:func:`_window_bound`, derived there; for FOSI (float64, central-difference Hessian-vector
products, since no double backward goes through ``fully_shard``) ``_fosi_replay.fosi_bound``.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from _distributed import refusals_of, run_on_ranks
from _kaisa_fsdp2 import KAISA_CASES, KAISA_STEPS, kaisa_scenario
from _shard_group_stall import STALL_TIMEOUT, stall_scenario

WORLD = 2
STEPS = 5
NGRADS = 4
U32 = 2.0**-24  # float32 unit roundoff


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): a float32 sum of n terms in any order errs by at most gamma_n * sum|terms|."""
    return n * U32 / (1 - n * U32)


def _window_bound(ref, scale: float, kind: str) -> torch.Tensor:
    """Per coordinate, a bound on how far the sharded step's update ``u`` can be from the reference's.

    Both runs hold the same window ``G`` (the same gradients) and the same new row ``x``
    (row ``slot``); they differ in how each scalar product of ``s = G x`` and of
    ``dots = G G^T`` sums its ``d`` float32 terms (one sum, or a sum per rank added in
    float64). Each run errs by at most ``gamma_d sum_i |G_ji x_i|`` (Higham), so the two
    differ by ``ds_j <= 2 gamma_d (|G| |x|)_j`` and ``dD_jk <= 2 gamma_d (|G| |G|^T)_jk``.
    The weights are ``z = f(dots) s`` with ``f(lam) = -1 / (damp (damp m + lam))`` for
    M-FAC and ``-1 / (eps sqrt(lam) (sqrt(lam) + eps))`` for GGT on the written rows
    (unwritten rows are zero in both runs, exactly). By Daleckii-Krein the Frechet
    derivative of ``f`` is bounded by ``L = max |f'|`` and ``f`` itself by ``M = max |f|``
    over the spectrum, both at its smallest eigenvalue (``|f|``, ``|f'|`` decrease), so to
    first order ``||dz|| <= L ||dD||_F ||s|| + M ||ds||``; we double it for the
    second-order terms (of relative size ``||dD|| / lam_min``, below 1e-3 here). The float64
    solve's own rounding is below ``2^-52`` relative and is left out. Then
    ``u = w @ G`` (``w = z + e_slot / scale``) adds ``|du_i| <= ||dz|| ||G[:, i]|| +
    2 gamma_m (|w| |G|)_i``, the last term for the two float32 combinations' rounding.
    """
    import tritonopt

    params = ref.param_groups[0]["params"]
    ring = ref.state[params[0]]
    if "ring_grads" in ring:
        window = ring["ring_grads"].double()
    else:  # a sparse ring keeping every entry holds the dense rows
        block_size = min(ref.param_groups[0]["block_size"], sum(p.numel() for p in params))
        dense = tritonopt.ops.densify_ring(ring["ring_indices"], ring["ring_values"], block_size)
        window = dense.reshape(dense.shape[0], -1)[:, : sum(p.numel() for p in params)].double()
    m, d = window.shape
    filled = ring["ring_filled"]
    slot = (ring["ring_slot"] - 1) % m
    rows = window[:filled] if filled < m else window
    x = window[slot]
    absolute = rows.abs()
    ds = 2 * _gamma(d) * (absolute @ x.abs())
    dD = 2 * _gamma(d) * (absolute @ absolute.T)
    dots = rows @ rows.T
    s = rows @ x
    lam = torch.linalg.eigvalsh(dots).clamp_min(0)
    if kind == "mfac":
        low = scale * m + lam.min()
        f_max, f_prime = 1 / (scale * low), 1 / (scale * low**2)
        z = -torch.linalg.solve(dots + scale * m * torch.eye(len(rows), dtype=torch.float64), s) / scale
    else:
        sigma = lam.min().sqrt()
        f_max = 1 / (scale * sigma * (sigma + scale))
        f_prime = (1 + scale / (2 * sigma)) / (scale * (lam.min() + scale * sigma) ** 2)
        vals, vecs = torch.linalg.eigh(dots)
        z = vecs @ ((-1 / (scale * vals.sqrt() * (vals.sqrt() + scale))) * (vecs.T @ s))
    dz = 2 * (f_prime * torch.linalg.matrix_norm(dD) * s.norm() + f_max * ds.norm())
    w = torch.zeros(m, dtype=torch.float64)
    w[: len(rows)] = z
    w[slot] += 1 / scale
    return dz * window.norm(dim=0) + 2 * _gamma(m) * (w.abs() @ window.abs())


def _lowrank_bound(fulls, steps_grads, lr: float, rank: int, ngrads: int, damp: float,
                   checked: set) -> dict[int, torch.Tensor]:
    """After each step in ``checked`` and per coordinate, a bound on how far LowRankMFAC's sharded parameters can
    be from the plain run's (a batched backward per step: the others are replayed, not checked).

    Both runs take the same gradients and perform the same float32 operations; they
    differ in the order of the sums over coordinates (a sum per rank, then the ranks'
    all-reduce). Each operation's result errs from the exact one by at most its
    rounding bound ``b`` (Higham: a sum or dot product of ``n`` terms in any order by
    ``gamma_n sum |terms|``, a chain of ``k`` roundings by ``gamma_k |result|``):
    ``A = e + g``, ``Y = A Q``, each Gram-Schmidt norm, scale, column and projection,
    ``Q = A^T P``, ``e = A - P Q^T``, the Frobenius products' ``P_j^T P``, ``Q_j^T Q`` and
    their sums, the float32 weights and ``sum_j w_j P_j Q_j^T``, ``theta - lr u``. The
    computation is replayed in float64 (as exact) with a zero perturbation added after
    each of these; to first order each run's parameters after step ``k`` are off by
    ``J delta`` with ``|delta| <= b``, so the runs differ by at most ``|J| (2 b)``,
    ``J`` the Jacobian of the parameters with respect to every perturbation so far
    (through the error feedback, the warm start and the window, all steps). We double
    it for the second-order terms. The Gram-Schmidt's keep decisions are taken as in
    the float64 replay (none is near its threshold here). The float64 solve's own
    rounding is left out, as in :func:`_window_bound`.
    """
    from tritonopt.kernels.lowrank import DEPENDENT_TOLERANCE, GRAM_SCHMIDT_EPS
    from tritonopt.optim._window_algebra import fold_new_row, mfac_weights

    f64 = torch.float64
    deltas, bounds = [], []

    def rounded(x, bound):
        delta = torch.zeros_like(x, requires_grad=True)
        deltas.append(delta)
        bounds.append(bound.detach())
        return x + delta

    def gamma(n):
        return _gamma(n)

    gen = torch.Generator().manual_seed(0)  # the optimizer's seed: the same warm starts
    shapes = [(f.shape[0], f[0].numel()) for f in fulls]
    warms = [torch.randn((c, rank), generator=gen, dtype=torch.float32).double() if f.dim() >= 2 else None
             for f, (_, c) in zip(fulls, shapes)]
    thetas = [f.double().reshape(n, c) for f, (n, c) in zip(fulls, shapes)]
    errors = [torch.zeros(n, c, dtype=f64) for n, c in shapes]
    ring = [[] for _ in fulls]  # per tensor, the stored (P, Q) of each written row
    dots = torch.zeros(ngrads, ngrads, dtype=f64)
    out = {}
    for step, grads in enumerate(steps_grads):
        slot = step % ngrads
        new = []
        for index, (g, (n, c)) in enumerate(zip(grads, shapes)):
            g = g.double().reshape(n, c)
            if warms[index] is None:  # 1-D: stored exactly, no error feedback
                new.append((torch.cat([g, torch.zeros(n, rank - 1, dtype=f64)], 1),
                            torch.eye(1, rank, dtype=f64)))
                continue
            a = errors[index] + g
            a = rounded(a, U32 * a.abs())
            warm = warms[index]
            y = rounded(a @ warm, gamma(c) * (a.abs() @ warm.abs()))
            original = y.detach().norm(dim=0)
            columns, alive = [y[:, i] for i in range(rank)], []
            for i in range(rank):
                norm = columns[i].norm()
                norm = rounded(norm, gamma(n + 2) * norm.abs())
                alive.append(bool(norm > DEPENDENT_TOLERANCE * original[i]))
                scale = 1.0 / (norm + GRAM_SCHMIDT_EPS) if alive[-1] else torch.zeros((), dtype=f64)
                scale = rounded(scale, gamma(2) * scale.abs())
                columns[i] = rounded(columns[i] * scale, U32 * (columns[i] * scale).abs())
                for j in range(i + 1, rank):
                    dot = rounded(columns[i] @ columns[j], gamma(n) * (columns[i].abs() @ columns[j].abs()))
                    bound_j = gamma(2) * (columns[j].abs() + columns[i].abs() * dot.abs())
                    columns[j] = rounded(columns[j] - columns[i] * dot, bound_j)
            p = torch.stack(columns, dim=1)
            q = rounded(a.T @ p, gamma(n) * (a.abs().T @ p.abs()))
            residual = a - p @ q.T
            errors[index] = rounded(residual, gamma(rank + 1) * (a.abs() + p.abs() @ q.abs().T))
            kept = torch.tensor(alive)
            warms[index] = torch.where(kept, q, warm)
            new.append((p, warms[index]))
        for index, pair in enumerate(new):
            if len(ring[index]) < ngrads:
                ring[index].append(pair)
            else:
                ring[index][slot] = pair
        products = []
        for j in range(len(ring[0])):
            total = torch.zeros((), dtype=f64)
            for index, (p, q) in enumerate(new):
                p_j, q_j = ring[index][j]
                n, c = shapes[index]
                left = rounded(p_j.T @ p, gamma(n) * (p_j.abs().T @ p.abs()))
                right = rounded(q_j.T @ q, gamma(q.shape[0]) * (q_j.abs().T @ q.abs()))
                terms = left * right
                total = total + rounded(terms.sum(), gamma(rank * rank + 1) * terms.abs().sum())
            products.append(total)
        s = torch.stack(products + [torch.zeros((), dtype=f64)] * (ngrads - len(products)))
        dots = dots.clone()
        dots[slot, :] = s
        dots[:, slot] = s
        weights = fold_new_row(mfac_weights(dots, s, damp), slot, damp)
        weights = rounded(weights, U32 * weights.abs())
        for index, (n, c) in enumerate(shapes):
            pairs = ring[index]
            u = sum(weights[j] * (p_j @ q_j.T) for j, (p_j, q_j) in enumerate(pairs))[:, :c]
            magnitude = sum(weights[j].abs() * (p_j.abs() @ q_j.abs().T) for j, (p_j, q_j) in enumerate(pairs))
            u = rounded(u, gamma(len(pairs) * rank + 1) * magnitude[:, :c])
            theta = thetas[index] - lr * u
            thetas[index] = rounded(theta, gamma(2) * (thetas[index].abs() + lr * u.abs()))
        if step not in checked:
            continue
        flat = torch.cat([t.reshape(-1) for t in thetas])
        eye = torch.eye(flat.numel(), dtype=f64)
        jacobians = torch.autograd.grad(flat, deltas, grad_outputs=eye, is_grads_batched=True, retain_graph=True,
                                        allow_unused=True)
        first_order = sum((jac.abs() * (2 * b)).reshape(flat.numel(), -1).sum(dim=1)
                          for jac, b in zip(jacobians, bounds) if jac is not None)
        out[step] = 2 * first_order
    return out


# ---------------------------------------------------------------------- the ranks' side


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3)).to(dtype)


def _sharded_model(mesh, dtype=torch.float32):
    from torch.distributed.fsdp import fully_shard

    model = _model(dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank: int, step: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 5, generator=gen, dtype=dtype), torch.randn(8, 3, generator=gen, dtype=dtype)


def _backward(model, rank: int, step: int):
    x, y = _batch(rank, step, next(model.parameters()).dtype)
    torch.nn.functional.mse_loss(model(x), y).backward()


CASES = {
    "SparseAdaGrad": ("SparseAdaGrad", dict(lr=0.05, density=1.0, block_size=16), None),
    "MFAC": ("MFAC", dict(lr=0.01, ngrads=NGRADS, damp=0.1), ("mfac", "damp")),
    "SparseMFAC": ("SparseMFAC", dict(lr=0.01, ngrads=NGRADS, damp=0.1, density=1.0, block_size=16), ("mfac", "damp")),
    "GGT": ("GGT", dict(lr=0.01, ngrads=NGRADS, eps=0.1), ("ggt", "eps")),
    "SparseGGT": ("SparseGGT", dict(lr=0.01, ngrads=NGRADS, eps=0.1, density=1.0, block_size=16), ("ggt", "eps")),
    "FlatSGD": ("FlatSGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True), None),
}
# LowRankMFAC at a step size where the runs' rounding shows in the parameters (at lr = 0.01 it drowns in theta's).
LOWRANK = ("LowRankMFAC", dict(lr=0.5, ngrads=NGRADS, damp=0.1, rank=2), ("lowrank", "damp"))
# What the checkpoint cases add to CASES' settings: a selection below density 1, momentum.
CHECKPOINT_SETTINGS = {
    "MFAC": dict(),  # CASES' settings: no momentum, so that _window_bound bounds the resumed run
    "GGT": dict(),
    "LowRankMFAC": dict(momentum=0.5),
    "SparseMFAC": dict(density=0.3, block_size=8, momentum=0.5),
    "SparseAdaGrad": dict(density=0.5, block_size=8),
    "FlatSGD": dict(),  # CASES' momentum already puts a momentum buffer in the checkpoint
    "FOSI": dict(),  # FOSI_CHECKPOINT_KW
}
# The optimizers whose state is per coordinate and laid out like the parameter, or the same on every rank (a dense
# window's m x m Gram matrix and counters; FOSI's Ritz values): a checkpoint of them reshards.
RESHARDABLE = ("FlatSGD", "SparseAdaGrad", "MFAC", "GGT", "LowRankMFAC", "FOSI")
# Of those, the ones whose steps sum over coordinates (the window's products): resumed on another number of ranks
# they differ from the uninterrupted run by the order of those sums, within _window_bound.
SUMS_OVER_COORDINATES = ("MFAC", "GGT")
# Of those, the ones whose sharded arithmetic sums in another order than the plain one's, on 1 rank too (FOSI's dot
# products and norms, LowRankMFAC's power iteration over the ranks' rows), and for which no bound on a resumed run
# is derived here: a checkpoint resumed on 1 rank is compared with a sharded twin given the whole saved state.
SHARDED_TWIN_COMPARED = ("LowRankMFAC", "FOSI")


def _optimizer(name: str, params, **overrides):
    import tritonopt

    cls_name, kwargs, _ = LOWRANK if name == "LowRankMFAC" else CASES[name]
    return getattr(tritonopt.optim, cls_name)(params, **{**kwargs, **overrides})


def _model_optimizer(name: str, model, **overrides):
    """``_optimizer`` over ``model``'s parameters; FOSI's curvature loss is ``model``'s on the ESE batch."""
    import tritonopt

    if name == "FOSI":
        loss = _CurvatureLoss(model, dtype=next(model.parameters()).dtype)
        return tritonopt.optim.FOSI(model.parameters(), curvature_loss_fn=loss, **{**FOSI_CHECKPOINT_KW, **overrides})
    return _optimizer(name, model.parameters(), **overrides)


def _unsharded_optimizer(name: str, model, **overrides):
    """``_model_optimizer`` over a plain ``model``; FOSI with the central differences a sharded one uses by default,
    so that both compute the same Hessian-vector products."""
    if name == "FOSI":
        overrides = {"hvp": "central_difference", **overrides}
    return _model_optimizer(name, model, **overrides)


def _compare_fsdp(rank, mesh, name):
    """A fully_shard'ed model under ``name`` beside a plain copy stepped with the same (gathered) gradients,
    with clip_grad_norm_ on the DTensor gradients, a StepLR schedule and zero_grad(set_to_none=True)."""
    model, reference = _sharded_model(mesh), _model()
    opt, ref_opt = _optimizer(name, model.parameters()), _optimizer(name, reference.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_schedule = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    largest_gap, budget, exact = 0.0, 0.0, True
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.full_tensor()
        lr = ref_opt.param_groups[0]["lr"]
        opt.step()
        ref_opt.step()
        schedule.step()
        ref_schedule.step()
        kind = CASES[name][2]
        if kind is not None:
            # The updates' differences add up: lr * du per step, and each parameter's own
            # float32 rounding of theta - lr u (one unit of |theta|) where theta already differs.
            flat_theta = torch.cat([q.detach().reshape(-1) for q in reference.parameters()]).double()
            budget_now = lr * _window_bound(ref_opt, CASES[name][1][kind[1]], kind[0]) + 2 * U32 * flat_theta.abs()
            budget = budget + budget_now
        sharded = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
        plain = torch.cat([q.detach().reshape(-1) for q in reference.parameters()])
        exact = exact and torch.equal(sharded, plain)
        if kind is not None:
            largest_gap = max(largest_gap, float(((sharded.double() - plain.double()).abs() / budget).max()))
    opt.zero_grad(set_to_none=True)
    return {"exact": exact, "gap_over_bound": largest_gap, "lr": opt.param_groups[0]["lr"],
            "grads_none": all(p.grad is None for p in model.parameters())}


def _explicit_dtensors(rank, mesh, name, placements=None, src_data_rank=0):
    """Shard(0) and Replicate() DTensors set by hand (a replicated bias counts 1/world on each rank), beside plain
    tensors with the same gradients: the largest gap (over the bound, for a window), the bytes all-reduced, the
    state's size and the window's local shape, the first parameter's local state and the shard spec.

    ``placements`` (one list per parameter) lay them out on another mesh; ``src_data_rank=None`` takes each
    rank's gradient as it is, unscattered (an HSDP mesh's replicas hold the same)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(1)
    fulls = [torch.randn(13, 5), torch.randn(3, 13), torch.randn(7)]
    placements = placements or [[Shard(0)], [Shard(0)], [Replicate()]]
    params = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, pl)) for f, pl in zip(fulls, placements)]
    plain = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt, ref_opt = _optimizer(name, params), _optimizer(name, plain)
    gap, budget = 0.0, 0.0
    kind = CASES[name][2]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(f.shape, generator=gen) for f in fulls]
        for p, q, g, pl in zip(params, plain, grads, placements):
            p.grad = distribute_tensor(g.clone(), mesh, pl, src_data_rank=src_data_rank)
            q.grad = g.clone()
        opt.step()
        ref_opt.step()
        sharded = torch.cat([p.full_tensor().detach().reshape(-1) for p in params]).double()
        reference = torch.cat([q.detach().reshape(-1) for q in plain]).double()
        if kind is None:
            gap = max(gap, float((sharded - reference).abs().max()))
            continue
        lr = CASES[name][1]["lr"]
        budget = budget + lr * _window_bound(ref_opt, CASES[name][1][kind[1]], kind[0]) + 2 * U32 * reference.abs()
        gap = max(gap, float(((sharded - reference).abs() / budget).max()))
    first = opt.state[params[0]]
    return {"gap": gap, "bytes": opt.shard_group.bytes_all_reduced, "calls": opt.shard_group.all_reduce_calls,
            "state_bytes": opt.state_bytes(), "expected_state_bytes": opt.expected_state_bytes()
            if hasattr(opt, "expected_state_bytes") else None,
            "ref_state_bytes": ref_opt.state_bytes(),
            "window_shape": tuple(first["ring_grads"].shape) if "ring_grads" in first else None,
            "local_state": {key: value.clone() for key, value in first.items() if isinstance(value, torch.Tensor)},
            "spec": tuple(getattr(opt.shard_group.spec, key, None) for key in ("world", "rank", "replicas", "replica"))}


def _lowrank_explicit(rank, mesh, placements=None, src_data_rank=0):
    """LowRankMFAC on Shard(0) matrices (13 rows: 7 and 6; 3 rows: 2 and 1) and a Replicate() vector, beside the
    plain run with the same gradients: both runs' parameters after every step, and the bytes all-reduced.

    ``placements`` (one list per parameter) lay them out on another mesh; ``src_data_rank=None`` takes each
    rank's gradient as it is, unscattered (an HSDP mesh's replicas hold the same)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(1)
    fulls = [torch.randn(13, 5), torch.randn(3, 13), torch.randn(7)]
    placements = placements or [[Shard(0)], [Shard(0)], [Replicate()]]
    params = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, pl)) for f, pl in zip(fulls, placements)]
    plain = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt, ref_opt = _optimizer("LowRankMFAC", params), _optimizer("LowRankMFAC", plain)
    sharded, reference, steps_grads = [], [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(f.shape, generator=gen) for f in fulls]
        steps_grads.append(grads)
        for p, q, g, pl in zip(params, plain, grads, placements):
            p.grad = distribute_tensor(g.clone(), mesh, pl, src_data_rank=src_data_rank)
            q.grad = g.clone()
        opt.step()
        ref_opt.step()
        sharded.append(torch.cat([p.full_tensor().detach().reshape(-1) for p in params]))
        reference.append(torch.cat([q.detach().reshape(-1) for q in plain]))
    return {"fulls": fulls, "grads": steps_grads, "sharded": sharded, "reference": reference,
            "bytes": opt.shard_group.bytes_all_reduced, "calls": opt.shard_group.all_reduce_calls,
            "local_rows": [tuple(opt.state[p]["ring_p"].shape) for p in params],
            "state_bytes": opt.state_bytes(), "expected_state_bytes": opt.expected_state_bytes()}


# FOSI on float64 parameters: one ESE (before the first update) of 6 Lanczos iterations keeping the 2 largest
# Ritz pairs, then Adam steps with the Newton step on them.
FOSI_KW = dict(lr=0.01, k=2, num_lanczos_iters=6, alpha=0.5, curvature_update_every=100)
FOSI_STEPS = 3
# The checkpoint case: float32, an ESE every other step (so the resumed steps run one), a velocity in the state.
FOSI_CHECKPOINT_KW = dict(lr=0.01, k=2, num_lanczos_iters=4, curvature_update_every=2, g1_momentum=0.5)


def _ese_batch(dtype=torch.float64):
    """The curvature loss's batch: fixed, the same on every rank (FSDP2 averages the ranks' gradients)."""
    gen = torch.Generator().manual_seed(7)
    return torch.randn(8, 5, generator=gen, dtype=dtype), torch.randn(8, 3, generator=gen, dtype=dtype)


def _mlp(params, x):
    """``_model``'s function on its four parameters (DTensors are gathered whole, differentiably)."""
    w1, b1, w2, b2 = (p.full_tensor() if hasattr(p, "full_tensor") else p for p in params)
    return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, w1, b1)), w2, b2)


class _CurvatureLoss:
    """The mean squared error on the ESE batch, of a model or of ``_mlp`` on a parameter list."""

    def __init__(self, model=None, params=None, dtype=torch.float64):
        self.model, self.params = model, params
        self.x, self.y = _ese_batch(dtype)

    def __call__(self):
        out = self.model(self.x) if self.model is not None else _mlp(self.params, self.x)
        return torch.nn.functional.mse_loss(out, self.y)


def _flat(params):
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1) for p in params])


def _fosi_fsdp(rank, mesh):
    """FOSI on a float64 fully_shard'ed model (central-difference products, its default there) beside FOSI with the
    same products on the plain model and torch's Adam, both given the sharded run's gradients, gathered."""
    import tritonopt

    model, reference, base_model = _sharded_model(mesh, torch.float64), _model(torch.float64), _model(torch.float64)
    theta0 = _flat(reference.parameters())
    opt = tritonopt.optim.FOSI(model.parameters(), curvature_loss_fn=_CurvatureLoss(model), **FOSI_KW)
    ref_opt = tritonopt.optim.FOSI(reference.parameters(), curvature_loss_fn=_CurvatureLoss(reference),
                                   hvp="central_difference", **FOSI_KW)
    base = torch.optim.Adam(base_model.parameters(), lr=FOSI_KW["lr"])
    grads = []
    for step in range(FOSI_STEPS):
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, step)
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        for q, b, g in zip(reference.parameters(), base_model.parameters(), grads[-1]):
            q.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        base.step()
        if step == 0:  # the ESE's gradient differences ran backward(): the step's own gradients are back
            grads_kept = all(torch.equal(p.grad.full_tensor(), g) for p, g in zip(model.parameters(), grads[0]))
    out = {"sharded": _flat(model.parameters()), "plain": _flat(reference.parameters()),
           "base": _flat(base_model.parameters()), "theta0": theta0, "grads": grads,
           "bytes": opt.shard_group.bytes_all_reduced, "calls": opt.shard_group.all_reduce_calls,
           "eigenvalues": (opt.eigenvalues, ref_opt.eigenvalues), "d_shape": opt.last_lanczos["basis_shape"],
           "grads_kept": grads_kept}
    try:  # no double backward reaches fully_shard's parameters: named, with the product that works
        other = _sharded_model(mesh, torch.float64)
        tritonopt.optim.FOSI(other.parameters(), curvature_loss_fn=_CurvatureLoss(other), hvp="double_backward",
                             **FOSI_KW).update_curvature()
        out["double_backward"] = None
    except ValueError as error:
        out["double_backward"] = str(error)
    return out


def _fosi_explicit(rank, mesh):
    """FOSI on Shard(0) parameters (13 rows: 7 and 6; 3 rows: 2 and 1) and a Replicate() one, whose loss is DTensor
    arithmetic, beside the plain parameters with the same gradients; and the double-backward products of both."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import tritonopt
    from tritonopt.optim.lanczos import make_hvp, start_vector

    torch.manual_seed(1)
    fulls = [torch.randn(13, 5, dtype=torch.float64), torch.randn(13, dtype=torch.float64),
             torch.randn(3, 13, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    placements = [[Shard(0)], [Shard(0)], [Shard(0)], [Replicate()]]
    params = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, pl)) for f, pl in zip(fulls, placements)]
    plain = [torch.nn.Parameter(f.clone()) for f in fulls]
    # One vector through both double-backward products (at the same weights): each rank's coordinates of the
    # plain product.
    v = start_vector(sum(f.numel() for f in fulls), 3)
    pieces = v.split([f.numel() for f in fulls])
    local_v = torch.cat([distribute_tensor(x.reshape(f.shape), mesh, pl).to_local().reshape(-1)
                         for x, f, pl in zip(pieces, fulls, placements)])
    sharded_hv = make_hvp(params, _CurvatureLoss(params=params))(local_v)
    whole_hv = make_hvp(plain, _CurvatureLoss(params=plain))(v).split([f.numel() for f in fulls])
    expected = torch.cat([distribute_tensor(x.reshape(f.shape), mesh, pl).to_local().reshape(-1)
                          for x, f, pl in zip(whole_hv, fulls, placements)])
    base_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt = tritonopt.optim.FOSI(params, curvature_loss_fn=_CurvatureLoss(params=params), **FOSI_KW)
    ref_opt = tritonopt.optim.FOSI(plain, curvature_loss_fn=_CurvatureLoss(params=plain), hvp="central_difference",
                                   **FOSI_KW)
    base = torch.optim.Adam(base_params, lr=FOSI_KW["lr"])
    grads = []
    for step in range(FOSI_STEPS):
        gen = torch.Generator().manual_seed(step)
        grads.append([0.1 * torch.randn(f.shape, generator=gen, dtype=torch.float64) for f in fulls])
        for p, q, b, g, pl in zip(params, plain, base_params, grads[-1], placements):
            p.grad = distribute_tensor(g.clone(), mesh, pl)
            q.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        base.step()
    return {"sharded": _flat(params), "plain": _flat(plain), "base": _flat(base_params),
            "theta0": torch.cat([f.reshape(-1) for f in fulls]), "grads": grads, "bytes": opt.shard_group.bytes_all_reduced,
            "calls": opt.shard_group.all_reduce_calls, "double_backward_equal": torch.equal(sharded_hv, expected),
            "eigenvectors": tuple(opt.state[params[3]]["eigenvectors"].shape)}


def _refusals(rank, mesh):
    import tritonopt

    model = _sharded_model(mesh)
    attempts = {
        "DHO2": lambda: tritonopt.dist.DHO2(model.parameters(), lr=0.1),
        "KFACPreconditioner": lambda: tritonopt.optim.KFACPreconditioner(model),
        "track_error_norm": lambda: tritonopt.optim.SparseMFAC(model.parameters(), track_error_norm=True),
        "mixed": lambda: tritonopt.optim.MFAC([*model.parameters(), torch.nn.Parameter(torch.zeros(3))]),
        "disagree": lambda: tritonopt.optim.MFAC(model.parameters(), lr=0.1 * (rank + 1), ngrads=NGRADS),
        "fosi_disagree": lambda: tritonopt.optim.FOSI(model.parameters(), k=2 + rank, hvp_eps=1e-3),
    }
    return refusals_of(attempts)


def _skip_together(rank, mesh):
    """A NaN, or an inf, in one rank's shard makes both ranks skip the step (no rank waits on the other's
    all-reduce)."""
    import warnings

    out = {}
    for bad in ("nan", "inf", "-inf"):
        model = _sharded_model(mesh)
        opt = _optimizer("MFAC", model.parameters())
        _backward(model, rank, 0)
        if rank == 1:
            next(model.parameters()).grad.to_local()[0, 0] = float(bad)
        before = [p.to_local().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        out[bad] = {"skipped": opt.skipped_steps,
                    "unchanged": all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())),
                    "says_nonfinite": any("NaN or inf" in str(w.message) for w in caught)}
    return out


def _flat_sgd_together(rank, mesh):
    """FlatSGD's shared decisions: a NaN, or an update that overflows, on rank 1's shard only; a group of which
    rank 1 holds no row, beside a float32 and a bfloat16 one, equal to the plain run."""
    import warnings

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import tritonopt

    out = {}
    for case in ("nan", "overflow", "raise"):
        model = _sharded_model(mesh)
        opt = _optimizer("FlatSGD", model.parameters(), on_nonfinite="raise" if case == "raise" else "skip")
        _backward(model, rank, 0)
        if rank == 1:
            # A finite gradient whose update overflows float32 on rank 1 only (rank 0's own update is finite).
            next(model.parameters()).grad.to_local()[0, 0] = 3e38 if case == "overflow" else float("nan")
        before = [p.to_local().clone() for p in model.parameters()]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
            raised = None
        except FloatingPointError as error:
            raised = str(error)
        out[case] = {"skipped": opt.skipped_steps, "raised": raised, "state": sum(bool(entry) for entry in opt.state.values()),
                     "unchanged": all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())),
                     "bytes": opt.shard_group.bytes_all_reduced, "calls": opt.shard_group.all_reduce_calls}

    torch.manual_seed(2)
    fulls = [torch.randn(1, 3), torch.randn(13, 5), torch.randn(7), torch.randn(3, 4)]
    placements = [[Shard(0)], [Shard(0)], [Replicate()], [Shard(0)]]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.bfloat16]
    params = [torch.nn.Parameter(distribute_tensor(f.to(dt), mesh, pl)) for f, pl, dt in zip(fulls, placements, dtypes)]
    plain = [torch.nn.Parameter(f.to(dt)) for f, dt in zip(fulls, dtypes)]
    groups = lambda ps: [{"params": ps[:1]}, {"params": ps[1:3], "momentum": 0.5}, {"params": ps[3:]}]  # noqa: E731
    opt = tritonopt.optim.FlatSGD(groups(params), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = tritonopt.optim.FlatSGD(groups(plain), lr=0.1, momentum=0.9, weight_decay=0.01)
    exact = True
    for step in range(3):
        gen = torch.Generator().manual_seed(10 + step)
        grads = [torch.randn(f.shape, generator=gen).to(dt) for f, dt in zip(fulls, dtypes)]
        for p, q, g, pl in zip(params, plain, grads, placements):
            p.grad = distribute_tensor(g.clone(), mesh, pl)
            q.grad = g.clone()
        opt.step()
        ref_opt.step()
        exact = exact and all(torch.equal(p.full_tensor(), q.detach()) for p, q in zip(params, plain))
    out["groups"] = {"exact": exact, "local_rows": params[0].to_local().shape[0],
                     "bytes": opt.shard_group.bytes_all_reduced, "calls": opt.shard_group.all_reduce_calls,
                     "momentum_local": tuple(opt.state[params[1]]["momentum_buffer"].shape)}
    return out


def _run(model, opt, rank, steps, gradients=None):
    """``steps`` of training; the parameters after them, whole. ``gradients``: a list that gets each step's
    gradients, whole (what the ranks' shards make together)."""
    for step in steps:
        opt.zero_grad(set_to_none=True)
        _backward(model, rank, step)
        if gradients is not None:
            gradients.append([p.grad.full_tensor() for p in model.parameters()])
        opt.step()
    return _whole(model)


def _whole(model):
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _whole_state(opt) -> dict:
    """``opt.state_dict()``'s per-parameter state with every DTensor gathered whole (a collective); copies, which
    later steps leave as they are."""
    return {key: {name: value.full_tensor() if hasattr(value, "full_tensor") else copy.deepcopy(value)
                  for name, value in entry.items()}
            for key, entry in opt.state_dict()["state"].items()}


def same_whole_state(state: dict, saved: dict) -> bool:
    """Whether two ``_whole_state`` results hold the same entries, bit for bit and in the same dtypes."""
    return state.keys() == saved.keys() and all(
        set(state[key]) == set(entry) and all(
            torch.equal(mine := state[key][name], value) and mine.dtype == value.dtype
            if isinstance(value, torch.Tensor) else state[key][name] == value
            for name, value in entry.items())
        for key, entry in saved.items())


def _checkpoints(rank, mesh, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import tritonopt

    results, saved_on_two = {}, {}
    for name, kwargs in CHECKPOINT_SETTINGS.items():
        model = _sharded_model(mesh)
        opt = _model_optimizer(name, model, **kwargs)
        _run(model, opt, rank, range(3))
        path = f"{directory}/{name}"
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        buffer = io.BytesIO()
        torch.save({"model": [p.detach().clone() for p in model.parameters()], "optim": opt.state_dict()}, buffer)
        saved_on_two[name] = {"params": _whole(model), "per_rank": opt.state_dict(),
                              "gradients": []}
        if name in RESHARDABLE:
            saved_on_two[name]["state"] = _whole_state(opt)
        uninterrupted = _run(model, opt, rank, range(3, STEPS), saved_on_two[name]["gradients"])
        saved_on_two[name]["uninterrupted"] = uninterrupted

        model2 = _sharded_model(mesh)
        opt2 = _model_optimizer(name, model2, **kwargs)
        template = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(template, checkpoint_id=path)
        set_model_state_dict(model2, template["model"])
        set_optimizer_state_dict(model2, opt2, template["optim"])
        via_dcp = _run(model2, opt2, rank, range(3, STEPS))

        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        model3 = _sharded_model(mesh)
        opt3 = _model_optimizer(name, model3, **kwargs)
        with torch.no_grad():
            for p, value in zip(model3.parameters(), saved["model"]):
                p.copy_(value)
        opt3.load_state_dict(saved["optim"])
        via_state_dict = _run(model3, opt3, rank, range(3, STEPS))

        plain = _model_optimizer(name, _model(), **kwargs)
        try:
            plain.load_state_dict(saved["optim"])
            refused = None
        except ValueError as error:
            refused = str(error)
        results[name] = {"dcp": torch.equal(via_dcp, uninterrupted),
                         "state_dict": torch.equal(via_state_dict, uninterrupted), "unsharded_refused": refused}
    results["one_rank"] = _resume_on_one_rank(rank, directory, saved_on_two)
    return results


def _load_dcp(model, opt, path, group, no_dist=False):
    """The checkpoint at ``path`` into ``model`` and ``opt`` through torch.distributed.checkpoint over ``group``
    (``no_dist``: in this process alone, a plain model's way); None, or the refusal as text."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        template = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(template, checkpoint_id=path, process_group=group, no_dist=no_dist)
        set_model_state_dict(model, template["model"])
        set_optimizer_state_dict(model, opt, template["optim"])
    except (ValueError, CheckpointException) as error:  # DCP's own refusals come wrapped (a BaseException)
        return f"{type(error).__name__}: {error}"
    return None


def _plain_template_optimizer(name, model, **kwargs):
    """``_unsharded_optimizer`` over a plain ``model``, with state for get_optimizer_state_dict's template. torch creates it
    by a step at lr 0 with zero gradients, unless gradients are attached: a plain FlatSGD's flat gradients are, from
    construction, so that step is taken here (the loaded checkpoint replaces what it wrote)."""
    opt = _unsharded_optimizer(name, model, **kwargs)
    if name == "FlatSGD":
        lrs = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = 0.0
        opt.step()
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
    return opt


def _resume_on_one_rank(rank, directory, saved_on_two):
    """Each 2-rank checkpoint loaded on 1 rank (a 1-rank mesh over rank 0); where it loads, the state against the
    2 ranks' at saving, gathered, and 2 more steps with the 2-rank run's gradients against that run and against
    plain tensors stepped from the gathered state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    group = dist.new_group([0])  # every rank takes part in making it; rank 1 then has nothing to do
    if rank != 0:
        return None
    mesh = DeviceMesh.from_group(group, "cpu")
    results = {}
    for name, kwargs in CHECKPOINT_SETTINGS.items():
        saved, path = saved_on_two[name], f"{directory}/{name}"
        model = _sharded_model(mesh)
        opt = _model_optimizer(name, model, **kwargs)
        seen = {"dcp_refused": _load_dcp(model, opt, path, group)}
        try:
            _model_optimizer(name, _sharded_model(mesh), **kwargs).load_state_dict(saved["per_rank"])
            seen["per_rank_refused"] = None
        except ValueError as error:
            seen["per_rank_refused"] = str(error)
        if seen["dcp_refused"] is None:
            params = list(model.parameters())
            seen["params_equal"] = torch.equal(_whole(model), saved["params"])
            # Each entry as the 2 ranks' state_dict() showed it, gathered whole (a window's rows unpadded).
            seen["state_equal"] = same_whole_state(_whole_state(opt), saved["state"])
            # The plain run from the same state: the 2 ranks' state dict with every entry gathered whole.
            plain_model = _model()
            with torch.no_grad():
                for q, value in zip(plain_model.parameters(), saved["params"].split([q.numel() for q in params])):
                    q.copy_(value.reshape(q.shape))
            plain = _unsharded_optimizer(name, plain_model, **kwargs)
            plain.load_state_dict({**saved["per_rank"], "state": saved["state"]})
            # The checkpoint itself loaded into a plain model in this one process.
            dcp_model = _model()
            dcp_opt = _plain_template_optimizer(name, dcp_model, **kwargs)
            seen["plain_dcp_refused"] = _load_dcp(dcp_model, dcp_opt, path, None, no_dist=True)
            # The twin: a sharded optimizer on this mesh given the whole saved state by load_state_dict.
            twin_model = twin = None
            if name in SHARDED_TWIN_COMPARED:
                twin_model = _sharded_model(mesh)
                with torch.no_grad():
                    for p, value in zip(twin_model.parameters(), saved["params"].split([p.numel() for p in params])):
                        p.to_local().copy_(value.reshape(p.shape))
                twin = _model_optimizer(name, twin_model, **kwargs)
                twin.load_state_dict({**saved["per_rank"], "state": saved["state"]})
            kind = CASES[name][2] if name in CASES else None
            budget = torch.zeros(())
            for gradients in saved["gradients"]:
                for p, q, r, whole in zip(params, plain_model.parameters(), dcp_model.parameters(), gradients):
                    p.grad = DTensor.from_local(whole.clone(), mesh, p.placements, run_check=False)
                    q.grad, r.grad = whole.clone(), whole.clone()
                opt.step()
                plain.step()
                dcp_opt.step()
                if twin is not None:
                    for p, whole in zip(twin_model.parameters(), gradients):
                        p.grad = DTensor.from_local(whole.clone(), mesh, p.placements, run_check=False)
                    twin.step()
                if name in SUMS_OVER_COORDINATES:  # as in _compare_fsdp: lr * du, and theta's own rounding
                    theta = torch.cat([q.detach().reshape(-1) for q in plain_model.parameters()]).double()
                    budget = budget + (CASES[name][1]["lr"] * _window_bound(plain, CASES[name][1][kind[1]], kind[0])
                                       + 2 * U32 * theta.abs())
            resumed = _whole(model)
            plain_params = torch.cat([q.detach().reshape(-1) for q in plain_model.parameters()])
            seen["equals_plain"] = torch.equal(resumed, plain_params)
            seen["equals_twin"] = twin is not None and torch.equal(resumed, _whole(twin_model))
            seen["plain_dcp_equal"] = seen["plain_dcp_refused"] is None and torch.equal(
                torch.cat([r.detach().reshape(-1) for r in dcp_model.parameters()]), plain_params)
            seen["equals_two_ranks"] = torch.equal(resumed, saved["uninterrupted"])
            if name in SUMS_OVER_COORDINATES:
                gap = (resumed.double() - saved["uninterrupted"].double()).abs() / budget
                seen["gap_over_bound"] = float(gap.max())
        results[name] = seen
    return results


def _resume_from_unsharded(rank, mesh, directory):
    """Each reshardable optimizer trained 3 steps on the plain model (the same run in every process), saved by rank 0
    alone through torch.distributed.checkpoint, then loaded on the mesh's sharded model: its weights and state,
    gathered whole, against the plain run's, and 2 more steps with the same gradients against that run."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import distribute_tensor

    results = {}
    for name in RESHARDABLE:
        kwargs, path = CHECKPOINT_SETTINGS[name], f"{directory}/unsharded-{name}"
        plain_model = _model()
        plain = _unsharded_optimizer(name, plain_model, **kwargs)
        for step in range(3):
            plain.zero_grad(set_to_none=True)
            _backward(plain_model, 0, step)
            plain.step()
        if rank == 0:
            dcp.save({"model": get_model_state_dict(plain_model), "optim": get_optimizer_state_dict(plain_model, plain)},
                     checkpoint_id=path, no_dist=True)
        dist.barrier()
        model = _sharded_model(mesh)
        opt = _model_optimizer(name, model, **kwargs)
        seen = {"refused": _load_dcp(model, opt, path, None)}
        if seen["refused"] is None:
            seen["params_equal"] = torch.equal(_whole(model), _flat(plain_model.parameters()))
            seen["state_equal"] = same_whole_state(_whole_state(opt), _whole_state(plain))
            for step in range(2):
                gen = torch.Generator().manual_seed(50 + step)
                for p, q in zip(model.parameters(), plain_model.parameters()):
                    whole = 0.1 * torch.randn(q.shape, generator=gen)
                    p.grad = distribute_tensor(whole.clone(), mesh, p.placements, src_data_rank=None)
                    q.grad = whole
                opt.step()
                plain.step()
            seen["steps_equal"] = torch.equal(_whole(model), _flat(plain_model.parameters()))
        results[name] = seen
    return results


def _scenario(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    out = {"fsdp": {}, "explicit": {}}
    for name in CASES:
        out["fsdp"][name] = _compare_fsdp(rank, mesh, name)
        out["explicit"][name] = _explicit_dtensors(rank, mesh, name)
    out["lowrank"] = _lowrank_explicit(rank, mesh)
    out["fosi_fsdp"] = _fosi_fsdp(rank, mesh)
    out["fosi_explicit"] = _fosi_explicit(rank, mesh)
    out["refusals"] = _refusals(rank, mesh)
    out["skip"] = _skip_together(rank, mesh)
    out["flat_sgd"] = _flat_sgd_together(rank, mesh)
    out["checkpoints"] = _checkpoints(rank, mesh, directory)
    out["from_unsharded"] = _resume_from_unsharded(rank, mesh, directory)
    out["local_rows"] = [p.to_local().shape[0] for p in _sharded_model(mesh).parameters()]
    out["kaisa"] = kaisa_scenario(rank, mesh, directory)
    out["stall"] = stall_scenario(rank, world)  # last: it breaks the group it makes
    return out


# ---------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(WORLD, _scenario, str(tmp_path_factory.mktemp("dcp")), timeout=400)


def test_shapes_are_uneven(ranks):
    assert ranks[0]["local_rows"] == [7, 7, 2, 2] and ranks[1]["local_rows"] == [6, 6, 1, 1]


@pytest.mark.parametrize("name", list(CASES))
def test_fully_sharded_model_equals_unsharded(ranks, name):
    for result in ranks:
        seen = result["fsdp"][name]
        if CASES[name][2] is None:  # every entry kept: elementwise, so bit for bit
            assert seen["exact"]
        else:
            assert seen["gap_over_bound"] <= 1.0, seen
        assert seen["lr"] == pytest.approx(CASES[name][1]["lr"] * 0.5 ** (STEPS // 2))  # the scheduler reached it
        assert seen["grads_none"]


@pytest.mark.parametrize("name", list(CASES))
def test_shard_and_replicate_placements_equal_unsharded(ranks, name):
    for result in ranks:
        seen = result["explicit"][name]
        if CASES[name][2] is None:
            assert seen["gap"] == 0.0
        else:
            assert seen["gap"] <= 1.0, seen


@pytest.mark.parametrize("name", ["MFAC", "SparseMFAC", "GGT", "SparseGGT"])
def test_one_all_reduce_of_m_products_per_step(ranks, name):
    # Per step: the m float64 products, and one float32 for the ranks' common gradient-norm check.
    for result in ranks:
        seen = result["explicit"][name]
        assert seen["bytes"] == STEPS * (8 * NGRADS + 4)
        assert seen["calls"] == 2 * STEPS


@pytest.mark.parametrize("name", ["MFAC", "GGT"])
def test_each_rank_keeps_its_share_of_the_window(ranks, name):
    d = 13 * 5 + 3 * 13 + 7
    span = 7 * 5 + 2 * 13 + 7  # rank 0's part, the fullest: every rank's window is padded to it
    for result in ranks:
        seen = result["explicit"][name]
        assert seen["window_shape"] == (NGRADS, span)
        assert seen["state_bytes"] == seen["expected_state_bytes"]
        replicated = 8 * NGRADS * NGRADS + 4 * 3  # dots and the three step counters
        # the window's columns and the packed gradient; sharded, also the replicated bias's column weights
        assert seen["ref_state_bytes"] == replicated + 4 * NGRADS * d + 4 * d
        assert seen["state_bytes"] == replicated + 4 * NGRADS * span + 2 * 4 * span


def test_lowrank_mfac_on_shard_and_replicate_placements_equals_unsharded(ranks):
    seen = ranks[0]["lowrank"]
    _, kwargs, _ = LOWRANK
    # The first step (the window's first row) and the last (every difference carried through the error
    # feedback, the warm starts and a full window).
    bounds = _lowrank_bound(seen["fulls"], seen["grads"], kwargs["lr"], kwargs["rank"], kwargs["ngrads"],
                            kwargs["damp"], checked={0, STEPS - 1})
    for result in ranks:
        sharded, reference = result["lowrank"]["sharded"], result["lowrank"]["reference"]
        gaps = [float(((sharded[k].double() - reference[k].double()).abs() / bound).max())
                for k, bound in bounds.items()]
        assert max(gaps) <= 1.0, gaps
    # The runs do differ (the sums' order): the bound is what holds, not equality.
    assert any(not torch.equal(a, b) for a, b in zip(seen["sharded"], seen["reference"]))


def test_lowrank_mfac_all_reduces_the_stated_bytes_per_step(ranks):
    # Per step, T = 2 row-sharded matrices (13 x 5 and 3 x 13) at rank r = 2: Gram-Schmidt's
    # 4 T (r + r (r - 1) / 2 + r - 1) bytes in 2 r - 1 calls, Q = E^T P's 4 r sum_l p_l in one,
    # the window's m float64 products and the shared float32 gradient check (the replicated
    # vector adds nothing).
    r, tensors, columns = 2, 2, 5 + 13
    per_step = 4 * tensors * (r + r * (r - 1) // 2 + r - 1) + 4 * r * columns + 8 * NGRADS + 4
    for result in ranks:
        seen = result["lowrank"]
        assert seen["bytes"] == STEPS * per_step and seen["calls"] == STEPS * (2 * r + 2)
        assert seen["state_bytes"] == seen["expected_state_bytes"]
    # Each rank holds its rows of ring_p; the replicated vector's whole.
    assert ranks[0]["lowrank"]["local_rows"] == [(NGRADS, 7, 2), (NGRADS, 2, 2), (NGRADS, 7, 2)]
    assert ranks[1]["lowrank"]["local_rows"] == [(NGRADS, 6, 2), (NGRADS, 1, 2), (NGRADS, 7, 2)]


def _fosi_bound(seen):
    """The replay's final parameters and the bound on two runs' distance (``_fosi_replay``) for a FOSI case."""
    from _fosi_replay import fosi_bound

    grads = [torch.cat([g.reshape(-1) for g in step]) for step in seen["grads"]]
    kwargs = {key: FOSI_KW[key] for key in ("lr", "k", "num_lanczos_iters", "alpha")}
    return fosi_bound(seen["theta0"], [(13, 5), (13,), (3, 13), (3,)], _ese_batch(), grads, **kwargs)


@pytest.fixture(scope="module")
def fosi_bounds(ranks):
    return {case: _fosi_bound(ranks[0][case]) for case in ("fosi_fsdp", "fosi_explicit")}


@pytest.mark.parametrize("case", ["fosi_fsdp", "fosi_explicit"])
def test_fosi_on_sharded_parameters_equals_unsharded_within_the_rounding_bound(ranks, fosi_bounds, case):
    # FOSI on a fully_shard'ed model, and on Shard(0) and Replicate() parameters whose loss is DTensor arithmetic,
    # against FOSI on the plain parameters with the same central-difference products and gradients:
    # _fosi_replay derives the float64 bound on what the other order of the sums over coordinates can change.
    replayed, bound = fosi_bounds[case]
    for result in ranks:
        seen = result[case]
        assert float(((seen["sharded"] - seen["plain"]).abs() / bound).max()) <= 1.0
        assert torch.equal(seen["sharded"], ranks[0][case]["sharded"])  # both ranks hold the same model
    # The replay is FOSI's computation: it lands within the same bound of the plain run.
    assert float(((replayed - ranks[0][case]["plain"]).abs() / bound).max()) <= 1.0


@pytest.mark.parametrize("case", ["fosi_fsdp", "fosi_explicit"])
def test_fosi_on_sharded_parameters_is_not_its_base_optimizer(ranks, fosi_bounds, case):
    # Adam alone, given the same gradients, ends outside the bound on every coordinate: the equality above
    # holds for FOSI's Newton step, not for a run without it.
    _, bound = fosi_bounds[case]
    seen = ranks[0][case]
    assert bool(((seen["base"] - seen["plain"]).abs() > bound).all())


def test_fosi_keeps_the_sharded_models_gradients_and_refuses_a_double_backward_through_fsdp(ranks):
    for result in ranks:
        seen = result["fosi_fsdp"]
        assert seen["grads_kept"]
        assert seen["double_backward"] is not None and "fully_shard" in seen["double_backward"]
        assert "hvp='central_difference'" in seen["double_backward"]
        # The products by DTensor arithmetic (not fully_shard) are the plain ones, bit for bit.
        assert result["fosi_explicit"]["double_backward_equal"]


@pytest.mark.parametrize("case", ["fosi_fsdp", "fosi_explicit"])
def test_fosi_all_reduces_the_stated_bytes(ranks, case):
    # One ESE of m = 6 float64 Lanczos iterations with 2 Gram-Schmidt passes: 8 * 2 * m (m - 1) / 2 bytes of
    # coefficients, 4 float64 per iteration and 1 at the last, then ||w||^2 for the step of the differences;
    # each of the 3 steps: V g and V u (r = 2 float64 each) and its largest gradient entry, the first step also
    # the state's largest entry.
    m, passes, r = FOSI_KW["num_lanczos_iters"], 2, FOSI_KW["k"]
    ese = 8 * passes * m * (m - 1) // 2 + 32 * (m - 1) + 8 + 8
    steps = FOSI_STEPS * (2 * 8 * r + 8) + 8
    for result in ranks:
        seen = result[case]
        assert seen["bytes"] == ese + steps
        assert seen["calls"] == passes * (m - 1) + m + 1 + FOSI_STEPS * 3


def test_fosi_keeps_each_ranks_coordinates(ranks):
    # Rank 0 holds 7 + 7 rows of the first layer and 2 + 2 of the second (70 coordinates), rank 1 the rest (50):
    # its part of each Lanczos vector; a replicated parameter's eigenvectors whole on every rank.
    assert ranks[0]["fosi_fsdp"]["d_shape"] == (FOSI_KW["num_lanczos_iters"], 70)
    assert ranks[1]["fosi_fsdp"]["d_shape"] == (FOSI_KW["num_lanczos_iters"], 50)
    assert all(result["fosi_explicit"]["eigenvectors"] == (FOSI_KW["k"], 3) for result in ranks)


def test_unsupported_optimizers_refuse_dtensors(ranks):
    for result in ranks:
        refusals = result["refusals"]
        for name in ("DHO2", "KFACPreconditioner"):
            assert refusals[name] is not None and "does not support DTensor" in refusals[name], refusals[name]
        assert "KAISAPreconditioner" in refusals["KFACPreconditioner"]
        assert "track_error_norm" in refusals["track_error_norm"]
        assert "mixed with plain tensors" in refusals["mixed"]


def test_ranks_with_other_settings_fail_naming_the_setting(ranks):
    for result in ranks:
        message = result["refusals"]["disagree"]
        assert message is not None and "param_groups[0].lr" in message
        assert "rank 0 has 0.1" in message and "rank 1 has 0.2" in message
        message = result["refusals"]["fosi_disagree"]  # FOSI's own settings are compared too
        assert message is not None and "k: rank 0 has 2, rank 1 has 3" in message, message


def test_a_nan_or_inf_on_one_rank_skips_the_step_on_every_rank(ranks):
    for result in ranks:
        for bad in ("nan", "inf", "-inf"):
            # Every rank names the cause: an inf read as the largest finite float would pass for "too large".
            assert result["skip"][bad] == {"skipped": 1, "unchanged": True, "says_nonfinite": True}, bad


def test_flat_sgd_steps_that_share_one_float_per_group(ranks):
    # Per step one float32 per group (its largest gradient entry), and at the first step, which measures the
    # bounds, two more per group (the largest weight and momentum entries). Rank 1 holds no row of the first
    # group, a 1-row Shard(0) parameter, and still takes part.
    for rank, result in enumerate(ranks):
        seen = result["flat_sgd"]["groups"]
        assert seen["exact"], seen
        assert seen["local_rows"] == 1 - rank
        assert seen["bytes"] == 3 * 4 * 3 + 2 * 3 * 4 and seen["calls"] == 3
        assert seen["momentum_local"] == ((7, 5) if rank == 0 else (6, 5))


@pytest.mark.parametrize("case", ["nan", "overflow"])
def test_flat_sgd_skips_on_every_rank_when_one_rank_sees_a_problem(ranks, case):
    for result in ranks:
        seen = result["flat_sgd"][case]
        assert seen["skipped"] == 1 and seen["raised"] is None and seen["unchanged"] and seen["state"] == 0, seen
    if case == "overflow":  # the bounds measured (12 bytes), then the checked step's result over the ranks (8)
        assert all(result["flat_sgd"][case]["bytes"] == 12 + 8 for result in ranks)
        assert all(result["flat_sgd"][case]["calls"] == 2 for result in ranks)
    else:
        assert all(result["flat_sgd"][case]["bytes"] == 12 for result in ranks)


def test_flat_sgd_raises_on_every_rank_when_one_rank_sees_a_nan(ranks):
    for result in ranks:
        seen = result["flat_sgd"]["raise"]
        assert seen["raised"] is not None and "NaN or inf" in seen["raised"] and seen["unchanged"], seen
        assert seen["skipped"] == 0


@pytest.mark.parametrize("name", list(CHECKPOINT_SETTINGS))
def test_checkpoints_resume_bit_for_bit(ranks, name):
    for result in ranks:
        seen = result["checkpoints"][name]
        assert seen["dcp"] and seen["state_dict"]
        assert seen["unsharded_refused"] is not None and "cannot reshard" in seen["unsharded_refused"], seen


@pytest.mark.parametrize("name", RESHARDABLE)
def test_a_dcp_checkpoint_of_two_ranks_resumes_on_one_rank_bit_for_bit(ranks, name):
    seen = ranks[0]["checkpoints"]["one_rank"][name]
    assert seen["dcp_refused"] is None, seen
    # Each coordinate's state and weight is what the 2 ranks saved; a window's m x m Gram matrix and counters are
    # the saved ones (every rank held the same), bit for bit.
    assert seen["params_equal"] and seen["state_equal"], seen
    # The resumed run is the one started on 1 rank from that state (as on plain tensors, the whole state loaded;
    # SHARDED_TWIN_COMPARED: as a sharded twin given the whole state), and the checkpoint loaded into a plain model
    # in one process goes on as the plain optimizer given the whole state.
    assert seen["equals_twin"] if name in SHARDED_TWIN_COMPARED else seen["equals_plain"], seen
    assert seen["plain_dcp_refused"] is None and seen["plain_dcp_equal"], seen
    if name == "FlatSGD":  # elementwise: also the 2 ranks' own run, given the same gradients
        assert seen["equals_two_ranks"], seen
    elif name in SUMS_OVER_COORDINATES:
        # The products s = G x of the resumed steps (and so the Gram matrix's new rows) sum the same float32
        # terms in another order (1 rank's sum, not 2 ranks' partial sums added): _window_bound's difference.
        assert seen["gap_over_bound"] <= 1.0, seen
    elif name == "SparseAdaGrad":  # Top-k blocks of 8 cut from 1 rank's shard instead of 2 ranks': by design
        assert not seen["equals_two_ranks"], seen
    # SHARDED_TWIN_COMPARED: the resumed steps sum over 1 rank's coordinates instead of 2 ranks' partial sums; the
    # FOSI and LowRankMFAC tests above bound a sharded run against the unsharded one from the start.
    # The per-rank state dict holds rank 0's part only: still refused, pointing to the checkpoint that reshards.
    refused = seen["per_rank_refused"]
    assert refused is not None and "sharded over 2 ranks" in refused and "over 1" in refused, refused
    assert "torch.distributed.checkpoint reshards it" in refused, refused


@pytest.mark.parametrize("name", RESHARDABLE)
def test_a_dcp_checkpoint_saved_unsharded_resumes_on_two_ranks(ranks, name):
    # 1 -> 2: trained on a plain model in one process, resumed on the fully_shard'ed model of 2 ranks. Each rank
    # takes its rows of every per-coordinate entry; the weights and the whole state are the saved ones, bit for bit.
    for result in ranks:
        seen = result["from_unsharded"][name]
        assert seen["refused"] is None and seen["params_equal"] and seen["state_equal"], seen
        # FlatSGD is elementwise: its next steps are the plain run's. The others sum over the coordinates (a
        # window's products, SparseAdaGrad's blocks cut per shard, FOSI's and the power iteration's dot products)
        # in another order: the tests above bound a sharded run against the unsharded one.
        if name == "FlatSGD":
            assert seen["steps_equal"], seen


@pytest.mark.parametrize("name", [name for name in CHECKPOINT_SETTINGS if name not in RESHARDABLE])
def test_window_checkpoints_refuse_another_number_of_ranks(ranks, name):
    seen = ranks[0]["checkpoints"]["one_rank"][name]
    # Through DCP: its own size check where the window's shape changes with the ranks (the rank-stacked rows),
    # else the optimizer's refusal naming both numbers of ranks.
    refused = seen["dcp_refused"]
    assert refused is not None, seen
    if name == "SparseMFAC":
        assert "Size mismatch" in refused and "ring_indices" in refused, refused
    else:
        assert "saved for sharded over 2 ranks, this optimizer has sharded over 1 ranks" in refused, refused
        assert "cannot reshard it: resume with the same number of ranks" in refused, refused
    refused = seen["per_rank_refused"]
    assert refused is not None and "sharded over 2 ranks" in refused and "over 1" in refused, refused
    assert "cannot reshard" in refused and "torch.distributed.checkpoint reshards" not in refused, refused


def test_a_ranks_part_saved_on_another_number_of_ranks_is_refused():
    # A momentum of 7 rows (rank 0's part of 13 on 2 ranks) under shard_world=2 may not load as anyone's whole
    # state: nothing tells which rows it holds. The optimizer is left as it was.
    import tritonopt

    model = _model()
    opt = tritonopt.optim.FlatSGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["shard_world"] = 2
    for group in saved["param_groups"]:  # as a sharded state_dict() says it in its groups too
        group["shard_world"] = 2
    saved["state"][0]["momentum_buffer"] = saved["state"][0]["momentum_buffer"][:7].clone()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"saved for sharded over 2 ranks, this optimizer has unsharded parameters, "
                                         r"and its state 'momentum_buffer' of shape \(7, 5\) is not laid out like"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert all(torch.equal(after["state"][key]["momentum_buffer"], entry["momentum_buffer"])
               for key, entry in before["state"].items())



def test_a_stalled_rank_makes_the_sharded_optimizer_raise_a_collective_failure_within_the_timeout(ranks):
    seen = ranks[0]["stall"]
    assert seen["step"] == 1 and seen["collective_failure"], seen
    assert seen["message"].startswith("MFAC: the collective 'all_reduce'"), seen["message"]
    assert f"(timeout {STALL_TIMEOUT:g} s)" in seen["message"] and "failed on rank 0" in seen["message"]
    assert seen["seconds"] <= STALL_TIMEOUT + 20.0  # the timeout, plus a loaded 2-core machine's slack
    assert ranks[1]["stall"]["collective_failure"]  # rank 1 then finds rank 0 gone


# ---------------------------------------------------------------------- K-FAC (KAISA) on FSDP2


@pytest.mark.parametrize("case", list(KAISA_CASES))
def test_kaisa_on_a_fully_sharded_model_equals_kaisa_unsharded_bit_for_bit(ranks, case):
    # Same data per rank, same averaged gradients: KAISA gathers each layer's whole gradient, so the
    # factors, P, the KL clip and every parameter agree exactly (tests/_kaisa_fsdp2.py).
    for result in ranks:
        seen = result["kaisa"][case]
        assert seen["stepped"] and seen["preconditioned"]
        assert seen["exact"]
    assert ranks[0]["kaisa"][case]["local_rows"] == [7, 7, 2, 2]
    assert ranks[1]["kaisa"][case]["local_rows"] == [6, 6, 1, 1]


def test_kaisa_keeps_its_strategy_on_the_shard_mesh(ranks):
    # MEM-OPT (1 gradient worker per layer on 2 ranks) broadcasts P; COMM-OPT does not.
    for result in ranks:
        assert result["kaisa"]["mem_opt"]["grad_broadcast"]
        assert not result["kaisa"]["comm_opt"]["grad_broadcast"]


def test_kaisa_gathers_the_stated_bytes_per_step(ranks):
    from tritonopt.dist.kaisa_sharded import expected_gather_bytes

    # Linear(5, 13) and Linear(13, 3): weights 13 x 5 and 3 x 13, biases 13 x 1 and 3 x 1, on 2 ranks.
    per_step = expected_gather_bytes([(13, 5), (13, 1), (3, 13), (3, 1)], 2)
    assert per_step == {"sent": 4 * (7 * 5 + 7 + 2 * 13 + 2), "received": 4 * (7 * 5 + 7 + 2 * 13 + 2)}
    for result in ranks:
        for case in KAISA_CASES:
            assert result["kaisa"][case]["gather"] == (KAISA_STEPS, KAISA_STEPS * per_step["sent"],
                                                       KAISA_STEPS * per_step["received"])


@pytest.mark.parametrize("source", ["own", "rank0"])
def test_kaisa_on_fsdp2_resumes_bit_for_bit(ranks, source):
    for result in ranks:
        assert result["kaisa"]["checkpoint"][source]
        assert result["kaisa"]["checkpoint"]["steps"] == KAISA_STEPS


def test_kaisa_refuses_what_it_cannot_shard_naming_it(ranks):
    for result in ranks:
        refusals = result["kaisa"]["refusals"]
        assert "Shard(dim=1)" in refusals["columns"] and "Shard(0)" in refusals["columns"], refusals["columns"]
        assert "plain-tensor parameters" in refusals["mixed"] and "['2']" in refusals["mixed"], refusals["mixed"]
        assert "damping" in refusals["disagree"], refusals["disagree"]
