"""What every planner takes besides the batch and the cost model: seed, effort, cap, progress, cancel."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

from workbench.solve.effort import DEFAULT_EFFORT, Effort, default_cap_s

__all__ = ["PlanOptions", "Cancelled", "CancelToken"]


class Cancelled(Exception):
    """Raised inside a planner when its cancel token is set."""


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    seed: int = 0
    """Seeds every random choice, so plans are reproducible."""
    effort: float = DEFAULT_EFFORT
    """How much a solver may search, in reference seconds (``workbench.solve.effort``): counted in
    work done, so the same inputs, seed and effort give the same plan on any machine, however
    loaded. 1 plans a 64 GPU x 512 sequence step in about a second on the 2-core reference machine."""
    time_limit: float | None = None
    """Wall-clock safety cap in seconds (None: ``effort.default_cap_s(effort)``, ten times the
    effort and more). When it ends a search the plan depends on the machine and says so."""
    max_len: int | None = None
    """The max context the data is configured for (static-max sizes its degree for it); None: the
    longest sequence of the batch."""
    progress: Callable[[float, str], None] | None = None
    """Called with (fraction done in [0, 1], message) from the planning thread."""
    cancel: CancelToken | None = None
    """A threading.Event (or anything with is_set()); planners stop with Cancelled when it is set."""
    clock: Effort | None = None
    """The running clock of the plan these options belong to: a planner called by another shares
    its caller's (its ``effort`` is then its share of the caller's budget)."""

    def start(self) -> tuple["PlanOptions", Effort]:
        """These options with a running clock, and the clock: the caller's when these options
        carry one, else a new ``Effort`` of ``effort`` with the wall-clock cap."""
        if self.clock is not None:
            return self, self.clock
        cap = self.time_limit if self.time_limit is not None else default_cap_s(self.effort)
        clock = Effort(self.effort, cap_s=cap)
        return dataclasses.replace(self, clock=clock), clock

    def report(self, fraction: float, message: str) -> None:
        """Forward progress to the callback, if any."""
        if self.progress is not None:
            self.progress(min(1.0, max(0.0, float(fraction))), message)

    def check_cancel(self) -> None:
        """Raise Cancelled when the cancel token is set."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("planning was cancelled")
