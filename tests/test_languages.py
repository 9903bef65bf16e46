"""The language table: lookups, and every node type it names exists in its grammar."""

from __future__ import annotations

import pytest

from completiond.completion.languages import GENERIC, SPECS, comment_for, language_of, spec_for, spec_of

pytestmark = pytest.mark.torch_free  # also run on the lowest supported Python, without torch (.ci/run)

# A small valid file per language: it parses without an error node, and holds one definition and one import.
SAMPLES = {
    "python": "import os\n\ndef f(x):\n    if x:\n        return os.sep\n",
    "javascript": "import a from 'a';\nfunction f(x) {\n  if (x) { return a(x); }\n}\n",
    "typescript": "import { a } from './a';\nfunction f(x: number): number {\n  return a(x);\n}\n",
    "tsx": "import React from 'react';\nfunction F(): JSX.Element {\n  return <div>{1}</div>;\n}\n",
    "go": "package p\n\nimport \"fmt\"\n\nfunc f(x int) {\n\tif x > 0 {\n\t\tfmt.Println(x)\n\t}\n}\n",
    "rust": "use std::io;\n\nfn f(x: i32) -> i32 {\n    if x > 0 { return x; }\n    x + 1\n}\n",
    "java": "import java.util.List;\n\nclass A {\n    int f(int x) {\n        return x + 1;\n    }\n}\n",
    "c": "#include <stdio.h>\n\nint f(int x) {\n    if (x) {\n        return x;\n    }\n    return 0;\n}\n",
    "cpp": "#include <vector>\n\nint f(int x) {\n    std::vector<int> v{x};\n    return v[0];\n}\n",
    "csharp": "using System;\n\nclass A {\n    int F(int x) {\n        return x + 1;\n    }\n}\n",
    "bash": "source ./lib.sh\n\nf() {\n  if [ -n \"$1\" ]; then\n    echo \"$1\"\n  fi\n}\n",
}


def test_at_least_the_languages_the_issue_names():
    assert {s.name for s in SPECS} >= set(SAMPLES)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_node_type_is_the_grammars_own(spec):
    lang = spec.language()
    assert lang is not None, f"{spec.name}: its grammar wheel did not load"
    for group in ("blocks", "statements", "definitions", "comments", "strings", "imports", "arguments"):
        for kind in getattr(spec, group):
            assert lang.id_for_node_kind(kind, True) is not None, f"{spec.name}.{group}: no node type {kind!r}"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_a_sample_parses_and_its_forms_are_found(spec):
    from tree_sitter import Parser

    tree = Parser(spec.language()).parse(SAMPLES[spec.name].encode())
    assert not tree.root_node.has_error
    assert tree.root_node.type in spec.blocks
    seen = set()
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        seen.add(node.type)
        stack.extend(node.children)
    assert seen & spec.definitions, spec.name
    assert seen & spec.imports, spec.name
    assert seen & spec.statements, spec.name


@pytest.mark.parametrize("key, name", [
    ("python", "python"), ("Python", "python"), ("typescriptreact", "tsx"), ("javascriptreact", "javascript"),
    ("shellscript", "bash"), ("csharp", "csharp"), ("cpp", "cpp"),
    ("src/a.tsx", "tsx"), ("lib/x.RS", "rust"), ("a/b.h", "c"), ("x.hpp", "cpp"), ("run.sh", "bash"),
    ("m.pyi", "python"), ("main.go", "go"),
])
def test_spec_for(key, name):
    spec = spec_for(key)
    assert spec is not None and spec.name == name


@pytest.mark.parametrize("key", ["kotlin", "a.kt", "README", "notes.txt", "", "ruby"])
def test_no_grammar_means_none(key):
    assert spec_for(key) is None


def test_the_editors_id_wins_over_the_extension():
    assert spec_of("python", "a.ts").name == "python"
    assert spec_of("kotlin", "a.ts") is None          # a language the table has no grammar for: generic
    assert spec_of(None, "a.ts").name == "typescript"


def test_ids_and_comments_for_every_language():
    assert language_of("a.py") == "python" and language_of("a.jsx") == "javascriptreact"
    assert language_of("a.tsx") == "typescriptreact" and language_of("a.rb") == "ruby"
    assert language_of("a.unknown") is None
    assert comment_for("rust") == "//" and comment_for("shellscript") == "#" and comment_for("lua") == "--"
    assert comment_for(None) is None
    assert not set(GENERIC) & {e for s in SPECS for e in s.extensions}
