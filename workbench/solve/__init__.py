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
from workbench.specs import degree_chains

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


MEETS = "the plan meets the lower bound"
"""What a planner says of a plan it proved optimal (its ``reason``)."""

SINGLE_DEGREE = ("static", "best-static")
"""Planners whose plans use one degree (every group alike): they take every candidate degree at once.
The others plan over one divisibility chain of degrees at a time (``_over_chains``)."""

CHAIN_MARGIN = 0.02
"""Another chain is searched only when its lower bound is more than this share under both the first
chain's bound and the fastest plan so far: where the bounds are that close the first chain's plan
is as good as another's could be within the planners' usual gap, and the search would only cost time
(64 GPUs x 512 sequences: the four chains' bounds within 1%)."""

MAX_EXTRA_CHAINS = 2
"""... and at most this many chains beyond the first ..."""

EXTRA_EFFORT = 0.5
"""... each with this share of the plan's effort: at most twice the first chain's search in all, and
only where a chain's bound says it may pay (bench/any_size.py measures what that buys)."""


def _over_chains(fn: PlannerFn, s: np.ndarray, cost: CostModel, chains, opts: PlanOptions,
                 full: CostModel) -> tuple[Plan, bool]:
    """The fastest plan of ``fn`` over the cluster's divisibility chains (``ClusterSpec.chains``):
    groups of one chain's degrees pack into aligned blocks, which every planner's placement needs,
    so each run sees one chain (``CostModel.restricted``). The first chain (the one holding the
    powers of two: on a power-of-two cluster the plan of before) is always searched, with ``opts``;
    each other, in order of its lower bound, only while that bound is more than ``CHAIN_MARGIN``
    under the first chain's bound and the fastest plan so far, at most ``MAX_EXTRA_CHAINS`` of them,
    each with ``EXTRA_EFFORT`` of the effort on a clock of its own (the plan stays a function of the
    inputs). The plan's lower bound is the one over every candidate shape (``lower_bound_ms`` on
    ``cost``), so its gap tells the truth about all of them; ``stats["chains"]`` lists each chain's
    degrees, bound and plan (None: not searched). Plans are compared as they will run: with the
    blocks each group swaps under ``full`` (``with_swap``; a plan that loses without swap can win
    with it: 6 GPUs, 100K + 30K + 8K + 8K + 4K, one group of 6 swapping 14 blocks against 6 + 3 + 3
    swapping none). Returns ``(plan, capped)``: the chosen plan before swap (``run_planner`` swaps it)
    and whether a cap ended another chain's search."""
    views = []
    for c in chains:
        v = cost.restricted(c)
        try:
            views.append((v, lower_bound_ms(s, v)))
        except InfeasibleError:  # a sequence no shape of this chain holds
            continue
    if not views:
        raise InfeasibleError(f"no divisibility chain of the degrees {list(cost.degrees)} holds every sequence of this "
                              f"batch in one plan: give degrees that divide one another (--degrees)")
    first = views[0][0]
    best = fn(s, first, opts)
    best_swapped = with_swap(best, s, full)
    tried = [{"degrees": list(first.degrees), "bound_ms": float(views[0][1]), "makespan_ms": best.makespan_ms,
              "swapped_ms": best_swapped.makespan_ms}]
    others = sorted(((b, k) for k, (_, b) in enumerate(views[1:], start=1)), key=lambda x: (x[0], x[1]))
    views = [v for v, _ in views]
    extra, capped = 0, False
    for bound, k in others:
        entry = {"degrees": list(views[k].degrees), "bound_ms": float(bound), "makespan_ms": None, "swapped_ms": None}
        tried.append(entry)
        if extra >= MAX_EXTRA_CHAINS or bound >= min(best.makespan_ms, tried[0]["bound_ms"]) * (1 - CHAIN_MARGIN):
            continue
        extra += 1
        o, clock = dataclasses.replace(opts, clock=None, effort=opts.effort * EXTRA_EFFORT).start()
        o.report(0.0, f"chain {views[k].degrees}: bound {bound:,.0f} ms under the best plan's {best.makespan_ms:,.0f}")
        plan = fn(s, views[k], o)
        capped = capped or clock.capped
        swapped = with_swap(plan, s, full)
        entry.update(makespan_ms=plan.makespan_ms, swapped_ms=swapped.makespan_ms)
        if swapped.makespan_ms < best_swapped.makespan_ms * (1 - 1e-9):
            best, best_swapped = plan, swapped
    lb = float(lower_bound_ms(s, cost))
    status = best.status
    if status == "optimal" and best.makespan_ms > lb * (1 + 1e-6):
        status = "feasible"  # optimal over its chain, not proven over every shape
    stats = dict(best.stats, chains=tried)
    return dataclasses.replace(best, lower_bound_ms=min(lb, best.lower_bound_ms), status=status, stats=stats), capped


def _swap_best(plan: Plan, s: np.ndarray, cost: CostModel, full: CostModel) -> Plan:
    """``plan`` with its groups' swapped blocks (``with_swap``), or, where groups may swap and it is
    faster so, the same plan with the longest sequence's group split in two: the longest sequence
    alone in it, the group's other sequences in a micro-step (pass) of their own right after, on the
    same ranks and split. Alone, the longest sequence's group may swap every block its host memory
    holds for it rather than the count its companions leave room for (24 GPUs, 1M + 200K + 50K +
    8K: 114.0 s against 118.8 s). A plan searched without swap cannot see that; one more plan to
    price is all it costs."""
    swapped = with_swap(plan, s, full)
    if not full.swap or not plan.micro_steps:
        return swapped
    longest = int(np.argmax(s))
    steps, blocks, split = [], [], False
    for ms in plan.micro_steps:
        row, brow, tail, tblocks = [], [], [], []
        for g in ms.groups:
            if longest in g.sequences and len(g.sequences) > 1:
                row.append((g.degree, [longest], g.cp))
                tail.append((g.degree, [i for i in g.sequences if i != longest], g.cp))
                tblocks.append(g.ranks[0] // g.degree)
                split = True
            else:
                row.append((g.degree, list(g.sequences), g.cp))
            brow.append(g.ranks[0] // g.degree)
        steps.append(row)
        blocks.append(brow)
        if tail:
            steps.append(tail)
            blocks.append(tblocks)
    if not split:
        return swapped
    try:
        alt = build_plan(plan.planner, steps, s, cost, status="feasible" if plan.status == "optimal" else plan.status,
                         reason=plan.reason, stats=plan.stats,
                         blocks=blocks, lower_bound=plan.lower_bound_ms)
    except PlanError:
        return swapped
    alt = with_swap(alt, s, full)
    if alt.makespan_ms < swapped.makespan_ms * (1 - 1e-9):
        stats = dict(alt.stats, swap_split={"before_ms": swapped.makespan_ms})
        return dataclasses.replace(alt, stats=stats, batch_id=plan.batch_id)
    return swapped


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
    chains = () if name.startswith(SINGLE_DEGREE) else degree_chains(cost.degrees)
    capped = False  # a cap ended another chain's search (on a clock of its own)
    if len(chains) <= 1:
        plan = fn(s, cost, opts)
    else:
        plan, capped = _over_chains(fn, s, cost, chains, opts, full)
    plan = _swap_best(plan, s, cost, full)
    stats = dict(plan.stats)
    stats["effort"] = dict(clock.report(), **({"capped": True} if capped else {}))
    reason = plan.reason
    if plan.gap > 1e-6 and MEETS in reason:  # said of the plan before swap, or of one chain's bound
        reason = reason.replace(MEETS, "the plan met its lower bound without swap" if "swap" in plan.stats
                                else "the plan met its chain's lower bound")
    if clock.capped or capped:
        where = (f"after {clock.capped_at:.2f} of {clock.budget:g} reference seconds of effort" if clock.capped else
                 "of another divisibility chain's plan")
        note = (f"the wall-clock cap ({clock.cap_s:g} s) ended the search {where}: this plan depends on the machine's "
                f"speed (raise --time-limit, or lower --effort)")
        reason = f"{reason}; {note}" if reason else note
    plan = dataclasses.replace(plan, stats=stats, reason=reason, solve_seconds=clock.wall_s())
    opts.report(1.0, f"{name}: makespan {plan.makespan_ms:,.0f} ms ({plan.gap:+.1%} over the lower bound)")
    return plan.with_batch(batch_id)
