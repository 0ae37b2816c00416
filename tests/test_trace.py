"""Step traces (``workbench runs trace``, ``workbench.trace``), ``workbench train --torch-profile`` and the
Runs panel's step timeline.

A real 2-rank CPU run (the tiny model, 3 steps, gloo, step 2 recorded by torch.profiler) is read
back (nothing here depends on the number of ranks beyond one per process: 2 prove what 4 did, for
~7 s of CPU less): the trace JSON is checked against the trace-event format by rules written here, its parts per
rank against ``metrics.jsonl`` read here, its planned track against ``plans.jsonl``; a hand-made run
(free execution, rows written here) checks the layout and the waits by hand. ``workbench runs trace``
runs through the console script's entry in this process (``conftest.cli_main``: it starts nothing, and
an interpreter per call cost more than the check); the run itself through the console script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_main
from workbench import runs

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def _workbench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / runs.METRICS_FILE).read_text().splitlines() if x.strip()]


def _check_trace_event_format(trace: dict) -> dict:
    """The trace-event format's rules (Chrome's "Trace Event Format" document): a ``traceEvents``
    list; every event an object with ``ph``, ``ts``, ``pid`` and ``tid`` (numbers but ``ph``);
    complete events (``X``) with a name and a non-negative ``dur``; metadata (``M``) naming the
    processes. Returns ``{pid: process name}``."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    names: dict = {}
    for e in trace["traceEvents"]:
        assert isinstance(e, dict) and {"ph", "ts", "pid", "tid"} <= set(e), e
        assert isinstance(e["ph"], str) and e["ph"] in ("X", "M"), e
        for k in ("ts", "pid", "tid"):
            assert isinstance(e[k], (int, float)) and not isinstance(e[k], bool), e
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and e["name"] and isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        elif e["name"] == "process_name":
            assert e["pid"] not in names, f"process {e['pid']} named twice"
            names[e["pid"]] = e["args"]["name"]
    return names


# ------------------------------------------------------------------------------------------------
# a hand-made run: free execution on 2 ranks, rows written here
# ------------------------------------------------------------------------------------------------


def _hand_run(tmp_path, *, with_clock: bool = True):
    """Step 1 of a 2-rank free run. Rank 0: micro-step 0 (degree 2 with rank 1) from 1 ms for 30 ms,
    idle in micro-step 1, its reduction the last 52 ms of its 86 ms (it waits for rank 1); rank 1:
    micro-step 0 from 1 ms for 30 ms, micro-step 1 (degree 1) from 32 ms for 40 ms, its reduction the
    last 2 ms of its 76.5 ms; optimizer 3 ms each. Rank 1 started its step 0.5 ms after rank 0 (wall
    clock), each broadcast started 5 ms before its step and lasted 4 ms."""
    from workbench.cost import CostModel
    from workbench.solve.plan import build_plan
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, load_profile

    r = runs.new_run("train", {"kind": "train", "scenario": {"planner": "hand"}}, root=tmp_path, run_id="hand")
    cost = CostModel(load_profile("cpu-gloo-tiny"), get_model("tiny"),
                     ClusterSpec(num_gpus=2, gpus_per_node=2, gpu_memory_gb=80.0, zero_stage=0), precision="fp32")
    plan = build_plan("hand", [[(2, [0])], [(1, [1])]], [100, 60], cost, blocks=[[0], [1]]).to_dict()
    assert [[g["ranks"] for g in ms["groups"]] for ms in plan["micro_steps"]] == [[[0, 1]], [[1]]]
    runs.append_jsonl(r.file(runs.PLANS_FILE), {"step": 0, "attempt": 1, "batch_id": "b", "plan": plan})
    ms0 = {"micro_step": 0, "degree": 2, "ranks": [0, 1], "sequences": [0], "tokens": 50, "measured_ms": 30.0,
           "predicted_ms": 10.0, "groups": [{"degree": 2, "ranks": [0, 1], "sequences": [0]}]}
    idle = {"micro_step": 1, "degree": 0, "ranks": [], "sequences": [], "tokens": 0, "measured_ms": 0.0,
            "predicted_ms": 0.0, "groups": []}
    ms1 = {"micro_step": 1, "degree": 1, "ranks": [1], "sequences": [1], "tokens": 60, "measured_ms": 40.0,
           "predicted_ms": 12.0, "groups": [{"degree": 1, "ranks": [1], "sequences": [1]}]}
    if with_clock:
        ms0 = {**ms0, "start_ms": 1.0}
        idle = {**idle, "start_ms": 31.5}
        ms1 = {**ms1, "start_ms": 32.0}
    t0 = 1_700_000_000.0
    for rank, recs, red, start in ((0, [ms0, idle], 52.0, t0), (1, [ms0, ms1], 2.0, t0 + 0.0005)):
        step_ms = 86.0 if rank == 0 else 76.5
        row = {"step": 0, "rank": rank, "attempt": 1, "execution": "free", "measured_ms": step_ms + 3.0,
               "step_ms": step_ms, "allreduce_ms": red, "optimizer_ms": 3.0, "broadcast_ms": 4.0,
               "predicted_ms": plan["makespan_ms"], "micro_steps": recs, "loss": 5.0, "tokens": 50}
        if with_clock:
            row.update(start_time=start, broadcast_start_time=start - 0.005)
        runs.append_jsonl(r.file(runs.METRICS_FILE), row)
    return r, plan


def test_hand_made_free_step_by_hand(tmp_path):
    from workbench.trace import chrome_trace, step_timeline

    run, plan = _hand_run(tmp_path)
    tl = step_timeline(run, 1)
    assert tl["aligned"] and tl["execution"] == "free" and tl["ranks"] == [0, 1]
    # the origin is rank 0's broadcast start, 5 ms before its step; rank 1 starts 0.5 ms after rank 0
    # (wall-clock seconds carry about 0.2 us of resolution: starts are compared to the microsecond)
    parts = {r: [(e["cat"], round(e["start_ms"], 3), round(e["dur_ms"], 6)) for e in tl["measured"]
                 if e["rank"] == r and e["cat"].startswith("step.")] for r in (0, 1)}
    # rank 0: a hole before its micro-step, one between it and the reduction (which starts at 86 - 52 ms)
    assert parts[0] == [("step.other", 5.0, 1.0), ("step.compute", 6.0, 30.0), ("step.other", 36.0, 3.0),
                        ("step.collective", 39.0, 52.0), ("step.optimizer", 91.0, 3.0)]
    assert parts[1] == [("step.other", 5.5, 1.0), ("step.compute", 6.5, 30.0), ("step.other", 36.5, 1.0),
                        ("step.compute", 37.5, 40.0), ("step.other", 77.5, 2.5), ("step.collective", 80.0, 2.0),
                        ("step.optimizer", 82.0, 3.0)]
    for r, want in ((0, 89.0), (1, 79.5)):
        assert sum(p[2] for p in parts[r]) == pytest.approx(want) == tl["measured_ms"][r]
    bc = [e for e in tl["measured"] if e["cat"] == "collective"]
    assert [(e["rank"], round(e["start_ms"], 3), e["dur_ms"]) for e in bc] == [(0, 0.0, 4.0), (1, 0.5, 4.0)]
    # who waited: rank 0 finished its micro-steps 40 ms before rank 1 and spent 50 ms more in the reduction
    by = {s["rank"]: s for s in tl["summary"]}
    assert by[0]["work_ms"] == 30.0 and by[1]["work_ms"] == 70.0 and by[0]["waited_ms"] == 50.0 and by[1]["waited_ms"] == 0
    assert "40.0 ms before rank 1" in by[0]["note"] and "slowest" in by[1]["note"]
    # the planned track: each group at its plan time, from the first rank's step start
    g = {(m, tuple(gr["ranks"])): gr["time_ms"] for m, ms in enumerate(plan["micro_steps"]) for gr in ms["groups"]}
    pl = [e for e in tl["planned"] if e["cat"] == "planned.compute"]
    assert sorted(round(e["dur_ms"], 6) for e in pl if e["rank"] == 1) == sorted(round(v, 6) for v in g.values())
    assert [round(e["dur_ms"], 6) for e in pl if e["rank"] == 0] == [round(g[(0, (0, 1))], 6)]
    step = [e for e in tl["planned"] if e["cat"] == "planned"]
    assert len(step) == 2 and all(round(e["start_ms"], 3) == 5.0 and e["dur_ms"] == plan["makespan_ms"] for e in step)
    names = _check_trace_event_format(chrome_trace(tl))
    assert names == {0: "rank 0", 1: "rank 1"}


def test_rows_without_clocks_lay_parts_end_to_end(tmp_path):
    from workbench.trace import step_timeline

    run, _ = _hand_run(tmp_path, with_clock=False)
    tl = step_timeline(run, 1)
    assert not tl["aligned"] and tl["origin_time"] is None
    r1 = [(e["cat"], round(e["start_ms"], 6), round(e["dur_ms"], 6)) for e in tl["measured"]
          if e["rank"] == 1 and e["cat"].startswith("step.")]
    # both ranks start at 4 ms (after a 4 ms broadcast placed before the step); the micro-steps back to back,
    # the reduction where step_ms puts it, the rest "other"
    assert r1 == [("step.compute", 4.0, 30.0), ("step.compute", 34.0, 40.0), ("step.other", 74.0, 4.5),
                  ("step.collective", 78.5, 2.0), ("step.optimizer", 80.5, 3.0)]
    assert sum(x[2] for x in r1) == pytest.approx(79.5)


def test_trace_errors_are_one_line(tmp_path, capsys):
    run, _ = _hand_run(tmp_path)
    p = cli_main(capsys, "runs", "trace", "hand", "--root", str(tmp_path), "--step", "7")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "run hand has no step 7 in metrics.jsonl (step 1 is recorded)" in p.stderr
    empty = runs.new_run("train", {}, root=tmp_path, run_id="empty")
    p = cli_main(capsys, "runs", "trace", str(empty.path))
    assert p.returncode == 2 and "has measured no step yet" in p.stderr


def test_torch_profile_step_is_checked_and_kept_on_resume(tmp_path):
    from workbench.training import SpecError, prepare_train

    with pytest.raises(SpecError, match=r"torch_profile \(--torch-profile\) must be a step from 1 to steps \(2\), got 5"):
        prepare_train({"steps": 2, "torch_profile": 5, "device": "cpu"}, root=tmp_path, name="x")
    run, spec, _ = prepare_train({"steps": 2, "device": "cpu"}, root=tmp_path, name="y")
    # recording a step on resume changes no plan: no --change needed
    _, spec2, changes = prepare_train({"steps": 4, "torch_profile": 3}, run_dir=run.path)
    assert changes == [] and spec2.torch_profile == 3 and spec2.steps == 4


# ------------------------------------------------------------------------------------------------
# a real run: 2 gloo ranks, the tiny model, 3 steps, step 2 recorded by torch.profiler
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("traced")
    p = _workbench("train", "--nproc", str(WORLD), "--model", "tiny", "--lengths", "stdlib", "--planner", "greedy",
                   "--steps", "3", "--seed", "3", "--max-len", "256", "--batch-tokens", "2048", "--checkpoint-every", "0",
                   "--profile", "cpu-gloo-tiny", "--torch-profile", "--run-root", str(root), "--name", "t", "--quiet")
    run_dir = root / "t"
    log = (run_dir / runs.LOG_FILE).read_text()[-3000:] if (run_dir / runs.LOG_FILE).exists() else ""
    assert p.returncode == 0, f"{p.stderr[-3000:]}\n{log}"
    return root, run_dir


@pytest.mark.slow
@pytest.mark.untimed
def test_trace_of_a_real_2_rank_step_is_valid_trace_event_json(traced_run, tmp_path, capsys):
    root, run_dir = traced_run
    out = tmp_path / "t.json"
    p = cli_main(capsys, "runs", "trace", "t", "--root", str(root), "--step", "3", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out) and "step 3 of t" in p.stderr
    trace = json.loads(out.read_text())
    names = _check_trace_event_format(trace)
    assert names == {r: f"rank {r}" for r in range(WORLD)}  # one process per rank
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == set(range(WORLD)) and {e["tid"] for e in xs} == {1, 2}
    assert trace["otherData"]["step"] == 3 and trace["otherData"]["aligned_by_wall_clock"] is True
    # the default step: the median of steps 2-3 less the profiled step 2, i.e. step 3
    p = cli_main(capsys, "runs", "trace", "t", "--root", str(root))
    assert p.returncode == 0 and p.stdout.strip() == str(run_dir / "trace-step3.json")


@pytest.mark.slow
@pytest.mark.untimed
def test_trace_parts_sum_to_the_measured_step_times(traced_run, tmp_path):
    from workbench.trace import chrome_trace, step_timeline

    root, run_dir = traced_run
    rows = _rows(run_dir)
    plans = {json.loads(x)["step"]: json.loads(x)["plan"] for x in (run_dir / runs.PLANS_FILE).read_text().splitlines()}
    assert sorted({r["step"] for r in rows}) == [0, 1, 2] and len(rows) == 3 * WORLD
    for step in (1, 2, 3):
        trace = chrome_trace(step_timeline(run_dir, step))
        plan = plans[step - 1]
        xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        for row in (r for r in rows if r["step"] == step - 1):
            rank = row["rank"]
            mine = [e for e in xs if e["pid"] == rank and e["tid"] == 1]
            (whole,) = [e for e in mine if e["cat"] == "step"]
            parts = sorted((e for e in mine if e["cat"].startswith("step.")), key=lambda e: e["ts"])
            # the parts tile the step: inside it, back to back, summing to metrics.jsonl's measured_ms
            assert sum(e["dur"] for e in parts) / 1e3 == pytest.approx(row["measured_ms"], rel=1e-9, abs=1e-6)
            assert whole["dur"] / 1e3 == pytest.approx(row["measured_ms"])
            assert parts[0]["ts"] == pytest.approx(whole["ts"])
            for a, b in zip(parts, parts[1:]):
                assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=1e-3)
            # each timed part is what the rank measured (a hole under 10 us given to the next part)
            comp = [e for e in parts if e["cat"] == "step.compute"]
            assert len(comp) == len(row["micro_steps"])  # lockstep: every rank runs every pass
            for e, rec in zip(comp, row["micro_steps"]):
                assert e["dur"] / 1e3 == pytest.approx(rec["measured_ms"], abs=0.011)
            (red,) = [e for e in parts if e["cat"] == "step.collective"]
            (opt,) = [e for e in parts if e["cat"] == "step.optimizer"]
            assert red["dur"] / 1e3 == pytest.approx(row["allreduce_ms"], abs=0.011)
            assert opt["dur"] / 1e3 == pytest.approx(row["optimizer_ms"], abs=0.011)
            # ranks are placed by the clock each recorded at its step's start
            assert whole["ts"] / 1e6 + trace["otherData"]["origin_time"] == pytest.approx(row["start_time"], abs=1e-6)
            # the planned track: one event per group the rank serves, the step as long as the plan's makespan
            planned = [e for e in xs if e["pid"] == rank and e["tid"] == 2]
            mine_groups = [g for ms in plan["micro_steps"] for g in ms["groups"] if rank in g["ranks"]]
            assert len([e for e in planned if e["cat"] == "planned.compute"]) == len(mine_groups)
            (pstep,) = [e for e in planned if e["cat"] == "planned"]
            assert pstep["dur"] / 1e3 == pytest.approx(plan["makespan_ms"])


@pytest.mark.slow
@pytest.mark.untimed
def test_torch_profile_writes_a_readable_trace_per_rank(traced_run):
    _, run_dir = traced_run
    rows = _rows(run_dir)
    for rank in range(WORLD):
        path = runs.torch_trace_path(run_dir, 2, rank)
        trace = json.loads(path.read_text())
        ops = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        # torch.profiler's own events: aten operators of the forward and backward, gloo's collectives
        assert any(n.startswith("aten::") for n in ops) and "aten::mm" in ops
        assert any("gloo" in n for n in ops)
        (row,) = [r for r in rows if r["rank"] == rank and r["step"] == 1]
        assert row["torch_trace"] == path.name
    assert not list(run_dir.glob("torch-trace-step1-*")) and not list(run_dir.glob("torch-trace-step3-*"))
    assert all("torch_trace" not in r for r in rows if r["step"] != 1)
    assert "torch.profiler recorded step 2 (every rank)" in (run_dir / runs.LOG_FILE).read_text()
    # profile --check leaves that step out (the profiler's own overhead is not the model's) and says so:
    # of the 3 steps the first is start-up, the second traced, the third compared
    from workbench.profile import check_fidelity

    res = check_fidelity("cpu-gloo-tiny", run_dir)
    assert [r["step"] for r in res["steps"]] == [2] and res["skipped_steps"] == 2
    assert any("left out step(s) 1: recorded under torch.profiler" in n for n in res["notes"])


@pytest.mark.slow
@pytest.mark.untimed
def test_runs_panel_draws_a_step_measured_beside_planned(traced_run):
    from widgets import RunsPanel

    root, run_dir = traced_run
    panel = RunsPanel(root=root)
    tl = panel.show_step("t", 3)
    assert panel.w_step.options == (1, 2, 3) and tl["step"] == 3
    rows = {r["rank"]: r for r in _rows(run_dir) if r["step"] == 2}
    plan = json.loads((run_dir / runs.PLANS_FILE).read_text().splitlines()[2])["plan"]
    fig = panel.fig_trace
    measured = [t for t in fig.data if t.xaxis == "x" and t.name != "plan broadcast"]
    planned = [t for t in fig.data if t.xaxis == "x2"]
    assert measured and planned
    for rank, row in rows.items():
        # the measured row of a rank: its bars sum to its step time as metrics.jsonl records it
        total = sum(x for t in measured for x, y in zip(t.x, t.y) if y == rank)
        assert total == pytest.approx(row["measured_ms"], rel=1e-9)
        # the planned row: the group it serves in each pass (one at most here), as long as the plan says
        comp = [t for t in planned if t.name == "micro-steps / passes"]
        durs = sorted(x for t in comp for x, y in zip(t.x, t.y) if y == rank)
        want = []
        for ms in plan["micro_steps"]:
            mine = [g["time_ms"] for g in ms["groups"] if rank in g["ranks"]]
            assert len(mine) <= 1
            want += mine
        assert durs == pytest.approx(sorted(want))
    assert fig.layout.xaxis.range == fig.layout.xaxis2.range  # one time scale on both sides
    assert "Step 3 of t" in fig.layout.title.text
    summary = panel.tables()["step_timeline"]["summary"]
    assert [s["rank"] for s in summary] == list(range(WORLD)) and all(s["note"] for s in summary)
    panel.select([])
    assert panel.step_timeline is None and panel.fig_trace.data == ()
