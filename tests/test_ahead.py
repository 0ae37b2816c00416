"""Planning ahead in a worker process: every plan is handed out only for the batch it was made for;
a worker that dies is a clear WorkerDied, and the trainer's planner goes on inline."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from workbench.cost import InfeasibleError
from workbench.data import GlobalBatchSampler, synthetic_lengths
from workbench.solve import run_planner, validate
from workbench.solve.ahead import (PlanAhead, PlanMismatchError, UnknownBatchError, WorkerDied, check_pairing,
                                   plan_ahead, plan_lengths)


def _same(a, b):
    da, db = a.to_dict(), b.to_dict()
    da.pop("solve_seconds")
    db.pop("solve_seconds")
    return da == db


@pytest.fixture(scope="module")
def cost():
    from workbench.cost import CostModel
    from workbench.models import get_model
    from workbench.specs import ClusterSpec, load_profile

    return CostModel(load_profile("a100-40g-flexsp"), get_model("7b"), ClusterSpec(num_gpus=8, gpus_per_node=8))


@pytest.fixture(scope="module")
def sampler():
    return GlobalBatchSampler(synthetic_lengths("wikipedia", 3000, seed=3), batch_size=48, seed=0)


@pytest.fixture(scope="module")
def greedy_ahead(cost):
    with PlanAhead("greedy", cost, seed=0) as ahead:
        yield ahead


def test_out_of_order_requests_get_their_own_plans(greedy_ahead, sampler, cost):
    batches = sampler.take(5)
    for b in batches:
        greedy_ahead.submit(b)
    assert greedy_ahead.pending == [b.batch_id for b in batches]
    for k in (3, 0, 4, 2, 1):
        b = batches[k]
        p = greedy_ahead.get(b, timeout=60)
        assert p.batch_id == b.batch_id
        assert np.array_equal(plan_lengths(p), b.lengths)
        validate(p, b.lengths, cost.cluster, cost)
    assert greedy_ahead.pending == []


def test_worker_plan_equals_in_process_plan(greedy_ahead, sampler, cost):
    b = sampler.batch(7)
    greedy_ahead.submit(b)
    p = greedy_ahead.get(b, timeout=60)
    q = run_planner("greedy", b.lengths, cost, seed=0, batch_id=b.batch_id)
    assert _same(p, q)


def test_pairs_and_bare_ids(greedy_ahead):
    lens = np.array([3000, 1200, 700, 80, 5000])
    assert greedy_ahead.submit(("step-a", lens)) == "step-a"
    assert greedy_ahead.submit(("step-a", lens.tolist())) == "step-a"  # same id, same lengths: no-op
    with pytest.raises(PlanMismatchError, match="already submitted with other lengths"):
        greedy_ahead.submit(("step-a", lens[:-1]))
    with pytest.raises(PlanMismatchError, match="other lengths"):
        greedy_ahead.get(("step-a", lens[::-1]))
    p = greedy_ahead.get("step-a", timeout=60)  # the id alone: checked against the submitted lengths
    assert p.batch_id == "step-a" and np.array_equal(plan_lengths(p), lens)


def test_unknown_and_handed_out_batches_are_clear_errors(greedy_ahead, sampler):
    with pytest.raises(UnknownBatchError, match="never submitted") as e:
        greedy_ahead.get(sampler.batch(999))
    assert isinstance(e.value, KeyError) and "b000999" in str(e.value)
    b = sampler.batch(11)
    greedy_ahead.submit(b)
    greedy_ahead.get(b, timeout=60)
    with pytest.raises(KeyError, match="already handed out"):
        greedy_ahead.get(b)
    with pytest.raises(TypeError):
        greedy_ahead.submit("b000011")  # an id without lengths cannot be planned


def test_worker_exceptions_surface_in_get(greedy_ahead, cost):
    greedy_ahead.submit(("too-long", [10_000_000, 100]))
    greedy_ahead.submit(("fine", [100, 200]))
    with pytest.raises(InfeasibleError, match="10,000,000 tokens") as e:
        greedy_ahead.get("too-long", timeout=60)
    assert any("too-long" in n for n in getattr(e.value, "__notes__", []))
    assert greedy_ahead.get("fine", timeout=60).batch_id == "fine"  # the worker lives on


def test_slow_planner_does_not_mix_plans_up(cost, sampler):
    # later batches are smaller and sleep longer: finishing order and submission order differ in cost
    batches = [sampler.batch(k) for k in range(4)]
    batches = [(b.batch_id, b.lengths[: 40 - 8 * k]) for k, b in enumerate(batches)]
    with PlanAhead("_slow_planner:plan_slow", cost, seed=1) as ahead:
        for b in batches:
            ahead.submit(b)
        assert not ahead.ready(batches[-1])
        for bid, lens in reversed(batches):
            p = ahead.get((bid, lens), timeout=60)
            assert p.batch_id == bid and p.planner == "greedy"
            assert np.array_equal(plan_lengths(p), lens)
            assert _same(p, run_planner("greedy", lens, cost, seed=1, batch_id=bid))


def test_failing_planners_by_path(cost):
    with PlanAhead("_slow_planner:plan_fail", cost) as ahead:
        ahead.submit(("x", [100, 200, 300]))
        with pytest.raises(RuntimeError, match="deliberate planner failure on 3 sequences"):
            ahead.get("x", timeout=60)
    with PlanAhead("_slow_planner:plan_odd_error", cost) as ahead:
        ahead.submit(("y", [100, 200]))
        with pytest.raises(RuntimeError, match="_OddError: odd failure 1/2"):
            ahead.get("y", timeout=60)
    with PlanAhead("_slow_planner:plan_reversed", cost) as ahead:
        ahead.submit(("z", [100, 200, 300]))
        with pytest.raises(PlanMismatchError, match="does not match its lengths"):
            ahead.get("z", timeout=60)


def test_check_pairing_refuses_another_batch(cost):
    p = run_planner("greedy", [100, 200, 300], cost, batch_id="b1")
    check_pairing(p, "b1", [100, 200, 300])
    with pytest.raises(PlanMismatchError, match="not batch 'b2'"):
        check_pairing(p, "b2", [100, 200, 300])
    with pytest.raises(PlanMismatchError, match="sequence 1 is 200 tokens in the plan but 201"):
        check_pairing(p, "b1", [100, 201, 300])
    with pytest.raises(PlanMismatchError, match="3 sequences in the plan, 4 in the batch"):
        check_pairing(p, "b1", [100, 200, 300, 5])


def test_bad_planner_names_fail_at_once(cost):
    with pytest.raises(ValueError, match="unknown planner"):
        PlanAhead("no-such-planner", cost)
    with pytest.raises(ValueError, match="cannot import"):
        PlanAhead("_slow_planner:no_such_function", cost)


def test_close_cancels_a_running_plan(cost):
    ahead = PlanAhead("_slow_planner:plan_until_cancelled", cost)
    ahead.warm_up(timeout=60)
    ahead.submit(("long", [100, 200]))
    time.sleep(0.3)
    t0 = time.perf_counter()
    ahead.close()
    assert time.perf_counter() - t0 < 5.0
    assert ahead.closed
    with pytest.raises(RuntimeError, match="closed"):
        ahead.submit(("again", [100]))
    ahead.close()  # idempotent


def test_plan_ahead_generator(cost, sampler):
    got = list(plan_ahead(sampler, "greedy", cost, steps=4, seed=0, depth=2))
    assert [b.batch_id for b, _ in got] == ["b000000", "b000001", "b000002", "b000003"]
    for b, p in got:
        assert p.batch_id == b.batch_id and np.array_equal(plan_lengths(p), b.lengths)


def test_iterate_plans_the_next_batch_while_handing_out_this_one(greedy_ahead, sampler):
    batches = sampler.take(3, start=20)
    seen = []
    for b, p in greedy_ahead.iterate(batches):
        assert p.batch_id == b.batch_id
        nxt = [x.batch_id for x in batches if x.step == b.step + 1]
        assert greedy_ahead.pending == nxt  # depth 1: the next batch is already planning
        seen.append(b.batch_id)
    assert seen == [b.batch_id for b in batches] and greedy_ahead.pending == []


def test_stopping_iterate_early_discards_what_was_planned_ahead(greedy_ahead, sampler):
    for b, p in greedy_ahead.iterate(iter(sampler)):  # an endless sampler
        assert p.batch_id == b.batch_id == "b000000"
        break
    assert greedy_ahead.pending == []


# ------------------------------------------------------------------------------------------------
# a worker that dies
# ------------------------------------------------------------------------------------------------


def _planning_worker(ahead: PlanAhead) -> int:
    """The pid of the planning worker itself (``worker_pids`` also lists multiprocessing's tracker)."""
    pids = [p for p in ahead.worker_pids() if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(pids) == 1, ahead.worker_pids()
    return pids[0]


def _gone(pid: int, seconds: float = 10.0) -> None:
    from workbench.runs import pid_alive

    t0 = time.monotonic()
    while pid_alive(pid):  # a zombie (dead, not yet reaped by the pool) counts as gone
        assert time.monotonic() - t0 < seconds, f"pid {pid} still alive"
        time.sleep(0.05)


def test_a_worker_killed_while_planning_is_a_clear_error(cost):
    ahead = PlanAhead("_slow_planner:plan_until_cancelled", cost)
    try:
        ahead.warm_up(timeout=60)
        pid = _planning_worker(ahead)
        ahead.submit(("long", [100, 200]))
        time.sleep(0.3)  # planning, for up to a minute
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=f"while batch 'long' was queued or being planned .pid {pid} killed by "
                                             f"SIGKILL"):
            ahead.get("long", timeout=30)
        with pytest.raises(WorkerDied, match="killed by SIGKILL"):  # and it stays dead
            ahead.submit(("next", [100]))
    finally:
        ahead.close()


def test_a_worker_killed_between_batches_is_a_clear_error(cost):
    ahead = PlanAhead("greedy", cost)
    try:
        ahead.warm_up(timeout=60)
        pid = _planning_worker(ahead)
        os.kill(pid, signal.SIGKILL)
        _gone(pid)
        with pytest.raises(WorkerDied, match=f"pid {pid} killed by SIGKILL"):
            ahead.submit(("b", [100, 200]))  # refused at once, or handed to the dead pool and failed in get
            ahead.get("b", timeout=30)
    finally:
        ahead.close()


def test_the_trainers_planner_goes_on_inline_with_the_same_plans(cost, sampler, tmp_path):
    """RankZeroPlanner (rank 0 of a run): the worker killed while it plans the next batch; that
    batch and every later one are planned inline, each plan equal to the planner's own plan of that
    batch; the run's status and stderr say so once."""
    from workbench import runs
    from workbench.runtime.train import RankZeroPlanner

    run = runs.new_run("train", {}, root=tmp_path, run_id="r")
    planner = RankZeroPlanner("_slow_planner:plan_slow", cost, seed=3, effort=1.0, time_limit=None, max_len=16384, ahead=True,
                              run_dir=run.path)
    try:
        assert planner.mode == "ahead"
        pid = _planning_worker(planner._ahead)
        batches = sampler.take(4)
        got = [planner.payload(batches[0], batches[1])]  # batch 1 now planning in the worker
        os.kill(pid, signal.SIGKILL)
        got += [planner.payload(b, nxt) for b, nxt in zip(batches[1:], batches[2:] + [None])]
    finally:
        planner.close()
    for b, msg in zip(batches, got):
        assert "error" not in msg, msg
        # "_slow_planner:plan_slow" plans as greedy does, after a pause
        want = run_planner("greedy", b.lengths, cost, seed=3, effort=1.0, max_len=16384, batch_id=b.batch_id)
        got_plan, want_plan = msg["plan"], want.to_dict()
        for d in (got_plan, want_plan):
            d.pop("solve_seconds")
        assert got_plan == want_plan
    assert planner.mode == "inline" and planner.worker_pids() == []
    assert f"pid {pid} killed by SIGKILL" in planner.note and "before step 2" in planner.note
    st = run.status()
    assert st.warnings == [planner.note]  # once
    assert st.resolved["planning"].startswith("inline")


def test_the_worker_does_not_import_the_parents_main_module(tmp_path):
    """A rank's ``__main__`` is ``workbench.runtime.train`` (``python -m``), which imports torch; spawn
    would import it again in the planning worker (a second of CPU, a few hundred MB). Checked from the
    worker process's own mapped libraries, with a main module of our own that imports a library the
    planner never loads (sqlite3's extension: cheap to import, unlike torch; a real rank's worker
    and torch: tests/test_faults.py, test_a_ranks_planning_worker_does_not_load_torch)."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "rank_like_main.py").write_text(textwrap.dedent("""
        import sys
        import sqlite3  # noqa: F401  (as workbench.runtime.train imports torch)
        from workbench.cost import CostModel
        from workbench.models import get_model
        from workbench.solve.ahead import PlanAhead
        from workbench.specs import ClusterSpec, load_profile

        if __name__ == "__main__":
            cost = CostModel(load_profile("a100-40g-flexsp"), get_model("7b"), ClusterSpec(num_gpus=8, gpus_per_node=8))
            with PlanAhead("greedy", cost, effort=0.2) as ahead:
                ahead.submit(("b0", [4096, 1024, 512]))
                plan = ahead.get("b0", timeout=60)
                pid = ahead.worker_pids()[0]
                maps = open(f"/proc/{pid}/maps").read()
                print(len(plan.micro_steps) > 0, "_sqlite3" in maps, "_sqlite3" in open("/proc/self/maps").read(),
                      "__spec__" in vars(sys.modules["__main__"]))
    """))
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc to read the worker's mapped libraries")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    p = subprocess.run([sys.executable, "-m", "rank_like_main"], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    # planned; the worker never loaded the main module's library (which the main process has, so the
    # probe sees it); the parent's main module kept its spec
    assert p.stdout.split() == ["True", "False", "True", "True"]
