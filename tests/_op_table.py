"""The table of ops the contract tests run through (in the manner of torch's ``OpInfo``).

Each entry gives a small valid call (every argument by name), the arguments the
op writes in place, and the op-specific bad inputs it must name. The contract
tests derive the generic bad inputs themselves (a non-tensor, a complex tensor,
a tensor on another device, a non-contiguous or grad-requiring buffer that is
written in place, an updated buffer aliased with another argument). A new op
joins every contract test by adding an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch

from tritonopt import ops


@dataclass
class OpInfo:
    op: Callable
    sample: Callable[[], dict]  # a valid call: argument name -> value
    updated: tuple = ()  # the arguments written in place
    bad: list = field(default_factory=list)  # (description, changes to the sample, exception, word)
    empty: Optional[Callable[[], dict]] = None  # a valid call with no elements to work on
    variant: str = ""  # tells apart entries of one op (other dtypes of the sample)

    @property
    def name(self) -> str:
        return f"{self.op.name}-{self.variant}" if self.variant else self.op.name


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ring(num_blocks=2, m=3, k=4, block_size=16, seed=0):
    gen = _generator(seed)
    indices = torch.stack([torch.randperm(block_size, generator=gen)[:k].sort().values
                           for _ in range(num_blocks * m)]).view(num_blocks, m, k).to(torch.int32)
    return indices, torch.randn(num_blocks, m, k, generator=gen)


def _orthonormal_rows(rows: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, rows, generator=_generator(seed)))[0].T.contiguous()


def _eigh(dim: int, seed: int):
    a = torch.randn(dim, dim, generator=_generator(seed))
    values, vectors = torch.linalg.eigh(a @ a.T + torch.eye(dim))
    return vectors.contiguous(), values


def _ef_topk():
    gen = _generator(1)
    return dict(grad=torch.randn(3, 32, generator=gen), error=torch.randn(3, 32, generator=gen), k=4)


def _densify_blocks():
    return dict(indices=torch.tensor([[0, 3], [1, 2]], dtype=torch.int32), values=torch.randn(2, 2), block_size=4)


def _sparse_sp():
    indices, values = _ring()
    return dict(indices=indices, values=values, x=torch.randn(2, 16, generator=_generator(2)))


def _sparse_lcg():
    indices, values = _ring()
    return dict(indices=indices, values=values, weights=torch.randn(3, generator=_generator(3)), block_size=16)


def _sparse_ring_insert():
    indices, values = _ring()
    new_indices, new_values = _ring(m=1, seed=4)
    return dict(indices=indices, values=values, slot=1, new_indices=new_indices[:, 0].contiguous(),
                new_values=new_values[:, 0].contiguous())


def _densify_ring():
    indices, values = _ring()
    return dict(indices=indices, values=values, block_size=16)


def _lowrank_ef():
    gen = _generator(5)
    return dict(grad=torch.randn(12, 8, generator=gen), error=torch.randn(12, 8, generator=gen),
                q=torch.randn(8, 2, generator=gen))


def _lowrank_frobenius_products():
    gen = _generator(6)
    return dict(ring_p=torch.randn(3, 7, 2, generator=gen), ring_q=torch.randn(3, 5, 2, generator=gen),
                p=torch.randn(7, 2, generator=gen), q=torch.randn(5, 2, generator=gen))


def _kfac_factor_update():
    return dict(factor=torch.eye(6), x=torch.randn(10, 5, generator=_generator(7)), decay=0.9, append_bias=True)


def _eigenbasis_precondition():
    qa, da = _eigh(5, 8)
    qg, dg = _eigh(3, 9)
    return dict(grad=torch.randn(3, 5, generator=_generator(10)), qa=qa, da=da, qg=qg, dg=dg, damping=0.1)


def _eigenbasis_precondition_prediv():
    qa, _ = _eigh(5, 8)
    qg, _ = _eigh(3, 9)
    return dict(grad=torch.randn(3, 5, generator=_generator(10)), qa=qa, qg=qg,
                inv_denominator=torch.rand(3, 5, generator=_generator(11)))


def _eigen_inv_denominator():
    return dict(dg=torch.rand(3, generator=_generator(12)), da=torch.rand(5, generator=_generator(13)), damping=0.1)


def _triu_pack():
    a = torch.randn(5, 5, generator=_generator(14))
    return dict(matrix=a + a.T)


def _triu_unpack():
    return dict(packed=torch.randn(15, generator=_generator(15)), dim=5)


def _gram_schmidt_project():
    return dict(basis=_orthonormal_rows(4, 20), h=torch.randn(20, generator=_generator(16)), num_rows=3)


def _gram_schmidt_coefficients():
    return dict(basis=_orthonormal_rows(4, 20), h=torch.randn(20, generator=_generator(16)), num_rows=3)


def _gram_schmidt_subtract():
    return dict(basis=_orthonormal_rows(4, 20), h=torch.randn(20, generator=_generator(16)),
                coef=torch.randn(3, generator=_generator(17)))


def _fosi_step():
    gen = _generator(18)
    n, r = 40, 3
    return dict(param=torch.randn(n, generator=gen), grad=torch.randn(n, generator=gen),
                basis=_orthonormal_rows(r, n, 19), newton_scale=torch.rand(r, generator=gen),
                base="adam", state_a=torch.zeros(n), state_b=torch.zeros(n), lr=0.01)


def _sgd_momentum_step():
    gen = _generator(20)
    return dict(param=torch.randn(40, generator=gen), grad=torch.randn(40, generator=gen),
                momentum_buffer=torch.randn(40, generator=gen), lr=0.1, momentum=0.9, weight_decay=1e-4,
                nesterov=True)


def _ssd_sgd_step(*, pulled: bool = False, shadow: bool = True, dtype: torch.dtype = torch.float32, n: int = 40):
    gen = _generator(20)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def vector(to: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(to)

    call = dict(param=vector(dtype), grad=vector(dtype), pre_weight=vector(state_dtype), lr=0.1, momentum=0.9,
                weight_decay=1e-4, local_lr=0.4, local_weight_decay=1e-4, glu_alpha=2.0, glu_beta=0.5,
                sync_coef=0.2, pulled=pulled)
    if shadow:
        call.update(shadow_weight=vector(state_dtype), shadow_momentum=vector(state_dtype, 0.1))
        if pulled:
            call.update(sync_momentum=torch.zeros(n, dtype=state_dtype), shadow_scale=0.5)
    return call


def _overlapping_shadow_buffers(call: dict) -> None:
    """The shadow weight and momentum as two overlapping views of one buffer."""
    n = call["param"].shape[0]
    buffer = torch.cat([call["shadow_weight"], call["shadow_momentum"][: n // 2]])
    call.update(shadow_weight=buffer[:n], shadow_momentum=buffer[n // 2 :])


def _with(sample: Callable[[], dict], **changes) -> Callable[[], dict]:
    return lambda: {**sample(), **changes}


OPS = [
    OpInfo(ops.ef_topk, _ef_topk, updated=("error",), empty=_with(_ef_topk, grad=torch.zeros(0, 32),
                                                                 error=torch.zeros(0, 32)), bad=[
        ("k zero", dict(k=0), ValueError, "k"),
        ("k above the block", dict(k=33), ValueError, "k"),
        ("k a float", dict(k=2.0), TypeError, "k"),
        ("k a bool", dict(k=True), TypeError, "k"),
        ("1-D grad", dict(grad=torch.zeros(32), error=torch.zeros(32)), ValueError, "grad"),
        ("error of another shape", dict(error=torch.zeros(3, 31)), ValueError, "error"),
        ("float16 error", dict(error=torch.zeros(3, 32, dtype=torch.float16)), TypeError, "error"),
        ("float64 grad", dict(grad=torch.zeros(3, 32, dtype=torch.float64)), TypeError, "grad"),
        ("strided grad", dict(grad=torch.zeros(32, 3).t()), ValueError, "grad"),
    ]),
    OpInfo(ops.ef_topk, _with(_ef_topk, grad=torch.randn(3, 32, generator=_generator(1)).half()), updated=("error",),
           variant="float16"),
    OpInfo(ops.ef_topk, _with(_ef_topk, grad=torch.randn(3, 32, generator=_generator(1)).bfloat16()),
           updated=("error",), variant="bfloat16"),
    OpInfo(ops.densify_blocks, _densify_blocks, bad=[
        ("index past the block", dict(block_size=3), ValueError, "indices"),
        ("block smaller than k", dict(block_size=1), ValueError, "block_size"),
        ("float indices", dict(indices=torch.zeros(2, 2)), TypeError, "indices"),
    ]),
    OpInfo(ops.sparse_sp, _sparse_sp, empty=_with(_sparse_sp, indices=torch.zeros(0, 3, 4, dtype=torch.int32),
                                                values=torch.zeros(0, 3, 4), x=torch.zeros(0, 16)), bad=[
        ("int64 indices", dict(indices=torch.zeros(2, 3, 4, dtype=torch.int64)), TypeError, "indices"),
        ("float16 values", dict(values=torch.zeros(2, 3, 4, dtype=torch.float16)), TypeError, "values"),
        ("x with other blocks", dict(x=torch.zeros(3, 16)), ValueError, "x must"),
        ("x narrower than k", dict(x=torch.zeros(2, 3)), ValueError, "block_size"),
        ("strided x", dict(x=torch.zeros(16, 2).t()), ValueError, "x must be contiguous"),
        ("values of another shape", dict(values=torch.zeros(2, 2, 4)), ValueError, "values"),
        ("2-D ring", dict(indices=torch.zeros(3, 4, dtype=torch.int32), values=torch.zeros(3, 4)), ValueError,
         "indices"),
    ]),
    OpInfo(ops.sparse_lcg, _sparse_lcg, empty=_with(_sparse_lcg, indices=torch.zeros(2, 0, 4, dtype=torch.int32),
                                                  values=torch.zeros(2, 0, 4), weights=torch.zeros(0)), bad=[
        ("a weight per row", dict(weights=torch.zeros(4)), ValueError, "weights"),
        ("block smaller than k", dict(block_size=3), ValueError, "block_size"),
        ("block_size a float", dict(block_size=16.0), TypeError, "block_size"),
    ]),
    OpInfo(ops.sparse_ring_insert, _sparse_ring_insert, updated=("indices", "values"), bad=[
        ("slot past the ring", dict(slot=3), ValueError, "slot"),
        ("negative slot", dict(slot=-1), ValueError, "slot"),
        ("slot a float", dict(slot=1.0), TypeError, "slot"),
        ("new row of another k", dict(new_indices=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "new_indices"),
        ("bfloat16 new values", dict(new_values=torch.zeros(2, 4, dtype=torch.bfloat16)), TypeError, "new_values"),
    ]),
    OpInfo(ops.densify_ring, _densify_ring, bad=[
        ("index past the block", dict(block_size=8), ValueError, "indices must lie"),
        ("block smaller than k", dict(block_size=3), ValueError, "block_size"),
    ]),
    OpInfo(ops.lowrank_ef, _lowrank_ef, updated=("error",),
           empty=_with(_lowrank_ef, grad=torch.zeros(0, 8), error=torch.zeros(0, 8)), bad=[
        ("3-D grad", dict(grad=torch.zeros(2, 6, 8), error=torch.zeros(2, 6, 8)), ValueError, "grad must be 1-D or 2-D"),
        ("q with other rows", dict(q=torch.zeros(7, 2)), ValueError, "q must be"),
        ("rank 0", dict(q=torch.zeros(8, 0)), ValueError, "q must be"),
        ("float64 error", dict(error=torch.zeros(12, 8, dtype=torch.float64)), TypeError, "error"),
        ("integer grad", dict(grad=torch.zeros(12, 8, dtype=torch.int32)), TypeError, "grad must be"),
        ("strided grad", dict(grad=torch.zeros(8, 12).t()), ValueError, "grad must be contiguous"),
    ]),
    OpInfo(ops.lowrank_frobenius_products, _lowrank_frobenius_products, bad=[
        ("mixed dtypes", dict(p=torch.zeros(7, 2, dtype=torch.float64)), TypeError, "dtype"),
        ("other m", dict(ring_q=torch.zeros(2, 5, 2)), ValueError, "same m"),
    ]),
    OpInfo(ops.kfac_factor_update, _kfac_factor_update, updated=("factor",),
           empty=_with(_kfac_factor_update, factor=torch.zeros(1, 1), x=torch.zeros(10, 0)), bad=[
        ("decay above 1", dict(decay=1.5), ValueError, "decay"),
        ("decay NaN", dict(decay=float("nan")), ValueError, "decay"),
        ("decay a string", dict(decay="0.5"), TypeError, "decay"),
        ("append_bias an int", dict(append_bias=1), TypeError, "append_bias"),
        ("unknown precision", dict(precision="fp8"), ValueError, "precision"),
        ("no rows", dict(x=torch.zeros(0, 5)), ValueError, "x"),
        ("factor without the bias column", dict(factor=torch.eye(5)), ValueError, "factor"),
        ("float16 factor", dict(factor=torch.eye(6).half()), TypeError, "factor"),
        ("integer x", dict(x=torch.ones(10, 5, dtype=torch.int32)), TypeError, "x"),
    ]),
    OpInfo(ops.eigenbasis_precondition, _eigenbasis_precondition, bad=[
        ("damping 0", dict(damping=0.0), ValueError, "damping"),
        ("qa of another size", dict(qa=torch.eye(4)), ValueError, "qa"),
        ("dg of another size", dict(dg=torch.ones(5)), ValueError, "dg"),
        ("unknown precision", dict(precision="fast"), ValueError, "precision"),
    ]),
    OpInfo(ops.eigenbasis_precondition_prediv, _eigenbasis_precondition_prediv, bad=[
        ("transposed reciprocal", dict(inv_denominator=torch.ones(5, 3)), ValueError, "inv_denominator"),
    ]),
    OpInfo(ops.eigen_inv_denominator, _eigen_inv_denominator, bad=[
        ("damping NaN", dict(damping=float("nan")), ValueError, "damping"),
        ("2-D eigenvalues", dict(dg=torch.ones(3, 1)), ValueError, "1-D"),
    ]),
    OpInfo(ops.triu_pack, _triu_pack, empty=lambda: dict(matrix=torch.zeros(0, 0)), bad=[
        ("not square", dict(matrix=torch.zeros(3, 4)), ValueError, "matrix"),
        ("integer target dtype", dict(dtype=torch.int32), TypeError, "dtype"),
    ]),
    OpInfo(ops.triu_unpack, _triu_unpack, bad=[
        ("too few entries", dict(packed=torch.zeros(14)), ValueError, "packed"),
        ("dim a float", dict(dim=5.0), TypeError, "dim"),
        ("strided", dict(packed=torch.zeros(30)[::2]), ValueError, "packed"),
    ]),
    OpInfo(ops.gram_schmidt_project, _gram_schmidt_project, empty=_with(_gram_schmidt_project, num_rows=0), bad=[
        ("more rows than the basis", dict(num_rows=5), ValueError, "num_rows"),
        ("num_rows a float", dict(num_rows=1.0), TypeError, "num_rows"),
        ("no pass", dict(passes=0), ValueError, "passes"),
        ("h of another dtype", dict(h=torch.zeros(20, dtype=torch.float64)), TypeError, "h must have basis's dtype"),
        ("h of another length", dict(h=torch.zeros(19)), ValueError, "h must be 1-D"),
        ("float16 basis", dict(basis=torch.zeros(4, 20, dtype=torch.float16), h=torch.zeros(20, dtype=torch.float16)),
         TypeError, "basis must be float32"),
        ("transposed basis", dict(basis=torch.zeros(20, 4).T), ValueError, "basis"),
    ]),
    OpInfo(ops.gram_schmidt_coefficients, _gram_schmidt_coefficients, bad=[
        ("negative num_rows", dict(num_rows=-1), ValueError, "num_rows"),
    ]),
    OpInfo(ops.gram_schmidt_subtract, _gram_schmidt_subtract, bad=[
        ("more coefficients than rows", dict(coef=torch.zeros(5)), ValueError, "coef"),
    ]),
    OpInfo(ops.fosi_step, _fosi_step, updated=("param", "state_a", "state_b"),
           empty=_with(_fosi_step, basis=torch.zeros(0, 40), newton_scale=torch.zeros(0)), bad=[
        ("unknown base", dict(base="lion"), ValueError, "base must be one of"),
        ("Adam without its second moment", dict(state_b=None), ValueError, "state_b is required"),
        ("lr NaN", dict(lr=float("nan")), ValueError, "lr"),
        ("lr a string", dict(lr="fast"), TypeError, "lr must be a float"),
        ("beta1 above 1", dict(beta1=1.5), ValueError, "beta1"),
        ("step 0", dict(step=0), ValueError, "step"),
        ("more than 64 directions", dict(basis=torch.zeros(65, 40), newton_scale=torch.zeros(65)), ValueError,
         "at most 64"),
        ("grad of another length", dict(grad=torch.zeros(39)), ValueError, "grad must be 1-D"),
        ("basis of another width", dict(basis=torch.zeros(3, 39)), ValueError, "basis must be"),
        ("transposed basis", dict(basis=torch.zeros(40, 3).T), ValueError, "basis"),
        ("a scale per direction", dict(newton_scale=torch.zeros(4)), ValueError, "newton_scale"),
        ("the velocity is the Newton scale",
         lambda call: call.update(g1_velocity=call["newton_scale"], g1_decay=0.5), ValueError,
         "newton_scale and g1_velocity"),
    ]),
    OpInfo(ops.sgd_momentum_step, _sgd_momentum_step, updated=("param", "momentum_buffer"),
           empty=_with(_sgd_momentum_step, param=torch.zeros(0), grad=torch.zeros(0), momentum_buffer=torch.zeros(0)),
           bad=[
        ("float64 param", dict(param=torch.zeros(40, dtype=torch.float64)), TypeError, "param must be float32"),
        ("strided param", dict(param=torch.zeros(80)[::2]), ValueError, "param must be contiguous"),
        ("integer grad", dict(grad=torch.zeros(40, dtype=torch.int64)), TypeError, "grad must be"),
        ("grad of another shape", dict(grad=torch.zeros(39)), ValueError, "grad must have param's shape"),
        ("strided grad", dict(grad=torch.zeros(80)[::2]), ValueError, "grad must be contiguous"),
        ("momentum without its buffer", dict(momentum_buffer=None), ValueError, "momentum_buffer is required"),
        ("float64 buffer", dict(momentum_buffer=torch.zeros(40, dtype=torch.float64)), TypeError,
         "momentum_buffer must be float32"),
        ("buffer of another shape", dict(momentum_buffer=torch.zeros(39)), ValueError, "momentum_buffer must have"),
        ("lr negative", dict(lr=-1.0), ValueError, "lr"),
        ("lr NaN", dict(lr=float("nan")), ValueError, "lr"),
        ("lr a tensor", dict(lr=torch.tensor(0.1)), TypeError, "lr"),
        ("momentum negative", dict(momentum=-0.5), ValueError, "momentum"),
        ("weight_decay inf", dict(weight_decay=float("inf")), ValueError, "weight_decay"),
        ("nesterov with dampening", dict(dampening=0.1), ValueError, "nesterov"),
        ("nesterov an int", dict(nesterov=1), TypeError, "nesterov"),
        ("first_step an int", dict(first_step=1), TypeError, "first_step"),
    ]),
    OpInfo(ops.sgd_momentum_step, _with(_sgd_momentum_step, grad=torch.randn(40, generator=_generator(21)).bfloat16()),
           updated=("param", "momentum_buffer"), variant="bfloat16-grad"),
    OpInfo(ops.sgd_momentum_step, _with(_sgd_momentum_step, momentum_buffer=None, momentum=0.0, nesterov=False),
           updated=("param",), variant="no-momentum",
           empty=_with(_sgd_momentum_step, param=torch.zeros(0), grad=torch.zeros(0), momentum_buffer=None,
                       momentum=0.0, nesterov=False)),
    OpInfo(ops.ssd_sgd_step, _ssd_sgd_step, updated=("param", "pre_weight", "shadow_weight", "shadow_momentum"),
           empty=partial(_ssd_sgd_step, n=0), bad=[
        ("2-D param", dict(param=torch.zeros(40, 1)), ValueError, "param must be 1-D"),
        ("grad of another length", dict(grad=torch.zeros(39)), ValueError, "grad must have shape"),
        ("strided grad", dict(grad=torch.zeros(80)[::2]), ValueError, "grad must be contiguous"),
        ("float16 pre_weight", dict(pre_weight=torch.zeros(40, dtype=torch.float16)), TypeError, "pre_weight must be"),
        ("float64 param, float32 state", dict(param=torch.zeros(40, dtype=torch.float64)), TypeError,
         "both be float64 or neither"),
        ("strided pre_weight", dict(pre_weight=torch.zeros(80)[::2]), ValueError, "pre_weight must be contiguous"),
        ("a shadow weight without its momentum", dict(shadow_momentum=None), ValueError, "given together"),
        ("float64 shadow momentum", dict(shadow_momentum=torch.zeros(40, dtype=torch.float64)), TypeError,
         "shadow_momentum must have pre_weight's dtype"),
        ("sync_momentum on a step without a pull", dict(sync_momentum=torch.zeros(40)), ValueError,
         "sync_momentum is written only"),
        ("shadow_scale on a step without a pull", dict(shadow_scale=0.5), ValueError, "shadow_scale applies"),
        ("shadow_scale 0", dict(shadow_scale=0.0, pulled=True), ValueError, "shadow_scale must be > 0"),
        ("momentum 1", dict(momentum=1.0), ValueError, "momentum must be < 1"),
        ("negative lr", dict(lr=-0.1), ValueError, "lr must be >= 0"),
        ("negative local_weight_decay", dict(local_weight_decay=-1e-4), ValueError, "local_weight_decay must be >= 0"),
        ("glu_beta NaN", dict(glu_beta=float("nan")), ValueError, "glu_beta must be a finite number"),
        ("sync_coef a string", dict(sync_coef="fast"), TypeError, "sync_coef must be a float"),
        ("pulled an int", dict(pulled=1), TypeError, "pulled must be a bool"),
        ("overlapping shadow buffers", _overlapping_shadow_buffers, ValueError,
         "shadow_weight and shadow_momentum must not share memory"),
    ]),
    OpInfo(ops.ssd_sgd_step, partial(_ssd_sgd_step, pulled=True),
           updated=("param", "pre_weight", "shadow_weight", "shadow_momentum", "sync_momentum"),
           empty=partial(_ssd_sgd_step, pulled=True, n=0), variant="pulled"),
    OpInfo(ops.ssd_sgd_step, partial(_ssd_sgd_step, pulled=True, shadow=False), updated=("param", "pre_weight"),
           variant="glu-only"),
    OpInfo(ops.ssd_sgd_step, partial(_ssd_sgd_step, pulled=True, dtype=torch.bfloat16),
           updated=("param", "pre_weight", "shadow_weight", "shadow_momentum", "sync_momentum"), variant="bfloat16"),
    OpInfo(ops.ssd_sgd_step, partial(_ssd_sgd_step, pulled=True, dtype=torch.float64),
           updated=("param", "pre_weight", "shadow_weight", "shadow_momentum", "sync_momentum"), variant="float64"),
]
