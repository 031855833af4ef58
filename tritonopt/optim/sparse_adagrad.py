"""Diagonal AdaGrad fed by error-feedback blockwise Top-k (EFCP, Modoranu et al. 2024, Alg. 7)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_float, check_int
from tritonopt.optim._blocks import BlockLayout, kept_per_block
from tritonopt.optim._packed import CheckpointSpec, PackedGroup, PackedOptimizer, StepWork, bind_flat_state
from tritonopt.optim._sharding import local_tensor
from tritonopt.optim.functional import apply_decoupled_update, sparse_adagrad

# Squares of entries below this, summed over many steps, stay far from float32's 3.4e38.
_MAX_GRADIENT_ENTRY = 1e17


class SparseAdaGrad(PackedOptimizer):
    r"""Diagonal AdaGrad on an error-feedback, blockwise Top-k compressed gradient.

    Each parameter group is one vector (its parameters that have a gradient,
    flattened in group order), cut into blocks of ``block_size``. Every step::

        a = e + g                        # error feedback
        c = TopK_per_block(a)            # k entries of largest |a| per block
        e = a - c
        H += c ** 2
        theta = (1 - lr * weight_decay) * theta - lr * c / (sqrt(H) + eps)

    Only the selected entries change ``H`` and the parameters. This is
    Algorithm 7 of EFCP (Modoranu et al., 2024) with an optional decoupled
    (AdamW-style) weight decay; ``weight_decay=0`` gives the algorithm exactly.

    Args:
        params: parameters or parameter groups. Groups may override every
            hyperparameter below except ``on_nonfinite``.
        lr: learning rate.
        density: fraction of each block kept, ``k = ceil(density * block_size)``
            (default 0.01 when neither ``density`` nor ``k`` is given).
        k: entries kept per block, instead of ``density``.
        block_size: Top-k block length. A group with fewer elements forms one
            block of its own size (``k`` is then capped at that size); the last
            block of a group is zero-padded, and padding never reaches a parameter.
        eps: added to ``sqrt(H)``, ``> 0`` (entries never selected have ``H = 0``).
        weight_decay: decoupled weight decay ``theta *= 1 - lr * weight_decay``.
        on_nonfinite: what a step does when a gradient holds NaN or inf:
            ``"skip"`` (default) leaves every parameter and all state untouched,
            warns, and counts the step in :attr:`skipped_steps`; ``"raise"``
            raises ``FloatingPointError``, also before anything is modified.
            Checking costs one device-to-host synchronisation per step.

    State (per parameter, all float32 and shaped like the parameter, whatever
    its dtype): ``error`` (e), ``sum_sq`` (H), and ``step``.
    Parameters whose ``.grad`` is None are skipped: neither they nor their
    state change. Sparse and complex gradients are rejected.

    Sharded parameters (DTensors of FSDP2's ``fully_shard``: ``Shard(0)`` or
    ``Replicate()`` on a 1-D mesh, or along the shard dimension of a 2-D HSDP
    mesh, whose replicas step alike): each rank packs its local shards and cuts
    *them* into blocks, so the Top-k selects per block of a rank's shard, and
    the state is the rank's part. Where every entry is kept (``k`` equal to
    the block) the update is elementwise and equals the unsharded optimizer's
    bit for bit; with fewer kept entries the blocks, and so the selection,
    differ from an unsharded run's. The ranks agree on skipping a step (one
    all-reduce of one float per step). A checkpoint of
    ``torch.distributed.checkpoint`` resumes on any number of ranks (and any mesh
    shape) with each coordinate's ``error`` and ``sum_sq`` as saved; the blocks
    are then cut from the new ranks' shards (on the same number of shard ranks,
    the same blocks), so with fewer kept entries the run goes on as one
    started on the new ranks from that state, not as the saved ranks' would.
    """

    ALGO = "sparse_adagrad"
    SHARDING_REFUSAL = None
    LIKE_PARAM_ENTRIES = frozenset({"error", "sum_sq"})
    RESHARDABLE = True  # e and H are per coordinate, the step counters the same on every rank

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        *,
        density: Optional[float] = None,
        k: Optional[int] = None,
        block_size: int = 4096,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        on_nonfinite: str = "skip",
    ):
        if density is None and k is None:
            density = 0.01
        defaults = dict(
            lr=lr, density=density, k=k, block_size=block_size, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults, on_nonfinite)

    def _check_group(self, group: dict) -> None:
        group = {"density": None, "k": None, **group}
        check_float("lr", group["lr"], low=0.0)
        check_float("eps", group["eps"], low=0.0, low_open=True)  # 0 would divide 0 by 0 where nothing was kept
        check_float("weight_decay", group["weight_decay"], low=0.0)
        check_int("block_size", group["block_size"], low=1)
        density, k = group["density"], group["k"]
        if density is not None and k is not None:
            raise ValueError("give density or k, not both")
        if k is not None:
            check_int("k", k, low=1, high=group["block_size"])
        elif isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")

    def _checkpoint_spec(self, index: int, group: dict, params) -> CheckpointSpec:
        return CheckpointSpec(per_param=frozenset({"step", "error", "sum_sq"}),
                              like_param=frozenset({"error", "sum_sq"}),
                              dtypes={"error": torch.float32, "sum_sq": torch.float32},
                              step_counters=frozenset({"step"}))

    def add_param_group(self, param_group: dict) -> None:
        if "k" in param_group and "density" not in param_group:
            param_group = {**param_group, "density": None}
        elif "density" in param_group and "k" not in param_group:
            param_group = {**param_group, "k": None}
        super().add_param_group(param_group)

    def _packed_group(self, index: int, groups: list[dict], params: list[torch.Tensor]) -> PackedGroup:
        """The group's flat buffers for this set of parameters, rebuilt when the set changes."""
        group = groups[0]
        grad_dtypes = {p.grad.dtype for p in params}
        grad_dtype = grad_dtypes.pop() if len(grad_dtypes) == 1 else torch.float32
        if grad_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            grad_dtype = torch.float32
        packed = self._packed.get(index)
        if (
            packed is not None
            and packed.layout.matches(params)
            and packed.layout.block_size == min(group["block_size"], packed.layout.total)
        ):
            if packed.grad.dtype != grad_dtype:
                packed.work["grad"] = packed.layout.zeros(grad_dtype)
            return packed
        layout = BlockLayout(params, group["block_size"])
        for p in params:
            self.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))
        buffers = bind_flat_state(self.state, layout, ["error", "sum_sq"], torch.float32)
        packed = PackedGroup(layout, buffers, {"grad": layout.zeros(grad_dtype), "update": layout.zeros()})
        self._packed[index] = packed
        return packed

    # ------------------------------------------------------------------ step

    def _prepare(self, index: int, groups: list[dict]) -> Optional[StepWork]:
        params = [p for p in groups[0]["params"] if p.grad is not None]
        if not any(local_tensor(p).numel() for p in params):  # nothing to step here
            return None
        packed = self._packed_group(index, groups, params)
        packed.layout.pack([p.grad for p in params], packed.grad)
        return StepWork(index, groups, params, packed, probe=packed.grad.abs().amax().float())

    def _gradient_problem(self, largest: float) -> Optional[str]:
        # Above _MAX_GRADIENT_ENTRY the squares summed into the AdaGrad state could overflow float32.
        if largest < _MAX_GRADIENT_ENTRY:
            return None
        too_large = f"a gradient entry of {largest:.3g} is too large for the float32 state"
        return super()._gradient_problem(largest) or too_large

    def _update(self, work: list[StepWork], stateless) -> None:
        for unit in work:
            group, layout = unit.groups[0], unit.packed.layout
            k = kept_per_block(group["density"], group["k"], layout.block_size)
            with nvtx_range("tritonopt/sparse_adagrad/update"):
                update = sparse_adagrad(unit.packed.grad, unit.packed.error, unit.packed.sum_sq,
                                        unit.packed.update, k=k, eps=group["eps"])
                apply_decoupled_update(layout.locals, layout.views(update), group["lr"], group["weight_decay"])
                for p in unit.params:
                    self.state[p]["step"] += 1
