"""One micro-step: the cost table, its heuristic, its local moves and its exact CP-SAT model.

Every planner that thinks in groups works on a ``Table``: per candidate group shape (row ``e``: a
degree, ``tab.deg[e]`` ranks) and sequence, the time, the activation memory per GPU and whether it
fits the budget; per shape the group's fixed overhead. One micro-step is a set of groups on
disjoint ranks (``[(e, [sequence, ...]), ...]``); its makespan is its slowest group's time. The
problem (DESIGN.md, "The solver, precisely")::

    choose a multiset of groups (rows e, sum of tab.deg[e] <= N GPUs),
    assign every sequence to exactly one group (a row that holds it),
    minimise T  s.t.  overhead(e) + sum_i time(s_i, e) <= T   for every group,
                      sum_i memory(s_i, e) <= memory budget    for every group.

With power-of-two degrees any multiset whose degrees sum to at most N packs into aligned blocks
(``place_groups``).

- ``heuristic_step``: degrees by bottleneck raising, group counts per row by a divisible estimate
  (``_balance``), longest-processing-time packing under memory; ``refine``: moves and swaps that
  lower the slowest group.
- ``cpsat_step`` / ``solve_step``: the exact model over items (single sequences, or length buckets
  from ``bucketize``) warm-started from the heuristic: item counts per candidate group, group
  activity and T; symmetry between groups of one row broken by non-increasing activity and load.
  It is exact for one micro-step and checked against an exhaustive search (tests/test_flexsp.py);
  stacked groups (``stack.py``) and lockstep passes (``lockstep.py``) build whole steps from these
  pieces.

Pure numpy + OR-Tools; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from workbench.cost import CostModel
from workbench.solve.cpsat import CPSAT_WORKERS, run_cpsat
from workbench.solve.effort import Effort
from workbench.solve.options import PlanOptions

__all__ = ["Table", "group_loads", "makespan", "heuristic_step", "refine", "bucketize", "StepResult", "solve_step",
           "solve_one_step", "cpsat_step", "min_micro_steps", "place_groups", "AUTO_BUCKET_ABOVE", "SINGLE_ITEMS",
           "PART_GPUS"]

AUTO_BUCKET_ABOVE = 40
"""With ``bucketing=None`` a micro-step with more sequences than this is bucketed."""

SINGLE_ITEMS = 16
"""With bucketing, this many of the longest sequences stay items of their own."""

PART_GPUS = 64
"""The per-micro-step heuristic solves clusters larger than this in parts of this many GPUs."""


# ------------------------------------------------------------------------------------------------
# cost tables
# ------------------------------------------------------------------------------------------------


class Table:
    """Per candidate group shape (row ``e``) and sequence: time, memory per GPU, whether it fits; per
    shape: the group's overhead. The rows are the cost model's shapes that fit the cluster, sorted by
    degree then CP size (``deg[e]`` ranks, split ``(deg[e] / cp[e]) x cp[e]``): with one split per
    degree (``--strategy ulysses`` or ``cp``) a row is a degree."""

    def __init__(self, s: np.ndarray, cost: CostModel):
        n_gpus = cost.cluster.num_gpus
        self.s = s
        self.n_gpus = n_gpus
        shapes = [(int(d), int(c)) for d, c in cost.shapes if d <= n_gpus]
        self.deg = np.array([d for d, _ in shapes], dtype=np.int64)
        self.cp = np.array([c for _, c in shapes], dtype=np.int64)
        self.t = np.stack([cost.time(s, d, c) for d, c in shapes])  # (E, n) ms
        self.mem = np.stack([cost.memory(s, d, c) for d, c in shapes])  # (E, n) GB per GPU
        self.budget = float(cost.memory_budget_gb)
        self.ok = self.mem <= self.budget
        self.over = np.array([cost.group_overhead_ms(d, c) for d, c in shapes], dtype=np.float64)
        work = np.where(self.ok, self.t * self.deg[:, None], np.inf)
        self.best_work = work.min(axis=0)
        single = np.where(self.ok, self.t + self.over[:, None], np.inf)
        self.best_single = single.min(axis=0)
        degrees = np.unique(self.deg)
        self.level = np.searchsorted(degrees, self.deg)  # (E,) index of each row's degree among the degrees
        # per row and sequence, the fastest row holding it among those of the next larger degree (-1: none)
        E, n = self.t.shape
        t_ok = np.where(self.ok, self.t, np.inf)
        best_at = np.full((degrees.size, n), -1, dtype=np.int64)
        for lv in range(degrees.size):
            rows = np.flatnonzero(self.level == lv)
            k = rows[np.argmin(t_ok[rows], axis=0)]
            best_at[lv] = np.where(np.isfinite(t_ok[rows].min(axis=0)), k, -1)
        nxt = np.minimum(self.level + 1, degrees.size - 1)
        self.up = np.where((self.level + 1 < degrees.size)[:, None], best_at[nxt], -1)  # (E, n)
        # each sequence's first row: the fastest split of the smallest degree that holds it
        first = np.argmax(self.ok, axis=0)
        self.dmin = best_at[self.level[first], np.arange(n)] if n else first
        self.dmin = np.where(self.dmin >= 0, self.dmin, first)
        share = np.where(self.ok, self.mem * self.deg[:, None], np.inf)
        self.share = share.min(axis=0)  # GB-GPUs of memory a sequence needs at least
        self._row = {shape: e for e, shape in enumerate(shapes)}

    def lift(self, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Rows ``rows`` for sequences ``idx``, each replaced where it does not hold its sequence by
        the fastest row of the same or a larger degree that does (unchanged where none does)."""
        rows = np.asarray(rows, dtype=np.int64).copy()
        for k in np.flatnonzero(~self.ok[rows, idx]):
            i = int(idx[k])
            cand = np.flatnonzero(self.ok[:, i] & (self.deg >= self.deg[rows[k]]))
            if cand.size:
                rows[k] = int(cand[np.argmin(self.t[cand, i])])
        return rows

    def row(self, degree: int, cp: int = 1) -> int:
        """The row of shape ``(degree, cp)``. Raises KeyError naming the shapes when it is not one."""
        try:
            return self._row[int(degree), int(cp)]
        except KeyError:
            raise KeyError(f"shape {int(degree) // int(cp)}x{int(cp)} (degree {degree}) is not among the cost model's "
                           f"shapes {[f'{d // c}x{c}' for d, c in self._row]}") from None

    def shape(self, e: int) -> tuple[int, int]:
        """``(degree, cp)`` of row ``e``."""
        return int(self.deg[e]), int(self.cp[e])

    def step_lower_bound(self, idx: np.ndarray) -> float:
        """A bound no one-micro-step plan of ``idx`` beats: every used GPU pays a group overhead,
        so T >= min overhead + work / N; and T >= the slowest single sequence at its best."""
        if idx.size == 0:
            return 0.0
        return max(float(self.best_single[idx].max()),
                   float(self.over.min()) + float(self.best_work[idx].sum()) / self.n_gpus)

def group_loads(groups, tab: Table) -> np.ndarray:
    return np.array([tab.over[e] + tab.t[e, m].sum() for e, m in groups], dtype=np.float64)

def makespan(groups, tab: Table) -> float:
    return float(group_loads(groups, tab).max()) if groups else 0.0


# ------------------------------------------------------------------------------------------------
# heuristic for one micro-step
# ------------------------------------------------------------------------------------------------


def _balance(tab: Table, idx: np.ndarray, di: np.ndarray, n_gpus: int):
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

def _pack_lpt(tab: Table, idx: np.ndarray, di: np.ndarray, k: np.ndarray, n_gpus: int, by_memory=False):
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

def _pack_tight(tab: Table, idx: np.ndarray, di: np.ndarray, k: np.ndarray, n_gpus: int):
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

def _pack(tab: Table, idx: np.ndarray, di: np.ndarray, k: np.ndarray, n_gpus: int):
    """LPT packing (``_pack_lpt``); where memory fragments, first-fit decreasing on memory."""
    g = _pack_lpt(tab, idx, di, k, n_gpus)
    if g is not None:
        return g
    g = _pack_lpt(tab, idx, di, k, n_gpus, by_memory=True)
    if g is not None:
        return g
    return _pack_tight(tab, idx, di, k, n_gpus)

def heuristic_step(tab: Table, idx: np.ndarray, n_gpus: int, clock: Effort):
    """Degrees by bottleneck raising, group counts by the divisible estimate, LPT packing. When
    memory fragments so that this packs nothing, the sequences above each degree level are raised
    to it (fewer, larger groups share their spare memory) and the best packing wins. None if none
    packs."""
    g = _heuristic_step_at(tab, idx, n_gpus, tab.dmin[idx].copy(), clock)
    if g is not None:
        return g
    best, best_ms = None, math.inf
    big = tab.dmin[idx] > 0
    for e in range(1, tab.deg.size):
        for di in (np.where(big, np.maximum(tab.dmin[idx], e), tab.dmin[idx]), np.maximum(tab.dmin[idx], e)):
            di = tab.lift(di, idx)  # a split of the same degree may need more memory
            g = _heuristic_step_at(tab, idx, n_gpus, di, clock)
            if g is not None:
                ms = makespan(g, tab)
                if ms < best_ms:
                    best, best_ms = g, ms
        if best is not None:
            break
    return best

def _heuristic_step_at(tab: Table, idx: np.ndarray, n_gpus: int, di: np.ndarray, clock: Effort):
    T, k = _balance(tab, idx, di, n_gpus)
    if k is None:
        return None
    if not math.isfinite(T):
        return _pack_tight(tab, idx, di, k, n_gpus)
    history = [(di, k)]
    for _ in range(4 * idx.size + 8):
        clock.tick(elements=27 * idx.size * tab.deg.size, steps=27)  # up to 9 divisible estimates
        single = tab.t[di, idx] + tab.over[di]
        top = np.argsort(-single, kind="stable")[:8]
        improved = False
        tries = [np.flatnonzero(single >= T * (1 - 1e-9))] + [np.array([j]) for j in top]
        for js in tries:
            js = js[tab.up[di[js], idx[js]] >= 0]
            if js.size == 0:
                continue
            di2 = di.copy()
            di2[js] = tab.up[di[js], idx[js]]  # the fastest split of the next larger degree
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


def _best_swap(tab: Table, e0: int, mi: np.ndarray, keep: np.ndarray, mload_gs: float, eh: int, members_h,
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

def refine(groups, tab: Table, n_gpus: int, deadline: float, clock: Effort, max_iter: int = 10_000,
           swap_groups: int = 48):
    """Moves and swaps that lower the slowest group, until none does (or the ``clock`` passes
    ``deadline``); each round is charged to the clock."""
    if not groups:
        return groups
    gd = [int(e) for e, _ in groups]
    members = [list(m) for _, m in groups]
    load = [float(tab.over[e] + tab.t[e, m].sum()) for e, m in zip(gd, members)]
    mload = [float(tab.mem[e, m].sum()) for e, m in zip(gd, members)]
    budget = tab.budget * (1 + 1e-12)
    D = tab.deg.size
    for it in range(max_iter):
        if it % 16 == 0 and clock.past(deadline):
            break
        clock.tick(elements=len(gd) * len(members[int(np.argmax(load))]) * 8, steps=2)
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
            clock.tick(elements=mi.size * sum(len(members[int(h)]) for h in order) * 16, steps=2 * order.size)
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

def _make_items(tab: Table, idx: np.ndarray, bucketed: bool, buckets: int) -> _Items:
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

def cpsat_step(tab: Table, items: _Items, n_gpus: int, hint_groups, *, effort: float, clock: Effort, seed: int,
               opts: PlanOptions | None, group_caps=None, workers: int = CPSAT_WORKERS):
    """Solve the one-micro-step model over ``items`` on ``effort`` of the ``clock`` (building the
    model is charged too); returns (groups as (row, counts per item), info). groups is None when no
    solution was found."""
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
    start = clock.now()
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
    clock.tick(steps=n_vars + len(slots))  # building: a few Python calls per variable
    left = float(effort) - (clock.now() - start)
    if left < 0.01:
        return None, {"cp_sat_status": "skipped (no effort left after building the model)", "variables": n_vars,
                      "dtime": 0.0, "items": n_items}
    if hint_groups:
        # every variable is hinted: the group counts, the assignment, and T (the hint's makespan)
        m.AddHint(T, int(max(int(cint[e]) + int((tint[e] * c).sum()) for e, c in hint_groups)))
    solver, status, run = run_cpsat(m, effort=left, clock=clock, seed=seed, workers=workers, opts=opts)
    info = {"cp_sat_status": run["status"], "variables": n_vars, "dtime": run["dtime"], "wall_s": run["wall_s"],
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

def _groups_to_counts(groups, items: _Items, tab: Table):
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

def _counts_to_groups(counts, items: _Items, tab: Table):
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
    """One micro-step's groups ``[(degree, [sequence index, ...])]`` and how they were found;
    ``rows``: the same groups as ``[(table row, [sequence index, ...])]`` (their shapes)."""

    groups: list
    makespan_ms: float
    lower_bound_ms: float
    proved: bool
    info: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)


def _split_parts(tab: Table, idx: np.ndarray, parts: int) -> list[np.ndarray]:
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

def solve_step(tab: Table, idx: np.ndarray, *, bucketing, buckets: int, effort: float, clock: Effort, seed: int,
               opts: PlanOptions | None, use_cpsat: bool = True, heuristic=None) -> StepResult | None:
    """Plan one micro-step of sequences ``idx`` on all the cluster's GPUs, on ``effort`` of the
    ``clock``: the heuristic and its moves, then (unless ``use_cpsat`` is False) the exact CP-SAT
    model warm-started from them. ``heuristic``: start from these groups ``[(row, members)]``
    instead. Returns a StepResult, or None when nothing holds the sequences in one micro-step."""
    t0 = clock.now()
    deadline = t0 + max(0.0, effort)
    n = tab.n_gpus
    lb = tab.step_lower_bound(idx)
    info: dict = {"sequences": int(idx.size)}
    if heuristic is None:
        if n > PART_GPUS and n % PART_GPUS == 0 and int(tab.deg.max()) <= PART_GPUS:
            parts = _split_parts(tab, idx, n // PART_GPUS)
            sub = Table.__new__(Table)
            sub.__dict__.update(tab.__dict__)
            sub.n_gpus = PART_GPUS
            groups = []
            for q in parts:
                g = heuristic_step(sub, q, PART_GPUS, clock)
                if g is None:
                    groups = None
                    break
                groups.extend(refine(g, sub, PART_GPUS, deadline, clock))
            if groups is None:
                groups = heuristic_step(tab, idx, n, clock)
            info["parts"] = len(parts)
        else:
            groups = heuristic_step(tab, idx, n, clock)
        if groups is not None:
            groups = refine(groups, tab, n, deadline, clock)
    else:
        groups = heuristic
    if groups is None and not use_cpsat:
        return None
    best = makespan(groups, tab) if groups is not None else math.inf
    info["heuristic_ms"] = best if groups is not None else None
    proved = best <= lb * (1 + 1e-9)
    info["cp_sat_status"] = "skipped (heuristic meets the bound)" if proved else "not run"
    remaining = deadline - clock.now()
    if use_cpsat and not proved and (remaining > 0.02 or groups is None) and not clock.capped:
        bucketed = (idx.size > AUTO_BUCKET_ABOVE) if bucketing is None else bool(bucketing)
        items = _make_items(tab, idx, bucketed, buckets)
        hint = _groups_to_counts(groups, items, tab) if groups is not None else None
        remaining = max(remaining, 0.05)
        caps = None
        if bucketed and groups is not None:
            # the heuristic's group counts per degree, with room to spare, bound the model's size
            have = np.bincount([e for e, _ in groups], minlength=tab.deg.size)
            caps = np.maximum(2 * have + 2, 4)
        counts, ci = cpsat_step(tab, items, n, hint, effort=remaining, clock=clock, seed=seed, opts=opts, group_caps=caps)
        info.update(ci)
        info["buckets"] = int(len(items.seqs) - min(SINGLE_ITEMS, idx.size)) if bucketed else 0
        if counts is not None:
            g2 = _counts_to_groups(counts, items, tab)
            if bucketed:
                g2 = refine(g2, tab, n, clock.now() + max(0.05, 0.2 * effort), clock)
            ms2 = makespan(g2, tab)
            info["cp_sat_ms"] = ms2
            if ms2 < best * (1 - 1e-12):
                groups, best = g2, ms2
            if items.exact and ci["cp_sat_status"] == "OPTIMAL":
                proved = True
                lb = max(lb, min(best, ci.get("bound_ms", 0.0)))
        elif items.exact and ci["cp_sat_status"] == "INFEASIBLE":
            info["infeasible"] = True
    info["effort"] = clock.now() - t0
    if groups is None:
        return None
    return StepResult(groups=[(int(tab.deg[e]), sorted(int(i) for i in m)) for e, m in groups],
                      rows=[(int(e), sorted(int(i) for i in m)) for e, m in groups],
                      makespan_ms=best, lower_bound_ms=lb, proved=proved, info=info)

def solve_one_step(lengths, cost: CostModel, *, bucketing: bool | None = False, buckets: int = 16,
                   effort: float = 10.0, seed: int = 0, opts: PlanOptions | None = None) -> StepResult | None:
    """Plan all of ``lengths`` as one micro-step on the whole cluster with ``effort`` reference
    seconds: heuristic, then CP-SAT (items are single sequences unless ``bucketing``). Returns a
    StepResult (``groups`` as ``[(degree, [sequence index, ...])]``, the slowest group's time
    without gradient sync, ``proved`` when CP-SAT proved it optimal), or None when one micro-step
    cannot hold the batch."""
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    tab = Table(s, cost)
    opts, clock = (opts or PlanOptions(effort=effort)).start()
    return solve_step(tab, np.arange(s.size), bucketing=bucketing, buckets=buckets, effort=effort, clock=clock,
                      seed=seed, opts=opts)

def min_micro_steps(tab: Table) -> int:
    """The fewest micro-steps whose memory (N x budget each) holds every sequence's least share."""
    return max(1, int(math.ceil(float(tab.share.sum()) / (tab.n_gpus * tab.budget) - 1e-9)))

def place_groups(tab: Table, groups) -> list:
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
