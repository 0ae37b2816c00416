"""Single-process checks of the runtime: model, varlen attention, shards, plan checks, quick fit.

The multi-process checks (Ulysses, exact gradients) are in test_runtime_dist.py.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from workbench.cost import CostModel  # noqa: E402
from workbench.models import get_model  # noqa: E402
from workbench.runtime.attention import AttentionUnavailable, select_attention, torch_varlen_attention  # noqa: E402
from workbench.runtime.groups import GroupRegistry, aligned_blocks  # noqa: E402
from workbench.runtime.model import Transformer  # noqa: E402
from workbench.runtime.step import IGNORE, StepExecutor, batch_loss, check_plan, make_shard  # noqa: E402
from workbench.runtime.ulysses import kv_repeats, shard_layout  # noqa: E402
from workbench.solve.plan import PlanError, build_plan  # noqa: E402
from workbench.specs import ClusterSpec, load_profile  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    return get_model("tiny")


def _cost(num_gpus: int = 4, zero_stage: int = 0):
    return CostModel(load_profile("cpu-gloo-tiny"), get_model("tiny"),
                     ClusterSpec(num_gpus=num_gpus, gpus_per_node=num_gpus, gpu_memory_gb=4.0, zero_stage=zero_stage))


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------


def _naive_attention(q, k, v, lengths):
    """Softmax attention written out: per sequence, explicit causal mask, KV heads repeated."""
    H, KV = q.shape[1], k.shape[1]
    outs, lo = [], 0
    for s in lengths:
        qi, ki, vi = q[lo:lo + s], k[lo:lo + s], v[lo:lo + s]
        ki = ki.repeat_interleave(H // KV, dim=1)
        vi = vi.repeat_interleave(H // KV, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) / math.sqrt(q.shape[-1])  # (H, s, s)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi))  # (s, H, hd)
        lo += s
    return torch.cat(outs)


def test_torch_varlen_attention_matches_naive_softmax():
    lengths = [5, 1, 17, 8]
    gen = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q = torch.randn(T, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = _cu(lengths)
    out = torch_varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths))
    ref = _naive_attention(q, k, v, lengths)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_queries_shorter_than_keys_are_bottom_right_aligned():
    """Segments of fewer queries than keys (context parallelism's chunk against its sequence's
    prefix): the queries are the last rows of the key range, so each query's output and gradients
    are those of the same row in full causal attention over the keys."""
    lengths_k = [9, 1, 17, 6]
    lengths_q = [4, 1, 17, 1]  # fewer, all, all of a longer one, one
    gen = torch.Generator().manual_seed(5)
    Tk = sum(lengths_k)
    q_full = torch.randn(Tk, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(Tk, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(Tk, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = torch.cat([torch.arange(b - n, b) for n, b in zip(lengths_q, _cu(lengths_k)[1:].tolist())])
    q = q_full[rows].clone().requires_grad_(True)
    out = torch_varlen_attention(q, k, v, _cu(lengths_q), _cu(lengths_k), max(lengths_q), max(lengths_k))
    qr = q_full.clone().requires_grad_(True)
    ref = _naive_attention(qr, k, v, lengths_k)[rows]
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (qr, k, v))
    torch.testing.assert_close(got[0], want[0][rows])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])


def test_torch_varlen_attention_rejects_bad_inputs():
    q = torch.zeros(6, 3, 4)
    z = torch.zeros(6, 2, 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        torch_varlen_attention(q, z, z, _cu([6]), _cu([6]), 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 5"):
        torch_varlen_attention(z, z, z, _cu([5]), _cu([5]), 5, 5)
    with pytest.raises(ValueError, match="cu_seqlens_k ends at 5"):
        torch_varlen_attention(z, z, z, _cu([6]), _cu([5]), 6, 5)
    with pytest.raises(ValueError, match="3 segments but cu_seqlens_k 1"):
        torch_varlen_attention(z, z, z, _cu([2, 2, 2]), _cu([6]), 2, 6)
    with pytest.raises(ValueError, match="6 queries but only 4 keys"):
        torch_varlen_attention(z, z[:4], z[:4], _cu([6]), _cu([4]), 6, 4)


def test_select_attention():
    fn, name = select_attention("torch", "cpu")
    assert name == "torch" and fn is torch_varlen_attention
    fn, name = select_attention("auto", "cpu")
    assert name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention("xformers", "cpu")


def test_flash_requested_on_cpu_is_a_clear_error():
    with pytest.raises(AttentionUnavailable, match="needs a CUDA device.*use --attention torch"):
        select_attention("flash", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where flash-attn cannot run")
def test_flash_attn_is_imported_lazily():
    # a fresh interpreter: other tests in this worker may have imported the flash-attn stand-ins
    import subprocess
    import sys

    code = ("import sys, workbench.runtime.attention, workbench.runtime.model; "
            "print(sorted(m for m in ('flash_attn', 'flash_attn_interface') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------


def test_model_packed_varlen_equals_per_sequence(tiny):
    model = Transformer(tiny, seed=1).double()
    gen = torch.Generator().manual_seed(1)
    lengths = [9, 1, 30, 4]
    seqs = [torch.randint(0, tiny.vocab, (n,), generator=gen) for n in lengths]
    packed = make_shard(seqs, 1, 0)
    out = model(packed.tokens, packed.positions, packed.cu_seqlens, packed.max_seqlen, torch_varlen_attention)
    assert out.shape == (sum(lengths), tiny.vocab)
    per = [model(s, torch.arange(len(s)), _cu([len(s)]), len(s), torch_varlen_attention) for s in seqs]
    torch.testing.assert_close(out, torch.cat(per))


def test_model_slice_with_true_positions_equals_whole_sequence_prefix(tiny):
    """Rotary angles come from the position ids: a prefix computed alone equals the whole
    sequence's first rows (causality); rotary attention depends only on relative positions, so a
    uniform shift changes nothing while wrong relative positions do."""
    model = Transformer(tiny, seed=2).double()
    s = torch.randint(0, tiny.vocab, (20,), generator=torch.Generator().manual_seed(2))
    whole = model(s, torch.arange(20), _cu([20]), 20, torch_varlen_attention)
    prefix = model(s[:7], torch.arange(7), _cu([7]), 7, torch_varlen_attention)
    torch.testing.assert_close(prefix, whole[:7])
    shifted = model(s[:7], torch.arange(7) + 5, _cu([7]), 7, torch_varlen_attention)
    torch.testing.assert_close(shifted, prefix)
    wrong = model(s[:7], torch.zeros(7, dtype=torch.long), _cu([7]), 7, torch_varlen_attention)
    assert not torch.allclose(wrong, prefix)


def test_model_init_is_seeded_and_independent_of_global_rng(tiny):
    torch.manual_seed(123)
    a = Transformer(tiny, seed=5)
    torch.manual_seed(456)
    b = Transformer(tiny, seed=5)
    c = Transformer(tiny, seed=6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.embed.weight, c.embed.weight)


# ------------------------------------------------------------------------------------------------
# shards and layouts
# ------------------------------------------------------------------------------------------------


def test_shard_layout_by_hand():
    # lengths 5 and 2 on degree 2: chunks 3 and 1; rank 1 holds positions 3,4,(5) of seq 0 and (1) of seq 1
    lay = shard_layout([5, 2], 2, 1)
    assert lay.chunks == (3, 1) and lay.local_tokens == 4
    assert lay.local_cu_seqlens.tolist() == [0, 3, 4]
    assert lay.full_cu_seqlens.tolist() == [0, 6, 8]
    assert lay.full_max_seqlen == 6
    assert lay.local_positions().tolist() == [3, 4, 5, 1]
    assert lay.local_valid().tolist() == [True, True, False, True]
    # gathered rank-major rows: rank0 [s0p0 s0p1 s0p2 s1p0] rank1 [s0p3 s0p4 s0p5 s1p1]
    assert lay.gather_index.tolist() == [0, 1, 2, 4, 5, 6, 3, 7]
    assert lay.scatter_index[lay.gather_index].tolist() == list(range(8))


def test_shard_layout_errors():
    with pytest.raises(ValueError, match="not in a group"):
        shard_layout([4], 2, 2)
    with pytest.raises(ValueError, match="positive length"):
        shard_layout([4, 0], 2, 0)


def test_make_shard_by_hand():
    s0 = torch.tensor([10, 11, 12, 13, 14])
    s1 = torch.tensor([20, 21])
    r0 = make_shard([s0, s1], 2, 0)
    r1 = make_shard([s0, s1], 2, 1)
    assert r0.tokens.tolist() == [10, 11, 12, 20]
    assert r0.labels.tolist() == [11, 12, 13, 21]
    assert r0.positions.tolist() == [0, 1, 2, 0]
    assert r1.tokens.tolist() == [13, 14, 0, 21]
    assert r1.labels.tolist() == [14, IGNORE, IGNORE, IGNORE]
    assert r1.positions.tolist() == [3, 4, 5, 1]
    assert (r0.real_tokens, r1.real_tokens) == (4, 3)
    assert r0.targets + r1.targets == 4 + 1
    whole = make_shard([s0, s1], 1, 0)
    assert whole.tokens.tolist() == [10, 11, 12, 13, 14, 20, 21]
    assert whole.cu_seqlens.tolist() == [0, 5, 7] and whole.max_seqlen == 5


def test_sequence_shorter_than_degree():
    sh = [make_shard([torch.tensor([7, 8])], 4, r) for r in range(4)]
    assert [s.tokens.tolist() for s in sh] == [[7], [8], [0], [0]]
    assert [s.real_tokens for s in sh] == [1, 1, 0, 0]
    assert sum(s.targets for s in sh) == 1


def test_kv_repeats():
    assert kv_repeats(2, 2) == 1 and kv_repeats(2, 4) == 2 and kv_repeats(8, 2) == 1
    with pytest.raises(ValueError, match="neither divides"):
        kv_repeats(3, 2)


# ------------------------------------------------------------------------------------------------
# plan checks
# ------------------------------------------------------------------------------------------------


def test_check_plan_accepts_a_good_plan():
    lengths = [30, 7, 12, 3]
    plan = build_plan("hand", [[(2, [0, 1]), (1, [2]), (1, [3])]], lengths, _cost())
    check_plan(plan, lengths, 4, [1, 2, 4], max_context=16384, heads=4, kv_heads=2)


def test_check_plan_world_size_mismatch():
    lengths = [30, 7]
    plan = build_plan("hand", [[(2, [0, 1])]], lengths, _cost())
    with pytest.raises(PlanError, match="plan is for 4 ranks but this run has 2"):
        check_plan(plan, lengths, 2)


def test_check_plan_sequence_longer_than_context(tiny):
    lengths = [tiny.max_context + 1, 7]
    plan = build_plan("hand", [[(4, [0]), ], [(1, [1])]], lengths, _cost())
    with pytest.raises(PlanError, match=r"sequence 0 has 16,385 tokens but the model's context is 16,384"):
        check_plan(plan, lengths, 4, max_context=tiny.max_context)


def test_check_plan_other_errors():
    lengths = [30, 7, 12]
    plan = build_plan("hand", [[(2, [0, 1]), (1, [2])]], lengths, _cost())
    with pytest.raises(PlanError, match="sequence 1 has 8 tokens but the plan says 7"):
        check_plan(plan, [30, 8, 12], 4)
    with pytest.raises(PlanError, match="sequence 3 runs 0 times"):
        check_plan(plan, lengths + [5], 4)
    with pytest.raises(PlanError, match="degree 2 has no process groups"):
        check_plan(plan, lengths, 4, [1, 4])
    with pytest.raises(PlanError, match="empty"):
        check_plan(plan, [30, 0, 12], 4)
    with pytest.raises(PlanError, match=r"\(split 2x1\) runs Ulysses over 2 ranks, which does not fit the model.s 3 query / 1 KV"):
        check_plan(plan, lengths, 4, heads=3, kv_heads=1)


def test_executor_checks_before_running(tiny):
    """One process, world size 1: a 4-rank plan is refused with the world-size message."""
    model = Transformer(tiny, seed=0)
    ex = StepExecutor(model, GroupRegistry(1, [1]), torch_varlen_attention)
    seqs = [torch.randint(0, tiny.vocab, (n,)) for n in (5, 9)]
    plan = build_plan("hand", [[(2, [0, 1])]], [5, 9], _cost())
    with pytest.raises(PlanError, match="world size"):
        ex.run(plan, seqs)


def test_single_process_step_equals_batch_loss(tiny):
    """World size 1, two micro-steps of degree 1: gradient accumulation equals the full batch."""
    model, ref = Transformer(tiny, seed=4).double(), Transformer(tiny, seed=4).double()
    ex = StepExecutor(model, GroupRegistry(1, [1]), torch_varlen_attention)
    gen = torch.Generator().manual_seed(4)
    lengths = [11, 3, 25]
    seqs = [torch.randint(0, tiny.vocab, (n,), generator=gen) for n in lengths]
    plan = build_plan("hand", [[(1, [0, 2])], [(1, [1])]], lengths, _cost(1))
    res = ex.run(plan, seqs)
    loss = batch_loss(ref, seqs, torch_varlen_attention)
    loss.backward()
    assert res.loss == pytest.approx(loss.item(), rel=1e-12)
    assert res.targets == sum(lengths) - 3 and len(res.records) == 2
    assert res.predicted_ms == pytest.approx(plan.makespan_ms)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def test_group_registry_single_process():
    assert aligned_blocks(4, 2) == [(0, 1), (2, 3)]
    reg = GroupRegistry(1, [1])
    assert reg.get([0]) is None and [0] in reg
    with pytest.raises(ValueError, match="outside 1..1"):
        GroupRegistry(1, [2])


# ------------------------------------------------------------------------------------------------
# the profiler's measuring side, in one process (the fit itself: tests/test_profile_fit.py)
# ------------------------------------------------------------------------------------------------


def test_measure_compute_in_one_process_fits_a_profile_the_cost_model_loads(tiny):
    """The profiler's torch side on one process (no collectives): real timings, a fit, a profile."""
    from workbench.profile.measure import measure_compute, measure_memory
    from workbench.profile.result import build_result

    packs = [[16], [64], [128], [16, 16, 16], [32]]
    rows = measure_compute(tiny, packs, attn=torch_varlen_attention, warmup=1, reps=2, min_sample_ms=2.0)
    assert [r["pack"] for r in rows] == packs
    assert all(r["forward_ms"] > 0 and r["backward_ms"] > 0 and len(r["forward_all"]) == 2 for r in rows)
    mem = measure_memory(tiny, lengths=(64, 128))
    assert mem["activation_mb_per_token"] > 0 and mem["method"].startswith("computed on CPU")
    # model states computed by hand: fp32 weights and gradients, two fp32 AdamW moments
    assert mem["model_state_mb"] == pytest.approx(16 * tiny.params() / 1e6)
    compute = [{**r, "role": "heldout" if r["pack"] == [32] else "fit"} for r in rows]
    res = build_result({"model": "tiny", "compute": compute, "collectives": [], "memory": mem,
                        "meta": {"name": "t", "gpu": "cpu", "provenance": {"kind": "measured"}}})
    prof = res.profile
    assert prof.provenance["kind"] == "measured" and prof.provenance["collectives"] == "estimate"
    assert prof.model == "tiny" and prof.activation_mb_per_token > 0 and res.heldout["total"]["count"] == 1
    CostModel(prof, tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=4.0))


def test_shipped_cpu_profile_loads(tiny):
    from workbench.specs import list_profiles

    assert "cpu-gloo-tiny" in list_profiles()
    prof = load_profile("cpu-gloo-tiny")
    assert prof.provenance["kind"] == "measured"
    assert prof.model == "tiny" and prof.provenance["when"]
    cost = _cost()
    assert cost.time([1024], 1)[0] > cost.time([1024], 4)[0] > 0


# ------------------------------------------------------------------------------------------------
# activation memory: what autograd keeps for backward, against the cost model's formula
# ------------------------------------------------------------------------------------------------


class _FlashSaves(torch.autograd.Function):
    """A stand-in for flash-attn's varlen kernel (CUDA only) that keeps for backward exactly what
    ``flash_attn_varlen_func`` keeps: q, k, v, the output and the fp32 softmax log-sum-exp (heads
    x tokens). The values come from the PyTorch path; the backward recomputes through it."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen):
        out = torch_varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)  # (H, T) as flash-attn's varlen
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu, ctx.max_seqlen = cu, max_seqlen
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = torch_varlen_attention(qq, kk, vv, ctx.cu, ctx.cu, ctx.max_seqlen, ctx.max_seqlen)
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad)
        return dq, dk, dv, None, None


def _flash_saves(q, k, v, cu, cu_k, max_seqlen, max_seqlen_k):
    return _FlashSaves.apply(q, k, v, cu, max_seqlen)


def _saved_bytes(tiny, length: int, mode: str, *, recompute: bool, block: int | None = None) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of one sequence
    of ``length`` tokens (parameters and their casts, which do not grow with tokens, cancel in the
    per-token slope). ``mode``: fp32, bf16 (weights and activations bf16, as FSDP2 runs) or autocast
    (bf16 over fp32 weights, as ZeRO 0-2 run). ``block``: count only what block ``block`` saves."""
    from workbench.runtime.zero import apply_recompute

    model = Transformer(tiny, seed=0)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    if recompute:
        apply_recompute(model)
    inside = [block is None]
    if block is not None:
        model.blocks[block].register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
        model.blocks[block].register_forward_hook(lambda *a: inside.__setitem__(0, False))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if inside[0] and st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    sh = make_shard([torch.randint(0, tiny.vocab, (length,), generator=torch.Generator().manual_seed(length))], 1, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            # the loss as the step executor computes it: from the model's head (chunked under recomputation)
            model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, _flash_saves, labels=sh.labels,
                  ignore_index=IGNORE)
    return sum(seen.values())


@pytest.mark.parametrize("mode, stage, precision", [("fp32", 3, "fp32"), ("fp32", 0, "fp32"), ("bf16", 3, "bf16"),
                                                    ("autocast", 0, "bf16"), ("autocast", 2, "bf16")])
@pytest.mark.parametrize("recompute", [False, True])
def test_activation_bytes_per_token_match_what_autograd_keeps(tiny, mode, stage, precision, recompute):
    """Per token, the bytes autograd keeps for backward (slope between two lengths, so fixed
    buffers cancel) equal the cost model's activation figure in each precision and stage (a
    profile without a measured figure for the model: the formula). With recomputation the peak
    is what the forward keeps (the blocks' inputs and what lies outside them) plus one block's
    working set while it is recomputed, measured from the plain model."""
    a, b = 256, 512

    def slope(**kw):
        return (_saved_bytes(tiny, b, mode, **kw) - _saved_bytes(tiny, a, mode, **kw)) / (b - a)

    measured = slope(recompute=recompute)
    if recompute:
        measured += max(slope(recompute=False, block=i) for i in range(tiny.layers))
    cost = CostModel(load_profile("h100-80g"), tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=4.0,
                                                                 zero_stage=stage),
                     precision=precision, recompute=recompute)
    expect = cost.activation_bytes_per_token
    if recompute:
        # the chunked loss's chunk holds the final norm's tensors of its tokens for a moment (the cost model
        # charges them with the loss's transient), and tiny's chunk holds the whole sequence
        from workbench.cost.memory import final_norm_bytes_per_token, loss_chunk_tokens

        assert loss_chunk_tokens(tiny.vocab) >= b
        expect += final_norm_bytes_per_token(cost.model, autocast=mode == "autocast")
    assert expect == pytest.approx(measured, rel=0.01), (mode, recompute)


def test_activation_formula_recompute_keeps_far_less_for_a_large_model():
    from workbench.cost import activation_bytes_per_token

    m = get_model("7b")
    full, rc = activation_bytes_per_token(m), activation_bytes_per_token(m, True)
    # by hand, bf16: per block 2 (6h + 2kv + 4ffn) + 8h + 4 heads + 8; outside: ids and targets,
    # rotary tables, final norm, fp32 log-softmax
    h, f = m.hidden, m.ffn
    per_block = 2 * (6 * h + 2 * h + 4 * f) + 8 * h + 4 * m.heads + 8
    outside = 16 + 2 * m.head_dim + (4 * h + 4 * h + 4)
    assert full == m.layers * per_block + outside + 4 * m.vocab
    # with recomputation the chunked loss takes the final norm in: the gradient of its input (2h) is kept
    assert rc == m.layers * 2 * h + per_block + 16 + 2 * m.head_dim + 2 * h - 8


def test_autocast_weight_copies_are_the_free_stages_bf16_working_set(tiny):
    """Under autocast every matmul keeps a bf16 copy of its weight for backward: the part of what
    autograd keeps that does not grow with the tokens (the intercept of two lengths) is the memory
    model's ZeRO 0-2 bf16 working set."""
    from workbench.cost.memory import model_states

    a, b = 300, 600  # no activation shaped like a weight
    sa, sb = _saved_bytes(tiny, a, "autocast", recompute=False), _saved_bytes(tiny, b, "autocast", recompute=False)
    fixed = sa - (sb - sa) / (b - a) * a

    # the same forward without the parameter filter: the copies are storages derived from weights
    def with_casts(length):
        model = Transformer(tiny, seed=0)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        shapes = {s for p in model.parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape)[::-1])}
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params and t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
                seen[st.data_ptr()] = st.nbytes()
            return t

        sh = make_shard([torch.randint(0, tiny.vocab, (length,))], 1, 0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, _flash_saves)
        return sum(seen.values())

    for stage in (0, 1, 2):
        want = model_states(tiny, zero_stage=stage, num_ranks=4, precision="bf16").working
        assert with_casts(a) == pytest.approx(want, rel=1e-9)
        assert fixed == pytest.approx(want, rel=0.01)
        assert model_states(tiny, zero_stage=stage, num_ranks=4, precision="fp32").working == 0


# ------------------------------------------------------------------------------------------------
# plans against the run's stage; lockstep passes
# ------------------------------------------------------------------------------------------------


def test_check_plan_refuses_a_plan_of_another_stage_naming_both():
    lengths = [30, 7, 12]
    free = build_plan("hand", [[(2, [0, 1]), (1, [2])]], lengths, _cost(4, 2))
    lock = build_plan("hand", [[(2, [0, 1]), (1, [2])]], lengths, _cost(4, 3))
    assert (free.execution, lock.execution) == ("free", "lockstep")
    with pytest.raises(PlanError, match=r"^the plan is free \(ZeRO 0-2\) but this run is ZeRO-3 \(lockstep\); "
                                        r"plan for ZeRO-3$"):
        check_plan(free, lengths, 4, zero_stage=3)
    with pytest.raises(PlanError, match=r"^the plan is lockstep \(ZeRO-3\) but this run is ZeRO-1 \(free\); "
                                        r"plan for ZeRO-1$"):
        check_plan(lock, lengths, 4, zero_stage=1)
    with pytest.raises(PlanError, match="the plan is for ZeRO-2 but this run is ZeRO-0; plan for ZeRO-0"):
        check_plan(free, lengths, 4, zero_stage=0)
    with pytest.raises(PlanError, match="the plan assumes fp32 but this run computes in bf16"):
        check_plan(lock, lengths, 4, zero_stage=3, precision="bf16")
    with pytest.raises(PlanError, match="the plan assumes no activation recomputation but this run recomputes"):
        check_plan(lock, lengths, 4, zero_stage=3, precision="fp32", recompute=True)
    check_plan(free, lengths, 4, zero_stage=2, precision="fp32", recompute=False)
    check_plan(lock, lengths, 4, zero_stage=3, precision="fp32", recompute=False)


def test_check_plan_accepts_ranks_serving_several_groups_only_in_lockstep_passes():
    lengths = [30, 7, 12]
    lock = build_plan("hand", [[(4, [0]), (2, [1]), (1, [2])]], lengths, _cost(4, 3), blocks=[[0, 0, 1]])
    assert [g.ranks for g in lock.micro_steps[0].groups] == [(0, 1, 2, 3), (0, 1), (1,)]
    check_plan(lock, lengths, 4, [1, 2, 4], zero_stage=3)
    import dataclasses

    as_free = dataclasses.replace(lock, execution="free", zero_stage=None)
    with pytest.raises(PlanError, match=r"rank\(s\) \[0, 1\] are in two groups"):
        check_plan(as_free, lengths, 4)


def test_pack_shards_and_pass_attention_equal_separate_groups(tiny):
    """One packed forward through PassAttention (two degree-1 groups) gives each group's logits as
    two separate forwards do."""
    from workbench.runtime.step import PassAttention, pack_shards

    model = Transformer(tiny, seed=2).double()
    gen = torch.Generator().manual_seed(2)
    a = [torch.randint(0, tiny.vocab, (n,), generator=gen) for n in (9, 4)]
    b = [torch.randint(0, tiny.vocab, (n,), generator=gen) for n in (13,)]
    sa, sb = make_shard(a, 1, 0), make_shard(b, 1, 0)
    packed = pack_shards([sa, sb])
    assert packed.cu_seqlens.tolist() == [0, 9, 13, 26] and packed.targets == sa.targets + sb.targets
    seen = []

    def spy(name):
        def attn(q, k, v, cu, cu_k, mx, mx_k):
            seen.append((name, q.shape[0], cu.tolist()))
            return torch_varlen_attention(q, k, v, cu, cu_k, mx, mx_k)
        return attn

    pa = PassAttention([(0, 13, spy("a"), sa.cu_seqlens, sa.max_seqlen), (13, 26, spy("b"), sb.cu_seqlens, sb.max_seqlen)])
    out = model(packed.tokens, packed.positions, packed.cu_seqlens, packed.max_seqlen, pa)
    ra = model(sa.tokens, sa.positions, sa.cu_seqlens, sa.max_seqlen, torch_varlen_attention)
    rb = model(sb.tokens, sb.positions, sb.cu_seqlens, sb.max_seqlen, torch_varlen_attention)
    torch.testing.assert_close(out, torch.cat([ra, rb]), rtol=1e-12, atol=1e-12)
    assert seen[:2] == [("a", 13, [0, 9, 13]), ("b", 13, [0, 13])]  # in the pass's order, every layer


def test_recompute_keeps_names_and_values(tiny):
    from workbench.runtime.zero import apply_recompute

    model, ref = Transformer(tiny, seed=5).double(), Transformer(tiny, seed=5).double()
    apply_recompute(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    seqs = [torch.randint(0, tiny.vocab, (n,)) for n in (17, 5)]
    batch_loss(model, seqs, torch_varlen_attention).backward()
    batch_loss(ref, seqs, torch_varlen_attention).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_fsdp_units_are_the_memory_models():
    """The modules the runtime wraps with fully_shard hold exactly the tensors of each unit of
    workbench.cost.memory.fsdp_units (tied and untied heads)."""
    import dataclasses

    from workbench.cost.memory import fsdp_units
    from workbench.runtime.zero import fsdp_modules

    for spec in (get_model("tiny"), dataclasses.replace(get_model("tiny"), tied_embeddings=True)):
        model = Transformer(spec, seed=0)
        name = {id(p): n for n, p in model.named_parameters()}
        got = [sorted({name[id(p)] for m in unit for p in m.parameters()}) for unit in fsdp_modules(model)]
        want = [sorted(n for n, _ in unit) for unit in fsdp_units(spec)]
        assert got == want
