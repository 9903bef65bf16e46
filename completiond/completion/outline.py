"""A source file's outline for retrieval, by tree-sitter in every language of languages.py: the lines
where its definitions start (where chunks are cut), the names they define, and its imports.

* Definitions: the file's top-level definitions and the members of its containers (classes, impls,
  traits, interfaces, namespaces, modules), never what a function body holds. A definition starts at
  its lead-in: the comments, decorators and attributes right above it (a doc comment stays with its
  function). Definitions of values (`const x = ...`, fields, Python's module-level assignments) define
  their names; they cut a chunk only where they span several lines (`export const f = () => {...}`).
* Imports: each language's forms (Python import/from, JS/TS import and require, Go import, Rust use,
  Java import, C/C++ #include, C# using), as the local names they bring in and the modules they come
  from; `module_targets` turns a module into the file or folder paths it can live at.

Parsing holds the GIL while tree-sitter runs, so the text is fed in pieces (READ_BYTES): another
thread gets a turn between pieces. Files over PARSE_MAX_BYTES are not parsed (the line rules of
chunking.py cut them). A language without a grammar has no outline: the callers use the line rules.
"""

from __future__ import annotations

import bisect
import os
import posixpath
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from tree_sitter import Node, Parser, Point, Tree

from completiond.completion.languages import LanguageSpec, spec_for

PARSE_MAX_BYTES = 512 << 10
READ_BYTES = 4096
MAX_LEAD_IN = 40          # lines of comments and attributes a definition may take along

# Definitions whose members are definitions too (their bodies are walked); a function's body never is.
CONTAINERS = frozenset({
    "class_definition", "class_declaration", "abstract_class_declaration", "interface_declaration",
    "enum_declaration", "record_declaration", "struct_declaration", "impl_item", "trait_item", "mod_item",
    "namespace_definition", "class_specifier", "struct_specifier", "namespace_declaration", "module",
    "internal_module", "object_type"})
# Nodes that wrap one definition and start at its lead-in (decorators, `export`, `template <...>`).
WRAPPERS = frozenset({"decorated_definition", "export_statement", "template_declaration", "ambient_declaration"})
# Nodes walked through as if their children stood in their place (conditional compilation, extern "C").
PASS_THROUGH = frozenset({"preproc_if", "preproc_ifdef", "preproc_else", "preproc_elif", "linkage_specification",
                          "declaration_list"})
# Definitions of values: they cut a chunk only where they span several lines.
VALUES = frozenset({"lexical_declaration", "variable_declaration", "field_declaration", "const_declaration",
                    "var_declaration", "const_item", "static_item", "preproc_def", "property_declaration",
                    "type_definition", "type_item", "alias_declaration"})
LEAD_IN = frozenset({"decorator", "attribute_item", "annotation", "marker_annotation", "attribute_list"})
_NAME_LEAVES = frozenset({"identifier", "type_identifier", "field_identifier", "property_identifier",
                          "package_identifier", "constant", "name", "simple_identifier"})


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


@dataclass
class Outline:
    """kinds: line -> 3 where a definition starts (lead-in included: chunks are cut there), 2 for a
    decorator line the line rules found in an edit; names: line -> the names defined from there."""
    kinds: dict[int, int]
    names: dict[int, tuple[str, ...]]
    size: int | None = None          # lines described (for an edit's new lines)

    def kind(self, line: int) -> int:
        return self.kinds.get(line, 0)

    def defined_in(self, start: int, end: int) -> tuple[str, ...]:
        out: list[str] = []
        for line in sorted(k for k in self.names if start <= k < end):
            out.extend(self.names[line])
        return tuple(dict.fromkeys(out))

    def edited(self, lo: int, n_old: int, new: Outline) -> Outline:
        """The outline after lines [lo, lo + n_old) became the lines `new` describes (numbered from
        lo): the rest as it was, moved by the lines added or removed."""
        hi = lo + n_old
        delta = (new.size or 0) - n_old

        def part(table: dict, add: dict) -> dict:
            out = {(k + delta if k >= hi else k): v for k, v in table.items() if k < lo or k >= hi}
            out.update(add)
            return out

        return Outline(part(self.kinds, new.kinds), part(self.names, new.names))


# -- parsing -------------------------------------------------------------------------

def spec_with_grammar(language: str | None) -> LanguageSpec | None:
    spec = spec_for(language) if language else None
    return spec if spec is not None and spec.language() is not None else None


def parse(data: bytes, spec: LanguageSpec, old: Tree | None = None) -> Tree | None:
    """The tree of `data` (UTF-8), fed in READ_BYTES pieces; `old` an edited tree to reuse (Tree.edit
    applied). None over PARSE_MAX_BYTES."""
    if len(data) > PARSE_MAX_BYTES:
        return None
    language = spec.language()
    if language is None:
        return None
    parser = Parser(language)     # parsers are not thread-safe, and cheap to make
    view = memoryview(data)

    def read(offset: int, _point: Point) -> bytes:
        return bytes(view[offset:offset + READ_BYTES])

    return parser.parse(read, old) if old is not None else parser.parse(read)


def edit_tree(tree: Tree, old_text: str, text: str, start: int, old_end: int, new_end: int) -> None:
    """Tell `tree` (of old_text) that old_text[start:old_end] became text[start:new_end] (code points)."""
    def at(s: str, offset: int) -> tuple[int, Point]:
        head = s[:offset]
        nbytes = offset if head.isascii() else len(head.encode("utf-8", "surrogatepass"))
        ls = s.rfind("\n", 0, offset) + 1
        line_head = s[ls:offset]
        col = len(line_head) if line_head.isascii() else len(line_head.encode("utf-8", "surrogatepass"))
        return nbytes, Point(s.count("\n", 0, offset), col)

    sb, sp = at(old_text, start)
    ob, op = at(old_text, old_end)
    nb, np = at(text, new_end)
    tree.edit(start_byte=sb, old_end_byte=ob, new_end_byte=nb, start_point=sp, old_end_point=op, new_end_point=np)


class _Rows:
    """Tree-sitter rows (lines ended by "\\n") to str.splitlines lines: the same where the text breaks
    lines at "\\n" or "\\r\\n" only (plain), else through the byte offsets of the lines."""

    def __init__(self, lines: list[str] | None, plain: bool):
        self.starts: list[int] | None = None
        if not plain and lines is not None:
            acc, starts = 0, []
            for line in lines:
                starts.append(acc)
                acc += len(line.encode("utf-8", "surrogatepass"))
            self.starts = starts

    def line(self, node: Node) -> int:
        if self.starts is None:
            return node.start_point.row
        return bisect.bisect_right(self.starts, node.start_byte) - 1

    def end_line(self, node: Node) -> int:
        if self.starts is None:
            end = node.end_point
            # a node that takes its line's "\n" along (Rust's line comments) ends on that line
            return end.row - 1 if end.column == 0 and end.row > node.start_point.row else end.row
        return bisect.bisect_right(self.starts, max(node.start_byte, node.end_byte - 1)) - 1


def outline(tree: Tree, spec: LanguageSpec, lines: list[str] | None = None, plain: bool = True) -> Outline:
    """Where the definitions of a parsed file start and what they define (see the module's doc)."""
    rows = _Rows(lines, plain)
    kinds: dict[int, int] = {}
    names: dict[int, tuple[str, ...]] = {}
    defs = spec.definitions
    comments = spec.comments

    def lead_in(node: Node, first: int) -> int:
        prev = node.prev_named_sibling
        taken = 0
        while prev is not None and taken < MAX_LEAD_IN and (prev.type in comments or prev.type in LEAD_IN):
            if rows.end_line(prev) < first - 1:
                break
            before = prev.prev_sibling
            if before is not None and rows.end_line(before) >= rows.line(prev):
                break                    # a comment that ends the line above: it belongs there
            first = rows.line(prev)
            prev = prev.prev_named_sibling
            taken += 1
        return first

    def record(node: Node, inner: Node) -> None:
        found = _names(inner, spec)
        first = lead_in(node, rows.line(node))
        if not (inner.type in VALUES and rows.end_line(node) == rows.line(node)):
            kinds[first] = 3
        if found:
            names[first] = tuple(dict.fromkeys(names.get(first, ()) + found))

    def members(node: Node, depth: int) -> None:
        for child in node.named_children:
            if child.type in defs or child.type in WRAPPERS or child.type in PASS_THROUGH:
                walk_one(child, depth)
            elif child.type in spec.blocks or child.type.endswith("_body") or child.type in (
                    "field_declaration_list", "enum_body_declarations"):
                walk(child, depth)

    def walk_one(child: Node, depth: int) -> None:
        kind = child.type
        if kind in WRAPPERS:
            inner = _unwrap(child, defs)
            if inner is not None:
                record(child, inner)
                if inner.type in CONTAINERS and depth < 6:
                    members(inner, depth + 1)
        elif kind in defs:
            record(child, child)
            if kind in CONTAINERS and depth < 6:
                members(child, depth + 1)
        elif kind in PASS_THROUGH and depth < 6:
            walk(child, depth + 1)

    def walk(node: Node, depth: int) -> None:
        for child in node.named_children:
            if child.type in defs or child.type in WRAPPERS or child.type in PASS_THROUGH:
                walk_one(child, depth)
            elif spec.name == "python" and depth == 0 and child.type == "expression_statement":
                assigned = _python_assigned(child)
                if assigned:
                    line = rows.line(child)
                    names[line] = tuple(dict.fromkeys(names.get(line, ()) + assigned))

    walk(tree.root_node, 0)
    return Outline(kinds, names)


def _unwrap(node: Node, defs: frozenset[str]) -> Node | None:
    for child in node.named_children:
        if child.type in defs:
            return child
        if child.type in WRAPPERS:
            return _unwrap(child, defs)
    return None


def _text(node: Node | None) -> str:
    return node.text.decode("utf-8", "replace") if node is not None and node.text is not None else ""


def _names(node: Node, spec: LanguageSpec) -> tuple[str, ...]:
    """The names a definition node defines."""
    name = node.child_by_field_name("name")
    if name is not None and name.type in _NAME_LEAVES | {"type_identifier"}:
        return (_text(name),)
    if name is not None:                       # a qualified or scoped name: its last part
        leaf = _last_leaf(name)
        return (leaf,) if leaf else ()
    out: list[str] = []
    for child in node.named_children:
        if child.type in ("variable_declarator", "type_spec", "type_alias", "const_spec", "var_spec",
                          "init_declarator"):
            n = child.child_by_field_name("name") or child.child_by_field_name("declarator")
            if n is not None:
                leaf = _text(n) if n.type in _NAME_LEAVES else _declarator_name(n)
                if leaf:
                    out.append(leaf)
    declarator = node.child_by_field_name("declarator")
    if declarator is not None and not out:
        leaf = _declarator_name(declarator)
        if leaf:
            out.append(leaf)
    return tuple(out)


def _declarator_name(node: Node) -> str:
    """The name a C/C++ declarator declares (`*name(args)`, `ns::name`, `name[4]`)."""
    for _ in range(12):
        if node.type in _NAME_LEAVES or node.type in ("destructor_name", "operator_name"):
            return _text(node)
        if node.type in ("qualified_identifier", "scoped_identifier"):
            inner = node.child_by_field_name("name")
            if inner is None:
                return ""
            node = inner
            continue
        inner = node.child_by_field_name("declarator")
        if inner is None:
            return ""
        node = inner
    return ""


def _last_leaf(node: Node) -> str:
    for _ in range(12):
        if node.named_child_count == 0:
            return _text(node)
        node = node.named_children[-1]
    return ""


def _python_assigned(stmt: Node) -> tuple[str, ...]:
    assign = stmt.named_children[0] if stmt.named_child_count else None
    if assign is None or assign.type != "assignment":
        return ()
    left = assign.child_by_field_name("left")
    return (_text(left),) if left is not None and left.type == "identifier" else ()


# -- imports -------------------------------------------------------------------------

_imports_lock = threading.Lock()
_imports: OrderedDict[tuple[str, str], tuple[str, Imports]] = OrderedDict()
MAX_IMPORT_CACHE = 64


def imports_of(text: str, language: str | None = "python", path: str | None = None,
               max_chars: int = 65536) -> Imports:
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


_PRELUDE = frozenset({"package_clause", "package_declaration", "namespace_declaration",
                      "file_scoped_namespace_declaration", "extern_crate_declaration", "preproc_ifdef", "preproc_def",
                      "preproc_if", "preproc_call"})


def _docstring(node: Node) -> bool:
    return node.type == "expression_statement" and node.named_child_count == 1 and \
        node.named_children[0].type in ("string", "concatenated_string")


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
            imported = child.type in spec.imports or (requires and child.type in ("lexical_declaration",
                                                                                   "variable_declaration"))
            if imported and reader is not None:
                reader(child, found)
            elif child.type in PASS_THROUGH or child.type in ("namespace_declaration", "mod_item"):
                stack.append(child)
            if node is root and not imported and child.type not in spec.comments and child.type not in _PRELUDE \
                    and not _docstring(child):
                prelude = child.start_byte      # the last one seen (children run backwards) is the first
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
            if (decl.type != "variable_declarator" or value is None or value.type != "call_expression"
                    or _text(value.child_by_field_name("function")) != "require"):
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
                            source, _text(part.child_by_field_name("key")))
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
            if part.type == "identifier":                      # the default export
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
        if name == "self" and prefix:                        # use a::b::{self}: the module b
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
    elif node.type == "using_declaration":                  # C++: using std::vector / using namespace x
        dotted = "".join(_text(c) for c in node.named_children).replace(" ", "")
        if dotted:
            found.wildcards.append(dotted)


def _csharp(node: Node, found: Imports) -> None:
    alias = node.child_by_field_name("name")
    target = next((c for c in node.named_children if c is not alias and c.type in ("qualified_name", "identifier")),
                  None)
    if target is None:
        return
    dotted = "".join(_text(target).split())
    if alias is not None:
        found.modules[_text(alias)] = dotted
        owner, _, name = dotted.rpartition(".")
        found.names[_text(alias)] = (owner, name)
    else:
        found.wildcards.append(dotted)


_IMPORT_READERS = {"python": _python, "javascript": _js, "typescript": _js, "tsx": _js, "go": _go,
                   "rust": _rust, "java": _java, "c": _c, "cpp": _c, "csharp": _csharp}


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
