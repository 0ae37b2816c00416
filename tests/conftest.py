import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")

# make test runs the suite in parallel with the heavy (slow) tests one at a time: see _xdist_heavy.py
from _xdist_heavy import (pytest_collection_modifyitems, pytest_configure, pytest_configure_node,  # noqa: E402,F401
                          pytest_unconfigure, pytest_xdist_make_scheduler)


@pytest.fixture
def a100_7b_64():
    """The FlexSP reference setting: 7B on 64 A100-40G."""
    from workbench.cost import CostModel
    from workbench.specs import ClusterSpec, get_model, load_profile

    return CostModel(load_profile("a100-40g-flexsp"), get_model("7b"), ClusterSpec(num_gpus=64))


@pytest.fixture
def small_cost():
    """7B on 8 A100-40G: memory binds at a few thousand tokens, so small cases exercise every rule."""
    from workbench.cost import CostModel
    from workbench.specs import ClusterSpec, get_model, load_profile

    return CostModel(load_profile("a100-40g-flexsp"), get_model("7b"), ClusterSpec(num_gpus=8, gpus_per_node=8))


def run_cli(*args, check=True):
    """Run the real console entry in a subprocess; returns CompletedProcess."""
    import subprocess

    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stderr}")
    return p


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (``item.rep_call``), for fixtures that act on a
    failure (the browser test's screenshot)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def set_partitions(items):
    """Every partition of ``items`` into non-empty groups (the exhaustive searches enumerate plans
    by it): yields lists of lists."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in set_partitions(rest):
        for j in range(len(p)):
            yield p[:j] + [[first] + p[j]] + p[j + 1:]
        yield [[first]] + p
