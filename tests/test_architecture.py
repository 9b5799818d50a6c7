"""The house's floors: every workbench module sits on a layer, imports only from its own layer
or below, and no import (at the top of a file or inside a function) closes a cycle.

ARCHITECTURE.md draws the same layers; a new module fails here until it is given one.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "workbench"

# From the bottom. Results sit below ablation because ablate() builds and returns a Results.
LAYERS = {
    1: "config, validation and measurement primitives",
    2: "data and models",
    3: "techniques",
    4: "the train step",
    5: "worker and process",
    6: "results and plots",
    7: "ablation",
    8: "the CLI and the widgets",
}
LAYER_OF = {
    "workbench.config": 1,
    "workbench.optional": 1,
    "workbench.devices": 1,
    "workbench.stats": 1,
    "workbench.heap": 1,
    "workbench.core_sync": 1,
    "workbench.peak_flops": 1,
    "workbench.telemetry": 1,
    "workbench.profiling": 1,
    "workbench.data_spec": 2,
    "workbench.jpeg_folder": 2,
    "workbench.models": 2,
    "workbench.data": 2,
    "workbench.techniques": 3,  # the registry and every technique module under it
    "workbench.raw_kernels": 3,
    "workbench.fused_ops": 3,
    "workbench.mixed_precision": 3,
    "workbench.kernel_bench": 3,
    "workbench.distributed": 3,
    "workbench.comm_hooks": 3,
    "workbench.loop": 4,
    "workbench.mfu": 4,
    "workbench.process_state": 5,
    "workbench.block": 5,
    "workbench.worker": 5,
    "workbench.process": 5,
    "workbench.template": 5,
    "workbench.environment": 5,
    "workbench.results_folder": 6,
    "workbench.plots": 6,
    "workbench.results_view": 6,
    "workbench.results": 6,
    "workbench.report": 6,
    "workbench.compare": 6,
    "workbench.arms": 7,
    "workbench.progress": 7,
    "workbench.slurm": 7,
    "workbench.ablation": 7,
    "workbench.advisor": 7,
    "workbench.tuner": 7,
    "workbench.live_run": 8,
    "workbench.panel_controls": 8,
    "workbench.widgets": 8,
    "workbench.cli": 8,
    "workbench.__main__": 8,
}
# The package's __init__ only names its exports, imported lazily on first use; the shipped
# datasets (installed as workbench.datasets from datasets/) import nothing of workbench's.
OUTSIDE_THE_FLOORS = {"workbench", "workbench.datasets"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    if module.startswith("workbench.techniques."):
        module = "workbench.techniques"
    return LAYER_OF.get(module)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (they never run)."""
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden |= {id(child) for child in ast.walk(node)}
    return hidden


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The workbench modules this file imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text())
    hidden = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from workbench import optional` imports the module workbench.optional.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(path) for path in paths} | OUTSIDE_THE_FLOORS
    graph = {}
    for path in paths:
        name = _module_name(path)
        if name != "workbench":
            graph[name] = _imports(path, modules) - {name} - OUTSIDE_THE_FLOORS
    return graph


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in _graph() if _layer(name) is None)
    assert not unplaced, f"give these modules a layer in LAYER_OF (and ARCHITECTURE.md): {unplaced}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name, targets in _graph().items()
        for target in sorted(targets)
        if _layer(target) is not None and _layer(name) is not None and _layer(target) > _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = _graph()
    cycles = []

    def visit(node: str, path: list[str], on_path: set[str], done: set[str]) -> None:
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in done:
                visit(target, path + [target], on_path | {target}, done)
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start], {start}, done)
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from workbench.a import x\n", {"workbench.a"}),
        ("def f():\n    from workbench.b import y\n", {"workbench.b"}),  # inside a function counts
        ("from workbench import a\n", {"workbench.a"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workbench.a import x\n", set()),
    ],
)
def test_the_import_reader_sees_every_import(tmp_path, source, expected):
    path = tmp_path / "module.py"
    path.write_text(source)
    assert _imports(path, {"workbench", "workbench.a", "workbench.b"}) - {"workbench"} == expected


MAX_FUNCTION_LINES = 60  # "about 60": a function longer than this does several jobs


def function_lengths(path: Path) -> dict[str, int]:
    """Each function's lines, from ``def`` to its end, without its docstring (documentation is
    not a job). Nested functions count inside their parent too."""
    lengths = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            documented = ast.get_docstring(node, clean=False) is not None
            docstring = node.body[0].end_lineno - node.body[0].lineno + 1 if documented else 0
            lengths[f"{node.name} (line {node.lineno})"] = node.end_lineno - node.lineno + 1 - docstring
    return lengths


def test_no_function_does_several_jobs():
    """No function in workbench/ is longer than about 60 lines (issue: the longest functions mixed
    several jobs). Split by job, not by line count."""
    long = [
        f"{path.relative_to(PACKAGE.parent)}: {name} has {lines} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in function_lengths(path).items()
        if lines > MAX_FUNCTION_LINES
    ]
    assert not long, "\n".join(long)


def test_the_function_length_reader_skips_docstrings_only(tmp_path):
    source = tmp_path / "example.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    source.write_text(
        f'def long():\n    """Doc.\n\n    More doc.\n    """\n{body}\n\n\ndef short():\n    return 1\n'
    )
    assert function_lengths(source) == {"long (line 1)": 62, "short (line 69)": 2}
