"""``make gpu-check`` (``workbench.gpucheck``, ``workbench.runtime.bench``) on a machine without CUDA.

- the dry run CI runs: ``make gpu-check`` with this Python, every part says it needs CUDA, exit 0;
- the CPU rehearsal: every part's code on CPU with toy sizes, its figures checked against what the
  test computes from the same files (the memory model, the FLOPs, the fidelity check);
- the orchestration with stand-in parts: budgets, a part that crashes, a part left out for time;
- PyTorch's varlen kernel across its three signatures (2.10, 2.11, 2.12+), with stand-ins that
  compute with SDPA and refuse what the real signatures refuse.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench import gpucheck

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.untimed
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without CUDA")
def test_make_gpu_check_dry_run_without_cuda(tmp_path):
    out = tmp_path / "gc"
    p = subprocess.run(["make", "-s", "gpu-check", f"PY={sys.executable}", f"GPU_CHECK_ARGS=--out {out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert res["cuda"] is False and res["ok"] is True and res["counts"]["skip"] == len(gpucheck.DEFAULT_PARTS)
    assert [x["name"] for x in res["parts"]] == list(gpucheck.DEFAULT_PARTS)  # offload runs when asked
    for part in res["parts"]:
        assert part["status"] == "skip" and part["summary"].startswith("needs CUDA: torch ")
        assert "CPU build" in part["summary"] or "sees no GPU" in part["summary"]
    assert res["machine"]["torch"] == torch.__version__ and res["machine"]["cuda_available"] is False
    md = (out / "report.md").read_text()
    assert f"**0 ok, 0 warn, 0 fail, {len(gpucheck.DEFAULT_PARTS)} skipped" in md and "device: no CUDA device" in md
    for name in gpucheck.DEFAULT_PARTS:
        assert f"| {name} | skip | 0 | needs CUDA" in md
    assert "gpu-check: 0 ok, 0 warn, 0 fail" in p.stderr


def test_the_check_imports_neither_torch_nor_the_notebook_stack():
    code = ("import sys, workbench.gpucheck, workbench.doctor, workbench.trace\n"
            "bad = sorted(m for m in ('torch', 'plotly', 'ipywidgets', 'ortools', 'pandas') if m in sys.modules)\n"
            "print(bad)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_budget_shares_and_bad_input(tmp_path):
    every = gpucheck.GpuCheck(tmp_path / "a")
    assert gpucheck.DEFAULT_PARTS == tuple(p for p in gpucheck.PARTS if p != "offload")
    assert every.budget_s == gpucheck.DEFAULT_BUDGET_S == pytest.approx(sum(s for k, (_, s) in gpucheck.PARTS.items()
                                                                            if k != "offload")) == 480.0
    assert every.shares == {k: s for k, (_, s) in gpucheck.PARTS.items() if k != "offload"}
    assert gpucheck.GpuCheck(tmp_path / "o", parts=["offload"]).shares == {"offload": gpucheck.PARTS["offload"][1]}
    # --parts in any order run in the check's order; --budget-s shared in proportion
    two = gpucheck.GpuCheck(tmp_path / "b", parts=["profile", "attention"], budget_s=105)
    a, p = gpucheck.PARTS["attention"][1], gpucheck.PARTS["profile"][1]
    assert two.names == ["attention", "profile"] and two.shares == pytest.approx({"attention": 105 * a / (a + p),
                                                                                 "profile": 105 * p / (a + p)})
    assert gpucheck.GpuCheck(tmp_path / "c", parts=["peak"]).budget_s == gpucheck.PARTS["peak"][1]
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['gpu'\]; the parts are doctor, peak"):
        gpucheck.GpuCheck(tmp_path, parts=["gpu"])
    with pytest.raises(ValueError, match="--budget-s must be a positive"):
        gpucheck.GpuCheck(tmp_path, budget_s=0)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file; give a folder"):
        gpucheck.GpuCheck(tmp_path / "f")


def test_a_crashing_part_and_a_spent_budget_are_reported_and_the_check_goes_on(tmp_path, monkeypatch):
    clock = [1000.0]  # the check's clock, moved by the stand-in parts: the budget is spent without waiting
    monkeypatch.setattr(gpucheck.time, "monotonic", lambda: clock[0])
    check = gpucheck.GpuCheck(tmp_path / "gc", parts=["doctor", "peak", "attention", "train-1b"], budget_s=3,
                              say=lambda m: None)
    check._env_probe = lambda: {"cuda_available": True, "torch": "x", "gpu": {"name": "NVIDIA H100 80GB HBM3"}}
    ran = []

    def doctor(part):
        ran.append("doctor")
        part.status, part.summary = "ok", "fine"

    def peak(part):
        ran.append("peak")
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    def attention(part):
        ran.append("attention")
        clock[0] += max(0.0, check.left() - 0.1)  # spend the budget: train-1b is left out
        part.status, part.summary = "warn", "slow"

    check.part_doctor, check.part_peak, check.part_attention = doctor, peak, attention
    check.part_train_1b = lambda part: ran.append("train-1b")
    res = check.run()
    assert ran == ["doctor", "peak", "attention"]
    by = {p["name"]: p for p in res["parts"]}
    assert by["peak"]["status"] == "fail" and by["peak"]["summary"] == \
        "crashed: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert by["train-1b"]["status"] == "skip" and "of the budget left" in by["train-1b"]["summary"]
    assert "--parts train-1b" in by["train-1b"]["summary"]
    assert res["counts"] == {"ok": 1, "warn": 1, "fail": 1, "skip": 1} and res["ok"] is False
    assert json.loads((tmp_path / "gc" / "result.json").read_text())["summary"] == res["summary"]
    assert "| peak | fail |" in (tmp_path / "gc" / "report.md").read_text()


def test_datasheet_rates_by_device_name():
    from workbench.runtime.bench import datasheet_tflops

    assert datasheet_tflops("NVIDIA H100 80GB HBM3") == 989.4  # SXM5
    assert datasheet_tflops("NVIDIA H100 PCIe") == 756.5
    assert datasheet_tflops("NVIDIA H100 NVL") == 835.5
    assert datasheet_tflops("NVIDIA H200") == 989.4
    assert datasheet_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert datasheet_tflops("Tesla V100-SXM2-32GB") is None


def _packed(lengths, H=4, KV=2, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = torch.randn(T, H, hd, generator=g), torch.randn(T, KV, hd, generator=g), torch.randn(T, KV, hd, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal: bool):
    """A stand-in kernel: causal or full SDPA per sequence; K/V heads must equal Q heads unless asked."""
    import torch.nn.functional as F

    out = []
    b = cu_q.tolist()
    for lo, hi in zip(b[:-1], b[1:]):
        qi, ki, vi = (t[lo:hi].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("release", ["2.10", "2.11", "2.12"])
def test_torch_varlen_across_its_signatures(monkeypatch, release):
    import torch.nn.attention.varlen as varlen_mod

    from workbench.runtime.attention import torch_varlen_attention
    from workbench.runtime.bench import torch_varlen_fn

    calls = []

    def check_kv(q, k):
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("key heads must equal query heads")  # 2.10/2.11: no grouped-query heads

    if release == "2.10":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            calls.append({"is_causal": is_causal})
            check_kv(query, key)
            return _sdpa_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)
    elif release == "2.11":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)):
            calls.append({"window_size": window_size})
            check_kv(query, key)
            return _sdpa_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=tuple(window_size) == (-1, 0))
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            calls.append({"window_size": window_size, "enable_gqa": enable_gqa})
            if not enable_gqa:
                check_kv(query, key)
            return _sdpa_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=tuple(window_size) == (-1, 0))

    monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)  # the stand-in's kernels
    fn, note = torch_varlen_fn()
    assert fn is not None, note
    lengths = [9, 1, 30]
    q, k, v, cu = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _packed(lengths))
    got = fn(q, k, v, cu, cu, max(lengths), max(lengths))
    want = torch_varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths))  # the per-sequence SDPA path, causal
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2e-2)  # both in bf16, summed in other orders
    assert calls == [{"is_causal": True}] if release == "2.10" else calls[0]["window_size"] == (-1, 0)
    if release == "2.12":
        assert calls[0]["enable_gqa"] is True and "enable_gqa" in note
    else:
        assert "KV heads repeated" in note


def test_nccl_world_of_one_steps_with_gloo():
    """The doctor's world-of-one check, its steps run with gloo on CPU, in this process (the check
    forms the default process group on an in-memory store and destroys it, as train_bench does in
    the out-of-memory test below)."""
    import torch.distributed as dist

    from workbench.runtime.probe import _nccl_world_of_one

    assert not dist.is_initialized(), "a process group left over in this process"
    c = _nccl_world_of_one(torch.device("cpu"), "gloo")
    assert c["name"] == "gloo (world 1)" and c["status"] == "ok" and "return their input" in c["detail"], c
    assert not dist.is_initialized()  # destroyed again


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One ``--cpu-rehearsal`` of every part, the offload part included (``--parts`` naming them all: each
    part's share is its own, as when it runs alone), read by the two rehearsal tests below: the command's
    own ``main`` run in this process, its stderr captured and the environment put back afterwards (a
    ``python -m workbench.gpucheck`` of its own would import torch again; the command line itself is the
    dry run's, above). Its torch parts run in the check's process, as the rehearsal runs them; the
    subprocess they run in on a GPU is the dry run's, whose environment probe is one; the doctor's probe
    and the profile and training runs are processes of their own, as on a GPU."""
    import contextlib
    import io
    import os
    from types import SimpleNamespace

    out = tmp_path_factory.mktemp("rehearsal") / "gc"
    err, env = io.StringIO(), dict(os.environ)
    os.environ.update(_env())
    try:
        with contextlib.redirect_stderr(err), contextlib.chdir(ROOT):
            code = gpucheck.main(["--cpu-rehearsal", "--parts", ",".join(gpucheck.PARTS), "--out", str(out)])
    finally:
        os.environ.clear()
        os.environ.update(env)
    return out, SimpleNamespace(returncode=code, stderr=err.getvalue())


@pytest.mark.slow
@pytest.mark.untimed
def test_cpu_rehearsal_runs_every_part(rehearsal):
    from workbench.cost import activation_bytes_per_token
    from workbench.cost.memory import model_states
    from workbench.profile import check_fidelity
    from workbench.models import get_model

    out, p = rehearsal
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((out / "result.json").read_text())
    by = {x["name"]: x for x in res["parts"]}
    assert res["rehearsal"] and [x["name"] for x in res["parts"]] == list(gpucheck.PARTS)
    assert [x["status"] for x in res["parts"]] == ["ok"] * len(gpucheck.PARTS), \
        {k: (v["status"], v["summary"]) for k, v in by.items()}
    # peak: the best row is the peak
    rows = by["peak"]["data"]["peak"]["rows"]
    peak = by["peak"]["data"]["peak"]["peak_tflops"]
    assert peak == max(r["tflops"] for r in rows) and all(r["tflops"] == pytest.approx(2 * r["n"] ** 3 / r["ms"] / 1e9)
                                                          for r in rows)
    # attention: the per-sequence path is the yardstick; every timed case of both shapes
    att = by["attention"]["data"]
    assert att["correctness"]["kernels"][0]["kernel"] == "sdpa per sequence" and att["training_uses"] == "torch"
    assert {(r["tokens"], r["shape"]) for r in att["timing"]} == {
        (T, shape) for T in (256, 512) for shape in ("one sequence", "eight sequences", "64-token documents")}
    # training: MFU and the memory model's prediction, recomputed here from the case's own figures
    m = get_model("tiny")
    for name, stage in (("train-1b", 0), ("train-8b", 3)):
        d = by[name]["data"]
        assert d["zero_stage"] == stage and d["peak_tflops"] == pytest.approx(peak, rel=1e-3)
        for c in d["cases"]:
            flops = sum(s * m.flops_per_token(s) for s in c["lengths"])
            assert sum(c["lengths"]) == c["tokens"]
            assert c["mfu"] == pytest.approx(flops / (c["step_ms"] / 1e3) / (d["peak_tflops"] * 1e12))
            assert c["tokens_per_s"] == pytest.approx(c["tokens"] / c["step_ms"] * 1e3)
            # the peak, by hand: at the loss's backward the states (under ZeRO-3 no gradients yet: 4 bytes
            # per parameter fewer), the activations and two fp32 (tokens, vocab) gradients; the states
            # with every gradient; at AdamW's step 16 bytes per parameter and its fp32 temporary
            states = model_states(m, zero_stage=stage, num_ranks=1, precision="fp32", optimizer="adamw").total
            backward = states - (4 * m.params() if stage == 3 else 0) + \
                activation_bytes_per_token(m, False) * c["tokens"] + 2 * 4 * m.vocab * c["tokens"]
            moments = {"the loss's backward": backward, "the backward's end": states,
                       "the optimizer's step": (16 + 4) * m.params()}
            assert c["predicted"]["total_bytes"] == pytest.approx(max(moments.values()))
            assert c["predicted"]["peak_at"] == max(moments, key=moments.get)
            assert c["measured_states_bytes"] == pytest.approx(c["predicted"]["states_bytes"], rel=0.01)
    # profile: the step error is profile --check's, recomputed here on the runs it left
    d = by["profile"]["data"]
    again = check_fidelity(d["profile"], Path(d["root"]) / d["train_run"], skip=1, root=d["root"])
    assert d["check"]["step_error"]["median_ape"] == pytest.approx(again["step_error"]["median_ape"])
    md = (out / "report.md").read_text()
    assert "**CPU rehearsal**" in md and "## train-8b" in md and "| step | 2 |" in md  # 3 steps, the first left out


def test_the_quick_gpu_profile_times_the_packs_the_run_will_run():
    """The check's profile covers the run's sizes: every sequence at most max_len, packs up to the
    run's batch and no larger, each fit pack one length, and enough packs to fit a, b and c."""
    from workbench.gpucheck import profile_packs

    for max_len, most in ((4096, 16384), (4096, 12288), (512, 2048)):
        fit, held = profile_packs(max_len, most)
        assert len(fit) >= 3 and len({tuple(p) for p in fit}) == len(fit)
        assert max(sum(p) for p in fit) == most and all(sum(p) <= most for p in fit + held)
        assert {s for p in fit for s in p} == {max_len // 8, max_len // 4, max_len // 2, max_len}
        assert all(len(set(p)) == 1 for p in fit) and held and all(len(set(p)) > 1 for p in held)


def test_an_out_of_memory_is_retried_with_recomputation_on_a_fresh_model(monkeypatch):
    """A case that runs out of memory half-way is recorded as such and retried once with
    recomputation; the model it ran on is gone before the next is built (a name still bound to it
    kept an 8B's states beside the new one on an H200), and the retry's clock holds only its own marks."""
    import gc
    import weakref

    import torch

    from workbench.runtime import bench

    built, alive_at_build = [], []
    real_build = bench._build

    def build(*a, **k):
        alive_at_build.append([w() is not None for w in built])
        out = real_build(*a, **k)
        built.append(weakref.ref(out[0]))
        if len(built) == 1:  # the first model's first step runs out of memory after its clock started
            ex = out[3]
            run = ex.run

            def oom_once(*a, **k):
                ex.run = run
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (a stand-in)")
            ex.run = oom_once
        return out

    monkeypatch.setattr(bench, "_build", build)
    res = bench.train_bench("tiny", torch.device("cpu"), zero_stage=0, tokens=[256], peak_tflops=None,
                            rehearsal=True, warmup=1, steps=1)
    gc.collect()
    first, retry = res["cases"]
    assert first["status"] == "oom" and first["recompute"] is False
    assert retry["status"] == "ok" and retry["recompute"] is True and retry["step_ms"] > 0
    assert alive_at_build == [[], [False]]  # the first model was freed before the second was built


# ------------------------------------------------------------------------------------------------
# the offload part
# ------------------------------------------------------------------------------------------------


def test_offload_lengths_by_hand():
    """A step of n tokens takes n / 10 ms (so 2 long steps of n take n / 5000 s): with 100 s, start-ups of
    10 s and short runs of 3 x 2 steps at 1,024 (0.6144 s), 100 - 30 - 0.6144 = 69.3856 s leave
    n <= 346,928 -> 346,112 (a multiple of 1,024) when memory holds more; the memory's own limit when
    it holds less."""
    from workbench.gpucheck import offload_lengths

    def step_ms(n):
        return n / 10

    got = offload_lengths(10**6, 8000, step_ms, budget_s=100, startup_s=10, short_target=8192, quantum=1024)
    assert got["short"] == 7168  # the most without offload (8,000), a multiple of 1,024
    short_s = 6 * 7168 / 10 / 1e3
    assert got["short_time_s"] == pytest.approx(short_s)
    assert got["long"] == int((100 - 30 - short_s) * 5000 // 1024) * 1024 and got["limited_by"] == "time"
    assert got["need_s"] == pytest.approx(30 + short_s + 2 * 7168 / 10 / 1e3)
    mem = offload_lengths(200_000, 10**6, step_ms, budget_s=100, startup_s=10, short_target=8192, quantum=1024)
    assert (mem["short"], mem["long"], mem["limited_by"]) == (8192, 199_680, "memory")
    tight = offload_lengths(10**6, 10**6, step_ms, budget_s=31, startup_s=10, short_target=8192, quantum=1024)
    assert (tight["long"], tight["limited_by"]) == (8192, "short")  # 1 - 0.49 s left: not even 8,192's two steps
    with pytest.raises(ValueError, match="not even 1024 tokens fit without offload"):
        offload_lengths(10**6, 1000, step_ms, budget_s=100, startup_s=10, short_target=8192, quantum=1024)


def test_offload_verdicts_at_their_edges():
    from workbench.gpucheck import offload_verdicts

    v = offload_verdicts(peak_bytes=110.0, predicted_bytes=100.0, host_bytes=90.0, predicted_host_bytes=100.0,
                         tps_offload=900.0, tps_plain=1000.0)
    assert [(k, x["ratio"], x["met"]) for k, x in v.items()] == [("peak", 1.1, True), ("host", 0.9, True),
                                                                 ("tokens_per_s", 0.9, True)]
    v = offload_verdicts(peak_bytes=111.0, predicted_bytes=100.0, host_bytes=31 / 32, predicted_host_bytes=1.0,
                         tps_offload=899.0, tps_plain=1000.0)
    assert (v["peak"]["met"], v["host"]["met"], v["tokens_per_s"]["met"]) == (False, True, False)
    v = offload_verdicts(peak_bytes=None, predicted_bytes=100.0, host_bytes=1.0, predicted_host_bytes=0.0,
                         tps_offload=1.0, tps_plain=None)
    assert all(x["ratio"] is None and x["met"] is None for x in v.values())


def _offload_cost(model="llama3-8b", optimizer="sgd", momentum=0.9, offload="inputs"):
    from workbench.training import prepare_train

    s = {"nproc": 1, "device": "cuda", "profile": "h100-80g", "host_memory_gb": 137.4, "zero_stage": 3,
         "recompute": True, "checkpoint_every": 0, "planner": "greedy", "seed": 0, "precision": "bf16",
         "gpu_memory_gb": 150.1, "model": model, "optimizer": optimizer, "momentum": momentum, "source": "8192",
         "max_len": 8192, "offload": offload, "steps": 3}
    return prepare_train(s, dry_run=True, on_gpu=True)[1].scenario.cost()


def test_offload_predicted_peak_by_hand():
    """Llama 3 8B, ZeRO-3 at world 1, bf16, SGD with momentum, on an H200 (150.1 GB): fp32 parameters,
    gradients and momentum of 8,030,261,248 parameters (32.12 GB each) and FSDP2's bf16 working set. At
    the loss's backward the gradients are not there yet; at 65,536 tokens that moment is below the
    backward's end (every gradient), which sets the peak; at 400K tokens the activations set it."""
    from workbench.gpucheck import offload_predicted_peak

    cost = _offload_cost()
    p = 8_030_261_248
    st = cost.states
    assert (st.parameters, st.gradients, st.optimizer_states) == (4 * p, 4 * p, 4 * p)
    for tokens, at in ((65536, "the backward's end"), (400_000, "the loss's backward")):
        act = (float(cost.gpu_memory([tokens], 1, 1, "inputs")[0]) + cost.tile_gb) * 1e9
        got = offload_predicted_peak(cost, tokens)
        at_loss = 8 * p + st.working + act + cost.loss_working_gb * 1e9
        assert got["peak_at"] == at and got["total_bytes"] == pytest.approx(max(at_loss, 12 * p + st.working))
    assert offload_predicted_peak(cost, 400_000, 20.0)["activation_bytes"] == 20e9  # the plan's group memory_gb


def test_the_offload_part_chooses_the_model_and_lengths_on_a_gpu(tmp_path, monkeypatch):
    """The GPU branch without a GPU: the runs replaced by figures made from the cost model (the measured
    step time 1.25x the predicted), a 150.1 GB GPU. AdamW's states do not fit the 8B at world 1, SGD with
    momentum does; the short runs are at 8,192 tokens, the long run at the longest length whose two steps
    fit what is left at the measured speed; the figures are judged against the plan's. With 150 s the 8B's
    three start-ups alone do not fit: the 1B runs."""
    from workbench.gpucheck import OFFLOAD_STARTUP_S, GpuCheck, Part

    made = []
    clock = [1000.0]  # the part's clock: each stand-in run takes its start-up and its steps' time

    def fake_run(self, process, name, settings, deadline, env):
        cost = _offload_cost(settings["model"], settings["optimizer"], settings["momentum"], settings["offload"])
        n, off = settings["max_len"], settings["offload"]
        level = "inputs" if off == "swap" else off  # the stand-in swap run: timed as inputs alone
        t, gpu_gb, _ = cost.group_at([n], 1, 1, level)
        host_gb = float(cost.host_memory([n], 1, level)[0])
        layers = cost.model.layers
        step = {"tokens": n, "measured_ms": 1.25 * (t + cost.optimizer_ms()), "peak_bytes": 0.0,
                "host_bytes": host_gb * 1e9 * (layers - 1) / layers}
        step["tokens_per_s"] = n / step["measured_ms"] * 1e3
        from workbench.gpucheck import offload_predicted_peak
        step["peak_bytes"] = 1.02 * offload_predicted_peak(cost, n, gpu_gb)["total_bytes"]
        made.append((settings["model"], settings["optimizer"], settings["momentum"], n, off, settings["steps"]))
        clock[0] += OFFLOAD_STARTUP_S[settings["model"]] + settings["steps"] * step["measured_ms"] / 1e3
        return {"steps": [dict(step)] * settings["steps"], "tokens_per_s": step["tokens_per_s"],
                "group": {"memory_gb": gpu_gb, "host_gb": host_gb, "offload": level,
                          "swap_layers": 3 if off == "swap" else 0}, "run": name, "state": "done",
                "error": None, "wall_s": OFFLOAD_STARTUP_S[settings["model"]], "startup_s": OFFLOAD_STARTUP_S[settings["model"]]}

    monkeypatch.setattr(GpuCheck, "_offload_run", fake_run)
    monkeypatch.setattr(gpucheck.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(gpucheck, "host_memory_gb", lambda: 137.4)
    check = GpuCheck(tmp_path / "gc", parts=["offload"], say=lambda m: None)
    check.env_info = {"gpu": {"total_memory_bytes": 150.1e9}}
    part = Part("offload", "offload", budget_s=600.0)
    check.part_offload(part)
    d = part.data
    assert (d["model"], d["optimizer"]) == ("llama3-8b", "sgd momentum"), d["candidates_left_out"]
    assert "llama3-8b adamw" in d["candidates_left_out"][0] and "needs 1" in d["candidates_left_out"][0]
    short, long = 8192, d["long"]
    # no swap run: after the short runs less than twice its start-up and steps is left
    assert [m[3:5] for m in made] == [(short, "none"), (short, "inputs"), (long, "inputs")] and made[-1][5] == 2
    assert "no time for the swap run" in d["swap_note"] and "swap" not in d
    # the long run's two steps at 1.25x the predicted time fit what is left; 1,024 more do not
    cost = _offload_cost()

    def step_s(n):
        return 2 * 1.25 * (cost.group_at([n], 1, 1, "inputs")[0] + cost.optimizer_ms()) / 1e3

    assert d["time_factor"] == pytest.approx(1.25)
    start = OFFLOAD_STARTUP_S["llama3-8b"]
    left = 600 - 3 * start - 2 * 3 * step_s(short) / 2  # three start-ups, the short runs' 3 steps each
    assert long > short and long <= d["longest_offload"] and d["long_limited_by"] == "time"
    assert step_s(long) <= left < step_s(long + 1024)
    v = d["verdicts"]
    assert v["peak"]["ratio"] == pytest.approx(1.02) and v["peak"]["met"]
    assert v["host"]["ratio"] == pytest.approx(31 / 32) and v["host"]["met"]
    none_t, in_t = (cost.group_at([short], 1, 1, x)[0] for x in ("none", "inputs"))
    ratio = (none_t + cost.optimizer_ms()) / (in_t + cost.optimizer_ms())
    assert v["tokens_per_s"]["ratio"] == pytest.approx(ratio) and v["tokens_per_s"]["met"] == (ratio >= 0.9)
    assert part.status == ("ok" if ratio >= 0.9 else "warn") and part.summary.startswith("llama3-8b (sgd momentum")
    # 300 s (the default share): the 8B's three start-ups (3 x 150 s, measured) alone overrun it, the
    # 1B's (3 x 25 s) do not, and there is time for the swap run between the short and the long runs
    made.clear()
    part = Part("offload", "offload", budget_s=300.0)
    check.part_offload(part)
    assert part.data["model"] == "1b" and {m[0] for m in made} == {"1b"}
    assert any(n.startswith("llama3-8b: about") for n in part.data["candidates_left_out"])
    assert [m[4] for m in made] == ["none", "inputs", "swap", "inputs"]
    sw = part.data["swap"]
    assert sw["state"] == "done" and sw["swap_layers"] == 3 and sw["ratio_to_recompute"] == pytest.approx(
        part.data["runs"]["short_swap"]["tokens_per_s"] / part.data["runs"]["short_none"]["tokens_per_s"])
    assert "swap: 3 of 16 blocks" in part.summary, part.summary
    assert "| long_inputs |" in gpucheck.format_markdown({"parts": [part.to_dict()], "budget_s": 300.0})


@pytest.mark.slow
@pytest.mark.untimed
def test_cpu_rehearsal_of_the_offload_part(rehearsal):
    """The offload part of the rehearsal (``--cpu-rehearsal``, the part named in ``--parts``): three
    ``workbench train`` runs of the tiny model (ZeRO-3, fp32, --recompute) through the part's code, at
    256 tokens without offload, with layer-input offload and with swap (the rehearsal caps the length
    at the short runs' own, so no longer run: the inputs run is judged; the part's choice of a longer
    run is test_the_offload_part_chooses_the_model_and_lengths_on_a_gpu's); the host bytes the runs
    recorded are the offloaded inputs (every block's but the last: (layers - 1) x hidden x 4 bytes a
    token), the plan's host_gb every block's, and the ratios the part reports are recomputed here from
    the run folders."""
    from workbench import runs
    from workbench.cost.offload import swap_blocks
    from workbench.models import get_model

    out, p = rehearsal
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((out / "result.json").read_text())
    (part,) = [x for x in res["parts"] if x["name"] == "offload"]
    assert part["status"] == "ok" and part["summary"].endswith("rehearsal: not judged"), part["summary"]
    d = part["data"]
    m = get_model("tiny")
    assert d["model"] == "tiny" and set(d["runs"]) == {"short_none", "short_inputs", "short_swap"}
    assert d["long"] == 256 and d["long_note"].startswith("no run longer than 256 tokens (the length cap"), d
    assert d["runs"]["short_none"]["steps"][0]["tokens"] == d["runs"]["short_inputs"]["steps"][0]["tokens"] == 256
    for name, r in d["runs"].items():
        run = runs.Run(out / "runs" / r["run"])
        assert runs.read_status(run.path).state == "done" and len(run.steps()) == len(r["steps"])
        swapped = set(swap_blocks(m.layers, r["group"]["swap_layers"]))
        # inputs offloaded: every block's that is not swapped, but the last block's (used at once)
        offloaded = [i for i in range(m.layers - 1) if i not in swapped] if r["group"]["offload"] == "inputs" else []
        for s in r["steps"]:
            assert s["host_bytes"] == len(offloaded) * m.hidden * 4 * s["tokens"], name
            assert (s["swap_host_bytes"] > 0) == bool(swapped), name
        if r["group"]["offload"] == "inputs" and not swapped:
            assert r["group"]["host_gb"] == pytest.approx(m.layers * m.hidden * 4 * r["steps"][0]["tokens"] / 1e9)
    sw = d["runs"]["short_swap"]
    assert sw["group"]["swap_layers"] >= 1 and d["swap"]["swap_layers"] == sw["group"]["swap_layers"]
    # what the swapped blocks and the offloaded inputs took in host memory, against the plan's host_gb
    # (H200, 2026-11-28: 1.02x for the 8B; the CPU's fp32 autograd keeps some 10% more)
    last = sw["steps"][-1]
    assert (last["swap_host_bytes"] + last["host_bytes"]) / (sw["group"]["host_gb"] * 1e9) == pytest.approx(1.0, abs=0.15)
    v = d["verdicts"]
    assert v["host"]["ratio"] == pytest.approx((m.layers - 1) / m.layers)
    tps = {k: d["runs"][k]["tokens_per_s"] for k in ("short_inputs", "short_none")}
    assert v["tokens_per_s"]["ratio"] == pytest.approx(tps["short_inputs"] / tps["short_none"])
    last = d["runs"]["short_inputs"]["steps"][-1]  # the judged run
    assert d["judged_tokens"] == last["tokens"] == 256
    assert v["peak"]["ratio"] == pytest.approx(last["peak_bytes"] / d["predicted"]["total_bytes"])
    md = (out / "report.md").read_text()
    assert "## offload" in md and "| short_inputs | 256 | inputs | done |" in md
