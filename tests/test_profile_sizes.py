"""Issue 35 (groups of any size), the profiler's part: which group sizes a profile measures its
collectives at (every size up to 8, 3 and 6 included, then the ones that tile the ranks), and how
the cost model says where a size's link figure comes from (measured, interpolated between two
measured sizes, or extrapolated beyond them: ``CostModel.link_source``), checked against figures
computed here by hand; and one real 3-rank profile on CPU whose tables hold size 3 (its ranks a
sub-world of the shared torchrun launch, tests/_torchrun.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from conftest import cli_main, run_cli
from workbench.cost import CostModel
from workbench.models import get_model
from workbench.profile import ProfileSpec, cp_blocks, default_group_sizes, micro_step_sizes
from workbench.specs import ClusterSpec, load_profile

# ------------------------------------------------------------------------------------------------
# the sizes a profile measures
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, node, sizes", [
    (1, None, []),
    (2, None, [2]),
    (3, None, [2, 3]),
    (4, None, [2, 3, 4]),
    (6, None, [2, 3, 4, 5, 6]),
    (8, None, [2, 3, 4, 5, 6, 7, 8]),
    (12, None, [2, 3, 4, 5, 6, 7, 8, 12]),
    (16, None, [2, 3, 4, 5, 6, 7, 8, 12, 16]),
    (20, None, [2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20]),  # 10 tiles the 20 ranks; 12, 16: 3 x 2^2, 2^4
    (64, None, [2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64]),
    # nodes of 8: every size within a node, then whole nodes in twos and threes (no 12: it straddles nodes)
    (64, 8, [2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 48, 64]),
    (16, 4, [2, 3, 4, 8, 12, 16]),
])
def test_the_profile_measures_every_size_up_to_8_then_the_ones_that_tile(world, node, sizes):
    assert default_group_sizes(world, node) == sizes


def test_resolved_sizes_collectives_everywhere_micro_steps_at_power_of_two_divisors():
    m4 = ProfileSpec(model="tiny", nproc=4).resolved("cpu")
    assert m4["group_sizes"] == [2, 3, 4] and m4["cp_sizes"] == [2, 3, 4]
    assert m4["micro_step_sizes"] == [2, 4] and m4["cp_splits"] == [[2, 2], [4, 4], [4, 2]]  # as before
    m3 = ProfileSpec(model="tiny", nproc=3).resolved("cpu")
    assert m3["group_sizes"] == [2, 3] and m3["cp_sizes"] == [2, 3]
    assert m3["micro_step_sizes"] == [] and m3["cp_splits"] == []
    m6 = ProfileSpec(model="tiny", nproc=6).resolved("cpu")
    assert m6["group_sizes"] == [2, 3, 4, 5, 6] and m6["micro_step_sizes"] == [2] and m6["cp_splits"] == [[2, 2]]
    assert micro_step_sizes([2, 3, 4, 5, 6, 7, 8], 8) == [2, 4, 8]
    # each CP size on the largest measured group it divides: 2 strided over the 4 ranks, 3 on {0, 1, 2}
    assert cp_blocks([2, 3, 4], [2, 3, 4]) == {2: 4, 3: 3, 4: 4}
    assert cp_blocks([2, 3, 4, 5, 6], [2, 3, 4, 5, 6]) == {2: 6, 3: 6, 4: 4, 5: 5, 6: 6}
    # --group-sizes: any size from 2 to --nproc
    assert ProfileSpec(model="tiny", nproc=4, group_sizes=(3,)).resolved("cpu")["group_sizes"] == [3]
    with pytest.raises(ValueError, match="group size 5 cannot be formed from 4"):
        ProfileSpec(model="tiny", nproc=4, group_sizes=(5,))


# ------------------------------------------------------------------------------------------------
# where a size's figure comes from
# ------------------------------------------------------------------------------------------------


def _cost(strategy="ulysses", num_gpus=8, per_node=8, degrees=(), **tables):
    prof = dataclasses.replace(load_profile("cpu-gloo-tiny"), **tables)
    return CostModel(prof, get_model("tiny"), ClusterSpec(num_gpus=num_gpus, gpus_per_node=per_node, degrees=degrees),
                     strategy=strategy)


def _by_hand(lo, hi, d, bw_lo, bw_hi):
    """The figure between two measured sizes, written out: a line in log(size) through log(bandwidth)."""
    t = (math.log(d) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp((1 - t) * math.log(bw_lo) + t * math.log(bw_hi))


def test_size_3_is_interpolated_between_2_and_4_and_size_8_extrapolated():
    cost = _cost(all_to_all_gbps={2: 10.0, 4: 40.0})
    three = cost.link_source("all_to_all", 3)
    # t = log(3/2) / log(2) = 0.585; 10 * 4^0.585 = 22.5 GB/s
    assert three["source"] == "interpolated" and three["sizes"] == [2, 4] and three["table"] == "all_to_all_gbps"
    assert three["gbps"] == pytest.approx(_by_hand(2, 4, 3, 10.0, 40.0)) == pytest.approx(22.5, abs=0.05)
    assert three["gbps"] == pytest.approx(cost.link_gbps("all_to_all", 3))  # the figure the time uses
    eight = cost.link_source("all_to_all", 8)
    assert eight["source"] == "extrapolated" and eight["sizes"] == [4] and eight["gbps"] == 40.0
    assert cost.link_source("all_to_all", 2) == {"kind": "all_to_all", "size": 2, "across_nodes": False,
                                                 "table": "all_to_all_gbps", "source": "measured", "sizes": [2],
                                                 "gbps": 10.0}
    # below the smallest measured size: held too
    low = _cost(all_to_all_gbps={4: 40.0, 8: 80.0}).link_source("all_to_all", 2)
    assert low["source"] == "extrapolated" and low["sizes"] == [4] and low["gbps"] == 40.0
    # without tables of their own, all-gather and reduce-scatter read the all-reduce's (as cp_link_gbps does)
    ag = _cost(all_to_all_gbps={2: 10.0}, allgather_gbps={}, allreduce_gbps={2: 3.0, 4: 6.0}).link_source("allgather", 3)
    assert ag["table"] == "allreduce_gbps" and ag["sizes"] == [2, 4]
    assert ag["gbps"] == pytest.approx(_by_hand(2, 4, 3, 3.0, 6.0))
    none = _cost(all_to_all_gbps={2: 10.0}, allgather_gbps={}, allreduce_gbps={}).link_source("allgather", 2)
    assert none["source"] == "none" and none["gbps"] == 0.0
    with pytest.raises(ValueError, match="unknown link kind"):
        cost.link_source("broadcast", 2)


def test_across_nodes_the_entries_over_a_node_are_read():
    """A profile of nodes of 4 with entries up to 16: within a node only the entries up to 4, across
    nodes only those over it."""
    cost = _cost(num_gpus=16, per_node=4, degrees=(1, 2, 4, 8, 16), gpus_per_node=4,
                 all_to_all_gbps={2: 10.0, 4: 20.0, 8: 2.0, 16: 4.0})
    within = cost.link_source("all_to_all", 3, crosses=False)
    assert within["sizes"] == [2, 4] and within["table"] == "all_to_all_gbps up to 4 ranks"
    assert within["gbps"] == pytest.approx(_by_hand(2, 4, 3, 10.0, 20.0))
    across = cost.link_source("all_to_all", 12)
    assert across["across_nodes"] and across["table"] == "all_to_all_gbps over 4 ranks"
    assert across["source"] == "interpolated" and across["sizes"] == [8, 16]
    assert across["gbps"] == pytest.approx(_by_hand(8, 16, 12, 2.0, 4.0))
    assert cost.link_source("all_to_all", 8)["source"] == "measured"


def test_the_cost_table_and_its_line_name_the_interpolated_and_extrapolated_sizes():
    """CP over 2, 3 and 6 ranks with all-gather and reduce-scatter measured at 2 and 4: 3 between 2
    and 4, 6 beyond 4 (4's figure held)."""
    tables = dict(all_to_all_gbps={2: 10.0, 4: 40.0}, allgather_gbps={2: 5.0, 4: 20.0},
                  reduce_scatter_gbps={2: 4.0, 4: 16.0})
    cost = _cost("cp", num_gpus=6, per_node=6, degrees=(1, 2, 3, 6), **tables)
    est = cost.estimated_links()
    assert [(r["kind"], r["size"], r["source"], r["sizes"]) for r in est] == [
        ("allgather", 3, "interpolated", [2, 4]), ("allgather", 6, "extrapolated", [4]),
        ("reduce_scatter", 3, "interpolated", [2, 4]), ("reduce_scatter", 6, "extrapolated", [4])]
    assert est[0]["gbps"] == pytest.approx(_by_hand(2, 4, 3, 5.0, 20.0))
    assert est[0]["gbps"] == pytest.approx(cost.cp_link_gbps("allgather", 3, 3))
    line = cost.estimated_links_note()
    assert "\n" not in line
    assert "CP all-gather interpolated at 3 (between 2 and 4)" in line
    assert "CP all-gather extrapolated at 6 (4's figure)" in line
    assert cost.table([1024], [1, 2, 3, 6])["estimated_links"] == est
    assert cost.table([1024], [1, 2])["estimated_links"] == []
    assert "every group size's figure measured" in cost.estimated_links_note([2])


def test_workbench_cost_prints_the_line_and_json_lists_them(tmp_path, capsys):
    """The line through the console script; the JSON through its entry in this process."""
    prof = dataclasses.replace(load_profile("cpu-gloo-tiny"), all_to_all_gbps={2: 10.0, 4: 40.0},
                               allgather_gbps={2: 5.0, 4: 20.0}, reduce_scatter_gbps={2: 4.0, 4: 16.0})
    path = tmp_path / "p.json"
    prof.save(path)
    args = ["cost", "--profile", str(path), "--model", "tiny", "--gpus", "6", "--gpus-per-node", "6",
            "--gpu-memory", "80", "--degrees", "1,2,3,6", "--lengths", "1024", "--strategy", "cp"]
    out = run_cli(*args).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("links not measured")]
    assert len(line) == 1 and "interpolated at 3 (between 2 and 4)" in line[0] and "extrapolated at 6" in line[0]
    data = json.loads(cli_main(capsys, *args, "--json").stdout)
    assert {(r["kind"], r["size"], r["source"]) for r in data["estimated_links"]} == {
        ("allgather", 3, "interpolated"), ("allgather", 6, "extrapolated"),
        ("reduce_scatter", 3, "interpolated"), ("reduce_scatter", 6, "extrapolated")}
    assert "inter_node_degrees" in data  # the sibling key stays


# ------------------------------------------------------------------------------------------------
# a real profile on 3 gloo ranks
# ------------------------------------------------------------------------------------------------


# The 3-rank profile's ranks are a sub-world of 3 of the shared torchrun launch (tests/_torchrun.py's
# SUBWORLD_SIZE and subworld_checks; this file's alone), whose ranks have imported torch already: they
# run the profiler's rank on the prepared run (conftest.profile_rank_in_subworld). The launcher's side
# of a profile run (torchrun under the supervisor, the run's final state) is test_profile_run.py's.

SUBWORLD_SIZE = 3


def world_prepare(folder: Path) -> list[str]:
    """Pytest side (before the shared launch): the 3-rank profile run prepared in ``folder``. A small
    grid (no real steps, no micro-steps at these sizes), one timed sample a pack of one call (no
    minimum sample length)."""
    from workbench.profile import prepare_profile

    run = prepare_profile(nproc=3, model="tiny", quick=True, root=folder, name="p3", device="cpu", oversubscribe=True,
                          max_len=256, reps=1, warmup=1, steps=False, fit_packs=[[64], [128], [256], [32] * 4],
                          heldout_packs=[[96]], group_packs=[[128]], message_bytes=[8192, 65536], collective_reps=3,
                          collective_inner=2, min_sample_ms=0.0)
    return [str(run.path)]


def subworld_checks(run_dir: str) -> list:
    """Rank side: each rank's exit status from the profiler on ``run_dir``."""
    from conftest import profile_rank_in_subworld

    return [lambda rank: {"exit": profile_rank_in_subworld(run_dir, rank), "run": run_dir}]


@pytest.mark.slow
@pytest.mark.untimed
def test_a_three_rank_profile_measures_sizes_2_and_3(request, tmp_path_factory):
    """3 ranks: size 2 on the block {0, 1} while rank 2 waits, size 3 on all of them; CP at 2 on
    {0, 1}, at 3 the world (the run ``world_prepare`` made): the test reads which sizes were measured."""
    from _torchrun import shared_world

    from workbench import runs
    from workbench.profile import load_result

    per_rank = shared_world(request, tmp_path_factory, __name__)
    run = runs.load_run(per_rank["0"]["run"])
    st = runs.read_status(run.path)  # as rank 0 left it (no supervisor marks it done: its ranks are the launch's)
    assert [per_rank[str(r)]["exit"] for r in range(3)] == [0, 0, 0] and st.progress == 1.0, (st, run.log_tail(30))
    assert st.error is None and st.message.startswith("done in"), st
    meas = json.loads((run.path / "measurements.json").read_text())
    a2a = {c["group_size"]: c for c in meas["collectives"] if c["kind"] == "all_to_all"}
    assert set(a2a) == {2, 3}
    assert a2a[2]["idle_ranks"] == [2] and len(a2a[2]["per_rank"]) == 2 and "idle_ranks" not in a2a[3]
    cp = {(c["kind"], c["group_size"], c["stride"]) for c in meas["collectives"] if c["kind"].startswith("cp_")}
    assert cp == {(k, c, 1) for k in ("cp_allgather", "cp_reduce_scatter") for c in (2, 3)}
    prof = load_result(run).profile
    assert set(prof.all_to_all_gbps) == {2, 3} and set(prof.p2p_gbps) == {2, 3}
    assert set(prof.allgather_gbps) == {2, 3} and set(prof.reduce_scatter_gbps) == {2, 3}
    assert prof.provenance["grid"]["group_sizes"] == [2, 3] and prof.provenance["grid"]["micro_step_sizes"] == []
