"""Baseline planners over the same cost model: static layouts, min-degree, greedy.

- ``static:D``: every sequence on SP degree D, data parallel over the N/D replicas (the
  Megatron-CP / DeepSpeed-Ulysses layout). Sequences go longest first to the least-loaded replica,
  then each replica packs its share into micro-batches by best-fit decreasing on memory. Under
  lockstep execution (ZeRO-3) every replica runs the same number of micro-batches together, so
  micro-batches are balanced instead: the fewest per replica that memory allows (or one or two
  more, whichever is faster), sequences longest first into the least-loaded micro-batch with room,
  and micro-batches of similar length run in the same pass.
- ``static-max``: static with the smallest degree that holds the max context, as those users set it.
- ``best-static``: the best static degree for this batch.
- ``min-degree``: each sequence on the smallest degree its memory needs (Megatron's dynamic
  context parallelism), scheduled longest first onto the group that finishes it first.
- ``greedy``: heterogeneous groups by longest-first list scheduling (``list_schedule``): each
  sequence joins the least-loaded group that can hold it or opens a new group, choosing its degree
  to finish within the lower bound at the least extra GPU-time.
"""

from __future__ import annotations

import math
import time

import numpy as np

from workbench.cost import CostModel, InfeasibleError
from workbench.solve.options import PlanOptions
from workbench.solve.plan import Plan, build_plan

__all__ = ["plan_static", "plan_static_max", "plan_best_static", "plan_min_degree", "plan_greedy", "greedy_rule_plans",
           "static_max_degree", "pack_best_fit", "list_schedule"]


def pack_best_fit(sizes: np.ndarray, capacity: float, order=None) -> list[list[int]]:
    """Best-fit decreasing bin packing: returns bins as lists of item indices (of ``sizes``).
    Each item goes to the bin it leaves least room in (the lowest-numbered on ties). Items larger
    than ``capacity`` get a bin of their own (callers check feasibility first)."""
    import bisect

    idx = list(order) if order is not None else np.argsort(-sizes, kind="stable").tolist()
    size = np.asarray(sizes, dtype=np.float64).tolist()
    bins: list[list[int]] = []
    rooms: list[tuple[float, int]] = []  # (room left, bin), sorted: the best fit is a bisection away
    for i in idx:
        sz = size[i]
        k = bisect.bisect_left(rooms, (sz - 1e-12, -1))
        if k == len(rooms):
            bins.append([int(i)])
            bisect.insort(rooms, (capacity - sz, len(bins) - 1))
        else:
            room, b = rooms.pop(k)
            bins[b].append(int(i))
            bisect.insort(rooms, (room - sz, b))
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


def _static_lockstep_assignment(s: np.ndarray, cost: CostModel, degree: int):
    """Passes and replica blocks of the static layout of ``degree`` under lockstep execution (module
    docstring); None when no number of micro-batches up to two above the memory minimum packs."""
    replicas = cost.cluster.num_gpus // degree
    t = cost.time(s, degree)
    mem = cost.memory(s, degree)
    budget = cost.memory_budget_gb * (1 + 1e-12)
    c = cost.group_overhead_ms(degree)
    m0 = max(1, int(math.ceil(float(mem.sum()) / (replicas * cost.memory_budget_gb) - 1e-9)))
    best, best_ms = None, math.inf
    for M in range(m0, m0 + 8):
        k = replicas * M
        load, room = np.zeros(k), np.full(k, budget)
        members: list[list[int]] = [[] for _ in range(k)]
        ok = True
        for i in np.argsort(-t, kind="stable"):
            fit = np.flatnonzero(room >= mem[i])
            if fit.size == 0:
                ok = False
                break
            j = int(fit[np.argmin(load[fit])])
            members[j].append(int(i))
            load[j] += t[i]
            room[j] -= mem[i]
        if not ok:
            continue
        order = np.argsort(-load, kind="stable")
        passes = [order[p * replicas:(p + 1) * replicas] for p in range(M)]
        ms = sum(cost.pass_ms(c + float(load[q].max())) for q in passes if any(members[j] for j in q))
        if ms < best_ms:
            micro = [[(degree, members[j]) for j in q if members[j]] for q in passes]
            blocks = [[r for r, j in enumerate(q) if members[j]] for q in passes]
            best, best_ms = (micro, blocks), ms
        elif best is not None:
            break  # one more micro-batch per replica no longer pays
    return best


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
    if opts.clock is not None:
        opts.clock.tick(elements=120 * s.size, steps=2 * s.size)  # the replicas' assignment, packing and plan
    found = _static_lockstep_assignment(s, cost, degree) if cost.execution == "lockstep" else None
    micro, blocks = found if found is not None else _static_assignment(s, cost, degree)
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
    # the longest sequence's degree, or more: under offload auto a sequence that offloads may fit a
    # smaller group than a shorter one that does not (1M offloaded on 2 GPUs, 200K needing 4)
    lo = max(static_max_degree(cost, int(s.max())), int(cost.min_degree(s).max()))
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
    """Each sequence on the smallest degree its memory needs (Megatron's dynamic context
    parallelism), scheduled longest first onto whichever group of that degree finishes it first."""
    t0 = time.perf_counter()
    cost = cost.chain_view()  # mixed degrees: one divisibility chain, so that aligned blocks pack
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    deg = cost.min_degree(s)
    micro, blocks = list_schedule(s, cost, lambda i: (int(deg[i]),), target=None, opts=opts)
    return build_plan("min-degree", micro, s, cost, blocks=blocks, solve_seconds=time.perf_counter() - t0)


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


def list_schedule(s: np.ndarray, cost: CostModel, allowed, *, target: float | None, opts: PlanOptions | None = None):
    """Longest-first list scheduling of sequences onto SP groups with the exact timeline.

    Each sequence (by GPU-time, longest first) either joins an *extendable* group (the last group
    on each of its ranks, so lengthening it delays nothing else) with memory room, or opens a new
    group of an allowed degree on the aligned block whose ranks are free earliest. With a
    ``target`` (ms), among the options that finish by it the one adding the least GPU-time wins
    (communication, fixed overhead and ranks left waiting all count); otherwise, or without a
    target, the earliest finish wins. A rank's groups run in micro-step order, so the timeline
    this models is exactly the one ``build_plan`` replays with the returned fixed blocks.

    ``allowed(i)`` gives the degrees sequence i may use. Returns ``(micro_steps, blocks)`` for
    ``build_plan``.
    """
    import heapq

    n = cost.cluster.num_gpus
    budget = cost.memory_budget_gb * (1 + 1e-9)
    degrees = list(cost.degrees)
    # plain lists: this loop is scalar work, where numpy calls cost more than they save
    times = {d: cost.time(s, d).tolist() for d in degrees}
    mems = {d: cost.memory(s, d).tolist() for d in degrees}
    over = {d: cost.group_overhead_ms(d) for d in degrees}
    work = _best_work(s, cost)
    ready = np.zeros(n)
    last = np.full(n, -1, dtype=np.int64)  # last group on each rank
    next_ms = np.zeros(n, dtype=np.int64)  # micro-steps each rank has joined
    g_deg: list[int] = []
    g_end: list[float] = []
    g_mem: list[float] = []
    g_open: list[bool] = []
    g_block: list[int] = []
    g_ms: list[int] = []
    g_seqs: list[list[int]] = []
    g_end_np = np.zeros(s.size)  # mirrors for the numpy path over many open groups
    g_mem_np = np.zeros(s.size)
    open_of: dict[int, list[int]] = {d: [] for d in degrees}  # open groups per degree, by index
    # per degree: each aligned block's latest ready rank and summed ready time, kept up to date (a
    # placement sets its block's ranks to one finish time, never earlier than before), and a heap
    # of (ready, block) with stale entries skipped, for the block free earliest (lowest index on ties)
    nbk = {d: n // d for d in degrees}
    bmax = {d: np.zeros(nbk[d]) for d in degrees}
    bsum = {d: np.zeros(nbk[d]) for d in degrees}
    heaps = {d: [(0.0, b) for b in range(nbk[d])] for d in degrees}

    def earliest(d: int) -> tuple[float, int]:
        h, bm = heaps[d], bmax[d]
        while h[0][0] != bm[h[0][1]]:
            heapq.heappop(h)
        return h[0]

    def set_ready(lo: int, hi: int, dg: int, finish: float) -> None:
        old_sum = float(ready[lo:hi].sum())
        ready[lo:hi] = finish
        for d2 in degrees:
            nb2 = nbk[d2]
            if not nb2:
                continue
            if d2 <= dg:
                a, z = lo // d2, hi // d2
                bmax[d2][a:z] = finish
                bsum[d2][a:z] = finish * d2
                h = heaps[d2]
                for y in range(a, z):
                    heapq.heappush(h, (finish, y))
                if len(h) > 8 * nb2 + 64:
                    heaps[d2] = [(float(v), y) for y, v in enumerate(bmax[d2])]
                    heapq.heapify(heaps[d2])
            else:
                y = lo // d2
                if y < nb2:
                    bsum[d2][y] += dg * finish - old_sum
                    if finish > bmax[d2][y]:
                        bmax[d2][y] = finish
                        heapq.heappush(heaps[d2], (finish, y))

    ng = 0
    clock = opts.clock if opts is not None else None
    for step, i in enumerate(np.argsort(-work, kind="stable").tolist()):
        if opts is not None and step % 256 == 0:
            opts.check_cancel()
        if clock is not None:
            clock.tick(steps=0.3 * len(degrees))
        best = None  # (finish, added work, kind, degree, group or block, start)
        for d in allowed(i):
            t_i, m_i = times[d][i], mems[d][i]
            if m_i > budget:
                continue
            # join an extendable group of this degree (the one ending first, lowest index on ties)
            og = open_of[d]
            if og:
                g, ge = -1, math.inf
                if len(og) <= 32:
                    for q in og:
                        if g_mem[q] + m_i <= budget and g_end[q] < ge:
                            g, ge = q, g_end[q]
                else:
                    cand = np.asarray(og, dtype=np.int64)
                    cand = cand[g_mem_np[cand] + m_i <= budget]
                    if cand.size:
                        g = int(cand[np.argmin(g_end_np[cand])])
                        ge = g_end[g]
                if g >= 0:
                    best = _better((ge + t_i, d * t_i, "join", d, g, 0.0), best, target)
            # open a new group on the block free earliest
            if nbk[d]:
                start, b = earliest(d)
                wait = d * start - float(bsum[d][b])
                best = _better((start + over[d] + t_i, d * (over[d] + t_i) + wait, "open", d, b, start), best, target)
        if best is None:
            raise InfeasibleError(cost.infeasible_message(int(i), int(s[i])))
        finish, _, kind, d, where, start = best
        if kind == "join":
            g = where
            g_seqs[g].append(int(i))
            g_end[g] = g_end_np[g] = finish
            g_mem[g] += mems[d][i]
            g_mem_np[g] = g_mem[g]
            lo, hi = g_block[g] * d, (g_block[g] + 1) * d
            set_ready(lo, hi, d, finish)
        else:
            lo, hi = where * d, (where + 1) * d
            for q in set(last[lo:hi].tolist()):
                if q >= 0 and g_open[q]:
                    g_open[q] = False
                    open_of[g_deg[q]].remove(q)
            g = ng
            ng += 1
            ms = int(next_ms[lo:hi].max())
            g_deg.append(d), g_end.append(finish), g_mem.append(mems[d][i]), g_open.append(True)
            g_block.append(where), g_ms.append(ms), g_seqs.append([int(i)])
            g_end_np[g], g_mem_np[g] = finish, mems[d][i]
            next_ms[lo:hi] = ms + 1
            last[lo:hi] = g
            set_ready(lo, hi, d, finish)
            open_of[d].append(g)
    steps = max(g_ms) + 1 if ng else 0
    micro: list[list] = [[] for _ in range(steps)]
    blks: list[list[int]] = [[] for _ in range(steps)]
    for g in range(ng):
        micro[g_ms[g]].append((g_deg[g], g_seqs[g]))
        blks[g_ms[g]].append(g_block[g])
    return micro, blks


def _better(opt, best, target):
    """Whether ``opt`` beats ``best`` under the target rule of list_schedule (returns the winner)."""
    if best is None:
        return opt
    if target is not None:
        a_in, b_in = opt[0] <= target, best[0] <= target
        if a_in != b_in:
            return opt if a_in else best
        if a_in:
            return opt if (opt[1], opt[0]) < (best[1], best[0]) else best
    return opt if (opt[0], opt[1]) < (best[0], best[1]) else best


def greedy_rule_plans(lengths, cost: CostModel, opts: PlanOptions, *, deadline: float | None = None) -> list[Plan]:
    """The plans of greedy's three list-scheduling rules (planner ``greedy`` returns the fastest):
    every degree that holds each sequence aiming at the lower bound, minimum degrees only, and every
    degree aiming 5% above the bound. With a ``deadline`` (a point on the plan's effort clock,
    ``opts.clock``) the rules after the first are skipped once it has passed. Raises InfeasibleError
    when a sequence fits no group."""
    from workbench.solve.bound import lower_bound_ms

    cost = cost.chain_view()
    opts, clock = opts.start()
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    lb = lower_bound_ms(s, cost) - cost.step_end_ms()
    dmin = cost.min_degree(s)
    every = lambda i: [d for d in cost.degrees if d >= dmin[i]]  # noqa: E731
    smallest = lambda i: (int(dmin[i]),)  # noqa: E731
    out: list[Plan] = []
    for rule, allowed, target in (("target", every, lb), ("min-degree", smallest, None),
                                  ("target+5%", every, lb * 1.05)):
        if out and deadline is not None and clock.past(deadline):
            break
        micro, blocks = list_schedule(s, cost, allowed, target=target, opts=opts)
        out.append(build_plan("greedy", micro, s, cost, blocks=blocks, stats={"rule": rule}))
    return out


def plan_greedy(lengths, cost: CostModel, opts: PlanOptions, *, deadline: float | None = None) -> Plan:
    """Heterogeneous greedy plan: the fastest of ``greedy_rule_plans`` (so greedy is never behind
    min-degree). ``stats["rules_skipped"]`` counts the rules a ``deadline`` cut."""
    t0 = time.perf_counter()
    cost = cost.chain_view()  # mixed degrees: one divisibility chain, so that aligned blocks pack
    plans = greedy_rule_plans(lengths, cost, opts, deadline=deadline)
    best = min(plans, key=lambda p: p.makespan_ms)
    if len(plans) < 3:
        best.stats["rules_skipped"] = 3 - len(plans)
    return _with_time(best, time.perf_counter() - t0)
