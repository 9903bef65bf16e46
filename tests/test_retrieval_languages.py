"""Retrieval in every language with a grammar: chunks cut where tree-sitter finds definitions, and
the definition of a name at the cursor found through the file's import forms (issue 44).

Each case writes a definition file, a decoy defining the same name in a folder that sorts first (so a
look-up that ignored the imports would pick the decoy), and a document that imports the right one."""

from __future__ import annotations

from pathlib import Path

import pytest

from completiond.completion import imports, outline, retrieval
from completiond.completion.retrieval import RetrievalIndex
from completiond.completion.workspace import LOCAL, Workspace

CASES = {
    "javascript": {
        "name": "formatDate",
        "files": {"lib/format.js": "/** Formats a date as YYYY-MM-DD. */\nexport function formatDate(d) {\n"
                                "  const pad = (n) => String(n).padStart(2, '0');\n"
                                "  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}`;\n}\n",
               "aaa/dates.js": "function formatDate(x) {\n  return 'decoy';\n}\nmodule.exports = { formatDate };\n"},
        "main": "src/app.js",
        "doc": "import { formatDate } from '../lib/format.js';\n\nexport function render(post) {\n"
            "  return post.title + ' ' + formatDate(",
        "want": "lib/format.js", "snippet": "export function formatDate(d) {"},
    "javascript-require": {
        "name": "parseArgs",
        "files": {"util/args.js": "function parseArgs(argv) {\n  const out = {};\n  for (const a of argv) {\n"
                               "    const [k, v] = a.replace(/^--/, '').split('=');\n    out[k] = v ?? true;\n  }\n"
                               "  return out;\n}\n\nmodule.exports = { parseArgs };\n",
               "aaa/cli.js": "function parseArgs() {\n  return 'decoy';\n}\n"},
        "main": "bin/run.js", "language": "javascript",
        "doc": "const { parseArgs } = require('../util/args');\n\nconst options = parseArgs(",
        "want": "util/args.js", "snippet": "function parseArgs(argv) {"},
    "typescript": {
        "name": "area",
        "files": {"geo/shapes.ts": "export interface Shape {\n  kind: 'circle' | 'square';\n  size: number;\n}\n\n"
                                "export function area(s: Shape): number {\n"
                                "  return s.kind === 'circle' ? Math.PI * s.size ** 2 : s.size ** 2;\n}\n",
               "aaa/area.ts": "export function area(w: number, h: number): number {\n  return w * h;\n}\n"},
        "main": "app/view.ts",
        "doc": "import * as geo from '../geo/shapes';\n\nexport function total(shapes: geo.Shape[]): number {\n"
            "  return shapes.reduce((sum, s) => sum + geo.area(",
        "want": "geo/shapes.ts", "snippet": "export function area(s: Shape): number {"},
    "go": {
        "name": "Open",
        "files": {"internal/store/store.go": "package store\n\n// Open opens the database file at path.\n"
                                          "func Open(path string) (*DB, error) {\n\tdb := &DB{path: path}\n"
                                          "\treturn db, db.load()\n}\n",
               "aaa/open.go": "package aaa\n\nfunc Open() error {\n\treturn nil\n}\n"},
        "main": "cmd/app/main.go",
        "doc": 'package main\n\nimport (\n\t"fmt"\n\n\t"example.com/proj/internal/store"\n)\n\nfunc main() {\n'
            '\tdb, err := store.Open(',
        "want": "internal/store/store.go", "snippet": "// Open opens the database file at path."},
    "rust": {
        "name": "load_settings",
        "files": {"src/config.rs": "use std::path::Path;\n\n/// Reads the settings file.\n"
                                "pub fn load_settings(path: &Path) -> Settings {\n"
                                "    let text = std::fs::read_to_string(path).unwrap_or_default();\n"
                                "    Settings::parse(&text)\n}\n",
               "src/aaa.rs": "pub fn load_settings() -> u32 {\n    0\n}\n"},
        "main": "src/main.rs",
        "doc": "use crate::config::load_settings;\nuse std::path::Path;\n\nfn main() {\n"
            "    let settings = load_settings(",
        "want": "src/config.rs", "snippet": "pub fn load_settings(path: &Path) -> Settings {"},
    "java": {
        "name": "capitalize",
        "files": {"src/main/java/com/acme/util/Strings.java":
               "package com.acme.util;\n\npublic final class Strings {\n    private Strings() {}\n\n"
               "    /** Upper-cases the first letter. */\n    public static String capitalize(String s) {\n"
               "        if (s == null || s.isEmpty()) return s;\n"
               "        return Character.toUpperCase(s.charAt(0)) + s.substring(1);\n    }\n}\n",
               "src/main/java/com/aaa/Other.java":
               "package com.aaa;\n\nclass Other {\n    static String capitalize(String s) { return s; }\n}\n"},
        "main": "src/main/java/com/acme/App.java",
        "doc": "package com.acme;\n\nimport com.acme.util.Strings;\n\npublic class App {\n"
            "    public static void main(String[] args) {\n        String name = Strings.capitalize(",
        "want": "src/main/java/com/acme/util/Strings.java", "snippet": "public static String capitalize(String s) {"},
    "c": {
        "name": "trim_spaces",
        "files": {"text/trim.h": "#ifndef TRIM_H\n#define TRIM_H\nchar *trim_spaces(char *s);\n#endif\n",
               "text/trim.c": '#include <ctype.h>\n#include "trim.h"\n\n/* Trims leading and trailing spaces in place. */\n'
                              "char *trim_spaces(char *s) {\n    while (isspace((unsigned char)*s)) s++;\n"
                              "    return s;\n}\n",
               "aaa/util.c": "char *trim_spaces(char *s) { return s; }\n"},
        "main": "src/main.c",
        "doc": '#include <stdio.h>\n#include "text/trim.h"\n\nint main(int argc, char **argv) {\n'
            "    char *name = trim_spaces(",
        "want": "text/trim.c", "snippet": "char *trim_spaces(char *s) {"},
    "cpp": {
        "name": "dot",
        "files": {"geom/vec.hpp": "#pragma once\n\nnamespace geom {\n\nstruct Vec { double x, y; };\n\n"
                               "inline double dot(const Vec& a, const Vec& b) {\n    return a.x * b.x + a.y * b.y;\n}\n\n"
                               "}  // namespace geom\n",
               "aaa/math.cpp": "double dot(double a, double b) {\n    return a * b;\n}\n"},
        "main": "src/physics.cpp",
        "doc": '#include "geom/vec.hpp"\n\ndouble work(const geom::Vec& f, const geom::Vec& d) {\n'
            "    return geom::dot(",
        "want": "geom/vec.hpp", "snippet": "inline double dot(const Vec& a, const Vec& b) {"},
    "csharp": {
        "name": "Total",
        "files": {"src/Billing/InvoiceMath.cs": "namespace Acme.Billing\n{\n    public static class InvoiceMath\n    {\n"
                                             "        public static decimal Total(decimal net, decimal rate)\n"
                                             "        {\n            return net * (1 + rate);\n        }\n    }\n}\n",
               "src/Aaa/Other.cs": "namespace Aaa\n{\n    class Other\n    {\n"
                                   "        public static int Total() { return 0; }\n    }\n}\n"},
        "main": "src/App/Program.cs",
        "doc": "using System;\nusing Acme.Billing;\n\nclass Program\n{\n    static void Main()\n    {\n"
            "        var due = InvoiceMath.Total(",
        "want": "src/Billing/InvoiceMath.cs", "snippet": "public static decimal Total(decimal net, decimal rate)"},
    "bash": {
        "name": "log_info",
        "files": {"lib/log.sh": "#!/usr/bin/env bash\n\n# Prints a timestamped line to stderr.\nlog_info() {\n"
                                "  printf '%s INFO %s\\n' \"$(date +%T)\" \"$*\" >&2\n}\n",
                  "aaa/other.sh": "log_info() {\n  echo decoy\n}\n"},
        "main": "bin/deploy.sh", "language": "shellscript",
        "doc": "#!/usr/bin/env bash\nsource \"$(dirname \"$0\")/../lib/log.sh\"\n\nmain() {\n  log_info ",
        "want": "lib/log.sh", "snippet": "log_info() {"},
    "python": {
        "name": "exponential_backoff",
        "files": {"pkg/timing.py": 'import random\n\n\ndef exponential_backoff(attempt, cap=60.0):\n'
                                '    """The delay before an attempt."""\n    return min(cap, 2 ** attempt * random.random())\n',
               "aaa/retry.py": "def exponential_backoff(n):\n    return 0\n"},
        "main": "app/client.py",
        "doc": "import pkg.timing as timing\n\n\ndef fetch(url, attempt):\n    wait = timing.exponential_backoff(",
        "want": "pkg/timing.py", "snippet": "def exponential_backoff(attempt, cap=60.0):"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_definition_imported_from_another_file_reaches_the_context(tmp_path: Path, case: str):
    c = CASES[case]
    language = c.get("language", case)
    for rel, text in c["files"].items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    w = Workspace([tmp_path], scan=False)
    w.scan()
    main = tmp_path / c["main"]
    w.did_open(main, c["doc"], language)
    ctx = w.context(main, language, 400, text=c["doc"], offset=len(c["doc"]), mode="retrieval")
    assert ctx, f"{case}: no context"
    assert ctx[0][0] == c["want"], f"{case}: {ctx}"
    assert c["snippet"] in ctx[0][1]
    # The import decided: without it, the same look-up takes the decoy (its folder sorts first).
    query = retrieval.make_query(c["doc"], len(c["doc"]), language=language, path=str(main))
    name = c["name"]

    def path_of(found: imports.Imports) -> str:
        ids = w.index.definitions([name], found, lambda ch: ch.path != str(main), qualifiers=query.qualifiers)
        return w.relative_path(w.index.chunks[ids[0]].path) if ids else ""

    assert path_of(query.imports) == c["want"]
    assert "aaa" in path_of(imports.Imports(language, None)).lower(), case

CHUNKED = {
    "go": ("package store\n\nimport \"os\"\n\n" + "".join(
        f"// F{i} does step {i}.\n// It has a second line.\nfunc F{i}(a int) int {{\n\tb := a + {i}\n"
        f"\tc := b * 2\n\treturn c\n}}\n\n" for i in range(4)), "// F{i} does step {i}.\n"),
    "rust": ("".join(f"/// Step {i}.\n#[inline]\npub fn step_{i}(a: u32) -> u32 {{\n    let b = a + {i};\n"
                     f"    let c = b * 2;\n    c\n}}\n\n" for i in range(4)), "/// Step {i}.\n"),
    "typescript": ("export class Machine {\n" + "".join(
        f"  /** Runs step {i}. */\n  step{i}(a: number): number {{\n    const b = a + {i};\n"
        f"    const c = b * 2;\n    return c;\n  }}\n\n" for i in range(4)) + "}\n", "  /** Runs step {i}. */\n"),
    "java": ("class Machine {\n" + "".join(
        f"    @Override\n    public int step{i}(int a) {{\n        int b = a + {i};\n        int c = b * 2;\n"
        f"        return c;\n    }}\n\n" for i in range(4)) + "}\n", "    @Override\n"),
}


@pytest.mark.parametrize("language", sorted(CHUNKED))
def test_chunks_start_at_definitions_with_their_doc_comments(language: str):
    text, head = CHUNKED[language]
    pieces = retrieval.prepare(text, language=language)
    starts = [body.splitlines(keepends=True)[0] for _, _, body, *_ in pieces]
    lines = text.splitlines(keepends=True)
    assert [s for s, *_ in pieces] == sorted(s for s, *_ in pieces) and pieces[-1][1] == len(lines)
    for i in range(1, 4):                      # the first may share the file's head
        assert head.format(i=i) in starts, (language, starts)
    # Each chunk records what it defines.
    names = {n for *_, defines in pieces for n in (defines or ())}
    assert {f"step{i}" for i in range(4)} <= names or {f"F{i}" for i in range(4)} <= names \
        or {f"step_{i}" for i in range(4)} <= names, names


def test_an_edited_document_keeps_its_cuts_and_indexes_what_is_typed(monkeypatch):
    text = CHUNKED["go"][0]
    index = RetrievalIndex()
    key = (LOCAL, "/w/store.go")
    index.update(key, "/w/store.go", "go", text, keep_outline=True)
    before = {index.chunks[c].start for c in index.by_key[key]}
    parses = []
    real_parse = outline.parse
    monkeypatch.setattr(outline, "parse", lambda *a, **kw: parses.append(1) or real_parse(*a, **kw))
    typed = "func Reopen(path string) error {\n\treturn nil\n}\n\n"
    at = text.index("// F2")
    for i in range(1, len(typed) + 1):          # one keystroke at a time, as an editor sends them
        old = text[:at] + typed[: i - 1] + text[at:]
        assert index.update_edit(key, "/w/store.go", "go", old, text[:at] + typed[:i] + text[at:])
    chunks = [index.chunks[c] for c in index.by_key[key]]
    new = text[:at] + typed + text[at:]
    assert "".join(c.text for c in chunks) == new               # they still tile the file
    assert index.defs.get("Reopen")                             # the new function is a definition
    moved = {s + (4 if s >= new.count("\n", 0, at) else 0) for s in before}
    assert len(moved - {c.start for c in chunks}) <= 1          # the cuts elsewhere stay
    assert parses == []                                         # and no keystroke parsed the file
    index._outlines.clear()                                     # its outline gone (evicted): one whole parse
    assert index.update_edit(key, "/w/store.go", "go", new, new + "\n") and len(parses) == 1


def test_a_file_over_the_parse_bound_is_cut_by_the_line_rules(monkeypatch):
    text = CHUNKED["rust"][0]
    assert retrieval.prepare(text, language="rust").outline is not None
    monkeypatch.setattr(outline, "PARSE_MAX_BYTES", 100)
    prepared = retrieval.prepare(text, language="rust")
    assert prepared.outline is None
    assert [(s, e) for s, e, *_ in prepared] == retrieval.split_lines(text.splitlines(keepends=True))


def test_imports_are_read_per_language_and_kept_while_the_code_below_changes():
    ts = "import def1, { a, b as c } from './x/y';\nimport * as ns from 'lib';\nconst { p, q: r } = require('./z');\n\n"
    imp = imports.imports_of(ts + "run();\n", "typescript", "/w/src/m.ts")
    assert imp.names["c"] == ("./x/y", "b") and imp.names["r"] == ("./z", "q") and imp.modules["ns"] == "lib"
    assert imports.module_targets("./x/y", "typescript", "/w/src/m.ts") == [("file", "/w/src/x/y")]
    again = imports.imports_of(ts + "run();\nmore();\n", "typescript", "/w/src/m.ts")
    assert again is imp                                         # typing below the imports re-reads nothing
    changed = imports.imports_of(ts.replace("'lib'", "'lib2'") + "run();\n", "typescript", "/w/src/m.ts")
    assert changed.modules["ns"] == "lib2"
    rs = imports.imports_of("use crate::a::{b, c as d};\nuse super::x::Y;\n", "rust")
    assert rs.names["d"] == ("crate::a", "c") and rs.names["Y"] == ("super::x", "Y")
    go = imports.imports_of('package m\n\nimport (\n\tal "github.com/x/y"\n\t"os"\n)\n', "go")
    assert go.modules == {"al": "github.com/x/y", "os": "os"}


def test_line_breaks_tree_sitter_does_not_count_keep_the_cuts_on_their_lines():
    # A form feed is a line break to str.splitlines, not to tree-sitter: its rows would be off by one
    # per page, and every cut after the first page a line early.
    text = "".join(f"def f{i}(a):\n    b = a + {i}\n    c = b * 2\n    d = c - 1\n    return d\n\x0c\n"
                   for i in range(4))
    lines = text.splitlines(keepends=True)
    pieces = retrieval.prepare(text, language="python")
    assert [(lines[s], defines) for s, _, _, _, _, defines in pieces] == [
        (f"def f{i}(a):\n", (f"f{i}",)) for i in range(4)]
