"""The peak bytes of the tensors a piece of code makes: ``LiveBytes``, a dispatch mode that counts
every operator's output storage from its creation until it is freed.

What the memory model calls saved tensors plus a transient, measured on any device (on CPU there is
no allocator to ask): ``bench/loss.py`` measures the head's loss with it, ``tests/test_loss.py``
checks the whole logits' backward against ``loss_backward_bytes_per_token``. Tensors made before the
mode is entered (inputs, parameters) are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as live: ...``; then ``live.peak``: the most bytes alive at once in the
    storages the operators inside made (each counted once, until freed); ``live.now``: those alive
    now."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, key)
        return out
