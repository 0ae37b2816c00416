"""The environment a run's processes get (``workbench.launch.process.worker_env``): a CUDA run's
allocator uses expandable segments unless the user set ``PYTORCH_CUDA_ALLOC_CONF`` (theirs is kept,
and the run's log says once when it leaves them out); a CPU run gets no allocator setting.
``start`` is driven with a stand-in ``Popen`` that records the environment it was given."""

from __future__ import annotations

import pytest

from workbench import runs
from workbench.launch import process
from workbench.launch.process import ALLOC_CONF, EXPANDABLE_SEGMENTS, run_uses_cuda, worker_env


def test_a_cuda_run_gets_expandable_segments():
    env, note = worker_env({"PATH": "/bin"}, cuda=True)
    assert env[ALLOC_CONF] == "expandable_segments:True" == EXPANDABLE_SEGMENTS and note is None
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"


def test_a_cpu_run_gets_no_allocator_setting_and_keeps_the_users():
    env, note = worker_env({"OMP_NUM_THREADS": "4"}, cuda=False)
    assert ALLOC_CONF not in env and note is None and env["OMP_NUM_THREADS"] == "4"
    env, note = worker_env({ALLOC_CONF: "max_split_size_mb:128"}, cuda=False)
    assert env[ALLOC_CONF] == "max_split_size_mb:128" and note is None  # a CPU run never reads it: no note


@pytest.mark.parametrize("theirs, noted", [("max_split_size_mb:512", True), ("expandable_segments:False", False),
                                           ("garbage_collection_threshold:0.8, expandable_segments: True", False),
                                           ("", True)])
def test_the_users_value_is_never_overridden(theirs, noted):
    base = {ALLOC_CONF: theirs}
    env, note = worker_env(base, cuda=True)
    assert env[ALLOC_CONF] == theirs and base == {ALLOC_CONF: theirs}  # kept, and the caller's mapping untouched
    assert (note is not None) == noted
    if noted:
        assert repr(theirs) in note and "is yours and kept" in note and EXPANDABLE_SEGMENTS in note


def _run(tmp_path, device):
    spec = {"device": device} if device is not None else {}
    return runs.new_run("train", spec, root=tmp_path)


def test_which_runs_use_cuda(tmp_path, monkeypatch):
    assert run_uses_cuda(_run(tmp_path, "cuda")) is True
    assert run_uses_cuda(_run(tmp_path, "cpu")) is False
    monkeypatch.setattr(process, "_gpu_may_be_visible", lambda: False)
    assert run_uses_cuda(_run(tmp_path, "auto")) is False and run_uses_cuda(_run(tmp_path, None)) is False
    monkeypatch.setattr(process, "_gpu_may_be_visible", lambda: True)
    assert run_uses_cuda(_run(tmp_path, "auto")) is True
    monkeypatch.undo()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert process._gpu_may_be_visible() is False
    assert run_uses_cuda(_run(tmp_path, "auto")) is False


class _Popen:
    """Records the environment and the command a supervisor would have been started with."""
    started: list = []

    def __init__(self, cmd, *, env, **kw):
        _Popen.started.append((cmd, env))
        self.pid = 2 ** 22 + len(_Popen.started)  # no such process: nothing is alive afterwards

    def poll(self):
        return 0


@pytest.fixture
def fake_popen(monkeypatch):
    _Popen.started = []
    monkeypatch.setattr(process.subprocess, "Popen", _Popen)
    monkeypatch.setattr(process.runs, "proc_start_time", lambda pid: None)
    monkeypatch.setattr(process.runs, "process_record", lambda pid=None: {})
    return _Popen.started


def test_start_hands_the_supervisor_the_worker_env(tmp_path, monkeypatch, fake_popen):
    """start() builds the environment with worker_env from the run's device; a user's setting without
    expandable segments is noted in the run's log once over two attempts."""
    gpu = _run(tmp_path, "cuda")
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    process.start(gpu, nproc=1)
    assert fake_popen[-1][1][ALLOC_CONF] == EXPANDABLE_SEGMENTS
    cpu = _run(tmp_path, "cpu")
    process.start(cpu, nproc=1)
    assert ALLOC_CONF not in fake_popen[-1][1]
    process.start(cpu, nproc=1, cuda=True)  # a caller that knows better (the GPU check) says so
    assert fake_popen[-1][1][ALLOC_CONF] == EXPANDABLE_SEGMENTS
    monkeypatch.setenv(ALLOC_CONF, "max_split_size_mb:256")
    user = _run(tmp_path, "cuda")
    for _ in range(2):
        process.start(user, nproc=1)
        assert fake_popen[-1][1][ALLOC_CONF] == "max_split_size_mb:256"
    log = runs.log_path(user.path, None).read_text()
    assert log.count("attempt") == 2 and log.count(f"{ALLOC_CONF}='max_split_size_mb:256' is yours and kept") == 1
    # an env given explicitly is the base, as before
    process.start(gpu, nproc=1, env={"PATH": "/bin"})
    assert fake_popen[-1][1] == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                 ALLOC_CONF: EXPANDABLE_SEGMENTS}
