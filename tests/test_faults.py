"""Training a user can trust: real torchrun runs (tiny model, gloo, 2 ranks; 1 where a command's
signal or whole-file checkpoints are what is checked) hit with the faults users cause, checked by pid.

- stop: every process of the run gone within 5 s, status ``stopped``, from the process that
  started it (``workbench train`` on SIGTERM or SIGHUP) and from one that did not (a restarted
  kernel attaching to the run it left);
- SIGKILL of rank 0 (what the out-of-memory killer sends) and of rank 1: ``failed`` within 10 s,
  the failing rank named with its signal, no process left (the plan-ahead worker and the
  multiprocessing resource tracker included);
- SIGTERM and SIGHUP to ``workbench train`` (a closed terminal) stop the run like Ctrl-C;
- SIGKILL of the plan-ahead worker: the run says so once and trains on, planning inline, with the
  planner's own plans;
- corrupt and empty checkpoints (whole files under ZeRO-0, sharded folders under ZeRO-3): resume
  from the previous good one, saying which file was skipped; none usable: one line;
- the plan-ahead worker of a rank does not load torch (the rank's ``__main__`` does);
- two runs at once, and a second start on a running run refused without touching its spec;
- every socket the run listens on is on the loopback interface.

Runs that are checked for different things share a run where one does not end it: the killed-rank
runs are the two runs at once, the killed planning worker's run is the ZeRO-3 checkpoint run, the
restarted kernel's run is the one checked for sockets, a second start and the stop. Runs that end
alike start at once: the two killed-rank runs; the three ``workbench train`` commands sent SIGTERM,
SIGHUP and SIGKILL; the two checkpoint runs, then their two resumes with the run that has no usable
checkpoint in either layout. The checkpoint tests and the killed worker check results, not times
(``untimed``); the rest check time bounds, measured from the fault.
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

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180
SETTINGS = dict(model="tiny", max_len=256, batch_tokens=1024, effort=0.5, device="cpu")
LIVE = dict(SETTINGS, steps=400, nproc=2, checkpoint_every=0, debug={"step_sleep_s": 0.2})
"""A run that trains until it is stopped or killed (a step every 0.2 s at least)."""


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
        time.sleep(0.1)


def _all_pids(st: runs.RunStatus, ranks: int = 2) -> list[tuple[int, int | None]]:
    pids = runs.status_pids(st)
    assert (st.pids or {}).get("supervisor") and len(st.pids.get("ranks", {})) == ranks, st.pids
    assert len(st.pids.get("workers", [])) >= 1, "the plan-ahead worker is recorded"
    return pids


def _start(root: Path, name: str, **extra) -> tuple[runs.Run, launch.RunHandle]:
    run, spec, _ = prepare_train({**LIVE, **extra}, root=root, name=name)
    return run, launch.start(run, nproc=spec.nproc)


@pytest.mark.slow
def test_a_run_its_kernel_left_listens_on_loopback_refuses_a_second_start_and_stops_within_5s(tmp_path):
    """A process starts a run and goes away (a notebook kernel restarted); this process, which did
    not start it, finds it in the store and attaches to it, then checks it (each was a test with a
    run of its own): every socket it listens on is on the loopback interface; a second start,
    through the API and through ``workbench train --run-dir``, is refused and changes nothing; a
    stop through the attached handle ends every process of it within 5 s, status ``stopped``. (A
    stop from the process that started the run, its own handle: test_signal_to_workbench_train_stops_the_run.)"""
    psutil = pytest.importorskip("psutil")
    script = f"""
from workbench import launch
from workbench.training import prepare_train
run, spec, _ = prepare_train({LIVE!r}, root={str(tmp_path)!r}, name="orphan")
launch.start(run, nproc=2)
print(run.path)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    run = runs.load_run("orphan", root=tmp_path)
    try:
        st = _wait_for_step(run, 2)
        pids = _all_pids(st)
        h = launch.attach(run)
        assert h is not None and h.process is None and h.pid == run.status().pids["supervisor"]
        assert launch.poll(h) is None  # still running, seen from a process that did not start it
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
        left = _alive(pids)
    finally:
        launch.stop(run)
    assert final.state == "stopped", final.to_dict()
    assert not left and took < 5.0, f"stop took {took:.1f}s, alive after it: {left}"
    # a stopped run reads as stopped, not as failed, and nothing of it is alive
    assert runs.load_run(run.path).status().state == "stopped"
    assert launch.attach(run) is None


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict:
    """Two runs of the same seed and settings started at once, ``kill0`` and ``kill1``; once both
    have trained 3 steps side by side, SIGKILL to rank 0 of the first and to rank 1 of the second
    at the same moment. Returns, by the rank killed: ``run``, ``before`` (its status just before
    the kills), ``pids`` (every process it recorded), ``worker_maps`` (the planning worker's
    ``/proc/PID/maps`` then) and ``rank_maps`` (rank 0's), ``gone`` (seconds from the kill until none of them was alive; None
    when some outlived 10 s), ``final`` (``launch.wait``'s status)."""
    root = tmp_path_factory.mktemp("kill")
    started = {}
    out = {}
    try:
        for rank in (0, 1):
            started[rank] = _start(root, f"kill{rank}")
        for run, h in started.values():
            _wait_for_step(run, 3, h)
        for rank, (run, _) in started.items():
            st = run.status()
            out[rank] = {"run": run, "before": st, "pids": _all_pids(st)}
            # the planning worker itself (the recorded workers also hold multiprocessing's resource tracker)
            # and the libraries it mapped: a rank's __main__ (workbench.runtime.train) imports torch
            workers = [p for p in st.pids["workers"] if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
            out[rank]["worker_maps"] = [Path(f"/proc/{p}/maps").read_text() for p in workers]
            out[rank]["rank_maps"] = Path(f"/proc/{st.pids['ranks']['0']}/maps").read_text()
        for rank in started:
            os.kill(out[rank]["before"].pids["ranks"][str(rank)], signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10.0 and any("gone" not in o for o in out.values()):
            for o in out.values():
                if "gone" not in o and not _alive(o["pids"]):
                    o["gone"] = time.monotonic() - t0
            time.sleep(0.05)
        for rank, (_, h) in started.items():
            out[rank].setdefault("gone", None)
            out[rank]["final"] = launch.wait(h, timeout=10)
    finally:
        for run, _ in started.values():
            launch.stop(run)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_sigkill_of_a_rank_fails_the_run_and_leaves_nothing(killed, rank):
    k = killed[rank]
    final = k["final"]
    assert k["gone"] is not None, f"still alive 10 s after the kill: {_alive(k['pids'])}"
    assert final.state == "failed" and final.failing_rank == rank and final.signal == "SIGKILL", final.to_dict()
    assert f"rank {rank} killed by SIGKILL" in final.error
    assert final.exit_codes[str(rank)] == -signal.SIGKILL
    assert final.log_tail, "the failing rank's last log lines (or the run's) are in the status"
    print(f"rank {rank} killed: every process gone after {k['gone']:.1f}s")


@pytest.mark.slow
def test_two_runs_at_once(killed):
    """Two runs of the same seed and settings side by side (the killed-rank runs, both training
    when the kills came): the same losses. (Two runs at once that both end ``done``: the checkpoint
    runs, test_corrupt_and_empty_checkpoints.)"""
    a, b = killed[0]["before"], killed[1]["before"]
    assert a.state == b.state == "running" and min(a.step, b.step) >= 3, (a.to_dict(), b.to_dict())
    losses_a, losses_b = killed[0]["run"].losses(), killed[1]["run"].losses()
    assert {1, 2, 3} <= set(losses_a) & set(losses_b), (losses_a, losses_b)
    both = sorted(set(losses_a) & set(losses_b))
    assert [losses_a[s] for s in both] == pytest.approx([losses_b[s] for s in both], rel=1e-6)


@pytest.mark.slow
def test_a_ranks_planning_worker_does_not_load_torch(killed):
    """A rank's ``__main__`` is ``workbench.runtime.train`` (``python -m``), which imports torch; spawn
    would import it again in the planning worker (a second of CPU, a few hundred MB). Checked on the
    live planning workers of the two killed-rank runs, from the libraries each had mapped (beside
    rank 0's, which has torch's)."""
    for rank in (0, 1):
        assert "libtorch" in killed[rank]["rank_maps"], "a rank maps torch's library (the probe sees it)"
        maps = killed[rank]["worker_maps"]
        assert len(maps) == 1, f"run kill{rank}: {len(maps)} planning worker(s)"
        assert "libtorch" not in maps[0], f"run kill{rank}: the planning worker loaded torch"


def _train_in_a_terminal(tmp_path: Path, name: str, nproc: int = 2, **streams) -> tuple[subprocess.Popen, runs.Run]:
    """``workbench train`` as a user starts it in a terminal; returns once its run folder exists."""
    cmd = _workbench("train", "--nproc", str(nproc), "--steps", "400", "--model", "tiny", "--max-len", "256",
                     "--batch-tokens", "1024", "--checkpoint-every", "0", "--debug-step-sleep", "0.2",
                     "--run-root", str(tmp_path), "--name", name, "--device", "cpu")
    proc = subprocess.Popen(cmd, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), **streams)
    run = runs.Run(tmp_path / name)
    t0 = time.monotonic()
    while not run.path.exists():
        assert time.monotonic() - t0 < TIMEOUT and proc.poll() is None, "the run folder never appeared"
        time.sleep(0.1)
    return proc, run


SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""What a user's terminal sends ``workbench train`` to stop it (Ctrl-C's SIGINT takes the same path)."""
RANKS = {signal.SIGTERM: 1, signal.SIGHUP: 1, signal.SIGKILL: 1}
"""Ranks of the run each signal's command starts: the stop they lead to is one (``launch.stop``, or
the supervisor's own when its parent is gone) whatever the ranks, and the stop of several ranks,
each in a session of its own, is checked on the kernel's run (and the end of several on the killed
ranks')."""


@pytest.fixture(scope="module")
def signalled(tmp_path_factory) -> dict:
    """``workbench train`` started three times at once (``RANKS``), as a user starts it in a terminal;
    once the three runs have trained 2 steps, at the same moment: SIGTERM to the first command, SIGHUP to the
    second, SIGKILL to the third. Returns, by signal: ``run``, ``proc`` (the command, ended),
    ``err`` (its stderr), ``ended`` (seconds from the signal until the command ended, None past 30
    s), ``left`` (the run's processes alive when it ended) and ``gone`` (seconds until none of
    them was alive, None past 30 s)."""
    root = tmp_path_factory.mktemp("sig")
    started = {}
    out = {}
    try:
        for sig in (*SIGNALS, signal.SIGKILL):
            started[sig] = _train_in_a_terminal(root, signal.Signals(sig).name, nproc=RANKS[sig], stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE)
        pids = {sig: _all_pids(_wait_for_step(run, 2), RANKS[sig]) for sig, (_, run) in started.items()}
        t0 = time.monotonic()
        for sig, (proc, _) in started.items():
            proc.send_signal(sig)
        ended, gone, left = {}, {}, {}
        while time.monotonic() - t0 < 30 and (len(ended) < len(started) or len(gone) < len(started)):
            now = time.monotonic() - t0
            for sig, (proc, _) in started.items():
                if sig not in ended and proc.poll() is not None:
                    ended[sig], left[sig] = now, _alive(pids[sig])
                if sig not in gone and not _alive(pids[sig]):
                    gone[sig] = now
            time.sleep(0.05)
        for sig, (proc, run) in started.items():
            err = proc.stderr.read() if sig in ended else ""
            out[sig] = {"run": run, "proc": proc, "err": err, "ended": ended.get(sig), "left": left.get(sig),
                        "gone": gone.get(sig)}
    finally:
        for proc, run in started.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stderr.close()
            launch.stop(run)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS)
def test_signal_to_workbench_train_stops_the_run(signalled, sig):
    """The signal stops the run like Ctrl-C: ``workbench train`` stops it through its own handle
    (``launch.stop``), every process gone and the command ended within 5 s of the signal (three
    commands, one signal each, were signalled at once)."""
    r = signalled[sig]
    proc, err, took = r["proc"], r["err"], r["ended"]
    name = signal.Signals(sig).name
    assert took is not None and took < 5.0 and not r["left"], f"workbench train ended {took}s after {name}, alive: {r['left']}"
    assert proc.returncode == 128 + sig, err
    assert f"{name} received" in err and "stopped" in err.strip().splitlines()[-1]
    assert r["run"].status().state == "stopped"


@pytest.mark.slow
def test_killing_workbench_train_itself_stops_the_run(signalled):
    """SIGKILL cannot be caught: the supervisor notices its parent is gone and stops the run, every
    process of it gone within 10 s."""
    r = signalled[signal.SIGKILL]
    assert r["ended"] is not None and r["proc"].returncode == -signal.SIGKILL
    assert r["gone"] is not None and r["gone"] < 10.0, f"alive 10 s after the kill: {r['left']}"
    st = r["run"].status()
    assert st.state == "stopped" and "the process that started it" in (st.note or ""), st.to_dict()


def _flip_bytes(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for k in range(n):
        i = len(data) // 2 + k * 7
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


WORKER_STEPS = 6
"""Steps of the run whose planning worker is killed: 2 before the kill; the rest (4 of
WORKER_STEP_SLEEP_S at least: 2 s, fewer steps for more time than 8 of 0.2 s) leave time to open a
panel on the live run."""
WORKER_STEP_SLEEP_S = 0.5


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> dict:
    """Two runs started at once, with a checkpoint after each step: ``ck0`` (ZeRO-0, whole files;
    one rank, 3 steps, planning inline: a whole file is laid out alike whatever the ranks, and a
    resume on several ranks is test_train's) and ``ck3`` (ZeRO-3, sharded folders: 2 ranks, a
    shard each; WORKER_STEPS steps of WORKER_STEP_SLEEP_S at least, planning ahead, in a run root of its own).
    After ``ck3``'s second step its planning worker is killed (SIGKILL); once the run says so, a
    Launch panel is opened on that root (a notebook reattaching) and shows what it shows. Returns,
    by name, ``run``, ``final`` (its status as it ended), ``steps`` and ``losses`` as they ended,
    before test_corrupt_and_empty_checkpoints damages and resumes them; for ``ck3`` also
    ``worker`` (the pid killed), ``attached`` (whether the panel reattached to the run), ``shown``
    (its status text) and ``show`` (what ``workbench runs show`` printed once it ended)."""
    from widgets import LaunchPanel

    root = tmp_path_factory.mktemp("ck")
    out: dict[str, dict] = {}
    started = {}
    try:
        ck3 = dict(steps=WORKER_STEPS, zero_stage=3, debug={"step_sleep_s": WORKER_STEP_SLEEP_S})
        for name, where, extra in (("ck0", root, dict(steps=3, nproc=1, zero_stage=0, plan_ahead=False, debug={})),
                                   ("ck3", root / "w", ck3)):
            run, h = _start(where, name, checkpoint_every=1, **extra)
            started[name] = (run, h)
            out[name] = {"run": run}
        # a panel built once first (while the runs start), so that the one opened on the live run below
        # does not pay its first imports (seconds under load, when the steps left could end the run
        # before it attaches)
        LaunchPanel(root=root / "w", follow=False, reattach=False).close()
        run, h = started["ck3"]
        st = _wait_for_step(run, 2, h)
        # the planning worker itself (the recorded workers also hold multiprocessing's resource tracker)
        worker = [p for p in st.pids["workers"] if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(worker) == 1, st.pids
        os.kill(worker[0], signal.SIGKILL)
        t0 = time.monotonic()
        while not run.status().warnings:
            assert time.monotonic() - t0 < 60 and launch.poll(h) is None, run.log_tail(30)
            time.sleep(0.1)
        panel = LaunchPanel(root=root / "w", follow=False)
        attached = panel.run == run
        panel.refresh()
        out["ck3"].update(worker=worker[0], attached=attached, shown=panel.status.value)
        panel.close()
        for name, (_, h) in started.items():
            out[name]["final"] = launch.wait(h, timeout=TIMEOUT)
    finally:
        for run, _ in started.values():
            launch.stop(run)
    for name, (run, _) in started.items():
        out[name].update(steps=[s.step for s in run.steps()], losses=run.losses())
    # what `workbench runs show` prints of it, as it ended
    out["ck3"]["show"] = subprocess.run(_workbench("runs", "show", "ck3", "--root", str(root / "w")), capture_output=True,
                                        text=True, timeout=60).stdout
    return out


@pytest.mark.slow
@pytest.mark.untimed
def test_a_killed_plan_ahead_worker_costs_time_not_the_run(checkpointed):
    from workbench.scenario import Scenario
    from workbench.solve import plan_from_dict, run_planner
    from workbench.solve.ahead import plan_lengths

    ck = checkpointed["ck3"]
    run, final, worker = ck["run"], ck["final"], ck["worker"]
    # a Launch panel opened once the run said so (a notebook reattaching) shows the warning beside the progress
    assert ck["attached"], "the panel reattached to the live run"
    shown = ck["shown"]
    assert "warning: the planning worker process died" in shown and "planning the remaining steps inline" in shown
    assert final.state == "done" and final.step == WORKER_STEPS, final.to_dict()
    assert ck["steps"] == list(range(1, WORKER_STEPS + 1))
    # said once: in the status (what `workbench runs show` and the Launch panel print) and in the log
    assert len(final.warnings) == 1, final.warnings
    note = final.warnings[0]
    assert f"pid {worker} killed by SIGKILL" in note and "planning the remaining steps inline" in note
    assert run.file("log.txt").read_text().count(f"pid {worker} killed by SIGKILL") == 1
    assert final.resolved["planning"].startswith("inline")
    assert f"warning: {note}" in ck["show"]
    # every step ran the planner's own plan of its batch, before the kill and after it (the first
    # attempt's: test_corrupt_and_empty_checkpoints may have resumed the run since)
    sc = Scenario.from_dict(final.resolved["scenario"])
    rows = [r for r in map(json.loads, run.file("plans.jsonl").read_text().splitlines()) if r["attempt"] == 1]
    assert [r["step"] for r in rows] == list(range(WORKER_STEPS))
    for r in rows:
        plan = plan_from_dict(r["plan"])
        want = run_planner(sc.planner, plan_lengths(plan), sc.cost(), seed=sc.seed, effort=sc.effort, time_limit=sc.time_limit,
                           max_len=sc.max_len, batch_id=r["batch_id"]).to_dict()
        got = dict(r["plan"])
        for d in (got, want):
            d.pop("solve_seconds")
        assert got == want, r["step"]


def _resume(run: runs.Run, steps: int) -> subprocess.Popen:
    """``workbench train --run-dir RUN --steps STEPS`` started (``communicate`` waits for it)."""
    return subprocess.Popen(_workbench("train", "--run-dir", str(run.path), "--steps", str(steps)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _ended(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def corrupted(checkpointed) -> dict:
    """Both checkpoint runs, by ZeRO stage (0: whole files, 3: sharded folders), damaged and resumed:
    the newest checkpoint (step n) gets 64 flipped bytes (a shard of the folder), the one before an
    empty file (the folder's trainer.pt), and ``workbench train --run-dir RUN --steps n+1`` resumes
    it. And a run with no usable checkpoint in either layout: a copy of ``ck0`` made before (its
    spec, files steps 1-3) given ``ck3``'s sharded folders of the later steps (as a run resumed from
    ZeRO-0 onto ZeRO-3 holds), every checkpoint then junk, tried with ``--steps`` past its last. The
    three commands run at once. Returns, by stage: ``run``, ``n``, ``damaged``, ``emptied``,
    ``good`` and ``good_after`` (step n-2's weights before and after the resume), ``resumed`` (that
    command's result), ``status`` (the run's after it), ``verified`` (``verify_checkpoint`` of step
    n after it); and ``junk``: ``run``, ``files`` and ``folders`` (the checkpoints made junk, by
    layout), ``result``, ``status`` (the run's after it)."""
    import shutil

    from workbench.runtime.checkpoint import full_model_state, verify_checkpoint

    out: dict = {}
    ck0, ck3 = checkpointed["ck0"]["run"], checkpointed["ck3"]["run"]
    junk = runs.Run(shutil.copytree(ck0.path, ck0.path.with_name("ck0-junk")))
    last = max(step for step, _ in junk.checkpoints())
    for step, path in ck3.checkpoints():
        if step > last:
            shutil.copytree(path, junk.path / "checkpoints" / path.name)
    for _, path in junk.checkpoints():
        (path / "trainer.pt" if path.is_dir() else path).write_bytes(b"junk")
    out["junk"] = {"run": junk, "files": [p.name for _, p in junk.checkpoints() if p.is_file()],
                   "folders": [p.name for _, p in junk.checkpoints() if p.is_dir()]}
    for stage in (0, 3):
        ck = checkpointed[f"ck{stage}"]
        run, n = ck["run"], ck["final"].step
        assert ck["final"].state == "done" and n >= 3, ck["final"].to_dict()
        folder = run.path / "checkpoints"
        if stage == 3:
            damaged, emptied = folder / f"step_{n}.dcp" / "__1_0.distcp", folder / f"step_{n - 1}.dcp" / "trainer.pt"
        else:
            damaged, emptied = folder / f"step_{n}.pt", folder / f"step_{n - 1}.pt"
        out[stage] = {"run": run, "n": n, "damaged": damaged, "emptied": emptied, "good": full_model_state(run.path, n - 2)}
        _flip_bytes(damaged)  # 64 flipped bytes
        emptied.write_bytes(b"")  # an empty file
    started = {stage: _resume(out[stage]["run"], out[stage]["n"] + 1) for stage in (0, 3)}
    started["junk"] = _resume(junk, checkpointed["ck3"]["final"].step + 2)
    for key, proc in started.items():
        o = out[key]
        if key == "junk":
            o.update(result=_ended(proc), status=junk.status())
            continue
        o.update(resumed=_ended(proc), status=o["run"].status())
        newest = o["run"].path / "checkpoints" / (f"step_{o['n']}.dcp" if key == 3 else f"step_{o['n']}.pt")
        o.update(verified=verify_checkpoint(newest), good_after=full_model_state(o["run"].path, o["n"] - 2))
    return out


@pytest.mark.slow
@pytest.mark.untimed
@pytest.mark.parametrize("stage", [0, 3])
def test_corrupt_and_empty_checkpoints(checkpointed, corrupted, stage):
    """Whole files (ZeRO-0) and sharded folders (ZeRO-3): a damaged and an empty checkpoint are
    skipped, naming the file, and the run resumes from the newest good one; none good: one line,
    naming the unusable checkpoints of this layout (a run holding both layouts, all junk). The two
    runs were started at once and both ended ``done``, every step trained."""
    first = checkpointed[f"ck{stage}"]
    assert first["final"].state == "done", first["final"].to_dict()
    c = corrupted[stage]
    run, n, damaged, emptied = c["run"], c["n"], c["damaged"], c["emptied"]
    # a checkpoint after each step, n of them: the newest damaged, the one before emptied
    assert first["steps"] == list(range(1, n + 1)) and n >= 3
    ck = run.path / "checkpoints"
    p = c["resumed"]
    assert p.returncode == 0, p.stderr
    assert f"{damaged.relative_to(ck)} does not match its checksum" in p.stderr
    assert f"{emptied.relative_to(ck)} is empty" in p.stderr
    st = c["status"]
    assert st.resumed_from == n - 2 and st.step == n + 1 and st.state == "done"
    # the resumed weights were step n-2's, not the damaged step n's: step n-1 redone from them gives
    # the first run's step n-1 loss again
    rows = [json.loads(x) for x in run.file("metrics.jsonl").read_text().splitlines()]
    before = {r["step"]: r["loss"] for r in rows if r["rank"] == 0 and r["attempt"] == 1}
    again = {r["step"]: r["loss"] for r in rows if r["rank"] == 0 and r["attempt"] == 2}
    assert again[n - 2] == pytest.approx(before[n - 2], rel=1e-6) and set(again) == {n - 2, n - 1, n}
    assert c["good_after"].keys() == c["good"].keys()
    assert c["verified"] is None  # step n rewritten by the resume, good again
    # no usable checkpoint at all: one line naming every junk checkpoint of this layout, nothing trained
    junk = corrupted["junk"]
    names = junk["folders"] if stage == 3 else junk["files"]
    assert junk["files"] and junk["folders"], junk
    p = junk["result"]
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("workbench train: error:") and "no usable checkpoint" in last, p.stderr
    assert all(name in last for name in names), (names, last)
    assert junk["status"].state == "failed"


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
