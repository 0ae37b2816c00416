"""``make test``'s parallel scheme (``_xdist_heavy.py``), checked on a small suite of its own run by a
real ``pytest -n 3`` (``make test`` runs one worker per core; three workers let every rule bind): the
timed lane (``slow`` and ``serial`` tests) on one worker, one at a time, started first, the ``serial``
ones before the rest and beside no heavy test; each module's untimed tests (``slow`` and
``untimed``) on one worker, one at a time, never two of them beside a timed test; each module's
fast tests on one worker (its module fixture built once). That the fast tests go beside the timed
lane first is a choice for speed, seen in the suite's timings, not checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

MODULE = textwrap.dedent("""
    import json, os, time
    import pytest

    SCALE = float(os.environ.get("SLEEP_SCALE", "1"))  # 0: no sleeps (the order alone is checked)

    def record(name, t0, t1):
        with open(os.environ["RECORD"], "a") as f:
            f.write(json.dumps({"name": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"), "t0": t0, "t1": t1}) + "\\n")

    @pytest.fixture(scope="module")
    def built_once():
        record(__name__ + ":fixture", time.time(), time.time())

    @pytest.mark.parametrize("i", range(4))
    def test_fast(i, built_once):
        t0 = time.time(); time.sleep(0.1 * SCALE); record(f"{__name__}:fast{i}", t0, time.time())

    @pytest.mark.slow
    @pytest.mark.parametrize("i", range(2))
    def test_heavy(i):
        t0 = time.time(); time.sleep(0.3 * SCALE); record(f"{__name__}:heavy{i}", t0, time.time())

    @pytest.mark.serial
    def test_serial():
        t0 = time.time(); time.sleep(0.1 * SCALE); record(f"{__name__}:heavy_serial", t0, time.time())

    @pytest.mark.slow
    @pytest.mark.untimed
    @pytest.mark.parametrize("i", range(2))
    def test_untimed(i):
        t0 = time.time(); time.sleep(0.3 * SCALE); record(f"{__name__}:untimed{i}", t0, time.time())
""")


def _suite(root: Path) -> None:
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
                                         'markers = ["slow: heavy", "serial: cores", "untimed: lane"]\n')
    (root / "tests" / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from _xdist_heavy import (pytest_collection_modifyitems, pytest_configure, pytest_configure_node,  # noqa\n"
        "                          pytest_unconfigure, pytest_xdist_make_scheduler)\n")
    for name in ("test_a", "test_b", "test_c"):
        (root / "tests" / f"{name}.py").write_text(MODULE)


def _run(root: Path, *args: str, sleep_scale: float = 1.0) -> list[dict]:
    record = root / "record.jsonl"
    record.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's xdist worker
    env.update(RECORD=str(record), SLEEP_SCALE=str(sleep_scale))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=root,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(x) for x in record.read_text().splitlines()]


def _one_at_a_time(rows: list[dict]) -> None:
    rows = sorted(rows, key=lambda r: r["t0"])
    assert len({r["worker"] for r in rows}) == 1, rows
    for a, b in zip(rows, rows[1:]):
        assert b["t0"] >= a["t1"], f"{a['name']} and {b['name']} overlapped"


def _overlap(a: dict, b: dict) -> bool:
    return a["t0"] < b["t1"] and b["t0"] < a["t1"]


@pytest.mark.long
def test_heavy_tests_run_in_lanes_beside_at_most_one_other(tmp_path):
    pytest.importorskip("xdist")
    _suite(tmp_path)
    rows = _run(tmp_path, "-n", "3")
    heavy = sorted((r for r in rows if ":heavy" in r["name"]), key=lambda r: r["t0"])
    untimed = sorted((r for r in rows if ":untimed" in r["name"]), key=lambda r: r["t0"])
    fast = [r for r in rows if ":fast" in r["name"]]
    assert len(heavy) == 9 and len(untimed) == 6 and len(fast) == 12  # 2 slow, 1 serial, 2 untimed per module
    _one_at_a_time(heavy)
    worker = heavy[0]["worker"]
    mine = sorted((r for r in rows if r["worker"] == worker and ":fixture" not in r["name"]), key=lambda r: r["t0"])
    assert ":heavy" in mine[0]["name"], "the timed lane's worker starts with it"
    assert [r["name"].split(":")[1] for r in heavy[:3]] == ["heavy_serial"] * 3, "the serial tests first"
    for s in heavy[:3]:
        assert not [u["name"] for u in untimed if _overlap(s, u)], f"an untimed test ran beside {s['name']}"
    for m in ("test_a", "test_b", "test_c"):  # each module's untimed tests: one worker, one at a time
        _one_at_a_time([u for u in untimed if u["name"].startswith(m + ":")])
    for t in heavy[3:]:  # beside a timed test, at most one untimed test at any moment
        near = [u for u in untimed if _overlap(t, u)]
        assert not any(_overlap(a, b) for i, a in enumerate(near) for b in near[i + 1:]), \
            f"two untimed tests ran beside {t['name']}: {[u['name'] for u in near]}"
    # a module's fast tests on one worker: its module fixture built once
    fixtures = defaultdict(int)
    for r in rows:
        if ":fixture" in r["name"]:
            fixtures[r["name"]] += 1
    assert dict(fixtures) == {f"{m}:fixture": 1 for m in ("test_a", "test_b", "test_c")}


def test_without_xdist_nothing_changes(tmp_path):
    _suite(tmp_path)
    rows = _run(tmp_path, "-p", "no:xdist", sleep_scale=0)  # in order, one after another: no overlap to see
    names = [r["name"] for r in sorted(rows, key=lambda r: r["t0"]) if ":fixture" not in r["name"]]
    assert names == [f"{m}:{k}" for m in ("test_a", "test_b", "test_c")
                     for k in ("fast0", "fast1", "fast2", "fast3", "heavy0", "heavy1", "heavy_serial", "untimed0",
                               "untimed1")]
