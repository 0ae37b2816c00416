"""The CLI's stable JSON shapes (DESIGN.md) and its one-line errors, through the real console script (the
table of bad inputs through its ``main`` in the test's process)."""

import json

import pytest

from conftest import cli_main, run_cli

A, B, C = 5.128e-6, 0.1840, 629.4  # FlexSP GPT-7B on A100-40G


def test_cost_json_shape_and_figures():
    out = json.loads(run_cli("cost", "--lengths", "8192,65536", "--degrees", "1,2,32", "--json").stdout)
    assert set(out) >= {"rows", "group_overhead_ms", "memory_budget_gb"}
    row = next(r for r in out["rows"] if r["length"] == 8192 and r["degree"] == 1)
    assert row["time_ms"] == pytest.approx(A * 8192 ** 2 + B * 8192)
    assert row["memory_gb"] == pytest.approx(4.48e6 * 8192 / 1e9)
    assert row["feasible"] is False  # 36.7 GB > 26.3 GB budget
    assert out["group_overhead_ms"]["32"] == pytest.approx(C)
    big = next(r for r in out["rows"] if r["length"] == 65536 and r["degree"] == 32)
    assert big["feasible"] is True


def test_cost_says_what_the_chunked_loss_takes_from_the_budget():
    # Llama 3's head under recomputation: one 697-token chunk of logits at 12 bytes a logit, the final
    # norm's tensors of its tokens (4 x 4,096 + 2 x 4,096 + 4 bytes a token) and the head's gradient in fp32
    # and bf16, 128,256 x 4,096 x 6 bytes (4.24 GB); none without it
    loss = (12 * 697 * 128_256 + 697 * (6 * 4096 + 4) + 6 * 128_256 * 4096) / 1e9
    args = ("cost", "--model", "llama3-8b", "--profile", "h100-80g", "--gpus", "64", "--lengths", "8192")
    assert f"(after {loss:.2f} GB for the chunked loss)" in run_cli(*args, "--recompute").stdout
    plain = run_cli(*args).stdout
    # without recomputation the whole logits' backward goes with the tokens: two fp32 gradients of
    # 128,256 logits, 1.03 MB a token
    assert "chunked loss" not in plain and f"(with the whole logits' backward, {8 * 128_256 / 1e6:.2f} MB a token)" in plain
    out = json.loads(run_cli(*args, "--recompute", "--json").stdout)
    assert out["loss_working_gb"] == pytest.approx(loss)


def test_lengths_json_by_hand():
    out = json.loads(run_cli("lengths", "100,200,300,10000", "--json").stdout)
    assert out["count"] == 4 and out["tokens"] == 10600 and out["max"] == 10000
    assert out["p50"] == pytest.approx(250.0)
    assert out["token_share_over"]["8192"] == pytest.approx(10000 / 10600)
    assert out["token_share_over"]["32768"] == 0.0


def test_plan_json_shape_and_validity():
    out = json.loads(run_cli("plan", "--lengths", "131072,70000,9000,3000,500,500", "--gpus", "64",
                             "--planner", "greedy", "--json").stdout)
    for k in ("planner", "status", "makespan_ms", "lower_bound_ms", "solve_seconds", "micro_steps"):
        assert k in out
    assert out["planner"] == "greedy" and out["lower_bound_ms"] <= out["makespan_ms"]
    seqs = sorted(i for m in out["micro_steps"] for g in m["groups"] for i in g["sequences"])
    assert seqs == list(range(6))
    g = out["micro_steps"][0]["groups"][0]
    assert set(g) >= {"degree", "ranks", "sequences", "lengths", "time_ms", "memory_gb"}
    assert len(g["ranks"]) == g["degree"]


def test_plan_text_reports_the_packing_bound_by_hand():
    """Three sequences that each need 60% of a 1-GPU group: three groups whatever the plan, so the
    packing bound is 3 x (overhead + time) + gradient sync (the optimum, computed here from the
    cost model), where the lower bound, counting memory alone, is below it."""
    import re

    from workbench.scenario import Scenario

    cost = Scenario(model="1b", num_gpus=1, gpus_per_node=1, gpu_memory_gb=80).cost()
    x = int(0.6 * cost.tokens_per_gpu())
    hand = 3 * (cost.group_overhead_ms(1) + float(cost.time([x], 1)[0])) + cost.grad_sync_ms()
    out = run_cli("plan", "--lengths", f"{x},{x},{x}", "--gpus", "1", "--gpus-per-node", "1", "--model", "1b",
                  "--gpu-memory", "80", "--max-len", str(x)).stdout
    lb = float(re.search(r"lower bound ([\d,.]+) ms", out).group(1).replace(",", ""))
    pb = float(re.search(r"packing bound ([\d,.]+) ms \(gap 0\.0%\)", out).group(1).replace(",", ""))
    assert pb == pytest.approx(hand, abs=0.1) and lb < hand - 1.0


def test_plan_says_on_stderr_before_a_long_pass_bound():
    """The lockstep pass bound takes seconds from a few hundred sequences up (20 s over 673 Llama-3-8B
    sequences on 64 H100s): over 256 sequences the text report says so on stderr before it starts;
    at 256 it says nothing, and stdout holds the report alone either way. The count is the rule, so
    the batches are short sequences (10-19 tokens) on 2 GPUs, whose bound takes milliseconds."""
    def args(n):
        lengths = ",".join(str(10 + k % 10) for k in range(n))
        return ("plan", "--lengths", lengths, "--gpus", "2", "--gpus-per-node", "2", "--model", "1b",
                "--zero-stage", "3", "--planner", "greedy")
    many = run_cli(*args(257))
    few = run_cli(*args(256))
    assert "lockstep pass(es)" in many.stdout and "lockstep pass(es)" in few.stdout  # a lockstep plan: the bound runs
    assert "# the lockstep pass bound over 257 sequences" in many.stderr, many.stderr
    assert "lockstep pass bound" not in few.stderr, few.stderr
    assert "lockstep pass bound over" not in many.stdout and "257 sequences" in many.stdout


def test_simulate_json_shape():
    out = json.loads(run_cli("simulate", "--lengths", "wikipedia", "--samples", "20000", "--batch-tokens", "400000",
                             "--gpus", "64", "--planners", "static-max,best-static,greedy", "--steps", "2",
                             "--quiet", "--json").stdout)
    for name in ("static-max", "best-static", "greedy"):
        r = out["planners"][name]
        assert set(r) >= {"mean_step_ms", "p50_step_ms", "p95_step_ms", "imbalance", "lower_bound_ms"}
        assert r["lower_bound_ms"] <= r["mean_step_ms"] and r["imbalance"] >= 1.0


@pytest.mark.parametrize("args, needle", [
    (["plan", "--lengths", "912384,100", "--gpus", "16", "--planner", "greedy"],
     "sequence 0 (912,384 tokens) needs"),
    (["plan", "--lengths", "wikipedia", "--gpus", "64", "--planner", "greedy"], "give --batch-tokens"),
    (["plan", "--lengths", "1000,2000", "--planner", "magic"], "unknown planner 'magic'"),
    (["plan", "--lengths", "1000,2000", "--model", "gpt5"], "unknown model 'gpt5'"),
    (["plan", "--lengths", "1000,2000", "--profile", "nope"], "unknown profile 'nope'"),
    (["plan", "--lengths", "1000,2000", "--gpus", "0"], "--gpus must be at least 1"),
    (["cost", "--lengths", "-5", "--degrees", "1"], "item 1 '-5' is not a positive length"),
    (["cost", "--lengths", "0", "--degrees", "1"], "item 1 '0' is not a positive length"),
    (["cost", "--lengths", "1024", "--degrees", "0"], "--degrees: item 1 '0' is not a positive length"),
    (["simulate", "--lengths", "1000,2000", "--steps", "0"], "--steps must be at least 1"),
    (["plan", "--lengths", "1000,2000", "--time-limit", "-1"], "--time-limit: must be a positive number"),
    (["plan", "--lengths", "1000,2000", "--profile", "workbench"], "is a folder, not a profile JSON file"),
    (["plan", "--lengths", "1000,2000", "--batch-size", "0"], "--batch-size: must be at least 1"),
    (["runs", "show", "no-such-run", "--root", "/nonexistent-root"], "no run 'no-such-run'"),
    (["lengths", "/no/such/file.txt"], "/no/such/file.txt"),
    (["cost", "--lengths", "10,x", "--degrees", "1"], "--lengths: item 2 'x' is not an integer"),
    (["simulate", "--lengths", "1000,2000", "--planners", "greedy,bogus"], "unknown planner 'bogus'"),
])
def test_bad_input_is_one_clear_line(args, needle, capsys, monkeypatch):
    """Through the console script's ``main`` in this process, from the repository's root as ``run_cli``
    runs (an interpreter per case cost more than the checks; the console script's own refusals are run
    for real by ``test_a_long_length_list_is_a_list`` and ``test_profile_missing_a_field_names_it``).
    An exception escaping ``main`` would fail the test here as its traceback would in a terminal."""
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    p = cli_main(capsys, *args)
    rc, err = p.returncode, p.stderr
    assert rc == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("workbench")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_a_long_length_list_is_a_list():
    lengths = ",".join(str(1000 + k) for k in range(200))  # ~1,000 characters: longer than a file name may be
    out = json.loads(run_cli("lengths", lengths, "--json").stdout)
    assert out["count"] == 200 and out["tokens"] == sum(1000 + k for k in range(200))
    p = run_cli("lengths", lengths + ",x", check=False)
    assert p.returncode == 2 and "item 201 'x' is not an integer" in p.stderr and "Traceback" not in p.stderr


def test_output_into_a_closed_pipe_is_not_a_traceback():
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("workbench")
    cmd = f"'{exe}' lengths wikipedia --samples 20000 --json | head -c 20"
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert p.stdout.startswith("{")


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c} in output"))


def test_plan_json_is_strict_json():
    out = _strict(run_cli("plan", "--lengths", "wikipedia", "--samples", "20000", "--batch-tokens", "300000",
                          "--gpus", "16", "--planner", "flexsp", "--time-limit", "0.5", "--json").stdout)
    assert out["planner"] == "flexsp"
    from workbench.util import dumps

    assert _strict(dumps({"tried": {"a": float("inf"), "b": float("nan"), "c": 1.5}})) == {
        "tried": {"a": None, "b": None, "c": 1.5}}


def test_profile_missing_a_field_names_it(tmp_path):
    from workbench.specs import load_profile

    d = load_profile("a100-40g-flexsp").to_dict()
    del d["gpu"]
    del d["forward"]
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps(d))
    p = run_cli("plan", "--lengths", "1000,2000", "--profile", str(bad), check=False)
    assert p.returncode == 2
    line = p.stderr.strip().splitlines()[-1]
    assert "missing fields 'gpu' (the GPU model" in line and "'forward' (the per-layer forward time curve" in line
    assert "__init__" not in p.stderr
    bad.write_text("{not json")
    p = run_cli("cost", "--lengths", "1000", "--profile", str(bad), check=False)
    assert p.returncode == 2 and "not valid JSON" in p.stderr


def test_error_hints_name_commands_that_exist():
    """Every `workbench X ...` a message or doc string in the package tells users to run is a
    command the CLI has."""
    import re
    from pathlib import Path

    from workbench.cli import build_parser

    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 - the parser's own table
    root = Path(__file__).resolve().parents[1] / "workbench"
    named = set()
    for path in root.rglob("*.py"):
        named |= set(re.findall(r"`workbench ([a-z-]+)", path.read_text()))
    assert named, "the scan found the hints"
    assert named <= commands, f"hints name commands that do not exist: {sorted(named - commands)}"


def test_cost_without_degrees_shows_the_clusters_own():
    """Without --degrees a 6-GPU node gets its candidate degrees, not 1..64 and an error about them."""
    from workbench.scenario import Scenario

    out = json.loads(run_cli("cost", "--lengths", "8192", "--gpus", "6", "--gpus-per-node", "6", "--json").stdout)
    shown = sorted({r["degree"] for r in out["rows"]})
    assert shown == list(Scenario(num_gpus=6, gpus_per_node=6).cluster().degrees) and max(shown) <= 6
    full = json.loads(run_cli("cost", "--lengths", "8192", "--json").stdout)  # 64 GPUs: 1 to 64, as before
    assert sorted({r["degree"] for r in full["rows"]}) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
