"""Cost figures against hand computation from the published FlexSP constants."""

import math

import numpy as np
import pytest

from workbench.cost import CostModel, InfeasibleError
from workbench.models import get_model
from workbench.specs import ClusterSpec, load_profile

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
    assert "sequence 1 (912,384 tokens)" in msg and "degree 256" in msg and "40 GB GPUs" in msg
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
    assert cp13.degrees == (1, 2, 4, 8, 16, 32, 64)


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
    # memory: the local share as Ulysses, plus the gathered K/V CP keeps for every layer's backward
    # beyond its own share (1 - 1/(2c) of the sequence's) and the layer's gathered K/V while it runs
    local = cost.activation_bytes_per_token * s / d
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
    assert cp.shapes == tuple((d, d) for d in (1, 2, 4, 8, 16, 32, 64))
    assert _llama3("ring").shapes == cp.shapes and _llama3("ring").strategy == "cp"
    assert auto.degrees == (1, 2, 4, 8, 16, 32, 64)
    assert {d for d, c in auto.shapes if c > 1} == {2, 4, 8, 16, 32, 64}
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


def test_forced_ulysses_past_the_head_limit_is_one_clear_line():
    cost = CostModel(load_profile("h100-80g"), get_model("llama3-8b"),
                     ClusterSpec(num_gpus=64, gpus_per_node=8, gpu_memory_gb=80), strategy="ulysses", recompute=True)
    with pytest.raises(InfeasibleError) as e:
        cost.check_feasible([8192, 3_000_000])
    msg = str(e.value)
    assert "\n" not in msg and "sequence 1 (3,000,000 tokens)" in msg
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
