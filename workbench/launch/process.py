"""Process control for runs: start a supervised torchrun tree, poll it, stop it, find it again.

:func:`start` launches ``python -m workbench.launch.supervisor`` (which is torchrun, see
``workbench.launch.supervisor``) as an argument list in a session of its own, output appended to
the run's ``log.txt``, and returns at once: a notebook kernel never forks and never imports torch
to launch. Everything a caller needs later is in the run store (``status.json``: the supervisor's,
every rank's and every helper's pid), so a restarted kernel or another shell can :func:`attach`
to a run and :func:`stop` it. Nothing here imports torch.

A run over several nodes is started once per node (``nnodes``, ``node_rank``): each node's
supervisor, processes and end live in that node's record (``nodes/node<k>.json``); node 0 also
opens the run's own status. A handle then follows its node (``RunHandle.node``), and :func:`stop`
of a run ends what runs on this host and asks the other nodes' supervisors to stop through the run
store (``stop.json``).

The processes' environment (``worker_env``): this process's (or the caller's ``env``), with
``OMP_NUM_THREADS=1`` unless set and, for a run on CUDA (its spec's ``device``; ``auto`` where the
machine may show a GPU), ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set
that variable: at long context the allocator's fixed segments fragment. A user's own value is
always kept; when it leaves expandable segments out the run's log says so once. CPU runs get no
allocator setting.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from workbench import runs

__all__ = ["RunHandle", "start", "attach", "poll", "wait", "stop", "run_alive", "supervisor_command", "new_steps",
           "SUPERVISOR_MODULE", "TRAINER_MODULE", "RunBusy", "sweep", "describe_exit", "records_here", "worker_env",
           "run_uses_cuda", "ALLOC_CONF", "EXPANDABLE_SEGMENTS", "STOP_GRACE_S"]

SUPERVISOR_MODULE = "workbench.launch.supervisor"
TRAINER_MODULE = "workbench.runtime.train"
SWEEP_GRACE_S = 2.0
STOP_GRACE_S = 4.0
"""Seconds :func:`stop` gives a run's processes after SIGTERM before SIGKILL (``workbench runs stop --grace``)."""
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
"""The environment variable PyTorch's CUDA caching allocator reads its settings from (once, when it starts)."""
EXPANDABLE_SEGMENTS = "expandable_segments:True"
"""What a CUDA run's processes get in ``PYTORCH_CUDA_ALLOC_CONF`` unless the user set it: segments that
grow in place instead of fixed-size blocks, which fragment at long context (PyTorch's own advice for
memory-bound runs: the allocator's peak "reserved but unallocated" falls)."""


class RunBusy(ValueError):
    """The run already has live processes."""


@dataclass
class RunHandle:
    """A started (or re-found) run: its store entry and, when this process started it, the
    supervisor's Popen (polling it reaps the process)."""

    run: runs.Run
    pid: int
    process: subprocess.Popen | None = None
    start_time: int | None = None
    _seen: set = field(default_factory=set, repr=False)
    node: int | None = None
    """The node this handle's supervisor runs, in a run over several nodes (None: a one-node run)."""

    @property
    def run_dir(self) -> Path:
        return self.run.path


def supervisor_command(run_dir: str | Path, *, nproc: int, module: str = TRAINER_MODULE,
                       module_args: Sequence[str] = (), nnodes: int = 1, node_rank: int = 0,
                       rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                       parent_pid: int | None = None, python: str | None = None,
                       rdzv_timeout: float | None = None) -> list[str]:
    """The argument list that starts a run's supervisor. Raises ValueError for bad counts or a
    multi-node run without an endpoint."""
    for name, v, lo in (("--nproc", nproc, 1), ("--nnodes", nnodes, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in 0..{nnodes - 1}, got {node_rank}")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError("a run over several nodes needs --rdzv-endpoint HOST:PORT (the same on every node)")
    cmd = [python or sys.executable, "-m", SUPERVISOR_MODULE, "--run-dir", str(Path(run_dir).resolve()),
           "--nproc", str(nproc), "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--module", module]
    if rdzv_endpoint:
        cmd += ["--rdzv-endpoint", rdzv_endpoint]
    if rdzv_id:
        cmd += ["--rdzv-id", rdzv_id]
    if rdzv_timeout is not None:
        if not rdzv_timeout > 0:
            raise ValueError(f"--rdzv-timeout must be a positive number of seconds, got {rdzv_timeout!r}")
        cmd += ["--rdzv-timeout", f"{float(rdzv_timeout):g}"]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    return cmd + ["--", *module_args]


def records_here(run_dir: Path) -> list[tuple[int | None, runs.RunStatus]]:
    """The run's status and every node record written on this host: ``[(node or None, status)]``
    (what a stop here can reach; ``workbench runs stop`` lists the processes left in them)."""
    here = socket.gethostname()
    out: list[tuple[int | None, runs.RunStatus]] = [(None, runs.read_status(run_dir))]
    out += [(k, r) for k, r in runs.Run(run_dir).nodes().items() if r.host in ("", here)]
    return out


def run_alive(target: runs.Run | runs.RunStatus | str | Path) -> bool:
    """Whether any process the run recorded is alive on this host (its own and its nodes' records)."""
    if isinstance(target, runs.RunStatus):
        return any(runs.pid_alive(p, t) for p, t in runs.status_pids(target))
    path = target.path if isinstance(target, runs.Run) else Path(target)
    return any(runs.pid_alive(p, t) for _, st in records_here(path) for p, t in runs.status_pids(st))


def _logged(log_file: Path, line: str) -> bool:
    """Whether ``line`` is already in the run's log (an earlier attempt wrote it)."""
    try:
        with open(log_file, "rb") as f:
            return line.encode() in f.read()
    except OSError:
        return False


def _gpu_may_be_visible() -> bool:
    """Whether this machine may show an NVIDIA GPU to the run, found without torch and without starting
    anything: not hidden by ``CUDA_VISIBLE_DEVICES``, and the driver lists a GPU or ``nvidia-smi`` is
    installed. A wrong yes only sets an allocator variable a CPU run never reads."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None and vis.strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    return shutil.which("nvidia-smi") is not None


def run_uses_cuda(run: runs.Run) -> bool:
    """Whether ``run``'s processes will compute on CUDA, from its ``spec.json``'s ``device`` (``cuda``:
    yes, ``cpu``: no; ``auto`` or none, as a notebook or demo run: when this machine may show a GPU)."""
    device = run.spec().get("device", "auto")
    if device in ("cuda", "cpu"):
        return device == "cuda"
    return _gpu_may_be_visible()


def worker_env(base: Mapping[str, str], *, cuda: bool) -> tuple[dict[str, str], str | None]:
    """The environment of a run's supervisor and, through torchrun, its ranks: ``base`` with
    ``OMP_NUM_THREADS=1`` unless set, unbuffered Python output, and for a CUDA run
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set that variable (theirs is
    always kept). A CPU run gets no allocator setting (its torch never reads it). Returns ``(env,
    note)``: the note is one line for the run's log when the user's allocator setting leaves
    expandable segments out on a CUDA run, else None."""
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    note = None
    if cuda:
        theirs = env.get(ALLOC_CONF)
        if theirs is None:
            env[ALLOC_CONF] = EXPANDABLE_SEGMENTS
        elif "expandable_segments" not in theirs.replace(" ", ""):
            note = (f"note: {ALLOC_CONF}={theirs!r} is yours and kept; without {EXPANDABLE_SEGMENTS} the "
                    f"allocator's fixed segments may fragment at long context (the workbench sets it when the "
                    f"variable is unset)")
    return env, note


def start(run: runs.Run | str | Path, *, nproc: int, module: str = TRAINER_MODULE, module_args: Sequence[str] = (),
          nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
          stop_with_parent: bool = False, env: dict | None = None, rdzv_timeout: float | None = None,
          cuda: bool | None = None) -> RunHandle:
    """Start a new attempt of ``run`` and return at once.

    ``module`` (run by torchrun on every rank with ``--run-dir RUN`` and ``module_args``) must be
    importable: the trainer by default, the profiler for profile runs. ``stop_with_parent``: the
    run stops when this process dies (a terminal's ``workbench train``; not for notebooks, whose
    runs should outlive a kernel restart). The status becomes ``starting`` with the next attempt
    number and the supervisor's pid. The processes' environment is ``worker_env``'s, from ``env`` (default
    this process's) and ``cuda`` (default ``run_uses_cuda``). With ``nnodes`` > 1 this starts node ``node_rank``'s share:
    its record (``nodes/node<k>.json``) gets the attempt, pids and end, node 0 also reopens the
    run's status, and the supervisor's output goes to that node's log. Raises RunBusy when the
    run's (or, for several nodes, this node's) processes are alive, ValueError for bad counts."""
    run = runs.load_run(run) if not isinstance(run, runs.Run) else run
    node = int(node_rank) if nnodes > 1 else None
    st = runs.read_status(run.path, node)
    if run_alive(st):
        where = f"node {node} of run {run.id}" if node is not None else f"run {run.id}"
        raise RunBusy(f"{where} is already running (pids {[p for p, _ in runs.status_pids(st)]}); "
                      f"stop it first (workbench runs stop {run.id})")
    cmd = supervisor_command(run.path, nproc=nproc, module=module, module_args=module_args, nnodes=nnodes,
                             node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                             parent_pid=os.getpid() if stop_with_parent else None, rdzv_timeout=rdzv_timeout)
    child_env, env_note = worker_env(os.environ if env is None else env,
                                     cuda=run_uses_cuda(run) if cuda is None else cuda)
    attempt = st.attempt + 1
    # stale reports of an earlier attempt must not be read as this one's (a node clears its own ranks')
    mine = range(node * nproc, (node + 1) * nproc) if node is not None else None
    for stale in (run.path / runs.FAILURES_DIR).glob("rank*.json") if (run.path / runs.FAILURES_DIR).is_dir() else ():
        if mine is None or stale.stem[4:].isdigit() and int(stale.stem[4:]) in mine:
            stale.unlink(missing_ok=True)
    fresh = dict(state="starting", started=runs.now(), finished=None, error=None, failing_rank=None, signal=None,
                 exit_code=None, exit_codes=None, log_tail=[], note=None, warnings=None, pids=None)
    if node is None or node == 0:
        run_attempt = attempt if node is None else runs.read_status(run.path).attempt + 1
        runs.update_status(run.path, reopen=True, attempt=run_attempt, **fresh,
                           message="starting torchrun" + (f" (node 0 of {nnodes})" if node is not None else ""))
    if node is not None:
        runs.update_status(run.path, node=node, reopen=True, attempt=attempt, host=socket.gethostname(), **fresh,
                           message=f"starting torchrun (node {node} of {nnodes})")
    log_file = runs.log_path(run.path, node)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        log.write(f"--- {runs.now()} attempt {attempt}: {' '.join(cmd)}\n".encode())
        if env_note is not None and not _logged(log_file, env_note):  # once in the run's log, not per attempt
            log.write(f"{env_note}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=child_env, start_new_session=True, close_fds=True)
        except OSError as e:
            runs.update_status(run.path, node=node, state="failed", error=f"the supervisor did not start: {e}",
                               finished=runs.now())
            raise
    runs.update_status(run.path, node=node, pids={"supervisor": proc.pid, **runs.process_record(proc.pid)})
    handle = RunHandle(run=run, pid=proc.pid, process=proc, start_time=runs.proc_start_time(proc.pid), node=node)
    handle._seen = {(r.step, r.attempt) for r in run.steps()}  # earlier attempts' steps are not new
    return handle


def attach(run: runs.Run | str | Path) -> RunHandle | None:
    """A handle on a run whose supervisor is still alive on this host (after a kernel restart, from
    another shell; for a run over several nodes, the first node running here), or None when nothing
    of it runs here any more."""
    run = runs.load_run(run) if not isinstance(run, runs.Run) else run
    for node, st in records_here(run.path):
        pid = (st.pids or {}).get("supervisor")
        if not isinstance(pid, int):
            continue
        t = (st.pids.get("start_times") or {}).get(str(pid))
        if runs.pid_alive(pid, t if isinstance(t, int) else None):
            return RunHandle(run=run, pid=pid, process=None, start_time=t if isinstance(t, int) else None, node=node)
    return None


def describe_exit(code: int | None) -> str:
    """'exit code 1', 'killed by SIGKILL', or 'exit code unknown' for a process's return code."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def poll(handle: RunHandle) -> runs.RunStatus | None:
    """None while the run's supervisor lives; afterwards its final RunStatus. Never blocks. A
    supervisor that died without writing its end (killed with SIGKILL) is recorded as failed, and
    whatever it left behind is ended."""
    if handle.process is not None:
        if handle.process.poll() is None:
            return None
    elif runs.pid_alive(handle.pid, handle.start_time):
        return None
    node = handle.node
    st = runs.read_status(handle.run_dir, node)
    if not st.final:
        left = sweep(handle.run_dir, node=node)
        rc = handle.process.returncode if handle.process is not None else None
        if node is None:
            err = st.error or f"the run's supervisor ended without a final status (exit {rc})"
        else:
            err = st.error or (f"node {node} ({st.host or socket.gethostname()}): its supervisor (torchrun's agent, "
                               f"pid {handle.pid}) ended without a final status ({describe_exit(rc)})")
        st = runs.update_status(handle.run_dir, node=node, state="failed", finished=runs.now(), exit_code=rc, error=err,
                                note=f"ended {len(left)} leftover process(es)" if left else st.note)
        if node is not None and not runs.read_status(handle.run_dir).final:
            # the run ends with its node (node 0's supervisor, if it lives, writes its own end later)
            runs.update_status(handle.run_dir, state="failed", finished=runs.now(), error=err)
    return st


def wait(handle: RunHandle, timeout: float | None = None, *, interval: float = 0.5,
         on_step: Callable[[runs.StepRecord], None] | None = None) -> runs.RunStatus:
    """Block until the run ends and return its final status; ``on_step`` gets each new step record.
    Raises TimeoutError after ``timeout`` seconds (the run goes on)."""
    t_end = None if timeout is None else time.monotonic() + timeout
    while True:
        st = poll(handle)
        if on_step is not None:
            for rec in new_steps(handle):
                on_step(rec)
        if st is not None:
            return st
        if t_end is not None and time.monotonic() > t_end:
            raise TimeoutError(f"run {handle.run.id} still running after {timeout:.0f}s")
        time.sleep(interval)


def new_steps(handle: RunHandle) -> list[runs.StepRecord]:
    """Step records not handed out by an earlier call. A step run again by a later attempt (after
    a resume) is new again, with ``repeat`` set."""
    out = [r for r in handle.run.steps() if (r.step, r.attempt) not in handle._seen]
    handle._seen.update((r.step, r.attempt) for r in out)
    return out


def sweep(run_dir: str | Path, grace: float = SWEEP_GRACE_S, *, node: int | None = None) -> list[int]:
    """End every process the run (or node ``node``'s record) recorded, except this one: SIGTERM to
    each recorded process's group (ranks lead their own; their plan-ahead worker and resource
    tracker are in it) and to the process itself, SIGKILL after ``grace`` seconds. Returns the pids
    that were still alive."""
    st = runs.read_status(run_dir, node)
    if node is not None and st.host not in ("", socket.gethostname()):
        return []  # another host's processes: only that host can end them
    me = os.getpid()
    targets = [(p, t) for p, t in runs.status_pids(st) if p != me and runs.pid_alive(p, t)]
    if not targets:
        return []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, t in targets:
            if not runs.pid_alive(pid, t):
                continue
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline and any(runs.pid_alive(p, t) for p, t in targets):
            time.sleep(0.05)
        if not any(runs.pid_alive(p, t) for p, t in targets):
            break
    return [p for p, _ in targets]


def _stop_one(run: runs.Run, node: int | None, handle: RunHandle | None, grace: float) -> None:
    """SIGTERM one supervisor (the run's, or node ``node``'s), SIGKILL what outlives ``grace``."""
    st = runs.read_status(run.path, node)
    sup = (st.pids or {}).get("supervisor")
    if isinstance(sup, int) and runs.pid_alive(sup):
        # the supervisor has torchrun stop the ranks and sweeps what is left; give it ``grace``
        try:
            os.kill(sup, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if handle is not None and handle.process is not None:
                handle.process.poll()
            if not run_alive(runs.read_status(run.path, node)):
                break
            time.sleep(0.05)
        sweep(run.path, grace=0.0, node=node)  # whatever outlived it: SIGKILL
    else:
        sweep(run.path, grace=grace, node=node)  # no supervisor: SIGTERM every recorded process, SIGKILL after grace


def stop(target: RunHandle | runs.Run | str | Path, grace: float = STOP_GRACE_S, *, wait_nodes: float = 20.0) -> runs.RunStatus:
    """End a run: SIGTERM to its supervisor (which has torchrun stop the ranks and then sweeps),
    then, after ``grace`` seconds, SIGKILL to every process group the run recorded. Returns the
    final status (``stopped`` unless it had already ended). Works from any process on the run's host.

    A run over several nodes: a handle stops its own node. A run (id or folder) is stopped on every
    node: the supervisors on this host directly, the others through ``stop.json`` in the run store
    (they watch it), waiting up to ``wait_nodes`` seconds for their records to end."""
    handle = target if isinstance(target, RunHandle) else None
    run = handle.run if handle else (runs.load_run(target) if not isinstance(target, runs.Run) else target)
    st = runs.read_status(run.path)
    was_final = st.final
    nodes = run.nodes()
    if handle is not None:
        _stop_one(run, handle.node, handle, grace)
        if handle.node is not None:
            nst = runs.read_status(run.path, handle.node)
            if not nst.final:
                runs.update_status(run.path, node=handle.node, state="stopped", finished=runs.now(), note="stopped")
    elif not nodes:
        _stop_one(run, None, None, grace)
    else:
        # every node at once: a node stopped before the others would see them as failed peers
        runs.request_stop(run.path, reason=f"workbench runs stop from {socket.gethostname()}")
        here = [k for k, _ in records_here(run.path) if k is not None]
        for k in here:
            sup = (runs.read_status(run.path, k).pids or {}).get("supervisor")
            if isinstance(sup, int) and runs.pid_alive(sup):
                try:
                    os.kill(sup, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(run_alive(runs.read_status(run.path, k)) for k in here):
            time.sleep(0.05)
        for k in here:
            sweep(run.path, grace=0.0, node=k)  # whatever outlived the grace: SIGKILL
            if not runs.read_status(run.path, k).final:
                runs.update_status(run.path, node=k, state="stopped", finished=runs.now(), note="stopped")
        deadline = time.monotonic() + wait_nodes
        while nodes and time.monotonic() < deadline:
            if all(r.final for r in run.nodes().values()):
                break
            time.sleep(0.2)
    if handle is not None and handle.process is not None:
        try:
            handle.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    if handle is not None and handle.node is not None:
        return runs.read_status(run.path, handle.node)
    st = runs.read_status(run.path)
    if not was_final and st.state not in ("done", "stopped"):
        st = runs.update_status(run.path, reopen=True, state="stopped", finished=st.finished or runs.now(),
                                note=st.note or "stopped")
    return st
