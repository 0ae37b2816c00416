"""Context parallelism in one process: the ``u x c`` layout (who holds which positions), what the CP
attention selects, the shards the executor feeds the model, and the plan refusals.

The collectives themselves (K/V all-gather, its reduce-scatter backward, whole steps against the
single-process update) run on 4 gloo ranks in test_cp_dist.py.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from workbench.cost import CostModel  # noqa: E402
from workbench.runtime.cp import CPLayout, cp_chunk, cp_layout, cp_positions, group_layout  # noqa: E402
from workbench.runtime.groups import split_subgroups  # noqa: E402
from workbench.runtime.step import IGNORE, check_plan, make_shard  # noqa: E402
from workbench.runtime.ulysses import ShardLayout, shard_layout  # noqa: E402
from workbench.solve.plan import Group, PlanError, build_plan  # noqa: E402
from workbench.models import get_model  # noqa: E402
from workbench.specs import ClusterSpec, load_profile  # noqa: E402

SPLITS = [(1, 2), (2, 2), (1, 4), (4, 2), (2, 4), (3, 2), (1, 8)]
LENGTHS = [1, 2, 3, 5, 7, 8, 13, 16, 31, 33, 64, 100]


def _chunks_of(positions, m):
    return sorted({int(p) // m for p in positions})


# ------------------------------------------------------------------------------------------------
# layout
# ------------------------------------------------------------------------------------------------


def test_chunk_size_covers_the_sequence_and_fits_the_ulysses_size():
    assert cp_chunk(5, 2, 2) == 2 and cp_chunk(17, 2, 2) == 5 and cp_chunk(1, 2, 2) == 1
    assert cp_chunk(3, 4, 2) == 2  # ceil(3/4) = 1, but 2m must be a multiple of u = 4
    assert cp_chunk(9, 3, 2) == 3  # 2m a multiple of 3 and even
    for u, c in SPLITS:
        for s in LENGTHS:
            m = cp_chunk(s, u, c)
            assert 2 * c * m >= s and (2 * m) % u == 0 and m >= 1
            assert 2 * c * (m - 1) < s or (2 * (m - 1)) % u or m == 1  # the smallest such m


def test_the_layout_of_a_2x2_group_by_hand():
    """Sequences of 5, 17 and 1 tokens on a 2 x 2 group: chunks of 2, 5 and 1; CP rank 0 holds
    chunks 0 and 3, CP rank 1 chunks 1 and 2; Ulysses rank a the a-th half of them."""
    want = {0: [0, 1, 0, 1, 2, 3, 4, 0], 1: [6, 7, 15, 16, 17, 18, 19, 3],
            2: [2, 3, 5, 6, 7, 8, 9, 1], 3: [4, 5, 10, 11, 12, 13, 14, 2]}
    for k, pos in want.items():
        lay = cp_layout([5, 17, 1], 2, 2, k)
        assert lay.local_positions().tolist() == pos
        assert (lay.ulysses_rank, lay.cp_rank) == (k % 2, k // 2)
        assert lay.chunk == (2, 5, 1) and lay.padded_lengths == (8, 20, 4)
        assert lay.local_cu_seqlens.tolist() == [0, 2, 7, 8]
        assert lay.local_valid().tolist() == [p < s for p, s in zip(pos, [5, 5, 17, 17, 17, 17, 17, 1])]


@pytest.mark.parametrize("u, c", SPLITS)
def test_every_position_is_held_once_in_balanced_chunks(u, c):
    """Over the group's ranks every position of every padded sequence is held exactly once; CP
    rank j holds exactly chunks j and 2c-1-j, each Ulysses rank a contiguous 1/u of them; padding
    only at the end; every rank holds the same number of tokens."""
    for k in range(u * c):
        lay = cp_layout(LENGTHS, u, c, k)
        assert lay.degree == u * c and lay.local_tokens == sum(2 * m // u for m in lay.chunk)
    for i, s in enumerate(LENGTHS):
        m = cp_chunk(s, u, c)
        seen = []
        for j in range(c):
            cp_pos = cp_positions(s, u, c, j)
            assert _chunks_of(cp_pos, m) == sorted({j, 2 * c - 1 - j})
            for a in range(u):
                lay = cp_layout(LENGTHS, u, c, j * u + a)
                lo, hi = lay.local_cu_seqlens[i].item(), lay.local_cu_seqlens[i + 1].item()
                mine = lay.local_positions()[lo:hi]
                assert mine.tolist() == cp_pos[a * 2 * m // u:(a + 1) * 2 * m // u].tolist()
                assert lay.local_valid()[lo:hi].tolist() == (mine < s).tolist()
                seen += mine.tolist()
        assert sorted(seen) == list(range(2 * c * m))


@pytest.mark.parametrize("u, c", SPLITS)
def test_the_keys_of_each_local_chunk_are_its_sequence_prefix(u, c):
    """The selection from the all-gathered K/V: with CP rank r's local row t of sequence i at row
    r*S + t of the gathered tensor, ``key_index`` picks, for every local chunk in order, exactly
    positions 0 .. chunk end of its sequence; the query segments are the chunks' own rows; every
    CP rank gets the same number of keys (causal work balanced)."""
    lays = [cp_layout(LENGTHS, u, c, j * u) for j in range(c)]
    gathered = torch.cat([lay.cp_positions for lay in lays])  # what each gathered row holds: its position
    seq_of = torch.cat([torch.full((2 * m,), i) for i, m in enumerate(lays[0].chunk)])
    gathered_seq = seq_of.repeat(c)
    keys_per_rank = set()
    for j, lay in enumerate(lays):
        picked, picked_seq = gathered[lay.key_index], gathered_seq[lay.key_index]
        kc, qc = lay.key_cu_seqlens.tolist(), lay.query_cu_seqlens.tolist()
        assert len(kc) == len(qc) == 2 * len(LENGTHS) + 1
        for seg in range(2 * len(LENGTHS)):
            i, t = seg // 2, (j if seg % 2 == 0 else 2 * c - 1 - j)
            m = lay.chunk[i]
            assert picked[kc[seg]:kc[seg + 1]].tolist() == list(range((t + 1) * m))
            assert set(picked_seq[kc[seg]:kc[seg + 1]].tolist()) == {i}
            # the queries: the chunk's m rows of the CP-local pack, the last rows of that key range
            assert lay.cp_positions[qc[seg]:qc[seg + 1]].tolist() == list(range(t * m, (t + 1) * m))
        assert lay.max_query == max(lay.chunk) and lay.max_key == max(kc[s + 1] - kc[s] for s in range(len(kc) - 1))
        keys_per_rank.add(lay.key_index.numel())
    assert keys_per_rank == {sum((2 * c + 1) * m for m in lays[0].chunk)}


@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_with_cp_1_the_layout_is_the_old_shard_layout(d):
    """c = 1: ``group_layout`` is ``shard_layout`` itself, and the general position rule (the whole
    sequence padded to a multiple of u, contiguous 1/u slices) gives exactly its positions."""
    for k in range(d):
        lay = group_layout(LENGTHS, d, 1, k)
        old = shard_layout(LENGTHS, d, k)
        assert isinstance(lay, ShardLayout)
        for f in dataclasses.fields(ShardLayout):
            x, y = getattr(lay, f.name), getattr(old, f.name)
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f.name
        by_rule = torch.cat([cp_positions(s, d, 1, 0).reshape(d, -1)[k] for s in LENGTHS])
        assert lay.local_positions().tolist() == by_rule.tolist()
        assert lay.padded_lengths == tuple(-(-s // d) * d for s in LENGTHS)


def test_layout_errors():
    with pytest.raises(ValueError, match="does not divide the degree 4"):
        group_layout([5], 4, 3, 0)
    with pytest.raises(ValueError, match="its layout is shard_layout"):
        cp_layout([5], 4, 1, 0)
    with pytest.raises(ValueError, match="rank 4 is not in a group of 2 x 2"):
        cp_layout([5], 2, 2, 4)
    with pytest.raises(ValueError, match="positive length"):
        cp_layout([5, 0], 2, 2, 0)
    with pytest.raises(ValueError, match="CP rank 2"):
        cp_positions(5, 1, 2, 2)
    assert isinstance(group_layout([5], 4, 2, 1), CPLayout)


# ------------------------------------------------------------------------------------------------
# the shards the executor feeds the model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d, c", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_make_shard_takes_tokens_and_labels_from_the_padded_sequence(d, c):
    gen = torch.Generator().manual_seed(d * 10 + c)
    seqs = [torch.randint(1, 100, (s,), generator=gen) for s in LENGTHS]
    targets = 0
    for k in range(d):
        sh = make_shard(seqs, d, k, c)
        assert isinstance(sh.layout, CPLayout) and sh.max_seqlen == max(sh.layout.chunks)
        lo = 0
        for s, seq, n in zip(LENGTHS, seqs, sh.layout.chunks):
            pos = sh.positions[lo:lo + n]
            for p, tok, lab in zip(pos.tolist(), sh.tokens[lo:lo + n].tolist(), sh.labels[lo:lo + n].tolist()):
                assert tok == (int(seq[p]) if p < s else 0)
                assert lab == (int(seq[p + 1]) if p < s - 1 else IGNORE)
            lo += n
        assert sh.cu_seqlens.tolist() == sh.layout.local_cu_seqlens.tolist()
        assert sh.real_tokens == int((sh.positions < torch.repeat_interleave(torch.tensor(LENGTHS),
                                                                             torch.tensor(sh.layout.chunks))).sum())
        targets += sh.targets
    assert targets == sum(s - 1 for s in LENGTHS)  # every target on exactly one rank


def test_make_shard_with_cp_1_is_the_contiguous_slice():
    """The Ulysses-only shard, by an independent rule: rank r's contiguous 1/d of the padded sequence."""
    seqs = [torch.arange(1, s + 1) for s in LENGTHS]
    for d in (1, 2, 4):
        for r in range(d):
            sh = make_shard(seqs, d, r)
            want_t, want_l = [], []
            for s in LENGTHS:
                n = -(-s // d)
                full = list(range(1, s + 1)) + [0] * (d * n - s)
                lab = list(range(2, s + 1)) + [IGNORE] * (d * n - s + 1)
                want_t += full[r * n:(r + 1) * n]
                want_l += lab[r * n:(r + 1) * n]
            assert sh.tokens.tolist() == want_t and sh.labels.tolist() == want_l
            assert isinstance(sh.layout, ShardLayout)


def test_split_subgroups():
    assert split_subgroups(range(4, 8), 2) == ([(4, 5), (6, 7)], [(4, 6), (5, 7)])
    assert split_subgroups(range(0, 4), 4) == ([(0,), (1,), (2,), (3,)], [(0, 1, 2, 3)])
    assert split_subgroups(range(8, 16), 1) == ([tuple(range(8, 16))], [(r,) for r in range(8, 16)])
    with pytest.raises(ValueError, match="does not divide the group's 4 ranks"):
        split_subgroups(range(4), 3)


# ------------------------------------------------------------------------------------------------
# plan refusals: one line each, before anything runs
# ------------------------------------------------------------------------------------------------


def _cost(num_gpus: int = 4):
    return CostModel(load_profile("cpu-gloo-tiny"), get_model("tiny"),
                     ClusterSpec(num_gpus=num_gpus, gpus_per_node=num_gpus, gpu_memory_gb=4.0, zero_stage=0))


def cp_plan(micro, lengths, cost=None):
    """``build_plan`` of ``micro = [[(degree, cp, [seq, ...]), ...] per micro-step]``: build_plan's
    (Ulysses-only) groups with each one's cp set, found by its sequences."""
    plan = build_plan("hand", [[(d, s) for d, _, s in ms] for ms in micro], lengths, cost or _cost())
    cp_of = {tuple(s): c for ms in micro for _, c, s in ms}
    steps = tuple(dataclasses.replace(ms, groups=tuple(dataclasses.replace(g, cp=cp_of[tuple(g.sequences)])
                                                       for g in ms.groups)) for ms in plan.micro_steps)
    return dataclasses.replace(plan, micro_steps=steps)


def test_check_plan_refuses_splits_the_run_cannot_execute():
    lengths = [30, 7, 12]
    plan = cp_plan([[(4, 2, [0, 1, 2])]], lengths)
    shapes = [(1, 1), (2, 1), (4, 1), (4, 2)]
    check_plan(plan, lengths, 4, [1, 2, 4], shapes=shapes, heads=4, kv_heads=2)  # 2x2 fits
    with pytest.raises(PlanError, match=r"split 2x2 \(Ulysses x CP\), which has no process groups: this run's "
                                        r"shapes are 1x1, 2x1, 4x1; plan with this run's cost model"):
        check_plan(plan, lengths, 4, [1, 2, 4], shapes=[(1, 1), (2, 1), (4, 1)])
    with pytest.raises(PlanError, match=r"split 2x2 \(Ulysses x CP\) but this run made process groups for "
                                        r"Ulysses-only splits"):
        check_plan(plan, lengths, 4, [1, 2, 4])
    # the Ulysses size, not the degree, must fit the heads: 4x1 does not fit 2 query heads, 2x2 and 1x4 do
    plan4 = cp_plan([[(4, 1, [0, 1, 2])]], lengths)
    with pytest.raises(PlanError, match=r"micro-step 0: group at ranks \[0, 1, 2, 3\] \(split 4x1\) runs Ulysses over "
                                        r"4 ranks, which does not fit the model's 2 query / 1 KV heads .* plan with "
                                        r"--strategy auto"):
        check_plan(plan4, lengths, 4, heads=2, kv_heads=1)
    check_plan(plan, lengths, 4, heads=2, kv_heads=1)
    check_plan(cp_plan([[(4, 4, [0, 1, 2])]], lengths), lengths, 4, heads=2, kv_heads=1)
    with pytest.raises(PlanError, match=r"\(split 2x2\) runs Ulysses over 2 ranks, which does not fit the model's "
                                        r"3 query / 3 KV heads"):
        check_plan(plan, lengths, 4, heads=3, kv_heads=3)
    # a cp that does not divide the degree never makes a group
    with pytest.raises(PlanError, match="context-parallel size 3 does not divide its degree 4"):
        Group(degree=4, ranks=(0, 1, 2, 3), sequences=(0,), lengths=(30,), time_ms=1.0, memory_gb=0.1, cp=3)


def test_a_plan_with_splits_round_trips_through_json():
    from workbench.solve import plan_from_dict

    plan = cp_plan([[(2, 2, [0]), (2, 1, [1])], [(4, 4, [2])]], [30, 7, 12])
    back = plan_from_dict(plan.to_dict())
    assert sorted((g.sequences, g.degree, g.cp, g.split) for ms in back.micro_steps for g in ms.groups) == \
        [((0,), 2, 2, "1x2"), ((1,), 2, 1, "2x1"), ((2,), 4, 4, "1x4")]
