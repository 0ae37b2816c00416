"""Baseline planners over the same cost model: static layouts, min-degree, greedy.

- ``static:D``: every sequence on SP degree D, data parallel over the N/D replicas (the
  Megatron-CP / DeepSpeed-Ulysses layout). Sequences go longest first to the least-loaded replica,
  then each replica packs its share into micro-batches by best-fit decreasing on memory.
- ``static-max``: static with the smallest degree that holds the max context, as those users set it.
- ``best-static``: the best static degree for this batch.
- ``min-degree``: each sequence on the smallest degree its memory needs (Megatron's dynamic
  context parallelism), groups packed greedily.
- ``greedy``: heterogeneous groups; sequences are spread over the fewest micro-steps that hold
  them, then, longest first, each goes to the least-loaded group that can hold it, or opens a new
  group sized to finish within the micro-step's lower bound.
"""

from __future__ import annotations

import math
import time

import numpy as np

from workbench.cost import CostModel, InfeasibleError
from workbench.solve.options import PlanOptions
from workbench.solve.plan import Plan, build_plan

__all__ = ["plan_static", "plan_static_max", "plan_best_static", "plan_min_degree", "plan_greedy",
           "static_max_degree", "pack_best_fit"]


def pack_best_fit(sizes: np.ndarray, capacity: float, order=None) -> list[list[int]]:
    """Best-fit decreasing bin packing: returns bins as lists of item indices (of ``sizes``).
    Items larger than ``capacity`` get a bin of their own (callers check feasibility first)."""
    idx = list(order) if order is not None else list(np.argsort(-sizes, kind="stable"))
    bins: list[list[int]] = []
    room: list[float] = []
    for i in idx:
        sz = float(sizes[i])
        best, best_left = -1, math.inf
        for b, r in enumerate(room):
            left = r - sz
            if -1e-12 <= left < best_left:
                best, best_left = b, left
        if best < 0:
            bins.append([int(i)])
            room.append(capacity - sz)
        else:
            bins[best].append(int(i))
            room[best] = best_left
    return bins


def _static_assignment(s: np.ndarray, cost: CostModel, degree: int):
    """Micro-steps and fixed replica blocks of the static layout of ``degree``."""
    n = cost.cluster.num_gpus
    replicas = n // degree
    t = cost.time(s, degree)
    mem = cost.memory(s, degree)
    c = cost.group_overhead_ms(degree)
    budget = cost.memory_budget_gb
    # longest first onto the least-loaded replica; a replica's load counts the overhead of the
    # micro-batches its memory will need, so that replicas end level
    load = np.zeros(replicas)
    mem_load = np.zeros(replicas)
    share: list[list[int]] = [[] for _ in range(replicas)]
    for i in np.argsort(-t, kind="stable"):
        est = load + t[i] + c * np.ceil((mem_load + mem[i]) / budget - 1e-9)
        r = int(np.argmin(est))
        share[r].append(int(i))
        load[r] += t[i]
        mem_load[r] += mem[i]
    bins = [pack_best_fit(mem[idx], budget) for idx in (np.array(x, dtype=np.int64) for x in share)]
    bins = [[[share[r][j] for j in b] for b in bins[r]] for r in range(replicas)]
    steps = max((len(b) for b in bins), default=0)
    micro, blocks = [], []
    for m in range(steps):
        groups, blk = [], []
        for r in range(replicas):
            if m < len(bins[r]):
                groups.append((degree, bins[r][m]))
                blk.append(r)
        micro.append(groups)
        blocks.append(blk)
    return micro, blocks


def _check_degree_holds(s: np.ndarray, cost: CostModel, degree: int, planner: str) -> None:
    if degree not in cost.degrees:
        reason = cost.degree_limit_reason(degree) or f"candidate degrees are {list(cost.degrees)}"
        raise InfeasibleError(f"{planner}: degree {degree} cannot be used ({reason})")
    mem = cost.memory(s, degree)
    bad = np.flatnonzero(mem > cost.memory_budget_gb)
    if bad.size:
        i = int(bad[np.argmax(s[bad])])
        need = int(cost.min_degree([s[i]])[0])
        hint = f"it needs degree {need}" if need else cost.infeasible_message(i, int(s[i]))
        raise InfeasibleError(
            f"{planner}: sequence {i} ({int(s[i]):,} tokens) needs {mem[i]:.1f} GB per GPU at degree {degree}, over "
            f"the {cost.memory_budget_gb:.1f} GB budget; {hint}")


def plan_static(lengths, cost: CostModel, opts: PlanOptions, degree: int, name: str | None = None) -> Plan:
    """The static layout: degree ``degree`` everywhere, data parallel over the rest."""
    t0 = time.perf_counter()
    s = np.asarray(lengths, dtype=np.int64)
    name = name or f"static:{degree}"
    _check_degree_holds(s, cost, degree, name)
    micro, blocks = _static_assignment(s, cost, degree)
    return build_plan(name, micro, s, cost, blocks=blocks, solve_seconds=time.perf_counter() - t0,
                      stats={"degree": degree})


def static_max_degree(cost: CostModel, max_len: int) -> int:
    """The smallest candidate degree that holds a sequence of ``max_len`` tokens."""
    d = int(cost.min_degree([max_len])[0])
    if d == 0:
        raise InfeasibleError("static-max: " + cost.infeasible_message(-1, int(max_len)).replace("sequence -1 ", "the max context "))
    return d


def plan_static_max(lengths, cost: CostModel, opts: PlanOptions) -> Plan:
    """Static layout with the degree the configured max context needs."""
    s = np.asarray(lengths, dtype=np.int64)
    max_len = int(opts.max_len) if opts.max_len else int(s.max())
    max_len = max(max_len, int(s.max()))
    d = static_max_degree(cost, max_len)
    p = plan_static(s, cost, opts, d, name="static-max")
    p.stats["max_len"] = max_len
    return p


def plan_best_static(lengths, cost: CostModel, opts: PlanOptions) -> Plan:
    """The static degree with the smallest makespan for this batch."""
    t0 = time.perf_counter()
    s = np.asarray(lengths, dtype=np.int64)
    lo = static_max_degree(cost, int(s.max()))
    best: Plan | None = None
    for d in cost.degrees:
        if d < lo:
            continue
        opts.check_cancel()
        p = plan_static(s, cost, opts, d, name="best-static")
        if best is None or p.makespan_ms < best.makespan_ms:
            best = p
    assert best is not None
    return _with_time(best, time.perf_counter() - t0)


def _with_time(p: Plan, seconds: float) -> Plan:
    import dataclasses

    return dataclasses.replace(p, solve_seconds=seconds)


def plan_min_degree(lengths, cost: CostModel, opts: PlanOptions) -> Plan:
    """Each sequence on its minimum degree; groups of each degree packed micro-step by micro-step:
    a sequence opens a new group while ranks are free, else joins the least-loaded group of its
    degree with memory room, else waits for the next micro-step."""
    t0 = time.perf_counter()
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    n = cost.cluster.num_gpus
    deg = cost.min_degree(s)
    budget = cost.memory_budget_gb
    t = np.array([cost.time([s[i]], int(deg[i]))[0] for i in range(s.size)]) if s.size else np.zeros(0)
    mem = np.array([cost.memory([s[i]], int(deg[i]))[0] for i in range(s.size)]) if s.size else np.zeros(0)
    remaining = list(np.lexsort((-t, -deg)))  # larger degrees first, then longer
    micro = []
    while remaining:
        opts.check_cancel()
        free = n
        groups: list[list] = []  # [degree, seqs, load, mem]
        left = []
        for i in remaining:
            d = int(deg[i])
            if free >= d:
                groups.append([d, [int(i)], t[i], mem[i]])
                free -= d
                continue
            cand = [g for g in groups if g[0] == d and g[3] + mem[i] <= budget * (1 + 1e-9)]
            if cand:
                g = min(cand, key=lambda g: g[2])
                g[1].append(int(i))
                g[2] += t[i]
                g[3] += mem[i]
            else:
                left.append(i)
        micro.append([(g[0], g[1]) for g in groups])
        remaining = left
    return build_plan("min-degree", micro, s, cost, solve_seconds=time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------
# greedy
# ------------------------------------------------------------------------------------------------


def _best_work(s: np.ndarray, cost: CostModel) -> np.ndarray:
    """Least GPU-time (degree x time) of each sequence over the degrees that hold it."""
    best = np.full(s.shape, np.inf)
    for d in cost.degrees:
        ok = cost.memory(s, d) <= cost.memory_budget_gb
        best = np.where(ok, np.minimum(best, d * cost.time(s, d)), best)
    return best


def _greedy_micro_step(idx: list[int], s: np.ndarray, cost: CostModel, work: np.ndarray):
    """Groups for one micro-step's sequences; returns (groups, deferred sequence indices)."""
    n = cost.cluster.num_gpus
    budget = cost.memory_budget_gb
    c = cost.group_overhead_ms(1)
    degrees = list(cost.degrees)
    if not idx:
        return [], []
    single = {d: cost.time(s[idx], d) for d in degrees}
    memd = {d: cost.memory(s[idx], d) for d in degrees}
    pos = {i: k for k, i in enumerate(idx)}
    target = max(float(work[idx].sum()) / n + c,
                 max(min((single[d][k] + c) for d in degrees if memd[d][k] <= budget) for k in range(len(idx))))
    groups: list[list] = []  # [degree, seqs, load, mem]
    free = n
    deferred = []
    order = sorted(idx, key=lambda i: -work[i])
    for i in order:
        k = pos[i]
        fits = [d for d in degrees if memd[d][k] <= budget * (1 + 1e-9)]
        # best existing group
        best_g, best_load = None, math.inf
        for g in groups:
            d = g[0]
            if d in fits and g[3] + memd[d][k] <= budget * (1 + 1e-9):
                load = g[2] + single[d][k]
                if load < best_load:
                    best_g, best_load = g, load
        # smallest new group that finishes within the target, else the largest that fits the free ranks
        new_d = None
        opening = [d for d in fits if d <= free]
        if opening:
            within = [d for d in opening if c + single[d][k] <= target]
            new_d = min(within) if within else max(opening)
        if best_g is not None and (best_load <= target or new_d is None or best_load <= c + single[new_d][k]):
            best_g[1].append(i)
            best_g[2] = best_load
            best_g[3] += memd[best_g[0]][k]
        elif new_d is not None:
            groups.append([new_d, [i], c + single[new_d][k], memd[new_d][k]])
            free -= new_d
        else:
            deferred.append(i)
    # spare ranks: widen the slowest groups while that shortens them
    improved = True
    while improved and free > 0:
        improved = False
        g = max(groups, key=lambda g: g[2])
        d2 = g[0] * 2
        if d2 in degrees and free >= g[0]:
            new_load = c + float(cost.time(s[g[1]], d2).sum())
            if new_load < g[2]:
                free -= g[0]
                g[0], g[2] = d2, new_load
                g[3] = float(cost.memory(s[g[1]], d2).sum())
                improved = True
    return [(g[0], g[1]) for g in groups], deferred


def greedy_assignment(s: np.ndarray, cost: CostModel, micro_steps: int) -> list[list[tuple[int, list[int]]]]:
    """Greedy groups for ``micro_steps`` micro-steps (more are added if sequences do not fit)."""
    work = _best_work(s, cost)
    act = cost.memory(s, 1)
    cap = cost.cluster.num_gpus * cost.memory_budget_gb
    buckets: list[list[int]] = [[] for _ in range(micro_steps)]
    wload = np.zeros(micro_steps)
    mload = np.zeros(micro_steps)
    for i in np.argsort(-work, kind="stable"):
        # least work first among micro-steps with memory room; long sequences spread out
        room = mload + act[i] <= cap
        cand = np.where(room, wload, np.inf)
        m = int(np.argmin(cand)) if np.isfinite(cand).any() else int(np.argmin(mload))
        buckets[m].append(int(i))
        wload[m] += work[i]
        mload[m] += act[i]
    out = []
    carry: list[int] = []
    m = 0
    while m < len(buckets) or carry:
        idx = (buckets[m] if m < len(buckets) else []) + carry
        groups, carry = _greedy_micro_step(idx, s, cost, work)
        if not groups and carry:
            raise InfeasibleError(cost.infeasible_message(carry[0], int(s[carry[0]])))
        out.append(groups)
        m += 1
    return out


def plan_greedy(lengths, cost: CostModel, opts: PlanOptions) -> Plan:
    """Heterogeneous greedy plan; tries the fewest micro-steps that hold the batch and two more,
    keeping the fastest."""
    t0 = time.perf_counter()
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    m_min = max(1, math.ceil(float(cost.memory(s, 1).sum()) / (cost.cluster.num_gpus * cost.memory_budget_gb)))
    best: Plan | None = None
    for m in range(m_min, m_min + 3):
        opts.check_cancel()
        p = build_plan("greedy", greedy_assignment(s, cost, m), s, cost)
        if best is None or p.makespan_ms < best.makespan_ms:
            best = p
    assert best is not None
    return _with_time(best, time.perf_counter() - t0)
