"""Groups of any size (issue 35): contiguous rank ranges of any degree, context parallelism over any
``c``, process groups made on demand.

In one process (fast):

- ``plan_rank_sets``: the rank sets a plan's process groups are made for, in order, against a list
  written by hand; ``GroupRegistry.ensure`` calls ``new_group`` for exactly the missing ones, in
  that order (``new_group`` recorded, no process group needed), and never twice;
- ``check_plan`` accepts groups on any contiguous range (``(1, 2)``, ``(3, 4, 5)`` on 6 ranks) of a
  candidate degree, and refuses ranks that are not contiguous, out of the world, overlapping in a
  free micro-step, of a degree or split the run has no process groups for; old aligned plans pass;
- the CP layout with ``c = 3, 5, 6`` on lengths that are not multiples of ``2c``: every position
  held once, the keys of every local chunk its sequence's prefix, every target on one rank (the
  checks of ``tests/test_cp.py``, run for these splits).

In a world of 3 gloo ranks (slow): a sub-world of the shared torchrun launch (``tests/_torchrun.py``:
once the 4-rank files' checks are done, ranks 0-2 form a new default process group of 3, with its own
communicators, as a ``--nproc-per-node 3`` launch would; alone, this file launches 3 ranks), each case
one SGD step in fp32 against the independent single-process update (``tests/test_runtime_zero.py``'s
reference), within 1e-5:

- a 1x3 group (context parallelism over 3 ranks), under ZeRO-0 and ZeRO-3, lengths not multiples of 6;
- ZeRO-3 lockstep: a pass with a group on ranks (0, 1) and one on rank (2,), then a pass of a 1x3 group;
- ZeRO-0: a group on ranks (1, 2) (not aligned) beside rank 0 alone, split 2x1 then 1x2;
- the registry on real ranks: made nothing at start, every rank made the same groups in the same
  order (``plan_rank_sets`` of the plans), a plan run again made none; the world is 3 ranks, so the
  1x3 group is the default group (no ``new_group``);
- a control: the same comparison finds an update that misses one sequence's share far off (> 1e-3).
"""

from __future__ import annotations

import dataclasses

import pytest
from _torchrun import assert_all_ranks, by_check, shared_world

torch = pytest.importorskip("torch")

from test_cp import (  # noqa: E402 - the layout checks of test_cp.py, run here for c = 3, 5, 6
    test_every_position_is_held_once_in_balanced_chunks as _positions_held_once,
    test_make_shard_takes_tokens_and_labels_from_the_padded_sequence as _shard_targets_once,
    test_the_keys_of_each_local_chunk_are_its_sequence_prefix as _keys_are_prefixes,
)
from workbench.runtime import groups as groups_mod  # noqa: E402
from workbench.runtime.groups import GroupRegistry, group_rank_sets, plan_rank_sets, split_subgroups  # noqa: E402
from workbench.runtime.step import check_plan  # noqa: E402
from workbench.solve.plan import Group, MicroStep, Plan, PlanError  # noqa: E402

WORLD = 3
SUBWORLD_SIZE = WORLD
"""This file's checks run in a world of 3 (``tests/_torchrun.py``'s sub-worlds)."""
DIST_TIMEOUT_S = 60
FP32_RTOL = 1e-5
LENGTHS = [33, 7, 50, 1, 19, 23, 4]
"""Not multiples of 6 (one shorter than 2c = 6, one of a single token)."""
SHAPES = ((2, 1), (2, 2), (3, 3))
"""The worker's candidate splits: 2x1, 1x2, 1x3 (and 3x1, 1x1 implied by its degrees 1, 2, 3)."""


def _plan(micro, lengths, *, world, execution="free", zero_stage=None) -> Plan:
    """A Plan of ``micro = [[(ranks, cp, [seq, ...]), ...] per micro-step]``, groups in that order."""
    steps = tuple(MicroStep(groups=tuple(
        Group(degree=len(r), ranks=tuple(r), sequences=tuple(s), lengths=tuple(int(lengths[i]) for i in s),
              time_ms=1.0, memory_gb=0.1, cp=c) for r, c, s in ms)) for ms in micro)
    return Plan(planner="hand", status="heuristic", makespan_ms=1.0, lower_bound_ms=1.0, solve_seconds=0.0,
                micro_steps=steps, num_gpus=world, execution=execution, zero_stage=zero_stage, precision="fp32")


# ------------------------------------------------------------------------------------------------
# process groups on demand: the order, by hand
# ------------------------------------------------------------------------------------------------

SIX = _plan([[((0, 1), 1, [0]), ((2, 3, 4, 5), 2, [1])],
             [((1, 2), 1, [2]), ((3, 4, 5), 3, [3]), ((0,), 1, [4])],
             [((0, 1, 2, 3, 4, 5), 3, [5])], [((0, 1, 2, 3), 1, [6])]], LENGTHS, world=6)
SIX_SETS = [
    (0, 1),  # micro-step 0: a 2x1 group (Ulysses over its ranks)
    (2, 3), (4, 5), (2, 4), (3, 5),  # a 2x2 group: Ulysses sub-groups by CP rank, then CP sub-groups by Ulysses rank
    (1, 2),  # micro-step 1: 2x1 on ranks (1, 2), not aligned
    (3, 4, 5),  # 1x3: its CP sub-group is the group itself (no Ulysses sub-group of one rank); rank 0 alone: none
    (0, 2, 4), (1, 3, 5),  # micro-step 2: 2x3 on all six; its Ulysses pairs (0,1), (2,3), (4,5) exist already
    (0, 1, 2, 3),  # micro-step 3: 4x1
]


def test_plan_rank_sets_by_hand():
    assert plan_rank_sets(SIX) == SIX_SETS
    assert group_rank_sets((3, 4, 5), 3) == [(3, 4, 5)] and group_rank_sets((7,), 1) == []
    assert group_rank_sets((2, 3, 4, 5, 6, 7), 2) == [(2, 3, 4), (5, 6, 7), (2, 5), (3, 6), (4, 7)]
    assert split_subgroups((1, 2, 3, 4, 5, 6), 3) == ([(1, 2), (3, 4), (5, 6)], [(1, 3, 5), (2, 4, 6)])
    with pytest.raises(ValueError, match=r"ranks \[0, 2\] are not a contiguous range"):
        split_subgroups((0, 2), 1)
    with pytest.raises(ValueError, match="does not divide the group's 5 ranks"):
        group_rank_sets(range(5), 2)


class _Recorder:
    """``dist.new_group`` recorded: each call's rank list, a token per group."""

    def __init__(self):
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, ranks, backend=None, **kw):
        self.calls.append(tuple(ranks))
        return ("group", tuple(ranks))


def test_ensure_makes_the_missing_groups_in_the_plans_order(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(groups_mod.dist, "new_group", rec)
    reg = GroupRegistry(6, [1, 2, 3, 4, 6], shapes=[(4, 2), (3, 3), (6, 3)], eager=False)
    assert rec.calls == [] and len(reg) == 0
    assert reg.ensure(SIX) == SIX_SETS
    assert rec.calls == SIX_SETS and reg.made == SIX_SETS
    assert reg.ensure(SIX) == [] and len(rec.calls) == len(SIX_SETS)  # a set already made is reused
    # the sub-groups a rank runs on: a non-aligned Ulysses group, and CP over 3
    assert reg.get((1, 2)) == ("group", (1, 2))
    assert reg.subgroups((3, 4, 5), 3, 4) == (None, ("group", (3, 4, 5)))
    assert reg.subgroups((0, 1, 2, 3, 4, 5), 3, 3) == (("group", (2, 3)), ("group", (1, 3, 5)))
    # a later plan: only what is new, the whole world as the default group (no new_group)
    later = _plan([[((0, 1, 2, 3, 4, 5), 1, [0]), ((1, 2, 3, 4), 1, [1])]], LENGTHS, world=6)
    assert reg.ensure(later) == [(0, 1, 2, 3, 4, 5), (1, 2, 3, 4)]
    assert rec.calls[len(SIX_SETS):] == [(1, 2, 3, 4)]
    with pytest.raises(KeyError, match=r"no process group for ranks \[2, 3, 4, 5\].*call registry.ensure"):
        reg.get((2, 3, 4, 5))


def test_an_eager_registry_makes_its_aligned_blocks_first_and_only_the_rest_on_demand(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(groups_mod.dist, "new_group", rec)
    reg = GroupRegistry(6, [1, 2], shapes=[(2, 2)])
    assert rec.calls == [(0, 1), (2, 3), (4, 5)]
    assert reg.ensure(SIX) == [s for s in SIX_SETS if s not in [(0, 1), (2, 3), (4, 5)]]
    assert rec.calls[3:] == reg.made[3:]


def test_ensure_refuses_ranks_outside_the_world_before_making_anything(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(groups_mod.dist, "new_group", rec)
    reg = GroupRegistry(4, [1, 2], eager=False)
    bad = _plan([[((0, 1), 1, [0]), ((4, 5), 1, [1])]], LENGTHS, world=4)
    with pytest.raises(ValueError, match=r"ranks \[4, 5\] are outside 0..3"):
        reg.ensure(bad)
    assert rec.calls == []


# ------------------------------------------------------------------------------------------------
# check_plan
# ------------------------------------------------------------------------------------------------


def test_check_plan_accepts_contiguous_groups_of_any_size():
    lengths = LENGTHS
    check_plan(SIX, lengths, 6)  # any degree without degrees
    check_plan(SIX, lengths, 6, [1, 2, 3, 4, 6], shapes=[(2, 1), (4, 2), (3, 3), (6, 3), (4, 1)],
               heads=4, kv_heads=2)
    three = _plan([[((0, 1), 1, [0, 1]), ((2,), 1, [2])], [((0, 1, 2), 3, [3, 4, 5, 6])]], lengths, world=3,
                  execution="lockstep", zero_stage=3)
    check_plan(three, lengths, 3, [1, 2, 3], shapes=SHAPES, zero_stage=3, heads=4, kv_heads=2)
    # a plan written to JSON and read back (plans.jsonl) is the same plan
    from workbench.solve import plan_from_dict

    back = plan_from_dict(SIX.to_dict())
    check_plan(back, lengths, 6)
    assert plan_rank_sets(back) == SIX_SETS


def test_check_plan_still_accepts_old_aligned_plans():
    from test_cp import cp_plan

    lengths = [30, 7, 12]
    old = cp_plan([[(2, 2, [0]), (2, 1, [1])], [(4, 4, [2])]], lengths)
    assert [g.ranks for g in old.micro_steps[0].groups] in ([(0, 1), (2, 3)], [(2, 3), (0, 1)])
    check_plan(old, lengths, 4, [1, 2, 4], shapes=[(2, 1), (2, 2), (4, 4)], heads=4, kv_heads=2)


@pytest.mark.parametrize("ranks, cp, message", [
    ((0, 2), 1, r"^micro-step 0: group ranks \[0, 2\] are not a contiguous range of 2 ranks .*; plan with this "
                r"runtime's planner$"),
    ((2, 1), 1, r"group ranks \[2, 1\] are not a contiguous range of 2 ranks"),
    ((4, 5, 6), 3, r"^micro-step 0: group ranks \[4, 5, 6\] are outside ranks 0..5 \(the world size is 6\); plan "
                   r"for 6 GPUs$"),
    ((-1, 0), 1, r"group ranks \[-1, 0\] are outside ranks 0..5"),
])
def test_check_plan_refuses_ranks_that_are_not_a_range_in_the_world(ranks, cp, message):
    plan = _plan([[(ranks, cp, list(range(len(LENGTHS))))]], LENGTHS, world=6)
    with pytest.raises(PlanError, match=message):
        check_plan(plan, LENGTHS, 6)


def test_check_plan_refuses_what_it_refused_before():
    lengths = LENGTHS
    # a degree that is not one of the run's
    plan = _plan([[((1, 2, 3, 4, 5), 1, list(range(7)))]], lengths, world=6)
    with pytest.raises(PlanError, match=r"^micro-step 0: degree 5 has no process groups \(this run's candidate "
                                        r"degrees are \[1, 2, 3, 6\]\); plan with this run's cost model$"):
        check_plan(plan, lengths, 6, [1, 2, 3, 6])
    # a split that is not one of the run's shapes
    plan = _plan([[((3, 4, 5), 3, list(range(7)))]], lengths, world=6)
    with pytest.raises(PlanError, match=r"split 1x3 \(Ulysses x CP\), which has no process groups"):
        check_plan(plan, lengths, 6, [1, 3], shapes=[(3, 1)])
    # overlapping groups under free execution (fine in a lockstep pass)
    plan = _plan([[((1, 2), 1, [0, 1, 2]), ((2, 3, 4), 1, [3, 4, 5, 6])]], lengths, world=6)
    with pytest.raises(PlanError, match=r"rank\(s\) \[2\] are in two groups"):
        check_plan(plan, lengths, 6)
    check_plan(dataclasses.replace(plan, execution="lockstep"), lengths, 6)
    # a Ulysses size that does not fit the heads: 3x1 on a model of 4 query heads
    plan = _plan([[((1, 2, 3), 1, list(range(7)))]], lengths, world=6)
    with pytest.raises(PlanError, match=r"\(split 3x1\) runs Ulysses over 3 ranks, which does not fit"):
        check_plan(plan, lengths, 6, heads=4, kv_heads=2)


# ------------------------------------------------------------------------------------------------
# the CP layout for c = 3, 5, 6 (lengths not multiples of 2c)
# ------------------------------------------------------------------------------------------------

ODD_SPLITS = [(1, 3), (2, 3), (1, 5), (1, 6), (2, 5), (2, 6)]


@pytest.mark.parametrize("u, c", ODD_SPLITS)
def test_cp_layout_of_any_c_holds_every_position_once_and_selects_prefixes(u, c):
    _positions_held_once(u, c)
    _keys_are_prefixes(u, c)


@pytest.mark.parametrize("d, c", [(3, 3), (5, 5), (6, 3), (6, 6), (10, 5)])
def test_make_shard_of_any_c_puts_every_target_on_one_rank(d, c):
    _shard_targets_once(d, c)


# ------------------------------------------------------------------------------------------------
# worker side (a world of 3 ranks in the shared torchrun launch)
# ------------------------------------------------------------------------------------------------


def _cases():
    """(key, stage, plan) of the exactness checks, in the order they run."""
    n = list(range(len(LENGTHS)))
    return [
        ("cp3_z0", 0, _plan([[((0, 1, 2), 3, n)]], LENGTHS, world=WORLD, zero_stage=0)),
        ("cp3_z3", 3, _plan([[((0, 1, 2), 3, n)]], LENGTHS, world=WORLD, execution="lockstep", zero_stage=3)),
        # pass 0: a 2x1 group on ranks (0, 1) beside rank 2 alone; pass 1: 1x3 over all three
        ("mixed_z3", 3, _plan([[((0, 1), 1, [0, 3, 4]), ((2,), 1, [1, 5])], [((0, 1, 2), 3, [2, 6])]], LENGTHS,
                              world=WORLD, execution="lockstep", zero_stage=3)),
        # not aligned: ranks (1, 2) as a 2x1 group, then as a 1x2 group, rank 0 alone beside them
        ("unaligned_z0", 0, _plan([[((0,), 1, [0, 1]), ((1, 2), 1, [2, 3])], [((1, 2), 2, [4, 5]), ((0,), 1, [6])]],
                                  LENGTHS, world=WORLD, zero_stage=0)),
    ]


def _check_steps(registry, rank: int) -> dict:
    import torch.distributed as dist

    from test_runtime_zero import _compare, _reference_update, _run_stage
    from workbench.models import get_model
    from workbench.runtime.model import Transformer

    spec = get_model("tiny")
    gen = torch.Generator().manual_seed(35)
    seqs = [torch.randint(0, spec.vocab, (n,), generator=gen) for n in LENGTHS]
    init = {n: p.detach().clone() for n, p in Transformer(spec, seed=3).named_parameters()}
    world = dist.get_world_size()
    refs, out = {}, {"made_at_start": {"ok": len(registry) == 0 and world == WORLD, "groups": len(registry),
                                       "world_size": world}}
    expected: list = []
    for key, stage, plan in _cases():
        if stage not in refs:
            refs[stage] = _reference_update(spec, seqs, "fp32", stage, "sgd", 3)
        ref, ref_loss, _ = refs[stage]
        before = list(registry.made)
        full, res, _, _ = _run_stage(registry, spec, plan, seqs, stage=stage, precision="fp32")
        worst, where = _compare(full, ref, init)
        loss_rel = abs(res.loss - ref_loss) / ref_loss
        again = registry.ensure(plan)  # the plan's groups all exist now
        expected += [s for s in plan_rank_sets(plan) if s not in expected and len(s) < WORLD]
        out[f"step_{key}"] = {"ok": worst < FP32_RTOL and loss_rel < FP32_RTOL and again == [],
                              "worst_rel": worst, "worst_param": where, "loss_rel": loss_rel,
                              "made": [list(s) for s in registry.made[len(before):]], "again": again,
                              "execution": res.execution,
                              "groups": [[(g["ranks"], g["cp"]) for g in r.groups] for r in res.records]}
    # the control: the same comparison tells an update apart from one that misses a sequence's share
    other, _, _ = _reference_update(spec, seqs[1:], "fp32", 0, "sgd", 3)
    worst, _ = _compare(other, refs[0][0], init)
    out["control"] = {"ok": worst > 1e-3, "worst_rel": worst}
    out["made_in_plan_order"] = {"ok": registry.made == expected, "made": [list(s) for s in registry.made],
                                 "expected": [list(s) for s in expected]}
    return out


def _check_world_of_3(rank: int) -> dict:
    """In the world of 3: a registry that makes no group at start (training's), then the checks."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    registry = GroupRegistry(dist.get_world_size(), [1, 2, 3], shapes=SHAPES, eager=False)
    return _check_steps(registry, rank)


def subworld_checks() -> list:
    """The checks this file runs in its world of 3 (``tests/_torchrun.py``)."""
    return [_check_world_of_3]


# ------------------------------------------------------------------------------------------------
# pytest side
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """This file's checks in its world of 3 of the shared launch (once a session, ``tests/_torchrun.py``)."""
    return by_check(shared_world(request, tmp_path_factory, __name__))


@pytest.mark.slow
@pytest.mark.untimed
@pytest.mark.parametrize("stage", [0, 3])
def test_cp_over_3_ranks_equals_single_process(results, stage):
    assert_all_ranks(results, f"step_cp3_z{stage}", WORLD)
    assert all(v["groups"] == [[[[0, 1, 2], 3]]] for v in results[f"step_cp3_z{stage}"].values())


@pytest.mark.slow
@pytest.mark.untimed
def test_lockstep_group_of_2_beside_1_then_1x3_equals_single_process(results):
    assert_all_ranks(results, "step_mixed_z3", WORLD)
    per_rank = results["step_mixed_z3"]
    assert per_rank["0"]["execution"] == "lockstep"
    assert per_rank["2"]["groups"] == [[[[2], 1]], [[[0, 1, 2], 3]]]


@pytest.mark.slow
@pytest.mark.untimed
def test_a_group_on_ranks_1_2_equals_single_process(results):
    assert_all_ranks(results, "step_unaligned_z0", WORLD)
    assert results["step_unaligned_z0"]["1"]["groups"] == [[[[1, 2], 1]], [[[1, 2], 2]]]


@pytest.mark.slow
@pytest.mark.untimed
def test_the_comparison_sees_a_missing_sequence(results):
    assert_all_ranks(results, "control", WORLD)


@pytest.mark.slow
@pytest.mark.untimed
def test_every_rank_made_the_plans_groups_on_demand_in_one_order(results):
    assert_all_ranks(results, "made_at_start", WORLD)
    assert {v["world_size"] for v in results["made_at_start"].values()} == {WORLD}
    assert_all_ranks(results, "made_in_plan_order", WORLD)
    made = {r: v["made"] for r, v in results["made_in_plan_order"].items()}
    assert len({str(m) for m in made.values()}) == 1, made
    # 1x3 on all ranks is the default group (no new_group); then (0, 1) and (1, 2): nothing else
    assert made["0"] == [[0, 1], [1, 2]]
    assert results["step_cp3_z0"]["0"]["made"] == [] and results["step_unaligned_z0"]["0"]["made"] == [[1, 2]]
