"""Context parallelism inside a group: a ``u x c`` split, K and V all-gathered over the CP ranks.

A group of degree ``d = u x c`` (a plan's ``Group.ulysses`` and ``Group.cp``) runs Ulysses over
``u`` ranks inside context parallelism over ``c``. Group rank ``k`` (``rank - ranks[0]``) is
Ulysses rank ``a = k % u`` of CP rank ``j = k // u``: the Ulysses sub-group is the block of
``u`` consecutive ranks ``ranks[0] + j*u + [0, u)`` (kept inside a node, where the all-to-all has
the fast link), the CP sub-group the strided ``ranks[0] + a + u*[0, c)``.

**Layout** (``cp_layout``). A sequence of ``s`` tokens is padded at its end to ``L = 2c*m`` with
``m = ceil(s / 2c)`` rounded up so that ``2m`` is a multiple of ``u``, and cut into ``2c`` chunks of
``m``. CP rank ``j`` holds chunks ``j`` and ``2c-1-j`` (a short early chunk and a long late one,
so every CP rank has the same causal work), concatenated: ``2m`` tokens, its *CP-local sequence*.
Ulysses rank ``a`` of CP rank ``j`` holds the ``a``-th contiguous ``1/u`` slice of those ``2m``
tokens, so inside the Ulysses sub-group the CP-local sequences are exactly what ``ShardLayout``
shards (already multiples of ``u``: no more padding). Positions are the true ones (RoPE), labels
come from the padded whole sequence. With ``c = 1`` there is no chunk boundary to respect and the
layout is ``workbench.runtime.ulysses.shard_layout`` itself (``group_layout`` returns it).

**Attention of one layer** (``CPAttention``), every rank of the group, in this order:

1. (``u > 1``) the Ulysses all-to-all over the ``u`` sub-group, q, k, v together: this rank now
   holds, for ``H/u`` query heads and ``KV'/u`` KV heads (``KV' = KV x kv_repeats(KV, u)``), the
   ``2m`` tokens of its CP rank's chunks of every sequence (``S = sum 2m`` rows);
2. K and V (concatenated on the head axis) all-gathered over the ``c`` CP ranks by ``gather_kv``,
   an autograd Function whose backward reduce-scatters (sums) the gradients back;
3. per sequence and local chunk ``t`` (``j``, then ``2c-1-j``), the keys are the prefix
   ``[0, (t+1)m)`` of the whole sequence, selected from the gathered tensor with one
   ``index_select`` into one packed key tensor (``key_index``); the queries are the chunk's ``m``
   rows; the kernel runs causal attention with bottom-right alignment (the chunk's queries are the
   last rows of their key range). The selection keeps only its index for backward, so the
   gathered tensor is freed as soon as the selection is made;
4. (``u > 1``) the output back through the Ulysses all-to-all.

**Memory kept for backward per layer** (what the cost model prices), per rank, with ``b`` bytes
per activation element (2 in bf16, 4 in fp32), ``hq = H/u`` query heads and ``hk = KV'/u`` KV heads
per rank, ``hd`` the head width, ``S = sum 2m_i`` the CP-local rows:

    the kernel's q and output         2 x S x hq x hd x b           (as any attention over S rows)
    the kernel's log-sum-exp          hq x S x 4                    (flash kernels; fp32)
    the selected K and V              2 x hk x hd x b x sum (2c+1) m_i  ~  2 x hk x hd x b x sum s_i (1 + 1/2c)

Each local chunk's key segment is its sequence's prefix: ``(j+1)m`` rows for chunk ``j`` and
``(2c-j)m`` for chunk ``2c-1-j``, ``(2c+1)m`` per sequence whatever ``j`` is. The prefixes overlap
but a varlen kernel takes one key segment per query segment, so chunk ``j``'s prefix is stored
twice; the all-gathered ``2c m`` rows are never kept (the selection keeps only its index). So the
K/V a CP rank keeps are slightly *more* than one whole sequence's for its heads: context
parallelism divides the q/output memory by ``c``, not the K/V memory (cheap under GQA, which is
why Llama 3 used it). Also kept, once per group and shared by every layer: the int64 indices
(``key_index``, ``(2c+1) sum m_i`` entries; with ``u > 1`` the Ulysses gather and scatter, ``S``
each). The PyTorch path (SDPA per segment) keeps K/V repeated to the query heads (``hq`` instead of
``hk``). With ``--recompute`` one block's worth lives at a time, during its backward. Transient:
the gathered ``c x S`` rows in the forward (freed by the selection), and in the backward a
zero-filled gradient of that size (the selection's backward) that the reduce-scatter consumes.

**Collectives of one layer** (per rank; elements, times ``b`` for bytes; ``T = S/u`` rows per rank):

    pass       op (group)                          tensor per rank                      on the wire per rank
    forward    all-to-all qkv (Ulysses, u > 1)     T x (H + 2KV') x hd in and out       (u-1)/u of it each way
               all-gather K,V (CP)                 in S x 2hk x hd, out c x S x 2hk x hd   receives (c-1) x S x 2hk x hd
               all-to-all out (Ulysses, u > 1)     T x H x hd in and out                (u-1)/u of it each way
    backward   all-to-all d(out) (Ulysses)         T x H x hd                           (u-1)/u each way
               reduce-scatter dK,dV (CP, sum)      in c x S x 2hk x hd, out S x 2hk x hd   sends (c-1) x S x 2hk x hd
               all-to-all d(qkv) (Ulysses)         T x (H + 2KV') x hd                  (u-1)/u each way
    recompute  the forward's three again, inside the block's backward, before its backward's three

``tests/test_cp_dist.py`` records them on real ranks (order, sizes, groups) and counts what
autograd keeps against the table above.

Every rank of a group makes them in this order, layer after layer; in a lockstep pass a rank
serving several groups makes each group's in the pass's order (``PassAttention``), and the
backward runs in reverse, so no two ranks wait on each other's collectives in opposite orders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from workbench.runtime.ulysses import ShardLayout, gather_heads, scatter_heads, shard_layout

__all__ = ["CPLayout", "cp_chunk", "cp_positions", "cp_layout", "group_layout", "gather_kv", "CPAttention",
           "all_gather_single", "reduce_scatter_single"]


# ------------------------------------------------------------------------------------------------
# pure helpers: who holds which tokens
# ------------------------------------------------------------------------------------------------


def _check_split(ulysses: int, cp: int) -> None:
    if ulysses < 1 or cp < 1:
        raise ValueError(f"a split needs ulysses >= 1 and cp >= 1, got {ulysses} x {cp}")


def cp_chunk(length: int, ulysses: int, cp: int) -> int:
    """``m``: the chunk size of a sequence of ``length`` tokens on a ``ulysses x cp`` group (cp > 1):
    ``ceil(length / 2cp)`` rounded up so that ``2m`` is a multiple of ``ulysses``. Raises ValueError
    for a non-positive length or split."""
    _check_split(ulysses, cp)
    if length < 1:
        raise ValueError(f"a sequence needs at least one token, got {length}")
    m = -(-int(length) // (2 * cp))
    step = ulysses if ulysses % 2 == 0 else 2 * ulysses  # 2m a multiple of lcm(2, u)
    return -(-2 * m // step) * step // 2


def cp_positions(length: int, ulysses: int, cp: int, cp_rank: int) -> torch.Tensor:
    """``(n,)`` positions in the padded sequence that CP rank ``cp_rank`` holds, in its local order:
    chunks ``j`` and ``2cp-1-j`` of ``cp_chunk`` tokens (``cp > 1``); with ``cp = 1`` the whole
    sequence padded to a multiple of ``ulysses`` (``shard_layout``'s padding). Positions at or
    past ``length`` are padding. Raises ValueError for a rank outside ``0..cp-1``."""
    _check_split(ulysses, cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"CP rank {cp_rank} is not in 0..{cp - 1}")
    if cp == 1:
        return torch.arange(-(-int(length) // ulysses) * ulysses)
    return _chunk_positions(cp_chunk(length, ulysses, cp), cp, cp_rank)


def _chunk_positions(m: int, cp: int, j: int) -> torch.Tensor:
    """(2m,) positions of chunks ``j`` and ``2cp-1-j`` (of ``m`` tokens each), in that order."""
    return torch.cat([torch.arange(j * m, (j + 1) * m), torch.arange((2 * cp - 1 - j) * m, (2 * cp - j) * m)])


@dataclass(frozen=True)
class CPLayout:
    """Where every token of a ``u x c`` group's sequences lives (``c > 1``), and what the CP
    attention selects. Rank-level fields mirror ``ShardLayout``'s (``local_*``, ``chunks``,
    ``padded_lengths``) so the executor packs both alike."""

    ulysses: int
    cp: int
    rank: int
    """This rank's index inside the group (0..u*c-1): Ulysses rank ``rank % u`` of CP rank ``rank // u``."""
    lengths: tuple[int, ...]
    chunk: tuple[int, ...]
    """``m`` per sequence: the padded sequence is ``2c`` chunks of ``m``."""
    local: ShardLayout
    """The Ulysses layout (degree ``u``, rank ``a``) of this CP rank's sequences (``2m`` tokens each)."""
    cp_positions: torch.Tensor
    """(S,) positions (in the padded sequence) of this CP rank's tokens, packed: the rows the
    Ulysses all-to-all gathers, sequence after sequence."""
    query_cu_seqlens: torch.Tensor
    """(2n+1,) int32: the query segments in that pack, two chunks of ``m`` per sequence."""
    key_cu_seqlens: torch.Tensor
    """(2n+1,) int32: their key segments in the selection, prefixes ``(j+1)m`` and ``(2c-j)m``."""
    key_index: torch.Tensor
    """(K,) rows of the all-gathered K/V (``c`` CP-rank blocks of ``S`` rows) the selection takes."""
    max_query: int
    max_key: int

    @property
    def degree(self) -> int:
        return self.ulysses * self.cp

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses

    @property
    def cp_rank(self) -> int:
        return self.rank // self.ulysses

    @property
    def chunks(self) -> tuple[int, ...]:
        """Tokens of each sequence this rank holds (``2m / u``)."""
        return self.local.chunks

    @property
    def padded_lengths(self) -> tuple[int, ...]:
        """Each sequence's length with its end padding (``2c * m``)."""
        return tuple(2 * self.cp * m for m in self.chunk)

    @property
    def local_tokens(self) -> int:
        return self.local.local_tokens

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        """(n+1,) int32: where each sequence's slice sits in this rank's pack."""
        return self.local.local_cu_seqlens

    def local_positions(self) -> torch.Tensor:
        """(T_loc,) true position ids of this rank's tokens (padding continues past the end)."""
        first = self.local.full_cu_seqlens[:-1].long()  # each CP-local sequence's first row (2m: no more padding)
        rows = self.local.local_positions() + torch.repeat_interleave(first, torch.tensor(self.chunks))
        return self.cp_positions[rows]

    def local_valid(self) -> torch.Tensor:
        """(T_loc,) bool: which of this rank's tokens are real (not padding)."""
        return self.local_positions() < torch.repeat_interleave(torch.tensor(self.lengths), torch.tensor(self.chunks))


def cp_layout(lengths: Sequence[int], ulysses: int, cp: int, rank: int) -> CPLayout:
    """The layout of sequences ``lengths`` on a ``ulysses x cp`` group (``cp > 1``) as seen by group
    rank ``rank``. Raises ValueError for ``cp < 2`` (that layout is ``shard_layout``'s), an empty
    group, a non-positive length or a rank outside the group."""
    u, c = int(ulysses), int(cp)
    _check_split(u, c)
    if c < 2:
        raise ValueError("with cp = 1 a group is Ulysses only: its layout is shard_layout's")
    if not 0 <= rank < u * c:
        raise ValueError(f"rank {rank} is not in a group of {u} x {c} = {u * c}")
    lens = tuple(int(s) for s in lengths)
    if not lens or min(lens) < 1:
        raise ValueError(f"a group needs at least one sequence of positive length, got {list(lens)}")
    a, j = rank % u, rank // u
    ms = [cp_chunk(s, u, c) for s in lens]
    local = shard_layout([2 * m for m in ms], u, a)
    S = sum(2 * m for m in ms)
    pos, q_sizes, k_sizes, rows = [], [], [], []
    off = 0
    for m in ms:
        pos.append(_chunk_positions(m, c, j))
        for t in (j, 2 * c - 1 - j):  # the local chunks, in local order
            p = torch.arange((t + 1) * m)  # the keys of chunk t: the prefix up to its end
            chunk_of = p // m
            holder = torch.where(chunk_of < c, chunk_of, 2 * c - 1 - chunk_of)  # the CP rank holding p
            within = torch.where(chunk_of < c, p % m, m + p % m)  # its row in that rank's CP-local sequence
            rows.append(holder * S + off + within)
            q_sizes.append(m)
            k_sizes.append((t + 1) * m)
        off += 2 * m
    zero = torch.zeros(1, dtype=torch.long)
    return CPLayout(ulysses=u, cp=c, rank=int(rank), lengths=lens, chunk=tuple(ms), local=local,
                    cp_positions=torch.cat(pos),
                    query_cu_seqlens=torch.cat([zero, torch.tensor(q_sizes).cumsum(0)]).to(torch.int32),
                    key_cu_seqlens=torch.cat([zero, torch.tensor(k_sizes).cumsum(0)]).to(torch.int32),
                    key_index=torch.cat(rows), max_query=max(ms), max_key=max(k_sizes))


def group_layout(lengths: Sequence[int], degree: int, cp: int, rank: int) -> ShardLayout | CPLayout:
    """The layout of a group of ``degree`` split ``(degree/cp) x cp`` for group rank ``rank``:
    ``shard_layout`` (Ulysses over the whole group, exactly as before splits existed) when
    ``cp = 1``, else ``cp_layout``. Raises ValueError when ``cp`` does not divide ``degree`` (and
    as those do)."""
    d, c = int(degree), int(cp)
    if c < 1 or d % c:
        raise ValueError(f"context-parallel size {c} does not divide the degree {d}")
    return shard_layout(lengths, d, rank) if c == 1 else cp_layout(lengths, d // c, c, rank)


# ------------------------------------------------------------------------------------------------
# the collective
# ------------------------------------------------------------------------------------------------

def all_gather_single(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
    """Every rank's ``x`` of ``group`` into ``out``, in rank order: one collective (NCCL's all-gather),
    under torch 2.13's name ``all_gather_single``, ``all_gather_into_tensor`` before it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
    """The sum over ``group`` of ``x``, this rank's block into ``out`` (NCCL's reduce-scatter), under
    torch 2.13's name ``reduce_scatter_single``, ``reduce_scatter_tensor`` before it."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        c = dist.get_world_size(group)
        out = x.new_empty((c * x.shape[0], *x.shape[1:]))  # (c*S, ...): CP rank r's rows at [r*S, (r+1)*S)
        all_gather_single(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        c = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // c, *grad.shape[1:]))  # (S, ...)
        reduce_scatter_single(out, grad.contiguous(), ctx.group)  # sum over the CP ranks of my rows' gradients
        return out, None


def gather_kv(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``x (S, ...)`` over the ``c`` ranks of ``group`` -> ``(c*S, ...)``, rank-major.
    Differentiable: the backward reduce-scatters (sums) the gradient, each rank getting its rows'."""
    return _GatherKV.apply(x, group)


class CPAttention:
    """An attention callable (the model's ``attn``) running the kernel ``local_attn`` on a ``u x c``
    group (module docstring): Ulysses over ``ulysses_group`` (None when ``u = 1``), K/V all-gathered
    over ``cp_group``. Bound to one ``CPLayout``; the boundaries the model passes describe the local
    pack and are ignored in favour of the layout's."""

    def __init__(self, ulysses_group, cp_group, layout: CPLayout, local_attn: Callable) -> None:
        u, c = layout.ulysses, layout.cp
        if (ulysses_group is None) != (u == 1) or (u > 1 and dist.get_world_size(ulysses_group) != u):
            raise ValueError(f"the layout is split {u} x {c} but the Ulysses group has "
                             f"{1 if ulysses_group is None else dist.get_world_size(ulysses_group)} ranks")
        if cp_group is None or dist.get_world_size(cp_group) != c:
            raise ValueError(f"the layout is split {u} x {c} but the CP group has "
                             f"{1 if cp_group is None else dist.get_world_size(cp_group)} ranks")
        self.ulysses_group = ulysses_group
        self.cp_group = cp_group
        self.layout = layout
        self.local_attn = local_attn
        self._device_index: tuple | None = None

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        # moved once per device, not once per layer
        if self._device_index is None or self._device_index[0].device != device:
            lay = self.layout
            self._device_index = tuple(t.to(device) for t in (
                lay.key_index, lay.local.gather_index, lay.local.scatter_index, lay.query_cu_seqlens,
                lay.key_cu_seqlens))
        return self._device_index

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
        lay = self.layout
        key_index, gather, scatter, cu_q, cu_k = self._indices(q.device)
        if self.ulysses_group is not None:
            qkv, hq, hk = scatter_heads(q, k, v, self.ulysses_group, gather)  # (S, hq + 2*hk, hd), CP-local sequences
            qf, kv = qkv[:, :hq].contiguous(), qkv[:, hq:].contiguous()  # (S, hq, hd), (S, 2*hk, hd)
        else:
            qf, hk = q, k.shape[1]
            kv = torch.cat([k, v], dim=1)  # (S, 2*hk, hd): one all-gather for both
        kv = gather_kv(kv, self.cp_group)  # (c*S, 2*hk, hd), CP-rank-major
        kv = kv.index_select(0, key_index)  # (K, 2*hk, hd): per local chunk, its sequence's prefix
        out = self.local_attn(qf, kv[:, :hk], kv[:, hk:], cu_q, cu_k, lay.max_query, lay.max_key)  # (S, hq, hd)
        if self.ulysses_group is not None:
            return gather_heads(out, self.ulysses_group, scatter)  # (T, H, hd)
        return out  # (T, H, hd)
