"""The profiler's pure side: fits against known coefficients, held-out errors and fidelity on fixed
fixtures computed by hand, the latency terms of the cost model, and bad input as one clear line.
No torch, milliseconds."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from conftest import run_cli
from workbench.cost import CostModel
from workbench.models import get_model
from workbench.profile import ProfileSpec, check_fidelity, prepare_profile
from workbench.profile.fit import (ape, error_summary, fit_collectives, fit_link, fit_pack_curve, heldout_errors,
                                   nnls, trimmed_median, wire_bytes)
from workbench.profile.result import ProfileResult, build_result
from workbench.specs import ClusterSpec, ComputeCurve, HardwareProfile, load_profile

PACKS = [[64], [256], [1024], [2048], [4096], [64] * 16, [256] * 8, [1024, 512, 256, 128, 64, 64]]



def _tiny_auto(profile, world: int = 4) -> CostModel:
    """The tiny model on one node of ``world`` ranks with memory to spare, every split allowed."""
    return CostModel(profile, get_model("tiny"), ClusterSpec(num_gpus=world, gpus_per_node=world, gpu_memory_gb=1e6),
                     strategy="auto")

def _t(a, b, c, pack):
    return a * sum(s * s for s in pack) + b * sum(pack) + c


# ------------------------------------------------------------------------------------------------
# compute fits
# ------------------------------------------------------------------------------------------------


def test_fit_recovers_exact_coefficients():
    a, b, c = 2e-6, 0.01, 1.5
    fit = fit_pack_curve(PACKS, [_t(a, b, c, p) for p in PACKS])
    assert fit.curve.a == pytest.approx(a, rel=1e-9)
    assert fit.curve.b == pytest.approx(b, rel=1e-9)
    assert fit.curve.c == pytest.approx(c, rel=1e-9)
    assert max(abs(r) for r in fit.residuals_ms) < 1e-9


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_known_coefficients_under_noise(seed):
    # 3% multiplicative noise, 5 noisy repetitions per pack reduced by the trimmed median (as measured)
    rng = np.random.default_rng(seed)
    a, b, c = 8e-6, 0.016, 2.0
    times = [trimmed_median(_t(a, b, c, p) * (1 + 0.03 * rng.standard_normal(5))) for p in PACKS]
    fit = fit_pack_curve(PACKS, times)
    assert fit.curve.a == pytest.approx(a, rel=0.08)
    assert fit.curve.b == pytest.approx(b, rel=0.08)
    assert fit.curve.c == pytest.approx(c, rel=0.35)  # c is small next to the longest packs
    # a pack it was not fitted on is predicted within the noise
    held = heldout_errors(fit.curve, [[3072], [512] * 4], [_t(a, b, c, [3072]), _t(a, b, c, [512] * 4)])
    assert held["worst_ape"] < 5.0


def test_nnls_clips_a_negative_coefficient():
    w = nnls(np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]), np.array([3.0, 2.0, 1.0]))
    assert (w >= 0).all() and w[1] == 0
    assert w[0] == pytest.approx(2.0)  # the best constant alone: the mean


def test_fit_rejects_too_few_or_bad_points():
    with pytest.raises(ValueError, match="at least 3"):
        fit_pack_curve([[1], [2]], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        fit_pack_curve([[1], [2], [3]], [1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="3 packs but 2 times"):
        fit_pack_curve([[1], [2], [3]], [1.0, 2.0])


def test_trimmed_median_and_ape_by_hand():
    assert trimmed_median([1, 2, 3, 100, 4], 0.2) == 3.0  # 1 and 100 dropped
    assert trimmed_median([5.0]) == 5.0
    assert ape(110.0, 100.0) == pytest.approx(10.0)
    assert ape(80.0, 100.0) == pytest.approx(20.0)
    s = error_summary([10.0, 20.0, 40.0])
    assert s["median_ape"] == 20.0 and s["worst_ape"] == 40.0 and s["count"] == 3


def test_heldout_error_on_a_fixed_fixture():
    curve = ComputeCurve(a=0.0, b=1.0, c=0.0)  # predicts the token count
    out = heldout_errors(curve, [[100], [200], [50, 50]], [100.0, 250.0, 80.0])
    assert [p["predicted_ms"] for p in out["points"]] == [100.0, 200.0, 100.0]
    assert [round(p["ape"], 6) for p in out["points"]] == [0.0, 20.0, 25.0]
    assert out["median_ape"] == pytest.approx(20.0) and out["worst_ape"] == pytest.approx(25.0)


# ------------------------------------------------------------------------------------------------
# collectives
# ------------------------------------------------------------------------------------------------


def test_link_fit_recovers_latency_and_bandwidth():
    lat, gbps = 0.5, 2.0
    sizes = [8192, 131072, 1 << 20, 4 << 20]
    for kind, d in (("all_to_all", 4), ("allreduce", 4), ("p2p", 2)):
        t = [lat + wire_bytes(kind, m, d) / (gbps * 1e9) * 1e3 for m in sizes]
        f = fit_link(kind, d, sizes, t)
        assert f.latency_ms == pytest.approx(lat, rel=1e-6) and f.gbps == pytest.approx(gbps, rel=1e-6)
        assert f.predict(2 << 20) == pytest.approx(lat + wire_bytes(kind, 2 << 20, d) / 2e9 * 1e3)
    # wire bytes by hand: all-to-all sends (d-1)/d, ring all-reduce 2(n-1)/n
    assert wire_bytes("all_to_all", 1000, 4) == 750 and wire_bytes("allreduce", 1000, 4) == 1500


def test_link_fit_without_size_dependence_keeps_a_finite_bandwidth():
    f = fit_link("all_to_all", 2, [1000, 1000], [1.0, 1.0])  # one size: no latency can be separated
    assert f.latency_ms == 0.0 and f.gbps == pytest.approx(500 / 1e-3 / 1e9)
    pts = [{"kind": "all_to_all", "group_size": 2, "message_bytes": m, "ms": 1.0 + m / 1e6} for m in (1e4, 1e5, 1e6)]
    fits = fit_collectives(pts)
    assert set(fits) == {"all_to_all"} and set(fits["all_to_all"]) == {2}


# ------------------------------------------------------------------------------------------------
# measurements -> profile
# ------------------------------------------------------------------------------------------------


def _measurements(a=(5e-6, 1e-5), b=(0.01, 0.02), c=(1.0, 2.0), lat=0.4, gbps=1.5):
    rows = []
    for p, role in [(p, "fit") for p in PACKS] + [([3072], "heldout"), ([128] * 8, "heldout")]:
        rows.append({"pack": p, "tokens": sum(p), "role": role, "forward_ms": _t(a[0], b[0], c[0], p),
                     "backward_ms": _t(a[1], b[1], c[1], p)})
    coll = []
    for kind, d in (("all_to_all", 2), ("all_to_all", 4), ("allreduce", 4), ("p2p", 2)):
        for m in (8192, 131072, 1 << 20):
            coll.append({"kind": kind, "group_size": d, "message_bytes": m,
                         "ms": lat * d / 2 + wire_bytes(kind, m, d) / (gbps * 1e9) * 1e3})
    return {"model": "tiny", "world_size": 4, "device": "cpu", "compute": rows, "collectives": coll,
            "memory": {"activation_mb_per_token": 0.013, "model_state_mb": 2.0, "method": "computed"},
            "meta": {"name": "synthetic", "gpu": "CPU test", "gpu_memory_gb": 8.0,
                     "provenance": {"kind": "measured", "source": "test"}}}


def test_build_result_gives_a_profile_the_planners_load(tmp_path):
    res = build_result(_measurements())
    p = res.profile
    assert p.forward.a == pytest.approx(5e-6) and p.backward.b == pytest.approx(0.02)
    assert p.all_to_all_latency_ms[2] == pytest.approx(0.4) and p.all_to_all_latency_ms[4] == pytest.approx(0.8)
    assert p.all_to_all_gbps[4] == pytest.approx(1.5) and p.allreduce_gbps[4] == pytest.approx(1.5)
    assert p.p2p_latency_ms[2] == pytest.approx(0.4)
    assert res.heldout["total"]["worst_ape"] < 1e-6 and res.heldout["total"]["count"] == 2
    assert p.provenance["collectives"] == "measured"
    # JSON round trips: the profile file, the result
    path = p.save(tmp_path / "p.json")
    assert load_profile(path) == p
    again = ProfileResult.from_dict(json.loads(res.to_json()))
    assert again.profile == p and again.fits["forward"]["a"] == pytest.approx(5e-6)
    # the planners take it by path, through a Scenario
    from workbench.scenario import Scenario

    sc = Scenario(model="tiny", profile=str(path), num_gpus=4, gpus_per_node=4, gpu_memory_gb=1.0,
                  source="4096,2048,512,512,256,64", planner="greedy")
    plan = sc.plan()
    assert plan.makespan_ms > 0 and plan.num_sequences == 6


def test_sp_overhead_is_the_residual_of_real_micro_steps_by_hand():
    from workbench.profile.result import fit_sp_overhead

    prof = _profile(all_to_all_latency_ms={2: 0.5, 4: 1.0})
    tiny = get_model("tiny")
    cost = CostModel(prof, tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=1e6))

    def pred(d, pack):
        return cost.group_overhead_ms(d) + float(cost.time(pack, d).sum())

    packs = [[1024], [128] * 8]
    packs = [[1024], [128] * 8, [2048], [256] * 8]
    # degree 1 runs 4 ms slower than the curve on the first pack (the curve's own error), on time on the others;
    # degree d pays o_d + r_d * tokens more than predicted (plus 1/d of the curve's error on the first pack)
    groups = [{"degree": 1, "pack": packs[0], "ms": pred(1, packs[0]) + 4.0}]
    groups += [{"degree": 1, "pack": p, "ms": pred(1, p)} for p in packs[1:]]
    for d, o, r in ((2, 6.0, 0.002), (4, 10.0, 0.005)):
        groups += [{"degree": d, "pack": p, "ms": pred(d, p) + o + r * sum(p) + (4.0 / d if p == packs[0] else 0.0)}
                   for p in packs]
    sp, tok, rows = fit_sp_overhead(prof, 4, groups)
    L = tiny.layers
    assert sp[2] == pytest.approx(6.0 / L) and sp[4] == pytest.approx(10.0 / L)
    assert tok[2] == pytest.approx(0.002 / L) and tok[4] == pytest.approx(0.005 / L)
    assert 1 not in sp and len(rows) == 12
    # what is left is the compute curve's own error on the first pack, 4 ms / d
    assert all(row["predicted_with_overhead_ms"] == pytest.approx(
        row["measured_ms"] - (4.0 / row["degree"] if row["pack"] == packs[0] else 0.0)) for row in rows)
    # one token count: a fixed overhead only; a group faster than predicted gives no negative overhead
    one = [{"degree": 1, "pack": packs[1], "ms": pred(1, packs[1])},
           {"degree": 2, "pack": packs[1], "ms": pred(2, packs[1]) + 3.0}]
    assert fit_sp_overhead(prof, 4, one)[:2] == ({2: pytest.approx(1.5)}, {2: 0.0})
    fast = [{"degree": 1, "pack": packs[1], "ms": pred(1, packs[1])},
            {"degree": 2, "pack": packs[1], "ms": pred(2, packs[1]) - 3.0}]
    assert fit_sp_overhead(prof, 4, fast)[0] == {2: 0.0}
    # the cost model adds both to every Ulysses group of that size
    withsp = CostModel(_profile(all_to_all_latency_ms={2: 0.5, 4: 1.0}, sp_overhead_ms=sp, sp_token_ms=tok), tiny,
                       ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=1e6))
    assert withsp.group_overhead_ms(4) - cost.group_overhead_ms(4) == pytest.approx(10.0)
    assert withsp.time([1000], 4)[0] - cost.time([1000], 4)[0] == pytest.approx(5.0)
    assert withsp.group_overhead_ms(1) == cost.group_overhead_ms(1) and withsp.time([1000], 1)[0] == cost.time([1000], 1)[0]


def test_one_process_profile_says_its_collectives_are_an_estimate():
    m = _measurements()
    m["collectives"] = []
    res = build_result(m)
    assert res.profile.provenance["collectives"] == "estimate" and res.profile.all_to_all_latency_ms == {}


# ------------------------------------------------------------------------------------------------
# latency terms of the cost model
# ------------------------------------------------------------------------------------------------


def _profile(**kw) -> HardwareProfile:
    base = dict(name="t", gpu="g", model="tiny", forward={"a": 0.0, "b": 0.01, "c": 1.0},
                backward={"a": 0.0, "b": 0.02, "c": 2.0}, all_to_all_gbps={2: 1e9, 4: 1e9}, gpu_memory_gb=8.0,
                provenance={"kind": "measured"})
    base.update(kw)
    return HardwareProfile(**base)


def test_group_overhead_counts_collective_latency_by_hand():
    tiny = get_model("tiny")  # 2 layers
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0)
    cost = CostModel(_profile(all_to_all_latency_ms={2: 1.0, 4: 3.0}), tiny, cl)
    C = 2 * (1.0 + 2.0)  # c forward + backward, per layer
    assert cost.group_overhead_ms(1) == pytest.approx(C)
    assert cost.group_overhead_ms(2) == pytest.approx(C + 2 * 2 * 2 * 1.0)  # 2 calls x 2 passes x 2 layers
    assert cost.group_overhead_ms(4) == pytest.approx(C + 8 * 3.0)
    rc = CostModel(_profile(all_to_all_latency_ms={2: 1.0, 4: 3.0}), tiny, cl, recompute=True)
    assert rc.group_overhead_ms(4) - rc._fit.C == pytest.approx(2 * 3 * 2 * 3.0)
    # context parallelism: per layer an all-gather of K/V in the forward and a reduce-scatter of
    # their gradients in the backward, at the CP sub-group's latency; a 2 x 2 split pays both kinds
    lat = dict(allgather_latency_ms={2: 0.5, 4: 0.7}, reduce_scatter_latency_ms={2: 0.25, 4: 0.4},
               allgather_gbps={2: 1.0, 4: 1.0}, reduce_scatter_gbps={2: 1.0, 4: 1.0}, all_to_all_latency_ms={2: 1.0})
    cp = CostModel(_profile(**lat), tiny, cl, strategy="cp")
    assert cp.group_overhead_ms(4) - C == pytest.approx(2 * (0.7 + 0.4))  # 2 layers x (all-gather + reduce-scatter)
    auto = CostModel(_profile(**lat), tiny, cl, strategy="auto")
    assert auto.group_overhead_ms(4, 2) - C == pytest.approx(2 * 2 * 2 * 1.0 + 2 * (0.5 + 0.25))
    # no latency figures (every shipped reference profile): the overhead is c alone
    assert CostModel(_profile(), tiny, cl).group_overhead_ms(4) == pytest.approx(C)


def test_grad_sync_adds_the_allreduce_latency():
    tiny = get_model("tiny")
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0, zero_stage=0)  # ZeRO-0: one all-reduce
    cost = CostModel(_profile(allreduce_gbps={4: 1.0}, allreduce_latency_ms={4: 2.5}), tiny, cl)
    by_hand = 2 * 3 / 4 * 4 * tiny.params() / 1e9 * 1e3 + 2.5  # fp32 gradients of the tiny model
    assert cost.grad_sync_ms() == pytest.approx(by_hand)


def test_lockstep_pass_terms_by_hand():
    """ZeRO-3: per pass every FSDP unit is all-gathered twice (forward, backward) in the compute dtype
    and its gradient reduce-scattered in fp32; the first unit's all-gather and reduce-scatter cannot
    overlap, and the profile's fixed pass cost adds to them."""
    tiny = get_model("tiny")  # fp32; units: embedding, 2 blocks, final norm + head
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0)
    prof = _profile(allgather_gbps={4: 2.0}, allgather_latency_ms={4: 0.5}, reduce_scatter_gbps={4: 1.0},
                    pass_overhead_ms={4: 3.0})
    cost = CostModel(prof, tiny, cl)
    h, ffn, v = 64, 172, 256
    block = h * h * 2 + 2 * h * 32 + 3 * h * ffn + 2 * h  # q, o (4 heads x 16); k, v (2 KV heads x 16); MLP; norms
    units = [v * h, block, block, h + v * h]

    def ag(n):
        return 3 / 4 * n * 4 / 2e9 * 1e3 + 0.5

    def rs(n):
        return 3 / 4 * n * 4 / 1e9 * 1e3

    assert cost.execution == "lockstep"
    assert cost.pass_comm_ms() == pytest.approx(sum(2 * ag(u) + rs(u) for u in units))
    assert cost.pass_overhead_ms() == pytest.approx(ag(units[0]) + rs(units[0]) + 3.0)
    assert cost.pass_ms(1.0) == pytest.approx(max(1.0, cost.pass_comm_ms()) + cost.pass_overhead_ms())
    assert cost.grad_sync_ms() == 0.0
    free = CostModel(prof, tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0, zero_stage=2))
    assert free.execution == "free" and free.pass_comm_ms() == 0.0 and free.pass_overhead_ms() == 0.0


@pytest.mark.parametrize("table, match", [({2: -1.0}, "finite number >= 0"), ({"x": 1.0}, "not a group size")])
def test_bad_latency_table_is_rejected(table, match):
    with pytest.raises(ValueError, match=match):
        _profile(all_to_all_latency_ms=table)


# ------------------------------------------------------------------------------------------------
# fidelity against a training run (a fixed fixture, expected figures by hand)
# ------------------------------------------------------------------------------------------------


def _fake_train_run(root):
    from workbench import runs

    run = runs.new_run("train", {"scenario": {"model": "tiny", "num_gpus": 2, "gpus_per_node": 2, "planner": "greedy",
                                              "profile": "cpu-gloo-tiny"}, "nproc": 2}, root=root)

    def plan(groups_per_ms):
        return {"planner": "greedy", "status": "heuristic", "makespan_ms": 50.0, "lower_bound_ms": 1.0,
                "solve_seconds": 0.0, "num_gpus": 2, "grad_sync_ms": 0.0,
                "micro_steps": [{"groups": [{"degree": len(r), "ranks": r, "sequences": list(range(len(ls))),
                                             "lengths": ls, "time_ms": 1.0, "memory_gb": 0.0} for r, ls in ms]}
                                for ms in groups_per_ms]}

    p = plan([[([0], [100, 300]), ([1], [200])], [([0, 1], [400])]])
    for step in (0, 1):
        runs.append_jsonl(run.file(runs.PLANS_FILE), {"step": step, "attempt": 1, "plan": p})
        for rank, step_ms, ms0, ms1 in ((0, 60.0, 33.0, 24.0), (1, 58.0, 18.0, 35.0)):
            runs.append_jsonl(run.file(runs.METRICS_FILE), {
                "step": step, "rank": rank, "attempt": 1, "step_ms": step_ms if step else 999.0,
                "measured_ms": step_ms + 2, "predicted_ms": 50.0, "optimizer_ms": 2.0,
                "micro_steps": [{"micro_step": 0, "degree": 1, "ranks": [rank], "measured_ms": ms0},
                                {"micro_step": 1, "degree": 2, "ranks": [0, 1], "measured_ms": ms1}]})
    return run


def test_check_fidelity_on_a_fixed_run_by_hand(tmp_path):
    run = _fake_train_run(tmp_path)
    prof = _profile(all_to_all_latency_ms={2: 0.5})
    out = check_fidelity(prof, run.path)
    # groups (tiny: 2 layers; per layer fwd+bwd b = 0.03 ms/token, c = 3 ms):
    #   d1 [100, 300]: 2*0.03*400 + 6 = 30; d1 [200]: 2*0.03*200 + 6 = 18;
    #   d2 [400]: 2*0.03*400/2 + 6 + 8 calls x 0.5 ms = 22 (the all-to-all bytes at 1e9 GB/s are ~0)
    # step: rank 0 runs 30 then the d2 group, which starts at max(30, 18): 52 ms (no all-reduce or
    # optimizer figure); measured: the slowest rank's step with its optimizer step, 60 + 2 ms
    assert out["skipped_steps"] == 1 and len(out["steps"]) == 1
    st = out["steps"][0]
    assert st["predicted_ms"] == pytest.approx(52.0) and st["measured_ms"] == 62.0
    assert st["ape"] == pytest.approx(100 * 10 / 62)
    assert st["optimizer_ms"] == 2.0 and st["predicted_optimizer_ms"] == 0.0
    g = sorted(out["groups"], key=lambda r: (r["micro_step"], r["ranks"][0]))
    assert [round(r["predicted_ms"], 6) for r in g] == [30.0, 18.0, 22.0]
    assert [r["measured_ms"] for r in g] == [33.0, 18.0, 24.0]  # the d2 group: the shorter of 24 and 35
    assert out["group_error"]["median_ape"] == pytest.approx(100 * 2 / 24)
    assert out["group_error"]["worst_ape"] == pytest.approx(100 * 3 / 33)
    assert out["by_degree"][2]["median_ratio"] == pytest.approx(24 / 22)
    from workbench.report.profile import fidelity_figure

    fig = fidelity_figure(out)
    xs = sorted(x for tr in fig.data if tr.name and tr.name.startswith("degree") for x in tr.x)
    assert xs == pytest.approx(sorted([30.0, 18.0, 22.0]))


def test_check_fidelity_rejects_a_run_without_steps(tmp_path):
    from workbench import runs

    run = runs.new_run("train", {"scenario": {"model": "tiny", "num_gpus": 2}}, root=tmp_path)
    with pytest.raises(ValueError, match="no step with both a plan and measurements"):
        check_fidelity(_profile(), run.path)
    other = runs.new_run("profile", {"model": "tiny"}, root=tmp_path)
    with pytest.raises(ValueError, match="not a training run"):
        check_fidelity(_profile(), other.path)


# ------------------------------------------------------------------------------------------------
# bad environments and input: one clear line
# ------------------------------------------------------------------------------------------------


def test_more_processes_than_cores_or_gpus_is_refused(tmp_path):
    from workbench.profile import check_machine

    with pytest.raises(ValueError, match=r"4 processes on 2 CPU core\(s\).*--oversubscribe"):
        check_machine(ProfileSpec(nproc=4, device="cpu"), cores=2, gpus=0)
    assert check_machine(ProfileSpec(nproc=4, device="cpu", oversubscribe=True), cores=2, gpus=0) == "cpu"
    with pytest.raises(ValueError, match=r"2 processes but this machine has 1 GPU\(s\)"):
        check_machine(ProfileSpec(nproc=2, device="cuda"), gpus=1)
    with pytest.raises(ValueError, match="shows no NVIDIA GPU"):
        check_machine(ProfileSpec(nproc=1, device="cuda"), gpus=0)
    with pytest.raises(ValueError, match="flash needs CUDA"):
        check_machine(ProfileSpec(nproc=1, device="cpu", attention="flash"), gpus=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(nproc=4, group_sizes=(5,)), "group size 5 cannot be formed from 4"),
    (dict(nproc=2, group_sizes=(4,)), "group size 4 cannot be formed from 2"),
    (dict(model="gpt5"), "unknown model 'gpt5'"),
    (dict(max_len=100_000), "exceeds model tiny's context"),
    (dict(fit_packs=((64,), (128,))), "at least 3 packs"),
    (dict(fit_packs=((64,), (0,), (128,))), "not a pack of positive sequence lengths"),
    (dict(nproc=0), "nproc must be a positive integer"),
])
def test_bad_profile_settings_are_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProfileSpec(**kwargs)


def test_prepare_profile_creates_a_profile_run(tmp_path):
    run = prepare_profile(nproc=1, model="tiny", quick=True, root=tmp_path, name="p1", device="cpu",
                          out=str(tmp_path / "prof.json"))
    spec = run.spec()
    assert spec["kind"] == "profile" and spec["resolved"]["device"] == "cpu"
    assert spec["resolved"]["fit_packs"] and not {tuple(p) for p in spec["resolved"]["fit_packs"]} & {
        tuple(p) for p in spec["resolved"]["heldout_packs"]}
    assert run.status().state == "created"
    with pytest.raises(ValueError, match="is a folder"):
        prepare_profile(nproc=1, root=tmp_path, device="cpu", out=str(tmp_path))


def test_cli_bad_environment_is_one_line(tmp_path):
    n = (os.cpu_count() or 1) + 1
    for args, needle in ((["profile", "--nproc", str(n), "--device", "cpu"], f"{n} processes on"),
                         (["profile", "--nproc", "2", "--device", "cpu", "--group-sizes", "3", "--oversubscribe"],
                          "group size 3 cannot be formed"),
                         (["profile", "--model", "gpt5", "--device", "cpu", "--nproc", "1"], "unknown model 'gpt5'")):
        p = run_cli(*args, "--run-root", str(tmp_path), check=False)
        assert p.returncode == 2, p.stderr
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("workbench")]
        assert len(lines) == 1 and needle in lines[0], p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    (json.dumps({"name": "x", "gpu": "g", "model": "tiny", "backward": {"a": 0, "b": 1}, "all_to_all_gbps": {"2": 1},
                 "provenance": {"kind": "measured"}}), "missing field 'forward'"),
])
def test_profile_file_that_does_not_parse_or_lacks_a_field(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle):
        load_profile(path)
    p = run_cli("plan", "--lengths", "1000,2000", "--gpus", "2", "--model", "tiny", "--profile", str(path), check=False)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr


def test_profile_package_imports_without_torch():
    import subprocess

    code = ("import sys, workbench.profile, workbench.profile.fidelity, workbench.report.profile; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_step_extras_by_hand():
    """What a step costs beyond its layers: the embedding, head and loss per token (split over a
    group's ranks like the rest of its tokens), a fixed cost per micro-step (in the packed call's
    constant), and the optimizer step after the last micro-step, per million parameters the most
    loaded rank updates."""
    from workbench.cost.memory import parameter_shapes, zero_partition
    from workbench.solve import build_plan, lower_bound_ms

    tiny = get_model("tiny")
    prof = _profile(head_ms_per_token=0.01, micro_step_ms=5.0, optimizer_ms_per_mparam=2.0, allreduce_gbps={4: 1.0})
    base = CostModel(_profile(allreduce_gbps={4: 1.0}), tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0))
    cost = CostModel(prof, tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0))
    s = np.array([600, 300])
    assert cost.time(s, 2) == pytest.approx(base.time(s, 2) + 0.01 * s / 2)
    assert cost.group_overhead_ms(2) == pytest.approx(base.group_overhead_ms(2) + 5.0)
    assert cost.call_overhead_ms() == pytest.approx(base.call_overhead_ms() + 5.0)
    numels = [int(np.prod(x)) for _, x in parameter_shapes(tiny)]
    shard = sum(-(-x[0] // 4) * int(np.prod(x[1:])) for _, x in parameter_shapes(tiny))  # FSDP: ceil(rows/4) rows
    assert cost.optimizer_ms() == pytest.approx(2.0 * shard / 1e6)  # ZeRO-3
    for stage, updated in ((0, sum(numels)), (2, max(zero_partition(numels, 4)))):
        c = CostModel(prof, tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0, zero_stage=stage))
        assert c.optimizer_ms() == pytest.approx(2.0 * updated / 1e6)
        p = build_plan("hand", [[(2, [0]), (2, [1])]], s, c)
        assert p.optimizer_ms == pytest.approx(c.optimizer_ms())
        assert p.makespan_ms == pytest.approx(max(g.time_ms for g in p.micro_steps[0].groups) + c.grad_sync_ms()
                                              + c.optimizer_ms())
        assert lower_bound_ms(s, c) <= p.makespan_ms
    # with recomputation the blocks' forward runs twice (b 0.01 per layer, 2 layers); the head and
    # loss once (the chunked loss makes its gradients in the forward: the same matmuls, none twice)
    rc, rc_base = (CostModel(p, tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0), recompute=True)
                   for p in (prof, _profile(allreduce_gbps={4: 1.0})))
    assert rc_base.time(s, 2) == pytest.approx(base.time(s, 2) + 2 * 0.01 * s / 2)
    assert rc.time(s, 2) == pytest.approx(rc_base.time(s, 2) + 0.01 * s / 2)
    unmeasured = CostModel(_profile(), tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0))
    assert unmeasured.optimizer_ms() == 0.0
    with pytest.raises(ValueError, match="micro_step_ms must be a finite number >= 0"):
        _profile(micro_step_ms=-1.0)


def test_measured_cp_extras_enter_the_split_by_hand():
    tiny = get_model("tiny")  # 2 layers, 4 heads, 2 KV heads of 16
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0)
    base = dict(allgather_gbps={2: 1.0, 4: 1.0}, reduce_scatter_gbps={2: 1.0, 4: 1.0})
    plain = CostModel(_profile(**base), tiny, cl, strategy="auto")
    cp = CostModel(_profile(cp_overhead_ms={2: 0.5, 4: 0.75}, cp_token_ms={2: 1e-4, 4: 2e-4}, **base), tiny, cl,
                   strategy="auto")
    s = np.array([1000.0, 3000.0])
    # 1 x 4: 2 layers x 0.75 ms once per group, 2 layers x 2e-4 ms per token of each sequence
    assert cp.group_overhead_ms(4, 4) - plain.group_overhead_ms(4, 4) == pytest.approx(2 * 0.75)
    assert cp.time(s, 4, 4) - plain.time(s, 4, 4) == pytest.approx(2 * 2e-4 * s)
    # 2 x 2: a rank holds the K/V of one of the 2 KV heads, so half the per-token extra
    assert cp.time(s, 4, 2) - plain.time(s, 4, 2) == pytest.approx(2 * 1e-4 * s / 2)
    assert cp.group_overhead_ms(4, 2) - plain.group_overhead_ms(4, 2) == pytest.approx(2 * 0.5)
    # Ulysses alone pays none of it
    assert cp.time(s, 4, 1) == pytest.approx(plain.time(s, 4, 1))


# ------------------------------------------------------------------------------------------------
# context parallelism: its collectives on the CP sub-groups, its extras from real micro-steps
# ------------------------------------------------------------------------------------------------


def test_cp_grid_measures_every_cp_size_and_the_splits_the_heads_allow():
    from workbench.profile import cp_grid, cp_packs

    assert cp_grid([2], [2]) == ([2], [[2, 2]])
    # 4 ranks: 1 x 2, 1 x 4, and 2 x 2 of the 4-rank group when Ulysses over 2 splits the heads
    assert cp_grid([2, 4], [2, 4]) == ([2, 4], [[2, 2], [4, 4], [4, 2]])
    assert cp_grid([2, 4], [4]) == ([2, 4], [[2, 2], [4, 4]])
    assert cp_grid([2, 4, 8], [2, 4, 8]) == ([2, 4, 8], [[2, 2], [4, 4], [8, 8], [8, 2], [8, 4]])
    assert cp_grid([], []) == ([], [])
    # the tiny model (4 query heads, 2 KV heads) on 4 ranks: CP collectives at every group size (3 on its
    # block of 3 ranks, tests/test_profile_sizes.py), micro-steps at 2 and 4; switched off with cp=False
    res = ProfileSpec(model="tiny", nproc=4).resolved("cpu")
    assert res["cp_sizes"] == [2, 3, 4] and res["cp_splits"] == [[2, 2], [4, 4], [4, 2]]
    # 1 x c micro-steps also run the longest length the curves are fitted to (CP's extra grows with it)
    assert res["cp_packs"] == res["group_packs"] + [[4096]] and max(max(p) for p in res["fit_packs"]) == 4096
    assert cp_packs([[256], [4096]], [[64], [4096]]) == [[256], [4096]]
    assert ProfileSpec(model="tiny", nproc=4, cp=False).resolved("cpu")["cp_sizes"] == []
    with pytest.raises(ValueError, match="profile cp must be true or false"):
        ProfileSpec(model="tiny", nproc=2, cp="yes")


def test_a_profile_times_the_dtype_runs_on_its_device_compute_in():
    """Training defaults to bf16 on CUDA and fp32 on CPU; a profile with no dtype follows (an fp32
    profile of a GPU would predict fp32 matmuls for bf16 runs); one asked for keeps its own."""
    from workbench.profile import ProfileSpec

    assert ProfileSpec(model="tiny", nproc=1).resolved("cuda")["dtype"] == "bfloat16"
    assert ProfileSpec(model="tiny", nproc=1).resolved("cpu")["dtype"] == "float32"
    assert ProfileSpec(model="tiny", nproc=1, dtype="float32").resolved("cuda")["dtype"] == "float32"
    with pytest.raises(ValueError, match="dtype"):
        ProfileSpec(model="tiny", nproc=1, dtype="int8")


def test_cp_collectives_fill_the_sizes_fsdp_does_not_measure():
    tiny = get_model("tiny")  # 2 layers; K and V of one token: 2 KV heads x 16 x 4 bytes x 2 = 256 bytes
    m = _measurements()
    # FSDP over the world (4 ranks), CP on its strided sub-groups of 2 and of 4: known latency and bandwidth each
    known = {("allgather", 4): (0.3, 2.0), ("reduce_scatter", 4): (0.35, 1.0),
             ("cp_allgather", 2): (0.1, 3.0), ("cp_allgather", 4): (0.2, 1.2),
             ("cp_reduce_scatter", 2): (0.15, 2.5), ("cp_reduce_scatter", 4): (0.25, 0.8)}
    for (kind, d), (lat, gbps) in known.items():
        for mb in (8192, 131072, 1 << 20):
            m["collectives"].append({"kind": kind, "group_size": d, "message_bytes": mb,
                                     "ms": lat + mb * (d - 1) / d / (gbps * 1e9) * 1e3})
    res = build_result(m)
    p = res.profile
    # size 2: context parallelism's own figures; the world size stays FSDP's (CP's kept as evidence)
    assert p.allgather_gbps == pytest.approx({2: 3.0, 4: 2.0}) and p.reduce_scatter_gbps == pytest.approx({2: 2.5, 4: 1.0})
    assert p.allgather_latency_ms == pytest.approx({2: 0.1, 4: 0.3})
    assert p.reduce_scatter_latency_ms == pytest.approx({2: 0.15, 4: 0.35})
    assert res.collective_fits["cp_allgather"][4]["gbps"] == pytest.approx(1.2)
    assert res.collective_fits["cp_reduce_scatter"][4]["latency_ms"] == pytest.approx(0.25)
    assert "strided CP sub-groups" in p.provenance["cp_collectives"]
    # what the cost model makes of it: a 1 x 2 group's K/V all-gather (forward) and reduce-scatter
    # (backward) per layer, each moving (c-1)/c of the sequence's K/V, plus their latencies
    cost = CostModel(p, tiny, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0), strategy="auto")
    s = 3000.0
    moved = s * 256 * 1 / 2
    assert cost.cp_link_gbps("allgather", 2, 2) == pytest.approx(3.0)
    assert cost.cp_comm_ms([s], 2, 2)[0] == pytest.approx(2 * (moved / 3.0e9 + moved / 2.5e9) * 1e3)
    assert cost.collective_latency_ms(2, 2) == pytest.approx(2 * (0.1 + 0.15))
    # FSDP over all 4 ranks keeps its own figure
    assert cost._bus("allgather", 1e6, 4) == pytest.approx(0.75 * 1e6 / 2.0e9 * 1e3 + 0.3)


def test_cp_extras_are_the_residual_of_real_cp_micro_steps_by_hand():
    from workbench.profile.result import fit_cp_overhead, fit_sp_overhead

    tiny = get_model("tiny")  # 2 layers, 4 heads, 2 KV heads
    L = tiny.layers
    prof = _profile(allgather_gbps={2: 1.0, 4: 0.8}, reduce_scatter_gbps={2: 0.9, 4: 0.7},
                    allgather_latency_ms={2: 0.1, 4: 0.2}, reduce_scatter_latency_ms={2: 0.15, 4: 0.25},
                    all_to_all_latency_ms={2: 0.5, 4: 1.0}, sp_overhead_ms={2: 1.5}, sp_token_ms={2: 1e-4})
    cost = _tiny_auto(prof)

    def pred(d, c, pack):
        return cost.group_overhead_ms(d, c) + float(cost.time(pack, d, c).sum())

    packs = [[1024], [128] * 8, [2048], [256] * 8]
    # degree 1 runs 4 ms slower than the curve on the first pack (the curve's own error), on time on the others
    groups = [{"degree": 1, "cp": 1, "pack": packs[0], "ms": pred(1, 1, packs[0]) + 4.0}]
    groups += [{"degree": 1, "cp": 1, "pack": p, "ms": pred(1, 1, p)} for p in packs[1:]]
    # 1 x c pays o_c + r_c * tokens more than predicted (plus 1/c of the curve's error on the first pack)
    for c, o, r in ((2, 8.0, 0.003), (4, 12.0, 0.006)):
        groups += [{"degree": c, "cp": c, "pack": p,
                    "ms": pred(c, c, p) + o + r * sum(p) + (4.0 / c if p == packs[0] else 0.0)} for p in packs]
    # 2 x 2: not fitted, re-timed as evidence; Ulysses groups of 2, which the CP fit leaves to fit_sp_overhead
    groups += [{"degree": 4, "cp": 2, "pack": p, "ms": pred(4, 2, p) + 2.0} for p in packs]
    groups += [{"degree": 2, "cp": 1, "pack": p, "ms": pred(2, 1, p) + 3.0 + (2.0 if p == packs[0] else 0.0)}
               for p in packs]
    cpo, cpt, rows, cpq = fit_cp_overhead(prof, 4, groups)
    assert cpo == pytest.approx({2: 8.0 / L, 4: 12.0 / L}) and cpt == pytest.approx({2: 0.003 / L, 4: 0.006 / L})
    assert cpq == {2: 0.0, 4: 0.0}  # the profile's curves have no attention term (a = 0)
    assert len(rows) == 12 and {r["split"] for r in rows} == {"1x2", "1x4", "2x2"}
    for row in rows:
        if row["split"] == "2x2":
            # a 2 x 2 rank holds the K/V of one of the 2 KV heads: half the per-token extra of 1 x 2
            extra = L * cpo[2] + L * cpt[2] * row["tokens"] * 0.5
            assert row["predicted_with_overhead_ms"] - row["predicted_ms"] == pytest.approx(extra)
            assert row["measured_ms"] - row["predicted_ms"] == pytest.approx(2.0)
        else:  # what is left is the compute curve's own error on the first pack, 4 ms / c
            assert row["predicted_with_overhead_ms"] == pytest.approx(
                row["measured_ms"] - (4.0 / row["cp"] if row["pack"] == packs[0] else 0.0))
    # the Ulysses fit sees its own groups only: the profile's extras of degree 2 (which they were predicted with)
    # plus 3 ms (and 2 ms / 2, the curve's error, on the first pack)
    sp, tok, sp_rows = fit_sp_overhead(dataclasses.replace(prof, sp_overhead_ms={}, sp_token_ms={}), 4, groups)
    assert sp == pytest.approx({2: 1.5 + 3.0 / L}) and tok == pytest.approx({2: 1e-4}) and len(sp_rows) == 8
    # one token count: a fixed extra only; a split faster than predicted gives no negative extra
    one = [{"degree": 1, "cp": 1, "pack": packs[1], "ms": pred(1, 1, packs[1])},
           {"degree": 2, "cp": 2, "pack": packs[1], "ms": pred(2, 2, packs[1]) + 3.0}]
    assert fit_cp_overhead(prof, 4, one)[:2] == ({2: pytest.approx(1.5)}, {2: 0.0})
    fast = [{"degree": 2, "cp": 2, "pack": packs[1], "ms": pred(2, 2, packs[1]) - 3.0}]
    assert fit_cp_overhead(prof, 4, fast)[0] == {2: 0.0}
    assert fit_cp_overhead(prof, 4, groups[:4]) == ({}, {}, [], {})  # no CP micro-steps: nothing fitted


CP_PACKS = [[1024], [2048], [128] * 8, [256] * 8, [4096]]
"""What a quick profile on 2 ranks runs as 1 x 2 micro-steps (the SP packs and the longest length)."""


def _cp_attention_case(known, noise=0.0, seed=0):
    """A tiny-model profile with an attention term, and real-looking micro-steps: degree 1 on time
    with the curves, ``1 x c`` paying ``layers * (o + r * tokens) + q * attention / c`` beyond them
    (``known``: {c: (o, r, q)}, o and r per layer; 1 + noise relative noise per step), 2 x 2 on time."""
    from workbench.profile.fit import trimmed_median

    prof = _profile(forward={"a": 2.7e-6, "b": 0.004, "c": 0.5}, backward={"a": 5.3e-6, "b": 0.008, "c": 1.0},
                    allgather_gbps={2: 1.0, 4: 0.8}, reduce_scatter_gbps={2: 0.5, 4: 0.4},
                    allgather_latency_ms={2: 0.1, 4: 0.2}, reduce_scatter_latency_ms={2: 0.15, 4: 0.25})
    cost = _tiny_auto(prof)
    L = 2
    A = L * (2.7e-6 + 5.3e-6)  # the whole model's a, forward and backward: ms per token pair
    rng = np.random.default_rng(seed)

    def ms(d, c, pack, extra=0.0):
        t = cost.group_overhead_ms(d, c) + float(cost.time(pack, d, c).sum()) + extra
        return trimmed_median(t * (1 + noise * rng.standard_normal(5))) if noise else t

    groups = [{"degree": 1, "cp": 1, "pack": p, "ms": ms(1, 1, p)} for p in CP_PACKS]
    for c, (o, r, q) in known.items():
        groups += [{"degree": c, "cp": c, "pack": p,
                    "ms": ms(c, c, p, L * (o + r * sum(p)) + q * A * sum(s * s for s in p) / c)} for p in CP_PACKS]
    groups += [{"degree": 4, "cp": 2, "pack": p, "ms": ms(4, 2, p)} for p in CP_PACKS]
    return prof, groups, A


def test_cp_attention_factor_is_recovered_from_synthetic_micro_steps():
    from workbench.profile.result import fit_cp_overhead

    known = {2: (0.5, 1e-3, 0.35), 4: (1.0, 2e-3, 0.2)}
    prof, groups, A = _cp_attention_case(known)
    cpo, cpt, rows, cpq = fit_cp_overhead(prof, 4, groups)
    for c, (o, r, q) in known.items():
        assert cpo[c] == pytest.approx(o, rel=1e-6) and cpt[c] == pytest.approx(r, rel=1e-6)
        assert cpq[c] == pytest.approx(q, rel=1e-6)
    for row in rows:
        if row["split"] == "2x2":
            # the same fraction of a 2 x 2 rank's own quarter of the attention, half the per-token extra (one of
            # the 2 KV heads), the fixed extra at c = 2
            attn = A * sum(s * s for s in row["pack"]) / 4
            extra = 2 * cpo[2] + 2 * cpt[2] * row["tokens"] * 0.5 + cpq[2] * attn
            assert row["predicted_with_overhead_ms"] - row["predicted_ms"] == pytest.approx(extra)
        else:  # 1 x c: the fitted extras are the synthetic ones
            assert row["predicted_with_overhead_ms"] == pytest.approx(row["measured_ms"], rel=1e-9)
    # the per-token fit of the same steps (what profiles held before the factor): the line through the
    # convex residual over-prices the short packs and under-prices the longest
    lo, lt, lrows, lq = fit_cp_overhead(prof, 4, groups, attention=False)
    assert lq == {2: 0.0, 4: 0.0}
    one = {tuple(r["pack"]): r for r in lrows if r["split"] == "1x2"}
    assert one[(128,) * 8]["predicted_with_overhead_ms"] > one[(128,) * 8]["measured_ms"]
    assert one[(4096,)]["predicted_with_overhead_ms"] < one[(4096,)]["measured_ms"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cp_attention_factor_under_noise(seed):
    # 1% noise per sample on the whole micro-step (the extras are a fraction of it), trimmed median of 5
    from workbench.profile.result import fit_cp_overhead

    known = {2: (0.0, 2e-3, 0.35)}
    prof, groups, _ = _cp_attention_case(known, noise=0.01, seed=seed)
    cpo, cpt, rows, cpq = fit_cp_overhead(prof, 4, groups)
    assert cpq[2] == pytest.approx(0.35, abs=0.05) and cpt[2] == pytest.approx(2e-3, rel=0.15)
    worst = max(abs(r["predicted_with_overhead_ms"] / r["measured_ms"] - 1) for r in rows if r["split"] == "1x2")
    assert worst < 0.03


def test_build_result_fits_the_cp_extras_into_the_profile():
    m = _measurements()
    prof0 = build_result(m).profile
    cost = _tiny_auto(prof0)
    packs = [[512], [1024], [64] * 8]
    m["groups"] = [{"degree": 1, "cp": 1, "pack": p, "ms": cost.group_overhead_ms(1) + float(cost.time(p, 1).sum())}
                   for p in packs]
    # 0.3 of each rank's causal share of the attention more (the 2 layers' a * s^2 over the pack, over c = 2)
    a = prof0.forward.a + prof0.backward.a
    assert a > 0 and prof0.forward.short_len is None
    m["groups"] += [{"degree": 2, "cp": 2, "pack": p,
                     "ms": cost.group_overhead_ms(2, 2) + float(cost.time(p, 2, 2).sum()) + 5.0 + 0.004 * sum(p)
                     + 0.3 * 2 * a * sum(s * s for s in p) / 2}
                    for p in packs]
    res = build_result(m)
    assert res.profile.cp_overhead_ms == pytest.approx({2: 2.5}) and res.profile.cp_token_ms == pytest.approx({2: 0.002})
    assert res.profile.cp_attention_factor == pytest.approx({2: 0.3})
    assert "1 x c context-parallel micro-steps" in res.profile.provenance["cp_overhead"]
    assert "cp_attention_factor" in res.profile.provenance["cp_overhead"]
    assert [g["cp"] for g in res.groups] == [1, 1, 1, 2, 2, 2]
    assert ProfileResult.from_dict(json.loads(res.to_json())).profile == res.profile


# ------------------------------------------------------------------------------------------------
# composite splits (u > 1 and c > 1): their residual beyond the sum of their parts
# ------------------------------------------------------------------------------------------------


def _split_case(known, world=4, noise=0.0, seed=0, packs=CP_PACKS):
    """A tiny-model profile holding every part (an attention term, the Ulysses and CP collectives with
    their latencies, the Ulysses extras at u, the CP extras and attention factor at c), and real-looking
    micro-steps: degree 1 on time with the curves but 4 ms slow on the first pack (the curve's own
    error), each composite split ``"uxc"`` of ``known`` paying ``layers * (o + r * tokens)`` beyond the
    sum of its parts (o, r per layer) plus its share of that curve error (4 ms / degree); 1 + noise
    relative noise per sample, trimmed median of 5."""
    from workbench.profile.fit import trimmed_median

    prof = _profile(forward={"a": 2.7e-6, "b": 0.004, "c": 0.5}, backward={"a": 5.3e-6, "b": 0.008, "c": 1.0},
                    all_to_all_gbps={2: 1.0, 4: 0.8}, all_to_all_latency_ms={2: 0.2, 4: 0.3},
                    allgather_gbps={2: 1.0, 4: 0.8}, reduce_scatter_gbps={2: 0.5, 4: 0.4},
                    allgather_latency_ms={2: 0.1, 4: 0.2}, reduce_scatter_latency_ms={2: 0.15, 4: 0.25},
                    sp_overhead_ms={2: 1.5, 4: 2.0}, sp_token_ms={2: 1e-3, 4: 5e-4},
                    cp_overhead_ms={2: 0.8, 4: 1.0}, cp_token_ms={2: 2e-3, 4: 1e-3}, cp_attention_factor={2: 0.3, 4: 0.2})
    cost = _tiny_auto(prof, world)
    L = 2
    rng = np.random.default_rng(seed)

    def ms(d, c, pack, extra=0.0):
        t = cost.group_overhead_ms(d, c) + float(cost.time(pack, d, c).sum()) + extra
        return trimmed_median(t * (1 + noise * rng.standard_normal(5))) if noise else t

    groups = [{"degree": 1, "cp": 1, "pack": p, "ms": ms(1, 1, p, 4.0 if p == packs[0] else 0.0)} for p in packs]
    # the parts themselves, measured on time: the residual fit leaves them to fit_sp_overhead / fit_cp_overhead
    groups += [{"degree": 2, "cp": c, "pack": p, "ms": ms(2, c, p)} for c in (1, 2) for p in packs]
    for key, (o, r) in known.items():
        u, c = (int(x) for x in key.split("x"))
        d = u * c
        groups += [{"degree": d, "cp": c, "pack": p,
                    "ms": ms(d, c, p, L * (o + r * sum(p)) + (4.0 / d if p == packs[0] else 0.0))} for p in packs]
    return prof, groups, cost


def test_split_residual_is_recovered_from_synthetic_micro_steps():
    from workbench.profile.result import fit_split_overhead

    # 8 ranks: three composite splits, each its own residual (a fixed one only, a per-token one only, both)
    known = {"2x2": (0.5, 1e-3), "4x2": (2.0, 0.0), "2x4": (0.0, 3e-3)}
    prof, groups, cost = _split_case(known, world=8)
    fixed, per_token, rows = fit_split_overhead(prof, 8, groups)
    assert list(fixed) == ["2x2", "4x2", "2x4"] and list(per_token) == list(fixed)  # in increasing c, then u
    for key, (o, r) in known.items():
        assert fixed[key] == pytest.approx(o, abs=1e-9) and per_token[key] == pytest.approx(r, abs=1e-12)
    assert len(rows) == 3 * len(CP_PACKS) and {r["split"] for r in rows} == set(known)
    bare = _tiny_auto(dataclasses.replace(prof, sp_overhead_ms={}, sp_token_ms={}, cp_overhead_ms={}, cp_token_ms={},
                                          cp_attention_factor={}), 8)
    for row in rows:
        d, c, pack = row["degree"], row["cp"], row["pack"]
        o, r = known[row["split"]]
        assert row["predicted_parts_ms"] == pytest.approx(cost.group_overhead_ms(d, c) + float(cost.time(pack, d, c).sum()))
        assert row["predicted_ms"] == pytest.approx(bare.group_overhead_ms(d, c) + float(bare.time(pack, d, c).sum()))
        assert row["predicted_ms"] < row["predicted_parts_ms"]
        # with the fitted residual the prediction is the measurement, less the curve's own error on the first pack
        assert row["predicted_with_overhead_ms"] - row["predicted_parts_ms"] == pytest.approx(2 * (o + r * row["tokens"]))
        assert row["predicted_with_overhead_ms"] == pytest.approx(
            row["measured_ms"] - (4.0 / d if pack == CP_PACKS[0] else 0.0), rel=1e-9)
    # the profile with the fit: the cost model prices exactly those splits with it
    fitted = _tiny_auto(dataclasses.replace(prof, split_overhead_ms=fixed, split_token_ms=per_token), 8)
    assert fitted.group_overhead_ms(8, 2) - cost.group_overhead_ms(8, 2) == pytest.approx(2 * 2.0)
    assert fitted.group_overhead_ms(8, 8) == cost.group_overhead_ms(8, 8)


def test_split_residual_falls_back_with_few_packs():
    from workbench.profile.result import fit_split_overhead

    # packs of one token count (1,024 each): the fixed part alone, the median residual
    one = [[1024], [128] * 8]
    prof, groups, _ = _split_case({"2x2": (0.0, 2e-3)}, packs=one)
    fixed, per_token, rows = fit_split_overhead(prof, 4, groups)
    # residuals: 2 x 2e-3 x 1,024 on both, plus 4 ms / 4 of curve error on the first, which the fit takes out
    assert fixed == {"2x2": pytest.approx(2e-3 * 1024)} and per_token == {"2x2": 0.0} and len(rows) == 2
    # one pack
    prof, groups, _ = _split_case({"2x2": (1.25, 0.0)}, packs=[[2048]])
    assert fit_split_overhead(prof, 4, groups)[:2] == ({"2x2": pytest.approx(1.25)}, {"2x2": 0.0})
    # a composite split faster than the sum of its parts gives no negative residual
    prof, groups, _ = _split_case({"2x2": (0.0, 0.0)})
    fast = [dict(g, ms=g["ms"] - 30.0) if (g["degree"], g["cp"]) == (4, 2) else g for g in groups]
    fixed, per_token, _ = fit_split_overhead(prof, 4, fast)
    assert fixed == {"2x2": 0.0} and per_token == {"2x2": 0.0}
    # nothing composite measured (2 ranks, or CP switched off): nothing fitted
    assert fit_split_overhead(prof, 4, [g for g in groups if (g["degree"], g["cp"]) != (4, 2)]) == ({}, {}, [])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_residual_under_noise(seed):
    # 1% noise per sample on the whole micro-step (the residual is a tenth to a fifth of it), trimmed median of 5
    from workbench.profile.result import fit_split_overhead

    prof, groups, _ = _split_case({"2x2": (1.0, 2e-3)}, noise=0.01, seed=seed)
    fixed, per_token, rows = fit_split_overhead(prof, 4, groups)
    assert per_token["2x2"] == pytest.approx(2e-3, rel=0.25) and fixed["2x2"] == pytest.approx(1.0, abs=1.5)
    # against the measurement less the curve's own error on the first pack (1 ms), which no split term holds
    worst = max(abs(r["predicted_with_overhead_ms"] / (r["measured_ms"] - (1.0 if r["pack"] == CP_PACKS[0] else 0.0)) - 1)
                for r in rows)
    assert worst < 0.02


def test_build_result_fits_the_split_residual_into_the_profile():
    m = _measurements()
    prof0 = build_result(m).profile
    cost = _tiny_auto(prof0)

    def pred(d, c, p):
        return cost.group_overhead_ms(d, c) + float(cost.time(p, d, c).sum())
    m["groups"] = [{"degree": 1, "cp": 1, "pack": p, "ms": pred(1, 1, p)} for p in CP_PACKS]
    # 2 x 2 pays 2 layers x (1.5 ms + 2.5e-3 ms per token) beyond its parts
    m["groups"] += [{"degree": 4, "cp": 2, "pack": p, "ms": pred(4, 2, p) + 2 * (1.5 + 2.5e-3 * sum(p))} for p in CP_PACKS]
    res = build_result(m)
    assert res.profile.split_overhead_ms == pytest.approx({"2x2": 1.5})
    assert res.profile.split_token_ms == pytest.approx({"2x2": 2.5e-3})
    assert "beyond the sum of their parts" in res.profile.provenance["split_overhead"]
    assert res.profile.provenance["profiler_version"] >= 3
    rows = [g for g in res.groups if g.get("split") == "2x2"]
    assert len(rows) == len(CP_PACKS)  # once each: fit_split_overhead's rows, not fit_cp_overhead's as well
    assert all(r["predicted_with_overhead_ms"] == pytest.approx(r["measured_ms"]) for r in rows)
    assert all(r["predicted_parts_ms"] < r["measured_ms"] for r in rows)
    back = ProfileResult.from_dict(json.loads(res.to_json()))
    assert back.profile == res.profile and back.groups == res.groups
    assert HardwareProfile.from_dict(json.loads(res.profile.to_json())).split_token_ms == res.profile.split_token_ms
    # without composite micro-steps the profile has none (2 ranks; profiles measured before them)
    m["groups"] = m["groups"][:len(CP_PACKS)]
    assert build_result(m).profile.split_overhead_ms == {} and "split_overhead" not in build_result(m).profile.provenance


def test_without_real_steps_the_optimizer_is_timed_alone():
    """A profile whose real steps are skipped (a model over 200M parameters, or steps off) times the
    optimizer's step alone on fp32 tensors of the model's shapes, blocks first, up to a cap, and the
    profile predicts that step per parameter (none before: a 1B's AdamW step, 31 ms of a 16K-token
    step on an H200, was missing from every prediction)."""
    import math

    import torch

    from workbench.cost.memory import parameter_shapes
    from workbench.profile.measure import measure_optimizer

    tiny = get_model("tiny")
    blocks = [s for n, s in parameter_shapes(tiny) if not n.startswith(("embed.", "head."))]
    cap = sum(math.prod(s) for s in blocks[:3])  # exactly the first three of the blocks' tensors
    got = measure_optimizer(tiny, optimizer="adamw", device=torch.device("cpu"), max_params=cap, reps=3)
    assert got["params"] == cap and got["ms"] > 0
    assert got["ms_per_mparam"] == pytest.approx(got["ms"] / cap * 1e6)
    whole = measure_optimizer(tiny, optimizer="sgd", device=torch.device("cpu"), max_params=1e12, reps=1)
    assert whole["params"] == sum(math.prod(s) for _, s in parameter_shapes(tiny))
    # the profile takes it where no real step says otherwise
    m = _measurements()
    m["optimizer"] = {"optimizer": "adamw", "params": 2_000_000, "ms": 3.0, "ms_per_mparam": 1.5, "reps": 5}
    prof = build_result(m).profile
    assert prof.optimizer_ms_per_mparam == 1.5 and prof.sharded_optimizer_ms_per_mparam is None
    assert "timed alone" in prof.provenance["optimizer"]
    assert build_result(_measurements()).profile.optimizer_ms_per_mparam is None


# ------------------------------------------------------------------------------------------------
# the host: memory and the pinned host-device link
# ------------------------------------------------------------------------------------------------


def _link(alone=(9.0, 11.0), every=((12.0, 16.0), (13.0, 15.0), (20.0, 14.0), (12.5, 15.5)), nbytes=1 << 28):
    """Copy times (ms) of ``nbytes`` each: rank 0 alone (h2d, d2h), then each rank's with all copying;
    every timed copy of a direction the same but for two outliers the median ignores."""
    reps = 5

    def times(ms):
        return [ms, ms, ms * 3, ms, ms * 0.5][:reps]

    return {"bytes": nbytes, "warmup": 2, "reps": reps, "ranks_per_node": len(every),
            "alone": {"h2d_ms": times(alone[0]), "d2h_ms": times(alone[1])},
            "all": {"h2d_ms": [times(h) for h, _ in every], "d2h_ms": [times(d) for _, d in every]}}


def test_host_link_from_copy_times_by_hand():
    from workbench.profile.fit import copy_gbps, fit_host_link

    assert copy_gbps(1e9, [20.0, 25.0, 400.0]) == pytest.approx(40.0)  # 1 GB in the median 25 ms
    f = fit_host_link(_link())
    gb = (1 << 28) / 1e9
    assert f["alone"] == {"h2d_gbps": pytest.approx(gb / 9e-3), "d2h_gbps": pytest.approx(gb / 11e-3)}
    assert f["host_link_gbps"] == pytest.approx(gb / 11e-3)  # the slower direction of one GPU alone
    # all four copying: the slowest rank (20 ms host-to-device) sets the node's total, x 4 GPUs
    assert f["all"]["h2d_gbps"][2] == pytest.approx(gb / 20e-3)
    assert f["host_link_node_gbps"] == pytest.approx(4 * gb / 20e-3)
    with pytest.raises(ValueError, match="positive"):
        copy_gbps(1e9, [0.0])
    with pytest.raises(ValueError, match="lack"):
        fit_host_link({"bytes": 1e9, "alone": {"h2d_ms": [1.0]}})


def test_build_result_records_the_host():
    import psutil

    # CPU (what the quick profile measures here): the host's memory, no host link, and the provenance says so
    m = _measurements()
    m["host"] = {"memory_gb": psutil.virtual_memory().total / 1e9, "link": None}
    res = build_result(m)
    p = res.profile
    assert p.host_memory_gb == pytest.approx(psutil.virtual_memory().total / 1e9, rel=0.01)
    assert p.host_link_gbps is None and p.host_link_node_gbps is None
    assert p.provenance["host_link"].startswith("none") and "do not offload" in p.provenance["host_link"]
    assert res.host == {"memory_gb": p.host_memory_gb, "link": None}
    # a CUDA measurement: the link's figures by hand, the provenance says they were measured, and how
    m = _measurements()
    m["device"] = "cuda"
    m["meta"]["provenance"]["host"] = "node7"
    m["host"] = {"memory_gb": 2048.0, "link": _link()}
    res = build_result(m)
    p, gb = res.profile, (1 << 28) / 1e9
    assert p.host_memory_gb == 2048.0
    assert p.host_link_gbps == pytest.approx(gb / 11e-3) and p.host_link_node_gbps == pytest.approx(4 * gb / 20e-3)
    note = p.provenance["host_link"]
    assert note.startswith("measured on node7") and "CUDA events" in note and "256 MiB" in note
    assert p.provenance["host_link_gpus"] == 4
    assert ProfileResult.from_dict(json.loads(res.to_json())).host == json.loads(json.dumps(res.host))
    # a profile measured before the host was: unchanged
    assert build_result(_measurements()).profile.host_memory_gb is None
