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
"""

from tritonopt._ops.ef_topk import densify_blocks, ef_topk
from tritonopt._ops.lowrank import lowrank_ef, lowrank_frobenius_products
from tritonopt._ops.sparse_ring import densify_ring, sparse_lcg, sparse_ring_insert, sparse_sp

__all__ = [
    "densify_blocks",
    "densify_ring",
    "ef_topk",
    "lowrank_ef",
    "lowrank_frobenius_products",
    "sparse_lcg",
    "sparse_ring_insert",
    "sparse_sp",
]
