"""Runs a perf script started as a file, ``python perf/<name>.py``, as ``python -m perf.<name>``.

Python puts the script's folder, ``perf/``, first on ``sys.path``; the scripts import the
``perf`` package as they do under ``python -m`` from the repository root, so the repository
root takes that first place before the module runs. Imported only in that case, from the
first lines of each script.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import NoReturn


def run(script: str) -> NoReturn:
    path = Path(script).resolve()
    sys.path[0] = str(path.parents[1])
    runpy.run_module(f"perf.{path.stem}", run_name="__main__", alter_sys=True)
    raise SystemExit(0)
