"""The trainer and its torchrun launcher.

Fast tests (no processes): spec.json validation, the torchrun argument list, resuming rules,
token data. Slow tests (``-m slow``): real torchrun runs of the tiny model on CPU with gloo,
1 to 4 ranks, through the ``workbench train`` CLI and the launcher API: the same parameters after
one SGD step whatever the plan and world size, a falling loss, an exact resume, clear errors
(and no hang) on bad input, and a stop that ends every process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from workbench.launch.spec import SpecError, TrainSpec, read_spec
from workbench.launch.torchrun import prepare_run, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 240  # s: a run that takes longer than this has hung

# small, fast settings shared by the slow tests: tiny model, short sequences, small batches
SMALL = ["--model", "tiny", "--max-len", "512", "--batch-tokens", "4096", "--time-limit", "0.5", "--quiet"]


def workbench(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """Run the ``workbench`` console entry; returns the CompletedProcess (never raises on status)."""
    exe = Path(sys.executable).with_name("workbench")
    cmd = [str(exe), *args] if exe.exists() else [sys.executable, "-m", "workbench.cli", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def metrics(run_dir: Path, rank: int = 0) -> dict[int, dict]:
    """Rank ``rank``'s metrics rows by step (a repeated step keeps its latest row)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if r["rank"] == rank}


def params_of(run_dir: Path, step: int) -> dict:
    import torch

    state = torch.load(run_dir / "checkpoints" / f"step_{step}.pt", weights_only=True)
    return state["model"]


# ------------------------------------------------------------------------------------------------
# fast
# ------------------------------------------------------------------------------------------------


def test_spec_round_trip_and_defaults(tmp_path):
    d = prepare_run(run_dir=tmp_path / "r", steps=3, planner="greedy", seed=4, optimizer="sgd")
    spec = read_spec(d)
    assert spec.steps == 3 and spec.seed == 4 and spec.run_id == "r"
    assert spec.learning_rate == 0.05  # SGD default
    assert TrainSpec.from_dict(json.loads((d / "spec.json").read_text())) == spec


@pytest.mark.parametrize("bad, words", [
    ({"steps": 0}, "steps"),
    ({"steps": 2, "optimizer": "lamb"}, "optimizer"),
    ({"steps": 2, "batch_size": 4, "batch_tokens": 100}, "not both"),
    ({"steps": 2, "policy": "truncate"}, "policy"),
])
def test_spec_rejects_bad_fields(bad, words):
    with pytest.raises(SpecError, match=words):
        TrainSpec(**bad)


def test_read_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        read_spec(tmp_path / "nowhere")
    with pytest.raises(SpecError, match="spec.json is missing"):
        read_spec(tmp_path)
    (tmp_path / "spec.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        read_spec(tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps({"steps": 2, "colour": "red"}))
    with pytest.raises(SpecError, match="unknown field"):
        read_spec(tmp_path)


def test_prepare_run_checks_names_and_resume_rules(tmp_path):
    with pytest.raises(ValueError, match="unknown planner"):
        prepare_run(run_dir=tmp_path / "a", steps=2, planner="nope")
    with pytest.raises(ValueError, match="max context"):
        prepare_run(run_dir=tmp_path / "b", steps=2, model="tiny", max_len=1 << 20)
    d = prepare_run(run_dir=tmp_path / "c", steps=2, seed=1)
    assert prepare_run(run_dir=d, steps=5) == d and read_spec(d).steps == 5  # steps may grow
    with pytest.raises(ValueError, match="different run"):
        prepare_run(run_dir=d, steps=6, seed=2)


def test_torchrun_command_is_an_argument_list(tmp_path):
    cmd = torchrun_command(tmp_path, 4)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[cmd.index("-m", 3) + 1] == "workbench.runtime.train"
    assert cmd[-2:] == ["--run-dir", str(tmp_path.resolve())]
    multi = torchrun_command(tmp_path, 2, nnodes=2, node_rank=1, rdzv_endpoint="h:29500")
    assert "--standalone" not in multi and multi[multi.index("--rdzv-endpoint") + 1] == "h:29500"
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        torchrun_command(tmp_path, 2, nnodes=2)


def test_token_data_corpus_documents_and_windows():
    from workbench.data.corpus import document_tokens, stdlib_documents
    from workbench.runtime.train import TokenData

    docs = stdlib_documents()
    td = TokenData("stdlib", max_len=256, policy="split", seed=0)
    assert td.lengths.max() <= 256 and td.report.affected_sequences > 0
    first = document_tokens(docs[0])
    # the first pieces are the first document, cut into 256-token pieces, in order
    got = np.concatenate([td.tokens(i) for i in range(-(-first.size // 256))])
    np.testing.assert_array_equal(got, first.astype(np.int64))
    clip = TokenData("stdlib", max_len=256, policy="clip", seed=0)
    np.testing.assert_array_equal(clip.tokens(0), first[:256])
    # other sources: windows of the byte stream, deterministic from the seed, in 0..255
    a = TokenData("100,3000,7", max_len=4096, policy="error", seed=3)
    b = TokenData("100,3000,7", max_len=4096, policy="error", seed=3)
    c = TokenData("100,3000,7", max_len=4096, policy="error", seed=4)
    assert a.ordered and [a.tokens(i).size for i in range(3)] == [100, 3000, 7]
    np.testing.assert_array_equal(a.tokens(1), b.tokens(1))
    assert not np.array_equal(a.tokens(1), c.tokens(1))
    assert a.tokens(1).max() < 256
    with pytest.raises(ValueError, match="max_len"):
        TokenData("100,5000", max_len=4096, policy="error", seed=0)


def test_cli_rejects_bad_settings_before_starting(tmp_path):
    p = workbench("train", "--steps", "2", "--planner", "nope", "--run-root", str(tmp_path), timeout=120)
    assert p.returncode == 2
    assert "unknown planner" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir()), "no run folder for settings that cannot work"


# ------------------------------------------------------------------------------------------------
# slow: real torchrun runs
# ------------------------------------------------------------------------------------------------


def _train(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    p = workbench("train", "--run-dir", str(run_dir), *args)
    print(f"workbench train {' '.join(args)}: {time.monotonic() - t0:.1f}s, exit {p.returncode}")
    return p


def _ok(p: subprocess.CompletedProcess, run_dir: Path) -> None:
    log = (run_dir / "log.txt").read_text()[-4000:] if (run_dir / "log.txt").exists() else ""
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stderr[-3000:]}\n{log}"
    assert status(run_dir)["state"] == "done"


@pytest.fixture(scope="module")
def sgd_reference(tmp_path_factory):
    """One SGD step on one rank with static:1 (plain data parallelism of one: the single-process
    update)."""
    d = tmp_path_factory.mktemp("ref") / "run"
    p = _train(d, "--nproc", "1", "--planner", "static:1", "--steps", "1", "--seed", "7", "--optimizer", "sgd",
               "--lr", "0.5", "--checkpoint-every", "1", *SMALL)
    _ok(p, d)
    return d


def _planners_for_equality() -> list[str]:
    from workbench.solve import planner_names

    names = ["greedy", "static:4"]
    if "flexsp" in planner_names():
        names.append("flexsp")
    return names


@pytest.mark.slow
@pytest.mark.parametrize("planner", _planners_for_equality())
def test_one_sgd_step_same_params_on_4_ranks(sgd_reference, tmp_path, planner):
    d = tmp_path / "run"
    p = _train(d, "--nproc", "4", "--planner", planner, "--steps", "1", "--seed", "7", "--optimizer", "sgd",
               "--lr", "0.5", "--checkpoint-every", "1", *SMALL)
    _ok(p, d)
    plan = json.loads((d / "plans.jsonl").read_text().splitlines()[0])["plan"]
    assert plan["num_gpus"] == 4 and plan["planner"].startswith(planner.split(":")[0])
    if planner == "static:4":  # every sequence ran sharded over 4 ranks with Ulysses all-to-alls
        assert {g["degree"] for m in plan["micro_steps"] for g in m["groups"]} == {4}
    ref, got = params_of(sgd_reference, 1), params_of(d, 1)
    for name, t in ref.items():
        np.testing.assert_allclose(got[name].numpy(), t.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    # and the step did change the parameters (the comparison is not of two untouched inits)
    from workbench.runtime.model import Transformer
    from workbench.specs import get_model

    init = Transformer(get_model("tiny"), seed=7).state_dict()
    moved = max(float((ref[k] - init[k]).abs().max()) for k in ref)
    assert moved > 1e-4
    r0, r3 = metrics(d, 0)[0], metrics(d, 3)[0]
    assert r0["loss"] == pytest.approx(metrics(sgd_reference)[0]["loss"], rel=1e-5)
    assert r0["loss"] == r3["loss"]  # the global loss, the same on every rank
    assert {"predicted_ms", "measured_ms", "peak_memory_mb", "tokens", "micro_steps"} <= set(r0)


LOSS_ARGS = ["--nproc", "2", "--planner", "greedy", "--seed", "1", "--optimizer", "adamw", "--lr", "3e-3", *SMALL]


@pytest.fixture(scope="module")
def loss_run(tmp_path_factory):
    """30 AdamW steps of the tiny model on the embedded corpus, 2 ranks."""
    d = tmp_path_factory.mktemp("loss") / "run"
    p = _train(d, "--steps", "30", "--checkpoint-every", "0", *LOSS_ARGS)
    _ok(p, d)
    return d


@pytest.mark.slow
def test_loss_falls_on_the_embedded_corpus(loss_run):
    m = metrics(loss_run)
    assert sorted(m) == list(range(30))
    first = np.mean([m[s]["loss"] for s in range(5)])
    last = np.mean([m[s]["loss"] for s in range(25, 30)])
    assert last < first - 0.5, f"loss {first:.3f} -> {last:.3f}"
    st = status(loss_run)
    assert st["step"] == 30 and st["exit_code"] == 0
    assert st["resolved"]["max_len"] == 512 and st["resolved"]["backend"] == "gloo"
    assert len((loss_run / "plans.jsonl").read_text().splitlines()) == 30
    assert not (loss_run / "checkpoints").exists()


@pytest.mark.slow
def test_resume_continues_exactly(loss_run, tmp_path):
    n = 3
    d = tmp_path / "run"
    _ok(_train(d, "--steps", str(n), "--checkpoint-every", str(n), *LOSS_ARGS), d)
    assert (d / "checkpoints" / f"step_{n}.pt").exists()
    # restart the same run folder with one more step: it continues from the checkpoint
    p = _train(d, "--steps", str(n + 1), *LOSS_ARGS)
    _ok(p, d)
    st = status(d)
    assert st["resumed_from"] == n and st["attempt"] == 2 and st["step"] == n + 1
    ref = metrics(loss_run)[n]["loss"]
    got = metrics(d)[n]["loss"]
    assert got == pytest.approx(ref, rel=1e-6, abs=0), f"resumed step {n + 1} loss {got} vs uninterrupted {ref}"
    # a different run's settings in the same folder are refused before anything starts
    p = _train(d, "--steps", str(n + 2), *LOSS_ARGS, "--seed", "2")
    assert p.returncode == 2 and "different run" in p.stderr


def _assert_failed(p: subprocess.CompletedProcess, run_dir: Path, words: str) -> None:
    assert p.returncode != 0
    st = status(run_dir)
    assert st["state"] == "failed" and words in st["error"], st
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("workbench train: error:") and words in last, p.stderr


@pytest.mark.slow
def test_plan_for_another_world_size_fails_on_every_rank(tmp_path):
    d = tmp_path / "run"
    p = _train(d, "--nproc", "2", "--planner", "greedy", "--steps", "2", "--debug-plan-gpus", "1",
               "--timeout", "60", *SMALL)
    _assert_failed(p, d, "the plan is for 1 ranks but this run has 2")
    assert not (d / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sequence_over_max_context_with_policy_error(tmp_path):
    d = tmp_path / "run"
    p = _train(d, "--nproc", "2", "--lengths", "100,5000", "--max-len", "4096", "--policy", "error",
               "--steps", "1", "--timeout", "60", "--quiet")
    _assert_failed(p, d, "length 5,000 > max_len 4,096")


@pytest.mark.slow
def test_missing_spec_json_fails_cleanly(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    cmd = torchrun_command(d, 2)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode != 0
    st = status(d)
    assert st["state"] == "failed" and "spec.json is missing" in st["error"]
    assert "spec.json is missing" in p.stderr


@pytest.mark.slow
def test_start_poll_stop_from_python(tmp_path):
    from workbench.launch import torchrun as launch

    d = launch.prepare_run(run_dir=tmp_path / "run", steps=1000, model="tiny", max_len=256, batch_tokens=1024,
                           checkpoint_every=0, debug={"step_sleep_s": 0.2})
    h = launch.start(d, 2)
    t0 = time.monotonic()
    try:
        while launch.read_status(d).get("step", 0) < 2:  # the notebook's loop: poll, never block
            assert launch.poll(h) is None, (d / "log.txt").read_text()[-3000:]
            assert time.monotonic() - t0 < RUN_TIMEOUT
            time.sleep(0.5)
        assert launch.progress(h), "progress lines for the steps done so far"
        assert launch.is_alive(d) is True
        with pytest.raises(ValueError, match="already running"):
            launch.start(d, 2)
    finally:
        st = launch.stop(h, grace=10)
    assert st["state"] == "stopped"
    assert h.returncode is not None and launch.is_alive(d) is False
    pids = [json.loads(p.read_text())["pid"] for p in (d / "ranks").glob("rank*.json")]
    assert len(pids) == 2
    time.sleep(0.5)
    for pid in pids:
        alive = Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        assert not alive, f"rank process {pid} survived the stop"
