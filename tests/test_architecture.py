"""The package's shape, kept true by tests: no import cycles anywhere (function-level
imports included), and the clients of the engine reach it only through its seam."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "tokenmill"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the tokenmill modules it imports, at any depth of its code."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod if is_pkg else mod.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        base = base.rsplit(".", 1)[0]
                    stem = f"{base}.{node.module}" if node.module else base
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                # a package importing its own submodules is not a cycle through it
                if t in mods and t != mod and not (is_pkg and t.startswith(mod + ".")):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


# What each client of the engine may import of it: the seam (api, and its leaf of data
# types); the composition root only where engines are started; the cluster's engine is
# an EngineFront of its own.
SEAM = {"tokenmill.engine.api", "tokenmill.engine.types"}
ALLOWED = {
    "server": SEAM | {"tokenmill.engine.factory"},  # the launch module starts the engine
    "batch": SEAM,
    "cluster": SEAM | {"tokenmill.engine.factory", "tokenmill.engine.front"},
    "cli": SEAM | {"tokenmill.engine.factory", "tokenmill.engine.llm"},  # generate --offline runs the LLM
    "bench": set(),  # HTTP only
    "eval": set(),  # HTTP only
    "cost": set(),
}


def test_clients_reach_the_engine_only_through_its_seam():
    graph = import_graph()
    offenders = []
    for mod, deps in graph.items():
        part = mod.split(".")[1] if "." in mod else ""
        if part not in ALLOWED:
            continue
        for dep in deps:
            if dep.startswith("tokenmill.engine") and dep not in ALLOWED[part]:
                offenders.append(f"{mod} -> {dep}")
    assert not offenders, offenders


def test_eval_reaches_servers_over_http_only():
    """`tokenmill eval` judges any server, ours or a peer's, the same way: it never loads
    the model, the engine or the server in-process."""
    graph = import_graph()
    offenders = [f"{m} -> {d}" for m, deps in graph.items() if m.startswith("tokenmill.eval")
                 for d in deps if d.startswith(("tokenmill.engine", "tokenmill.model", "tokenmill.server"))]
    assert not offenders, offenders


def test_nothing_in_the_engine_imports_upward():
    graph = import_graph()
    upward = ("tokenmill.server", "tokenmill.cluster", "tokenmill.batch", "tokenmill.cli", "tokenmill.bench",
              "tokenmill.cost", "tokenmill.eval")
    offenders = [f"{m} -> {d}" for m, deps in graph.items()
                 if m.startswith(("tokenmill.engine", "tokenmill.kv", "tokenmill.model"))
                 for d in deps if d.startswith(upward)]
    assert not offenders, offenders


def test_the_engine_seam_and_front_import_no_torch():
    code = ("import sys, tokenmill.engine.api, tokenmill.engine.types, tokenmill.engine.front, "
            "tokenmill.engine.factory, tokenmill.config\n"
            "assert 'torch' not in sys.modules, 'the engine seam pulled in torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
