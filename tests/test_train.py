"""The trainer, its spec and its launcher.

Fast tests (no processes): spec.json validation, preparing and resuming rules, the supervisor's
argument list, token data, resource checks. Slow tests (``-m slow``): real torchrun runs of the
tiny model on CPU with gloo, 1 to 4 ranks, through the ``workbench train`` CLI and the launcher
API (three launches at once), and (the runs and resumes whose checks need neither) the trainer
itself on each run of one tree of runs, a world of 4 ranks of the shared torchrun launch
(tests/_torchrun.py's sub-worlds; this file's alone): the same parameters
after one SGD step whatever the plan and world size, a falling loss, an exact resume that keeps
the run's own settings, resumes onto another world and ZeRO stage, and clear errors (and no hang)
on bad input.
Faults (kills, signals, corrupt checkpoints, sockets) are in test_faults.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from workbench.launch.process import supervisor_command
from workbench.scenario import Scenario
from workbench.training import SpecError, TrainSpec, check_resources, prepare_train, read_train_spec

# its slow tests check exact steps, files and refusals, not times: make test runs them in the untimed lane (tests/_xdist_heavy.py)
pytestmark = pytest.mark.untimed

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 240  # s: a run that takes longer than this has hung

# small, fast settings shared by the slow tests: tiny model, short sequences, small batches
SMALL = ["--model", "tiny", "--max-len", "512", "--batch-tokens", "4096", "--time-limit", "0.5", "--quiet"]


def _workbench_cmd(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("workbench")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]


def workbench_started(*args: str) -> subprocess.Popen:
    """The ``workbench`` console entry started, not waited for (``finished`` waits)."""
    return subprocess.Popen(_workbench_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def finished(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """What ``workbench`` returns for a process of ``workbench_started`` once it ends."""
    from _torchrun import communicate_or_kill

    out, err = communicate_or_kill(proc, timeout, "workbench")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def metrics(run_dir: Path, rank: int = 0) -> dict[int, dict]:
    """Rank ``rank``'s metrics rows by step (a repeated step keeps its latest row)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if r["rank"] == rank}


def params_of(run_dir: Path, step: int) -> dict:
    """The model weights of a run's checkpoint, whole, whatever its layout (file or sharded folder)."""
    from workbench.runtime.checkpoint import full_model_state

    return full_model_state(run_dir, step)


# ------------------------------------------------------------------------------------------------
# fast
# ------------------------------------------------------------------------------------------------


def test_spec_round_trip_and_cpu_defaults(tmp_path):
    run, spec, changes = prepare_train({"steps": 3, "planner": "greedy", "seed": 4, "optimizer": "sgd", "nproc": 2,
                                        "device": "cpu"}, root=tmp_path, name="r")
    assert changes == [] and run.path == tmp_path / "r"
    back = read_train_spec(run.path)
    assert back == spec and back.steps == 3 and back.scenario.seed == 4
    assert back.learning_rate == 0.05  # SGD default
    sc = back.scenario
    # CPU defaults keep every token: split at 1,024, the measured CPU profile, one node of 2 ranks
    assert (sc.model, sc.source, sc.policy, sc.max_len, sc.profile) == ("tiny", "stdlib", "split", 1024, "cpu-gloo-tiny")
    assert (sc.num_gpus, sc.gpus_per_node) == (2, 2)
    # the stage, precision and optimizer the run holds its states in, resolved and recorded
    assert (sc.zero_stage, sc.precision, sc.recompute, sc.optimizer) == (3, "fp32", False, "sgd")
    assert json.loads((run.path / "spec.json").read_text())["kind"] == "train"
    ls = sc.lengths_set()
    assert ls.policy_report.tokens_after == ls.policy_report.tokens_before


@pytest.mark.parametrize("bad, words", [
    ({"steps": 0}, "steps"),
    ({"steps": 2, "optimizer": "lamb"}, "optimizer"),
    ({"steps": 2, "batch_size": 4, "batch_tokens": 100}, "not both"),
    ({"steps": 2, "policy": "truncate"}, "policy"),
    ({"steps": 2, "planner": "nope"}, "unknown planner"),
    ({"steps": 2, "max_len": 1 << 20}, "max context"),
    ({"steps": 2, "colour": "red"}, "unknown training setting"),
    ({"planner": "greedy"}, "steps is required"),
])
def test_prepare_rejects_bad_settings_and_writes_nothing(tmp_path, bad, words):
    with pytest.raises(ValueError, match=words):
        prepare_train(bad, root=tmp_path)
    assert not any(tmp_path.iterdir())


def test_read_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        read_train_spec(tmp_path / "nowhere")
    with pytest.raises(SpecError, match="spec.json is missing"):
        read_train_spec(tmp_path)
    (tmp_path / "spec.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        read_train_spec(tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps({"steps": 2, "scenario": {}, "colour": "red"}))
    with pytest.raises(SpecError, match="unknown field"):
        read_train_spec(tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps({"steps": 2, "lengths": "stdlib"}))  # an older flat spec
    with pytest.raises(SpecError, match="unknown field"):
        read_train_spec(tmp_path)
    with pytest.raises(SpecError, match="num_gpus"):
        TrainSpec(scenario=Scenario(model="tiny", num_gpus=4), steps=1, nproc=2)


def test_resume_keeps_the_runs_settings(tmp_path):
    run, spec, _ = prepare_train({"steps": 2, "seed": 1, "nproc": 4, "device": "cpu"}, root=tmp_path, name="c")
    # the README's resume command: only --steps; every other setting is the run's own
    r2, spec2, changes = prepare_train({"steps": 60}, run_dir=run.path)
    assert r2.path == run.path and changes == [] and spec2.nproc == 4 and spec2.steps == 60
    assert spec2.scenario == spec.scenario
    # an option equal to the run's is fine; a different one is refused, naming it
    assert prepare_train({"steps": 5, "seed": 1, "nproc": 4}, run_dir=run.path)[2] == []
    with pytest.raises(SpecError, match=r"nproc: 4 in the run, 1 given.*--change"):
        prepare_train({"steps": 5, "nproc": 1}, run_dir=run.path)
    _, spec3, changes = prepare_train({"steps": 5, "nproc": 2, "seed": 2}, run_dir=run.path, allow_changes=True)
    assert {c.name for c in changes} == {"nproc", "seed"}
    assert spec3.nproc == 2 and spec3.scenario.num_gpus == 2 and spec3.scenario.seed == 2
    assert read_train_spec(run.path) == spec  # preparing a resume writes nothing
    # the stage, precision and recomputation are the run's too
    with pytest.raises(SpecError, match=r"zero_stage: 3 in the run, 0 given.*--change"):
        prepare_train({"steps": 5, "zero_stage": 0}, run_dir=run.path)
    with pytest.raises(SpecError, match=r"precision: 'fp32' in the run, 'bf16' given"):
        prepare_train({"steps": 5, "precision": "bf16"}, run_dir=run.path)
    with pytest.raises(SpecError, match=r"recompute: False in the run, True given"):
        prepare_train({"steps": 5, "recompute": True}, run_dir=run.path)
    _, spec4, changes = prepare_train({"steps": 5, "zero_stage": 1, "precision": "bf16"}, run_dir=run.path,
                                      allow_changes=True)
    assert {c.name for c in changes} == {"zero_stage", "precision"}
    assert (spec4.scenario.zero_stage, spec4.scenario.precision) == (1, "bf16")


def test_the_scenarios_optimizer_follows_the_runs():
    sc = Scenario(model="tiny", num_gpus=2)
    assert TrainSpec(scenario=sc, steps=1, nproc=2, optimizer="adamw").scenario.optimizer == "adamw"
    assert TrainSpec(scenario=sc, steps=1, nproc=2, optimizer="sgd").scenario.optimizer == "sgd"
    spec = TrainSpec(scenario=sc, steps=1, nproc=2, optimizer="sgd", momentum=0.9)
    assert spec.scenario.optimizer == "sgd-momentum"
    assert spec.replace(momentum=0.0).scenario.optimizer == "sgd"


def test_resume_must_name_an_existing_run(tmp_path):
    (tmp_path / "afile").write_text("x")
    for bad, words in ((tmp_path / "typo", "no run at"), ("", "--run-dir is empty"),
                       (tmp_path / "afile", "is a file"), (tmp_path / "afile" / "x", "is a file")):
        with pytest.raises(SpecError, match=words):
            prepare_train({"steps": 2}, run_dir=bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="not a training run"):
        prepare_train({"steps": 2}, run_dir=tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty"]


def test_supervisor_command_is_an_argument_list(tmp_path):
    cmd = supervisor_command(tmp_path, nproc=4)
    assert cmd[1:3] == ["-m", "workbench.launch.supervisor"]
    assert cmd[cmd.index("--nproc") + 1] == "4" and cmd[cmd.index("--module") + 1] == "workbench.runtime.train"
    assert cmd[cmd.index("--run-dir") + 1] == str(tmp_path.resolve())
    assert "--rdzv-endpoint" not in cmd  # one node: the supervisor binds 127.0.0.1 itself
    multi = supervisor_command(tmp_path, nproc=2, nnodes=2, node_rank=1, rdzv_endpoint="h:29500")
    assert multi[multi.index("--rdzv-endpoint") + 1] == "h:29500"  # passed through unchanged
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        supervisor_command(tmp_path, nproc=2, nnodes=2)
    with pytest.raises(ValueError, match="--nproc must be a positive integer"):
        supervisor_command(tmp_path, nproc=0)


def test_loopback_torchrun_arguments(tmp_path):
    from workbench.launch.supervisor import LOOPBACK_BACKEND, torchrun_args

    one = torchrun_args(tmp_path, nproc=2, nnodes=1, node_rank=0, rdzv_endpoint=None, rdzv_id=None,
                        module="m", module_args=[], attempt=1)
    assert one[one.index("--rdzv-backend") + 1] == LOOPBACK_BACKEND
    assert one[one.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
    two = torchrun_args(tmp_path, nproc=2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.5:29400", rdzv_id="x",
                        module="m", module_args=[], attempt=1)
    # several nodes: torchrun's static rendezvous, so node k is the node rank it was given (tests/test_multinode.py)
    assert two[two.index("--rdzv-backend") + 1] == "static" and two[two.index("--rdzv-endpoint") + 1] == "10.0.0.5:29400"


def test_resource_checks():
    assert check_resources(2, device="cpu", cores=2, available_gb=20.0) == []
    warn = check_resources(3, device="cpu", cores=2, available_gb=20.0)
    assert len(warn) == 1 and "3 processes on 2 CPU core(s)" in warn[0]
    with pytest.raises(ValueError, match=r"64 processes is more than 4 per core on 2 core\(s\).*--oversubscribe"):
        check_resources(64, device="cpu", cores=2, available_gb=20.0)
    assert check_resources(64, device="cpu", cores=2, available_gb=100.0, allow=True)  # warned, not refused
    # memory: 1B model on CPU, a full replica with Adam states per rank (16 bytes per parameter)
    with pytest.raises(ValueError, match="GB estimated for .* against 20.0 GB available"):
        check_resources(2, device="cpu", model="1b", cores=8, available_gb=20.0)


def test_resource_check_counts_the_model_states_of_the_zero_stage():
    from workbench.models import get_model

    P = get_model("1b").params()
    # ZeRO-0, fp32 AdamW: parameters, gradients and both moments whole on each of 4 ranks, by hand
    zero0 = 4 * (0.45 + 16 * P / 1e9) + 0.5
    with pytest.raises(ValueError, match=rf"~{zero0:.1f} GB estimated for 4 process\(es\) of model 1b, ZeRO-0"):
        check_resources(4, device="cpu", model="1b", cores=4, available_gb=60.0, zero_stage=0, precision="fp32")
    # ZeRO-3 shards those 16 bytes over the 4 ranks: a quarter each, plus one unit's transient working set,
    # so the same machine holds it (warned: above half of what is available)
    warn = check_resources(4, device="cpu", model="1b", cores=4, available_gb=60.0, zero_stage=3, precision="fp32")
    est = float(warn[0].split("estimated memory ")[1].split(" GB")[0])
    assert 4 * (0.45 + 4 * P / 1e9) + 0.5 < est < zero0 / 2
    # SGD without momentum holds no optimizer states: 8 bytes per parameter under ZeRO-0
    sgd = 4 * (0.45 + 8 * P / 1e9) + 0.5
    with pytest.raises(ValueError, match=rf"~{sgd:.1f} GB estimated"):
        check_resources(4, device="cpu", model="1b", cores=4, available_gb=60.0, zero_stage=0, optimizer="sgd")


def test_token_data_corpus_documents_and_windows():
    from workbench.data.corpus import document_tokens, stdlib_documents
    from workbench.runtime.train import TokenData

    docs = stdlib_documents()
    td = TokenData("stdlib", max_len=256, policy="split", seed=0)
    assert td.lengths.max() <= 256 and td.report.affected_sequences > 0
    first = document_tokens(docs[0])
    # the first pieces are the first document, cut into 256-token pieces, in order
    got = np.concatenate([td.tokens(i) for i in range(-(-first.size // 256))])
    np.testing.assert_array_equal(got, first.astype(np.int64))
    clip = TokenData("stdlib", max_len=256, policy="clip", seed=0)
    np.testing.assert_array_equal(clip.tokens(0), first[:256])
    # other sources: windows of the byte stream, deterministic from the seed, in 0..255
    a = TokenData("100,3000,7", max_len=4096, policy="error", seed=3)
    b = TokenData("100,3000,7", max_len=4096, policy="error", seed=3)
    c = TokenData("100,3000,7", max_len=4096, policy="error", seed=4)
    assert a.ordered and [a.tokens(i).size for i in range(3)] == [100, 3000, 7]
    np.testing.assert_array_equal(a.tokens(1), b.tokens(1))
    assert not np.array_equal(a.tokens(1), c.tokens(1))
    assert a.tokens(1).max() < 256
    with pytest.raises(ValueError, match="max_len"):
        TokenData("100,5000", max_len=4096, policy="error", seed=0)


def _cli(capsys, *args: str) -> tuple[int, str]:
    """``workbench *args`` through the console script's entry (``workbench.cli.main``, which the
    script exits with) in this process: ``(exit status, stderr)``."""
    from conftest import cli_main

    p = cli_main(capsys, *args)
    return p.returncode, p.stderr


def test_cli_rejects_bad_settings_before_starting(tmp_path, capsys):
    for args, words in ((["--planner", "nope"], "unknown planner"),
                        (["--nproc", "64"], "refusing to start: 64 processes"),
                        (["--change"], "--change applies only when resuming")):
        code, err = _cli(capsys, "train", "--steps", "2", "--run-root", str(tmp_path), *args)
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], err
        assert not any(tmp_path.iterdir()), "no run folder for settings that cannot work"
    for where, words in ((tmp_path / "typo", "no run at"), ("", "--run-dir is empty")):
        code, err = _cli(capsys, "train", "--steps", "2", "--run-dir", str(where))
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], err
        assert not any(tmp_path.iterdir()), "no run folder for settings that cannot work"


# ------------------------------------------------------------------------------------------------
# slow: real torchrun runs
# ------------------------------------------------------------------------------------------------


def _ok(p: subprocess.CompletedProcess, run_dir: Path) -> None:
    log = (run_dir / "log.txt").read_text()[-4000:] if (run_dir / "log.txt").exists() else ""
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stderr[-3000:]}\n{log}"
    st = status(run_dir)
    assert st["state"] == "done" and st["exit_code"] == 0, st


# Runs that no check needs through ``workbench train`` share one world of 4 ranks: a sub-world of the
# shared torchrun launch (tests/_torchrun.py: ``SUBWORLD_SIZE``, ``subworld_checks``; this file's
# alone), whose ranks have imported torch and FSDP for the other files' checks already. Its ranks
# leave the sub-world's process group, and the first ``nproc`` run the real trainer (``Trainer.run``,
# which starts and ends a process group of its own) on each run folder in turn, as a world of ``nproc``
# (the other ranks wait). A resume in the tree is a later attempt of an earlier run's folder with the
# spec a resume with ``--change`` writes (``prepare_train(..., allow_changes=True)``, as the CLI does).
# The launcher's and supervisor's side (the CLI, a run's final ``done``, resumes with and without
# ``--change``, the error lines) is checked by the runs still started through ``workbench train``: the
# resume the README shows (test_resume_continues_exactly), a resume onto another world with ``--change``
# (test_checkpoints_resume_on_another_world_and_stage, each ending ``done`` with exit code 0), and
# the missing spec.json (the launcher API); the CLI's error line for a run its ranks failed is in
# test_faults.py (no usable checkpoint), and a new run started by ``workbench train`` that ends
# ``done`` is in test_profile_run.py and test_trace.py.

TREE_TIMEOUT = 480  # s: a tree of several runs that takes longer than this has hung
TREE_RANKS = 4
SUBWORLD_SIZE = TREE_RANKS  # tests/_torchrun.py: the tree is a sub-world of 4 of the shared launch

SMALL_SETTINGS = {"model": "tiny", "max_len": 512, "batch_tokens": 4096, "time_limit": 0.5}  # SMALL, for prepare_train


class Tree:
    """The runs of one tree: ``dirs[name]`` is each run's folder, ``codes[name]`` the exit
    status of ``Trainer.run`` on each of its ranks (0 done, 1 failed), ``statuses[name]`` its
    ``status.json`` as that run (or resume) left it, ``steps[name]`` the steps its spec asked for."""

    def __init__(self, dirs: dict[str, Path], codes: dict[str, list[int]], statuses: dict[str, dict],
                 steps: dict[str, int], log: str) -> None:
        self.dirs, self.codes, self.statuses, self.steps, self.log = dirs, codes, statuses, steps, log

    def ok(self, name: str) -> Path:
        """The run (or resume) ``name``, checked to have trained all its steps on every rank."""
        d = self.dirs[name]
        st = self.statuses[name]
        assert self.codes[name] == [0] * len(self.codes[name]), f"{name}: exit statuses {self.codes[name]}\n{self.log[-4000:]}"
        assert st["error"] is None and st["step"] == self.steps[name], st
        return d


def subworld_checks(folder: str) -> list:
    """Rank side (tests/_torchrun.py's sub-world of 4): the tree prepared in ``folder`` (``world_prepare``)."""
    return [lambda rank: {"codes": _tree_worker(Path(folder), rank), "folder": folder}]


def _tree_worker(folder: Path, rank: int) -> dict[int, int]:
    """Rank side of the tree: the sub-world's process group ended, for each ``{"nproc", "dir",
    "resume"}`` of ``folder/plan.json`` in turn, the first ``nproc`` ranks run ``Trainer.run`` on
    ``dir`` as a world of ``nproc``; rank 0 copies each run's status as it ended to
    ``folder/status<i>.json``; returns the exit statuses by run (the sub-world's ranks meet again
    after it: ``_run_subworld``). A resume (``resume``: the spec a
    resume with ``--change`` writes) is set up by rank 0 once every rank is done with the run before
    it, as ``workbench train --run-dir`` does: the new spec, then a new attempt in the status. The
    ranks keep in step on torchrun's store (their launch's), under keys of their own; each run's
    process group meets on a store of its own (rank 0 picks a free loopback port and passes it through
    torchrun's store): torch names a default group's keys by a count that restarts after
    ``destroy_process_group``, so a second group on torchrun's store would read the first one's gloo
    addresses and hang."""
    import datetime
    import gc
    import shutil
    import socket

    import torch.distributed as dist
    from _torchrun import environ_kept
    from torch.distributed import TCPStore

    from workbench import runs
    from workbench.runtime.train import DistEnv, Trainer
    from workbench.util import write_json_atomic

    timeout = datetime.timedelta(seconds=TREE_TIMEOUT)
    if dist.is_initialized():
        dist.destroy_process_group()
    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    codes: dict[int, int] = {}
    # what the imports made lives to the end: kept out of the collections (each full one would walk
    # it, ~0.1-0.3 s on each rank after every run), as is what outlives each run's collection below
    gc.freeze()
    with environ_kept("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts each run's store (env://)
        for k, item in enumerate(json.loads((folder / "plan.json").read_text())):
            nproc, d = int(item["nproc"]), item["dir"]
            if rank == 0:
                if item["resume"] is not None:
                    while int(agent.add(f"test_train/done{k - 1}", 0)) < TREE_RANKS:  # the run before, over on every rank
                        time.sleep(0.01)
                    write_json_atomic(Path(d, "spec.json"), item["resume"])
                    runs.update_status(d, reopen=True, attempt=runs.read_status(d).attempt + 1, state="starting",
                                       started=runs.now(), finished=None, error=None, exit_code=None, pids=None)
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    agent.set(f"test_train/run{k}_port", str(s.getsockname()[1]))
            port = agent.get(f"test_train/run{k}_port").decode()  # also keeps the ranks in step, run by run
            if rank < nproc:
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(nproc),
                                  LOCAL_WORLD_SIZE=str(nproc))
                codes[k] = Trainer(Path(d), DistEnv.from_env()).run()
                if dist.is_initialized():  # a run that failed in a step returns with its group up
                    dist.destroy_process_group()
                gc.collect()  # the run's objects, its process groups among them, go now, not in a later run
                gc.freeze()
                if rank == 0:
                    shutil.copyfile(Path(d, "status.json"), folder / f"status{k}.json")
            agent.add(f"test_train/done{k}", 1)
    return codes  # the sub-world's ranks meet again after this check (_run_subworld)


def world_prepare(folder: Path) -> list[str]:
    """Pytest side (tests/_torchrun.py, before the shared launch): every run of the tree prepared in
    ``folder`` (``prepare_train``, as ``workbench train`` does: ``TREE_SETTINGS[name]``, with its
    ``nproc``, over SMALL_SETTINGS on the CPU, in ``folder/name``; ``"resume": base`` is a resume of
    the earlier run ``base`` with the rest of its settings given as changes, ``--change``), the order
    the ranks run them in (``plan.json``) and what the checks read back (``tree.json``)."""
    from workbench import runs

    folder = Path(folder)
    dirs, nprocs, steps, plan = {}, {}, {}, []
    for name, s in TREE_SETTINGS.items():
        if "resume" in s:
            base = s["resume"]
            _, spec, changes = prepare_train({k: v for k, v in s.items() if k != "resume"}, run_dir=dirs[base],
                                             allow_changes=True)
            assert changes, f"{name}: a resume that changes nothing"
            dirs[name], resume = dirs[base], spec.to_dict()
        else:
            run, spec, _ = prepare_train({**SMALL_SETTINGS, "device": "cpu", **s}, root=folder, name=name)
            runs.update_status(run.path, attempt=1)  # the first attempt, as the launcher records it
            dirs[name], resume = str(run.path), None
        nprocs[name], steps[name] = spec.nproc, spec.steps
        plan.append({"nproc": spec.nproc, "dir": dirs[name], "resume": resume})
    (folder / "plan.json").write_text(json.dumps(plan))
    (folder / "tree.json").write_text(json.dumps({"names": list(dirs), "dirs": dirs, "nprocs": nprocs, "steps": steps}))
    return [str(folder)]


# the exactness runs and the refused plans plan inline (plan_ahead false: no planning worker process per
# run; the plans are the same either way, which test_faults.py's killed-worker run checks step by step,
# and a plan is checked against the run where it runs, wherever it was made); the loss and resume runs
# plan ahead, the default
SGD = {"steps": 1, "seed": 7, "optimizer": "sgd", "lr": 0.5, "checkpoint_every": 1, "plan_ahead": False}
ZSET = {"planner": "greedy", "seed": 3, "optimizer": "sgd", "lr": 0.2, "momentum": 0.9, "plan_ahead": False}
LOSS_SETTINGS = {"planner": "greedy", "seed": 1, "optimizer": "adamw", "lr": 3e-3}
LOSS_STEPS = 10  # the loss run's steps: its first five against its last five
LOSS_ARGS = ["--nproc", "2", "--planner", "greedy", "--seed", "1", "--optimizer", "adamw", "--lr", "3e-3", *SMALL]


def _planners_for_equality() -> list[str]:
    from workbench.solve import planner_names

    names = ["greedy", "static:4"]
    if "flexsp" in planner_names():
        names.append("flexsp")
    return names


SGD_CASES = [(p, 3) for p in _planners_for_equality()] + [("greedy", 0), ("greedy", 2)]


def _sgd_name(planner: str, stage: int) -> str:
    return f"sgd-{planner.replace(':', '')}-zero{stage}"


TREE_SETTINGS = {
    **{_sgd_name(pl, st): {**SGD, "nproc": 4, "planner": pl, "zero_stage": st} for pl, st in SGD_CASES},
    "sgd-reference": {**SGD, "nproc": 1, "planner": "static:1", "zero_stage": 0},
    "zero-ref": {**ZSET, "nproc": 4, "steps": 4, "checkpoint_every": 1},
    "zero-a": {**ZSET, "nproc": 4, "steps": 2, "checkpoint_every": 2},
    "zero-b": {**ZSET, "nproc": 2, "zero_stage": 1, "steps": 2, "checkpoint_every": 2},
    "zero-b@3": {"resume": "zero-b", "steps": 3, "nproc": 4, "zero_stage": 3},
    "zero-b@4": {"resume": "zero-b", "steps": 4, "nproc": 2, "zero_stage": 2},
    "loss": {**LOSS_SETTINGS, "nproc": 2, "steps": LOSS_STEPS, "checkpoint_every": 0},
    "resume": {**LOSS_SETTINGS, "nproc": 2, "steps": 3, "checkpoint_every": 3},
    "states": {"nproc": 2, "zero_stage": 2, "optimizer": "adamw", "steps": 1, "checkpoint_every": 0, "plan_ahead": False},
    "plan-world": {"nproc": 2, "planner": "greedy", "steps": 2, "debug": {"plan_num_gpus": 1}, "timeout_s": 60,
                   "plan_ahead": False},
    "plan-stage": {"nproc": 2, "planner": "greedy", "steps": 2, "debug": {"plan_zero_stage": 0}, "timeout_s": 60,
                   "plan_ahead": False},
    "policy-error": {"nproc": 2, "source": "100,5000", "max_len": 4096, "policy": "error", "batch_tokens": 16384,
                     "steps": 1, "timeout_s": 60},
}
"""The runs of the tree, in the order it runs them (``tree``)."""


@pytest.fixture(scope="module")
def tree(request, tmp_path_factory) -> Tree:
    """Every run here that no check needs through ``workbench train``, in one tree (``TREE_SETTINGS``):

    - one SGD step on 4 ranks for each planner and stage of ``SGD_CASES``, and ``sgd-reference``: one
      SGD step on one rank with static:1 under ZeRO-0 (a plain model on one process: the
      single-process update);
    - SGD with momentum under ZeRO-3 on 4 ranks: 4 steps with a checkpoint after each (``zero-ref``,
      the uninterrupted run) and 2 with one checkpoint (``zero-a``); on 2 ranks under ZeRO-1, 2 steps
      with one checkpoint (``zero-b``), then resumed (``--change``): to 3 steps on 4 ranks under
      ZeRO-3 (``zero-b@3``), and to 4 on 2 ranks under ZeRO-2 (``zero-b@4``);
    - on 2 ranks: ``loss`` (10 AdamW steps on the embedded corpus, no checkpoint; the mean loss of
      the last five is about 1.0 below the first five's: twice what test_loss_falls_on_the_embedded_corpus
      asks, as 15 steps, 1.65 below, were three times),
      ``resume`` (the loss run's settings, 3 steps, a checkpoint after the last),
      ``states`` (one AdamW step under ZeRO-2), and last the three that must fail on every rank:
      ``plan-world`` (plans made for 1 rank), ``plan-stage`` (plans made for ZeRO-0 in a ZeRO-3
      run) and ``policy-error`` (a sequence of 5,000 tokens, max context 4,096, policy error: the
      settings of ``workbench train --lengths 100,5000 --max-len 4096 --policy error``)."""
    from _torchrun import shared_world

    per_rank = shared_world(request, tmp_path_factory, __name__)
    folder = Path(per_rank["0"]["folder"])
    meta = json.loads((folder / "tree.json").read_text())
    names = meta["names"]
    return Tree({name: Path(meta["dirs"][name]) for name in names},
                {name: [per_rank[str(r)]["codes"][str(k)] for r in range(meta["nprocs"][name])] for k, name in enumerate(names)},
                {name: json.loads((folder / f"status{k}.json").read_text()) for k, name in enumerate(names)}, meta["steps"],
                "(the shared launch's output: tests/_torchrun.py)")


@pytest.fixture(scope="module")
def launched(tree, tmp_path_factory) -> dict:
    """The launches that check the launcher's side, started at once (their checks are of results,
    not times): ``resume``, the README's resume of the tree's ``resume`` run (``workbench train
    --run-dir D --steps 4``: the steps only); ``zero-a``, the tree's ZeRO-3 run saved on 4 ranks
    resumed on 2 (``--steps 3 --nproc 2 --change``); ``missing-spec``, ``launch.start`` of a run
    folder without spec.json, one rank (its final status from ``launch.wait``; how the ranks of a
    world agree on a set-up error: test_sequence_over_max_context_with_policy_error). Also what was there before:
    ``zero-a checkpoints``, the names in zero-a's checkpoint folder."""
    from workbench import launch, runs

    before = sorted(x.name for x in (tree.ok("zero-a") / "checkpoints").iterdir())
    resume = workbench_started("train", "--run-dir", str(tree.ok("resume")), "--steps", "4")
    zero_a = workbench_started("train", "--run-dir", str(tree.dirs["zero-a"]), "--steps", "3", "--nproc", "2", "--change",
                               "--quiet")
    try:
        run = runs.new_run("train", {}, root=tmp_path_factory.mktemp("launched"), run_id="run")
        run.file("spec.json").unlink()
        try:
            missing = launch.wait(launch.start(run, nproc=1), timeout=RUN_TIMEOUT)
        finally:
            launch.stop(run)
    finally:
        done = {"resume": finished(resume), "zero-a": finished(zero_a)}
    return {**done, "missing-spec": missing, "zero-a checkpoints": before}


@pytest.mark.slow
@pytest.mark.parametrize("planner, stage", SGD_CASES)
def test_one_sgd_step_same_params_on_4_ranks(tree, planner, stage):
    sgd_reference = tree.ok("sgd-reference")
    d = tree.ok(_sgd_name(planner, stage))
    plan = json.loads((d / "plans.jsonl").read_text().splitlines()[0])["plan"]
    assert plan["num_gpus"] == 4 and plan["planner"].startswith(planner.split(":")[0])
    # planned for the stage the run holds its states in, and run that way
    assert plan["zero_stage"] == stage and plan["execution"] == ("lockstep" if stage == 3 else "free")
    assert status(d)["resolved"]["zero_stage"] == stage
    assert (d / "checkpoints" / ("step_1.dcp" if stage == 3 else "step_1.pt")).exists()
    if planner == "static:4":  # every sequence ran sharded over 4 ranks with Ulysses all-to-alls
        assert {g["degree"] for m in plan["micro_steps"] for g in m["groups"]} == {4}
    ref, got = params_of(sgd_reference, 1), params_of(d, 1)
    for name, t in ref.items():
        np.testing.assert_allclose(got[name].numpy(), t.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    # and the step did change the parameters (the comparison is not of two untouched inits)
    from workbench.models import get_model
    from workbench.runtime.model import Transformer

    init = Transformer(get_model("tiny"), seed=7).state_dict()
    moved = max(float((ref[k] - init[k]).abs().max()) for k in ref)
    assert moved > 1e-4
    r0, r3 = metrics(d, 0)[0], metrics(d, 3)[0]
    assert r0["loss"] == pytest.approx(metrics(sgd_reference)[0]["loss"], rel=1e-5)
    assert r0["loss"] == r3["loss"]  # the global loss, the same on every rank
    assert {"predicted_ms", "measured_ms", "peak_memory_mb", "tokens", "micro_steps"} <= set(r0)


@pytest.mark.slow
def test_loss_falls_on_the_embedded_corpus(tree):
    loss_run = tree.ok("loss")  # 2 ranks: every rank trained its 10 steps
    m = metrics(loss_run)
    assert sorted(m) == list(range(LOSS_STEPS))
    first = np.mean([m[s]["loss"] for s in range(5)])
    last = np.mean([m[s]["loss"] for s in range(LOSS_STEPS - 5, LOSS_STEPS)])
    assert last < first - 0.5, f"loss {first:.3f} -> {last:.3f}"
    st = status(loss_run)
    assert st["step"] == LOSS_STEPS
    assert st["resolved"]["max_len"] == 512 and st["resolved"]["backend"] == "gloo"
    assert len((loss_run / "plans.jsonl").read_text().splitlines()) == LOSS_STEPS
    assert not (loss_run / "checkpoints").exists()


@pytest.mark.slow
def test_resume_continues_exactly(tree, launched, capsys):
    n = 3
    d = tree.ok("resume")  # the loss run's settings, 3 steps, a checkpoint after the last
    assert (d / "checkpoints" / f"step_{n}.dcp").is_dir()  # ZeRO-3 (the default): a sharded checkpoint
    # restarted (``launched``) with one more step, as the README does (naming only the steps): it
    # continues from the checkpoint with the run's own settings (its 2 ranks, not the CLI default 1)
    _ok(launched["resume"], d)
    st = status(d)
    assert st["resumed_from"] == n and st["attempt"] == 2 and st["step"] == n + 1
    assert st["resolved"]["world_size"] == 2
    plans = [json.loads(x) for x in (d / "plans.jsonl").read_text().splitlines()]
    assert plans[-1]["plan"]["num_gpus"] == 2 and plans[-1]["step"] == n
    ref = metrics(tree.ok("loss"))[n]["loss"]
    got = metrics(d)[n]["loss"]
    assert got == pytest.approx(ref, rel=1e-6, abs=0), f"resumed step {n + 1} loss {got} vs uninterrupted {ref}"
    # a different setting on resume is refused before anything starts, naming it and only it (every
    # other option given is the run's own); the spec is untouched (the console script's entry in this
    # process: it starts nothing)
    before = (d / "spec.json").read_bytes()
    code, err = _cli(capsys, "train", "--run-dir", str(d), "--steps", str(n + 2), *LOSS_ARGS, "--seed", "2")
    assert code == 2 and "seed: 1 in the run, 2 given" in err, err
    assert err.count(" in the run, ") == 1, err
    assert (d / "spec.json").read_bytes() == before


def _update_error(got: dict, ref: dict, before: dict) -> float:
    """Worst relative difference of two updates from the same weights ``before``, over the tensors."""
    return max(float((got[k] - before[k] - (ref[k] - before[k])).norm() / (ref[k] - before[k]).norm()) for k in ref)


@pytest.mark.slow
def test_checkpoints_resume_on_another_world_and_stage(tree, launched):
    """SGD with momentum (the optimizer state matters, and its update is linear in it): a ZeRO-3
    run saved on 4 ranks resumes on 2 (DCP reshards the folder); a ZeRO-1 run's whole file resumes
    under ZeRO-3 on 4, and its sharded folder under ZeRO-2 on 2; each step after a resume gives the
    uninterrupted run's loss and weights. The first resume goes through ``workbench train --change``;
    the two of the ZeRO-1 run are resumes in the tree (the spec the CLI writes, a new attempt)."""
    ref = tree.ok("zero-ref")  # 4 ranks, ZeRO-3, 4 steps, a checkpoint after each
    loss = {s: r["loss"] for s, r in metrics(ref).items()}
    # ZeRO-3, 4 ranks -> 2 ranks
    a = tree.ok("zero-a")  # 4 ranks, ZeRO-3, 2 steps, a checkpoint after the last
    assert launched["zero-a checkpoints"] == ["step_2.dcp"]
    _ok(launched["zero-a"], a)  # workbench train --run-dir A --steps 3 --nproc 2 --change
    st = status(a)
    assert st["resumed_from"] == 2 and st["resolved"]["world_size"] == 2 and st["resolved"]["zero_stage"] == 3
    assert metrics(a)[2]["loss"] == pytest.approx(loss[2], rel=1e-5)
    assert _update_error(params_of(a, 3), params_of(ref, 3), params_of(ref, 2)) < 1e-4
    # ZeRO-1 (whole file, consolidated optimizer states), 2 ranks -> ZeRO-3, 4 ranks
    b = tree.ok("zero-b")  # 2 ranks, ZeRO-1, 2 steps, a checkpoint after the last
    assert (b / "checkpoints" / "step_2.pt").is_file()
    assert _update_error(params_of(b, 2), params_of(ref, 2), params_of(ref, 1)) < 1e-4
    tree.ok("zero-b@3")  # resumed: 3 steps on 4 ranks under ZeRO-3
    st = tree.statuses["zero-b@3"]
    assert st["resumed_from"] == 2 and st["attempt"] == 2 and st["resolved"]["world_size"] == 4
    assert st["resolved"]["execution"] == "lockstep"
    assert metrics(b)[2]["loss"] == pytest.approx(loss[2], rel=1e-5)
    assert _update_error(params_of(b, 3), params_of(ref, 3), params_of(ref, 2)) < 1e-4
    # and that sharded folder, on 2 ranks under ZeRO-2 (the momentum buffers into ZeroRedundancyOptimizer's shards)
    tree.ok("zero-b@4")
    st = tree.statuses["zero-b@4"]
    assert st["resumed_from"] == 3 and st["attempt"] == 3 and st["resolved"]["world_size"] == 2
    assert st["resolved"]["zero_stage"] == 2
    assert metrics(b)[3]["loss"] == pytest.approx(loss[3], rel=1e-5)
    assert _update_error(params_of(b, 4), params_of(ref, 4), params_of(ref, 3)) < 1e-4


@pytest.mark.slow
def test_model_states_in_metrics_match_the_memory_model(tree):
    from workbench.cost.memory import model_states
    from workbench.models import get_model

    d = tree.ok("states")  # 2 ranks, ZeRO-2, one AdamW step
    for rank in (0, 1):
        got = metrics(d, rank)[0]["model_states"]
        want = model_states(get_model("tiny"), zero_stage=2, num_ranks=2, precision="fp32", optimizer="adamw", rank=rank)
        assert got["parameters_bytes"] == pytest.approx(want.parameters, rel=0.05)
        assert got["gradients_bytes"] == pytest.approx(want.gradients, rel=0.05)
        assert got["optimizer_bytes"] == pytest.approx(want.optimizer_states, rel=0.05)


def _assert_failed_on_every_rank(tree: Tree, name: str, words: str) -> None:
    """Run ``name`` of ``tree`` failed on each rank (its exit status, its own failure record), and the
    run's status says why."""
    d = tree.dirs[name]
    assert tree.codes[name] == [1] * len(tree.codes[name]), f"{name}: exit statuses {tree.codes[name]}"
    st = tree.statuses[name]
    assert st["state"] == "failed" and words in st["error"], st
    for rank in range(len(tree.codes[name])):
        failure = json.loads((d / "failures" / f"rank{rank}.json").read_text())
        assert words in failure["error"], (rank, failure)


@pytest.mark.slow
def test_plan_for_another_world_size_fails_on_every_rank(tree):
    _assert_failed_on_every_rank(tree, "plan-world", "the plan is for 1 ranks but this run has 2")
    assert not (tree.dirs["plan-world"] / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_plan_for_another_stage_is_refused_on_every_rank(tree):
    _assert_failed_on_every_rank(tree, "plan-stage",
                                 "the plan is free (ZeRO 0-2) but this run is ZeRO-3 (lockstep); plan for ZeRO-3")
    assert not (tree.dirs["plan-stage"] / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sequence_over_max_context_with_policy_error(tree):
    """A set-up error (the data, before any step): every rank stops with exit status 1, the run's
    status says why, and the first rank to see it reports it. (The CLI's error line for a run its
    ranks failed: test_faults.py's no usable checkpoint, also a set-up error.)"""
    name, words = "policy-error", "length 5,000 > max_len 4,096"
    d = tree.dirs[name]
    assert tree.codes[name] == [1, 1], f"{name}: exit statuses {tree.codes[name]}"
    st = tree.statuses[name]
    assert st["state"] == "failed" and words in st["error"], st
    assert words in json.loads((d / "failures" / "rank0.json").read_text())["error"]
    assert not (d / "metrics.jsonl").exists()


@pytest.mark.slow
def test_missing_spec_json_fails_cleanly(launched):
    from workbench import launch

    st = launched["missing-spec"]  # launch.start on a run folder without spec.json
    assert st.state == "failed" and "spec.json is missing" in st.error, st
    assert not launch.run_alive(st)


def test_a_max_context_no_group_holds_is_refused_before_the_run_exists(tmp_path):
    """Forced Ulysses on a model with 4 heads: a group of 8 cannot scatter them, so a max context that
    needs 8 GPUs is one line naming the heads and --strategy auto, and no run folder is made; auto
    runs it with context parallelism."""
    settings = {"steps": 1, "nproc": 8, "model": "tiny", "device": "cpu", "max_len": 4096, "source": "stdlib",
                "gpu_memory_gb": 0.02}
    with pytest.raises(SpecError) as e:
        prepare_train({**settings, "strategy": "ulysses"}, root=tmp_path, dry_run=True)
    msg = str(e.value)
    assert "\n" not in msg and "the max context (4,096 tokens)" in msg
    assert "4 query / 2 KV heads" in msg and "--strategy auto" in msg
    _, spec, _ = prepare_train({**settings, "strategy": "auto"}, root=tmp_path, dry_run=True)
    cost = spec.scenario.cost()
    d = int(cost.min_degree([4096])[0])  # 6 since groups of any size: Ulysses over 2 inside CP over 3
    assert 4 < d <= 8 and all(c > 1 for c in cost.splits(d)) and cost.memory([4096], 4, cost.splits(4)[0])[0] > \
        cost.memory_budget_gb
    assert not any(tmp_path.iterdir())
