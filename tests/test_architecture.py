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


def modules(sources: dict[str, Path] | None = None) -> dict[str, Path]:
    found = {}
    for package, folder in (SOURCES if sources is None else sources).items():
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


def imports(module: str, path: Path, type_checking: bool = False, known: dict[str, Path] | None = None) -> set[str]:
    """Project modules `module` imports at run time (function-level imports included; imports
    under `if TYPE_CHECKING:` are annotations only and left out unless type_checking is set)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
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
    known = modules() if known is None else known
    return {m for m in out if m in known and m != module}


def test_every_module_has_a_layer():
    unplaced = [m for m in modules() if layer(m) is None and m != "completiond"]
    assert not unplaced, f"modules outside every layer of docs/ARCHITECTURE.md: {unplaced}"


def test_imports_run_downward():
    wrong = []
    known = modules()
    for module, path in known.items():
        mine = layer(module)
        if mine is None:
            continue
        for target in imports(module, path, known=known):
            theirs = layer(target)
            if theirs is None or theirs == mine:
                continue
            if RANK[theirs] >= RANK[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def import_graph(sources: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Every import between project modules, the module-level, function-level and `if TYPE_CHECKING:`
    ones alike: a circle that only type checkers follow still ties the two modules into one unit."""
    known = modules(sources)
    graph = {m: imports(m, p, type_checking=True, known=known) for m, p in known.items()}
    # Importing a module imports its package's __init__ first: edges to an enclosing package say nothing.
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (Tarjan), each as a -> b -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in sorted(graph.get(m, ())):
            if t not in index:
                connect(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            group = []
            while True:
                t = stack.pop()
                on_stack.discard(t)
                group.append(t)
                if t == m:
                    break
            if len(group) > 1:
                groups.append(group)

    for m in sorted(graph):
        if m not in index:
            connect(m)
    return [_cycle_in(sorted(g), graph) for g in groups]


def _cycle_in(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the group's first module, for the failure message."""
    inside = set(group)
    start = group[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in sorted(graph.get(m, set()) & inside):
                if t == start:
                    return paths[m] + [start]
                if t not in paths:
                    paths[t] = paths[m] + [t]
                    nxt.append(t)
        frontier = nxt
    return group + [start]


def test_no_import_cycles():
    """No module imports itself back through others, inside a package or across packages (issue 28)."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_checker_catches_a_planted_cycle(tmp_path):
    """A package whose modules import each other back, once through a TYPE_CHECKING import and once
    through a function-level one: the checker names both circles; without them it finds none."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import leaf\n")  # an __init__ importing its own module
    (pkg / "sub" / "leaf.py").write_text("import os\n")
    (pkg / "engine.py").write_text("from pkg import draft\n")
    (pkg / "draft.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.engine import Engine\n")
    (pkg / "forward.py").write_text("from pkg.sub import leaf\nfrom pkg import native\n")
    (pkg / "native.py").write_text("def bind():\n    from pkg import forward\n    return forward\n")
    cycles = import_cycles(import_graph({"pkg": pkg}))
    assert sorted(cycles) == [["pkg.draft", "pkg.engine", "pkg.draft"], ["pkg.forward", "pkg.native", "pkg.forward"]]
    (pkg / "draft.py").write_text("from pkg.sub import leaf\n")
    (pkg / "native.py").write_text("def bind():\n    return None\n")
    assert import_cycles(import_graph({"pkg": pkg})) == []


def test_every_package_is_installed():
    """pyproject.toml lists its packages one by one: a new package folder (completion/workspace/) left off
    the list would be missing from the wheel, though every test run from the checkout still passes."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = set()
    for package, folder in SOURCES.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            if package == "completiond" and rel and rel[0] in ("lsp", "models"):
                continue
            found.add(".".join([package, *rel]))
    assert found - listed == set(), f"packages missing from pyproject.toml's [tool.setuptools] packages: {found - listed}"

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


# --- the drafts' interface (issue 28): drafts use the model through engine/runner.py's Runner ---------------------

DRAFT_MODULES = ("draft", "draft_model", "exit_adapter", "medusa")
# The names the draft modules give the runner they hold (the target model, or a draft model's engine).
RUNNER_NAMES = {"engine", "eng", "drafter", "dr"}


def _class_members(path: Path, cls: str) -> set[str]:
    """Methods, annotated fields and `self.x = ...` attributes of class cls in the file at path."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def runner_uses(path: Path) -> set[str]:
    """Attributes a draft module reads off the runner it holds (`engine.x`, `eng.x`, `self.engine.x`, ...)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id in RUNNER_NAMES) or (
                isinstance(v, ast.Attribute) and v.attr in RUNNER_NAMES and isinstance(v.value, ast.Name)
                and v.value.id == "self"):
            used.add(node.attr)
    return used


def test_drafts_use_only_the_runner_interface():
    """The drafts reach for nothing of the engine but what Runner names, and Engine provides all of it;
    none of them imports the engine module, not even for type checking."""
    engine_dir = ROOT / "completiond" / "engine"
    protocol = _class_members(engine_dir / "runner.py", "Runner")
    engine = _class_members(engine_dir / "engine.py", "Engine")
    assert protocol - engine == set(), f"Runner members Engine lacks: {sorted(protocol - engine)}"
    known = modules()
    for name in DRAFT_MODULES:
        path = engine_dir / f"{name}.py"
        outside = runner_uses(path) - protocol
        assert not outside, f"completiond/engine/{name}.py uses {sorted(outside)} of the engine, which Runner does not name"
        imported = imports(f"completiond.engine.{name}", path, type_checking=True, known=known)
        assert "completiond.engine.engine" not in imported, f"completiond/engine/{name}.py imports the engine module"


def test_runner_checker_sees_an_engine_attribute(tmp_path):
    planted = tmp_path / "draft.py"
    planted.write_text("class D:\n    def propose(self):\n        eng = self.engine\n"
                       "        return eng.cache, self.engine.fwd, self.drafter.tokenizer\n")
    assert runner_uses(planted) == {"cache", "fwd", "tokenizer"}
    assert not {"cache", "tokenizer"} & _class_members(ROOT / "completiond" / "engine" / "runner.py", "Runner")


# --- one completion pipeline (issue 46): what completes sits behind completion/completer.py's Completer -------------

COMPLETERS = {"completion/suggest.py": "LocalCompleter", "completion/team.py": "TeamCompleter"}


def _protocol_members(path: Path, cls: str) -> set[str]:
    """Public methods and annotated fields of a Protocol class."""
    return {m for m in _class_members(path, cls) if not m.startswith("_")}


def test_every_completer_implements_the_protocol():
    """Local and team completers provide every member the Completer protocol names, so the service can hold
    either without asking which it has."""
    root = ROOT / "completiond"
    protocol = _protocol_members(root / "completion" / "completer.py", "Completer")
    assert {"complete", "budgets", "backend"} <= protocol
    for module, cls in COMPLETERS.items():
        tree = ast.parse((root / module).read_text(encoding="utf-8"))
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        members = _class_members(root / module, cls) | {
            t.id for item in node.body if isinstance(item, ast.Assign) for t in item.targets if isinstance(t, ast.Name)}
        assert protocol <= members, f"{cls} lacks {sorted(protocol - members)} of the Completer protocol"


def test_serving_holds_a_completer_not_an_engine():
    """serving/ never probes what it holds with getattr/hasattr, and no shipped module talks about test fakes:
    the fakes implement the protocols instead."""
    probes, fakes = [], []
    for module, path in modules().items():
        text = path.read_text(encoding="utf-8")
        if module.startswith("completiond.serving."):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                        "getattr", "hasattr") and isinstance(node.args[0], ast.Attribute) and node.args[0].attr in (
                        "engine", "completer"):
                    probes.append(f"{module}:{node.lineno}")
        if "fake engines in tests" in text or "tests' fakes" in text:
            fakes.append(module)
    assert not probes, f"getattr probes of the engine/completer: {probes}"
    assert not fakes, f"shipped code special-casing test fakes: {fakes}"



def test_no_serving_or_engine_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for folder in ("engine", "serving") for p in (ROOT / "completiond" / folder).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"


def test_the_engines_load_and_generate_fit_on_a_screen():
    """Issue 46: Engine.generate reads like gpt-fast's loop (<= 50 lines) and Engine.load is a short list of
    steps (<= 60); what they do lives in decode.py, load_plan.py and loader.py."""
    tree = ast.parse((ROOT / "completiond" / "engine" / "engine.py").read_text(encoding="utf-8"))
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    size = {f.name: f.end_lineno - f.lineno + 1 for f in engine.body
            if isinstance(f, ast.FunctionDef) and f.name in ("load", "generate") and f.end_lineno is not None}
    assert size.keys() == {"load", "generate"} and size["generate"] <= 50 and size["load"] <= 60, size


def _backend_members() -> set[str]:
    tree = ast.parse((ROOT / "completiond" / "completion" / "completer.py").read_text(encoding="utf-8"))
    enum = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Backend")
    return {t.id for item in enum.body if isinstance(item, ast.Assign) for t in item.targets if isinstance(t, ast.Name)}


def _matched_backends(source: str) -> set[str]:
    """Backend members named by the `case` patterns of the match in load_completer."""
    tree = ast.parse(source)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "load_completer")
    match = next(n for n in ast.walk(fn) if isinstance(n, ast.Match))
    return {n.attr for case in match.cases for n in ast.walk(case.pattern)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "Backend"}


def test_every_backend_has_its_completer():
    """The backend setting is a closed enum, matched exhaustively where the completer is made (mypy proves the
    same through the NoReturn fallback); the setting's choices are exactly the enum's values."""
    from completiond import config as config_mod

    members = _backend_members()
    assert members == {"LOCAL", "OPENAI", "LLAMACPP_INFILL"}
    source = (ROOT / "completiond" / "serving" / "lifecycle.py").read_text(encoding="utf-8")
    assert _matched_backends(source) == members
    planted = source.replace("case Backend.OPENAI | Backend.LLAMACPP_INFILL:", "case Backend.OPENAI:")
    assert _matched_backends(planted) == members - {"LLAMACPP_INFILL"}  # the checker sees a missing case
    from completiond.completion.completer import Backend

    assert set(config_mod.SETTINGS_BY_KEY["backend"].enum or ()) == {b.value for b in Backend}


# --- drafts behind one interface (issue 46): kinds are named in the registry only --------------------------------------

KIND_NAMES = {"early_exit", "adapter", "draft_model", "medusa"}


def kind_literals(path: Path) -> list[int]:
    """Lines of path where a string constant names a model draft kind; a subscript, dict key or .get() key is
    a data label (a metric named after the adapter), a `/` operand a path part: those do not count."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    labels = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            labels.add(id(node.slice))
        elif isinstance(node, ast.Dict):
            labels.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            labels.update((id(node.left), id(node.right)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            labels.add(id(node.args[0]))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in KIND_NAMES
            and id(node) not in labels]


def test_draft_kinds_are_named_only_in_the_registry():
    """Every draft kind is a DraftKind member (engine/draft_kind.py); a string naming one is parsed there,
    never compared elsewhere."""
    found = {m: lines for m, p in modules().items() if m != "completiond.engine.draft_kind"
             and (lines := kind_literals(p))}
    assert not found, found


def test_kind_checker_sees_a_literal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('if kind == "medusa":\n    pass\nscores = {"adapter": 1}\nx = scores["adapter"]\n'
                   'y = scores.get("adapter")\nSamplingParams(draft="early_exit")\n')
    assert kind_literals(bad) == [1, 6]


def test_the_decode_loop_never_names_a_kind():
    """engine.py and decode.py reach every draft through speculators.py: neither names DraftKind."""
    for name in ("engine.py", "decode.py"):
        text = (ROOT / "completiond" / "engine" / name).read_text(encoding="utf-8")
        assert "DraftKind" not in text, name


@pytest.mark.torch_free
def test_the_load_plan_is_torch_free():
    probe = "import sys, completiond.engine.load_plan, completiond.engine.draft_kind; assert 'torch' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_engine_never_imports_the_training_code():
    """models/training/ (data, tokenizer, recipe, model card) is for the training commands only: nothing the
    daemon or the editor runs imports it."""
    known = modules()
    runtime = ("completiond.engine", "completiond.completion", "completiond.serving", "completiond.lsp",
               "completiond.backends")
    wrong = [f"{m} imports {t}" for m, p in known.items() if m.startswith(runtime)
             for t in imports(m, p, type_checking=True, known=known) if t.startswith("completiond.models.training")]
    assert not wrong, wrong
