"""tritonopt's optimizers beside the authors' own implementations of the same algorithms.

An *anchor pair* is one algorithm built twice over the same model: with tritonopt and with the
authors' code (the *anchor*), at the same hyperparameters, as two ``TrainStep`` builders
(``perf/_optimizers.py``: ``step(x, y, loss_fn) -> loss``, the update inside
``step.update_timer()``). ``perf.bench_anchors`` times both in one run and checks that they
still agree: in lockstep (both updating the same parameters with the same gradient), each
step's updates must match to float32 rounding.

The anchors are not dependencies of tritonopt. They are read from checkouts of the authors'
repositories under one folder (``--anchors DIR``, default ``.anchors/`` at the repository root,
which ``make anchors`` fills), named as in :data:`CHECKOUTS`. A pair whose checkout is missing is
reported as skipped, with how to get it (:class:`AnchorMissing`); a checkout that is there but
does not import stops the benchmark with the error and how to fix it (:class:`AnchorBroken`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import tomllib
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
    """The anchor's checkout is not there; the message says how to get it."""


class AnchorBroken(RuntimeError):
    """The anchor's checkout is there but its code does not import here; the message gives the
    error and how to fix it."""


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
    anchor: str  # "owner/repository", and how it is configured where two pairs differ in that
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
    logging; an empty module in their place leaves the arithmetic untouched. The stubs are in
    ``sys.modules`` only while the block runs: the modules imported in it keep theirs, and the
    rest of the process still finds such a package missing (a stub ``tqdm`` would hand every
    later ``from tqdm import tqdm`` a function returning None).
    """
    replaced = {}
    for name in stubs:
        try:
            importlib.import_module(name)
        except ImportError:
            replaced[name] = sys.modules.get(name, _ABSENT)
            sys.modules[name] = _stub_module(name)
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for name, before in replaced.items():
            if before is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before


_ABSENT = object()


def _normalized(distribution: str) -> str:
    """A distribution's name as installers compare it: ``kfac-pytorch`` is ``kfac_pytorch``."""
    return re.sub(r"[-_.]+", "_", distribution).lower()


class _CheckoutDistribution(importlib.metadata.Distribution):
    """The metadata of a checkout that was cloned, not installed: its name and version."""

    def __init__(self, root: Path, name: str, version: str):
        self.root = root
        self._metadata_text = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"

    def read_text(self, filename):
        return self._metadata_text if filename == "METADATA" else None

    def locate_file(self, path):
        return self.root / path


class _CheckoutMetadataFinder:
    """Answers ``importlib.metadata`` look-ups of one distribution, and no imports."""

    def __init__(self, distribution: _CheckoutDistribution):
        self.distribution = distribution

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is None or _normalized(context.name) == _normalized(self.distribution.name):
            return iter([self.distribution])
        return iter(())


def checkout_version(root: Path) -> str:
    """The version in a checkout's ``pyproject.toml``, or ``0+checkout`` where it gives none."""
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        project = {}
    return str(project.get("version", "0+checkout"))


@contextmanager
def installed_as(root: Path, distribution: str) -> Iterator[None]:
    """While the block runs, ``importlib.metadata`` finds ``distribution`` (at the checkout's
    version) where it is not installed.

    A package that asks for its own installed version at import (kfac-pytorch does) then
    imports from a plain clone; where the distribution is installed, its own metadata answers.
    """
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        yield
        return
    metadata = _CheckoutDistribution(root, distribution, checkout_version(root))
    finder = _CheckoutMetadataFinder(metadata)
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def broken(root: Path, module: str, error: BaseException) -> AnchorBroken:
    """:class:`AnchorBroken` for the checkout at ``root``: its ``module`` raised ``error``."""
    return AnchorBroken(
        f"the checkout at {root} is there but {module} does not import from it: {error!r}."
        " `make anchors` checks it out at the commit measured here and installs what it needs;"
        f" removing {root} skips its pairs instead"
    )


def require(module: str, install: str) -> types.ModuleType:
    """Import ``module`` or raise :class:`AnchorBroken` saying ``install``: called once the
    anchor's checkout is known to be there, which without ``module`` cannot run."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise AnchorBroken(f"cannot import {module} ({error}): {install}") from error


# Each module of this package (kfac.py, fosi.py, efcp.py) defines
#     pairs(anchors_dir: Path, size: perf.bench_optimizer_step.Size) -> list[AnchorPair]
# raising AnchorMissing when its anchor's checkout is not there, AnchorBroken when it is but
# does not import.
