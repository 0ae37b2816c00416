"""Process groups of SP groups and their Ulysses / CP sub-groups, made by every rank in one order.

A plan's group of degree ``d`` holds a contiguous range of ranks ``r0 .. r0+d-1`` (any ``r0``, any
``d``: not only aligned power-of-two blocks). A group split ``u x c`` (``workbench.runtime.cp``:
Ulysses over ``u`` inside context parallelism over ``c``, ``c`` any divisor of ``d``) runs its
collectives on sub-groups instead: the Ulysses sub-groups, ``u`` consecutive ranks
(``r0 + j*u + [0, u)``), and the CP sub-groups, strided (``r0 + a + u*[0, c)``).
``torch.distributed.new_group`` is collective (every rank of the world calls it for every group, in
the same order, even for groups it is not in), and a registry caches each group by its rank tuple.

**When groups are made.** A registry can make, at construction, every aligned block of a few
degrees and the sub-groups of a few splits (``eager=True``, the default: what the profiler, the
doctor's probe and the benchmarks use). Training (``workbench.runtime.train``) makes them on demand
instead (``eager=False``): ``ensure(plan)`` makes the groups a plan needs that do not exist yet,
called by every rank with the same plan before it runs (``StepExecutor.run``, after ``check_plan``).
Why on demand: with groups on any contiguous range and a dozen candidate degrees, every group a run
*could* plan is hundreds of communicators (each with its connections, and on NCCL its memory), while
the plans of a run use a few; and the order stays deterministic because every rank holds the same
plan (broadcast from rank 0) and the same history of plans. The order is ``plan_rank_sets(plan)``, a
pure function of the plan. ``new_group``'s ``use_local_synchronization`` is not used: every rank
calls ``new_group`` for every set anyway, so the world-wide barrier costs little and keeps group
creation in the one global order that gloo and NCCL's communicator splits both expect.

There are no module globals: the registry object is handed to the code that runs collectives.
"""

from __future__ import annotations

from typing import Iterable

import torch.distributed as dist

__all__ = ["GroupRegistry", "aligned_blocks", "split_subgroups", "group_rank_sets", "plan_rank_sets"]


def aligned_blocks(world_size: int, degree: int) -> list[tuple[int, ...]]:
    """The aligned rank blocks of ``degree`` on ``world_size`` ranks, in order."""
    return [tuple(range(b * degree, (b + 1) * degree)) for b in range(world_size // degree)]


def _contiguous(ranks: Iterable[int]) -> tuple[int, ...]:
    """``ranks`` sorted; raises ValueError unless they are a non-empty range of consecutive ranks."""
    key = tuple(sorted(int(r) for r in ranks))
    if not key or key != tuple(range(key[0], key[0] + len(key))):
        raise ValueError(f"ranks {list(key)} are not a contiguous range of ranks")
    return key


def split_subgroups(ranks: Iterable[int], cp: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The sub-groups of a group on ``ranks`` (a contiguous range, any start and size) split
    ``u x cp``: returns ``(ulysses, cp_groups)``, ``ulysses[j]`` the ``u`` consecutive ranks of CP
    rank ``j`` and ``cp_groups[a]`` the ``cp`` ranks ``r0 + a + u*[0, cp)`` of Ulysses rank ``a``.
    Raises ValueError when ``cp`` does not divide the group's size or the ranks are not contiguous."""
    ranks = _contiguous(ranks)
    d, c = len(ranks), int(cp)
    if c < 1 or d % c:
        raise ValueError(f"context-parallel size {c} does not divide the group's {d} ranks")
    u, r0 = d // c, ranks[0]
    return ([tuple(r0 + j * u + a for a in range(u)) for j in range(c)],
            [tuple(r0 + a + u * j for j in range(c)) for a in range(u)])


def group_rank_sets(ranks: Iterable[int], cp: int = 1) -> list[tuple[int, ...]]:
    """The rank sets whose process groups a group on ``ranks`` split ``(d/cp) x cp`` runs its
    collectives on, in order: the group itself when ``cp = 1`` (Ulysses over all of it), else its
    Ulysses sub-groups (by CP rank) and its CP sub-groups (by Ulysses rank), leaving out sets of one
    rank (no group). A ``u x c`` group with ``u, c > 1`` never uses its whole rank set, so it is not
    listed. Raises ValueError as ``split_subgroups`` does."""
    key = _contiguous(ranks)
    uly, cps = ([key], []) if int(cp) == 1 else split_subgroups(key, cp)
    return [s for s in (*uly, *cps) if len(s) > 1]


def plan_rank_sets(plan) -> list[tuple[int, ...]]:
    """Every rank set whose process group ``plan`` (a ``workbench.solve.plan.Plan``, or anything with
    ``micro_steps[i].groups[k].ranks`` and ``.cp``) needs, each once, in the order a registry makes
    them (``GroupRegistry.ensure``): micro-step by micro-step, group by group in the plan's order,
    each group's sets as ``group_rank_sets`` lists them. A pure function of the plan, so every rank
    holding the plan computes the same list. Raises ValueError for a group whose ranks are not a
    contiguous range or whose cp does not divide its degree."""
    out: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for ms in plan.micro_steps:
        for g in ms.groups:
            for s in group_rank_sets(g.ranks, getattr(g, "cp", 1)):
                if s not in seen:
                    seen.add(s)
                    out.append(s)
    return out


class GroupRegistry:
    """Process groups keyed by their sorted rank tuples: made at construction (``eager``) for every
    aligned ``(degree, block)`` and the sub-groups of every ``(degree, cp)`` split in ``shapes``, and
    later for the groups of the plans handed to ``ensure`` (any contiguous range).

    ``degrees`` and ``shapes`` are also what plans may use: ``check_plan`` refuses a group of another
    degree or split (``StepExecutor.check`` passes them). Construct it on every rank with the same
    arguments after ``init_process_group``. Degree 1 needs no group (``get`` returns None); a set of
    the whole world reuses the default group, and a set already made is reused. With ``eager`` the
    groups are made in one fixed order: the blocks of every degree (ascending), then the Ulysses
    blocks a split needs that no degree made (ascending size), then for every split ``(degree, cp)``
    with ``cp > 1`` (ascending) and every aligned block of its degree, its CP sub-groups (by Ulysses
    rank). With ``eager=False`` nothing is made until ``ensure``.
    """

    def __init__(self, world_size: int, degrees: Iterable[int], *, shapes: Iterable[tuple[int, int]] = (),
                 backend: str | None = None, eager: bool = True) -> None:
        self.world_size = int(world_size)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.degrees = tuple(sorted({int(d) for d in degrees}))
        splits = sorted({(int(d), int(c)) for d, c in shapes})
        for d, c in splits:
            if c < 1 or d % c:
                raise ValueError(f"shape ({d}, {c}): the context-parallel size {c} does not divide the degree {d}")
            if d not in self.degrees:
                raise ValueError(f"shape ({d}, {c}): degree {d} is not one of the degrees {list(self.degrees)}")
        for d in self.degrees:
            if d < 1 or d > self.world_size:
                raise ValueError(f"degree {d} is outside 1..{self.world_size} (the world size)")
        self.shapes = tuple(sorted({(d, 1) for d in self.degrees} | set(splits)))
        """Every ``(degree, cp)`` split plans may use (``(d, 1)`` for every degree)."""
        self.eager = bool(eager)
        self._groups: dict[tuple[int, ...], object] = {}
        self._backend = backend
        self.made: list[tuple[int, ...]] = []
        """Every rank set this registry called ``new_group`` for, in order (the same on every rank)."""
        if not self.eager:
            return
        for d in self.degrees:
            for ranks in aligned_blocks(self.world_size, d):
                self._make(ranks)
        for u in sorted({d // c for d, c in splits} - set(self.degrees)):
            for ranks in aligned_blocks(self.world_size, u):
                self._make(ranks)
        for d, c in splits:
            if c == 1:
                continue
            for block in aligned_blocks(self.world_size, d):
                for ranks in split_subgroups(block, c)[1]:
                    self._make(ranks)

    def _make(self, ranks: tuple[int, ...]) -> bool:
        """Make the group of ``ranks`` unless it exists (or is one rank); True when it was made."""
        if len(ranks) == 1 or ranks in self._groups:
            return False
        if len(ranks) == self.world_size:
            self._groups[ranks] = dist.group.WORLD
            return True
        # collective: every rank calls this for every group, in this same order
        self._groups[ranks] = dist.new_group(list(ranks), backend=self._backend)
        self.made.append(ranks)
        return True

    def ensure(self, plan) -> list[tuple[int, ...]]:
        """Make the process groups ``plan`` needs that do not exist yet, in ``plan_rank_sets(plan)``'s
        order, and return their rank sets (empty when all exist). Collective: every rank of the world
        calls it with the same plan at the same point (as ``StepExecutor.run`` does, after the plan
        passed ``check_plan``), since then every rank makes the same groups in the same order. Raises
        ValueError, before making any group, for a group whose ranks are not a contiguous range inside
        the world or whose cp does not divide its degree."""
        sets = plan_rank_sets(plan)
        for s in sets:
            if s[0] < 0 or s[-1] >= self.world_size:
                raise ValueError(f"ranks {list(s)} are outside 0..{self.world_size - 1} (the world)")
        return [s for s in sets if self._make(s)]

    def subgroups(self, ranks: Iterable[int], cp: int, rank: int | None = None) -> tuple[object | None, object | None]:
        """``(ulysses_group, cp_group)`` of ``rank`` (default: this process's) in the group on ``ranks``
        split ``(len(ranks)/cp) x cp``: None for a sub-group of one rank (no Ulysses when ``u = 1``, no
        CP when ``cp = 1``). Raises KeyError when the split is not one of the registry's shapes (naming
        them) or its sub-groups were not made, and ValueError when ``rank`` is not in ``ranks``, the ranks
        are not contiguous or ``cp`` does not divide them."""
        key = tuple(sorted(int(r) for r in ranks))
        rank = self.rank if rank is None else int(rank)
        if rank not in key:
            raise ValueError(f"rank {rank} is not in the group {list(key)}")
        if (len(key), int(cp)) not in self.shapes and len(key) > 1:
            have = ", ".join(f"{d // c}x{c}" for d, c in self.shapes)
            raise KeyError(f"no process groups for a group of {len(key)} split {len(key) // int(cp)}x{cp} "
                           f"(Ulysses x CP): this run has {have}")
        uly, cps = split_subgroups(key, cp)
        u = len(key) // int(cp)
        k = key.index(rank)
        return self.get(uly[k // u]), self.get(cps[k % u])

    def get(self, ranks: Iterable[int]):
        """The process group of ``ranks`` (None for a single rank). Raises KeyError for a rank set
        that was not made (neither at construction nor by ``ensure``)."""
        key = tuple(sorted(int(r) for r in ranks))
        if len(key) == 1:
            return None
        try:
            return self._groups[key]
        except KeyError:
            made = (f"aligned blocks of degrees {list(self.degrees)} at start" if self.eager else "none at start")
            raise KeyError(f"no process group for ranks {list(key)} on {self.world_size} ranks ({made}, then the "
                           f"groups of the plans given to ensure); call registry.ensure(plan) on every rank "
                           f"before running the plan") from None

    def __contains__(self, ranks) -> bool:
        key = tuple(sorted(int(r) for r in ranks))
        return len(key) == 1 or key in self._groups

    def __len__(self) -> int:
        return len(self._groups)
