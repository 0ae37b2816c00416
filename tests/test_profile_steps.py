"""What a step costs beyond its layers, and predictions that hold where they run: the profiler's fits
of its real steps (the head, a micro-step's and a lockstep pass's fixed costs, the pass's compute
factor, the optimizer) against synthetic measurements with known coefficients, the lockstep pass
model and ``--check`` of a lockstep run computed by hand, the machine profile cache, the note a
run planned with another machine's profile carries, and the load a run ran under. Pure: no torch,
milliseconds."""

from __future__ import annotations

import html
import itertools
import json
import time

import numpy as np
import pytest

from conftest import run_cli
from workbench import runs
from workbench.cost import CostModel
from workbench.cost.memory import parameter_shapes
from workbench.models import get_model
from workbench.profile import check_fidelity
from workbench.profile.fit import fit_line, wire_bytes
from workbench.profile.result import build_result, fit_head
from workbench.specs import ClusterSpec, HardwareProfile, load_profile

TINY = get_model("tiny")  # 2 layers, hidden 64, 4 heads (2 KV) of 16, ffn 172, vocab 256, fp32
L = TINY.layers
BLOCK = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 172 + 2 * 64  # q, o; k, v; MLP; two norms
UNITS = [256 * 64, BLOCK, BLOCK, 64 + 256 * 64]  # FSDP units: embedding, 2 blocks, final norm + head
PARAMS = sum(UNITS)


def _profile(**kw) -> HardwareProfile:
    base = dict(name="t", gpu="g", model="tiny", forward={"a": 0.0, "b": 0.01, "c": 1.0},
                backward={"a": 0.0, "b": 0.02, "c": 2.0}, all_to_all_gbps={2: 1e9, 4: 1e9}, gpu_memory_gb=8.0,
                provenance={"kind": "measured"})
    base.update(kw)
    return HardwareProfile(**base)


# ------------------------------------------------------------------------------------------------
# fits
# ------------------------------------------------------------------------------------------------


def test_fit_line_recovers_slope_and_intercept():
    assert fit_line([256, 1024, 4096], [0.05 + 0.0005 * t for t in (256, 1024, 4096)]) == pytest.approx((0.0005, 0.05))
    assert fit_line([512, 512], [1.0, 3.0]) == pytest.approx((2.0 / 512, 0.0))  # one x: median y / x
    with pytest.raises(ValueError, match="positive"):
        fit_line([0, 1], [1, 2])


def test_head_is_taken_out_of_the_whole_model_rows_by_hand():
    head = fit_head([{"tokens": t, "forward_ms": 0.05 + 5e-4 * t, "backward_ms": 0.08 + 1e-3 * t} for t in (256, 1024, 4096)])
    assert head["forward_per_token"] == pytest.approx(5e-4) and head["backward_intercept"] == pytest.approx(0.08)
    from workbench.profile.result import _blocks_only

    row = {"pack": [1024], "tokens": 1024, "forward_ms": 10.0, "backward_ms": 20.0}
    out = _blocks_only([row], head, layers=2)[0]
    # per layer: the whole model's time less the head's per-token part, shared over the 2 layers
    assert out["forward_ms"] == pytest.approx(10.0 - 5e-4 * 1024 / 2)
    assert out["backward_ms"] == pytest.approx(20.0 - 1e-3 * 1024 / 2)
    assert out["model_forward_ms"] == 10.0


def _group_ms(pack, *, m=0.7, af=2e-6, ab=4e-6, bf=0.004, bb=0.008, cf=0.3, cb=0.4, hf=5e-4, hb=1e-3):
    """A degree-1 group by hand: the blocks' curves times the layers, the head per token, the
    micro-step's fixed cost."""
    q, t = sum(s * s for s in pack), sum(pack)
    return L * ((af + ab) * q + (bf + bb) * t + cf + cb) + (hf + hb) * t + m


def _link_ms(kind, m, lat, gbps, d=2):
    return lat + wire_bytes(kind, m, d) / (gbps * 1e9) * 1e3


def _synthetic(*, m=0.7, fixed=12.0, factor=1.25, rate0=9.0, rate3=45.0):
    packs = [[64], [256], [1024], [4096], [64] * 16, [256] * 8, [512] * 8]
    compute = []
    for p in packs:  # whole model per layer: blocks plus the head's per-token part over the layers
        t = sum(p)
        compute.append({"pack": p, "tokens": t, "role": "fit",
                        "forward_ms": 2e-6 * sum(s * s for s in p) + 0.004 * t + 0.3 + 5e-4 * t / L,
                        "backward_ms": 4e-6 * sum(s * s for s in p) + 0.008 * t + 0.4 + 1e-3 * t / L})
    head = [{"tokens": t, "forward_ms": 0.05 + 5e-4 * t, "backward_ms": 0.08 + 1e-3 * t} for t in (256, 1024, 4096)]
    links = {"all_to_all": (0.1, 1.0), "allreduce": (0.3, 2.0), "allgather": (0.2, 1.0), "reduce_scatter": (0.3, 0.5)}
    coll = [{"kind": k, "group_size": 2, "message_bytes": b, "ms": _link_ms(k, b, lat, bw)}
            for k, (lat, bw) in links.items() for b in (65536, 181760, 1 << 20)]
    comm = sum(2 * _link_ms("allgather", 4 * u, 0.2, 1.0) + _link_ms("reduce_scatter", 4 * u, 0.3, 0.5) for u in UNITS)
    grad = _link_ms("allreduce", 4 * PARAMS, 0.3, 2.0)

    def groups(pack):
        return [{"degree": 1, "ranks": [r], "lengths": pack} for r in (0, 1)]

    steps = []
    work = {"busy": _group_ms([512], m=m), "heavy": _group_ms([256] * 8, m=m)}
    for name, pack in (("busy", [512]), ("heavy", [256] * 8)):
        w = work[name]
        steps.append({"name": f"free-{name}", "execution": "free", "micro_steps": [groups(pack)],
                      "micro_step_ms": [[w, w]], "step_ms": [w + grad] * 2, "allreduce_ms": [grad] * 2,
                      "optimizer_ms": [rate0 * PARAMS / 1e6] * 2, "updated_params": [PARAMS] * 2})
        p = factor * w + comm + fixed
        steps.append({"name": f"lockstep-{name}", "execution": "lockstep", "micro_steps": [groups(pack)],
                      "micro_step_ms": [[p, p - 1.0]], "step_ms": [p] * 2, "allreduce_ms": [0.1] * 2,
                      "optimizer_ms": [rate3 * 61856 / 1e6] * 2, "updated_params": [61856] * 2})
    idle = factor * _group_ms([8], m=m) + comm + fixed  # rank 0 runs 8 tokens, rank 1 an empty pass
    steps.append({"name": "lockstep-idle", "execution": "lockstep",
                  "micro_steps": [[{"degree": 1, "ranks": [0], "lengths": [8]}]], "micro_step_ms": [[idle, idle]],
                  "step_ms": [idle] * 2, "allreduce_ms": [0.1] * 2, "optimizer_ms": [rate3 * 61856 / 1e6] * 2,
                  "updated_params": [61856] * 2})
    return {"model": "tiny", "world_size": 2, "device": "cpu", "compute": compute, "collectives": coll, "head": head,
            "steps": steps, "memory": {"activation_mb_per_token": 0.013}, "meta": {
                "name": "synthetic", "gpu": "CPU test (2 cores)", "gpu_memory_gb": 8.0,
                "provenance": {"kind": "measured", "source": "test", "device": "cpu", "world_size": 2}}}, comm


def test_step_terms_are_fitted_from_synthetic_real_steps_by_hand():
    res = build_result(_synthetic()[0])
    p = res.profile
    assert p.forward.a == pytest.approx(2e-6) and p.backward.b == pytest.approx(0.008) and p.forward.c == pytest.approx(0.3)
    assert p.head_ms_per_token == pytest.approx(1.5e-3)
    assert p.allgather_gbps[2] == pytest.approx(1.0) and p.allgather_latency_ms[2] == pytest.approx(0.2)
    assert p.reduce_scatter_gbps[2] == pytest.approx(0.5) and p.reduce_scatter_latency_ms[2] == pytest.approx(0.3)
    assert p.micro_step_ms == pytest.approx(0.7)
    assert p.pass_comm_overlap == 0.0  # a CPU profile: FSDP's collectives run on the compute thread
    assert p.pass_overhead_ms[2] == pytest.approx(12.0) and p.pass_compute_factor[2] == pytest.approx(1.25)
    assert p.optimizer_ms_per_mparam == pytest.approx(9.0) and p.sharded_optimizer_ms_per_mparam == pytest.approx(45.0)
    for key in ("head", "micro_step", "pass_overhead", "optimizer"):
        assert key in p.provenance, key
    # the profile predicts its own real steps: every pass, group and whole step
    passes = [r for r in res.steps if r.get("execution") == "lockstep" and "micro_step" in r and not r.get("fit")]
    assert len(passes) == 3 and all(r["predicted_ms"] == pytest.approx(r["measured_ms"]) for r in passes)
    whole = [r for r in res.steps if r.get("step")]
    assert len(whole) == 5 and p.provenance["steps_error"]["worst_ape"] < 1e-6


def test_a_profile_without_steps_leaves_the_step_terms_out():
    data, _ = _synthetic()
    data = {**data, "steps": [], "head": []}
    p = build_result(data).profile
    assert p.head_ms_per_token is None and p.micro_step_ms is None
    assert not p.pass_overhead_ms and not p.pass_compute_factor and p.optimizer_ms_per_mparam is None
    assert p.pass_comm_overlap is None  # unmeasured: the cost model keeps the published (overlapped) pass


# ------------------------------------------------------------------------------------------------
# the lockstep pass model
# ------------------------------------------------------------------------------------------------


def test_pass_without_overlap_and_with_its_compute_factor_by_hand():
    cl = ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0)  # ZeRO-3
    prof = _profile(allgather_gbps={4: 2.0}, allgather_latency_ms={4: 0.5}, reduce_scatter_gbps={4: 1.0},
                    pass_overhead_ms={4: 3.0}, pass_comm_overlap=0.0, pass_compute_factor={4: 1.2},
                    sharded_optimizer_ms_per_mparam=40.0, optimizer_ms_per_mparam=8.0)
    cost = CostModel(prof, TINY, cl)

    def ag(n):
        return 3 / 4 * n * 4 / 2e9 * 1e3 + 0.5

    def rs(n):
        return 3 / 4 * n * 4 / 1e9 * 1e3

    comm = sum(2 * ag(u) + rs(u) for u in UNITS)
    assert cost.fsdp_comm_ms() == pytest.approx(comm)
    assert cost.pass_comm_ms() == 0.0  # nothing overlaps: every collective adds to the pass
    assert cost.pass_overhead_ms() == pytest.approx(comm + 3.0)
    assert cost.pass_ms(10.0) == pytest.approx(10.0 + comm + 3.0)
    # inside a pass the same work takes 1.2 times as long; a free micro-step's does not change
    free = CostModel(prof, TINY, ClusterSpec(num_gpus=4, gpus_per_node=4, gpu_memory_gb=8.0, zero_stage=0))
    s = np.array([600, 300])
    assert cost.time(s, 2) == pytest.approx(1.2 * free.time(s, 2))
    assert cost.call_overhead_ms() == pytest.approx(1.2 * free.call_overhead_ms()) == pytest.approx(1.2 * 2 * 3.0)
    # the optimizer: FSDP's shards (ceil(rows / 4) rows of every tensor) at the sharded rate
    shard = sum(-(-x[0] // 4) * int(np.prod(x[1:])) for _, x in parameter_shapes(TINY))
    assert cost.optimizer_ms() == pytest.approx(40.0 * shard / 1e6)
    assert free.optimizer_ms() == pytest.approx(8.0 * PARAMS / 1e6)
    half = CostModel(_profile(allgather_gbps={4: 2.0}, allgather_latency_ms={4: 0.5}, reduce_scatter_gbps={4: 1.0},
                              pass_comm_overlap=0.5), TINY, cl)
    first = ag(UNITS[0]) + rs(UNITS[0])
    assert half.pass_comm_ms() == pytest.approx(comm / 2)
    assert half.pass_overhead_ms() == pytest.approx(comm / 2 + first / 2)


# ------------------------------------------------------------------------------------------------
# --check of a lockstep run, by hand
# ------------------------------------------------------------------------------------------------


def _lockstep_run(root, *, resolved=None):
    run = runs.new_run("train", {"scenario": {"model": "tiny", "num_gpus": 2, "gpus_per_node": 2, "planner": "greedy",
                                              "profile": "cpu-gloo-tiny", "zero_stage": 3, "precision": "fp32"},
                                 "nproc": 2, "optimizer": "adamw"}, root=root)

    def g(ranks, ls):
        return {"degree": len(ranks), "ranks": ranks, "sequences": list(range(len(ls))), "lengths": ls, "time_ms": 1.0,
                "memory_gb": 0.0}

    plan = {"planner": "greedy", "status": "heuristic", "makespan_ms": 70.0, "lower_bound_ms": 1.0, "solve_seconds": 0.0,
            "num_gpus": 2, "execution": "lockstep", "zero_stage": 3, "precision": "fp32",
            "micro_steps": [{"groups": [g([0], [100, 300]), g([1], [200])], "time_ms": 1.0},
                            {"groups": [g([0, 1], [400])], "time_ms": 1.0}]}
    for step in (0, 1):
        runs.append_jsonl(run.file(runs.PLANS_FILE), {"step": step, "attempt": 1, "plan": plan})
        for rank, (p0, p1) in ((0, (60.0, 40.0)), (1, (58.0, 41.0))):
            runs.append_jsonl(run.file(runs.METRICS_FILE), {
                "step": step, "rank": rank, "attempt": 1, "step_ms": p0 + p1 + 1, "measured_ms": p0 + p1 + 1 + 2.5,
                "optimizer_ms": 2.5, "allreduce_ms": 0.4, "predicted_ms": 70.0,
                "micro_steps": [{"micro_step": 0, "degree": 1, "ranks": [rank], "measured_ms": p0},
                                {"micro_step": 1, "degree": 2, "ranks": [0, 1], "measured_ms": p1}]})
    if resolved:
        runs.update_status(run.path, resolved=resolved)
    return run


def test_check_fidelity_compares_lockstep_passes_by_hand(tmp_path):
    run = _lockstep_run(tmp_path)
    prof = _profile(allgather_gbps={2: 1e9}, allgather_latency_ms={2: 0.5}, reduce_scatter_gbps={2: 1e9},
                    reduce_scatter_latency_ms={2: 0.25}, pass_overhead_ms={2: 5.0}, pass_comm_overlap=0.0,
                    pass_compute_factor={2: 1.5}, sharded_optimizer_ms_per_mparam=40.0)
    out = check_fidelity(prof, run.path)
    # per layer fwd+bwd: 0.03 ms/token and 3 ms per call; 2 layers; x1.5 inside a pass
    #   pass 0: rank 0 [100, 300]: 1.5 * (2 * 0.03 * 400 + 6) = 45; rank 1 [200]: 1.5 * 18 = 27
    #   pass 1: the d2 group [400]: 1.5 * (2 * 0.03 * 400 / 2 + 6) = 27
    #   each pass + FSDP's collectives (4 units x (2 x 0.5 + 0.25) ms; their bytes ~0) + 5 ms fixed
    comm = 4 * (2 * 0.5 + 0.25)
    opt = 40.0 * 61856 / 1e6  # ZeRO-3: rank 0's shard of the tiny model
    assert out["execution"] == "lockstep" and out["groups"] == [] and len(out["passes"]) == 2
    p0, p1 = sorted(out["passes"], key=lambda r: r["pass"])
    assert p0["predicted_ms"] == pytest.approx(45 + comm + 5) and p0["measured_ms"] == 60.0  # the slowest rank's
    assert p1["predicted_ms"] == pytest.approx(27 + comm + 5) and p1["measured_ms"] == 41.0
    st = out["steps"][0]
    assert st["predicted_ms"] == pytest.approx(45 + 27 + 2 * (comm + 5) + opt)
    assert st["measured_ms"] == pytest.approx(60 + 40 + 1 + 2.5)  # rank 0's step with its optimizer step
    assert st["predicted_optimizer_ms"] == pytest.approx(opt) and st["optimizer_ms"] == 2.5
    assert out["pass_error"]["count"] == 2 and out["optimizer_error"]["count"] == 1
    from workbench.profile.fidelity import fidelity_table

    text = fidelity_table(out)
    assert "| lockstep pass | 2 |" in text and "ZeRO-3, lockstep passes" in text and "| optimizer step |" in text


# ------------------------------------------------------------------------------------------------
# this machine's profile: fingerprint, cache, note
# ------------------------------------------------------------------------------------------------


def test_fingerprint_names_the_machine_and_process_count():
    from workbench.profile.machine import machine_fingerprint, same_machine

    a, b = machine_fingerprint(2), machine_fingerprint(2)
    assert a == b and set(a) == {"cpu", "cores", "torch", "device", "nproc", "key"}
    from importlib import metadata

    assert a["torch"] == metadata.version("torch") and a["device"] == "cpu" and a["nproc"] == 2
    c = machine_fingerprint(4)
    assert c["key"] != a["key"] and not same_machine(a, c)
    with pytest.raises(ValueError, match="cpu or cuda"):
        machine_fingerprint(2, device="tpu")
    # a CUDA image's package metadata and torch.__version__ differ by the local tag (seen on an H200:
    # 2.11.0 and 2.11.0+cu130): the same torch; another release is not
    gpu = {**a, "torch": "2.11.0", "device": "cuda NVIDIA H200", "nproc": 1}
    assert same_machine(gpu, {**gpu, "torch": "2.11.0+cu130"})
    assert not same_machine(gpu, {**gpu, "torch": "2.12.0+cu130"})


_MADE = itertools.count()


def _cached(root, fp, *, state="done", damage=None, model="tiny", version=None):
    """A machine profile run as ``ensure_machine_profile`` leaves one, without measuring (by this
    profiler, or by the one of ``version``; 1: before context parallelism, which wrote none)."""
    from workbench.profile.result import PROFILER_VERSION

    # run ids order by the second they were made, then by their 4 hex digits: a counter there keeps
    # the entries of one second in the order they were made, where waiting a second each took 10 s
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-profile-{next(_MADE) % 0x10000:04x}"
    run = runs.new_run("profile", {"model": model, "nproc": fp["nproc"], "quick": True, "fingerprint": fp}, root=root,
                       run_id=run_id)
    prov = {"kind": "measured", "device": "cpu", "world_size": fp["nproc"], "fingerprint": fp,
            "versions": {"torch": fp["torch"]}, "profiler_version": version or PROFILER_VERSION}
    if version == 1:
        del prov["profiler_version"]
    prof = _profile(name=f"cpu-gloo-tiny-{fp['nproc']}r", gpu=f"CPU {fp['cpu']} ({fp['cores']} cores)",
                    provenance=prov)
    prof.save(run.file(runs.PROFILE_FILE))
    if damage == "truncated":
        run.file(runs.PROFILE_FILE).write_text(run.file(runs.PROFILE_FILE).read_text()[:50])
    elif damage == "missing":
        run.file(runs.PROFILE_FILE).unlink()
    runs.update_status(run.path, state=state)
    return run


def test_the_cache_reuses_this_machines_profile_and_passes_over_the_rest(tmp_path):
    from workbench.profile.machine import ensure_machine_profile, find_machine_profile, machine_fingerprint

    fp = machine_fingerprint(2)
    assert find_machine_profile(2, root=tmp_path) is None
    good = _cached(tmp_path, fp)
    _cached(tmp_path, machine_fingerprint(4))  # another process count
    _cached(tmp_path, {**fp, "cpu": "another CPU"})  # another machine
    _cached(tmp_path, fp, state="failed")
    _cached(tmp_path, fp, damage="truncated")
    _cached(tmp_path, fp, damage="missing")
    found = find_machine_profile(2, root=tmp_path)
    assert found is not None and found.run == good and not found.measured
    assert load_profile(found.path).name == "cpu-gloo-tiny-2r"
    seen = []
    again = ensure_machine_profile(2, root=tmp_path, progress=lambda f, m: seen.append((f, m)))
    assert again.run == good and not again.measured and seen and "reusing" in seen[-1][1]
    assert len(runs.list_runs(tmp_path, kind="profile")) == 6  # nothing measured
    newer = _cached(tmp_path, fp)
    assert find_machine_profile(2, root=tmp_path).run == newer  # the newest good one
    # a damaged newest entry is passed over: the good one before it is reused
    _cached(tmp_path, fp, damage="truncated")
    assert find_machine_profile(2, root=tmp_path).run == newer
    # so is one the profiler wrote before it measured context parallelism: plans would price CP without
    # this machine's figures; on one process there is no CP to measure, so an old one still serves
    _cached(tmp_path, fp, version=1)
    assert find_machine_profile(2, root=tmp_path).run == newer
    one = machine_fingerprint(1)
    old_single = _cached(tmp_path, one, version=1)
    assert find_machine_profile(1, root=tmp_path).run == old_single


def test_a_profile_from_another_machine_says_so():
    from workbench.profile.machine import machine_fingerprint, profile_origin_note

    note = profile_origin_note(load_profile("cpu-gloo-tiny"), 2)
    assert note and note.startswith("profile cpu-gloo-tiny is from another machine")
    assert "4 processes" in note and "workbench profile --quick --nproc 2" in note
    fp = machine_fingerprint(2)
    mine = _profile(provenance={"kind": "measured", "fingerprint": fp})
    assert profile_origin_note(mine, 2) is None
    other = profile_origin_note(mine, 4)
    assert "differs in process count" in other
    assert "a reference profile" in profile_origin_note(load_profile("a100-40g-flexsp"), 2)


def test_runs_show_says_where_the_profile_came_from_and_the_load(tmp_path):
    note = "profile cpu-gloo-tiny is from another machine: measured on X"
    run = _lockstep_run(tmp_path, resolved={"profile": "cpu-gloo-tiny", "profile_note": note})
    for load1, running in ((1.5, 2), (2.5, 3), (2.0, 2)):
        runs.append_jsonl(run.file(runs.LOAD_FILE), {"t": 0.0, "load1": load1, "load5": 1.0, "load15": 1.0,
                                                    "running": running})
    s = run.summary()
    assert s["profile_note"] == note and s["profile"] == "cpu-gloo-tiny"
    la = s["load_average"]
    assert la["mean"] == pytest.approx(2.0) and la["start"] == 1.5 and la["max"] == 2.5 and la["end"] == 2.0
    assert la["samples"] == 3 and la["running_mean"] == pytest.approx(7 / 3) and "2 process(es)" in la["text"]
    out = run_cli("runs", "show", run.id, "--root", str(tmp_path)).stdout
    assert f"note: {note}" in out and "load average during the run: 2.0" in out
    chk = check_fidelity(_profile(), run.path)
    assert any("load average during the run" in n for n in chk["notes"]) and chk["load_average"]["mean"] == 2.0


def test_the_load_sampler_writes_the_machines_load(tmp_path):
    s = runs.LoadSampler(tmp_path, interval=0.05).start()
    time.sleep(0.3)
    s.stop()
    rows, skipped = runs.read_jsonl(tmp_path / runs.LOAD_FILE)
    assert skipped == 0 and len(rows) >= 3
    assert all(r["load1"] >= 0 and r["running"] >= 1 for r in rows)
    now = runs.read_loadavg()
    assert now is not None and now["load1"] == pytest.approx(float(open("/proc/loadavg").read().split()[0]), abs=1.0)


def test_the_demo_report_states_the_profile_the_error_and_the_load(tmp_path):
    from workbench.demo import _prediction_blocks

    note = "profile cpu-gloo-tiny is from another machine: measured on X"
    run = _lockstep_run(tmp_path, resolved={"profile": "cpu-gloo-tiny", "profile_note": note})
    runs.append_jsonl(run.file(runs.LOAD_FILE), {"t": 0.0, "load1": 1.25, "running": 2})
    blocks = _prediction_blocks(run, run.summary(), None)
    text = json.dumps(blocks)
    assert blocks[0][0] == "warn" and note in blocks[0][1]
    assert "workbench profile --check" in text and "median error" in text
    assert "The machine's load during the run" in text and "1.2" in text


def test_hardware_panel_reuses_this_machines_cached_profile(tmp_path):
    from widgets import HardwarePanel
    from workbench.profile.machine import machine_fingerprint

    cached = _cached(tmp_path, machine_fingerprint(2))
    panel = HardwarePanel("cpu-gloo-tiny", root=tmp_path)
    assert panel.measure_this_machine(nproc=2) is None  # nothing started: the cached one is selected
    assert panel.profile_ref == str(cached.file(runs.PROFILE_FILE)) and panel.profile.name == "cpu-gloo-tiny-2r"
    assert "reusing this machine's quick profile" in html.unescape(panel.run_status.value) and panel.run is None
    assert len(runs.list_runs(tmp_path, kind="profile")) == 1


def test_short_sequences_get_their_own_attention_coefficient_by_hand():
    from workbench.profile.fit import choose_short_len, fit_compute, predict_pack, short_len_candidates
    from workbench.specs import ComputeCurve

    packs = [[64], [256], [1024], [4096], [64] * 16, [256] * 8, [512] * 8, [256] * 16, [512] * 16]
    assert short_len_candidates(packs) == [362, 724]  # two lengths each side at least

    def t(p, k):  # per layer; sequences under 724 tokens cost twice as much per token pair
        return k * (sum((2 * 4e-6 if s < 724 else 4e-6) * s * s for s in p) + 0.01 * sum(p) + 0.5)

    rows = [{"pack": p, "role": "fit", "forward_ms": t(p, 1.0), "backward_ms": t(p, 2.0)} for p in packs]
    rows.append({"pack": [128] * 8, "role": "heldout", "forward_ms": t([128] * 8, 1.0), "backward_ms": t([128] * 8, 2.0)})
    assert choose_short_len(packs, [t(p, 3.0) for p in packs]) == 724
    comp = fit_compute(rows)
    f = comp["forward"].curve
    assert comp["short_len"] == 724 and (f.short_len, f.a, f.a_short, f.b) == pytest.approx((724, 4e-6, 8e-6, 0.01))
    assert comp["backward"].curve.a_short == pytest.approx(16e-6) and comp["heldout"]["total"]["worst_ape"] < 1e-6
    # one coefficient where it fits: no threshold
    one = [{"pack": p, "role": "fit", "forward_ms": 4e-6 * sum(s * s for s in p) + 0.01 * sum(p) + 0.5,
            "backward_ms": 1.0 + 0.02 * sum(p)} for p in packs]
    assert fit_compute(one)["short_len"] is None
    curve = ComputeCurve(a=4e-6, b=0.01, c=0.5, a_short=8e-6, short_len=724)
    assert predict_pack(curve, [512, 1024]) == pytest.approx(8e-6 * 512**2 + 4e-6 * 1024**2 + 0.01 * 1536 + 0.5)
    # the cost model: a 512-token sequence at the short coefficient, a 1,024 one at the long, x2 layers
    prof = _profile(forward={"a": 4e-6, "b": 0.01, "c": 0.5, "a_short": 8e-6, "short_len": 724},
                    backward={"a": 8e-6, "b": 0.02, "c": 1.0, "a_short": 16e-6, "short_len": 724})
    cost = CostModel(prof, TINY, ClusterSpec(num_gpus=2, gpus_per_node=2, gpu_memory_gb=8.0, zero_stage=0))
    got = cost.compute_ms([512, 1024], 2)
    assert got == pytest.approx([2 * (24e-6 * 512**2 + 0.03 * 512) / 2, 2 * (12e-6 * 1024**2 + 0.03 * 1024) / 2])
    with pytest.raises(ValueError, match="go together"):
        ComputeCurve(a=1.0, b=1.0, a_short=2.0)


def test_check_counts_the_plan_ahead_solver_on_the_ranks_cores(tmp_path):
    prof = _profile(allgather_gbps={2: 1e9}, allgather_latency_ms={2: 0.5}, reduce_scatter_gbps={2: 1e9},
                    reduce_scatter_latency_ms={2: 0.25}, pass_overhead_ms={2: 5.0}, pass_comm_overlap=0.0)
    base = check_fidelity(prof, _lockstep_run(tmp_path / "a").path)["steps"][0]["predicted_ms"]
    run = _lockstep_run(tmp_path / "b", resolved={"device": "cpu", "planning": "ahead", "local_world_size": 2,
                                                  "machine": {"cores": 2}})
    nxt = json.loads(run.file(runs.PLANS_FILE).read_text().splitlines()[-1])
    nxt["step"], nxt["plan"]["solve_seconds"] = 2, 0.08  # solved by the worker while step 1 trained
    runs.append_jsonl(run.file(runs.PLANS_FILE), nxt)
    out = check_fidelity(prof, run.path)
    st = out["steps"][0]
    assert st["step"] == 1 and st["planner_cpu_ms"] == pytest.approx(80 / 2)  # 80 ms of solving over 2 cores
    assert st["predicted_ms"] == pytest.approx(base + 40)
    # spread over the step's passes in proportion: every pass stretched by 1 + 40 / (the passes' sum)
    before = check_fidelity(prof, _lockstep_run(tmp_path / "c").path)["passes"]
    stretch = 1 + 40 / sum(p["predicted_ms"] for p in before if p["step"] == 1)
    after = [p for p in out["passes"] if p["step"] == 1]
    assert [p["predicted_ms"] for p in after] == pytest.approx([stretch * p["predicted_ms"] for p in before
                                                                if p["step"] == 1])
    assert any("plan-ahead worker" in n for n in out["notes"])
    # with a core to spare, or planning inline, the solver takes nothing from the ranks
    runs.update_status(run.path, resolved={"local_world_size": 1})
    assert check_fidelity(prof, run.path)["steps"][0]["planner_cpu_ms"] == 0.0


def test_a_cpu_run_without_a_profile_plans_with_this_machines_cached_one(tmp_path):
    from workbench.profile.machine import machine_fingerprint
    from workbench.training import prepare_train

    settings = {"steps": 1, "nproc": 2, "device": "cpu", "max_len": 256, "batch_tokens": 1024}
    _, spec, _ = prepare_train(settings, root=tmp_path, dry_run=True)
    assert spec.scenario.profile == "cpu-gloo-tiny" and not runs.list_runs(tmp_path)  # none cached; nothing written
    cached = _cached(tmp_path, machine_fingerprint(2))
    _, spec, _ = prepare_train(settings, root=tmp_path, dry_run=True)
    assert spec.scenario.profile == str(cached.file(runs.PROFILE_FILE))
    _, spec, _ = prepare_train({**settings, "nproc": 1}, root=tmp_path, dry_run=True)
    assert spec.scenario.profile == "cpu-gloo-tiny"  # another process count: not this one's
    _, spec, _ = prepare_train({**settings, "profile": "cpu-gloo-tiny"}, root=tmp_path, dry_run=True)
    assert spec.scenario.profile == "cpu-gloo-tiny"  # a profile named is the profile used
