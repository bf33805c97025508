"""The client's modules import each other without a cycle, and the parts of ``RLClient`` meet only
through the connection they are given (imports read by grimp, lazy ones inside functions too)."""

import grimp
import pytest


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("opentinker_client", "opentinker_common", "opentinker")


def _client_imports(graph, module: str) -> set[str]:
    return {m for m in graph.find_modules_directly_imported_by(module) if m.split(".")[0] == "opentinker_client"}


def _a_cycle(graph) -> list[str] | None:
    """One import cycle among opentinker_client's modules, as the modules along it, else None."""
    modules = sorted(m for m in graph.modules if m.split(".")[0] == "opentinker_client")
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(_client_imports(graph, module)):
            if state.get(imported) == 1:
                return path[path.index(imported) :] + [imported]
            if imported not in state:
                found = visit(imported)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in modules:
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_client_modules_import_no_cycle(graph) -> None:
    cycle = _a_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_the_cycle_search_finds_a_cycle() -> None:
    g = grimp.ImportGraph()
    for name in ("opentinker_client", "opentinker_client.a", "opentinker_client.b", "opentinker_client.c"):
        g.add_module(name)
    g.add_import(importer="opentinker_client.a", imported="opentinker_client.b")
    g.add_import(importer="opentinker_client.b", imported="opentinker_client.c")
    assert _a_cycle(g) is None
    g.add_import(importer="opentinker_client.c", imported="opentinker_client.a")
    assert _a_cycle(g) == ["opentinker_client.a", "opentinker_client.b", "opentinker_client.c", "opentinker_client.a"]


def test_inference_reaches_neither_rlclient_nor_the_package(graph) -> None:
    reached = graph.find_upstream_modules("opentinker_client.inference")  # all it imports, directly or not
    assert "opentinker_client.client_tasks" in reached  # the graph does hold its imports
    assert "opentinker_client.client" not in reached
    assert "opentinker_client" not in reached  # the package imports RLClient


def test_the_parts_meet_only_through_the_connection(graph) -> None:
    parts = {"opentinker_client.client_tasks", "opentinker_client.client_data", "opentinker_client.client_serving"}
    for part in parts:
        assert "opentinker_client.connection" in _client_imports(graph, part), part
        assert "opentinker_client.client" not in _client_imports(graph, part), part
    # Serving hands its inference clients the task calls it was given; the data part needs neither.
    assert _client_imports(graph, "opentinker_client.client_data").isdisjoint(parts)
    assert _client_imports(graph, "opentinker_client.client_tasks").isdisjoint(parts)
