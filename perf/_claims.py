"""The papers' claims an experiment checks, and the exit status they decide.

Part of the perf harness; scripts reach it through ``perf._harness``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# --------------------------------------------------------------------------- claims


@dataclass(frozen=True)
class Claim:
    """A claim an experiment checks: ``holds`` is the measured verdict.

    ``smoke_scale``: whether a smoke run (a few steps) can decide it (a state size, an exact
    reproduction), or only a full run can (a training result).
    """

    text: str
    holds: bool
    detail: str = ""
    smoke_scale: bool = False


def report_claims(claims: Sequence[Claim], *, smoke: bool) -> int:
    """Print each claim's verdict; the exit status: 1 when a checked claim fails, else 0.

    A smoke run checks only the claims it can decide; the others are reported as not checked.
    """
    status = 0
    if claims:
        print("Claims:")
    for claim in claims:
        detail = f" ({claim.detail})" if claim.detail else ""
        if smoke and not claim.smoke_scale:
            print(f"  not checked (smoke run): {claim.text}{detail}")
            continue
        print(f"  {'PASS' if claim.holds else 'FAIL'}: {claim.text}{detail}")
        if not claim.holds:
            status = 1
    if status:
        print("a claim failed: exit status 1")
    return status
