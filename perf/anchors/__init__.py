"""tritonopt's optimizers beside the authors' own implementations of the same algorithms.

An *anchor pair* is one algorithm built twice over the same model: with tritonopt and with the
authors' code (the *anchor*), at the same hyperparameters, as two ``TrainStep`` builders
(``perf/_optimizers.py``: ``step(x, y, loss_fn) -> loss``, the update inside
``step.update_timer()``). ``perf.bench_anchors`` times both in one run and checks that they
still agree: in lockstep (both updating the same parameters with the same gradient), each
step's updates must match to float32 rounding.

The anchors are not dependencies of tritonopt. They are read from checkouts of the authors'
repositories under one folder (``--anchors DIR``, default ``.anchors/`` at the repository root,
which ``make anchors`` fills), named as in :data:`CHECKOUTS`. A pair whose anchor is missing is
reported as skipped, with what to install.
"""

from __future__ import annotations

import importlib
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from perf._optimizers import TrainStep

# Folder name under the anchors folder -> the repository it is a checkout of.
CHECKOUTS = {
    "kfac-pytorch": "gpauloski/kfac-pytorch",
    "fosi": "hsivan/fosi",
    "EFCP": "IST-DASLab/EFCP",
}


class AnchorMissing(RuntimeError):
    """The anchor's code cannot be imported here; the message says what to install."""


@dataclass(frozen=True)
class AnchorPair:
    """One algorithm, built by tritonopt and by its authors' code, at the same settings.

    ``period``: steps between the algorithm's periodic work (an eigendecomposition, an ESE),
    so that timings are means over whole periods. ``agreement_steps``: how many lockstep steps
    the agreement check runs (past any warm-up, through at least one periodic update).
    ``rtol``: the bound on each step's ``max |u_tritonopt - u_anchor| / max |u_anchor|`` (``u``:
    the change of the parameters), derived from the float32 rounding of the operations where
    the pair is defined.
    """

    name: str
    anchor: str  # "owner/repository"
    build_tritonopt: Callable[[torch.nn.Module], TrainStep]
    build_anchor: Callable[[torch.nn.Module], TrainStep]
    period: int = 1
    agreement_steps: int = 10
    rtol: float = 1e-5
    notes: str = ""
    settings: dict = field(default_factory=dict)


def checkout(anchors_dir: Path, folder: str) -> Path:
    """The checkout ``anchors_dir / folder``, or :class:`AnchorMissing` naming the repository."""
    path = Path(anchors_dir) / folder
    if not path.is_dir():
        raise AnchorMissing(
            f"no checkout of {CHECKOUTS[folder]} at {path}: run `make anchors`, or clone it there"
        )
    return path


def _stub_module(name: str) -> types.ModuleType:
    """An empty module: stands in for an anchor's logging-only imports (wandb, line_profiler)."""
    module = types.ModuleType(name)

    def anything(attr: str):
        # Dunder look-ups (__file__, __path__, ...) must fail as on a real module: inspect and
        # importlib probe them on every module in sys.modules.
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: None

    module.__dict__["__getattr__"] = anything
    return module


@contextmanager
def importable(root: Path, *, stubs: Sequence[str] = ()) -> Iterator[None]:
    """Make ``root`` importable (first on ``sys.path``), with ``stubs`` as empty modules if absent.

    The anchors' training scripts import experiment loggers that the optimizers only call for
    logging; an empty module in their place leaves the arithmetic untouched.
    """
    added = []
    for name in stubs:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = _stub_module(name)
            added.append(name)
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        # Keep the stubs: modules imported above hold references to them.


def require(module: str, install: str) -> types.ModuleType:
    """Import ``module`` or raise :class:`AnchorMissing` saying ``install``."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise AnchorMissing(f"cannot import {module} ({error}): {install}") from error


# Each module of this package (kfac.py, fosi.py, efcp.py) defines
#     pairs(anchors_dir: Path, size: perf.bench_optimizer_step.Size) -> list[AnchorPair]
# raising AnchorMissing when its anchor cannot be imported.
