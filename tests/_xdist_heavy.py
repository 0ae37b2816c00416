"""``make test`` in parallel, with the heavy tests one at a time (pytest-xdist hooks; conftest.py
imports them).

A heavy test is one marked ``slow``: it starts a torchrun tree (2-4 ranks, a supervisor, a planning
worker), a papermill kernel, or JupyterLab and Chromium. Two of them at once on a 2-core machine
fight over the cores, and their timing checks (a stop within 5 s, a killed rank noticed within
10 s) with them. A test marked ``serial`` is fast but checks what a time-limited solver finds in
its time, which a heavy test beside it would starve: it runs among the heavy ones (and stays in the
fast subset, ``-m "not slow"``). So under ``pytest -n N`` (``--dist load``, the default with ``-n``, or
``loadgroup``) this scheduler hands every heavy test to one worker, in one work unit, first: that
worker runs them one after another from the start (they are the longest chain: the run lasts at
least as long as they do), while the other workers run the fast tests beside them, a module at a
time so that a module-scoped fixture is built once. Without xdist, or with ``-n 0``, nothing changes.

Why a scheduler and not ``--dist loadgroup`` with an ``xdist_group`` mark: loadgroup passes the
group inside the test id, and with pytest 9.2 that rewrite silently stops taking effect
(pytest-xdist issue 1386), so heavy tests would run side by side with nothing saying so. And why not
a file lock around heavy tests: a worker waiting for the lock idles a core, and module fixtures that
start runs (the trained runs several tests share) would be built on both workers. The workers know
the marks, the scheduler (in the controlling process) only sees test ids: each worker writes the ids
of its heavy tests to a file the controller named (``workerinput``), and the scheduler reads it once
every worker has collected. ``tests/test_parallel.py`` checks the whole scheme on a small suite.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

HEAVY = "heavy"
"""The work unit (xdist scope) that holds every heavy test."""

_INPUT_KEY = "workbench_heavy_tests_file"


def is_heavy(item) -> bool:
    """Whether a test runs in the heavy work unit: marked ``slow`` (multi-process, notebook and
    browser runs) or ``serial`` (needs the cores to itself)."""
    return item.get_closest_marker("slow") is not None or item.get_closest_marker("serial") is not None


def _distributing(config) -> bool:
    """In the controlling process of ``pytest -n N`` with load distribution."""
    return (not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))
            and getattr(config.option, "dist", "no") in ("load", "loadgroup"))


def pytest_configure(config):
    if _distributing(config):
        config._workbench_heavy_dir = Path(tempfile.mkdtemp(prefix="workbench-heavy-tests-"))


def pytest_unconfigure(config):
    d = getattr(config, "_workbench_heavy_dir", None)
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller: tell each worker where to list its heavy tests."""
    d = getattr(node.config, "_workbench_heavy_dir", None)
    if d is not None:
        node.workerinput[_INPUT_KEY] = str(d / "heavy.json")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Worker: heavy tests first (the scheduler keeps collection order), and their ids written for
    the scheduler. Every worker collects the same tests and writes the same list."""
    path = getattr(config, "workerinput", {}).get(_INPUT_KEY)
    if path is None:
        return
    items.sort(key=lambda item: not is_heavy(item))  # stable: files and tests keep their order
    tmp = f"{path}.{os.getpid()}"
    Path(tmp).write_text(json.dumps([item.nodeid for item in items if is_heavy(item)]))
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if getattr(config, "_workbench_heavy_dir", None) is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class HeavyApartScheduling(LoadScopeScheduling):
        """LoadScope with two kinds of scope: all heavy tests (one unit, first), and each module's
        fast tests."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._heavy: set[str] | None = None
            # the work queue follows collection order, where the workers put the heavy tests first
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            if self._heavy is None:  # first called once every worker has collected (and written)
                path = config._workbench_heavy_dir / "heavy.json"
                try:
                    self._heavy = set(json.loads(path.read_text()))
                except (OSError, ValueError) as e:  # never run heavy tests side by side unknowingly
                    raise RuntimeError(f"the workers did not list their heavy tests in {path} ({e}); run "
                                       f"without -n") from None
            return HEAVY if nodeid in self._heavy else nodeid.split("::", 1)[0]

    return HeavyApartScheduling(config, log)
