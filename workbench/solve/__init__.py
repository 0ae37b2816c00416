"""Planners: functions ``(lengths, cost, options) -> Plan``, looked up by name.

Names: ``static:D``, ``static-max``, ``best-static``, ``min-degree``, ``greedy`` and any registered
later (``flexsp``, ``two-stage``). ``run_planner`` is the one entry point the CLI, the simulator,
the trainer and the panels use. Pure numpy (and OR-Tools for the MILP): no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from workbench.cost import CostModel, InfeasibleError
from workbench.solve import baselines
from workbench.solve.effort import DEFAULT_EFFORT
from workbench.solve.options import Cancelled, PlanOptions
from workbench.solve.bound import lower_bound_ms
from workbench.solve.plan import Plan, PlanError, build_plan, plan_from_dict, timeline, validate, with_swap

__all__ = [
    "Plan", "PlanError", "PlanOptions", "Cancelled", "InfeasibleError", "build_plan", "lower_bound_ms",
    "plan_from_dict", "timeline", "validate", "run_planner", "register_planner", "planner_names",
]

PlannerFn = Callable[[np.ndarray, CostModel, PlanOptions], Plan]

_PLANNERS: dict[str, PlannerFn] = {
    "static-max": baselines.plan_static_max,
    "best-static": baselines.plan_best_static,
    "min-degree": baselines.plan_min_degree,
    "greedy": baselines.plan_greedy,
}


def register_planner(name: str, fn: PlannerFn) -> None:
    """Make ``fn`` available as planner ``name``."""
    _PLANNERS[name] = fn


def planner_names() -> list[str]:
    """Known planner names (``static:D`` stands for any candidate degree D)."""
    _load_optional()
    return ["static:D", *_PLANNERS]


def _load_optional() -> None:
    # the MILP and two-stage planners register themselves on import; they need OR-Tools
    for mod in ("workbench.solve.flexsp", "workbench.solve.two_stage"):
        try:
            __import__(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("workbench"):
                continue
            raise


def get_planner(name: str) -> PlannerFn:
    """The planner function for ``name``; raises ValueError listing the known names."""
    _load_optional()
    if name.startswith("static:"):
        try:
            degree = int(name.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"planner {name!r}: the degree after 'static:' must be an integer, e.g. static:8") from None
        return lambda s, cost, opts: baselines.plan_static(s, cost, opts, degree)
    if name not in _PLANNERS:
        raise ValueError(f"unknown planner {name!r}; known planners: {', '.join(planner_names())}")
    return _PLANNERS[name]


def run_planner(
    name: str,
    lengths,
    cost: CostModel,
    *,
    seed: int = 0,
    effort: float = DEFAULT_EFFORT,
    time_limit: float | None = None,
    max_len: int | None = None,
    progress=None,
    cancel=None,
    batch_id: str | None = None,
) -> Plan:
    """Plan one step's batch with planner ``name``, searching ``effort`` reference seconds
    (``workbench.solve.effort``): the plan is a function of the lengths, the cost model, ``seed``
    and ``effort`` alone. ``time_limit`` is a wall-clock safety cap (None: ten times the effort and
    more); when it ends the search the plan's ``stats["effort"]["capped"]`` is true and its
    ``reason`` says the plan depends on the machine.

    Returns the Plan (tagged with ``batch_id``; ``solve_seconds`` is the wall time it took, the one
    figure of it that is measured rather than planned). Raises ValueError for an unknown planner or
    bad lengths, InfeasibleError when a sequence fits no group (naming it, the memory it needs and
    the degree that would hold it), Cancelled when ``cancel`` is set. Safe to call from a background
    thread: progress goes to ``progress(fraction, message)``.
    """
    fn = get_planner(name)
    s = np.asarray(lengths)
    if s.ndim != 1 or s.size == 0:
        raise ValueError("a batch needs at least one sequence length")
    if not np.issubdtype(s.dtype, np.integer) or (s <= 0).any():
        bad = int(np.flatnonzero(~(s > 0))[0]) if (s <= 0).any() else 0
        raise ValueError(f"sequence lengths must be positive integers; sequence {bad} is {s[bad]!r}")
    s = s.astype(np.int64)
    cost.check_feasible(s)
    full, cost = cost, cost.without_swap()  # planners search without swap; the chosen plan's groups swap after
    opts, clock = PlanOptions(seed=seed, effort=effort, time_limit=time_limit, max_len=max_len, progress=progress,
                              cancel=cancel).start()
    opts.report(0.0, f"{name}: planning {s.size} sequences on {cost.cluster.num_gpus} GPUs")
    plan = with_swap(fn(s, cost, opts), s, full)
    stats = dict(plan.stats)
    stats["effort"] = clock.report()
    reason = plan.reason
    if clock.capped:
        note = (f"the wall-clock cap ({clock.cap_s:g} s) ended the search after {clock.capped_at:.2f} of {clock.budget:g} "
                f"reference seconds of effort: this plan depends on the machine's speed (raise --time-limit, or "
                f"lower --effort)")
        reason = f"{reason}; {note}" if reason else note
    plan = dataclasses.replace(plan, stats=stats, reason=reason, solve_seconds=clock.wall_s())
    opts.report(1.0, f"{name}: makespan {plan.makespan_ms:,.0f} ms ({plan.gap:+.1%} over the lower bound)")
    return plan.with_batch(batch_id)
