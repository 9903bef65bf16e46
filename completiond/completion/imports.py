"""A file's imports, by tree-sitter in every language of languages.py: each language's forms (Python
import/from, JS/TS import and require, Go import, Rust use, Java import, C/C++ #include, C# using, Bash
source), as
the local names they bring in and the modules they come from; `module_targets` turns a module into the
file or folder paths it can live at, `matches` says whether a file is one of them.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from tree_sitter import Node, Tree

from completiond.completion.languages import LanguageSpec, spec_for
from completiond.completion.outline import PASS_THROUGH, parse, spec_with_grammar


def _text(node: Node | None) -> str:
    return node.text.decode("utf-8", "replace") if node is not None and node.text is not None else ""


@dataclass
class Imports:
    """What a file imports: local name -> (module, the name there); local name of a module or namespace
    -> module (used as `alias.member`); modules all of whose names are in scope (C #include, `import
    a.b.*`, C# using, `from m import *`). Modules are as the language writes them, with `language` and
    the importing file's `path` to resolve relative ones (module_targets)."""

    language: str = "python"
    path: str | None = None
    names: dict[str, tuple[str, str]] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    wildcards: list[str] = field(default_factory=list)

    def __contains__(self, name: object) -> bool:
        return name in self.names or name in self.modules

    def __iter__(self):
        return iter(list(self.names) + [m for m in self.modules if m not in self.names])

    def module_of(self, name: str, qualifier: str | None = None) -> tuple[list[str], str]:
        """(modules that define `name`, the name it has there): its import, else its qualifier's module
        (`ns.name`, `pkg::name`), else the wildcard imports."""
        if name in self.names:
            module, there = self.names[name]
            return [module], there
        if qualifier is not None and qualifier in self.modules:
            return [self.modules[qualifier]], name
        return list(self.wildcards), name


# -- imports -------------------------------------------------------------------------

_imports_lock = threading.Lock()
_imports: OrderedDict[tuple[str, str], tuple[str, Imports]] = OrderedDict()
MAX_IMPORT_CACHE = 64


def imports_of(text: str, language: str | None = "python", path: str | None = None, max_chars: int = 65536) -> Imports:
    """The imports of a file (read from its first max_chars characters). Asked on every request: per
    file, the answer is kept with the text up to the first line of code after the imports, and holds
    while the text starts with that (typing in the code below them parses nothing)."""
    spec = spec_with_grammar(language)
    if spec is None:
        return Imports(language or "", path)
    key = (spec.name, path) if path is not None else None
    if key is not None:
        with _imports_lock:
            hit = _imports.get(key)
        if hit is not None and text.startswith(hit[0]):
            return hit[1]
    data = text[:max_chars].encode("utf-8", "surrogatepass")
    found = Imports(language or "", path)
    tree = parse(data, spec)
    if tree is None:
        return found
    prelude = collect_imports(tree, spec, found)
    if key is not None:
        head = data[:prelude].decode("utf-8", "ignore")
        nl = text.find("\n", len(head))
        head = text[: nl + 1 if nl >= 0 else len(text)]
        with _imports_lock:
            _imports[key] = (head, found)
            _imports.move_to_end(key)
            while len(_imports) > MAX_IMPORT_CACHE:
                _imports.popitem(last=False)
    return found


_PRELUDE = frozenset(
    {
        "package_clause",
        "package_declaration",
        "namespace_declaration",
        "file_scoped_namespace_declaration",
        "extern_crate_declaration",
        "preproc_ifdef",
        "preproc_def",
        "preproc_if",
        "preproc_call",
    }
)


def _docstring(node: Node) -> bool:
    return (
        node.type == "expression_statement"
        and node.named_child_count == 1
        and node.named_children[0].type in ("string", "concatenated_string")
    )


def collect_imports(tree: Tree, spec: LanguageSpec, found: Imports) -> int:
    """Add the import forms at the top level of `tree` (and in namespaces, #if blocks) to `found`; the
    byte offset where the code after the file's leading imports begins."""
    reader = _IMPORT_READERS.get(spec.name)
    prelude = -1
    requires = spec.name in ("javascript", "typescript", "tsx")
    root = tree.root_node
    stack = [root]
    seen = 0
    while stack and seen < 5000:
        node = stack.pop()
        for child in reversed(node.named_children):
            seen += 1
            imported = child.type in spec.imports or (
                requires and child.type in ("lexical_declaration", "variable_declaration")
            )
            if imported and reader is not None:
                reader(child, found)
            elif child.type in PASS_THROUGH or child.type in ("namespace_declaration", "mod_item"):
                stack.append(child)
            if (
                node is root
                and not imported
                and child.type not in spec.comments
                and child.type not in _PRELUDE
                and not _docstring(child)
            ):
                prelude = child.start_byte  # the last one seen (children run backwards) is the first
    return prelude if prelude >= 0 else root.end_byte


def _python(node: Node, found: Imports) -> None:
    if node.type == "import_statement":
        for child in node.children_by_field_name("name"):
            if child.type == "aliased_import":
                found.modules[_text(child.child_by_field_name("alias"))] = _text(child.child_by_field_name("name"))
            else:
                dotted = _text(child)
                found.modules.setdefault(dotted.split(".")[0], dotted.split(".")[0])
        return
    if node.type != "import_from_statement":
        return
    module = "".join(_text(node.child_by_field_name("module_name")).split())
    if any(c.type == "wildcard_import" for c in node.named_children):
        found.wildcards.append(module)
    for child in node.children_by_field_name("name"):
        if child.type == "aliased_import":
            there, local = _text(child.child_by_field_name("name")), _text(child.child_by_field_name("alias"))
        else:
            there = local = _text(child)
        found.names[local] = (module, there)
        # `from pkg import mod`: the name may be a module itself
        found.modules.setdefault(local, (module.rstrip(".") + "." + there) if module.strip(".") else module + there)


def _string_value(node: Node | None) -> str:
    text = _text(node)
    return text[1:-1] if len(text) >= 2 and text[0] in "\"'`<" else text


def _js(node: Node, found: Imports) -> None:
    if node.type in ("lexical_declaration", "variable_declaration"):
        for decl in node.named_children:
            value = decl.child_by_field_name("value")
            if (
                decl.type != "variable_declarator"
                or value is None
                or value.type != "call_expression"
                or _text(value.child_by_field_name("function")) != "require"
            ):
                continue
            args = value.child_by_field_name("arguments")
            source = _string_value(args.named_children[0]) if args is not None and args.named_child_count else ""
            target = decl.child_by_field_name("name")
            if not source or target is None:
                continue
            if target.type == "identifier":
                found.modules[_text(target)] = source
            elif target.type == "object_pattern":
                for part in target.named_children:
                    if part.type == "shorthand_property_identifier_pattern":
                        found.names[_text(part)] = (source, _text(part))
                    elif part.type == "pair_pattern":
                        found.names[_text(part.child_by_field_name("value"))] = (
                            source,
                            _text(part.child_by_field_name("key")),
                        )
        return
    if node.type != "import_statement":
        return
    source = _string_value(node.child_by_field_name("source"))
    if not source:
        return
    for clause in node.named_children:
        if clause.type != "import_clause":
            continue
        for part in clause.named_children:
            if part.type == "identifier":  # the default export
                found.names[_text(part)] = (source, _text(part))
            elif part.type == "namespace_import":
                for ident in part.named_children:
                    found.modules[_text(ident)] = source
            elif part.type == "named_imports":
                for spec in part.named_children:
                    if spec.type == "import_specifier":
                        there = _text(spec.child_by_field_name("name"))
                        local = _text(spec.child_by_field_name("alias")) or there
                        found.names[local] = (source, there)


def _go(node: Node, found: Imports) -> None:
    specs = [c for c in node.named_children if c.type == "import_spec"]
    for group in node.named_children:
        if group.type == "import_spec_list":
            specs.extend(c for c in group.named_children if c.type == "import_spec")
    for spec in specs:
        source = _string_value(spec.child_by_field_name("path"))
        alias = _text(spec.child_by_field_name("name"))
        if not source:
            continue
        if alias == ".":
            found.wildcards.append(source)
        elif alias != "_":
            found.modules[alias or source.rsplit("/", 1)[-1]] = source


def _rust(node: Node, found: Imports) -> None:
    if node.type == "use_declaration":
        _rust_use(node.child_by_field_name("argument"), [], found, 0)


def _rust_use(node: Node | None, prefix: list[str], found: Imports, depth: int) -> None:
    if node is None or depth > 8:
        return
    kind = node.type
    if kind in ("identifier", "self", "crate", "super"):
        name = _text(node)
        path = prefix + [name]
        if name == "self" and prefix:  # use a::b::{self}: the module b
            found.modules[prefix[-1]] = "::".join(prefix)
        else:
            found.names[name] = ("::".join(prefix), name)
            found.modules[name] = "::".join(path)
    elif kind == "scoped_identifier":
        path = prefix + _text(node.child_by_field_name("path")).replace(" ", "").split("::")
        name = _text(node.child_by_field_name("name"))
        found.names[name] = ("::".join(path), name)
        found.modules[name] = "::".join(path + [name])
    elif kind == "use_as_clause":
        target = _text(node.child_by_field_name("path")).replace(" ", "").split("::")
        alias = _text(node.child_by_field_name("alias"))
        full = prefix + target
        found.names[alias] = ("::".join(full[:-1]), full[-1])
        found.modules[alias] = "::".join(full)
    elif kind == "scoped_use_list":
        path = prefix + [p for p in _text(node.child_by_field_name("path")).replace(" ", "").split("::") if p]
        _rust_use(node.child_by_field_name("list"), path, found, depth + 1)
    elif kind == "use_list":
        for child in node.named_children:
            _rust_use(child, prefix, found, depth + 1)
    elif kind == "use_wildcard":
        inner = node.named_children[0] if node.named_child_count else None
        found.wildcards.append("::".join(prefix + ([_text(inner).replace(" ", "")] if inner is not None else [])))


def _java(node: Node, found: Imports) -> None:
    target = next((c for c in node.named_children if c.type in ("scoped_identifier", "identifier")), None)
    if target is None:
        return
    dotted = "".join(_text(target).split())
    if any(c.type == "asterisk" for c in node.named_children):
        found.wildcards.append(dotted)
        return
    owner, _, name = dotted.rpartition(".")
    static = any(not c.is_named and c.type == "static" for c in node.children)
    # `import a.b.C` is in the file a/b/C.java, and so are the members used as `C.m`;
    # `import static a.b.C.m`: m is in a/b/C.java too
    found.names[name] = (dotted if not static else owner, name)
    if not static:
        found.modules[name] = dotted


def _c(node: Node, found: Imports) -> None:
    if node.type == "preproc_include":
        header = _string_value(node.child_by_field_name("path"))
        if header:
            found.wildcards.append(header)
    elif node.type == "using_declaration":  # C++: using std::vector / using namespace x
        dotted = "".join(_text(c) for c in node.named_children).replace(" ", "")
        if dotted:
            found.wildcards.append(dotted)


def _csharp(node: Node, found: Imports) -> None:
    alias = node.child_by_field_name("name")
    target = next(
        (c for c in node.named_children if c is not alias and c.type in ("qualified_name", "identifier")), None
    )
    if target is None:
        return
    dotted = "".join(_text(target).split())
    if alias is not None:
        found.modules[_text(alias)] = dotted
        owner, _, name = dotted.rpartition(".")
        found.names[_text(alias)] = (owner, name)
    else:
        found.wildcards.append(dotted)


def _bash(node: Node, found: Imports) -> None:
    """`source FILE` and `. FILE`: every function of FILE is in scope (a `$VAR/` prefix is dropped)."""
    name = node.child_by_field_name("name")
    if _text(name) not in ("source", "."):
        return
    for arg in node.children_by_field_name("argument"):
        target = _string_value(arg) if arg.type in ("string", "raw_string") else _text(arg)
        if "$" in target:
            target = target.rsplit("}", 1)[-1] if "}" in target else target.split("/", 1)[-1]
        target = target.lstrip("/")
        if target:
            found.wildcards.append(target)
        break


_IMPORT_READERS = {
    "python": _python,
    "javascript": _js,
    "typescript": _js,
    "tsx": _js,
    "go": _go,
    "rust": _rust,
    "java": _java,
    "c": _c,
    "cpp": _c,
    "csharp": _csharp,
    "bash": _bash,
}


# -- modules to paths -------------------------------------------------------------------


def module_targets(module: str, language: str, path: str | None) -> list[tuple[str, str]]:
    """("file", path without extension) or ("dir", folder) suffixes where `module` (as `language` writes
    it, imported by the file at `path`) can live; a path that starts with "/" is whole, else a suffix."""
    here = posixpath.dirname(path.replace(os.sep, "/")) if path else None
    spec = spec_for(language)
    name = spec.name if spec is not None else language
    if name == "python":
        dots = len(module) - len(module.lstrip("."))
        rest = module[dots:].replace(".", "/")
        if dots and here is not None:
            base = here
            for _ in range(dots - 1):
                base = posixpath.dirname(base)
            return [("file", posixpath.join(base, rest) if rest else base)]
        return [("file", rest)] if rest else []
    if name in ("javascript", "typescript", "tsx"):
        stem = module
        for ext in (".js", ".mjs", ".cjs", ".jsx", ".ts", ".tsx", ".mts", ".cts"):
            if stem.endswith(ext):
                stem = stem[: -len(ext)]
                break
        if stem.startswith(".") and here is not None:
            stem = posixpath.normpath(posixpath.join(here, stem))
        else:
            stem = stem.lstrip("./@~")
        return [("file", stem)] if stem else []
    if name == "go":
        parts = [p for p in module.split("/") if p]
        return [("dir", "/".join(parts[-2:]))] if parts else []
    if name == "rust":
        parts = [p for p in module.split("::") if p and p not in ("crate", "self", "super")]
        return [("file", "/".join(parts))] if parts else ([("dir", here)] if here and "super" not in module else [])
    if name == "java":
        return [("file", module.replace(".", "/")), ("dir", module.replace(".", "/"))]
    if name == "bash":
        stem = posixpath.normpath(posixpath.join(here, module)) if here and module.startswith(".") else module
        return [("file", posixpath.splitext(stem)[0])] if stem else []
    if name in ("c", "cpp"):
        stem = posixpath.splitext(module.replace("\\", "/").lstrip("./"))[0]
        return [("file", stem)] if stem and "::" not in module else []
    if name == "csharp":
        parts = module.split(".")
        return [("dir", "/".join(parts)), ("dir", parts[-1])]
    return []


_INDEX_NAMES = ("/__init__", "/index", "/mod")


def matches(path: str, targets: list[tuple[str, str]]) -> bool:
    """Whether the file at `path` is where one of module_targets' answers points."""
    p = path.replace("\\", "/")
    stem = posixpath.splitext(p)[0]
    for kind, suffix in targets:
        if not suffix:
            continue
        if kind == "dir":
            d = posixpath.dirname(p)
            if d == suffix or d.endswith("/" + suffix.lstrip("/")):
                return True
            continue
        candidates = [stem] + [stem[: -len(tail)] for tail in _INDEX_NAMES if stem.endswith(tail)]
        for c in candidates:
            if c == suffix or (not suffix.startswith("/") and c.endswith("/" + suffix)):
                return True
    return False
