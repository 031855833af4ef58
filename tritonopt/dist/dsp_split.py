"""Cut a model into the ``K`` consecutive blocks of a DSP pipeline (paper sec. 2, 5.1).

Two ways in:

* an ``nn.Sequential``: contiguous slices of its children, cut before the
  indices in ``boundaries`` (or into ``num_stages`` slices of near-equal child
  counts). The slices share the model's modules and parameters.
* any module whose ``forward`` calls ``torch.distributed.pipelining.pipe_split()``
  where a stage should end: traced with ``torch.distributed.pipelining.pipeline``
  on ``example_args`` (one micro-batch's positional arguments); the stage
  modules it returns share the model's parameters and buffers.

The paper balances the blocks by hand (sec. 3.3, 5.1); with DSP a non-last block
runs forward + recompute + backward per batch and the last block forward +
backward, so the last block can carry about 4/3 of the others' forward cost.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

__all__ = ["split_stages"]


def split_stages(
    model: nn.Module,
    num_stages: Optional[int] = None,
    *,
    boundaries: Optional[Sequence[int]] = None,
    example_args: Optional[tuple] = None,
) -> list[nn.Module]:
    """The stage modules of ``model``, in pipeline order.

    Args:
        model: an ``nn.Sequential``, or a module with ``pipe_split()`` markers.
        num_stages: how many stages (checked against the markers when tracing).
        boundaries: ``nn.Sequential`` only: the child indices where stages 1, 2, ...
            begin, strictly increasing inside ``(0, len(model))``.
        example_args: positional arguments of one forward call; selects tracing
            at the ``pipe_split()`` markers.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if example_args is not None:
        if boundaries is not None:
            raise ValueError("give boundaries (nn.Sequential) or example_args (pipe_split markers), not both")
        return _split_traced(model, num_stages, example_args)
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            "only an nn.Sequential splits without tracing; for another module put pipe_split() "
            "markers in its forward and pass example_args"
        )
    length = len(model)
    if boundaries is None:
        if num_stages is None:
            raise ValueError("give num_stages or boundaries")
        if num_stages > length:
            raise ValueError(f"cannot cut {length} children into {num_stages} non-empty stages")
        boundaries = [round(i * length / num_stages) for i in range(1, num_stages)]
    boundaries = list(boundaries)
    for b in boundaries:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"boundaries must be ints, got {b!r}")
    cuts = [0, *boundaries, length]
    if any(not a < b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(
            f"boundaries must increase strictly inside (0, {length}) so no stage is empty, got {boundaries}"
        )
    if num_stages is not None and num_stages != len(cuts) - 1:
        raise ValueError(f"{len(boundaries)} boundaries make {len(cuts) - 1} stages, not num_stages={num_stages}")
    return [model[a:b] for a, b in zip(cuts, cuts[1:])]


def _split_traced(model: nn.Module, num_stages: Optional[int], example_args) -> list[nn.Module]:
    from torch.distributed.pipelining import pipeline

    if not isinstance(example_args, tuple):
        raise TypeError(f"example_args must be a tuple of positional arguments, got {type(example_args).__name__}")
    pipe = pipeline(model, mb_args=example_args)
    if num_stages is not None and pipe.num_stages != num_stages:
        raise ValueError(
            f"the model's pipe_split() markers make {pipe.num_stages} stages, not num_stages={num_stages}"
        )
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
