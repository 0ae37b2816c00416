"""The ``flexsp`` planner: heterogeneous SP groups for a whole step, planned by the step's execution.

How a step runs decides what is planned (DESIGN.md, "The solver, precisely"):

- ``free`` (ZeRO 0-2, replicated parameters): groups stacked on aligned rank blocks, each rank
  running its groups back to back: ``workbench.solve.free.plan_free``;
- ``lockstep`` (ZeRO-3, FSDP2): passes every rank joins together:
  ``workbench.solve.lockstep.plan_lockstep``.

Both build on one micro-step's machinery (``workbench.solve.microstep``: the cost table, its
heuristic and moves, its CP-SAT model) and are bounded below by ``workbench.solve.bound``. This
module only picks between them and registers the name.

Pure numpy + OR-Tools; no torch.
"""

from __future__ import annotations

from workbench.cost import CostModel
from workbench.solve.free import plan_free
from workbench.solve.lockstep import plan_lockstep
from workbench.solve.options import PlanOptions
from workbench.solve.plan import Plan

__all__ = ["plan_flexsp"]


def plan_flexsp(lengths, cost: CostModel, opts: PlanOptions | None = None, *, cpsat: bool = True, **free_options) -> Plan:
    """The ``flexsp`` plan of one step: ``plan_lockstep`` for a lockstep (ZeRO-3) cost model,
    ``plan_free`` (with ``free_options``: ``bucketing``, ``buckets``) for a free one. ``cpsat=False``
    skips the CP-SAT models (the ablation ``bench/solver.py`` reports). Returns what they return and
    raises what they raise (InfeasibleError when a sequence fits no group, Cancelled when cancelled)."""
    if cost.execution == "lockstep":
        return plan_lockstep(lengths, cost, opts, cpsat=cpsat)
    return plan_free(lengths, cost, opts, cpsat=cpsat, **free_options)


def _register() -> None:
    from workbench.solve import register_planner

    register_planner("flexsp", plan_flexsp)


_register()
