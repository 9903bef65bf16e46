"""A source file's outline for retrieval, by tree-sitter in every language of languages.py: the lines
where its definitions start (where chunks are cut), the names they define, and its imports.

* Definitions: the file's top-level definitions and the members of its containers (classes, impls,
  traits, interfaces, namespaces, modules), never what a function body holds. A definition starts at
  its lead-in: the comments, decorators and attributes right above it (a doc comment stays with its
  function). Definitions of values (`const x = ...`, fields, Python's module-level assignments) define
  their names; they cut a chunk only where they span several lines (`export const f = () => {...}`).
* Imports: imports.py reads them from the same trees.

Parsing holds the GIL while tree-sitter runs, so the text is fed in pieces (READ_BYTES): another
thread gets a turn between pieces. Files over PARSE_MAX_BYTES are not parsed (the line rules of
chunking.py cut them). A language without a grammar has no outline: the callers use the line rules.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tree_sitter import Node, Parser, Point, Tree

from completiond.completion.languages import LanguageSpec, spec_for

PARSE_MAX_BYTES = 512 << 10
READ_BYTES = 4096
MAX_LEAD_IN = 40  # lines of comments and attributes a definition may take along

# Definitions whose members are definitions too (their bodies are walked); a function's body never is.
CONTAINERS = frozenset(
    {
        "class_definition",
        "class_declaration",
        "abstract_class_declaration",
        "interface_declaration",
        "enum_declaration",
        "record_declaration",
        "struct_declaration",
        "impl_item",
        "trait_item",
        "mod_item",
        "namespace_definition",
        "class_specifier",
        "struct_specifier",
        "namespace_declaration",
        "module",
        "internal_module",
        "object_type",
    }
)
# Nodes that wrap one definition and start at its lead-in (decorators, `export`, `template <...>`).
WRAPPERS = frozenset({"decorated_definition", "export_statement", "template_declaration", "ambient_declaration"})
# Nodes walked through as if their children stood in their place (conditional compilation, extern "C").
PASS_THROUGH = frozenset(
    {"preproc_if", "preproc_ifdef", "preproc_else", "preproc_elif", "linkage_specification", "declaration_list"}
)
# Definitions of values: they cut a chunk only where they span several lines.
VALUES = frozenset(
    {
        "lexical_declaration",
        "variable_declaration",
        "field_declaration",
        "const_declaration",
        "var_declaration",
        "const_item",
        "static_item",
        "preproc_def",
        "property_declaration",
        "type_definition",
        "type_item",
        "alias_declaration",
    }
)
LEAD_IN = frozenset({"decorator", "attribute_item", "annotation", "marker_annotation", "attribute_list"})
_NAME_LEAVES = frozenset(
    {
        "identifier",
        "type_identifier",
        "field_identifier",
        "property_identifier",
        "package_identifier",
        "constant",
        "name",
        "simple_identifier",
    }
)


@dataclass
class Outline:
    """kinds: line -> 3 where a definition starts (lead-in included: chunks are cut there), 2 for a
    decorator line the line rules found in an edit; names: line -> the names defined from there."""

    kinds: dict[int, int]
    names: dict[int, tuple[str, ...]]
    size: int | None = None  # lines described (for an edit's new lines)

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
    applied). None over PARSE_MAX_BYTES, or where the grammar does not load."""
    if len(data) > PARSE_MAX_BYTES:
        return None
    language = spec.language()
    if language is None:
        return None
    parser = Parser(language)  # parsers are not thread-safe, and cheap to make
    view = memoryview(data)

    def read(offset: int, _point: Point) -> bytes:
        return bytes(view[offset : offset + READ_BYTES])

    return parser.parse(read, old) if old is not None else parser.parse(read)


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
                break  # a comment that ends the line above: it belongs there
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
            elif (
                child.type in spec.blocks
                or child.type.endswith("_body")
                or child.type in ("field_declaration_list", "enum_body_declarations")
            ):
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
    if name is not None and name.type in _NAME_LEAVES:
        return (_text(name),)
    if name is not None:  # a qualified or scoped name: its last part
        leaf = _last_leaf(name)
        return (leaf,) if leaf else ()
    out: list[str] = []
    for child in node.named_children:
        if child.type in (
            "variable_declarator",
            "type_spec",
            "type_alias",
            "const_spec",
            "var_spec",
            "init_declarator",
        ):
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
