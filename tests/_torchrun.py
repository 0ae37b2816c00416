"""Test files' worker runs under torchrun, and what their ranks found gathered into one file.

A multi-process test file either runs itself as the worker (``python -m torch.distributed.run
--standalone --nproc-per-node N --start-method fork --run-path <the test file> <args>``, started
once per module by :func:`run_worker`: the ranks are forks of torchrun, torch already imported), or
lends its checks to the *shared 4-rank world* (:func:`shared_world`): one torchrun tree of 4 gloo
ranks that runs the checks of every such file the session collected (this file is its worker),
so the ranks' start-up (torch, torch._dynamo, the process group: about 3 s of
CPU a rank, 15 s a tree) is paid once instead of once per file. A file still runs alone: its
session then launches the world with its checks only. Each rank checks its part and returns a dict;
:func:`gather_to_file` collects them on rank 0 as ``{rank: dict}``.

A file takes part in the shared world by defining, besides a module-scoped fixture that calls
:func:`shared_world`:

- ``world_checks(*args)`` (rank side): the list of ``check(registry, rank) -> dict`` to run;
- ``world_prepare(folder)`` (pytest side, optional): writes what its checks read into ``folder`` and
  returns the ``args`` (strings) for ``world_checks``;
- ``WORLD_SHAPES`` (optional): the ``(degree, cp)`` splits its checks need process groups for, and
  ``DIST_TIMEOUT_S`` (the collective timeout it asks for; the world takes the shortest).

A file whose checks need a world of fewer ranks (a world of 3: FSDP over 3 ranks, a group of 3 that is
the whole world) defines ``SUBWORLD_SIZE = n`` and ``subworld_checks(*args)`` (each ``check(rank) ->
dict``, making its own registry) instead of ``world_checks``: once the 4-rank checks are done and
their process group is destroyed, ranks ``0 .. n-1`` of the same launch form a new world of ``n``
(a new default gloo process group on a file store, ``WORLD_SIZE`` set to ``n``) and run them, while
the other ranks end. That world is as real as one launched with ``--nproc-per-node n`` (its own
default group, its own communicators), without a second tree's start-up (a 3-rank launch: about 11 s
of CPU). A session whose files all have sub-worlds launches ``n`` ranks only.
"""

from __future__ import annotations

import contextlib
import importlib
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
    # the ranks are forks of torchrun, which has imported torch (about 1.7 s of CPU a rank saved, as the
    # supervisor's ranks are: workbench.launch.forked); the script runs in them as it would as __main__
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--start-method", "fork", "--run-path", str(Path(script).resolve()), *args]
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


# ------------------------------------------------------------------------------------------------
# the shared 4-rank world
# ------------------------------------------------------------------------------------------------

SHARED_WORLD = 4
SHARED_DEGREES = (1, 2, 4)
SHARED_RUN_TIMEOUT_S = 1200
_SHARED_FIXTURE_CACHE: dict = {}


def _takes_part(mod) -> bool:
    return hasattr(mod, "world_checks") or hasattr(mod, "subworld_checks")


def _shared_modules(session) -> list:
    """The collected test modules (in collection order) that take part in the shared world: those
    with ``world_checks`` (or ``subworld_checks``) and a selected test."""
    mods: list = []
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and _takes_part(mod) and mod not in mods:
            mods.append(mod)
    return mods


def _ranks_of(mod) -> int:
    """How many ranks run ``mod``'s checks: its sub-world's, else the shared world's."""
    return int(getattr(mod, "SUBWORLD_SIZE", None) or SHARED_WORLD)


def shared_world(request, tmp_path_factory, module_name: str) -> dict:
    """Pytest side: ``{rank: dict}`` of ``module_name``'s checks in the shared 4-rank world. The
    first call of a session launches it for every taking-part module the session collected (each
    ``world_prepare`` first); under pytest-xdist the workers share it through a lock and a file in
    the run's common temporary folder, so whichever worker asks first runs it and the others read it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    key = str(root)
    if key not in _SHARED_FIXTURE_CACHE:
        folder = root / "shared-world"
        with FileLock(str(root / "shared-world.lock")):
            done = folder / "results.json"
            if not done.exists():
                folder.mkdir(exist_ok=True)
                mods = _shared_modules(request.session)
                if module_name not in [m.__name__ for m in mods]:
                    mods.append(sys.modules[module_name])
                spec = []
                for mod in mods:
                    prep = getattr(mod, "world_prepare", None)
                    sub = folder / mod.__name__
                    sub.mkdir(exist_ok=True)
                    spec.append([mod.__name__, list(prep(sub)) if prep else []])
                out = folder / "gathered.json"
                # 4 ranks, or only as many as the sub-worlds need when no file has 4-rank checks
                nproc = SHARED_WORLD if any(hasattr(m, "world_checks") for m in mods) else max(map(_ranks_of, mods))
                per_rank = run_worker(__file__, str(out), json.dumps(spec), nproc=nproc,
                                      timeout=SHARED_RUN_TIMEOUT_S, out=out)
                done.write_text(json.dumps(per_rank))
            _SHARED_FIXTURE_CACHE[key] = json.loads(done.read_text())
    per_rank = _SHARED_FIXTURE_CACHE[key]
    mine = {r: res[module_name] for r, res in per_rank.items() if module_name in res}
    want = _ranks_of(sys.modules[module_name])
    assert sorted(mine, key=int) == [str(r) for r in range(want)], \
        f"the shared world ran {module_name}'s checks on ranks {sorted(mine, key=int)}, not on ranks 0..{want - 1}"
    return mine


def _shared_worker(out_path: str, spec_json: str) -> int:
    """Rank side of the shared world: each taking-part module's checks, in order, on one process
    group and one registry (the union of the modules' splits; :func:`run_checks`), gathered as
    ``{rank: {module: dict}}``; then each sub-world (:func:`_run_subworld`), its results merged into
    the same file: largest first, so that every rank of a sub-world comes from the one before, which
    all its ranks left together (a rank waiting out a smaller world's checks for a larger one could
    pass the process group's timeout at its rendezvous)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    mods = [(importlib.import_module(name), args) for name, args in json.loads(spec_json)]
    full = [(mod, args) for mod, args in mods if hasattr(mod, "world_checks")]
    shapes = sorted({tuple(s) for mod, _ in full for s in getattr(mod, "WORLD_SHAPES", ())})
    timeout_s = min(getattr(mod, "DIST_TIMEOUT_S", 90) for mod, _ in mods)
    run_checks(out_path, [_module_checks(mod, args) for mod, args in full],
               degrees=SHARED_DEGREES if full else (), shapes=shapes, timeout_s=timeout_s)
    subs = [(mod, args) for mod, args in mods if hasattr(mod, "subworld_checks")]
    for n in sorted({_ranks_of(mod) for mod, _ in subs}, reverse=True):
        _run_subworld(out_path, n, [(mod, args) for mod, args in subs if _ranks_of(mod) == n],
                      timeout_s=min(getattr(mod, "DIST_TIMEOUT_S", 90) for mod, _ in subs))
    return 0


def _run_subworld(out_path: str, n: int, mods: list, *, timeout_s: float) -> None:
    """Rank side, once the launch's process group is destroyed: ranks ``0 .. n-1`` form a new world
    of ``n`` (a new default gloo process group on a file store beside ``out_path``), run each of
    ``mods``' ``subworld_checks`` in order (a check may end the group to run a world of its own: the
    ranks then meet again on a new file store), and rank 0 merges ``{rank: {module: dict}}`` into
    ``out_path``; the other ranks of the launch take no part."""
    import datetime

    import torch.distributed as dist

    rank = int(os.environ["RANK"])  # this process's rank in the launch
    if rank >= n:
        return
    os.environ["WORLD_SIZE"] = str(n)  # what this process is a rank of from now on
    store = dist.FileStore(str(Path(out_path).with_name(f"world-of-{n}.store")), n)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=timeout_s))
    results: dict = {}
    joined = 0
    for mod, args in mods:
        mine: dict = {}
        for check in mod.subworld_checks(*args):
            mine.update(check(rank))
            if not dist.is_initialized():
                # the check ended the sub-world's group to run a world of its own (a trainer's, a
                # profiler's): the same ranks meet again on a new file store
                joined += 1
                store = dist.FileStore(str(Path(out_path).with_name(f"world-of-{n}.{joined}.store")), n)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=n,
                                        timeout=datetime.timedelta(seconds=timeout_s))
        results[mod.__name__] = mine
    gathered = [None] * n
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = json.loads(Path(out_path).read_text())
        for r, res in enumerate(gathered):
            merged.setdefault(str(r), {}).update(res)
        Path(out_path).write_text(json.dumps(merged, indent=1))
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def environ_kept(*keys: str):
    """Rank side: the environment variables ``keys`` as they were once the block ends (unset where they
    were), however it changed them (a sub-world check running a trainer or a profiler as a world of
    its own sets ``MASTER_ADDR``, ``WORLD_SIZE`` ...)."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _module_checks(mod, args: list[str]):
    """One check running all of ``mod``'s world checks (made once the process group is up), their
    results under the module's name."""

    def check(registry, rank) -> dict:
        mine: dict = {}
        for c in mod.world_checks(*args):
            mine.update(c(registry, rank))
        return {mod.__name__: mine}

    return check


if __name__ == "__main__":
    sys.exit(_shared_worker(sys.argv[1], sys.argv[2]))
