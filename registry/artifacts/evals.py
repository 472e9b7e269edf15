"""An artifact's gate status, judged from its eval results.

Apart from the ORM rows: a rule over whatever results a caller holds (all of them, or those a channel
was promoted with), which the resolve, channel and web code apply without touching the tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kiln.core.evals import EvalStatus

__all__ = ["EvalStatus", "HasStatus", "eval_status"]


class HasStatus(Protocol):
    @property
    def status(self) -> str: ...


def eval_status(evals: Iterable[HasStatus]) -> EvalStatus:
    """An artifact's gate status: failed if any runtime failed it, passed if any passed, else not_evaluated."""
    statuses = {e.status for e in evals}
    if "failed" in statuses:
        return "failed"
    if "passed" in statuses:
        return "passed"
    return "not_evaluated"
