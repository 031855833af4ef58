"""The checkpoints of a packed optimizer: ``state_dict``, its checks, ``load_state_dict``.

:class:`PackedCheckpoints` is the part of :class:`~tritonopt.optim._packed.PackedOptimizer`
that saves and loads: a checkpoint keeps every tensor's saved dtype (the base
class would cast float state to the parameter's dtype), carries ``skipped_steps``
and names the layout it was saved for (``param_layout``: each parameter's shape
and dtype, in order, per group); a state dict is checked whole (layout,
hyperparameters, counters, every entry's shape and dtype, see
:meth:`PackedCheckpoints._checkpoint_spec`) before anything is loaded.

Every ``state_dict`` carries its layout and skipped steps in each parameter group
as well (``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` keeps only
``state`` and ``param_groups``), so that ``get_optimizer_state_dict`` and
``set_optimizer_state_dict`` serve plain models too. Sharded optimizers: a
``state_dict`` shows the per-rank state as DTensors (so that
``torch.distributed.checkpoint`` saves every rank's part) and carries the world
size in each group. A checkpoint resumes on as many ranks as saved it, or on any
number (an unsharded model in one process included) where the whole state is per
coordinate or the same on every rank (:meth:`PackedCheckpoints._reshard_refusal`
is None): ``torch.distributed.checkpoint`` reshards it exactly.

On a 2-D (HSDP) mesh the world size is the shard dimension's: the ranks of a
replica group hold the same state, which the ``state_dict`` shows replicated
along the replicate dimension (``torch.distributed.checkpoint`` saves it once).
So "as many ranks" means as many along the shard dimension, whatever the number
of replicas: a checkpoint of an ``R x S`` mesh resumes on an ``R' x S`` mesh or
on a 1-D mesh of ``S`` ranks (and a 1-D one of ``S`` ranks on an ``R' x S``
mesh), each shard rank taking the state its index held; another ``S`` is
refused, unless ``RESHARDABLE``.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from tritonopt.optim._checkpoints import (
    LAYOUT_KEY,
    SHARD_WORLD_KEY,
    SKIPPED_KEY,
    CheckpointSpec,
    check_param_layout,
    param_layout,
)
from tritonopt.optim._sharding import (
    is_sharded,
    like_param,
    local_tensor,
    rank_stacked,
    rows_placements,
    shard_world_of,
)

# Kept in every saved parameter group of a sharded optimizer too: torch.distributed.checkpoint's
# get_optimizer_state_dict passes on only "state" and "param_groups".
_GROUP_METADATA = (LAYOUT_KEY, SHARD_WORLD_KEY, SKIPPED_KEY)


class PackedCheckpoints:
    """Saving and loading for :class:`~tritonopt.optim._packed.PackedOptimizer`, which puts it before
    ``torch.optim.Optimizer`` in its bases (see the module docstring).

    A subclass says what a group's checkpoint must hold (:meth:`_checkpoint_spec`)
    and, when it steps sharded parameters, which entries are laid out how.
    """

    # State entries shaped like the parameter's local part, and per-rank window entries (the same shape
    # on every rank): a sharded state_dict shows them as DTensors laid out like the parameter, or stacked
    # over the ranks along their first dimension.
    LIKE_PARAM_ENTRIES: frozenset = frozenset()
    RANK_STACKED_ENTRIES: frozenset = frozenset()
    # Entries of vectors laid out like the parameter, [r, *p.shape] (a DTensor sharded along dimension 1 where the
    # parameter is along 0): a subclass shows them so, and they reshard as the parameter's rows do.
    LIKE_PARAM_ROWS_ENTRIES: frozenset = frozenset()
    # True where a sharded checkpoint may resume on another number of ranks: the whole state is per coordinate
    # and laid out like the parameter (LIKE_PARAM_ENTRIES) or the same on every rank (counters), so what
    # torch.distributed.checkpoint reshards onto this optimizer's parameters is each coordinate's saved state.
    # A subclass whose answer depends on its settings overrides _reshard_refusal instead.
    RESHARDABLE: bool = False

    def _reshard_refusal(self) -> Optional[str]:
        """None where a checkpoint of this optimizer may resume on another number of ranks; else why not (the
        end of the refusal's sentence)."""
        if self.RESHARDABLE:
            return None
        return ("keeps each rank's part of its state (its shards' columns of the window, its blocks) and cannot "
                "reshard it")

    def _resharded_layout(self, name: str, value: torch.Tensor, p) -> Optional[bool]:
        """Whether state ``name`` (``value``) of parameter ``p`` is laid out for ``p`` as this optimizer holds it
        (a DTensor laid out like ``p``, or a tensor of its whole shape); None for an entry that is not per
        coordinate (a counter, a replicated ``m x m`` matrix), which every rank holds alike."""
        if name in self.LIKE_PARAM_ROWS_ENTRIES:
            laid_out = value.dim() == p.dim() + 1 and tuple(value.shape[1:]) == tuple(p.shape)
            if is_sharded(value):
                return laid_out and is_sharded(p) and list(value.placements) == rows_placements(p, 1)
            return laid_out
        if name not in self.LIKE_PARAM_ENTRIES:
            return None
        if is_sharded(value):
            return value.shape == p.shape and value.placements == getattr(p, "placements", None)
        return value.shape == p.shape

    def _checkpoint_spec(self, index: int, group: dict, params: Sequence[torch.Tensor]) -> Optional[CheckpointSpec]:
        """What a checkpoint of group ``index`` (``group``: its saved hyperparameters) must hold; None checks nothing."""
        return None

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        state[LAYOUT_KEY] = param_layout(self.param_groups)
        # The groups name the world size unsharded too (None): a DCP checkpoint loaded into this optimizer's
        # get_optimizer_state_dict then brings the saved one, and a state that cannot reshard is refused.
        metadata = {SKIPPED_KEY: self.skipped_steps, SHARD_WORLD_KEY: None}
        if self._shards is not None:
            state[SHARD_WORLD_KEY] = self._shards.spec.world
            state["state"] = self._sharded_state(state["state"])
            metadata[SHARD_WORLD_KEY] = self._shards.spec.world
        for saved, layout in zip(state["param_groups"], state[LAYOUT_KEY]):
            saved.update({LAYOUT_KEY: layout, **metadata})
        return state

    def _sharded_state(self, saved_state: dict) -> dict:
        """The per-parameter state with each rank's tensors as DTensors (new dicts; the live state is not touched)."""
        params = list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        spec = self._shards.spec
        shown = {}
        for key, entry in saved_state.items():
            p = params[key]
            entry = dict(entry)
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if name in self.LIKE_PARAM_ENTRIES and value.shape == local_tensor(p).shape:
                    entry[name] = like_param(value, p)
                elif name in self.RANK_STACKED_ENTRIES:
                    entry[name] = rank_stacked(value, spec)
            shown[key] = entry
        return shown

    def _local_state_dict(self, state_dict: dict) -> dict:
        """``state_dict`` with DTensor entries as this rank's local tensors and the layout, world size and
        skipped steps at the top (from its groups when only those carry them); the groups lose those keys.

        A DTensor saved on a mesh whose shard dimension (a 1-D mesh's only one) has another size than this
        optimizer's is refused.
        """
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
            state_dict.get("param_groups"), (list, tuple)
        ):
            return state_dict  # check_state_dict names the problem
        out = dict(state_dict)
        groups = []
        for saved in state_dict["param_groups"]:
            if isinstance(saved, dict) and any(key in saved for key in _GROUP_METADATA):
                saved = dict(saved)
                metadata = {key: saved.pop(key) for key in _GROUP_METADATA if key in saved}
                if LAYOUT_KEY not in state_dict:
                    out.setdefault(LAYOUT_KEY, []).append(metadata.get(LAYOUT_KEY))
                for key in (SHARD_WORLD_KEY, SKIPPED_KEY):
                    if key not in metadata:
                        continue
                    if key not in out:
                        out[key] = metadata[key]
                    elif not (type(metadata[key]) is type(out[key]) and metadata[key] == out[key]):
                        raise ValueError(
                            f"{key}: the state dict says {out[key]!r} and one of its parameter groups "
                            f"{metadata[key]!r}; a state dict of state_dict() holds the same value in both"
                        )
            groups.append(saved)
        out["param_groups"] = groups
        world = self._shards.spec.world if self._shards is not None else None
        local_state = {}
        for key, entry in state_dict["state"].items():
            if isinstance(entry, dict) and any(is_sharded(v) for v in entry.values()):
                entry = dict(entry)
                for name, value in entry.items():
                    if is_sharded(value):
                        if shard_world_of(value) != world:
                            refusal = self._reshard_refusal()
                            why = (f"{refusal}: resume on as many ranks" if refusal is not None else
                                   "keeps each rank's part of its state and cannot reshard it: resume on as many "
                                   "ranks (torch.distributed.checkpoint reshards it: dcp.load into this "
                                   "optimizer's get_optimizer_state_dict, then set_optimizer_state_dict)")
                            raise ValueError(
                                f"saved state {name!r} is sharded over {shard_world_of(value)} ranks, and this "
                                f"optimizer's parameters over {world or 1}; {type(self).__name__} {why}"
                            )
                        entry[name] = value.to_local()
            local_state[key] = entry
        out["state"] = local_state
        return out

    def check_state_dict(self, state_dict) -> None:
        """Raise ``ValueError`` naming the first problem unless :meth:`load_state_dict` can load ``state_dict``.

        Checks, without modifying anything: the parameter layout it was saved for
        (``param_layout``), every group's hyperparameters, ``skipped_steps``, that
        the state belongs to listed parameters, and every entry's names, shapes,
        dtypes, counters and finiteness (:meth:`_checkpoint_spec`).
        """
        as_given = state_dict
        state_dict = self._local_state_dict(state_dict)
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
            state_dict.get("param_groups"), (list, tuple)
        ):
            raise ValueError("state_dict must be a dict with 'state' (a dict) and 'param_groups' (a list), "
                             "as state_dict() returns")
        self._check_shard_world(state_dict.get(SHARD_WORLD_KEY))
        saved_state, saved_groups = state_dict["state"], state_dict["param_groups"]
        if not all(isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) for g in saved_groups):
            raise ValueError("each of the state dict's param_groups must be a dict with a 'params' list")
        if len(saved_groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"]) for saved, group in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("the state dict's parameter groups do not match the optimizer's (count or sizes)")
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in saved_groups))
        if len(set(saved_ids)) != len(saved_ids):
            raise ValueError("the state dict's param_groups list a parameter id more than once")
        strays = sorted(set(saved_state) - set(saved_ids), key=str)
        if strays:
            raise ValueError(f"the state dict holds state for parameter ids {strays} that no parameter group lists")
        check_param_layout(state_dict.get(LAYOUT_KEY), self.param_groups)
        self._check_resharded(as_given["state"], saved_groups, state_dict.get(SHARD_WORLD_KEY))
        skipped = state_dict.get("skipped_steps", 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"skipped_steps must be an int >= 0, got {skipped!r}")
        hypers = [{**self.defaults, **{k: v for k, v in saved.items() if k != "params"}} for saved in saved_groups]
        for index, hyper in enumerate(hypers):
            try:
                self._check_group(hyper)
            except TypeError as error:  # a checkpoint's field of the wrong kind is a bad value of the state dict
                raise ValueError(f"param_groups[{index}]: {error}") from error
        self._check_group_set(hypers)
        for index, (saved, group, hyper) in enumerate(zip(saved_groups, self.param_groups, hypers)):
            spec = self._checkpoint_spec(index, hyper, group["params"])
            if spec is not None:
                spec.check(type(self).__name__, [local_tensor(p) for p in group["params"]],
                           [saved_state.get(i) for i in saved["params"]])

    def _check_shard_world(self, saved) -> None:
        """A checkpoint resumes on as many ranks as saved it (None: unsharded), else ``ValueError``; a
        reshardable one's (:meth:`_reshard_refusal`) on any number, its entries checked by
        :meth:`_check_resharded`."""
        world = self._shards.spec.world if self._shards is not None else None
        if saved == world:
            return
        if saved is not None and (isinstance(saved, bool) or not isinstance(saved, int) or saved < 1):
            raise ValueError(f"{SHARD_WORLD_KEY} must be an int >= 1, got {saved!r}")
        refusal = self._reshard_refusal()
        if refusal is None:
            return
        saved_text, mine_text = self._world_texts(saved)
        raise ValueError(
            f"{SHARD_WORLD_KEY}: the state dict was saved for {saved_text}, this optimizer has {mine_text}; "
            f"{type(self).__name__} {refusal}: resume with the same number of ranks"
        )

    def _world_texts(self, saved) -> tuple[str, str]:
        world = self._shards.spec.world if self._shards is not None else None
        mine = f"sharded over {world} ranks" if world is not None else "unsharded parameters"
        if self._shards is not None and self._shards.spec.mesh.ndim == 2:
            mine += f" (the shard dimension of a {self._shards.spec.replicas} x {world} mesh)"
        return (f"sharded over {saved} ranks" if saved is not None else "unsharded parameters", mine)

    def _check_resharded(self, saved_state: dict, saved_groups: Sequence[dict], saved_world) -> None:
        """A checkpoint saved on another number of ranks holds every per-coordinate entry laid out for this
        optimizer's parameters (``ValueError`` otherwise): a DTensor laid out like its parameter (what
        ``torch.distributed.checkpoint`` loads into this optimizer's ``get_optimizer_state_dict``), or a
        tensor of the parameter's whole shape. A rank's part saved on another count of ranks is refused:
        nothing tells which of the parameter's rows it holds.
        """
        world = self._shards.spec.world if self._shards is not None else None
        if saved_world == world:
            return
        saved_ids = itertools.chain.from_iterable(g["params"] for g in saved_groups)
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            entry = saved_state.get(saved_id)
            if not isinstance(entry, dict):
                continue  # CheckpointSpec names the problem
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and self._resharded_layout(name, value, p) is False:
                    saved_text, mine_text = self._world_texts(saved_world)
                    raise ValueError(
                        f"{SHARD_WORLD_KEY}: the state dict was saved for {saved_text}, this optimizer has "
                        f"{mine_text}, and its state {name!r} of shape {tuple(value.shape)} is not laid out like "
                        f"its parameter of shape {tuple(p.shape)}: a rank's part saved on another number of ranks "
                        "cannot be resharded; load a torch.distributed.checkpoint instead (dcp.load into this "
                        "optimizer's get_optimizer_state_dict, then set_optimizer_state_dict)"
                    )

    def load_state_dict(self, state_dict: dict) -> None:
        self.check_state_dict(state_dict)
        state_dict = self._local_state_dict(state_dict)
        skipped = state_dict.pop("skipped_steps", 0)
        state_dict.pop(LAYOUT_KEY)
        state_dict.pop(SHARD_WORLD_KEY, None)
        saved_state = state_dict["state"]
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        # The base class casts float state to the parameter's dtype; keep the saved dtypes.
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            for name, value in saved_state.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    device = value.device if name == "step" else p.device
                    self.state[p][name] = value.to(device=device, copy=True)
        self.skipped_steps = int(skipped)
        self._packed.clear()
