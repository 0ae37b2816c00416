"""Offload in the cost model and the planners, against hand counts and brute force
(``workbench.cost.offload``; the runtime's side is tests/test_offload.py)."""

import dataclasses
import json

import numpy as np
import pytest

from conftest import cli_main, run_cli
from workbench.cost import CostModel
from workbench.cost.offload import exposed_copy_ms, host_link_gbps, mlp_flop_share, offload_saved_bytes_per_token
from workbench.models import get_model
from workbench.scenario import Scenario
from workbench.solve.plan import plan_from_dict, validate
from workbench.specs import ClusterSpec, load_profile

LLAMA = get_model("llama3-8b")


def _cost(offload="auto", *, gpus=8, frac=0.9, host=None, recompute=True, profile="h100-80g", zero=3):
    cl = ClusterSpec(num_gpus=gpus, gpus_per_node=min(8, gpus), gpu_memory_gb=80.0, usable_memory_fraction=frac,
                     zero_stage=zero, host_memory_gb=host)
    return CostModel(load_profile(profile), LLAMA, cl, strategy="auto", recompute=recompute, offload=offload)


def test_saved_and_host_bytes_by_hand():
    # Llama-3-8B in bf16 (FSDP2 casts: the residual stream is bf16): 32 layers x 4096 x 2 bytes of block
    # inputs per token, of which two layers stay on the GPU; the MLP's gate, up, silu and product, 4 x 14336 x 2;
    # the MLP norm's fp32 input (4 x 4096) and its normed input and output (2 x 2 x 4096)
    saved = 30 * 4096 * 2 + 4 * 14336 * 2 + 4 * 4096 + 4 * 4096
    assert offload_saved_bytes_per_token(LLAMA) == saved
    c = _cost()
    s = np.array([1_000_000.0])
    for d, cp in ((8, 1), (8, 8)):
        none = c.gpu_memory(s, d, cp, "none")[0]
        assert c.gpu_memory(s, d, cp, "inputs")[0] == pytest.approx(none - saved * 1e6 / d / 1e9)
    assert c.host_memory(s, 8)[0] == pytest.approx(32 * 8192 * 1e6 / 8 / 1e9)
    # host: 2 TB per node, 80% of it, over 8 GPUs; the link: 200 GB/s for the node shared by 8 (below 50 each)
    assert c.host_budget_gb == pytest.approx(2048 * 0.8 / 8)
    assert c.host_link_gbps == pytest.approx(25.0)
    assert host_link_gbps(50.0, 200.0, 2) == 50.0 and host_link_gbps(None, 200.0, 4) == 50.0


def test_offload_time_by_hand():
    c = _cost()
    f = c._fit
    L, h = LLAMA.layers, LLAMA.hidden
    for s, d in ((2048.0, 8), (2_000_000.0, 8)):
        copy = (s / d) * h * 2 / 25e9 * 1e3  # one layer's input of s/d tokens, bf16, at 25 GB/s
        fwd = (f.A_fwd * s * s + f.B_fwd * s) / d / L
        bwd = c.compute_ms([s], d)[0] / L - fwd
        exposed = L * (max(0.0, copy - fwd) + max(0.0, copy - bwd))
        tile = f.B_fwd * mlp_flop_share(LLAMA) * s / d
        assert c.offload_ms([s], d)[0] == pytest.approx(exposed + tile, rel=1e-9)
    # attention grows as s^2, the copy as s: the copy's share of a layer's forward falls with the length
    assert exposed_copy_ms([1.0], [5.0], [5.0], 32)[0] == 0.0
    assert exposed_copy_ms([3.0], [1.0], [2.0], 2)[0] == pytest.approx(2 * (2.0 + 1.0))
    s = np.array([2048.0, 2_000_000.0])
    fwd = (f.A_fwd * s * s + f.B_fwd * s) / 8 / L
    copy = (s / 8) * h * 2 / 25e9 * 1e3
    assert copy[1] / fwd[1] < copy[0] / fwd[0] / 10


def test_auto_offloads_only_what_does_not_fit():
    c = _cost("auto")
    budget = c.memory_budget_gb
    s = np.array([8192.0, 600_000.0, 2_000_000.0])
    off = c.offloaded(s, 8, 1)
    assert off.tolist() == [False, False, True]
    none = c.gpu_memory(s, 8, 1, "none")
    assert none[1] <= budget < none[2]
    # what a sequence is charged: as before where it fits; offloaded, its GPU share with the tile (its
    # host share is lower here)
    mem = c.memory(s, 8, 1)
    assert mem[0] == pytest.approx(none[0]) and mem[1] == pytest.approx(none[1])
    assert mem[2] == pytest.approx(c.gpu_memory(s[2:], 8, 1, "inputs")[0] + c.tile_gb)
    # the planners' time: as without offload where a sequence is not offloaded; the offloaded one pays its
    # copies and the tiled MLP with no block swapped (a group's swapped blocks only shorten it once placed)
    t_none = _cost("none").time(s, 8, 1)
    assert c.time(s, 8, 1)[:2] == pytest.approx(t_none[:2])
    assert c.time(s, 8, 1)[2] == pytest.approx(t_none[2] + c.offload_ms(s[2:], 8, "inputs", 0)[0])
    # the bounds' time: what the level adds at best over the counts of swapped blocks
    best_none = np.min([c.offload_ms(s[:2], 8, "none", k) for k in range(1, 33)] + [np.zeros(2)], axis=0)
    best_inputs = min(float(c.offload_ms(s[2:], 8, "inputs", k)[0]) for k in range(33))
    b = c.bound_view()
    assert b is not c and b.bound_view() is b and _cost("none").bound_view().offload == "none"
    assert b.time(s, 8, 1)[:2] == pytest.approx(t_none[:2] + best_none)
    assert b.time(s, 8, 1)[2] == pytest.approx(t_none[2] + best_inputs)
    assert best_none[1] < 0  # 600K tokens: swapping blocks instead of recomputing them pays


def test_longest_sequence_is_the_edge_by_brute_force():
    for c in (_cost("none"), _cost("auto"), _cost("auto", frac=0.7)):
        n = c.longest_sequence()
        assert c.min_degree([n])[0] > 0 and c.min_degree([n + 1])[0] == 0
    plain, off = _cost("none").longest_sequence(), _cost("auto").longest_sequence()
    assert off > 3 * plain  # one node of 8 H100s: about 0.77M tokens without, 2.7M with


def test_small_host_memory_limits_what_offloads_by_brute_force():
    """Every planned group fits the GPU and the host; with a host of 64 GB per node the host binds."""
    small = _cost("auto", host=64.0)
    big = _cost("auto")
    assert small.longest_sequence() < big.longest_sequence()
    n = small.longest_sequence()
    g_host = small.host_memory([n], 8)[0]
    assert g_host <= small.host_budget_gb * (1 + 1e-9)
    sc = Scenario(model="llama3-8b", profile="h100-80g", num_gpus=8, recompute=True, host_memory_gb=64.0,
                  source=f"{n},{n // 4}", planner="greedy")
    plan = sc.plan()
    for ms in plan.micro_steps:
        for g in ms.groups:
            assert g.memory_gb <= small.memory_budget_gb * (1 + 1e-9)
            assert g.host_gb <= small.host_budget_gb * (1 + 1e-9)


@pytest.mark.parametrize("planner", ["greedy", "flexsp", "two-stage", "static-max"])
def test_a_plan_that_fits_without_offload_gets_no_longer(planner):
    """Under auto no plan of a batch that fits without offload is longer, no group offloads its inputs,
    and every swapping group swaps as many blocks as ``choose_swap`` says."""
    # a wall-clock cap far past what the effort takes: the plans compared are the effort clock's alone (on a
    # 2-core box at load 13 the groups of the two differed once, most likely the default 15 s cap ending one search)
    kw = dict(model="llama3-8b", profile="h100-80g", num_gpus=16, recompute=True, source="github",
              batch_tokens=400_000, planner=planner, seed=3, time_limit=600.0)
    none = Scenario(offload="none", **kw).plan()
    off = Scenario(offload="auto", **kw).plan()
    assert off.makespan_ms <= none.makespan_ms * (1 + 1e-9)
    assert off.lower_bound_ms <= off.makespan_ms * (1 + 1e-9)
    # planners search without swap: the same groups on the same ranks, each as fast or faster
    shape = lambda p: [[(g.degree, g.cp, g.ranks, g.sequences) for g in m.groups] for m in p.micro_steps]  # noqa: E731
    assert shape(off) == shape(none)
    for m, n in zip(off.micro_steps, none.micro_steps):
        for g, h in zip(m.groups, n.groups):
            assert g.time_ms <= h.time_ms * (1 + 1e-12)
    cost = Scenario(offload="auto", **kw).cost()
    for m in off.micro_steps:
        for g in m.groups:
            assert g.offload == "none"
            if g.swap_layers:
                assert g.swap_layers == cost.choose_swap(g.lengths, g.degree, g.cp, g.offload)


def test_a_group_that_needs_offload_gets_it_and_its_costs():
    sc = Scenario(model="llama3-8b", profile="h100-80g", num_gpus=8, recompute=True, source="2000000,4096",
                  planner="flexsp")
    plan = sc.plan()
    c = sc.cost()
    groups = [g for m in plan.micro_steps for g in m.groups]
    big = next(g for g in groups if 2_000_000 in g.lengths)
    assert big.offload == "inputs"
    t, gpu, host = c.group_at(big.lengths, big.degree, big.cp, "inputs")
    assert (big.time_ms, big.memory_gb, big.host_gb) == pytest.approx((t, gpu, host))
    assert big.memory_gb <= c.memory_budget_gb and big.host_gb > 0
    validate(plan, [2_000_000, 4096], c.cluster, c)
    # and the same batch without offload cannot be planned at all
    with pytest.raises(ValueError, match="2,000,000 tokens"):
        sc.replace(offload="none").plan()


def test_plans_written_before_offload_read_as_none():
    sc = Scenario(model="7b", num_gpus=8, source="8192,4096,1024", planner="greedy")
    d = sc.plan().to_dict()
    for m in d["micro_steps"]:
        for g in m["groups"]:
            del g["offload"], g["host_gb"]
    back = plan_from_dict(d)
    assert all(g.offload == "none" and g.host_gb == 0.0 for m in back.micro_steps for g in m.groups)
    bad = json.loads(json.dumps(d))
    bad["micro_steps"][0]["groups"][0]["offload"] = "everything"
    with pytest.raises(ValueError, match="offload 'everything' is not one of none, inputs"):
        plan_from_dict(bad)


def test_offload_needs_recompute_and_a_host():
    with pytest.raises(ValueError, match="needs recomputation"):
        _cost("inputs", recompute=False)
    with pytest.raises(ValueError, match="no host link figure"):
        _cost("inputs", profile="cpu-gloo-tiny")
    # auto without recomputation, or without figures, plans as none and says why
    assert not _cost("auto", recompute=False).can_offload
    assert "host_link_gbps" in _cost("auto", profile="cpu-gloo-tiny").offload_note
    prof = dataclasses.replace(load_profile("h100-80g"), host_memory_gb=None)
    cl = ClusterSpec(num_gpus=8, gpu_memory_gb=80.0)
    assert "--host-memory" in CostModel(prof, LLAMA, cl, recompute=True, offload="auto").offload_note


def test_profile_memory_fraction_is_the_default():
    assert Scenario(profile="h100-80g", model="llama3-8b").cluster().usable_memory_fraction == 0.9
    assert Scenario().cluster().usable_memory_fraction == 0.7  # FlexSP's published setting
    assert Scenario(profile="h100-80g", model="llama3-8b", memory_fraction=0.7).cluster().usable_memory_fraction == 0.7


@pytest.mark.parametrize("args, needle", [
    (["plan", "--lengths", "1000,2000", "--offload", "inputs"], "needs recomput"),
    (["plan", "--lengths", "1000,2000", "--offload", "swapall"], "invalid choice: 'swapall'"),
    (["plan", "--lengths", "1000,2000", "--host-memory", "-4"], "--host-memory"),
])
def test_offload_flags_on_bad_input_are_one_line(args, needle, capsys):
    """Through the console script's ``main`` in this process (an interpreter per case cost more than the
    checks; ``test_train_refuses_more_host_memory_than_the_machine_has`` runs the real console script's
    refusals). An exception escaping ``main`` fails the test as its traceback would show in a terminal."""
    p = cli_main(capsys, *args)
    rc, err = p.returncode, p.stderr
    assert rc == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) <= 2 and needle in err, err  # argparse prints its usage line first
    assert "Traceback" not in err


def test_plan_text_says_the_longest_sequence_with_and_without_offload():
    p = run_cli("plan", "--lengths", "2000000", "--gpus", "8", "--model", "llama3-8b", "--profile", "h100-80g",
                "--recompute", "--planner", "greedy")
    plain, off = _cost("none").longest_sequence(), _cost("auto").longest_sequence()
    assert f"{plain:,} tokens without offload, {off:,} with" in p.stdout
    assert "offload inputs" in p.stdout and "host " in p.stdout


def test_the_memory_view_shows_an_offloaded_group_at_its_level():
    from workbench.report.memory import plan_memory

    sc = Scenario(model="llama3-8b", profile="h100-80g", num_gpus=8, recompute=True, source="2000000,4096",
                  planner="greedy")
    plan = sc.plan().to_dict()
    rows = plan_memory(plan, sc.cost())
    groups = [g for m in plan["micro_steps"] for g in m["groups"]]
    for row, g in zip(rows, groups):
        assert row["activations_gb"] == pytest.approx(g["memory_gb"]) and row["host_gb"] == pytest.approx(g["host_gb"])
        assert ("host memory" in row["label"]) == (g["offload"] == "inputs")
    assert any(g["offload"] == "inputs" for g in groups)


def test_the_runtime_takes_a_plan_that_offloads_only_with_recomputation():
    from workbench.runtime.step import check_plan
    from workbench.solve.plan import PlanError

    sc = Scenario(model="llama3-8b", profile="h100-80g", num_gpus=8, recompute=True, source="2000000", planner="greedy")
    plan = sc.plan()
    assert plan.micro_steps[0].groups[0].offload == "inputs"
    check_plan(plan, [2_000_000], 8, recompute=True, zero_stage=3)  # the runtime executes it (tests/test_offload.py)
    with pytest.raises(PlanError, match="activation recomputation"):
        check_plan(plan, [2_000_000], 8, recompute=False, zero_stage=3)


def test_swap_blocks_are_evenly_spread_by_brute_force():
    from workbench.cost.offload import swap_blocks

    for L in (1, 4, 7, 32):
        for k in range(L + 1):
            b = swap_blocks(L, k)
            assert len(b) == k and len(set(b)) == k and all(0 <= i < L for i in b)
            # evenly: any window of w consecutive blocks holds floor or ceil of w k / L swapped ones
            for w in range(1, L + 1):
                for lo in range(L - w + 1):
                    n = sum(lo <= i < lo + w for i in b)
                    assert abs(n - w * k / L) < 1 + 1e-9
    with pytest.raises(ValueError, match="outside 0..4"):
        swap_blocks(4, 5)


def test_swap_time_and_memory_by_hand():
    c = _cost("auto")
    f, L, h = c._fit, LLAMA.layers, LLAMA.hidden
    s, d = 600_000.0, 8
    block = 2 * (4 * h + 2 * 4096 + 2 * 1024 + 4 * 14336) + 8 * h + 4 * 32 + 8  # bf16, FSDP2: no autocast
    assert c._block_bytes == block
    fwd = (f.A_fwd * s * s + f.B_fwd * s) / d / L
    bwd = c.compute_ms([s], d)[0] / L - 2 * fwd
    for k in (1, 8, 32):
        copies = k * (s / d) * block / 25e9 * 1e3  # level none: only the swapped blocks go out and come back
        expect = max(0.0, copies - L * fwd) + max(0.0, copies - L * bwd - (L - k) * fwd) - k * fwd
        assert c.offload_ms([s], d, "none", k)[0] == pytest.approx(expect, rel=1e-9)
        # in host memory: every swapped block but the last, which the backward starts with on the GPU
        assert c.swap_host_memory([s], d, "none", k)[0] == pytest.approx((k - 1) * block * s / d / 1e9)
        # one more block's activations on the GPU, less the swapped blocks' own inputs
        assert c.swap_gpu_memory([s], d, "none", k)[0] == pytest.approx((block - k * h * 2) * s / d / 1e9)


def test_choose_swap_is_the_brute_force_best_within_the_budgets():
    for host in (None, 300.0, 40.0):
        c = _cost("auto", gpus=64, host=host)
        for lengths, d, cp in (([1_000_000, 200_000, 50_000, 8000], 64, 8), ([300_000], 8, 1), ([4096] * 20, 2, 1)):
            for level in ("none", "inputs"):
                best, best_t = 0, c.group_at(lengths, d, cp, level, 0)[0]
                for k in range(1, LLAMA.layers + 1):
                    t, gpu, hm = c.group_at(lengths, d, cp, level, k)
                    if gpu <= c.memory_budget_gb and hm <= c.host_budget_gb and t < best_t - 1e-9 * best_t:
                        best, best_t = k, t
                assert c.choose_swap(lengths, d, cp, level) == best, (host, lengths, level)


def test_the_issue_batch_swaps_and_its_bound_holds():
    kw = dict(model="llama3-8b", profile="h100-80g", num_gpus=64, recompute=True,
              source="1000000,200000,50000,8000", planner="flexsp")
    none = Scenario(offload="none", **kw).plan()
    auto = Scenario(**kw).plan()
    g = auto.micro_steps[0].groups[0]
    assert g.swap_layers > 0 and g.host_gb > 0
    assert auto.makespan_ms < 0.9 * none.makespan_ms  # recomputation skipped where the host holds the blocks
    assert auto.lower_bound_ms <= auto.makespan_ms
    back = plan_from_dict(json.loads(json.dumps(auto.to_dict())))
    assert [x.swap_layers for m in back.micro_steps for x in m.groups] == [x.swap_layers for m in auto.micro_steps
                                                                            for x in m.groups]


def test_a_rank_serving_two_groups_in_a_pass_does_not_swap():
    from workbench.solve.plan import Group, _swapped

    c = _cost("auto", gpus=8)
    a = Group(degree=2, ranks=(0, 1), sequences=(0,), lengths=(50_000,), time_ms=1.0, memory_gb=1.0)
    b = Group(degree=1, ranks=(1,), sequences=(1,), lengths=(100_000,), time_ms=1.0, memory_gb=1.0)
    alone = Group(degree=2, ranks=(2, 3), sequences=(2,), lengths=(50_000,), time_ms=1.0, memory_gb=1.0)
    out = _swapped([a, b, alone], c)
    assert out[0].swap_layers == 0 and out[1].swap_layers == 0
    assert out[2].swap_layers == c.choose_swap([50_000], 2, 1, "none") > 0


def test_train_refuses_more_host_memory_than_the_machine_has(tmp_path):
    import psutil

    here = psutil.virtual_memory().total / 1e9
    args = ["train", "--nproc", "1", "--steps", "1", "--model", "tiny", "--lengths", "64,64", "--recompute",
            "--profile", "h100-80g", "--run-root", str(tmp_path / "runs"), "--name", "x"]
    p = run_cli(*args, "--host-memory", str(round(here * 4)), check=False)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert f"{here * 4:,.0f} GB of host memory per node" in lines[0] and f"this machine has {here:,.0f} GB" in lines[0]
    assert not (tmp_path / "runs" / "x").exists()  # nothing started, nothing written
    # the profile's own 2 TB as well
    p = run_cli(*args, check=False)
    assert p.returncode == 2 and "profile h100-80g's" in p.stderr and not (tmp_path / "runs" / "x").exists()


def test_offload_takes_its_share_of_a_measured_activation_figure():
    """7B on a100-40g-flexsp: the profile's published 4.48 MB a token (no recomputation), scaled to
    recomputation by the formula; offload removes the formula's share of it, never more than there is."""
    from workbench.cost import activation_bytes_per_token

    c = Scenario(model="7b", profile="a100-40g-flexsp", num_gpus=64, recompute=True, source="1000").cost()
    m = c.model
    share = offload_saved_bytes_per_token(m) / activation_bytes_per_token(m, True)
    act = 4.48e6 * activation_bytes_per_token(m, True) / activation_bytes_per_token(m, False)
    assert c.activation_bytes_per_token == pytest.approx(act)
    s = np.array([100_000.0])
    assert c.gpu_memory(s, 8, 1, "inputs")[0] == pytest.approx(act * (1 - share) * 1e5 / 8 / 1e9)
    assert 0 < c.gpu_memory(s, 8, 1, "inputs")[0] < c.gpu_memory(s, 8, 1, "none")[0]
    assert c.longest_sequence() > c.plain_limit


def test_the_memory_view_shows_a_swapping_group_and_its_host_memory():
    from workbench.report.memory import plan_memory

    sc = Scenario(model="llama3-8b", profile="h100-80g", num_gpus=64, recompute=True,
                  source="1000000,200000,50000,8000", planner="greedy")
    plan = sc.plan().to_dict()
    rows = plan_memory(plan, sc.cost())
    g = plan["micro_steps"][0]["groups"][0]
    assert g["swap_layers"] > 0 and g["offload"] == "none"
    t, gpu, host = sc.cost().group_at(g["lengths"], g["degree"], g["cp"], "none", g["swap_layers"])
    assert rows[0]["activations_gb"] == pytest.approx(g["memory_gb"]) == pytest.approx(gpu)
    assert rows[0]["host_gb"] == pytest.approx(g["host_gb"]) == pytest.approx(host)
    assert f"{g['swap_layers']} blocks swapped" in rows[0]["label"]
