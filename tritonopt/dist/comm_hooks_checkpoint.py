"""The communication hooks' checkpoints: the fields both states save, and the checks a loaded one passes.

A hook state's ``state_dict`` (:mod:`tritonopt.dist.comm_hooks`) starts with a
header, ``format``, ``version``, ``settings``, ``world_size``, ``process_rank``
and ``iteration``, and the parameters it was saved for (shape and dtype name,
numbered in the order the hook first met them); Top-k adds its buckets, low-rank
its layout, generator and tensors. Every check here raises ``ValueError`` naming
the field, and none changes anything: a state calls them all before loading.
"""

from __future__ import annotations

from typing import Optional

import torch

from tritonopt._validation import FLOAT_DTYPES

__all__ = ["STATE_DICT_VERSION", "StateDictChecks", "check_buckets", "check_header", "check_parameters",
           "describe_parameters"]

STATE_DICT_VERSION = 1
# What both states save first; each adds its own fields after these.
_HEADER_FIELDS = ("format", "version", "settings", "world_size", "process_rank", "iteration", "parameters")
_DTYPES_BY_NAME = {str(d).removeprefix("torch."): d for d in FLOAT_DTYPES}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class StateDictChecks:
    """Checks of one loaded state dict, each raising ``ValueError`` that names the field."""

    def __init__(self, layer: str):
        self.layer = layer

    def fail(self, field: str, message: str):
        raise ValueError(f"{self.layer}.load_state_dict: {field} {message}")

    def int(self, field: str, value, low: int = 0, high: Optional[int] = None) -> int:
        if not _is_int(value) or value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            self.fail(field, f"must be an int {bound}, got {value!r}")
        return value

    def mapping(self, field: str, value, keys) -> dict:
        if not isinstance(value, dict):
            self.fail(field, f"must be a dict, got {type(value).__name__}")
        if set(value) != set(keys):
            self.fail(field, f"must hold exactly the keys {sorted(keys)}, got {sorted(map(str, value))}")
        return value

    def sequence(self, field: str, value) -> list:
        if not isinstance(value, (list, tuple)):
            self.fail(field, f"must be a list, got {type(value).__name__}")
        return list(value)

    def tensor(self, field: str, value, shape: tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            self.fail(field, f"must be a tensor, got {type(value).__name__}")
        if value.dtype != dtype or tuple(value.shape) != tuple(shape):
            self.fail(field, f"must be a {dtype} tensor of shape {tuple(shape)}, got {value.dtype} "
                             f"{tuple(value.shape)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            self.fail(field, "holds a NaN or an infinity (errors and warm starts are always finite)")
        return value

    def same(self, field: str, value, expected) -> None:
        if type(value) is not type(expected) or value != expected:
            self.fail(field, f"is {value!r} but this state has {expected!r}")


def check_header(check: StateDictChecks, state_dict, own_fields, *, format_name: str, settings: dict,
                 world_size: int, process_rank: int) -> int:
    """The saved header against this state's (the fields named here must be the same) and the key set
    (the header's fields and ``own_fields``): the saved iteration."""
    check.mapping("the state dict", state_dict, [*_HEADER_FIELDS, *own_fields])
    check.same("format", state_dict["format"], format_name)
    check.same("version", state_dict["version"], STATE_DICT_VERSION)
    saved_settings = check.mapping("settings", state_dict["settings"], settings)
    for name, value in settings.items():
        check.same(f"settings.{name}", saved_settings[name], value)
    check.same("world_size", state_dict["world_size"], world_size)
    check.same("process_rank", state_dict["process_rank"], process_rank)
    return check.int("iteration", state_dict["iteration"])


def describe_parameters(parameters) -> list:
    """``[[shape as a list, dtype name]]`` per ``(shape, dtype)``, as a state dict saves them."""
    return [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in parameters]


def check_parameters(check: StateDictChecks, entries) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The saved ``parameters`` field as ``[(shape, dtype)]`` per parameter number."""
    layout = []
    for key, entry in enumerate(check.sequence("parameters", entries)):
        entry = check.sequence(f"parameters[{key}]", entry)
        if len(entry) != 2:
            check.fail(f"parameters[{key}]", f"must be [shape, dtype name], got {entry!r}")
        shape = check.sequence(f"parameters[{key}] shape", entry[0])
        for size in shape:
            check.int(f"parameters[{key}] shape", size)
        if entry[1] not in _DTYPES_BY_NAME:
            check.fail(f"parameters[{key}] dtype", f"must be one of {sorted(_DTYPES_BY_NAME)}, got {entry[1]!r}")
        layout.append((tuple(shape), _DTYPES_BY_NAME[entry[1]]))
    return layout


def check_buckets(check: StateDictChecks, field: str, buckets, layout) -> list[tuple[int, tuple[int, ...], object]]:
    """``[(index, keys, entry)]`` of a list of buckets, each parameter number in exactly one of them."""
    out, indices, owner = [], set(), {}
    for position, entry in enumerate(check.sequence(field, buckets)):
        if not isinstance(entry, dict) or "index" not in entry or "keys" not in entry:
            check.fail(f"{field}[{position}]", "must be a dict with an index and keys")
        index = check.int(f"{field}[{position}].index", entry["index"])
        if index in indices:
            check.fail(f"{field}[{position}].index", f"repeats bucket {index}")
        indices.add(index)
        keys = []
        for key in check.sequence(f"{field}[{position}].keys", entry["keys"]):
            check.int(f"{field}[{position}].keys", key, 0, len(layout) - 1)
            if key in owner:
                check.fail(f"{field}[{position}].keys", f"repeat parameter {key} (also in bucket {owner[key]})")
            owner[key] = index
            keys.append(key)
        out.append((index, tuple(keys), entry))
    if out and len(owner) != len(layout):
        check.fail(field, f"cover {len(owner)} of the {len(layout)} parameters; a saved iteration covers all")
    return sorted(out, key=lambda item: item[0])
