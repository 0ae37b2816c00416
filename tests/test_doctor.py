"""``workbench doctor``: the lines a GPU machine would show, driven with stand-ins (``nvidia-smi topo
-m`` outputs of real machines' shapes, a stand-in ``torch.cuda`` with an A100 and a V100), and the
whole doctor on this machine (slow: 2 gloo ranks), checked against what is known here independently.
"""

from __future__ import annotations

import importlib.metadata
import json
from types import SimpleNamespace

import pytest
import torch

from workbench.doctor import format_report, parse_topology, topology_check

# `nvidia-smi topo -m` as an 8 x A100 SXM node prints it (NVSwitch: every pair NV12) and as a
# 4-GPU PCIe box with two NVLink bridges prints it
DGX = """\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tPXB\t48-63,176-191\t3
GPU1\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tPXB\t48-63,176-191\t3
GPU2\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tNV12\tSYS\t16-31,144-159\t1
GPU3\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tNV12\tSYS\t16-31,144-159\t1
GPU4\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tNV12\tSYS\t112-127,240-255\t7
GPU5\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tNV12\tSYS\t112-127,240-255\t7
GPU6\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tNV12\tSYS\t80-95,208-223\t5
GPU7\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\tNV12\t X \tSYS\t80-95,208-223\t5

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NV#  = Connection traversing a bonded set of # NVLinks
"""
PCIE = """\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tSYS\tSYS\t0-15\t0
GPU1\tNV4\t X \tSYS\tSYS\t0-15\t0
GPU2\tSYS\tSYS\t X \tNV4\t16-31\t1
GPU3\tSYS\tSYS\tNV4\t X \t16-31\t1
"""


def test_topology_lines():
    t = parse_topology(DGX)
    assert len(t["gpus"]) == 8 and t["links"][(0, 7)] == "NV12" and t["links"][(3, 3)] == "X"
    ok = topology_check(run=lambda cmd: (0, DGX))
    assert ok.status == "ok" and "8 GPUs, NVLink between every pair (NV12)" in ok.detail
    mixed = topology_check(run=lambda cmd: (0, PCIE))
    assert mixed.status == "warn" and "2 of 6 pairs on NVLink" in mixed.detail and "SYS" in mixed.detail
    assert "PCIe speed" in mixed.fix
    one = topology_check(run=lambda cmd: (0, "\tGPU0\tCPU Affinity\nGPU0\t X \t0-31\n"))
    assert one.status == "skip" and "1 GPU(s)" in one.detail
    broken = topology_check(run=lambda cmd: (9, "NVIDIA-SMI has failed because it couldn't communicate with the driver"))
    assert broken.status == "warn" and "driver" in broken.fix


def _props(name, gb, major, minor):
    return SimpleNamespace(name=name, total_memory=int(gb * 1e9), major=major, minor=minor)


def test_gpu_lines_with_a_stand_in_cuda(monkeypatch):
    from workbench.runtime import probe

    gpus = [_props("NVIDIA A100-SXM4-40GB", 42.4, 8, 0)] * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: gpus[0].major >= 8)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    lines = {c["name"]: c for c in probe._gpu_checks(nvidia_visible=True)}
    assert lines["gpus"]["status"] == "ok" and "2 GPU(s): NVIDIA A100-SXM4-40GB x2; 42.4 GB, compute capability 8.0" == \
        lines["gpus"]["detail"]
    assert lines["nccl"]["detail"] == "NCCL 2.27.3" and lines["bf16"]["status"] == "ok"
    gpus[:] = [_props("Tesla V100-SXM2-32GB", 34.1, 7, 0)]
    lines = {c["name"]: c for c in probe._gpu_checks(nvidia_visible=True)}
    assert lines["gpus"]["status"] == "warn" and "predate Ampere" in lines["gpus"]["detail"]
    assert "--precision fp32" in lines["gpus"]["fix"] and lines["bf16"]["status"] == "warn"
    # a GPU the driver shows that torch cannot use is a failure with its fix
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = {c["name"]: c for c in probe._gpu_checks(nvidia_visible=True)}
    assert lines["gpus"]["status"] == "fail" and "CUDA_VISIBLE_DEVICES" in lines["gpus"]["fix"]
    assert probe._torch_check(nvidia_visible=True)["status"] == ("fail" if torch.version.cuda is None else "ok")


def test_report_text_shows_fixes_and_the_summary():
    from workbench.doctor import Check, DoctorReport

    rep = DoctorReport([Check("python", "ok", "Python 3.11"), Check("flash-attn", "warn", "not installed", "make install"),
                        Check("gpus", "skip", "no NVIDIA GPU on this machine")], seconds=1.0)
    text = format_report(rep)
    assert "fix: make install" in text and "no NVIDIA GPU on this machine" in text
    assert rep.summary() == "1 ok, 1 warn, 0 fail, 1 skipped (gpus: see the reasons above)" and rep.ok


@pytest.mark.slow
def test_doctor_on_this_machine(capsys):
    """``workbench doctor --json`` through the console script's entry in this process (the doctor
    starts its probe and its 2 ranks as processes of their own either way)."""
    from conftest import cli_main

    p = cli_main(capsys, "doctor", "--json")
    rep = json.loads(p.stdout)
    by = {c["name"]: c for c in rep["checks"]}
    assert p.returncode == (0 if rep["ok"] else 1)
    assert importlib.metadata.version("torch") in by["torch"]["detail"]
    for c in rep["checks"]:
        assert c["status"] in ("ok", "warn", "fail", "skip") and c["detail"]
        if c["status"] in ("warn", "fail"):
            assert c["fix"], c
    if not torch.cuda.is_available():  # the CPU machine: GPU lines skipped with their reason, gloo checked
        for name in ("gpus", "nccl", "bf16", "flash-attn", "nccl all-to-all", "nccl all-gather"):
            assert by[name]["status"] == "skip", by[name]
        assert by["gloo all-to-all"]["status"] == by["gloo all-gather"]["status"] == "ok"
        step = by["training step"]["data"]
        # the step's peak is what the model states and the saved activations hold: compare with the
        # memory model computed here
        from workbench.cost import activation_bytes_per_token
        from workbench.cost.memory import model_states
        from workbench.models import get_model

        m = get_model("tiny")
        want = model_states(m, zero_stage=0, num_ranks=1, precision="fp32", optimizer="adamw").total + \
            activation_bytes_per_token(m) * step["tokens"]
        assert step["predicted_bytes"] == pytest.approx(want)
        assert step["peak_bytes"] == pytest.approx(want, rel=0.25)
    sharded = by["sharded step (ZeRO-3)"]
    assert sharded["status"] == "ok" and sharded["data"]["worst"] < 1e-4
