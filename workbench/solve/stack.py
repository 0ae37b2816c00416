"""Whole-step plans as groups stacked on aligned rank blocks, their local search and their CP-SAT model.

A *stack* gives every group of a step an aligned block of ranks (degree d: ranks ``[b*d, (b+1)*d)``)
and nothing else: no micro-step index, no order. Blocks of the candidate degrees (each dividing the
next) are laminar: two blocks are disjoint or one holds the other. Each rank runs the groups on the
blocks that hold it, **larger degrees first**; then no rank ever waits, and each rank finishes at
its *load*, the summed time of the groups on its blocks.

Why (by induction over the degrees, largest first): all ranks of a block B of degree d run the same
groups before B's own ones (those on the blocks holding B: a larger aligned block holding one rank
of B holds all of B), so they reach B's groups at the same moment and run them back to back; they
finish them together, which is where the blocks inside B begin. So no group waits for a rank and
the step's compute time is ``max over ranks of load`` (``Stack.makespan_ms``). No plan on aligned
blocks does better: in any order a rank is busy at least its load. Reordering any plan this way
never slows it (``Stack.from_plan``); ``Stack.assignment`` numbers the micro-steps so that
``build_plan`` and ``plan.timeline`` replay exactly this order (tests/test_whole_step.py checks it
against ``timeline`` on random stacks).

Four tools work on stacks:

- ``Stack.greedy``: list scheduling under stack semantics. Sequences, longest first, each join a
  group with room on any block or open a new group on any block; among the options that keep the
  ranks within a target time, the one adding the least GPU-time wins. Unlike greedy's list
  scheduling (``baselines.list_schedule``), a group need not be the last on its ranks to grow.
- ``Stack.improve``: local search on the exact loads. It takes a most-loaded rank and moves one
  sequence off a group on one of its blocks (to a group with room on another block, or into a new
  group), or swaps it with a sequence elsewhere, when that brings every rank it changes below the
  current maximum; when none does, a move anywhere that saves GPU-time while every rank it raises
  stays below the maximum, or the emptying of one of the loaded rank's groups into other groups'
  spare memory. Groups left empty vanish with their overhead; a block whose sequences pack into
  fewer groups (first-fit decreasing on memory) is repacked.
- ``solve_stack``: the whole-step CP-SAT model. Per block ``(degree, b)``: the number of groups
  ``k``; the longest sequences one by one (booleans; as many as a budget of variables allows); the
  rest as length buckets counted in *tokens* (activation memory is linear in tokens, so a
  bucket's memory is exact whatever sequences carry it, and its time is the bucket's time per
  token). Per block ``tokens <= k * capacity(d)`` (plus dual-feasible bin-packing cuts on the single
  sequences), per block load ``L = k * overhead + sum of times``, per rank ``sum of L over its
  blocks <= T``; minimise T. Sibling blocks are ordered by load (symmetry). The hint is a stack
  (a feasible plan) in the model's units with its siblings put in that order, so it is a complete,
  feasible solution of the model (CP-SAT says so in its log, which ``run_cpsat`` reads). The answer
  maps back to sequences (k groups per block; bucket sequences longest first to the block furthest
  below both its bucket's token target and its load) and is then polished by ``improve``.
- ``canonical``: the same stack with sibling subtrees reordered by a key (what the hint needs).

Pure numpy + OR-Tools; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from workbench.solve.cpsat import run_cpsat
from workbench.solve.effort import Effort
from workbench.solve.microstep import bucketize

__all__ = ["Stack", "solve_stack", "StackModelInfo", "canonical"]

_TOL = 1e-9

PRESOLVE_ABOVE_S = 5.0
"""The whole-step model runs CP-SAT's presolve only with at least this much effort (reference
seconds) to search."""

SWAP_PAIRS = 200_000
"""``Stack.improve`` weighs at most this many swap pairs per degree in a round (those with the most
slack): at 64 GPUs x 8192 sequences all pairs made one round take about a second."""

GLOBAL_MOVE_ITEMS = 512
"""``Stack.improve``'s moves that save GPU-time look at this many sequences at most (the most to save)."""


# ------------------------------------------------------------------------------------------------
# the stack
# ------------------------------------------------------------------------------------------------


class Stack:
    """Groups on aligned blocks of a cost table ``tab`` (``microstep.Table``): per group its degree
    index ``e``, block ``b`` and sequences. Keeps the per-rank loads up to date."""

    def __init__(self, tab):
        self.tab = tab
        self.n = int(tab.n_gpus)
        self.D = int(tab.deg.size)
        self.d = [int(x) for x in tab.deg]
        self.nb = [self.n // d for d in self.d]
        self.load = np.zeros(self.n)  # per rank: summed time of the groups on its blocks
        self.g_e: list[int] = []
        self.g_b: list[int] = []
        self.g_mem: list[float] = []
        self.g_members: list[list[int]] = []
        self.g_alive: list[bool] = []
        self.by_block: dict[tuple[int, int], list[int]] = {}
        self.where = np.full(tab.s.size, -1, dtype=np.int64)
        self.budget = tab.budget * (1 + 1e-12)

    # ---- building ------------------------------------------------------------------------------
    @classmethod
    def from_groups(cls, tab, groups) -> "Stack":
        """A stack of ``[(degree index e, block b, [sequence, ...]), ...]``."""
        st = cls(tab)
        for e, b, mem in groups:
            if mem:
                st._add_group(int(e), int(b), [int(i) for i in mem])
        return st

    @classmethod
    def from_plan(cls, plan, tab) -> "Stack":
        """The plan's groups on their blocks (its order dropped: larger degrees first is never slower)."""
        groups = []
        for ms in plan.micro_steps:
            for g in ms.groups:
                groups.append((tab.row(g.degree, g.cp), g.ranks[0] // g.degree, list(g.sequences)))
        return cls.from_groups(tab, groups)

    def copy(self) -> "Stack":
        return Stack.from_groups(self.tab, self.groups())

    def groups(self) -> list[tuple[int, int, list[int]]]:
        """The live groups as ``(e, b, members)``."""
        return [(self.g_e[g], self.g_b[g], list(self.g_members[g])) for g in range(len(self.g_e)) if self.g_alive[g]]

    def _ranks(self, e: int, b: int) -> slice:
        return slice(b * self.d[e], (b + 1) * self.d[e])

    def _add_group(self, e: int, b: int, members: list[int]) -> int:
        tab = self.tab
        g = len(self.g_e)
        self.g_e.append(e)
        self.g_b.append(b)
        self.g_members.append(list(members))
        self.g_mem.append(float(tab.mem[e, members].sum()))
        self.g_alive.append(True)
        self.by_block.setdefault((e, b), []).append(g)
        self.where[members] = g
        self.load[self._ranks(e, b)] += float(tab.over[e] + tab.t[e, members].sum())
        return g

    def _drop_if_empty(self, g: int) -> None:
        if self.g_members[g]:
            return
        e, b = self.g_e[g], self.g_b[g]
        self.g_alive[g] = False
        self.by_block[(e, b)].remove(g)
        self.load[self._ranks(e, b)] -= float(self.tab.over[e])

    def _remove(self, i: int) -> int:
        g = int(self.where[i])
        e, b = self.g_e[g], self.g_b[g]
        self.g_members[g].remove(i)
        self.g_mem[g] -= float(self.tab.mem[e, i])
        self.load[self._ranks(e, b)] -= float(self.tab.t[e, i])
        self.where[i] = -1
        return g

    def _insert(self, i: int, g: int) -> None:
        e, b = self.g_e[g], self.g_b[g]
        self.g_members[g].append(i)
        self.g_mem[g] += float(self.tab.mem[e, i])
        self.load[self._ranks(e, b)] += float(self.tab.t[e, i])
        self.where[i] = g

    # ---- reading -------------------------------------------------------------------------------
    @property
    def makespan_ms(self) -> float:
        """The step's compute time: the largest rank load (no gradient sync)."""
        return float(self.load.max()) if self.n else 0.0

    def exact_loads(self) -> np.ndarray:
        """Per-rank loads recomputed from scratch (the incremental ones drift by rounding only)."""
        tab = self.tab
        load = np.zeros(self.n)
        for e, b, mem in self.groups():
            load[self._ranks(e, b)] += float(tab.over[e] + tab.t[e, mem].sum())
        return load

    def num_groups(self) -> int:
        return sum(self.g_alive)

    def assignment(self):
        """``(micro_steps, blocks)`` for ``build_plan``: a group's micro-step is the number of groups
        before it on its ranks, larger degrees first, so that ``build_plan`` and ``timeline`` replay
        the stack's order (and its makespan) exactly."""
        order = sorted((g for g in range(len(self.g_e)) if self.g_alive[g]),
                       key=lambda g: (-self.d[self.g_e[g]], self.g_b[g], g))
        depth = np.zeros(self.n, dtype=np.int64)
        micro: list[list] = []
        blocks: list[list[int]] = []
        for g in order:
            e, b = self.g_e[g], self.g_b[g]
            r = self._ranks(e, b)
            lv = int(depth[r].max())
            depth[r] = lv + 1
            while len(micro) <= lv:
                micro.append([])
                blocks.append([])
            micro[lv].append((self.d[e], sorted(self.g_members[g]), int(self.tab.cp[e])))
            blocks[lv].append(b)
        return micro, blocks

    # ---- local search --------------------------------------------------------------------------
    def _block_max(self, e: int) -> np.ndarray:
        d, nb = self.d[e], self.nb[e]
        return self.load[: nb * d].reshape(nb, d).max(axis=1)

    def _block_min_mem(self, e: int) -> np.ndarray:
        """Per block of level e: the least memory of its groups (inf without groups)."""
        return self._min_mem_all()[e]

    def _min_mem_all(self) -> list:
        alive = np.asarray(self.g_alive, dtype=bool)
        ge = np.asarray(self.g_e, dtype=np.int64)[alive]
        gb = np.asarray(self.g_b, dtype=np.int64)[alive]
        gm = np.asarray(self.g_mem, dtype=np.float64)[alive]
        out = []
        for e in range(self.D):
            a = np.full(self.nb[e], np.inf)
            sel = ge == e
            np.minimum.at(a, gb[sel], gm[sel])
            out.append(a)
        return out

    def repack(self, e: int, b: int) -> bool:
        """Repack block (e, b)'s sequences by first-fit decreasing on memory; applied (True) only when
        it needs fewer groups."""
        gs = self.by_block.get((e, b), [])
        if len(gs) < 2:
            return False
        bins = _ffd(self.tab, e, [i for g in gs for i in self.g_members[g]])
        if len(bins) >= len(gs):
            return False
        for g in list(gs):
            for i in list(self.g_members[g]):
                self._remove(i)
            self._drop_if_empty(g)
        for bn in bins:
            self._add_group(e, b, bn)
        return True

    @classmethod
    def greedy(cls, tab, *, target: float | None, clock: Effort, seqs=None, max_extra_work: float | None = None,
               deadline: float | None = None, lowest: bool = True, cancel=None) -> "Stack | None":
        """List scheduling under stack semantics: sequences by least GPU-time (longest first), each
        either into any group with room on any block (every rank of the block gains its time: no
        group needs to be the last on its ranks, unlike ``baselines.list_schedule``) or into a new
        group on any block. Among the options whose ranks all stay within ``target`` (ms) the one
        adding the least GPU-time wins (its time x degree, plus the overhead x degree of a new
        group), else the one ending lowest. ``max_extra_work``: degrees whose GPU-time exceeds the
        sequence's least by more than this share are not tried (None: all that hold it). Ties
        among the options adding the least GPU-time go to the block ending lowest (``lowest``) or to
        each degree's first block (then the lowest of those): two structures to start from.
        Returns None when the ``clock`` passes ``deadline`` first (each sequence is charged to it); ``cancel()`` is
        called every 64 sequences (it may raise)."""
        st = cls(tab)
        idx = np.arange(tab.s.size) if seqs is None else np.asarray(seqs, dtype=np.int64)
        order = idx[np.argsort(-tab.best_work[idx], kind="stable")]
        # every block of every level in one flat array (level by level), so that a sequence's
        # options are weighed in a few array operations: per block the least memory of its groups
        # and its largest rank load, kept up to date (loads only grow here, so a block's maximum is
        # its old one or the grown block's); per level a view into them
        off = np.concatenate([[0], np.cumsum(st.nb)]).astype(np.int64)
        lvl = np.repeat(np.arange(st.D), st.nb)
        dblk = np.asarray(st.d, dtype=np.float64)[lvl]
        over_blk = tab.over[lvl]
        minmem_f = np.full(int(off[-1]), np.inf)
        bmax_f = np.zeros(int(off[-1]))
        bmax = [bmax_f[off[e]:off[e + 1]] for e in range(st.D)]
        dd = np.asarray(st.d, dtype=np.float64)
        for step, i in enumerate(order.tolist()):
            if step % 64 == 0:
                if cancel is not None:
                    cancel()
                if deadline is not None and clock.past(deadline):
                    return None
            clock.tick(elements=6 * off[-1] + 2 * st.D, steps=1.5)
            use = tab.ok[:, i].copy()
            if max_extra_work is not None:
                use &= (dd * tab.t[:, i] <= tab.best_work[i] * (1 + max_extra_work)) | (np.arange(st.D) == tab.dmin[i])
            valid = use[lvl]
            join = minmem_f + tab.mem[:, i][lvl] <= st.budget
            add = tab.t[:, i][lvl] + np.where(join, 0.0, over_blk)
            end = bmax_f + add
            work = dblk * add
            inside = valid & (end <= target) if target is not None else None
            if inside is not None and inside.any():
                # the least GPU-time within the target; among those, the block ending lowest
                w = np.where(inside, work, np.inf)
                cand = inside & (w <= w.min() * (1 + 1e-12))
                if lowest:
                    f = int(np.argmin(np.where(cand, end, np.inf)))
                else:  # each level's first such block, then the one ending lowest
                    idx = np.flatnonzero(cand)
                    firsts = idx[np.unique(lvl[idx], return_index=True)[1]]
                    f = int(firsts[np.argmin(end[firsts])])
            else:
                f = int(np.argmin(np.where(valid, end + 1e-9 * work, np.inf)))
            e = int(lvl[f])
            b = f - int(off[e])
            if join[f]:
                fit = [g for g in st.by_block.get((e, b), []) if st.g_mem[g] + tab.mem[e, i] <= st.budget]
                g = max(fit, key=lambda g: st.g_mem[g])
                st._insert(i, g)
                delta = float(tab.t[e, i])
            else:
                g = st._add_group(e, b, [i])
                delta = float(tab.t[e, i] + tab.over[e])
            minmem_f[f] = min(st.g_mem[h] for h in st.by_block[(e, b)])
            lo, hi = b * st.d[e], (b + 1) * st.d[e]
            top = float(st.load[lo:hi].max())
            for e2 in range(st.D):
                d2 = st.d[e2]
                if e2 <= e:
                    bmax[e2][lo // d2:hi // d2] += delta
                elif lo // d2 < st.nb[e2]:
                    y = lo // d2
                    bmax[e2][y] = max(bmax[e2][y], top)
        return st

    def repack_all(self) -> int:
        """Repack every block (see ``repack``); returns how many changed."""
        return sum(self.repack(e, b) for (e, b) in list(self.by_block))

    def improve(self, deadline: float, clock: Effort, max_iter: int = 100_000, cancel=None) -> int:
        """Local search on the exact loads until no move helps or the ``clock`` passes ``deadline``
        (every round is charged to it).

        Each round takes a most-loaded rank r and, among the sequences of the groups on r's blocks,
        the move (to a group with room on any other block, or into a new group on any block) or the
        swap (with a sequence of a group elsewhere; memory checked on both sides) after which every
        rank it changes ends below the current maximum, the one with the lowest such finish. That
        removes at least r from the most-loaded ranks; the maximum itself falls once none is left.
        Returns the number of moves made. ``cancel()`` is called every few rounds (it may raise)."""
        self.repack_all()
        moves = 0
        for it in range(max_iter):
            if clock.past(deadline):
                break
            if cancel is not None and it % 4 == 0:
                cancel()
            if not (self._step(clock) or self._global_move(clock) or self._eject(deadline, clock)):
                break
            moves += 1
        return moves

    def _all_items(self):
        """Every placed sequence: (items, group, level, block) arrays."""
        Q, G = [], []
        for g in range(len(self.g_e)):
            if self.g_alive[g]:
                Q.extend(self.g_members[g])
                G.extend([g] * len(self.g_members[g]))
        G = np.asarray(G, dtype=np.int64)
        ge = np.asarray(self.g_e, dtype=np.int64)
        gb = np.asarray(self.g_b, dtype=np.int64)
        return np.asarray(Q, dtype=np.int64), G, ge[G], gb[G]

    def _global_move(self, clock: Effort) -> bool:
        """When no move helps a most-loaded rank: the move of any sequence to another block (not
        overlapping its own) that saves the most GPU-time (its time x degree, plus the overhead x
        degree of a group it empties or opens) while every rank it raises stays below the maximum.
        Such moves free time on other ranks, where later moves of the loaded ranks' sequences can
        go. Returns whether one was made."""
        tab = self.tab
        T = float(self.load.max())
        limit = T * (1 - _TOL)
        Q, G, EI, BI = self._all_items()
        if Q.size == 0:
            return False
        dI = np.asarray(self.d)[EI]
        gsize = np.bincount(G, minlength=len(self.g_e))[G]
        w_out = dI * (tab.t[EI, Q] + tab.over[EI] * (gsize == 1))  # GPU-time the move saves at X
        if Q.size > GLOBAL_MOVE_ITEMS:
            # the sequences whose GPU-time is furthest above their cheapest (the most to save)
            keep = np.argsort(-(w_out - tab.best_work[Q]), kind="stable")[:GLOBAL_MOVE_ITEMS]
            Q, G, EI, BI, dI, w_out = Q[keep], G[keep], EI[keep], BI[keep], dI[keep], w_out[keep]
        best_val, best = -T * _TOL * self.n, None
        minmem_all = self._min_mem_all()
        clock.tick(elements=4 * Q.size * sum(self.nb), steps=2 * self.D)
        for e2 in range(self.D):
            fits = tab.ok[e2, Q]
            if not fits.any():
                continue
            d2 = self.d[e2]
            bm2 = self._block_max(e2)
            cols = np.arange(bm2.size)
            minmem = minmem_all[e2]
            join = minmem[None, :] + tab.mem[e2, Q][:, None] <= self.budget
            t2 = tab.t[e2, Q][:, None]
            dY = np.where(join, t2, t2 + tab.over[e2])
            overlap = ((cols[None, :] * d2 < (BI[:, None] + 1) * dI[:, None])
                       & (BI[:, None] * dI[:, None] < (cols[None, :] + 1) * d2))
            ok = fits[:, None] & ~overlap & (bm2[None, :] + dY < limit)
            if not ok.any():
                continue
            dw = np.where(ok, d2 * dY - w_out[:, None], np.inf)
            k = int(np.argmin(dw))
            a, c = divmod(k, dw.shape[1])
            if dw[a, c] < best_val:
                best_val, best = float(dw[a, c]), ("move", int(Q[a]), e2, int(c), bool(join[a, c]))
        if best is None:
            return False
        self._apply(best)
        return True

    def _eject(self, deadline: float, clock: Effort, tries: int = 8) -> bool:
        """Empty one group of a most-loaded rank (the least full first) into the spare memory of
        other groups (on any block, its own and overlapping ones included), each sequence (longest
        first) where the ranks it raises stay lowest, all of them below the maximum once the group's
        overhead is gone. Returns whether one was."""
        T = float(self.load.max())
        limit = T * (1 - _TOL)
        r = int(np.argmax(self.load))
        path = [g for e in range(self.D) if r // self.d[e] < self.nb[e]
                for g in self.by_block.get((e, r // self.d[e]), [])]
        path.sort(key=lambda g: self.g_mem[g])
        for g in path[:tries]:
            if clock.past(deadline):
                return False
            clock.tick(elements=len(self.g_members[g]) * (self.num_groups() + self.n) * 90, steps=len(self.g_members[g]) * 70)
            plan = self._eject_plan(g, limit)
            if plan is not None:
                for i, h in plan:
                    self._remove(i)
                    self._insert(i, h)
                self._drop_if_empty(g)
                return True
        return False

    def _eject_plan(self, g: int, limit: float):
        """Where each sequence of group g would go (``[(seq, group)]``) in ``_eject``, or None."""
        tab = self.tab
        e0, b0 = self.g_e[g], self.g_b[g]
        lo0, hi0 = b0 * self.d[e0], (b0 + 1) * self.d[e0]
        load = self.load.copy()
        load[lo0:hi0] -= float(tab.over[e0])
        alive = np.asarray(self.g_alive, dtype=bool)
        alive[g] = False
        H = np.flatnonzero(alive)
        He = np.asarray(self.g_e, dtype=np.int64)[H]
        Hb = np.asarray(self.g_b, dtype=np.int64)[H]
        dH = np.asarray(self.d, dtype=np.int64)[He]
        lo, hi = Hb * dH, (Hb + 1) * dH
        # groups on blocks overlapping g's count too: g's ranks have lost its overhead already
        room = self.budget - np.asarray(self.g_mem)[H]
        out = []
        for i in sorted(self.g_members[g], key=lambda i: -float(tab.mem[e0, i])):
            load[lo0:hi0] -= float(tab.t[e0, i])
            bm = [load[: nb * d].reshape(nb, d).max(axis=1) for nb, d in zip(self.nb, self.d)]
            top = np.zeros(H.size)
            for e in range(self.D):
                sel = He == e
                top[sel] = bm[e][Hb[sel]]
            v = top + tab.t[He, i]
            ok = (room >= tab.mem[He, i]) & tab.ok[He, i] & (v < limit)
            if not ok.any():
                return None
            k = int(np.flatnonzero(ok)[np.argmin(v[ok])])
            load[lo[k]:hi[k]] += float(tab.t[He[k], i])
            room[k] -= float(tab.mem[He[k], i])
            out.append((i, int(H[k])))
        return out

    def _path_items(self, r: int):
        """Sequences of the groups on rank r's blocks: (items, group, level, block) arrays."""
        Q, G, E, B = [], [], [], []
        for e in range(self.D):
            b = r // self.d[e]
            if b >= self.nb[e]:
                continue
            for g in self.by_block.get((e, b), []):
                for i in self.g_members[g]:
                    Q.append(i)
                    G.append(g)
                    E.append(e)
                    B.append(b)
        return (np.asarray(Q, dtype=np.int64), np.asarray(G, dtype=np.int64), np.asarray(E, dtype=np.int64),
                np.asarray(B, dtype=np.int64))

    def _new_max(self, EI, BI, dX, dY, e2: int, colB: np.ndarray, bm2: np.ndarray) -> np.ndarray:
        """Largest new load over the ranks of block ``colB[c]`` of level e2 when sequence row a, on
        block ``BI[a]`` of level ``EI[a]`` (X, whose ranks change by ``dX[a]``), goes there (Y, whose
        ranks change by ``dY[a, c]``). Disjoint blocks: Y's max + dY; Y inside X: Y's max + dX + dY;
        Y holding X: the larger of Y's other ranks + dY and X's ranks + dX + dY; Y = X: inf (no move).
        The rows come from one rank's blocks, so there are at most D distinct X."""
        d2 = self.d[e2]
        dE = np.asarray(self.d)[EI]
        dX2 = dX[:, None] if dX.ndim == 1 else dX
        out = bm2[colB][None, :] + dY
        same = (EI == e2)[:, None] & (colB[None, :] == BI[:, None])
        inside = (EI > e2)[:, None] & ((colB[None, :] * d2) // dE[:, None] == BI[:, None])
        out = np.where(inside, out + dX2, out)
        up = EI < e2
        if up.any():
            holder = (BI * dE) // d2
            hold = up[:, None] & (colB[None, :] == holder[:, None])
            if hold.any():
                other = np.full(EI.size, -np.inf)
                xmax = np.zeros(EI.size)
                for e, b in {(int(e), int(b)) for e, b in zip(EI[up], BI[up])}:
                    y = (b * self.d[e]) // d2
                    if y >= self.nb[e2]:
                        continue
                    ratio = d2 // self.d[e]
                    seg = self.load[y * d2:(y + 1) * d2].reshape(ratio, self.d[e]).max(axis=1)
                    j = b - y * ratio
                    rows = (EI == e) & (BI == b)
                    xmax[rows] = seg[j]
                    if ratio > 1:
                        seg = seg.copy()
                        seg[j] = -np.inf
                        other[rows] = seg.max()
                with np.errstate(invalid="ignore"):  # -inf + inf on rows the mask leaves out
                    val = np.maximum(other[:, None] + dY, xmax[:, None] + dX2 + dY)
                out = np.where(hold, val, out)
        return np.where(same, np.inf, out)

    def _step(self, clock: Effort) -> bool:
        tab = self.tab
        T = float(self.load.max())
        tol = T * _TOL
        r = int(np.argmax(self.load))
        Q, G, EI, BI = self._path_items(r)
        if Q.size == 0:
            return False
        gsize = np.array([len(self.g_members[g]) for g in G])
        dX = -tab.t[EI, Q] - tab.over[EI] * (gsize == 1)
        limit = T - tol
        best_val, best = limit, None
        bmax = [self._block_max(e) for e in range(self.D)]
        minmem_all = self._min_mem_all()
        clock.tick(elements=10 * Q.size * sum(self.nb) + self.num_groups() * 2, steps=5 * self.D)
        for e2 in range(self.D):
            fits = tab.ok[e2, Q]
            if not fits.any():
                continue
            bm2 = bmax[e2]
            minmem = minmem_all[e2]
            join = minmem[None, :] + tab.mem[e2, Q][:, None] <= self.budget
            t2 = tab.t[e2, Q][:, None]
            dY = np.where(join, t2, t2 + tab.over[e2])
            dY = np.where(fits[:, None], dY, np.inf)
            new = self._new_max(EI, BI, dX, dY, e2, np.arange(bm2.size), bm2)
            # among equal finishes the move adding the least GPU-time wins
            key = new + 1e-9 * tol * dY * self.d[e2]
            k = int(np.argmin(key))
            a, c = divmod(k, new.shape[1])
            v = float(new[a, c])
            if v < best_val:
                best_val, best = v, ("move", int(Q[a]), e2, c, bool(join[a, c]))
        if best is None:
            best = self._best_swap(Q, G, EI, BI, bmax, limit, clock)
            if best is None:
                return False
        self._apply(best)
        return True

    def _best_swap(self, Q, G, EI, BI, bmax, limit, clock: Effort):
        """The swap of a sequence of rank r's blocks (rows) with one of a group on a block whose
        ranks all end below ``limit`` that leaves every changed rank lowest, or None."""
        tab = self.tab
        best_val, best = limit, None
        gmem = np.asarray(self.g_mem)
        gmem_I = gmem[G]
        AJ, AH, AE, AB = self._all_items()
        for e2 in range(self.D):
            if not tab.ok[e2, Q].any():
                continue
            sel = (AE == e2)
            sel[sel] = bmax[e2][AB[sel]] < limit
            if not sel.any():
                continue
            J, H, BJ = AJ[sel], AH[sel], AB[sel]
            cap = max(1, SWAP_PAIRS // max(1, Q.size))
            if J.size > cap:  # the sequences on the blocks with the most slack (keeps a round cheap)
                keep = np.argsort(bmax[e2][BJ], kind="stable")[:cap]
                J, H, BJ = J[keep], H[keep], BJ[keep]
            clock.tick(elements=14 * Q.size * J.size, steps=4)
            memx = gmem_I[:, None] - tab.mem[EI, Q][:, None] + tab.mem[EI[:, None], J[None, :]]
            memy = gmem[H][None, :] - tab.mem[e2, J][None, :] + tab.mem[e2, Q][:, None]
            dX = tab.t[EI[:, None], J[None, :]] - tab.t[EI, Q][:, None]
            ok = ((dX < -limit * _TOL) & (memx <= self.budget) & (memy <= self.budget)
                  & tab.ok[EI[:, None], J[None, :]] & tab.ok[e2, Q][:, None])
            if not ok.any():
                continue
            dY = tab.t[e2, Q][:, None] - tab.t[e2, J][None, :]
            new = self._new_max(EI, BI, dX, np.where(ok, dY, np.inf), e2, BJ, bmax[e2])
            new = np.where(ok, new, np.inf)
            k = int(np.argmin(new))
            a, q = divmod(k, new.shape[1])
            v = float(new[a, q])
            if v < best_val:
                best_val, best = v, ("swap", int(Q[a]), int(J[q]))
        return best

    def _apply(self, mv) -> None:
        tab = self.tab
        if mv[0] == "move":
            _, i, e2, b2, join = mv
            g0 = self._remove(i)
            e0, b0 = self.g_e[g0], self.g_b[g0]
            self._drop_if_empty(g0)
            target = None
            if join:
                m = float(tab.mem[e2, i])
                fit = [g for g in self.by_block.get((e2, b2), []) if self.g_mem[g] + m <= self.budget]
                if fit:
                    target = max(fit, key=lambda g: self.g_mem[g])  # best fit keeps room elsewhere
            if target is None:
                self._add_group(e2, b2, [i])
            else:
                self._insert(i, target)
            self.repack(e0, b0)
        else:
            _, i, j = mv
            gi, gj = int(self.where[i]), int(self.where[j])
            self._remove(i)
            self._remove(j)
            self._insert(j, gi)
            self._insert(i, gj)
            self.repack(self.g_e[gi], self.g_b[gi])


# ------------------------------------------------------------------------------------------------
# the CP-SAT model
# ------------------------------------------------------------------------------------------------


@dataclass
class StackModelInfo:
    """What one whole-step CP-SAT call did."""

    status: str = "not run"
    objective_ms: float | None = None
    bound_ms: float | None = None
    dtime: float = 0.0
    """CP-SAT's deterministic time used (what the plan's effort was charged)."""
    wall_s: float = 0.0
    """Measured seconds (reported with the plan's wall-clock figures, not in ``to_dict``)."""
    variables: int = 0
    singles: int = 0
    buckets: int = 0
    hint: str = "none"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The call's figures as plain data, wall-clock seconds left out (a plan's stats hold only
        what its inputs decide; ``wall_s`` goes to its ``stats["wall"]``)."""
        out = {"status": self.status, "objective_ms": _finite(self.objective_ms), "bound_ms": _finite(self.bound_ms),
               "dtime": self.dtime, "variables": self.variables,
               "singles": self.singles, "buckets": self.buckets, "hint": self.hint}
        out.update(self.extra)
        return out


def _finite(x):
    return float(x) if x is not None and math.isfinite(x) else None


def _parents(stack: Stack):
    """Per level e and block b: the parent block's index at level e + 1, or -1 (a root)."""
    out = []
    for e in range(stack.D):
        if e + 1 < stack.D:
            ratio = stack.d[e + 1] // stack.d[e]
            p = np.arange(stack.nb[e]) // ratio
            p[p >= stack.nb[e + 1]] = -1
        else:
            p = np.full(stack.nb[e], -1)
        out.append(p)
    return out


def _sibling_sets(stack: Stack):
    """Lists of sibling blocks ``(e, [b, ...])`` in index order: the children of each block, and the
    roots of each level."""
    par = _parents(stack)
    out = []
    for e in range(stack.D):
        groups: dict[int, list[int]] = {}
        for b, p in enumerate(par[e].tolist()):
            groups.setdefault(p, []).append(b)
        out.extend((e, bs) for bs in groups.values() if len(bs) > 1)
    return out


def canonical(stack: Stack, block_key) -> Stack:
    """The same stack with sibling subtrees reordered so that ``block_key(e, b)`` does not increase
    along each set of siblings (moving a subtree to another aligned block of its size keeps every
    rank's load, only on other ranks)."""
    par = _parents(stack)
    children: dict[tuple[int, int], list[int]] = {}
    for e in range(stack.D - 1):
        for b, p in enumerate(par[e].tolist()):
            if p >= 0:
                children.setdefault((e + 1, p), []).append(b)
    new_of: dict[tuple[int, int], int] = {}

    def place(e: int, old: int, new: int) -> None:
        new_of[(e, old)] = new
        kids = children.get((e, old), [])
        if not kids:
            return
        ratio = stack.d[e] // stack.d[e - 1]
        for j, ch in enumerate(sorted(kids, key=lambda ch: -block_key(e - 1, ch))):
            place(e - 1, ch, new * ratio + j)

    for e in range(stack.D):
        roots = [b for b in range(stack.nb[e]) if par[e][b] < 0]
        if not roots:
            continue
        for old, new in zip(sorted(roots, key=lambda b: -block_key(e, b)), sorted(roots)):
            place(e, old, new)
    return Stack.from_groups(stack.tab, [(e, new_of[(e, b)], m) for e, b, m in stack.groups()])


@dataclass
class _ItemSet:
    singles: np.ndarray  # sequence index of each single item
    buckets: list  # sequence indices of each bucket
    tokens: np.ndarray  # tokens of each bucket


def _items(tab, idx: np.ndarray, singles: int, buckets: int) -> _ItemSet:
    order = idx[np.argsort(-tab.s[idx], kind="stable")]
    sg = order[:singles]
    rest = order[singles:]
    bks = []
    if rest.size:
        bid = bucketize(tab.s[rest], buckets)
        bks = [rest[bid == k] for k in np.unique(bid)]
    return _ItemSet(singles=sg, buckets=bks, tokens=np.array([int(tab.s[q].sum()) for q in bks], dtype=np.int64))


def solve_stack(tab, hint: Stack, *, effort: float, clock: Effort, seed: int = 0, opts=None,
                singles: int | None = None, single_vars: int = 2000, buckets: int = 12, work_slack: float = 0.25,
                span: int = 3, workers: int = 2):
    """Run the whole-step CP-SAT model (module docstring) on ``effort`` of the ``clock`` (building
    it included), hinted with ``hint``; returns ``(Stack or None, StackModelInfo)``. The stack is
    CP-SAT's solution mapped back to sequences and packed into groups per block (not yet polished);
    None when CP-SAT found none (``info.status`` says why). An item may use the shapes of degrees
    within ``span`` of its smallest. Raises Cancelled when ``opts``' cancel token is set."""
    from ortools.sat.python import cp_model

    start = clock.now()
    info = StackModelInfo()
    D, N = hint.D, hint.n
    deg = hint.d
    idx = np.array(sorted(i for _, _, mem in hint.groups() for i in mem), dtype=np.int64)
    if idx.size == 0:
        info.status = "skipped (no sequences)"
        return None, info
    if singles is None:
        # the longest sequences one by one while their variables (blocks of the levels they may
        # use) stay within the budget: many on small clusters, a few dozen on large ones
        order = idx[np.argsort(-tab.s[idx], kind="stable")]
        dcol0 = np.asarray(deg, dtype=np.float64)[:, None]
        w = np.where(tab.ok[:, order], tab.t[:, order] * dcol0, np.inf)
        okl = (tab.ok[:, order] & (w <= w.min(axis=0) * (1 + work_slack))
               & (tab.level[:, None] <= tab.level[tab.dmin[order]][None, :] + span))
        cost_v = (okl * np.asarray(hint.nb)[:, None]).sum(axis=0)
        singles = int(np.searchsorted(np.cumsum(cost_v), single_vars, side="right"))
    items = _items(tab, idx, singles, buckets)
    S, Bk = items.singles.size, len(items.buckets)
    info.singles, info.buckets = S, Bk
    # activation memory is linear in tokens: per degree, how many tokens one group holds
    i_ref = int(idx[np.argmax(tab.s[idx])])
    mpt = tab.mem[:, i_ref] / float(tab.s[i_ref])  # GB per GPU per token, per degree index
    cap = np.floor(tab.budget * (1 + 1e-9) / mpt).astype(np.int64)
    # time of a bucket per token per degree; whether it fits (its longest sequence) and its work
    tau = np.zeros((D, Bk))
    fits_b = np.zeros((D, Bk), dtype=bool)
    for j, q in enumerate(items.buckets):
        tau[:, j] = tab.t[:, q].sum(axis=1) / float(tab.s[q].sum())
        fits_b[:, j] = tab.ok[:, q].all(axis=1)
    # the levels each item may use: those that hold it, within `span` of its smallest and
    # `work_slack` of its cheapest, plus every level the hint uses for it
    def allowed(ok_col, work_col):
        lv = np.flatnonzero(ok_col)
        if lv.size == 0:
            return set()
        best = float(work_col[lv].min())
        return {int(e) for e in lv if tab.level[e] <= tab.level[lv[0]] + span and work_col[e] <= best * (1 + work_slack)}

    dcol = np.asarray(deg, dtype=np.float64)[:, None]
    lev_s = [allowed(tab.ok[:, i], (tab.t[:, i:i + 1] * dcol)[:, 0]) for i in items.singles]
    lev_b = [allowed(fits_b[:, j], (tau[:, j:j + 1] * dcol)[:, 0]) for j in range(Bk)]
    single_of = {int(i): k for k, i in enumerate(items.singles)}
    bucket_of = np.full(tab.s.size, -1, dtype=np.int64)
    for j, q in enumerate(items.buckets):
        bucket_of[q] = j
    h_groups = hint.groups()
    for e, _, mem in h_groups:
        for i in mem:
            if i in single_of:
                lev_s[single_of[i]].add(e)
            else:
                lev_b[int(bucket_of[i])].add(e)
    T_hint_ms = hint.makespan_ms
    scale = 1e9 / max(T_hint_ms, 1e-9)
    c_int = np.rint(tab.over * scale).astype(np.int64)
    ts_int = np.rint(tab.t[:, items.singles] * scale).astype(np.int64)  # (D, S)
    tau_int = np.rint(tau * scale).astype(np.int64)  # (D, Bk) per token
    s_tok = tab.s[items.singles].astype(np.int64)

    m = cp_model.CpModel()
    kv: dict = {}
    xv: dict = {}
    yv: dict = {}
    Lv: dict = {}
    n_vars = 0
    kmax = [int(max(1, math.floor(T_hint_ms / max(float(tab.over[e]), 1e-9)) + 1)) for e in range(D)]
    for e in range(D):
        ss = [k for k in range(S) if e in lev_s[k]]
        bb = [j for j in range(Bk) if e in lev_b[j]]
        if not ss and not bb:
            continue
        for b in range(hint.nb[e]):
            k = m.NewIntVar(0, kmax[e], f"k{e}_{b}")
            kv[e, b] = k
            terms, coefs, toks, tcoef = [k], [int(c_int[e])], [], []
            big, mid = [], []
            for q in ss:
                v = m.NewBoolVar(f"x{q}_{e}_{b}")
                xv[q, e, b] = v
                terms.append(v)
                coefs.append(int(ts_int[e, q]))
                toks.append(v)
                tcoef.append(int(s_tok[q]))
                if 2 * s_tok[q] > cap[e]:
                    big.append(v)
                if 3 * s_tok[q] > 2 * cap[e]:
                    mid.append((v, 2))
                elif 3 * s_tok[q] > cap[e]:
                    mid.append((v, 1))
            for j in bb:
                v = m.NewIntVar(0, int(items.tokens[j]), f"y{j}_{e}_{b}")
                yv[j, e, b] = v
                terms.append(v)
                coefs.append(int(tau_int[e, j]))
                toks.append(v)
                tcoef.append(1)
            n_vars += len(terms)
            m.Add(cp_model.LinearExpr.WeightedSum(toks, tcoef) <= int(cap[e]) * k)
            if big:
                m.Add(sum(big) <= k)
            if any(w == 1 for _, w in mid):
                m.Add(cp_model.LinearExpr.WeightedSum([v for v, _ in mid], [w for _, w in mid]) <= 2 * k)
            L = m.NewIntVar(0, 2**50, f"L{e}_{b}")
            m.Add(L == cp_model.LinearExpr.WeightedSum(terms, coefs))
            Lv[e, b] = L
    for q in range(S):
        m.AddExactlyOne([xv[q, e, b] for e in lev_s[q] for b in range(hint.nb[e])])
    for j in range(Bk):
        m.Add(sum(yv[j, e, b] for e in lev_b[j] for b in range(hint.nb[e])) == int(items.tokens[j]))
    T = m.NewIntVar(0, 2**52, "T")
    rank_terms: dict[tuple, list[int]] = {}
    for r in range(N):
        key = tuple((e, r // deg[e]) for e in range(D) if (e, r // deg[e]) in Lv)
        rank_terms.setdefault(key, []).append(r)
    for key in rank_terms:  # ranks with the same blocks share one constraint
        m.Add(sum(Lv[eb] for eb in key) <= T)
    for e, bs in _sibling_sets(hint):
        for b1, b2 in zip(bs, bs[1:]):
            if (e, b1) in Lv and (e, b2) in Lv:
                m.Add(Lv[e, b1] >= Lv[e, b2])
    m.Minimize(T)

    # the hint: the stack's groups, in the model's integer units, siblings ordered by those loads
    def int_load_of(st: Stack):
        lo = {}
        for e, b, mem in st.groups():
            v = int(c_int[e])
            for i in mem:
                if i in single_of:
                    v += int(ts_int[e, single_of[i]])
            lo[(e, b)] = lo.get((e, b), 0) + v
        toks: dict = {}
        for e, b, mem in st.groups():
            for i in mem:
                j = int(bucket_of[i])
                if j >= 0:
                    toks[(j, e, b)] = toks.get((j, e, b), 0) + int(tab.s[i])
        for (j, e, b), y in toks.items():
            lo[(e, b)] = lo.get((e, b), 0) + int(tau_int[e, j]) * y
        return lo, toks

    lo0, _ = int_load_of(hint)
    hs = canonical(hint, lambda e, b: lo0.get((e, b), 0))
    lo, toks = int_load_of(hs)
    kh: dict = {}
    for e, b, _ in hs.groups():
        kh[(e, b)] = kh.get((e, b), 0) + 1
    on = {}
    for e, b, mem in hs.groups():
        for i in mem:
            if i in single_of:
                on[single_of[i]] = (e, b)
    for (e, b), v in kv.items():
        m.AddHint(v, kh.get((e, b), 0))
        m.AddHint(Lv[e, b], lo.get((e, b), 0))
    for (q, e, b), v in xv.items():
        m.AddHint(v, 1 if on.get(q) == (e, b) else 0)
    for (j, e, b), v in yv.items():
        m.AddHint(v, toks.get((j, e, b), 0))
    rank = np.zeros(N, dtype=np.int64)
    for (e, b), v in lo.items():
        rank[b * deg[e]:(b + 1) * deg[e]] += v
    m.AddHint(T, int(rank.max()))
    info.extra["hint_objective_ms"] = float(rank.max()) / scale

    clock.tick(elements=n_vars, steps=0.3 * (n_vars + N))  # building: a few Python calls per variable
    info.variables = n_vars
    left = float(effort) - (clock.now() - start)
    if left < 0.01:
        info.status = "skipped (no effort left after building the model)"
        return None, info
    # under PRESOLVE_ABOVE_S, presolving would take the effort the search needs (measured: at 64 GPUs x
    # 512 sequences CP-SAT still had no solution after 1 s with it, and had the hint at once without)
    solver, status, run = run_cpsat(m, effort=left, clock=clock, seed=seed, workers=workers, opts=opts,
                                    presolve=left >= PRESOLVE_ABOVE_S)
    info.status, info.dtime, info.wall_s, info.hint = run["status"], run["dtime"], run["wall_s"], run["hint"]
    info.extra["presolve"] = left >= PRESOLVE_ABOVE_S
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, info
    info.objective_ms = float(solver.ObjectiveValue()) / scale
    info.bound_ms = float(solver.BestObjectiveBound()) / scale
    # map back: k groups per block, singles first (first fit decreasing), then bucket sequences,
    # longest first, each to the block with the largest token deficit of its bucket that has a
    # group with room (best fit), else to the block with the largest deficit in a new group
    kval = {eb: int(solver.Value(v)) for eb, v in kv.items()}
    singles_on: dict = {}
    for (q, e, b), v in xv.items():
        if solver.Value(v):
            singles_on.setdefault((e, b), []).append(int(items.singles[q]))
    targets = []
    for j in range(Bk):
        vals = {(e, b): int(solver.Value(yv[j, e, b])) for e in lev_b[j] for b in range(hint.nb[e])}
        targets.append({eb: y for eb, y in vals.items() if y > 0})
    block_ms = {eb: solver.Value(v) / scale for eb, v in Lv.items()}
    clock.tick(elements=idx.size * len(kval) / 2, steps=idx.size)  # mapping back: a few steps per sequence
    out = Stack.from_groups(tab, _map_back(tab, kval, singles_on, items, targets, block_ms))
    return out, info


def _map_back(tab, kval: dict, singles_on: dict, items: _ItemSet, targets: list, block_ms: dict) -> list:
    """Groups ``[(e, b, members)]`` realising a model solution: ``kval[(e, b)]`` groups per block,
    ``singles_on[(e, b)]`` its single sequences, ``targets[j][(e, b)]`` tokens of bucket j,
    ``block_ms[(e, b)]`` the block's load in the model. Bucket sequences go longest first to a
    block with a group that has room, the one furthest below both its bucket's token target and
    its load (so rounding errors of different buckets do not pile up on one block); new groups
    open only where no block has room."""
    budget = tab.budget * (1 + 1e-12)
    bins: dict = {}  # (e, b) -> [[room, members], ...]
    maxroom: dict = {}  # (e, b) -> the largest room of its groups
    for eb, k in kval.items():
        if k > 0:
            bins[eb] = [[budget, []] for _ in range(k)]
            maxroom[eb] = budget

    def put(eb, i) -> None:
        e = eb[0]
        m = float(tab.mem[e, i])
        bl = bins.setdefault(eb, [])
        fit = [x for x in bl if x[0] >= m]
        if fit:
            x = min(fit, key=lambda x: x[0])
        else:
            x = [budget, []]
            bl.append(x)
        x[0] -= m
        x[1].append(int(i))
        maxroom[eb] = max(x[0] for x in bl)

    left = {eb: float(v) - float(tab.over[eb[0]]) * kval.get(eb, 0) for eb, v in block_ms.items()}
    for eb, mem in singles_on.items():
        for i in sorted(mem, key=lambda i: -tab.s[i]):
            put(eb, i)
            left[eb] = left.get(eb, 0.0) - float(tab.t[eb[0], i])
    deficit = [dict(t) for t in targets]
    seqs = [(int(i), j) for j, q in enumerate(items.buckets) for i in q]
    seqs.sort(key=lambda x: -tab.s[x[0]])
    for i, j in seqs:
        m_i = tab.mem[:, i]
        own = [eb for eb in deficit[j] if tab.ok[eb[0], i]]
        roomy = [eb for eb in own if maxroom.get(eb, -1.0) >= m_i[eb[0]]]
        if not roomy:  # no group of the bucket's blocks has room: any block with a group that does
            roomy = [eb for eb, r in maxroom.items() if tab.ok[eb[0], i] and r >= m_i[eb[0]]]
        pool = roomy or own or [eb for eb in bins if tab.ok[eb[0], i]]
        if not pool:
            e = int(np.argmax(tab.ok[:, i]))
            pool = [(e, 0)]
        eb = max(pool, key=lambda eb: min(deficit[j].get(eb, -math.inf) * float(tab.t[eb[0], i]) / float(tab.s[i]),
                                          left.get(eb, -math.inf)))
        put(eb, i)
        deficit[j][eb] = deficit[j].get(eb, 0) - int(tab.s[i])
        left[eb] = left.get(eb, 0.0) - float(tab.t[eb[0], i])
    return [(e, b, x[1]) for (e, b), bl in bins.items() for x in bl if x[1]]


def _ffd(tab, e: int, mem: list[int]) -> list[list[int]]:
    """First-fit decreasing of sequences ``mem`` into groups of degree index e under the budget."""
    m = tab.mem[e, mem]
    budget = tab.budget * (1 + 1e-12)
    bins: list[list[int]] = []
    room: list[float] = []
    for j in np.argsort(-m, kind="stable"):
        x = float(m[j])
        for k in range(len(bins)):
            if room[k] >= x:
                bins[k].append(int(mem[j]))
                room[k] -= x
                break
        else:
            bins.append([int(mem[j])])
            room.append(budget - x)
    return bins
