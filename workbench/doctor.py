"""``workbench doctor``: what this machine can do, checked by doing it.

Every line is ok / warn / fail (with the fix) or skip (with the reason): Python; torch and its
CUDA/NCCL build; the GPUs (name, memory, compute capability) and how they are linked (NVLink or
PCIe, from ``nvidia-smi topo -m``); NCCL on one GPU (a process group of one rank); bf16;
flash-attn, and one varlen call of it against the PyTorch path; a training step of the tiny model
with CUDA-event timing and its peak memory against the memory model; with 2+ GPUs an NCCL
all-to-all and all-gather on 2 ranks; and the sharded path (a ZeRO-3 step on 2 ranks against
ZeRO-0; gloo on CPU).

The torch checks run in processes of their own (``workbench.runtime.probe``): this module imports
no torch and never initialises CUDA, so a notebook kernel can run it. The 2-rank check binds its
store to a loopback socket (handed to rank 0), its processes run in a session of their own and are
ended on a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

__all__ = ["Check", "DoctorReport", "run_doctor", "topology_check", "parse_topology", "format_report"]

STATUSES = ("ok", "warn", "fail", "skip")
PROBE_TIMEOUT_S = 300.0
DIST_TIMEOUT_S = 240.0


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: str
    """ok, warn, fail or skip."""
    detail: str
    fix: str = ""
    """What to do about a warn or fail (empty otherwise)."""
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DoctorReport:
    checks: list[Check]
    seconds: float

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    @property
    def ok(self) -> bool:
        """No line failed."""
        return self.counts["fail"] == 0

    def summary(self) -> str:
        c = self.counts
        skipped = [x.name for x in self.checks if x.status == "skip"]
        line = f"{c['ok']} ok, {c['warn']} warn, {c['fail']} fail, {c['skip']} skipped"
        return line + (f" ({', '.join(skipped)}: see the reasons above)" if skipped else "")

    def to_dict(self) -> dict:
        return {"checks": [c.to_dict() for c in self.checks], "counts": self.counts, "ok": self.ok,
                "summary": self.summary(), "seconds": self.seconds}


def _check_from(d: dict) -> Check:
    return Check(name=str(d.get("name")), status=str(d.get("status")), detail=str(d.get("detail")),
                 fix=str(d.get("fix") or ""), data=dict(d.get("data") or {}))


# ------------------------------------------------------------------------------------------------
# topology (nvidia-smi, no torch)
# ------------------------------------------------------------------------------------------------

_LINKS = {"X": "self", "SYS": "PCIe + SMP interconnect (across CPU sockets)", "NODE": "PCIe within a NUMA node",
          "PHB": "PCIe through a host bridge", "PXB": "PCIe through several switches", "PIX": "PCIe, one switch"}


def parse_topology(text: str) -> dict:
    """``nvidia-smi topo -m``'s GPU matrix: ``{"gpus": [...], "links": {(i, j): "NV12" | "PIX" | ...}}``."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s*GPU0\b", ln.strip()) or "\tGPU0" in ln), None)
    if header is None:
        return {"gpus": [], "links": {}}
    cols = header.split()
    gpu_cols = [c for c in cols if re.fullmatch(r"GPU\d+", c)]
    links = {}
    for ln in lines:
        parts = ln.split()
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]) or ln == header:
            continue
        i = int(parts[0][3:])
        for j, val in enumerate(parts[1:1 + len(gpu_cols)]):
            links[(i, j)] = val
    return {"gpus": gpu_cols, "links": links}


def topology_check(run: Callable[[list[str]], tuple[int, str]] | None = None) -> Check:
    """How the GPUs are linked, from ``nvidia-smi topo -m``: ok when every pair has NVLink, warn
    when some pair talks over PCIe (Ulysses' all-to-alls then run at PCIe speed), skip without
    nvidia-smi or with one GPU. ``run`` runs an argument list and returns (status, output)."""
    exe = shutil.which("nvidia-smi")
    if run is None:
        if exe is None:
            return Check("topology", "skip", "no nvidia-smi on this machine (no NVIDIA driver): nothing to link")

        def run(cmd):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            return p.returncode, p.stdout + p.stderr

        cmd = [exe, "topo", "-m"]
    else:
        cmd = ["nvidia-smi", "topo", "-m"]
    try:
        code, text = run(cmd)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("topology", "warn", f"nvidia-smi topo -m did not answer: {e}", "check the NVIDIA driver")
    if code != 0:
        return Check("topology", "warn", f"nvidia-smi topo -m failed: {text.strip().splitlines()[-1:] or ['']}",
                     "check the NVIDIA driver")
    topo = parse_topology(text)
    n = len(topo["gpus"])
    if n < 2:
        return Check("topology", "skip", f"{n} GPU(s): no link between GPUs to check", data={"gpus": n})
    pairs = {(i, j): v for (i, j), v in topo["links"].items() if i < j}
    nv = {k: v for k, v in pairs.items() if v.startswith("NV")}
    kinds = sorted(set(pairs.values()))
    data = {"gpus": n, "links": {f"{i}-{j}": v for (i, j), v in pairs.items()}}
    if len(nv) == len(pairs):
        return Check("topology", "ok", f"{n} GPUs, NVLink between every pair ({', '.join(kinds)})", data=data)
    slow = sorted({v for v in pairs.values() if not v.startswith("NV")})
    detail = (f"{n} GPUs, {len(nv)} of {len(pairs)} pairs on NVLink; the others over "
              f"{'; '.join(f'{k} ({_LINKS.get(k, k)})' for k in slow)}")
    return Check("topology", "warn", detail, "Ulysses' all-to-alls between those GPUs run at PCIe speed: profile this "
                 "machine (`workbench profile`) so plans know, and prefer SP groups inside NVLink islands", data=data)


# ------------------------------------------------------------------------------------------------
# running the torch checks
# ------------------------------------------------------------------------------------------------


def _nvidia_visible() -> bool:
    from workbench.training import cuda_visible

    return cuda_visible()


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _probe(device: str, precision: str | None, timeout: float) -> list[Check]:
    cmd = [sys.executable, "-m", "workbench.runtime.probe", "probe", "--device", device]
    if precision:
        cmd += ["--precision", precision]
    if _nvidia_visible():
        cmd.append("--nvidia-visible")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                         start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        return [Check("torch checks", "fail", f"the checks did not finish in {timeout:.0f} s (a hang in CUDA?)",
                      "run `python -m workbench.runtime.probe probe` by hand to see where it stops")]
    try:
        return [_check_from(d) for d in json.loads(out.strip().splitlines()[-1])]
    except (ValueError, IndexError):
        last = (err.strip().splitlines() or ["no output"])[-1]
        return [Check("torch", "fail", f"the torch checks could not run: {last}",
                      "install the project (`make install`) and check that `python -c 'import torch'` works")]


def _dist(precision: str | None, timeout: float) -> list[Check]:
    """The 2-rank checks: two processes on a store bound to 127.0.0.1 (rank 0 is handed the socket)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    env = _env()
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="workbench-doctor-") as tmp:
        out = os.path.join(tmp, "dist.json")
        procs, logs = [], []
        try:
            for rank in (0, 1):
                cmd = [sys.executable, "-m", "workbench.runtime.probe", "dist", "--rank", str(rank), "--world", "2",
                       "--port", str(port), "--timeout", f"{min(timeout, 120.0):g}"]
                kw = {}
                if rank == 0:
                    cmd += ["--listen-fd", str(sock.fileno()), "--out", out]
                    kw["pass_fds"] = (sock.fileno(),)
                if precision:
                    cmd += ["--precision", precision]
                log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
                logs.append(log)
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                              stdin=subprocess.DEVNULL, **kw))
            sock.close()  # rank 0's store owns the listening socket now
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.1)
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
            sock.close()
        if hung:
            return [Check("sharded step (ZeRO-3)", "fail", f"the 2-rank check did not finish in {timeout:.0f} s "
                          f"(rank(s) {hung} still running; a collective that never completed)",
                          "run `workbench doctor --json` again; if it repeats, check NCCL/gloo networking (NCCL_DEBUG=INFO)")]
        try:
            with open(out) as f:
                return [_check_from(d) for d in json.load(f)]
        except (OSError, ValueError):
            tail = []
            for log in logs:
                log.seek(0)
                tail += [ln.rstrip() for ln in log.readlines()[-3:]]
            why = next((ln for ln in reversed(tail) if ln.strip()), "no output")
            return [Check("sharded step (ZeRO-3)", "fail", f"the 2-rank check failed: {why}",
                          "run `python -m workbench.doctor` with --json and read the ranks' errors")]
        finally:
            for log in logs:
                log.close()


def run_doctor(*, device: str = "auto", precision: str | None = None, dist: bool = True,
               progress: Callable[[str], None] | None = None, probe_timeout: float = PROBE_TIMEOUT_S,
               dist_timeout: float = DIST_TIMEOUT_S) -> DoctorReport:
    """Run every check (``dist``: also the 2-rank ones) and return the report. ``device``: ``auto``
    (the GPUs when there are any), ``cpu`` or ``cuda``; ``precision`` of the training step (default
    bf16 on GPUs that support it, else fp32)."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    say("doctor: torch, GPUs, attention and a training step (one process)...")
    checks = _probe(device, precision, probe_timeout)
    checks.append(topology_check())
    if dist:
        say("doctor: 2 ranks: NCCL collectives (with 2+ GPUs) and a ZeRO-3 step against ZeRO-0...")
        checks += _dist(precision, dist_timeout)
    else:
        checks.append(Check("sharded step (ZeRO-3)", "skip", "left out (--quick)"))
    order = ["python", "torch", "gpus", "topology", "nccl", "nccl (world 1)", "bf16", "attention (PyTorch path)",
             "flash-attn", "attention kernel",
             "training step", "nccl all-to-all", "nccl all-gather", "gloo all-to-all", "gloo all-gather",
             "sharded step (ZeRO-3)"]
    checks.sort(key=lambda c: order.index(c.name) if c.name in order else len(order))
    return DoctorReport(checks=checks, seconds=time.perf_counter() - t0)


_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def format_report(report: DoctorReport) -> str:
    """The report as text: one line per check, the fix under each warn or fail, then the summary."""
    w = max(len(c.name) for c in report.checks) if report.checks else 10
    lines = ["workbench doctor: what this machine can do, checked by doing it"]
    for c in report.checks:
        lines.append(f"  {_MARK.get(c.status, c.status):<4}  {c.name:<{w}}  {c.detail}")
        if c.fix and c.status in ("warn", "fail"):
            lines.append(f"  {'':<4}  {'':<{w}}  fix: {c.fix}")
    lines.append(f"summary: {report.summary()} in {report.seconds:.0f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.doctor")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--precision", default=None, choices=["bf16", "fp32"])
    a = ap.parse_args(argv)
    rep = run_doctor(device=a.device, precision=a.precision, dist=not a.quick)
    print(json.dumps(rep.to_dict()) if a.json else format_report(rep))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
