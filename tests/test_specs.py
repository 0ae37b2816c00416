import json

import pytest

from workbench.models import get_model
from workbench.specs import ClusterSpec, HardwareProfile, ModelSpec, list_profiles, load_profile


def test_presets_round_trip_json():
    for name in ("tiny", "1b", "7b", "13b", "30b", "70b"):
        m = get_model(name)
        assert ModelSpec.from_json(m.to_json()) == m


def test_7b_parameter_count_by_hand():
    m = get_model("7b")
    h, f, v, L = 4096, 11008, 32000, 32
    per_layer = 4 * h * h + 3 * h * f + 2 * h
    assert m.params() == 2 * v * h + L * per_layer + h  # untied embeddings, final norm
    assert 6.7e9 < m.params() < 6.8e9


def test_70b_uses_grouped_query_attention():
    m = get_model("70b")
    assert m.kv_heads == 8 and m.heads == 64 and m.kv_dim == 1024


def test_cluster_defaults_and_round_trip():
    c = ClusterSpec(num_gpus=64)
    # divisors of the node (8), whole nodes in 2^a and 3 x 2^a (1, 2, 3, 4, 6, 8 nodes), the cluster
    assert c.degrees == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert ClusterSpec.from_json(c.to_json()) == c
    # ZeRO shares (FlexSP): 16 bytes/param x share
    m = get_model("7b")
    assert c.model_state_gb(m) == pytest.approx(16 * m.params() / 64 / 1e9)
    c2 = ClusterSpec(num_gpus=64, zero_stage=2)
    assert c2.model_state_gb(m) == pytest.approx(16 * m.params() * (7 / 8 / 64 + 1 / 8) / 1e9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_gpus=0), "num_gpus must be a positive integer"),
    (dict(num_gpus=12, gpus_per_node=8), "multiple of gpus_per_node"),
    (dict(num_gpus=8, degrees=(1, 16)), "outside 1..num_gpus"),
    (dict(num_gpus=8, zero_stage=4), "zero_stage"),
    (dict(num_gpus=8, usable_memory_fraction=1.5), "usable_memory_fraction"),
])
def test_cluster_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=100, heads=3), "divisible by heads"),
    (dict(kv_heads=3), "multiple of kv_heads"),
    (dict(layers=-1), "layers must be a positive integer"),
])
def test_model_rejects_bad_values(kwargs, match):
    base = dict(name="m", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ModelSpec(**base)


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="presets are tiny, 1b, 7b"):
        get_model("8x7b")


def test_profiles_ship_with_provenance_and_round_trip(tmp_path):
    assert {"a100-40g-flexsp", "h100-80g"} <= set(list_profiles())
    a = load_profile("a100-40g-flexsp")
    assert a.provenance["kind"] == "reference" and "FlexSP" in a.provenance["source"]
    h = load_profile("h100-80g")
    assert h.is_estimate and "ESTIMATE" in h.provenance["source"]
    path = a.save(tmp_path / "p.json")
    assert load_profile(path) == a
    assert HardwareProfile.from_dict(json.loads(path.read_text())) == a


def test_profile_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown profile 'nope'"):
        load_profile("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        load_profile(bad)
    d = load_profile("a100-40g-flexsp").to_dict()
    d["provenance"] = {}
    (tmp_path / "noprov.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="provenance.kind"):
        load_profile(tmp_path / "noprov.json")
    d = load_profile("a100-40g-flexsp").to_dict()
    d["bogus"] = 1
    with pytest.raises(ValueError, match="unknown field"):
        HardwareProfile.from_dict(d)


def test_cp_attention_factor_loads_like_the_other_size_tables(tmp_path):
    # a profile written before the field existed loads with none; one that has it round-trips, keyed by c
    old = load_profile("a100-40g-flexsp").to_dict()
    del old["cp_attention_factor"]
    assert HardwareProfile.from_dict(old).cp_attention_factor == {}
    new = dict(old, cp_attention_factor={"4": 0.5, "2": 0.3})
    p = HardwareProfile.from_dict(new)
    assert p.cp_attention_factor == {2: 0.3, 4: 0.5}
    path = p.save(tmp_path / "p.json")
    assert load_profile(path) == p and json.loads(path.read_text())["cp_attention_factor"] == {"2": 0.3, "4": 0.5}
    with pytest.raises(ValueError, match="finite number >= 0"):
        HardwareProfile.from_dict(dict(old, cp_attention_factor={"2": -0.1}))


def test_split_residual_tables_load_keyed_by_the_split(tmp_path):
    # a profile written before split_overhead_ms / split_token_ms existed loads with none; one that has
    # them round-trips, keyed by the split "u x c" (normalised, in increasing c then u)
    old = load_profile("a100-40g-flexsp").to_dict()
    del old["split_overhead_ms"], old["split_token_ms"]
    prof = HardwareProfile.from_dict(old)
    assert prof.split_overhead_ms == {} and prof.split_token_ms == {}
    p = HardwareProfile.from_dict(dict(old, split_overhead_ms={"4x2": 0.5, " 2 X 4": 0.25, "2x2": 1.5},
                                       split_token_ms={"2x2": 0.002}))
    assert p.split_overhead_ms == {"2x2": 1.5, "4x2": 0.5, "2x4": 0.25}
    assert list(p.split_overhead_ms) == ["2x2", "4x2", "2x4"] and p.split_token_ms == {"2x2": 0.002}
    path = p.save(tmp_path / "p.json")
    assert load_profile(path) == p
    assert json.loads(path.read_text())["split_overhead_ms"] == {"2x2": 1.5, "4x2": 0.5, "2x4": 0.25}


@pytest.mark.parametrize("table, match", [
    ({"2x1": 1.0}, "only composite splits"), ({"1x4": 1.0}, "only composite splits"),
    ({"2by2": 1.0}, "not a split"), ({"2x2x2": 1.0}, "not a split"), ({"2": 1.0}, "not a split"),
    ({"2x2": -0.5}, "finite number >= 0"), ({"2x2": float("nan")}, "finite number >= 0"),
    ({"2x2": True}, "finite number >= 0"), ([1.0], "must be an object")])
def test_bad_split_residual_table_is_one_clear_error(tmp_path, table, match):
    import dataclasses

    old = load_profile("a100-40g-flexsp").to_dict()
    with pytest.raises(ValueError, match=match):
        HardwareProfile.from_dict(dict(old, split_token_ms=table))
    with pytest.raises(ValueError, match=f"HardwareProfile a100-40g-flexsp: split_overhead_ms: .*{match}"):
        dataclasses.replace(load_profile("a100-40g-flexsp"), split_overhead_ms=table)
    (tmp_path / "p.json").write_text(json.dumps(dict(old, split_overhead_ms=table)))
    with pytest.raises(ValueError, match=r"p\.json: ") as e:
        load_profile(tmp_path / "p.json")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n, g, want", [
    (6, 6, (1, 2, 3, 4, 5, 6)),  # one node: every degree up to it
    (3, 8, (1, 2, 3)),  # fewer GPUs than a node
    (24, 8, (1, 2, 4, 8, 16, 24)),  # 1, 2, 3 nodes
    (48, 8, (1, 2, 4, 8, 16, 24, 32, 48)),  # 1, 2, 3, 4, 6 nodes
    (40, 8, (1, 2, 4, 8, 16, 24, 32, 40)),  # 5 nodes: the cluster itself
    (12, 4, (1, 2, 4, 8, 12)),
    (12, 3, (1, 3, 6, 9, 12)),  # 1, 2, 3, 4 nodes of 3
])
def test_candidate_degrees_by_hand(n, g, want):
    from workbench.specs import candidate_degrees

    assert candidate_degrees(n, g) == want
    assert ClusterSpec(num_gpus=n, gpus_per_node=min(g, n) if n < g else g).degrees == want


def _maximal_chains_brute_force(ds):
    """Every subset of ds in which each divides the next and no element of ds can be added."""
    import itertools

    out = set()
    for r in range(1, len(ds) + 1):
        for sub in itertools.combinations(sorted(ds), r):
            if all(b % a == 0 for a, b in zip(sub, sub[1:])):
                out.add(sub)
    def extendable(c):
        return any(all((x % y == 0 or y % x == 0) for y in c) and x not in c for x in ds)
    return {c for c in out if not extendable(c)}


@pytest.mark.parametrize("ds", [(1, 2, 3, 4, 5, 6), (1, 2, 4, 8, 16, 24, 32, 48, 64), (1, 2, 4, 8, 12), (3, 4, 6, 12),
                                (1, 2, 4, 8, 16, 24, 32, 40)])
def test_degree_chains_are_the_maximal_divisibility_chains(ds):
    from workbench.specs import degree_chains

    got = degree_chains(ds)
    assert set(got) == _maximal_chains_brute_force(ds) and len(got) == len(set(got))
    pow2 = tuple(d for d in ds if d & (d - 1) == 0)
    if pow2 and 1 in ds:
        assert set(pow2) <= set(got[0])  # the powers of two first: a power-of-two set plans as before
    assert degree_chains((1, 2, 4, 8)) == ((1, 2, 4, 8),)


def test_any_degree_is_accepted_and_costed_across_nodes_where_its_blocks_straddle():
    c = ClusterSpec(num_gpus=16, gpus_per_node=8, degrees=(1, 3, 8, 16))
    assert c.degrees == (1, 3, 8, 16)
    # blocks of 3 on 16 GPUs: [6, 9) straddles the node boundary at 8; 8 and 16 are whole nodes
    assert [c.crosses_nodes(d) for d in (1, 2, 3, 4, 8, 16)] == [False, False, True, False, False, True]
    one = ClusterSpec(num_gpus=6, gpus_per_node=6)  # one node: nothing crosses
    assert not any(one.crosses_nodes(d) for d in one.degrees)
