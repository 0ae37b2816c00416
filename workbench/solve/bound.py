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

``lockstep_pass_bound_ms`` sees how a lockstep step is cut into passes: pass classes by length, a
share only in a pass at least its single-group time, the passes holding the longest sequences whole
(branch and bound), C paid by every busy rank in every pass, and the activations a rank cannot use
beside a share that takes most of its pass (its docstring has the programme). ``step_bound_ms`` is
the largest of them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import heapq
import math
import warnings

import numpy as np

from workbench.cost import CostModel

__all__ = ["lower_bound_ms", "lockstep_lower_bound_ms", "pair_bound_ms", "packing_bound_ms", "lockstep_packing_bound_ms",
           "lockstep_pass_bound_ms",
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
    cost = cost.bound_view()  # where groups may swap blocks, each sequence at its least
    s = np.asarray(lengths, dtype=np.int64)
    if s.size == 0:
        return cost.step_end_ms()
    cost.check_feasible(s)
    if cost.execution == "lockstep":
        return max(lockstep_lower_bound_ms(s, cost), pair_bound_ms(s, cost))
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
    return max(t_lb + cost.step_end_ms(), pair_bound_ms(s, cost))

def pair_bound_ms(lengths, cost: CostModel) -> float:
    """A bound from the two longest sequences (by their fastest single-group time), in ms, for any
    placement of groups on contiguous rank ranges. Put the longest on a shape of degree ``d1`` and
    the second on one of ``d2``: where ``d1 + d2`` exceeds the cluster the two groups share a rank
    (any two ranges of those sizes overlap), which runs both, so it is busy for at least both
    single-group times less what they share: the group's constant where both are one group, else
    the packed call's constant a lockstep pass shares (in other passes or micro-steps, longer
    still); where they fit side by side, the longer of the two. The bound is the
    least of that over every pair of shapes that hold them, plus a pass's constant cost (lockstep)
    and the step's end. It sees what the GPU-time bounds cannot: a cluster the longest sequence fills
    leaves no room beside it, so the second waits for it or stretches it (24 GPUs, a 1M and a 200K
    sequence of Llama-3-8B: the 1M needs all 24). 0 for fewer than two sequences."""
    cost = cost.bound_view()  # where groups may swap blocks, each sequence at its least
    s = np.asarray(lengths, dtype=np.int64)
    if s.size < 2:
        return 0.0
    cost.check_feasible(s)
    n = cost.cluster.num_gpus
    shapes = list(cost.shapes)
    single = np.full((len(shapes), s.size), np.inf)
    for k, (d, cp) in enumerate(shapes):
        ok = cost.memory(s, d, cp) <= cost.memory_budget_gb
        single[k] = np.where(ok, cost.time(s, d, cp) + cost.group_overhead_ms(d, cp), np.inf)
    order = np.argsort(-single.min(axis=0), kind="stable")
    a, b = single[:, order[0]], single[:, order[1]]
    degs = np.array([d for d, _ in shapes])
    lockstep = cost.execution == "lockstep"
    # what the two share on a common rank: one group's constant where they are one group (same
    # shape), else the packed call's constant in a lockstep pass, nothing in free execution
    shared = np.full((len(shapes), len(shapes)), float(cost.call_overhead_ms()) if lockstep else 0.0)
    np.fill_diagonal(shared, [max(float(cost.group_overhead_ms(d, cp)), shared[0, 0]) for d, cp in shapes])
    side = (degs[:, None] + degs[None, :]) <= n
    load = np.where(side, np.maximum(a[:, None], b[None, :]), a[:, None] + b[None, :] - shared)
    best = float(load.min())
    if lockstep:
        best = max(best, float(cost.pass_comm_ms())) + float(cost.pass_overhead_ms())
    return best + float(cost.step_end_ms())


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
    cost = cost.bound_view()  # where groups may swap blocks, each sequence at its least
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
    cost = cost.bound_view()  # where groups may swap blocks, each sequence at its least
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


def _lockstep_setting(s: np.ndarray, cost) -> tuple:
    """What both lockstep bounds read of the cost model, after checking every length fits some
    group: the GPUs, the shapes that fit them, the activation budget, and the packed call's constant
    C, FSDP's per-pass collectives, the pass overhead and ``P = max(C, comm)``."""
    cost.check_feasible(s)
    n = int(cost.cluster.num_gpus)
    C, comm, ovh = float(cost.call_overhead_ms()), float(cost.pass_comm_ms()), float(cost.pass_overhead_ms())
    return (n, [(int(d), int(cp)) for d, cp in cost.shapes if d <= n], float(cost.memory_budget_gb),
            (C, comm, ovh, max(C, comm)))


def lockstep_packing_bound_ms(lengths, cost, upper_ms: float | None = None, *, multi: bool = True) -> float:
    """The packing lower bound for lockstep plans (module docstring), in ms, the step's end (gradient
    sync and optimizer) included. ``upper_ms``: some plan's compute time (its makespan less the
    step's end; a larger figure restricts less); ``multi``: whether plans may give a rank several groups in a pass
    (default True: a bound for every lockstep plan, stacked or not), False adds the one-group-per-rank
    constraints (a bound for FlexSP's one group per GPU and pass only)."""
    cost = cost.bound_view()  # where groups may swap blocks, each sequence at its least
    from ortools.linear_solver import pywraplp

    multi = bool(multi)
    s = np.asarray(lengths, dtype=np.int64)
    end = float(cost.step_end_ms())
    if s.size == 0:
        return end
    n, shapes, B, (C, comm, ovh, P) = _lockstep_setting(s, cost)
    degs = [d for d, _ in shapes]
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


def step_bound_ms(lengths, cost, plans=(), *, passes: bool = True, cancel=None, branch: int = 0) -> float:
    """The tightest lower bound on one step this package knows: the largest of ``lower_bound_ms``,
    the packing bound and, for a lockstep cost model, the pass bound (``lockstep_pass_bound_ms``), the
    last two restricted by the fastest of ``plans`` (Plans of these lengths over ``cost``; their compute
    time is ``upper_ms``). What the Solver panel, ``workbench plan`` and ``bench/solver.py`` report
    beside the plans. ``passes=False`` leaves the pass bound out (the panel shows the rest at once and
    the pass bound when it is ready: it takes seconds on thousands of sequences); ``cancel``, a
    callable, is called between the pass bound's programmes (it raises to stop); ``branch``, the pass
    bound's branching on the longest sequences' shapes (``lockstep_pass_bound_ms``; one pass bound per
    shape, so seconds more). A part that comes out above the fastest of ``plans`` cannot be a bound:
    it is left out, with a RuntimeWarning."""
    cost = cost.bound_view()  # where groups may swap blocks, each sequence at its least
    makespans = [float(p.makespan_ms) for p in plans]
    upper = min(makespans) - float(cost.step_end_ms()) if makespans else None
    parts = {"lower bound": float(lower_bound_ms(lengths, cost)),
             "packing bound": packing_bound_ms(lengths, cost, upper_ms=upper)}
    if passes and cost.execution == "lockstep":
        parts["lockstep pass bound"] = lockstep_pass_bound_ms(lengths, cost, upper_ms=upper, cancel=cancel,
                                                              branch=branch)
    out = 0.0
    for name, value in parts.items():
        if makespans and value > min(makespans) * (1 + 1e-6):
            # above a plan of this very batch: not a bound here (a solver's numerical failure or a
            # bug); left out, loudly, rather than reported as what no plan can beat
            warnings.warn(f"the {name} ({value:,.1f} ms) came out above a plan of this batch "
                          f"({min(makespans):,.1f} ms): left out of the step bound; please report the batch",
                          RuntimeWarning, stacklevel=2)
            continue
        out = max(out, float(value))
    return out




PASS_GRID = 1.01
"""``lockstep_pass_bound_ms`` cuts pass lengths into classes at most this ratio apart, and at every
single-group time of the longest sequences (``PASS_EXACT_SEQS``); the other sequences' single-group
times are rounded down onto the grid (a share allowed in a pass a little shorter than itself: a
relaxation, so still a bound)."""

PASS_TIER = 1.12
"""... and groups the classes into tiers at most this ratio apart: a share's pass is chosen per tier
(its time and activations land in the same tier) and the passes per tier are whole numbers."""

PASS_EXACT_SEQS = 48
"""The longest sequences (by their fastest single-group time) whose every share is exact."""

PASS_ITEMS = 240
"""Above this many distinct lengths the shorter ones share an item per run of neighbouring lengths,
each at its shortest member's time and memory (both grow with length: a relaxation)."""

PASS_GLOP = ""
"""GLOP's parameters for the pass bound (the dual simplex restarts well after a branch's bounds change)."""

PASS_NODES = 64
"""Branch and bound on the passes per tier stops after this many programmes per pass count and keeps
the least value still open (a node limit, not a time limit: deterministic)."""

PASS_WORK = 1_200_000
"""All programmes together solve at most this much: each charges its size (variables and rows) when
solved. Past it the bound stops where it is and keeps what is proven: the least value still open for
the pass count under way and, for the pass counts not reached, their passes' constant cost plus the
least GPU-time over the GPUs (a work limit, not a time limit: deterministic). Enough for every 64 GPU x
1M-token batch of the four families (at most 0.73 M of it, 1-5 s); a byted step of 512 sequences at
64 GPUs (636 classes, 60,000 variables a programme) stops after 20 programmes, 15 s, where it took 143
and 133 s, and 1.1% lower (the pass counts not reached)."""


class _Programme:
    """A minimising linear programme written as lists (variables; rows of bounds, indices and
    coefficients) and loaded into GLOP at once through OR-Tools' model proto: one call where building
    it through ``pywraplp`` makes one per variable, row and entry. Variables and rows keep the order
    they were made in, and an entry of 0 is left out, as ``SetCoefficient`` leaves it: the same
    programme."""

    def __init__(self):
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.obj: dict[int, float] = {}
        self.bounds: list[tuple[float, float]] = []
        self.idx: list[list[int]] = []
        self.coef: list[list[float]] = []

    def var(self, lb: float, ub: float) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        return len(self.lb) - 1

    def row(self, lb: float, ub: float) -> int:
        self.bounds.append((lb, ub))
        self.idx.append([])
        self.coef.append([])
        return len(self.bounds) - 1

    def add(self, row: int, var: int, coefficient: float) -> None:
        if coefficient:
            self.idx[row].append(var)
            self.coef[row].append(coefficient)

    def load(self):
        """A GLOP solver holding the programme (``PASS_GLOP`` its parameters), minimising."""
        from ortools.linear_solver import linear_solver_pb2, pywraplp

        proto = linear_solver_pb2.MPModelProto(maximize=False)
        obj = self.obj
        for i, (lb, ub) in enumerate(zip(self.lb, self.ub)):
            proto.variable.add(lower_bound=lb, upper_bound=ub, objective_coefficient=obj.get(i, 0.0))
        for (lb, ub), idx, coef in zip(self.bounds, self.idx, self.coef):
            proto.constraint.add(lower_bound=lb, upper_bound=ub, var_index=idx, coefficient=coef)
        lp = pywraplp.Solver.CreateSolver("GLOP")
        if lp is None:
            raise RuntimeError("OR-Tools has no GLOP")
        error = lp.LoadModelFromProto(proto)
        if error:
            raise RuntimeError(f"OR-Tools refused the pass bound's programme: {error}")
        lp.SetSolverSpecificParametersAsString(PASS_GLOP)
        return lp


def lockstep_pass_bound_ms(lengths, cost, upper_ms: float | None = None, *, detail: dict | None = None,
                           work: float | None = PASS_WORK, cancel=None, branch: int = 0) -> float:
    """A lower bound on every lockstep plan (one group or several per rank in a pass) that sees how a
    step is cut into passes, in ms with the step's end (gradient sync and optimizer) included.
    ``upper_ms``: some plan's compute time (its makespan less the step's end; larger restricts less).

    A pass of length L (its busiest rank) costs ``max(L, comm) + overhead``; every rank busy in it
    pays the packed call's constant C once, so it gives each rank at most ``L - C`` of group extras and
    sequence time and ``budget`` of activations; a sequence at degree d sits in a pass at least its
    single-group time ``C + extra(d) + time(s, d)`` long. The programme works on *pass classes*: class
    k holds the passes whose length lies in ``[g_k, g_k+1)``, the floors ``g`` being ``P = max(C,
    comm)`` (class 0: a shorter pass is taken as P, which costs ``P + overhead`` all the same and gives
    more room), the single-group times above P and a geometric grid (``PASS_GRID``). Per class,
    ``z_k`` passes with lengths summing to ``w_k`` in ``[g_k z_k, g_k+1 z_k]``; classes form tiers
    (``PASS_TIER``) with a whole number of passes each (unless ``integral`` is False). A share of a
    length (``x`` of the sequences of length j at degree d, per tier, summing to their count) may only
    sit in a class at least its single-group time's ``kappa(j, d)``, so in each tier, for every k, the
    shares of class k or above fit in the tier's passes of class k or above (Hall's condition, per
    resource):

    - time: ``sum d (time + extra(d) memory / budget) x <= N sum (w - C z)`` (groups of degree d hold at
      most a budget each, so there are at least memory / budget of them, each paying extra(d));
    - activations: ``sum d memory x <= N budget sum z``, less what ranks cannot use: a rank whose share
      takes more than half its time in the pass (one such share per rank at most) holds besides it at
      most ``f(g_k+1 - C - extra - time)``, ``f(tau)`` the most activations shares fill in ``tau`` ms on
      one rank (fractional knapsack, densest first); in each class where ``budget - memory - f(...)`` is
      positive such a share has its own variable and takes that much more of the class's activations;
    - a rank holds at most one share over half the budget in a pass (``sum d x <= N sum z`` over those)
      and at most two "units" (a share over two thirds weighing 2, over a third 1);
    - at least ``n_k`` passes of class k or above, ``n_k`` what the sequences that fit no class below
      k need (one, or more by their activations and their shares over half a budget);
    - ``sum z = M``: one programme per pass count M from the memory minimum up, while ``M (C +
      overhead)`` plus the least GPU-time over N is below the best so far; minimise ``sum w + overhead M``.

    Every plan maps onto a solution (its passes per class, their lengths, its sequences' degrees and
    classes), so the least optimum over M is a bound. The integer programme runs on SCIP with a node
    limit (``PASS_NODES``) and gives its proven bound; ``integral=False`` solves the linear programme
    on GLOP (weaker where a fraction of a long pass would do). Shares a cheaper one of the same length
    dominates in every demand are left out. ``work`` caps the programmes' summed size (``PASS_WORK``;
    None: no cap); where it stops the search, the bound keeps what is proven so far. ``cancel``, a
    callable, is called before each programme is solved (it raises to stop). ``detail``, when
    given, gets the value per M, the sizes, the programmes solved, the work spent, whether the cap
    stopped it (``stopped``), and the best programme's passes per class (``passes``: ``[(count, summed
    length ms, floor ms)]``).

    ``branch``: the programme lets a long sequence sit partly at one degree and partly at another (a
    fraction of a long pass at its wide degree, the rest in a shorter pass at a wider one), so with
    ``branch`` > 0 the bound also branches on the shape of each of the ``branch`` longest lengths that
    one sequence alone has (best first: the least value's node is opened next; a child's value is at
    least its parent's) and takes the least value over the open nodes (every plan places that sequence
    at one shape). Each node is a whole pass bound at ``work``; ``detail`` then also gets ``branches``
    (``[({length: (degree, cp)}, value)]``, every node solved) and the least open node's own detail."""
    cost = cost.bound_view()  # where groups may swap blocks, each sequence at its least
    if branch > 0:
        return _branched_pass_bound(lengths, cost, upper_ms, detail, work, cancel, int(branch))
    return _pass_bound(lengths, cost, upper_ms, detail, work, cancel, {})


def _branched_pass_bound(lengths, cost, upper_ms, detail, work, cancel, branch: int) -> float:
    """``lockstep_pass_bound_ms`` with ``branch`` (its docstring): best-first over the shapes of the
    longest lengths held by one sequence each."""
    s = np.asarray(lengths, dtype=np.int64)
    if s.size == 0:
        return float(cost.step_end_ms())
    u, cnt = np.unique(s, return_counts=True)
    singles = [int(x) for x in u[cnt == 1][::-1][:branch]]  # the longest lengths one sequence has
    n, shapes, B, (C, _, ovh, _) = _lockstep_setting(s, cost)
    L = np.asarray(singles, dtype=np.int64)
    ok = np.stack([cost.memory(L, d, cp) <= B for d, cp in shapes]) if singles else None
    if singles and upper_ms is not None:
        # a shape whose single-group time is above upper_ms is no plan's within it (as in the programme)
        single = np.stack([C + float(cost.group_extra_ms(d, cp)) + cost.time(L, d, cp) for d, cp in shapes])
        ok &= single <= (float(upper_ms) - ovh) * (1 + 1e-9)
    nodes = []

    def solve(only: dict) -> tuple[float, dict]:
        d: dict = {}
        v = _pass_bound(s, cost, upper_ms, d, work, cancel, only)
        nodes.append(({x: shapes[e] for x, e in only.items()}, v))
        return v, d

    root, root_d = solve({})
    heap = [(root, 0, {}, root_d)]
    tie = 1
    while heap and len(heap[0][2]) < len(singles):
        v, _, only, _ = heapq.heappop(heap)
        k = len(only)
        for e in np.flatnonzero(ok[:, k]):
            child = {**only, singles[k]: int(e)}
            cv, cd = solve(child)
            heapq.heappush(heap, (max(v, cv), tie, child, cd))
            tie += 1
    best, _, _, best_d = heap[0] if heap else (math.inf, 0, {}, {})
    if detail is not None:
        detail.update(best_d)
        detail["branches"] = nodes
    return best if math.isfinite(best) else float(cost.step_end_ms())  # (no branch holds: claim nothing)


def _pass_bound(lengths, cost, upper_ms, detail, work, cancel, only: dict) -> float:
    """The pass bound (``lockstep_pass_bound_ms``) with the lengths in ``only`` (each one sequence's)
    held to one shape each: ``{length: index into the shapes}``."""
    from ortools.linear_solver import pywraplp

    s = np.asarray(lengths, dtype=np.int64)
    end = float(cost.step_end_ms())
    if s.size == 0:
        return end
    n, shapes, B, (C, comm, ovh, P) = _lockstep_setting(s, cost)
    u, cnt = np.unique(s, return_counts=True)
    deg = np.array([d for d, _ in shapes], dtype=np.float64)
    t = np.stack([cost.time(u, d, cp) for d, cp in shapes])
    mem = np.stack([cost.memory(u, d, cp) for d, cp in shapes])
    for L, e in only.items():  # a branch: that sequence at that shape alone (the others over the budget)
        j = int(np.searchsorted(u, L))
        other = np.arange(len(shapes)) != e
        mem[other, j] = np.maximum(mem[other, j], 2.0 * B + 1.0)
    extra = np.array([float(cost.group_extra_ms(d, cp)) for d, cp in shapes])
    act = float((cost.memory(u, 1) * cnt).sum())
    fits = mem <= B
    least_work = float((np.where(fits, deg[:, None] * t, np.inf).min(axis=0) * cnt).sum())
    if u.size > PASS_ITEMS:
        # the longest lengths stay items; the rest share items per run of neighbouring lengths, each at
        # its shortest member's time and memory (both grow with length: a relaxation)
        rest = u.size - PASS_EXACT_SEQS
        runs = [r for r in np.array_split(np.arange(rest), PASS_ITEMS - PASS_EXACT_SEQS) if r.size]
        first = np.array([r[0] for r in runs] + list(range(rest, u.size)))
        c2 = np.array([cnt[r].sum() for r in runs] + list(cnt[rest:]))
        t, mem, u, cnt = t[:, first], mem[:, first], u[first], c2
    single = C + extra[:, None] + t
    allowed = mem <= B
    if upper_ms is not None:
        # no pass of a plan of compute time upper_ms is longer than upper_ms less its overhead
        allowed &= single <= (float(upper_ms) - ovh) * (1 + 1e-9)
    if not allowed.any(axis=0).all():  # upper_ms is no plan's: claim only what holds for every plan
        allowed = mem <= B
        upper_ms = None
    J = u.size
    # the class floors
    fastest = np.where(allowed, single, np.inf).min(axis=0)
    top = np.argsort(-fastest, kind="stable")[:PASS_EXACT_SEQS]
    exact = single[:, top][allowed[:, top]]
    exact = exact[exact > P * (1 + 1e-12)]
    hi = float(np.where(allowed, single, 0.0).max())
    if upper_ms is not None:
        hi = max(hi, float(upper_ms) - ovh)
    grid = P * PASS_GRID ** np.arange(max(1, int(math.ceil(math.log(max(hi, P) / P) / math.log(PASS_GRID)))) + 1)
    rest = single[allowed]
    rest = rest[rest > P * (1 + 1e-12)]
    snapped = grid[np.searchsorted(grid, rest * (1 + 1e-12), side="right") - 1]  # down onto the grid
    g = np.unique(np.concatenate([grid, exact, snapped]))
    g = g[g >= P * (1 - 1e-12)]
    g[0] = P
    K = g.size
    ceiling = np.append(g[1:], math.inf)
    # a share's class: the last floor at or below its single-group time
    kappa = np.clip(np.searchsorted(g, single * (1 + 1e-12), side="right") - 1, 0, K - 1)
    # f(tau): the most activations shares fill in tau ms on one rank (fractional, densest first)
    tt, mm = t[allowed], mem[allowed]
    rep = np.broadcast_to(cnt[None, :], allowed.shape)[allowed].astype(np.float64)
    order = np.argsort(-(mm / np.maximum(tt, 1e-12)), kind="stable")
    cum_t = np.concatenate([[0.0], np.cumsum((tt * rep)[order])])
    cum_m = np.concatenate([[0.0], np.cumsum((mm * rep)[order])])
    # per length: the least class any of its shares needs, and the passes the lengths needing class k need
    kmin = np.where(allowed, kappa, K).min(axis=0)
    share_mem = np.where(allowed, deg[:, None] * mem, np.inf).min(axis=0)
    half_all = np.where(allowed, mem > 0.5 * B * (1 + 1e-12), True).all(axis=0)
    half_deg = np.where(allowed, deg[:, None], np.inf).min(axis=0)
    need = np.zeros(K)
    for k in range(1, K):
        q = kmin >= k
        if not q.any():
            break
        by_mem = math.ceil(float((share_mem[q] * cnt[q]).sum()) / (n * B) - 1e-9)
        hq = q & half_all
        by_half = math.ceil(float((half_deg[hq] * cnt[hq]).sum()) / n - 1e-9) if hq.any() else 0
        need[k] = max(1, by_mem, by_half)
    m_min = max(1, int(math.ceil(act / (n * B) - 1e-9)))
    # demands per share: time, activations, rank-slots over half a budget, units over a third
    dem = np.stack([deg[:, None] * (t + extra[:, None] * mem / B), deg[:, None] * mem,
                    np.where(mem > 0.5 * B * (1 + 1e-12), deg[:, None], 0.0),
                    deg[:, None] * np.where(mem > (2 / 3) * B * (1 + 1e-12), 2.0,
                                            np.where(mem > B / 3 * (1 + 1e-12), 1.0, 0.0))])
    # the classes where a share takes over half a rank's time and leaves activations unusable
    bands: dict = {}
    for e, j in np.argwhere(allowed):
        k0 = int(kappa[e, j])
        room = ceiling[k0:] - C
        lost = B - mem[e, j] - np.minimum(B, np.interp(np.maximum(room - extra[e] - t[e, j], 0.0), cum_t, cum_m))
        ok = (t[e, j] > 0.5 * room) & (lost > 1e-9 * B)
        stop = int(np.argmin(ok)) if not ok.all() else ok.size
        if stop:
            bands[int(e), int(j)] = lost[:stop]
    # shares dominated by another of the same length (no more of any demand, no higher class, no band)
    keep = allowed.copy()
    for j in range(J):
        es = np.flatnonzero(allowed[:, j])
        for e in es:
            for f in es:
                if f != e and keep[f, j] and (e, j) not in bands and (f, j) not in bands \
                        and kappa[f, j] <= kappa[e, j] and (dem[:, f, j] <= dem[:, e, j] * (1 + 1e-12)).all() \
                        and (kappa[f, j] < kappa[e, j] or (dem[:, f, j] < dem[:, e, j]).any() or f < e):
                    keep[e, j] = False
                    break
    # tiers of classes
    tb = P * PASS_TIER ** np.arange(1, 2 + int(math.ceil(math.log(max(hi, P) / P) / math.log(PASS_TIER))))
    tier_of = np.searchsorted(tb, g * (1 + 1e-12), side="right")
    _, tier_of = np.unique(tier_of, return_inverse=True)
    tiers = [np.flatnonzero(tier_of == v) for v in range(int(tier_of.max()) + 1)]
    def build(M: int):
        """The programme with M passes (GLOP), its pass-count variables ``z``, its rows ``above[v]`` (the
        passes of tier v or above: branched on), and its objective; None when no M-pass plan fits. It is
        written row by row into a model proto and loaded at once (:class:`_Programme`): the same
        programme, variables and rows in the same order, as one ``SetCoefficient`` call per entry made
        (about 20,000 entries for a 64-GPU step), in a fifth of the time."""
        lmax = math.inf if upper_ms is None else float(upper_ms) - ovh - (M - 1) * (P + ovh)
        if lmax < P * (1 - 1e-12):
            return None
        pr = _Programme()
        z = [pr.var(0.0, float(M)) for _ in range(K)]
        w = [pr.var(0.0, math.inf) for _ in range(K)]
        # per class and resource, a slack chain within the tier: sl[k] = sl[above] + cap(k) - demands
        sl = [[pr.var(0.0, math.inf) for _ in range(4)] for _ in range(K)]
        chain = [[pr.row(0.0, 0.0) for _ in range(4)] for _ in range(K)]
        for ks in tiers:
            for a, k in enumerate(ks):
                for r in range(4):
                    ct = chain[k][r]
                    pr.add(ct, sl[k][r], 1.0)
                    if a + 1 < ks.size:
                        pr.add(ct, sl[int(ks[a + 1])][r], -1.0)
                ca = chain[k]
                pr.add(ca[0], w[k], -float(n))
                pr.add(ca[0], z[k], float(n) * C)
                pr.add(ca[1], z[k], -float(n) * B)
                pr.add(ca[2], z[k], -float(n))
                pr.add(ca[3], z[k], -2.0 * n)
        cover = [pr.row(float(c), float(c)) for c in cnt]
        idx, coef = pr.idx, pr.coef
        held = np.zeros(J, dtype=bool)
        for e, j in np.argwhere(keep):
            e, j = int(e), int(j)
            if g[int(kappa[e, j])] > lmax * (1 + 1e-9):
                # no pass of this programme reaches its class (judged by the class, as the shares
                # are placed: a share that dominates it is in its class or below, so never left out
                # where it is kept)
                continue
            held[j] = True
            d = [float(x) for x in dem[:, e, j]]
            lost = bands.get((e, j), ())
            k0 = int(kappa[e, j])
            places = [(k0 + off, float(deg[e]) * float(x)) for off, x in enumerate(lost)]  # one per class of its band
            kr = k0 + len(lost)
            if kr < K:
                places += [(max(kr, int(ks[0])), 0.0) for ks in tiers[int(tier_of[kr]):]]  # one per tier above
            for k, more in places:  # a share's column: its count, and its demands in its class's chains
                v = pr.var(0.0, float(cnt[j]))
                pr.add(cover[j], v, 1.0)
                for r, c in zip(chain[k], (d[0], d[1] + more, d[2], d[3])):
                    if c:
                        idx[r].append(v)
                        coef[r].append(c)
        if not held.all():
            return None  # a length no pass of an M-pass plan within upper_ms holds
        for k in range(K):
            c = pr.row(0.0, math.inf)  # w >= g z
            pr.add(c, w[k], 1.0)
            pr.add(c, z[k], -float(g[k]))
            top_k = min(float(ceiling[k]), lmax)
            if g[k] > lmax * (1 + 1e-12):
                pr.ub[z[k]] = 0.0
            elif math.isfinite(top_k):
                c = pr.row(0.0, math.inf)  # w <= ceiling z
                pr.add(c, w[k], -1.0)
                pr.add(c, z[k], top_k)
        c = pr.row(float(M), float(M))
        for k in range(K):
            pr.add(c, z[k], 1.0)
        for k in range(1, K):  # passes of class k or above
            if need[k] > 0:
                c = pr.row(float(need[k]), math.inf)
                for k2 in range(k, K):
                    pr.add(c, z[k2], 1.0)
        above = []
        for v in range(len(tiers)):  # passes of tier v or above: a whole number (branched on)
            c = pr.row(0.0, float(M))
            for ks in tiers[v:]:
                for k in ks:
                    pr.add(c, z[int(k)], 1.0)
            above.append(c)
        for k in range(K):
            pr.obj[w[k]] = 1.0
            pr.obj[z[k]] = ovh
        lp = pr.load()
        return lp, [lp.variable(i) for i in z], [lp.variable(i) for i in w], [lp.constraint(i) for i in above], lp.Objective()

    solves, spent = [0], [0.0]

    def out_of_work() -> bool:
        return work is not None and spent[0] >= work

    def branch_and_bound(M: int, best: float):
        """The least optimum over whole numbers of passes per tier and above, or below ``best`` by at
        most the nodes it could not open (``PASS_NODES``): ``(value, passes)``, value inf when no
        M-pass plan fits."""
        built = build(M)
        if built is None:
            return math.inf, []
        lp, z, w, above, obj = built
        V = len(tiers)
        heap = [(-math.inf, 0, [0.0] * V, [float(M)] * V)]  # (parent's value, tie, lower, upper)
        found, found_passes, nodes, tie = math.inf, [], 0, 1
        while heap:
            parent, _, lo, up = heapq.heappop(heap)
            if parent >= min(found, best) * (1 - 1e-9):
                continue
            if nodes >= PASS_NODES or out_of_work():
                heapq.heappush(heap, (parent, 0, lo, up))
                break
            nodes += 1
            for v in range(V):
                above[v].SetBounds(lo[v], up[v])
            if cancel is not None:
                cancel()
            status = lp.Solve()
            solves[0] += 1
            spent[0] += lp.NumVariables() + lp.NumConstraints()
            if status != pywraplp.Solver.OPTIMAL:
                # GLOP restarting from the last basis can lose its way, and can call a feasible node
                # infeasible (7B/A100 wikipedia step 2 of bench/strategies.py: a 1-pass plan of
                # 5,304 ms whose node came back infeasible, the bound 6,124): once more from scratch
                lp, z, w, above, obj = build(M)
                for v in range(V):
                    above[v].SetBounds(lo[v], up[v])
                status = lp.Solve()
                solves[0] += 1
                spent[0] += lp.NumVariables() + lp.NumConstraints()
            if status == pywraplp.Solver.INFEASIBLE:
                continue
            if status != pywraplp.Solver.OPTIMAL:
                heapq.heappush(heap, (parent, 0, lo, up))  # left open at its parent's value
                break
            val = obj.Value()
            if val >= min(found, best) * (1 - 1e-9):
                continue
            zs = np.array([x.solution_value() for x in z])
            cum = np.array([zs[np.concatenate(tiers[v:])].sum() for v in range(V)])
            frac = np.flatnonzero(np.abs(cum - np.round(cum)) > 1e-6)
            if frac.size == 0:
                found = val
                found_passes = [(float(zs[k]), w[k].solution_value(), float(g[k])) for k in range(K) if zs[k] > 1e-9]
                continue
            v = int(frac[-1])  # the longest passes first
            down_up = (lo[:], up[:]), (lo[:], up[:])
            down_up[0][1][v] = math.floor(cum[v])
            down_up[1][0][v] = math.ceil(cum[v])
            for l2, u2 in down_up:
                # the passes of a tier or above are at least those of every higher tier
                for x in range(V):
                    l2[x] = max(l2[x], max(l2[x + 1:], default=0.0))
                    u2[x] = min(u2[x], min(u2[:x], default=float(M)))
                if all(a <= b for a, b in zip(l2, u2)):
                    heapq.heappush(heap, (val, tie, l2, u2))
                    tie += 1
        open_min = min((h[0] for h in heap), default=math.inf)
        return min(found, open_min), found_passes

    best, per_m, best_passes = math.inf, {}, []
    stopped = False
    M = m_min
    while M * (C + ovh) + least_work / n < best * (1 - 1e-9):
        if upper_ms is not None and float(upper_ms) - ovh - (M - 1) * (P + ovh) < P * (1 - 1e-12):
            break
        if out_of_work() or (upper_ms is None and M > m_min + 64):
            # every plan of M passes or more pays M times the pass's constant cost and its share of the
            # least GPU-time: what is proven for the pass counts not reached
            best, best_passes, stopped = min(best, M * (C + ovh) + least_work / n), [], True
            break
        r = branch_and_bound(M, best)
        per_m[M] = r[0] if math.isfinite(r[0]) else None  # None: no M-pass plan, or none below the best
        if r[0] < best:
            best, best_passes = r[0], r[1]
        M += 1
    stopped = stopped or out_of_work()
    if detail is not None:
        detail.update({"per_passes": per_m, "classes": int(K), "items": int(J), "tiers": len(tiers),
                       "bands": len(bands), "shares": int(keep.sum()), "programmes": solves[0],
                       "work": spent[0], "stopped": stopped, "passes": best_passes})
    if not math.isfinite(best):
        return math.inf if only else end  # a branch no plan takes; unbranched, claim nothing
    # the solvers' optimum is a floating-point vertex: step back by their tolerance so it stays a bound
    return max(0.0, best * (1 - 1e-6)) + end
