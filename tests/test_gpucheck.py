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
import time
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
    assert res["cuda"] is False and res["ok"] is True and res["counts"]["skip"] == len(gpucheck.PARTS)
    assert [x["name"] for x in res["parts"]] == list(gpucheck.PARTS)
    for part in res["parts"]:
        assert part["status"] == "skip" and part["summary"].startswith("needs CUDA: torch ")
        assert "CPU build" in part["summary"] or "sees no GPU" in part["summary"]
    assert res["machine"]["torch"] == torch.__version__ and res["machine"]["cuda_available"] is False
    md = (out / "report.md").read_text()
    assert f"**0 ok, 0 warn, 0 fail, {len(gpucheck.PARTS)} skipped" in md and "device: no CUDA device" in md
    for name in gpucheck.PARTS:
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
    assert every.budget_s == gpucheck.DEFAULT_BUDGET_S == pytest.approx(sum(s for _, s in gpucheck.PARTS.values()))
    assert every.shares == {k: s for k, (_, s) in gpucheck.PARTS.items()}
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


def test_a_crashing_part_and_a_spent_budget_are_reported_and_the_check_goes_on(tmp_path):
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
        time.sleep(max(0.0, check.left() - 0.1))  # spend the budget: train-1b is left out
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
    """The doctor's world-of-one check, its steps run with gloo on CPU (a process of its own: the
    default process group is process-wide)."""
    code = ("import json, torch\nfrom workbench.runtime.probe import _nccl_world_of_one\n"
            "print(json.dumps(_nccl_world_of_one(torch.device('cpu'), 'gloo')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout.strip().splitlines()[-1])
    assert c["name"] == "gloo (world 1)" and c["status"] == "ok" and "return their input" in c["detail"]


@pytest.mark.slow
@pytest.mark.untimed
def test_cpu_rehearsal_runs_every_part(tmp_path):
    from workbench.cost import activation_bytes_per_token
    from workbench.cost.memory import model_states
    from workbench.profile import check_fidelity
    from workbench.models import get_model

    out = tmp_path / "gc"
    p = subprocess.run([sys.executable, "-m", "workbench.gpucheck", "--cpu-rehearsal", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=_env())
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads((out / "result.json").read_text())
    by = {x["name"]: x for x in res["parts"]}
    assert res["rehearsal"] and [x["status"] for x in res["parts"]] == ["ok"] * len(gpucheck.PARTS), \
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
    assert "**CPU rehearsal**" in md and "## train-8b" in md and "| step | 5 |" in md


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
