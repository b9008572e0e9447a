"""moonep's modules import each other without a cycle, and ``moonep/handles.py`` imports nothing of moonep.

Read from the source, nothing is imported: every ``.py`` file under ``moonep/`` is parsed with ``ast`` and
every ``import`` / ``from ... import`` in it (module level, inside functions and classes, relative or
absolute) becomes an edge to the moonep module it names:

* ``import a.b.c`` is an edge to ``a.b.c`` only (that Python also runs ``a`` and ``a.b`` first is not
  counted: the usual reading of "import cycle");
* ``from p import x`` is an edge to ``p.x`` when ``x`` is a submodule of ``p``, else to ``p`` (a package's
  ``__init__`` is counted whenever it is imported directly);
* ``from . import x`` / ``from ..q import y`` are resolved against the importing module's package;
* imports under ``if TYPE_CHECKING:`` never run and are left out.

A cycle fails with every module on it and the file:line of each import that closes it.
"""
from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "moonep"


@dataclass
class Site:
    """One import statement that makes an edge."""

    file: str
    line: int
    text: str
    scope: str  # "module" or "function"

    def __str__(self):
        return f"{self.file}:{self.line} [{self.scope}-level] {self.text}"


@dataclass
class Graph:
    modules: dict[str, Path]                      # dotted name -> file (a package's __init__.py)
    namespaces: set[str]                          # directories without __init__.py
    edges: dict[str, dict[str, list[Site]]] = field(default_factory=dict)  # src -> dst -> sites
    errors: list[str] = field(default_factory=list)

    def is_package(self, name: str) -> bool:
        return name in self.namespaces or (name in self.modules and self.modules[name].name == "__init__.py")


def _discover(root: Path, package: str):
    """(modules, namespace packages) of ``root/package``: dotted name -> file."""
    modules, namespaces = {}, set()
    pkg_dir = root / package
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if "__pycache__" in parts or any(not p.isidentifier() for p in parts[:-1]):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    for d in [pkg_dir, *sorted(p for p in pkg_dir.rglob("*") if p.is_dir())]:
        parts = d.relative_to(root).parts
        if "__pycache__" in parts or not all(p.isidentifier() for p in parts):
            continue
        name = ".".join(parts)
        if name not in modules and any(d.glob("*.py")):
            namespaces.add(name)
    return modules, namespaces


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Yield (node, scope) for every import statement that can run, with its scope."""

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:  # the ``else`` branch does run
                    yield from visit_one(sub, scope)
                continue
            yield from visit_one(child, scope)

    def visit_one(child, scope):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, scope
        inner = "function" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else scope
        yield from visit(child, inner)

    yield from visit(tree, "module")


def build_graph(root: Path = REPO_ROOT, package: str = PACKAGE) -> Graph:
    modules, namespaces = _discover(root, package)
    g = Graph(modules, namespaces)

    def internal(name):
        return name == package or name.startswith(package + ".")

    def target(name):
        """The module file that ``import name`` runs (no edge for a namespace package)."""
        while name:
            if name in modules:
                return name
            if name in namespaces:
                return None
            name = name.rpartition(".")[0]  # not a module (a typo, an attribute): its closest module
        return None

    for src, path in modules.items():
        rel = path.relative_to(root).as_posix()
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=rel)
        except (SyntaxError, UnicodeDecodeError) as exc:
            g.errors.append(f"{rel}: cannot parse: {exc}")
            continue
        lines = source.splitlines()
        here = src if g.is_package(src) else src.rpartition(".")[0]  # the package relative imports start in
        out = g.edges.setdefault(src, {})
        for node, scope in _imports(tree):
            site = Site(rel, node.lineno, lines[node.lineno - 1].strip() if node.lineno <= len(lines) else "",
                        scope)
            dsts = []
            if isinstance(node, ast.Import):
                dsts = [target(a.name) for a in node.names if internal(a.name)]
            else:
                if node.level:
                    parts = here.split(".")
                    if node.level - 1 >= len(parts):
                        g.errors.append(f"{site}: relative import beyond the top-level package")
                        continue
                    base = ".".join(parts[:len(parts) - (node.level - 1)])
                    if node.module:
                        base = f"{base}.{node.module}"
                else:
                    base = node.module or ""
                if not internal(base):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if a.name != "*" and (sub in modules or sub in namespaces):
                        dsts.append(target(sub))
                    else:
                        dsts.append(target(base))
            for dst in dict.fromkeys(dsts):  # one site per statement and target
                if dst is not None and dst != src:
                    out.setdefault(dst, []).append(site)
    return g


def strongly_connected(edges: dict[str, dict]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of more than one module, each sorted."""
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]
    nodes = sorted(set(edges) | {d for out in edges.values() for d in out})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, {})))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
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
                        comps.append(sorted(comp))
    return sorted(comps)


def shortest_cycle(edges: dict[str, dict], comp: list[str]) -> list[str]:
    """A shortest cycle inside one strongly connected component: [m0, m1, ..., m0]."""
    members, best = set(comp), None
    for start in comp:
        prev, queue = {start: None}, deque([start])
        while queue:
            v = queue.popleft()
            for w in sorted(edges.get(v, {})):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    cycle = list(reversed(path)) + [start]  # path runs v, prev[v], ..., start
                    if best is None or len(cycle) < len(best):
                        best = cycle
                    queue.clear()
                    break
                if w in members and w not in prev:
                    prev[w] = v
                    queue.append(w)
    return best


def describe_cycles(g: Graph) -> str:
    comps = strongly_connected(g.edges)
    if not comps:
        return ""
    out = [f"{len(comps)} import cycle(s) among {PACKAGE} modules "
           f"(module-level and function-level imports both count):"]
    for i, comp in enumerate(comps, 1):
        cycle = shortest_cycle(g.edges, comp)
        out.append(f"\n cycle {i}: " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            for site in g.edges[a][b]:
                out.append(f"    {a} -> {b}:  {site}")
        if len(comp) > len(cycle) - 1:
            out.append(f"    (the whole strongly connected set, {len(comp)} modules: {', '.join(comp)})")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------- tests
def test_every_module_parses():
    g = build_graph()
    assert g.modules, f"no module found under {REPO_ROOT / PACKAGE}"
    if g.errors:
        pytest.fail("\n".join(g.errors), pytrace=False)


def test_no_import_cycle():
    g = build_graph()
    report = describe_cycles(g)
    if report:
        if g.errors:
            report += "\n\n(not read: " + "; ".join(g.errors) + ")"
        pytest.fail(report, pytrace=False)


def test_handles_imports_nothing_of_moonep():
    path = REPO_ROOT / PACKAGE / "handles.py"
    if not path.exists():
        pytest.skip("moonep/handles.py does not exist yet")
    g = build_graph()
    assert not any(e.startswith("moonep/handles.py") for e in g.errors), g.errors
    out = g.edges.get(f"{PACKAGE}.handles", {})
    if out:
        pytest.fail("moonep/handles.py must import nothing else of moonep, but imports:\n" + "\n".join(
            f"  {dst}:  {site}" for dst, sites in sorted(out.items()) for site in sites), pytrace=False)


def test_import_moonep_imports_no_compiler():
    """``import moonep`` leaves torch's compilers unimported (over a second of every process's start, which a
    process that never compiles would pay for nothing: ``moonep.eager_only``); compiling still works."""
    import subprocess
    import sys

    code = ("import sys, torch, moonep\n"
            "late = sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules)\n"
            "assert not late, late\n"
            "ep = moonep.ExpertParallel(num_experts=4, topk=2, hidden=8, max_tokens=4, dtype=torch.float32,\n"
            "                           device='cpu')\n"
            "x, idx, w = torch.randn(4, 8), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]]), torch.rand(4, 2)\n"
            "def step(x, idx, w):\n"
            "    h = ep.dispatch(x, idx, w)\n"
            "    return ep.combine(h.tokens * 2, h)\n"
            "assert torch.equal(torch.compile(step, backend='aot_eager', fullgraph=True)(x, idx, w), step(x, idx, w))\n"
            "ep.close()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


# The walker itself, on a small made-up package (so it is checked whatever state moonep/ is in).
def _write(root: Path, files: dict):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_walker_resolves_imports(tmp_path):
    _write(tmp_path, {
        "moonep/__init__.py": "from . import a\nfrom .b import thing\nimport os\n",
        "moonep/a.py": "def f():\n    from moonep.sub import deep\n    import moonep.sub.other\n",
        "moonep/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moonep import a\n"
                       "else:\n    import moonep.errors\nthing = 1\n",
        "moonep/errors.py": "from moonep import thing, a\n",
        "moonep/sub/__init__.py": "from .. import errors\nfrom .deep import name\n",
        "moonep/sub/deep.py": "from ..sub import name2\nfrom . import *\n",
        "moonep/sub/other.py": "from ... import outside\n",
        "moonep/ns/mod.py": "from moonep import ns\nfrom moonep.ns import mod2\n",
        "moonep/ns/mod2.py": "",
    })
    g = build_graph(tmp_path, "moonep")
    e = {src: set(dst) for src, dst in g.edges.items()}
    assert e["moonep"] == {"moonep.a", "moonep.b"}
    assert e["moonep.a"] == {"moonep.sub.deep", "moonep.sub.other"}  # function level; not moonep, moonep.sub
    assert e["moonep.b"] == {"moonep.errors"}                         # TYPE_CHECKING left out, else kept
    assert e["moonep.errors"] == {"moonep", "moonep.a"}               # a name -> the package; a submodule
    assert e["moonep.sub"] == {"moonep.errors", "moonep.sub.deep"}
    assert e["moonep.sub.deep"] == {"moonep.sub"}                     # ``from . import *``: the package
    assert e["moonep.ns.mod"] == {"moonep.ns.mod2"}                   # a namespace package runs nothing
    assert g.namespaces == {"moonep.ns"}
    assert len(g.errors) == 1 and "beyond the top-level package" in g.errors[0]
    assert g.edges["moonep.a"]["moonep.sub.deep"][0].scope == "function"
    # moonep -> moonep.b -> moonep.errors -> moonep, and moonep -> a -> sub.deep -> sub -> errors -> moonep
    comps = strongly_connected(g.edges)
    assert comps == [["moonep", "moonep.a", "moonep.b", "moonep.errors", "moonep.sub", "moonep.sub.deep"]]
    assert shortest_cycle(g.edges, comps[0]) == ["moonep.sub", "moonep.sub.deep", "moonep.sub"]
    report = describe_cycles(g)
    assert "cycle 1: moonep.sub -> moonep.sub.deep -> moonep.sub" in report, report
    assert "moonep/sub/__init__.py:2 [module-level] from .deep import name" in report, report
    assert "moonep/sub/deep.py:1 [module-level] from ..sub import name2" in report, report
    assert "the whole strongly connected set, 6 modules" in report, report


def test_walker_finds_no_cycle_in_a_layered_package(tmp_path):
    _write(tmp_path, {
        "moonep/__init__.py": "from .top import run\n",
        "moonep/top.py": "from .low import x\ndef run():\n    from moonep import low\n",
        "moonep/low.py": "x = 1\n",
    })
    g = build_graph(tmp_path, "moonep")
    assert strongly_connected(g.edges) == [] and describe_cycles(g) == ""
