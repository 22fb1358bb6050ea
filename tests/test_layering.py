"""The import graph of the product: the contracts of ``[tool.importlinter]`` in pyproject.toml
hold (layers, no benchmark imports, FastAPI only at the top, a light client), no module takes
part in an import circle, and both checks fail on an import planted against them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    # The tree's own packages first on the path: a planted copy is checked, not the checkout.
    env = {"PYTHONPATH": f"{tree}:{tree / 'client'}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(tree / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, list(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                target = pending.pop()
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, list(graph.get(target, ()))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def module_graph(tree: Path, package: str) -> dict[str, set[str]]:
    """Module -> modules it imports at run time (imports under TYPE_CHECKING left out)."""
    code = (
        "import grimp, json, sys;"
        f"g = grimp.build_graph({package!r}, exclude_type_checking_imports=True);"
        "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={"PYTHONPATH": f"{tree}:{tree / 'client'}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return {module: set(imported) for module, imported in json.loads(done.stdout).items()}


@pytest.fixture(scope="module")
def planted_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the product's sources, to plant imports in."""
    tree = tmp_path_factory.mktemp("tree")
    for name in ("service", "client", "loadtest"):
        shutil.copytree(
            ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def plant(tree: Path, module: str, line: str) -> str:
    path = tree / (module.replace(".", "/") + ".py")
    original = path.read_text()
    path.write_text(original + f"\n{line}\n")
    return original


def test_the_contracts_hold() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 4 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        # crypto -> the HTTP layer: an upward edge.
        ("service.crypto.aead", "import service.api.application", "each layer imports only"),
        # the key store -> the operations above it.
        ("service.keys.keyring", "from service import operations", "each layer imports only"),
        ("service.operations", "import loadtest.scenarios", "nothing from the benchmark"),
        ("service.keys.snapshot", "import fastapi", "FastAPI and Starlette only"),
        ("cryptd_client.signing", "import service.errors", "nothing of the server"),
    ],
)
def test_a_planted_import_breaks_its_contract(
    planted_tree: Path, module: str, line: str, contract: str
) -> None:
    path_module = module if module.startswith("service") else f"client.{module}"
    original = plant(planted_tree, path_module, line)
    try:
        done = lint_imports(planted_tree)
    finally:
        (planted_tree / (path_module.replace(".", "/") + ".py")).write_text(original)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 broken" in done.stdout
    broken = done.stdout.split("Broken contracts", 1)[1]
    assert contract in broken


def test_no_module_of_the_product_is_in_an_import_circle() -> None:
    for package in ("service", "cryptd_client"):
        assert circles(module_graph(ROOT, package)) == [], package


def test_a_planted_circle_is_found(planted_tree: Path) -> None:
    # errors is a leaf; making it import the key store closes a circle through keys -> errors.
    original = plant(planted_tree, "service.errors", "import service.keys.keyring")
    try:
        found = circles(module_graph(planted_tree, "service"))
    finally:
        (planted_tree / "service/errors.py").write_text(original)
    assert any({"service.errors", "service.keys.keyring"} <= set(c) for c in found), found


def test_tarjan_on_a_small_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
