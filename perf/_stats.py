"""Mean and standard error over seeds, and their printed form, for every experiment."""

from __future__ import annotations

import math

import numpy as np


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n)); the error is NaN for one value."""
    values = np.asarray([float(v) for v in values])
    if values.size == 0:
        raise ValueError("mean_se needs at least one value")
    # numpy, not statistics: a diverged run's NaN or inf must give a NaN figure, not an exception.
    with np.errstate(invalid="ignore"):
        se = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else float("nan")
    return float(values.mean()), se


def pm(mean: float, se: float, digits: int = 2, signed: bool = False) -> str:
    """``mean ± se`` (the mean alone where the error is NaN); ``signed``: a difference, with its sign."""
    text = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    return text if math.isnan(se) else f"{text} ± {se:.{digits}f}"
