"""The panels, driven from Python as a notebook under papermill drives them: build each panel, set
its controls, press its buttons through its API, and check its state and the data behind its
figures against references computed here independently (hand formulas, the run store's files).

Slow tests (``-m slow``) start real torchrun runs through the Launch panel.
"""

from __future__ import annotations

import html
import json
import re
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from workbench.solve.plan import pass_loads
from workbench.scenario import DEFAULT_PLANNERS, Scenario

ROOT = Path(__file__).resolve().parents[1]

# a small planning scenario: 8 A100-40G, 7B, 256K-token batches (memory binds at ~5.9K tokens per GPU)
SMALL = dict(num_gpus=8, gpus_per_node=8, samples=20_000, batch_tokens=262_144, effort=0.3, source="wikipedia")
# SMALL's batch cut to 64K tokens (44 sequences up to 16K, memory-bound all the same): its lockstep pass bound
# takes ~1 s of CPU where SMALL's takes ~6, for the tests that solve through the panel (every such solve bounds)
QUICK = dict(SMALL, batch_tokens=65_536)
ACT_BYTES_7B = 4.48e6  # published activation bytes per token of GPT-7B (a100-40g-flexsp), typed in


# ------------------------------------------------------------------------------------------------
# memory breakdown: the ZeRO formula by hand
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 8, 64])
def test_model_state_parts_follow_zero_stages(stage, n):
    """By hand, 7B in bf16 with AdamW (fp32 master weights and gradients, 8 bytes of moments): ZeRO-3
    shards everything 1/N (every 7B tensor's rows divide by 64); ZeRO 1-2 shard whole parameters'
    optimizer states, so the most loaded rank holds between 1/N of them and 1/N plus the largest
    tensor; free stages hold whole gradients at the peak."""
    from workbench.report.memory import model_state_parts

    sc = Scenario(num_gpus=n, gpus_per_node=min(8, n), zero_stage=stage, precision="bf16", optimizer="adamw",
                  gpu_memory_gb=1e4)  # room for every stage: the figures, not the fit
    P = sc.model_spec().params()
    largest = sc.model_spec().vocab * sc.model_spec().hidden  # the embedding (and the head)
    got = model_state_parts(sc.cost())
    assert got["parameters"] == pytest.approx(4 * P / (n if stage == 3 else 1) / 1e9, rel=1e-12)
    assert got["gradients"] == pytest.approx(4 * P / (n if stage == 3 else 1) / 1e9, rel=1e-12)
    if stage in (0, 3):
        assert got["optimizer"] == pytest.approx(8 * P / (n if stage == 3 else 1) / 1e9, rel=1e-12)
    else:
        assert 8 * P / n / 1e9 <= got["optimizer"] * (1 + 1e-12) and got["optimizer"] <= 8 * (P / n + largest) / 1e9
    blocks = sc.model_spec().layer_params()
    if stage == 3:  # two bf16 all-gathered blocks and one fp32 unsharded gradient (at a world of one
        # too: FSDP2 gathers into unsharded copies there, as an H200 measured for the 8B)
        assert got["working"] == pytest.approx((2 * 2 * blocks + 4 * blocks) / 1e9, rel=1e-9)
    else:  # autocast's bf16 copies of every matmul weight: all but the embedding and the norms
        m = sc.model_spec()
        matmul = P - m.vocab * m.hidden - (2 * m.layers + 1) * m.hidden
        assert got["working"] == pytest.approx(2 * matmul / 1e9, rel=1e-12)


def test_gpu_memory_breakdown_by_hand():
    from workbench.report.memory import gpu_memory_breakdown

    sc = Scenario(num_gpus=64)
    cost = sc.cost()
    b = gpu_memory_breakdown(cost, [131072], 32)
    P = sc.model_spec().params()
    working = (2 * 2 + 4) * sc.model_spec().layer_params()  # ZeRO-3: two bf16 blocks gathered, one fp32 gradient
    assert b["usable_gb"] == pytest.approx(40 * 0.7)
    assert b["model_states_gb"] == pytest.approx(16 * P / 64 / 1e9)
    assert b["working_gb"] == pytest.approx(working / 1e9) and "all-gathered" in b["working_label"]
    assert b["activations_gb"] == pytest.approx(ACT_BYTES_7B * 131072 / 32 / 1e9)
    assert b["activation_budget_gb"] == pytest.approx(28 - (16 * P / 64 + working) / 1e9)
    assert b["fits"] and b["headroom_gb"] == pytest.approx(28 - b["total_gb"])
    assert b["total_gb"] == pytest.approx(b["model_states_gb"] + b["working_gb"] + b["activations_gb"])
    assert not gpu_memory_breakdown(cost, [131072], 16)["fits"]  # 36.7 GB of activations on 16 GPUs


def test_memory_figure_says_free_execution_holds_whole_gradients():
    from workbench.report.memory import FREE_GRADIENTS_NOTE, gpu_memory_breakdown, memory_breakdown_figure

    free = Scenario(num_gpus=8, gpus_per_node=8, zero_stage=2, model="1b").cost()
    fig = memory_breakdown_figure([dict(gpu_memory_breakdown(free, [4096], 1), label="a")])
    assert FREE_GRADIENTS_NOTE in fig.layout.title.text
    assert [t.name for t in fig.data] == ["parameters", "gradients", "optimizer states", "working set (transient)",
                                          "activations"]
    lock = Scenario(num_gpus=8, gpus_per_node=8, zero_stage=3, model="1b").cost()
    fig = memory_breakdown_figure([dict(gpu_memory_breakdown(lock, [4096], 1), label="a")])
    assert FREE_GRADIENTS_NOTE not in fig.layout.title.text and "all-gathered" in fig.layout.title.text


def test_rank_memory_sums_a_lockstep_ranks_groups_in_a_pass():
    from workbench.report.memory import rank_activations

    cost = Scenario(num_gpus=4, gpus_per_node=4, model="1b").cost()
    plan = {"num_gpus": 4, "execution": "lockstep", "micro_steps": [
        {"groups": [{"degree": 4, "ranks": [0, 1, 2, 3], "lengths": [8192]}, {"degree": 1, "ranks": [1], "lengths": [1024]}]},
        {"groups": [{"degree": 2, "ranks": [2, 3], "lengths": [4096]}]}]}
    act = rank_activations(plan, cost)
    m = lambda s, d: float(cost.memory([s], d)[0])  # noqa: E731
    assert act == pytest.approx([m(8192, 4), m(8192, 4) + m(1024, 1), max(m(8192, 4), m(4096, 2)),
                                 max(m(8192, 4), m(4096, 2))])
    free = dict(plan, execution="free")
    assert rank_activations(free, cost)[1] == pytest.approx(max(m(8192, 4), m(1024, 1)))


# ------------------------------------------------------------------------------------------------
# Solver panel
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def solved():
    from widgets import SolverPanel

    panel = SolverPanel(Scenario(**QUICK), auto=False)
    return panel, panel.solve()


def test_solver_solve_plans_every_planner_and_draws_them(solved):
    from workbench.solve import validate

    panel, res = solved
    sc = res.scenario
    cost = sc.cost()
    batch = np.asarray(sc.batches(1)[0].lengths)
    assert set(res) | set(res.errors) == set(DEFAULT_PLANNERS)
    assert "flexsp" in res and "static-max" in res
    for plan in res.values():
        validate(plan, batch, cost.cluster, cost)  # the same batch, every sequence once, memory within budget
        assert plan.makespan_ms >= plan.lower_bound_ms * (1 - 1e-9)
    # the timeline shows the chosen planner's plan: one bar per group, every rank labelled. QUICK is
    # ZeRO-3, so the plan runs in lockstep passes: a rank serving k groups of a pass pays the
    # packed call's constant once (its later groups are drawn without it)
    plan = res["flexsp"]
    assert plan.execution == "lockstep" and plan.zero_stage == 3 and plan.grad_sync_ms == 0.0
    bars = [t for t in panel.fig_timeline.data if t.type == "bar" and str(t.name).startswith("degree")]
    assert sorted(int(t.name.split()[1]) for t in bars) == sorted({g.degree for m in plan.micro_steps for g in m.groups})
    assert sum(len(t.x) for t in bars) == sum(len(m.groups) for m in plan.micro_steps)
    later = 0
    for m in plan.micro_steps:
        seen: set[int] = set()
        for g in m.groups:
            later += all(r in seen for r in g.ranks)
            seen |= set(g.ranks)
    shared = plan.shared_overhead_ms
    assert sum(sum(t.x) for t in bars) * 1e3 == pytest.approx(
        sum(g.time_ms for m in plan.micro_steps for g in m.groups) - later * shared)
    assert not [t for t in panel.fig_timeline.data if t.name == "gradient sync (all ranks)"]
    # one shaded band per pass; every rank's idle time to the end of its pass is drawn as a wait:
    # ranks x passes, less each rank's load, is the waits' total
    assert len(panel.fig_timeline.layout.shapes) - 2 == len(plan.micro_steps)  # + the two vlines
    waits = [t for t in panel.fig_timeline.data if t.name == "waiting for the pass to end"]
    loads = sum(float(sum(ld)) for ld in pass_loads(plan))
    span = sum(m.time_ms for m in plan.micro_steps) * plan.num_gpus
    assert sum(waits[0].x) * 1e3 == pytest.approx(span - loads) if waits else span == pytest.approx(loads)
    assert list(panel.fig_timeline.layout.yaxis.tickvals) == list(range(8))
    # every planner side by side, in the order solved, at its makespan
    bar = panel.fig_planners.data[0]
    assert list(bar.y) == list(res)
    assert [x * 1e3 for x in bar.x] == pytest.approx([res[k].makespan_ms for k in res])
    assert "plan #1: flexsp" in panel.status.value and panel.solves == 1
    assert "lockstep pass(es) (ZeRO-3)" in panel.status.value


def test_solver_zero_control_changes_memory_and_timeline_together():
    """ZeRO-3 (lockstep) against ZeRO-2 (free) for a model both hold (1B on 8 A100-40G): the ZeRO
    control changes the activation budget by the model states ZeRO-2 replicates, and the plans'
    execution: gradient reduction at the end and no passes under ZeRO-2. A 16K-token batch: the
    ZeRO-3 solve's lockstep pass bound on SMALL's 256K tokens of the 1B took ~25 s of CPU (and the
    bound is not what is checked here: the ZeRO-3 solve leaves it out)."""
    from widgets import SolverPanel
    from workbench.cost.memory import model_states

    panel = SolverPanel(Scenario(**dict(SMALL, model="1b", batch_tokens=16_384)), auto=False)
    res3 = panel.solve(["greedy", "flexsp"], pass_bound=False)
    budget3 = res3.scenario.cost().memory_budget_gb
    panel.set(zero_stage=2)
    res2 = panel.solve(["greedy", "flexsp"])
    sc2 = res2.scenario
    assert sc2.zero_stage == 2
    m = sc2.model_spec()
    s2 = model_states(m, zero_stage=2, num_ranks=8, precision="bf16", optimizer="adamw").total / 1e9
    s3 = model_states(m, zero_stage=3, num_ranks=8, precision="bf16", optimizer="adamw").total / 1e9
    assert sc2.cost().memory_budget_gb == pytest.approx(budget3 - (s2 - s3))
    assert all(p.execution == "free" for p in res2.values()) and all(p.execution == "lockstep" for p in res3.values())
    names = [t.name for t in panel.fig_timeline.data]
    assert "gradient sync (all ranks)" in names and "waiting for the pass to end" not in names
    assert "micro-step(s), barrier-free" in panel.status.value
    assert f"model states {s2:.2f} GB under ZeRO-2" in panel.data_line.value
    assert "chunked loss" not in panel.data_line.value
    # without recomputation the whole logits' backward goes with the tokens (1B on a100-40g-flexsp, whose
    # measured figure is 7B's: the formula's, two fp32 gradients of 128,256 logits a token)
    assert f"the whole logits' backward {8 * 128_256 / 1e6:.2f} MB a token" in panel.data_line.value
    # with recomputation the budget line says what the chunked loss takes: Llama 3's 128,256-token head
    # (1B: hidden 2,048), one 697-token chunk at 12 bytes a logit and its gradient at 6 bytes a weight
    panel.set(recompute=True)
    res_rc = panel.solve(["greedy"])
    loss = (12 * 697 * 128_256 + 697 * (6 * 2048 + 4) + 6 * 128_256 * 2048) / 1e9  # + the final norm's chunk
    assert res_rc.scenario.cost().memory_budget_gb == pytest.approx(sc2.cost().memory_budget_gb - loss)
    assert f"the chunked loss {loss:.2f} GB under recomputation" in panel.data_line.value


def test_solver_reports_the_packing_bound_of_the_step(solved):
    """The step's packing bound (whole sequences; ``test_packing_bound.py`` checks it against
    exhaustive search) sits between every plan's lower bound and the fastest plan; the table's
    "over packing bound" is each makespan over it, and the planners figure marks it."""
    from workbench.solve.bound import packing_bound_ms

    panel, res = solved
    cost = res.scenario.cost()
    pb = res.packing_bound_ms
    fastest = min(p.makespan_ms for p in res.values())
    assert max(p.lower_bound_ms for p in res.values()) * (1 - 1e-9) <= pb <= fastest * (1 + 1e-9)
    assert pb >= packing_bound_ms(res.batch.lengths, cost, upper_ms=fastest - cost.grad_sync_ms()) * (1 - 1e-9)
    rows = {r["planner"]: r for r in panel.planner_table() if "error" not in r}
    assert set(rows) == set(res)
    for name, plan in res.items():
        assert rows[name]["packing_gap"] == pytest.approx(plan.makespan_ms / pb - 1)
        assert rows[name]["packing_gap"] <= rows[name]["gap"] + 1e-12
    assert "over packing bound" in panel.table.value
    marks = [s.x0 for s in panel.fig_planners.layout.shapes]
    if pb > res["flexsp"].lower_bound_ms * (1 + 1e-9):
        assert pb / 1e3 in [pytest.approx(x) for x in marks] and len(marks) == 2
        assert "packing bound" in panel.status.value
    else:
        assert len(marks) == 1


def test_solver_memory_breakdown_of_the_chosen_group(solved):
    panel, res = solved
    plan = res["flexsp"]
    groups = [(m, k, g) for m, ms in enumerate(plan.micro_steps) for k, g in enumerate(ms.groups)]
    # default: the group holding the most activations; computed here from the published bytes/token
    act = {(m, k): ACT_BYTES_7B * sum(g.lengths) / g.degree / 1e9 for m, k, g in groups}
    top = max(act, key=act.get)
    mem = panel.memory()
    assert (mem["micro_step"], mem["index"]) == top
    assert mem["activations_gb"] == pytest.approx(act[top])
    assert mem["activations_gb"] <= mem["activation_budget_gb"] * (1 + 1e-9)
    fig = panel.fig_memory
    parts = {t.name: t.x[0] for t in fig.data}
    assert parts["activations"] == pytest.approx(act[top])
    assert parts["parameters"] + parts["gradients"] + parts["optimizer states"] == pytest.approx(mem["model_states_gb"])
    # choose another group: the figure's first bar follows
    m, k, g = min(groups, key=lambda x: act[(x[0], x[1])])
    chosen = panel.select_group(m, k)
    assert chosen["degree"] == g.degree and chosen["sequences"] == len(g.sequences)
    assert panel.fig_memory.data[-1].x[0] == pytest.approx(act[(m, k)])
    with pytest.raises(KeyError):
        panel.select_group(99, 0)


def test_solver_memory_view_shows_host_memory_of_offloading_groups():
    """Llama-3-8B on one node of 8 H100s with recomputation: a 2M-token sequence only fits with its
    block inputs in host memory, so its group offloads; the memory view shows, beside its GPU memory,
    the host memory per GPU the plan recorded for it against the host budget, and the offload
    control drives the scenario."""
    from widgets import SolverPanel

    panel = SolverPanel(Scenario(planner="greedy", effort=0.3), auto=False)
    panel.set(model="llama3-8b", profile="h100-80g", num_gpus=8, gpus_per_node=8, recompute=True,
              source="2000000,4096", compare=False)
    assert panel.w_offload.value == "auto" and panel.w_host.value == 2048.0  # the profile's host memory
    res = panel.solve(pass_bound=False)  # the lockstep pass bound (70% of this test's CPU) is not what is checked
    plan = res[panel.w_show.value]
    off = [(m, k, g) for m, ms in enumerate(plan.micro_steps) for k, g in enumerate(ms.groups) if g.offload != "none"]
    assert off, "the 2M-token sequence's group offloads"
    m, k, g = off[0]
    assert 2_000_000 in g.lengths and g.host_gb > 0
    panel.select_group(m, k)
    cost = res.scenario.cost()
    h = panel.host_memory()
    assert h["chosen_host_gb"] == pytest.approx(g.host_gb)
    assert [(x["micro_step"], x["index"]) for x in h["groups"]] == [(m2, k2) for m2, k2, _ in off]
    assert h["host_budget_gb"] == pytest.approx(cost.host_budget_gb)
    shown = html.unescape(panel.host_line.value)
    assert f"Host memory per GPU: {g.host_gb:.2f} GB of {cost.host_budget_gb:.2f} GB budget" in shown
    assert f"host memory per GPU <b>{g.host_gb:.2f} GB</b>" in panel.memory_line.value
    assert any(f"{g.host_gb:.1f} GB in host memory" in str(t.y) for t in panel.fig_memory.data)  # the bar's label
    # the offload control: without offload no planner fits this batch; offload of the inputs without
    # recomputation (the control unticked) is shown beside the memory controls
    panel.set(offload="none")
    assert panel.scenario.offload == "none"
    assert not panel.solve() and "no planner could plan" in panel.status.value
    panel.set(offload="inputs")
    panel.w_recompute.value = False
    assert "offload" in panel.n_memory.value and "recompute" in panel.n_memory.value
    # a host memory typed in reaches the scenario; the profile's own value means "the profile's"
    panel.set(offload="auto", recompute=True, host_memory_gb=1024.0)
    assert panel.scenario.host_memory_gb == 1024.0 and panel.w_host.value == 1024.0
    panel.w_host.value = 2048.0
    assert panel.scenario.host_memory_gb is None


def test_solver_shows_a_broken_constraint_beside_its_control():
    from widgets import SolverPanel

    panel = SolverPanel(Scenario(**SMALL), auto=False)
    panel.set(num_gpus=12)  # 12 GPUs cannot be laid out as nodes of 8
    assert "multiple of gpus_per_node" in panel.n_cluster.value
    assert "cannot plan" in panel.status.value and panel.n_memory.value == ""
    with pytest.raises(ValueError, match="gpus_per_node"):
        panel.solve()
    panel.set(num_gpus=16)
    assert panel.n_cluster.value == ""
    # a model whose states do not fit: the note goes beside the memory controls
    panel.set(model="70b", num_gpus=8)
    assert "GB per GPU of parameters" in panel.n_memory.value


@pytest.fixture(scope="module")
def threaded():
    """QUICK solved on the panel's thread, as a notebook's first solve is (``auto``): the result as
    its plans came (its packing bound then, with the quick bounds), and what the panel showed once
    the lockstep pass bound was in. The debounce test goes on with this panel afterwards."""
    from widgets import SolverPanel

    panel = SolverPanel(Scenario(**QUICK), auto=True, debounce=0.4)
    assert panel.wait_idle(120)
    res = panel.result
    quick = res.packing_bound_ms
    assert panel.wait_idle(120, bound=True)
    shown = {"status": panel.status.value, "table": panel.planner_table(), "solves": panel.solves}
    return panel, res, quick, shown


@pytest.mark.long
def test_solver_threaded_requests_are_debounced_and_the_latest_wins(threaded):
    """Requests that come while one is pending replace it: one solve, for the last (on ``threaded``'s
    panel, after its first solve; from here it compares no other planner: which planners a request
    runs is not what is checked)."""
    panel, res, _, shown = threaded
    first = shown["solves"]
    assert first == 1 and res.scenario.num_gpus == 8
    panel.planners = ["greedy"]
    # three changes in quick succession: one solve, for the last
    panel.set(num_gpus=16)
    panel.set(num_gpus=32)
    panel.set(planner="greedy")
    assert panel.busy
    assert panel.wait_idle(120)
    assert panel.solves == first + 1
    assert panel.result.scenario.num_gpus == 32 and panel.result.scenario.planner == "greedy"
    assert panel._worker.superseded >= 2
    assert list(panel.fig_timeline.layout.yaxis.tickvals) == list(range(32))
    panel.cancel()  # the lockstep pass bound of the plans shown, not checked here


@pytest.mark.serial  # a cancellation within 4 s: beside a heavy test on 2 cores it took 7.6 s (2026-11-28)
def test_solver_a_newer_request_cancels_a_running_solve():
    from widgets import SolverPanel

    # flexsp with an 8 s limit on a 4M-token batch: runs ~5 s unless cancelled
    slow = Scenario(batch_tokens=4_000_000, samples=100_000, effort=8.0)
    panel = SolverPanel(slow, auto=False, debounce=0.0)
    panel.set(compare=False)
    panel.request_solve()
    t0 = time.monotonic()
    while not panel._worker._running and time.monotonic() - t0 < 30:
        time.sleep(0.02)
    time.sleep(0.8)  # the solver is inside flexsp now
    # the older request is cancelled, not waited for; the newer one plans a 64K-token batch (static-max planned
    # and drew the 4M-token one in 1.3 s of CPU), so what `took` measures is the cancellation
    panel.set(planner="static-max", batch_tokens=65_536)
    panel.request_solve()
    assert panel.wait_idle(60)
    took = time.monotonic() - t0
    assert panel.result.scenario.planner == "static-max" and list(panel.result) == ["static-max"]
    assert panel.result.scenario.batch_tokens == 65_536
    assert took < 4.0, f"the superseded flexsp solve was not cancelled ({took:.1f}s)"
    assert panel.solves == 1
    # the static-max plan's lockstep pass bound has started on the panel's other thread: ~8 s of CPU on this
    # 4M-token batch, not checked here, that would go on beside the tests after this one
    panel.cancel()
    assert panel._bounds.wait_idle(30)


def test_solver_threaded_shows_plans_first_then_the_pass_bound(solved, threaded):
    """A threaded lockstep solve (``threaded``) draws its plans with the quick bounds, then the
    lockstep pass bound when it is ready: the step bound the synchronous path reports (``solved``:
    the same scenario solved by ``solve()``, whose bound is ``step_bound_ms`` of its plans), below
    the fastest plan."""
    from workbench.solve.bound import packing_bound_ms

    _, res, quick, shown = threaded
    cost = res.scenario.cost()
    assert cost.execution == "lockstep"
    fastest = min(p.makespan_ms for p in res.values())
    assert quick >= packing_bound_ms(res.batch.lengths, cost, upper_ms=fastest - cost.step_end_ms()) * (1 - 1e-9)
    assert res.pass_bound_pending is False and "on its way" not in shown["status"]
    _, sync = solved
    # the same plans (the planners' effort is counted on a work clock, not wall time): the same bound's inputs
    assert {k: p.makespan_ms for k, p in res.items()} == {k: p.makespan_ms for k, p in sync.items()}
    assert list(res.batch.lengths) == list(sync.batch.lengths)
    full = sync.packing_bound_ms
    assert res.packing_bound_ms == pytest.approx(full) and quick * (1 - 1e-9) <= full <= fastest * (1 + 1e-9)
    top = shown["table"][0]
    assert top["packing_gap"] == pytest.approx(res[top["planner"]].makespan_ms / full - 1)


# ------------------------------------------------------------------------------------------------
# Solver panel: groups of any size (issue 35)
# ------------------------------------------------------------------------------------------------

# Llama-3-8B on H100s, ZeRO-3 with recomputation: docs/solver.md's "Groups of any size" figures
ANY_SIZE = dict(model="llama3-8b", profile="h100-80g", zero_stage=3, recompute=True, planner="flexsp")
BATCH_48 = (1048576, 204800, 51200, 8192)
BATCH_6 = (102400, 30720, 8192, 8192, 4096)


def _reference(**fields):
    """The plan of the same scenario made outside the panel: run_planner on its cost model."""
    from workbench.solve import run_planner

    sc = Scenario(**fields)
    s = np.asarray([int(x) for x in sc.source.split(",")], dtype=np.int64)
    return sc, run_planner(sc.planner, s, sc.cost(), seed=sc.seed, effort=sc.effort, time_limit=sc.time_limit,
                           max_len=sc.resolved_max_len())


def _idle_by_hand(plan) -> tuple[float, int]:
    """Idle GPU-time over the step's (every rank waits for its pass's busiest) and the GPUs in no group."""
    n = plan.num_gpus
    idle = sum(float(ld.max()) * n - float(ld.sum()) for ld in pass_loads(plan))
    used = set()
    for m in plan.micro_steps:
        for g in m.groups:
            assert list(g.ranks) == list(range(g.ranks[0], g.ranks[0] + g.degree))  # a contiguous range
            used |= set(g.ranks)
    return idle / (n * plan.makespan_ms), n - len(used)


def _idle_words(share: float, free: int, n: int) -> str:
    return f"idle GPU-time {100 * share:.1f}%" + (f" ({free} of {n} GPUs in no group)" if free else "")


def _check_panel_shows(panel, res, ref) -> None:
    """The panel's plan, status line, table and timeline against the reference plan."""
    plan = res["flexsp"]
    assert plan.makespan_ms == pytest.approx(ref.makespan_ms, rel=1e-9)
    assert plan.lower_bound_ms == pytest.approx(ref.lower_bound_ms, rel=1e-9)
    groups = lambda p: sorted((g.degree, g.cp, tuple(g.ranks), tuple(g.lengths)) for m in p.micro_steps for g in m.groups)  # noqa: E731
    assert groups(plan) == groups(ref)
    share, free = _idle_by_hand(ref)
    assert ref.idle_share == pytest.approx(share, abs=1e-12)
    status = html.unescape(panel.status.value)
    assert (f"flexsp {ref.makespan_ms / 1e3:.3f}s per step, lower bound {ref.lower_bound_ms / 1e3:.3f}s "
            f"(gap {100 * ref.gap:.1f}%)") in status
    assert _idle_words(share, free, ref.num_gpus) + ", " in status
    row = next(r for r in panel.planner_table() if r["planner"] == "flexsp")
    assert row["idle_share"] == pytest.approx(share, abs=1e-12) and row["idle_gpus"] == free
    assert "idle GPU-time" in panel.table.value and f"{100 * share:.1f}%" in panel.table.value
    # the timeline: one bar per group over its ranks (any size, any offset), every rank labelled
    bars = [t for t in panel.fig_timeline.data if t.type == "bar" and str(t.name).startswith("degree")]
    drawn = sorted((int(t.name.split()[1]), y, w) for t in bars for y, w in zip(t.y, t.width))
    want = sorted((g.degree, (g.ranks[0] + g.ranks[-1]) / 2, g.ranks[-1] - g.ranks[0] + 0.86)
                  for m in ref.micro_steps for g in m.groups)
    assert [d for d, _, _ in drawn] == [d for d, _, _ in want]
    assert [y for _, y, _ in drawn] == pytest.approx([y for _, y, _ in want])
    assert [w for _, _, w in drawn] == pytest.approx([w for _, _, w in want])
    assert len({t.marker.color for t in bars}) == len(bars)  # every degree its own colour
    assert list(panel.fig_timeline.layout.yaxis.tickvals) == list(range(ref.num_gpus))
    # a GPU in no group waits the whole pass: drawn as a wait on its row
    waits = [t for t in panel.fig_timeline.data if t.name == "waiting for the pass to end"]
    idle_rows = set(range(ref.num_gpus)) - {r for m in ref.micro_steps for g in m.groups for r in g.ranks}
    assert idle_rows <= ({int(y) for t in waits for y in t.y})


@pytest.mark.long
def test_solver_panel_plans_48_gpus_in_nodes_of_8_with_groups_of_any_size():
    """48 GPUs (6 nodes of 8): the panel offers 48 and the cluster's candidate degrees (divisors of the
    node, whole nodes in twos and threes, the cluster), and shows the plan run_planner makes for the
    same scenario, with its idle share: one 48-GPU group, none idle. Restricted to the powers of two
    (the degree toggles, as a user clicks them) 13 GPUs are in no group."""
    from widgets import SolverPanel

    fields = dict(ANY_SIZE, num_gpus=48, gpus_per_node=8, source=",".join(map(str, BATCH_48)))
    sc, ref = _reference(**fields)
    panel = SolverPanel(sc, auto=False)
    assert panel.w_gpus.value == 48 and panel.w_per_node.value == 8
    assert {8, 16, 24, 40, 48, 56, 64, 512} <= set(panel.w_gpus.options) and 12 not in panel.w_gpus.options
    assert list(panel._degree_buttons) == [1, 2, 4, 8, 16, 24, 32, 48]  # 1,2,4,8 | 8x(1,2,4) | 8x(3,6) | the cluster
    assert panel.w_degrees_auto.value and all(b.disabled for b in panel._degree_buttons.values())
    assert panel.scenario.degrees == () and panel.scenario.cluster().degrees == (1, 2, 4, 8, 16, 24, 32, 48)
    assert "1·2·4·8·16·32 | 1·2·4·8·16·48 | 1·2·4·8·24·48" in html.unescape(panel.degrees_line.value)
    res = panel.solve(["flexsp"], pass_bound=False)  # the bounds of shapes of any size: test_any_size_plans.py
    _check_panel_shows(panel, res, ref)
    assert [(g.degree, g.cp) for m in ref.micro_steps for g in m.groups] == [(48, 6)]  # 8x6 over every GPU
    assert "idle GPU-time 0.0%, " in html.unescape(panel.status.value)
    chains = {tuple(c["degrees"]): c for c in ref.stats["chains"]}
    assert f"flexsp planned 1·2·4·8·16·32 ({chains[(1, 2, 4, 8, 16, 32)]['swapped_ms'] / 1e3:.3f}s)" in html.unescape(
        panel.degrees_line.value)
    # the powers of two only, chosen on the toggles: untick auto (every candidate on), then 24 and 48
    panel.w_degrees_auto.value = False
    assert all(b.value and not b.disabled for b in panel._degree_buttons.values())
    panel._degree_buttons[24].value = False
    panel._degree_buttons[48].value = False
    assert panel.scenario.degrees == (1, 2, 4, 8, 16, 32)
    sc2, ref2 = _reference(**dict(fields, degrees=(1, 2, 4, 8, 16, 32)))
    assert panel.scenario.cluster() == sc2.cluster()
    # this time through the threaded path a click takes (its lockstep pass bound, seconds here, not awaited)
    panel.set(compare=False)
    assert panel.request_solve(debounce=False) is not None and panel.wait_idle(120)
    panel._bounds.cancel()
    res2 = panel.result
    assert list(res2) == ["flexsp"] and res2.scenario.degrees == (1, 2, 4, 8, 16, 32)
    _check_panel_shows(panel, res2, ref2)
    share, free = _idle_by_hand(ref2)
    assert free == 13 and share > 0.25  # 48 - 32 - 2 - 1 GPUs have no group
    assert "(13 of 48 GPUs in no group)" in html.unescape(panel.status.value)
    assert ref2.makespan_ms > 1.3 * ref.makespan_ms


def test_lengths_panel_static_degree_that_does_not_divide_the_gpus():
    """48 GPUs: a static layout of degree 32 has one replica and leaves 16 GPUs idle; the control says
    so, and the token-balanced loads are those of that one replica (every sequence on it)."""
    from widgets import LengthsPanel

    sc = Scenario(**dict(ANY_SIZE, num_gpus=48, gpus_per_node=8, source=",".join(map(str, BATCH_48))))
    panel = LengthsPanel(sc, auto=False)
    labels = {v: k for k, v in panel.w_degree.options}
    assert list(labels) == [1, 2, 4, 8, 16, 24, 32, 48]
    assert labels[32] == "32 (1 replica, 16 GPUs idle)" and labels[16] == "16 (3 replicas)" and labels[48] == "48 (1 replica)"
    panel.set(static_degree=32, batches=1)
    imb = panel.refresh()["imbalance"]
    cost = sc.cost()
    assert (imb["degree"], imb["replicas"], imb["idle_gpus"]) == (32, 1, 16)
    assert imb["batches"][0]["loads_ms"] == pytest.approx([float(cost.time(list(BATCH_48), 32).sum())
                                                          + cost.group_overhead_ms(32)])


def test_solver_panel_plans_one_node_of_6_gpus():
    """One node of 6 GPUs: every degree 1..6 is a candidate; the plan run_planner makes for the same
    scenario (groups of 6) is what the panel shows, with no GPU idle; with the powers of two only one
    GPU has no group; with groups of 3 only they sit on ranks 0-2 and 3-5 (an offset that is
    not a power of two). The GPU count and node size are reached through the controls, as a user
    picks them. Solved without the lockstep pass bound (``solve(pass_bound=False)``), whose packing
    bound is then the quick one."""
    from widgets import SolverPanel
    from workbench.solve.bound import step_bound_ms

    panel = SolverPanel(Scenario(**dict(ANY_SIZE, num_gpus=8, gpus_per_node=8, source=",".join(map(str, BATCH_6)))),
                        auto=False)
    assert 6 in panel.w_per_node.options
    panel.w_per_node.value = 6  # 8 GPUs are not whole nodes of 6: said beside the cluster controls
    assert panel.w_gpus.value == 8 and "multiple of gpus_per_node" in panel.n_cluster.value
    assert [1, 2, 3, 4, 5, 6, 12, 18] == [x for x in panel.w_gpus.options if x != 8][:8]
    panel.w_gpus.value = 6
    assert panel.n_cluster.value == "" and (panel.scenario.num_gpus, panel.scenario.gpus_per_node) == (6, 6)
    assert list(panel._degree_buttons) == [1, 2, 3, 4, 5, 6]
    sc, ref = _reference(**dict(ANY_SIZE, num_gpus=6, gpus_per_node=6, source=",".join(map(str, BATCH_6))))
    assert panel.scenario.cluster() == sc.cluster()
    res = panel.solve(["flexsp"], pass_bound=False)  # the bounds of shapes of any size: test_any_size_plans.py
    _check_panel_shows(panel, res, ref)
    # without the lockstep pass bound the packing bound is the quick one, final (nothing "on its way")
    assert res.packing_bound_ms == pytest.approx(step_bound_ms(res.batch.lengths, res.scenario.cost(), res.values(),
                                                               passes=False), rel=1e-12)
    assert not res.pass_bound_pending and "on its way" not in panel.status.value and not panel._bounds.busy()
    assert _idle_by_hand(ref)[1] == 0
    assert {g.degree for m in ref.micro_steps for g in m.groups} - {1, 2, 4, 8}  # a size not a power of two
    panel.set(degrees=(1, 2, 4))
    assert [(d, b.value) for d, b in panel._degree_buttons.items()] == [(1, True), (2, True), (3, False), (4, True),
                                                                        (5, False), (6, False)]
    _, ref2 = _reference(**dict(ANY_SIZE, num_gpus=6, gpus_per_node=6, source=",".join(map(str, BATCH_6)),
                                degrees=(1, 2, 4)))
    res2 = panel.solve(["flexsp"], pass_bound=False)
    _check_panel_shows(panel, res2, ref2)
    assert _idle_by_hand(ref2)[1] == 1 and "(1 of 6 GPUs in no group)" in html.unescape(panel.status.value)
    assert ref2.makespan_ms > ref.makespan_ms
    panel.set(degrees=(3,))
    _, ref3 = _reference(**dict(ANY_SIZE, num_gpus=6, gpus_per_node=6, source=",".join(map(str, BATCH_6)), degrees=(3,)))
    _check_panel_shows(panel, panel.solve(["flexsp"], pass_bound=False), ref3)
    threes = [t for t in panel.fig_timeline.data if t.name == "degree 3"]
    assert threes and 4.0 in list(threes[0].y)  # a group of 3 on ranks 3-5


# ------------------------------------------------------------------------------------------------
# Lengths panel
# ------------------------------------------------------------------------------------------------


def test_lengths_panel_data_behind_the_figures():
    from widgets import LengthsPanel
    from workbench.data import load_lengths

    panel = LengthsPanel(Scenario(**SMALL), auto=False, batches=4)
    d = panel.refresh()
    raw = load_lengths("wikipedia", samples=20_000, seed=0).lengths.astype(np.int64)  # the same draw, loaded here
    ml = d["max_len"]
    assert d["summary"]["count"] == raw.size and d["summary"]["max"] == int(raw.max())
    # bins: powers of two; shares of sequences, tokens and s^2 by hand
    b = d["profile"]["bins"]
    k = np.floor(np.log2(raw)).astype(int)
    for i, lo in enumerate(b["edges"][:-1]):
        sel = k == int(round(np.log2(lo)))
        assert b["counts"][i] == int(sel.sum())
        assert b["work_share"][i] == pytest.approx(float((raw[sel].astype(float) ** 2).sum() / (raw.astype(float) ** 2).sum()))
    assert d["profile"]["cdf"]["work"][-1] == pytest.approx(1.0)
    # the max-context policy (clip): the sequences over it and the tokens cut, by hand
    over = raw[raw > ml]
    assert d["policy"]["affected"] == over.size
    assert d["policy"]["tokens_removed"] == int((over - ml).sum())
    # the figures hold those numbers
    assert list(panel.fig_hist.data[0].y) == b["counts"]
    assert panel.fig_cdf.data[2].y[-1] == pytest.approx(100.0)
    assert sum(panel.fig_policy.data[0].y) == over.size
    imb = d["imbalance"]
    assert len(imb["batches"]) == 4
    for bt in imb["batches"]:
        assert bt["imbalance"] == pytest.approx(max(bt["loads_ms"]) / statistics.mean(bt["loads_ms"]))


def test_token_balanced_loads_by_hand():
    from workbench.report.lengths import token_balanced_loads

    cost = Scenario(**SMALL).cost()
    # two replicas of degree 4; 1,300 tokens -> 650 each: [1000] on replica 0, [100, 100, 100] on replica 1
    res = token_balanced_loads([np.array([1000, 100, 100, 100])], cost, 4)
    c = cost.group_overhead_ms(4)
    t = lambda s: float(cost.time([s], 4)[0])  # noqa: E731
    loads = res["batches"][0]["loads_ms"]
    assert res["replicas"] == 2
    assert loads == pytest.approx([t(1000) + c, 3 * t(100) + c])
    assert res["batches"][0]["tokens"] == [1000, 300] and res["idle_gpus"] == 0
    # a degree that does not divide the GPUs: 8 // 3 = 2 replicas, 2 GPUs idle; 650 tokens each again
    res3 = token_balanced_loads([np.array([1000, 100, 100, 100])], cost, 3)
    c3, t3 = cost.group_overhead_ms(3), (lambda s: float(cost.time([s], 3)[0]))  # noqa: E731
    assert res3["replicas"] == 2 and res3["idle_gpus"] == 2
    assert res3["batches"][0]["loads_ms"] == pytest.approx([t3(1000) + c3, 3 * t3(100) + c3])
    with pytest.raises(ValueError, match="candidate degree"):
        token_balanced_loads([np.array([1])], Scenario(**dict(SMALL, degrees=(1, 2, 4, 8))).cost(), 3)


def test_lengths_policy_split_keeps_every_token():
    from widgets import LengthsPanel

    panel = LengthsPanel(Scenario(**SMALL), auto=False)
    panel.set(policy="split", max_len=8192)
    d = panel.refresh()
    assert d["policy"]["tokens_removed"] == 0
    assert d["after_policy"]["tokens"] == d["summary"]["tokens"]
    assert d["after_policy"]["max"] <= 8192


# ------------------------------------------------------------------------------------------------
# Hardware panel
# ------------------------------------------------------------------------------------------------


def test_hardware_panel_curves_points_and_save(tmp_path):
    from widgets import HardwarePanel
    from workbench.specs import load_profile

    # a profile written here, with two measured packs: the panel's curves, points and residuals
    # are checked against the coefficients typed in below
    fwd, bwd = {"a": 1e-5, "b": 0.02, "c": 2.0}, {"a": 2e-5, "b": 0.03, "c": 3.0}
    meas = [{"pack": [1024], "tokens": 1024, "forward_ms": 35.0, "backward_ms": 60.0},
            {"pack": [256, 256], "tokens": 512, "forward_ms": 12.0, "backward_ms": 20.0}]
    mine = tmp_path / "bench.json"
    mine.write_text(json.dumps({"name": "bench", "gpu": "test", "model": "tiny", "forward": fwd, "backward": bwd,
                                "all_to_all_gbps": {"2": 0.5, "4": 0.4}, "allreduce_gbps": {"4": 0.3},
                                "gpu_memory_gb": 8.0, "provenance": {"kind": "measured", "measurements": meas}}))
    panel = HardwarePanel(str(mine), root=tmp_path)
    c = panel.curves()
    i = c["lengths"].index(1024)
    assert c["forward_ms"][i] == pytest.approx(1e-5 * 1024**2 + 0.02 * 1024 + 2.0)
    assert c["total_ms"][i] == pytest.approx(c["forward_ms"][i] + 2e-5 * 1024**2 + 0.03 * 1024 + 3.0)
    pts = panel.points()
    assert [(p["kind"], p["tokens"]) for p in pts] == [("forward", 1024), ("backward", 1024), ("forward", 512),
                                                       ("backward", 512)]
    fit_pack = 2 * (1e-5 * 256**2 + 0.02 * 256) + 2.0  # two sequences, one call
    assert pts[2]["fitted_ms"] == pytest.approx(fit_pack)
    assert pts[2]["relative_error"] == pytest.approx(12.0 / fit_pack - 1)
    # measured markers (single-sequence packs), residuals of every pack, bandwidth by group size
    markers = [t for t in panel.fig_compute.data if t.mode == "markers"]
    assert [list(t.x) for t in markers] == [[1024], [1024]]
    assert sorted(len(t.x) for t in panel.fig_residuals.data) == [2, 2]
    assert list(panel.fig_bandwidth.data[0].x) == [2, 4] and list(panel.fig_bandwidth.data[0].y) == [0.5, 0.4]
    # save, load back, and tell listeners
    seen = []
    panel.on_profile(seen.append)
    out = panel.save_profile(str(tmp_path / "copy"))
    assert out.suffix == ".json" and load_profile(out) == panel.profile
    panel.select("a100-40g-flexsp")
    assert seen == ["a100-40g-flexsp"] and panel.points() == [] and panel.profile.name == "a100-40g-flexsp"
    panel.load(str(out))
    assert panel.profile.name == "bench" and seen[-1] == str(out)
    with pytest.raises(ValueError):
        panel.select("no-such-profile")
    # saving the panel's results (figures and tables) is another thing than saving the profile
    saved = panel.save(tmp_path / "results")
    assert {Path(p).name for p in saved["figures"]} >= {"compute.html", "bandwidth.html", "residuals.html"}
    assert json.loads((tmp_path / "results/tables/profile.json").read_text())["name"] == "bench"


def test_hardware_panel_shows_cp_collectives_and_split_extras(tmp_path):
    """The bandwidth figure draws the all-gather and reduce-scatter (context parallelism's and FSDP's)
    beside the all-to-all, bandwidth on the left and latency on the right; the extras figure draws
    Ulysses' and CP's measured extras and the composite splits' residual beyond them; both checked
    against the figures typed into the profile."""
    from widgets import HardwarePanel

    mine = tmp_path / "cp.json"
    mine.write_text(json.dumps({
        "name": "cp", "gpu": "test", "model": "tiny", "forward": {"a": 1e-5, "b": 0.02, "c": 2.0},
        "backward": {"a": 2e-5, "b": 0.03, "c": 3.0}, "gpu_memory_gb": 8.0, "provenance": {"kind": "measured"},
        "all_to_all_gbps": {"2": 0.5, "4": 0.4}, "all_to_all_latency_ms": {"2": 0.2, "4": 0.3},
        "allgather_gbps": {"2": 0.6, "4": 0.9}, "allgather_latency_ms": {"2": 0.15, "4": 0.25},
        "reduce_scatter_gbps": {"2": 0.35, "4": 0.7}, "reduce_scatter_latency_ms": {"2": 0.1, "4": 0.3},
        "sp_overhead_ms": {"2": 5.0}, "sp_token_ms": {"2": 0.001},
        "cp_overhead_ms": {"2": 4.0, "4": 6.0}, "cp_token_ms": {"2": 0.002, "4": 0.003},
        "cp_attention_factor": {"2": 0.3},
        "split_overhead_ms": {"4x2": 0.5, "2x2": 1.5}, "split_token_ms": {"2x2": 0.004}}))
    panel = HardwarePanel(str(mine), root=tmp_path)
    links = panel.links()
    assert links["allgather"] == {2: {"gbps": 0.6, "latency_ms": 0.15}, 4: {"gbps": 0.9, "latency_ms": 0.25}}
    assert links["reduce_scatter"][4] == {"gbps": 0.7, "latency_ms": 0.3} and "p2p" not in links
    by = {(t.name, t.xaxis): t for t in panel.fig_bandwidth.data}
    a2a = next(t for (n, ax), t in by.items() if n.startswith("all-to-all") and ax == "x")
    assert list(a2a.x) == [2, 4] and list(a2a.y) == [0.5, 0.4]
    ag = next(t for (n, ax), t in by.items() if n.startswith("all-gather") and ax == "x")
    ag_lat = next(t for (n, ax), t in by.items() if n.startswith("all-gather") and ax == "x2")
    assert list(ag.x) == [2, 4] and list(ag.y) == [0.6, 0.9] and list(ag_lat.y) == [0.15, 0.25]
    rs_lat = next(t for (n, ax), t in by.items() if n.startswith("reduce-scatter") and ax == "x2")
    assert list(rs_lat.x) == [2, 4] and list(rs_lat.y) == [0.1, 0.3]
    a2a_lat = next(t for (n, ax), t in by.items() if n.startswith("all-to-all") and ax == "x2")
    assert list(a2a_lat.y) == [0.2, 0.3]
    # the extras: fixed per micro-step (left) and per 1,000 tokens (right), per layer, by group size
    ex = panel.extras()
    assert ex["cp"] == {2: {"fixed_ms": 4.0, "per_1k_tokens_ms": pytest.approx(2.0), "attention_factor": 0.3},
                        4: {"fixed_ms": 6.0, "per_1k_tokens_ms": pytest.approx(3.0), "attention_factor": 0.0}}
    assert ex["ulysses"] == {2: {"fixed_ms": 5.0, "per_1k_tokens_ms": pytest.approx(1.0)}}
    # the composite splits, by their own key, in increasing c then u; a split without a per-token entry has 0
    assert ex["splits"] == {"2x2": {"fixed_ms": 1.5, "per_1k_tokens_ms": pytest.approx(4.0)},
                            "4x2": {"fixed_ms": 0.5, "per_1k_tokens_ms": 0.0}}
    assert list(ex["splits"]) == ["2x2", "4x2"]
    bars = {(t.name, t.xaxis): t for t in panel.fig_extras.data}
    cp_fixed = next(t for (n, ax), t in bars.items() if n.startswith("context") and ax == "x")
    cp_tok = next(t for (n, ax), t in bars.items() if n.startswith("context") and ax == "x2")
    assert list(cp_fixed.x) == ["2", "4"] and list(cp_fixed.y) == [4.0, 6.0]
    assert list(cp_tok.y) == pytest.approx([2.0, 3.0])
    cp_attn = next(t for (n, ax), t in bars.items() if n.startswith("context") and ax == "x3")
    assert list(cp_attn.x) == ["2", "4"] and list(cp_attn.y) == [0.3, 0.0]
    split_fixed = next(t for (n, ax), t in bars.items() if n.startswith("composite") and ax == "x")
    split_tok = next(t for (n, ax), t in bars.items() if n.startswith("composite") and ax == "x2")
    assert list(split_fixed.x) == ["2x2", "4x2"] and list(split_fixed.y) == [1.5, 0.5]
    assert list(split_tok.x) == ["2x2", "4x2"] and list(split_tok.y) == pytest.approx([4.0, 0.0])
    assert not any(n.startswith("composite") and ax == "x3" for n, ax in bars)
    assert panel.fig_extras._wb_box.layout.display == ""
    saved = panel.save(tmp_path / "results")
    assert "extras.html" in {Path(p).name for p in saved["figures"]}
    tables = json.loads((tmp_path / "results/tables/links.json").read_text())
    assert tables["allgather"]["2"] == {"gbps": 0.6, "latency_ms": 0.15}
    extras = json.loads((tmp_path / "results/tables/extras.json").read_text())
    assert extras["splits"]["2x2"] == {"fixed_ms": 1.5, "per_1k_tokens_ms": pytest.approx(4.0)}
    # a reference profile without them: no extras drawn (the box hidden), no all-gather line
    panel.select("a100-40g-flexsp")
    assert panel.extras() == {"ulysses": {}, "cp": {}, "splits": {}} and len(panel.fig_extras.data) == 0
    assert panel.fig_extras._wb_box.layout.display == "none"
    assert not any(t.name.startswith("all-gather") for t in panel.fig_bandwidth.data)


def test_hardware_panel_shows_the_host_link_and_host_memory(tmp_path):
    """The host side of a profile, per GPU alone, per GPU when the whole node copies (the node's total
    over its GPUs) and host memory per node, with where the figures come from; checked against the
    numbers read here from the shipped profile's JSON, a measured profile's and one without a link."""
    from widgets import HardwarePanel

    ref = json.loads((ROOT / "workbench/profile/reference/h100-80g.json").read_text())
    panel = HardwarePanel("h100-80g", root=tmp_path)
    h = panel.host()
    assert h["per_gpu_gbps"] == ref["host_link_gbps"] and h["node_gbps"] == ref["host_link_node_gbps"]
    assert h["per_gpu_node_gbps"] == pytest.approx(ref["host_link_node_gbps"] / ref["gpus_per_node"])
    assert h["host_memory_gb"] == ref["host_memory_gb"] and h["offload"]
    assert h["note"] == ref["provenance"]["host_link"] and h["kind"] == "estimate"
    shown = html.unescape(panel.host_view.value)
    assert f"{ref['host_link_gbps']:.3g} GB/s" in shown
    assert f"{ref['host_link_node_gbps'] / ref['gpus_per_node']:.3g} GB/s per GPU" in shown
    assert f"node total {ref['host_link_node_gbps']:.3g} GB/s" in shown
    assert f"{ref['host_memory_gb']:,.0f} GB" in shown and ref["provenance"]["host_link"] in shown
    # a measured profile: its own note and the GPUs that copied at once (no gpus_per_node field)
    base = {"gpu": "test", "model": "tiny", "forward": {"a": 1e-5, "b": 0.02, "c": 2.0},
            "backward": {"a": 2e-5, "b": 0.03, "c": 3.0}, "gpu_memory_gb": 8.0, "all_to_all_gbps": {"2": 0.5}}
    mine = tmp_path / "gpu.json"
    mine.write_text(json.dumps({**base, "name": "gpu", "host_link_gbps": 40.0, "host_link_node_gbps": 120.0,
                                "host_memory_gb": 512.0,
                                "provenance": {"kind": "measured", "host": "node7", "host_link_gpus": 4,
                                               "host_link": "measured on node7: pinned copies"}}))
    h = panel.select(str(mine)) and panel.host()
    assert h["per_gpu_node_gbps"] == pytest.approx(120.0 / 4) and h["note"] == "measured on node7: pinned copies"
    shown = html.unescape(panel.host_view.value)
    assert "30 GB/s per GPU" in shown and "measured on node7" in shown and "512 GB" in shown
    # no host link (a CPU profile): said so; a measured profile's provenance.host (its machine) is no note
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({**base, "name": "cpu", "host_memory_gb": 16.0,
                               "provenance": {"kind": "measured", "host": "laptop"}}))
    panel.select(str(cpu))
    h = panel.host()
    assert not h["offload"] and h["note"] is None and h["per_gpu_node_gbps"] is None
    assert "none: plans do not offload" in html.unescape(panel.host_view.value)
    assert panel.tables()["host"]["host_memory_gb"] == 16.0


def test_hardware_panel_without_the_profiler_says_so(tmp_path, monkeypatch):
    import widgets.hardware as hw

    monkeypatch.setattr(hw, "_profiler", lambda: None)
    panel = hw.HardwarePanel(root=tmp_path)
    assert panel.b_run.disabled and "no profiler" in panel.run_status.value
    with pytest.raises(RuntimeError, match="no profiler"):
        panel.start_profile()


# ------------------------------------------------------------------------------------------------
# Workbench: settings handed on
# ------------------------------------------------------------------------------------------------


def test_workbench_hands_settings_on(tmp_path):
    from widgets import Workbench

    wb = Workbench(Scenario(**SMALL), root=tmp_path, auto=False)
    assert [wb.tabs.get_title(i) for i in range(5)] == ["Hardware", "Lengths", "Solver", "Launch", "Runs"]
    wb.lengths.set(source="github", max_len=16384)
    assert wb.solver.scenario.source == "github" and wb.solver.scenario.max_len == 16384
    wb.solver.set(num_gpus=16, planner="two-stage")
    assert wb.lengths.scenario.num_gpus == 16
    assert wb.scenario.source == "github" and wb.scenario.planner == "two-stage"
    wb.hardware.select("h100-80g")
    assert wb.solver.scenario.profile == "h100-80g" and wb.lengths.scenario.profile == "h100-80g"
    # "train with these settings": the planning scenario goes to Launch, and Launch is shown
    wb.solver.b_train.click()
    s = wb.launch.settings()
    assert s["source"] == "github" and s["planner"] == "two-stage" and s["samples"] == 20_000
    assert s["model"] == "tiny" and s["max_len"] <= 1024  # kept small for this CPU machine, and said so
    assert "Kept for this CPU machine" in wb.launch.settings_note.value
    assert wb.tabs.selected_index == 3


def test_big_scatters_are_drawn_with_webgl():
    from workbench.report.runs import live_run_figure

    many = {"step": list(range(1, 5001)), "loss": [1.0] * 5000, "measured_ms": [2.0] * 5000, "predicted_ms": [2.0] * 5000}
    assert {t.type for t in live_run_figure(many).data} == {"scattergl"}
    few = {k: v[:20] for k, v in many.items()}
    assert {t.type for t in live_run_figure(few).data} == {"scatter"}


def test_panels_save_figures_and_tables(tmp_path, solved):
    panel, _ = solved
    saved = panel.save(tmp_path)
    names = {Path(p).name for p in saved["figures"]}
    assert {"timeline.html", "planners.html", "work.html", "memory.html"} <= names
    assert (tmp_path / "figures" / "plotly.min.js").is_file()  # the pages open offline
    page = (tmp_path / "figures" / "timeline.html").read_text()
    assert "cdn.plot.ly" not in page and 'src="plotly.min.js"' in page
    rows = json.loads((tmp_path / "tables" / "planners.json").read_text())
    assert {r["planner"] for r in rows} == set(DEFAULT_PLANNERS)


# ------------------------------------------------------------------------------------------------
# Launch and Runs panels: real torchrun runs (slow)
# ------------------------------------------------------------------------------------------------

TINY = dict(max_len=512, batch_tokens=8192, effort=0.3)
# a smaller quick grid than test_profile_run.py's for the profile runs the panels start: what a panel does with
# a profile run does not depend on how many lengths it measures nor how often (the default quick grid takes
# 4-5x longer, ~50 s of CPU for 2 ranks; this one ~9 s, most of it starting processes), and it still prices
# every term (the fixed costs of a pass and a micro-step, the head)
SMALL_GRID = dict(max_len=256, reps=1, warmup=0, collective_reps=1, min_sample_ms=5.0)


# the planning the kernel drives before it launches: every planner on a 16K-token batch at a small effort (what
# is checked there is that planning never imports torch, not the plans; QUICK's solve took ~1 s more of CPU)
KERNEL_PLAN = dict(SMALL, batch_tokens=16_384, effort=0.05)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """One fresh interpreter, as a notebook's kernel, drives every panel through a session whose
    run store's only cached profile of this machine was damaged (a half-written file): it plans
    with the Solver and Lengths panels, builds the Workbench, and its Launch panel (sized by
    ``profile_options``: ``SMALL_GRID``, progress read every 0.2 s) launches

    - run ``a`` (static-max, no profile of its own): the launch passes over the damaged profile and
      measures this machine, with its progress on the panel, then plans with it; the run goes on
      (a sleep in each step) until a second Launch panel, built as after a page reload, finds it
      live, follows it and stops it after its third step;
    - run ``b`` (greedy, 3 steps, the shipped ``cpu-gloo-tiny``: another machine's profile), which
      runs to the end.

    In between the panel asks for this machine's profile again (reused, not measured). Then it
    writes a cluster script and starts measuring this machine in an empty store (stopped at once:
    the measurement runs in its own process tree). Its observations come back as JSON on its last
    line; the run store (the two runs, the profile runs) is read here. Returns ``(root, (a, b),
    obs, empty, p)``: ``obs`` None when the kernel failed (``p`` its process)."""
    from workbench import runs
    from workbench.profile.machine import machine_fingerprint

    tmp = tmp_path_factory.mktemp("kernel")
    root, empty = tmp / "runs", tmp / "measure"
    damaged = runs.new_run("profile", {"model": "tiny", "nproc": 2, "quick": True, "fingerprint": machine_fingerprint(2)},
                           root=root)
    damaged.file(runs.PROFILE_FILE).write_text('{"name": "cut sho')
    runs.update_status(damaged.path, state="done")
    script = textwrap.dedent(f"""
        import json, sys, time
        from widgets import LaunchPanel, LengthsPanel, RunsPanel, SolverPanel, Workbench
        from workbench import runs
        from workbench.profile.machine import ensure_machine_profile
        from workbench.scenario import Scenario
        obs = {{"damaged": {damaged.id!r}}}
        sc = Scenario(**{KERNEL_PLAN!r})
        SolverPanel(sc, auto=False).solve()
        LengthsPanel(sc, auto=False).refresh()
        wb = Workbench(sc, root={str(root)!r}, auto=False)
        first = wb.launch
        first.profile_options, first.poll_interval = {SMALL_GRID!r}, 0.2
        seen = []
        first.progress.observe(lambda ch: first.progress.max == 100 and seen.append(ch["new"]), names="value")

        def until(step):
            deadline = time.monotonic() + 300
            while (first.refresh().step or 0) < step:
                if time.monotonic() > deadline:
                    sys.exit(f"no step {{step}} within 300 s: " + "\\n".join(first.run.log_tail(30)))
                time.sleep(0.2)

        # a: no profile of its own, so the launch measures this machine first and plans with it
        a = first.launch(planner="static-max", steps=200, nproc=2, debug={{"step_sleep_s": 0.5}}, **{TINY!r})
        mp = first.machine_profile
        obs["a"], obs["profile_progress"] = a.id, list(seen)
        obs["measured"] = [mp.run.id, mp.measured, str(mp.path), mp.fingerprint]
        obs["a_note"] = first.profile_note.value
        until(3)
        # a new panel (as after a kernel restart or a page reload) finds the live run and follows it
        second = LaunchPanel(root={str(root)!r})
        obs["second"] = [second.run.id if second.run else None, second.handle is not None, second.state,
                         second.status.value]
        finished = []
        second.on_finished(finished.append)
        obs["stop_state"] = second.stop().state
        second.refresh()
        obs["finished"] = [r.id for r in finished]
        obs["second_final"] = second.final.state if second.final else None
        obs["first_after"] = first.refresh().state  # the panel that started it sees the end too (and reaps)
        second.close()
        # what a launch without a profile of its own plans with now: the profile just measured, reused
        again = first.machine_profile_for(2)
        obs["machine_profile"] = [again.run.id, again.measured]
        # b: a profile of its own (the shipped one, another machine's): nothing measured, the run says so
        b = first.launch(planner="greedy", steps=3, nproc=2, profile="cpu-gloo-tiny", **{TINY!r})
        obs["b"], obs["b_machine_profile"] = b.id, first.machine_profile is not None
        st = first.wait(timeout=300)
        obs["b_state"], obs["b_final"], obs["run"] = st.state, first.final.state, first.run.id
        obs["b_note"] = first.profile_note.value
        obs["b_summary_note"] = runs.load_run(b.path).summary().get("profile_note")
        obs["progress"] = [first.progress.value, first.progress.max, first.progress.bar_style]
        obs["fig"] = [list(first.fig.data[0].x), list(first.fig.data[0].y), list(first.fig.data[2].y)]
        obs["log_lines"], obs["status"] = first.log_lines, first.status.value
        obs["profile_runs"] = [r.id for r in runs.list_runs({str(root)!r}, kind="profile")]
        first.cluster_script("slurm", nnodes=2, run_root={str(tmp / "shared")!r})
        # the path that measures this machine: its profile run started, polled with progress, stopped
        seen, obs["measure"] = [], None
        try:
            ensure_machine_profile(2, root={str(empty)!r}, timeout=0.0, progress=lambda f, m: seen.append(m))
        except RuntimeError as e:
            obs["measure"] = [str(e), len(seen)]
        obs["torch"] = "torch" in sys.modules
        print(json.dumps(obs))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, cwd=ROOT)
    obs = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None
    found = {r.id: r for r in runs.list_runs(root, kind="train")}
    a, b = (found.get(obs[k]) for k in "ab") if obs else (None, None)
    return root, (a, b), obs, empty, p


def _kernel(two_runs) -> dict:
    """``two_runs``' observations, or the kernel's stderr as the failure."""
    *_, obs, _, p = two_runs
    assert p.returncode == 0 and obs is not None, (p.stdout[-2000:], p.stderr[-3000:])
    return obs


@pytest.mark.slow
def test_launch_panel_plans_cpu_runs_with_this_machines_profile(two_runs):
    """The first launch (``a``) passed over the damaged profile and measured this machine (a quick
    profile for 2 processes on the panel's grid, its progress on the panel up to the end) and
    planned with it; asked again, the panel reuses it; a launch with a profile of its own (``b``)
    measures nothing."""
    from workbench import runs
    from workbench.profile.machine import find_machine_profile
    from workbench.specs import load_profile

    root, (a, b), _, _, _ = two_runs
    obs = _kernel(two_runs)
    rid, measured, path, fingerprint = obs["measured"]
    first = runs.load_run(root / rid)
    assert measured and rid != obs["damaged"], obs
    assert obs["machine_profile"] == [rid, False], obs  # reused, not measured again
    assert sorted(obs["profile_runs"]) == sorted(r.id for r in runs.list_runs(root, kind="profile")) == sorted(
        [obs["damaged"], rid]), obs  # b measured nothing
    assert first.spec()["fingerprint"]["nproc"] == 2 and first.status().state == "done"
    spec = first.spec()
    assert {k: spec[k] for k in SMALL_GRID} == SMALL_GRID and spec["quick"] is True, spec
    # measured on a smaller grid, it is this machine's profile all the same: found without any options
    assert find_machine_profile(2, root=root).run == first
    assert Path(path) == first.file(runs.PROFILE_FILE)
    prof = load_profile(path)
    assert prof.provenance["fingerprint"]["key"] == fingerprint["key"] and prof.pass_overhead_ms
    assert prof.head_ms_per_token and prof.micro_step_ms is not None
    seen = obs["profile_progress"]  # up to the end of the measurement (then the bar is set up for the steps)
    assert 100 in seen and seen[:seen.index(100)] == sorted(seen[:seen.index(100)]) and len(seen[:seen.index(100)]) > 2
    assert a.spec()["scenario"]["profile"] == path
    res = a.status().resolved
    assert res["profile_from_this_machine"] is True and not res.get("profile_note")
    assert "planned with this machine's quick profile" in html.unescape(obs["a_note"])
    # b: planned with the shipped profile, another machine's; the panel and the run's summary say so
    assert not obs["b_machine_profile"], obs
    assert b.spec()["scenario"]["profile"] == "cpu-gloo-tiny"
    assert "cpu-gloo-tiny is from another machine" in obs["b_note"], obs
    assert "another machine" in obs["b_summary_note"], obs


def test_launch_panel_profile_options_size_only_a_new_measurement(tmp_path):
    """The panel's ``profile_options`` say how this machine is measured when it has no profile yet:
    a cached profile (seeded on the default grid, no sizes in its spec) is reused whatever they say,
    and a setting that is not a size, or a bad size, is refused in one line before anything is
    measured or the cache is read. (A measurement on them is ``two_runs``'s.)"""
    from conftest import seed_machine_profile
    from widgets import LaunchPanel
    from workbench import runs

    seeded = seed_machine_profile(tmp_path)
    panel = LaunchPanel(root=tmp_path, follow=False, reattach=False, profile_options={"reps": 1, "max_len": 256})
    mp = panel.machine_profile_for(2)
    assert mp.run == seeded and not mp.measured
    assert "reused from the cache" in panel.profile_note.value
    for bad, word in (({"steps": False}, "steps"), ({"reps": 0}, "reps"), ({"max_len": 10}, "max_len")):
        other = LaunchPanel(root=tmp_path, follow=False, reattach=False, profile_options=bad)
        with pytest.raises(ValueError, match=word) as e:
            other.machine_profile_for(2)
        assert len(str(e.value).splitlines()) == 1
    assert [r.id for r in runs.list_runs(tmp_path, kind="profile")] == [seeded.id]


@pytest.mark.slow
def test_launch_panel_runs_and_shows_progress(two_runs):
    """The panel that launched ``b`` followed it to the end: its progress, figure (the run's own
    records), log and status."""
    from workbench import runs

    root, (a, b), _, _, _ = two_runs
    obs = _kernel(two_runs)
    assert obs["run"] == b.id and obs["b_state"] == "done" and obs["b_final"] == "done", obs
    assert obs["progress"] == [3, 3, "success"], obs
    # the figure holds the run's own records
    rows = [json.loads(x) for x in (b.path / runs.METRICS_FILE).read_text().splitlines() if x.strip()]
    rank0 = {r["step"] + 1: r for r in rows if r["rank"] == 0}
    loss_x, loss_y, predicted = obs["fig"]
    assert loss_x == [1, 2, 3] and loss_y == pytest.approx([rank0[k]["loss"] for k in (1, 2, 3)])
    assert predicted == pytest.approx([rank0[k]["predicted_ms"] for k in (1, 2, 3)])
    assert any("step 3/3" in line for line in obs["log_lines"])
    assert "done" in obs["status"]
    spec = json.loads((b.path / runs.SPEC_FILE).read_text())
    assert spec["scenario"]["planner"] == "greedy" and spec["nproc"] == 2 and spec["scenario"]["max_len"] == 512


@pytest.mark.slow
def test_runs_panel_compares_measured_and_predicted(two_runs):
    from widgets import RunsPanel

    root, (a, b), *_ = two_runs
    _kernel(two_runs)
    panel = RunsPanel(root=root)
    assert len(panel.w_runs.options) == 2
    rows = panel.select([a.id, b.id], baseline=a.id)
    by_id = {r["id"]: r for r in rows}

    def medians(run):  # from metrics.jsonl, first step left out, computed here
        recs = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines() if x.strip()]
        r0 = sorted((r for r in recs if r["rank"] == 0), key=lambda r: r["step"])[1:]
        return statistics.median(r["measured_ms"] for r in r0), statistics.median(r["predicted_ms"] for r in r0)

    (ma, pa), (mb, pb) = medians(a), medians(b)
    assert by_id[a.id]["median_measured_ms"] == pytest.approx(ma)
    assert by_id[b.id]["median_predicted_ms"] == pytest.approx(pb)
    assert by_id[b.id]["speedup_over_baseline"] == pytest.approx(ma / mb)
    assert by_id[b.id]["predicted_speedup"] == pytest.approx(pa / pb)
    assert by_id[a.id]["speedup_over_baseline"] == 1.0
    assert panel.compare(a, b)["speedup_b_over_a"] == pytest.approx(ma / mb)
    # figures: one loss line per run, measured + predicted per run, speedups in the panel's order
    assert len(panel.fig_loss.data) == 2 and len(panel.fig_time.data) == 4
    assert list(panel.fig_speedup.data[0].y) == pytest.approx([1.0, ma / mb])
    panel.select([])
    assert panel.table() == [] and panel.fig_loss.data == ()


@pytest.mark.slow
def test_solver_compares_a_runs_predicted_and_measured_memory(two_runs):
    """The model states each rank counted from tensor storage against the memory model's, per rank."""
    from widgets import SolverPanel
    from workbench.cost.memory import model_states

    root, (a, _), *_ = two_runs
    _kernel(two_runs)
    panel = SolverPanel(Scenario(**SMALL), auto=False, root=root)
    panel.refresh_runs()
    assert len(panel.w_run.options) == 3  # the two runs and the prompt
    res = panel.compare_run(a)
    sc = Scenario.from_dict(json.loads((a.path / "spec.json").read_text())["scenario"])
    want = [model_states(sc.model_spec(), zero_stage=sc.zero_stage, num_ranks=2, precision=sc.precision,
                         optimizer=sc.optimizer, rank=r).states / 1e9 for r in (0, 1)]
    assert res["predicted_gb"] == pytest.approx(want)
    assert set(res["measured_gb"]) == {0, 1}
    for r in (0, 1):
        assert res["measured_gb"][r] == pytest.approx(want[r], rel=0.05)
    assert "tensor storage" in res["note"] and res["peak_measured_gb"] == {}  # CPU: no allocator peak
    assert list(panel.fig_run_memory.data[0].y) == pytest.approx(res["predicted_gb"])
    assert list(panel.fig_run_memory.data[1].y) == pytest.approx([res["measured_gb"][0], res["measured_gb"][1]])


@pytest.mark.slow
def test_driving_the_panels_never_imports_torch_into_the_kernel(two_runs):
    """``two_runs``' kernel drove the planning panels, measured this machine, launched, followed,
    reattached to and stopped runs, and started measuring this machine (stopped at its timeout)
    without importing torch (training and profiling are separate process trees)."""
    from workbench import runs
    from workbench.launch import run_alive

    *_, empty, _ = two_runs
    obs = _kernel(two_runs)
    assert obs["measure"] is not None, "measuring with a 0 s timeout did not raise"
    assert re.search(r"^measuring this machine \(profile run \S+\) took over 0 s; stopped it$", obs["measure"][0]) \
        and obs["measure"][1] >= 1, obs
    (measuring,) = runs.list_runs(empty, kind="profile")
    assert not run_alive(measuring.status())
    assert obs["torch"] is False, "driving the panels imported torch into the kernel"


@pytest.mark.slow
def test_launch_panel_stop_ends_every_process_and_reattach(two_runs):
    """``two_runs``' run ``a``: followed by a second panel that found it live, stopped from there
    with every process ended, and seen ended by the panel that started it."""
    from workbench import runs
    from workbench.launch import run_alive

    root, (a, _), _, _, _ = two_runs
    obs = _kernel(two_runs)
    rid, handle, state, status = obs["second"]
    assert rid == a.id and handle and state == "running", obs
    assert f"{a.id} (reattached): running" in status, obs
    assert obs["stop_state"] == "stopped" and obs["finished"] == [a.id] and obs["second_final"] == "stopped", obs
    st = a.status()
    assert st.state == "stopped" and runs.status_pids(st) and st.step >= 3
    assert not run_alive(st), [p for p, t in runs.status_pids(st) if runs.pid_alive(p, t)]
    assert obs["first_after"] == "stopped", obs


@pytest.mark.long
def test_background_threads_never_print(capsys):
    """Worker threads set widget values; nothing they do reaches stdout/stderr (output from a thread
    lands in whichever cell ran last)."""
    from widgets import LengthsPanel, SolverPanel

    panels = [SolverPanel(Scenario(**QUICK), auto=True, debounce=0.05), LengthsPanel(Scenario(**QUICK), auto=True)]
    for p in panels:
        assert p.wait_idle(120)
    panels[0].set(num_gpus=12)  # an error, reported in the panel
    panels[0].set(num_gpus=16)
    assert panels[0].wait_idle(120, bound=True)  # the lockstep pass bound's thread too
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


@pytest.mark.slow
def test_hardware_panel_profiles_this_machine(tmp_path):
    """A quick profile run from the panel (a torchrun tree through workbench.profile), its evidence
    drawn and its profile used; a second one stopped with nothing left."""
    from widgets import HardwarePanel
    from workbench import runs
    from workbench.launch import run_alive

    panel = HardwarePanel(root=tmp_path)
    if not panel.profiler_available:
        pytest.skip("this tree has no profiler (workbench.profile.prepare_profile, issue 10)")
    seen = []
    panel.on_profile(seen.append)
    # SMALL_GRID: 13 s of CPU for this test where max_len 512 with 2 reps after a warm-up took 19
    run = panel.start_profile(nproc=2, model="tiny", quick=True, **SMALL_GRID)
    st = panel.wait(timeout=600)
    assert st.state == "done", run.log_tail(30)
    assert panel.result is not None and panel.profile == panel.result.profile
    assert Path(seen[-1]).resolve() in (run.path.resolve(), run.file(runs.PROFILE_FILE).resolve())
    assert len(panel.fig_fit.data) > 0 and len(panel.fig_collectives.data) > 0 and len(panel.fig_residuals.data) > 0
    assert any(v == str(run.file(runs.PROFILE_FILE)) for _, v in panel.w_profile.options)  # listed as measured here
    # the profile plans: a Scenario takes the panel's reference
    from workbench.scenario import Scenario

    sc = Scenario(model="tiny", profile=panel.profile_ref, num_gpus=2, gpus_per_node=2, source="stdlib",
                  batch_tokens=8192, max_len=1024, policy="split")
    assert sc.plan(planner="greedy").makespan_ms > 0
    # Stop ends the profile run's whole tree, once both ranks are up (their pids in the status)
    other = panel.start_profile(nproc=2, model="tiny", quick=True)
    deadline = time.monotonic() + 120
    while len(((cur := other.status()).pids or {}).get("ranks") or {}) < 2:
        assert time.monotonic() < deadline and cur.state in ("created", "starting", "running"), other.log_tail(30)
        time.sleep(0.1)
    st = panel.stop()
    assert st.state == "stopped" and not run_alive(runs.load_run(other.path).status())


# ------------------------------------------------------------------------------------------------
# GPU and clusters: the Doctor section, the Launch panel's cluster script
# ------------------------------------------------------------------------------------------------


@pytest.mark.long
def test_hardware_panel_doctor_section_shows_what_this_machine_can_do(tmp_path):
    """The Doctor section runs ``workbench doctor`` as a process and shows its lines; checked against
    this machine's facts read here (Python's and torch's versions, no NVIDIA GPU on the test VM)."""
    import importlib.metadata
    import platform

    from widgets import HardwarePanel
    from workbench.training import cuda_visible

    panel = HardwarePanel(root=tmp_path)
    report = panel.run_doctor(quick=True)
    rows = panel.doctor_rows()
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == [c["name"] for c in report["checks"]]
    assert {r["status"] for r in rows} <= {"ok", "warn", "fail", "skip"}
    assert report["counts"] == {s: sum(r["status"] == s for r in rows) for s in ("ok", "warn", "fail", "skip")}
    assert by["python"]["status"] == "ok" and platform.python_version() in by["python"]["detail"]
    assert importlib.metadata.version("torch") in by["torch"]["detail"]
    assert by["training step"]["status"] in ("ok", "warn") and "left out" in by["training step"]["detail"]
    if not cuda_visible():  # a CPU machine says which lines were skipped and why
        for name in ("gpus", "nccl", "flash-attn", "topology"):
            assert by[name]["status"] == "skip" and by[name]["detail"], by[name]
    # what is shown is what the report says
    for r in rows:
        assert r["name"] in panel.doctor_section.table.value
    assert report["summary"] in panel.doctor_section.status.value


def test_launch_panel_cluster_script_runs_the_panels_settings_on_n_nodes(tmp_path):
    """The script's ``workbench train`` command, parsed by the real CLI, prepares exactly the spec the
    panel's settings make on N nodes (the reference: ``prepare_train`` of those settings)."""
    import shlex

    from widgets import LaunchPanel
    from workbench.cli import _TRAIN_SETTINGS, build_parser
    from workbench.training import prepare_train

    panel = LaunchPanel(root=tmp_path, reattach=False, follow=False)
    panel.set(steps=7, nproc=4, model="tiny", max_len=512, batch_tokens=8192, planner="flexsp", seed=3)
    text = panel.cluster_script("slurm", nnodes=3, run_root=str(tmp_path / "shared"), name="job")
    assert panel.cluster.area.value == text and "#SBATCH --nodes=3" in text and "#SBATCH --gpus-per-node=4" in text
    # the command srun runs on every node: the script's last (backslash-continued) line after srun's own
    cmd = shlex.split(text.split("workbench-node \\\n", 1)[1].replace("\\\n", " "))
    args = build_parser().parse_args(cmd[1:] + ["--node-rank", "1"])
    got = {k: getattr(args, k) for k in _TRAIN_SETTINGS if getattr(args, k, None) is not None}
    _, spec, _ = prepare_train(got, dry_run=True, on_gpu=True)
    _, want, _ = prepare_train({**panel.settings(), "nnodes": 3, "device": "cuda"}, dry_run=True, on_gpu=True)
    assert spec == want and spec.nnodes == 3 and spec.scenario.num_gpus == 12
    assert args.run_root == str((tmp_path / "shared").resolve()) and args.name == "job"
    saved = panel.save_cluster_script(tmp_path / "job.sbatch")
    assert saved.read_text() == text and saved.stat().st_mode & 0o111
    # without Slurm: one command per node, node ranks 0..N-1, node 0's endpoint on every line
    text = panel.cluster_script("torchrun", nnodes=2, run_root=str(tmp_path / "shared"), endpoint="10.1.2.3:29511",
                                name="byhand")
    lines = [shlex.split(x) for x in text.replace("\\\n", " ").splitlines() if x and not x.startswith("#")]
    assert [x[x.index("--node-rank") + 1] for x in lines] == ["0", "1"]
    assert {x[x.index("--rdzv-endpoint") + 1] for x in lines} == {"10.1.2.3:29511"}
    # settings that cannot run are refused beside the button, in one line
    panel.set(planner="nope")
    panel.cluster._guard(lambda: panel.cluster_script("slurm", nnodes=2, run_root=str(tmp_path / "s2")))
    assert "✖" in panel.cluster.status.value and "unknown planner" in panel.cluster.status.value
    assert not (tmp_path / "s2").exists()
