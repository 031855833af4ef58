"""Public ops of tritonopt.

Each op is a ``torch.library`` custom op in the ``tritonopt`` namespace
(``torch.ops.tritonopt.<name>``); the functions here validate their arguments
with messages naming the argument, then run the Triton kernel (CUDA tensors, or
CPU tensors under ``TRITON_INTERPRET=1``) or the PyTorch reference.

Error-feedback compression (EFCP)

==============================  ================================================
``ef_topk``                     blockwise Top-k with error feedback
``densify_blocks``              the dense blocks of an ``ef_topk`` result
``sparse_ring_insert``          replace one row of a block-major sparse ring buffer
``sparse_sp``                   scalar products of a dense vector with every row
``sparse_lcg``                  dense linear combination of the rows
``densify_ring``                the dense ``[m, d]`` matrix of a sparse ring buffer
``lowrank_ef``                  rank-``r`` power-iteration compression with error feedback
``lowrank_frobenius_products``  Frobenius products of stored low-rank pairs with a new one
==============================  ================================================

K-FAC (KAISA)

==================================  ============================================
``kfac_factor_update``              fused running average ``decay F + (1-decay) X^T X / n``
``eigenbasis_precondition``         ``QG [(QG^T grad QA) / (dG dA^T + damping)] QA^T``
``eigenbasis_precondition_prediv``  the same with a precomputed reciprocal
``eigen_inv_denominator``           that reciprocal, ``1 / (dG dA^T + damping)``
``triu_pack`` / ``triu_unpack``     upper-triangle packing with a dtype cast
==================================  ============================================

FOSI / DHO2

===============================  ===============================================
``gram_schmidt_project``         fused Gram-Schmidt step of Lanczos (CGS2 for fp32)
``gram_schmidt_coefficients``    its first half, ``basis[:r] @ h``
``gram_schmidt_subtract``        its second half, ``h - basis[:r]^T coef`` and the norm
``fosi_step``                    one FOSI update of a flat parameter buffer
===============================  ===============================================

SSD-SGD

===============================  ===============================================
``ssd_sgd_step``                 GLU local update fused with the shadow server's momentum step
===============================  ===============================================

DSP

===============================  ===============================================
``sgd_momentum_step``            one fused ``torch.optim.SGD`` step of a flat buffer
===============================  ===============================================
"""

from tritonopt._ops.ef_topk import densify_blocks, ef_topk
from tritonopt._ops.fosi_step import fosi_step
from tritonopt._ops.kfac import (
    eigen_inv_denominator,
    eigenbasis_precondition,
    eigenbasis_precondition_prediv,
    kfac_factor_update,
    triu_pack,
    triu_unpack,
)
from tritonopt._ops.lanczos import (
    gram_schmidt_coefficients,
    gram_schmidt_project,
    gram_schmidt_subtract,
)
from tritonopt._ops.lowrank import lowrank_ef, lowrank_frobenius_products
# The thresholds of lowrank_ef's Gram-Schmidt (a column kept above DEPENDENT_TOLERANCE of its norm, divided by
# its norm plus GRAM_SCHMIDT_EPS), for code that runs the same orthogonalisation over shards.
from tritonopt._ops.lowrank import DEPENDENT_TOLERANCE, GRAM_SCHMIDT_EPS  # noqa: E402
from tritonopt._ops.sgd_momentum import sgd_momentum_step
from tritonopt._ops.sparse_ring import densify_ring, sparse_lcg, sparse_ring_insert, sparse_sp
from tritonopt._ops.ssd_sgd import ssd_sgd_step

__all__ = [
    "densify_blocks",
    "densify_ring",
    "ef_topk",
    "eigen_inv_denominator",
    "eigenbasis_precondition",
    "eigenbasis_precondition_prediv",
    "fosi_step",
    "gram_schmidt_coefficients",
    "gram_schmidt_project",
    "gram_schmidt_subtract",
    "kfac_factor_update",
    "lowrank_ef",
    "lowrank_frobenius_products",
    "sgd_momentum_step",
    "sparse_lcg",
    "sparse_ring_insert",
    "sparse_sp",
    "ssd_sgd_step",
    "triu_pack",
    "triu_unpack",
]
