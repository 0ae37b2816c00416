"""``make install`` where users have GPUs (``workbench/installer.py``), without a GPU or a network:
a stand-in ``nvidia-smi`` on PATH, a stand-in pip that records its commands, and a stand-in for the
release's HTTP answer. The wheel names are checked against names flash-attn's releases publish."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from workbench import installer

CUDA_BUILD = {"torch": "2.8.0+cu128", "cuda": "12.8", "cxx11_abi": True, "python_tag": "cp311",
              "platform_tag": "linux_x86_64", "flash_attn": None}


def test_wheel_names_are_the_releases():
    # names as flash-attn v2.8.3's release lists them (its setup.py's get_wheel_url: CUDA major only,
    # torch major.minor, the C++ ABI of torch, the Python tag twice)
    assert installer.wheel_name(flash_version="2.8.3", torch_version="2.8.0+cu128", cuda_version="12.8",
                                cxx11_abi=True, python_tag="cp311", platform_tag="linux_x86_64") == \
        "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
    assert installer.wheel_name(flash_version="2.7.4.post1", torch_version="2.6.0", cuda_version="12.4",
                                cxx11_abi=False, python_tag="cp310", platform_tag="linux_x86_64") == \
        "flash_attn-2.7.4.post1+cu12torch2.6cxx11abiFALSE-cp310-cp310-linux_x86_64.whl"


def test_the_flash_attn_step_decides_without_surprises():
    seen = []

    def exists(answer):
        def f(url):
            seen.append(url)
            return answer
        return f

    cpu = installer.plan_flash_attn({**CUDA_BUILD, "torch": "2.13.0+cpu", "cuda": None}, url_exists=exists(True), env={})
    assert cpu.action == "nothing" and "CPU build" in cpu.message and seen == []
    have = installer.plan_flash_attn({**CUDA_BUILD, "flash_attn": "2.8.3"}, url_exists=exists(True), env={})
    assert have.action == "nothing" and "already installed" in have.message
    wheel = installer.plan_flash_attn(CUDA_BUILD, url_exists=exists(True), env={})
    assert wheel.action == "wheel" and wheel.target == seen[-1] == (
        "https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/"
        "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl")
    none = installer.plan_flash_attn(CUDA_BUILD, url_exists=exists(False), env={})
    assert none.action == "fallback" and "the PyTorch attention path will be used" in none.message
    assert "FLASH_ATTN_BUILD=1" in none.message and "no prebuilt wheel" in none.message
    offline = installer.plan_flash_attn(CUDA_BUILD, url_exists=exists(None), env={})
    assert offline.action == "fallback" and "could not reach" in offline.message
    built = installer.plan_flash_attn(CUDA_BUILD, url_exists=exists(False), env={"FLASH_ATTN_BUILD": "1"})
    assert built.action == "build" and built.target == "flash-attn==2.8.3"
    other = installer.plan_flash_attn(CUDA_BUILD, url_exists=exists(True), env={"FLASH_ATTN_VERSION": "2.7.4.post1"})
    assert "/v2.7.4.post1/flash_attn-2.7.4.post1+cu12torch2.8" in other.target


def test_the_flash_attn_step_runs_pip_only_when_it_should():
    said, ran = [], []

    def run(cmd):
        ran.append(cmd)
        return 0

    kw = dict(say=said.append, run=run, build=CUDA_BUILD)
    assert installer.install_flash_attn("py", url_exists=lambda u: False, env={}, **kw) == 0
    assert ran == [] and "PyTorch attention path will be used" in said[-1]  # never a surprise source build
    assert installer.install_flash_attn("py", url_exists=lambda u: True, env={}, **kw) == 0
    assert ran[-1][:5] == ["py", "-m", "pip", "install", "--no-deps"] and ran[-1][5].endswith(".whl")
    assert installer.install_flash_attn("py", url_exists=lambda u: False, env={"FLASH_ATTN_BUILD": "1"}, **kw) == 0
    assert ran[-1] == ["py", "-m", "pip", "install", "--no-build-isolation", "flash-attn==2.8.3"]
    # a build that was asked for and failed is the one failure of this step
    assert installer.install_flash_attn("py", url_exists=lambda u: False, env={"FLASH_ATTN_BUILD": "1"},
                                        say=said.append, run=lambda cmd: 1, build=CUDA_BUILD) == 1
    assert "source build failed" in said[-1]


def _fake_nvidia_smi(tmp_path: Path, code: int) -> Path:
    b = tmp_path / f"bin{code}"
    b.mkdir()
    exe = b / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n[ \"$1\" = \"-L\" ] && echo 'GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-x)'\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return b


def test_cuda_is_found_by_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not installer.cuda_present()
    monkeypatch.setenv("PATH", str(_fake_nvidia_smi(tmp_path, 0)))
    assert installer.cuda_present()
    monkeypatch.setenv("PATH", str(_fake_nvidia_smi(tmp_path, 9)))  # a driver that cannot see its GPU
    assert not installer.cuda_present()


def test_torch_step_checks_that_a_gpu_machine_got_the_cuda_build(monkeypatch):
    said, ran = [], []
    run = lambda cmd: ran.append(cmd) or 0  # noqa: E731
    assert installer.install_torch("py", ["--index-url", "X"], say=said.append, run=run, present=False) == 0
    assert ran == [["py", "-m", "pip", "install", "--index-url", "X", "torch==2.13.0"]]
    assert "no CUDA: installing torch==2.13.0 (the CPU build)" in said[0] and len(said) == 1
    monkeypatch.setattr(installer, "_torch_build", lambda python: {"torch": "2.13.0+cpu", "cuda": None})
    installer.install_torch("py", [], say=said.append, run=run, present=True)
    assert "has no CUDA although this machine has a GPU" in said[-1] and "TORCH_PIP_ARGS=" in said[-1]
    monkeypatch.setattr(installer, "_torch_build", lambda python: {"torch": "2.13.0", "cuda": "12.8"})
    installer.install_torch("py", [], say=said.append, run=run, present=True)
    assert said[-1] == "torch 2.13.0 with CUDA 12.8"


def test_this_machines_torch_build_is_read(tmp_path):
    """The probe the installer runs in the new environment (here: this one, a CPU build)."""
    b = installer._torch_build(sys.executable)
    assert b["torch"].startswith("2.") and b["python_tag"] == f"cp{sys.version_info.major}{sys.version_info.minor}"
    plan = installer.plan_flash_attn(b, url_exists=lambda u: pytest.fail("no lookup for a CPU build"), env={})
    assert (plan.action == "nothing") == (b["cuda"] is None)
