"""What a packed optimizer's checkpoint must hold, checked before anything is loaded.

:class:`CheckpointSpec` describes one parameter group's saved state (names,
shapes, dtypes, counters); :func:`param_layout` and :func:`check_param_layout`
name the parameters a state dict was saved for, so that a checkpoint resumes
only the parameters it was saved for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch


def _no_entries(p: torch.Tensor) -> dict:
    return {}


@dataclass
class CheckpointSpec:
    """What the saved state of one parameter group must hold, checked before a checkpoint is loaded.

    Every parameter that has state holds the names in ``per_param`` and those
    ``param_shapes(p)`` returns, with those shapes; it may hold ``optional``
    ones. Entries named in ``like_param`` are shaped like the parameter. The first
    parameter's state also holds the group's entries: tensors ``group_shapes``
    and integers ``group_counters`` (each below its bound), which ``group_rule``
    (given that state) may check further by raising ``ValueError``. Tensors named
    in ``dtypes`` have that dtype; ``step_counters`` are 0-d float32 tensors
    holding a whole number ``>= 0``. Every floating-point tensor is finite.
    """

    per_param: frozenset
    like_param: frozenset = frozenset()
    optional: frozenset = frozenset()
    param_shapes: Callable[[torch.Tensor], dict] = _no_entries
    group_shapes: dict = field(default_factory=dict)
    group_counters: dict = field(default_factory=dict)
    dtypes: dict = field(default_factory=dict)
    step_counters: frozenset = frozenset()
    group_rule: Optional[Callable[[dict], None]] = None

    def check(self, owner: str, params: Sequence[torch.Tensor], entries: Sequence[Optional[dict]]) -> None:
        if not any(entries):
            return
        group_names = set(self.group_shapes) | set(self.group_counters)
        for position, (p, entry) in enumerate(zip(params, entries)):
            if not entry:
                continue
            if not isinstance(entry, dict):
                raise ValueError(f"the saved state of a parameter must be a dict, got {type(entry).__name__}")
            expected = dict(self.param_shapes(p))
            required = set(self.per_param) | set(expected) | (group_names if position == 0 else set())
            expected.update({name: tuple(p.shape) for name in self.like_param})
            allowed = required | set(self.optional)
            unknown = sorted(set(entry) - allowed, key=str)
            if unknown:
                raise ValueError(
                    f"the saved state holds {unknown}, which {owner} does not keep: "
                    "was it saved by another optimizer?"
                )
            missing = sorted(required - set(entry))
            if missing:
                raise ValueError(f"the saved state of a parameter lacks {missing}; it cannot be resumed")
            if position == 0:
                expected.update(self.group_shapes)
            for name, shape in expected.items():
                value = entry.get(name)
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(f"saved state {name!r} has shape {got}, expected {tuple(shape)}")
            for name in self.step_counters:
                _check_step_tensor(name, entry.get(name))
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if name in self.dtypes and value.dtype != self.dtypes[name]:
                    raise ValueError(f"saved state {name!r} is {value.dtype}, expected {self.dtypes[name]}")
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ValueError(f"saved state {name!r} holds NaN or inf")
            if position == 0:
                for name, bound in self.group_counters.items():
                    value = entry[name]
                    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
                        raise ValueError(f"saved state {name!r} must be an int in [0, {bound}], got {value!r}")
                if self.group_rule is not None:
                    self.group_rule(entry)


def _check_step_tensor(name: str, value) -> None:
    """A step counter kept as a 0-d float32 tensor: a whole number >= 0 (absent ones are checked elsewhere)."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or value.dtype != torch.float32:
        got = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"saved state {name!r} must be a 0-d float32 tensor, got {got}")
    count = float(value)
    if not (math.isfinite(count) and count >= 0 and count == int(count)):
        raise ValueError(f"saved state {name!r} must hold a whole number >= 0, got {count!r}")


LAYOUT_KEY = "param_layout"
SHARD_WORLD_KEY = "shard_world"
SKIPPED_KEY = "skipped_steps"


def param_layout(groups: Sequence[dict]) -> list[list[tuple]]:
    """Each group's parameters as ``(shape, dtype)`` pairs, in order: what a checkpoint was saved for."""
    return [[(tuple(p.shape), p.dtype) for p in group["params"]] for group in groups]


def check_param_layout(saved, groups: Sequence[dict]) -> None:
    """``saved`` (a state dict's ``param_layout``) names exactly the parameters of ``groups``; else ``ValueError``.

    A checkpoint resumes only the parameters it was saved for: a flat window
    or buffer read for other shapes, another order or another dtype would mix
    their coordinates without any shape telling.
    """
    if saved is None:
        raise ValueError(
            f"the state dict has no {LAYOUT_KEY!r} (the shape and dtype of each parameter it was saved for), so "
            "it cannot be checked against this optimizer's parameters; save it with this version's state_dict()"
        )
    mine = param_layout(groups)
    if not isinstance(saved, (list, tuple)) or len(saved) != len(mine):
        raise ValueError(f"{LAYOUT_KEY} must list one group per parameter group ({len(mine)}), got {saved!r}")
    for index, (saved_group, group) in enumerate(zip(saved, mine)):
        entries = []
        if isinstance(saved_group, (list, tuple)):
            for item in saved_group:
                if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], (list, tuple))
                        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in item[0])
                        and isinstance(item[1], torch.dtype)):
                    raise ValueError(f"{LAYOUT_KEY}[{index}] must hold (shape, dtype) pairs, got {item!r}")
                entries.append((tuple(item[0]), item[1]))
        else:
            raise ValueError(f"{LAYOUT_KEY}[{index}] must be a list of (shape, dtype) pairs, got {saved_group!r}")
        if entries != group:
            raise ValueError(
                f"{LAYOUT_KEY}: the state dict was saved for parameters {_describe(entries)} in group {index}, "
                f"this optimizer has {_describe(group)}; a checkpoint resumes only the parameters it was saved "
                "for (same shapes, dtypes and order)"
            )


def _describe(layout: Sequence[tuple]) -> str:
    return "[" + ", ".join(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in layout) + "]"
