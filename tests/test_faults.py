"""Training a user can trust: real torchrun runs (tiny model, gloo, 2 ranks) hit with the faults
users cause, checked by pid.

- stop: every process of the run gone within 5 s, status ``stopped``;
- SIGKILL of rank 0 (what the out-of-memory killer sends) and of rank 1: ``failed`` within 10 s,
  the failing rank named with its signal, no process left (the plan-ahead worker and the
  multiprocessing resource tracker included);
- SIGTERM and SIGHUP to ``workbench train`` (a closed terminal) stop the run like Ctrl-C;
- SIGKILL of the plan-ahead worker: the run says so once and trains on, planning inline, with the
  planner's own plans;
- corrupt and empty checkpoints (whole files under ZeRO-0, sharded folders under ZeRO-3): resume
  from the previous good one, saying which file was skipped; none usable: one line;
- two runs at once, and a second start on a running run refused without touching its spec;
- every socket the run listens on is on the loopback interface.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench import launch, runs
from workbench.training import prepare_train

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180
SETTINGS = dict(model="tiny", max_len=256, batch_tokens=1024, effort=0.5, device="cpu")


def _workbench(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("workbench")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]


def _alive(pids) -> list[int]:
    return [p for p, t in pids if runs.pid_alive(p, t)]


def _wait_for_step(run: runs.Run, step: int, handle=None) -> runs.RunStatus:
    t0 = time.monotonic()
    while True:
        st = run.status()
        if st.step >= step and st.state == "running":
            return st
        if handle is not None and launch.poll(handle) is not None or st.final:
            pytest.fail(f"run ended before step {step}: {st.to_dict()}\n{run.log_tail(40)}")
        assert time.monotonic() - t0 < TIMEOUT, f"no step {step} after {TIMEOUT}s:\n" + "\n".join(run.log_tail(40))
        time.sleep(0.2)


def _all_pids(st: runs.RunStatus) -> list[tuple[int, int | None]]:
    pids = runs.status_pids(st)
    assert (st.pids or {}).get("supervisor") and len(st.pids.get("ranks", {})) == 2, st.pids
    assert len(st.pids.get("workers", [])) >= 1, "the plan-ahead worker is recorded"
    return pids


def _start(tmp_path: Path, name: str, steps: int = 400, **extra) -> tuple[runs.Run, launch.RunHandle]:
    run, spec, _ = prepare_train({**SETTINGS, "steps": steps, "nproc": 2, "checkpoint_every": 0,
                                  "debug": {"step_sleep_s": 0.2}, **extra}, root=tmp_path, name=name)
    return run, launch.start(run, nproc=2)


def _gone_within(pids, seconds: float) -> float:
    t0 = time.monotonic()
    while _alive(pids):
        assert time.monotonic() - t0 < seconds, f"still alive after {seconds}s: {_alive(pids)}"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_live_run_listens_on_loopback_refuses_a_second_start_and_stops_within_5s(tmp_path):
    """One live run checked three ways, in this order (each was a test with a run of its own): every
    socket it listens on is on the loopback interface; a second start, through the API and through
    ``workbench train --run-dir``, is refused and changes nothing; a stop ends every process of it
    within 5 s, status ``stopped``."""
    psutil = pytest.importorskip("psutil")
    run, h = _start(tmp_path, "live")
    try:
        st = _wait_for_step(run, 2, h)
        pids = _all_pids(st)
        # every socket the run listens on is on the loopback interface
        pid_set = {p for p, _ in pids}
        listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pid_set]
        assert listening, "the run's rendezvous store and gloo listen somewhere"
        owners = {c.pid for c in listening}
        assert st.pids["supervisor"] in owners  # the rendezvous store, hosted by the supervisor (torchrun)
        for c in listening:
            assert ipaddress.ip_address(c.laddr.ip).is_loopback, f"pid {c.pid} listens on {c.laddr}"
        # a second start on the running run, through the API and through the CLI, changes nothing
        spec_before = run.file("spec.json").read_bytes()
        status_before = run.status()
        with pytest.raises(ValueError, match="already running"):
            launch.start(run, nproc=2)
        p = subprocess.run(_workbench("train", "--run-dir", str(run.path), "--steps", "500"), capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
        assert p.returncode == 2 and "already running" in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert run.file("spec.json").read_bytes() == spec_before
        after = run.status()
        assert after.attempt == status_before.attempt and after.pids["supervisor"] == status_before.pids["supervisor"]
        # a stop ends every process within 5 s
        t0 = time.monotonic()
        final = launch.stop(h)
        took = time.monotonic() - t0
    finally:
        launch.stop(run)
    assert final.state == "stopped", final.to_dict()
    assert not _alive(pids) and took < 5.0, f"stop took {took:.1f}s"
    assert h.process.returncode is not None
    # a stopped run reads as stopped, not as failed, and nothing of it is alive
    assert runs.load_run(run.path).status().state == "stopped"


@pytest.mark.parametrize("rank", [0, 1])
def test_sigkill_of_a_rank_fails_the_run_and_leaves_nothing(tmp_path, rank):
    run, h = _start(tmp_path, f"kill{rank}")
    try:
        st = _wait_for_step(run, 2, h)
        pids = _all_pids(st)
        os.kill(st.pids["ranks"][str(rank)], signal.SIGKILL)
        took = _gone_within(pids, 10.0)
        final = launch.wait(h, timeout=10)
    finally:
        launch.stop(run)
    assert final.state == "failed" and final.failing_rank == rank and final.signal == "SIGKILL", final.to_dict()
    assert f"rank {rank} killed by SIGKILL" in final.error
    assert final.exit_codes[str(rank)] == -signal.SIGKILL
    assert final.log_tail, "the failing rank's last log lines (or the run's) are in the status"
    print(f"rank {rank} killed: every process gone after {took:.1f}s")


def test_a_killed_plan_ahead_worker_costs_time_not_the_run(tmp_path):
    from workbench.scenario import Scenario
    from workbench.solve import plan_from_dict, run_planner
    from workbench.solve.ahead import plan_lengths
    from widgets import LaunchPanel

    steps = 10  # 2 before the kill; the rest leave time to open a panel on the live run
    # a panel built once first, so that the one opened on the live run below does not pay its first
    # imports (seconds under load, when the 8 steps left could end the run before it attaches)
    LaunchPanel(root=tmp_path, follow=False, reattach=False).close()
    run, h = _start(tmp_path, "worker", steps=steps)
    try:
        st = _wait_for_step(run, 2, h)
        # the planning worker itself (the recorded workers also hold multiprocessing's resource tracker)
        worker = [p for p in st.pids["workers"] if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(worker) == 1, st.pids
        os.kill(worker[0], signal.SIGKILL)
        t0 = time.monotonic()
        while not run.status().warnings:
            assert time.monotonic() - t0 < 60 and launch.poll(h) is None, run.log_tail(30)
            time.sleep(0.1)
        # a Launch panel opened now (a notebook reattaching) shows the warning beside the progress
        panel = LaunchPanel(root=tmp_path, follow=False)
        assert panel.run == run, "the panel reattached to the live run"
        panel.refresh()
        shown = panel.status.value
        panel.close()
        final = launch.wait(h, timeout=TIMEOUT)
    finally:
        launch.stop(run)
    assert "warning: the planning worker process died" in shown and "planning the remaining steps inline" in shown
    assert final.state == "done" and final.step == steps, final.to_dict()
    assert [s.step for s in run.steps()] == list(range(1, steps + 1))
    # said once: in the status (what `workbench runs show` and the Launch panel print) and in the log
    assert len(final.warnings) == 1, final.warnings
    note = final.warnings[0]
    assert f"pid {worker[0]} killed by SIGKILL" in note and "planning the remaining steps inline" in note
    assert run.file("log.txt").read_text().count(f"pid {worker[0]} killed by SIGKILL") == 1
    assert final.resolved["planning"].startswith("inline")
    show = subprocess.run(_workbench("runs", "show", "worker", "--root", str(tmp_path)), capture_output=True,
                          text=True, timeout=60).stdout
    assert f"warning: {note}" in show
    # every step ran the planner's own plan of its batch, before the kill and after it
    sc = Scenario.from_dict(final.resolved["scenario"])
    rows = [json.loads(x) for x in run.file("plans.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        plan = plan_from_dict(r["plan"])
        want = run_planner(sc.planner, plan_lengths(plan), sc.cost(), seed=sc.seed, effort=sc.effort, time_limit=sc.time_limit,
                           max_len=sc.max_len, batch_id=r["batch_id"]).to_dict()
        got = dict(r["plan"])
        for d in (got, want):
            d.pop("solve_seconds")
        assert got == want, r["step"]


def _train_in_a_terminal(tmp_path: Path, name: str, **streams) -> tuple[subprocess.Popen, runs.Run]:
    """``workbench train`` as a user starts it in a terminal; returns once its run folder exists."""
    cmd = _workbench("train", "--nproc", "2", "--steps", "400", "--model", "tiny", "--max-len", "256",
                     "--batch-tokens", "1024", "--checkpoint-every", "0", "--debug-step-sleep", "0.2",
                     "--run-root", str(tmp_path), "--name", name, "--device", "cpu")
    proc = subprocess.Popen(cmd, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), **streams)
    run = runs.Run(tmp_path / name)
    t0 = time.monotonic()
    while not run.path.exists():
        assert time.monotonic() - t0 < TIMEOUT and proc.poll() is None, "the run folder never appeared"
        time.sleep(0.1)
    return proc, run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_to_workbench_train_stops_the_run(tmp_path, sig):
    proc, run = _train_in_a_terminal(tmp_path, "sig", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pids = _all_pids(_wait_for_step(run, 2))
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        _gone_within(pids, 5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
        launch.stop(run)
    assert proc.returncode == 128 + sig, err
    assert f"{signal.Signals(sig).name} received" in err and "stopped" in err.strip().splitlines()[-1]
    assert run.status().state == "stopped"


def test_killing_workbench_train_itself_stops_the_run(tmp_path):
    """SIGKILL cannot be caught: the supervisor notices its parent is gone and stops the run."""
    proc, run = _train_in_a_terminal(tmp_path, "k", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = _all_pids(_wait_for_step(run, 2))
        proc.kill()
        proc.wait(10)
        _gone_within(pids, 10.0)
    finally:
        launch.stop(run)
    st = run.status()
    assert st.state == "stopped" and "the process that started it" in (st.note or ""), st.to_dict()


def _flip_bytes(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for k in range(n):
        i = len(data) // 2 + k * 7
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> dict:
    """Three runs started at once, 3 steps with a checkpoint after each: ``ck0`` and ``twin`` (ZeRO-0,
    whole files; the same seed and settings) and ``ck3`` (ZeRO-3, sharded folders). Returns, by name,
    ``(run, final status, steps, losses)`` as they ended, before test_corrupt_and_empty_checkpoints
    damages and resumes ``ck0`` and ``ck3``."""
    root = tmp_path_factory.mktemp("ck")
    started = {}
    try:
        for name, stage in (("ck0", 0), ("twin", 0), ("ck3", 3)):
            run, _, _ = prepare_train({**SETTINGS, "steps": 3, "nproc": 2, "checkpoint_every": 1, "zero_stage": stage},
                                      root=root, name=name)
            started[name] = (run, launch.start(run, nproc=2))
        final = {name: launch.wait(h, timeout=TIMEOUT) for name, (_, h) in started.items()}
    finally:
        for run, _ in started.values():
            launch.stop(run)
    return {name: (run, final[name], [s.step for s in run.steps()], run.losses()) for name, (run, _) in started.items()}


def test_two_runs_at_once(checkpointed):
    (_, sa, steps_a, losses_a), (_, sb, steps_b, losses_b) = checkpointed["ck0"], checkpointed["twin"]
    assert sa.state == sb.state == "done", (sa.to_dict(), sb.to_dict())
    assert steps_a == steps_b == [1, 2, 3]
    # same seed and settings: the same losses, though they ran side by side (with a third run)
    assert losses_a == pytest.approx(losses_b, rel=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_corrupt_and_empty_checkpoints(checkpointed, stage):
    """Whole files (ZeRO-0) and sharded folders (ZeRO-3): a damaged and an empty checkpoint are
    skipped, naming the file, and the run resumes from the newest good one; none good: one line."""
    from workbench.runtime.checkpoint import full_model_state, verify_checkpoint

    run, first_status, _, _ = checkpointed[f"ck{stage}"]
    assert first_status.state == "done", first_status.to_dict()
    good = full_model_state(run.path, 1)
    ck = run.path / "checkpoints"
    if stage == 3:
        damaged, emptied = ck / "step_3.dcp" / "__1_0.distcp", ck / "step_2.dcp" / "trainer.pt"
    else:
        damaged, emptied = ck / "step_3.pt", ck / "step_2.pt"
    _flip_bytes(damaged)  # 64 flipped bytes
    emptied.write_bytes(b"")  # an empty file
    p = subprocess.run(_workbench("train", "--run-dir", str(run.path), "--steps", "4"), capture_output=True, text=True,
                       cwd=ROOT, timeout=TIMEOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    assert f"{damaged.relative_to(ck)} does not match its checksum" in p.stderr
    assert f"{emptied.relative_to(ck)} is empty" in p.stderr
    st = run.status()
    assert st.resumed_from == 1 and st.step == 4 and st.state == "done"
    # the resumed weights were step 1's, not the damaged step 3's: step 2 redone from them gives the
    # first run's step-2 loss again
    rows = [json.loads(x) for x in run.file("metrics.jsonl").read_text().splitlines()]
    first = {r["step"]: r["loss"] for r in rows if r["rank"] == 0 and r["attempt"] == 1}
    again = {r["step"]: r["loss"] for r in rows if r["rank"] == 0 and r["attempt"] == 2}
    assert again[1] == pytest.approx(first[1], rel=1e-6) and set(again) == {1, 2, 3}
    assert full_model_state(run.path, 1).keys() == good.keys()
    assert verify_checkpoint(ck / ("step_3.dcp" if stage == 3 else "step_3.pt")) is None  # rewritten, good again
    # no usable checkpoint at all: one line, nothing trained
    for _, path in run.checkpoints():
        (path / "trainer.pt" if path.is_dir() else path).write_bytes(b"junk")
    p = subprocess.run(_workbench("train", "--run-dir", str(run.path), "--steps", "6"), capture_output=True, text=True,
                       cwd=ROOT, timeout=TIMEOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("workbench train: error:") and "no usable checkpoint" in last, p.stderr
    assert run.status().state == "failed"


def test_a_restarted_kernel_finds_its_run_and_stops_it(tmp_path):
    """A process starts a run and goes away (a notebook kernel restarted); a new process finds the
    run in the store, attaches to it and stops it: every process gone."""
    script = f"""
from workbench import launch
from workbench.training import prepare_train
run, spec, _ = prepare_train({dict(SETTINGS, steps=400, nproc=2, checkpoint_every=0, debug={"step_sleep_s": 0.2})!r},
                             root={str(tmp_path)!r}, name="orphan")
launch.start(run, nproc=2)
print(run.path)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    run = runs.load_run("orphan", root=tmp_path)
    try:
        pids = _all_pids(_wait_for_step(run, 2))
        h = launch.attach(run)
        assert h is not None and h.process is None and h.pid == run.status().pids["supervisor"]
        assert launch.poll(h) is None  # still running, seen from a process that did not start it
        final = launch.stop(h)
        _gone_within(pids, 5.0)
    finally:
        launch.stop(run)
    assert final.state == "stopped"
    assert launch.attach(run) is None


def test_a_rank_killed_by_a_signal_is_the_cause_over_its_peers_errors(tmp_path):
    """torchrun's first failure is the earliest by timestamp, and a peer that failed on a collective
    after the kill wrote its error file with a time (whole seconds) that can come before torchrun's
    notice of the killed rank: the status names the killed rank (the race a loaded machine showed
    in test_sigkill_of_a_rank_fails_the_run_and_leaves_nothing[1]). The failures are torch's own
    ProcessFailure records, as torchrun makes them."""
    import json
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from workbench.launch.supervisor import _failure_fields

    err = tmp_path / "rank0_error.json"
    err.write_text(json.dumps({"message": {"message": "RuntimeError: Connection closed by peer",
                                           "extraInfo": {"py_callstack": "", "timestamp": int(time.time()) - 5}}}))
    peer = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(err))
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGKILL, error_file="<N/A>")
    e = ChildFailedError("train", {0: peer, 1: killed})
    assert e.get_first_failure()[0] == 0  # what torchrun alone would report
    out = _failure_fields(tmp_path, 0, e)
    assert out["failing_rank"] == 1 and out["signal"] == "SIGKILL", out
    assert out["error"].startswith("rank 1 killed by SIGKILL")
    assert out["exit_codes"] == {"0": 1, "1": -signal.SIGKILL}
    # torchrun's own SIGTERM to the ranks left (and a user's stop) names no cause: torchrun's first stays
    stopped = ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGTERM, error_file="<N/A>")
    e = ChildFailedError("train", {0: peer, 1: stopped})
    assert _failure_fields(tmp_path, 0, e)["failing_rank"] == e.get_first_failure()[0]
    # a run whose only failures are errors keeps torchrun's first
    other = ProcessFailure(local_rank=1, pid=101, exitcode=2, error_file="<N/A>")
    assert _failure_fields(tmp_path, 0, ChildFailedError("train", {0: peer, 1: other}))["failing_rank"] == 0
