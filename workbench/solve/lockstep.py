"""FlexSP's problem under ZeRO-3: a step as lockstep passes, and the solver for it.

Under ZeRO-3 every rank runs the same passes together (``plan.py``): a pass lasts as long as its most
loaded rank (or FSDP's collectives), so the step is ``sum over passes of max(L_p, comm) + M *
overhead``. The problem: choose the number of passes M and, per pass, groups on aligned blocks and
the sequences each runs, so that every sequence runs once, a rank's activations in a pass fit the
budget, and that sum is least.

Two pass shapes (``Passes.multi``):

- *single* (FlexSP's own): every rank in at most one group per pass, so a pass lasts as long as its
  slowest group (its overhead, which includes the packed call's constant, plus its sequences).
- *multi*: a rank may serve several groups in a pass (on nested aligned blocks). Their tokens go
  through one packed forward and backward, so the rank pays the packed call's constant once and
  every group's own extras (collective latencies, SP layout) and sequences; it holds the activations
  of all of them. A pass ends when its most loaded *rank* ends, not its slowest group, so a rank
  whose group finishes early can take more work on a smaller degree. Single is the special case.

How ``plan_lockstep`` plans (within ``opts.effort``, counted on the plan's clock: ``effort.py``):

1. Filled starts (``fill_passes``): for M from the memory minimum ``M_min`` (the activations over N
   ranks x budget) and one more, list scheduling over all M passes at once, the sequences slowest
   alone first, each where the step grows least (plus its GPU-time over N): the pass the longest
   sequence opens fills up to its length before the others grow, each sequence at the cheapest
   degree that fits there. With floors under the passes, then again with the best start's own pass
   lengths as floors (so a sequence takes the degree that fits the passes the step will have).
2. Splits. For M from ``M_min`` up to a few more, the batch is split into M passes by three rules:
   FlexSP's (sorted by length, consecutive chunks of equal tokens), work-balanced
   (longest-processing-time on each sequence's least GPU-time, within each pass's memory) and
   memory-balanced. Every pass is planned as one micro-step by the per-micro-step heuristic of
   ``microstep`` (degrees by bottleneck raising, group counts by a divisible estimate, LPT packing,
   moves and swaps).
3. Local search on the whole step (``Passes.improve``): take the most loaded rank of the passes that
   are longer than FSDP's collectives, and move one of its sequences to the group (or a new group
   on idle ranks, or on any ranks with memory to spare when ``multi``) of any pass where the sum of
   passes falls most (every pass's new length exact, vectorised over groups and blocks); when
   nothing moves, try to empty the lightest pass into the others. Then pairs of passes are pooled
   and split again. It starts from the best start of each of the fastest pass counts and, where
   the effort allows (``IMPROVE_OTHER_MIN``), from the best start of the other kind (filled or
   split) at the leading count too: a start's length says little of where its search ends.
4. CP-SAT on the one-micro-step model (``microstep.solve_step``) for the longest passes that have
   one group per rank, warm-started from their groups, kept when a pass gets shorter.
5. With ``multi``, the local search once more with stacked groups allowed; then every group on the
   fastest split of its degree that fits its ranks (``Passes.resplit``: the search leaves a group on
   the split it opened with).

Pure numpy (and OR-Tools through ``microstep``): no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workbench.cost import CostModel
from workbench.solve.bound import lower_bound_ms
from workbench.solve.cpsat import warm_up
from workbench.solve.effort import ELEMENT_S, STEP_S, Effort, Phases
from workbench.solve.microstep import Table, heuristic_step, makespan, min_micro_steps, refine, solve_step
from workbench.solve.options import PlanOptions
from workbench.solve.plan import Plan, build_plan
from workbench.solve.rivals import MIN_SEARCH_SHARE, rival_plans

__all__ = ["Passes", "plan_lockstep", "split_passes", "MULTI_GROUP"]

MULTI_GROUP = True
"""Whether ``plan_lockstep`` lets a rank serve several groups in a pass (see the module docstring;
measured in docs/solver.md: up to 1.2% shorter steps on FlexSP's code batches, within +-1.2% at
64 GPUs x 1M tokens, so on)."""

STACK_EARLY = False
"""Whether the first local search may stack groups already (else only the last one does)."""

EXTRA_PASSES = 2
"""Splits are tried with up to this many passes above the memory minimum."""

CONSTRUCT_SHARE = 0.35
"""Share of the time limit the filled starts and the splits may take together (the first split
always completes: where the filled starts took it all, only that one runs)."""

FILL_SHARE = 0.35
"""Share of the time limit the filled starts (``fill_passes``) may take (none starts that would
overrun it)."""

FILL_PRICES = (0.0, 3.0, 10.0, 30.0)
"""Where no pass count's fill holds the step, the fills are tried again with the activations each
place holds beyond the sequence's least share (``fill_passes``' ``mem_price``) priced at these many
pass levels per budget, one after the other until one holds; the count's later fills at the price
that held. Context-parallel splits run faster and hold more: with 7B on A100-40G, 1.18x, 1.42x and
1.91x the activations at c = 2, 4 and 8 (the gathered K/V), so a fill of the fewest passes that takes
the fastest split everywhere runs out of memory a third of the way through (docs/solver.md). Only ..."""

FILL_PRICED_MAX = 4
"""... for counts of at most this many passes: there one pass more costs a quarter of the step or
more, and a priced fill that holds the fewest passes pays (64 GPUs x 1M tokens: 3-4 passes). Above
it (github's and byted's 5-15 passes at 64 GPUs x 512 sequences) the priced fills only took effort
from the splits that gave the better starts: steps up to 10.5% longer."""

FILL_EXTRA = 1
"""Filled starts are tried with up to this many passes above the memory minimum ..."""

FILL_FLOORS = (0.0, 0.8, 1.15)
"""... with every pass's floor at these shares of the level the passes but the longest would have if
the step's least GPU-time were spread evenly over them ..."""

FILL_ROUNDS = 4
"""... and up to this many times more, first with the best one's own pass lengths as floors, then
each round's (until they repeat)."""

IMPROVE_SHARE = 0.65
"""Share of the time left after the splits that the local search and the pair re-splits get."""

IMPROVE_STARTS = 3
"""They improve the best start of this many pass counts (the fastest counts first)."""

IMPROVE_OTHER_MIN = 0.4
"""... and, where that leaves every start at least this much effort with one start more, the best
start of the other kind (a fill where a split or a rival leads, and the reverse) at the leading
start's pass count, second. A start's own length says little of where its search ends: on FlexSP's
code 1 batch (four passes, every one nearly full) the fill at the highest floors starts 4% behind
the consecutive split (9,594 against 9,209 ms) and ends 1% ahead of it (8,909 after 0.4 units,
where the split's search ends at 8,972 after 4)."""

CPSAT_SHARE = 0.5
"""Share of the time left after the first local search that CP-SAT on the longest passes gets."""

LAYOUT_MAX_SEQS = 96
"""Passes of at most this many sequences are also tried on fixed two-degree layouts (``_layout_pass``)."""

SWAP_CANDIDATES = 8
"""The local search tries swaps for this many sequences of a pass's most loaded rank (longest first)."""

SWAP_GROUPS = 256
"""... against this many groups at most (those with the most slack in their pass first)."""

_EPS = 1e-9


# ------------------------------------------------------------------------------------------------
# passes on aligned blocks
# ------------------------------------------------------------------------------------------------


class Passes:
    """Groups of a lockstep step: per group its pass, degree index ``e`` (into ``tab.deg``), block
    ``b`` (ranks ``[b*d, (b+1)*d)``) and sequences; per pass and rank the summed group extras and
    sequence times (``load``, without the packed call's constant), the number of groups (``cnt``)
    and the activations (``mem``). ``tab`` is a ``microstep.Table`` of the step's lengths."""

    clock: Effort | None = None
    """The plan's effort clock while ``improve`` runs (charged for every move weighed)."""

    def __init__(self, tab, cost: CostModel, *, multi: bool) -> None:
        self.tab = tab
        self.n = int(tab.n_gpus)
        self.d = [int(x) for x in tab.deg]
        self.D = len(self.d)
        self.C = float(cost.call_overhead_ms())
        self.extra = np.asarray(tab.over, dtype=np.float64) - self.C  # per degree index
        self.comm = float(cost.pass_comm_ms())
        self.ovh = float(cost.pass_overhead_ms())
        self.multi = bool(multi)
        self.budget = float(tab.budget) * (1 + 1e-12)
        self.load: list[np.ndarray] = []
        self.cnt: list[np.ndarray] = []
        self.mem: list[np.ndarray] = []
        self.g_p: list[int] = []
        self.g_e: list[int] = []
        self.g_b: list[int] = []
        self.g_members: list[list[int]] = []
        self.g_alive: list[bool] = []
        self.p_groups: list[set] = []  # live groups per pass
        self.where = np.full(tab.s.size, -1, dtype=np.int64)
        degs = np.unique(np.asarray(self.d))
        self._levels = degs  # the distinct degrees, and each row's index among them
        self._lv = np.searchsorted(degs, np.asarray(self.d))
        self._lv_off = np.concatenate([[0], np.cumsum(self.n // degs)])  # a level's blocks in a flat array

    # ---- building ---------------------------------------------------------------------------------
    def new_pass(self) -> int:
        self.load.append(np.zeros(self.n))
        self.cnt.append(np.zeros(self.n, dtype=np.int64))
        self.mem.append(np.zeros(self.n))
        self.p_groups.append(set())
        return len(self.load) - 1

    def add_group(self, p: int, e: int, b: int, members) -> int:
        """A group of degree index ``e`` on block ``b`` of pass ``p`` running ``members``."""
        g = len(self.g_p)
        members = [int(i) for i in members]
        self.g_p.append(int(p))
        self.g_e.append(int(e))
        self.g_b.append(int(b))
        self.g_members.append(members)
        self.g_alive.append(True)
        self.p_groups[p].add(g)
        r = self._ranks(e, b)
        self.load[p][r] += self.extra[e] + float(self.tab.t[e, members].sum())
        self.cnt[p][r] += 1
        self.mem[p][r] += float(self.tab.mem[e, members].sum())
        self.where[members] = g
        return g

    @classmethod
    def from_passes(cls, tab, cost: CostModel, passes, *, multi: bool) -> "Passes":
        """From a list of passes, each either ``[(e, members), ...]`` (single-group: placed on the lowest
        free aligned blocks, larger degrees first) or ``[(e, b, members), ...]`` (blocks given)."""
        ps = cls(tab, cost, multi=multi)
        for groups in passes:
            groups = [g for g in groups if len(g[-1])]
            if not groups:
                continue
            p = ps.new_pass()
            if len(groups[0]) == 3:
                for e, b, mem in groups:
                    ps.add_group(p, e, b, mem)
                continue
            used = np.zeros(ps.n, dtype=bool)
            for e, mem in sorted(groups, key=lambda g: -ps.d[g[0]]):
                d = ps.d[e]
                free = ~used[: (ps.n // d) * d].reshape(-1, d).any(axis=1)
                b = int(np.argmax(free))
                if not free[b]:
                    raise ValueError(f"a pass's groups need more than {ps.n} ranks")
                used[b * d:(b + 1) * d] = True
                ps.add_group(p, e, b, mem)
        return ps

    def copy(self) -> "Passes":
        out = Passes.__new__(Passes)
        out.__dict__.update(self.__dict__)
        out.load = [x.copy() for x in self.load]
        out.cnt = [x.copy() for x in self.cnt]
        out.mem = [x.copy() for x in self.mem]
        out.g_p, out.g_e, out.g_b = list(self.g_p), list(self.g_e), list(self.g_b)
        out.g_members = [list(m) for m in self.g_members]
        out.g_alive = list(self.g_alive)
        out.p_groups = [set(x) for x in self.p_groups]
        out.where = self.where.copy()
        return out

    # ---- reading ----------------------------------------------------------------------------------
    def _ranks(self, e: int, b: int) -> slice:
        d = self.d[e]
        return slice(b * d, (b + 1) * d)

    def rank_loads(self, p: int) -> np.ndarray:
        """Every rank's load in pass ``p`` (ms), the packed call's constant included when busy."""
        return self.load[p] + self.C * (self.cnt[p] > 0)

    def pass_len(self, p: int) -> float:
        """Pass ``p``'s largest rank load (0 for an empty pass)."""
        return float(self.rank_loads(p).max()) if self.cnt[p].any() else 0.0

    def pass_cost(self, p: int) -> float:
        """What pass ``p`` adds to the step: ``max(L_p, comm) + overhead``, 0 when it is empty."""
        return self._cost_of(self.pass_len(p)) if self.cnt[p].any() else 0.0

    def _cost_of(self, length: float) -> float:
        return max(length, self.comm) + self.ovh

    def step_ms(self) -> float:
        """The step's compute time: the sum of its non-empty passes."""
        return float(sum(self.pass_cost(p) for p in range(len(self.load))))

    def passes(self) -> list[int]:
        """Indices of the non-empty passes."""
        return [p for p in range(len(self.load)) if self.cnt[p].any()]

    def groups(self, p: int | None = None) -> list[int]:
        """Live groups (of pass ``p``)."""
        if p is None:
            return [g for g in range(len(self.g_p)) if self.g_alive[g]]
        return sorted(self.p_groups[p])

    def assignment(self):
        """``(micro_steps, blocks)`` for ``build_plan``: per non-empty pass its groups as ``(degree,
        members, cp)`` and their block indices."""
        micro, blocks = [], []
        for p in self.passes():
            gs = sorted(self.groups(p), key=lambda g: (-self.d[self.g_e[g]], self.g_b[g]))
            micro.append([(self.d[self.g_e[g]], sorted(self.g_members[g]), int(self.tab.cp[self.g_e[g]])) for g in gs])
            blocks.append([self.g_b[g] for g in gs])
        return micro, blocks

    def check(self) -> None:
        """Raise AssertionError when the cached loads or memories disagree with the groups (tests)."""
        for p in range(len(self.load)):
            load, cnt, mem = np.zeros(self.n), np.zeros(self.n, dtype=np.int64), np.zeros(self.n)
            for g in self.groups(p):
                e, r, m = self.g_e[g], self._ranks(self.g_e[g], self.g_b[g]), self.g_members[g]
                load[r] += self.extra[e] + self.tab.t[e, m].sum()
                cnt[r] += 1
                mem[r] += self.tab.mem[e, m].sum()
            assert np.allclose(load, self.load[p]) and (cnt == self.cnt[p]).all() and np.allclose(mem, self.mem[p])
            if not self.multi:
                assert (cnt <= 1).all()
            assert (mem <= self.budget * (1 + 1e-9)).all()

    # ---- moves -------------------------------------------------------------------------------------
    def resplit(self) -> int:
        """Put every group on the fastest split of its degree that holds its sequences within its
        ranks' memory (its block, its pass and its sequences unchanged), and return how many moved.
        A group's part of its ranks' loads only falls, so no pass gets longer: under ``auto`` the
        search moves sequences between groups and its groups keep the split they opened with."""
        tab = self.tab
        moved = 0
        for g in self.groups():
            e, m = self.g_e[g], self.g_members[g]
            if self.clock is not None:
                self.clock.tick(elements=4 * self.D * len(m), steps=8)
            p, r = self.g_p[g], self._ranks(e, self.g_b[g])
            rows = np.flatnonzero((tab.deg == tab.deg[e]) & tab.ok[:, m].all(axis=1))
            if rows.size < 2:
                continue
            own = self.extra[rows] + tab.t[np.ix_(rows, m)].sum(axis=1)
            act = tab.mem[np.ix_(rows, m)].sum(axis=1)
            k = int(np.flatnonzero(rows == e)[0])
            room = self.budget - (self.mem[p][r].max() - act[k])
            fits = act <= room
            fits[k] = True
            best = int(np.argmin(np.where(fits, own, np.inf)))
            if own[best] >= own[k] * (1 - 1e-12):
                continue
            self.load[p][r] += own[best] - own[k]
            self.mem[p][r] += act[best] - act[k]
            self.g_e[g] = int(rows[best])
            moved += 1
        return moved

    def _remove(self, i: int) -> None:
        g = int(self.where[i])
        p, e = self.g_p[g], self.g_e[g]
        r = self._ranks(e, self.g_b[g])
        self.g_members[g].remove(i)
        self.load[p][r] -= self.tab.t[e, i]
        self.mem[p][r] -= self.tab.mem[e, i]
        self.where[i] = -1
        if not self.g_members[g]:
            self.g_alive[g] = False
            self.p_groups[p].discard(g)
            self.load[p][r] -= self.extra[e]
            self.cnt[p][r] -= 1
            self.mem[p][r] = np.where(self.cnt[p][r] == 0, 0.0, self.mem[p][r])  # no float dust

    def _insert(self, i: int, g: int) -> None:
        p, e = self.g_p[g], self.g_e[g]
        r = self._ranks(e, self.g_b[g])
        self.g_members[g].append(int(i))
        self.load[p][r] += self.tab.t[e, i]
        self.mem[p][r] += self.tab.mem[e, i]
        self.where[i] = g

    def _source_after(self, i: int) -> tuple[int, np.ndarray, bool]:
        """Pass of ``i`` and its rank loads once ``i`` left (and whether its group then vanishes)."""
        g = int(self.where[i])
        p, e = self.g_p[g], self.g_e[g]
        r = self._ranks(e, self.g_b[g])
        load = self.load[p].copy()
        cnt = self.cnt[p].copy()
        load[r] -= self.tab.t[e, i]
        gone = len(self.g_members[g]) == 1
        if gone:
            load[r] -= self.extra[e]
            cnt[r] -= 1
        return p, load + self.C * (cnt > 0), gone

    def _level_max(self, x: np.ndarray) -> np.ndarray:
        """Per aligned block of every degree, the largest of ``x`` over its ranks: one flat array, the
        blocks of degree level v at ``_lv_off[v]:_lv_off[v + 1]``."""
        return np.concatenate([x[: (self.n // int(d)) * int(d)].reshape(-1, int(d)).max(axis=1) for d in self._levels])

    def _place(self, i: int, q: int, rl: np.ndarray, mem: np.ndarray | None = None, cnt: np.ndarray | None = None,
               skip: int = -1):
        """The best place for ``i`` in pass ``q`` and the pass's largest rank load once it is there:
        ``(kind, group or (e, b), new_len)`` (``join`` an existing group before ``new`` on ties), or
        None. ``rl``, ``mem``, ``cnt``: the pass's rank loads, activations and group counts (default
        its own; ``i``'s own pass gives them with ``i`` removed, and ``skip``, its group)."""
        tab = self.tab
        n = self.n
        mem = self.mem[q] if mem is None else mem
        cnt = self.cnt[q] if cnt is None else cnt
        gs = [g for g in self.p_groups[q] if g != skip]
        if self.clock is not None:
            self.clock.tick(elements=(8 + 2 * self.D) * n + 12 * len(gs), steps=3 + 0.5 * self.D + 0.025 * len(gs))
        pre = np.maximum.accumulate(rl)
        suf = np.maximum.accumulate(rl[::-1])[::-1]
        idle = cnt <= 0
        f_rl, f_mem = self._level_max(rl), self._level_max(mem)
        best = None
        if gs:
            gs.sort()
            ga = np.asarray(gs)
            ge = np.asarray([self.g_e[g] for g in gs])
            gb = np.asarray([self.g_b[g] for g in gs])
            lv = self._lv[ge]
            d = self._levels[lv]
            f = self._lv_off[lv] + gb
            ok = tab.ok[ge, i] & (f_mem[f] + tab.mem[ge, i] <= self.budget)
            if ok.any():
                lo, hi = gb * d, gb * d + d
                out = np.maximum(np.where(lo > 0, pre[np.maximum(lo - 1, 0)], 0.0),
                                 np.where(hi < n, suf[np.minimum(hi, n - 1)], 0.0))
                new = np.where(ok, np.maximum(out, f_rl[f] + tab.t[ge, i]), np.inf)
                k = int(np.argmin(new))
                best = ("join", int(ga[k]), float(new[k]))
        f_free = self._level_max((~idle).astype(np.float64)) if not self.multi else None
        f_rlc = self._level_max(rl + self.C * idle)
        for e in np.flatnonzero(tab.ok[:, i]):
            v = int(self._lv[e])
            d = int(self._levels[v])
            sl = slice(int(self._lv_off[v]), int(self._lv_off[v + 1]))
            room = (f_mem[sl] + tab.mem[e, i] <= self.budget) if self.multi else (f_free[sl] == 0)
            if not room.any():
                continue
            lo = np.arange(room.size) * d
            hi = lo + d
            out = np.maximum(np.where(lo > 0, pre[np.maximum(lo - 1, 0)], 0.0),
                             np.where(hi < n, suf[np.minimum(hi, n - 1)], 0.0))
            new = np.where(room, np.maximum(out, f_rlc[sl] + self.extra[e] + tab.t[e, i]), np.inf)
            b = int(np.argmin(new))
            if best is None or new[b] < best[2]:
                best = ("new", (int(e), b), float(new[b]))
        return best

    def apply(self, i: int, kind: str, where, q: int) -> None:
        """Move sequence ``i`` into group ``where`` (``kind`` ``join``) or into a new group ``where =
        (e, b)`` of pass ``q`` (``kind`` ``new``)."""
        self._remove(i)
        if kind == "join":
            self._insert(i, int(where))
        else:
            e, b = where
            self.add_group(q, e, b, [i])

    def best_move(self, i: int):
        """The move of sequence ``i`` that lowers the step most: ``(delta_ms, kind, where, pass)`` or
        None. Every pass's new length is exact (its largest rank load once ``i`` is there and gone)."""
        p, rl_src, gone = self._source_after(i)
        g0 = int(self.where[i])
        base_p = self.pass_cost(p)
        new_p = 0.0 if self._pass_empty_after(i) else self._cost_of(float(rl_src.max()))
        e0, r0 = self.g_e[g0], self._ranks(self.g_e[g0], self.g_b[g0])
        mem = self.mem[p].copy()
        mem[r0] -= self.tab.mem[e0, i]
        cnt = self.cnt[p].copy()
        if gone:
            cnt[r0] -= 1
        best = None
        for q in self.passes():
            if q == p:
                mv = self._place(i, q, rl_src, mem, cnt, skip=g0)
                if mv is not None:
                    delta = self._cost_of(mv[2]) - base_p
                    if best is None or delta < best[0]:
                        best = (delta, mv[0], mv[1], q)
                continue
            mv = self._place(i, q, self.rank_loads(q))
            if mv is not None:
                delta = (new_p - base_p) + (self._cost_of(mv[2]) - self.pass_cost(q))
                if best is None or delta < best[0]:
                    best = (delta, mv[0], mv[1], q)
        return best

    def best_swap(self, i: int, limit_groups: int | None = None):
        """The swap of sequence ``i`` with a sequence of another group (any pass) that lowers the
        step most: ``(delta_ms, j)`` or None. Both groups keep their degrees and blocks; the pass
        lengths are exact when the groups are in different passes and recomputed when they share
        one. ``limit_groups``: look at this many groups at most (those of the other passes with the
        most slack first)."""
        tab = self.tab
        n = self.n
        g = int(self.where[i])
        p, eg = self.g_p[g], self.g_e[g]
        rg = self._ranks(eg, self.g_b[g])
        passes = self.passes()
        rl = {q: self.rank_loads(q) for q in passes}
        length = {q: float(rl[q].max()) for q in passes}
        f_rl = {q: self._level_max(rl[q]) for q in passes}
        f_mem = {q: self._level_max(self.mem[q]) for q in passes}
        pre = {q: np.maximum.accumulate(rl[q]) for q in passes}
        suf = {q: np.maximum.accumulate(rl[q][::-1])[::-1] for q in passes}

        def outside(q: int, r: slice) -> float:
            a = pre[q][r.start - 1] if r.start > 0 else 0.0
            b = suf[q][r.stop] if r.stop < n else 0.0
            return float(max(a, b))

        rl_p = rl[p]
        a_p = outside(p, rg)
        b_p = float(rl_p[rg].max())
        mem_g = float(self.mem[p][rg].max()) - tab.mem[eg, i]
        base_p = self.pass_cost(p)
        best = None
        groups = [h for h in self.groups() if h != g]
        if self.clock is not None:
            self.clock.tick(elements=8 * self.tab.s.size + 6 * len(groups) + 4 * n * len(passes),
                            steps=2 * len(passes) + 0.6 * min(len(groups), limit_groups or len(groups))
                            + 0.05 * len(groups))
        flat = {h: int(self._lv_off[self._lv[self.g_e[h]]]) + self.g_b[h] for h in groups}
        if limit_groups is not None and len(groups) > limit_groups:
            slack = [length[self.g_p[h]] - float(f_rl[self.g_p[h]][flat[h]]) for h in groups]
            groups = [groups[k] for k in np.argsort(slack)[::-1][:limit_groups]]
        for h in groups:
            q, eh = self.g_p[h], self.g_e[h]
            if not tab.ok[eh, i]:
                continue
            js = np.asarray(self.g_members[h], dtype=np.int64)
            rh = self._ranks(eh, self.g_b[h])
            ok = tab.ok[eg, js] & (mem_g + tab.mem[eg, js] <= self.budget)
            ok &= float(f_mem[q][flat[h]]) - tab.mem[eh, js] + tab.mem[eh, i] <= self.budget
            if not ok.any():
                continue
            dg = tab.t[eg, js] - tab.t[eg, i]
            dh = tab.t[eh, i] - tab.t[eh, js]
            if q != p:
                a_q = outside(q, rh)
                b_q = float(f_rl[q][flat[h]])
                lp = np.maximum(a_p, b_p + dg)
                lq = np.maximum(a_q, b_q + dh)
                delta = (np.maximum(lp, self.comm) - max(length[p], self.comm)
                         + np.maximum(lq, self.comm) - max(length[q], self.comm))
            else:
                if rg.start < rh.stop and rh.start < rg.stop:
                    continue  # nested blocks of one pass: a swap moves both ways on shared ranks
                load = rl_p.copy()
                delta = np.full(js.size, np.inf)
                for k in np.flatnonzero(ok):
                    load[rg] = rl_p[rg] + dg[k]
                    load[rh] = rl_p[rh] + dh[k]
                    delta[k] = self._cost_of(float(load.max())) - base_p
            delta = np.where(ok, delta, np.inf)
            k = int(np.argmin(delta))
            if np.isfinite(delta[k]) and (best is None or delta[k] < best[0]):
                best = (float(delta[k]), int(js[k]))
        return best

    def swap(self, i: int, j: int) -> None:
        """Exchange sequences ``i`` and ``j`` between their groups."""
        g, h = int(self.where[i]), int(self.where[j])
        for x, frm in ((i, g), (j, h)):
            e, r = self.g_e[frm], self._ranks(self.g_e[frm], self.g_b[frm])
            self.g_members[frm].remove(x)
            self.load[self.g_p[frm]][r] -= self.tab.t[e, x]
            self.mem[self.g_p[frm]][r] -= self.tab.mem[e, x]
        self._insert(i, h)
        self._insert(j, g)

    def _pass_empty_after(self, i: int) -> bool:
        g = int(self.where[i])
        p = self.g_p[g]
        return len(self.g_members[g]) == 1 and int(self.cnt[p].sum()) == self.d[self.g_e[g]]

    def improve(self, deadline: float, clock: Effort, cancel=None, max_iter: int = 100_000) -> int:
        """Local search (module docstring, step 2) until nothing improves or the ``clock`` (charged
        for every move weighed) passes ``deadline``; returns the number of moves made."""
        self.clock = clock
        moves = 0
        for it in range(max_iter):
            if clock.past(deadline):
                break
            if cancel is not None and it % 8 == 0:
                cancel()
            if self._improve_once(deadline):
                moves += 1
                continue
            if clock.past(deadline):
                break
            if self._eject_lightest(deadline):
                moves += 1
                continue
            break
        return moves

    def _improve_once(self, deadline: float = math.inf) -> bool:
        order = sorted(self.passes(), key=lambda p: -self.pass_len(p))
        for p in order:
            if self.clock is not None and self.clock.past(deadline):
                return False
            if self.pass_len(p) <= self.comm * (1 + _EPS):
                break  # FSDP's collectives set these passes' length: shorter compute gains nothing
            rl = self.rank_loads(p)
            top = float(rl.max())
            crit = np.flatnonzero(rl >= top * (1 - 1e-12))
            r = int(crit[0])
            cands = []
            for g in self.groups(p):
                sl = self._ranks(self.g_e[g], self.g_b[g])
                if sl.start <= r < sl.stop:
                    e = self.g_e[g]
                    cands.extend((float(self.tab.t[e, i]), i) for i in self.g_members[g])
            cands.sort(reverse=True)
            for k, (_, i) in enumerate(cands):
                if k % 8 == 7 and self.clock is not None and self.clock.past(deadline):
                    return False
                mv = self.best_move(i)
                if mv is not None and mv[0] < -_EPS * max(1.0, top):
                    delta, kind, where, q = mv
                    self.apply(i, kind, where, q)
                    return True
            for _, i in cands[:SWAP_CANDIDATES]:
                sw = self.best_swap(i, limit_groups=SWAP_GROUPS)
                if sw is not None and sw[0] < -_EPS * max(1.0, top):
                    self.swap(i, sw[1])
                    return True
        return False

    def _eject_lightest(self, deadline: float) -> bool:
        """Empty the pass whose removal saves most (its cost) into the others, move by move, when
        the step gets shorter; undone otherwise."""
        ps = self.passes()
        if len(ps) <= 1:
            return False
        p = min(ps, key=lambda q: float(self.mem[q].sum()))
        trial = self.copy()
        members = sorted((i for g in trial.groups(p) for i in trial.g_members[g]),
                         key=lambda i: -float(trial.tab.share[i]))
        before = self.step_ms()
        for i in members:
            if self.clock is not None and self.clock.past(deadline):
                return False
            best = None
            src, _, _ = trial._source_after(i)
            for q in trial.passes():
                if q == src:
                    continue
                mv = trial._place(i, q, trial.rank_loads(q))
                if mv is not None:
                    delta = trial._cost_of(mv[2]) - trial.pass_cost(q)
                    if best is None or delta < best[0]:
                        best = (delta, mv[0], mv[1], q)
            if best is None:
                return False
            trial.apply(i, best[1], best[2], best[3])
        if trial.step_ms() < before * (1 - 1e-12):
            self.__dict__.update(trial.__dict__)
            return True
        return False


# ------------------------------------------------------------------------------------------------
# filling passes: list scheduling over every pass at once
# ------------------------------------------------------------------------------------------------


def fill_cost(tab, M: int) -> float:
    """The effort ``fill_passes`` charges for M passes, at most (reference seconds)."""
    n = int(tab.n_gpus)
    degs = np.unique(tab.deg)
    F = M * int((n // degs).sum())
    per = (4 * F + 6 * tab.s.size + 5 * n * degs.size) * ELEMENT_S + (6 + 0.5 * degs.size) * STEP_S
    return float(tab.s.size * per)


def fill_passes(tab, cost: CostModel, M: int, floors, clock: Effort, *, multi: bool, order=None,
                cancel=None, mem_price: float = 0.0) -> "Passes | None":
    """List scheduling of the whole step into ``M`` passes: sequences one by one (``order``; default
    slowest alone first) each go where the step grows least, counting the GPU-time it adds over N
    besides: ``max(0, new length - allowance) + GPU-time / N``, the allowance of a pass being the
    larger of its length so far and its floor (``floors[q]``, at least ``max(C, comm)``). A sequence
    may join a group with memory room (at the group's degree and split) or open a group of any shape
    that holds it on a free aligned block (with ``multi``: on any block with memory room, stacked).
    ``mem_price`` (ms of GPU-time per GB) adds the activations a place holds beyond the sequence's
    least share (``tab.share``: a context-parallel split's gathered K/V, say), priced, to its GPU-time.
    A fill stops (None) as soon as the activations left over all ranks and passes are fewer than the
    least shares of the sequences left: no placement could hold them.
    So the pass the longest sequence opens fills up to its length before the others grow, each
    sequence at the cheapest degree that fits there. Charged to ``clock``. None when a sequence fits
    nowhere. ``cancel`` (PlanOptions.check_cancel, as ``Passes.improve`` takes it) is called every
    64 sequences: a fill of thousands of sequences takes seconds."""
    ps = Passes(tab, cost, multi=multi)
    for _ in range(M):
        ps.new_pass()
    n, C, B = ps.n, ps.C, ps.budget
    degs = np.unique(tab.deg)
    nbs = n // degs
    off = np.concatenate([[0], np.cumsum(M * nbs)])  # level v's blocks of pass q: off[v] + q * nbs[v] + b
    F = int(off[-1])
    f_load = np.zeros(F)  # per block: the largest rank load without C, its largest activations, idle ranks
    f_mem = np.zeros(F)
    f_idle = np.concatenate([np.tile(np.full(nbs[v], float(degs[v])), M) for v in range(degs.size)])
    f_busy = np.zeros(F, dtype=bool)
    f_pass = np.concatenate([np.repeat(np.arange(M), nbs[v]) for v in range(degs.size)])
    lv_of_row = np.searchsorted(degs, tab.deg)
    floor = np.maximum(np.asarray(floors, dtype=np.float64), max(C, ps.comm))
    cap_g = int(tab.s.size)
    g_flat = np.zeros(cap_g, dtype=np.int64)  # per group: its block's index in the flat arrays, row, id
    g_row = np.zeros(cap_g, dtype=np.int64)
    g_id = np.zeros(cap_g, dtype=np.int64)
    n_g = 0
    if order is None:
        order = np.lexsort((-tab.s, -tab.best_single))
    # activations left on all ranks and passes, and the least the sequences still to place need: once
    # the first is below the second, no placement can hold them all
    free, need = float(M * n * B), float(tab.share[np.asarray(order, dtype=np.int64)].sum())
    for j, i in enumerate(order):
        i = int(i)
        if cancel is not None and j % 64 == 63:
            cancel()
        if free < need * (1 - 1e-9):
            return None
        clock.tick(elements=4 * F + 6 * n_g + 5 * n * degs.size, steps=6 + 0.5 * int(tab.ok[:, i].sum()))
        rl_pass = np.array([float(ps.rank_loads(q).max()) if ps.cnt[q].any() else 0.0 for q in range(M)])
        cap = np.maximum(rl_pass, floor)
        best = None
        # joins
        if n_g:
            gf, ge = g_flat[:n_g], g_row[:n_g]
            ok = tab.ok[ge, i] & (f_mem[gf] + tab.mem[ge, i] <= B)
            if ok.any():
                new = f_load[gf] + C + tab.t[ge, i]
                over = np.maximum(0.0, new - cap[f_pass[gf]])
                waste = mem_price * (tab.deg[ge] * tab.mem[ge, i] - tab.share[i])
                score = np.where(ok, over + (tab.deg[ge] * tab.t[ge, i] + waste) / n, np.inf)
                k = int(np.argmin(score + 1e-12 * new))
                key = (float(score[k]), float(new[k] - cap[f_pass[gf[k]]]))
                if best is None or key < best[0]:
                    best = (key, "join", k)
        # new groups
        for e in np.flatnonzero(tab.ok[:, i]):
            v = int(lv_of_row[e])
            d = int(degs[v])
            sl = slice(int(off[v]), int(off[v + 1]))
            t, m = float(tab.t[e, i]), float(tab.mem[e, i])
            room = (f_mem[sl] + m <= B) if multi else ~f_busy[sl]
            if not room.any():
                continue
            new = f_load[sl] + C + ps.extra[e] + t
            over = np.maximum(0.0, new - cap[f_pass[sl]])
            waste = mem_price * (d * m - float(tab.share[i]))
            score = np.where(room, over + (d * (ps.extra[e] + t) + C * f_idle[sl] + waste) / n, np.inf)
            k = int(np.argmin(score + 1e-12 * new))
            key = (float(score[k]), float(new[k] - cap[f_pass[sl][k]]))
            if best is None or key < best[0]:
                best = (key, "new", (int(e), int(off[v]) + k))
        if best is None:
            return None
        _, kind, where = best
        need -= float(tab.share[i])
        if kind == "join":
            g = int(g_id[where])
            free -= float(tab.deg[g_row[where]] * tab.mem[g_row[where], i])
            ps._insert(i, g)
            q = ps.g_p[g]
        else:
            e, f = where
            free -= float(tab.deg[e] * tab.mem[e, i])
            v = int(lv_of_row[e])
            q, b = divmod(f - int(off[v]), int(nbs[v]))
            g = ps.add_group(q, e, b, [i])
            g_id[n_g], g_flat[n_g], g_row[n_g] = g, f, e
            n_g += 1
        # the pass's blocks at every level again
        load, mem, busy = ps.load[q], ps.mem[q], ps.cnt[q] > 0
        for v in range(degs.size):
            d, nb = int(degs[v]), int(nbs[v])
            a = int(off[v]) + q * nb
            f_load[a:a + nb] = load[: nb * d].reshape(nb, d).max(axis=1)
            f_mem[a:a + nb] = mem[: nb * d].reshape(nb, d).max(axis=1)
            bb = busy[: nb * d].reshape(nb, d)
            f_busy[a:a + nb] = bb.any(axis=1)
            f_idle[a:a + nb] = d - bb.sum(axis=1)
    return ps


# ------------------------------------------------------------------------------------------------
# splitting a batch into passes
# ------------------------------------------------------------------------------------------------


def split_passes(tab, M: int, rule: str, clock: Effort | None = None) -> list[np.ndarray] | None:
    """Sequence indices of each of ``M`` passes by ``rule``: ``consecutive`` (FlexSP's: sorted by
    length, M consecutive chunks of about equal tokens), ``work`` (longest-processing-time on each
    sequence's least GPU-time, into the pass with the least work among those with memory room) or
    ``memory`` (the same on activations). None when a rule leaves a pass over its memory."""
    s = tab.s
    cap = tab.n_gpus * tab.budget
    share = tab.share
    if rule == "consecutive":
        order = np.argsort(-s, kind="stable")
        cum = np.cumsum(share[order])
        total = float(cum[-1])
        cuts = [int(np.searchsorted(cum, total * k / M, side="left")) for k in range(1, M)]
        parts = np.split(order, cuts)
        if any(float(share[q].sum()) > cap * (1 + 1e-9) for q in parts):
            return None
        return [q for q in parts if q.size]
    if clock is not None:
        clock.tick(elements=4 * M * s.size, steps=0.2 * s.size)  # a few numpy calls per sequence
    key = tab.best_work if rule == "work" else share
    work = np.zeros(M)
    memw = np.zeros(M)
    out: list[list[int]] = [[] for _ in range(M)]
    for i in np.argsort(-key, kind="stable"):
        room = memw + share[i] <= cap * (1 + 1e-9)
        if not room.any():
            return None
        p = int(np.flatnonzero(room)[np.argmin((work if rule == "work" else memw)[room])])
        out[p].append(int(i))
        work[p] += tab.best_work[i]
        memw[p] += share[i]
    return [np.array(o, dtype=np.int64) for o in out if o]


def _two_way_splits(tab, idx: np.ndarray, current: np.ndarray):
    """Ways to split the sequences ``idx`` of two passes into two (``current``: the indices the
    first pass holds now): by length, the longest ones first, at the point of equal activations and
    a few points around it; and longest-processing-time on time with memory caps. Yields index
    arrays of the first pass."""
    order = idx[np.argsort(-tab.s[idx], kind="stable")]
    cum = np.cumsum(tab.share[order])
    k_eq = int(np.searchsorted(cum, cum[-1] / 2))
    k_cur = int(np.isin(order, current).sum())
    seen = set()
    for k in (k_eq, k_cur - 1, k_cur + 1, k_eq - 2, k_eq + 2, k_cur - 3, k_cur + 3, k_eq - 6, k_eq + 6):
        if 0 < k < order.size and k not in seen:
            seen.add(k)
            yield order[:k]
    cap = tab.n_gpus * tab.budget
    load, memw = np.zeros(2), np.zeros(2)
    first: list[int] = []
    for i in idx[np.argsort(-tab.best_work[idx], kind="stable")]:
        room = memw + tab.share[i] <= cap * (1 + 1e-9)
        if not room.any():
            return
        k = int(np.flatnonzero(room)[np.argmin(load[room])])
        load[k] += tab.best_work[i]
        memw[k] += tab.share[i]
        if k == 0:
            first.append(int(i))
    yield np.array(first, dtype=np.int64)


def _resplit_pair(ps: "Passes", cost: CostModel, p: int, q: int, deadline: float, clock: Effort) -> "Passes | None":
    """Pool passes ``p`` and ``q`` and split them again (``_two_way_splits``), each half planned as
    one pass; the stack with the shortest pair, when shorter than now, else None."""
    tab = ps.tab
    a = np.array(sorted(i for g in ps.groups(p) for i in ps.g_members[g]), dtype=np.int64)
    b = np.array(sorted(i for g in ps.groups(q) for i in ps.g_members[g]), dtype=np.int64)
    pool = np.concatenate([a, b])
    now = ps.pass_cost(p) + ps.pass_cost(q)
    best, best_ms = None, now * (1 - 1e-9)
    for first in _two_way_splits(tab, pool, a):
        if clock.past(deadline):
            break
        second = np.setdiff1d(pool, first)
        if first.size == 0 or second.size == 0:
            continue
        halves = []
        for part in (first, second):
            g = _plan_pass(tab, part, deadline, clock)
            if g is None:
                break
            halves.append(g)
        if len(halves) < 2:
            continue
        ms = sum(ps._cost_of(max(float(tab.over[e] + tab.t[e, m].sum()) for e, m in g)) for g in halves)
        if ms < best_ms:
            best, best_ms = halves, ms
    if best is None:
        return None
    rebuilt = [[(ps.g_e[g], ps.g_b[g], list(ps.g_members[g])) for g in ps.groups(r)] for r in ps.passes()
               if r not in (p, q)]
    return Passes.from_passes(tab, cost, rebuilt + [list(h) for h in best], multi=ps.multi)


def _pair_search(ps: "Passes", cost: CostModel, deadline: float, clock: Effort, cancel=None) -> tuple["Passes", int]:
    """Re-split pairs of passes (``_resplit_pair``) until no pair gets shorter or ``deadline``:
    neighbours by their longest sequence first (splits by length make them the likeliest to trade),
    then every pair. Returns the passes and the number of pairs re-split."""
    done = 0
    improved = True
    while improved and not clock.past(deadline):
        improved = False
        order = sorted(ps.passes(), key=lambda r: -max(int(ps.tab.s[i]) for g in ps.groups(r) for i in ps.g_members[g]))
        pairs = list(zip(order, order[1:])) + [(x, y) for k, x in enumerate(order) for y in order[k + 2:]]
        for p, q in pairs:
            if clock.past(deadline):
                break
            if cancel is not None:
                cancel()
            new = _resplit_pair(ps, cost, p, q, deadline, clock)
            if new is not None:
                ps, improved = new, True
                done += 1
                break
    return ps, done


def _layout_pass(tab, idx: np.ndarray, clock: Effort):
    """One pass of sequences ``idx`` on fixed layouts: ``a`` groups of a wide degree and the rest of
    the ranks in groups of a narrower one (or all of one degree); sequences, longest first, each to
    the group where it would finish first among those with memory room. The fastest layout's groups
    ``[(e, members)]``, or None when no layout holds them. When memory binds, the per-micro-step
    heuristic (which raises degrees one sequence at a time) misses what these find: a wide group
    holding the longest sequence *and* others in its spare memory. Each degree takes the one split
    that runs the pass's sequences fastest in all (where it holds them)."""
    n = int(tab.n_gpus)
    order = idx[np.argsort(-(tab.t[0, idx] if tab.ok[0, idx].all() else tab.best_single[idx]), kind="stable")]
    dmin = int(tab.deg[tab.dmin[order[0]]])
    best, best_ms = None, math.inf
    # one row per degree: the split with the least total time over the sequences it holds, those it
    # does not hold counted at their slowest
    worst = np.where(tab.ok[:, idx], tab.t[:, idx], -np.inf).max(axis=0)
    total = np.where(tab.ok[:, idx], tab.t[:, idx], worst[None, :] * 2).sum(axis=1)
    rows = [int(r[np.argmin(total[r])]) for r in (np.flatnonzero(tab.level == lv) for lv in np.unique(tab.level))]
    layouts = []
    for k1, e1 in enumerate(rows):
        d1 = int(tab.deg[e1])
        if d1 < dmin:
            continue
        for a in (1, 2, 3):
            if a * d1 > n:
                break
            for e2 in rows[:k1 + 1]:
                d2 = int(tab.deg[e2])
                rest = n - a * d1
                layouts.append([e1] * a + [e2] * (rest // d2) if e2 != e1 else [e1] * (n // d1))
    seen = set()
    for lay in layouts:
        key = tuple(sorted(lay))
        if key in seen:
            continue
        seen.add(key)
        ge = np.asarray(lay, dtype=np.int64)
        clock.tick(elements=2 * ge.size * order.size, steps=order.size / 3)
        load = tab.over[ge].copy()
        mload = np.zeros(ge.size)
        members: list[list[int]] = [[] for _ in ge]
        ok = True
        for i in order:
            fit = tab.ok[ge, i] & (mload + tab.mem[ge, i] <= tab.budget * (1 + 1e-12))
            if not fit.any():
                ok = False
                break
            fin = np.where(fit, load + tab.t[ge, i], np.inf)
            g = int(np.argmin(fin))
            members[g].append(int(i))
            load[g] += tab.t[ge[g], i]
            mload[g] += tab.mem[ge[g], i]
            if load[g] >= best_ms:
                ok = False
                break
        if not ok:
            continue
        ms = float(max(load[g] for g in range(ge.size) if members[g]))
        if ms < best_ms:
            best, best_ms = [(int(e), m) for e, m in zip(ge, members) if m], ms
    return best


def _plan_pass(tab, idx: np.ndarray, deadline: float, clock: Effort):
    """One pass of sequences ``idx`` as single groups ``[(e, members)]``: the better of the
    per-micro-step heuristic and (for passes of at most ``LAYOUT_MAX_SEQS`` sequences) the fixed
    layouts of ``_layout_pass``, refined by moves and swaps until the ``clock`` passes ``deadline``;
    None when they do not fit one pass."""
    # what the per-micro-step heuristic does beyond its own charges grows with the cluster (measured:
    # about 1.2 us per sequence and 64 GPUs at 1024 GPUs, where the two differed by 1.9 times)
    clock.tick(elements=10 * idx.size * tab.n_gpus, steps=0)
    starts = (heuristic_step(tab, idx, tab.n_gpus, clock),
              _layout_pass(tab, idx, clock) if idx.size <= LAYOUT_MAX_SEQS else None)
    found = [refine(g, tab, tab.n_gpus, deadline, clock) for g in starts if g is not None]
    return min(found, key=lambda g: makespan(g, tab)) if found else None


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------


@dataclass
class _Cand:
    passes: Passes
    source: str

    @property
    def ms(self) -> float:
        return self.passes.step_ms()


def plan_lockstep(lengths, cost: CostModel, opts: PlanOptions | None = None, *, multi: bool | None = None,
                  cpsat: bool = True, name: str = "flexsp") -> Plan:
    """The lockstep plan of one step (module docstring): the ``flexsp`` planner under ZeRO-3.

    ``multi``: let a rank serve several groups in a pass (default ``MULTI_GROUP``); ``cpsat``: run
    CP-SAT on the longest passes. Returns a Plan never slower than the best of the splits and the
    lockstep baselines it starts from (``greedy``, ``best-static``); ``stats`` says which split won
    (``source``), the passes tried (``tried``), the starts the local search took (``searched``), its
    moves and CP-SAT's calls.
    Raises InfeasibleError when a sequence fits no group, Cancelled when cancelled, ValueError when
    the cost model is not lockstep.
    """
    if cost.execution != "lockstep":
        raise ValueError(f"plan_lockstep plans ZeRO-3 (lockstep) steps; this cost model is {cost.execution}")
    cost = cost.chain_view()  # groups on aligned blocks: one divisibility chain of the degrees
    opts, clock = (opts or PlanOptions()).start()
    multi = MULTI_GROUP if multi is None else bool(multi)
    warm_up()
    start = clock.now()
    budget = max(0.05, float(opts.effort))
    s = np.asarray(lengths, dtype=np.int64)
    cost.check_feasible(s)
    lb = lower_bound_ms(s, cost)
    tab = Table(s, cost)
    phases = Phases(clock)
    lap = phases.lap
    cp_wall = 0.0

    opts.report(0.02, "flexsp (lockstep): the other planners' plans")
    rivals = rival_plans(s, cost, opts)
    baselines = [rivals.greedy[0], rivals.best_static, *([rivals.two_stage] if rivals.two_stage is not None else [])]
    baseline = rivals.best()
    # the search's own effort: what the rivals left of the budget, and at least MIN_SEARCH_SHARE of it
    t0 = clock.now()
    limit = max(budget - (t0 - start), MIN_SEARCH_SHARE * budget)
    deadline = t0 + 0.85 * limit
    cands: list[_Cand] = []
    for p in baselines:
        groups = [[(tab.row(g.degree, g.cp), g.ranks[0] // g.degree, list(g.sequences)) for g in ms.groups]
                  for ms in p.micro_steps]
        cands.append(_Cand(Passes.from_passes(tab, cost, groups, multi=False), p.planner))
    lap("baselines")
    M0 = min_micro_steps(tab)
    tried = []
    # 1. the whole step filled at once (``fill_passes``), with floors and again with its own lengths
    opts.report(0.08, "flexsp (lockstep): filling passes")
    fill_end = t0 + FILL_SHARE * limit

    def fill_count(M: int, prices) -> bool:
        """The filled starts of M passes: the first at each of ``prices`` (indices into
        ``FILL_PRICES``) in turn until one holds, the others at the price that held, ending at the
        first that does not hold; whether any held."""
        rest = max(0.0, float(tab.best_work.sum()) / tab.n_gpus + M * float(cost.call_overhead_ms())
                   - float(tab.best_single.max()))
        level = rest / (M - 1) if M > 1 else 0.0
        floors_list = [[theta * level] * M for theta in FILL_FLOORS]
        best_fill, floors, price = None, None, prices[0]
        seen = set()
        for k in range(len(floors_list) + FILL_ROUNDS):
            if clock.past(fill_end) or clock.now() + fill_cost(tab, M) > fill_end:
                break  # (a fill that would overrun its share does not start)
            opts.check_cancel()
            if k < len(floors_list):
                floors = floors_list[k]
            elif k == len(floors_list):
                floors = best_fill[1]  # the best start's own lengths, then each round's
            if tuple(floors) in seen:
                # the same floors at the same price: the same fill (one pass, or a longest sequence
                # that outlasts the level: every share of a zero level is zero)
                continue
            seen.add(tuple(floors))
            ps = None
            for j in (prices if best_fill is None else (price,)):
                if j != prices[0] and (clock.past(fill_end) or clock.now() + fill_cost(tab, M) > fill_end):
                    break
                ps = fill_passes(tab, cost, M, floors, clock, multi=multi, cancel=opts.check_cancel,
                                 mem_price=FILL_PRICES[j] * level / tab.budget)
                if ps is not None:
                    price = j  # the count's later fills at the price that held
                    break
            if ps is None:
                break
            ms = ps.step_ms()
            tried.append({"passes": M, "rule": f"fill:{k}", "ms": ms, "price": FILL_PRICES[price],
                          "floors": [round(float(f), 3) for f in floors]})
            cands.append(_Cand(ps, f"fill:{M}:{k}"))
            lens = sorted((ps.pass_len(q) for q in range(M)), reverse=True)
            if best_fill is None or ms < best_fill[0]:
                best_fill = (ms, lens)
            if k >= len(floors_list):
                if np.allclose(lens, floors):
                    break  # its own lengths again: nothing new to find
                floors = lens
        return best_fill is not None

    # every count unpriced; where none holds, the counts of at most FILL_PRICED_MAX passes again, up
    # the price ladder
    counts = range(M0, M0 + FILL_EXTRA + 1)
    held = [fill_count(M, (0,)) for M in counts]
    if not any(held):
        for M in counts:
            if M <= FILL_PRICED_MAX:
                fill_count(M, tuple(range(1, len(FILL_PRICES))))
    lap("fill")
    # 2. splits
    opts.report(0.1, "flexsp (lockstep): splitting the batch into passes")
    construct_end = t0 + CONSTRUCT_SHARE * limit
    n_split = len(cands)
    for M in range(M0, M0 + EXTRA_PASSES + 1):
        for rule in ("consecutive", "work", "memory"):
            if len(cands) > n_split and clock.past(construct_end):
                break
            opts.check_cancel()
            parts = split_passes(tab, M, rule, clock)
            if parts is None:
                continue
            planned = []
            for idx in parts:
                opts.check_cancel()
                g = _plan_pass(tab, idx, min(deadline, clock.now() + 0.05 * limit), clock)
                if g is None:
                    planned = None
                    break
                planned.append(g)
            if planned is None:
                tried.append({"passes": M, "rule": rule, "ms": None})
                continue
            ps = Passes.from_passes(tab, cost, planned, multi=False)
            tried.append({"passes": M, "rule": rule, "ms": ps.step_ms()})
            cands.append(_Cand(ps, f"split:{rule}:{M}"))
    lap("splits")
    cands.sort(key=lambda c: c.ms)
    best = cands[0]
    moves = 0
    # 3. local search and pair re-splits on the best start of each pass count (a count above the
    # memory minimum often starts ahead, and the minimum often ends ahead)
    opts.report(0.4, "flexsp (lockstep): local search")
    improve_end = clock.now() + IMPROVE_SHARE * clock.left(deadline)
    by_count: dict[int, _Cand] = {}
    for c in cands:
        k = len(c.passes.passes())
        if k not in by_count or c.ms < by_count[k].ms:
            by_count[k] = c
    starts = sorted(by_count.values(), key=lambda c: c.ms)[:IMPROVE_STARTS]
    if starts and clock.left(improve_end) / (len(starts) + 1) >= IMPROVE_OTHER_MIN:
        lead = starts[0]
        count, kind = len(lead.passes.passes()), lead.source.startswith("fill")
        other = [c for c in cands if len(c.passes.passes()) == count and c.source.startswith("fill") != kind]
        if other:
            starts.insert(1, min(other, key=lambda c: c.ms))
    resplit = 0
    for k, c in enumerate(starts):
        left = clock.left(improve_end)
        if left <= 0:
            break
        end = clock.now() + left / (len(starts) - k)
        ps = c.passes.copy()
        ps.multi = multi and STACK_EARLY
        moves += ps.improve(clock.now() + 0.4 * clock.left(end), clock, cancel=opts.check_cancel)
        ps, n_pairs = _pair_search(ps, cost, end, clock, cancel=opts.check_cancel)
        resplit += n_pairs
        if n_pairs:
            moves += ps.improve(end, clock, cancel=opts.check_cancel)
        if ps.step_ms() < best.ms * (1 - 1e-12):
            best = _Cand(ps, c.source + ("+local-search+pairs" if n_pairs else "+local-search"))
    lap("local_search")
    # 4. CP-SAT on the longest passes (one-micro-step model, warm-started from the pass's groups)
    cp_calls = []
    if cpsat and not clock.past(deadline - 0.05):
        opts.report(0.6, "flexsp (lockstep): CP-SAT on the longest passes")
        cp_end = clock.now() + CPSAT_SHARE * clock.left(deadline)
        ps = best.passes.copy()
        order = sorted(ps.passes(), key=lambda p: -ps.pass_len(p))
        improved = False
        for k, p in enumerate(order):
            left = clock.left(cp_end) / max(1, len(order) - k)
            if left < 0.05 or ps.pass_len(p) <= ps.comm:
                break
            if (ps.cnt[p] > 1).any():
                continue  # stacked groups: the one-micro-step model has one group per rank
            gs = ps.groups(p)
            idx = np.array(sorted(i for g in gs for i in ps.g_members[g]), dtype=np.int64)
            heur = [(ps.g_e[g], list(ps.g_members[g])) for g in gs]
            r = solve_step(tab, idx, bucketing=None, buckets=16, effort=left, clock=clock, seed=opts.seed, opts=opts,
                           heuristic=heur)
            call = {"pass": int(p), "status": (r.info.get("cp_sat_status") if r is not None else "none"),
                    "dtime": float(r.info.get("dtime", 0.0)) if r is not None else 0.0,
                    "before_ms": ps.pass_len(p), "after_ms": r.makespan_ms if r is not None else None}
            cp_wall += float(r.info.get("wall_s", 0.0)) if r is not None else 0.0
            cp_calls.append(call)
            if r is not None and r.makespan_ms < ps.pass_len(p) * (1 - 1e-9):
                rebuilt = [[(ps.g_e[g], ps.g_b[g], list(ps.g_members[g])) for g in ps.groups(q)] if q != p
                           else [(e, list(m)) for e, m in r.rows] for q in ps.passes()]
                ps = Passes.from_passes(tab, cost, rebuilt, multi=False)
                improved = True
                order = sorted(ps.passes(), key=lambda q: -ps.pass_len(q))
        if improved and ps.step_ms() < best.ms * (1 - 1e-12):
            best = _Cand(ps, best.source + "+cp-sat")
        lap("cp_sat")
    # 5. stacked groups (multi) and what effort is left
    final = best.passes.copy()
    if multi:
        final.multi = True
        opts.report(0.85, "flexsp (lockstep): local search with stacked groups")
    moves += final.improve(deadline, clock, cancel=opts.check_cancel)
    improved = final.step_ms() < best.ms * (1 - 1e-12)
    # every group on its fastest split (off the critical path too: a plan says what each group runs)
    resplit_groups = final.resplit()
    if improved or (resplit_groups and final.step_ms() <= best.ms * (1 + 1e-12)):
        stacked = any((final.cnt[p] > 1).any() for p in final.passes())
        best = _Cand(final, best.source + ("+stacked" if stacked else "+local-search" if improved else "+resplit"))
    lap("final_search")
    opts.check_cancel()
    stats = {"passes": len(best.passes.passes()), "min_passes": M0, "tried": tried, "local_search_moves": moves,
             "pairs_resplit": resplit, "groups_resplit": resplit_groups, "searched": [c.source for c in starts],
             "cp_sat": cp_calls, "greedy_ms": baselines[0].makespan_ms, "best_static_ms": baselines[1].makespan_ms,
             "two_stage_ms": rivals.two_stage.makespan_ms if rivals.two_stage is not None else None,
             "multi_group": multi, "stacked_groups": int(sum(int((best.passes.cnt[p] > 1).sum())
                                                            for p in best.passes.passes())),
             "effort_phases": phases.effort, "wall": {"phases_s": phases.wall, "cp_sat_s": cp_wall}}
    grad = cost.step_end_ms()
    if best.ms + grad < baseline.makespan_ms * (1 - 1e-12):
        micro, blocks = best.passes.assignment()
        plan = build_plan(name, micro, s, cost, blocks=blocks, lower_bound=lb, status="feasible")
        stats["source"] = best.source
    else:
        plan = _replace(baseline, planner=name, status="feasible",
                        reason=f"no candidate beat {baseline.planner}'s plan; returning it")
        stats["source"] = baseline.planner
    if plan.makespan_ms <= lb * (1 + 1e-9):
        plan = _replace(plan, status="optimal", reason="the plan meets the lower bound")
    stats["gap"] = plan.makespan_ms / lb - 1.0 if lb > 0 else 0.0
    opts.report(0.99, f"flexsp (lockstep): {plan.makespan_ms:,.0f} ms in {stats['passes']} passes ({stats['source']})")
    return _replace(plan, lower_bound_ms=lb, stats=stats)


def _replace(p: Plan, **kw) -> Plan:
    import dataclasses

    return dataclasses.replace(p, **kw)
