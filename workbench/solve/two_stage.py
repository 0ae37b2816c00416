"""The ``two-stage`` planner: Hydraulis-style dispatch to fixed data-parallel replicas, then packing.

A *layout* is a fixed set of data-parallel replicas, each an SP group of one degree that keeps its
ranks for the whole step (``blocks`` in ``build_plan``): e.g. ``1x32+16x2`` is one replica of degree
32 and sixteen of degree 2 on 64 GPUs. Replicas are placed largest first on consecutive ranks, so
(candidate degrees each dividing the next) every replica is an aligned block.

For each candidate layout (``candidate_layouts``: every homogeneous layout whose degree holds the
longest sequence, mixes of a few big replicas with smaller ones, and layouts whose GPUs per degree
follow the work of the sequences that need that degree):

1. **dispatch** (``dispatch``): sequences that fit the fewest replicas first (those only the largest
   replicas hold), then longest first, each to the replica that minimises the resulting maximum
   replica cost, where a replica's cost is the sum of its sequences' times plus the group overhead
   of each micro-batch its memory will need (``ceil(memory / budget)``); ties go to the replica
   that ends lowest (together: the replica that ends lowest). Randomised restarts (seeded by
   ``opts.seed``) perturb the order and the ties.
2. **packing** (``pack_min_microbatches``): each replica's sequences into micro-batches whose
   memory fits the budget. A replica keeps its ranks, so its time is the sum of its sequences'
   times plus one group overhead per micro-batch, whatever the split: the packing that matters is
   the one with the fewest micro-batches. Best-fit decreasing first; when it is above the lower
   bound and the share is small, CP-SAT checks the counts from the bound upwards (the first
   feasible count is the minimum).
3. **local search** on the shortlisted layouts: move one sequence at a time off the slowest
   replica to the replica where the pair ends lowest, while that lowers the slowest replica.

The layout and restart with the smallest makespan win. The homogeneous layouts' deterministic
pass is the static planner's assignment, so (unless the effort budget cuts the layouts short)
two-stage is never behind ``best-static``. Deterministic for a given seed and effort: layouts,
restarts and the local search stop on the plan's effort clock (``workbench.solve.effort``;
``stats["truncated"]`` says when it cut them short) and CP-SAT runs one worker on deterministic time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from workbench.cost import CostModel, InfeasibleError
from workbench.solve.baselines import pack_best_fit
from workbench.solve.cpsat import run_cpsat
from workbench.solve.effort import DTIME_PER_S, Effort
from workbench.solve.options import PlanOptions
from workbench.solve.plan import Plan, build_plan

__all__ = [
    "plan_two_stage",
    "candidate_layouts",
    "layout_name",
    "layout_blocks",
    "dispatch",
    "pack_min_microbatches",
    "microbatch_lower_bound",
]

RESTARTS = 4
"""Dispatch passes per shortlisted layout: one deterministic and RESTARTS-1 randomised."""
SHORTLIST = 3
"""Layouts (best after the deterministic pass) that get randomised restarts and exact packing."""
EXACT_MAX_ITEMS = 40
"""Shares up to this many sequences are packed exactly by CP-SAT when best fit is above the bound."""
EXACT_DET_TIME = 0.2
"""CP-SAT deterministic time limit per micro-batch count checked."""
ORDER_NOISE = 0.15
"""Randomised restarts scale each sequence's sort key by a factor in [1 - noise, 1 + noise]."""
TIE_NOISE = 0.03
_TOL = 1e-9


# ------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------


def layout_name(layout) -> str:
    """``"1x32+16x2"``: replica count x degree, largest degree first."""
    degs = sorted((int(d) for d in layout), reverse=True)
    parts: list[str] = []
    for d in dict.fromkeys(degs):
        parts.append(f"{degs.count(d)}x{d}")
    return "+".join(parts)


def layout_blocks(layout) -> list[int]:
    """Aligned block index of each replica of ``layout`` (degrees sorted largest first), placed
    on consecutive ranks from rank 0."""
    out, offset = [], 0
    for d in layout:
        d = int(d)
        if offset % d:
            raise ValueError(f"layout {layout_name(layout)}: a replica of degree {d} would start at rank {offset}, "
                             f"not a multiple of {d}; list larger degrees first")
        out.append(offset // d)
        offset += d
    return out


def _proportional(s: np.ndarray, cost: CostModel, cls: np.ndarray, n: int) -> tuple[int, ...] | None:
    """Replicas per degree class, GPUs in proportion to the class's GPU-time (work)."""
    budget = cost.memory_budget_gb
    classes = sorted({int(c) for c in cls}, reverse=True)
    work = {}
    for c in classes:
        sel = s[cls == c]
        micro = math.ceil(float(cost.memory(sel, c).sum()) / budget - _TOL)
        work[c] = float(cost.work(sel, c).sum()) + c * cost.group_overhead_ms(c) * max(1, micro)
    total = sum(work.values())
    gpus = {c: max(c, int(round(n * work[c] / total / c)) * c) for c in classes}
    while sum(gpus.values()) > n:
        shrink = [c for c in classes if gpus[c] > c]
        if not shrink:
            return None
        c = min(shrink, key=lambda c: (work[c] / gpus[c], -c))  # the most over-provisioned class
        gpus[c] -= c
    while True:
        free = n - sum(gpus.values())
        grow = [c for c in classes if c <= free]
        if not grow:
            break
        c = max(grow, key=lambda c: (work[c] / gpus[c], c))  # the most under-provisioned class
        gpus[c] += c
    reps: list[int] = []
    for c in classes:
        reps += [c] * (gpus[c] // c)
    return tuple(reps)


def candidate_layouts(lengths, cost: CostModel) -> list[tuple[str, tuple[int, ...]]]:
    """The layouts the planner tries, as ``(name, replica degrees largest first)``, best guesses
    first: the static layout of the degree the longest sequence needs, the work-proportional
    layouts, the other homogeneous layouts, then ``k`` replicas of the needed degree with the rest
    of the GPUs at one smaller degree. Raises InfeasibleError when a sequence fits no group."""
    cost = cost.chain_view()  # replicas of mixed degrees: one divisibility chain, so that they pack
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    n = cost.cluster.num_gpus
    degs = [int(d) for d in cost.degrees if d <= n]
    dmin = cost.min_degree(s)
    need = int(dmin.max())
    seen: dict[tuple[int, ...], str] = {}

    def add(reps) -> None:
        if not reps:
            return
        reps = tuple(sorted((int(d) for d in reps), reverse=True))
        if reps[0] < need or sum(reps) > n or reps in seen:
            return
        seen[reps] = layout_name(reps)

    homo = [d for d in degs if d >= need and n // d >= 1]
    if need in homo:
        add([need] * (n // need))
    for floor in degs:
        if floor > need:
            break
        prop = _proportional(s, cost, np.maximum(dmin, floor), n)
        if prop is not None:
            add(prop)
    for d in homo:
        add([d] * (n // d))
    ks, k = [], 1
    while k < n // need:
        ks.append(k)
        k = k + 1 if k < 4 else k + k // 2
    for k in ks:
        rest = n - k * need
        for small in reversed(degs):
            if small < need:
                add([need] * k + [small] * (rest // small))
    return [(name, reps) for reps, name in seen.items()]


# ------------------------------------------------------------------------------------------------
# stage 1: dispatch to replicas
# ------------------------------------------------------------------------------------------------


def dispatch(lengths, cost: CostModel, layout, *, rng: np.random.Generator | None = None) -> list[list[int]]:
    """Stage 1: the sequence indices each replica of ``layout`` (a list of degrees) runs.

    Order: sequences that fit the fewest replicas first, then longest first (with ``rng``: the
    length key scaled by a random factor within ``ORDER_NOISE``). Each goes to the replica that
    holds it and minimises the resulting maximum estimated replica cost ``sum(time) +
    overhead * ceil(memory / budget)``; ties go to the replica whose own cost ends lowest, then the
    lower index (with ``rng``: costs within ``TIE_NOISE`` are ties broken at random). Raises
    InfeasibleError when a sequence fits no replica of the layout.
    """
    s = np.asarray(lengths, dtype=np.int64)
    R, k = len(layout), s.size
    budget = cost.memory_budget_gb
    T, M, over = _matrices(s, cost, layout)
    fits = M <= budget * (1 + _TOL)
    n_fit = fits.sum(axis=1)
    key = s.astype(np.float64)
    if rng is not None:
        key = key * (1.0 + ORDER_NOISE * rng.uniform(-1.0, 1.0, size=k))
    order = np.lexsort((np.arange(k), -key, n_fit))
    load = np.zeros(R)
    mem = np.zeros(R)
    est = np.zeros(R)
    share: list[list[int]] = [[] for _ in range(R)]
    bad = np.flatnonzero(n_fit == 0)
    if bad.size:
        i = int(bad[0])
        raise InfeasibleError(f"two-stage: layout {layout_name(layout)} has no replica that holds "
                              f"sequence {i} ({int(s[i]):,} tokens)")
    pen = np.where(fits, 0.0, np.inf)
    for i in order:
        new = load + T[i] + over * np.ceil((mem + M[i]) / budget - _TOL) + pen[i]
        if rng is None:
            # the smallest resulting maximum, ties to the replica ending lowest: with
            # res = max(new, max(est)) and new >= est, that is the replica ending lowest
            r = int(np.argmin(new))
        else:
            res = np.maximum(new, est.max())
            cand = np.flatnonzero(res <= res.min() * (1 + TIE_NOISE))
            r = int(cand[np.argmin(new[cand] * (1.0 + TIE_NOISE * rng.uniform(0.0, 1.0, size=cand.size)))])
        share[r].append(int(i))
        load[r] += T[i, r]
        mem[r] += M[i, r]
        est[r] = new[r]
    return share


# ------------------------------------------------------------------------------------------------
# stage 2: micro-batches of one replica
# ------------------------------------------------------------------------------------------------


def microbatch_lower_bound(sizes, capacity: float) -> int:
    """No packing of ``sizes`` into bins of ``capacity`` uses fewer bins: the total over the
    capacity, and the items over half the capacity (no two share a bin)."""
    x = np.asarray(sizes, dtype=np.float64)
    if x.size == 0:
        return 0
    return max(1, math.ceil(float(x.sum()) / capacity - _TOL), int((x > capacity / 2 * (1 + _TOL)).sum()))


def _int_sizes(x: np.ndarray, capacity: float, scale: int = 10**9) -> tuple[list[int], int]:
    """Integer sizes for CP-SAT, rounded up unless within a hair of an integer, so a packing that
    fits in integers fits in floats up to the 1e-9 tolerance the planners use."""
    q = x / capacity * scale
    r = np.round(q)
    v = np.where(np.abs(q - r) <= 1e-3, r, np.ceil(q))
    return [int(a) for a in v], scale


def _cpsat_pack(x: np.ndarray, capacity: float, bins: int, *, seed: int, det_time: float,
                clock: Effort) -> tuple[str, list[list[int]] | None]:
    """Whether the items fit ``bins`` bins: ("feasible", packing) / ("infeasible", None) /
    ("unknown", None); CP-SAT on ``det_time`` of deterministic time, one worker, charged to ``clock``."""
    from ortools.sat.python import cp_model

    sizes, cap = _int_sizes(x, capacity)
    k = len(sizes)
    order = sorted(range(k), key=lambda i: (-sizes[i], i))
    m = cp_model.CpModel()
    a = {}
    for pos, i in enumerate(order):
        # symmetry: the pos-th largest item goes to one of the first pos+1 bins
        for b in range(min(bins, pos + 1)):
            a[i, b] = m.NewBoolVar(f"a{i}_{b}")
        m.AddExactlyOne(a[i, b] for b in range(min(bins, pos + 1)))
    for b in range(bins):
        terms = [(a[i, b], sizes[i]) for i in range(k) if (i, b) in a]
        if terms:
            m.Add(sum(v * w for v, w in terms) <= cap)
    solver, st, _ = run_cpsat(m, effort=float(det_time) / DTIME_PER_S, clock=clock, seed=seed, workers=1)
    if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        out: list[list[int]] = [[] for _ in range(bins)]
        for (i, b), v in a.items():
            if solver.BooleanValue(v):
                out[b].append(i)
        return "feasible", [sorted(o, key=lambda i: (-x[i], i)) for o in out if o]
    if st == cp_model.INFEASIBLE:
        return "infeasible", None
    return "unknown", None


def pack_min_microbatches(sizes, capacity: float, *, exact_items: int = EXACT_MAX_ITEMS, seed: int = 0,
                          det_time: float = EXACT_DET_TIME, clock: Effort | None = None) -> tuple[list[list[int]], bool]:
    """Stage 2: split items (activation memory per GPU of a replica's sequences) into the fewest
    micro-batches whose memory is at most ``capacity``.

    Returns ``(bins, proven)``: bins as lists of item indices (largest first), and whether their
    count is proven minimal (it meets the lower bound, or CP-SAT showed one fewer is infeasible).
    Best-fit decreasing first; when it uses more bins than the lower bound and there are at most
    ``exact_items`` items, CP-SAT tries each count from the bound up (``det_time`` of deterministic
    time each, charged to the plan's ``clock`` when given). Items larger than the capacity get a bin
    of their own (callers check feasibility first).
    """
    x = np.asarray(sizes, dtype=np.float64)
    if x.size == 0:
        return [], True
    lb = microbatch_lower_bound(x, capacity)
    best = pack_best_fit(x, capacity)
    if len(best) <= lb:
        return best, True
    if x.size > exact_items or (x > capacity * (1 + _TOL)).any():
        return best, False
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:  # pragma: no cover - OR-Tools is a dependency; best fit without it
        return best, False
    clock = clock if clock is not None else Effort(budget=1e9)
    for m in range(lb, len(best)):
        if clock.capped:
            return best, False
        status, packing = _cpsat_pack(x, capacity, m, seed=seed, det_time=det_time, clock=clock)
        if status == "feasible":
            return packing, True
        if status == "unknown":
            return best, False
    return best, True  # every smaller count is infeasible


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------


@dataclass
class _Candidate:
    name: str
    layout: tuple[int, ...]
    restart: int
    share: list[list[int]]
    bins: list[list[list[int]]]  # per replica: micro-batches of sequence indices
    totals: np.ndarray  # per replica: sum(time) + overhead * micro-batches
    proven: list[bool] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return float(self.totals.max()) if self.totals.size else 0.0


def _pack_share(s: np.ndarray, cost: CostModel, d: int, idx: list[int], *, exact: bool, seed: int,
                clock: Effort | None = None) -> tuple[list[list[int]], bool]:
    if not idx:
        return [], True
    sizes = cost.memory(s[idx], d)
    if exact:
        bins, proven = pack_min_microbatches(sizes, cost.memory_budget_gb, seed=seed, clock=clock)
    else:
        bins = pack_best_fit(sizes, cost.memory_budget_gb)
        proven = len(bins) <= microbatch_lower_bound(sizes, cost.memory_budget_gb)
    return [[idx[j] for j in b] for b in bins], proven


def _totals(s: np.ndarray, cost: CostModel, layout, share, bins) -> np.ndarray:
    out = np.zeros(len(layout))
    for r, d in enumerate(layout):
        if share[r]:
            out[r] = float(cost.time(s[share[r]], d).sum()) + cost.group_overhead_ms(d) * len(bins[r])
    return out


def _evaluate(s, cost, name, layout, restart, rng, clock: Effort) -> _Candidate:
    clock.tick(elements=2.5 * s.size * len(layout), steps=0.6 * s.size)  # the dispatch and best-fit packing
    share = dispatch(s, cost, layout, rng=rng)
    packed = [_pack_share(s, cost, d, share[r], exact=False, seed=0) for r, d in enumerate(layout)]
    bins = [b for b, _ in packed]
    return _Candidate(name=name, layout=tuple(layout), restart=restart, share=share, bins=bins,
                      totals=_totals(s, cost, layout, share, bins), proven=[p for _, p in packed])


def _matrices(s: np.ndarray, cost: CostModel, layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Time and memory of every sequence on every replica (k x R), and each replica's overhead."""
    deg = np.asarray([int(d) for d in layout], dtype=np.int64)
    T = np.empty((s.size, deg.size))
    M = np.empty((s.size, deg.size))
    over = np.empty(deg.size)
    for d in np.unique(deg):
        cols = deg == d
        T[:, cols] = cost.time(s, int(d))[:, None]
        M[:, cols] = cost.memory(s, int(d))[:, None]
        over[cols] = cost.group_overhead_ms(int(d))
    return T, M, over


def _improve(s: np.ndarray, cost: CostModel, c: _Candidate, deadline: float, opts: PlanOptions, clock: Effort,
             max_moves: int = 100) -> tuple[_Candidate, int, bool]:
    """Local search after packing: move one sequence off the slowest replica to the replica where
    the pair ends lowest, while that lowers the slowest replica. Packings change incrementally
    (the sequence leaves its micro-batch; it joins the fullest micro-batch of the target that has
    room, or a new one), so a move never adds a micro-batch it does not need. Returns the improved
    candidate, the number of moves, and whether the deadline stopped it."""
    budget = cost.memory_budget_gb * (1 + _TOL)
    layout = c.layout
    R = len(layout)
    T, M, over = _matrices(s, cost, layout)
    fits = M <= budget
    bins = [[list(b) for b in c.bins[r]] for r in range(R)]
    room = [[budget - float(M[b, r].sum()) for b in bins[r]] for r in range(R)]
    where = {i: (r, k) for r in range(R) for k, b in enumerate(bins[r]) for i in b}
    maxroom = np.array([max(room[r], default=-np.inf) for r in range(R)])
    totals = c.totals.copy()
    moves, cut = 0, False
    while moves < max_moves:
        if clock.past(deadline):
            cut = True
            break
        opts.check_cancel()
        clock.tick(elements=50 * sum(len(b) for b in bins[int(np.argmax(totals))]) * R, steps=130)
        r = int(np.argmax(totals))
        top = totals[r]
        best = None  # (pair max, new_q, i, q)
        for b in bins[r]:
            for i in b:
                new_r = top - T[i, r] - (over[r] if len(b) == 1 else 0.0)
                new_q = totals + T[i] + over * (maxroom < M[i])
                pair = np.where(fits[i], np.maximum(new_r, new_q), np.inf)
                pair[r] = np.inf
                q = int(np.argmin(pair))
                if pair[q] < top - 1e-9 and (best is None or (pair[q], new_q[q], i) < best[:3]):
                    best = (float(pair[q]), float(new_q[q]), i, q)
        if best is None:
            break
        _, _, i, q = best
        rr, k = where.pop(i)
        bins[rr][k].remove(i)
        room[rr][k] += M[i, rr]
        if not bins[rr][k]:
            del bins[rr][k], room[rr][k]
            where.update({j: (rr, kk) for kk, bb in enumerate(bins[rr]) for j in bb})
        ok = [kk for kk, x in enumerate(room[q]) if x >= M[i, q]]
        if ok:
            kk = min(ok, key=lambda kk: (room[q][kk], kk))
            bins[q][kk].append(i)
            room[q][kk] -= M[i, q]
        else:
            kk = len(bins[q])
            bins[q].append([i])
            room[q].append(budget - M[i, q])
        where[i] = (q, kk)
        for x in (rr, q):
            maxroom[x] = max(room[x], default=-np.inf)
            totals[x] = sum(float(T[bb, x].sum()) for bb in bins[x]) + over[x] * len(bins[x])
        moves += 1
    if not moves:
        return c, 0, cut
    share = [sorted((i for bb in bins[r] for i in bb), key=lambda i: (-s[i], i)) for r in range(R)]
    proven = [len(bins[r]) <= microbatch_lower_bound(M[share[r], r], cost.memory_budget_gb) if share[r] else True
              for r in range(R)]
    return _Candidate(name=c.name, layout=layout, restart=c.restart, share=share, bins=bins, totals=totals,
                      proven=proven), moves, cut


def _key(c: _Candidate):
    return (round(c.makespan, 9), len(c.layout), c.restart)


def plan_two_stage(lengths, cost: CostModel, opts: PlanOptions) -> Plan:
    """Hydraulis-style two-stage plan (see the module docstring). ``plan.stats``: ``layout`` (name),
    ``degrees`` (replica degrees), ``layouts`` (how many were tried), ``restarts`` (dispatch passes
    run in all), ``best_restart`` (0: the deterministic pass), ``micro_batches`` (per replica),
    ``packing_proven`` (every replica's micro-batch count proven minimal), ``exact_packings``
    (replicas CP-SAT improved), ``moves`` (local-search moves off the slowest replica), ``truncated``
    (the effort budget cut the search short), ``candidates`` (the best makespan per layout tried, ms,
    without the gradient sync)."""
    try:  # import before the clock starts: the first import of OR-Tools takes about a second
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:  # pragma: no cover - best fit only
        pass
    opts, clock = opts.start()
    t0 = clock.now()
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    limit = max(0.0, float(opts.effort))
    deadline = t0 + limit
    layouts = candidate_layouts(s, cost)
    truncated = False
    runs = 0
    first: list[_Candidate] = []
    for li, (name, layout) in enumerate(layouts):
        opts.check_cancel()
        if li > 0 and clock.past(t0 + 0.6 * limit):
            truncated = True
            break
        first.append(_evaluate(s, cost, name, layout, 0, None, clock))
        runs += 1
        opts.report(0.6 * (li + 1) / len(layouts), f"two-stage: layout {name}: {first[-1].makespan:,.0f} ms")
    by_layout = {c.layout: c for c in first}
    order = sorted(first, key=_key)
    short = order[:SHORTLIST]
    # randomised restarts of the dispatch on the best layouts
    for si, c0 in enumerate(short):
        li = next(i for i, (_, lay) in enumerate(layouts) if lay == c0.layout)
        for r in range(1, RESTARTS):
            opts.check_cancel()
            if clock.past(t0 + 0.85 * limit):
                truncated = True
                break
            rng = np.random.default_rng([int(opts.seed), li, r])
            c = _evaluate(s, cost, c0.name, c0.layout, r, rng, clock)
            runs += 1
            if _key(c) < _key(by_layout[c.layout]):
                by_layout[c.layout] = c
        opts.report(0.6 + 0.25 * (si + 1) / len(short), f"two-stage: restarts on {c0.name}")
    # local search, then exact packing where best fit may be above the minimum, on the shortlist
    finals: list[_Candidate] = []
    exact_done = 0
    moved = 0
    for c in sorted((by_layout[c.layout] for c in short), key=_key):
        opts.check_cancel()
        c, m, cut = _improve(s, cost, c, t0 + 0.95 * limit, opts, clock)
        moved += m
        truncated |= cut
        bins, proven, totals = list(c.bins), list(c.proven), c.totals.copy()
        tried: set[int] = set()
        while True:  # only the slowest replica matters: pack it exactly while that helps
            r = int(np.argmax(totals))
            if proven[r] or r in tried or len(c.share[r]) > EXACT_MAX_ITEMS or clock.past(deadline):
                break
            tried.add(r)
            b, p = _pack_share(s, cost, c.layout[r], c.share[r], exact=True, seed=opts.seed, clock=clock)
            if len(b) < len(bins[r]):
                exact_done += 1
                bins[r], proven[r] = b, p
            elif len(b) == len(bins[r]):
                proven[r] = p
            totals = _totals(s, cost, c.layout, c.share, bins)
        finals.append(_Candidate(name=c.name, layout=c.layout, restart=c.restart, share=c.share, bins=bins,
                                 totals=totals, proven=proven))
    best = min(finals, key=_key)
    opts.report(0.95, f"two-stage: best layout {best.name}")
    blocks_r = layout_blocks(best.layout)
    steps = max((len(b) for b in best.bins), default=0)
    micro, blocks = [], []
    for m in range(steps):
        groups, blk = [], []
        for r, d in enumerate(best.layout):
            if m < len(best.bins[r]):
                groups.append((d, best.bins[r][m]))
                blk.append(blocks_r[r])
        micro.append(groups)
        blocks.append(blk)
    for c in finals:
        by_layout[c.layout] = c
    stats = {
        "layout": best.name,
        "degrees": list(best.layout),
        "layouts": len(first),
        "restarts": runs,
        "best_restart": best.restart,
        "micro_batches": [len(b) for b in best.bins],
        "packing_proven": bool(all(best.proven)),
        "exact_packings": exact_done,
        "moves": moved,
        "truncated": truncated,
        "candidates": {c.name: round(c.makespan, 3) for c in sorted(by_layout.values(), key=_key)},
    }
    return build_plan("two-stage", micro, s, cost, blocks=blocks, stats=stats)


def _register() -> None:
    from workbench.solve import register_planner

    register_planner("two-stage", plan_two_stage)


_register()
