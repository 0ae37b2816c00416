"""``make test`` in parallel, with the heavy tests at most two at once and never two timed ones
(pytest-xdist hooks; conftest.py imports them).

A heavy test is one marked ``slow``: it starts a torchrun tree (2-4 ranks, a supervisor, a planning
worker), a papermill kernel, or JupyterLab and Chromium. A test marked ``serial`` is fast but checks
what a time-limited solver finds in its time, which a heavy test beside it would starve. Heavy tests
run in lanes:

- the *timed* lane: heavy tests whose checks depend on time (a stop within 5 s, a killed rank
  noticed within 10 s, a rendezvous timeout, the browser's waits) and the ``serial`` ones (first of
  all). It is one work unit, handed to the first worker at once: its tests run one at a time.
- the *untimed* units, one per module (one for all the files of the shared torchrun world, first of
  them: ``SHARED_WORLD_UNIT``): heavy tests also marked ``untimed``, whose checks hold however
  loaded the machine is (exact results, files written, refusals; their only clocks are generous
  timeouts). While the timed lane runs, a worker takes one only once the ``serial`` tests are done
  and no fast module is left, and only when no third worker runs one: so a timed check shares the
  cores with fast tests, or with at most one heavy run, and a ``serial`` one with fast tests only.
  Once the timed lane is done, every worker takes untimed modules.
- the fast tests, one work unit per module (a module-scoped fixture is built once).

A worker asking for work takes the timed lane if no one has it, else an untimed module if one may
start, else a fast module, else waits for one of those to become possible. So the timed lane runs
beside the fast tests, as it did with one untimed lane, and the untimed modules end the run on
every worker: with the untimed tests in one lane, queued after the fast tests, that lane ran alone
for about five minutes at the end while the other worker, done with the timed lane, had nothing
left. (Starting the untimed modules first, beside the timed lane, made the timed tests slower and
late ones failed their clocks: the browser's 120 s wait, the Solver panel's 4 s cancellation.)
Without xdist, or with ``-n 0``, nothing changes.

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
"""The lane of heavy tests whose checks hold however loaded the machine is; its work units are
``heavy-untimed::<module>``, one per module."""

_INPUT_KEY = "workbench_heavy_tests_file"


def is_heavy(item) -> bool:
    """Whether a test runs in the heavy work unit: marked ``slow`` (multi-process, notebook and
    browser runs) or ``serial`` (needs the cores to itself)."""
    return item.get_closest_marker("slow") is not None or item.get_closest_marker("serial") is not None


def lane(item) -> str | None:
    """The lane of a heavy test (``HEAVY`` or ``UNTIMED``), None for a fast one."""
    if not is_heavy(item):
        return None
    untimed = item.get_closest_marker("untimed") is not None and item.get_closest_marker("serial") is None
    return UNTIMED if untimed else HEAVY


SHARED_WORLD_UNIT = f"{UNTIMED}::shared-world"
"""The one work unit of the untimed tests of every file that takes part in the shared torchrun world
(``tests/_torchrun.py``: it defines ``world_checks`` or ``subworld_checks``)."""


def in_shared_world(item) -> bool:
    """Whether the test's file lends checks to the shared torchrun world."""
    mod = getattr(item, "module", None)
    return hasattr(mod, "world_checks") or hasattr(mod, "subworld_checks")


def untimed_unit(item) -> str:
    """The work unit of an untimed test: its module's, or ``SHARED_WORLD_UNIT`` for every file of the
    shared world. The first of those files' tests to run launches the world (a lock shares it between
    workers); with the files in one unit, one worker runs them all, and no other worker waits on that
    lock for the length of the launch, idle."""
    return SHARED_WORLD_UNIT if in_shared_world(item) else f"{UNTIMED}::{item.nodeid.split('::', 1)[0]}"


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
    """Worker: the timed lane's tests in the order they run (the ``serial`` ones first), and each
    heavy test's work unit written for the scheduler (with the serial ones). Every worker collects
    the same tests and writes the same file."""
    path = getattr(config, "workerinput", {}).get(_INPUT_KEY)
    if path is None:
        return
    order = {HEAVY: 0, None: 2, UNTIMED: 3}
    # the serial tests first of all, while only fast tests run beside them; stable: files and tests
    # keep their order; the untimed tests of the shared torchrun world's files first of the untimed
    # (the longest unit: on a worker of its own from the start, not left to the end)
    items.sort(key=lambda item: 1 if lane(item) == HEAVY and item.get_closest_marker("serial") is None
               else order[lane(item)] - (0.5 if lane(item) == UNTIMED and in_shared_world(item) else 0))
    tmp = f"{path}.{os.getpid()}"
    units = {item.nodeid: lane(item) if lane(item) == HEAVY else untimed_unit(item) for item in items if is_heavy(item)}
    serial = [item.nodeid for item in items if item.get_closest_marker("serial") is not None]
    Path(tmp).write_text(json.dumps({"units": units, "serial": serial}))
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if getattr(config, "_workbench_heavy_dir", None) is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class HeavyApartScheduling(LoadScopeScheduling):
        """LoadScope whose work units are the timed lane, each module's untimed tests and each
        module's fast tests, handed out by what may run beside what (the module docstring)."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._units: dict[str, str] | None = None
            self._serial: set[str] = set()
            # the work queue follows collection order, where the workers put the heavy tests first
            config.option.loadscopereorder = False

        def _read_lanes(self) -> None:
            path = config._workbench_heavy_dir / "heavy.json"
            try:
                d = json.loads(path.read_text())
                self._units, self._serial = dict(d["units"]), set(d["serial"])
            except (OSError, ValueError, KeyError) as e:  # never run heavy tests side by side unknowingly
                raise RuntimeError(f"the workers did not list their heavy tests in {path} ({e}); run "
                                   f"without -n") from None

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:  # first called once every worker has collected (and written)
                self._read_lanes()
            return self._units.get(nodeid) or nodeid.split("::", 1)[0]

        # ---- which unit a worker takes ------------------------------------------------------------
        @staticmethod
        def _untimed(scope: str) -> bool:
            return scope.startswith(UNTIMED + "::")

        def _pending(self, node, kind: str) -> list[str]:
            """The node's tests not yet done, of one kind: ``timed`` (the timed lane), ``serial`` (the
            timed lane's first tests) or ``untimed`` (any untimed module)."""
            out = []
            for scope, unit in self.assigned_work.get(node, {}).items():
                if (self._untimed(scope) if kind == "untimed" else scope == HEAVY):
                    out += [t for t, done in unit.items() if not done and (kind != "serial" or t in self._serial)]
            return out

        def _untimed_may_start(self, node) -> bool:
            """Whether ``node`` may take an untimed module now: no other worker still has a serial
            test; and while another runs the timed lane, only once no fast module is left to run
            beside it, and when no third worker has an untimed module."""
            others = [n for n in self.assigned_work if n is not node]
            if any(self._pending(n, "serial") for n in others):
                return False
            timed = [n for n in others if self._pending(n, "timed")]
            if not timed:
                return True
            if any(s != HEAVY and not self._untimed(s) for s in self.workqueue):  # a fast module is left
                return False
            return not any(self._pending(n, "untimed") for n in others if n not in timed)

        def _next_scope(self, node) -> str | None:
            if HEAVY in self.workqueue:
                return HEAVY
            untimed = [s for s in self.workqueue if self._untimed(s)]
            if untimed and self._untimed_may_start(node):
                return untimed[0]
            fast = [s for s in self.workqueue if s != HEAVY and not self._untimed(s)]
            return fast[0] if fast else None  # None: only untimed modules are left, and they must wait

        def _assign_work_unit(self, node) -> None:
            scope = self._next_scope(node)
            if scope is None:
                return
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # a finished test can let a waiting worker start an untimed module
                if other is not node:
                    self._reschedule(other)

    return HeavyApartScheduling(config, log)
