"""Python's own rules beside its grammar, and the whole-file checks the eval judges by.

* `layout_errors(tree, data)`: what tree-sitter's Python grammar lets through and Python does not, the
  layout of statements: a statement indented deeper or shallower than the one before it in its block (the
  grammar reads `x = 1` / `    y = 2` as two statements), a body no deeper than its header, and a header
  with no body (reported as a zero-width "body" error at the header's end: the judge allows one where the
  suggestion ends, the header the user goes on to fill), and a simple statement running on past a line end
  outside brackets (`x =` / `y = 1` is one assignment to the grammar), and `del` of what cannot be deleted.
* `parses(source, spec)`: whether a whole file is valid, Python by `ast` (only the parser runs, no code),
  other languages by their grammar; `error_at(source)`: where `ast` finds the first error.
"""

from __future__ import annotations

import ast
import re
import warnings

from tree_sitter import Node, Parser, Tree

from completiond.completion.languages import LanguageSpec
from completiond.completion.syntax_tree import Error, encode

MAX_LAYOUT_STATEMENTS = 2000  # statements visited per tree (a region holds far fewer)
_INDENT = re.compile(rb"[ \t]*")


def _line_indent(data: bytes, b: int) -> tuple[int, bool]:
    """(indentation width of the line holding byte b, whether only whitespace precedes b on it)."""
    ls = data.rfind(b"\n", 0, b) + 1
    m = _INDENT.match(data, ls)  # matches the empty string too: never None
    i = m.end() if m is not None else ls
    return i - ls, i >= b


def _blocks(stmt: Node) -> list[Node]:
    """The bodies of a compound statement, its clauses' included (elif / else / except / finally / case)."""
    out: list[Node] = []
    stack = list(stmt.children)
    while stack:
        n = stack.pop()
        if n.type == "block":
            out.append(n)
        elif n.type.endswith(("_clause", "_definition")) or n.type in ("case_clause", "block_clause"):
            stack.extend(n.children)
    return out


_TARGETS = frozenset({"identifier", "attribute", "subscript"})
_TARGET_LISTS = frozenset(
    {"expression_list", "tuple", "list", "parenthesized_expression", "pattern_list", "tuple_pattern", "list_pattern"}
)


def _deletable(n: Node) -> bool:
    """`del` takes names, attributes and subscripts, in tuples and lists (`del f(x)` is Python's error)."""
    if n.type in _TARGETS or n.type == "comment":
        return True
    return n.type in _TARGET_LISTS and all(_deletable(c) for c in n.named_children)


_OPEN = frozenset("([{")
_CLOSE = frozenset(")]}")


def _loose_newline(stmt: Node, data: bytes) -> bool:
    """A simple statement runs on past a line end that is outside brackets and strings and not escaped
    (the grammar reads `x =` / `y = 1` as one chained assignment)."""
    depth = 0
    prev: Node | None = None
    stack = [stmt]
    seen = 0
    while stack and seen < MAX_LAYOUT_STATEMENTS:
        n = stack.pop()
        seen += 1
        if n.child_count and n.type not in ("string", "concatenated_string"):
            stack.extend(reversed(n.children))
            continue
        if (
            prev is not None
            and n.start_point.row > prev.end_point.row
            and depth == 0
            and n.type != "comment"
            and not data[prev.end_byte : n.start_byte].rstrip(b" \t\n").endswith(b"\\")
        ):
            return True
        if n.type in _OPEN:
            depth += 1
        elif n.type in _CLOSE:
            depth = max(0, depth - 1)
        if n.type != "comment":
            prev = n
    return False


def layout_errors(tree: Tree, data: bytes, lo: int = 0, hi: int | None = None) -> list[Error]:
    """Layout errors of a Python tree (see the module doc), (start, end, False, kind), in document order;
    only of the statements that reach into bytes [lo, hi] (the judge looks near the cursor line: errors
    elsewhere are in every parse alike)."""
    hi = len(data) if hi is None else hi
    out: list[Error] = []
    todo: list[tuple[Node, int]] = [(tree.root_node, -1)]
    seen = 0
    while todo and seen < MAX_LAYOUT_STATEMENTS:
        body, header_indent = todo.pop()
        col = None
        for stmt in body.named_children:
            seen += 1
            if stmt.type == "comment" or stmt.is_error:
                continue
            near = stmt.end_byte >= lo and stmt.start_byte <= hi
            if not near and col is not None:
                if stmt.start_byte > hi:
                    break
                continue
            width, first = _line_indent(data, stmt.start_byte)
            if first:
                if col is None:
                    col = width  # the block's first statement sets its indentation
                    if width <= header_indent and near:
                        # No deeper than its header: the header has no body, and the grammar took the
                        # statements after it for one. Reported where the body should begin.
                        colon = body.prev_sibling
                        at = colon.end_byte if colon is not None else body.start_byte
                        out.append((at, at, False, "body"))
                elif width != col:
                    out.append((stmt.start_byte, stmt.end_byte, False, "indent"))
            if not near:
                continue
            if stmt.type == "delete_statement" and not all(_deletable(t) for t in stmt.named_children):
                out.append((stmt.start_byte, stmt.end_byte, False, "target"))
            blocks = _blocks(stmt)
            if not blocks and stmt.start_point.row != stmt.end_point.row and _loose_newline(stmt, data):
                out.append((stmt.start_byte, stmt.end_byte, False, "newline"))
            for block in blocks:
                if block.start_byte == block.end_byte or not block.named_child_count:
                    out.append((block.start_byte, block.start_byte, False, "body"))
                else:
                    todo.append((block, _line_indent(data, block.parent.start_byte if block.parent else 0)[0]))
    return sorted(out)


def parses(source: str, spec: LanguageSpec | None = None) -> bool:
    """Whether `source` is valid: Python by its own parser (`ast`: only the parser runs, no code), other
    languages by their tree-sitter grammar (no ERROR or MISSING node)."""
    if spec is None or spec.name == "python":
        return error_at(source) is None
    lang = spec.language()
    if lang is None:
        return True
    return not Parser(lang).parse(encode(source)).root_node.has_error


def error_at(source: str) -> int | None:
    """None when `source` is valid Python syntax, else the offset in it where the parser reports its
    first error (len(source) when it names no place). Only the parser runs (no compile, no code)."""
    with warnings.catch_warnings():
        # Invalid escape sequences and the like are warnings of the parser, not errors.
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            ast.parse(source)
        except SyntaxError as exc:  # IndentationError included
            if not exc.lineno:
                return len(source)
            pos = 0
            for _ in range(exc.lineno - 1):
                nl = source.find("\n", pos)
                if nl < 0:
                    return len(source)
                pos = nl + 1
            return min(len(source), pos + max(0, (exc.offset or 1) - 1))
        except (ValueError, MemoryError, RecursionError):
            return len(source)
    return None
