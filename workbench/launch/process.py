"""Process control for runs: start a supervised torchrun tree, poll it, stop it, find it again.

:func:`start` launches ``python -m workbench.launch.supervisor`` (which is torchrun, see
``workbench.launch.supervisor``) as an argument list in a session of its own, output appended to
the run's ``log.txt``, and returns at once: a notebook kernel never forks and never imports torch
to launch. Everything a caller needs later is in the run store (``status.json``: the supervisor's,
every rank's and every helper's pid), so a restarted kernel or another shell can :func:`attach`
to a run and :func:`stop` it. Nothing here imports torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from workbench import runs

__all__ = ["RunHandle", "start", "attach", "poll", "wait", "stop", "run_alive", "supervisor_command", "new_steps",
           "SUPERVISOR_MODULE", "TRAINER_MODULE", "RunBusy", "sweep"]

SUPERVISOR_MODULE = "workbench.launch.supervisor"
TRAINER_MODULE = "workbench.runtime.train"
SWEEP_GRACE_S = 2.0


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

    @property
    def run_dir(self) -> Path:
        return self.run.path


def supervisor_command(run_dir: str | Path, *, nproc: int, module: str = TRAINER_MODULE,
                       module_args: Sequence[str] = (), nnodes: int = 1, node_rank: int = 0,
                       rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                       parent_pid: int | None = None, python: str | None = None) -> list[str]:
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
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    return cmd + ["--", *module_args]


def run_alive(target: runs.Run | runs.RunStatus | str | Path) -> bool:
    """Whether any process the run recorded is alive on this host."""
    st = target if isinstance(target, runs.RunStatus) else runs.read_status(
        target.path if isinstance(target, runs.Run) else target)
    return any(runs.pid_alive(p, t) for p, t in runs.status_pids(st))


def start(run: runs.Run | str | Path, *, nproc: int, module: str = TRAINER_MODULE, module_args: Sequence[str] = (),
          nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
          stop_with_parent: bool = False, env: dict | None = None) -> RunHandle:
    """Start a new attempt of ``run`` and return at once.

    ``module`` (run by torchrun on every rank with ``--run-dir RUN`` and ``module_args``) must be
    importable: the trainer by default, the profiler for profile runs. ``stop_with_parent``: the
    run stops when this process dies (a terminal's ``workbench train``; not for notebooks, whose
    runs should outlive a kernel restart). The status becomes ``starting`` with the next attempt
    number and the supervisor's pid. Raises RunBusy when the run's processes are alive, ValueError
    for bad counts."""
    run = runs.load_run(run) if not isinstance(run, runs.Run) else run
    st = runs.read_status(run.path)
    if run_alive(st):
        raise RunBusy(f"run {run.id} is already running (pids {[p for p, _ in runs.status_pids(st)]}); "
                      f"stop it first (workbench runs stop {run.id})")
    cmd = supervisor_command(run.path, nproc=nproc, module=module, module_args=module_args, nnodes=nnodes,
                             node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                             parent_pid=os.getpid() if stop_with_parent else None)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env["PYTHONUNBUFFERED"] = "1"
    attempt = st.attempt + 1
    # stale reports of an earlier attempt must not be read as this one's
    for stale in (run.path / runs.FAILURES_DIR).glob("rank*.json") if (run.path / runs.FAILURES_DIR).is_dir() else ():
        stale.unlink(missing_ok=True)
    runs.update_status(run.path, reopen=True, state="starting", attempt=attempt, started=runs.now(), finished=None,
                       error=None, failing_rank=None, signal=None, exit_code=None, exit_codes=None, log_tail=[],
                       note=None, warnings=None, pids=None, message="starting torchrun")
    with open(run.file(runs.LOG_FILE), "ab") as log:
        log.write(f"--- {runs.now()} attempt {attempt}: {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=child_env, start_new_session=True, close_fds=True)
        except OSError as e:
            runs.update_status(run.path, state="failed", error=f"the supervisor did not start: {e}", finished=runs.now())
            raise
    runs.update_status(run.path, pids={"supervisor": proc.pid, **runs.process_record(proc.pid)})
    handle = RunHandle(run=run, pid=proc.pid, process=proc, start_time=runs.proc_start_time(proc.pid))
    handle._seen = {(r.step, r.attempt) for r in run.steps()}  # earlier attempts' steps are not new
    return handle


def attach(run: runs.Run | str | Path) -> RunHandle | None:
    """A handle on a run whose supervisor is still alive (after a kernel restart, from another
    shell), or None when nothing of it runs any more."""
    run = runs.load_run(run) if not isinstance(run, runs.Run) else run
    st = runs.read_status(run.path)
    pid = (st.pids or {}).get("supervisor")
    if not isinstance(pid, int):
        return None
    t = (st.pids.get("start_times") or {}).get(str(pid))
    if not runs.pid_alive(pid, t if isinstance(t, int) else None):
        return None
    return RunHandle(run=run, pid=pid, process=None, start_time=t if isinstance(t, int) else None)


def poll(handle: RunHandle) -> runs.RunStatus | None:
    """None while the run's supervisor lives; afterwards its final RunStatus. Never blocks. A
    supervisor that died without writing its end (killed with SIGKILL) is recorded as failed, and
    whatever it left behind is ended."""
    if handle.process is not None:
        if handle.process.poll() is None:
            return None
    elif runs.pid_alive(handle.pid, handle.start_time):
        return None
    st = runs.read_status(handle.run_dir)
    if not st.final:
        left = sweep(handle.run_dir)
        rc = handle.process.returncode if handle.process is not None else None
        st = runs.update_status(handle.run_dir, state="failed", finished=runs.now(), exit_code=rc,
                                error=st.error or f"the run's supervisor ended without a final status (exit {rc})",
                                note=f"ended {len(left)} leftover process(es)" if left else st.note)
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


def sweep(run_dir: str | Path, grace: float = SWEEP_GRACE_S) -> list[int]:
    """End every process the run recorded, except this one: SIGTERM to each recorded process's
    group (ranks lead their own; their plan-ahead worker and resource tracker are in it) and to the
    process itself, SIGKILL after ``grace`` seconds. Returns the pids that were still alive."""
    st = runs.read_status(run_dir)
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


def stop(target: RunHandle | runs.Run | str | Path, grace: float = 4.0) -> runs.RunStatus:
    """End a run: SIGTERM to its supervisor (which has torchrun stop the ranks and then sweeps),
    then, after ``grace`` seconds, SIGKILL to every process group the run recorded. Returns the
    final status (``stopped`` unless it had already ended). Works from any process on the run's host."""
    handle = target if isinstance(target, RunHandle) else None
    run = handle.run if handle else (runs.load_run(target) if not isinstance(target, runs.Run) else target)
    st = runs.read_status(run.path)
    sup = (st.pids or {}).get("supervisor")
    was_final = st.final
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
            if not run_alive(runs.read_status(run.path)):
                break
            time.sleep(0.05)
        sweep(run.path, grace=0.0)  # whatever outlived it: SIGKILL
    else:
        sweep(run.path, grace=grace)  # no supervisor: SIGTERM every recorded process, SIGKILL after grace
    if handle is not None and handle.process is not None:
        try:
            handle.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    st = runs.read_status(run.path)
    if not was_final and st.state not in ("done", "stopped"):
        st = runs.update_status(run.path, reopen=True, state="stopped", finished=st.finished or runs.now(),
                                note=st.note or "stopped")
    return st
