"""Ranks forked from the supervisor (``workbench.launch.forked``, the default on Linux) start as
torchrun's exec-started ones do, in everything a rank can observe: the reference is the same probe
started by ``WORKBENCH_RANK_START=exec`` (new interpreters, as torchrun's CLI starts them), and
Python's own defaults for a fresh interpreter.

Each run is two ranks of ``tests/_probes/rank.py`` under the real supervisor: each writes what it sees
(``__main__``, its arguments, its session and process group, its signal dispositions, its parent-death
signal, the sockets it holds, whether its output is unbuffered, torch's threads, torchrun's
variables); rank 1 then ends with status 3 or an uncaught exception, rank 0 with
``exit_process(0)``. The whole run ending ``done`` under fork is every other multi-process test
(test_train, test_faults, test_multinode ...), which run forked by default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from workbench import launch, runs
from workbench.launch import forked

TESTS = Path(__file__).resolve().parent
TIMEOUT = 120


def _start(root: Path, method: str, rank1: str) -> launch.RunHandle:
    run = runs.new_run("train", {}, root=root, run_id=f"probe-{method}-{rank1}")
    env = dict(os.environ, WORKBENCH_RANK_START=method,
               PYTHONPATH=os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p))
    return launch.start(run, nproc=2, module="_probes.rank", module_args=["--rank1", rank1], env=env, cuda=False)


def _probes(run_dir: Path) -> dict:
    return {r: json.loads((run_dir / f"probe-rank{r}.json").read_text()) for r in (0, 1)}


def _rank_log(run_dir: Path, rank: int, stream: str) -> str:
    found = list((run_dir / runs.TORCHRUN_LOG_DIR).glob(f"attempt_1/*/attempt_0/{rank}/{stream}.log"))
    assert len(found) == 1, found
    return found[0].read_text()


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """The three runs at once: exec and fork with rank 1 exiting 3, fork with rank 1 raising."""
    root = tmp_path_factory.mktemp("forked")
    handles = {(m, r): _start(root, m, r) for m, r in (("exec", "exit3"), ("fork", "exit3"), ("fork", "raise"))}
    return {key: (h.run_dir, launch.wait(h, timeout=TIMEOUT)) for key, h in handles.items()}


@pytest.mark.slow
@pytest.mark.untimed
def test_a_forked_rank_sees_what_an_exec_started_one_sees(ended):
    (exec_dir, _), (fork_dir, _) = ended["exec", "exit3"], ended["fork", "exit3"]
    exec_probe, fork_probe = _probes(exec_dir), _probes(fork_dir)
    for r in (0, 1):
        want, got = exec_probe[r], fork_probe[r]
        # the run folder differs, nothing else
        assert got["argv"] == [a.replace(str(exec_dir), str(fork_dir)) for a in want["argv"]]
        assert {k: v for k, v in got.items() if k != "argv"} == {k: v for k, v in want.items() if k != "argv"}, r
        # and what a fresh interpreter started by torchrun has (Python's defaults, torchrun's variables)
        assert got["main"] == "__main__" and got["argv"] == ["--run-dir", str(fork_dir), "--rank1", "exit3"]
        assert got["own_session"] and got["own_process_group"]
        assert got["signals"] == {"SIGTERM": "default", "SIGINT": "KeyboardInterrupt", "SIGHUP": "default",
                                  "SIGQUIT": "default", "SIGUSR1": "default", "SIGUSR2": "default",
                                  "SIGCHLD": "default", "SIGPIPE": "ignored"}
        assert got["death_signal"] == 0 and got["sockets"] == 0 and got["unbuffered"] is True
        assert got["torch_threads"] == int(os.environ.get("OMP_NUM_THREADS", "1")) and got["cuda_bad_fork"] is False
        assert got["env"]["RANK"] == got["env"]["LOCAL_RANK"] == str(r)
        assert got["env"]["WORLD_SIZE"] == got["env"]["LOCAL_WORLD_SIZE"] == "2"


@pytest.mark.slow
@pytest.mark.untimed
def test_a_forked_ranks_exit_status_and_the_runs_end_are_an_exec_started_ones(ended):
    (_, exec_st), (fork_dir, fork_st) = ended["exec", "exit3"], ended["fork", "exit3"]
    assert exec_st.state == fork_st.state == "failed"
    assert exec_st.failing_rank == fork_st.failing_rank == 1
    assert exec_st.exit_codes["1"] == fork_st.exit_codes["1"] == 3
    assert fork_st.error == exec_st.error and fork_st.error.startswith("rank 1 ") and fork_st.error.endswith(" 3")
    # the supervisor says how its ranks started; no rank warns that its module was imported twice
    assert "(ranks start by fork)" in runs.log_path(fork_dir).read_text()
    for r in (0, 1):
        assert "RuntimeWarning" not in _rank_log(fork_dir, r, "stderr")


@pytest.mark.slow
@pytest.mark.untimed
def test_a_forked_ranks_uncaught_exception_is_in_its_log_and_fails_the_run(ended):
    run_dir, st = ended["fork", "raise"]
    assert st.state == "failed" and st.failing_rank == 1 and st.exit_codes["1"] == 1
    err = _rank_log(run_dir, 1, "stderr")
    # what the interpreter prints for an uncaught exception
    assert "Traceback (most recent call last):" in err
    assert err.rstrip().endswith("ValueError: the probe's rank 1 fails here")
    assert any("ValueError: the probe's rank 1 fails here" in line for line in st.log_tail)


def test_the_start_method_comes_from_the_environment(monkeypatch):
    import torch

    monkeypatch.delenv(forked.START_METHOD_ENV, raising=False)
    assert forked.start_method() == "fork"  # Linux and a CPU build of torch, where the tests run
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    assert forked.start_method() == "exec"  # a CUDA build keeps new interpreters unless asked
    monkeypatch.setenv(forked.START_METHOD_ENV, "fork")
    assert forked.start_method() == "fork"
    monkeypatch.setenv(forked.START_METHOD_ENV, "exec")
    assert forked.start_method() == "exec"
    monkeypatch.setenv(forked.START_METHOD_ENV, "spawn")
    with pytest.raises(ValueError, match="WORKBENCH_RANK_START must be one of fork, exec, got 'spawn'"):
        forked.start_method()


def test_a_supervisor_that_initialised_cuda_does_not_fork(monkeypatch):
    """A forked process cannot use its parent's CUDA context: the supervisor refuses, naming the way out
    (torch's own flag, stood in for on this machine without a GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    forked.refuse_cuda()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="WORKBENCH_RANK_START=exec"):
        forked.refuse_cuda()


def test_torchruns_launch_configuration_asks_about_cuda_without_initialising_it(monkeypatch, tmp_path):
    """torchrun's LaunchConfig, built in the supervisor before its ranks fork, asks
    ``torch.cuda.is_available()`` and the device count (to choose NUMA bindings). torch's default
    check calls ``cudaGetDeviceCount``, which initialises CUDA in the supervisor and leaves no forked
    rank able to use the GPU; under ``cuda_checks_without_init`` it asks NVML instead. Stand-ins on
    this machine without a GPU: a CUDA build of torch, NVML counting 2 GPUs, and a recorder in place
    of ``cudaGetDeviceCount``."""
    import torch
    from torch.distributed.run import config_from_args, parse_args

    from workbench.launch.supervisor import torchrun_args

    calls: list = []
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: calls.append("cudaGetDeviceCount") or 2, raising=False)
    monkeypatch.delenv(forked.NVML_CHECK_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def config() -> None:
        config_from_args(parse_args(torchrun_args(tmp_path, nproc=2, nnodes=1, node_rank=0, rdzv_endpoint=None,
                                                  rdzv_id=None, module="m", module_args=[], attempt=1)))

    config()
    assert calls == ["cudaGetDeviceCount"]  # torchrun's own check initialises CUDA: what the guard is for
    calls.clear()
    with forked.cuda_checks_without_init():
        config()
    assert calls == []
    assert forked.NVML_CHECK_ENV not in os.environ  # the supervisor's environment as it was
