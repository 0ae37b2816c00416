"""The planners' clock: search effort counted in work done, not in seconds elapsed.

A plan must depend on its inputs and seed, never on how fast the machine happened to be (DESIGN.md,
"Plans are a function of their inputs"). So the planners do not stop on wall-clock time: every loop
that searches charges an ``Effort`` for the work it did (``tick``: a step and the array elements it
touched), every CP-SAT call runs on a deterministic-time budget with a fixed worker count and is
charged the deterministic time it used, and every phase's share of the search is a share of the
effort budget. The same inputs, seed and budget give the same plan on an idle machine, on a loaded
one, and on a faster one.

Effort is measured in *reference seconds*: the constants below are calibrated so that one unit is
about one second of planning on the reference machine (2 cores of a CI-class x86 server, the
machine ``make test`` runs on): ``effort=1`` plans a 64 GPU x 512 sequence step in about a second
there (docs/solver.md, "Deterministic plans", has the calibration). A faster machine finishes the
same plan sooner; a loaded one later.

The wall clock is only a safety cap (``cap_s``): when it passes, ``now()`` jumps to infinity, every
phase ends at its next check, and ``capped`` says so; the plan then depends on the machine, and its
stats and reason say that too.

Pure Python; no torch.
"""

from __future__ import annotations

import math
import time

__all__ = ["Effort", "Phases", "STEP_S", "ELEMENT_S", "DTIME_PER_S", "DEFAULT_EFFORT", "default_cap_s"]

DEFAULT_EFFORT = 1.0
"""The effort a plan gets unless told (reference seconds)."""

STEP_S = 15e-6
"""Reference seconds one search step costs beyond its arrays (the Python and numpy call overheads)."""

ELEMENT_S = 1.8e-9
"""Reference seconds per array element a search step touches."""

DTIME_PER_S = 1.0
"""CP-SAT deterministic time per reference second of effort (measured: two workers interleaved in
batches of two use about one unit of deterministic time per second on the reference machine)."""

CPSAT_CALL_S = 0.05
"""Reference seconds every CP-SAT call costs beyond its deterministic time (loading the model)."""

CAP_FACTOR = 10.0
"""With no explicit cap, the wall clock stops a plan after this many times its effort ..."""

CAP_SLACK_S = 5.0
"""... plus this many seconds."""


def default_cap_s(effort: float) -> float:
    """The wall-clock safety cap of a plan of ``effort`` when none is given: far beyond what the
    effort takes on a loaded machine, so that it only ends a search that would not."""
    return CAP_FACTOR * float(effort) + CAP_SLACK_S


class Effort:
    """A deterministic clock for one plan: ``now()`` is the effort spent so far (reference seconds),
    advanced only by ``tick`` and ``charge_cpsat``; ``budget`` is what the plan may spend. Deadlines
    are points on this clock (``now() + share * left``); ``past(deadline)`` says whether one is passed.

    ``cap_s``: the wall-clock safety cap (None: none). Once it passes ``now()`` is infinite,
    ``past`` is true for every deadline and ``capped`` is set."""

    def __init__(self, budget: float = DEFAULT_EFFORT, cap_s: float | None = None) -> None:
        if not budget > 0:
            raise ValueError(f"the planning effort must be positive, got {budget!r}")
        if cap_s is not None and not cap_s > 0:
            raise ValueError(f"the wall-clock cap must be positive seconds, got {cap_s!r}")
        self.budget = float(budget)
        self.cap_s = None if cap_s is None else float(cap_s)
        self.spent = 0.0
        self.capped_at: float | None = None
        self._t0 = time.perf_counter()
        self._parent: Effort | None = None

    def child(self, budget: float) -> "Effort":
        """A clock for a planner run inside this one (its rivals: ``workbench.solve.rivals``): its own
        ``budget``, counted from 0 as a fresh clock would be, so that the planner decides exactly as
        it would alone; everything it is charged is charged here too, and this clock's wall-clock cap
        ends it as well."""
        out = Effort(budget)
        out.cap_s, out._t0, out._parent = self.cap_s, self._t0, self
        return out

    # ---- the clock ------------------------------------------------------------------------------
    def tick(self, elements: float = 0.0, steps: float = 1.0) -> None:
        """Charge ``steps`` search steps that touched ``elements`` array elements in all."""
        units = steps * STEP_S + float(elements) * ELEMENT_S
        self.spent += units
        if self._parent is not None:
            self._parent.charge(units)

    def charge(self, units: float) -> None:
        """Charge ``units`` reference seconds of work measured some other way."""
        units = max(0.0, float(units))
        self.spent += units
        if self._parent is not None:
            self._parent.charge(units)

    def now(self) -> float:
        """The effort spent so far; infinite once the wall-clock cap has passed."""
        if self.capped_at is None and self.cap_s is not None and self.wall_s() > self.cap_s:
            self.capped_at = self.spent
        return math.inf if self.capped_at is not None else self.spent

    def past(self, deadline: float) -> bool:
        """Whether the clock is past ``deadline`` (always, once the cap has passed: deadlines taken
        from ``now()`` after it are infinite too, and inf > inf is false)."""
        return self.now() > deadline or self.capped_at is not None

    def left(self, deadline: float | None = None) -> float:
        """Effort left before ``deadline`` (default: the budget's end), at least 0."""
        end = self.budget if deadline is None else deadline
        return max(0.0, end - self.now())

    @property
    def capped(self) -> bool:
        """Whether the wall-clock cap has ended the search."""
        self.now()
        return self.capped_at is not None

    def wall_s(self) -> float:
        """Wall-clock seconds since the plan started (measured: not part of any decision)."""
        return time.perf_counter() - self._t0

    def wall_left_s(self) -> float:
        """Wall-clock seconds left before the cap (infinite without one)."""
        return math.inf if self.cap_s is None else max(0.0, self.cap_s - self.wall_s())

    # ---- CP-SAT -------------------------------------------------------------------------------
    def cpsat_dtime(self, units: float) -> float:
        """CP-SAT's deterministic-time limit for ``units`` of effort."""
        return max(0.0, float(units)) * DTIME_PER_S

    def charge_cpsat(self, deterministic_time: float) -> None:
        """Charge a CP-SAT call: the deterministic time it used, and loading its model."""
        self.charge(CPSAT_CALL_S + float(deterministic_time) / DTIME_PER_S)

    # ---- reporting ----------------------------------------------------------------------------
    def report(self) -> dict:
        """The effort as plain data for a plan's stats: ``budget``, ``spent`` (reference seconds;
        deterministic unless ``capped``), ``cap_s`` and ``capped``."""
        capped = self.capped
        spent = self.capped_at if capped else self.spent
        return {"budget": self.budget, "spent": round(float(spent), 9), "cap_s": self.cap_s, "capped": capped}


class Phases:
    """Effort and wall-clock seconds per named phase of a planner (``lap(name)`` closes the phase
    that ran since the last lap). ``effort`` is deterministic and goes into the plan's stats;
    ``wall`` is measured and goes into its ``stats["wall"]``."""

    def __init__(self, clock: Effort) -> None:
        self.clock = clock
        self.effort: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self._e, self._w = clock.spent, clock.wall_s()

    def lap(self, name: str) -> None:
        e, w = self.clock.spent, self.clock.wall_s()
        self.effort[name] = round(self.effort.get(name, 0.0) + e - self._e, 9)
        self.wall[name] = self.wall.get(name, 0.0) + w - self._w
        self._e, self._w = e, w
