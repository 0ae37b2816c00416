"""``make test`` in parallel, with the heavy tests one at a time per lane (pytest-xdist hooks;
conftest.py imports them).

A heavy test is one marked ``slow``: it starts a torchrun tree (2-4 ranks, a supervisor, a planning
worker), a papermill kernel, or JupyterLab and Chromium. A test marked ``serial`` is fast but checks
what a time-limited solver finds in its time, which a heavy test beside it would starve. Heavy tests
run in two lanes, each one test at a time:

- the *timed* lane: heavy tests whose checks depend on time (a stop within 5 s, a killed rank
  noticed within 10 s, a rendezvous timeout, the browser's waits) and the ``serial`` ones (first of
  all). It is handed to one worker first, so it starts at once and runs beside fast tests while
  they last.
- the *untimed* lane: heavy tests also marked ``untimed``, whose checks hold however loaded the
  machine is (exact results, files written, refusals; their only clocks are generous timeouts).
  It is queued last, so the worker that runs the fast tests takes it after them and runs it beside
  the timed lane.

So at most two heavy tests run at once, and a timed check shares the cores with at most one untimed
run. Before the second lane (one lane for all heavy tests) the other worker idled for most of the run:
the fast tests take about 2 minutes on one core, the heavy ones 11, and most heavy tests keep only
about one core busy (process start-up, rendezvous, waiting on children). The scheduler keeps each
module's fast tests in one work unit, so a module-scoped fixture is built once. Without xdist, or
with ``-n 0``, nothing changes.

Why a scheduler and not ``--dist loadgroup`` with an ``xdist_group`` mark: loadgroup passes the
group inside the test id, and with pytest 9.2 that rewrite silently stops taking effect
(pytest-xdist issue 1386), so heavy tests would run side by side with nothing saying so. And why not
a file lock around heavy tests: a worker waiting for the lock idles a core, and module fixtures that
start runs (the trained runs several tests share) would be built on both workers. The workers know
the marks, the scheduler (in the controlling process) only sees test ids: each worker writes the
lane of each of its heavy tests to a file the controller named (``workerinput``), and the scheduler
reads it once every worker has collected. ``tests/test_parallel.py`` checks the whole scheme on a
small suite.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

HEAVY = "heavy"
"""The work unit (xdist scope) of the timed lane: heavy tests whose checks depend on time."""

UNTIMED = "heavy-untimed"
"""The work unit of the untimed lane: heavy tests whose checks hold however loaded the machine is."""

_INPUT_KEY = "workbench_heavy_tests_file"


def is_heavy(item) -> bool:
    """Whether a test runs in the heavy work unit: marked ``slow`` (multi-process, notebook and
    browser runs) or ``serial`` (needs the cores to itself)."""
    return item.get_closest_marker("slow") is not None or item.get_closest_marker("serial") is not None


def lane(item) -> str | None:
    """The work unit of a heavy test (``HEAVY`` or ``UNTIMED``), None for a fast one."""
    if not is_heavy(item):
        return None
    untimed = item.get_closest_marker("untimed") is not None and item.get_closest_marker("serial") is None
    return UNTIMED if untimed else HEAVY


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
    """Worker: the timed lane first, the fast tests, the untimed lane last (the scheduler keeps
    collection order), and each heavy test's lane written for the scheduler. Every worker collects
    the same tests and writes the same file."""
    path = getattr(config, "workerinput", {}).get(_INPUT_KEY)
    if path is None:
        return
    order = {HEAVY: 0, None: 2, UNTIMED: 3}
    # the serial tests first of all, while only fast tests run beside them; stable: files and tests
    # keep their order
    items.sort(key=lambda item: 1 if lane(item) == HEAVY and item.get_closest_marker("serial") is None
               else order[lane(item)])
    tmp = f"{path}.{os.getpid()}"
    Path(tmp).write_text(json.dumps({item.nodeid: lane(item) for item in items if is_heavy(item)}))
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if getattr(config, "_workbench_heavy_dir", None) is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class HeavyApartScheduling(LoadScopeScheduling):
        """LoadScope with three kinds of scope: the timed lane (one unit, first), each module's fast
        tests, and the untimed lane (one unit, last)."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._heavy: dict[str, str] | None = None
            # the work queue follows collection order, where the workers put the heavy tests first
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            if self._heavy is None:  # first called once every worker has collected (and written)
                path = config._workbench_heavy_dir / "heavy.json"
                try:
                    self._heavy = dict(json.loads(path.read_text()))
                except (OSError, ValueError) as e:  # never run heavy tests side by side unknowingly
                    raise RuntimeError(f"the workers did not list their heavy tests in {path} ({e}); run "
                                       f"without -n") from None
            return self._heavy.get(nodeid) or nodeid.split("::", 1)[0]

    return HeavyApartScheduling(config, log)
