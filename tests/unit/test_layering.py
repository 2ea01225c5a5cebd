"""The layering ARCHITECTURE.md states, held by the imports themselves.

Every module's imports of the controller package (read with ``ast``, also those inside functions and under
``TYPE_CHECKING``) go down the layers or sideways within one, never up: data types (``model``) under the inventory
folder's owner, under the stages (each stage only to itself and the stages before it), under the reports, under
the actions, under the terminal (``cli``). Nothing in the collection imports the controller, and there are no
import circles between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "controller"
COLLECTION = ROOT / "ansible_collections" / "v100box" / "llm"

# Lowest first. A module may import its own layer's modules (stages: its own stage and earlier ones) and lower ones.
BASE = ("controller.errors", "controller.files")
LAYERS = [
    ("base", BASE),
    ("model", ("controller.model",)),
    ("inventory", ("controller.inventory",)),
    ("stages", ("controller.stages",)),
    ("reports", ("controller.reports",)),
    ("actions", ("controller.actions",)),
    ("cli", ("controller.cli", "controller.__main__")),
]
# The stages in the order a box goes through them (ARCHITECTURE.md's picture); transports are the probe's edge,
# which the runner's known-hosts handling also uses.
STAGES = ["transports", "probe", "estimate", "planner", "render", "strategy", "runner", "playbook_guard", "verify"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, name: str) -> set[str]:
    """The controller modules ``path`` imports (a ``from X import y`` counts as X.y when that is a module)."""
    known = modules()
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    # A module's own packages run before it anyway (Python imports a parent first): that is no arrow.
    return {target for target in found if target in known and not (name + ".").startswith(target + ".")}


def layer_of(name: str) -> int:
    for index, (_label, prefixes) in enumerate(LAYERS):
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{name} is in no layer of ARCHITECTURE.md: add it to the picture and to LAYERS here")


def stage_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "stages":
        return STAGES.index(parts[2]) if parts[2] in STAGES else -1
    return None


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for source, targets in graph.items():
        if source == "controller":
            continue
        for target in sorted(targets):
            if target == "controller":
                continue
            if layer_of(target) > layer_of(source):
                wrong.append(f"{source} imports {target} ({LAYERS[layer_of(target)][0]} is above "
                             f"{LAYERS[layer_of(source)][0]})")
            elif layer_of(target) == layer_of(source) and stage_of(source) is not None:
                if stage_of(target) > stage_of(source):
                    wrong.append(f"{source} imports {target}: a stage never imports a later one")
    return wrong


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    return {name: imported(path, name) for name, path in modules().items()}


def test_every_module_has_a_layer_and_no_import_goes_up():
    graph = import_graph()
    assert len(graph) > 50, "the controller package was not found"
    assert back_arrows(graph) == []


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_collection_never_imports_the_controller():
    offenders = []
    for path in sorted(COLLECTION.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)} imports {name}" for name in names
                          if name == "controller" or name.startswith("controller.")]
    assert offenders == []


@pytest.mark.parametrize(("graph", "expected"), [
    ({"controller.model.fleet": {"controller.stages.planner.core"}}, "stages is above model"),
    ({"controller.stages.planner.core": {"controller.stages.verify.status"}}, "never imports a later one"),
    ({"controller.reports.certify": {"controller.cli.options"}}, "cli is above reports"),
], ids=["model-imports-a-stage", "stage-imports-a-later-stage", "report-imports-the-cli"])
def test_the_check_sees_an_upward_import(graph, expected):
    assert any(expected in line for line in back_arrows(graph))


def test_the_check_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
