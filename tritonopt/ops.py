"""Public ops of tritonopt.

Each op is a ``torch.library`` custom op in the ``tritonopt`` namespace
(``torch.ops.tritonopt.<name>``); the functions here validate their arguments
with messages naming the argument, then run the Triton kernel (CUDA tensors, or
CPU tensors under ``TRITON_INTERPRET=1``) or the PyTorch reference.

=================  ===========================================================
``ef_topk``        blockwise Top-k with error feedback (EFCP)
``densify_blocks`` the dense blocks of an ``ef_topk`` result
=================  ===========================================================
"""

from tritonopt._ops.ef_topk import densify_blocks, ef_topk

__all__ = ["densify_blocks", "ef_topk"]
