"""Helpers of the perf/ tests: import a perf module, run a perf script, each smoke run once per session."""

from __future__ import annotations

import atexit
import contextlib
import csv
import functools
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
PERF_DIR = REPO_ROOT / "perf"
# The scripts: every perf module whose name does not start with an underscore.
SCRIPTS = sorted(path.stem for path in PERF_DIR.glob("[!_]*.py") if path.stem != "__init__")


def perf_module(name: str) -> ModuleType:
    """``perf.<name>``, importable whatever the working directory (the package is loaded from its path)."""
    if "perf" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "perf", PERF_DIR / "__init__.py", submodule_search_locations=[str(PERF_DIR)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules["perf"] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"perf.{name}")


def script_env() -> dict[str, str]:
    env = dict(os.environ)
    # Plumbing only: the interpreter would make any Triton path crawl, and the CPU never counts as Triton.
    env.pop("TRITON_INTERPRET", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_script(name: str, *args: str, timeout: int = 300, as_file: bool = False) -> subprocess.CompletedProcess:
    """``python -m perf.<name> ARGS`` (or ``python perf/<name>.py ARGS``) from the repository root."""
    command = [sys.executable, str(PERF_DIR / f"{name}.py")] if as_file else [sys.executable, "-m", f"perf.{name}"]
    return subprocess.run(command + list(args), cwd=REPO_ROOT, env=script_env(), capture_output=True,
                          text=True, timeout=timeout)


_SMOKE_ROOT = Path(tempfile.mkdtemp(prefix="perf-smoke-"))
atexit.register(shutil.rmtree, _SMOKE_ROOT, ignore_errors=True)


# A test that runs a perf script end to end (a subprocess: seconds of interpreter start-up, and for the
# experiments real training) carries the ``smoke`` mark: ``make test-smoke`` runs those, not the default suite.

# Extra arguments of a script's smoke run, where its default leaves something out.
SMOKE_ARGS = {"autotune": ("--model", "resnet18", "bert-base")}


@functools.lru_cache(maxsize=None)
def smoke_run(name: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m perf.<name> --smoke --out DIR ARGS`` (ARGS: ``SMOKE_ARGS[name]`` by default),
    run once per test session for all the tests that ask; (result, DIR)."""
    args = args or SMOKE_ARGS.get(name, ())
    out = _SMOKE_ROOT / "-".join((name,) + args).replace(" ", "_").replace("/", "_")
    result = run_script(name, "--smoke", "--out", str(out), *args)
    return result, out


def output_of(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def read_csv(path: Path) -> list[dict]:
    with Path(path).open(newline="") as handle:
        return list(csv.DictReader(handle))


@contextlib.contextmanager
def modules_set_aside(*packages: str):
    """Set the imported modules of ``packages`` aside for the block, where a fake checkout
    imports its own under the same names, and put them back after."""
    def named(name: str) -> bool:
        return name.split(".")[0] in packages

    saved = {name: module for name, module in sys.modules.items() if named(name)}
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [name for name in sys.modules if named(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
