"""Process groups for every aligned SP block, created once at start and passed explicitly.

A plan's groups are aligned blocks of consecutive ranks: degree d holds ranks ``[k*d, (k+1)*d)``.
``torch.distributed.new_group`` is collective (every rank must call it for every group, in the same
order, even for groups it is not in), so all candidate groups are made up front, on all ranks, in
a fixed order, and cached by their rank tuple. There are no module globals: the registry object is
handed to the code that runs collectives.
"""

from __future__ import annotations

from typing import Iterable

import torch.distributed as dist

__all__ = ["GroupRegistry", "aligned_blocks"]


def aligned_blocks(world_size: int, degree: int) -> list[tuple[int, ...]]:
    """The aligned rank blocks of ``degree`` on ``world_size`` ranks, in order."""
    return [tuple(range(b * degree, (b + 1) * degree)) for b in range(world_size // degree)]


class GroupRegistry:
    """Every aligned ``(degree, block)`` process group, keyed by its sorted rank tuple.

    Construct it on every rank with the same arguments after ``init_process_group``. Degree 1
    needs no group (``get`` returns None); a block of the whole world reuses the default group.
    """

    def __init__(self, world_size: int, degrees: Iterable[int], *, backend: str | None = None) -> None:
        self.world_size = int(world_size)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.degrees = tuple(sorted({int(d) for d in degrees}))
        self._groups: dict[tuple[int, ...], object] = {}
        for d in self.degrees:
            if d < 1 or d > self.world_size:
                raise ValueError(f"degree {d} is outside 1..{self.world_size} (the world size)")
            if d == 1:
                continue
            for ranks in aligned_blocks(self.world_size, d):
                if d == self.world_size:
                    self._groups[ranks] = dist.group.WORLD
                else:
                    # collective: every rank calls this for every block, in this same order
                    self._groups[ranks] = dist.new_group(list(ranks), backend=backend)

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
