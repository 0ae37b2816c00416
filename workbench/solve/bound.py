"""A lower bound on a step's makespan that counts how sequences pack into groups.

``lower_bound_ms`` charges group overhead for the activations' memory as if groups could be
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

import math

import numpy as np

from workbench.cost import CostModel

__all__ = ["lower_bound_ms", "lockstep_lower_bound_ms", "packing_bound_ms", "lockstep_packing_bound_ms",
           "step_bound_ms"]


MAX_GROUPS_PER_GPU = 4096
"""Beyond this many groups per GPU in one step the slot bound is not computed (it would only be slow)."""

def lower_bound_ms(lengths, cost: CostModel) -> float:
    """A bound no plan can beat, in ms, gradient sync included.

    Let T be any plan's compute time (makespan less the gradient sync). Every sequence runs in a
    group whose time is at least its own ``time(s, d) + overhead(d)``, so it must use a degree d
    that holds it with ``time(s, d) + overhead(d) <= T``; on that degree it costs at least
    ``d * time(s, d)`` GPU-ms. Each GPU is busy at most T, so the GPU-time of all sequences (each
    at its cheapest degree that is fast enough for T), plus one group overhead per GPU-slot (at
    least ``sum(activations) / budget`` slots, as each holds at most the memory budget), is at
    most N * T. The bound is the smallest T meeting both conditions. It is at least the classic
    "perfectly divided work" bound (each sequence at its cheapest degree) and at least the longest
    single sequence on its fastest degree, and tighter than both when the long sequences must
    run on wide, less efficient groups to finish in time. ``_slot_bound`` then raises it further
    by counting each GPU's groups as a whole number. Lockstep cost models get
    ``lockstep_lower_bound_ms`` instead.
    Raises InfeasibleError when a sequence fits no group.
    """
    s = np.asarray(lengths, dtype=np.int64)
    if s.size == 0:
        return cost.step_end_ms()
    cost.check_feasible(s)
    if cost.execution == "lockstep":
        return lockstep_lower_bound_ms(s, cost)
    n = cost.cluster.num_gpus
    shapes = list(cost.shapes)  # every (degree, cp) a group may take
    single = np.full((len(shapes), s.size), np.inf)  # time(s, d) + overhead(d), inf where d cannot hold s
    work = np.full((len(shapes), s.size), np.inf)  # d * time(s, d)
    gpu_mem = np.full((len(shapes), s.size), np.inf)  # d * memory(s, d): activations over the group's GPUs
    for k, (d, cp) in enumerate(shapes):
        m = cost.memory(s, d, cp)
        ok = m <= cost.memory_budget_gb
        t = cost.time(s, d, cp)
        single[k] = np.where(ok, t + cost.group_overhead_ms(d, cp), np.inf)
        work[k] = np.where(ok, d * t, np.inf)
        gpu_mem[k] = np.where(ok, d * m, np.inf)
    slots = max(1.0, float(cost.memory(s, 1).sum()) / cost.memory_budget_gb)
    c = min(cost.group_overhead_ms(d, cp) for d, cp in shapes)

    def need(x: float) -> float:
        """The compute time the GPU-time argument forces when no group may take longer than x."""
        return (_least_work(single, work, x) + slots * c) / n

    x0 = float(single.min(axis=0).max())  # the longest sequence on its fastest degree
    # need() only changes where x crosses some single[d, s]; find the first such breakpoint b_i
    # with need(b_i) <= b_i (need is non-increasing, so this is monotone); the bound lies in
    # [b_{i-1}, b_i]: it is b_i, or need(b_{i-1}) when that falls inside the interval.
    b = np.unique(single[np.isfinite(single) & (single >= x0)])
    lo, hi = 0, b.size  # first index in [lo, hi] whose breakpoint is enough; b.size: none is
    while lo < hi:
        mid = (lo + hi) // 2
        if need(float(b[mid])) <= b[mid]:
            hi = mid
        else:
            lo = mid + 1
    if lo == 0:
        t_lb = float(b[0])
    elif lo == b.size:
        t_lb = need(float(b[-1]))
    else:
        t_lb = min(float(b[lo]), need(float(b[lo - 1])))
    t_lb = _slot_bound(t_lb, single, work, gpu_mem, cost)
    return t_lb + cost.step_end_ms()

def lockstep_lower_bound_ms(lengths, cost: CostModel) -> float:
    """A bound no lockstep plan beats (one group or several per rank in a pass), in ms.

    With M passes a step lasts ``sum over passes of max(L_p, comm) + M * overhead`` (``L_p`` the
    pass's largest rank load). Then:

    - M is at least ``M_min = ceil(sum of activations / (N * budget))``: a pass holds at most the
      budget on each of the N ranks (every sequence's activations over its group, ``d * memory(s,
      d)``, do not depend on d);
    - a rank busy in a pass pays the packed call's constant C once, so every pass is at least
      ``P = max(C, comm)`` long and the longest one is at most ``X = S - M overhead - (M - 1) P``
      for a step of S; every sequence runs on a degree whose single-group time ``C + extra(d) +
      time(s, d)`` is within X, costing at least ``d * time(s, d)`` GPU-ms there;
    - the passes' largest loads are at least their mean loads, whose sum is at least ``(W(X) + C
      * slots) / N``: W(X) the GPU-time of every sequence at its cheapest degree fast enough for X,
      ``slots`` the busy rank-passes, at least ``max(M, sum of activations / budget)``;
    - and at least the longest sequence on its fastest degree plus ``(M - 1) P``.

    The bound is the smallest S meeting ``S >= M overhead + max(the above)`` (the requirement only
    falls as S grows: bisection). Raises InfeasibleError when a sequence fits no group.
    """
    s = np.asarray(lengths, dtype=np.int64)
    if s.size == 0:
        return cost.step_end_ms()
    cost.check_feasible(s)
    n = cost.cluster.num_gpus
    end = float(cost.step_end_ms())
    shapes = list(cost.shapes)
    single = np.full((len(shapes), s.size), np.inf)
    work = np.full((len(shapes), s.size), np.inf)
    for k, (d, cp) in enumerate(shapes):
        ok = cost.memory(s, d, cp) <= cost.memory_budget_gb
        t = cost.time(s, d, cp)
        single[k] = np.where(ok, t + cost.group_overhead_ms(d, cp), np.inf)
        work[k] = np.where(ok, d * t, np.inf)
    act = float(cost.memory(s, 1).sum())  # GB over GPUs, whatever the degrees
    B = float(cost.memory_budget_gb)
    M = max(1, int(math.ceil(act / (n * B) - 1e-9)))
    slots = max(float(M), act / B)
    C, comm, ovh = float(cost.call_overhead_ms()), float(cost.pass_comm_ms()), float(cost.pass_overhead_ms())
    P = max(C, comm)
    x0 = float(single.min(axis=0).max())

    def need(S: float) -> float:
        X = S - M * ovh - (M - 1) * P
        if X < x0 * (1 - 1e-12):
            return math.inf
        W = _least_work(single, work, X)
        return M * ovh + max((W + C * slots) / n, M * C, M * comm, x0 + (M - 1) * P)

    lo = M * ovh + max(float(work.min(axis=0).sum() + C * slots) / n, M * C, M * comm, x0 + (M - 1) * P)
    if need(lo) <= lo:
        return lo + end
    hi = max(lo, 1e-9) * 2.0
    for _ in range(200):
        if need(hi) <= hi:
            break
        lo, hi = hi, hi * 2.0
    else:
        return lo + end
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if need(mid) <= mid:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return lo + end  # a step of lo cannot be, so every plan is longer

def _least_work(single: np.ndarray, work: np.ndarray, x: float) -> float:
    """GPU-time of all sequences, each on its cheapest degree whose group alone takes at most x."""
    return float(np.where(single <= x, work, np.inf).min(axis=0).sum())

def _slot_bound(t0: float, single: np.ndarray, work: np.ndarray, gpu_mem: np.ndarray, cost: CostModel) -> float:
    """Raise a compute-time bound ``t0`` by counting each GPU's groups as a whole number.

    A GPU that takes part in k groups in a step is busy at least ``k * c`` with group overheads
    (c the smallest), so it computes at most ``a_k = T - k c``; its groups hold at most ``k B``
    activations in all (B the budget), and at most ``a_k / rho`` (every sequence computes at least
    rho ms per GB it holds, rho the least ratio time / memory over the sequences and the degrees
    that hold them). Over the N GPUs, a fraction l_k of them with k groups must supply the work W(T)
    (as in ``lower_bound_ms``) and the activations M (each sequence at its least d x memory), so
    ``(W, M) / N`` lies under the convex hull of the points ``(a_k, b_k = min(k B, a_k / rho))``.
    With short sequences only, one group per GPU cannot fill the step and two leave memory unused:
    the bound sees that where the continuous ``sum(activations) / B`` does not. Smallest T by
    bisection (feasibility only grows with T).
    """
    n = cost.cluster.num_gpus
    B = float(cost.memory_budget_gb)
    c = min(float(cost.group_overhead_ms(d, cp)) for d, cp in cost.shapes)
    if c + B <= 0:
        return t0
    M = float(gpu_mem.min(axis=0).sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.isfinite(single), work / gpu_mem, np.inf)
    rho = float(ratio.min())  # work / (d * memory) = time / memory
    if not (M > 0 and B > 0 and np.isfinite(rho) and rho > 0):
        return t0

    def feasible(T: float) -> bool:
        w = _least_work(single, work, T) / n
        m = M / n
        kmax = int(T / (c + rho * B)) + 1
        if kmax > MAX_GROUPS_PER_GPU:
            return True  # too many groups per GPU to enumerate: claim nothing (the bound stays valid)
        ks = np.arange(1, kmax + 1, dtype=np.float64)
        a = np.maximum(T - c * ks, 0.0)
        bb = np.minimum(ks * B, a / rho)
        if ((a >= w) & (bb >= m)).any():
            return True
        # a mix of GPUs with k and k + 1 groups (the points lie on a concave chain)
        for j in range(ks.size - 1):
            lo_l, hi_l = 0.0, 1.0  # weight on point j
            for p, q, need_ in ((a[j], a[j + 1], w), (bb[j], bb[j + 1], m)):
                # lam * p + (1 - lam) * q >= need_
                if p == q:
                    if p < need_:
                        lo_l, hi_l = 1.0, 0.0
                elif p > q:
                    lo_l = max(lo_l, (need_ - q) / (p - q))
                else:
                    hi_l = min(hi_l, (need_ - q) / (p - q))
            if lo_l <= hi_l:
                return True
        return False

    if feasible(t0):
        return t0
    lo, hi = t0, max(t0, 1e-9) * 2.0
    for _ in range(200):
        if feasible(hi):
            break
        lo, hi = hi, hi * 2.0
    else:
        return t0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return lo  # infeasible, so the optimum lies above it


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
    shapes = [(int(d), int(cp)) for d, cp in cost.shapes if d <= n]
    degs = [d for d, _ in shapes]
    B = float(cost.memory_budget_gb)
    u, cnt = np.unique(s, return_counts=True)
    t = np.stack([cost.time(u, d, cp) for d, cp in shapes])
    mem = np.stack([cost.memory(u, d, cp) for d, cp in shapes])
    over = np.array([float(cost.group_overhead_ms(d, cp)) for d, cp in shapes])
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


def lockstep_packing_bound_ms(lengths, cost, upper_ms: float | None = None, *, multi: bool = True) -> float:
    """The packing lower bound for lockstep plans (module docstring), in ms, the step's end (gradient
    sync and optimizer) included. ``upper_ms``: some plan's compute time (its makespan less the
    step's end; a larger figure restricts less); ``multi``: whether plans may give a rank several groups in a pass
    (default True: a bound for every lockstep plan, stacked or not), False adds the one-group-per-rank
    constraints (a bound for FlexSP's one group per GPU and pass only)."""
    from ortools.linear_solver import pywraplp

    multi = bool(multi)
    s = np.asarray(lengths, dtype=np.int64)
    end = float(cost.step_end_ms())
    if s.size == 0:
        return end
    cost.check_feasible(s)
    n = int(cost.cluster.num_gpus)
    shapes = [(int(d), int(cp)) for d, cp in cost.shapes if d <= n]
    degs = [d for d, _ in shapes]
    B = float(cost.memory_budget_gb)
    C, comm, ovh = float(cost.call_overhead_ms()), float(cost.pass_comm_ms()), float(cost.pass_overhead_ms())
    P = max(C, comm)
    u, cnt = np.unique(s, return_counts=True)
    t = np.stack([cost.time(u, d, cp) for d, cp in shapes])
    mem = np.stack([cost.memory(u, d, cp) for d, cp in shapes])
    extra = np.array([float(cost.group_extra_ms(d, cp)) for d, cp in shapes])
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
    ``lower_bound_ms`` and the packing bound, the packing bound restricted by the fastest of
    ``plans`` (Plans of these lengths over ``cost``; their compute time is ``upper_ms``). What the
    Solver panel, ``workbench plan`` and ``bench/solver.py`` call "packing bound"."""
    weak = float(lower_bound_ms(lengths, cost))
    makespans = [float(p.makespan_ms) for p in plans]
    upper = min(makespans) - float(cost.step_end_ms()) if makespans else None
    return max(weak, packing_bound_ms(lengths, cost, upper_ms=upper))
