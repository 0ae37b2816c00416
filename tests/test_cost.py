"""Cost figures against hand computation from the published FlexSP constants."""

import math

import numpy as np
import pytest

from workbench.cost import CostModel, InfeasibleError
from workbench.models import get_model
from workbench.specs import ClusterSpec, HardwareProfile, load_profile

# FlexSP GPT-7B on A100-40G (REFERENCE.md): whole model, forward + backward
A, B, C = 5.128e-6, 0.1840, 629.4
A2A = {2: 119.5, 4: 104.1, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}


def test_compute_matches_published_fit(a100_7b_64):
    for s in (128, 8192, 131072):
        for d in (1, 2, 8, 32):
            assert a100_7b_64.compute_ms([s], d)[0] == pytest.approx((A * s * s + B * s) / d, rel=1e-9)
    assert a100_7b_64.group_overhead_ms(4) == pytest.approx(C)


def test_ulysses_all_to_all_by_hand(a100_7b_64):
    s, d, h, layers = 65536, 8, 4096, 32
    # q, k, v, o of (s/d) tokens x hidden in bf16; each rank sends (d-1)/d; forward + backward
    per_layer = 2 * (s / d) * 4 * h * (d - 1) / d
    expect = 2 * layers * per_layer / (A2A[d] * 1e9) * 1e3
    assert a100_7b_64.comm_ms([s], d)[0] == pytest.approx(expect, rel=1e-9)
    assert a100_7b_64.comm_ms([s], 1)[0] == 0.0
    assert a100_7b_64.time([s], d)[0] == pytest.approx((A * s * s + B * s) / d + expect, rel=1e-9)


def test_memory_and_budget_by_hand(a100_7b_64):
    m = get_model("7b")
    assert a100_7b_64.memory([8192], 2)[0] == pytest.approx(4.48e6 * 8192 / 2 / 1e9)
    # ZeRO-3 over 64 GPUs (FSDP2): fp32 parameters, fp32 gradients and Adam's two fp32 moments, all
    # sharded (7B's rows all divide by 64: no padding) ...
    states = (4 + 4 + 8) * m.params() / 64 / 1e9
    # ... plus FSDP's working set: two blocks all-gathered in bf16 (the one computing and the one
    # prefetched) and one block's fp32 gradient awaiting its reduce-scatter
    h, ffn = 4096, 11008
    block = 4 * h * h + 3 * h * ffn + 2 * h  # q, k, v, o; gate, up, down; two norms (MHA: kv_dim = h)
    working = (2 * 2 * block + 4 * block) / 1e9
    assert a100_7b_64.model_states_gb == pytest.approx(states + working)
    assert a100_7b_64.memory_budget_gb == pytest.approx(40 * 0.7 - states - working)


def test_min_degree_is_next_candidate_that_fits(a100_7b_64):
    per_gpu = a100_7b_64.memory_budget_gb * 1e9 / 4.48e6  # tokens per GPU
    for s in (1000, 5000, 20000, 100000, 160000):
        need = math.ceil(s / per_gpu)
        expect = 1 << (need - 1).bit_length()
        assert a100_7b_64.min_degree([s])[0] == expect
    # 7B has 32 heads: Ulysses stops at degree 32, so 200K tokens (needs 64) fits nowhere
    assert 64 not in a100_7b_64.degrees
    assert a100_7b_64.min_degree([200000])[0] == 0


def test_infeasible_message_names_sequence_memory_and_degree():
    cost = CostModel(load_profile("a100-40g-flexsp"), get_model("7b"), ClusterSpec(num_gpus=16))
    with pytest.raises(InfeasibleError) as e:
        cost.check_feasible([1000, 912384])
    msg = str(e.value)
    # past the cluster the degree is what the GPUs' budgets add up to (no longer rounded to a power of two)
    need = math.ceil(float(cost.memory([912384], 1)[0]) / cost.memory_budget_gb)
    assert 128 < need < 256 and "sequence 1 (912,384 tokens)" in msg and f"degree {need} " in msg and "40 GB GPUs" in msg
    assert "the cluster has 16 GPUs" in msg


def test_kv_replication_and_head_limit():
    m70 = get_model("70b")  # 64 heads, 8 KV heads
    cost = CostModel(load_profile("a100-40g-flexsp"), m70, ClusterSpec(num_gpus=64, gpu_memory_gb=80))
    assert cost.degrees == (1, 2, 4, 8, 16, 32, 64)
    s, d = 32768, 16
    hd = 128
    kv_eff = 16 * hd  # 8 KV heads replicated to 16
    per_layer = 2 * (s / d) * (2 * 8192 + 2 * kv_eff) * (d - 1) / d
    bw = A2A[16]
    assert cost.comm_ms([s], d)[0] == pytest.approx(2 * 80 * per_layer / (bw * 1e9) * 1e3, rel=1e-9)
    m13 = get_model("13b")  # 40 heads: Ulysses degrees must divide 40
    cost13 = CostModel(load_profile("a100-40g-flexsp"), m13, ClusterSpec(num_gpus=64))
    assert cost13.degrees == (1, 2, 4, 8)
    cp13 = CostModel(load_profile("a100-40g-flexsp"), m13, ClusterSpec(num_gpus=64), strategy="cp")
    assert cp13.degrees == (1, 2, 4, 8, 16, 24, 32, 48, 64)  # context parallelism of any size: every candidate


def _llama3(strategy, n=64, **kw):
    return CostModel(load_profile("h100-80g"), get_model("llama3-8b"),
                     ClusterSpec(num_gpus=n, gpus_per_node=8, gpu_memory_gb=80), strategy=strategy, **kw)


def test_context_parallel_split_by_hand():
    """Llama-3-8B (32 query, 8 KV heads of 128, bf16) on 64 H100s, a group of 64 as Ulysses 8 x CP 8."""
    cost = _llama3("auto")
    s, d, c, u, layers = 1_000_000, 64, 8, 8, 32
    # Ulysses inside the node: q and o (32 heads) and k, v (8 heads) of s/d tokens, (u-1)/u sent, at
    # the profile's all-to-all bandwidth for 8 ranks (145 GB/s); forward and backward
    uly = 2 * layers * 2 * (s / d) * (2 * 32 * 128 + 2 * 8 * 128) * (u - 1) / u / (145.0 * 1e9) * 1e3
    # CP: each rank all-gathers the K and V of its one KV head (8 heads over u = 8) of the whole
    # sequence, (c-1)/c of it from the others, in the forward, and reduce-scatters their gradients in
    # the backward; the 8 CP ranks sit on 8 nodes: the profile's bus bandwidth across nodes (180 GB/s)
    kv = s * 2 * 2 * 128 * 1 * (c - 1) / c
    cp = layers * 2 * kv / (180.0 * 1e9) * 1e3
    assert cost.ulysses_comm_ms([s], d, c)[0] == pytest.approx(uly, rel=1e-12)
    assert cost.cp_comm_ms([s], d, c)[0] == pytest.approx(cp, rel=1e-12)
    assert cost.comm_ms([s], d, c)[0] == pytest.approx(uly + cp, rel=1e-12)
    assert cost.time([s], d, c)[0] == pytest.approx(cost.compute_ms([s], d)[0] + uly + cp, rel=1e-12)
    # memory: the local share as Ulysses (its activations and, without recomputation, the whole
    # logits' backward: two fp32 gradients of 128,256 logits a token), plus the gathered K/V CP keeps
    # for every layer's backward beyond its own share (1 - 1/(2c) of the sequence's) and the layer's
    # gathered K/V while it runs
    local = (cost.activation_bytes_per_token + 2 * 4 * 128_256) * s / d
    extra = (layers * (1 - 1 / (2 * c)) + 1) * s * 2 * 2 * 128
    assert cost.memory([s], d, c)[0] == pytest.approx((local + extra) / 1e9, rel=1e-12)
    # with recomputation one layer's K/V is kept (the block being recomputed), and every forward
    # (the recomputed one too) all-gathers
    rc = _llama3("auto", recompute=True)
    assert rc.cp_memory_gb([s], d, c)[0] == pytest.approx((1 - 1 / (2 * c) + 1) * s * 512 / 1e9, rel=1e-12)
    assert rc.cp_comm_ms([s], d, c)[0] == pytest.approx(1.5 * cp, rel=1e-12)
    assert rc.collective_calls(d, c) == 2 * 3 * layers + 3 * layers


def test_strategies_and_their_shapes():
    uly, cp, auto = _llama3("ulysses"), _llama3("cp"), _llama3("auto")
    # Ulysses is capped by the 32 query heads (past the 8 KV heads K and V are replicated)
    assert uly.shapes == tuple((d, 1) for d in (1, 2, 4, 8, 16, 32)) and uly.ulysses_limit() == 32
    assert cp.shapes == tuple((d, d) for d in (1, 2, 4, 8, 16, 24, 32, 48, 64))  # CP of any size
    assert _llama3("ring").shapes == cp.shapes and _llama3("ring").strategy == "cp"
    assert auto.degrees == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert {d for d, c in auto.shapes if c > 1} == {2, 4, 8, 16, 24, 32, 48, 64}
    assert all(c > 1 for d, c in auto.shapes if d == 64)  # Ulysses alone cannot run 64
    # a degree's per-sequence figures without a split are the least over its splits
    s = np.array([2_000, 60_000, 500_000])
    for d in (8, 64):
        both = np.stack([auto.time(s, d, c) for c in auto.splits(d)])
        assert np.allclose(auto.time(s, d), both.min(axis=0))
    with pytest.raises(ValueError, match="does not divide degree 8"):
        auto.time(s, 8, 3)
    with pytest.raises(ValueError, match="32 query / 8 KV heads"):
        uly.time(s, 64, 1)


def test_auto_keeps_every_split_a_group_would_choose():
    """Pruning the dominated splits loses nothing: for random groups, the best split over every split
    the heads allow is as fast as the best over the kept shapes (brute force over all splits)."""
    auto = _llama3("auto")
    rng = np.random.default_rng(0)
    for _ in range(200):
        d = int(rng.choice([2, 4, 8, 16, 32, 64]))
        seqs = rng.integers(100, 300_000, size=int(rng.integers(1, 6)))
        every = [c for c in range(1, d + 1) if d % c == 0 and auto.split_supported(d // c)]

        def group(c, d=d, seqs=seqs):
            return (auto.group_overhead_ms(d, c) + float(auto.time(seqs, d, c).sum()),
                    float(auto.memory(seqs, d, c).sum()))
        fits = [group(c)[0] for c in every if group(c)[1] <= auto.memory_budget_gb]
        kept = [group(c)[0] for c in auto.splits(d) if group(c)[1] <= auto.memory_budget_gb]
        assert bool(fits) == bool(kept)
        if fits:
            assert min(kept) == pytest.approx(min(fits), rel=1e-12)
            c = auto.best_split(seqs, d)
            assert group(c)[0] == pytest.approx(min(fits), rel=1e-12)


def test_cp_attention_factor_enters_the_split_by_hand():
    """CP's extra attention: ``factor(c) * A * s^2 / d`` per sequence of a ``u x c`` split, ``factor``
    interpolated in log c, nothing for Ulysses alone and nothing in the group's fixed overhead."""
    import dataclasses

    p = load_profile("a100-40g-flexsp")
    plain = CostModel(p, get_model("7b"), ClusterSpec(num_gpus=64), strategy="auto")
    cost = CostModel(dataclasses.replace(p, cp_attention_factor={2: 0.4, 8: 1.0}), get_model("7b"),
                     ClusterSpec(num_gpus=64), strategy="auto")
    s = np.array([8192.0, 65536.0])
    # c = 4 lies halfway between 2 and 8 in log c: 0.4 + (1.0 - 0.4) / 2; past 8 the table's end holds
    for d, c, f in ((2, 2, 0.4), (8, 2, 0.4), (16, 4, 0.7), (8, 8, 1.0), (32, 16, 1.0)):
        assert cost.time(s, d, c) - plain.time(s, d, c) == pytest.approx(f * A * s * s / d, rel=1e-9)
        assert cost.cp_attention_ms(s, d, c) == pytest.approx(f * A * s * s / d, rel=1e-12)
        assert cost.group_overhead_ms(d, c) == plain.group_overhead_ms(d, c)
    assert np.array_equal(cost.time(s, 8, 1), plain.time(s, 8, 1))
    assert cost.cp_attention_factor(1) == 0.0 and plain.cp_attention_factor(8) == 0.0

    # the fit's quadratic: a_short below short_len, the forward twice with recomputation
    tiny = get_model("tiny")  # 2 layers
    short = {"a": 1e-6, "b": 0.01, "c": 1.0, "a_short": 3e-6, "short_len": 512}
    short_b = {"a": 2e-6, "b": 0.02, "c": 2.0, "a_short": 5e-6, "short_len": 512}
    tp = HardwareProfile(name="t", gpu="g", model="tiny", forward=short, backward=short_b,
                         all_to_all_gbps={2: 1.0, 4: 1.0}, provenance={"kind": "measured"})
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0, zero_stage=0)
    s = np.array([256.0, 2048.0])
    a_per_pair = np.array([2 * (3e-6 + 5e-6), 2 * (1e-6 + 2e-6)])  # layers x (forward + backward)
    for recompute, twice in ((False, np.array([2 * (3e-6 + 5e-6), 2 * (1e-6 + 2e-6)])),
                             (True, np.array([2 * (2 * 3e-6 + 5e-6), 2 * (2 * 1e-6 + 2e-6)]))):
        t0 = CostModel(tp, tiny, cl, strategy="auto", recompute=recompute)
        t1 = CostModel(dataclasses.replace(tp, cp_attention_factor={2: 0.5}), tiny, cl, strategy="auto",
                       recompute=recompute)
        for d, c in ((4, 2), (4, 4), (2, 2)):
            assert t1.time(s, d, c) - t0.time(s, d, c) == pytest.approx(0.5 * twice * s * s / d, rel=1e-9)
    assert a_per_pair[0] > a_per_pair[1]


def _quadratic_cp_profile():
    """A tiny-model profile (2 layers) whose degree-4 splits, on the tokens alone, are: 1 x 4 the
    least fixed cost (0.4 ms) and per-token extra (2e-4 ms), the fastest wherever its memory holds the
    group; 2 x 2, paying both the Ulysses and the CP extras (2 ms + 6e-3 ms per token), slower than
    Ulysses 4 x 1 (20 ms + 2e-3 ms per token) past 1,000 tokens, so never the fastest. CP's extra
    attention (factor 1.0 at c = 4, 0.1 at c = 2) turns that around for long sequences: single
    sequences of about 2,000 to 3,500 tokens run fastest on 2 x 2, longer ones on 4 x 1."""
    return HardwareProfile(
        name="q", gpu="g", model="tiny", forward={"a": 2.7e-6, "b": 0.004, "c": 0.5},
        backward={"a": 5.3e-6, "b": 0.008, "c": 1.0}, all_to_all_gbps={2: 1e6, 4: 1e6},
        allgather_gbps={2: 1e6, 4: 1e6}, reduce_scatter_gbps={2: 1e6, 4: 1e6},
        sp_overhead_ms={2: 0.5, 4: 10.0}, sp_token_ms={2: 4e-3, 4: 1e-3},
        cp_overhead_ms={2: 0.5, 4: 0.2}, cp_token_ms={2: 2e-3, 4: 1e-4}, cp_attention_factor={2: 0.1, 4: 1.0},
        provenance={"kind": "measured"})


def _splits_won_by_brute_force(auto, draws: int = 300) -> set:
    """Random groups of 2 or 4 GPUs (1-6 sequences up to 600, 4K or 16K tokens): every split that
    divides the degree, timed and sized by hand (overhead plus sequences, summed memory). The splits
    ``auto`` keeps hold the fastest one that fits, and ``best_split`` picks it. Returns the splits
    that won some group of 4."""
    rng = np.random.default_rng(1)
    won = set()
    for _ in range(draws):
        d = int(rng.choice([2, 4]))
        n = int(rng.integers(1, 7))
        seqs = rng.integers(8, int(rng.choice([600, 4000, 16384])), size=n)
        every = [c for c in range(1, d + 1) if d % c == 0 and auto.split_supported(d // c)]

        def group(c, d=d, seqs=seqs):
            return (auto.group_overhead_ms(d, c) + float(auto.time(seqs, d, c).sum()),
                    float(auto.memory(seqs, d, c).sum()))
        fits = [(group(c)[0], c) for c in every if group(c)[1] <= auto.memory_budget_gb]
        kept = [group(c)[0] for c in auto.splits(d) if group(c)[1] <= auto.memory_budget_gb]
        assert bool(fits) == bool(kept)
        if fits:
            assert min(kept) == pytest.approx(min(fits)[0], rel=1e-12)
            assert group(auto.best_split(seqs, d))[0] == pytest.approx(min(fits)[0], rel=1e-12)
            if d == 4:
                won.add(min(fits)[1])
    return won


def test_auto_keeps_every_split_a_group_would_choose_with_cp_attention():
    """The same brute force with CP's quadratic extra: a group's best split depends on its sequences'
    lengths, not only on its tokens, and the pruning still loses nothing. The profile is built so that
    a pruning on the tokens alone (the r = 0 envelope) would drop 2 x 2: the groups of long sequences
    that choose it show the new term is covered."""
    import dataclasses

    from workbench.cost import _envelope_splits

    p = _quadratic_cp_profile()
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0, zero_stage=0)
    auto = CostModel(p, get_model("tiny"), cl, strategy="auto")
    one = np.ones(1)
    cands = [(c, auto.group_overhead_ms(4, c), float(auto._split_linear_ms(one, 4, c)[0]), auto.cp_attention_factor(c) / 4,
              float(auto.memory(one, 4, c)[0])) for c in (1, 2, 4)]
    assert _envelope_splits(cands, auto.memory_budget_gb, 0.0) == {1, 4}
    assert auto.splits(4) == (1, 2, 4)
    # without the factor the same profile drops 2 x 2
    assert CostModel(dataclasses.replace(p, cp_attention_factor={}), get_model("tiny"), cl,
                     strategy="auto").splits(4) == (1, 4)
    assert _splits_won_by_brute_force(auto) == {1, 2, 4}


def _residual_profile(**split):
    """A tiny-model profile (2 layers, 4 heads of 16, 2 KV heads; fp32) whose every term is easy to
    follow by hand: no attention term, no latencies; Ulysses at 2 over 1 GB/s, CP's all-gather at
    0.5 GB/s and reduce-scatter at 0.25 GB/s, the Ulysses and CP extras at 2, and ``split``'s
    residual tables."""
    return HardwareProfile(
        name="r", gpu="g", model="tiny", forward={"a": 0.0, "b": 0.01, "c": 1.0},
        backward={"a": 0.0, "b": 0.02, "c": 2.0}, all_to_all_gbps={2: 1.0, 4: 1.0},
        allgather_gbps={2: 0.5, 4: 0.5}, reduce_scatter_gbps={2: 0.25, 4: 0.25},
        sp_overhead_ms={2: 0.5}, sp_token_ms={2: 1e-4}, cp_overhead_ms={2: 0.75}, cp_token_ms={2: 2e-4},
        provenance={"kind": "measured"}, **split)


def test_split_residual_enters_exactly_its_split_by_hand():
    """A composite split's measured residual (``split_overhead_ms``, ``split_token_ms``) adds, per
    layer, its fixed part to the group's overhead and its per-token part to every sequence, for that
    split only: a 2 x 2 group of 1,000 and 3,000 tokens costed term by term by hand."""
    from workbench.solve import build_plan

    tiny = get_model("tiny")
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0, zero_stage=0)
    cost = CostModel(_residual_profile(split_overhead_ms={"2x2": 1.5}, split_token_ms={"2x2": 3e-4}), tiny, cl,
                     strategy="auto")
    plain = CostModel(_residual_profile(), tiny, cl, strategy="auto")
    s = np.array([1000.0, 3000.0])
    S = s.sum()
    overhead = 2 * (1.0 + 2.0) + 2 * 0.5 + 2 * 0.75 + 2 * 1.5  # C, the Ulysses, CP and split fixed parts
    compute = 2 * (0.01 + 0.02) * S / 4
    # Ulysses over 2: each rank's s/4 tokens of q, o (64 each) and k, v (2 KV heads x 16 each), fp32, half sent,
    # forward and backward, 2 layers, 1 GB/s
    ulysses = 2 * 2 * 4 * (S / 4) * (2 * 64 + 2 * 32) * 0.5 / 1e9 * 1e3
    # CP over 2: half of each sequence's K/V (a rank of 2 x 2 holds 1 KV head: 2 x 4 x 16 bytes a token)
    # all-gathered at 0.5 GB/s in the forward, reduce-scattered at 0.25 GB/s in the backward, 2 layers
    moved = S * 128 * 0.5
    cp = 2 * (moved / 0.5e9 + moved / 0.25e9) * 1e3
    per_token = 2 * 1e-4 * S / 2 + 2 * 2e-4 * S * 0.5 + 2 * 3e-4 * S  # Ulysses (s/c), CP (its KV share), split
    assert cost.group_overhead_ms(4, 2) == pytest.approx(overhead, rel=1e-12)
    group = cost.group_overhead_ms(4, 2) + float(cost.time(s, 4, 2).sum())
    assert group == pytest.approx(overhead + compute + ulysses + cp + per_token, rel=1e-12)
    assert group == pytest.approx(79.708, rel=1e-12)  # the same sum, added up on paper
    assert group - (plain.group_overhead_ms(4, 2) + float(plain.time(s, 4, 2).sum())) == pytest.approx(
        2 * 1.5 + 2 * 3e-4 * S, rel=1e-12)
    assert cost.split_residual(4, 2) == (1.5, 3e-4) and cost.split_residual(4, 1) == (0.0, 0.0)
    # the planners see it: a plan's 2 x 2 group, the lockstep extra, the cost table
    plan = build_plan("hand", [[(4, [0, 1], 2)]], s.astype(np.int64), cost)
    assert plan.micro_steps[0].groups[0].split == "2x2"
    assert plan.micro_steps[0].groups[0].time_ms == pytest.approx(group, rel=1e-12)
    assert cost.group_extra_ms(4, 2) - plain.group_extra_ms(4, 2) == pytest.approx(3.0)
    row = cost.table([1000], [4], cps=[2])["split_rows"][0]
    assert (row["ulysses"], row["cp"]) == (2, 2) and row["group_overhead_ms"] == pytest.approx(overhead)
    assert row["time_ms"] == pytest.approx(float(cost.time([1000], 4, 2)[0]))
    # every other split, and the per-degree figures where 2 x 2 is not the choice, are the sum of the parts
    for d, c in ((4, 1), (4, 4), (2, 1), (2, 2), (1, 1)):
        assert cost.group_overhead_ms(d, c) == plain.group_overhead_ms(d, c)
        assert np.array_equal(cost.time(s, d, c), plain.time(s, d, c))
    # 8 ranks: 4 x 2 and 2 x 4 have no entry, so nothing (no entry is interpolated to another split)
    cl8 = ClusterSpec(num_gpus=8, gpus_per_node=8, gpu_memory_gb=8.0, zero_stage=0)
    c8 = CostModel(_residual_profile(split_overhead_ms={"2x2": 1.5}, split_token_ms={"2x2": 3e-4}), tiny, cl8,
                   strategy="auto")
    p8 = CostModel(_residual_profile(), tiny, cl8, strategy="auto")
    for d, c in ((8, 2), (8, 4)):
        assert c8.group_overhead_ms(d, c) == p8.group_overhead_ms(d, c)
        assert np.array_equal(c8.time(s, d, c), p8.time(s, d, c))
    assert c8.group_overhead_ms(4, 2) == pytest.approx(p8.group_overhead_ms(4, 2) + 3.0)


def test_auto_keeps_every_split_a_group_would_choose_with_a_split_residual():
    """The brute force of the pruning with a composite split's residual: on the profile where CP's
    extra attention makes 2 x 2 the fastest split of some groups, a small residual narrows where it
    wins (it is still kept and still chosen), a large one makes it dominated (pruned); in both every
    group's best split over all the splits the heads allow is among the kept ones."""
    import dataclasses

    from workbench.cost import _envelope_splits

    p = _quadratic_cp_profile()
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0, zero_stage=0)
    tiny = get_model("tiny")
    for fixed, tok, kept_splits, chosen_splits in ((0.5, 2e-4, (1, 2, 4), {1, 2, 4}), (40.0, 1e-2, (1, 4), {1, 4})):
        auto = CostModel(dataclasses.replace(p, split_overhead_ms={"2x2": fixed}, split_token_ms={"2x2": tok}), tiny,
                         cl, strategy="auto")
        base = CostModel(p, tiny, cl, strategy="auto")
        one = np.ones(1)
        # the pruning's lines carry the residual: fixed in o, per token in k
        assert auto.group_overhead_ms(4, 2) - base.group_overhead_ms(4, 2) == pytest.approx(2 * fixed)
        assert float(auto._split_linear_ms(one, 4, 2)[0] - base._split_linear_ms(one, 4, 2)[0]) == pytest.approx(2 * tok)
        assert auto.splits(4) == kept_splits
        shapes = {(x["ulysses"], x["cp"]): x for x in auto.table([1000], [4])["shapes"]}
        if (2, 2) in shapes:
            assert shapes[2, 2]["split_residual_ms"] == pytest.approx(2 * fixed)
            assert shapes[2, 2]["split_residual_ms_per_token"] == pytest.approx(2 * tok)
        assert shapes[1, 4]["split_residual_ms"] is None
        assert _splits_won_by_brute_force(auto) == chosen_splits
        # the envelope on the same lines, and a dense (S, r) grid, agree on what is kept
        cands = [(c, auto.group_overhead_ms(4, c), float(auto._split_linear_ms(one, 4, c)[0]),
                  auto.cp_attention_factor(c) / 4, float(auto.memory(one, 4, c)[0])) for c in (1, 2, 4)]
        top = auto.memory_budget_gb / min(x[4] for x in cands)
        S = np.geomspace(1.0, top, 400)[:, None, None]
        r = np.linspace(0.0, float(auto._fit.quadratic(np.array([top]))[0]) / top, 200)[None, :, None]
        o, k, g, m = (np.array([x[i] for x in cands])[None, None, :] for i in (1, 2, 3, 4))
        T = np.where(m * S <= auto.memory_budget_gb, o + (k + g * r) * S, np.inf)
        grid = {cands[i][0] for i in np.unique(np.argmin(T, axis=2))}
        assert grid <= _envelope_splits(cands, auto.memory_budget_gb, float(r.max())) == set(kept_splits)


def test_envelope_keeps_every_split_fastest_on_a_dense_grid():
    """``_envelope_splits`` against brute force on random lines: every split that is the fastest
    fitting one at some point of a dense (S, r) grid is kept, and so is the fastest at r = 0 of the
    old, tokens-only envelope. Some of the cases need an r strictly between the ends (the envelopes
    at r = 0 and at r_max alone miss a split there)."""
    from workbench.cost import _envelope_splits

    def at(cands, r):  # the tokens-only envelope of the lines at one r
        return _envelope_splits([(c, o, k + g * r, 0.0, m) for c, o, k, g, m in cands], 1.0, 0.0)

    rng = np.random.default_rng(2)
    inner = 0
    for _ in range(300):
        n = int(rng.integers(2, 6))
        cands = sorted((c, float(rng.uniform(0, 20)), float(rng.uniform(1e-4, 1e-2)), float(rng.uniform(0, 0.5)),
                        float(rng.uniform(1e-6, 3e-6))) for c in range(1, n + 1))
        budget, r_max = 1.0, float(rng.uniform(0.0, 0.05))
        kept = _envelope_splits(cands, budget, r_max)
        top = budget / min(x[4] for x in cands)
        S = np.geomspace(1.0, top, 400)[:, None, None]
        r = np.linspace(0.0, r_max, 120)[None, :, None]
        o, k, g, m = (np.array([x[i] for x in cands])[None, None, :] for i in (1, 2, 3, 4))
        T = np.where(m * S <= budget, o + (k + g * r) * S, np.inf)
        grid = {cands[i][0] for i in np.unique(np.argmin(T, axis=2))}
        assert grid <= kept
        assert _envelope_splits(cands, budget, 0.0) <= kept
        inner += not grid <= at(cands, 0.0) | at(cands, r_max)
    assert inner > 0


def test_forced_ulysses_past_the_head_limit_is_one_clear_line():
    cost = CostModel(load_profile("h100-80g"), get_model("llama3-8b"),
                     ClusterSpec(num_gpus=64, gpus_per_node=8, gpu_memory_gb=80), strategy="ulysses", recompute=True)
    with pytest.raises(InfeasibleError) as e:
        cost.check_feasible([8192, 4_000_000])
    msg = str(e.value)
    assert "\n" not in msg and "sequence 1 (4,000,000 tokens)" in msg
    assert "32 query / 8 KV heads" in msg and "--strategy auto" in msg


def test_grad_sync_by_hand(a100_7b_64):
    # fp32 gradients (4 bytes per parameter) over the profile's 40 GB/s bus bandwidth at 64 GPUs; the
    # profile has no all-gather / reduce-scatter tables, so they run at the all-reduce's bandwidth
    m = get_model("7b")
    nbytes = 4 * m.params()
    one_way = 63 / 64 * nbytes / 40e9 * 1e3  # all-gather or reduce-scatter: (n-1)/n of the bytes
    expect = {0: 2 * one_way,  # all-reduce
              1: 2 * one_way + one_way,  # all-reduce, then the sharded optimizer's parameter broadcast
              2: one_way + one_way,  # reduce-scatter, then the broadcast
              3: 0.0}  # ZeRO-3 reduce-scatters inside every pass
    p = load_profile("a100-40g-flexsp")
    for stage, ms in expect.items():
        # GPUs large enough for ZeRO-0's replicas: the sync does not depend on the memory
        cost = CostModel(p, m, ClusterSpec(num_gpus=64, zero_stage=stage, gpu_memory_gb=400))
        assert cost.grad_sync_ms() == pytest.approx(ms), stage
    assert a100_7b_64.grad_sync_ms() == 0.0


def test_other_model_scaled_by_flops():
    p = load_profile("a100-40g-flexsp")
    m7, m13 = get_model("7b"), get_model("13b")
    c13 = CostModel(p, m13, ClusterSpec(num_gpus=64))
    lin = lambda m: m.layers * (4 * m.hidden ** 2 + 3 * m.hidden * m.ffn + 2 * m.hidden) + m.vocab * m.hidden
    a13 = A * (40 * 5120) / (32 * 4096)
    b13 = B * lin(m13) / lin(m7)
    s = 10000
    assert c13.compute_ms([s], 1)[0] == pytest.approx(a13 * s * s + b13 * s, rel=1e-9)
    assert c13.group_overhead_ms(1) == pytest.approx(C * 40 / 32)


def test_recompute_trades_memory_for_time(a100_7b_64):
    p = load_profile("a100-40g-flexsp")
    rc = CostModel(p, get_model("7b"), ClusterSpec(num_gpus=64), recompute=True)
    s = 16384
    # forward again: (a+b terms) grow by the forward third
    assert rc.compute_ms([s], 1)[0] == pytest.approx(4 / 3 * (A * s * s + B * s), rel=1e-9)
    assert rc.memory([s], 1)[0] < 0.25 * a100_7b_64.memory([s], 1)[0]


def test_model_states_that_do_not_fit_are_a_clear_error():
    with pytest.raises(ValueError, match="needs .* GB per GPU of parameters"):
        CostModel(load_profile("a100-40g-flexsp"), get_model("70b"), ClusterSpec(num_gpus=8, zero_stage=0))


def test_cost_is_vectorised(a100_7b_64):
    s = np.array([100, 1000, 10000])
    v = a100_7b_64.time(s, 4)
    assert v.shape == (3,)
    assert all(v[i] == pytest.approx(a100_7b_64.time([s[i]], 4)[0]) for i in range(3))


def test_recomputation_charges_the_chunked_loss_once_not_per_token():
    """Under recomputation the loss is chunked (``workbench.runtime.loss``): the activation budget
    loses one chunk of Llama 3's logits (697 tokens x 128,256 x 12 bytes) and the head's gradient made
    in the forward, fp32 and its bf16 cast (128,256 x 4096 x 6 bytes), by hand (what a token keeps is checked against
    autograd in test_runtime_unit); the memory report counts the transient in the working set."""
    from workbench.report.memory import gpu_memory_breakdown

    cl = ClusterSpec(num_gpus=64, gpus_per_node=8, gpu_memory_gb=80, zero_stage=3)
    plain = CostModel(load_profile("h100-80g"), get_model("llama3-8b"), cl)
    rc = CostModel(load_profile("h100-80g"), get_model("llama3-8b"), cl, recompute=True)
    loss = (12 * 697 * 128_256 + 697 * (6 * 4096 + 4) + (4 + 2) * 128_256 * 4096) / 1e9  # + the final norm's chunk
    assert rc.loss_working_gb == pytest.approx(loss) and plain.loss_working_gb == 0.0
    assert rc.memory_budget_gb == pytest.approx(plain.memory_budget_gb - loss)
    b = gpu_memory_breakdown(rc, [100_000], 64, 8)
    assert b["working_gb"] == pytest.approx(rc.states.working / 1e9 + loss)
    assert "chunked loss" in b["working_label"]
    assert b["total_gb"] == pytest.approx(b["model_states_gb"] + b["working_gb"] + b["activations_gb"])


def test_the_whole_logits_loss_is_charged_with_every_token_without_recomputation():
    """Without recomputation a rank holds, at its step's peak, the whole logits' backward: 8 bytes a
    logit (two fp32 gradients, ``tests/test_loss.py`` measures them) on top of its activations. The
    planner charges them per token where the activations come from the formula; a profile's measured
    figure (a forward's peak: logits, their fp32 copy and the log-softmax) and the chunked loss under
    recomputation (its constant, ``loss_working_gb``) are not charged again."""
    plain, rc = _llama3("auto"), _llama3("auto", recompute=True)
    assert plain.loss_bytes_per_token == 8 * 128_256 and rc.loss_bytes_per_token == 0.0
    assert plain.memory_bytes_per_token == plain.activation_bytes_per_token + 8 * 128_256
    s = np.array([10_000, 64_000])
    assert plain.memory(s, 8, 1) == pytest.approx((plain.activation_bytes_per_token + 8 * 128_256) * s / 8 / 1e9,
                                                  rel=1e-12)
    assert plain.tokens_per_gpu() == pytest.approx(plain.memory_budget_gb * 1e9 / (plain.activation_bytes_per_token
                                                                                  + 8 * 128_256))
    measured = CostModel(load_profile("a100-40g-flexsp"), get_model("7b"), ClusterSpec(num_gpus=64, gpus_per_node=8,
                                                                                       gpu_memory_gb=40))
    assert measured.loss_bytes_per_token == 0.0
    assert measured.memory([8192], 2)[0] == pytest.approx(4.48e6 * 8192 / 2 / 1e9)
