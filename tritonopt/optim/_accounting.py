"""How much memory an optimizer's state holds."""

from __future__ import annotations

import torch
from torch.optim import Optimizer


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state``, each storage counted once.

    Works for any ``torch.optim.Optimizer``; state held as views of one flat
    buffer (as tritonopt's optimizers do) is counted by its storage, padding
    included.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    seen: set[tuple[str, int]] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            storage = value.untyped_storage()
            key = (str(value.device), storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total
