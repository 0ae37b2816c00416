"""Profile runs for real: 2 gloo ranks on CPU through the launcher (torchrun under the supervisor).

One quick profile through the console script, then: the profile loads and drives plan, simulate
and a short training run by path, and ``--check`` compares it with that run. A profile whose ranks
fail says why in its status; a profile run stops on ``workbench runs stop``. And a 4-rank profile's
sub-groups and splits, its ranks a sub-world of the shared torchrun launch (tests/_torchrun.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import cli_main, run_cli

pytestmark = pytest.mark.slow

# a small grid, one timed sample a pack of one call, 3 timed repetitions of each collective: the checks
# read which figures the profile holds and how they were fitted, not how close they are
GRID = ["--max-len", "256", "--reps", "1", "--warmup", "1", "--min-sample-ms", "0", "--collective-reps", "3"]


def _cli(capsys, *args):
    """``workbench *args`` through the console script's entry in this process; it must succeed."""
    p = cli_main(capsys, *args)
    assert p.returncode == 0, (args, p.stderr[-3000:])
    return p


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile_runs")
    out = root / "prof.json"
    p = run_cli("profile", "--quick", "--nproc", "2", "--device", "cpu", "--run-root", str(root), "--out", str(out),
                "--name", "p2", *GRID)
    return root, out, p


def test_quick_profile_on_two_gloo_ranks(profiled):
    from workbench import runs
    from workbench.profile import load_result
    from workbench.specs import load_profile

    root, out, p = profiled
    run = runs.load_run(root / "p2")
    st = run.status()
    assert st.state == "done" and st.exit_code == 0 and st.progress == 1.0
    assert st.kind == "profile" and "held-out" in st.message
    prof = load_profile(out)
    assert prof == load_profile(run.path)  # --out is a copy of the run's profile.json
    assert prof.model == "tiny" and prof.provenance["kind"] == "measured"
    assert prof.provenance["collectives"] == "measured" and prof.provenance["world_size"] == 2
    for key in ("host", "when", "command", "attention", "versions", "device"):
        assert prof.provenance.get(key), key
    assert prof.provenance["versions"]["torch"]
    assert set(prof.all_to_all_gbps) == {2} and set(prof.all_to_all_latency_ms) == {2}
    assert set(prof.allreduce_gbps) == {2} and set(prof.p2p_gbps) == {2}
    assert prof.forward.a + prof.forward.b > 0 and prof.activation_mb_per_token > 0
    # what a step costs beyond its layers, from real steps in the same rounds: FSDP's collectives at
    # the unit sizes, the head, a micro-step's and a ZeRO-3 pass's fixed costs, the optimizer
    assert set(prof.allgather_gbps) == {2} and set(prof.reduce_scatter_latency_ms) == {2}
    assert prof.head_ms_per_token > 0 and prof.micro_step_ms is not None
    assert set(prof.pass_overhead_ms) == {2} and set(prof.pass_compute_factor) == {2}
    assert prof.pass_comm_overlap == 0.0 and prof.pass_compute_factor[2] >= 1.0
    assert prof.optimizer_ms_per_mparam > 0 and prof.sharded_optimizer_ms_per_mparam > 0
    assert prof.provenance["load_average"]["start"] is not None
    # the host: its memory recorded (psutil's total, GB = 1e9 bytes); on CPU no host link, so no offload
    import psutil

    assert prof.host_memory_gb == pytest.approx(psutil.virtual_memory().total / 1e9, rel=0.01)
    assert prof.host_link_gbps is None and prof.host_link_node_gbps is None
    assert prof.provenance["host_link"].startswith("none") and "psutil" in prof.provenance["host_memory"]
    names = {c["name"] for c in json.loads((run.path / "measurements.json").read_text())["steps"]}
    assert names == {"lockstep-idle", "lockstep-busy", "lockstep-heavy", "lockstep-mixed", "free-busy", "free-heavy",
                     "free-mixed"}
    res = load_result(run)
    assert res.heldout["total"]["count"] >= 3 and res.heldout["total"]["median_ape"] is not None
    assert {r["role"] for r in res.compute} == {"fit", "heldout"}
    assert all(len(r["per_rank"]["forward_ms"]) == 2 for r in res.compute)
    assert "| forward |" in p.stdout and "held-out" in p.stdout and "fixed cost of a ZeRO-3 pass" in p.stdout
    assert (run.path / runs.LOAD_FILE).is_file()  # the supervisor sampled the machine's load
    assert (run.path / runs.LOG_FILE).is_file()
    from workbench.report.profile import collectives_figure, fit_figure, residual_figure

    assert len(fit_figure(res).data) >= 4 and residual_figure(res).data and collectives_figure(res).data
    # context parallelism on 2 ranks: its collectives on the CP sub-group (the world here) at every message
    # size, real 1 x 2 micro-steps of every group pack, and the extras fitted from them
    meas = json.loads((run.path / "measurements.json").read_text())
    sizes = sorted({c["message_bytes"] for c in meas["collectives"] if c["kind"] == "all_to_all"})
    for kind in ("cp_allgather", "cp_reduce_scatter"):
        pts = [c for c in meas["collectives"] if c["kind"] == kind]
        assert sorted(c["message_bytes"] for c in pts) == sizes and {(c["group_size"], c["stride"]) for c in pts} == {(2, 1)}
        assert all(c["ms"] > 0 and len(c["per_rank"]) == 2 for c in pts)
    resolved = run.spec()["resolved"]
    assert resolved["min_sample_ms"] == 0.0 and resolved["collective_reps"] == 3  # --min-sample-ms, --collective-reps
    packs = resolved["group_packs"] + [[256]]  # and the longest length the curves are fitted to (--max-len 256)
    assert sorted(resolved["cp_packs"]) == sorted(packs)
    cp_rows = [g for g in meas["groups"] if g["cp"] == 2]
    assert sorted(g["pack"] for g in cp_rows) == sorted(packs) and all(g["degree"] == 2 and g["ms"] > 0 for g in cp_rows)
    assert set(prof.cp_overhead_ms) == {2} and set(prof.cp_token_ms) == {2} and set(prof.cp_attention_factor) == {2}
    assert "CP extras per layer (1 x c): c = 2" in p.stdout and "| 1x2 |" in p.stdout
    assert "CP's extra attention" in p.stdout
    # at the world size the all-gather stays FSDP's; CP's own figure there is kept beside it
    assert prof.allgather_gbps[2] == pytest.approx(res.collective_fits["allgather"][2]["gbps"])
    assert res.collective_fits["cp_allgather"][2]["gbps"] > 0
    # the fit is a pure function of what the ranks measured
    from workbench.profile.result import build_result

    again = build_result(meas, run_id=run.id).profile
    assert again.cp_overhead_ms == prof.cp_overhead_ms and again.cp_token_ms == prof.cp_token_ms
    assert again.cp_attention_factor == prof.cp_attention_factor


def test_profile_drives_plan_simulate_train_and_check(profiled, capsys):
    """The planning commands and the checks through the console script's entry in this process (they
    start no process); the training runs through the console script."""
    root, out, _ = profiled
    plan = json.loads(_cli(capsys, "plan", "--lengths", "4096,2048,512,300,200", "--gpus", "2", "--model", "tiny",
                              "--gpu-memory", "1", "--profile", str(out), "--planner", "greedy", "--json").stdout)
    assert plan["makespan_ms"] > 0
    sim = json.loads(_cli(capsys, "simulate", "--lengths", "4096,2048,512,300,200", "--gpus", "2", "--model", "tiny",
                             "--gpu-memory", "1", "--profile", str(out), "--planners", "static-max,greedy",
                             "--steps", "1", "--quiet", "--json").stdout)
    assert sim["planners"]["greedy"]["mean_step_ms"] > 0
    # the run folder works as --profile too (load_profile reads its profile.json)
    _cli(capsys, "cost", "--lengths", "1024", "--degrees", "1,2", "--gpus", "2", "--model", "tiny", "--profile",
         str(root / "p2"), "--json")
    tr = run_cli("train", "--nproc", "2", "--model", "tiny", "--lengths", "300,200,150,100,60,40", "--planner", "greedy",
                 "--steps", "3", "--seed", "0", "--profile", str(out), "--run-root", str(root), "--name", "t2",
                 "--quiet", "--checkpoint-every", "0")
    assert tr.returncode == 0
    chk = json.loads(_cli(capsys, "profile", "--check", "t2", "--profile", str(out), "--run-root", str(root), "--json",
                             "--html", str(root / "fidelity.html")).stdout)
    assert chk["run"] == "t2" and chk["skipped_steps"] == 1 and len(chk["steps"]) == 2
    # ZeRO-3 by default: lockstep passes, compared pass by pass, the optimizer step in both figures
    assert chk["execution"] == "lockstep" and chk["passes"] and not chk["groups"]
    assert all(x["predicted_ms"] > 0 and x["measured_ms"] > 0 for x in chk["passes"])
    assert all(s["optimizer_ms"] > 0 and s["predicted_optimizer_ms"] > 0 for s in chk["steps"])
    assert chk["profile_note"] is None  # measured here for this process count
    assert chk["step_error"]["median_ape"] is not None and (root / "fidelity.html").stat().st_size > 10_000
    # the run was planned with this very profile: re-timing its plans reproduces the run's own predictions
    # (plus the plan-ahead solver's time on the ranks' cores: 2 ranks on this 2-core machine)
    for s in chk["steps"]:
        assert s["predicted_ms"] - s["planner_cpu_ms"] == pytest.approx(s["run_predicted_ms"], rel=1e-9)
    text = _cli(capsys, "profile", "--check", "t2", "--profile", "p2", "--run-root", str(root)).stdout
    assert "| step |" in text and "| lockstep pass |" in text
    # a ZeRO-0 run of the same: free micro-steps, compared group by group
    tr = run_cli("train", "--nproc", "2", "--model", "tiny", "--lengths", "300,200,150,100,60,40", "--planner", "greedy",
                 "--steps", "3", "--seed", "0", "--profile", str(out), "--run-root", str(root), "--name", "t0",
                 "--quiet", "--checkpoint-every", "0", "--zero-stage", "0")
    free = json.loads(_cli(capsys, "profile", "--check", "t0", "--run-root", str(root), "--json").stdout)
    # without --profile: the one the run planned with (t0 planned with the profile t2's check was given)
    assert free["profile"] == chk["profile"]
    assert free["execution"] == "free" and free["groups"] and not free["passes"]
    assert all(s["predicted_ms"] - s["planner_cpu_ms"] == pytest.approx(s["run_predicted_ms"], rel=1e-9)
               for s in free["steps"])


# The 4-rank profile's ranks are a sub-world of 4 of the shared torchrun launch (tests/_torchrun.py's
# SUBWORLD_SIZE and subworld_checks; this file's alone), whose ranks have imported torch already: they
# run the profiler's rank on the prepared run (conftest.profile_rank_in_subworld). The launcher's side
# of a profile run (torchrun under the supervisor, its final state, a stop, a failure) is the other
# tests' here.

SUBWORLD_SIZE = 4


def world_prepare(folder: Path) -> list[str]:
    """Pytest side (before the shared launch): the 4-rank profile run prepared in ``folder``. A small
    grid, few collective samples, one timed sample a pack of one call (no minimum sample length), no
    real steps (what they add is the 2-rank test's)."""
    from workbench.profile import prepare_profile

    run = prepare_profile(nproc=4, model="tiny", quick=True, root=folder, name="p4", device="cpu", oversubscribe=True,
                          max_len=512, reps=1, warmup=1, steps=False, fit_packs=[[64], [128], [256], [512], [32] * 8],
                          heldout_packs=[[96]], group_packs=[[256], [32] * 8], message_bytes=[8192, 131072],
                          collective_reps=3, collective_inner=2, min_sample_ms=0.0)
    return [str(run.path)]


def subworld_checks(run_dir: str) -> list:
    """Rank side: each rank's exit status from the profiler on ``run_dir``."""
    from conftest import profile_rank_in_subworld

    return [lambda rank: {"exit": profile_rank_in_subworld(run_dir, rank), "run": run_dir}]


# its checks read which figures were measured and fitted, not times: the untimed lane (tests/_xdist_heavy.py)
@pytest.mark.untimed
def test_four_ranks_measure_cp_sub_groups_of_every_size_and_a_2x2_split(request, tmp_path_factory):
    """4 gloo ranks (on however many cores): CP's collectives on the strided sub-groups of 2 (ranks
    {0,2} and {1,3}), on the block {0,1,2} for 3 (rank 3 idle) and of 4, real micro-steps of 1 x 2,
    1 x 4 and 2 x 2 (none at 3: micro-steps stay at the power-of-two sizes), all three on the CP packs
    (the SP packs and the longest fitted length); the profile's all-gather at 2 and 3 is CP's, at 4
    FSDP's; the extras at 2 and 4, and 2 x 2's residual beyond them (the run ``world_prepare`` made)."""
    from _torchrun import shared_world

    from workbench import runs
    from workbench.profile import load_result
    from workbench.profile.result import PROFILER_VERSION

    per_rank = shared_world(request, tmp_path_factory, __name__)
    run = runs.load_run(per_rank["0"]["run"])
    st = runs.read_status(run.path)  # as rank 0 left it (no supervisor marks it done: its ranks are the launch's)
    assert [per_rank[str(r)]["exit"] for r in range(4)] == [0] * 4 and st.progress == 1.0, (st, run.log_tail(30))
    assert st.error is None and st.message.startswith("done in"), st
    meas = json.loads((run.path / "measurements.json").read_text())
    cp = {(c["kind"], c["group_size"], c["stride"]) for c in meas["collectives"] if c["kind"].startswith("cp_")}
    assert cp == {(k, c, s) for k in ("cp_allgather", "cp_reduce_scatter") for c, s in ((2, 2), (3, 1), (4, 1))}
    splits = {(g["degree"], g["cp"]) for g in meas["groups"]}
    assert splits == {(1, 1), (2, 1), (4, 1), (2, 2), (4, 4), (4, 2)}
    packs = {s: sorted(tuple(g["pack"]) for g in meas["groups"] if (g["degree"], g["cp"]) == s) for s in splits}
    assert packs[4, 2] == packs[2, 2] == packs[4, 4] == sorted([(256,), (32,) * 8, (512,)])
    assert packs[2, 1] == sorted([(256,), (32,) * 8])
    res = load_result(run)
    prof = res.profile
    assert set(prof.allgather_gbps) == {2, 3, 4} and set(prof.reduce_scatter_latency_ms) == {2, 3, 4}
    assert set(prof.all_to_all_gbps) == {2, 3, 4}
    assert prof.allgather_gbps[2] == pytest.approx(res.collective_fits["cp_allgather"][2]["gbps"])
    assert prof.allgather_gbps[4] == pytest.approx(res.collective_fits["allgather"][4]["gbps"])
    assert set(prof.cp_overhead_ms) == {2, 4} and set(prof.cp_token_ms) == {2, 4}
    assert set(prof.cp_attention_factor) == {2, 4}
    assert set(prof.split_overhead_ms) == {"2x2"} and set(prof.split_token_ms) == {"2x2"}
    assert "split_overhead" in prof.provenance and prof.provenance["profiler_version"] == PROFILER_VERSION
    # no real steps: the optimizer's step was timed alone, on rank 0
    assert prof.optimizer_ms_per_mparam == pytest.approx(meas["optimizer"]["ms_per_mparam"])
    from workbench.models import get_model

    assert meas["optimizer"]["params"] == get_model("tiny").params()  # all of it: under the cap
    rows = [g for g in res.groups if g["cp"] > 1]
    assert sorted({g["split"] for g in rows}) == ["1x2", "1x4", "2x2"] and len(rows) == 9
    assert all(g["predicted_with_overhead_ms"] >= g["predicted_ms"] for g in rows)
    assert all(g["predicted_with_overhead_ms"] >= g["predicted_parts_ms"] for g in rows if g["split"] == "2x2")


def test_a_failing_profile_says_why(tmp_path):
    from workbench import runs
    from workbench.launch import process
    from workbench.profile import prepare_profile, start_profile

    run = prepare_profile(nproc=2, model="tiny", root=tmp_path, name="bad", device="cpu")
    spec = run.spec()
    spec["device"] = "cuda"  # as if prepared on a GPU machine: no rank here can run it
    (run.path / runs.SPEC_FILE).write_text(json.dumps(spec))
    st = process.wait(start_profile(run), timeout=120)
    assert st.state == "failed"
    assert "CUDA" in (st.error or "") and len(st.error.splitlines()) == 1
    assert list((run.path / runs.FAILURES_DIR).glob("rank*.json"))


def test_a_profile_run_stops(tmp_path):
    from workbench import runs
    from workbench.launch import process
    from workbench.profile import prepare_profile, start_profile

    # a quick grid with 1,000 timed samples a pack: minutes of measuring, its first sample within seconds
    run = prepare_profile(nproc=2, model="tiny", quick=True, root=tmp_path, name="long", device="cpu", max_len=128,
                          reps=1000, warmup=1, steps=False)
    handle = start_profile(run)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        st = run.status()
        if st.state == "running" and (st.progress or 0) > 0:
            break
        assert process.poll(handle) is None, run.log_tail(20)
        time.sleep(0.3)
    p = run_cli("runs", "stop", "long", "--root", str(tmp_path))
    assert "no process left" in p.stdout
    st = runs.Run(run.path).status()
    assert st.state == "stopped"
    assert not [pid for pid, t in runs.status_pids(st) if runs.pid_alive(pid, t)]
