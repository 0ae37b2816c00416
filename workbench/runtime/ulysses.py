"""Ulysses sequence parallelism on packed variable-length shards.

A group of degree ``d`` runs some sequences together. Each rank holds, for every sequence of the
group, a contiguous ``1/d`` slice (the sequence padded at its end to a multiple of ``d``, so every
rank's slice of it is ``c = ceil(s/d)`` tokens long and all ranks hold the same number of tokens).
Around attention the group swaps the sharded dimension with one all-to-all:

    seq -> head:  (T_loc, H, hd) --reshape--> (T_loc, d, H/d, hd) --move d first--> (d, T_loc, H/d, hd)
                  --all_to_all_single--> (d, T_loc, H/d, hd), now indexed by source rank
                  --reshape--> (d*T_loc, H/d, hd) --reorder--> whole padded sequences, packed
    head -> seq:  the mirror image.

Each direction is an ``autograd.Function`` whose backward is the other direction (an all-to-all
with equal splits is a permutation, so its adjoint is its inverse). Padding sits at the end of
each sequence, so with causal attention no real token ever attends to padding; the caller masks
padded tokens out of the loss.

With fewer KV heads than the degree, K and V are repeated (``d / kv_heads`` times each head)
before the scatter so that each rank receives the KV head its query heads use; the degree must
divide the query heads and either divide or be a multiple of the KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["ShardLayout", "shard_layout", "seq_to_head", "head_to_seq", "scatter_heads", "gather_heads",
           "UlyssesAttention", "kv_repeats"]


# ------------------------------------------------------------------------------------------------
# pure helpers: who holds which tokens
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """Where every token of a group's sequences lives, before and after the all-to-all.

    ``chunks[i]`` tokens of sequence ``i`` per rank; rank ``r`` holds positions
    ``[r*chunks[i], (r+1)*chunks[i])`` of it, of which those ``< lengths[i]`` are real.
    """

    degree: int
    rank: int
    """This rank's index inside the group (0..degree-1)."""
    lengths: tuple[int, ...]
    chunks: tuple[int, ...]
    local_tokens: int
    """Tokens every rank of the group holds (padding included): ``sum(chunks)``."""
    local_cu_seqlens: torch.Tensor
    """(n+1,) int32 cumulative chunk sizes: where each sequence's slice sits in the local pack."""
    full_cu_seqlens: torch.Tensor
    """(n+1,) int32 cumulative padded lengths ``d*chunks[i]``: the gathered pack."""
    full_max_seqlen: int
    gather_index: torch.Tensor
    """(d*T_loc,) rows of the rank-major gathered tensor, in whole-sequence order."""
    scatter_index: torch.Tensor
    """(d*T_loc,) the inverse permutation: whole-sequence rows back to rank-major order."""

    @property
    def padded_lengths(self) -> tuple[int, ...]:
        """Each sequence's length with its end padding (``degree * chunks[i]``)."""
        return tuple(self.degree * c for c in self.chunks)

    def local_positions(self) -> torch.Tensor:
        """(T_loc,) true position ids of this rank's tokens (padding continues past the end)."""
        parts = [torch.arange(self.rank * c, (self.rank + 1) * c) for c in self.chunks]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def local_valid(self) -> torch.Tensor:
        """(T_loc,) bool: which of this rank's tokens are real (not padding)."""
        return self.local_positions() < torch.repeat_interleave(torch.tensor(self.lengths), torch.tensor(self.chunks))


def shard_layout(lengths: Sequence[int], degree: int, rank: int) -> ShardLayout:
    """The layout of sequences ``lengths`` on a group of ``degree`` as seen by group rank ``rank``.
    Raises ValueError for an empty group, a non-positive length or a rank outside the group."""
    d = int(degree)
    if d < 1 or not 0 <= rank < d:
        raise ValueError(f"rank {rank} is not in a group of degree {d}")
    lens = tuple(int(s) for s in lengths)
    if not lens or min(lens) < 1:
        raise ValueError(f"a group needs at least one sequence of positive length, got {list(lens)}")
    chunks = tuple(-(-s // d) for s in lens)
    c = torch.tensor(chunks, dtype=torch.long)
    zero = torch.zeros(1, dtype=torch.long)
    local_off = torch.cat([zero, c.cumsum(0)])
    T = int(local_off[-1])
    full_cu = torch.cat([zero, (c * d).cumsum(0)])
    # whole sequence i = chunk of rank 0, chunk of rank 1, ... where rank r's chunk of i sits at
    # rows r*T + local_off[i] ... of the rank-major gathered tensor
    gather = torch.cat([
        (torch.arange(d)[:, None] * T + local_off[i] + torch.arange(chunks[i])[None, :]).reshape(-1)
        for i in range(len(lens))
    ])
    scatter = torch.empty_like(gather)
    scatter[gather] = torch.arange(gather.numel())
    return ShardLayout(degree=d, rank=int(rank), lengths=lens, chunks=chunks, local_tokens=T,
                       local_cu_seqlens=local_off.to(torch.int32), full_cu_seqlens=full_cu.to(torch.int32),
                       full_max_seqlen=int(max(chunks)) * d, gather_index=gather, scatter_index=scatter)


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How many times each KV head is repeated before the scatter (1 when the degree divides the
    KV heads). Raises ValueError when the KV heads cannot be spread over ``degree`` ranks."""
    if kv_heads % degree == 0:
        return 1
    if degree % kv_heads == 0:
        return degree // kv_heads
    raise ValueError(f"Ulysses degree {degree} neither divides nor is a multiple of the {kv_heads} KV heads")


# ------------------------------------------------------------------------------------------------
# the collectives
# ------------------------------------------------------------------------------------------------


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    d = dist.get_world_size(group)
    T, H, hd = x.shape
    send = x.reshape(T, d, H // d, hd).transpose(0, 1).contiguous()  # (d, T, H/d, hd): head chunk j for rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # (d, T, H/d, hd): recv[j] = rank j's tokens
    return recv.reshape(d * T, H // d, hd)  # (d*T, H/d, hd), rank-major


def _head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    d = dist.get_world_size(group)
    dT, h, hd = y.shape
    T = dT // d
    send = y.reshape(d, T, h, hd).contiguous()  # (d, T, h, hd): send[j] = rank j's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # (d, T, h, hd): recv[j] = my tokens, head chunk j
    return recv.transpose(0, 1).reshape(T, d * h, hd)  # (T, H, hd)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _head_to_seq(grad.contiguous(), ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _head_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_head(grad.contiguous(), ctx.group), None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """Scatter heads, gather sequence: ``(T_loc, H, hd)`` on each of the group's ``d`` ranks ->
    ``(d*T_loc, H/d, hd)`` ordered by source rank. Differentiable (backward: ``head_to_seq``)."""
    return _SeqToHead.apply(x, group)


def head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The reverse of ``seq_to_head``: ``(d*T_loc, h, hd)`` rank-major -> ``(T_loc, d*h, hd)``.
    Differentiable (backward: ``seq_to_head``)."""
    return _HeadToSeq.apply(y, group)


def scatter_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, gather_index: torch.Tensor
                  ) -> tuple[torch.Tensor, int, int]:
    """The all-to-all before attention, q, k and v in one: ``(T_loc, H, hd)``, ``(T_loc, KV, hd)`` on
    each of the group's ``d`` ranks -> ``(qkv (S, H/d + 2*KV'/d, hd), H/d, KV'/d)``: whole sequences
    (rows in ``gather_index`` order, a layout's), this rank's query heads, then its K heads, then its
    V heads; ``KV' = KV * kv_repeats(KV, d)``. Differentiable. Raises ValueError when ``d`` does not
    divide the query heads or fit the KV heads."""
    d = dist.get_world_size(group)
    T, H, hd = q.shape
    if H % d:
        raise ValueError(f"Ulysses degree {d} must divide the {H} query heads")
    rep = kv_repeats(k.shape[1], d)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)  # (T, d, hd): one KV head per rank
        v = v.repeat_interleave(rep, dim=1)  # (T, d, hd)
    kvh = k.shape[1]
    # per destination rank j, its query heads then its K and V heads
    qkv = torch.cat([q.reshape(T, d, H // d, hd), k.reshape(T, d, kvh // d, hd), v.reshape(T, d, kvh // d, hd)],
                    dim=2).reshape(T, -1, hd)  # (T, H + 2*KV', hd)
    gathered = seq_to_head(qkv, group)  # (d*T, (H + 2*KV')/d, hd), rank-major
    return gathered.index_select(0, gather_index), H // d, kvh // d  # (S, (H + 2*KV')/d, hd), whole sequences


def gather_heads(out: torch.Tensor, group, scatter_index: torch.Tensor) -> torch.Tensor:
    """The all-to-all after attention: whole sequences ``(S, H/d, hd)`` -> this rank's tokens with every
    head ``(T_loc, H, hd)`` (``scatter_index``: a layout's). Differentiable."""
    return head_to_seq(out.index_select(0, scatter_index), group)  # (T_loc, H, hd)


class UlyssesAttention:
    """An attention callable (the model's ``attn``) running ``local_attn`` under Ulysses SP.

    Bound to one group and one ``ShardLayout``; the ``cu_seqlens`` the model passes describe the
    local pack and are ignored in favour of the layout's whole-sequence ``full_cu_seqlens``, which
    ``local_attn`` (an attention kernel, see ``workbench.runtime.attention``) gets for queries and keys.
    Q, K and V travel together in one all-to-all; the attention output returns in one more.
    """

    def __init__(self, group, layout: ShardLayout, local_attn: Callable) -> None:
        if layout.degree > 1 and dist.get_world_size(group) != layout.degree:
            raise ValueError(f"the layout is for degree {layout.degree} but the group has "
                             f"{dist.get_world_size(group)} ranks")
        self.group = group
        self.layout = layout
        self.local_attn = local_attn
        self._device_index: tuple | None = None

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # moved once per device, not once per layer
        if self._device_index is None or self._device_index[0].device != device:
            lay = self.layout
            self._device_index = (lay.gather_index.to(device), lay.scatter_index.to(device),
                                  lay.full_cu_seqlens.to(device))
        return self._device_index

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
        lay = self.layout
        gather, scatter, full_cu = self._indices(q.device)
        qkv, hq, hk = scatter_heads(q, k, v, self.group, gather)  # (S, hq + 2*hk, hd), whole sequences
        qf, kf, vf = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
        mx = lay.full_max_seqlen
        out = self.local_attn(qf.contiguous(), kf.contiguous(), vf.contiguous(), full_cu, full_cu, mx, mx)  # (S, hq, hd)
        return gather_heads(out, self.group, scatter)  # (T, H, hd)
