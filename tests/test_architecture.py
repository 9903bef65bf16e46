"""The layers of docs/ARCHITECTURE.md hold: every import runs downward, nothing imports in a
circle, shipped code never imports tests, and installing puts no generic top-level package
(`lsp`, `models`) into the user's environment."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Higher ranks may import lower ones; equal ranks only within their own folder.
RANK = {
    "completiond.cli": 7,
    "completiond.commands": 6,
    "completiond.lsp": 6,
    "completiond.serving": 5,
    "completiond.completion": 4,
    "completiond.engine": 3,
    "completiond.backends": 3,   # a team server in the engine's place: neither imports the other
    "completiond.models": 2,
    "completiond.config": 1,
    "completiond.errors": 0,
    "completiond.fileio": 0,
}
SOURCES = {"completiond": ROOT / "completiond", "completiond.lsp": ROOT / "lsp", "completiond.models": ROOT / "models"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "completiond" and parts and parts[0] in ("lsp", "models"):
                continue  # never inside completiond/ itself
            found[name] = path
    return found


def layer(module: str) -> str | None:
    best = None
    for prefix in RANK:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, path: Path) -> set[str]:
    """Project modules `module` imports at run time (function-level imports included; imports
    under `if TYPE_CHECKING:` are annotations only and left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                out.add(target)
                out.update(f"{target}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    known = modules()
    return {m for m in out if m in known and m != module}


def test_every_module_has_a_layer():
    unplaced = [m for m in modules() if layer(m) is None and m != "completiond"]
    assert not unplaced, f"modules outside every layer of docs/ARCHITECTURE.md: {unplaced}"


def test_imports_run_downward():
    wrong = []
    for module, path in modules().items():
        mine = layer(module)
        if mine is None:
            continue
        for target in imports(module, path):
            theirs = layer(target)
            if theirs is None or theirs == mine:
                continue
            if RANK[theirs] >= RANK[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = {m: imports(m, p) for m, p in modules().items()}
    # A package's __init__ is imported with each of its modules: ignore those edges.
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                walk(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)


def test_shipped_code_never_imports_tests():
    offenders = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "conftest" or n.split(".")[0] == "tests" or n.startswith("test_") for n in names):
                offenders.append(module)
    assert not offenders, offenders


def test_checker_catches_an_upward_import(tmp_path):
    engine_module = tmp_path / "bad.py"
    engine_module.write_text("from completiond.serving import client\n"
                             "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from completiond.commands import bench\n")
    got = imports("completiond.engine.bad", engine_module)
    assert got == {"completiond.serving", "completiond.serving.client"}
    assert RANK[layer("completiond.serving.client")] > RANK[layer("completiond.engine.bad")]


@pytest.mark.slow
def test_install_puts_no_generic_top_level_package(tmp_path):
    """Build the wheel, install it into a fresh venv beside a dummy `models` package: ours live
    under completiond.*, theirs still imports."""
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist),
                            str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(dist.glob("completiond-*.whl"))
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert "lsp" not in tops and "models" not in tops, sorted(tops)
    assert "completiond" in tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "completiond/models/completiond-py-mini/model.safetensors" in names  # the bundled model ships
    assert "completiond/lsp/server.py" in names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    inst = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-3000:]
    other = tmp_path / "project"
    (other / "models").mkdir(parents=True)
    (other / "models" / "__init__.py").write_text("WHOSE = 'theirs'\n")
    probe = ("import models, completiond.models, completiond.lsp, importlib.util as u\n"
             "assert models.WHOSE == 'theirs', models.__file__\n"
             "assert u.find_spec('lsp') is None\n"
             "print(completiond.models.default_model_dir())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run([str(py), "-c", probe], cwd=other, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "site-packages/completiond/models/completiond-py-mini" in out.stdout
