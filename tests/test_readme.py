"""The README's commands and Python lines work as written (run from a temporary run store)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_readme_python_block_runs(tmp_path):
    """The block runs as written in a fresh interpreter (as in a new notebook kernel), and leaves
    that interpreter without torch: training ran as its own process tree."""
    (block,) = _python_blocks()[:1]
    checks = """
import sys
assert plan.planner == "greedy" and plan.lower_bound_ms <= plan.makespan_ms
assert set(sim.planners) == {"static-max", "greedy"}
assert status.state == "done", status.to_dict()
assert len(losses) == 5 and all(isinstance(x, float) for x in losses), losses
assert [s["id"] for s in summary] == [run.id], summary
assert "torch" not in sys.modules, "launching must not import torch into the caller"
print("README-OK", run.path)
"""
    script = tmp_path / "readme_block.py"
    script.write_text(block + checks)
    env = dict(os.environ, WORKBENCH_RUNS=str(tmp_path / "runs"), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=300)
    assert p.returncode == 0 and "README-OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
    assert str(tmp_path / "runs") in p.stdout


def test_readme_names_only_existing_commands_and_options():
    """Every `workbench COMMAND --option` in the README's shell blocks parses."""
    from workbench.cli import build_parser

    parser = build_parser()
    text = README.read_text()
    lines = [ln.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
             for ln in block.splitlines()]
    cmds = [ln for ln in lines if ln.startswith("workbench ")]
    assert len(cmds) >= 8
    for ln in cmds:
        args = [a.replace("<id>", "x").replace("<id-a>", "a").replace("<id-b>", "b").replace("PATH", "p.json")
                for a in ln.split()[1:]]
        parser.parse_args(args)  # exits (SystemExit) on an unknown command or option
