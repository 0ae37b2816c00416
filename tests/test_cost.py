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
    ring13 = CostModel(load_profile("a100-40g-flexsp"), m13, ClusterSpec(num_gpus=64), strategy="ring")
    assert ring13.degrees == (1, 2, 4, 8, 16, 32, 64)


def test_ring_comm_overlaps_attention_by_hand():
    p = load_profile("a100-40g-flexsp")
    cost = CostModel(p, get_model("7b"), ClusterSpec(num_gpus=64), strategy="ring")
    s, d = 4096, 32
    per_layer = 2 * (s / d) * 2 * 4096 * (d - 1)  # K and V blocks passed d-1 times
    comm = 3 * 32 * per_layer / (20.0 * 1e9) * 1e3  # forward once, backward twice (K/V and dK/dV)
    attn = A * s * s / d
    assert cost.comm_ms([s], d)[0] == pytest.approx(max(0.0, comm - attn), rel=1e-9)
    s = 262144  # long: attention hides the ring traffic
    assert cost.comm_ms([s], 16)[0] == 0.0


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
