"""``make gpu-check`` / ``workbench gpu-check``: what one GPU does with this workbench, measured in at most 8 minutes.

    PYTHONPATH=. python3 -m workbench.gpucheck [--parts doctor,peak,...] [--budget-s 480] [--out gpu-check]

Runs with the machine's own ``python3`` and its CUDA torch: no virtual environment, no flash-attn, no
download (numpy and torch; OR-Tools is never needed). It writes ``<out>/result.json`` (every part's
figures) and ``<out>/report.md`` (the same, short, for ``docs/gpu-results.md``); subprocess logs go to
``<out>/logs/``, the profile and training runs of the last part to ``<out>/runs/``.

The parts (:data:`PARTS`), each in processes of its own so that a CUDA error or an out-of-memory in
one cannot take the others down:

- ``doctor``: ``workbench doctor`` on the device (CUDA, NCCL at world 1, bf16, the attention kernel
  training uses, a training step, and the 2-rank checks where there are 2 GPUs);
- ``peak``: the device's bf16 matmul rate, measured: what MFU is computed against;
- ``attention``: the varlen kernels that import (PyTorch's ``varlen_attn``, flash-attn) against the
  per-sequence SDPA path: outputs and gradients within bf16 tolerance, time at 4K to 128K tokens;
- ``train-1b``, ``train-8b``: the runtime's own step on packed batches of 8K to 64K tokens, bf16, one
  rank (the 8B under ZeRO-3: FSDP2 at world 1, where the memory model says it fits): tokens/s, MFU,
  the allocator's peak against the memory model's prediction;
- ``profile``: a quick profile of this GPU (bf16), a short training run planned with it, and
  ``profile --check`` of that run: the step time's median error;
- ``offload`` (only when asked: ``--parts offload``): ``workbench train`` runs of Llama 3 8B (or the
  1B where the time does not allow the 8B) with ``--recompute`` on one GPU: layer-input offload at the
  longest length the memory model and the part's time allow, against the memory model's peak and the
  plan's host bytes, and its tokens/s against recomputation alone at a length both fit.

Each part has a share of ``--budget-s`` (:data:`PARTS`' seconds, scaled to the budget over the parts
chosen); a part that would start with less than half its share left is skipped with a line saying
so, a running part that overruns its share (plus a grace) is stopped and keeps what it measured (its
processes write after every measurement). Without CUDA every part says it needs CUDA and the exit
status is 0 (the CPU dry run CI runs); otherwise 1 when a part failed. ``--cpu-rehearsal`` runs every
part on CPU with toy sizes (the tests do, to run this code; its figures mean nothing), the
``workbench.runtime.bench`` parts in this process (on CPU no CUDA error can take the others down).

This module imports no torch (it runs the torch side, ``workbench.runtime.bench`` and the doctor's
probes, as subprocesses; the rehearsal imports it when it runs) and nothing beyond the standard
library and the workbench's pure modules.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

__all__ = ["PARTS", "DEFAULT_PARTS", "Part", "GpuCheck", "run_check", "format_markdown", "main", "DEFAULT_BUDGET_S",
           "offload_lengths", "offload_verdicts", "offload_predicted_peak", "OFFLOAD_TARGETS"]

PARTS: dict[str, tuple[str, float]] = {
    "doctor": ("the doctor's checks on the device", 45.0),
    "peak": ("peak bf16 matmul rate", 25.0),
    "attention": ("varlen attention kernels against per-sequence SDPA", 60.0),
    "train-1b": ("training step, Llama-style 1B, ZeRO-0", 70.0),
    "train-8b": ("training step, Llama 3 8B, ZeRO-3 at world 1", 110.0),
    "profile": ("quick GPU profile, a short run planned with it, profile --check", 170.0),
    "offload": ("layer-input offload at the longest length, one GPU, --recompute", 300.0),
}
"""Every part: its title and its share of the default budget, in seconds. Measured on an H200
(2026-11-26, docs/gpu-results.md): doctor 22 s, peak 5, attention 27, train-1b 19, train-8b 27-33,
profile 121 (its packs at the run's sizes: the quick profile alone 74 s). ``offload``: measured
2026-11-28: 284 s for the 8B's two short runs (each some 140 s of start-up), so no third run."""
DEFAULT_PARTS = tuple(p for p in PARTS if p != "offload")
"""The parts a plain ``make gpu-check`` runs: ``offload`` (three training runs of the 8B, some 5
minutes) runs when asked (``--parts offload``), so the whole check keeps its 8-minute budget."""
DEFAULT_BUDGET_S = sum(PARTS[p][1] for p in DEFAULT_PARTS)
GRACE_S = 20.0
"""A part's processes get this long past its share before they are stopped (they stop starting new
measurements at the share themselves)."""
STATUSES = ("ok", "warn", "fail", "skip")
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Part:
    """One part's outcome: ``status`` ok / warn / fail / skip, one ``summary`` line (the reason, for a
    skip), its figures in ``data``."""

    name: str
    title: str
    status: str = "skip"
    summary: str = ""
    seconds: float = 0.0
    budget_s: float = 0.0
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "title": self.title, "status": self.status, "summary": self.summary,
                "seconds": round(self.seconds, 1), "budget_s": round(self.budget_s, 1), "data": self.data}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _env(threads: int | None = None) -> dict:
    """The environment of every subprocess: this checkout first on PYTHONPATH (absolute, so a process
    started elsewhere imports the same code), unbuffered output."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _nvidia_smi() -> dict | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        p = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [ln.split(", ") for ln in p.stdout.strip().splitlines() if ln.strip()]
    return {"gpus": [{"name": r[0], "memory": r[1] if len(r) > 1 else None, "driver": r[2] if len(r) > 2 else None}
                     for r in rows]} if p.returncode == 0 else None


def profile_packs(max_len: int, most_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """The packs the check's quick profile times: ``(fit, heldout)``, sequences of ``max_len / 8`` to
    ``max_len`` tokens in packs of a quarter, half and all of ``most_tokens`` (the run's batch, or
    less where the device would not hold it), and three mixed packs held out.

    The quick profile's own grid (one sequence of 64 tokens up to packs of ``max_len``) measured an
    H200 where the host, not the GPU, sets the time: a 1B layer took 1.2 ms on 64 tokens and 2.0 ms
    on 4,096, so the fitted slope came out at a quarter of the device's and a run of 16K-token steps
    measured 1.54x what the profile predicted. Timed where the run computes, the fit is the device's."""
    lengths = [max_len // 8, max_len // 4, max_len // 2, max_len]
    totals = sorted({max(most_tokens // 4, max_len), most_tokens // 2, most_tokens})
    fit = [list(p) for p in dict.fromkeys(tuple([L] * (t // L)) for t in totals for L in lengths if t >= L)]
    half, quarter, eighth = max_len // 2, max_len // 4, max_len // 8
    held = [[max_len, half, quarter, eighth, eighth], [half, half, quarter, quarter, quarter, eighth, eighth],
            [max_len, half, half, quarter, quarter, eighth, eighth, eighth, eighth]]
    return fit, [p for p in held if sum(p) <= most_tokens]


OFFLOAD_TARGETS = {"peak": 0.10, "host": 0.10, "tokens_per_s": 0.9}
"""The offload part's targets (issue 34): the allocator's peak within 10% of the memory model's, the
host bytes the offloaded inputs took within 10% of the plan's ``host_gb``, and tokens/s with
layer-input offload at least 0.9x recomputation alone at one length."""
OFFLOAD_STARTUP_S = {"llama3-8b": 150.0, "1b": 25.0, "tiny": 10.0}
"""What one ``workbench train`` run of each model takes beyond its steps (torchrun, the process
group, building and sharding the model, planning): used to choose the model before anything ran; the
first run's measured figure replaces it. The 8B's is measured (H200, 2026-11-28: 126-146 s, most of it
initialising 8B parameters on the CPU before sharding); the others are guesses. At the default share
(300 s) three 8B runs do not fit, so the part runs the 1B; ``--parts offload --budget-s 600`` runs the 8B."""
OFFLOAD_STEPS = 3
"""Steps of each short run (the first is warm-up: the allocator, FSDP's set-up, the optimizer's states)."""
OFFLOAD_LONG_STEPS = 2
"""Steps of the long run: the second is the one judged (the optimizer's states exist by then)."""


def _round_down(n: float, quantum: int) -> int:
    return int(n // quantum) * quantum


def offload_lengths(longest_offload: int, longest_plain: int, step_ms: Callable[[int], float], *, budget_s: float,
                    startup_s: float, short_target: int, quantum: int) -> dict:
    """The offload part's two lengths, from the memory model and the time: ``short`` (both short runs,
    with and without offload: at most ``short_target`` and what fits without offload), ``long`` (the
    offloading run: the longest multiple of ``quantum`` within ``longest_offload`` whose
    ``OFFLOAD_LONG_STEPS`` steps of ``step_ms(L)`` ms fit what ``budget_s`` leaves after three runs'
    ``startup_s`` and the short runs' steps). Returns ``{short, long, limited_by, long_time_s,
    short_time_s, need_s}``: ``limited_by`` is "memory" or "time" (or "short" when nothing longer than
    the short length fits the time); ``need_s`` the least the part needs (three start-ups, the short
    runs and the long run at the short length). Raises ValueError when not even ``quantum`` tokens fit
    without offload."""
    short = _round_down(min(short_target, longest_plain, longest_offload), quantum)
    if short < quantum:
        raise ValueError(f"not even {quantum} tokens fit without offload (the memory model holds {longest_plain:,})")
    short_time = 2 * OFFLOAD_STEPS * step_ms(short) / 1e3
    left = budget_s - 3 * startup_s - short_time
    need = 3 * startup_s + short_time + OFFLOAD_LONG_STEPS * step_ms(short) / 1e3
    top = _round_down(longest_offload, quantum)

    def fits(n: int) -> bool:
        return OFFLOAD_LONG_STEPS * step_ms(n) / 1e3 <= left

    if fits(top):
        long, why = top, "memory"
    elif not fits(short):
        long, why = short, "short"
    else:  # bisection over multiples of quantum: step time grows with the length
        lo, hi = short // quantum, top // quantum
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid * quantum) else (lo, mid)
        long, why = lo * quantum, "time"
    return {"short": short, "long": max(long, short), "limited_by": why,
            "long_time_s": OFFLOAD_LONG_STEPS * step_ms(max(long, short)) / 1e3, "short_time_s": short_time,
            "need_s": need}


def offload_predicted_peak(cost, tokens: int, activations_gb: float | None = None) -> dict:
    """The memory model's peak for one offloading rank of a world of one running one sequence of
    ``tokens`` (bytes): the largest of the loss's backward (the model states as the runtime holds them,
    under ZeRO-3 without the gradients a step of one pass has not made yet; the chunked loss's working
    set; the group's activations at level ``inputs``: ``activations_gb``, the plan's group
    ``memory_gb``, else ``cost.gpu_memory`` plus one MLP tile), the backward's end (the states with
    every gradient) and the optimizer's step (parameters, gradients, states and the step's temporary),
    as the train parts' prediction (``runtime.bench.predicted_memory``) with the offloading cost
    model's activations."""
    st = cost.states
    act = (activations_gb if activations_gb is not None
           else float(cost.gpu_memory([tokens], 1, 1, "inputs")[0]) + cost.tile_gb) * 1e9
    at_loss = st.total + act + cost.loss_working_gb * 1e9 - (st.gradients if cost.cluster.zero_stage == 3 else 0.0)
    moments = {"the loss's backward": at_loss, "the backward's end": st.total,
               "the optimizer's step": st.states + st.optimizer_step}
    peak_at = max(moments, key=moments.get)
    return {"total_bytes": moments[peak_at], "peak_at": peak_at, "activation_bytes": act,
            "states_bytes": st.states, "loss_working_bytes": cost.loss_working_gb * 1e9}


def offload_verdicts(*, peak_bytes: float | None, predicted_bytes: float | None, host_bytes: float | None,
                     predicted_host_bytes: float | None, tps_offload: float | None, tps_plain: float | None) -> dict:
    """Each target (``OFFLOAD_TARGETS``) with its measured ratio and whether it is met: ``{peak, host,
    tokens_per_s}``, each ``{ratio, met, target}``; ``met`` None where a figure is missing."""
    def ratio(a, b):
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None

    out = {}
    for name, (a, b) in (("peak", (peak_bytes, predicted_bytes)), ("host", (host_bytes, predicted_host_bytes))):
        r = ratio(a, b)
        tol = OFFLOAD_TARGETS[name]
        out[name] = {"ratio": r, "met": None if r is None else abs(r - 1.0) <= tol + 1e-12,
                     "target": f"within {tol:.0%} of predicted"}
    r = ratio(tps_offload, tps_plain)
    floor = OFFLOAD_TARGETS["tokens_per_s"]
    out["tokens_per_s"] = {"ratio": r, "met": None if r is None else r >= floor - 1e-12,
                           "target": f"at least {floor:g}x recomputation alone"}
    return out


def host_memory_gb() -> float | None:
    """This machine's memory (GB, from /proc/meminfo), where a run's offloaded activations live; None
    where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return None


def run_figures(run) -> dict:
    """What a finished training run measured, from its store (rank 0): per step ``{step, tokens,
    measured_ms, tokens_per_s, peak_bytes, host_bytes}`` (``peak_bytes``: the CUDA allocator's peak of
    the step's last pass and optimizer step, else the process's peak resident set on CPU;
    ``host_bytes``: the most the offloaded inputs took in host memory), the plan's first group
    (``memory_gb``, ``host_gb``, ``offload``), and the median tokens/s of the steps after the first."""
    steps = []
    for r in sorted(run.metrics(rank=0), key=lambda r: (r.get("step", 0), r.get("attempt", 1))):
        ms = r.get("measured_ms")
        tokens = r.get("batch_tokens") or r.get("tokens")
        peak = r.get("max_memory_allocated_bytes")
        if peak is None and isinstance(r.get("peak_memory_mb"), (int, float)):
            peak = r["peak_memory_mb"] * 2**20
        host = max([float(m.get("offload_host_mb") or 0.0) for m in r.get("micro_steps") or []] + [0.0]) * 2**20
        swap = max([float(m.get("swap_host_mb") or 0.0) for m in r.get("micro_steps") or []] + [0.0]) * 2**20
        steps.append({"step": r.get("step"), "tokens": tokens, "measured_ms": ms,
                      "tokens_per_s": tokens / ms * 1e3 if ms else None, "peak_bytes": peak, "host_bytes": host,
                      "swap_host_bytes": swap})
    group = {}
    for row in run.plans()[:1]:
        for ms in (row.get("plan") or {}).get("micro_steps") or []:
            for g in ms.get("groups") or []:
                group = group or {k: g.get(k) for k in ("degree", "memory_gb", "host_gb", "offload", "swap_layers",
                                                        "time_ms", "lengths")}
    timed = [x["tokens_per_s"] for x in steps[1:] if x["tokens_per_s"]] or [x["tokens_per_s"] for x in steps
                                                                             if x["tokens_per_s"]]
    timed.sort()
    tps = (timed[len(timed) // 2] if len(timed) % 2 else sum(timed[len(timed) // 2 - 1:len(timed) // 2 + 1]) / 2) \
        if timed else None
    return {"steps": steps, "group": group, "tokens_per_s": tps}


class GpuCheck:
    """One run of the check: the parts chosen, the budget, where it writes. :meth:`run` returns the
    result dict (also written to ``<out>/result.json`` and ``<out>/report.md``)."""

    def __init__(self, out: str | Path = "gpu-check", *, parts: list[str] | None = None, budget_s: float | None = None,
                 rehearsal: bool = False, say: Callable[[str], None] | None = None) -> None:
        names = list(parts) if parts else list(DEFAULT_PARTS)
        unknown = [p for p in names if p not in PARTS]
        if unknown:
            raise ValueError(f"unknown part(s) {unknown}; the parts are {', '.join(PARTS)}")
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"--budget-s must be a positive number of seconds, got {budget_s!r}")
        self.out = Path(out).resolve()  # absolute: the subprocesses run in the checkout's folder
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {self.out} is a file; give a folder")
        self.names = [p for p in PARTS if p in names]  # in the check's own order
        share = sum(PARTS[p][1] for p in self.names)
        self.budget_s = float(budget_s) if budget_s is not None else (DEFAULT_BUDGET_S if not parts else share)
        self.shares = {p: PARTS[p][1] * self.budget_s / share for p in self.names}
        self.rehearsal = rehearsal
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.t0 = time.monotonic()
        self.env_info: dict = {}
        self.peak_tflops: float | None = None

    # ---- processes -----------------------------------------------------------------------------
    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def _log(self, name: str) -> Path:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        return self.out / "logs" / f"{name}.log"

    def _bench(self, part: str, args: list[str], budget: float, log_name: str | None = None) -> tuple[dict, str | None]:
        """Run ``python -m workbench.runtime.bench PART ARGS`` with ``budget`` seconds (it leaves out
        what would overrun; stopped at budget + grace); returns (its JSON, why it was stopped or failed).
        The CPU rehearsal runs it in this process (:meth:`_bench_here`)."""
        res_path = self.out / "parts" / f"{log_name or part}.json"
        res_path.parent.mkdir(parents=True, exist_ok=True)
        if res_path.exists():
            res_path.unlink()
        argv = [part, "--out", str(res_path), "--budget-s", f"{budget:.0f}", *args,
                *(["--cpu-rehearsal"] if self.rehearsal else [])]
        if self.rehearsal:
            why = self._bench_here(argv, log_name or part)
        else:
            why = self._run([sys.executable, "-m", "workbench.runtime.bench", *argv], budget + GRACE_S, log_name or part)
        try:
            data = json.loads(res_path.read_text())
        except (OSError, ValueError):
            data = {}
            why = why or f"it wrote no result (see {self._log(log_name or part)})"
        return data, why

    def _bench_here(self, argv: list[str], log_name: str) -> str | None:
        """The CPU rehearsal's ``workbench.runtime.bench`` parts (env, peak, attention, train): its
        ``main(argv)`` in this process, one thread, its output to the part's log. On a GPU each part
        has a process of its own, so that a CUDA error or an out-of-memory cannot take the others
        down; on CPU there is neither, and a process each would spend most of its time importing
        torch. Returns None, or why it did not end well."""
        import contextlib

        import torch
        import torch.distributed as dist

        from workbench.runtime import bench

        log = self._log(log_name)
        threads = torch.get_num_threads()
        with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            f.write(f"$ (in this process) python -m workbench.runtime.bench {' '.join(argv)}\n")
            f.flush()
            torch.set_num_threads(1)
            try:
                code = bench.main(argv)
            except SystemExit as e:  # its argument parser's refusal
                code = e.code
            finally:
                torch.set_num_threads(threads)
                if dist.is_initialized():  # a train part that failed before closing its world of one
                    dist.destroy_process_group()
        return None if code in (0, None) else f"exited with status {code} (see {log})"

    def _run(self, cmd: list[str], timeout: float, log_name: str, threads: int | None = None) -> str | None:
        """Run ``cmd`` in a session of its own, its output to the part's log and, line by line, to the
        terminal; stop the whole session past ``timeout``. Returns None, or why it did not end well."""
        log = self._log(log_name)
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(threads),
                                 cwd=str(REPO), start_new_session=True, stdin=subprocess.DEVNULL)

            def pump() -> None:
                for line in p.stdout:
                    f.write(line)
                    f.flush()
                    s = line.rstrip()
                    if s and not s.startswith(("  File ", "Traceback", "    ")) and len(s) < 400:
                        self.say(f"  | {s}")

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_session(p)
                reader.join(timeout=5)
                return f"stopped after {timeout:.0f} s (over its share of the budget); what it measured is kept"
            reader.join(timeout=5)
        if p.returncode != 0:
            return f"exited with status {p.returncode} (see {log})"
        return None

    # ---- the parts ------------------------------------------------------------------------------
    def _env_probe(self) -> dict:
        data, why = self._bench("env", [], 120.0)
        if why and not data:
            tail = [ln.strip() for ln in self._log("env").read_text(errors="replace").splitlines() if ln.strip()]
            data = {"error": tail[-1] if tail else why}
        data["nvidia_smi"] = _nvidia_smi()
        data["host"] = socket.gethostname()
        data["os"] = f"{platform.system()} {platform.release()}"
        return data

    def part_doctor(self, part: Part) -> None:
        from workbench.doctor import run_doctor

        b = part.budget_s
        rep = run_doctor(device="cpu" if self.rehearsal else "cuda", dist=not self.rehearsal,
                         probe_timeout=max(45.0, 0.65 * b), dist_timeout=max(40.0, 0.35 * b),
                         progress=lambda m: self.say(f"  | {m}"))
        c = rep.counts
        part.data = rep.to_dict()
        part.status = "fail" if c["fail"] else "warn" if c["warn"] else "ok"
        lines = {x.name: x for x in rep.checks}
        nccl = lines.get("nccl (world 1)")
        flash = lines.get("flash-attn")
        part.summary = (f"{c['ok']} ok, {c['warn']} warn, {c['fail']} fail, {c['skip']} skipped"
                        + (f"; NCCL at world 1: {nccl.status}" if nccl else "")
                        + (f"; flash-attn: {flash.status}" if flash else ""))

    def part_peak(self, part: Part) -> None:
        data, why = self._bench("peak", [], part.budget_s)
        part.data = data
        peak = (data.get("peak") or {}).get("peak_tflops")
        if peak:
            self.peak_tflops = peak
            sheet = self.env_info.get("datasheet_bf16_tflops")
            part.status = "ok"
            part.summary = (f"{peak:,.0f} TFLOPs bf16 (matmul of {data['peak']['at_n']:,})"
                            + (f", {peak / sheet:.0%} of the datasheet's {sheet:,.0f}" if sheet else ""))
        else:
            part.status = "fail"
            part.summary = why or data.get("error") or "no size ran"

    def part_attention(self, part: Part) -> None:
        data, why = self._bench("attention", [], part.budget_s)
        part.data = data
        corr = (data.get("correctness") or {}).get("kernels") or []
        bad = [r["kernel"] for r in corr if r["status"] != "ok"]
        others = [r for r in corr if not r.get("yardstick")]
        timing = [r for r in data.get("timing") or [] if r.get("status") == "ok"]
        if not corr:
            part.status, part.summary = "fail", why or data.get("error") or "no kernel ran"
            return
        part.status = "fail" if bad else ("warn" if why else "ok")
        words = [f"{r['kernel']}: {r['status']} (out {r['max_abs_error']['out']:.1e}, dq {r['max_abs_error']['dq']:.1e})"
                 if "max_abs_error" in r else f"{r['kernel']}: {r['status']} ({r.get('error')})" for r in others]
        if not others:
            words = ["only the per-sequence SDPA path imports here"]
        longest = max(timing, key=lambda r: (r["tokens"], r["shape"] == "one sequence"), default=None)
        if longest:
            words.append(f"{longest['tokens']:,} tokens ({longest['shape']}) fwd+bwd: " + ", ".join(
                f"{k} {v['fwd_bwd_ms']:,.1f} ms" for k, v in longest["kernels"].items() if v.get("fwd_bwd_ms")))
        words.append(f"training uses: {data.get('training_uses')}")
        part.summary = "; ".join(words) + (f"; {why}" if why else "")

    def _train(self, part: Part, model: str, stage: int, tokens: str) -> None:
        args = ["--model", model, "--zero-stage", str(stage), "--tokens", tokens]
        if self.peak_tflops:
            args += ["--peak-tflops", repr(float(self.peak_tflops))]
        data, why = self._bench("train", args, part.budget_s, log_name=part.name)
        part.data = data
        cases = data.get("cases") or []
        ok = [c for c in cases if c.get("status") == "ok"]
        if data.get("status") == "skip" or (not cases and data.get("reason")):
            part.status, part.summary = "skip", data.get("reason") or "skipped"
            return
        if not ok:
            part.status = "fail"
            part.summary = why or data.get("error") or "; ".join(f"{c['tokens']:,}: {c.get('error') or c.get('reason')}"
                                                                  for c in cases) or "no case ran"
            return
        bad = [c for c in cases if c.get("status") in ("fail", "error")]
        ooms = [c for c in cases if c.get("status") == "oom"]
        part.status = "fail" if bad else ("warn" if ooms or why else "ok")
        best = max(ok, key=lambda c: c["tokens_per_s"])
        words = [(f"{c['tokens'] // 1024}K" if c["tokens"] >= 1024 else f"{c['tokens']}") + f": {c['tokens_per_s']:,.0f} tok/s"
                 + (f", MFU {c['mfu']:.0%}" if c.get("mfu") else "")
                 + (f", peak {c['peak_over_predicted']:.2f}x predicted" if c.get("peak_over_predicted") else "")
                 + (" (recompute)" if c.get("recompute") else "") for c in ok]
        if ooms:
            words.append("out of memory at " + ", ".join(f"{c['tokens']:,}" for c in ooms)
                         + " (predicted " + ", ".join(f"{c['predicted']['total_bytes'] / 2**30:.0f} GiB" for c in ooms) + ")")
        skipped = [c for c in cases if c.get("status") == "skip"]
        if skipped:
            words.append(f"left out {', '.join(str(c['tokens']) for c in skipped)}: {skipped[0].get('reason')}")
        part.summary = f"{data.get('optimizer')}, {'; '.join(words)}" + (f"; {why}" if why else "")
        part.data["best_tokens_per_s"] = best["tokens_per_s"]

    def part_train_1b(self, part: Part) -> None:
        # the rehearsal: one case here, two on train-8b's (a second case on the model the first built)
        self._train(part, "tiny" if self.rehearsal else "1b", 0, "256" if self.rehearsal else "8192,16384,32768,65536")

    def part_train_8b(self, part: Part) -> None:
        self._train(part, "tiny" if self.rehearsal else "llama3-8b", 3,
                    "256,512" if self.rehearsal else "8192,16384,32768,65536")

    def part_profile(self, part: Part) -> None:
        """A quick profile of this device (bf16, one process), a short run planned with it, then
        ``profile --check`` of the run: in the run store ``<out>/runs``."""
        from workbench import runs
        from workbench.launch import process
        from workbench.profile import check_fidelity, prepare_profile, start_profile
        from workbench.training import prepare_train

        root = (self.out / "runs").resolve()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        model = "tiny" if self.rehearsal else "1b"
        device = "cpu" if self.rehearsal else "cuda"
        deadline = time.monotonic() + part.budget_s + GRACE_S
        env = _env(1 if self.rehearsal else None)
        part.data = {"model": model, "root": str(root)}
        # 1. the profile, in the precision the run computes in (a profile's default: bf16 on CUDA, fp32 on
        # CPU), over the packs the run will run (profile_packs). The rehearsal's: one sample of one call a
        # pack and, as the 1B's on a GPU (over 200M parameters), no real steps
        max_len = 128 if self.rehearsal else 4096
        batch_tokens = 256 if self.rehearsal else 16384
        big = ((self.env_info.get("gpu") or {}).get("total_memory_bytes") or 0) >= 100 * 2**30
        fit, held = profile_packs(max_len, batch_tokens if big or self.rehearsal else 12288)
        part.data["profile_packs"] = {"fit": fit, "heldout": held}
        prof = prepare_profile(nproc=1, model=model, quick=True, root=root, name=f"profile-{stamp}", device=device,
                               max_len=max_len, fit_packs=fit, heldout_packs=held,
                               command="workbench.gpucheck (quick profile, 1 process)",
                               **({"reps": 1, "min_sample_ms": 0.0, "steps": False} if self.rehearsal else {}))
        part.data["profile_run"] = prof.id
        self.say(f"  | profile: {prof.path}")
        st = self._wait(process, start_profile(prof, stop_with_parent=True, env=env), deadline, part.budget_s * 0.6)
        if st is None or st.state != "done":
            part.status = "fail"
            part.summary = f"the quick profile did not finish: {st.error if st else 'stopped at its share of the budget'}"
            return
        profile_path = prof.file(runs.PROFILE_FILE)
        part.data["profile"] = str(profile_path)
        # 2. a short training run planned with it
        settings = {"steps": 3 if self.rehearsal else 6, "nproc": 1, "device": device, "model": model, "source": "stdlib",
                    "max_len": max_len, "batch_tokens": batch_tokens,
                    "profile": str(profile_path), "zero_stage": 0, "checkpoint_every": 0, "planner": "greedy",
                    "seed": 0}
        run, spec, _ = prepare_train(settings, root=root, name=f"train-{stamp}")
        part.data["train_run"] = run.id
        self.say(f"  | short run: {run.path}")
        handle = process.start(run, nproc=1, stop_with_parent=True, env=env)
        st = self._wait(process, handle, deadline, None)
        if st is None or st.state != "done":
            part.status = "fail"
            part.summary = f"the short run did not finish: {st.error if st else 'stopped at its share of the budget'}"
            return
        # 3. profile --check
        res = check_fidelity(str(profile_path), run.path, skip=1, root=root)
        err = res["step_error"]
        part.data["check"] = {k: res[k] for k in ("profile", "run", "execution", "zero_stage", "step_error",
                                                  "group_error", "optimizer_error", "notes", "steps")}
        from workbench.profile.fidelity import fidelity_table

        part.data["check_table"] = fidelity_table(res)
        part.status = "ok" if err["median_ape"] is not None else "fail"
        part.summary = (f"step time median error {err['median_ape']:.1f}% (worst {err['worst_ape']:.1f}%, "
                        f"{err['count']} steps) of the {model} run planned with this GPU's quick profile"
                        if err["median_ape"] is not None else "no step to compare")

    def _offload_run(self, process, name: str, settings: dict, deadline: float, env: dict) -> dict:
        """One ``workbench train`` run of the offload part, in the check's run store; returns its
        figures (``run_figures``) with ``run`` (the id), ``state``, ``error`` and ``wall_s``."""
        from workbench.training import prepare_train

        root = (self.out / "runs").resolve()
        run, _, _ = prepare_train(settings, root=root, name=name)
        self.say(f"  | {name}: {settings['model']}, {settings['max_len']:,} tokens, offload {settings['offload']}: "
                 f"{run.path}")
        t = time.monotonic()
        st = self._wait(process, process.start(run, nproc=1, stop_with_parent=True, env=env,
                                               cuda=not self.rehearsal), deadline, None)
        out = run_figures(run)
        out.update(run=run.id, wall_s=time.monotonic() - t, state=st.state if st else "stopped",
                   error=(st.error if st else "stopped at the part's share of the budget") if not st or
                   st.state != "done" else None)
        steps_s = sum((x["measured_ms"] or 0.0) for x in out["steps"]) / 1e3
        out["startup_s"] = max(0.0, out["wall_s"] - steps_s)
        return out

    def part_offload(self, part: Part) -> None:
        """Layer-input offload on one GPU (module docstring): two short runs at one length, with and
        without offload, then the offloading run at the longest length the memory model and what is
        left of the part's share allow (the short runs' measured step time calibrates the cost
        model's); the targets judged by ``offload_verdicts``. In the rehearsal the figures are
        computed, not judged (the CPU's resident set is no allocator peak), and the length is capped
        at the short runs' own: no longer run, the short offloading run is judged."""
        import dataclasses

        from workbench.launch import process
        from workbench.models import get_model
        from workbench.specs import load_profile
        from workbench.training import prepare_train

        t0 = time.monotonic()
        end = t0 + part.budget_s
        deadline = end + GRACE_S
        env = _env(1 if self.rehearsal else None)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        host = host_memory_gb()
        if not host:
            part.status, part.summary = "fail", "the host's memory could not be read (/proc/meminfo)"
            return
        if self.rehearsal:  # the CPU profile has no host link: a stand-in one, so that plans may offload
            prof = dataclasses.replace(load_profile("cpu-gloo-tiny"), name="cpu-gloo-tiny-rehearsal",
                                       host_link_gbps=10.0, host_link_node_gbps=10.0)
            profile = str(prof.save(self.out / "parts" / "offload-profile.json"))
            gpu_gb, candidates = None, ["tiny"]
        else:  # the shipped Hopper estimates (datasheet host link) at this GPU's memory
            profile, candidates = "h100-80g", ["llama3-8b", "1b"]
            gpu_gb = ((self.env_info.get("gpu") or {}).get("total_memory_bytes") or 0) / 1e9 or None
        quantum, short_target = (64, 256) if self.rehearsal else (1024, 8192)
        base = {"nproc": 1, "device": "cpu" if self.rehearsal else "cuda", "profile": profile, "host_memory_gb": host,
                "zero_stage": 3, "recompute": True, "checkpoint_every": 0, "planner": "greedy", "seed": 0,
                "precision": "fp32" if self.rehearsal else "bf16", **({"gpu_memory_gb": gpu_gb} if gpu_gb else {})}

        def settings(model, opt, length, offload, steps):
            return {**base, "model": model, "optimizer": opt[0], "momentum": opt[1], "source": str(length),
                    "max_len": length, "offload": offload, "steps": steps}

        # 1. the model and optimizer: the first that the memory model and the time allow
        chosen, notes = None, []
        for model in candidates:
            ctx = min(get_model(model).max_context, short_target) if self.rehearsal else get_model(model).max_context
            for opt in (("adamw", 0.0), ("sgd", 0.9), ("sgd", 0.0)):
                try:
                    _, spec, _ = prepare_train(settings(model, opt, short_target, "inputs", OFFLOAD_STEPS), dry_run=True,
                                               on_gpu=not self.rehearsal)
                    cost = spec.scenario.cost()
                    plain = spec.scenario.replace(offload="none").cost()
                    longest, longest_plain = min(cost.longest_sequence(), ctx), min(plain.longest_sequence(), ctx)

                    def step_ms(n, cost=cost):
                        return cost.group_at([n], 1, 1, "inputs")[0] + cost.optimizer_ms()

                    lengths = offload_lengths(longest, longest_plain, step_ms, budget_s=end - time.monotonic(),
                                              startup_s=OFFLOAD_STARTUP_S.get(model, 30.0), short_target=short_target,
                                              quantum=quantum)
                except ValueError as e:
                    notes.append(f"{model} {opt[0]}{' momentum' if opt[1] else ''}: {str(e).splitlines()[0]}")
                    continue
                if lengths["need_s"] > end - time.monotonic():
                    notes.append(f"{model}: about {lengths['need_s']:.0f} s needed, {end - time.monotonic():.0f} s left")
                    break  # a lighter optimizer does not make the runs shorter
                chosen = (model, opt, cost, longest, longest_plain, step_ms, lengths)
                break
            if chosen:
                break
        part.data = {"candidates_left_out": notes, "host_memory_gb": host, "profile": profile, "gpu_memory_gb": gpu_gb}
        if chosen is None:
            part.status, part.summary = "skip", "; ".join(notes) or "no model fits"
            return
        model, opt, cost, longest, longest_plain, step_ms, lengths = chosen
        ctx = min(get_model(model).max_context, short_target) if self.rehearsal else get_model(model).max_context
        part.data.update(model=model, optimizer=opt[0] + (" momentum" if opt[1] else ""), zero_stage=3,
                         layers=get_model(model).layers, longest_offload=longest, longest_plain=longest_plain,
                         longest_by_memory=cost.longest_sequence(), max_context=ctx, estimate=lengths)
        short = lengths["short"]
        self.say(f"  | {model}: the memory model holds {longest:,} tokens with offload, {longest_plain:,} without "
                 f"(max context {ctx:,}); short runs at {short:,}")
        # 2. the short runs: recomputation alone, then with offload, at one length
        runs_ = {}
        for off in ("none", "inputs"):
            runs_[f"short_{off}"] = r = self._offload_run(process, f"offload-{stamp}-{short}-{off}",
                                                          settings(model, opt, short, off, OFFLOAD_STEPS), deadline, env)
            if r["state"] != "done":
                part.data["runs"] = runs_
                part.status, part.summary = "fail", f"the short run with offload {off} did not finish: {r['error']}"
                return
        inputs = runs_["short_inputs"]
        measured = sorted(x["measured_ms"] for x in inputs["steps"][1:] if x["measured_ms"]) or [step_ms(short)]
        factor = measured[len(measured) // 2] / step_ms(short)
        # 2b. swap at the short length (the plan chooses how many blocks, within this host's memory):
        # the swapped blocks' pinned copies and prefetch, where time is left for a run beside the long one
        swap_need = OFFLOAD_STARTUP_S.get(model, 30.0) + OFFLOAD_STEPS * step_ms(short) * factor / 1e3
        if end - time.monotonic() >= 2 * swap_need:
            runs_["short_swap"] = self._offload_run(process, f"offload-{stamp}-{short}-swap",
                                                    settings(model, opt, short, "swap", OFFLOAD_STEPS), deadline, env)
        else:
            part.data["swap_note"] = f"no time for the swap run (about {swap_need:.0f} s, twice that left needed)"
        # 3. the long run: what is left of the share, at the short run's measured speed
        left = end - time.monotonic() - inputs["startup_s"]
        top = (longest // quantum) * quantum
        long = short
        if OFFLOAD_LONG_STEPS * step_ms(top) * factor / 1e3 <= left:
            long = top
        else:
            lo, hi = short // quantum, top // quantum
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if OFFLOAD_LONG_STEPS * step_ms(mid * quantum) * factor / 1e3 <= left else (lo, mid)
            long = lo * quantum
        part.data.update(time_factor=factor, long=long,
                         long_limited_by="memory" if long == top and top < ctx - quantum else
                         "the length cap (the model's max context; in the rehearsal the short runs' length)" if long == top
                         else "time")
        judged = inputs
        if long > short:
            runs_["long_inputs"] = judged = self._offload_run(
                process, f"offload-{stamp}-{long}-inputs", settings(model, opt, long, "inputs", OFFLOAD_LONG_STEPS),
                deadline, env)
            if judged["state"] != "done":
                part.data["runs"] = runs_
                part.status, part.summary = "fail", f"the {long:,}-token run did not finish: {judged['error']}"
                return
        else:
            part.data["long_note"] = (f"no run longer than {short:,} tokens (" + ("no time for one" if long < top else
                                                                                   part.data["long_limited_by"])
                                      + "): the short run is judged")
        part.data["runs"] = runs_
        # 4. the targets
        tokens = judged["steps"][-1]["tokens"]
        last = judged["steps"][-1]
        pred = offload_predicted_peak(cost, tokens, judged["group"].get("memory_gb"))
        host_pred = (judged["group"].get("host_gb") or 0.0) * 1e9
        verdicts = offload_verdicts(peak_bytes=last["peak_bytes"], predicted_bytes=pred["total_bytes"],
                                    host_bytes=last["host_bytes"], predicted_host_bytes=host_pred,
                                    tps_offload=inputs["tokens_per_s"], tps_plain=runs_["short_none"]["tokens_per_s"])
        layers = get_model(model).layers
        part.data.update(judged_tokens=tokens, predicted=pred, predicted_host_bytes=host_pred,
                         host_expected_ratio=(layers - 1) / layers, verdicts=verdicts)
        sw = runs_.get("short_swap")
        if sw is not None:
            last_sw = (sw["steps"] or [{}])[-1]
            part.data["swap"] = {"state": sw["state"], "error": sw["error"], "swap_layers": sw["group"].get("swap_layers"),
                                 "tokens_per_s": sw["tokens_per_s"], "peak_bytes": last_sw.get("peak_bytes"),
                                 "swap_host_bytes": last_sw.get("swap_host_bytes"),
                                 "predicted_host_bytes": (sw["group"].get("host_gb") or 0.0) * 1e9,
                                 "ratio_to_recompute": (sw["tokens_per_s"] / runs_["short_none"]["tokens_per_s"]
                                                        if sw["tokens_per_s"] and runs_["short_none"]["tokens_per_s"]
                                                        else None)}
        if self.rehearsal:
            part.status = "ok"
        else:
            met = [v["met"] for v in verdicts.values()]
            part.status = "ok" if all(m is True for m in met) and (sw is None or sw["state"] == "done") else "warn"
        v = verdicts

        def r(x, fmt=".2f"):
            return format(x, fmt) if isinstance(x, (int, float)) else "-"

        part.summary = (f"{model} ({part.data['optimizer']}, ZeRO-3, --recompute): {long:,} tokens with offload "
                        f"({part.data['long_limited_by']}; the memory model holds {longest:,} with it, {longest_plain:,} "
                        f"without): peak {r(v['peak']['ratio'])}x predicted, host {r(v['host']['ratio'])}x the plan's "
                        f"(the last block's input stays on the GPU: {(layers - 1) / layers:.3f} expected); at {short:,} "
                        f"tokens {r(inputs['tokens_per_s'], ',.0f')} tok/s with offload, "
                        f"{r(runs_['short_none']['tokens_per_s'], ',.0f')} without ({r(v['tokens_per_s']['ratio'])}x)"
                        + (f"; swap: {sw['group'].get('swap_layers')} of {layers} blocks, "
                           f"{r(sw['tokens_per_s'], ',.0f')} tok/s ({r(part.data['swap']['ratio_to_recompute'])}x), "
                           f"{r((part.data['swap']['swap_host_bytes'] or 0) / 1e9, '.1f')} GB host"
                           if sw is not None and sw["state"] == "done" else
                           f"; the swap run failed: {sw['error']}" if sw is not None else "")
                        + ("; rehearsal: not judged" if self.rehearsal else
                           "; missed: " + ", ".join(k for k, x in v.items() if x["met"] is not True)
                           if part.status == "warn" else ""))

    def _wait(self, process, handle, deadline: float, share: float | None):
        """Wait for a run (profile or training) until ``deadline`` (or ``share`` seconds); stop it
        past that. Returns its final RunStatus, or None when it was stopped. Whether it has ended is
        asked every 0.1 s (whether its supervisor still runs: one system call), so the next run starts
        as soon as this one has ended: the rehearsal's runs take seconds, and the launcher's default
        of 0.5 s left 0.25 s on average between runs."""
        limit = deadline - time.monotonic()
        if share is not None:
            limit = min(limit, share + GRACE_S)
        try:
            return process.wait(handle, timeout=max(1.0, limit), interval=0.1)
        except TimeoutError:
            process.stop(handle)
            return None

    # ---- the whole check ------------------------------------------------------------------------
    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        started = _now()
        self.say(f"gpu-check: parts {', '.join(self.names)}; budget {self.budget_s:.0f} s; writing {self.out}/")
        self.env_info = self._env_probe()
        cuda = bool(self.env_info.get("cuda_available"))
        gpu = (self.env_info.get("gpu") or {}).get("name")
        if cuda:
            self.say(f"gpu-check: {gpu}, torch {self.env_info.get('torch')} (CUDA {self.env_info.get('cuda_build')})")
        parts: list[Part] = []
        why_not = None
        if not cuda and not self.rehearsal:
            if "torch" not in self.env_info:
                why_not = f"needs CUDA: torch does not import with {sys.executable} ({self.env_info.get('error')})"
            elif not self.env_info.get("cuda_build"):
                why_not = f"needs CUDA: torch {self.env_info['torch']} is a CPU build"
            else:
                why_not = f"needs CUDA: torch {self.env_info['torch']} (CUDA {self.env_info['cuda_build']}) sees no GPU"
        for name in self.names:
            part = Part(name, PARTS[name][0], budget_s=self.shares[name])
            parts.append(part)
            if why_not:
                part.summary = why_not
                self.say(f"gpu-check: {name}: skip: {why_not}")
                continue
            left = self.left()
            if left < 0.5 * part.budget_s:
                part.summary = (f"skipped: {max(left, 0):.0f} s of the budget left, this part needs about "
                                f"{part.budget_s:.0f} s (rerun it: --parts {name})")
                self.say(f"gpu-check: {name}: {part.summary}")
                continue
            part.budget_s = min(part.budget_s, max(left, 0.0))
            self.say(f"gpu-check: {name}: {part.title} (up to {part.budget_s:.0f} s; {left:.0f} s of the budget left)")
            t = time.monotonic()
            try:
                getattr(self, "part_" + name.replace("-", "_"))(part)
            except Exception as e:  # noqa: BLE001 - one part's crash is that part's finding, the check goes on
                part.status = "fail"
                msg = str(e).strip().splitlines()
                part.summary = f"crashed: {type(e).__name__}: {msg[0] if msg else ''}"
            part.seconds = time.monotonic() - t
            self.say(f"gpu-check: {name}: {part.status}: {part.summary} ({part.seconds:.0f} s)")
            self._write(started, parts, cuda)
        result = self._write(started, parts, cuda)
        self.say(f"gpu-check: {result['summary']}; {self.out / 'report.md'}")
        return result

    def _write(self, started: str, parts: list[Part], cuda: bool) -> dict:
        from workbench.util import write_json_atomic, write_text_atomic

        counts = {s: sum(p.status == s for p in parts) for s in STATUSES}
        result = {
            "version": 1, "started": started, "finished": _now(), "seconds": round(time.monotonic() - self.t0, 1),
            "budget_s": self.budget_s, "rehearsal": self.rehearsal, "cuda": cuda,
            "command": ("workbench " if Path(sys.argv[0]).name == "workbench" else
                        f"{Path(sys.executable).name} -m workbench.gpucheck ") + " ".join(sys.argv[1:]),
            "python": sys.executable, "machine": self.env_info, "parts": [p.to_dict() for p in parts],
            "counts": counts, "ok": counts["fail"] == 0,
            "summary": f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} skipped "
                       f"in {time.monotonic() - self.t0:.0f} s",
        }
        write_json_atomic(self.out / "result.json", result)
        write_text_atomic(self.out / "report.md", format_markdown(result))
        return result


def _kill_session(p: subprocess.Popen) -> None:
    """SIGTERM to ``p``'s session, 5 s, then SIGKILL (``p`` leads a session of its own)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------


def _f(v, fmt: str = ",.1f", none: str = "-") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else none


def _gib(b) -> str:
    return _f(b / 2**30 if isinstance(b, (int, float)) else None, ".1f")


def format_markdown(result: dict) -> str:
    """``report.md``: the machine, one line per part, then each part's tables."""
    m = result.get("machine") or {}
    gpu = m.get("gpu") or {}
    lines = ["# GPU check", ""]
    if result.get("rehearsal"):
        lines += ["**CPU rehearsal** (`--cpu-rehearsal`): every part on CPU with toy sizes, to run the code; the "
                  "figures mean nothing.", ""]
    lines += [f"- when: {result.get('started')} ({result.get('seconds')} s of a {result.get('budget_s'):.0f} s budget)",
              f"- command: `{result.get('command')}`",
              f"- device: {gpu.get('name') or ('no CUDA device' if not result.get('cuda') else '?')}"
              + (f", {_gib(gpu.get('total_memory_bytes'))} GiB, compute capability {gpu.get('capability')}" if gpu else ""),
              f"- torch {m.get('torch', '-')} (CUDA build {m.get('cuda_build') or 'none'}), NCCL {m.get('nccl') or '-'}, "
              f"Python {m.get('python', '-')}; flash-attn {m.get('flash_attn') or 'not installed'}; "
              f"torch varlen: {(m.get('torch_varlen') or {}).get('note', '-')}; training's attention: "
              f"{m.get('attention_auto') or '-'}",
              f"- driver: {((m.get('nvidia_smi') or {}).get('gpus') or [{}])[0].get('driver') or '-'}; host {m.get('host', '-')}",
              "", f"**{result.get('summary')}**", "", "| part | status | s | summary |", "|---|---|---:|---|"]
    for p in result.get("parts") or []:
        lines.append(f"| {p['name']} | {p['status']} | {p['seconds']:.0f} | {p['summary'].replace('|', '/')} |")
    for p in result.get("parts") or []:
        d = p.get("data") or {}
        if p["status"] == "skip" or not d:
            continue
        lines += ["", f"## {p['name']}: {p['title']}", ""]
        if p["name"] == "doctor":
            for c in d.get("checks") or []:
                lines.append(f"- {c['status']}: **{c['name']}**: {c['detail']}" + (f" (fix: {c['fix']})" if c.get("fix") and
                                                                                   c['status'] in ("warn", "fail") else ""))
        elif p["name"] == "peak":
            lines += ["| n | ms | TFLOPs |", "|---:|---:|---:|"]
            for r in (d.get("peak") or {}).get("rows") or []:
                lines.append(f"| {r['n']:,} | {_f(r.get('ms'), '.3f')} | {_f(r.get('tflops'), ',.1f')} |"
                             if r.get("status") == "ok" else f"| {r['n']:,} | {r.get('status')} | {r.get('error', '')} |")
        elif p["name"] == "attention":
            c = d.get("correctness") or {}
            lines += [f"Correctness: {c.get('heads')} heads over {c.get('kv_heads')} KV heads of {c.get('head_dim')}, "
                      f"sequences {c.get('lengths')}, {c.get('dtype')} against a {c.get('reference')} reference; "
                      f"rule: {c.get('rule')}.", "",
                      "| kernel | status | out | dq | dk | dv |", "|---|---|---:|---:|---:|---:|"]
            for r in c.get("kernels") or []:
                e = r.get("max_abs_error") or {}
                lines.append(f"| {r['kernel']} | {r['status']} | " + " | ".join(_f(e.get(k), ".2e") for k in
                                                                               ("out", "dq", "dk", "dv")) + " |"
                             if e else f"| {r['kernel']} | {r['status']} | {r.get('error', '')} | | | |")
            for u in d.get("unavailable") or []:
                lines.append(f"\n{u['kernel']}: {u['status']}: {u['reason']}")
            names = d.get("kernels") or []
            lines += ["", "Time (ms, forward / forward+backward; CUDA events, median of 3):", "",
                      "| tokens | shape | " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(names)]
            for r in d.get("timing") or []:
                if r.get("status") != "ok":
                    lines.append(f"| {r['tokens']:,} | {r['shape']} | {r.get('status')}: {r.get('reason') or r.get('error')} |")
                    continue
                cells = []
                for n in names:
                    k = r["kernels"].get(n) or {}
                    cells.append(f"{_f(k.get('fwd_ms'))} / {_f(k.get('fwd_bwd_ms'))}" if k.get("status") == "ok"
                                 else str(k.get("status", "-")))
                lines.append(f"| {r['tokens']:,} | {r['shape']} | " + " | ".join(cells) + " |")
        elif p["name"].startswith("train"):
            lines += [f"{d.get('model')} ({_f(d.get('params'), ',.0f')} parameters), ZeRO-{d.get('zero_stage')}, "
                      f"{d.get('precision')}, {d.get('optimizer')}, one rank ({d.get('backend')}), attention "
                      f"{d.get('attention')}; MFU against the measured peak {_f(d.get('peak_tflops'), ',.0f')} TFLOPs"
                      + (f" (datasheet {d['datasheet_tflops']:,.0f})" if d.get("datasheet_tflops") else "")
                      + "; model FLOPs = sum over sequences of s x flops_per_token(s) (causal attention included).", "",
                      "| tokens | recompute | status | ms/step | tokens/s | TFLOPs | MFU | peak GiB | predicted GiB | "
                      "peak/predicted | predicted peak at |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
            for c in d.get("cases") or []:
                pr = (c.get("predicted") or {}).get("total_bytes")
                lines.append(f"| {c['tokens']:,} | {c.get('recompute', '-')} | {c.get('status')} | {_f(c.get('step_ms'))} | "
                             f"{_f(c.get('tokens_per_s'), ',.0f')} | {_f(c.get('model_tflops'))} | "
                             f"{_f(100 * c['mfu'], '.1f') + '%' if c.get('mfu') else '-'} | {_gib(c.get('peak_bytes'))} | "
                             f"{_gib(pr)} | {_f(c.get('peak_over_predicted'), '.2f')} | "
                             f"{(c.get('predicted') or {}).get('peak_at') or '-'} |"
                             + (f" {c.get('reason') or c.get('error')}" if c.get("status") != "ok" else ""))
        elif p["name"] == "profile":
            if d.get("check_table"):
                lines += ["```", d["check_table"], "```"]
        elif p["name"] == "offload" and d.get("model"):
            lines += [f"{d['model']} ({d.get('optimizer')}, ZeRO-3 at world 1, --recompute), profile {d.get('profile')} at "
                      f"{_f(d.get('gpu_memory_gb'), ',.1f')} GB, host memory {_f(d.get('host_memory_gb'), ',.1f')} GB; "
                      f"the memory model's longest sequence: {_f(d.get('longest_offload'), ',.0f')} tokens with "
                      f"layer-input offload, {_f(d.get('longest_plain'), ',.0f')} without (max context "
                      f"{_f(d.get('max_context'), ',.0f')}); the long run's length set by {d.get('long_limited_by')}.", "",
                      "| run | tokens | offload | state | tokens/s | peak GiB | host MB | plan: GPU GB | plan: host GB |",
                      "|---|---:|---|---|---:|---:|---:|---:|---:|"]
            for name, r in (d.get("runs") or {}).items():
                last = (r.get("steps") or [{}])[-1]
                g = r.get("group") or {}
                lines.append(f"| {name} | {_f(last.get('tokens'), ',.0f')} | {g.get('offload', '-')} | {r.get('state')} | "
                             f"{_f(r.get('tokens_per_s'), ',.0f')} | {_gib(last.get('peak_bytes'))} | "
                             f"{_f((last.get('host_bytes') or 0) / 1e6, ',.1f')} | {_f(g.get('memory_gb'), ',.2f')} | "
                             f"{_f(g.get('host_gb'), ',.3f')} |")
            pr = d.get("predicted") or {}
            lines += ["", f"Predicted peak at {_f(d.get('judged_tokens'), ',.0f')} tokens: {_gib(pr.get('total_bytes'))} GiB "
                      f"({pr.get('peak_at')}; states {_gib(pr.get('states_bytes'))}, activations "
                      f"{_gib(pr.get('activation_bytes'))}, the loss's working set {_gib(pr.get('loss_working_bytes'))})", "",
                      "| target | goal | measured | met |", "|---|---|---:|---|"]
            for name, v in (d.get("verdicts") or {}).items():
                lines.append(f"| {name} | {v.get('target')} | {_f(v.get('ratio'), '.3f')} | "
                             f"{'-' if v.get('met') is None else 'yes' if v['met'] else 'no'} |")
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", default=None, metavar="A,B",
                    help=f"the parts to run (default all: {','.join(PARTS)})")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help=f"the whole check's time budget (default {DEFAULT_BUDGET_S:.0f} s for every part; with --parts "
                         f"their shares): parts share it, one that would overrun is skipped or stopped")
    ap.add_argument("--out", default="gpu-check", metavar="DIR", help="where result.json and report.md go (default gpu-check)")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run every part on CPU with toy sizes (tests the check's code; figures meaningless; the "
                         "benchmark parts in this process)")


def run_check(args) -> int:
    """Run the check for parsed ``args``; returns the exit status (1 when a part failed)."""
    parts = [p.strip() for p in args.parts.split(",") if p.strip()] if args.parts else None
    # every process the check starts (the doctor's too) imports this checkout, wherever it runs
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    check = GpuCheck(args.out, parts=parts, budget_s=args.budget_s, rehearsal=args.cpu_rehearsal)
    result = check.run()
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.gpucheck", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run_check(args)
    except ValueError as e:
        print(f"gpu-check: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
