"""Multi-process checks of the runtime, on CPU with gloo, on the 4 ranks of the shared torchrun world
(``tests/_torchrun.py``: one launch runs the checks of every file that takes part).

Its checks compare Ulysses attention against single-process attention (forward and backward)
and, for several random heterogeneous plans, the all-reduced gradient (ZeRO-0, free micro-steps)
against a single-process full-batch reference, one JSON result per check; the pytest tests below
assert on each result. The other ZeRO stages and lockstep passes: test_runtime_zero.py.
"""

from __future__ import annotations

import pytest
from _torchrun import assert_all_ranks, by_check, shared_world

# its slow tests check exact results, not times: make test runs them in the untimed lane (tests/_xdist_heavy.py)
pytestmark = pytest.mark.untimed

WORLD = 4
N_PLANS = 6
DIST_TIMEOUT_S = 90


# ------------------------------------------------------------------------------------------------
# worker side (runs under torchrun)
# ------------------------------------------------------------------------------------------------


def _slice(x, d: int, r: int):
    """Rank r's contiguous slice of one sequence x (L, ...) padded with zeros to a multiple of d."""
    import torch.nn.functional as F

    L = x.shape[0]
    c = -(-L // d)
    pad = [0, 0] * (x.dim() - 1) + [0, d * c - L]
    return F.pad(x, pad)[r * c:(r + 1) * c]


def _check_ulysses(registry, rank: int) -> dict:
    """Ulysses attention vs single-process attention, forward and backward, for degree 2 (KV heads
    split) and degree 4 (KV heads replicated), on uneven lengths."""
    import torch
    import torch.distributed as dist

    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.ulysses import UlyssesAttention, shard_layout

    results = {}
    H, KV, hd = 4, 2, 8
    lengths = [7, 1, 12, 5, 30]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    for d in (2, 4):
        gen = torch.Generator().manual_seed(100 + d)
        q = torch.randn(T, H, hd, generator=gen, dtype=torch.float64)
        k = torch.randn(T, KV, hd, generator=gen, dtype=torch.float64)
        v = torch.randn(T, KV, hd, generator=gen, dtype=torch.float64)
        gout = torch.randn(T, H, hd, generator=gen, dtype=torch.float64)
        for t in (q, k, v, gout):  # same inputs everywhere: broadcast from rank 0
            dist.broadcast(t, src=0)
        # reference on the whole batch
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        out_ref = torch_varlen_attention(qr, kr, vr, cu, cu, max(lengths), max(lengths))
        (out_ref * gout).sum().backward()
        # distributed: this rank's group and slices
        ranks = tuple(range((rank // d) * d, (rank // d + 1) * d))
        gr = ranks.index(rank)
        lay = shard_layout(lengths, d, gr)

        def local(x, d=d, gr=gr):
            return torch.cat([_slice(x[int(cu[i]):int(cu[i + 1])], d, gr) for i in range(len(lengths))])

        ql, kl, vl = (local(t).requires_grad_(True) for t in (q, k, v))
        attn = UlyssesAttention(registry.get(ranks), lay, torch_varlen_attention)
        out = attn(ql, kl, vl, lay.local_cu_seqlens, lay.local_cu_seqlens, max(lay.chunks), max(lay.chunks))
        (out * local(gout)).sum().backward()
        valid = lay.local_valid()
        try:
            torch.testing.assert_close(out[valid], local(out_ref.detach())[valid], rtol=1e-10, atol=1e-10)
            for name, got, ref in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
                torch.testing.assert_close(got, local(ref), rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
            results[f"ulysses_d{d}"] = {"ok": True}
        except AssertionError as e:
            results[f"ulysses_d{d}"] = {"ok": False, "error": str(e)[:2000]}
    return results


_LAYOUTS = ([4], [2, 2], [2, 1, 1], [1, 1, 1, 1], [2], [1, 1], [4], [2, 1])


def _random_plan(lengths, cost, rng):
    """A random heterogeneous plan: random layouts per micro-step (some ranks idle), every sequence
    on a random group of a random micro-step."""
    from workbench.solve.plan import build_plan

    n_micro = rng.randint(2, 4)
    layouts = [list(rng.choice(_LAYOUTS)) for _ in range(n_micro)]
    assign = [[[] for _ in lay] for lay in layouts]
    for i in range(len(lengths)):
        m = rng.randrange(n_micro)
        assign[m][rng.randrange(len(layouts[m]))].append(i)
    micro = [[(d, seqs) for d, seqs in zip(layouts[m], assign[m])] for m in range(n_micro)]
    return build_plan("random", micro, lengths, cost)


def _check_gradients(registry, rank: int) -> dict:
    """All-reduced gradients of random plans vs the single-process full-batch gradient."""
    import random

    import torch

    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import StepExecutor, batch_loss
    from workbench.specs import ClusterSpec, load_profile

    spec = get_model("tiny")
    cost = CostModel(load_profile("cpu-gloo-tiny"), spec,
                     ClusterSpec(num_gpus=WORLD, gpus_per_node=WORLD, gpu_memory_gb=4.0, zero_stage=0))
    model = Transformer(spec, seed=3)
    ref_model = Transformer(spec, seed=3)
    ex = StepExecutor(model, registry, torch_varlen_attention)
    results = {}
    # the random plans, then one mixing degrees 1, 2 and 4 in one step by hand (rank 3 idle in
    # micro-step 0), then one from the greedy planner
    for p_i in range(N_PLANS + 2):
        rng = random.Random(p_i)
        # uneven lengths: some not divisible by 2 or 4, some shorter than the degree
        lengths = [rng.choice([1, 2, 3, 5, 9, 17, 31, 40, 63, 64, 97]) for _ in range(rng.randint(5, 9))]
        gen = torch.Generator().manual_seed(1000 + p_i)
        seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in lengths]
        if p_i < N_PLANS:
            plan = _random_plan(lengths, cost, rng)
            key = f"grad_plan{p_i}"
        elif p_i == N_PLANS:
            from workbench.solve.plan import build_plan

            lengths = [33, 6, 1, 50, 7, 2, 19, 4]
            seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in lengths]
            micro = [[(2, [0, 1]), (1, [2])], [(4, [3, 4])], [(1, [5]), (1, [6]), (2, [7])]]
            plan = build_plan("mixed", micro, lengths, cost, blocks=[[0, 2], [0], [0, 1, 1]])
            key = "grad_mixed"
        else:  # and one plan from a real planner
            key = "grad_greedy"
            from workbench.solve import run_planner

            lengths = [200, 97, 31, 17, 9, 5, 3, 2, 1, 40, 63]
            seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in lengths]
            plan = run_planner("greedy", lengths, cost)
        res = ex.run(plan, seqs)
        ref_model.zero_grad(set_to_none=True)
        ref_loss = batch_loss(ref_model, seqs, torch_varlen_attention)
        ref_loss.backward()
        worst = 0.0
        worst_name = ""
        for (name, p), pr in zip(model.named_parameters(), ref_model.parameters()):
            rel = float((p.grad - pr.grad).norm() / pr.grad.norm().clamp_min(1e-30))
            if rel > worst:
                worst, worst_name = rel, name
        degrees = sorted({g.degree for ms in plan.micro_steps for g in ms.groups})
        ref_v = float(ref_loss.detach())
        loss_rel = abs(res.loss - ref_v) / abs(ref_v)
        results[key] = {
            "ok": worst < 1e-5 and loss_rel < 1e-5, "worst_rel": worst, "worst_param": worst_name,
            "loss": res.loss, "ref_loss": ref_v, "degrees": degrees, "lengths": lengths,
            "micro_steps": len(plan.micro_steps),
            "idle_records": sum(1 for r in res.records if r.degree == 0),
        }
    return results


def _check_misc(registry, rank: int) -> dict:
    """A plan the world cannot run fails on every rank before any collective (no hang); the
    profiler's collective measurement (all-to-all, ring steps, all-reduce) works under gloo."""
    import torch

    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.model import Transformer
    from workbench.profile.fit import fit_collectives
    from workbench.profile.measure import measure_collectives
    from workbench.runtime.step import StepExecutor
    from workbench.solve.plan import PlanError, build_plan
    from workbench.specs import ClusterSpec, load_profile

    spec = get_model("tiny")
    results = {}
    cost8 = CostModel(load_profile("cpu-gloo-tiny"), spec, ClusterSpec(num_gpus=8, gpus_per_node=8, gpu_memory_gb=4.0,
                                                                    zero_stage=0))
    plan8 = build_plan("bad", [[(8, [0, 1], 2)]], [5, 9], cost8)  # 4x2: tiny has 4 heads
    ex = StepExecutor(Transformer(spec, seed=0), registry, torch_varlen_attention)
    try:
        ex.run(plan8, [torch.zeros(5, dtype=torch.long), torch.zeros(9, dtype=torch.long)])
        results["bad_plan"] = {"ok": False, "error": "no error"}
    except PlanError as e:
        results["bad_plan"] = {"ok": "world size" in str(e), "error": str(e)}
    points = measure_collectives(registry, [2, 4], [16384, 262144], reps=2, inner=2)
    fits = fit_collectives(points)
    agreed = all(len(p["per_rank"]) == WORLD and p["ms"] > 0 for p in points)
    ok = (set(fits.get("all_to_all", {})) == {2, 4} and set(fits.get("p2p", {})) == {2, 4}
          and set(fits.get("allreduce", {})) == {WORLD}
          and all(f.gbps > 0 and f.latency_ms >= 0 for by in fits.values() for f in by.values()))
    results["collectives"] = {"ok": ok and agreed,
                              "figures": {k: {str(d): [f.latency_ms, f.gbps] for d, f in by.items()}
                                          for k, by in fits.items()}}
    return results


def world_checks() -> list:
    """The checks this file runs in the shared world (``tests/_torchrun.py``), in order."""
    return [_check_ulysses, _check_gradients, _check_misc]


# ------------------------------------------------------------------------------------------------
# pytest side
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist_results(request, tmp_path_factory):
    """This file's checks in the shared 4-rank world (launched once a session, ``tests/_torchrun.py``)."""
    return by_check(shared_world(request, tmp_path_factory, __name__))


def _assert_all_ranks(results: dict, key: str) -> None:
    assert_all_ranks(results, key, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("degree", [2, 4])
def test_ulysses_matches_single_process_attention(dist_results, degree):
    _assert_all_ranks(dist_results, f"ulysses_d{degree}")


@pytest.mark.slow
@pytest.mark.parametrize("plan", range(N_PLANS))
def test_random_plan_gradients_equal_full_batch(dist_results, plan):
    _assert_all_ranks(dist_results, f"grad_plan{plan}")


@pytest.mark.slow
@pytest.mark.parametrize("key", ["grad_mixed", "grad_greedy"])
def test_mixed_and_greedy_plan_gradients_equal_full_batch(dist_results, key):
    _assert_all_ranks(dist_results, key)


@pytest.mark.slow
def test_mixed_plan_has_every_degree_and_an_idle_rank(dist_results):
    per_rank = dist_results["grad_mixed"]
    assert per_rank["0"]["degrees"] == [1, 2, 4]
    assert per_rank["3"]["idle_records"] == 1


@pytest.mark.slow
def test_bad_plan_fails_on_every_rank_without_hanging(dist_results):
    _assert_all_ranks(dist_results, "bad_plan")


@pytest.mark.slow
def test_profiler_measures_gloo_collectives(dist_results):
    _assert_all_ranks(dist_results, "collectives")


@pytest.mark.slow
def test_random_plans_cover_every_degree_and_idle_ranks(dist_results):
    degrees = set()
    idle = 0
    for p in range(N_PLANS):
        r0 = dist_results[f"grad_plan{p}"]["0"]
        degrees |= set(r0["degrees"])
        idle += sum(v["idle_records"] for v in dist_results[f"grad_plan{p}"].values())
    assert degrees == {1, 2, 4}
    assert idle > 0, "no plan left a rank idle in a micro-step"
