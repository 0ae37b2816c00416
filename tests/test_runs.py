"""The run store: the one status writer (locking, merging, atomic), readers that never crash on
half-written, older or damaged runs, listing, comparing by hand-computed figures, checksums."""

import json
import multiprocessing
import os
import statistics

import pytest

from workbench import runs


def test_new_run_layout_and_errors(tmp_path):
    r = runs.new_run("train", {"steps": 3}, root=tmp_path, run_id="a1")
    assert r.path == tmp_path / "a1" and r.spec() == {"kind": "train", "steps": 3}
    st = r.status()
    assert st.state == "created" and st.run_id == "a1" and st.kind == "train" and st.created
    with pytest.raises(ValueError, match="already exists"):
        runs.new_run("train", {}, root=tmp_path, run_id="a1")
    with pytest.raises(ValueError, match="unknown run kind"):
        runs.new_run("party", {}, root=tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        runs.new_run("demo", {}, root=tmp_path / "afile" / "sub")
    with pytest.raises(ValueError, match="may hold only"):
        runs.new_run("demo", {}, root=tmp_path, run_id="../x")
    fresh = runs.new_run("demo", {}, root=tmp_path)
    assert "-demo-" in fresh.id


def test_update_status_merges_and_keeps_final_states(tmp_path):
    r = runs.new_run("train", {}, root=tmp_path, run_id="m")
    runs.update_status(r.path, state="running", pids={"supervisor": 11, "ranks": {"0": 12}})
    runs.update_status(r.path, pids={"ranks": {"1": 13}})
    st = runs.read_status(r.path)
    assert st.pids == {"supervisor": 11, "ranks": {"0": 12, "1": 13}}
    runs.update_status(r.path, pids={"ranks": {"0": None}})  # None deletes a key
    assert runs.read_status(r.path).pids["ranks"] == {"1": 13}
    runs.update_status(r.path, state="stopped")
    runs.update_status(r.path, state="running", step=5)  # a late write from a dying rank
    st = runs.read_status(r.path)
    assert st.state == "stopped" and st.step == 5
    runs.update_status(r.path, state="starting", reopen=True, pids=None)  # a new attempt
    st = runs.read_status(r.path)
    assert st.state == "starting" and st.pids == {}
    with pytest.raises(ValueError, match="no field"):
        runs.update_status(r.path, colour="red")
    with pytest.raises(ValueError, match="unknown run state"):
        runs.update_status(r.path, state="exploded")


def test_warnings_are_appended_once_and_shown(tmp_path):
    from conftest import run_cli

    r = runs.new_run("train", {}, root=tmp_path, run_id="w")
    runs.update_status(r.path, state="running", warnings=["the worker died"])
    runs.update_status(r.path, warnings=["the worker died"], step=3)  # said again: kept once
    runs.update_status(r.path, warnings=["disk nearly full"])
    assert runs.read_status(r.path).warnings == ["the worker died", "disk nearly full"]
    assert r.summary()["warnings"] == ["the worker died", "disk nearly full"]
    out = run_cli("runs", "show", "w", "--root", str(tmp_path)).stdout
    assert "  warning: the worker died\n  warning: disk nearly full\n" in out
    runs.update_status(r.path, state="starting", reopen=True, warnings=None)  # a new attempt
    assert runs.read_status(r.path).warnings == []
    # an older or foreign status with something else there still reads
    (r.path / runs.STATUS_FILE).write_text(json.dumps({"state": "done", "warnings": "one line"}))
    assert runs.read_status(r.path).warnings == ["one line"]


def _writer(path: str, rank: int, n: int) -> None:
    for k in range(n):
        runs.update_status(path, pids={"ranks": {str(rank): 1000 + rank}}, resolved={f"r{rank}": k})


def test_concurrent_writers_lose_nothing(tmp_path):
    """Four processes update the same status 25 times each: every key of every writer survives
    (the lock makes read-merge-write one step), and the file is valid JSON throughout."""
    r = runs.new_run("train", {}, root=tmp_path, run_id="c")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(r.path), k, 25)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    st = runs.read_status(r.path)
    assert st.pids["ranks"] == {str(k): 1000 + k for k in range(4)}
    assert st.resolved == {f"r{k}": 24 for k in range(4)}


def test_readers_survive_half_written_and_older_runs(tmp_path):
    # an older demo run's status shape, a run without spec.json, a status that is not JSON
    old = tmp_path / "20250101-000000-demo-0000"
    old.mkdir()
    (old / "status.json").write_text(json.dumps({"state": "done", "seconds": 7.2}))
    (old / "spec.json").write_text(json.dumps({"kind": "demo", "family": "wikipedia"}))
    half = tmp_path / "half"
    half.mkdir()
    (half / "status.json").write_text('{"state": "runn')
    nospec = tmp_path / "nospec"
    nospec.mkdir()
    (nospec / "status.json").write_text(json.dumps({"state": "weird-state"}))
    (tmp_path / "not-a-run").mkdir()
    listed = runs.list_runs(tmp_path)
    assert [r.id for r in listed] == ["20250101-000000-demo-0000", "half", "nospec"]
    a, h, n = listed
    assert a.status().state == "done" and a.status().extra == {"seconds": 7.2} and a.kind == "demo"
    assert h.status().state == "created" and any("unreadable" in p for p in h.problems)
    assert n.status().state == "created" and n.spec() == {} and any("no spec.json" in p for p in n.problems)
    for r in listed:
        s = r.summary()  # never raises
        assert s["id"] == r.id
    with pytest.raises(runs.RunNotFound, match="not a run"):
        runs.load_run(tmp_path / "not-a-run")


def test_bad_metrics_lines_are_skipped_and_counted(tmp_path):
    r = runs.new_run("train", {}, root=tmp_path, run_id="m")
    rows = [{"step": s, "rank": 0, "loss": 5.0 - s, "batch_tokens": 1000, "sequences": 4, "measured_ms": 100.0 + s,
             "predicted_ms": 90.0} for s in range(3)]
    with open(r.file(runs.METRICS_FILE), "wb") as f:
        f.write((json.dumps(rows[0]) + "\n").encode())
        f.write(b"\xff\xfe not utf-8 \x80\n")
        f.write(b"{not json}\n")
        f.write(b"[1, 2]\n")
        f.write((json.dumps(rows[1]) + "\n").encode())
        f.write((json.dumps(rows[2]) + "\n").encode())
        f.write(b'{"step": 3, "rank": 0, "lo')  # being written: no newline yet, not counted
    steps = r.steps()
    assert [s.step for s in steps] == [1, 2, 3]
    assert [s.loss for s in steps] == [5.0, 4.0, 3.0]
    assert steps[0].tokens_per_s == pytest.approx(1000 / 100.0 * 1e3)
    assert any("3 unreadable line(s)" in p for p in r.problems)


def test_latest_attempt_of_a_repeated_step_counts(tmp_path):
    r = runs.new_run("train", {}, root=tmp_path, run_id="re")
    for attempt, loss in ((1, 9.0), (2, 1.0)):
        runs.append_jsonl(r.file(runs.METRICS_FILE), {"step": 0, "rank": 0, "attempt": attempt, "loss": loss,
                                                      "measured_ms": 1.0, "batch_tokens": 1})
    assert r.losses() == {1: 1.0}


def _fake_train_run(root, rid, measured, predicted, planner):
    r = runs.new_run("train", {"scenario": {"planner": planner}}, root=root, run_id=rid)
    for s, (m, p) in enumerate(zip(measured, predicted)):
        runs.append_jsonl(r.file(runs.METRICS_FILE), {"step": s, "rank": 0, "loss": 3.0 - 0.1 * s, "batch_tokens": 2000,
                                                      "sequences": 3, "measured_ms": m, "predicted_ms": p})
    return r


def test_compare_by_hand(tmp_path):
    a = _fake_train_run(tmp_path, "a", [900, 200, 210, 190], [180, 180, 180, 180], "static:4")
    _fake_train_run(tmp_path, "b", [800, 150, 170, 160], [170, 170, 170, 170], "greedy")
    res = runs.compare("a", "b", root=tmp_path)  # first step (start-up) left out
    ra, rb = res["runs"]
    assert ra["median_measured_ms"] == statistics.median([200, 210, 190]) == 200
    assert rb["median_measured_ms"] == 160
    assert ra["measured_over_predicted"] == pytest.approx(200 / 180)
    assert res["speedup_b_over_a"] == pytest.approx(200 / 160)
    assert res["predicted_speedup"] == pytest.approx(180 / 170)
    assert rb["median_tokens_per_s"] == pytest.approx(2000 / 160 * 1e3)
    empty = runs.new_run("train", {}, root=tmp_path, run_id="empty")
    with pytest.raises(ValueError, match="no measured steps"):
        runs.compare(a, empty)


def test_load_run_by_id_prefix_and_clear_misses(tmp_path):
    runs.new_run("train", {}, root=tmp_path, run_id="20261123-100000-train-aaaa")
    runs.new_run("train", {}, root=tmp_path, run_id="20261123-100000-train-bbbb")
    assert runs.load_run("20261123-100000-train-a", root=tmp_path).id.endswith("aaaa")
    with pytest.raises(runs.RunNotFound, match="matches 2 runs"):
        runs.load_run("20261123", root=tmp_path)
    with pytest.raises(runs.RunNotFound, match="no run 'zzz'"):
        runs.load_run("zzz", root=tmp_path)
    with pytest.raises(runs.RunNotFound, match="empty"):
        runs.load_run("", root=tmp_path)


def test_checksums(tmp_path):
    p = tmp_path / "step_2.pt"
    p.write_bytes(os.urandom(4096))
    digest = runs.write_checksum(p)
    assert runs.verify_checksum(p) is None
    assert runs.checksum_path(p).read_text().startswith(digest)
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    assert "does not match its checksum" in runs.verify_checksum(p)
    p.write_bytes(b"")
    assert "is empty" in runs.verify_checksum(p)
    q = tmp_path / "step_4.pt"
    q.write_bytes(b"abc")
    assert "no readable checksum" in runs.verify_checksum(q)


def test_status_json_is_strict_json(tmp_path):
    r = runs.new_run("train", {}, root=tmp_path, run_id="s")
    runs.update_status(r.path, loss=float("nan"), resolved={"x": float("inf")})
    text = r.file(runs.STATUS_FILE).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert runs.read_status(r.path).loss is None


def test_a_running_status_with_dead_processes_reads_as_failed(tmp_path):
    r = runs.new_run("train", {}, root=tmp_path, run_id="dead")
    p = multiprocessing.get_context("spawn").Process(target=int)
    p.start()
    p.join()
    runs.update_status(r.path, state="running", pids={"supervisor": p.pid})
    st = r.status()
    assert st.state == "failed" and "gone" in st.error
    assert runs.read_status(r.path).state == "running"  # the file itself is not changed by a reader


@pytest.mark.serial  # a 0.5 s grace against a 3 s shutdown: the kill must come first
def test_runs_stop_gives_the_grace_it_is_told(tmp_path, capsys):
    """``workbench runs stop --grace S``: a supervisor that takes a while to end after SIGTERM (as one
    saving a checkpoint) ends by itself within a long grace and is SIGKILLed past a short one."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import cli_main

    slow_exit = ("import signal, sys, time\n"
                 "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(float(sys.argv[1])), sys.exit(0)))\n"
                 "print('ready', flush=True)\ntime.sleep(120)\n")
    for name, shutdown_s, grace, want in (("long", 1.0, "30", 0), ("short", 3.0, "0.5", -signal.SIGKILL)):
        proc = subprocess.Popen([sys.executable, "-c", slow_exit, str(shutdown_s)], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            assert proc.stdout.readline().strip() == "ready"  # its handler is installed
            r = runs.new_run("train", {}, root=tmp_path, run_id=name)
            runs.update_status(r.path, state="running", pids={"supervisor": proc.pid, **runs.process_record(proc.pid)})
            t0 = time.monotonic()
            res = cli_main(capsys, "runs", "stop", name, "--root", str(tmp_path), "--grace", grace)
            took = time.monotonic() - t0
            assert proc.wait(timeout=10) == want, (name, took, res.stdout, res.stderr)
            assert res.returncode == 0 and f"{name}: stopped; no process left here" in res.stdout, res.stdout + res.stderr
            assert took < float(grace) + 3, took  # no longer than the grace (and the sweep's SIGKILL second)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
