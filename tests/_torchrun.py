"""A test file's own worker run under torchrun, and what its ranks found gathered into one file.

The multi-process test files (``test_runtime_dist.py``, ``test_runtime_zero.py``,
``test_gpu_dist.py``, ``test_hf_dist.py``) run themselves as the worker: ``python -m
torch.distributed.run --standalone --nproc-per-node N <the test file> <args>``. Each rank checks
its part and returns a dict; :func:`gather_to_file` collects them on rank 0 as ``{rank: dict}``;
the pytest side starts the launch once per module with :func:`run_worker` and reads that file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def run_checks(out_path: str | Path, checks, *, degrees=(1, 2, 4), shapes=(), timeout_s: float) -> int:
    """Rank side of a worker: the gloo process group (a short ``timeout_s``, so a mismatched or
    deadlocked collective fails the run instead of hanging it), a GroupRegistry of ``degrees`` (and
    the sub-groups of the ``(degree, cp)`` splits in ``shapes``), then each ``check(registry, rank)
    -> dict`` in order, merged and gathered to ``out_path``."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    from workbench.runtime.groups import GroupRegistry

    registry = GroupRegistry(dist.get_world_size(), list(degrees), shapes=shapes)
    results: dict = {}
    for check in checks:
        results.update(check(registry, rank))
    gather_to_file(results, out_path)
    return 0


def gather_to_file(results: dict, out_path: str | Path) -> None:
    """Rank side: every rank's ``results`` written by rank 0 as ``{"0": ..., "1": ...}``, then the
    process group torn down (every rank calls it, in the same place)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps({str(r): res for r, res in enumerate(gathered)}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def by_check(per_rank: dict) -> dict:
    """``{rank: {check: value}}`` turned into ``{check: {rank: value}}``."""
    merged: dict = {}
    for r, res in per_rank.items():
        for key, val in res.items():
            merged.setdefault(key, {})[r] = val
    return merged


def run_worker(script: str | Path, *args: str, nproc: int, timeout: float, out: Path) -> dict:
    """Pytest side: launch ``script`` under torchrun in its own session (a timeout kills every rank),
    fail with the output's tails unless it ends well, and return the ``{rank: dict}`` it wrote to
    ``out``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
           *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    stdout, stderr = communicate_or_kill(proc, timeout, "torchrun")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads(out.read_text())


def communicate_or_kill(proc: subprocess.Popen, timeout: float, what: str) -> tuple[str, str]:
    """``proc.communicate`` within ``timeout`` seconds; past it, every process of ``proc``'s session
    (started with ``start_new_session=True``) is killed and the test fails with the output's tails."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")


def assert_all_ranks(results: dict, key: str, world: int) -> None:
    """Check ``key`` ran on every rank and came out ``ok`` on each."""
    per_rank = results[key]
    assert len(per_rank) == world
    bad = {r: v for r, v in per_rank.items() if not v["ok"]}
    assert not bad, f"{key} failed on ranks {sorted(bad)}: {bad}"
