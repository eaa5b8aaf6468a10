"""The store's layout: pagekv/store/{client,node,wire,cli}, no import cycle among its modules,
the node's lane server given one callable (it imports nothing of the node), and the wire layer
shared by both ends importing neither."""

import ast
from pathlib import Path

STORE = Path(__file__).resolve().parents[1] / "pagekv" / "store"


def _module(path: Path) -> str:
    parts = path.relative_to(STORE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each store module and the store modules it imports at its top level (TYPE_CHECKING
    blocks and imports inside functions are not cycles that break an import)."""
    modules = {_module(p): p for p in STORE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for candidate in (target, *(f"{target}.{a.name}" for a in node.names)):
                if candidate in modules and candidate != name:
                    found.add(candidate)
        graph[name] = found
    return graph


def test_no_import_cycle_in_the_store():
    graph = _imports()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for dep in graph[name]:
            if dep.startswith(name + "."):  # a package importing its own modules
                continue
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep] if dep in stack else [name, dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_the_layers_import_what_they_may():
    graph = _imports()
    for name, deps in graph.items():
        if name.startswith("pagekv.store.wire"):  # both ends share it: it sees neither
            assert not {d for d in deps if d.startswith(("pagekv.store.client",
                        "pagekv.store.node", "pagekv.store.cli"))}, (name, deps)  # fmt: skip
        if name.startswith("pagekv.store.client"):
            assert not {d for d in deps if d.startswith("pagekv.store.node")}, (name, deps)
    assert not {d for d in graph["pagekv.store.node.lane"] if d.startswith("pagekv.store.node")}
