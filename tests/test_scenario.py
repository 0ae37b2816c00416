"""Scenario: validation, JSON round trip, and that what it builds matches hand-built references.

The references are built independently: the cost model from its published constants, the max
context from the memory formula by hand, the batches from the sampler called directly.
"""

import json

import numpy as np
import pytest

from workbench.data import is_length_list
from workbench.scenario import Scenario, aligned_degrees

A, B, C = 5.128e-6, 0.1840, 629.4  # FlexSP GPT-7B on A100-40G: ms per token^2, per token, per group
ACT = 4.48e6  # bytes of activations per token (FlexSP, 7B)


def test_round_trip_and_hash():
    sc = Scenario(num_gpus=16, gpus_per_node=8, source="github", samples=5000, max_len=65536, policy="split",
                  batch_size=32, degrees=(1, 2, 4, 8), planner="greedy", seed=3, recompute=True)
    back = Scenario.from_json(json.dumps(sc.to_dict()))
    assert back == sc and hash(back) == hash(sc)
    assert sc.to_dict()["degrees"] == [1, 2, 4, 8]
    assert sc.replace(seed=4).seed == 4 and sc.seed == 3


@pytest.mark.parametrize("bad, words", [
    ({"num_gpus": 0}, "Scenario.num_gpus must be an integer >= 1"),
    ({"model": "gpt5"}, "unknown model 'gpt5'"),
    ({"planner": "magic"}, "unknown planner 'magic'"),
    ({"batch_size": 4, "batch_tokens": 100}, "not both"),
    ({"max_len": 10**7}, "exceeds model 7b's max context 393,216"),
    ({"policy": "truncate"}, "Scenario.policy must be one of clip, split, drop, error"),
    ({"time_limit": -1}, "Scenario.time_limit must be a finite number > 0"),
    ({"effort": 0}, "Scenario.effort must be a finite number > 0"),
    ({"memory_fraction": 1.5}, "Scenario.memory_fraction"),
    ({"degrees": [0, 2]}, "Scenario.degrees"),
    ({"source": ""}, "Scenario.source must be a non-empty string"),
])
def test_validation_names_the_field(bad, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        Scenario(**bad)


def test_unknown_field_in_json_is_named():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['colour'\]"):
        Scenario.from_dict({"colour": "red"})


def test_cost_matches_published_constants():
    sc = Scenario(num_gpus=64)
    cost = sc.cost()
    assert cost.time([8192], 1)[0] == pytest.approx(A * 8192**2 + B * 8192)
    assert cost.memory([8192], 1)[0] == pytest.approx(ACT * 8192 / 1e9)
    assert cost.group_overhead_ms(8) == pytest.approx(C)
    # budget: 70% of 40 GB less 16 bytes/parameter sharded over 64 GPUs (ZeRO-3: fp32 weights and
    # gradients, Adam's two moments) and FSDP's working set (two 7B blocks in bf16, one block's fp32
    # gradient)
    params = sc.model_spec().params()
    block = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert cost.execution == "lockstep"
    assert cost.memory_budget_gb == pytest.approx(0.7 * 40 - 16 * params / 64 / 1e9 - 8 * block / 1e9)


def test_default_max_len_by_hand():
    sc = Scenario(num_gpus=64)
    params = sc.model_spec().params()
    budget = 0.7 * 40 - 16 * params / 64 / 1e9
    tokens_per_gpu = budget * 1e9 / ACT
    # Ulysses alone splits 7B's 32 heads: the largest group has 32 GPUs, holding 32 GPUs' worth of tokens
    cap = min(32 * tokens_per_gpu, 393216)
    want = 1 << (int(cap).bit_length() - 1)
    assert sc.replace(strategy="ulysses").resolved_max_len() == want == 131072
    # with context parallelism (auto, the default) a group of all 64 holds twice that
    assert sc.resolved_max_len() == 2 * want
    # an explicit list is planned as given: no default clip
    assert Scenario(source="400000,10").resolved_max_len() is None
    assert Scenario(max_len=4096).resolved_max_len() == 4096


def test_lengths_and_batches_match_the_sampler():
    from workbench.data import GlobalBatchSampler, load_lengths

    sc = Scenario(source="wikipedia", samples=5000, seed=7, max_len=8192, policy="clip", batch_tokens=200_000)
    ref = load_lengths("wikipedia", samples=5000, seed=7, max_len=8192, policy="clip")
    np.testing.assert_array_equal(sc.lengths(), ref.lengths)
    assert sc.lengths().max() <= 8192
    raw = sc.lengths_set(apply_policy=False).lengths
    assert raw.max() > 8192 and raw.size == 5000
    got = sc.batches(3, start=2)
    want = GlobalBatchSampler(ref.lengths, batch_tokens=200_000, seed=7).take(3, start=2)
    assert [b.batch_id for b in got] == [b.batch_id for b in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.lengths, w.lengths)
    with pytest.raises(ValueError, match="give batch_tokens"):
        Scenario(source="wikipedia", samples=100).batches(1)


def test_explicit_list_is_one_batch_in_order():
    sc = Scenario(source="3000,100,2000", num_gpus=8)
    assert is_length_list(sc.source)
    (b,) = sc.batches(5)
    assert list(b.lengths) == [3000, 100, 2000]


def test_plan_and_simulate_through_the_scenario(small_lockstep):
    from workbench.solve import run_planner

    small_cost = small_lockstep  # the scenario's default: ZeRO-3, lockstep
    sc = Scenario(num_gpus=8, gpus_per_node=8, source="9000,5000,3000,700,700,120", planner="greedy")
    p = sc.plan()
    q = run_planner("greedy", np.array([9000, 5000, 3000, 700, 700, 120]), small_cost)
    assert p.makespan_ms == pytest.approx(q.makespan_ms)
    assert sorted(i for m in p.micro_steps for g in m.groups for i in g.sequences) == list(range(6))
    res = sc.simulate(["static-max", "greedy"], steps=1)
    assert set(res.planners) == {"static-max", "greedy"}
    assert res.planners["greedy"]["lower_bound_ms"] <= res.planners["greedy"]["mean_step_ms"]
    with pytest.raises(ValueError, match="unknown planner"):
        sc.simulate(["greedy", "nope"])


def test_cluster_degrees_fit_the_nodes():
    assert aligned_degrees(12, 3) == (1, 3, 6, 9, 12)  # within a 3-GPU node, then 1 to 4 whole nodes
    assert aligned_degrees(16, 8) == (1, 2, 4, 8, 16)
    assert Scenario(num_gpus=3, gpus_per_node=3, model="tiny", profile="cpu-gloo-tiny").cluster().degrees == (1, 2, 3)
    assert Scenario(num_gpus=4, gpus_per_node=8).cluster().gpus_per_node == 4  # capped at the cluster


def test_profile_file_and_run_folder(tmp_path):
    from workbench.specs import load_profile

    prof = load_profile("cpu-gloo-tiny")
    path = prof.save(tmp_path / "p.json")
    assert Scenario(profile=str(path), model="tiny", num_gpus=2).cost().profile == prof
    run = tmp_path / "run"
    run.mkdir()
    prof.save(run / "profile.json")
    assert Scenario(profile=str(run), model="tiny", num_gpus=2).profile_spec() == prof
    with pytest.raises(ValueError, match="is a folder, not a profile JSON file"):
        Scenario(profile=str(tmp_path), num_gpus=2).cost()


def test_the_layer_between_stays_light_and_acyclic():
    """scenario, runs, training, launch and the CLI's parser import neither torch nor ipywidgets
    (a notebook kernel that launches must not touch CUDA), and nothing in the package imports the
    CLI (no cli -> demo -> cli circle)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, workbench.scenario, workbench.runs, workbench.training, workbench.launch, workbench.demo, "
            "workbench.cli; workbench.cli.build_parser(); "
            "bad = [m for m in ('torch', 'ipywidgets', 'IPython') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    pkg = Path(__file__).resolve().parents[1] / "workbench"
    importers = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py") if p.name != "cli.py"
                 and re.search(r"^\s*(from workbench(\.cli| import cli)\b|import workbench\.cli)", p.read_text(), re.M)]
    assert importers == [], f"modules importing the CLI: {importers}"


def test_time_limit_is_the_cap_now_and_the_budget_in_specs_written_before_effort():
    # a scenario file or run spec written before plans were deterministic: its time limit was how long
    # the search ran, so it reads as that much effort (and no cap)
    old = {k: v for k, v in Scenario(time_limit=3.0).to_dict().items() if k != "effort"}
    sc = Scenario.from_dict(old, stored=True)
    assert (sc.effort, sc.time_limit) == (3.0, None)
    assert Scenario.from_json(json.dumps(old)).effort == 3.0
    # built now (a new run's settings, a panel, the CLI): the time limit is the wall-clock cap, the
    # effort the default
    sc = Scenario.from_dict({"time_limit": 0.5})
    assert (sc.effort, sc.time_limit) == (Scenario().effort, 0.5)
    # and a spec written now keeps both
    both = Scenario(effort=2.0, time_limit=7.0).to_dict()
    assert Scenario.from_dict(both, stored=True).effort == 2.0 and Scenario.from_dict(both, stored=True).time_limit == 7.0
