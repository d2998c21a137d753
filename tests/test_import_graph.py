"""No import circle between the modules of ckpt_agent, ckpt_operator and ckpt_e2e.

import-linter's contracts order the layers, but a circle inside one layer (two
modules of the same package that import each other, even only under
``TYPE_CHECKING``) passes them all. This test reads the same import graph
(grimp, import-linter's engine) with the ``TYPE_CHECKING`` imports kept and
fails on any strongly connected set of modules, naming one circle in it.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import grimp
import pytest

PACKAGES = ("ckpt_agent", "ckpt_operator", "ckpt_e2e")


def strongly_connected(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node (or a self-loop).

    Tarjan's algorithm, iterative (the module graph is deep enough for recursion limits).
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp: list[str] = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1 or node in graph.get(node, ()):
                    found.append(sorted(comp))
    return found


def one_circle(graph: Mapping[str, Set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the first module of ``component`` (breadth-first)."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier: list[str] = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt not in members:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no circle through {start} in {component}")  # pragma: no cover


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``TYPE_CHECKING`` imports included)."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_finds_circles_in_a_small_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    comps = strongly_connected(graph)
    assert comps == [["a", "b", "c"], ["e"]]
    assert one_circle(graph, comps[0]) == ["a", "b", "c", "a"]
    assert one_circle(graph, comps[1]) == ["e", "e"]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_reads_type_checking_imports() -> None:
    # The S3 transfer module imports its boto3 type definitions only under TYPE_CHECKING;
    # the graph must still see what every module imports there.
    graph = grimp.build_graph(
        "ckpt_agent", include_external_packages=True, exclude_type_checking_imports=False
    )
    assert "mypy_boto3_s3" in graph.find_modules_directly_imported_by(
        "ckpt_agent.storage.s3.transfer"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str, import_graph: dict[str, set[str]]) -> None:
    graph = import_graph
    circles = [
        " -> ".join(one_circle(graph, comp))
        for comp in strongly_connected(graph)
        if any(m == package or m.startswith(package + ".") for m in comp)
    ]
    assert not circles, "import circles (break them; TYPE_CHECKING imports count):\n" + "\n".join(
        circles
    )
