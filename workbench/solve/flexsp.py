"""The FlexSP planner: heterogeneous SP groups per micro-step, chosen by OR-Tools CP-SAT.

For one micro-step the problem is (DESIGN.md, "The solver, precisely")::

    choose a multiset of groups (degree d from cost.degrees, sum of degrees <= N GPUs),
    assign every sequence to exactly one group (degree >= its memory minimum),
    minimise T  s.t.  overhead(d) + sum_i time(s_i, d) <= T   for every group,
                      sum_i memory(s_i, d) <= memory budget    for every group.

With power-of-two degrees any multiset whose degrees sum to at most N packs into aligned blocks,
so the model never needs rank positions; ``build_plan`` places the groups (larger first).

How a step is planned (``plan_flexsp``):

1. Baselines: ``plan_greedy`` and ``plan_best_static`` (the answer is never worse than either).
2. Micro-steps: the fewest ``M_min`` whose GPU memory holds the batch (sum over sequences of their
   smallest per-GPU memory share x degree, over N x budget), then ``M_min + 1``...: sequences go,
   heaviest first, to the micro-step with the least work that has memory room (balancing long
   sequences across micro-steps).
3. Per micro-step, a fast heuristic: every sequence on its smallest degree; the bottleneck
   sequences are raised to larger degrees while that lowers the divisible estimate of T; the
   number of groups per degree comes from a binary search on T; longest-processing-time packing
   within each degree under memory; then refinement with exact lengths (moves of a sequence out of
   the slowest group to any group, or a new group on free GPUs, and swaps).
4. CP-SAT on the micro-steps furthest above their own lower bound, warm-started (AddHint) from the
   heuristic. Items are single sequences, or for large steps length buckets (a dynamic programme
   minimising padding, FlexSP's 16 buckets) plus the longest sequences one by one; variables are
   the item counts per candidate group ``x[item, group]`` (integer), group activity ``a[group]``
   (bool) and T. Times are integer-scaled (the slowest group is ~1e8 units with exact items) and
   memory is scaled to 1e9 units per budget. Symmetry between groups of one degree is broken by
   non-increasing activity and load. The answer is mapped back to sequences, refined with exact
   lengths and kept when it beats the heuristic. Large clusters are split into parts of 64 GPUs
   solved one by one (sequences spread across parts by work), then refined as a whole.

CP-SAT runs with ``num_workers`` <= 2 (``CPSAT_WORKERS``): the planning machines are small and
shared, and notebook panels call planners from background threads. With a time limit the search is
not bit-for-bit repeatable across machines; ``random_seed`` is ``opts.seed``.

Pure numpy + OR-Tools; no torch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from workbench.cost import CostModel
from workbench.solve.baselines import plan_best_static, plan_greedy
from workbench.solve.options import Cancelled, PlanOptions
from workbench.solve.plan import Plan, build_plan, lower_bound_ms

__all__ = ["plan_flexsp", "solve_one_step", "bucketize", "StepResult", "CPSAT_WORKERS"]

CPSAT_WORKERS = 2
"""CP-SAT search workers (at most 2: small shared machines, planners on background threads)."""

AUTO_BUCKET_ABOVE = 40
"""With ``bucketing=None`` a micro-step with more sequences than this is bucketed."""

SINGLE_ITEMS = 16
"""With bucketing, this many of the longest sequences stay items of their own."""

CPSAT_SHARE = 0.5
"""Share of the time left after the heuristics that CP-SAT gets (the rest: timeline refinement)."""

PART_GPUS = 64
"""Clusters larger than this are solved in parts of this many GPUs (then refined as a whole)."""

_EPS = 1e-9


# ------------------------------------------------------------------------------------------------
# cost tables
# ------------------------------------------------------------------------------------------------


class _Table:
    """Per sequence and candidate degree: time, memory, whether it fits; per degree: overhead."""

    def __init__(self, s: np.ndarray, cost: CostModel):
        n_gpus = cost.cluster.num_gpus
        self.s = s
        self.n_gpus = n_gpus
        self.deg = np.array([d for d in cost.degrees if d <= n_gpus], dtype=np.int64)
        self.t = np.stack([cost.time(s, int(d)) for d in self.deg])  # (D, n) ms
        self.mem = np.stack([cost.memory(s, int(d)) for d in self.deg])  # (D, n) GB per GPU
        self.budget = float(cost.memory_budget_gb)
        self.ok = self.mem <= self.budget
        self.over = np.array([cost.group_overhead_ms(int(d)) for d in self.deg], dtype=np.float64)
        work = np.where(self.ok, self.t * self.deg[:, None], np.inf)
        self.best_work = work.min(axis=0)
        single = np.where(self.ok, self.t + self.over[:, None], np.inf)
        self.best_single = single.min(axis=0)
        self.dmin = np.argmax(self.ok, axis=0)  # first degree index that holds each sequence
        share = np.where(self.ok, self.mem * self.deg[:, None], np.inf)
        self.share = share.min(axis=0)  # GB-GPUs of memory a sequence needs at least

    def step_lower_bound(self, idx: np.ndarray) -> float:
        """A bound no one-micro-step plan of ``idx`` beats: every used GPU pays a group overhead,
        so T >= min overhead + work / N; and T >= the slowest single sequence at its best."""
        if idx.size == 0:
            return 0.0
        return max(float(self.best_single[idx].max()),
                   float(self.over.min()) + float(self.best_work[idx].sum()) / self.n_gpus)


def _loads(groups, tab: _Table) -> np.ndarray:
    return np.array([tab.over[e] + tab.t[e, m].sum() for e, m in groups], dtype=np.float64)


def _makespan(groups, tab: _Table) -> float:
    return float(_loads(groups, tab).max()) if groups else 0.0


# ------------------------------------------------------------------------------------------------
# heuristic for one micro-step
# ------------------------------------------------------------------------------------------------


def _balance(tab: _Table, idx: np.ndarray, di: np.ndarray, n_gpus: int):
    """Divisible estimate for degrees ``di``: the least T with enough groups per degree, and the
    group counts. Returns (inf, None) when memory cannot hold the sequences in one micro-step."""
    D = tab.deg.size
    tt = tab.t[di, idx]
    W = np.bincount(di, weights=tt, minlength=D)
    Mem = np.bincount(di, weights=tab.mem[di, idx], minlength=D)
    cnt = np.bincount(di, minlength=D)
    kmin = np.where(cnt > 0, np.maximum(1, np.ceil(Mem / tab.budget - 1e-9)), 0)
    if float((tab.deg * kmin).sum()) > n_gpus:
        # memory-tight: the largest degrees keep their groups, the smallest get what is left and
        # ``_pack`` spills the rest into the other groups' spare memory
        k = kmin.astype(np.int64).copy()
        for e in range(D):
            if k[e] == 0:
                continue
            rest = int((tab.deg[e + 1:] * k[e + 1:]).sum())
            k[e] = max(0, min(k[e], (n_gpus - rest - int((tab.deg[:e] * k[:e]).sum())) // int(tab.deg[e])))
        return math.inf, k
    over = tab.over

    def k_of(T):
        k = np.ceil(W / np.maximum(T - over, 1e-12) - 1e-12)
        return np.where(cnt > 0, np.minimum(cnt, np.maximum(kmin, k)), 0)

    lo = float((tt + over[di]).max())
    if float((tab.deg * k_of(lo)).sum()) <= n_gpus:
        return lo, k_of(lo).astype(np.int64)
    hi = lo * 2
    while float((tab.deg * k_of(hi)).sum()) > n_gpus:
        hi *= 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float((tab.deg * k_of(mid)).sum()) <= n_gpus:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-7 * hi:
            break
    return hi, k_of(hi).astype(np.int64)


def _pack_lpt(tab: _Table, idx: np.ndarray, di: np.ndarray, k: np.ndarray, n_gpus: int, by_memory=False):
    """Longest-processing-time packing within each degree, under memory (``by_memory``: largest
    memory first, each to the least-loaded group with room). None if it cannot."""
    groups = []
    used = int((tab.deg * k).sum())
    for e in range(tab.deg.size):
        sel = idx[di == e]
        if sel.size == 0:
            continue
        kk = int(k[e])
        load = np.full(kk, tab.over[e])
        memload = np.zeros(kk)
        members: list[list[int]] = [[] for _ in range(kk)]
        order = sel[np.argsort(-(tab.mem[e, sel] if by_memory else tab.t[e, sel]), kind="stable")]
        for i in order:
            m, t = tab.mem[e, i], tab.t[e, i]
            room = memload + m <= tab.budget * (1 + 1e-12)
            if not room.any():
                if used + tab.deg[e] > n_gpus:
                    return None
                used += int(tab.deg[e])
                load = np.append(load, tab.over[e])
                memload = np.append(memload, 0.0)
                members.append([])
                room = np.zeros(load.size, dtype=bool)
                room[-1] = True
            g = int(np.flatnonzero(room)[np.argmin(load[room])])
            members[g].append(int(i))
            load[g] += t
            memload[g] += m
        groups.extend((e, mm) for mm in members if mm)
    return groups


def _pack_tight(tab: _Table, idx: np.ndarray, di: np.ndarray, k: np.ndarray, n_gpus: int):
    """Packing when memory binds: largest degrees first, ``k[e]`` groups of each, sequences by
    memory (largest first) to the least-loaded group of their degree with room; a sequence that
    fits none spills into the least-loaded group of a larger degree with room, or opens a group on
    free GPUs. None if it cannot."""
    gd: list[int] = []
    load: list[float] = []
    mload: list[float] = []
    members: list[list[int]] = []
    used = 0
    budget = tab.budget * (1 + 1e-12)
    for e in range(tab.deg.size - 1, -1, -1):
        sel = idx[di == e]
        if sel.size == 0:
            continue
        first = len(gd)
        for _ in range(min(int(k[e]), (n_gpus - used) // int(tab.deg[e]))):
            gd.append(e), load.append(float(tab.over[e])), mload.append(0.0), members.append([])
        used += int(tab.deg[e]) * (len(gd) - first)
        for i in sel[np.argsort(-tab.mem[e, sel], kind="stable")]:
            L = np.asarray(load)
            ge = np.asarray(gd, dtype=np.int64)
            fits = tab.ok[ge, i] & (np.asarray(mload) + tab.mem[ge, i] <= budget) if gd else np.zeros(0, bool)
            own = fits.copy()
            own[:first] = False
            if own.any():
                c = np.flatnonzero(own)
                g = int(c[np.argmin(L[c])])
            elif fits.any():
                c = np.flatnonzero(fits)
                g = int(c[np.argmin(L[c] + tab.t[ge[c], i])])
            else:
                opened = False
                for e2 in range(e, tab.deg.size):
                    if used + int(tab.deg[e2]) <= n_gpus and tab.ok[e2, i]:
                        gd.append(e2), load.append(float(tab.over[e2])), mload.append(0.0), members.append([])
                        used += int(tab.deg[e2])
                        g, opened = len(gd) - 1, True
                        break
                if not opened:
                    return None
            members[g].append(int(i))
            load[g] += float(tab.t[gd[g], i])
            mload[g] += float(tab.mem[gd[g], i])
    return [(e, m) for e, m in zip(gd, members) if m]


def _pack(tab: _Table, idx: np.ndarray, di: np.ndarray, k: np.ndarray, n_gpus: int):
    """LPT packing (``_pack_lpt``); where memory fragments, first-fit decreasing on memory."""
    g = _pack_lpt(tab, idx, di, k, n_gpus)
    if g is not None:
        return g
    g = _pack_lpt(tab, idx, di, k, n_gpus, by_memory=True)
    if g is not None:
        return g
    return _pack_tight(tab, idx, di, k, n_gpus)


def _heuristic_step(tab: _Table, idx: np.ndarray, n_gpus: int):
    """Degrees by bottleneck raising, group counts by the divisible estimate, LPT packing. When
    memory fragments so that this packs nothing, the sequences above each degree level are raised
    to it (fewer, larger groups share their spare memory) and the best packing wins. None if none
    packs."""
    g = _heuristic_step_at(tab, idx, n_gpus, tab.dmin[idx].copy())
    if g is not None:
        return g
    best, best_ms = None, math.inf
    big = tab.dmin[idx] > 0
    for e in range(1, tab.deg.size):
        for di in (np.where(big, np.maximum(tab.dmin[idx], e), tab.dmin[idx]), np.maximum(tab.dmin[idx], e)):
            g = _heuristic_step_at(tab, idx, n_gpus, di)
            if g is not None:
                ms = _makespan(g, tab)
                if ms < best_ms:
                    best, best_ms = g, ms
        if best is not None:
            break
    return best


def _heuristic_step_at(tab: _Table, idx: np.ndarray, n_gpus: int, di: np.ndarray):
    D = tab.deg.size
    T, k = _balance(tab, idx, di, n_gpus)
    if k is None:
        return None
    if not math.isfinite(T):
        return _pack_tight(tab, idx, di, k, n_gpus)
    history = [(di, k)]
    for _ in range(4 * idx.size + 8):
        single = tab.t[di, idx] + tab.over[di]
        top = np.argsort(-single, kind="stable")[:8]
        improved = False
        tries = [np.flatnonzero(single >= T * (1 - 1e-9))] + [np.array([j]) for j in top]
        for js in tries:
            js = js[di[js] + 1 < D]
            if js.size == 0:
                continue
            di2 = di.copy()
            di2[js] += 1
            T2, k2 = _balance(tab, idx, di2, n_gpus)
            if T2 < T * (1 - 1e-9):
                di, T, k, improved = di2, T2, k2, True
                history.append((di, k))
                break
        if not improved:
            break
    # the last degree choice whose groups pack under memory (more groups fragment memory more)
    for di, k in reversed(history):
        groups = _pack(tab, idx, di, k, n_gpus)
        if groups is not None:
            return groups
    return None


# ------------------------------------------------------------------------------------------------
# refinement with exact lengths
# ------------------------------------------------------------------------------------------------


def _best_swap(tab: _Table, e0: int, mi: np.ndarray, keep: np.ndarray, mload_gs: float, eh: int, members_h,
               finish_h: float, mload_h: float, budget: float) -> tuple[float, int, int]:
    """The best swap of an item of the slowest group (degree index e0, items ``mi``; ``keep[i]`` its
    finish without item i) with an item of group h (degree index eh, finishing at ``finish_h``):
    ``(later of the two finishes, i, j)``, inf when no swap fits memory."""
    mj = np.asarray(members_h, dtype=np.int64)
    a = keep[:, None] + tab.t[e0, mj][None, :]  # the slowest group after the swap
    b = finish_h - tab.t[eh, mj][None, :] + tab.t[eh, mi][:, None]  # h after the swap
    ok = (tab.ok[eh, mi][:, None] & tab.ok[e0, mj][None, :]
          & (mload_gs - tab.mem[e0, mi][:, None] + tab.mem[e0, mj][None, :] <= budget)
          & (mload_h - tab.mem[eh, mj][None, :] + tab.mem[eh, mi][:, None] <= budget))
    v = np.where(ok, np.maximum(a, b), np.inf)
    i, j = np.unravel_index(int(np.argmin(v)), v.shape)
    return float(v[i, j]), int(i), int(j)


def _refine(groups, tab: _Table, n_gpus: int, deadline: float, max_iter: int = 10_000, swap_groups: int = 48):
    """Moves and swaps that lower the slowest group, until none does (or the deadline)."""
    if not groups:
        return groups
    gd = [int(e) for e, _ in groups]
    members = [list(m) for _, m in groups]
    load = [float(tab.over[e] + tab.t[e, m].sum()) for e, m in zip(gd, members)]
    mload = [float(tab.mem[e, m].sum()) for e, m in zip(gd, members)]
    budget = tab.budget * (1 + 1e-12)
    D = tab.deg.size
    for it in range(max_iter):
        if it % 16 == 0 and time.perf_counter() > deadline:
            break
        L_arr = np.asarray(load)
        gs = int(np.argmax(L_arr))
        L = float(L_arr[gs])
        eps = L * 1e-9
        free = n_gpus - int(sum(int(tab.deg[e]) for e in gd))
        mi = np.asarray(members[gs], dtype=np.int64)
        e0 = gd[gs]
        t_out = tab.t[e0, mi]
        keep = L - t_out  # load of gs after removing each item
        # moves into existing groups
        ge = np.asarray(gd)
        tt = tab.t[ge[:, None], mi[None, :]]  # (groups, items of gs)
        new_h = L_arr[:, None] + tt
        okm = tab.ok[ge[:, None], mi[None, :]] & (np.asarray(mload)[:, None] + tab.mem[ge[:, None], mi[None, :]] <= budget)
        okm[gs, :] = False
        cand = np.where(okm, np.maximum(keep[None, :], new_h), np.inf)
        best_val, best = math.inf, None
        if cand.size:
            h, j = np.unravel_index(int(np.argmin(cand)), cand.shape)
            best_val, best = float(cand[h, j]), ("move", int(h), int(j))
        # moves into a new group on free GPUs
        for e in range(D):
            if tab.deg[e] > free:
                break
            nv = np.where(tab.ok[e, mi], np.maximum(keep, tab.over[e] + tab.t[e, mi]), np.inf)
            j = int(np.argmin(nv))
            if nv[j] < best_val:
                best_val, best = float(nv[j]), ("new", e, j)
        if best is None or best_val >= L - eps:
            # swaps with the least-loaded groups
            best_val, best = math.inf, None
            order = np.argsort(L_arr, kind="stable")[: swap_groups + 1]
            for h in order:
                h = int(h)
                if h == gs:
                    continue
                val, i, j = _best_swap(tab, e0, mi, keep, mload[gs], gd[h], members[h], load[h], mload[h], budget)
                if val < best_val:
                    best_val, best = val, ("swap", h, i, j)
            if best is None or best_val >= L - eps:
                break
        kind = best[0]
        if kind == "move":
            _, h, j = best
            i = int(mi[j])
            members[gs].remove(i)
            members[h].append(i)
            load[h] += float(tab.t[gd[h], i])
            mload[h] += float(tab.mem[gd[h], i])
        elif kind == "new":
            _, e, j = best
            i = int(mi[j])
            members[gs].remove(i)
            gd.append(int(e))
            members.append([i])
            load.append(float(tab.over[e] + tab.t[e, i]))
            mload.append(float(tab.mem[e, i]))
        else:
            _, h, j, jj = best
            i = int(mi[j])
            k = int(members[h][jj])
            members[gs].remove(i)
            members[h].remove(k)
            members[gs].append(k)
            members[h].append(i)
            load[h] = float(tab.over[gd[h]] + tab.t[gd[h], members[h]].sum())
            mload[h] = float(tab.mem[gd[h], members[h]].sum())
        if members[gs]:
            load[gs] = float(tab.over[e0] + tab.t[e0, members[gs]].sum())
            mload[gs] = float(tab.mem[e0, members[gs]].sum())
        else:
            del gd[gs], members[gs], load[gs], mload[gs]
    return [(e, m) for e, m in zip(gd, members) if m]


# ------------------------------------------------------------------------------------------------
# bucketing
# ------------------------------------------------------------------------------------------------


def bucketize(lengths, buckets: int = 16, atoms: int = 512) -> np.ndarray:
    """Bucket id (0 = shortest) of each length, by a dynamic programme over sorted lengths that
    minimises the padding (sum over sequences of their bucket's maximum minus their length).
    Boundaries are restricted to ``atoms`` quantile positions when there are more distinct lengths.
    Returns an int array aligned with ``lengths``."""
    s = np.asarray(lengths, dtype=np.int64)
    if s.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(s, kind="stable")
    srt = s[order]
    # atoms: runs of equal lengths, merged down to at most `atoms` contiguous runs
    ends = np.flatnonzero(np.diff(srt)) + 1
    ends = np.append(ends, srt.size)  # exclusive end of each run of equal values
    if ends.size > atoms:
        pick = np.unique(np.linspace(0, ends.size - 1, atoms).round().astype(np.int64))
        ends = ends[pick]
    U = ends.size
    B = max(1, min(int(buckets), U))
    cnt = np.concatenate([[0], ends]).astype(np.float64)  # prefix counts at atom boundaries
    pre = np.concatenate([[0.0], np.cumsum(srt, dtype=np.float64)])
    S = pre[np.concatenate([[0], ends])]
    top = srt[ends - 1].astype(np.float64)  # max of the run ending at each atom
    # cost[i, j]: one bucket over atoms i..j (inclusive)
    ii = np.arange(U)[:, None]
    jj = np.arange(U)[None, :]
    cost = np.where(jj >= ii, top[None, :] * (cnt[1:][None, :] - cnt[:-1][:, None]) - (S[1:][None, :] - S[:-1][:, None]),
                    np.inf)
    # dp[j]: least padding of atoms 0..j with at most b buckets; start[b][j]: first atom of the last
    dp = np.full(U, np.inf)
    start = []
    for _ in range(B):
        prev = np.concatenate([[0.0], dp[:-1]])  # padding before a last bucket starting at atom st
        cand = prev[:, None] + cost
        st = np.argmin(cand, axis=0)
        dp = cand[st, np.arange(U)]
        start.append(st)
    starts = []
    j, b = U - 1, B - 1
    while j >= 0:
        st = int(start[b][j])
        starts.append(st)
        j, b = st - 1, b - 1
    starts = sorted(starts)
    bid_atom = np.zeros(U, dtype=np.int64)
    for k, st in enumerate(starts):
        bid_atom[st:] = k
    atom_of = np.searchsorted(ends, np.arange(srt.size), side="right")
    out = np.empty(s.size, dtype=np.int64)
    out[order] = bid_atom[atom_of]
    return out


# ------------------------------------------------------------------------------------------------
# CP-SAT
# ------------------------------------------------------------------------------------------------


@dataclass
class _Items:
    """What the CP-SAT model assigns: single sequences, or buckets of sequences with a count."""

    seqs: list[np.ndarray]  # sequence indices of each item
    t: np.ndarray  # (D, I) time of one sequence of the item (mean over the item)
    mem: np.ndarray  # (D, I) memory of one sequence of the item (max over the item)
    ok: np.ndarray  # (D, I)
    cnt: np.ndarray  # (I,)
    exact: bool


def _make_items(tab: _Table, idx: np.ndarray, bucketed: bool, buckets: int) -> _Items:
    if not bucketed:
        seqs = [np.array([i]) for i in idx]
    else:
        order = idx[np.argsort(-tab.s[idx], kind="stable")]
        singles = order[:SINGLE_ITEMS]
        rest = order[SINGLE_ITEMS:]
        seqs = [np.array([i]) for i in singles]
        if rest.size:
            bid = bucketize(tab.s[rest], buckets)
            for b in np.unique(bid):
                seqs.append(rest[bid == b])
    t = np.stack([tab.t[:, q].mean(axis=1) for q in seqs], axis=1)
    mem = np.stack([tab.mem[:, q].max(axis=1) for q in seqs], axis=1)
    ok = mem <= tab.budget
    cnt = np.array([q.size for q in seqs], dtype=np.int64)
    return _Items(seqs=seqs, t=t, mem=mem, ok=ok, cnt=cnt, exact=not bucketed)


class _Stopper:
    """CP-SAT solution callback: cancellation, progress."""

    def __new__(cls, *a, **k):
        from ortools.sat.python import cp_model

        class _CB(cp_model.CpSolverSolutionCallback):
            def __init__(self, opts: PlanOptions | None, note):
                super().__init__()
                self.opts = opts
                self.note = note
                self.cancelled = False
                self.solutions = 0

            def on_solution_callback(self):
                self.solutions += 1
                if self.opts is not None and self.opts.cancel is not None and self.opts.cancel.is_set():
                    self.cancelled = True
                    self.stop_search()

        return _CB(*a, **k)


def _cpsat(tab: _Table, items: _Items, n_gpus: int, hint_groups, *, time_limit: float, seed: int,
           opts: PlanOptions | None, group_caps=None, workers: int = CPSAT_WORKERS):
    """Solve the one-micro-step model over ``items``; returns (groups as (degree index, counts per
    item), info). groups is None when no solution was found."""
    from ortools.sat.python import cp_model

    D, n_items = items.t.shape
    deg = tab.deg
    # scale: the hint's (or a crude) makespan maps to ~1e8 units with exact items
    if hint_groups:
        ub = max(float(tab.over[e] + (items.t[e] * c).sum()) for e, c in hint_groups)
    else:  # any plan's slowest group is at most everything at its slowest allowed degree
        ub = float(tab.over.max() + (np.where(items.ok, items.t, 0.0).max(axis=0) * items.cnt).sum())
    scale = (1e8 if items.exact else 1e5) / max(ub, 1e-9)
    tint = np.rint(items.t * scale).astype(np.int64)
    cint = np.rint(tab.over * scale).astype(np.int64)
    MEMCAP = 1_000_000_000
    mint = np.rint(items.mem / tab.budget * MEMCAP).astype(np.int64)
    t_build = time.perf_counter()
    m = cp_model.CpModel()
    # candidate groups per degree
    slots = []  # (e, a, {item: var}, load expr)
    hint_by_e: dict[int, list] = {}
    for e, c in hint_groups or []:
        hint_by_e.setdefault(e, []).append(c)
    n_vars = 0
    T_ub = int(max(1, math.ceil(ub * scale))) + int(items.cnt.sum()) + 1
    T = m.NewIntVar(0, T_ub, "T")
    lb = tab.step_lower_bound(np.concatenate(items.seqs)) * (1.0 if items.exact else 0.999)
    if lb > 0:
        m.Add(T >= int(math.floor(lb * scale * (1 - 1e-7))) - int(items.cnt.sum()))
    per_item: list[list] = [[] for _ in range(n_items)]
    hint_vals = []
    for e in range(D):
        allowed = np.flatnonzero(items.ok[e])
        if allowed.size == 0:
            continue
        G = min(n_gpus // int(deg[e]), int(items.cnt[allowed].sum()))
        if group_caps is not None:
            G = min(G, int(group_caps[e]))
        hints = sorted(hint_by_e.get(e, []), key=lambda c: -float((items.t[e] * c).sum()))
        G = max(G, min(len(hints), n_gpus // int(deg[e])))
        prev = None
        for g in range(G):
            a = m.NewBoolVar(f"a{e}_{g}")
            xs = {}
            for b in allowed:
                cap = int(items.cnt[b])
                if cap == 1:
                    v = m.NewBoolVar(f"x{e}_{g}_{b}")
                else:
                    v = m.NewIntVar(0, cap, f"x{e}_{g}_{b}")
                xs[int(b)] = v
                per_item[b].append(v)
            n_vars += 1 + len(xs)
            vs = list(xs.values())
            bs = list(xs.keys())
            load = cp_model.LinearExpr.WeightedSum([a, *vs], [int(cint[e]), *(int(tint[e, b]) for b in bs)])
            m.Add(load <= T)
            m.Add(cp_model.LinearExpr.WeightedSum([*vs, a], [*(int(mint[e, b]) for b in bs), -MEMCAP]) <= 0)
            if prev is not None:
                m.Add(prev[0] >= a)
                m.Add(prev[1] >= load)
            prev = (a, load)
            hc = hints[g] if g < len(hints) else None
            hint_vals.append((a, 1 if hc is not None else 0))
            for b, v in xs.items():
                hint_vals.append((v, int(hc[b]) if hc is not None else 0))
            slots.append((e, a, xs))
    for b in range(n_items):
        m.Add(cp_model.LinearExpr.Sum(per_item[b]) == int(items.cnt[b]))
    m.Add(cp_model.LinearExpr.WeightedSum([a for _, a, _ in slots], [int(deg[e]) for e, _, _ in slots]) <= n_gpus)
    if hint_groups:
        for v, val in hint_vals:
            m.AddHint(v, val)
    m.Minimize(T)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, float(time_limit))
    solver.parameters.num_workers = max(1, min(2, int(workers)))
    solver.parameters.random_seed = int(seed) % (2**31)
    cb = _Stopper(opts, None)
    build_s = time.perf_counter() - t_build
    if float(time_limit) - build_s < 0.01:
        return None, {"cp_sat_status": "skipped (no time left after building the model)", "variables": n_vars,
                      "wall_s": 0.0, "build_s": build_s, "items": n_items}
    solver.parameters.max_time_in_seconds = float(time_limit) - build_s
    status = solver.Solve(m, cb)
    info = {"cp_sat_status": solver.StatusName(status), "variables": n_vars, "wall_s": solver.WallTime(),
            "build_s": build_s, "items": n_items}
    if cb.cancelled:
        raise Cancelled("planning was cancelled")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, info
    info["objective_ms"] = solver.ObjectiveValue() / scale
    info["bound_ms"] = solver.BestObjectiveBound() / scale
    out = []
    for e, a, xs in slots:
        if not solver.Value(a):
            continue
        c = np.zeros(n_items, dtype=np.int64)
        for b, v in xs.items():
            c[b] = solver.Value(v)
        if c.any():
            out.append((e, c))
    return out, info


def _groups_to_counts(groups, items: _Items, tab: _Table):
    """Express sequence groups as item counts (for the hint)."""
    where = {}
    for k, q in enumerate(items.seqs):
        for i in q:
            where[int(i)] = k
    out = []
    for e, mem in groups:
        c = np.zeros(len(items.seqs), dtype=np.int64)
        for i in mem:
            c[where[int(i)]] += 1
        out.append((e, c))
    # the hint must respect the item's (max-length) memory; drop it otherwise
    for e, c in out:
        if (items.mem[e] * c).sum() > tab.budget * (1 + 1e-9) or (c > 0)[~items.ok[e]].any():
            return None
    return out


def _counts_to_groups(counts, items: _Items, tab: _Table):
    """Hand each item's sequences to the groups that got counts of it, longest first to the group
    with the least actual load so far."""
    load = np.array([tab.over[e] for e, _ in counts], dtype=np.float64)
    members: list[list[int]] = [[] for _ in counts]
    order = np.argsort([-float(tab.s[q].max()) for q in items.seqs], kind="stable")
    for b in order:
        q = items.seqs[b]
        q = q[np.argsort(-tab.s[q], kind="stable")]
        left = np.array([int(c[b]) for _, c in counts])
        for i in q:
            cand = np.flatnonzero(left > 0)
            g = int(cand[np.argmin(load[cand])])
            members[g].append(int(i))
            load[g] += tab.t[counts[g][0], i]
            left[g] -= 1
    return [(e, mm) for (e, _), mm in zip(counts, members) if mm]


# ------------------------------------------------------------------------------------------------
# one micro-step
# ------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """One micro-step's groups ``[(degree, [sequence index, ...])]`` and how they were found."""

    groups: list
    makespan_ms: float
    lower_bound_ms: float
    proved: bool
    info: dict = field(default_factory=dict)


def _split_parts(tab: _Table, idx: np.ndarray, parts: int) -> list[np.ndarray]:
    """Spread a micro-step's sequences over ``parts`` equal sub-clusters: heaviest first to the
    part with the least work among those with memory room."""
    work = np.zeros(parts)
    memw = np.zeros(parts)
    cap = tab.budget * tab.n_gpus / parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in idx[np.argsort(-tab.best_work[idx], kind="stable")]:
        room = memw + tab.share[i] <= cap
        cand = np.flatnonzero(room) if room.any() else np.arange(parts)
        p = int(cand[np.argmin(work[cand])]) if room.any() else int(np.argmin(memw))
        out[p].append(int(i))
        work[p] += tab.best_work[i]
        memw[p] += tab.share[i]
    return [np.array(o, dtype=np.int64) for o in out if o]


def _solve_step(tab: _Table, idx: np.ndarray, *, bucketing, buckets: int, time_limit: float, seed: int,
                opts: PlanOptions | None, use_cpsat: bool = True, heuristic=None) -> StepResult | None:
    """Plan one micro-step of sequences ``idx`` on all the cluster's GPUs."""
    t0 = time.perf_counter()
    deadline = t0 + max(0.0, time_limit)
    n = tab.n_gpus
    lb = tab.step_lower_bound(idx)
    info: dict = {"sequences": int(idx.size)}
    if heuristic is None:
        if n > PART_GPUS and n % PART_GPUS == 0 and int(tab.deg.max()) <= PART_GPUS:
            parts = _split_parts(tab, idx, n // PART_GPUS)
            sub = _Table.__new__(_Table)
            sub.__dict__.update(tab.__dict__)
            sub.n_gpus = PART_GPUS
            groups = []
            for q in parts:
                g = _heuristic_step(sub, q, PART_GPUS)
                if g is None:
                    groups = None
                    break
                groups.extend(_refine(g, sub, PART_GPUS, deadline))
            if groups is None:
                groups = _heuristic_step(tab, idx, n)
            info["parts"] = len(parts)
        else:
            groups = _heuristic_step(tab, idx, n)
        if groups is not None:
            groups = _refine(groups, tab, n, deadline)
    else:
        groups = heuristic
    if groups is None and not use_cpsat:
        return None
    best = _makespan(groups, tab) if groups is not None else math.inf
    info["heuristic_ms"] = best if groups is not None else None
    proved = best <= lb * (1 + 1e-9)
    info["cp_sat_status"] = "skipped (heuristic meets the bound)" if proved else "not run"
    remaining = deadline - time.perf_counter()
    if use_cpsat and not proved and (remaining > 0.02 or groups is None):
        bucketed = (idx.size > AUTO_BUCKET_ABOVE) if bucketing is None else bool(bucketing)
        items = _make_items(tab, idx, bucketed, buckets)
        hint = _groups_to_counts(groups, items, tab) if groups is not None else None
        remaining = max(remaining, 0.05)
        caps = None
        if bucketed and groups is not None:
            # the heuristic's group counts per degree, with room to spare, bound the model's size
            have = np.bincount([e for e, _ in groups], minlength=tab.deg.size)
            caps = np.maximum(2 * have + 2, 4)
        counts, ci = _cpsat(tab, items, n, hint, time_limit=remaining, seed=seed, opts=opts, group_caps=caps)
        info.update(ci)
        info["buckets"] = int(len(items.seqs) - min(SINGLE_ITEMS, idx.size)) if bucketed else 0
        if counts is not None:
            g2 = _counts_to_groups(counts, items, tab)
            if bucketed:
                g2 = _refine(g2, tab, n, time.perf_counter() + max(0.05, 0.2 * time_limit))
            ms2 = _makespan(g2, tab)
            info["cp_sat_ms"] = ms2
            if ms2 < best * (1 - 1e-12):
                groups, best = g2, ms2
            if items.exact and ci["cp_sat_status"] == "OPTIMAL":
                proved = True
                lb = max(lb, min(best, ci.get("bound_ms", 0.0)))
        elif items.exact and ci["cp_sat_status"] == "INFEASIBLE":
            info["infeasible"] = True
    if groups is None:
        info["solve_s"] = time.perf_counter() - t0
        return None
    info["solve_s"] = time.perf_counter() - t0
    return StepResult(groups=[(int(tab.deg[e]), sorted(int(i) for i in m)) for e, m in groups],
                      makespan_ms=best, lower_bound_ms=lb, proved=proved, info=info)


def solve_one_step(lengths, cost: CostModel, *, bucketing: bool | None = False, buckets: int = 16,
                   time_limit: float = 10.0, seed: int = 0, opts: PlanOptions | None = None) -> StepResult | None:
    """Plan all of ``lengths`` as one micro-step on the whole cluster: heuristic, then CP-SAT
    (items are single sequences unless ``bucketing``). Returns a StepResult (``groups`` as
    ``[(degree, [sequence index, ...])]``, the slowest group's time without gradient sync,
    ``proved`` when CP-SAT proved it optimal), or None when one micro-step cannot hold the batch."""
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    tab = _Table(s, cost)
    return _solve_step(tab, np.arange(s.size), bucketing=bucketing, buckets=buckets, time_limit=time_limit,
                       seed=seed, opts=opts)


# ------------------------------------------------------------------------------------------------
# micro-steps
# ------------------------------------------------------------------------------------------------


def min_micro_steps(tab: _Table) -> int:
    """The fewest micro-steps whose memory (N x budget each) holds every sequence's least share."""
    return max(1, int(math.ceil(float(tab.share.sum()) / (tab.n_gpus * tab.budget) - 1e-9)))


def _chunks(tab: _Table, M: int) -> list[np.ndarray]:
    """Split the batch into M micro-steps balancing work and memory together: sequences, largest
    first, each to the micro-step whose larger relative fill (work or memory) stays lowest, so long
    sequences spread across micro-steps and no micro-step runs out of memory first."""
    idx = np.arange(tab.s.size)
    if M == 1:
        return [idx]
    w = tab.best_work / max(float(tab.best_work.sum()) / M, 1e-12)
    m = tab.share / max(float(tab.share.sum()) / M, 1e-12)
    fw = np.zeros(M)
    fm = np.zeros(M)
    out: list[list[int]] = [[] for _ in range(M)]
    for i in idx[np.argsort(-np.maximum(w, m), kind="stable")]:
        c = int(np.argmin(np.maximum(fw + w[i], fm + m[i]) + 1e-3 * (fw + fm)))
        out[c].append(int(i))
        fw[c] += w[i]
        fm[c] += m[i]
    return [np.array(o, dtype=np.int64) for o in out if o]


# ------------------------------------------------------------------------------------------------
# improving a whole (multi-micro-step) plan on its timeline
# ------------------------------------------------------------------------------------------------


def _improve_timeline(plan: Plan, tab: _Table, deadline: float, max_iter: int = 20_000):
    """Local search on a plan's exact timeline (fixed blocks, no barrier between micro-steps).

    The group that ends last is always the last on its ranks, so taking a sequence out of it, or
    swapping one of its sequences for a shorter one, delays nothing else. A sequence moves to
    another group that is last on all its ranks (it ends later, still before the makespan), or to a
    new group on the aligned block that frees earliest; swaps go with such last groups. Groups left
    empty disappear (their overhead with them). Returns ``(micro_steps, blocks)`` for
    ``build_plan`` or None when nothing improved.
    """
    n = tab.n_gpus
    e_of = {int(d): e for e, d in enumerate(tab.deg)}
    gd: list[int] = []
    blk: list[int] = []
    members: list[list[int]] = []
    start: list[float] = []
    end: list[float] = []
    mload: list[float] = []
    stacks: list[list[int]] = [[] for _ in range(n)]
    ready = np.zeros(n)
    for ms in plan.micro_steps:
        for g in ms.groups:
            e = e_of[g.degree]
            lo = g.ranks[0]
            k = len(gd)
            gd.append(e), blk.append(lo // g.degree), members.append(list(g.sequences))
            st = float(ready[lo:lo + g.degree].max())
            dur = float(tab.over[e] + tab.t[e, list(g.sequences)].sum())
            start.append(st), end.append(st + dur), mload.append(float(tab.mem[e, list(g.sequences)].sum()))
            ready[lo:lo + g.degree] = st + dur
            for r in range(lo, lo + g.degree):
                stacks[r].append(k)
    alive = [True] * len(gd)
    budget = tab.budget * (1 + 1e-12)
    D = tab.deg.size
    improved = False

    def ranks(k):
        d = int(tab.deg[gd[k]])
        return range(blk[k] * d, (blk[k] + 1) * d)

    def is_last(k):
        return all(stacks[r][-1] == k for r in ranks(k))

    for it in range(max_iter):
        if it % 8 == 0 and time.perf_counter() > deadline:
            break
        live = [k for k in range(len(gd)) if alive[k]]
        E = np.array([end[k] for k in live])
        gs = live[int(np.argmax(E))]
        T = end[gs]
        eps = T * 1e-9
        mi = np.asarray(members[gs], dtype=np.int64)
        e0 = gd[gs]
        keep = T - tab.t[e0, mi]
        lasts = sorted({stacks[r][-1] for r in range(n) if stacks[r]} - {gs})
        lasts = [k for k in lasts if is_last(k)]
        best_val, best = T - eps, None
        if lasts:
            la = np.asarray(lasts)
            ge = np.asarray([gd[k] for k in lasts])
            tt = tab.t[ge[:, None], mi[None, :]]
            ok = tab.ok[ge[:, None], mi[None, :]] & (np.asarray([mload[k] for k in lasts])[:, None]
                                                     + tab.mem[ge[:, None], mi[None, :]] <= budget)
            v = np.where(ok, np.maximum(keep[None, :], np.asarray([end[k] for k in lasts])[:, None] + tt), np.inf)
            h, j = np.unravel_index(int(np.argmin(v)), v.shape)
            if v[h, j] < best_val:
                best_val, best = float(v[h, j]), ("move", int(la[h]), int(j))
        # a new group on the block of each degree that frees earliest (ignoring gs's own ranks' order)
        for e in range(D):
            d = int(tab.deg[e])
            if not tab.ok[e, mi].any():
                continue
            bm = ready[: (n // d) * d].reshape(-1, d).max(axis=1)
            b = int(np.argmin(bm))
            v = np.where(tab.ok[e, mi], np.maximum(keep, bm[b] + tab.over[e] + tab.t[e, mi]), np.inf)
            j = int(np.argmin(v))
            if v[j] < best_val:
                best_val, best = float(v[j]), ("new", e, b, j)
        if best is None:
            for h in lasts:
                val, i, j = _best_swap(tab, e0, mi, keep, mload[gs], gd[h], members[h], end[h], mload[h], budget)
                if val < best_val:
                    best_val, best = val, ("swap", h, i, j)
        if best is None:
            break
        improved = True
        kind = best[0]
        if kind == "move":
            _, h, j = best
            i = int(mi[j])
            members[gs].remove(i)
            members[h].append(i)
            end[h] += float(tab.t[gd[h], i])
            mload[h] += float(tab.mem[gd[h], i])
            for r in ranks(h):
                ready[r] = end[h]
        elif kind == "new":
            _, e, b, j = best
            i = int(mi[j])
            members[gs].remove(i)
            k = len(gd)
            d = int(tab.deg[e])
            st = float(ready[b * d:(b + 1) * d].max())
            gd.append(e), blk.append(b), members.append([i]), start.append(st)
            end.append(st + float(tab.over[e] + tab.t[e, i])), mload.append(float(tab.mem[e, i])), alive.append(True)
            for r in range(b * d, (b + 1) * d):
                stacks[r].append(k)
                ready[r] = end[k]
        else:
            _, h, j, jj = best
            i = int(mi[j])
            q = int(members[h][jj])
            members[gs].remove(i)
            members[h].remove(q)
            members[gs].append(q)
            members[h].append(i)
            end[h] = start[h] + float(tab.over[gd[h]] + tab.t[gd[h], members[h]].sum())
            mload[h] = float(tab.mem[gd[h], members[h]].sum())
            for r in ranks(h):
                ready[r] = end[h]
        if members[gs]:
            end[gs] = start[gs] + float(tab.over[e0] + tab.t[e0, members[gs]].sum())
            mload[gs] = float(tab.mem[e0, members[gs]].sum())
            for r in ranks(gs):
                ready[r] = end[gs]
        else:
            alive[gs] = False
            for r in ranks(gs):
                stacks[r].pop()
                ready[r] = end[stacks[r][-1]] if stacks[r] else 0.0
    if not improved:
        return None
    # micro-step of each group: one more than the latest of its predecessors on its ranks
    level = {}
    order = sorted((k for k in range(len(gd)) if alive[k]), key=lambda k: (start[k], end[k]))
    depth = np.zeros(n, dtype=np.int64)
    for k in order:
        rr = list(ranks(k))
        lv = int(depth[rr].max())
        level[k] = lv
        depth[rr] = lv + 1
    steps = int(max(level.values())) + 1 if level else 0
    micro = [[] for _ in range(steps)]
    blocks = [[] for _ in range(steps)]
    for k, lv in level.items():
        micro[lv].append((int(tab.deg[gd[k]]), list(members[k])))
        blocks[lv].append(int(blk[k]))
    return micro, blocks


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------


def _replace(p: Plan, **kw) -> Plan:
    return dataclasses.replace(p, **kw)


def plan_flexsp(lengths, cost: CostModel, opts: PlanOptions | None = None, *, bucketing: bool | None = None,
                buckets: int = 16, extra_micro_steps: int = 2) -> Plan:
    """The FlexSP plan of one step (planner ``flexsp``).

    ``bucketing``: None buckets micro-steps of more than ``AUTO_BUCKET_ABOVE`` sequences, True
    always, False never (exact per-sequence model). ``buckets``: length buckets when bucketing.
    ``extra_micro_steps``: micro-step counts tried beyond the fewest that fit.

    Returns a Plan whose makespan is never above greedy's or best-static's. ``status``:
    ``optimal`` when CP-SAT proved the one-micro-step plan optimal (exact lengths) and nothing beat
    it, or when the plan meets the lower bound; ``feasible`` otherwise (``stats["gap"]``: over the
    lower bound); ``fallback`` when the solver produced nothing and a baseline's plan is returned
    (``reason`` says why). ``stats`` (plain JSON data):
    ``micro_steps``, ``min_micro_steps``, ``tried`` ({micro-step count or "<baseline>-split":
    makespan}), ``buckets``, ``variables``, ``cp_sat_status`` ({status: micro-steps}),
    ``cp_sat_wall_s``, ``best_bound_ms`` (the lower bound, or CP-SAT's proved bound for one
    micro-step), ``source`` (where the plan came from: ``heuristic``, ``cp-sat``, ``greedy``,
    ``best-static``, with ``+timeline`` when the timeline search improved it), ``greedy_ms``,
    ``best_static_ms``, ``wall_s``, ``gap``; ``solver_ms`` when a baseline won.
    Raises InfeasibleError when a sequence fits no group, Cancelled when cancelled.
    """
    opts = opts or PlanOptions()
    warm_up()
    t0 = time.perf_counter()
    # leave 15% of the limit for building and checking the final plan; stop starting heuristic
    # candidates at 60% of the rest so that CP-SAT and the timeline refinement get their share
    deadline = t0 + max(0.05, 0.85 * float(opts.time_limit))
    cand_deadline = t0 + 0.6 * (deadline - t0)
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    lb = lower_bound_ms(s, cost)
    tab = _Table(s, cost)

    opts.report(0.02, "flexsp: baselines (greedy, best static)")
    greedy = plan_greedy(s, cost, opts)
    opts.check_cancel()
    static = plan_best_static(s, cost, opts)
    opts.check_cancel()
    baseline = min((greedy, static), key=lambda p: p.makespan_ms)

    M0 = min_micro_steps(tab)
    tried: dict[str, float] = {}
    cands: list[tuple[float, int, list[StepResult], Plan]] = []
    # the fewest micro-steps first, then the split of the better baseline re-planned micro-step by
    # micro-step (it always fits memory, so it is the safe candidate), then more micro-steps and
    # the other baseline's split
    splits = [(f"{base.planner}-split", base) for base in sorted((static, greedy), key=lambda p: p.makespan_ms)]
    Ms: list = [M0, splits[0], *range(M0 + 1, M0 + 1 + max(0, int(extra_micro_steps))), splits[1]]
    for k, M in enumerate(Ms):
        opts.check_cancel()
        if time.perf_counter() > cand_deadline:
            # out of time (the baselines can take it all on huge batches): keep what we have; with
            # no candidate yet, the best baseline is returned below with the reason
            break
        if isinstance(M, tuple):
            label, base = M
            chunks = [np.array(sorted(i for g in ms.groups for i in g.sequences), dtype=np.int64)
                      for ms in base.micro_steps]
            M = len(chunks)
        else:
            label, chunks = str(M), None
        opts.report(0.1 + 0.3 * k / len(Ms), f"flexsp: heuristic with {M} micro-step(s)")
        steps = []
        for q in (chunks if chunks is not None else _chunks(tab, M)):
            opts.check_cancel()
            left = max(0.0, cand_deadline - time.perf_counter())
            if left <= 0.0 and (cands or chunks is None):
                steps = None  # abandoned at the time limit; a baseline split is finished once
                break
            r = _solve_step(tab, q, bucketing=bucketing, buckets=buckets, time_limit=left / max(1, M),
                            seed=opts.seed, opts=opts, use_cpsat=False)
            if r is None:
                steps = None
                break
            steps.append(r)
        if steps is None:
            tried[label] = math.inf
            continue
        p = build_plan("flexsp", [r.groups for r in steps], s, cost, lower_bound=lb)
        tried[label] = p.makespan_ms
        cands.append((p.makespan_ms, M, steps, p))

    source = "heuristic"
    solver_plan: Plan | None = None
    steps: list[StepResult] = []
    if cands:
        cands.sort(key=lambda c: c[0])
        _, M, steps, solver_plan = cands[0]
        # CP-SAT on the micro-steps furthest above their own bound
        order = sorted(range(len(steps)), key=lambda j: -(steps[j].makespan_ms - steps[j].lower_bound_ms))
        todo = [j for j in order if not steps[j].proved]
        improved = False
        cp_deadline = time.perf_counter() + CPSAT_SHARE * max(0.0, deadline - time.perf_counter())
        for n_done, j in enumerate(todo):
            opts.check_cancel()
            left = cp_deadline - time.perf_counter()
            if left < 0.03:
                break
            opts.report(0.4 + 0.55 * n_done / max(1, len(todo)), f"flexsp: CP-SAT on micro-step {j + 1} of {len(steps)}")
            idx = np.array(sorted(i for _, g in steps[j].groups for i in g), dtype=np.int64)
            e_of = {int(d): e for e, d in enumerate(tab.deg)}
            heur = [(e_of[d], list(g)) for d, g in steps[j].groups]
            if len(steps) == 1:
                # warm start from the best one-micro-step plan at hand: ours, greedy's, best static's
                for base in (greedy, static):
                    if len(base.micro_steps) == 1:
                        alt = [(e_of[g.degree], list(g.sequences)) for g in base.micro_steps[0].groups]
                        if _makespan(alt, tab) < _makespan(heur, tab):
                            heur = alt
            share = left / max(1, len(todo) - n_done)
            r = _solve_step(tab, idx, bucketing=bucketing, buckets=buckets, time_limit=share, seed=opts.seed,
                            opts=opts, heuristic=heur)
            if r is not None:
                r.info = {**steps[j].info, **r.info}
                if r.makespan_ms < steps[j].makespan_ms * (1 - 1e-12):
                    improved = True
                steps[j] = r
        if improved:
            p = build_plan("flexsp", [r.groups for r in steps], s, cost, lower_bound=lb)
            if p.makespan_ms < solver_plan.makespan_ms:
                solver_plan = p
                source = "cp-sat"

    # local search on the exact timeline, from the solver's plan and from greedy's
    opts.report(0.9, "flexsp: refining on the timeline")
    starts = [(p, src_name) for p, src_name in ((solver_plan, source), (greedy, "greedy")) if p is not None]
    improved_from = None
    for k, (p0, src_name) in enumerate(starts):
        opts.check_cancel()
        left = deadline - time.perf_counter()
        r = _improve_timeline(p0, tab, time.perf_counter() + max(0.02, left / (len(starts) - k)))
        if r is None:
            continue
        p1 = build_plan("flexsp", r[0], s, cost, blocks=r[1], lower_bound=lb)
        if p1.makespan_ms < p0.makespan_ms * (1 - 1e-12) and (
                solver_plan is None or p1.makespan_ms < solver_plan.makespan_ms):
            solver_plan, improved_from = p1, src_name
    if improved_from is not None:
        source = f"{improved_from}+timeline"

    wall = time.perf_counter() - t0
    cp_status: dict[str, int] = {}
    for r in steps:
        key = str(r.info.get("cp_sat_status", "not run"))
        cp_status[key] = cp_status.get(key, 0) + 1
    stats = {
        "micro_steps": len(steps),
        "min_micro_steps": M0,
        "tried": tried,
        "buckets": max([r.info.get("buckets", 0) for r in steps], default=0),
        "variables": int(sum(r.info.get("variables", 0) for r in steps)),
        "cp_sat_status": cp_status,
        "cp_sat_wall_s": float(sum(r.info.get("wall_s", 0.0) for r in steps)),
        "greedy_ms": greedy.makespan_ms,
        "best_static_ms": static.makespan_ms,
        "wall_s": wall,
    }
    all_proved = bool(steps) and all(r.proved for r in steps)
    if solver_plan is not None and len(steps) == 1 and all_proved:
        stats["best_bound_ms"] = steps[0].lower_bound_ms + cost.grad_sync_ms()
    else:
        stats["best_bound_ms"] = lb
    if solver_plan is not None and solver_plan.makespan_ms <= baseline.makespan_ms * (1 + 1e-12):
        status = "optimal" if (all_proved and len(steps) == 1 and M0 == 1) else "feasible"
        if status == "optimal":
            reason = "CP-SAT proved the one-micro-step plan optimal"
        else:
            why = [] if all_proved else ["time limit or bucketing: not proved optimal"]
            if len(steps) > 1:
                why.append(f"{len(steps)} micro-steps planned one by one")
            reason = "; ".join(why)
        plan = _replace(solver_plan, status=status, reason=reason)
        stats["source"] = source
    else:
        if solver_plan is None and not tried:
            status, reason = "fallback", (f"the baselines (greedy, best static) took the whole {opts.time_limit:g}s "
                                          f"time limit; returning {baseline.planner}'s plan (raise the time limit "
                                          f"to let the solver improve on it)")
        elif solver_plan is None:
            status, reason = "fallback", (f"the solver found no plan within {opts.time_limit:g}s for "
                                          f"{'/'.join(tried) or M0} micro-step(s); returning {baseline.planner}'s plan")
        else:
            status, reason = "feasible", (f"{baseline.planner}'s plan ({baseline.makespan_ms:,.1f} ms) beat the "
                                          f"solver's ({solver_plan.makespan_ms:,.1f} ms); returning it")
        plan = _replace(baseline, planner="flexsp", status=status, reason=reason)
        stats["source"] = baseline.planner
        stats["solver_ms"] = solver_plan.makespan_ms if solver_plan is not None else None
    if plan.status != "optimal" and plan.makespan_ms <= lb * (1 + 1e-9):
        plan = _replace(plan, status="optimal", reason="the plan meets the lower bound")
    stats["gap"] = plan.makespan_ms / lb - 1.0 if lb > 0 else 0.0
    stats["wall_s"] = time.perf_counter() - t0
    opts.report(0.99, f"flexsp: {plan.makespan_ms:,.0f} ms ({stats['source']})")
    return _replace(plan, solve_seconds=time.perf_counter() - t0, lower_bound_ms=lb, stats=stats)


def warm_up() -> None:
    """Import OR-Tools' CP-SAT (about 0.6 s, once per process) so that it is not charged to the
    first plan's time limit. PlanAhead's worker calls it when it starts."""
    from ortools.sat.python import cp_model  # noqa: F401


def _register() -> None:
    from workbench.solve import register_planner

    register_planner("flexsp", plan_flexsp)


_register()
