"""Process groups for every aligned SP block, created once at start and passed explicitly.

A plan's groups are aligned blocks of consecutive ranks: degree d holds ranks ``[k*d, (k+1)*d)``.
A group split ``u x c`` (``workbench.runtime.cp``: Ulysses over ``u`` inside context parallelism
over ``c``) runs its collectives on sub-groups instead: the Ulysses sub-groups, aligned blocks of
``u`` (``r0 + j*u + [0, u)``), and the CP sub-groups, strided (``r0 + a + u*[0, c)``).
``torch.distributed.new_group`` is collective (every rank must call it for every group, in the same
order, even for groups it is not in), so all candidate groups are made up front, on all ranks, in
a fixed order, and cached by their rank tuple. There are no module globals: the registry object is
handed to the code that runs collectives.
"""

from __future__ import annotations

from typing import Iterable

import torch.distributed as dist

__all__ = ["GroupRegistry", "aligned_blocks", "split_subgroups"]


def aligned_blocks(world_size: int, degree: int) -> list[tuple[int, ...]]:
    """The aligned rank blocks of ``degree`` on ``world_size`` ranks, in order."""
    return [tuple(range(b * degree, (b + 1) * degree)) for b in range(world_size // degree)]


def split_subgroups(ranks: Iterable[int], cp: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The sub-groups of a group on ``ranks`` (an aligned block) split ``u x cp``: returns
    ``(ulysses, cp_groups)``, ``ulysses[j]`` the ``u`` consecutive ranks of CP rank ``j`` and
    ``cp_groups[a]`` the ``cp`` ranks ``r0 + a + u*[0, cp)`` of Ulysses rank ``a``. Raises ValueError
    when ``cp`` does not divide the group's size."""
    ranks = tuple(sorted(int(r) for r in ranks))
    d, c = len(ranks), int(cp)
    if c < 1 or d % c:
        raise ValueError(f"context-parallel size {c} does not divide the group's {d} ranks")
    u, r0 = d // c, ranks[0]
    return ([tuple(r0 + j * u + a for a in range(u)) for j in range(c)],
            [tuple(r0 + a + u * j for j in range(c)) for a in range(u)])


class GroupRegistry:
    """Every aligned ``(degree, block)`` process group, and the sub-groups of every ``(degree, cp)``
    split in ``shapes``, keyed by their sorted rank tuples.

    Construct it on every rank with the same arguments after ``init_process_group``. Degree 1
    needs no group (``get`` returns None); a block of the whole world reuses the default group, and
    a sub-group with the ranks of a group already made reuses it. Groups are made in one fixed
    order: the blocks of every degree (ascending), then the Ulysses blocks a split needs that no
    degree made (ascending size), then for every split ``(degree, cp)`` with ``cp > 1`` (ascending)
    and every aligned block of its degree, its CP sub-groups (by Ulysses rank).
    """

    def __init__(self, world_size: int, degrees: Iterable[int], *, shapes: Iterable[tuple[int, int]] = (),
                 backend: str | None = None) -> None:
        self.world_size = int(world_size)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.degrees = tuple(sorted({int(d) for d in degrees}))
        splits = sorted({(int(d), int(c)) for d, c in shapes})
        for d, c in splits:
            if c < 1 or d % c:
                raise ValueError(f"shape ({d}, {c}): the context-parallel size {c} does not divide the degree {d}")
            if d not in self.degrees:
                raise ValueError(f"shape ({d}, {c}): degree {d} is not one of the degrees {list(self.degrees)}")
        self.shapes = tuple(sorted({(d, 1) for d in self.degrees} | set(splits)))
        """Every ``(degree, cp)`` split the registry has process groups for (``(d, 1)`` for every degree)."""
        self._groups: dict[tuple[int, ...], object] = {}
        self._backend = backend
        for d in self.degrees:
            if d < 1 or d > self.world_size:
                raise ValueError(f"degree {d} is outside 1..{self.world_size} (the world size)")
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

    def _make(self, ranks: tuple[int, ...]) -> None:
        if len(ranks) == 1 or ranks in self._groups:
            return
        if len(ranks) == self.world_size:
            self._groups[ranks] = dist.group.WORLD
        else:
            # collective: every rank calls this for every group, in this same order
            self._groups[ranks] = dist.new_group(list(ranks), backend=self._backend)

    def subgroups(self, ranks: Iterable[int], cp: int, rank: int | None = None) -> tuple[object | None, object | None]:
        """``(ulysses_group, cp_group)`` of ``rank`` (default: this process's) in the group on ``ranks``
        split ``(len(ranks)/cp) x cp``: None for a sub-group of one rank (no Ulysses when ``u = 1``, no
        CP when ``cp = 1``). Raises KeyError when the split has no process groups (naming the ones
        this registry has) and ValueError when ``rank`` is not in ``ranks`` or ``cp`` does not divide them."""
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
        that is not an aligned block of a registered degree."""
        key = tuple(sorted(int(r) for r in ranks))
        if len(key) == 1:
            return None
        try:
            return self._groups[key]
        except KeyError:
            raise KeyError(f"no process group for ranks {list(key)}: registered degrees are {list(self.degrees)} "
                           f"on {self.world_size} ranks (aligned blocks only)") from None

    def __contains__(self, ranks) -> bool:
        key = tuple(sorted(int(r) for r in ranks))
        return len(key) == 1 or key in self._groups

    def __len__(self) -> int:
        return len(self._groups)
