"""The house rules on imports, read from the code (nothing is imported or run):

* no two modules of ``workbench/`` or ``widgets/`` import each other, directly or round a loop
  (imports inside functions count: they still tie the two modules together);
* no module uses another module's underscore names (``from X import _name`` or ``X._name``): a
  helper two modules share is public in the module that owns it;
* exactly one module is named ``doctor``.

A package's ``__init__`` re-exporting its own submodules is not a loop by itself (importing a
submodule imports its package first anyway), so edges from a package to its own children are left
out. Imports by a string (``importlib.import_module(name)``) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("workbench", "widgets")

# No break of the rules is tolerated: every circle, private import and second doctor is gone (the
# list of known breaks that other work was removing went with the last of them).


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: Path = ROOT, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the packages under ``root`` (a package
    by its ``__init__.py``)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


class _Graph:
    """Who imports whom, and who uses whose underscore names, over ``mods``."""

    def __init__(self, mods: dict[str, Path]):
        self.mods = mods
        self.edges: dict[str, set[str]] = {m: set() for m in mods}
        self.private: set[str] = set()
        for m, path in mods.items():
            self._read(m, path)
        for m in self.edges:
            self.edges[m] = {t for t in self.edges[m] if t != m and not t.startswith(m + ".")}

    def module_of(self, dotted: str) -> str | None:
        """The module ``dotted`` names, or the innermost module holding it; None outside the packages."""
        while dotted:
            if dotted in self.mods:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    def _base(self, m: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = m.split(".") if self.mods[m].name == "__init__.py" else m.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def _read(self, m: str, path: Path) -> None:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        bound: dict[str, str] = {}  # local name -> the module of ours it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    target = self.module_of(a.name)
                    if target is None:
                        continue
                    self.edges[m].add(target)
                    if a.asname:
                        bound[a.asname] = target
                    else:  # ``import a.b`` binds ``a``; uses are written out in full
                        bound.setdefault(a.name.partition(".")[0], a.name.partition(".")[0])
            elif isinstance(node, ast.ImportFrom):
                base = self._base(m, node)
                if self.module_of(base) is None:
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    target = full if full in self.mods else self.module_of(base)
                    self.edges[m].add(target)
                    if full in self.mods:
                        bound[a.asname or a.name] = full
                    if _private(a.name) and target != m:
                        self.private.add(f"{m} imports {full}")
        for node in ast.walk(tree):  # X._name on a module X of ours
            if isinstance(node, ast.Attribute) and _private(node.attr):
                dotted = _dotted(node.value, bound)
                if dotted is not None and dotted in self.mods and dotted != m:
                    self.private.add(f"{m} uses {dotted}.{node.attr}")

    def circles(self) -> list[list[str]]:
        """The strongly connected components of more than one module (Tarjan's, iterative)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        out = []
        for root in sorted(self.edges):
            if root in index:
                continue
            work = [(root, iter(sorted(self.edges[root])))]
            index[root] = low[root] = len(index)
            stack.append(root)
            on_stack.add(root)
            while work:
                v, it = work[-1]
                w = next(it, None)
                if w is not None:
                    if w not in index:
                        index[w] = low[w] = len(index)
                        stack.append(w)
                        on_stack.add(w)
                        work.append((w, iter(sorted(self.edges[w]))))
                    elif w in on_stack:
                        low[v] = min(low[v], index[w])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
        return sorted(out)


def _dotted(expr: ast.expr, bound: dict[str, str]) -> str | None:
    """``a.b.c`` written in ``expr`` with its first name replaced by the module it is bound to."""
    names = []
    while isinstance(expr, ast.Attribute):
        names.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in bound:
        return None
    return ".".join([bound[expr.id], *reversed(names)])


def _circle_line(comp) -> str:
    return "circle: " + " <-> ".join(sorted(comp))


@pytest.fixture(scope="module")
def graph() -> _Graph:
    return _Graph(_modules())


def _problems(graph: _Graph) -> set[str]:
    """Every break of the rules, one line each."""
    out = {_circle_line(c) for c in graph.circles()} | graph.private
    doctors = sorted(m for m in graph.mods if m.rpartition(".")[2] == "doctor")
    if len(doctors) != 1:
        out.add(f"{len(doctors)} doctor modules: {', '.join(doctors)}")
    return out


def test_the_check_reads_the_packages(graph):
    # a check that found nothing to read would pass whatever the code does
    assert {"workbench.specs", "workbench.scenario", "workbench.data.files", "widgets.solver"} <= set(graph.mods)
    assert "workbench.data" in graph.edges["workbench.scenario"]  # imported inside its methods only
    assert "workbench.scenario" in graph.edges["widgets.solver"]


def test_no_import_circles(graph):
    new = [_circle_line(c) for c in graph.circles()]
    assert not new, ("modules that import each other (imports inside functions count); move what one needs "
                     "to where it belongs by DESIGN.md's dependency direction:\n" + "\n".join(new))


def test_no_private_names_of_other_modules(graph):
    new = sorted(graph.private)
    assert not new, ("another module's underscore names used; make a shared helper public in the module that "
                     "owns it:\n" + "\n".join(new))


def test_one_module_named_doctor(graph):
    new = [line for line in _problems(graph) if "doctor modules" in line]
    assert not new, "\n".join(new)


def test_the_rules_catch_a_circle_and_a_private_import(tmp_path):
    # the check itself, on a small package written here: a loop through a function-level import, a
    # private name imported, one used through its module, a package re-exporting its children
    pkg = tmp_path / "workbench"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from workbench import b\n",
        "b.py": "def f():\n    from workbench.c import g\n",
        "c.py": "import workbench.a\nfrom workbench.d import _hidden\n",
        "d.py": "_hidden = 1\n",
        "e.py": "from workbench import d as dd\nx = dd._hidden\n",
        "sub/__init__.py": "from .x import y\nfrom . import z\n",
        "sub/x.py": "from workbench.sub import z\ny = 1\n",
        "sub/z.py": "from . import x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    g = _Graph(_modules(tmp_path, ("workbench",)))
    assert g.circles() == [["workbench.a", "workbench.b", "workbench.c"], ["workbench.sub.x", "workbench.sub.z"]]
    assert g.private == {"workbench.c imports workbench.d._hidden", "workbench.e uses workbench.d._hidden"}
    assert "workbench.sub.x" not in g.edges["workbench.sub"]  # a package's own children: re-exports


