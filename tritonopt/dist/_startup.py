"""What DHO2, MR-DHO2, SSD-SGD and the communication hooks need at construction, before their start-up agreement.

An initialised process group, the device the agreement's small tensors live on (the group's
backend must be able to move them) and the model's layout the ranks compare.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agreement_device", "model_layout", "require_process_group"]


def require_process_group(layer: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{layer} needs an initialised torch.distributed process group")


def agreement_device(group) -> torch.device:
    """Where the start-up collectives' tensors live when the parameters cannot tell (NCCL: the GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_layout(params) -> list[tuple]:
    """Each parameter's ``(shape, dtype name)``, in order: what the ranks' models must share."""
    return [(tuple(p.shape), str(p.dtype)) for p in params]
