"""The run store: one folder per run, one status record, one writer, readers that never crash.

Every run (training, profile, demo, notebook) is a folder ``<root>/<run-id>/``::

    spec.json        what the run is (kind, scenario, settings): enough to repeat it
    status.json      one RunStatus: state, step, attempt, pids, exit codes, failing rank, error
    metrics.jsonl    per step and rank: loss, tokens, predicted and measured ms, peak memory
    plans.jsonl      each step's plan
    log.txt          the processes' output
    checkpoints/     step_<n>.pt with step_<n>.pt.sha256 beside it (ZeRO 0-2), or step_<n>.dcp/ (ZeRO-3:
                     torch.distributed.checkpoint shards, trainer.pt, SHA256SUMS)
    ranks/, failures/, torchrun/   per-rank pids, error reports, per-rank logs
    load.jsonl       the machine's load while the run's processes lived (the supervisor samples it)
    nodes/           a run over several nodes: node<k>.json (that node's RunStatus: host, pids, state,
                     exit codes, error), node<k>.log.txt and node<k>.metrics.jsonl (nodes other than 0)

``status.json`` is written only by :func:`update_status` (under a lock, atomically): the
supervisor, the trainer's rank 0 and the launcher all go through it, so no update is lost and no
reader sees half a file. A run over several nodes keeps one run (``status.json``: the run's state
and progress, written from node 0, where rank 0 lives) and one record per node
(``nodes/node<k>.json``: that node's host, processes and end, written only from that node), so a run
store on a shared path never has two hosts writing one file. Readers (:func:`load_run`, :class:`Run`, :func:`list_runs`,
:func:`compare`) take whatever is there: a missing or broken file becomes a note in
``Run.problems``, a bad or non-UTF-8 line in ``metrics.jsonl`` is skipped and counted.

Pure Python: no torch, no ipywidgets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from workbench.util import json_safe, write_json_atomic, write_text_atomic

__all__ = [
    "SPEC_FILE", "STATUS_FILE", "METRICS_FILE", "PLANS_FILE", "LOG_FILE", "CHECKPOINTS_DIR", "RANKS_DIR",
    "FAILURES_DIR", "TORCHRUN_LOG_DIR", "PROFILE_FILE", "REPORT_FILE", "RESULTS_DIR", "KINDS", "STATES",
    "FINAL_STATES", "RunStatus", "Run", "StepRecord", "RunNotFound", "default_root", "new_run", "load_run",
    "list_runs", "update_status", "read_status", "compare", "append_jsonl", "read_jsonl", "file_sha256",
    "checksum_path", "write_checksum", "verify_checksum", "now", "pid_alive", "status_pids", "tail_lines",
    "proc_start_time", "process_record", "LOAD_FILE", "read_loadavg", "LoadSampler", "summarize_load",
    "NODES_DIR", "STOP_FILE", "node_status_path", "metrics_path", "log_path", "request_stop", "stop_requested",
    "torch_trace_path", "TORCH_TRACE_GLOB",
]

SPEC_FILE = "spec.json"
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
PLANS_FILE = "plans.jsonl"
LOG_FILE = "log.txt"
CHECKPOINTS_DIR = "checkpoints"
RANKS_DIR = "ranks"
FAILURES_DIR = "failures"
TORCHRUN_LOG_DIR = "torchrun"
PROFILE_FILE = "profile.json"
REPORT_FILE = "report.html"
RESULTS_DIR = "results"
LOAD_FILE = "load.jsonl"
NODES_DIR = "nodes"
STOP_FILE = "stop.json"
_LOCK_FILE = ".status.lock"

KINDS = ("train", "profile", "demo", "notebook", "simulate")
STATES = ("created", "starting", "running", "done", "failed", "stopped")
FINAL_STATES = ("done", "failed", "stopped")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RunNotFound(ValueError):
    """No run folder at the path or id given (the message says where it looked)."""


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def default_root() -> Path:
    """Where runs go: ``$WORKBENCH_RUNS`` if set, else ``./runs``."""
    return Path(os.environ.get("WORKBENCH_RUNS") or "runs")


# ------------------------------------------------------------------------------------------------
# the status record
# ------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RunStatus:
    """What a run is doing or how it ended. ``to_dict`` is what ``status.json`` holds; ``from_dict``
    reads any older or newer shape (unknown keys are kept in ``extra``, missing ones default)."""

    run_id: str = ""
    kind: str = "train"
    state: str = "created"
    """created, starting, running, done, failed or stopped."""
    step: int = 0
    """Optimizer steps completed (training) or work items done (others)."""
    steps: int | None = None
    """Steps the run aims for."""
    attempt: int = 0
    """How many times the run was started (a resume is a new attempt)."""
    progress: float | None = None
    """Fraction done in [0, 1] for runs without steps (profile, notebook)."""
    message: str = ""
    """What the run is doing now, one line."""
    loss: float | None = None
    exit_code: int | None = None
    """The run's own exit status (the supervisor's): 0 done; negative: killed by that signal."""
    exit_codes: dict = field(default_factory=dict)
    """Exit status per rank (``{"0": -9, "1": -15}``); negative: killed by that signal."""
    failing_rank: int | None = None
    """The rank that failed first (torchrun's root cause)."""
    signal: str | None = None
    """The signal that ended the failing rank, e.g. ``SIGKILL``."""
    error: str | None = None
    """One line: what went wrong."""
    log_tail: list = field(default_factory=list)
    """The failing rank's last log lines."""
    pids: dict = field(default_factory=dict)
    """``{"supervisor": pid, "ranks": {"0": pid, ...}, "workers": [pid, ...]}`` on ``host``: what a
    stop must reach. Every rank and the supervisor lead their own process group."""
    host: str = ""
    created: str | None = None
    started: str | None = None
    updated: str | None = None
    finished: str | None = None
    resumed_from: int | None = None
    """The checkpoint step this attempt resumed from."""
    resolved: dict = field(default_factory=dict)
    """Settings the run decided at start (world size, device, max context and what it did, ...)."""
    note: str | None = None
    warnings: list = field(default_factory=list)
    """One line each: what went wrong without stopping the run (e.g. the plan-ahead worker died and
    planning went on inline). ``update_status(warnings=[...])`` appends; a new attempt starts empty."""
    extra: dict = field(default_factory=dict)
    """Fields of another version of the workbench, kept as they were."""

    @property
    def final(self) -> bool:
        """Whether the run has ended (done, failed or stopped)."""
        return self.state in FINAL_STATES

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return json_safe(out)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunStatus":
        """Build from ``status.json``'s object, tolerating older and newer shapes."""
        if not isinstance(data, Mapping):
            raise ValueError(f"status must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        st = cls(**kw, extra=extra)
        if st.state not in STATES:
            st.extra["state_as_written"] = st.state
            st.state = "failed" if st.state in ("error", "crashed") else "created"
        if not isinstance(st.pids, dict):
            st.pids = {}
        if not isinstance(st.exit_codes, dict):
            st.exit_codes = {}
        if not isinstance(st.warnings, list):
            st.warnings = [str(st.warnings)] if st.warnings else []
        return st


def node_status_path(run_dir: str | Path, node: int | None = None) -> Path:
    """Where a status record lives: ``status.json`` (the run; ``node`` None) or
    ``nodes/node<k>.json`` (node ``k`` of a run over several nodes)."""
    run_dir = Path(run_dir)
    return run_dir / STATUS_FILE if node is None else run_dir / NODES_DIR / f"node{int(node)}.json"


def metrics_path(run_dir: str | Path, node: int | None = None) -> Path:
    """The metrics file the ranks of ``node`` append to: ``metrics.jsonl`` on one node and on node 0,
    ``nodes/node<k>.metrics.jsonl`` on the others (appends from two hosts to one file on a shared
    filesystem can overwrite each other). ``Run.metrics`` reads them all."""
    run_dir = Path(run_dir)
    return run_dir / METRICS_FILE if not node else run_dir / NODES_DIR / f"node{int(node)}.metrics.jsonl"


TORCH_TRACE_GLOB = "torch-trace-step*-rank*.json"


def torch_trace_path(run_dir: str | Path, step: int, rank: int) -> Path:
    """Where ``workbench train --torch-profile`` writes rank ``rank``'s torch.profiler Chrome trace of
    step ``step`` (1-based): ``torch-trace-step<step>-rank<rank>.json`` in the run folder."""
    return Path(run_dir) / f"torch-trace-step{int(step)}-rank{int(rank)}.json"


def log_path(run_dir: str | Path, node: int | None = None) -> Path:
    """The log a node's supervisor writes: ``log.txt`` (one node, node 0), ``nodes/node<k>.log.txt``."""
    run_dir = Path(run_dir)
    return run_dir / LOG_FILE if not node else run_dir / NODES_DIR / f"node{int(node)}.log.txt"


def request_stop(run_dir: str | Path, reason: str = "") -> Path:
    """Ask every node's supervisor of the run to stop (``stop.json``; supervisors of a run over
    several nodes watch for it: a stop from one host reaches the others through a shared run store)."""
    path = Path(run_dir) / STOP_FILE
    write_json_atomic(path, {"time": time.time(), "host": socket.gethostname(), "reason": reason})
    return path


def stop_requested(run_dir: str | Path, since: float) -> dict | None:
    """The stop request written after ``since`` (a ``time.time()``), or None."""
    try:
        d = json.loads((Path(run_dir) / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("time"), (int, float)) and d["time"] >= since else None


@contextlib.contextmanager
def _locked(run_dir: Path, node: int | None = None) -> Iterator[None]:
    """An exclusive lock over one status record (processes and threads of any writer on this host)."""
    if node is None:
        lock = run_dir / _LOCK_FILE
    else:
        (run_dir / NODES_DIR).mkdir(exist_ok=True)
        lock = run_dir / NODES_DIR / f".node{int(node)}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def read_status(run_dir: str | Path, node: int | None = None) -> RunStatus:
    """The run's RunStatus as written (``state="created"`` when there is no readable status yet;
    the reason is in ``note``), or with ``node`` that node's record. Never raises for a bad file."""
    run_dir = Path(run_dir)
    path = node_status_path(run_dir, node)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        st = RunStatus.from_dict(data)
    except FileNotFoundError:
        st = RunStatus(note="no status.json yet")
    except (OSError, ValueError, TypeError) as e:
        st = RunStatus(note=f"status.json is unreadable ({type(e).__name__}: {str(e)[:120]})")
    if not st.run_id:
        st.run_id = run_dir.name
    return st


_MERGED = ("pids", "resolved", "exit_codes")


def _merge(old: Any, new: Any) -> dict:
    if new is None:
        return {}
    if not isinstance(new, Mapping):
        raise ValueError(f"expected an object to merge, got {type(new).__name__}")
    out = dict(old) if isinstance(old, Mapping) else {}
    for k, v in new.items():
        k = str(k)
        if v is None:
            out.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            inner = {**out[k], **{str(a): b for a, b in v.items()}}
            out[k] = {a: b for a, b in inner.items() if b is not None}
        else:
            out[k] = v
    return out


def update_status(run_dir: str | Path, *, reopen: bool = False, node: int | None = None, **changes: Any) -> RunStatus:
    """The one writer of ``status.json``: under the run's lock, read the current record, apply
    ``changes`` (RunStatus fields; ``pids`` and ``resolved`` are merged key by key, ``exit_codes``
    too), stamp ``updated`` and write atomically. Returns the new record.

    ``pids``, ``resolved`` and ``exit_codes`` are merged key by key (one level deep: ranks add
    their own pid to ``pids["ranks"]``); a None value deletes a key, and None for the whole field
    empties it. ``warnings`` are appended (a line already there is not repeated); None empties them.

    A final state is not overwritten by ``running`` or ``starting`` (a late progress write from a
    dying rank must not revive a stopped run) unless ``reopen`` is True (a new attempt of the
    run). ``node``: write node ``k``'s record (``nodes/node<k>.json``) instead of the run's. Raises
    ValueError for an unknown field or state."""
    run_dir = Path(run_dir)
    names = {f.name for f in dataclasses.fields(RunStatus)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"RunStatus has no field(s) {unknown}")
    if "state" in changes and changes["state"] not in STATES:
        raise ValueError(f"unknown run state {changes['state']!r}; states are {', '.join(STATES)}")
    with _locked(run_dir, node):
        st = read_status(run_dir, node)
        if node is not None:
            st.extra["node"] = int(node)
        if st.final and not reopen and changes.get("state") in ("created", "running", "starting"):
            changes = {k: v for k, v in changes.items() if k != "state"}
        for k, v in changes.items():
            if k in _MERGED:
                setattr(st, k, _merge(getattr(st, k), v))
            elif k == "warnings" and v is not None:
                have = list(st.warnings)
                st.warnings = have + [w for w in v if w not in have]
            elif k == "warnings":
                st.warnings = []
            else:
                setattr(st, k, v)
        st.updated = now()
        if not st.host:
            st.host = socket.gethostname()
        write_json_atomic(node_status_path(run_dir, node), st.to_dict())
    return st


# ------------------------------------------------------------------------------------------------
# JSON lines
# ------------------------------------------------------------------------------------------------


def append_jsonl(path: str | Path, obj: Any) -> None:
    """Append one strict-JSON line in a single write (appenders do not interleave lines)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(json_safe(obj), allow_nan=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def read_jsonl(path: str | Path) -> tuple[list[dict], int]:
    """``(rows, skipped)``: every complete line of ``path`` that is a JSON object, and how many
    lines were skipped (not UTF-8, not JSON, not an object). A last line without its newline is
    still being written: it is left out and not counted. A missing file is ``([], 0)``."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return [], 0
    rows, skipped = [], 0
    for raw in data.split(b"\n")[:-1]:
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            skipped += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            skipped += 1
    return rows, skipped


# ------------------------------------------------------------------------------------------------
# the machine's load while a run lives
# ------------------------------------------------------------------------------------------------


def read_loadavg() -> dict | None:
    """The machine's load now: ``{"t", "load1", "load5", "load15", "running"}`` from
    ``/proc/loadavg`` (``running``: tasks runnable at this instant), or the load averages alone
    where there is no such file; None where the OS has neither."""
    try:
        parts = Path("/proc/loadavg").read_text().split()
        running = int(parts[3].split("/")[0])
        return {"t": time.time(), "load1": float(parts[0]), "load5": float(parts[1]), "load15": float(parts[2]),
                "running": running}
    except (OSError, IndexError, ValueError):
        pass
    try:
        a, b, c = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return {"t": time.time(), "load1": a, "load5": b, "load15": c, "running": None}


class LoadSampler:
    """Samples the machine's load (:func:`read_loadavg`) into ``RUN/load.jsonl`` every
    ``interval`` seconds from a daemon thread, from :meth:`start` to :meth:`stop` (one sample at
    each end). What a run's report says about the load it ran under comes from here, not a guess."""

    def __init__(self, run_dir: str | Path, interval: float = 2.0) -> None:
        self.path = Path(run_dir) / LOAD_FILE
        self.interval = float(interval)
        self._stop = None
        self._thread = None

    def _sample(self) -> None:
        row = read_loadavg()
        if row is not None:
            try:
                append_jsonl(self.path, row)
            except OSError:
                pass  # a full disk must not end the run

    def start(self) -> "LoadSampler":
        import threading

        self._sample()
        self._stop = threading.Event()

        def loop(stop=self._stop) -> None:
            while not stop.wait(self.interval):
                self._sample()

        self._thread = threading.Thread(target=loop, name="load-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=2.0)
            self._stop = None
            self._sample()


def summarize_load(rows: list[dict], *, processes: int | None = None, cores: int | None = None) -> dict | None:
    """The load a run ran under, from its ``load.jsonl`` rows: ``{"samples", "start", "end", "mean",
    "max" (1-minute load average), "running_mean" (runnable tasks, sampled), "cores", "text"}``;
    None without samples. ``processes``: the run's own (they count in the load)."""
    pts = [r for r in rows if isinstance(r.get("load1"), (int, float))]
    if not pts:
        return None
    load = [float(r["load1"]) for r in pts]
    run_q = [float(r["running"]) for r in pts if isinstance(r.get("running"), (int, float))]
    cores = cores or os.cpu_count()
    own = f"; the run's own {processes} process(es) count in it" if processes else ""
    text = (f"{statistics.fmean(load):.1f} on {cores} cores (1-minute load average over {len(pts)} sample(s): "
            f"{load[0]:.1f} at the start, {max(load):.1f} at most, {load[-1]:.1f} at the end{own})")
    return {"samples": len(pts), "start": load[0], "end": load[-1], "mean": statistics.fmean(load), "max": max(load),
            "running_mean": statistics.fmean(run_q) if run_q else None, "cores": cores, "text": text}


# ------------------------------------------------------------------------------------------------
# checksums (checkpoints)
# ------------------------------------------------------------------------------------------------


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checksum_path(path: str | Path) -> Path:
    """Where the checksum of ``path`` lives: ``<path>.sha256`` beside it."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def write_checksum(path: str | Path) -> str:
    """Write ``<path>.sha256`` (``"<hex>  <name>"``, as sha256sum does) atomically; returns the hex."""
    digest = file_sha256(path)
    write_text_atomic(checksum_path(path), f"{digest}  {Path(path).name}\n")
    return digest


def verify_checksum(path: str | Path) -> str | None:
    """None when ``path`` matches its ``.sha256``; otherwise why not, in words (missing file,
    missing checksum, empty file, mismatch)."""
    path = Path(path)
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size == 0:
        return f"{path} is empty"
    cs = checksum_path(path)
    try:
        want = cs.read_text(encoding="utf-8").split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        return f"{path} has no readable checksum file {cs.name}"
    got = file_sha256(path)
    if got != want:
        return f"{path} does not match its checksum (sha256 {got[:12]}... expected {want[:12]}...): the file is damaged"
    return None


# ------------------------------------------------------------------------------------------------
# runs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One training step as the run measured it (rank 0's row; a step run again after a resume
    keeps its latest attempt)."""

    step: int
    """1-based: the number of optimizer steps completed with this one."""
    loss: float | None
    tokens: int
    sequences: int
    measured_ms: float | None
    predicted_ms: float | None
    tokens_per_s: float | None
    peak_memory_mb: float | None
    attempt: int
    planner: str | None
    time: float | None
    repeat: bool = False
    """Run again after a resume (an earlier attempt had gone past the checkpoint)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _step_record(r: Mapping[str, Any]) -> StepRecord:
    def num(k):
        v = r.get(k)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    meas = num("measured_ms")
    tokens = int(r.get("batch_tokens") or r.get("tokens") or 0)
    return StepRecord(step=int(r["step"]) + 1, loss=num("loss"), tokens=tokens, sequences=int(r.get("sequences") or 0),
                      measured_ms=meas, predicted_ms=num("predicted_ms"),
                      tokens_per_s=tokens / meas * 1e3 if meas else None, peak_memory_mb=num("peak_memory_mb"),
                      attempt=int(r.get("attempt") or 1), planner=r.get("planner"), time=num("time"),
                      repeat=bool(r.get("repeat")))


class Run:
    """A run folder, read on demand. Never raises for what is (or is not) in the folder: problems
    are collected in ``problems`` (one line each)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.problems: list[str] = []

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and self.path.resolve() == other.path.resolve()

    def __hash__(self) -> int:
        return hash(self.path.resolve())

    @property
    def id(self) -> str:
        return self.path.name

    def file(self, name: str) -> Path:
        """The path of one of the run's files (``runs.SPEC_FILE``, ...)."""
        return self.path / name

    # ---- what it is --------------------------------------------------------------------------
    def spec(self) -> dict:
        """``spec.json`` as a dict (``{}`` when missing or unreadable, with a problem noted)."""
        try:
            data = json.loads(self.file(SPEC_FILE).read_bytes().decode("utf-8"))
        except FileNotFoundError:
            self._problem(f"{self.id}: no {SPEC_FILE} (a half-created run, or not a workbench run)")
            return {}
        except (OSError, ValueError) as e:
            self._problem(f"{self.id}: {SPEC_FILE} is unreadable ({type(e).__name__})")
            return {}
        if not isinstance(data, dict):
            self._problem(f"{self.id}: {SPEC_FILE} does not hold a JSON object")
            return {}
        return data

    @property
    def kind(self) -> str:
        st = self.status()
        return str(self.spec().get("kind") or st.kind or "?")

    def status(self) -> RunStatus:
        """The RunStatus as written (see :func:`read_status`); a run whose status says running
        but whose processes on this host are all gone is reported ``failed`` with a note (a
        detached run killed from outside cannot write its own end). The file is not changed."""
        st = read_status(self.path)
        if st.note and st.note.startswith("status.json is unreadable"):
            self._problem(f"{self.id}: {st.note}")
        if st.state not in ("starting", "running"):
            return st
        here = socket.gethostname()
        nodes = self.nodes()
        if any(r.host not in ("", here) and not r.final for r in nodes.values()):
            return st  # a node elsewhere may still run it: only that host can tell
        mine = [r for r in [st, *nodes.values()] if r.host in ("", here) and r.pids]
        if mine and not any(pid_alive(p, t) for r in mine for p, t in status_pids(r)):
            st.state = "failed"
            failed = [r for r in nodes.values() if r.state == "failed" and r.error]
            st.error = st.error or (failed[0].error if failed else "the run's processes are gone but it did not report an end")
            st.note = "ended without a final status (killed from outside?)"
        return st

    def nodes(self) -> dict[int, RunStatus]:
        """The node records of a run over several nodes, by node rank (empty for a one-node run)."""
        folder = self.file(NODES_DIR)
        out = {}
        for p in sorted(folder.glob("node*.json")) if folder.is_dir() else ():
            m = re.match(r"^node(\d+)\.json$", p.name)
            if m:
                out[int(m.group(1))] = read_status(self.path, int(m.group(1)))
        return dict(sorted(out.items()))

    # ---- what it measured ----------------------------------------------------------------------
    def metrics(self, rank: int | None = None) -> list[dict]:
        """Rows of ``metrics.jsonl`` (optionally of one rank), bad lines skipped and counted in
        ``problems``."""
        rows, skipped = read_jsonl(self.file(METRICS_FILE))
        folder = self.file(NODES_DIR)
        for extra in sorted(folder.glob("node*.metrics.jsonl")) if folder.is_dir() else ():
            more, bad = read_jsonl(extra)  # the other nodes' ranks (a run over several nodes)
            rows += more
            skipped += bad
        if skipped:
            self._problem(f"{self.id}: {skipped} unreadable line(s) in {METRICS_FILE} skipped")
        return [r for r in rows if rank is None or r.get("rank") == rank]

    def steps(self) -> list[StepRecord]:
        """Progress as records, one per step (rank 0; the latest attempt of a step run twice)."""
        by_step: dict[int, dict] = {}
        for r in self.metrics(rank=0):
            if isinstance(r.get("step"), int):
                prev = by_step.get(r["step"])
                if prev is None or int(r.get("attempt") or 1) >= int(prev.get("attempt") or 1):
                    by_step[r["step"]] = r
        out = []
        for k in sorted(by_step):
            try:
                out.append(_step_record(by_step[k]))
            except (KeyError, TypeError, ValueError):
                self._problem(f"{self.id}: metrics row of step {k} lacks fields; skipped")
        return out

    def load_average(self) -> dict | None:
        """The machine's load while the run's processes lived (``summarize_load`` of its
        ``load.jsonl``); None when nothing was sampled (a run older than the sampler)."""
        rows, _ = read_jsonl(self.file(LOAD_FILE))
        spec = self.spec()
        n = spec.get("nproc")
        return summarize_load(rows, processes=int(n) if isinstance(n, int) else None)

    def losses(self) -> dict[int, float]:
        """Loss by step (1-based steps completed)."""
        return {r.step: r.loss for r in self.steps() if r.loss is not None}

    def plans(self) -> list[dict]:
        """Rows of ``plans.jsonl``: ``{step, batch_id, plan_wait_s, plan}``."""
        rows, skipped = read_jsonl(self.file(PLANS_FILE))
        if skipped:
            self._problem(f"{self.id}: {skipped} unreadable line(s) in {PLANS_FILE} skipped")
        return rows

    def log_tail(self, lines: int = 20, name: str = LOG_FILE) -> list[str]:
        """The last ``lines`` lines of the log (undecodable bytes replaced)."""
        return tail_lines(self.file(name), lines)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every checkpoint, oldest first: ``checkpoints/step_<n>.pt`` files (ZeRO
        0-2) and ``checkpoints/step_<n>.dcp`` folders (ZeRO-3, sharded)."""
        folder = self.file(CHECKPOINTS_DIR)
        if not folder.is_dir():
            return []
        found = []
        for p in folder.iterdir():
            m = re.match(r"^step_(\d+)\.(pt|dcp)$", p.name)
            if m and (m.group(2) == "pt") != p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def summary(self) -> dict:
        """One run as plain data: id, kind, state, step, timings and the medians of its steps."""
        st = self.status()
        spec = self.spec()
        steps = self.steps()
        meas = [r.measured_ms for r in steps if r.measured_ms]
        pred = [r.predicted_ms for r in steps if r.predicted_ms]
        sc = spec.get("scenario") if isinstance(spec.get("scenario"), dict) else {}
        out = {
            "id": self.id, "path": str(self.path), "kind": spec.get("kind") or st.kind, "state": st.state,
            "step": st.step, "steps": st.steps, "attempt": st.attempt, "created": st.created or st.started,
            "finished": st.finished, "error": st.error, "failing_rank": st.failing_rank,
            "planner": sc.get("planner") or spec.get("planner"), "model": sc.get("model") or spec.get("model"),
            "nproc": spec.get("nproc"), "loss": steps[-1].loss if steps else st.loss,
            "median_measured_ms": statistics.median(meas) if meas else None,
            "median_predicted_ms": statistics.median(pred) if pred else None,
            "profile": (st.resolved or {}).get("profile") or sc.get("profile"),
            "profile_note": (st.resolved or {}).get("profile_note") or None,
            "load_average": self.load_average(),
            "problems": list(dict.fromkeys(self.problems)), "warnings": list(st.warnings),
        }
        nodes = self.nodes()
        if nodes:
            out["nnodes"] = spec.get("nnodes")
            out["nodes"] = [{"node": k, "host": r.host, "state": r.state, "attempt": r.attempt, "error": r.error,
                             "failing_rank": r.failing_rank, "exit_code": r.exit_code} for k, r in nodes.items()]
        return json_safe(out)

    def _problem(self, msg: str) -> None:
        if msg not in self.problems:
            self.problems.append(msg)


def status_pids(st: RunStatus) -> list[tuple[int, int | None]]:
    """Every process a status records (supervisor, ranks, workers) as ``(pid, start time)``."""
    p = st.pids or {}
    starts = p.get("start_times") if isinstance(p.get("start_times"), Mapping) else {}
    ranks = p.get("ranks") if isinstance(p.get("ranks"), Mapping) else {}
    workers = p.get("workers") if isinstance(p.get("workers"), list) else []
    out = []
    for v in (p.get("supervisor"), *ranks.values(), *workers):
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            t = starts.get(str(v))
            out.append((v, t if isinstance(t, int) else None))
    return out


def process_record(pid: int | None = None) -> dict:
    """``{"start_times": {pid: start}}`` for ``pid`` (default: this process), to merge into
    ``pids`` with the pid itself."""
    pid = pid or os.getpid()
    t = proc_start_time(pid)
    return {"start_times": {str(pid): t}} if t is not None else {}


def proc_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22), or None
    when it does not exist. With the pid it identifies a process across pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rfind(")") + 2:].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether process ``pid`` exists, is not a zombie, and (when ``start_time`` is given) is the
    same process that was recorded (not a later one that got the same pid)."""
    if start_time is not None:
        t = proc_start_time(pid)
        if t is not None and t != start_time:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2:].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def tail_lines(path: str | Path, lines: int = 20, max_bytes: int = 1 << 16) -> list[str]:
    """The last ``lines`` lines of a text file (reading at most ``max_bytes`` from its end);
    ``[]`` when it does not exist."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace")
    return [ln.rstrip("\r") for ln in text.splitlines()[-lines:]] if lines > 0 else []


def new_run(kind: str, spec: Mapping[str, Any] | None = None, *, root: str | Path | None = None,
            run_id: str | None = None) -> Run:
    """Create ``root/<run-id>/`` with ``spec.json`` (``{"kind": kind, **spec}``) and a ``created``
    status, and return it. The id is ``<YYYYmmdd-HHMMSS>-<kind>-<4 hex>`` unless given. Raises
    ValueError for an unknown kind, a bad id, a root that is a file, or an id already taken."""
    if kind not in KINDS:
        raise ValueError(f"unknown run kind {kind!r}; kinds are {', '.join(KINDS)}")
    root = Path(root) if root is not None else default_root()
    if str(root).strip() == "":
        raise ValueError("the run root is empty; give a folder, e.g. runs")
    for parent in (root, *root.parents):
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"cannot make runs under {root}: {parent} is a file, not a folder")
    if run_id is None:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}-{secrets.token_hex(2)}"
    elif not _RUN_ID.match(run_id):
        raise ValueError(f"run id {run_id!r} may hold only letters, digits, '.', '_' and '-' (and not start with them)")
    path = root / run_id
    try:
        path.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        raise ValueError(f"{path} already exists; pick another name, or resume it with --run-dir {path}") from None
    except OSError as e:
        raise ValueError(f"cannot create run folder {path}: {e.strerror or e}") from None
    run = Run(path)
    write_json_atomic(run.file(SPEC_FILE), {"kind": kind, **dict(spec or {})})
    update_status(path, run_id=run_id, kind=kind, state="created", created=now(), host=socket.gethostname())
    return run


def load_run(ref: str | Path | Run, *, root: str | Path | None = None) -> Run:
    """The run at ``ref``: a Run, a folder path, or a run id under ``root`` (default
    :func:`default_root`); a unique prefix of an id is enough. Raises RunNotFound saying where it
    looked and which ids come close."""
    if isinstance(ref, Run):
        return ref
    text = os.fspath(ref)
    if not str(text).strip():
        raise RunNotFound("no run given (an empty run id or path)")
    root = Path(root) if root is not None else default_root()
    p = Path(text)
    for cand in (p, root / text):
        if cand.is_dir():
            if not (cand / SPEC_FILE).exists() and not (cand / STATUS_FILE).exists():
                raise RunNotFound(f"{cand} is a folder but not a run (no {SPEC_FILE} or {STATUS_FILE})")
            return Run(cand)
        if cand.exists():
            raise RunNotFound(f"{cand} is a file, not a run folder")
    matches = [r for r in _run_dirs(root) if r.name.startswith(text)] if "/" not in text else []
    if len(matches) == 1:
        return Run(matches[0])
    if len(matches) > 1:
        raise RunNotFound(f"{text!r} matches {len(matches)} runs in {root}: "
                          f"{', '.join(m.name for m in matches[:5])}; give more of the id")
    ids = [r.name for r in _run_dirs(root)]
    hint = f"; runs there: {', '.join(ids[-5:])}" if ids else f"; {root} holds no runs"
    raise RunNotFound(f"no run {text!r} (looked for the folder {p} and {root / text}){hint}")


def _run_dirs(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def list_runs(root: str | Path | None = None, *, kind: str | None = None) -> list[Run]:
    """Runs under ``root`` (default :func:`default_root`), oldest first, optionally of one kind.
    Folders that are not runs are left out."""
    root = Path(root) if root is not None else default_root()
    out = []
    for p in _run_dirs(root):
        if not ((p / SPEC_FILE).exists() or (p / STATUS_FILE).exists()):
            continue
        r = Run(p)
        if kind is None or r.kind == kind:
            out.append(r)
    return out


def compare(a: str | Path | Run, b: str | Path | Run, *, root: str | Path | None = None, skip: int = 1) -> dict:
    """Measured against predicted step time of two runs, and ``b``'s speedup over ``a``.

    Per run: steps compared, median measured and predicted ms (leaving out the first ``skip``
    steps, which pay start-up costs, when there are more), their ratio, median tokens/s and the
    last loss. ``speedup_b_over_a`` = a's median measured step / b's (above 1: b is faster);
    ``predicted_speedup`` the same from the predictions. Raises RunNotFound for a missing run and
    ValueError when a run has no measured steps yet."""
    runs = [load_run(x, root=root) for x in (a, b)]
    rows = []
    for r in runs:
        steps = r.steps()
        use = steps[skip:] if len(steps) > skip else steps
        meas = [s.measured_ms for s in use if s.measured_ms]
        pred = [s.predicted_ms for s in use if s.predicted_ms]
        if not meas:
            raise ValueError(f"run {r.id} has no measured steps yet ({r.status().state}); compare runs that trained")
        tps = [s.tokens_per_s for s in use if s.tokens_per_s]
        m, p = statistics.median(meas), (statistics.median(pred) if pred else None)
        spec = r.spec()
        sc = spec.get("scenario") if isinstance(spec.get("scenario"), dict) else {}
        rows.append({"id": r.id, "planner": sc.get("planner") or spec.get("planner"), "steps": len(use),
                     "median_measured_ms": m, "median_predicted_ms": p,
                     "measured_over_predicted": (m / p) if p else None,
                     "median_tokens_per_s": statistics.median(tps) if tps else None,
                     "last_loss": use[-1].loss, "problems": list(r.problems)})
    ra, rb = rows
    pred = (ra["median_predicted_ms"] / rb["median_predicted_ms"]
            if ra["median_predicted_ms"] and rb["median_predicted_ms"] else None)
    return json_safe({"runs": rows, "speedup_b_over_a": ra["median_measured_ms"] / rb["median_measured_ms"],
                       "predicted_speedup": pred})
