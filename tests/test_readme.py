"""Every command shown in README.md and in docs/*.md works as written (a new doc is picked up by
itself).

In every ```bash block:
- ``workbench ...`` lines are parsed by the CLI's own parser (an unknown command or option, or a
  bad value, fails); a usage line (``[--step N]``, ``a|b``) must name an existing command and
  options. The fast ones that write nothing (``lengths``, ``cost``, ``plan``,
  ``simulate``, ``notebook list``, ``runs list``) are also run, in a temporary folder with a
  temporary run store, and must exit 0;
- ``python bench/X.py ...``: the script exists and takes every option named (its ``--help``);
  benchmarks take minutes, so they are never run here;
- ``make TARGET ...``: the Makefile has the target;
- ``.venv/bin/python -m pytest ...``: the test files exist and the marks are declared.
Other lines (``apt-get``, ``cd``, ...) are left alone.

A block whose commands must not run (they take long, or read a file an earlier command writes) is
marked by this HTML comment on the line just before its opening fence (invisible when rendered;
a reason may follow "only")::

    <!-- docs-test: parse only -->

Its commands are still parsed. Inline code in the prose that names a command (```workbench plan
--gpus 64```, ```python bench/solver.py --small 120```) must name an existing command, script and
options; inline code with syntax brackets (``[--html PATH]``) is not checked. Every ```python block
compiles; README's block that trains runs as written (slow). Links between the docs, their
#anchors and the images resolve.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PARSE_ONLY = "<!-- docs-test: parse only"
RUN_COMMANDS = {("lengths",), ("cost",), ("plan",), ("simulate",), ("notebook", "list"), ("runs", "list")}

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", flags=re.S | re.M)


def _blocks(path: Path, lang: str) -> list[tuple[str, bool]]:
    """``(body, parse_only)`` of each fenced block of ``lang`` in ``path``."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) != lang:
            continue
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append((m.group(2), before.startswith(PARSE_ONLY)))
    return out


def _lines(path: Path) -> list[tuple[str, bool]]:
    """The command lines of the bash blocks (comments stripped, ``\\`` continuations joined), with
    the block's parse-only flag."""
    out = []
    for body, only in _blocks(path, "bash"):
        for ln in body.replace("\\\n", " ").splitlines():
            ln = ln.split(" #")[0].strip()
            if ln and not ln.startswith("#"):
                out.append((ln, only))
    return out


def _synopsis(line: str) -> bool:
    """A usage line (``[--step N]``, ``a|b``, ``...``) rather than a command to type."""
    return bool(re.search(r"[\[\]|]|\.\.\.", line))


def _placeholders(args: list[str]) -> list[str]:
    """``runs/<id>`` -> ``runs/1``, ``RUN``/``PATH``/``N`` -> ``1``: what a user types there."""
    return ["1" if re.fullmatch(r"[A-Z]+", a) else re.sub(r"<[^>]+>", "1", a) for a in args]


@functools.cache
def _cli() -> argparse.ArgumentParser:
    from workbench.cli import build_parser

    return build_parser()


def _subparser(command: str) -> argparse.ArgumentParser:
    for action in _cli()._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert command in action.choices, f"no command `workbench {command}`"
            return action.choices[command]
    raise AssertionError("the CLI has no subcommands")


HELPS = """
import contextlib, io, json, os, runpy, sys
out = {}
for script in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv, path = [script, "--help"], list(sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python bench/X.py` has it
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(script, run_name="__main__")
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException as e:  # noqa: BLE001 - reported as the script's failure
            rc = 1
            print(repr(e), file=stderr)
    sys.path[:] = path
    out[script] = [rc, stdout.getvalue(), stderr.getvalue()[-500:]]
print("HELPS " + json.dumps(out))
"""
"""Runs each script given as JSON with ``--help`` as ``python bench/X.py --help`` would (``__main__``,
its folder first on ``sys.path``), one after another in one interpreter (an interpreter each cost
more than most of them), and prints each exit status, its help and the end of its stderr."""


@functools.cache
def _bench_helps() -> dict:
    """``{script: [exit status, stdout, stderr's end]}`` of ``--help`` of every ``bench/*.py`` script the
    docs name, in one interpreter (``HELPS``)."""
    import json

    named = sorted({m for doc in DOCS for m in re.findall(r"python (bench/[\w.-]+\.py)", doc.read_text())
                    if (ROOT / m).is_file()})
    p = subprocess.run([sys.executable, "-c", HELPS, json.dumps(named)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0 and "HELPS " in p.stdout, p.stderr[-4000:]
    return json.loads(p.stdout.rsplit("HELPS ", 1)[1])


def _bench_options(script: str) -> str:
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    rc, out, err = _bench_helps()[script]
    assert rc == 0, f"{script} --help failed: {err}"
    return out


def _options(args: list[str]) -> list[str]:
    return [a.split("=")[0] for a in args if a.startswith("--")]


def _check_line(line: str, where: str, *, parse_fully: bool) -> list[str] | None:
    """Check one command; returns the workbench arguments when it is one to run."""
    args = _placeholders(shlex.split(line))
    if ">" in args:  # `workbench train ... --emit slurm > job.sbatch`: the command is what comes before
        args = args[:args.index(">")]
    if len(args) < 2:
        return None
    if args[0] == "workbench":
        if parse_fully:
            try:
                _cli().parse_args(args[1:])
            except SystemExit:
                raise AssertionError(f"{where}: `{line}` does not parse (see the usage line above)") from None
        else:  # a mention in the prose: the command and its options exist
            sub = _subparser(args[1])
            for opt in _options(args[2:]):
                assert opt in sub._option_string_actions, f"{where}: `workbench {args[1]}` has no option {opt}"
        key = tuple(a for a in args[1:3] if not a.startswith("-"))
        if key[:1] in RUN_COMMANDS or key[:2] in RUN_COMMANDS:
            return args[1:]
    elif args[0] == "python" and args[1].startswith("bench/") and args[1].endswith(".py"):
        helptext = _bench_options(args[1])
        for opt in _options(args[2:]):
            assert re.search(rf"(^|[\s,]){re.escape(opt)}\b", helptext), f"{where}: {args[1]} has no option {opt}"
    elif args[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        for t in (a for a in args[1:] if "=" not in a):
            assert t in targets, f"{where}: the Makefile has no target {t}"
    elif args[:3] == [".venv/bin/python", "-m", "pytest"]:
        marks = (ROOT / "pyproject.toml").read_text()
        rest = args[3:]
        for k, a in enumerate(rest):
            if a.endswith(".py") or "::" in a:
                assert (ROOT / a.split("::")[0]).is_file(), f"{where}: {a} does not exist"
            if k and rest[k - 1] == "-m":
                for mark in re.findall(r"\w+", a.replace("not", " ")):
                    assert f'"{mark}:' in marks, f"{where}: no pytest mark {mark} is declared"
    return None


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


RUNNER = """
import contextlib, io, json, sys
from workbench.cli import main

out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    out.append([rc, err.getvalue()[-2000:]])
print("RESULTS " + json.dumps(out))
"""
"""Runs each command given as JSON through the console script's own ``main``, one after another in
one interpreter (an interpreter start per command cost more than most of them), and prints each
exit status and the end of its stderr."""

_RAN: set[str] = set()
"""The commands that ran and exited 0 in this session, as their parsed arguments: a doc that shows
the same command (``--effort 1`` is the default effort) does not run it again."""


def _key(args: list[str]) -> str:
    ns = vars(_cli().parse_args(args))
    return repr(sorted((k, repr(v)) for k, v in ns.items() if k != "func"))


@pytest.mark.long
@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_command_in_the_doc_parses_and_the_quick_ones_run(doc, tmp_path):
    """The bash blocks: every command parses (or exists, for scripts and make targets); the quick
    read-only ``workbench`` commands run and exit 0 (one interpreter runs a doc's commands in turn;
    a command another doc ran in this session with the same parsed arguments is not run twice)."""
    import json

    to_run = []
    for line, parse_only in _lines(doc):
        args = _check_line(line, _doc_id(doc), parse_fully=not _synopsis(line))
        if args is not None and not parse_only and not _synopsis(line):
            to_run.append(args)
    to_run = [a for a in to_run if _key(a) not in _RAN]
    if not to_run:
        return
    env = dict(os.environ, WORKBENCH_RUNS=str(tmp_path / "runs"), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(to_run)], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0 and "RESULTS " in p.stdout, p.stderr[-4000:]
    results = json.loads(p.stdout.rsplit("RESULTS ", 1)[1])
    assert len(results) == len(to_run)
    for args, (rc, err) in zip(to_run, results):
        assert rc == 0, (f"{_doc_id(doc)}: `workbench {' '.join(args)}` exited {rc} (a command that "
                         f"needs your files or takes long: put {PARSE_ONLY} --> on the line before its "
                         f"block):\n{err}")
        _RAN.add(_key(args))


def test_the_readme_shows_the_commands_a_newcomer_needs():
    lines = [ln for ln, _ in _lines(README)]
    for needed in ("make demo", "make test", "make lab", ".venv/bin/python -m pytest tests/test_cost.py"):
        assert any(ln.startswith(needed) for ln in lines), needed
    assert sum(ln.startswith("workbench ") for ln in lines) >= 8
    assert len(README.read_text().splitlines()) < 250, "README.md is for a newcomer's ten minutes: move detail to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_commands_named_in_the_prose_exist(doc):
    text = FENCE.sub("", doc.read_text())
    for code in re.findall(r"`([^`]+)`", text):
        code = " ".join(code.split())
        if not re.match(r"(workbench|python bench/\S+\.py)( |$)", code) or _synopsis(code):
            continue
        _check_line(code, _doc_id(doc), parse_fully=False)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_links_and_images_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{_doc_id(doc)} links to {target}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", path.read_text()), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{_doc_id(doc)} links to {target}: no such heading"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_python_blocks_compile(doc):
    for k, (body, _) in enumerate(_blocks(doc, "python")):
        compile(body, f"{_doc_id(doc)} python block {k + 1}", "exec")


@pytest.mark.slow
def test_readme_python_block_runs(tmp_path):
    """README's block that trains runs as written in a fresh interpreter (as in a new notebook
    kernel), and leaves that interpreter without torch: training ran as its own process tree."""
    (block,) = [b for b, _ in _blocks(README, "python") if "prepare_train" in b]
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
