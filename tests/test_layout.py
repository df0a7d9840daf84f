"""The package's shape stays readable: no import circles, no module over 600 lines, and a
README a newcomer reads to the end (docs/development.md describes the layout)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_MODULE_LINES = 600
MAX_README_LINES = 199


def module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the gspo modules it imports (``from gspo.pkg import name`` counts as the
    submodule ``gspo.pkg.name`` where there is one, else as ``gspo.pkg``); imports under
    ``TYPE_CHECKING`` and inside functions count too: a circle of them is still a circle."""
    paths = {module_name(p, src): p for p in (src / "gspo").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in paths:
                        targets.add(sub)
                    elif base in paths:
                        targets.add(base)
        targets.discard(name)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle_through_a_package_face(tmp_path):
    package = tmp_path / "gspo" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "gspo" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from gspo.pkg.a import A\n")
    (package / "a.py").write_text("from gspo.pkg.b import B\nA = 1\n")
    (package / "b.py").write_text("from gspo.pkg import A\nB = 2\n")  # back through the face
    (tmp_path / "gspo" / "c.py").write_text("from . import pkg\n")
    graph = import_graph(tmp_path)
    assert graph["gspo.c"] == {"gspo.pkg"}
    assert circles(graph) == [["gspo.pkg", "gspo.pkg.a", "gspo.pkg.b"]]
    (package / "b.py").write_text("B = 2\n")
    assert circles(import_graph(tmp_path)) == []


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 50  # the whole package was read
    assert circles(graph) == []


def test_no_module_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (SRC / "gspo").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_every_module_imports():
    """Each module of the package imports (in a fresh process): a name moved away from a
    module that another still imports it from (gspo.environments took answer_text from
    gspo.rewards.parsing after it moved to gspo.rewards.thinking) failed every run."""
    import os
    import subprocess
    import sys

    names = sorted(module_name(p) for p in (SRC / "gspo").rglob("*.py"))
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        print(f'{name}: {type(e).__name__}: {e}')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=240, env=env
    )
    assert (done.returncode, done.stdout) == (0, ""), done.stderr[-2000:]
