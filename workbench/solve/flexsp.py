"""The FlexSP planner: heterogeneous SP groups for a whole step, with OR-Tools CP-SAT.

A step's plan is a *stack* (``workbench.solve.stack``): every group on an aligned block of ranks,
each rank running the groups of its blocks larger degrees first, so that the step's compute time is
exactly the largest per-rank load (the barrier-free timeline of ``plan.timeline``). The problem
(DESIGN.md, "The solver, precisely"): choose the groups (degree, block, sequences) so that every
sequence runs once, each group's activations fit the memory budget, and the largest rank load
(group overheads plus sequence times over the rank's blocks) is least.

How a step is planned (``plan_flexsp``):

1. Baselines: greedy's three list-scheduling rules, ``best-static`` and a short ``two-stage`` run
   (the answer is never slower than any of them); their plans are stacks already.
2. ``Stack.greedy``: list scheduling under stack semantics (a sequence may join any group with
   room, not only the last one on its ranks), aiming at the lower bound and a little above it,
   with and without a cap on the extra GPU-time of wider degrees: each target gives another
   structure.
3. For batches of at most ``AUTO_BUCKET_ABOVE`` sequences whose memory fits one micro-step: the
   exact per-micro-step CP-SAT model (``_solve_step``; below), one more candidate.
4. Local search (``Stack.improve``) from the best starts, on the exact per-rank loads.
5. The whole-step CP-SAT model (``stack.solve_stack``), warm-started from the best stack (on
   parts of ``CPSAT_PART_GPUS`` ranks for larger clusters), its answer mapped back to sequences
   and polished by the local search; kept when it is faster.
6. What time is left: more local search on the best.

The per-micro-step model (one micro-step, groups on disjoint ranks)::

    choose a multiset of groups (degree d from cost.degrees, sum of degrees <= N GPUs),
    assign every sequence to exactly one group (degree >= its memory minimum),
    minimise T  s.t.  overhead(d) + sum_i time(s_i, d) <= T   for every group,
                      sum_i memory(s_i, d) <= memory budget    for every group.

With power-of-two degrees any multiset whose degrees sum to at most N packs into aligned blocks.
Items are single sequences (or, in ``solve_one_step`` with bucketing, length buckets); variables are
the item counts per candidate group, group activity and T; symmetry between groups of one degree
is broken by non-increasing activity and load. It is exact for one micro-step and checked against
an exhaustive search (tests/test_flexsp.py); stacked groups can beat it, so its OPTIMAL proves
nothing about the step.

CP-SAT runs with at most 2 workers (``CPSAT_WORKERS``): the planning machines are small and
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
from workbench.solve.baselines import greedy_rule_plans, plan_best_static
from workbench.solve.options import PlanOptions
from workbench.solve.plan import Plan, build_plan, lower_bound_ms
from workbench.solve.stack import Stack, run_cpsat, solve_stack

__all__ = ["plan_flexsp", "solve_one_step", "bucketize", "StepResult", "CPSAT_WORKERS"]

CPSAT_WORKERS = 2
"""CP-SAT search workers (at most 2: small shared machines, planners on background threads)."""

AUTO_BUCKET_ABOVE = 40
"""With ``bucketing=None`` a micro-step with more sequences than this is bucketed."""

SINGLE_ITEMS = 16
"""With bucketing, this many of the longest sequences stay items of their own."""

BASELINE_SHARE = 0.3
"""Share of the time limit the baselines may take (greedy stops trying further rules after it)."""

STACK_GREEDY_RULES = ((1.03, 0.5, True), (1.0, None, False), (1.02, 0.2, True), (1.02, None, True),
                      (1.03, 0.1, False), (1.03, 0.05, True), (1.02, None, False), (1.0, 0.1, True))
"""``Stack.greedy`` runs (target as a multiple of the lower bound's compute time, ``max_extra_work``,
``lowest``), in the order they are tried while time allows: the first 8 of a greedy choice among 50
rules on 20 batches that are not the benchmarks' (64 GPUs; sampler seed 1 and synthetic seeds
10-11), each adding the most to the best of the ones before."""

STARTS_SHARE = 0.5
"""No ``Stack.greedy`` run starts after this share of the time limit (the first always runs)."""

LS_STARTS = 3
"""How many starts the local search improves (the best of the stack greedy and of the baselines first)."""

BASELINE_KINDS = ("greedy", "best-static", "two-stage", "micro-step")

TWO_STAGE_SHARE = 0.15
"""A short two-stage run (this share of flexsp's limit) is one more baseline when greedy and
best-static took less than this share."""

TWO_STAGE_MAX_SEQS = 4096
"""No two-stage run above this many sequences (its first pass alone overruns a short limit)."""

MICRO_SHARE = 0.3
"""Share of the time left that the exact per-micro-step model gets (small batches only)."""

LS_SHARE = 0.3
"""Share of the time left that the first local search gets."""

CPSAT_SHARE = 0.6
"""Share of the time left after the first local search that the whole-step CP-SAT model gets
(with the polishing local search of its answer)."""

CPSAT_MAX_SEQS = 4096
"""The whole-step model runs on parts of at most this many sequences: above it, mapping the bucket
tokens back to sequences costs more time than the model gains (measured at 64 GPUs x 8192
sequences: CP-SAT gain -0.3% to 0% and solve time past the limit)."""

MIN_CPSAT_S = 0.15
"""The whole-step model is not built with less time than this left for it (building takes ~0.1 s)."""

POLISH_SHARE = 0.5
"""Share of the time left after a whole-step CP-SAT call for polishing its answer."""

PART_GPUS = 64
"""The per-micro-step heuristic solves clusters larger than this in parts of this many GPUs."""

CPSAT_PART_GPUS = 64
"""The whole-step CP-SAT model runs on parts of this many GPUs (aligned blocks no group straddles)
when the cluster is larger, the parts whose ranks end latest first."""

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
    # rounded down: a group that fits in GB fits in units (so a feasible hint stays feasible)
    mint = np.floor(items.mem / tab.budget * MEMCAP).astype(np.int64)
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
        # in the model's own units, so that the non-increasing loads of the symmetry rule hold
        hints = sorted(hint_by_e.get(e, []), key=lambda c: -int((tint[e] * c).sum()))
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
    build_s = time.perf_counter() - t_build
    if float(time_limit) - build_s < 0.01:
        return None, {"cp_sat_status": "skipped (no time left after building the model)", "variables": n_vars,
                      "wall_s": 0.0, "build_s": build_s, "items": n_items}
    if hint_groups:
        # every variable is hinted: the group counts, the assignment, and T (the hint's makespan)
        m.AddHint(T, int(max(int(cint[e]) + int((tint[e] * c).sum()) for e, c in hint_groups)))
    solver, status, run = run_cpsat(m, time_limit=float(time_limit) - build_s, seed=seed, workers=workers, opts=opts)
    info = {"cp_sat_status": run["status"], "variables": n_vars, "wall_s": run["wall_s"], "build_s": build_s,
            "items": n_items, "hint": run["hint"] if hint_groups else "none"}
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


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------


def _replace(p: Plan, **kw) -> Plan:
    return dataclasses.replace(p, **kw)


@dataclass
class _Cand:
    """A candidate whole-step plan: its stack, where it came from and its compute time."""

    stack: Stack
    source: str
    start: str

    @property
    def ms(self) -> float:
        return self.stack.makespan_ms


def plan_flexsp(lengths, cost: CostModel, opts: PlanOptions | None = None, *, bucketing: bool | None = None,
                buckets: int = 16, extra_micro_steps: int = 2, cpsat: bool = True) -> Plan:
    """The FlexSP plan of one step (planner ``flexsp``).

    Steps (module docstring): the baselines (greedy's rules, ``best-static``, a short ``two-stage``)
    and ``Stack.greedy`` runs give stacks (groups on aligned blocks, larger degrees first); local
    search on the exact per-rank loads improves the best of them; the whole-step CP-SAT model
    (``stack.solve_stack``) is warm-started from the best stack and its answer polished by the same
    local search; for small batches that fit one micro-step, the exact per-micro-step model is one
    more candidate. The fastest candidate wins.

    ``cpsat=False`` skips both CP-SAT models (the ablation ``bench/solver.py`` reports).
    ``bucketing`` / ``buckets``: the per-micro-step model's length buckets (None: only above
    ``AUTO_BUCKET_ABOVE`` sequences, False: never). ``extra_micro_steps`` is kept for
    compatibility and unused (stacks choose each rank's number of groups themselves).

    Returns a Plan never slower than greedy's, best-static's (hence min-degree's and static-max's)
    or the short two-stage run's for the same batch. ``status``: ``optimal`` when the plan meets the
    lower bound (nothing else proves a whole step optimal: the per-micro-step model's OPTIMAL is
    optimal among one-micro-step plans only); ``feasible`` otherwise; ``fallback`` when the
    baselines took the whole time limit and the best of them is returned (``reason`` says why).
    ``stats`` (plain JSON): ``source`` (``cp-sat`` when the plan is CP-SAT's answer as mapped
    back, ``cp-sat+local-search`` when the local search then improved it; CP-SAT's answer counts
    only when CP-SAT improved on its own hint; ``local-search`` when the local search improved a
    start, ``stack-greedy`` or a baseline's name when a start won as it was), ``start`` (which
    start: ``greedy:<rule>``, ``best-static``, ``two-stage``, ``stack-greedy:<target>,<extra>,<ties>``,
    ``micro-step``), ``cp_sat`` (one entry per CP-SAT call: ``model`` (``whole-step`` or
    ``micro-step``), ``status`` (CP-SAT's own, or why it was skipped), ``objective_ms`` and
    ``bound_ms`` (compute time, model units converted to ms; None without a solution),
    ``wall_s``, ``build_s``, ``variables``, ``hint`` (what CP-SAT reported of the warm start),
    ``used`` (its answer is the plan returned), and for the whole-step model ``part``,
    ``hint_objective_ms``, ``improved_hint``, ``mapped_ms``, ``polished_ms``, ``singles``,
    ``buckets``, ``presolve``), ``cp_sat_status`` ({status: calls}), ``cp_sat_wall_s``,
    ``best_bound_ms``, ``groups``, ``groups_per_gpu``, ``micro_steps``, ``min_micro_steps``,
    ``greedy_ms``, ``best_static_ms``, ``two_stage_ms``, ``local_search_moves``, ``wall_s``, ``gap``,
    ``timing`` (seconds per stage). Raises InfeasibleError when a sequence fits no group,
    Cancelled when cancelled.
    """
    opts = opts or PlanOptions()
    if cost.execution == "lockstep":
        from workbench.solve.lockstep import plan_lockstep

        return plan_lockstep(lengths, cost, opts, cpsat=cpsat)
    warm_up()
    t0 = time.perf_counter()
    limit = max(0.05, float(opts.time_limit))
    # 15% of the limit stays for building and checking the final plan
    deadline = t0 + 0.85 * limit
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    lb = lower_bound_ms(s, cost)
    grad = cost.step_end_ms()  # the gradient sync and the optimizer step
    tab = _Table(s, cost)
    timing: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timing[name] = timing.get(name, 0.0) + now - since
        return now

    tick = time.perf_counter()
    opts.report(0.02, "flexsp: baselines (greedy, best static, two-stage)")
    rule_plans = greedy_rule_plans(s, cost, opts, deadline=t0 + BASELINE_SHARE * limit)
    greedy = min(rule_plans, key=lambda p: p.makespan_ms)
    opts.check_cancel()
    static = plan_best_static(s, cost, opts)
    opts.check_cancel()
    baselines = [greedy, static]
    if time.perf_counter() < t0 + TWO_STAGE_SHARE * limit and s.size <= TWO_STAGE_MAX_SEQS:
        # two-stage's replica layouts are stacks too; a short run of it is one more start
        from workbench.solve.two_stage import plan_two_stage

        two = plan_two_stage(s, cost, dataclasses.replace(opts, time_limit=0.5 * TWO_STAGE_SHARE * limit, progress=None))
        baselines.append(two)
    opts.check_cancel()
    baseline = min(baselines, key=lambda p: p.makespan_ms)
    tick = lap("baselines", tick)
    M0 = min_micro_steps(tab)
    cp_calls: list[dict] = []
    cands: list[_Cand] = []
    moves = 0
    if time.perf_counter() < deadline:
        seen = set()
        for p in sorted([*rule_plans, *baselines[1:]], key=lambda p: p.makespan_ms):
            key = round(p.makespan_ms, 6)
            if key in seen:
                continue
            seen.add(key)
            name = p.planner if p.planner != "greedy" else f"greedy:{p.stats.get('rule', '')}"
            cands.append(_Cand(Stack.from_plan(p, tab), p.planner, name))
        # 1. list scheduling under stack semantics, for a few targets (each gives another structure)
        opts.report(0.15, "flexsp: whole-step list scheduling")
        lbc = lb - grad
        for k, (tgt, extra, lowest) in enumerate(STACK_GREEDY_RULES):
            if k and time.perf_counter() > t0 + STARTS_SHARE * limit:
                break
            opts.check_cancel()
            # the first run may take until the deadline (there is no stack without it); the others
            # give up a little after the starts' share
            cut = deadline if k == 0 else min(deadline, t0 + (STARTS_SHARE + 0.1) * limit)
            st = Stack.greedy(tab, target=lbc * tgt, max_extra_work=extra, deadline=cut, lowest=lowest,
                              cancel=opts.check_cancel)
            if st is None:
                break
            name = f"stack-greedy:{tgt:g},{'-' if extra is None else f'{extra:g}'},{'lowest' if lowest else 'first'}"
            cands.append(_Cand(st, "stack-greedy", name))
        tick = lap("stack_greedy", tick)
        # 2. the exact per-micro-step model where the batch is small and fits one micro-step
        if cpsat and M0 == 1 and s.size <= AUTO_BUCKET_ABOVE and time.perf_counter() < deadline:
            opts.report(0.2, "flexsp: CP-SAT on the one-micro-step model")
            left = deadline - time.perf_counter()
            r = _solve_step(tab, np.arange(s.size), bucketing=bucketing, buckets=buckets,
                            time_limit=MICRO_SHARE * left, seed=opts.seed, opts=opts)
            if r is not None:
                call = {"model": "micro-step", **_step_call_info(r)}
                cp_calls.append(call)
                e_of = {int(d): e for e, d in enumerate(tab.deg)}
                st = Stack.from_groups(tab, _place(tab, [(e_of[d], g) for d, g in r.groups]))
                cands.append(_Cand(st, "cp-sat" if call["used"] else "heuristic", "micro-step"))
            tick = lap("micro_step_model", tick)
        # 3. local search from the best starts, each until it stops improving or its share
        cands.sort(key=lambda c: c.ms)
        opts.report(0.3, "flexsp: local search on the whole step")
        ls_end = time.perf_counter() + LS_SHARE * max(0.0, deadline - time.perf_counter())
        # the best start of each kind first (a baseline's plan improves most; the stack greedy's
        # start lower), then the next best
        firsts = [next((c for c in cands if c.start.split(":")[0] == k), None) for k in ("stack-greedy", *BASELINE_KINDS)]
        starts = [c for c in firsts if c is not None]
        starts.sort(key=lambda c: c.ms)
        starts += [c for c in cands if c not in starts]
        starts = starts[:LS_STARTS]
        for k, c in enumerate(starts):
            opts.check_cancel()
            left = ls_end - time.perf_counter()
            if left <= 0:
                break
            st = c.stack.copy()
            before = st.makespan_ms
            moves += st.improve(time.perf_counter() + left * (0.5 if k + 1 < len(starts) else 1.0),
                                cancel=opts.check_cancel)
            if st.makespan_ms < before * (1 - 1e-12):
                cands.append(_Cand(st, _plus(c.source, "local-search"), c.start))
        cands.sort(key=lambda c: c.ms)
        tick = lap("local_search", tick)
        # 4. the whole-step CP-SAT model, warm-started from the best stack
        if cpsat and time.perf_counter() < deadline - 0.02:
            best = cands[0]
            opts.report(0.55, "flexsp: CP-SAT on the whole-step model")
            left = deadline - time.perf_counter()
            cp_deadline = time.perf_counter() + CPSAT_SHARE * left
            split = _split(best.stack)
            # the parts whose ranks end latest first
            parts = [None] if split is None else sorted((p for p in split if split[p].num_groups()),
                                                        key=lambda p: -split[p].makespan_ms)
            sizes = {p: sum(len(m) for _, _, m in (best.stack if p is None else split[p]).groups()) for p in parts}
            for k, part in enumerate(parts):
                left = (cp_deadline - time.perf_counter()) / (len(parts) - k)
                if left < MIN_CPSAT_S:
                    cp_calls.append({"model": "whole-step", "status": f"skipped ({left:.2f}s left)", "objective_ms": None,
                                     "bound_ms": None, "wall_s": 0.0, "build_s": 0.0, "variables": 0, "hint": "none",
                                     "used": False})
                    break
                if sizes[part] > CPSAT_MAX_SEQS:
                    cp_calls.append({"model": "whole-step", "status": f"skipped ({sizes[part]} sequences)",
                                     "objective_ms": None, "bound_ms": None, "wall_s": 0.0, "build_s": 0.0,
                                     "variables": 0, "hint": "none", "used": False})
                    continue
                if part is None:
                    hint = best.stack
                else:  # the part as it is now: polishing after an earlier part may have moved sequences
                    split = _split(best.stack)
                    if split is None:
                        break
                    hint = split[part]
                # part of the share stays for mapping the answer back and polishing it
                out, info = solve_stack(hint.tab, hint, time_limit=0.7 * left, seed=opts.seed, opts=opts)
                call = {"model": "whole-step", **info.to_dict(), "used": False}
                if part is not None:
                    call["part"] = part
                cp_calls.append(call)
                opts.check_cancel()
                if out is None:
                    continue
                merged = _merge_part(best.stack, part, out)
                raw = merged.makespan_ms
                polished = merged.copy()
                moves += polished.improve(time.perf_counter() + max(0.01, POLISH_SHARE * (deadline - time.perf_counter())),
                                          cancel=opts.check_cancel)
                call["mapped_ms"] = raw
                call["polished_ms"] = polished.makespan_ms
                # CP-SAT's answer counts only when CP-SAT improved on its hint (else it handed the hint
                # back, and whatever the mapping and polishing found is the local search's)
                found = info.objective_ms is not None and info.objective_ms < info.extra["hint_objective_ms"] * (1 - 1e-9)
                call["improved_hint"] = bool(found)
                if found and polished.makespan_ms < best.ms * (1 - 1e-12):
                    src = "cp-sat" if polished.makespan_ms >= raw * (1 - 1e-12) else "cp-sat+local-search"
                    best = _Cand(polished if polished.makespan_ms < raw else merged, src, best.start)
                    call["used"] = True
                    cands.append(best)
            cands.sort(key=lambda c: c.ms)
            tick = lap("cp_sat", tick)
        # 5. what time is left: more local search on the best
        left = deadline - time.perf_counter()
        if cands and left > 0.01:
            c = cands[0]
            st = c.stack.copy()
            n = st.improve(deadline, cancel=opts.check_cancel)
            moves += n
            if st.makespan_ms < c.ms * (1 - 1e-12):
                cands.insert(0, _Cand(st, _plus(c.source, "local-search"), c.start))
            tick = lap("local_search", tick)
    opts.check_cancel()

    stats: dict = {
        "min_micro_steps": M0,
        "greedy_ms": greedy.makespan_ms,
        "best_static_ms": static.makespan_ms,
        "two_stage_ms": baselines[2].makespan_ms if len(baselines) > 2 else None,
        "local_search_moves": moves,
        "cp_sat": cp_calls,
        "cp_sat_status": _count(str(c.get("status")) for c in cp_calls),
        "cp_sat_wall_s": float(sum(c.get("wall_s") or 0.0 for c in cp_calls)),
    }
    best = min(cands, key=lambda c: c.ms) if cands else None
    if best is not None and best.ms + grad < baseline.makespan_ms * (1 - 1e-12):
        micro, blocks = best.stack.assignment()
        plan = build_plan("flexsp", micro, s, cost, blocks=blocks, lower_bound=lb)
        # CP-SAT's OPTIMAL on the per-micro-step model is optimal among one-micro-step plans only:
        # stacking groups on a rank can still be faster, so it proves nothing about the step
        plan = _replace(plan, status="feasible", reason="")
        stats["source"] = best.source
        stats["start"] = best.start
    else:
        if best is None:
            status, reason = "fallback", (f"the baselines (greedy, best static) took the whole {opts.time_limit:g}s "
                                          f"time limit; returning {baseline.planner}'s plan (raise the time limit "
                                          f"to let the solver improve on it)")
        else:
            status, reason = "feasible", f"no candidate beat {baseline.planner}'s plan; returning it"
        plan = _replace(baseline, planner="flexsp", status=status, reason=reason)
        stats["source"] = baseline.planner
        stats["start"] = baseline.planner
    if plan.status != "optimal" and plan.makespan_ms <= lb * (1 + 1e-9):
        plan = _replace(plan, status="optimal", reason="the plan meets the lower bound")
    groups = [g for m in plan.micro_steps for g in m.groups]
    stats["groups"] = len(groups)
    stats["groups_per_gpu"] = float(sum(g.degree for g in groups)) / max(1, cost.cluster.num_gpus)
    stats["micro_steps"] = len(plan.micro_steps)
    stats["best_bound_ms"] = lb
    stats["gap"] = plan.makespan_ms / lb - 1.0 if lb > 0 else 0.0
    stats["timing"] = timing
    stats["wall_s"] = time.perf_counter() - t0
    opts.report(0.99, f"flexsp: {plan.makespan_ms:,.0f} ms ({stats['source']})")
    return _replace(plan, solve_seconds=time.perf_counter() - t0, lower_bound_ms=lb, stats=stats)


def _plus(source: str, step: str) -> str:
    """``source`` with ``step`` appended once (``greedy`` + ``local-search`` is ``local-search``)."""
    if source.startswith("cp-sat"):
        return "cp-sat+local-search"
    return step


def _count(keys) -> dict:
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out


def _step_call_info(r: "StepResult") -> dict:
    """The per-micro-step CP-SAT call's figures in the shape of the whole-step ones."""
    i = r.info
    used = "cp_sat_ms" in i and i.get("heuristic_ms") is not None and i["cp_sat_ms"] < i["heuristic_ms"] * (1 - 1e-12)
    return {"status": str(i.get("cp_sat_status", "not run")), "objective_ms": i.get("objective_ms"),
            "bound_ms": i.get("bound_ms"), "wall_s": float(i.get("wall_s", 0.0)), "build_s": float(i.get("build_s", 0.0)),
            "variables": int(i.get("variables", 0)), "hint": str(i.get("hint", "none")), "used": bool(used)}


def _place(tab: _Table, groups) -> list:
    """One micro-step's groups ``[(e, members)]`` on aligned blocks (larger degrees first, each to
    the lowest free block; degrees dividing each other pack without gaps)."""
    used = np.zeros(tab.n_gpus, dtype=bool)
    out = []
    for e, mem in sorted(groups, key=lambda g: -int(tab.deg[g[0]])):
        d = int(tab.deg[e])
        free = ~used[: (tab.n_gpus // d) * d].reshape(-1, d).any(axis=1)
        b = int(np.argmax(free))
        used[b * d:(b + 1) * d] = True
        out.append((e, b, list(mem)))
    return out


def _split(stack: Stack) -> dict | None:
    """The stack's parts ``{part index: sub-stack on its ranks}``, a part being an aligned block
    of ``CPSAT_PART_GPUS`` ranks, or None when the cluster is not larger than that or some group
    is wider (it would straddle two parts)."""
    tab = stack.tab
    P = int(CPSAT_PART_GPUS)
    used = max((int(tab.deg[e]) for e, _, _ in stack.groups()), default=1)
    if stack.n <= P or stack.n % P or used > P:
        return None
    sub = _Table.__new__(_Table)
    sub.__dict__.update(tab.__dict__)
    sub.n_gpus = P
    per_part: dict[int, list] = {p: [] for p in range(stack.n // P)}
    for e, b, mem in stack.groups():
        d = int(tab.deg[e])
        p = (b * d) // P
        per_part[p].append((e, b - p * (P // d), mem))
    return {p: Stack.from_groups(sub, g) for p, g in per_part.items()}


def _merge_part(stack: Stack, part, out: Stack) -> Stack:
    """``stack`` with part ``part`` replaced by ``out`` (a stack on the part's ranks)."""
    if part is None:
        return Stack.from_groups(stack.tab, out.groups())
    tab = stack.tab
    P = out.n
    groups = []
    for e, b, mem in stack.groups():
        d = int(tab.deg[e])
        if (b * d) // P != part:
            groups.append((e, b, mem))
    for e, b, mem in out.groups():
        d = int(tab.deg[e])
        groups.append((e, b + part * (P // d), mem))
    return Stack.from_groups(tab, groups)


def warm_up() -> None:
    """Import OR-Tools' CP-SAT (about 0.6 s, once per process) so that it is not charged to the
    first plan's time limit. PlanAhead's worker calls it when it starts."""
    from ortools.sat.python import cp_model  # noqa: F401


def _register() -> None:
    from workbench.solve import register_planner

    register_planner("flexsp", plan_flexsp)


_register()
