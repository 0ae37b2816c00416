"""Runs over several nodes, tested on one machine, and the way from the workbench to a cluster.

Fast: the inter-node cost of groups that span nodes (hand-computed), the profile fields, the
rendezvous arguments, the node checks (another --nproc, run or spec), heartbeats naming the node
gone (a stand-in store), node records in the run store, joining a run by name, the emitted commands
rebuilding the same spec, the Slurm script's syntax, and the one-line refusals of this machine
(--device cuda without a GPU, --attention flash without flash-attn or CUDA).

Slow (real torchrun "nodes" of 1-2 processes each on this machine, gloo, the tiny model; the
``workbench`` commands that start no process, run in this process: emit, runs show/list/stop): one heterogeneous plan whose
groups span the node boundary gives the single-process update (computed here from the whole
batch), under ZeRO-3 through the emitted torchrun commands, then resumed by both nodes, and under
ZeRO-0 through the Slurm script under a stand-in ``srun``; node 1 (of two processes) killed mid-run
fails both nodes' runs naming it and leaves no process; a stop from the run store ends both nodes
(the resumed ZeRO-3 run); an endpoint that does not answer, a node 0 left alone, another --nproc and
another spec on the second node each end in one line with nothing left running (the last two before
any rank starts).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from _torchrun import communicate_or_kill
from workbench import runs
from workbench.launch import cluster
from workbench.training import SpecError, prepare_train

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300
# a batch whose greedy plan on two nodes of one process under 0.008 GB per device puts the 500-token
# sequence on the group of both ranks (both nodes) and the rest on single ranks (the planner's own
# choice, checked below)
LENGTHS = "500,240,200,90,60,30"


def _exe() -> list[str]:
    exe = Path(sys.executable).with_name("workbench")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "workbench.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def _cli(*args: str) -> tuple[int, str, str]:
    """The ``workbench`` command line run in this process (its real ``main``, without the start-up of
    another interpreter): (exit status, stdout, stderr)."""
    from workbench.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _procs_of(run_dir: Path) -> list[int]:
    """Every process on this machine whose command line names the run folder (supervisors, ranks,
    plan-ahead workers): what "no process left" is checked against."""
    needle = str(run_dir)
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            out.append(int(d.name))
    return out


def _none_left(run_dir: Path, within: float = 15.0) -> None:
    t0 = time.monotonic()
    while _procs_of(run_dir):
        assert time.monotonic() - t0 < within, f"left running: {_procs_of(run_dir)}"
        time.sleep(0.2)


class Nodes:
    """Two ``workbench train`` commands, one per "node", as two machines' shells would start them."""

    def __init__(self, tmp_path: Path, name: str, common: list[str], per_node: list[list[str]] | None = None,
                 roots: list[Path] | None = None, port: int | None = None, delay: float = 0.5,
                 node0_prepared: bool = False, nproc: int = 2) -> None:
        self.port = port or _free_port()
        self.roots = roots or [tmp_path / "store"] * 2
        self.name = name
        self.procs = []
        for k in range(2):
            args = [*_exe(), "train", "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                    "--run-root", str(self.roots[k]), "--name", name, "--device", "cpu", "--nproc", str(nproc), "--quiet",
                    *common, *((per_node or [[], []])[k])]
            self.procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               cwd=ROOT, env=_env(), start_new_session=True))
            if k == 1:
                break
            time.sleep(delay)
            t0 = time.monotonic()
            while node0_prepared and k == 0 and not (self.roots[0] / name / runs.SPEC_FILE).exists():
                # node 1 started once node 0 has prepared the run (on a loaded machine 0.5 s may not do)
                assert self.procs[0].poll() is None and time.monotonic() - t0 < 120, self.procs[0].communicate()
                time.sleep(0.1)

    @property
    def run_dir(self) -> Path:
        return self.roots[0] / self.name

    def wait(self, timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
        return _wait_all(self.procs, timeout)

    def kill(self) -> None:
        _kill_all(self.procs)


def _wait_all(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    """Each node's (exit status, stdout, stderr) once it ended (killed, and the test failed, past ``timeout``)."""
    out = []
    for p in procs:
        o, e = communicate_or_kill(p, timeout, "a node")
        out.append((p.returncode, o, e))
    return out


def _kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every node still running (its terminal's Ctrl-C), SIGKILL to one that outlives 20 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------
# fast: the cost of groups that span nodes
# ------------------------------------------------------------------------------------------------


def _ulysses_ms(cost, s: float, d: int, gbps: float) -> float:
    """The all-to-all time of one sequence of ``s`` tokens on ``d`` ranks at ``gbps``, written out from
    the cost model's formula (q, k, v and o; each rank sends (d-1)/d of its share; forward and backward)."""
    m = cost.model
    kv_eff = max(m.kv_heads, d) * m.head_dim
    per_layer = m.dtype_bytes * (s / d) * (2 * m.q_dim + 2 * kv_eff) * (d - 1) / d
    return 2 * m.layers * per_layer / (gbps * 1e9) * 1e3


def test_groups_larger_than_a_node_pay_inter_node_bandwidth():
    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, load_profile

    prof = load_profile("a100-40g-flexsp")  # FlexSP's table: NVLink up to 8, InfiniBand from 16 (8 x 8 A100)
    assert prof.gpus_per_node == 8
    m = get_model("7b")
    eight = CostModel(prof, m, ClusterSpec(num_gpus=64, gpus_per_node=8))
    four = CostModel(prof, m, ClusterSpec(num_gpus=64, gpus_per_node=4))
    s = 32768.0
    # 8 GPUs per node: a group of 8 stays on NVLink (96.5 GB/s); of 16 it crosses (10.33)
    assert not eight.crosses_nodes(8) and eight.crosses_nodes(16)
    assert eight.comm_ms([s], 8)[0] == pytest.approx(_ulysses_ms(eight, s, 8, 96.5))
    assert eight.comm_ms([s], 16)[0] == pytest.approx(_ulysses_ms(eight, s, 16, 10.33))
    # 4 GPUs per node: the same group of 8 spans two nodes and gets the inter-node figure (the table's
    # smallest inter-node entry, 16's: no faster link exists between nodes), 4 stays intra-node
    assert four.crosses_nodes(8) and not four.crosses_nodes(4)
    assert four.comm_ms([s], 8)[0] == pytest.approx(_ulysses_ms(four, s, 8, 10.33))
    assert four.comm_ms([s], 4)[0] == pytest.approx(_ulysses_ms(four, s, 4, 104.1))
    assert four.time([s], 8)[0] > eight.time([s], 8)[0]
    t = four.table([s], [4, 8, 16])
    assert t["inter_node_degrees"] == [8, 16] and t["link_gbps"]["8"] == pytest.approx(10.33)


def test_an_explicit_inter_node_table_is_used_for_spanning_groups_and_the_gradient_sync():
    import dataclasses

    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, HardwareProfile, load_profile

    base = load_profile("cpu-gloo-tiny")  # one machine: no node size, no inter-node figures
    m = get_model("tiny")
    one_node = CostModel(base, m, ClusterSpec(num_gpus=4, gpus_per_node=2, gpu_memory_gb=4.0, zero_stage=0))
    assert "no inter-node figures" in one_node.inter_node_source()
    # without inter-node figures a spanning group keeps the table's figure (and the source says so)
    assert one_node.link_gbps("all_to_all", 4) == pytest.approx(base.all_to_all_gbps[4])
    prof = dataclasses.replace(base, inter_node_all_to_all_gbps={4: 0.05}, inter_node_allreduce_gbps={4: 0.5})
    back = HardwareProfile.from_dict(prof.to_dict())  # new fields round-trip through JSON
    assert back.inter_node_all_to_all_gbps == {4: 0.05} and back.gpus_per_node is None
    cost = CostModel(back, m, ClusterSpec(num_gpus=4, gpus_per_node=2, gpu_memory_gb=4.0, zero_stage=0))
    assert cost.link_gbps("all_to_all", 2) == pytest.approx(base.all_to_all_gbps[2])  # inside a node
    assert cost.link_gbps("all_to_all", 4) == pytest.approx(0.05)
    assert cost.comm_ms([300], 4)[0] == pytest.approx(_ulysses_ms(cost, 300, 4, 0.05))
    # the whole-world all-reduce of a 2-node cluster runs across nodes: 2(n-1)/n of fp32 gradients
    n, nbytes = 4, 4.0 * m.params()
    want = 2 * (n - 1) / n * nbytes / (0.5 * 1e9) * 1e3 + base.allreduce_latency_ms[4]
    assert cost.grad_sync_ms() == pytest.approx(want)
    with pytest.raises(ValueError, match="gpus_per_node must be a positive integer"):
        dataclasses.replace(base, gpus_per_node=0)


def test_the_planner_avoids_spanning_groups_that_inter_node_links_make_slow():
    from workbench.scenario import Scenario

    kw = dict(model="7b", num_gpus=16, source="65536,65536,8192,4096,2048,1024,1024,512", planner="greedy",
              zero_stage=3, seed=0)
    wide = Scenario(gpus_per_node=16, **kw).plan()  # one node of 16: every group on NVLink
    narrow = Scenario(gpus_per_node=4, **kw).plan()  # 4 nodes of 4: groups of 8 and 16 cross InfiniBand
    assert narrow.makespan_ms > wide.makespan_ms


# ------------------------------------------------------------------------------------------------
# fast: rendezvous, node checks, heartbeats, node records
# ------------------------------------------------------------------------------------------------


def test_several_nodes_use_the_static_rendezvous_with_their_node_rank(tmp_path):
    from workbench.launch.supervisor import NODE_CHECKED_BACKEND, torchrun_args

    args = torchrun_args(tmp_path, nproc=2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.5:29400", rdzv_id="r",
                         module="m", module_args=[], attempt=3, rdzv_timeout=45)
    assert args[args.index("--rdzv-backend") + 1] == "static"
    # a trainer's nodes: the static rendezvous followed by the nodes' comparison, same arguments otherwise
    checked = torchrun_args(tmp_path, nproc=2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.5:29400", rdzv_id="r",
                            module="m", module_args=[], attempt=3, rdzv_timeout=45, node_check=True)
    assert checked == [NODE_CHECKED_BACKEND if a == "static" else a for a in args]
    assert args[args.index("--node-rank") + 1] == "1" and args[args.index("--rdzv-conf") + 1] == "rank=1,timeout=45"
    assert args[args.index("--log-dir") + 1].endswith("attempt_3/node1")


def test_node_problems_name_the_node():
    from workbench.launch.cluster import node_problem

    spec = {"nproc": 2, "scenario": {"planner": "greedy", "seed": 1}}

    def info(rank, node, lws=2, run="r", sp=spec):
        return {"rank": rank, "node": node, "host": f"h{node}", "local_world_size": lws, "run_id": run, "spec": sp}

    same = [info(0, 0), info(1, 0), info(2, 1), info(3, 1)]
    assert node_problem(same) is None
    r, msg = node_problem([info(0, 0), info(1, 0), info(2, 1, lws=1)])
    assert node_problem([info(0, 0), info(1, 0), info(2, 1, lws=1, sp={**spec, "nproc": 1})]) == (r, msg)  # node 0's spec decides
    assert r == 2 and "node 1 (h1) started 1 process(es) but the run has 2 per node" in msg and "--nproc 2" in msg
    r, msg = node_problem([info(0, 0), info(1, 0), info(2, 1, run="other"), info(3, 1, run="other")])
    assert r == 2 and "node 1 (h1) joined with run 'other' but node 0 runs 'r'" in msg
    other = {"nproc": 2, "scenario": {"planner": "flexsp", "seed": 1}}
    r, msg = node_problem([info(0, 0), info(1, 0), info(2, 1, sp=other), info(3, 1, sp=other)])
    assert "node 1 (h1) runs another spec than node 0 (planner: 'greedy' on node 0, 'flexsp' here)" in msg


class FakeStore:
    """The few Store calls PeerWatch makes (add, set, check), kept in a dict."""

    def __init__(self):
        self.kv: dict[str, int | bytes] = {}
        self.down = False

    def _up(self):
        if self.down:
            raise RuntimeError("Connection reset by peer")

    def add(self, key, n):
        self._up()
        self.kv[key] = int(self.kv.get(key, 0)) + n
        return self.kv[key]

    def set(self, key, value):
        self._up()
        self.kv[key] = value

    def check(self, keys):
        self._up()
        return all(k in self.kv for k in keys)


def _two_nodes(store):
    """Watches of four ranks, two on node 0 (host a) and two on node 1 (host b), beating every 50 ms."""
    from workbench.runtime.peers import PeerWatch

    members = {0: (0, "a"), 1: (0, "a"), 2: (1, "b"), 3: (1, "b")}
    return {r: PeerWatch(store, r, members, interval=0.05).start() for r in members}


@pytest.mark.long
def test_heartbeats_name_the_node_that_went_away():
    store = FakeStore()
    watches = _two_nodes(store)
    time.sleep(0.3)
    assert watches[0].diagnose(wait=1.0) is None  # everybody beats (20 beats in the window)
    watches[2].stop()
    watches[3].stop()  # node 1's processes are gone
    time.sleep(0.15)
    assert watches[0].diagnose(wait=1.0) == "node 1 (b, ranks 2-3) stopped answering (its processes are gone)"
    watches[1].mark_ended("failed")  # a rank that said it ended is not "gone"
    watches[1].stop()
    time.sleep(0.15)
    assert watches[0].diagnose(wait=1.0) == "node 1 (b, ranks 2-3) stopped answering (its processes are gone)"
    store.down = True  # the store lives on node 0: its loss names node 0
    assert watches[2].diagnose(wait=0.1).startswith("node 0 (a) is gone: the rendezvous store")
    for w in watches.values():
        w.stop()


@pytest.mark.long
def test_a_node_whose_ranks_die_one_after_another_is_named_whole():
    """Node 1's agent killed: rank 2 dies at once, rank 3 seconds later (as in a loaded CI run). The
    diagnosis watches on while part of a node is still, so the line names the whole node; a rank that
    goes on beating is left out ("part of node 1") once the extra windows are over."""
    watches = _two_nodes(FakeStore())
    time.sleep(0.2)
    watches[2].stop()
    threading.Timer(0.8, watches[3].stop).start()  # outlives the first 0.5 s window
    t0 = time.monotonic()
    line = watches[0].diagnose(wait=0.5)
    assert line == "node 1 (b, ranks 2-3) stopped answering (its processes are gone)", line
    assert time.monotonic() - t0 < 0.5 * 4 + 0.5  # the first window and at most three more
    watches[3]._stop.clear()
    watches[3].start()  # rank 3 beats again: only rank 2 of node 1 is still
    time.sleep(0.2)
    t0 = time.monotonic()
    line = watches[0].diagnose(wait=0.3, settle=2)
    took = time.monotonic() - t0
    assert line == "part of node 1 (b, rank 2) stopped answering (its processes are gone)", line
    assert 0.3 * 3 <= took < 0.3 * 3 + 0.5  # the extra windows were watched, and no more
    for w in watches.values():
        w.stop()


@pytest.mark.long
def test_a_silent_peer_ends_the_rank_instead_of_a_collective_timeout():
    from workbench.runtime.peers import PeerWatch

    store = FakeStore()
    members = {0: (0, "a"), 1: (1, "b")}
    heard: list[str] = []
    me = PeerWatch(store, 0, members, interval=0.05, stall_s=2.0, on_stall=heard.append).start()
    peer = PeerWatch(store, 1, members, interval=0.05).start()
    time.sleep(0.5)
    assert heard == []
    peer.stop()  # the machine vanished: no closed socket, no error, just silence
    t0 = time.monotonic()
    while not heard and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    me.stop()
    assert heard == ["node 1 (b, rank 1) silent for over 2 s"]


def test_node_records_in_the_run_store(tmp_path):
    run = runs.new_run("train", {"steps": 2, "nnodes": 2}, root=tmp_path, run_id="r")
    runs.update_status(run.path, node=1, state="running", pids={"supervisor": 123})
    runs.update_status(run.path, node=0, state="running")
    runs.append_jsonl(runs.metrics_path(run.path, 0), {"step": 0, "rank": 0, "loss": 1.0, "measured_ms": 5.0})
    runs.append_jsonl(runs.metrics_path(run.path, 1), {"step": 0, "rank": 2, "loss": 1.0, "measured_ms": 6.0})
    assert runs.metrics_path(run.path, 1) == run.path / "nodes" / "node1.metrics.jsonl"
    assert sorted(r["rank"] for r in run.metrics()) == [0, 2]  # both nodes' rows, one run
    nodes = run.nodes()
    assert sorted(nodes) == [0, 1] and nodes[1].pids["supervisor"] == 123 and nodes[1].extra["node"] == 1
    assert runs.read_status(run.path).pids == {}  # the run's own record holds no node's processes
    s = run.summary()
    assert [n["node"] for n in s["nodes"]] == [0, 1] and s["nodes"][1]["state"] == "running"
    t0 = time.time()
    assert runs.stop_requested(run.path, t0) is None
    runs.request_stop(run.path, "test")
    assert runs.stop_requested(run.path, t0)["reason"] == "test"
    assert runs.stop_requested(run.path, time.time() + 10) is None  # an older request is not for a later start


# ------------------------------------------------------------------------------------------------
# fast: joining a run, the emitted commands, this machine's refusals
# ------------------------------------------------------------------------------------------------

SET = dict(model="tiny", max_len=256, batch_tokens=1024, effort=0.5, device="cpu", steps=2, nproc=2, nnodes=2)


def test_nodes_join_one_run_by_name_and_refuse_another_runs_spec(tmp_path):
    run0, spec0, _ = prepare_train(SET, root=tmp_path, name="j", join=True)
    run1, spec1, _ = prepare_train(SET, root=tmp_path, name="j", join=True)  # the second node joins
    assert run1.path == run0.path and spec1 == spec0
    with pytest.raises(SpecError, match=r"run j in .* was prepared \(by another node\) with other settings "
                                        r"\(nproc: 2 on node 0, 1 here"):
        prepare_train({**SET, "nproc": 1}, root=tmp_path, name="j", join=True)
    with pytest.raises(SpecError, match="planner: 'greedy' on node 0, 'flexsp' here"):
        prepare_train({**SET, "planner": "flexsp"}, root=tmp_path, name="j", join=True)
    runs.update_status(run0.path, state="done")
    with pytest.raises(SpecError, match="already ended \\(done\\); pick another --name"):
        prepare_train(SET, root=tmp_path, name="j", join=True)
    with pytest.raises(SpecError, match="needs --name ID, the same on every node"):
        prepare_train(SET, root=tmp_path, join=True)


def test_emitted_arguments_rebuild_the_same_spec(tmp_path):
    from workbench.cli import build_parser
    from workbench.cli import _TRAIN_SETTINGS  # the flags' settings, as cmd_train collects them

    data = tmp_path / "lengths.txt"
    data.write_text("\n".join(str(x) for x in (300, 20, 75, 512, 9)))
    _, spec, _ = prepare_train({**SET, "source": str(data), "planner": "flexsp", "zero_stage": 1, "precision": "bf16",
                                "recompute": True, "optimizer": "sgd", "momentum": 0.9, "lr": 0.25, "seed": 9,
                                "debug": {"step_sleep_s": 0.5}, "degrees": (1, 2, 4), "memory_fraction": 0.6},
                               dry_run=True)
    argv = cluster.train_argv(spec)
    args = build_parser().parse_args(["train", *argv])
    settings = {k: getattr(args, k) for k in _TRAIN_SETTINGS if getattr(args, k, None) is not None}
    settings["degrees"] = tuple(int(x) for x in settings["degrees"].split(","))
    settings["debug"] = {"step_sleep_s": args.debug_step_sleep}
    _, again, _ = prepare_train(settings, dry_run=True, on_gpu=False)
    assert again == spec


def test_slurm_script_runs_one_workbench_per_node(tmp_path):
    _, spec, _ = prepare_train({**SET, "device": "cuda"}, dry_run=True, on_gpu=True)
    text = cluster.slurm_script(spec, run_root=tmp_path / "shared", name="job", port=29555,
                                sbatch=["partition=gpu", "time=01:00:00"])
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # the script parses
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --partition=gpu", "#SBATCH --time=01:00:00", "PORT=${WORKBENCH_RDZV_PORT:-29555}"):
        assert line in text.splitlines(), line
    assert "--node-rank \"$SLURM_NODEID\"" in text and '"$HEAD:$PORT"' in text and "slurm-$SLURM_JOB_ID" in text
    assert f"--run-root {tmp_path / 'shared'}" in text and "--precision bf16" in text and "--device cuda" in text


def test_this_machines_refusals_are_one_line(tmp_path, monkeypatch):
    from workbench import training

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU shown, whatever this machine has
    for bad, words in (({"device": "cuda"}, "--device cuda but this machine shows no NVIDIA GPU"),
                       ({"attention": "flash"}, "--attention flash needs CUDA and this run is on CPU")):
        code, _, err = _cli("train", "--steps", "1", "--run-root", str(tmp_path), "--model", "tiny",
                            *sum(([f"--{k}", v] for k, v in bad.items()), []))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and words in lines[0], err
        assert not any(tmp_path.iterdir())
    # a machine with a GPU but no flash-attn, and an fp32 run asking for flash
    monkeypatch.setattr(training, "cuda_visible", lambda: True)
    monkeypatch.setattr(training, "flash_installed", lambda: None)
    with pytest.raises(SpecError, match="flash-attn is not installed here .*use --attention auto"):
        prepare_train({"steps": 1, "attention": "flash", "model": "tiny"}, root=tmp_path)
    with pytest.raises(SpecError, match="precision is fp32; use --precision bf16"):
        prepare_train({"steps": 1, "attention": "flash", "model": "tiny", "precision": "fp32"}, root=tmp_path)
    # torch's own varlen kernel: half precision only, and only in torch >= 2.10
    with pytest.raises(SpecError, match="--attention varlen computes in bf16/fp16 but this run's precision is fp32"):
        prepare_train({"steps": 1, "attention": "varlen", "model": "tiny", "precision": "fp32"}, root=tmp_path)
    monkeypatch.setattr(training, "torch_has_varlen", lambda: False)
    with pytest.raises(SpecError, match="--attention varlen needs torch >= 2.10"):
        prepare_train({"steps": 1, "attention": "varlen", "model": "tiny"}, root=tmp_path)
    assert not any(tmp_path.iterdir())
    assert training.ATTENTION == ("auto", "varlen", "flash", "torch")


# ------------------------------------------------------------------------------------------------
# slow: two torchrun nodes on this machine
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hetero_reference() -> dict:
    """The single-process SGD step on the heterogeneous batch, computed here: the whole batch (the
    run's token ids for step 0, seed 7) through one plain Transformer, ``batch_loss`` (the definition
    a distributed step reproduces: mean next-token cross-entropy), ``torch.optim.SGD`` at lr 0.5;
    {name: weight after the step}."""
    import torch

    from workbench.data import GlobalBatchSampler
    from workbench.data.sequences import TokenData
    from workbench.models import get_model
    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import batch_loss

    spec = get_model("tiny")
    data = TokenData(LENGTHS, max_len=512, policy="split", seed=7, vocab=spec.vocab)
    assert data.ordered and [int(x) for x in data.lengths] == [int(x) for x in LENGTHS.split(",")]
    batch = GlobalBatchSampler(data, batch_size=None, batch_tokens=None, seed=7).batch(0)
    seqs = [torch.from_numpy(data.tokens(int(i))) for i in batch.indices]
    model = Transformer(spec, seed=7).to(torch.float32)
    loss = batch_loss(model, seqs, torch_varlen_attention)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# one SGD step of the heterogeneous batch on two nodes of one process (LENGTHS), checkpointed
EXACT = ["--steps", "1", "--seed", "7", "--optimizer", "sgd", "--lr", "0.5", "--checkpoint-every", "1", "--model", "tiny",
         "--max-len", "512", "--time-limit", "0.5", "--no-plan-ahead", "--lengths", LENGTHS, "--planner", "greedy",
         "--gpu-memory", "0.008"]


def _assert_same_update(run_dir: Path, reference: dict, nproc: int) -> dict:
    from test_train import params_of

    from workbench.models import get_model
    from workbench.runtime.model import Transformer

    plan = json.loads((run_dir / "plans.jsonl").read_text().splitlines()[0])["plan"]
    groups = [g for m in plan["micro_steps"] for g in m["groups"]]
    degrees = {g["degree"] for g in groups}
    world = 2 * nproc
    # heterogeneous (a group of the whole world and smaller ones), and a group spans the node
    # boundary (ranks 0..nproc-1 are node 0, the rest node 1)
    assert world in degrees and min(degrees) < world, degrees
    assert any(min(g["ranks"]) < nproc <= max(g["ranks"]) for g in groups)
    got = params_of(run_dir, 1)
    init = Transformer(get_model("tiny"), seed=7).state_dict()
    assert sorted(got) == sorted(reference)
    assert max(float((reference[k] - init[k]).abs().max()) for k in reference) > 1e-4  # the step moved the weights
    for name, t in reference.items():
        np.testing.assert_allclose(got[name].numpy(), t.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    return plan


def _emitted_commands(run_root: Path, name: str, *args: str) -> list[list[str]]:
    """``workbench train --emit torchrun``'s command per node, split as a shell reads them (lines
    continued with backslashes); emitting starts and writes nothing."""
    code, out, err = _cli("train", "--emit", "torchrun", "--nproc", "1", "--nnodes", "2", "--device", "cpu",
                          "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--run-root", str(run_root), "--name", name, *args)
    assert code == 0, err
    cmds = [shlex.split(ln) for ln in out.replace("\\\n", " ").splitlines() if ln and not ln.startswith("#")]
    assert len(cmds) == 2 and [c[c.index("--node-rank") + 1] for c in cmds] == ["0", "1"]
    assert not (run_root / name).exists()  # emitting starts and writes nothing
    return cmds


def _left_after(run_dir: Path, within: float = 15.0) -> list[int]:
    """The run's processes still alive ``within`` seconds from now at the latest (``[]`` as soon as none is)."""
    t0 = time.monotonic()
    while _procs_of(run_dir) and time.monotonic() - t0 < within:
        time.sleep(0.2)
    return _procs_of(run_dir)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> dict:
    """ZeRO-3 (the default) over two nodes of one process each, started by the commands ``--emit
    torchrun`` prints, each node's line run by its own shell in another folder (one SGD step of the
    heterogeneous batch, checkpointed); then both nodes resume it (``--steps 200 --change
    --debug-step-sleep 0.3``: it trains on until stopped) and, once a resumed step is recorded,
    ``workbench runs stop`` (with a 30 s grace that holds under any load; it ends as soon as both
    nodes have) ends it. Returns ``dir``, ``first`` (each node's exit status and stderr tail),
    ``status``, ``nodes``, ``metric_ranks``, ``show``, ``listed`` and ``left`` as the first attempt
    ended; ``resumed`` (each resuming node's exit status and stderr tail), ``stop`` (the stop
    command's exit status, stdout and stderr), ``after`` and ``after_nodes`` (the statuses once it
    ended) and ``after_left``."""
    tmp = tmp_path_factory.mktemp("two-nodes")
    cmds = _emitted_commands(tmp / "s", "mn3", *EXACT)
    d = tmp / "s" / "mn3"
    procs = []
    for k, c in enumerate(cmds):  # each node's shell runs its line
        procs.append(subprocess.Popen([*c, "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=tmp, env=_env(), start_new_session=True))
        if k == 0:
            time.sleep(0.5)
    out: dict = {"dir": d, "first": []}
    for k, pr in enumerate(procs):
        _, err = communicate_or_kill(pr, TIMEOUT, f"node {k}")
        out["first"].append((pr.returncode, err[-3000:] + "\n" + "\n".join(runs.tail_lines(d / "log.txt", 40))))
    if any(code != 0 for code, _ in out["first"]):
        return out
    run = runs.load_run(d)
    out.update(status=run.status(), nodes=run.nodes(), metric_ranks=sorted({r["rank"] for r in run.metrics()}),
               show=_cli("runs", "show", "mn3", "--root", str(d.parent))[1],
               listed=_cli("runs", "list", "--json", "--root", str(d.parent))[1], left=_left_after(d))
    # both nodes resume it from its (sharded) checkpoint, training on until the stop
    port = _free_port()
    resumed = [subprocess.Popen([*_exe(), "train", "--run-dir", str(d), "--steps", "200", "--change", "--debug-step-sleep",
                                       "0.3", "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint", f"127.0.0.1:{port}",
                                       "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      env=_env(), start_new_session=True) for k in (0, 1)]
    try:
        t0 = time.monotonic()
        while not (run.status().attempt == 2 and run.status().step >= 2):  # a resumed step recorded
            assert all(p.poll() is None for p in resumed), [p.communicate() for p in resumed]
            assert time.monotonic() - t0 < TIMEOUT, "no resumed step"
            time.sleep(0.2)
        out["stop"] = _cli("runs", "stop", "mn3", "--root", str(d.parent), "--grace", "30")
        out["resumed"] = [(code, err[-3000:]) for code, _, err in _wait_all(resumed, timeout=60)]
    finally:
        _kill_all(resumed)
    out.update(after=run.status(), after_nodes=run.nodes(), after_left=_left_after(d))
    return out


@pytest.mark.slow
@pytest.mark.untimed  # an exact update and files, whatever the load (tests/_xdist_heavy.py)
def test_two_nodes_give_the_single_process_update(hetero_reference, two_nodes):
    """ZeRO-3 (the default) over two nodes of one process each, started by the commands ``--emit
    torchrun`` prints (``two_nodes``). (ZeRO-0's update over two nodes: the Slurm test below; node
    records of nodes of two processes: the kill test.)"""
    for k, (code, err) in enumerate(two_nodes["first"]):
        assert code == 0, f"node {k}:\n{err}"
    d = two_nodes["dir"]
    plan = _assert_same_update(d, hetero_reference, nproc=1)
    assert plan["execution"] == "lockstep"  # ZeRO-3, the default
    st = two_nodes["status"]
    assert st.state == "done" and st.resolved["world_size"] == 2 and st.resolved["nnodes"] == 2
    nodes_ = two_nodes["nodes"]  # one run, two node records
    assert sorted(nodes_) == [0, 1] and all(n.state == "done" for n in nodes_.values())
    assert {tuple(sorted(n.pids["ranks"])) for n in nodes_.values()} == {("0",), ("1",)}
    assert two_nodes["metric_ranks"] == [0, 1]
    show = two_nodes["show"]
    assert "node 0 (" in show and "node 1 (" in show and ": done, attempt 1" in show, show
    assert [r["id"] for r in json.loads(two_nodes["listed"])["runs"]] == ["mn3"]  # one run, not one per node
    assert two_nodes["left"] == [], f"left running: {two_nodes['left']}"


@pytest.mark.slow
@pytest.mark.untimed  # the resume's files and records, whatever the load
def test_both_nodes_resume_it_from_its_sharded_checkpoint(two_nodes):
    """Both nodes resume the two-node run of ``two_nodes`` from its (sharded) checkpoint: attempt 2
    on the run and on each node's record, resumed from step 1, and a resumed step trained."""
    assert "after" in two_nodes, f"the first attempt failed: {two_nodes['first']}"
    st = two_nodes["after"]
    assert st.resumed_from == 1 and st.attempt == 2 and st.step >= 2, st.to_dict()
    assert all(n.attempt == 2 for n in two_nodes["after_nodes"].values())
    rows = runs.Run(two_nodes["dir"]).metrics()
    assert {r["rank"] for r in rows if r.get("attempt") == 2 and r["step"] == 1} == {0, 1}  # both nodes trained the 2nd step


@pytest.mark.slow
@pytest.mark.untimed  # a 30 s grace (the default's 4 s could SIGKILL a supervisor slowed by load: "failed")
def test_a_stop_from_the_run_store_ends_both_nodes(two_nodes):
    """``workbench runs stop`` on a run of two nodes (one process each) while it trains (the resumed
    run of ``two_nodes``); a grace that holds under any load (it ends as soon as both nodes have)."""
    assert "after" in two_nodes, f"the first attempt failed: {two_nodes['first']}"
    code, out, err = two_nodes["stop"]
    assert code == 0 and "no process left here" in out, out + err
    assert all(code != 0 for code, _ in two_nodes["resumed"]), two_nodes["resumed"]
    assert two_nodes["after"].state == "stopped"
    assert {n.state for n in two_nodes["after_nodes"].values()} == {"stopped"}
    assert sorted(two_nodes["after_nodes"]) == [0, 1]
    assert two_nodes["after_left"] == [], f"left running: {two_nodes['after_left']}"


FAKE_SRUN = r'''#!{python}
"""A stand-in srun: starts the command once per node of the job on this machine, with the node's
SLURM_NODEID, and (--kill-on-bad-exit) ends the others when one fails."""
import os, subprocess, sys, time
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
nnodes = int(os.environ["SLURM_NNODES"])
procs = []
for k in range(nnodes):
    procs.append(subprocess.Popen(args, env=dict(os.environ, SLURM_NODEID=str(k), SLURM_PROCID=str(k))))
    time.sleep(0.5)
code = 0
while any(p.poll() is None for p in procs):
    if any(p.returncode not in (None, 0) for p in procs):
        for p in procs:
            if p.poll() is None:
                p.terminate()
    time.sleep(0.2)
sys.exit(max(abs(p.returncode) for p in procs))
'''


@pytest.mark.slow
@pytest.mark.untimed  # an exact update and files, whatever the load (tests/_xdist_heavy.py)
def test_slurm_script_under_a_stand_in_srun(hetero_reference, tmp_path):
    """The script ``--emit slurm`` prints, run by bash with a stand-in ``srun`` starting one node per
    job node: a ZeRO-0 run (free micro-steps) over two nodes of one process each whose update is the
    single process's (the same plan as the ZeRO-3 test's)."""
    port = _free_port()
    code, out, err = _cli("train", "--emit", "slurm", "--nproc", "1", "--nnodes", "2", "--device", "cpu",
                          "--rdzv-endpoint", f":{port}", "--run-root", str(tmp_path / "shared"), "--name", "sl",
                          "--zero-stage", "0", *EXACT)
    assert code == 0, err
    script = tmp_path / "job.sbatch"
    script.write_text(out)
    assert "#SBATCH --gpus-per-node" not in out  # a CPU rehearsal asks for no GPUs
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(FAKE_SRUN.replace("{python}", sys.executable))
    (bin_ / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")  # `scontrol show hostnames`: the job's hosts
    for f in bin_.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = dict(_env(), PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[0-1]", SLURM_NNODES="2",
               SLURM_JOB_ID="4242")
    job = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=TIMEOUT)
    d = tmp_path / "shared" / "sl"
    assert job.returncode == 0, job.stderr[-3000:]
    run = runs.load_run(d)
    assert run.status().state == "done" and run.status().step == 1
    assert sorted(run.nodes()) == [0, 1] and all(n.state == "done" for n in run.nodes().values())
    assert _assert_same_update(d, hetero_reference, nproc=1)["execution"] == "free"
    log = (d / "log.txt").read_text()
    assert "--rdzv-id slurm-4242" in log and f"127.0.0.1:{port}" in log
    _none_left(d)


def _wait_for_steps(run_dir: Path, n: int, nodes: Nodes) -> None:
    t0 = time.monotonic()
    while True:
        rows = runs.Run(run_dir).metrics() if run_dir.exists() else []
        if len({r["step"] for r in rows}) >= n:
            return
        assert all(p.poll() is None for p in nodes.procs), [p.communicate() for p in nodes.procs]
        assert time.monotonic() - t0 < TIMEOUT, "no progress"
        time.sleep(0.3)


# a run that trains for a minute or more: the same 1,024-token batch every step (a list of lengths: no
# corpus for each rank to read), 0.3 s of sleep a step, no checkpoints
LONG = ["--steps", "200", "--model", "tiny", "--max-len", "256", "--lengths", "256,256,256,128,64,64", "--checkpoint-every",
        "0", "--time-limit", "0.5", "--debug-step-sleep", "0.3"]


@pytest.mark.slow
def test_node_1_killed_fails_both_nodes_naming_it(tmp_path):
    nodes = Nodes(tmp_path, "killed", LONG)
    d = nodes.run_dir
    try:
        _wait_for_steps(d, 2, nodes)
        sup = runs.read_status(d, 1).pids["supervisor"]
        os.kill(sup, signal.SIGKILL)  # node 1's torchrun agent dies, as with its machine
        outs = nodes.wait(timeout=120)
    finally:
        nodes.kill()
    (c0, _, e0), (c1, _, e1) = outs
    last0, last1 = e0.strip().splitlines()[-1], e1.strip().splitlines()[-1]
    assert c0 == 1 and "node 1 (" in last0 and "ranks 2-3) stopped answering" in last0, e0[-2000:]
    assert c1 == 1 and "node 1 (" in last1 and "killed by SIGKILL" in last1, e1[-2000:]
    run = runs.load_run(d)
    st, n0, n1 = run.status(), runs.read_status(d, 0), runs.read_status(d, 1)
    assert st.state == "failed" and "node 1" in st.error
    assert n0.state == "failed" and "node 1" in n0.error and n1.state == "failed" and "SIGKILL" in n1.error
    # node k holds ranks 2k and 2k+1 (its record), and both nodes' metrics make the run's
    assert {tuple(sorted(n.pids["ranks"])) for n in (n0, n1)} == {("0", "1"), ("2", "3")}
    assert sorted({r["rank"] for r in run.metrics()}) == [0, 1, 2, 3]
    _none_left(d)


@pytest.mark.slow
def test_an_endpoint_that_does_not_answer_is_one_line(tmp_path):
    """Node 1 given an endpoint where nothing listens, and node 0 left alone (it waits for the
    others, then says how many came), both with a 2 s rendezvous timeout, side by side."""
    dead = _free_port()  # nothing listens there
    common = ["--nnodes", "2", "--rdzv-timeout", "2", "--run-root", str(tmp_path), "--nproc", "2", "--device", "cpu",
              "--quiet", *LONG]
    lonely = subprocess.Popen([*_exe(), "train", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{dead}", "--name",
                               "lonely", *common], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=_env(), start_new_session=True)
    alone = subprocess.Popen([*_exe(), "train", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                              "--name", "alone", *common], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, env=_env(), start_new_session=True)
    _, err = communicate_or_kill(lonely, 120, "node 1")
    last = err.strip().splitlines()[-1]
    assert lonely.returncode == 1 and f"node 1: the rendezvous endpoint 127.0.0.1:{dead} did not answer within 2 s" in last, \
        err[-2000:]
    _, err = communicate_or_kill(alone, 120, "node 0")
    last = err.strip().splitlines()[-1]
    assert alone.returncode == 1 and "waited 2 s but only 1 of 2 node(s) joined" in last, err[-2000:]
    assert runs.read_status(tmp_path / "lonely", 1).state == "failed"
    _none_left(tmp_path / "lonely")
    _none_left(tmp_path / "alone")


@pytest.mark.slow
@pytest.mark.untimed  # refusals and nothing left, whatever the load: its only clocks are generous timeouts (60 s and up)
def test_another_nproc_or_spec_on_the_second_node_is_one_line(tmp_path):
    """Three pairs of nodes side by side. On a shared run store the second node is refused before it
    starts anything; node 0, left waiting for it, is stopped (its terminal's Ctrl-C) and leaves
    nothing. With a run store each (no shared path) the nodes compare themselves at the rendezvous,
    before any rank starts (the supervisors, through the rendezvous store): another --nproc, and
    another spec (on one process a node: its process counts agree, its planners do not)."""
    apart = [("apart-nproc", [["--nproc", "2"], ["--nproc", "1"]], "started 1 process(es) but the run has 2 per node"),
             ("apart-spec", [["--nproc", "1", "--planner", "greedy"], ["--nproc", "1", "--planner", "static:1"]],
              "runs another spec than node 0 (planner: 'greedy' on node 0, 'static:1' here)")]
    started = []
    try:
        for name, per_node, _ in apart:
            started.append(Nodes(tmp_path, name, [*LONG, "--timeout", "60"], per_node=per_node,
                                 roots=[tmp_path / "a", tmp_path / "b"]))
        shared = Nodes(tmp_path, "mismatch", [*LONG, "--rdzv-timeout", "60"], per_node=[["--nproc", "2"], ["--nproc", "1"]],
                       node0_prepared=True)
        started.append(shared)
        _, e1 = shared.procs[1].communicate(timeout=120)
        c1 = shared.procs[1].returncode
        shared.kill()
        outs = [nodes.wait(timeout=180) for nodes in started[:2]]
    finally:
        for nodes in started:
            nodes.kill()
    assert c1 == 2 and len(e1.strip().splitlines()) == 1 and "nproc: 2 on node 0, 1 here" in e1, e1
    _none_left(tmp_path / "store" / "mismatch")
    for (name, _, words), out in zip(apart, outs):
        for k, (code, _, err) in enumerate(out):
            last = err.strip().splitlines()[-1]
            assert code == 1 and "node 1 (" in last and words in last, f"{name}, node {k}: {err[-2000:]}"
            rec = runs.read_status(tmp_path / "ab"[k] / name, k)  # node k's record, in its own run store
            assert rec.state == "failed" and not (rec.pids or {}).get("ranks"), f"{name}, node {k}: {rec.to_dict()}"
        for r in (tmp_path / "a", tmp_path / "b"):
            _none_left(r / name)
