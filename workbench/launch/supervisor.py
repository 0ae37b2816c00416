"""The supervisor: one process per run and node that *is* torchrun, and cleans up after it.

    python -m workbench.launch.supervisor --run-dir RUN --nproc N [--nnodes K --node-rank R
        --rdzv-endpoint HOST:PORT --rdzv-id ID --rdzv-timeout S] [--parent-pid PID] --module MOD [-- ARGS...]

It runs torchrun's own entry (``torch.distributed.run.run``) in this process, so torchrun's
elastic agent is this process and its structured failures come back as an exception rather
than as text. Around it:

- **Loopback only on one node.** Without ``--rdzv-endpoint`` the rendezvous store is a TCPStore
  created on a socket bound to 127.0.0.1 (a registered ``workbench-loopback`` rendezvous; torch's
  own stores listen on every interface), and gloo/NCCL are pinned to the loopback interface.
- **Several nodes.** torchrun's static rendezvous on the user's endpoint: node 0 hosts the store
  there, every node is the rank it was given (``--node-rank``: node k holds ranks
  ``k*nproc .. (k+1)*nproc - 1``, so the plan's node-aligned groups are the machines'), and a node
  that cannot reach the endpoint, or a node 0 that waits for the others, gives up after
  ``--rdzv-timeout`` seconds with one line naming the endpoint. Once they meet, a trainer's nodes
  compare their ``--nproc``, run and spec through the rendezvous store: a node that differs ends
  every node with one line naming it, before any rank starts. Each node writes its own record
  (``nodes/node<k>.json``: host, pids, attempt, end) and watches the run store's ``stop.json``, so a
  stop from any host reaches it through a shared run store.
- **Per-rank logs** under ``RUN/torchrun/attempt_<k>/`` (and every line also in ``log.txt``).
- **Signals.** SIGTERM, SIGINT, SIGHUP and SIGQUIT stop the run (torchrun terminates its ranks;
  the supervisor then sweeps). With ``--parent-pid`` the run also stops when that process dies
  (``workbench train`` in a terminal that was closed or killed).
- **No orphans.** Whatever ends the run, every process group it recorded (each rank leads one,
  with its plan-ahead worker and multiprocessing's resource tracker inside) gets SIGTERM, then
  SIGKILL after a grace period.
- **One final status**: done, stopped, or failed with the failing rank, its exit code or signal,
  the error it reported and its last log lines.

Exit status: 0 done, 1 failed, 128 + signal number when stopped by a signal.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

from workbench import runs
from workbench.launch.forked import START_METHODS, cuda_checks_without_init, preload, rank_main, refuse_cuda, start_method
from workbench.launch.process import TRAINER_MODULE, sweep

LOOPBACK_BACKEND = "workbench-loopback"
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class _Stop(Exception):
    """A stop signal that arrived before torchrun installed its own handlers."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _early_handler(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _Stop(signum)


# ------------------------------------------------------------------------------------------------
# the loopback rendezvous
# ------------------------------------------------------------------------------------------------


def _register_loopback() -> None:
    """Register a static rendezvous whose TCPStore listens on 127.0.0.1 only (a socket bound here
    and handed to the store), not on every interface as TCPStore binds by itself."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOOPBACK_BACKEND

        def next_rendezvous(self):
            if not self._store:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(("127.0.0.1", 0))
                sock.listen(128)
                self.master_addr, self.master_port = "127.0.0.1", sock.getsockname()[1]
                # the store owns the listening socket from here on (detach: Python must not close it)
                self._store = TCPStore("127.0.0.1", self.master_port, self.world_size, True, self.timeout,
                                       multi_tenant=True, master_listen_fd=sock.detach())
            return super().next_rendezvous()

    _register_static(LOOPBACK_BACKEND, LoopbackRendezvous)


def _register_static(backend: str, rendezvous_class) -> None:
    """Register ``backend`` for torchrun: its static rendezvous's parameters, as a
    ``rendezvous_class`` (a ``StaticTCPRendezvous`` of ours). Once per process."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    def create(params):
        h = create_rdzv_handler(params)
        return rendezvous_class(h.master_addr, h.master_port, int(h.rank), h.world_size, h.run_id,
                                int(h.timeout.total_seconds()))

    try:
        rendezvous_handler_registry.register(backend, create)
    except ValueError:
        pass  # already registered in this process


NODE_CHECKED_BACKEND = "workbench-static"
"""The rendezvous of a trainer's run over several nodes: torchrun's static one (node k is group
rank k, node 0 hosts the store at the endpoint), after which the nodes compare their ``--nproc``,
run and spec through that store and, if they differ, end with one line before any rank starts."""


class NodeMismatch(RuntimeError):
    """The nodes of a run differ (another ``--nproc``, run or spec on some node): the message says
    which node and what to change (``workbench.launch.cluster.node_problem``)."""


_NODE_KEY = "workbench/node/"
_NODES_READ_KEY = "workbench/nodes_read"


def node_info(run_dir: Path, *, node: int, nproc: int) -> dict:
    """What this node says about itself at the rendezvous, in the shape every rank says it at start
    (``workbench.runtime.train``; ``cluster.node_problem`` compares either): its first rank, node,
    host, processes, run id and spec (without ``steps``: a resume may raise them on one node first);
    the spec is None when the run folder has none readable (the ranks then say what is wrong)."""
    from workbench.training import read_train_spec

    try:
        spec = read_train_spec(run_dir).to_dict()
        spec.pop("steps", None)
    except Exception:  # noqa: BLE001 - the trainer reports a missing or bad spec itself
        spec = None
    return {"rank": node * nproc, "node": node, "host": socket.gethostname(), "local_world_size": nproc,
            "run_id": run_dir.name, "spec": spec}


def compare_nodes(store, mine: dict, nnodes: int, timeout_s: float) -> None:
    """Every node's ``node_info`` through the rendezvous store (each node sets its own and reads the
    others'); raises NodeMismatch with ``node_problem``'s line when they differ. Node 0 hosts the
    store, so it leaves only once every node has read (or after ``timeout_s``)."""
    import datetime

    from workbench.launch.cluster import node_problem

    store.set(f"{_NODE_KEY}{int(mine['node'])}", json.dumps(mine))
    keys = [f"{_NODE_KEY}{k}" for k in range(nnodes)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    infos = sorted((json.loads(store.get(k)) for k in keys), key=lambda i: int(i["node"]))
    problem = node_problem(infos)
    if problem is None:
        return
    read = int(store.add(_NODES_READ_KEY, 1))
    deadline = time.monotonic() + timeout_s
    while int(mine["node"]) == 0 and read < nnodes and time.monotonic() < deadline:
        time.sleep(0.05)
        read = int(store.add(_NODES_READ_KEY, 0))
    raise NodeMismatch(problem[1])


def _register_node_checked(run_dir: Path, nproc: int) -> None:
    """Register ``NODE_CHECKED_BACKEND``: torchrun's static rendezvous followed by ``compare_nodes``."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class NodeCheckedRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return NODE_CHECKED_BACKEND

        def next_rendezvous(self):
            info = super().next_rendezvous()
            store = getattr(info, "store", None) or info[0]  # a RendezvousInfo (a tuple in older torch)
            compare_nodes(store, node_info(run_dir, node=int(self.rank), nproc=nproc), int(self.world_size),
                          self.timeout.total_seconds())
            return info

    _register_static(NODE_CHECKED_BACKEND, NodeCheckedRendezvous)


DEFAULT_RDZV_TIMEOUT_S = 600
"""How long a node waits for the rendezvous (to reach the endpoint, or for every node to join)."""


def torchrun_args(run_dir: Path, *, nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
                  rdzv_id: str | None, module: str, module_args: list[str], attempt: int,
                  rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT_S, node_check: bool = False) -> list[str]:
    """torchrun's arguments for this node's share of the run. ``node_check`` (several nodes): the
    rendezvous is ``NODE_CHECKED_BACKEND`` (the nodes compare themselves before any rank starts;
    ``main`` registers it) instead of torchrun's plain ``static``."""
    log_dir = run_dir / runs.TORCHRUN_LOG_DIR / f"attempt_{attempt}"
    if nnodes == 1 and rdzv_endpoint is None:
        out = ["--nnodes", "1", "--node-rank", "0", "--rdzv-backend", LOOPBACK_BACKEND,
               "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-conf", "rank=0"]
    else:
        if rdzv_endpoint is None:
            raise ValueError("a run over several nodes needs --rdzv-endpoint HOST:PORT (the same on every node)")
        # static: node k is group rank k (c10d would order nodes by host name and pid)
        out = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend",
               NODE_CHECKED_BACKEND if node_check else "static",
               "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id or run_dir.name,
               "--rdzv-conf", f"rank={node_rank},timeout={max(1, int(round(rdzv_timeout)))}"]
        if nnodes > 1:
            log_dir = log_dir / f"node{node_rank}"
    out += ["--nproc-per-node", str(nproc), "--max-restarts", "0", "--monitor-interval", "0.2",
            "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3",
            "-m", module, "--run-dir", str(run_dir), *module_args]
    return out


def _torchrun(targs, method: str, run_dir: Path) -> None:
    """torchrun's ``run`` on its parsed arguments ``targs`` (``torchrun_args``: our own rendezvous,
    ``-m module``), its ranks started as ``method`` says: ``exec``, new interpreters as torchrun's
    CLI starts them; ``fork``, forks of this process running ``forked.rank_main`` (torch imported once)."""
    from torch.distributed.run import config_from_args, run

    if method == "exec":
        run(targs)
        return
    from torch.distributed.launcher.api import elastic_launch

    if targs.master_port is None:  # as run() sets it (our rendezvous passes its own address and port)
        targs.master_port = 29500
    with cuda_checks_without_init():  # LaunchConfig asks whether CUDA is there (NUMA bindings)
        config, _cmd, cmd_args = config_from_args(targs)
    refuse_cuda()
    # cmd_args: ["-u", "-m", module, *its arguments] (-u: rank_main makes its output unbuffered)
    if cmd_args[:2] != ["-u", "-m"]:
        raise RuntimeError(f"unexpected rank command for a forked start: {cmd_args[:3]}")
    config.start_method = "fork"
    preload(_rank_imports(cmd_args[2], run_dir))
    elastic_launch(config=config, entrypoint=rank_main)(*cmd_args[2:])


def _rank_imports(module: str, run_dir: Path) -> list[str]:
    """What every rank of ``module`` imports, to import once here before they fork: the module itself
    (with its dependencies; each rank runs it afresh as ``__main__``) and, for a trainer, the torch
    modules of the run's ZeRO stage (``zero.STAGE_IMPORTS``: FSDP is 0.8 s of CPU a rank)."""
    out = [module]
    if module == TRAINER_MODULE:
        from workbench.runtime.zero import STAGE_IMPORTS

        try:
            stage = (runs.Run(run_dir).spec().get("scenario") or {}).get("zero_stage")
        except (OSError, ValueError, AttributeError):  # the ranks say what is wrong with the spec
            stage = None
        out += STAGE_IMPORTS.get(stage, ())
    return out


# ------------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------------


def _rank_log_tail(run_dir: Path, attempt: int, local_rank: int, lines: int = 15) -> list[str]:
    """The failing rank's last lines: its own torchrun log files, else the end of ``log.txt``
    (a rank that printed nothing before it died leaves only the others' last words)."""
    base = run_dir / runs.TORCHRUN_LOG_DIR / f"attempt_{attempt}"
    found = sorted(base.glob(f"**/{local_rank}/stderr.log")) + sorted(base.glob(f"**/{local_rank}/stdout.log"))
    for path in found:
        tail = runs.tail_lines(path, lines)
        if any(t.strip() for t in tail):
            return tail
    return [f"(rank {local_rank} printed nothing; the end of {runs.LOG_FILE}:)",
            *runs.tail_lines(run_dir / runs.LOG_FILE, lines)]


def _reported_error(run_dir: Path, rank: int | None) -> str | None:
    """The error a rank wrote itself (``failures/rank<k>.json``): the failing rank's, else the first."""
    folder = run_dir / runs.FAILURES_DIR
    found = {}
    for p in folder.glob("rank*.json") if folder.is_dir() else ():
        try:
            d = json.loads(p.read_text())
            found[int(d.get("rank", -1))] = str(d.get("error"))
        except (OSError, ValueError, TypeError):
            continue
    if rank is not None and rank in found:
        return found[rank]
    return found[min(found)] if found else None


def _describe_exit(code: int) -> tuple[str, str | None]:
    """('exit code 1' | 'killed by SIGKILL', signal name or None) of a rank's exit code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        extra = " (what the out-of-memory killer sends)" if name == "SIGKILL" else ""
        return f"killed by {name}{extra}", name
    return f"exit code {code}", None


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


_PARENT_GONE: list[int] = []


def _watch_stop_file(run_dir: Path, since: float) -> None:
    """Stop this node (SIGTERM to ourselves) when the run store asks every node to stop."""

    def loop() -> None:
        while runs.stop_requested(run_dir, since) is None:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=loop, name="stop-watch", daemon=True).start()


def _is_loopback(endpoint: str) -> bool:
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _rendezvous_error(e: BaseException, endpoint: str, nnodes: int, node_rank: int, timeout: float) -> str | None:
    """One line for a rendezvous that failed (torchrun's static store: a client that cannot connect,
    a host that waited for the others), or None when ``e`` is something else."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    low = text.lower()
    if "waiting for clients" in low or "waiting for workers" in low:
        m = re.search(r"(\d+)/(\d+) clients joined", text)
        joined = f"{m.group(1)} of {m.group(2)}" if m else "not every"
        return (f"the rendezvous at {endpoint} (hosted by node 0) waited {timeout:.0f} s but only {joined} node(s) "
                f"joined: start every node with --nnodes {nnodes} and --rdzv-endpoint {endpoint} (or raise --rdzv-timeout)")
    if "connect" in low or "timed out" in low or "refused" in low or "unreachable" in low or "resolve" in low:
        return (f"node {node_rank}: the rendezvous endpoint {endpoint} did not answer within {timeout:.0f} s ({text}); "
                f"start node 0 first (it listens there) and check the address and that the port is open between the nodes")
    return None


def _watch_parent(pid: int) -> None:
    """Stop the run (SIGTERM to ourselves) when process ``pid`` is gone."""
    start = runs.proc_start_time(pid)

    def loop() -> None:
        while runs.pid_alive(pid, start):
            time.sleep(0.5)
        _PARENT_GONE.append(pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Run one node's share of a run under torchrun and record how it ended; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m workbench.launch.supervisor", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--rdzv-endpoint", default=None)
    ap.add_argument("--rdzv-id", default=None)
    ap.add_argument("--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT_S)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--module", default="workbench.runtime.train")
    ap.add_argument("--start-method", choices=START_METHODS, default=None,
                    help="fork: ranks start as forks of this process, torch already imported (workbench.launch.forked); "
                         "exec: as new interpreters, as torchrun's CLI starts them (default: $WORKBENCH_RANK_START, "
                         "else fork on Linux with a CPU build of torch)")
    ap.add_argument("module_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    extra = args.module_args[1:] if args.module_args[:1] == ["--"] else args.module_args
    run_dir = Path(args.run_dir).resolve()
    for s in HANDLED_SIGNALS:
        signal.signal(s, _early_handler)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    node = args.node_rank if args.nnodes > 1 else None
    started = time.time()
    st = runs.read_status(run_dir, node)
    attempt = max(1, st.attempt)
    runs.update_status(run_dir, node=node, reopen=True, state="starting", host=socket.gethostname(),
                       pids={"supervisor": os.getpid(), **runs.process_record()})
    if node is not None:
        _watch_stop_file(run_dir, started)
    state, code, fields = "failed", 1, {}
    # the machine's load while the run lives (one node samples it: they may share the folder)
    sampler = runs.LoadSampler(run_dir).start() if args.node_rank == 0 else None
    try:
        if args.nnodes == 1 and args.rdzv_endpoint is None:
            _register_loopback()
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        elif _is_loopback(args.rdzv_endpoint):  # every "node" on this machine (a test, a rehearsal)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args

        # a trainer's nodes compare themselves at the rendezvous: another --nproc, run or spec on some
        # node ends every node with one line before any rank starts (the ranks compare again at start)
        node_check = args.nnodes > 1 and args.module == TRAINER_MODULE
        if node_check:
            _register_node_checked(run_dir, args.nproc)
        gc.freeze()  # what the imports made lives to the end: no collection walks it again
        targs = torchrun_args(run_dir, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                              rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, module=args.module,
                              module_args=extra, attempt=attempt, rdzv_timeout=args.rdzv_timeout,
                              node_check=node_check)
        method = args.start_method or start_method()
        print(f"workbench supervisor: torchrun {' '.join(targs)} (ranks start by {method})", flush=True)
        try:
            _torchrun(parse_args(targs), method, run_dir)
            state, code = "done", 0
        except ChildFailedError as e:
            state, code, fields = "failed", 1, _failure_fields(run_dir, attempt, e)
        except SignalException as e:
            sig = int(e.sigval)
            state, code = "stopped", 128 + sig
            fields = {"note": f"stopped by {signal.Signals(sig).name}"}
    except _Stop as e:
        state, code, fields = "stopped", 128 + e.signum, {"note": f"stopped by {e}"}
    except NodeMismatch as e:
        state, code, fields = "failed", 1, {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - recorded in the status, never a silent death
        state, code = "failed", 1
        rdzv = (_rendezvous_error(e, args.rdzv_endpoint, args.nnodes, args.node_rank, args.rdzv_timeout)
                if args.rdzv_endpoint else None)
        fields = {"error": rdzv or f"torchrun could not run: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}"}
    finally:
        for s in HANDLED_SIGNALS:  # a second signal must not interrupt the sweep
            signal.signal(s, signal.SIG_IGN)
        if sampler is not None:
            sampler.stop()
        left = sweep(run_dir, node=node)
    asked = runs.stop_requested(run_dir, started) if node is not None else None
    if asked is not None and state == "failed":
        # every node was asked to stop: a rank that saw its peers go first failed only because of it
        state, code = "stopped", 128 + signal.SIGTERM
        fields = {"note": f"stopped: the run store asked every node to stop ({asked.get('reason') or 'stop.json'})"}
    if _PARENT_GONE and state == "stopped":
        fields["note"] = f"stopped: the process that started it (pid {_PARENT_GONE[0]}) ended"
    if left:
        fields["note"] = (fields.get("note", "") + f"; ended {len(left)} leftover process(es)").lstrip("; ")
    prev = runs.read_status(run_dir) if node in (None, 0) else runs.read_status(run_dir, node)
    if state == "done" and prev.state == "failed":  # the trainer said it failed, torchrun did not
        state, code = "failed", 1
    if state == "failed" and not fields.get("error"):
        fields["error"] = prev.error or _reported_error(run_dir, fields.get("failing_rank")) or "the run failed"
    if node is not None:
        runs.update_status(run_dir, node=node, state=state, exit_code=code, finished=runs.now(), reopen=True, **fields)
    # the run's own end: node 0 (rank 0's node) writes it; another node only when it failed first
    if node in (None, 0):
        runs.update_status(run_dir, state=state, exit_code=code, finished=runs.now(), reopen=True, **fields)
    elif state != "done" and not runs.read_status(run_dir).final:
        runs.update_status(run_dir, state=state, finished=runs.now(), error=fields.get("error"),
                           failing_rank=fields.get("failing_rank"))
    print(f"workbench supervisor: {'node ' + str(node) + ' of the ' if node is not None else ''}run {state} "
          f"(exit {code})", flush=True)
    return code


def _failure_fields(run_dir: Path, attempt: int, e) -> dict:
    """Status fields of torchrun's ChildFailedError: per-rank exit codes, the first failure."""
    failures = getattr(e, "failures", {}) or {}
    exit_codes = {str(r): int(f.exitcode) for r, f in failures.items()}
    try:
        rank, first = e.get_first_failure()
    except Exception:  # noqa: BLE001
        rank, first = (min(failures), failures[min(failures)]) if failures else (None, None)
    # a rank killed by a signal from outside (SIGKILL, a crash's SIGSEGV; not the SIGTERM or SIGINT
    # torchrun and a user's stop send to every rank) is the cause: its peers fail after it, on a
    # collective that lost a member, and their error files can carry an earlier time than torchrun's
    # notice of the kill
    killed = sorted((r for r, f in failures.items()
                     if int(f.exitcode) < 0 and -int(f.exitcode) not in (signal.SIGTERM, signal.SIGINT)),
                    key=lambda r: (failures[r].timestamp, r))
    if killed and (first is None or int(first.exitcode) >= 0):
        rank, first = killed[0], failures[killed[0]]
    out: dict = {"exit_codes": exit_codes}
    if first is None:
        out["error"] = "torchrun reported a failure without a rank"
        return out
    how, sig = _describe_exit(int(first.exitcode))
    reported = _reported_error(run_dir, rank)
    out.update(failing_rank=int(rank), signal=sig,
               log_tail=_rank_log_tail(run_dir, attempt, int(getattr(first, "local_rank", rank))))
    out["error"] = f"rank {rank} {how}" + (f": {reported}" if reported and sig is None else "")
    return out


if __name__ == "__main__":
    from workbench.util import exit_process

    # its end is written (status, node record, the last line flushed): skip the interpreter's
    # finalization of torch, which took about as long as the run's own end on 2 busy cores
    exit_process(main())
