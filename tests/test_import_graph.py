"""Import structure of the whole gdskv package: no import cycle anywhere, every module imports
on its own, and the engine packages depend one way (ttft -> connectors -> engine).

The import graph is read from the source with ``ast``: every ``import`` and ``from ...
import`` of a module, at module level and inside functions alike (a function-level import
that closes a cycle is still a cycle, only a hidden one), relative imports resolved, and
only edges to modules inside gdskv kept. ``from P import name`` is an edge to the module
``P.name`` when there is one, else to ``P``. Two kinds of import are left out: those under
``if TYPE_CHECKING:`` (never executed), and the implicit import of a module's parent
packages (every ``gdskv.x`` runs ``gdskv/__init__.py`` first; that is no cycle unless the
``__init__`` imports back, which is an explicit edge).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Packages of the optional extras in pyproject.toml (gpu, uring, rdma, engine, bench) and
#: the serving engines: a module that needs one that is not installed is skipped, not failed.
OPTIONAL = ("kvikio", "cupy", "liburing", "pyverbs", "torch", "transformers", "matplotlib", "rich", "vllm", "sglang")


def module_files(root: Path, package: str) -> Dict[str, Path]:
    """Module name -> file of every module of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _import_nodes(other)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def import_graph(root: Path, package: str) -> Dict[str, Set[str]]:
    """Module -> the modules of ``package`` it imports (see the module docstring)."""
    modules = module_files(root, package)
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        edges: Set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target:
                        edges.add(target)
                continue
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    edges.add(f"{source}.{alias.name}")
                elif source in modules:
                    edges.add(source)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one
    module, found with Tarjan's algorithm (iteratively: no recursion limit)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_cycle_through(graph, component) for component in components]


def _cycle_through(graph: Dict[str, Set[str]], component: List[str]) -> List[str]:
    """A shortest cycle from the component's first module back to itself (breadth first)."""
    members = set(component)
    start = component[0]
    previous: Dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path: List[str] = []
                    at: Optional[str] = node
                    while at is not None:
                        path.append(at)
                        at = previous[at]
                    return path[::-1] + [start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in component {component}")


def test_the_cycle_finder_sees_hidden_and_relative_imports(tmp_path):
    """The control: a package whose cycle goes through a function-level and a relative
    import is reported, with the modules of the cycle in order."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def later():\n    from .sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..a import something\nimport os\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
        "pkg/e.py": "import pkg.d\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set()  # a TYPE_CHECKING import is never executed
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_gdskv_has_no_import_cycle():
    cycles = find_cycles(import_graph(ROOT, "gdskv"))
    assert not cycles, "import cycles in gdskv:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


#: What the engine packages may import of each other: the TTFT benchmark sits on the
#: adapters and the core, the adapters on the core, and the core on neither, save for the
#: old module paths of the adapters (re-exports kept for engine configs that name them).
ENGINE_LAYERS = {"gdskv.engine": ("gdskv.connectors", "gdskv.ttft"), "gdskv.connectors": ("gdskv.ttft",)}
ALIASES = {"gdskv.engine.vllm": "gdskv.connectors.vllm", "gdskv.engine.sglang": "gdskv.connectors.sglang"}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_engine_packages_depend_one_way():
    graph = import_graph(ROOT, "gdskv")
    bad = []
    for module, targets in sorted(graph.items()):
        for package, above in ENGINE_LAYERS.items():
            if _within(module, package):
                for target in sorted(targets):
                    if any(_within(target, a) for a in above) and ALIASES.get(module) != target:
                        bad.append(f"{module} -> {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


# A fresh interpreter that has imported gdskv forks one child per module. Importing
# ``gdskv.x`` in a new interpreter runs ``gdskv/__init__.py`` first, so a child forked
# right after that starts from exactly the state a new interpreter would reach, minus the
# ~0.25 s of startup per module (about 100 modules, on 2 shared cores).
DRIVER = textwrap.dedent(
    """
    import importlib, importlib.util, json, os, sys, traceback

    modules, optional, workers = json.loads(sys.argv[1]), tuple(sys.argv[2].split(",")), int(sys.argv[3])
    import gdskv  # noqa: F401  (what importing any gdskv module does first)

    def missing_optional(exc):
        while exc is not None:
            name = getattr(exc, "name", None) or ""
            top = name.partition(".")[0]
            if isinstance(exc, ImportError) and top in optional and importlib.util.find_spec(top) is None:
                return top
            exc = exc.__cause__ or exc.__context__
        return None

    def child(module, fd):
        try:
            importlib.import_module(module)
            result = {"ok": True}
        except BaseException as exc:
            top = missing_optional(exc)
            result = {"skip": top} if top else {"error": traceback.format_exc()}
        os.write(fd, json.dumps(result).encode())
        os._exit(0)

    results, running, queue = {}, {}, list(modules)
    while queue or running:
        while queue and len(running) < workers:
            module = queue.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                child(module, w)
            os.close(w)
            running[pid] = (module, r)
        pid, status = os.wait()
        module, r = running.pop(pid)
        chunks = []
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(r)
        text = b"".join(chunks).decode()
        results[module] = json.loads(text) if text else {"error": f"the child died (wait status {status})"}
    print(json.dumps(results))
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the per-module import check forks")
def test_every_module_imports_on_its_own():
    # ``__main__`` modules are programs (``python -m``): importing one runs it.
    modules = sorted(m for m in module_files(ROOT, "gdskv") if m != "gdskv" and not m.endswith(".__main__"))
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(modules), ",".join(OPTIONAL), str(os.cpu_count() or 2)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # gdskv itself imports
    results = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(results) == modules
    errors = {m: r["error"] for m, r in results.items() if "error" in r}
    assert not errors, "modules that fail to import on their own:\n" + "\n".join(f"{m}:\n{e}" for m, e in errors.items())
    skipped = {m: r["skip"] for m, r in results.items() if "skip" in r}
    for module, package in skipped.items():
        assert importlib.util.find_spec(package) is None, f"{module}: {package} is installed"
    assert len(skipped) < len(modules) // 4, f"too many skipped: {skipped}"
