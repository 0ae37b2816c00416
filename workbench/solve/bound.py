"""A lower bound on a step's makespan that counts how sequences pack into groups.

``plan.lower_bound_ms`` charges group overhead for the activations' memory as if groups could be
filled to the byte (``sum(activations) / budget`` GPU-slots). Sequences are not divisible: two
sequences that each need more than half a group's memory at some degree never share a group of it,
and a long sequence that needs a wide degree pays that group's whole overhead however little of its
memory it uses (unless other sequences fill the rest, at that degree's cost). ``packing_bound_ms``
is the linear programme that says so.

The linear programme (every plan of the step gives a solution, so its optimum is a lower bound):

- ``x[i, d]`` in [0, 1]: the share of sequence i run at degree d (sum over d = 1; only degrees that
  hold it, and whose single-group time ``time(i, d) + overhead(d)`` is within ``upper_ms``);
- ``y[d] >= 0``: the number of groups of degree d;
- memory: ``sum_i x[i, d] * memory(i, d) <= budget * y[d]`` for each d;
- each group holds at most one sequence that needs more than half its memory:
  ``sum over those i of x[i, d] <= y[d]``; and, weighing a sequence over two thirds 2 and one over
  a third 1, at most 2 per group: ``sum w_i x[i, d] <= 2 y[d]`` (dual-feasible functions of
  bin packing, both valid for any group);
- GPU-time: ``sum_d d * (overhead(d) * y[d] + sum_i x[i, d] * time(i, d)) <= N * T``, as each of the
  N GPUs computes at most the compute time T;
- T is at least every sequence's fastest single-group time on the degrees it may use;
- minimise T. The bound is T plus the gradient sync.

A plan's integer group counts and assignment satisfy every constraint with its own compute time as
T, so the optimum's T is at most any plan's. ``upper_ms`` restricts the degrees only to those a
plan at least as fast as ``upper_ms`` (compute time) could use, so the bound holds for the optimum
whenever ``upper_ms`` is some plan's compute time (or None: no restriction). Sequences of equal
length are one variable per degree (their count as its upper limit): exact, and small at thousands
of sequences. Uses OR-Tools' GLOP; pure numpy otherwise.

Under lockstep execution (ZeRO-3) the step is a sum of passes and ``lockstep_packing_bound_ms``
solves the same programme with the passes in it: ``M >= 1`` passes (continuous, at least the
memory minimum), ``Lam`` the sum of the passes' largest rank loads. A busy rank pays the packed
call's constant C once per pass, each group its extras and sequences, so ``N * Lam >= sum_d d *
(extra(d) * y[d] + sum_i x[i, d] * time(i, d)) + C * busy`` with ``busy`` the busy rank-passes:
at least ``M`` and the activations over the budget (and, when every rank serves one group per
pass, ``sum_d d * y[d]`` with ``sum_d d * y[d] <= N * M``). A rank holds in a pass at most one
sequence's share over half its budget (and two "units", shares over a third), so those shares'
rank-slots are at most ``N * M`` (``2 * N * M``). Every pass is at least
``P = max(C, comm)``, the longest at least the slowest sequence's fastest group, so ``T >= Lam + M
* overhead``, ``T >= M * (comm + overhead)`` and ``T >= alone + (M - 1) * P + M * overhead``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["packing_bound_ms", "lockstep_packing_bound_ms", "step_bound_ms"]


def packing_bound_ms(lengths, cost, upper_ms: float | None = None) -> float:
    """The packing lower bound (module docstring) in ms, gradient sync and optimizer step included. ``upper_ms``: the
    compute time (no gradient sync) of some plan of these lengths, or None."""
    from ortools.linear_solver import pywraplp

    if cost.execution == "lockstep":
        return lockstep_packing_bound_ms(lengths, cost, upper_ms)
    s = np.asarray(lengths, dtype=np.int64)
    grad = float(cost.step_end_ms())  # the gradient sync and the optimizer step
    if s.size == 0:
        return grad
    cost.check_feasible(s)
    n = int(cost.cluster.num_gpus)
    degs = [int(d) for d in cost.degrees if d <= n]
    B = float(cost.memory_budget_gb)
    u, cnt = np.unique(s, return_counts=True)
    t = np.stack([cost.time(u, d) for d in degs])
    mem = np.stack([cost.memory(u, d) for d in degs])
    over = np.array([float(cost.group_overhead_ms(d)) for d in degs])
    allowed = mem <= B
    if upper_ms is not None:
        # a plan no slower than upper_ms runs no group longer than that (small slack for rounding)
        allowed &= t + over[:, None] <= float(upper_ms) * (1 + 1e-9)
    if not allowed.any(axis=0).all():  # upper_ms below some sequence's fastest group: no such plan
        allowed = mem <= B
    lp = pywraplp.Solver.CreateSolver("GLOP")
    inf = lp.infinity()
    # no plan is faster than its slowest sequence alone on its fastest allowed degree
    alone = float(np.where(allowed, t + over[:, None], np.inf).min(axis=0).max())
    T = lp.NumVar(alone, inf, "T")
    work = _groups_lp(lp, u, cnt, allowed, degs, t, mem, over, B).work
    lp.Add(lp.Sum(work) <= n * T)
    lp.Minimize(T)
    status = lp.Solve()
    if status != pywraplp.Solver.OPTIMAL:
        return grad  # claim nothing
    # GLOP's optimum is a floating-point vertex: step back by its tolerance so it stays a bound
    return max(0.0, float(T.solution_value()) * (1 - 1e-7)) + grad


def lockstep_packing_bound_ms(lengths, cost, upper_ms: float | None = None, *, multi: bool | None = None) -> float:
    """The packing lower bound for lockstep plans (module docstring), in ms, the step's end (gradient
    sync and optimizer) included. ``upper_ms``: some plan's compute time (its makespan less the
    step's end; a larger figure restricts less); ``multi``: whether plans may give a rank several groups in a pass
    (default: as the lockstep planner does, ``lockstep.MULTI_GROUP``), which leaves out the
    one-group-per-rank constraints."""
    from ortools.linear_solver import pywraplp

    from workbench.solve.lockstep import MULTI_GROUP

    multi = MULTI_GROUP if multi is None else bool(multi)
    s = np.asarray(lengths, dtype=np.int64)
    end = float(cost.step_end_ms())
    if s.size == 0:
        return end
    cost.check_feasible(s)
    n = int(cost.cluster.num_gpus)
    degs = [int(d) for d in cost.degrees if d <= n]
    B = float(cost.memory_budget_gb)
    C, comm, ovh = float(cost.call_overhead_ms()), float(cost.pass_comm_ms()), float(cost.pass_overhead_ms())
    P = max(C, comm)
    u, cnt = np.unique(s, return_counts=True)
    t = np.stack([cost.time(u, d) for d in degs])
    mem = np.stack([cost.memory(u, d) for d in degs])
    extra = np.array([float(cost.group_extra_ms(d)) for d in degs])
    single = t + (C + extra)[:, None]
    allowed = mem <= B
    if upper_ms is not None:
        # no pass of a plan of at most upper_ms is longer than upper_ms less the others' least
        allowed &= single <= float(upper_ms) * (1 + 1e-9)
    if not allowed.any(axis=0).all():
        allowed = mem <= B
    act = float((cost.memory(u, 1) * cnt).sum())
    m_min = max(1.0, float(np.ceil(act / (n * B) - 1e-9)))
    alone = float(np.where(allowed, single, np.inf).min(axis=0).max())
    lp = pywraplp.Solver.CreateSolver("GLOP")
    inf = lp.infinity()
    T = lp.NumVar(0.0, inf, "T")
    M = lp.NumVar(m_min, inf, "M")
    lam = lp.NumVar(0.0, inf, "Lam")
    groups = _groups_lp(lp, u, cnt, allowed, degs, t, mem, extra, B)
    work, slots, big_half, big_third = groups.work, groups.slots, groups.big_half, groups.big_third
    # a rank holds, in one pass, at most one sequence share over half its budget (and at most two
    # "units", a share over two thirds weighing 2, one over a third 1), whatever groups it serves
    if big_half:
        lp.Add(lp.Sum(big_half) <= n * M)
    if big_third:
        lp.Add(lp.Sum(big_third) <= 2 * n * M)
    busy = lp.NumVar(max(m_min, act / B), inf, "busy")
    lp.Add(busy >= M)
    if not multi:
        lp.Add(busy == lp.Sum(slots))
        lp.Add(lp.Sum(slots) <= n * M)
    lp.Add(lp.Sum(work) + C * busy <= n * lam)
    lp.Add(lam >= C * M)
    lp.Add(T >= lam + ovh * M)
    lp.Add(T >= (comm + ovh) * M)
    lp.Add(T >= alone - P + (P + ovh) * M)
    lp.Minimize(T)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return end  # claim nothing
    return max(0.0, float(T.solution_value()) * (1 - 1e-7)) + end


@dataclass
class _GroupsLP:
    """The part of the packing programmes both executions share (module docstring): what it adds
    to the GPU-time, the group slots, and the rank-slots of sequences over half / a third of the budget."""

    work: list
    slots: list
    big_half: list
    big_third: list


def _groups_lp(lp, u, cnt, allowed, degs, t, mem, per_group, B) -> _GroupsLP:
    """Add to ``lp`` the shares ``x[j, d]`` of the sequences of each length ``u[j]`` (``cnt[j]`` of
    them) run at each allowed degree, the group counts ``y[d]``, each degree's memory within its
    groups' budget and the bin-packing cuts per group (at most one share over half a group's memory,
    two "units" over a third). ``per_group[e]`` is what a group of degree ``degs[e]`` costs each of
    its ranks beyond its sequences."""
    inf = lp.infinity()
    y = [lp.NumVar(0.0, inf, f"y{e}") for e in range(len(degs))]
    x: dict = {}
    for j in range(u.size):
        row = []
        for e in range(len(degs)):
            if allowed[e, j]:
                v = lp.NumVar(0.0, float(cnt[j]), f"x{j}_{e}")
                x[j, e] = v
                row.append(v)
        lp.Add(lp.Sum(row) == float(cnt[j]))
    out = _GroupsLP([], [], [], [])
    for e, d in enumerate(degs):
        js = [j for j in range(u.size) if (j, e) in x]
        if not js:
            continue
        f = mem[e, js] / B
        lp.Add(lp.Sum([x[j, e] * float(mem[e, j]) for j in js]) <= B * y[e])
        half = [x[j, e] for j, fj in zip(js, f) if fj > 0.5 * (1 + 1e-12)]
        if half:
            lp.Add(lp.Sum(half) <= y[e])
            out.big_half.extend(v * float(d) for v in half)
        third = [x[j, e] * (2.0 if fj > (2 / 3) * (1 + 1e-12) else 1.0) for j, fj in zip(js, f)
                 if fj > (1 / 3) * (1 + 1e-12)]
        if third:
            lp.Add(lp.Sum(third) <= 2 * y[e])
            out.big_third.extend(v * float(d) for v in third)
        out.work.append(y[e] * float(d * per_group[e]))
        out.work.extend(x[j, e] * float(d * t[e, j]) for j in js)
        out.slots.append(y[e] * float(d))
    return out


def step_bound_ms(lengths, cost, plans=()) -> float:
    """The tightest lower bound on one step this package knows: the larger of
    ``plan.lower_bound_ms`` and the packing bound, the packing bound restricted by the fastest of
    ``plans`` (Plans of these lengths over ``cost``; their compute time is ``upper_ms``). What the
    Solver panel, ``workbench plan`` and ``bench/solver.py`` call "packing bound"."""
    from workbench.solve.plan import lower_bound_ms

    weak = float(lower_bound_ms(lengths, cost))
    makespans = [float(p.makespan_ms) for p in plans]
    upper = min(makespans) - float(cost.step_end_ms()) if makespans else None
    return max(weak, packing_bound_ms(lengths, cost, upper_ms=upper))
