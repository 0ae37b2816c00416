"""Start, watch and stop training runs under torchrun; the ``workbench train`` command.

A run is a folder ``runs/<id>/``: :func:`prepare_run` writes its ``spec.json``; :func:`start`
launches ``python -m torch.distributed.run ... -m workbench.runtime.train --run-dir DIR`` as an
argument list in its own session (stdout and stderr to ``log.txt``) and returns at once, so a
notebook can poll it (:func:`poll`, :func:`read_status`, :func:`read_metrics`,
:func:`progress`); :func:`wait` blocks; :func:`stop` ends the whole run (SIGTERM to torchrun's
process group and to every rank, SIGKILL after a grace period) and marks it ``stopped``.

Importing this module imports no torch (the CLI builds its parser from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from workbench.launch.spec import ATTENTION, DEVICES, OPTIMIZERS, SPEC_FILE, TrainSpec, read_spec
from workbench.util import write_json_atomic

__all__ = [
    "RunHandle", "prepare_run", "torchrun_command", "start", "poll", "wait", "stop", "read_status",
    "read_metrics", "read_plans", "losses", "progress", "is_alive", "add_train_arguments", "train_main",
    "RESUMABLE_FIELDS",
]

RESUMABLE_FIELDS = frozenset({"steps", "nproc", "nnodes", "checkpoint_every", "time_limit", "plan_ahead",
                              "timeout_s", "debug"})
"""Spec fields a restarted run may change; the others must match the run's spec.json."""

FINAL_STATES = ("done", "failed", "stopped")
TRAINER_MODULE = "workbench.runtime.train"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------------
# preparing a run
# ------------------------------------------------------------------------------------------------


def _check_names(spec: TrainSpec) -> None:
    """Fail fast, before any process starts, on names that cannot work (no torch needed)."""
    from workbench.solve import get_planner
    from workbench.specs import get_model, load_profile

    model = get_model(spec.model)
    get_planner(spec.planner)
    if spec.profile is not None:
        load_profile(spec.profile)
    if spec.max_len is not None and spec.max_len > model.max_context:
        raise ValueError(f"--max-len {spec.max_len:,} exceeds model {model.name}'s max context "
                         f"{model.max_context:,}")


def prepare_run(*, run_dir: str | Path | None = None, run_root: str | Path = "runs", **fields: Any) -> Path:
    """Write a run's ``spec.json`` and return its folder.

    ``fields`` are :class:`~workbench.launch.spec.TrainSpec` fields (``steps`` is required for a
    new run; leave a field out to get its default). Without ``run_dir`` a fresh folder
    ``run_root/<YYYYmmdd-HHMMSS>-train-<hex>`` is made. With a ``run_dir`` that already holds a
    spec.json the run is resumed: ``fields`` may change only :data:`RESUMABLE_FIELDS` (typically
    ``steps``); the trainer continues from the latest checkpoint.

    Raises ValueError (SpecError) for an invalid field, an unknown model/planner/profile, or a
    resumed run whose fields differ from its spec.json.
    """
    fields = {k: v for k, v in fields.items() if v is not None}
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(TrainSpec)})
    if unknown:
        raise ValueError(f"unknown run setting(s) {unknown}")
    if run_dir is not None and (Path(run_dir) / SPEC_FILE).exists():
        run_dir = Path(run_dir)
        old = read_spec(run_dir)
        changed = {k: (getattr(old, k), v) for k, v in fields.items() if k != "run_id" and getattr(old, k) != v}
        fixed = {k: d for k, d in changed.items() if k not in RESUMABLE_FIELDS}
        if fixed:
            what = ", ".join(f"{k}: {a!r} in spec.json, {b!r} given" for k, (a, b) in sorted(fixed.items()))
            raise ValueError(f"{run_dir} already holds a different run ({what}); a restarted run may change only "
                             f"{', '.join(sorted(RESUMABLE_FIELDS))}; use a new --run-dir")
        spec = old.replace(**{k: v for k, v in fields.items() if k in RESUMABLE_FIELDS})
        _check_names(spec)
    else:
        if "steps" not in fields:
            raise ValueError("steps is required for a new run (--steps K)")
        spec = TrainSpec(**fields)
        _check_names(spec)  # before a folder is made for a run that cannot work
        if run_dir is None:
            from workbench.demo import new_run_dir

            run_dir = new_run_dir(run_root, "train")
        else:
            run_dir = Path(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
        spec = spec.replace(run_id=run_dir.name)
    write_json_atomic(run_dir / SPEC_FILE, spec.to_dict())
    return run_dir


# ------------------------------------------------------------------------------------------------
# starting and watching
# ------------------------------------------------------------------------------------------------


def torchrun_command(run_dir: str | Path, nproc: int, *, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     python: str | None = None) -> list[str]:
    """The argument list that starts one node's share of a run. Single node without an endpoint:
    ``--standalone``; otherwise the c10d rendezvous at ``rdzv_endpoint`` (``HOST:PORT``).
    Raises ValueError for a bad count or a multi-node run without an endpoint."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {nproc!r}")
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"--nnodes must be a positive integer, got {nnodes!r}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in 0..{nnodes - 1}, got {node_rank}")
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone"]
    else:
        if rdzv_endpoint is None:
            raise ValueError("a run over several nodes needs --rdzv-endpoint HOST:PORT (the same on every node)")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id or Path(run_dir).name]
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", "0",
            "-m", TRAINER_MODULE, "--run-dir", str(Path(run_dir).resolve())]
    return cmd


@dataclass
class RunHandle:
    """A started run: its folder, the torchrun process (own session: its pid is its group id)."""

    run_dir: Path
    process: subprocess.Popen
    command: list[str]
    log: IO | None = None
    returncode: int | None = None
    _metrics_offset: int = field(default=0, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid


def start(run_dir: str | Path, nproc: int = 1, *, nnodes: int = 1, node_rank: int = 0,
          rdzv_endpoint: str | None = None, rdzv_id: str | None = None, env: dict | None = None) -> RunHandle:
    """Launch torchrun for a prepared run and return at once.

    stdout and stderr go to ``run_dir/log.txt`` (appended); ``status.json`` says ``starting`` and
    ``launch.json`` records the command and pid (so :func:`stop` works from another process).
    Raises ValueError when ``run_dir`` has no spec.json, is already running, or the counts are bad.
    """
    run_dir = Path(run_dir)
    read_spec(run_dir)  # a SpecError (ValueError) here beats a run that fails at once
    if is_alive(run_dir):
        raise ValueError(f"run {run_dir} is already running; stop it first (workbench.launch.torchrun.stop)")
    cmd = torchrun_command(run_dir, nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                           rdzv_id=rdzv_id)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env["PYTHONUNBUFFERED"] = "1"
    prev = read_status(run_dir)
    attempt = int(prev.get("attempt", 0)) + 1 if prev else 1
    for stale in (run_dir / "failures").glob("rank*.json") if (run_dir / "failures").is_dir() else ():
        stale.unlink()  # failures of an earlier attempt must not be read as this one's
    write_json_atomic(run_dir / "status.json", {"state": "starting", "attempt": attempt, "run_id": run_dir.name,
                                                "nproc": nproc, "nnodes": nnodes, "node_rank": node_rank,
                                                "step": prev.get("step", 0) if prev else 0,
                                                "started": _now(), "updated": _now()})
    log = open(run_dir / "log.txt", "ab")
    log.write(f"--- {_now()} attempt {attempt}: {' '.join(cmd)}\n".encode())
    log.flush()
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env, start_new_session=True)
    except OSError as e:
        log.close()
        write_json_atomic(run_dir / "status.json", {"state": "failed", "attempt": attempt,
                                                    "error": f"torchrun did not start: {e}", "updated": _now()})
        raise
    write_json_atomic(run_dir / "launch.json", {"pid": proc.pid, "pgid": proc.pid, "host": socket.gethostname(),
                                                "command": cmd, "attempt": attempt, "started": _now()})
    return RunHandle(run_dir=run_dir, process=proc, command=cmd, log=log)


def read_status(run_dir: str | Path, *, live: bool = False) -> dict:
    """The run's status.json (``{}`` when there is none yet).

    With ``live=True`` a run that says ``starting``/``running`` but whose processes (on this host)
    are all gone is reported ``failed`` (with the error a rank left, if any): a detached run whose
    ranks were killed cannot write its own end. The file itself is not changed."""
    run_dir = Path(run_dir)
    try:
        st = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    if live and st.get("state") in ("starting", "running") and is_alive(run_dir) is False:
        st = dict(st, state="failed", error=st.get("error") or _failure_message(run_dir, None),
                  note="the run's processes are gone but it did not report an end")
    return st


def _run_pids(run_dir: Path) -> tuple[list[int], bool]:
    """(pids of the run's torchrun and ranks on this host that are still ours, whether every
    recorded process is on this host)."""
    here = socket.gethostname()
    pids, local = [], True
    records = []
    try:
        records.append(json.loads((run_dir / "launch.json").read_text()))
    except (OSError, ValueError):
        pass
    ranks_dir = run_dir / "ranks"
    for p in sorted(ranks_dir.glob("rank*.json")) if ranks_dir.is_dir() else ():
        try:
            records.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    for info in records:
        pid = int(info.get("pid", 0) or 0)
        if info.get("host") != here:
            local = False
        elif pid > 0 and _is_trainer_or_torchrun(pid):
            pids.append(pid)
    return pids, local


def is_alive(run_dir: str | Path) -> bool | None:
    """Whether any process of the run is alive on this host; None when some of its processes are
    on another host (nothing can be said from here)."""
    pids, local = _run_pids(Path(run_dir))
    if any(_alive(p) for p in pids):
        return True
    return False if local else None


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines(keepends=True):
        if line.endswith("\n") and line.strip():  # a line still being written is skipped
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def read_metrics(run_dir: str | Path, rank: int | None = None) -> list[dict]:
    """Rows of metrics.jsonl (one per step and rank), optionally of one rank. A step run twice
    (a resumed run repeats the steps after its checkpoint) appears twice; the later row counts."""
    rows = _read_jsonl(Path(run_dir) / "metrics.jsonl")
    return [r for r in rows if rank is None or r.get("rank") == rank]


def read_plans(run_dir: str | Path) -> list[dict]:
    """Rows of plans.jsonl: ``{step, batch_id, plan_wait_s, plan}``."""
    return _read_jsonl(Path(run_dir) / "plans.jsonl")


def losses(run_dir: str | Path) -> dict[int, float]:
    """Loss per step (rank 0's rows; a repeated step keeps its latest value)."""
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(run_dir, rank=0)}


def _finalize(run_dir: Path, rc: int) -> dict:
    """Merge torchrun's exit status into status.json; a run that ended without saying how is failed."""
    st = read_status(run_dir)
    st["exit_code"] = rc
    if st.get("state") not in FINAL_STATES or (rc != 0 and st.get("state") == "done"):
        if rc == 0:
            st["state"] = "done"
        else:
            st["state"] = "failed"
            st["error"] = st.get("error") or _failure_message(run_dir, rc)
    st.setdefault("finished", _now())
    st["updated"] = _now()
    write_json_atomic(run_dir / "status.json", st)
    return st


def _failure_message(run_dir: Path, rc: int | None) -> str:
    folder = run_dir / "failures"
    if folder.is_dir():
        found = []
        for p in folder.glob("rank*.json"):
            try:
                found.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                pass
        if found:
            f = min(found, key=lambda x: x.get("rank", 0))
            return f"rank {f.get('rank')}: {f.get('error')}"
    how = f"torchrun exited with status {rc}" if rc is not None else "the run's processes ended"
    return f"{how} before the trainer reported an error; see {run_dir / 'log.txt'}"


def poll(handle: RunHandle) -> int | None:
    """The run's exit status, or None while it runs (never blocks). On the first call after the
    end, status.json gets the exit code (and ``failed`` if the trainer could not say so)."""
    if handle.returncode is not None:
        return handle.returncode
    rc = handle.process.poll()
    if rc is None:
        return None
    handle.returncode = rc
    if handle.log is not None:
        handle.log.close()
    _finalize(handle.run_dir, rc)
    return rc


def progress(handle: RunHandle) -> list[str]:
    """New one-line progress messages since the last call (one per step rank 0 finished)."""
    path = handle.run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(handle._metrics_offset)
            data = f.read()
    except OSError:
        return []
    end = data.rfind(b"\n") + 1  # consume whole lines only
    handle._metrics_offset += end
    total = read_status(handle.run_dir).get("steps")
    out = []
    for line in data[:end].splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("rank") != 0:
            continue
        out.append(f"step {r['step'] + 1}{'/' + str(total) if total else ''}: loss {r['loss']:.4f}, "
                   f"{r['batch_tokens']:,} tokens in {r['sequences']} sequences, measured {r['measured_ms']:,.0f} ms, "
                   f"predicted {r['predicted_ms']:,.0f} ms, {len(r.get('micro_steps', []))} micro-step(s)")
    return out


def wait(handle: RunHandle, timeout: float | None = None, *, on_progress: Callable[[str], None] | None = None,
         interval: float = 0.5) -> int:
    """Block until the run ends and return its exit status; ``on_progress`` gets each progress line.
    Raises TimeoutError after ``timeout`` seconds (the run keeps going; :func:`stop` it)."""
    t_end = None if timeout is None else time.monotonic() + timeout
    while True:
        rc = poll(handle)
        if on_progress is not None:
            for line in progress(handle):
                on_progress(line)
        if rc is not None:
            return rc
        if t_end is not None and time.monotonic() > t_end:
            raise TimeoutError(f"run {handle.run_dir} still running after {timeout:.0f}s")
        time.sleep(interval)


def _is_trainer_or_torchrun(pid: int) -> bool:
    """Whether ``pid`` is still one of ours (guards against a recycled pid)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"torch.distributed.run" in cmd or TRAINER_MODULE.encode() in cmd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(target: RunHandle | str | Path, grace: float = 10.0) -> dict:
    """End a run: SIGTERM to torchrun's process group and to every rank (torchrun puts each in a
    session of its own), SIGKILL to what is left after ``grace`` seconds. ``target`` is a handle
    or a run folder (processes found from launch.json and ranks/*.json, on this host). Marks
    status.json ``stopped`` unless the run had already ended, and returns the status."""
    handle = target if isinstance(target, RunHandle) else None
    run_dir = handle.run_dir if handle else Path(target)
    # torchrun and every rank lead sessions (and process groups) of their own: pid == pgid
    groups, _ = _run_pids(run_dir)
    if handle is not None and handle.pid not in groups:
        groups.append(handle.pid)
    before = read_status(run_dir)
    was_running = before.get("state") not in FINAL_STATES
    for g in groups:
        _signal_group(g, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if handle is not None:
            handle.process.poll()
        if not any(_alive(g) for g in groups):
            break
        time.sleep(0.1)
    for g in groups:
        if _alive(g):
            _signal_group(g, signal.SIGKILL)
    rc = None
    if handle is not None:
        try:
            rc = handle.process.wait(timeout=max(1.0, grace))
        except subprocess.TimeoutExpired:
            rc = None
        handle.returncode = rc
        if handle.log is not None:
            handle.log.close()
    st = read_status(run_dir)
    if was_running and st.get("state") not in ("done",):
        st.update(state="stopped", stopped=_now(), updated=_now())
        if rc is not None:
            st["exit_code"] = rc
        write_json_atomic(run_dir / "status.json", st)
    elif rc is not None and "exit_code" not in st:
        st = _finalize(run_dir, rc)
    return st


# ------------------------------------------------------------------------------------------------
# the CLI: workbench train
# ------------------------------------------------------------------------------------------------


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``workbench train`` (settings left out keep TrainSpec's defaults, or a resumed
    run's spec.json)."""
    g = p.add_argument_group("processes")
    g.add_argument("--nproc", type=int, default=1, metavar="N", help="processes (GPUs) per node (default 1)")
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    g.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank (multi-node)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous endpoint (multi-node)")
    g.add_argument("--rdzv-id", default=None, metavar="ID", help="rendezvous id (default: the run id)")
    g.add_argument("--device", default=None, choices=DEVICES, help="auto (CUDA when available), cpu, cuda")
    g = p.add_argument_group("run")
    g.add_argument("--model", default=None, help="model preset (default tiny)")
    g.add_argument("--lengths", default=None, metavar="SOURCE",
                   help="stdlib (default: the embedded corpus, one document per sequence), a family, a file, or "
                        "L1,L2,... (that batch every step)")
    g.add_argument("--samples", type=int, default=None, metavar="N", help="sequences drawn from the source")
    g.add_argument("--column", default=None, help="file column holding lengths or text")
    g.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="max context (default: 1024 on CPU, what the cluster holds on CUDA; at most the model's)")
    g.add_argument("--policy", default=None, choices=["clip", "split", "drop", "error"],
                   help="sequences over --max-len (default clip; always reported)")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--batch-tokens", type=int, default=None, metavar="T", help="global batch token budget "
                   "(default 16384)")
    b.add_argument("--batch-size", type=int, default=None, metavar="B", help="global batch in sequences")
    g.add_argument("--planner", default=None, help="planner (default greedy)")
    g.add_argument("--time-limit", type=float, default=None, metavar="S", help="planner time limit per step")
    g.add_argument("--profile", default=None, metavar="NAME|PATH",
                   help="profile for the cost model (default cpu-gloo-tiny on CPU, a100-40g-flexsp on CUDA)")
    g.add_argument("--gpu-memory", dest="gpu_memory_gb", type=float, default=None, metavar="GB",
                   help="memory per device for the cost model (default: the profile's)")
    g.add_argument("--attention", default=None, choices=ATTENTION, help="attention backend (default auto)")
    g.add_argument("--steps", type=int, default=None, metavar="K", help="optimizer steps (required for a new run)")
    g.add_argument("--seed", type=int, default=None, help="seeds weights, batches and plans (default 0)")
    g.add_argument("--optimizer", default=None, choices=OPTIMIZERS, help="default adamw")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default sgd 0.05, adamw 1e-3)")
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--momentum", type=float, default=None, help="SGD momentum (default 0)")
    g.add_argument("--grad-clip", type=float, default=None, metavar="NORM", help="clip the gradient norm (0: off)")
    g.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="checkpoint every K steps and after the last (default 100; 0: never)")
    g.add_argument("--no-plan-ahead", dest="plan_ahead", action="store_const", const=False, default=None,
                   help="plan each step inline instead of one step ahead")
    g.add_argument("--timeout", dest="timeout_s", type=float, default=None, metavar="S",
                   help="collective timeout: a rank waiting longer fails (default 600)")
    g = p.add_argument_group("where")
    g.add_argument("--run-dir", default=None, metavar="DIR",
                   help="the run folder (an existing run is resumed from its latest checkpoint)")
    g.add_argument("--run-root", default="runs", metavar="DIR", help="where new run folders go (default runs)")
    g.add_argument("--detach", action="store_true", help="print the run folder and return; the run goes on")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    # test hook: rank 0 plans for this many ranks (to exercise the plan/world check)
    p.add_argument("--debug-plan-gpus", type=int, default=None, help=argparse.SUPPRESS)


_SPEC_ARGS = ("model", "lengths", "samples", "column", "max_len", "policy", "batch_tokens", "batch_size", "planner",
              "time_limit", "profile", "gpu_memory_gb", "attention", "steps", "seed", "optimizer", "lr",
              "weight_decay", "momentum", "grad_clip", "checkpoint_every", "plan_ahead", "timeout_s", "device")


def train_main(args: argparse.Namespace) -> int:
    """``workbench train``: prepare (or resume) a run, start torchrun, print the run folder and a
    progress line per step, and return the run's exit status. Bad settings raise ValueError (the
    CLI turns it into exit status 2 and one line on stderr)."""
    fields = {k: getattr(args, k) for k in _SPEC_ARGS if getattr(args, k, None) is not None}
    fields["nproc"], fields["nnodes"] = args.nproc, args.nnodes
    if args.debug_plan_gpus is not None:
        fields["debug"] = {"plan_num_gpus": args.debug_plan_gpus}
    torchrun_command(".", args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                     rdzv_endpoint=args.rdzv_endpoint)  # bad counts fail before a folder is made
    run_dir = prepare_run(run_dir=args.run_dir, run_root=args.run_root, **fields)
    print(run_dir, flush=True)
    handle = start(run_dir, args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                   rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    if args.detach:
        return 0

    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    try:
        rc = wait(handle, on_progress=say)
    except KeyboardInterrupt:
        stop(handle)
        print(f"workbench train: interrupted; run {run_dir} stopped", file=sys.stderr, flush=True)
        return 130
    st = read_status(run_dir)
    if rc != 0 or st.get("state") != "done":
        err = str(st.get("error") or f"the run ended {st.get('state', 'without a status')}").splitlines()[0]
        print(f"workbench train: error: {err} (run {run_dir}; log {run_dir / 'log.txt'})", file=sys.stderr,
              flush=True)
        return rc or 1
    say(f"workbench train: done, {st.get('step')} steps; {run_dir}")
    return 0

