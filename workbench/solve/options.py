"""What every planner takes besides the batch and the cost model: seed, limits, progress, cancel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

__all__ = ["PlanOptions", "Cancelled", "CancelToken"]


class Cancelled(Exception):
    """Raised inside a planner when its cancel token is set."""


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    seed: int = 0
    """Seeds every random choice, so plans are reproducible."""
    time_limit: float = 1.0
    """Seconds a solver may search before returning its best plan."""
    max_len: int | None = None
    """The max context the data is configured for (static-max sizes its degree for it); None: the
    longest sequence of the batch."""
    progress: Callable[[float, str], None] | None = None
    """Called with (fraction done in [0, 1], message) from the planning thread."""
    cancel: CancelToken | None = None
    """A threading.Event (or anything with is_set()); planners stop with Cancelled when it is set."""

    def report(self, fraction: float, message: str) -> None:
        """Forward progress to the callback, if any."""
        if self.progress is not None:
            self.progress(min(1.0, max(0.0, float(fraction))), message)

    def check_cancel(self) -> None:
        """Raise Cancelled when the cancel token is set."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("planning was cancelled")
