"""The engine's imports run one way (docs/architecture.md, "Engine layers").

Every module of engine/ is parsed with ast; every import counts, those inside functions
included (a deferred import is still a dependency, only a later one). The nodes are the
engine's subpackages and top-level modules (`kubesgl.engine.scheduler.roles` is
`scheduler`, `kubesgl.engine.config` is `config`, engine/__init__.py is `__init__`), since
that is the grain at which the layers are stated. `if TYPE_CHECKING:` imports count too:
the engine has none below its package facade, so nothing needs to be excused.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "engine"
PACKAGE = "kubesgl.engine"


def _module_name(path: Path) -> tuple[str, bool]:
    """Dotted name of an engine file, and whether it is a package's __init__."""
    parts = list(path.relative_to(ENGINE).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts]), is_package


def _unit(module: str) -> str | None:
    """The node of an engine module: its top-level subpackage or module; None outside."""
    if module == PACKAGE:
        return "__init__"
    if not module.startswith(PACKAGE + "."):
        return None
    return module[len(PACKAGE) + 1 :].split(".")[0]


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement (or an importlib call on a literal) brings in."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # `from kubesgl.engine import config` imports the module config, not the facade.
        return [
            f"{target}.{alias.name}" if _is_engine_module(f"{target}.{alias.name}") else target
            for alias in node.names
        ]
    if (
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and (
            getattr(node.func, "attr", None) == "import_module"
            or getattr(node.func, "id", None) in ("import_module", "__import__")
        )
    ):
        return [node.args[0].value]
    return []


def _is_engine_module(name: str) -> bool:
    if not name.startswith(PACKAGE + "."):
        return False
    path = ENGINE.joinpath(*name[len(PACKAGE) + 1 :].split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """Edges between engine units, and for each edge where it comes from (file:line)."""
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(ENGINE.rglob("*.py")):
        module, is_package = _module_name(path)
        source = _unit(module)
        edges[source]  # every unit is a node, imports or not
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported(node, module, is_package):
                target = _unit(name)
                if target is not None and target != source:
                    edges[source].add(target)
                    place = f"{path.relative_to(ROOT)}:{node.lineno}"
                    if place not in where[(source, target)]:
                        where[(source, target)].append(place)
    return edges, where


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def documented_layers() -> list[list[str]]:
    """The rows of the table under "## Engine layers" in docs/architecture.md, lowest first:
    the units each row names in backquotes (`models/` -> models, `config.py` -> config)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Engine layers\n", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        layers.append(
            [re.sub(r"(\.py|/)$", "", name) for name in re.findall(r"`([^`]+)`", cells[1])]
        )
    return layers


def _describe(cycle: list[str], where: dict[tuple[str, str], list[str]]) -> str:
    return "\n".join(
        f"  {a} -> {b}: {', '.join(where[(a, b)][:3])}" for a, b in zip(cycle, cycle[1:])
    )


def test_the_engine_import_graph_has_no_cycle():
    edges, where = import_graph()
    cycle = find_cycle(edges)
    assert cycle is None, f"import cycle {' -> '.join(cycle)}:\n{_describe(cycle, where)}"


def test_imports_follow_the_documented_layers():
    edges, where = import_graph()
    layers = documented_layers()
    layer_of = {unit: i for i, row in enumerate(layers) for unit in row}
    named = [unit for row in layers for unit in row]
    assert len(named) == len(set(named)), f"a unit is named in two layers: {named}"
    assert set(layer_of) == set(edges), (
        f"docs/architecture.md's engine layers name {sorted(set(layer_of) - set(edges))} that do not "
        f"exist and miss {sorted(set(edges) - set(layer_of))}"
    )
    upward = [
        f"{a} (layer {layer_of[a] + 1}) -> {b} (layer {layer_of[b] + 1}): {', '.join(where[(a, b)][:3])}"
        for a in sorted(edges)
        for b in sorted(edges[a])
        if layer_of[b] > layer_of[a]
    ]
    assert not upward, "imports into a higher layer:\n" + "\n".join(upward)


def test_the_graph_reader_sees_cycles_and_deferred_imports(tmp_path, monkeypatch):
    """The checker itself: a loop made by an import inside a function is found and printed."""
    engine = tmp_path / "engine"
    (engine / "low").mkdir(parents=True)
    (engine / "__init__.py").write_text("")
    (engine / "low" / "__init__.py").write_text("")
    (engine / "low" / "a.py").write_text("def f():\n    from kubesgl.engine.high import b\n")
    (engine / "high.py").write_text("from .low import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", engine)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    edges, _ = import_graph()
    assert edges == {"__init__": set(), "low": {"high"}, "high": {"low"}}
    assert find_cycle(edges) == ["high", "low", "high"]
