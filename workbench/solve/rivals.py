"""The plans ``flexsp`` must never be behind: every other planner's, for the same batch, seed and effort.

``flexsp`` promises a step at least as short as any other planner's (issue: "never behind a
baseline"). It keeps that promise by taking their plans as candidates, computed exactly as
``run_planner`` would compute them alone: the same functions, the same seed, the same effort on a
clock of their own (``Effort.child``: counted from zero, charged to flexsp's clock too), so a
planner decides inside flexsp what it decides alone.

- ``greedy`` (all three of its list-scheduling rules) and ``min-degree`` (greedy's rule of that
  name is its plan, the same list scheduling on the smallest degrees);
- ``best-static``, which is never slower than ``static-max`` or any ``static:D`` that holds the
  batch (it tries every such degree, static-max's among them);
- ``two-stage``, for batches of at most ``TWO_STAGE_MAX_SEQS`` sequences: above that its first pass
  alone takes more than a plan's effort, and flexsp does not wait for it (the promise holds up to
  that size).

Pure numpy (and OR-Tools through two-stage); no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from workbench.cost import CostModel
from workbench.solve.baselines import greedy_rule_plans, plan_best_static
from workbench.solve.options import PlanOptions
from workbench.solve.plan import Plan
from workbench.solve.two_stage import plan_two_stage

__all__ = ["Rivals", "rival_plans", "TWO_STAGE_MAX_SEQS", "MIN_SEARCH_SHARE"]

TWO_STAGE_MAX_SEQS = 4096
"""No two-stage rival above this many sequences (its first pass alone overruns a plan's effort)."""

MIN_SEARCH_SHARE = 0.5
"""flexsp's own search gets what its rivals left of the effort budget, and at least this share of
it (so a plan takes at most 1.5 times its effort)."""


@dataclass
class Rivals:
    """The other planners' plans of one batch: ``greedy`` (its rules' plans, fastest first),
    ``best_static``, ``two_stage`` (None above ``TWO_STAGE_MAX_SEQS``)."""

    greedy: list[Plan]
    best_static: Plan
    two_stage: Plan | None

    def all(self) -> list[Plan]:
        """Every plan, the greedy rules' each."""
        return [*self.greedy, self.best_static, *([self.two_stage] if self.two_stage is not None else [])]

    def best(self) -> Plan:
        """The fastest of them (the first on ties, in the order of ``all``)."""
        return min(self.all(), key=lambda p: p.makespan_ms)

    def makespans(self) -> dict:
        """``{planner: makespan_ms}`` as each planner alone would return it (greedy: its fastest rule)."""
        out = {"greedy": self.greedy[0].makespan_ms, "best-static": self.best_static.makespan_ms}
        if self.two_stage is not None:
            out["two-stage"] = self.two_stage.makespan_ms
        return out


def rival_plans(lengths, cost: CostModel, opts: PlanOptions) -> Rivals:
    """The other planners' plans of ``lengths`` (module docstring), each as ``run_planner`` would
    make it with ``opts.seed`` and ``opts.effort``; their work is charged to ``opts.clock``. Raises
    what the planners raise (InfeasibleError, Cancelled)."""
    opts, clock = opts.start()
    quiet = dataclasses.replace(opts, progress=None)
    rules = sorted(greedy_rule_plans(lengths, cost, dataclasses.replace(quiet, clock=clock.child(opts.effort))),
                   key=lambda p: p.makespan_ms)
    opts.check_cancel()
    static = plan_best_static(lengths, cost, quiet)
    opts.check_cancel()
    two = None
    if len(lengths) <= TWO_STAGE_MAX_SEQS:
        two = plan_two_stage(lengths, cost, dataclasses.replace(quiet, clock=clock.child(opts.effort)))
    return Rivals(greedy=rules, best_static=static, two_stage=two)
