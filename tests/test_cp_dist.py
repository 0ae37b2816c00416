"""Context parallelism on real processes: 4 gloo ranks of the shared torchrun world
(``tests/_torchrun.py``: one launch runs the checks of every file that takes part), every check
against an independent single-process reference; the pytest tests below assert on its JSON results.

- attention: ``CPAttention`` of splits 2x2, 1x4 and 1x2 (and 2x2 / 1x4 with one KV head, so the
  Ulysses part repeats K/V) against single-process causal attention on the whole sequences,
  forward and backward in float64 (lengths not multiples of 2c, some shorter than 2c); what
  autograd keeps for backward (the selected K/V, never the all-gathered tensor) against the
  formula in ``workbench.runtime.cp``; the kernel calls torch's ``varlen_attn`` and flash-attn
  get inside CP (stand-ins that refuse what the real kernels refuse, ``tests/fakes``) in bf16;
- the collectives one step makes, per rank and in order, with their sizes: forward, backward, and
  the recomputed forward of ``--recompute`` (a recording wrapper around the real collectives);
- one SGD step of the tiny model equals the single-process update (fp32 within 1e-5) for splits
  4x1, 2x2 and 1x4, a micro-step mixing a 1x2 and a 2x1 group, a model with one KV head, ZeRO
  0-3 (lockstep passes whose ranks serve several CP groups), recomputation, bf16 (within the
  bf16 tolerance of test_runtime_zero.py) and random lockstep plans of CP groups (float64);
- a tiny Hugging Face Llama 3.1 (rope scaling) under CP splits: logits against transformers';
- refusals: a split without process groups stops every rank before any collective.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from _torchrun import assert_all_ranks, by_check, shared_world

# its slow tests check exact results, not times: make test runs them in the untimed lane (tests/_xdist_heavy.py)
pytestmark = pytest.mark.untimed

WORLD = 4
WORLD_SHAPES = ((2, 2), (4, 2), (4, 4))
"""The splits the world's registry makes sub-groups for: 1x2, 2x2, 1x4 (and every Ulysses-only one)."""
DIST_TIMEOUT_S = 90
HERE = Path(__file__).resolve().parent
ATTN_LENGTHS = [7, 1, 12, 5, 30, 3]
STEP_LENGTHS = [33, 6, 1, 50, 7, 2, 19, 4, 23]
HF_LENGTHS = [33, 6, 1, 50, 7, 2, 19, 4, 97]
HALF_TOL = 5e-2
N_RANDOM = 3


# ------------------------------------------------------------------------------------------------
# worker side (runs under torchrun)
# ------------------------------------------------------------------------------------------------


def _block(rank: int, d: int) -> tuple[int, ...]:
    return tuple(range((rank // d) * d, (rank // d + 1) * d))


def _local(x, lengths, lay):
    """This rank's rows of the packed whole-sequence tensor ``x (sum(lengths), ...)``: each sequence
    zero-padded to its padded length and taken at the layout's positions."""
    import torch
    import torch.nn.functional as F

    parts = []
    for xi, n, pos in zip(x.split(lengths), lay.padded_lengths, lay.local_positions().split(list(lay.chunks))):
        pad = [0, 0] * (xi.dim() - 1) + [0, n - xi.shape[0]]
        parts.append(F.pad(xi, pad)[pos])
    return torch.cat(parts)


def _cu(lengths):
    import torch

    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _cp_plan(name, micro, lengths, cost, blocks=None):
    """``build_plan`` of ``micro = [[(degree, cp, [seq, ...]), ...] per micro-step]``: the groups
    build_plan makes (Ulysses-only, in its own order) with each one's cp set, found by its sequences."""
    from workbench.solve.plan import build_plan

    plan = build_plan(name, [[(d, s) for d, _, s in ms] for ms in micro], lengths, cost, blocks=blocks)
    cp_of = {tuple(s): c for ms in micro for _, c, s in ms}
    steps = tuple(dataclasses.replace(ms, groups=tuple(dataclasses.replace(g, cp=cp_of[tuple(g.sequences)])
                                                       for g in ms.groups)) for ms in plan.micro_steps)
    return dataclasses.replace(plan, micro_steps=steps)


class _FlashLike:
    """An attention kernel that keeps for backward what the flash kernels keep (q, k, v, the output
    and an fp32 log-sum-exp, heads x tokens) and computes with the PyTorch path."""

    def __new__(cls):
        import torch

        from workbench.runtime.attention import torch_varlen_attention

        class Saves(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, cu_q, cu_k, mq, mk):
                out = torch_varlen_attention(q, k, v, cu_q, cu_k, mq, mk)
                ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[1], q.shape[0]))
                ctx.args = (cu_q, cu_k, mq, mk)
                return out

            @staticmethod
            def backward(ctx, grad):
                q, k, v, _, _ = ctx.saved_tensors
                with torch.enable_grad():
                    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
                    out = torch_varlen_attention(qq, kk, vv, *ctx.args)
                    return (*torch.autograd.grad(out, (qq, kk, vv), grad), None, None, None, None)

        return Saves.apply


def _check_attention(registry, rank: int) -> dict:
    """CPAttention against single-process attention on the whole sequences (float64), forward and
    backward; and what it keeps for backward."""
    import torch
    import torch.distributed as dist

    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.cp import CPAttention, group_layout

    out = {}
    lengths = ATTN_LENGTHS
    cu = _cu(lengths)
    T, hd = int(cu[-1]), 8
    cases = {"2x2": (4, 2, 4, 2), "1x4": (4, 4, 4, 2), "1x2": (2, 2, 4, 2), "2x2_kv1": (4, 2, 4, 1),
             "1x4_kv1": (4, 4, 4, 1)}
    for i, (name, (d, c, H, KV)) in enumerate(cases.items()):
        gen = torch.Generator().manual_seed(300 + i)
        q, k, v, gout = (torch.randn(T, h, hd, generator=gen, dtype=torch.float64) for h in (H, KV, KV, H))
        for t in (q, k, v, gout):  # the same inputs everywhere
            dist.broadcast(t, src=0)
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = torch_varlen_attention(qr, kr, vr, cu, cu, max(lengths), max(lengths))
        (ref * gout).sum().backward()
        ranks = _block(rank, d)
        lay = group_layout(lengths, d, c, ranks.index(rank))
        ql, kl, vl = (_local(t, lengths, lay).requires_grad_(True) for t in (q, k, v))
        ug, cg = registry.subgroups(ranks, c)
        attn = CPAttention(ug, cg, lay, torch_varlen_attention)
        mx = max(lay.chunks)
        o = attn(ql, kl, vl, lay.local_cu_seqlens, lay.local_cu_seqlens, mx, mx)
        (o * _local(gout, lengths, lay)).sum().backward()
        valid = lay.local_valid()
        u = d // c
        group_ranks = {"ulysses": None if ug is None else dist.get_process_group_ranks(ug),
                       "cp": dist.get_process_group_ranks(cg)}
        k_ = ranks.index(rank)
        want_ranks = {"ulysses": None if u == 1 else [ranks[0] + (k_ // u) * u + a for a in range(u)],
                      "cp": [ranks[0] + k_ % u + u * j for j in range(c)]}
        try:
            assert group_ranks == want_ranks, (group_ranks, want_ranks)
            torch.testing.assert_close(o[valid], _local(ref.detach(), lengths, lay)[valid], rtol=1e-10, atol=1e-10)
            # padding gets no gradient (it is zero in the reference's padded rows as well)
            for g, got, want in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
                torch.testing.assert_close(got, _local(want, lengths, lay), rtol=1e-10, atol=1e-10,
                                           msg=lambda m, g=g: f"{g}: {m}")
            out[f"attn_{name}"] = {"ok": True, "tokens": int(valid.sum())}
        except AssertionError as e:
            out[f"attn_{name}"] = {"ok": False, "error": str(e)[:2000]}
    out.update(_saved_by_cp_attention(registry, rank))
    return out


def _saved_by_cp_attention(registry, rank: int) -> dict:
    """What one CPAttention forward keeps for backward, storage by storage, against the formula of
    the module docstring: the kernel's q, output and lse over the S local rows and the selected
    K/V, (2c+1) m rows per sequence; never the all-gathered c x S rows."""
    import torch

    from workbench.runtime.cp import CPAttention, group_layout

    out = {}
    lengths = ATTN_LENGTHS
    T, hd = sum(lengths), 8
    for d, c, H, KV in ((4, 2, 4, 2), (4, 4, 4, 2), (4, 2, 4, 1)):
        ranks = _block(rank, d)
        lay = group_layout(lengths, d, c, ranks.index(rank))
        u = d // c
        hq, hk = H // u, max(KV, u) // u  # KV heads after repetition, per Ulysses rank
        gen = torch.Generator().manual_seed(7)
        q, k, v = (_local(torch.randn(T, h, hd, generator=gen), lengths, lay).requires_grad_(True) for h in (H, KV, KV))
        storages: dict[int, tuple] = {}

        def pack(t, storages=storages):
            st = t.untyped_storage()
            storages[st.data_ptr()] = (st.nbytes(), t.dtype, tuple(t.shape))
            return t

        attn = CPAttention(*registry.subgroups(ranks, c), lay, _FlashLike())
        mx = max(lay.chunks)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o = attn(q, k, v, lay.local_cu_seqlens, lay.local_cu_seqlens, mx, mx)
        o.sum().backward()  # every rank of the group: the backward is collective
        S = sum(2 * m for m in lay.chunk)
        K = sum((2 * c + 1) * m for m in lay.chunk)
        floats = sorted(n for n, dt, _ in storages.values() if dt.is_floating_point)
        want = sorted([S * hq * hd * 4, S * hq * hd * 4, hq * S * 4, K * 2 * hk * hd * 4])  # q, out, lse, K/V
        gathered_rows = c * S
        out[f"saved_{u}x{c}_kv{KV}"] = {
            "ok": floats == want and not any(sh and sh[0] == gathered_rows for _, _, sh in storages.values()),
            "float_bytes": floats, "want": want, "selected_kv_bytes": K * 2 * hk * hd * 4,
            "index_bytes": sorted(n for n, dt, _ in storages.values() if not dt.is_floating_point)}
    return out


def _check_kernels(registry, rank: int) -> dict:
    """CPAttention (and Ulysses) in bf16 with torch's varlen_attn and flash-attn's varlen kernel
    replaced by stand-ins that refuse what the real kernels refuse: the outputs and gradients
    against the PyTorch path in fp32 on the same bf16 values, and the calls each kernel got."""
    import torch

    sys.path.insert(0, str(HERE / "fakes"))
    import _varlen_checks
    import flash_attn  # the flash-attn 2.x stand-in

    from workbench.runtime.attention import flash_attention_fn, varlen_attention_fn, torch_varlen_attention
    from workbench.runtime.cp import CPAttention, group_layout
    from workbench.runtime.ulysses import UlyssesAttention

    out = {}
    lengths = [9, 1, 24, 6, 33]
    cu = _cu(lengths)
    T, hd = int(cu[-1]), 16
    with _varlen_checks.installed() as vcalls:
        kernels = {"varlen": (varlen_attention_fn("bf16"), vcalls), "flash": (flash_attention_fn("bf16"), flash_attn.CALLS)}
        for kname, (kernel, calls) in kernels.items():
            for d, c, KV in ((4, 2, 2), (4, 4, 2), (4, 2, 1), (4, 1, 2)):
                H = 4
                gen = torch.Generator().manual_seed(40 + d + c + KV)  # the same inputs on every rank
                q, k, v, gout = (torch.randn(T, h, hd, generator=gen).to(torch.bfloat16) for h in (H, KV, KV, H))
                qr, kr, vr = (t.float().requires_grad_(True) for t in (q, k, v))
                ref = torch_varlen_attention(qr, kr, vr, cu, cu, max(lengths), max(lengths))
                (ref * gout.float()).sum().backward()
                ranks = _block(rank, d)
                lay = group_layout(lengths, d, c, ranks.index(rank))
                ql, kl, vl = (_local(t, lengths, lay).requires_grad_(True) for t in (q, k, v))
                n0 = len(calls)
                attn = (UlyssesAttention(registry.get(ranks), lay, kernel) if c == 1
                        else CPAttention(*registry.subgroups(ranks, c), lay, kernel))
                mx = max(lay.chunks)
                o = attn(ql, kl, vl, lay.local_cu_seqlens, lay.local_cu_seqlens, mx, mx)
                (o.float() * _local(gout, lengths, lay).float()).sum().backward()
                valid = lay.local_valid()
                errs = {"out": float((o.detach().float()[valid] - _local(ref.detach(), lengths, lay)[valid]).abs().max())}
                for g, got, want in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
                    errs[g] = float((got.float() - _local(want, lengths, lay)).abs().max())
                new = calls[n0:]
                fwd = [x for x in new if x.get("op", "forward") == "forward"]
                if c == 1:
                    want_cu = (lay.full_cu_seqlens.tolist(), lay.full_cu_seqlens.tolist())
                    want_max = (lay.full_max_seqlen, lay.full_max_seqlen)
                else:
                    want_cu = (lay.query_cu_seqlens.tolist(), lay.key_cu_seqlens.tolist())
                    want_max = (lay.max_query, lay.max_key)
                call_ok = len(fwd) == 1 and fwd[0]["dtype"] == torch.bfloat16
                if kname == "varlen":
                    call_ok = (call_ok and (fwd[0]["cu_q"], fwd[0]["cu_k"]) == want_cu and fwd[0]["max"] == want_max
                               and fwd[0]["is_causal"] and fwd[0]["window"] == (-1, 0)
                               and [x["op"] for x in new] == ["forward", "backward"])
                else:
                    call_ok = (call_ok and (fwd[0]["cu"], fwd[0]["cu_k"]) == want_cu and fwd[0]["max_seqlen"] == want_max
                               and fwd[0]["causal"] is True)
                out[f"kernel_{kname}_{d // c}x{c}_kv{KV}"] = {
                    "ok": max(errs.values()) < HALF_TOL and call_ok, "errors": errs, "calls": len(new),
                    "call": {k_: str(v_) for k_, v_ in fwd[0].items()} if fwd else None}
    return out


def _record_collectives(log: list):
    """Wrap the collectives the attention makes so each call is logged as (name, elements, group
    ranks) and then made for real; returns an undo."""
    import torch.distributed as dist

    saved = {}
    for name in ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                 "reduce_scatter_tensor"):
        real = getattr(dist, name, None)
        if real is None:
            continue
        saved[name] = real

        def wrapper(*args, _real=real, _name=name, **kw):
            group = kw.get("group")
            kind = {"all_to_all_single": "a2a", "all_gather_single": "ag", "all_gather_into_tensor": "ag"}.get(_name, "rs")
            big = args[0] if kind == "ag" else args[1]  # the all-gather's output, the others' input
            log.append((kind, int(big.numel()), dist.get_process_group_ranks(group) if group is not None else None))
            return _real(*args, **kw)

        setattr(dist, name, wrapper)

    def undo():
        for name, real in saved.items():
            setattr(dist, name, real)

    return undo


def _check_collectives(registry, rank: int) -> dict:
    """The collectives of one step of the tiny model (2 layers) on a 2x2 and a 1x4 group, in order
    and with their sizes, without and with --recompute."""
    import torch

    from test_runtime_zero import _cost, _run_stage
    from workbench.runtime.cp import group_layout
    from workbench.models import get_model

    spec = get_model("tiny")
    H, KV, hd, L = spec.heads, spec.kv_heads, spec.head_dim, spec.layers
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in STEP_LENGTHS]
    out = {}
    for c in (2, 4):
        u = WORLD // c
        lay = group_layout(STEP_LENGTHS, WORLD, c, rank)
        T = lay.local_tokens
        S = u * T
        kvp = max(KV, u)  # KV heads after repetition
        hk = kvp // u
        qkv, o_, kv_all = T * (H + 2 * kvp) * hd, T * H * hd, c * S * 2 * hk * hd
        uly = None if u == 1 else [(rank // u) * u + a for a in range(u)]
        cpg = [rank % u + u * j for j in range(c)]
        fwd = ([("a2a", qkv, uly)] if u > 1 else []) + [("ag", kv_all, cpg)] + ([("a2a", o_, uly)] if u > 1 else [])
        bwd = ([("a2a", o_, uly)] if u > 1 else []) + [("rs", kv_all, cpg)] + ([("a2a", qkv, uly)] if u > 1 else [])
        for recompute in (False, True):
            plan = _cp_plan("one", [[(WORLD, c, list(range(len(seqs))))]], STEP_LENGTHS, _cost(0, "fp32", recompute))
            log: list = []
            undo = _record_collectives(log)
            try:
                _run_stage(registry, spec, plan, seqs, stage=0, precision="fp32", recompute=recompute)
            finally:
                undo()
            got = [(k_, n, r) for k_, n, r in log]
            want = fwd * L + (fwd + bwd if recompute else bwd) * L
            out[f"collectives_{u}x{c}{'_recompute' if recompute else ''}"] = {
                "ok": got == want, "got": [list(x) for x in got][:20], "want": [list(x) for x in want][:20]}
    return out


def _step_cases():
    """(key, spec name, stage, precision, recompute, plan maker) for the exactness checks."""
    from test_runtime_zero import _cost

    n = len(STEP_LENGTHS)

    def single(c):
        return lambda stage, prec, rec: _cp_plan("one", [[(WORLD, c, list(range(n)))]], STEP_LENGTHS,
                                                 _cost(stage, prec, rec))

    def mixed(stage, prec, rec):
        # micro-step 0: a 1x2 group on ranks 0-1 beside a 2x1 group on ranks 2-3; then a 2x2 group
        micro = [[(2, 2, [0, 1, 2]), (2, 1, [3, 4])], [(4, 2, [5, 6, 7, 8])]]
        return _cp_plan("mixed", micro, STEP_LENGTHS, _cost(stage, prec, rec), blocks=[[0, 1], [0]])

    def lockstep(stage, prec, rec):
        # pass 0: ranks 0-1 serve a 2x2 group and a 1x2 group, ranks 2-3 the 2x2 group and a 2x1 group;
        # pass 1: a 1x4 group, and rank 3 a degree-1 group too; pass 2: ranks 0-1 idle
        micro = [[(4, 2, [0, 1]), (2, 2, [2, 3]), (2, 1, [4])], [(4, 4, [5, 6]), (1, 1, [7])], [(2, 2, [8])]]
        return _cp_plan("lockstep", micro, STEP_LENGTHS, _cost(3, prec, rec), blocks=[[0, 0, 1], [0, 3], [1]])

    cases = [(f"{WORLD // c}x{c}", "tiny", 0, "fp32", False, single(c)) for c in (1, 2, 4)]
    cases += [(f"{WORLD // c}x{c}_kv1", "tiny-kv1", 0, "fp32", False, single(c)) for c in (1, 2, 4)]
    cases += [(f"mixed_z{z}", "tiny", z, "fp32", False, mixed) for z in (0, 1, 2)]
    cases += [("lockstep_z3", "tiny", 3, "fp32", False, lockstep), ("lockstep_z3_kv1", "tiny-kv1", 3, "fp32", False, lockstep)]
    cases += [("mixed_z0_recompute", "tiny", 0, "fp32", True, mixed), ("lockstep_z3_recompute", "tiny", 3, "fp32", True, lockstep)]
    cases += [("mixed_z0_bf16", "tiny", 0, "bf16", False, mixed), ("lockstep_z3_bf16", "tiny", 3, "bf16", False, lockstep)]
    # the chunked loss under autocast (ZeRO 0) and under FSDP2's bf16 casts (ZeRO-3): the paths a GPU runs
    cases += [("mixed_z0_bf16_recompute", "tiny", 0, "bf16", True, mixed),
              ("lockstep_z3_bf16_recompute", "tiny", 3, "bf16", True, lockstep)]
    return cases


def _random_cp_plan(lengths, rng):
    """Random lockstep passes of groups of random splits on random aligned blocks (a rank may serve
    several groups of a pass, of any splits, or none)."""
    from test_runtime_zero import _cost

    shapes = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (4, 2)]
    passes = [[rng.choice(shapes) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(2, 3))]
    flat = [(m, i) for m, p in enumerate(passes) for i in range(len(p))]
    assign: dict = {}
    order = list(range(len(lengths)))
    rng.shuffle(order)
    for j, s in enumerate(order):
        assign.setdefault(flat[j] if j < len(flat) else rng.choice(flat), []).append(s)
    micro, blocks = [], []
    for m, p in enumerate(passes):
        keep = [(i, d, c) for i, (d, c) in enumerate(p) if assign.get((m, i))]
        micro.append([(d, c, assign[(m, i)]) for i, d, c in keep])
        blocks.append([rng.randrange(WORLD // d) for _, d, _ in keep])
    return _cp_plan("random-cp", micro, lengths, _cost(3, "fp32"), blocks=blocks)


def _check_steps(registry, rank: int) -> dict:
    import random

    import torch

    from test_runtime_zero import BF16_RTOL, FP32_RTOL, FP64_RTOL, _compare, _reference_update, _run_stage
    from workbench.runtime.model import Transformer
    from workbench.models import get_model

    specs = {"tiny": get_model("tiny"), "tiny-kv1": dataclasses.replace(get_model("tiny"), kv_heads=1, name="tiny-kv1")}
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in STEP_LENGTHS]
    refs, out = {}, {}
    for key, sname, stage, prec, rec, make in _step_cases():
        spec = specs[sname]
        plan = make(stage, prec, rec)
        rkey = (sname, prec, 3 if stage == 3 and prec == "bf16" else 0)
        if rkey not in refs:
            refs[rkey] = _reference_update(spec, seqs, prec, stage, "sgd", 3)
        ref, ref_loss, _ = refs[rkey]
        init = {n: p.detach().clone() for n, p in Transformer(spec, seed=3).named_parameters()}
        full, res, _, _ = _run_stage(registry, spec, plan, seqs, stage=stage, precision=prec, recompute=rec)
        worst, where = _compare(full, ref, init)
        tol = BF16_RTOL if prec == "bf16" else FP32_RTOL
        loss_rel = abs(res.loss - ref_loss) / ref_loss
        out[f"step_{key}"] = {"ok": worst < tol and loss_rel < tol, "worst_rel": worst, "worst_param": where,
                              "loss_rel": loss_rel, "execution": res.execution,
                              "splits": [[f"{g['degree'] // g['cp']}x{g['cp']}" for g in r.groups] for r in res.records]}
    spec = specs["tiny"]
    init64 = {n: p.detach().clone() for n, p in Transformer(spec, seed=3).double().named_parameters()}
    for i in range(N_RANDOM):
        rng = random.Random(500 + i)
        lengths = [rng.choice([1, 2, 3, 5, 9, 17, 31, 40]) for _ in range(rng.randint(6, 9))]
        g2 = torch.Generator().manual_seed(600 + i)
        rseqs = [torch.randint(0, spec.vocab, (n,), generator=g2) for n in lengths]
        plan = _random_cp_plan(lengths, rng)
        ref, _, _ = _reference_update(spec, rseqs, "fp32", 3, "sgd", 3, torch.float64)
        full, res, _, _ = _run_stage(registry, spec, plan, rseqs, stage=3, precision="fp32", dtype=torch.float64)
        worst, where = _compare(full, ref, init64)
        out[f"random_cp_{i}"] = {"ok": worst < FP64_RTOL, "worst_rel": worst, "worst_param": where,
                                 "groups_on_a_rank": max(len(r.groups) for r in res.records),
                                 "splits": sorted({f"{g.degree // g.cp}x{g.cp}" for m in plan.micro_steps for g in m.groups})}
    return out


def _check_hf(registry, rank: int, data_dir: str) -> dict:
    """A tiny Hugging Face Llama 3.1 (rope scaling: positions matter) under CP splits: every rank's
    logits against transformers' logits of the whole sequences, and the step's loss."""
    if not data_dir:
        return {"hf_llama": {"ok": True, "skipped": "transformers is not installed"}}
    import torch

    from workbench.cost import CostModel
    from workbench.hf import model_from_config
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.cp import CPAttention
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor, make_shard
    from workbench.runtime.ulysses import UlyssesAttention
    from workbench.runtime.weights import load_initial_weights
    from workbench.specs import ClusterSpec, load_profile

    folder = Path(data_dir) / "llama"
    ref = torch.load(Path(data_dir) / "llama.pt", weights_only=True)
    spec = model_from_config(folder)
    model = Transformer(spec, seed=99)
    load_initial_weights(model, folder)
    seqs, logits_ref = ref["sequences"], ref["logits"]
    scale = max(float(x.abs().max()) for x in logits_ref)
    cost = CostModel(load_profile("cpu-gloo-tiny"), spec, ClusterSpec(num_gpus=WORLD, gpus_per_node=WORLD,
                                                                       gpu_memory_gb=4.0, zero_stage=0))
    micro = [[(4, 2, [0, 8])], [(2, 2, [1, 2, 3]), (2, 1, [4, 5])], [(4, 4, [6, 7])]]
    plan = _cp_plan("cp", micro, HF_LENGTHS, cost, blocks=[[0], [0, 1], [0]])
    worst, compared = 0.0, 0
    with torch.no_grad():
        for ms in plan.micro_steps:
            g = next(g for g in ms.groups if rank in g.ranks)
            sh = make_shard([seqs[i] for i in g.sequences], g.degree, g.ranks.index(rank), g.cp)
            attn = (UlyssesAttention(registry.get(g.ranks), sh.layout, torch_varlen_attention) if g.cp == 1
                    else CPAttention(*registry.subgroups(g.ranks, g.cp), sh.layout, torch_varlen_attention))
            lg = model(sh.tokens, sh.positions, sh.cu_seqlens, sh.max_seqlen, attn)  # (T_loc, vocab)
            valid = sh.layout.local_valid()
            cu = sh.cu_seqlens.tolist()
            for j, i in enumerate(g.sequences):
                keep = valid[cu[j]:cu[j + 1]]
                got, want = lg[cu[j]:cu[j + 1]][keep], logits_ref[i][sh.positions[cu[j]:cu[j + 1]][keep]]
                if got.numel():
                    worst = max(worst, float((got - want).abs().max()) / scale)
                    compared += int(keep.sum())
    res = StepExecutor(model, registry, torch_varlen_attention).run(plan, seqs)
    loss_rel = abs(res.loss - ref["loss"]) / abs(ref["loss"])
    return {"hf_llama": {"ok": worst <= 1e-5 and loss_rel <= 1e-5, "worst_rel": worst, "loss_rel": loss_rel,
                         "compared_tokens": compared}}


def _check_refusals(registry, rank: int) -> dict:
    """A split the run made no process groups for is refused on every rank before any collective:
    every rank then meets at a barrier (a rank stuck in a collective would time the run out)."""
    import torch
    import torch.distributed as dist

    from test_runtime_zero import _cost
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.groups import GroupRegistry
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor
    from workbench.solve.plan import PlanError
    from workbench.models import get_model

    spec = get_model("tiny")
    plain = GroupRegistry(WORLD, [1, 2, 4])  # Ulysses-only, as a run whose cost model lists no CP shape
    plan = _cp_plan("cp", [[(4, 2, [0, 1])]], [9, 5], _cost(0, "fp32"))
    seqs = [torch.zeros(9, dtype=torch.long), torch.zeros(5, dtype=torch.long)]
    try:
        StepExecutor(Transformer(spec, seed=0), plain, torch_varlen_attention).run(plan, seqs)
        res = {"ok": False, "error": "no error"}
    except PlanError as e:
        res = {"ok": "split 2x2 (Ulysses x CP), which has no process groups: this run's shapes are 1x1, 2x1, 4x1"
                     in str(e) and "\n" not in str(e), "error": str(e)}
    dist.barrier()
    return {"refuse_unmade_split": res}


def world_checks(data_dir: str) -> list:
    """The checks this file runs in the shared world (``tests/_torchrun.py``), in order."""
    return [_check_attention, _check_kernels, _check_collectives, _check_steps,
            lambda reg, rank: _check_hf(reg, rank, data_dir), _check_refusals]


# ------------------------------------------------------------------------------------------------
# pytest side
# ------------------------------------------------------------------------------------------------


def world_prepare(folder: Path) -> list[str]:
    """Pytest side, before the launch: the HF reference (transformers, when installed) written to
    ``folder``; the argument of :func:`world_checks` ("" without transformers)."""
    import torch

    try:
        import transformers  # noqa: F401
    except ImportError:
        return [""]
    from _hf_models import hf_batch_loss, hf_logits, make_hf_model

    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 300, (n,), generator=gen) for n in HF_LENGTHS]
    ref = make_hf_model("llama", folder / "llama", seed=20)
    torch.save({"sequences": seqs, "logits": [hf_logits(ref, s) for s in seqs], "loss": hf_batch_loss(ref, seqs)},
               folder / "llama.pt")
    return [str(folder)]


@pytest.fixture(scope="module")
def cp_results(request, tmp_path_factory):
    """This file's checks in the shared 4-rank world (launched once a session, ``tests/_torchrun.py``)."""
    pytest.importorskip("torch")
    return by_check(shared_world(request, tmp_path_factory, __name__))


def _assert_all_ranks(results: dict, key: str) -> None:
    assert_all_ranks(results, key, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["2x2", "1x4", "1x2", "2x2_kv1", "1x4_kv1"])
def test_cp_attention_matches_single_process_attention(cp_results, case):
    _assert_all_ranks(cp_results, f"attn_{case}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["2x2_kv2", "1x4_kv2", "2x2_kv1"])
def test_cp_attention_keeps_the_selected_kv_not_the_gathered(cp_results, case):
    _assert_all_ranks(cp_results, f"saved_{case}")


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["varlen", "flash"])
@pytest.mark.parametrize("split", ["2x2_kv2", "1x4_kv2", "2x2_kv1", "4x1_kv2"])
def test_kernel_calls_inside_cp_meet_the_kernel_contract(cp_results, kernel, split):
    _assert_all_ranks(cp_results, f"kernel_{kernel}_{split}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["2x2", "1x4", "2x2_recompute", "1x4_recompute"])
def test_collectives_in_order_with_their_sizes(cp_results, case):
    _assert_all_ranks(cp_results, f"collectives_{case}")


STEP_KEYS = ["4x1", "2x2", "1x4", "4x1_kv1", "2x2_kv1", "1x4_kv1", "mixed_z0", "mixed_z1", "mixed_z2", "lockstep_z3",
             "lockstep_z3_kv1", "mixed_z0_recompute", "lockstep_z3_recompute", "mixed_z0_bf16", "lockstep_z3_bf16",
             "mixed_z0_bf16_recompute", "lockstep_z3_bf16_recompute"]


@pytest.mark.slow
@pytest.mark.parametrize("key", STEP_KEYS)
def test_one_step_equals_the_single_process_update(cp_results, key):
    _assert_all_ranks(cp_results, f"step_{key}")


@pytest.mark.slow
def test_the_plans_ran_the_splits_they_say(cp_results):
    mixed = cp_results["step_mixed_z0"]
    assert mixed["0"]["splits"] == [["1x2"], ["2x2"]] and mixed["2"]["splits"] == [["2x1"], ["2x2"]]
    lock = cp_results["step_lockstep_z3"]
    assert lock["0"]["execution"] == "lockstep"
    assert lock["0"]["splits"] == [["2x2", "1x2"], ["1x4"], []]  # two CP groups in one pass, then an empty pass
    assert lock["3"]["splits"] == [["2x2", "2x1"], ["1x4", "1x1"], ["1x2"]]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(N_RANDOM))
def test_random_lockstep_plans_of_cp_groups_are_exact(cp_results, i):
    _assert_all_ranks(cp_results, f"random_cp_{i}")


@pytest.mark.slow
def test_hugging_face_llama_logits_under_cp_match_transformers(cp_results):
    pytest.importorskip("transformers")
    _assert_all_ranks(cp_results, "hf_llama")
    assert sum(v["compared_tokens"] for v in cp_results["hf_llama"].values()) == sum(HF_LENGTHS)


@pytest.mark.slow
def test_a_split_without_process_groups_is_refused_everywhere(cp_results):
    _assert_all_ranks(cp_results, "refuse_unmade_split")
