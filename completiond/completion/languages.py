"""The language table: what the syntax layer, the stop rules and retrieval need to know about each language.

One `LanguageSpec` per language with a tree-sitter grammar (the grammar wheels from PyPI, pinned in
pyproject.toml): its names (the LSP language ids editors send, file extensions), a lazy loader of its
grammar, and the node types the rules ask about (blocks, statements, definitions, comments, strings,
imports) plus its bracket pairs. Node type names are the grammar's own; tests/test_languages.py checks
every one exists in its grammar, so a grammar upgrade that renames one fails there, not silently here.

`spec_for(language_id_or_path)` finds a spec by LSP id, by name or by a path's extension; a language
without a grammar gets None, and the callers fall back to their generic (language-blind) rules. Those
languages still have an id and a line comment marker (`GENERIC`, `language_of`, `comment_for`), which
the prompt and retrieval use.

Data only: nothing here parses. Loading a grammar imports its wheel once per process; a wheel that is
missing or fails to load is noted in the log once and the language is then treated as generic.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass, field

from tree_sitter import Language

log = logging.getLogger(__name__)

_BRACKETS = (("(", ")"), ("[", "]"), ("{", "}"))


@dataclass(frozen=True)
class LanguageSpec:
    name: str  # canonical name (also an LSP id)
    lsp_ids: tuple[str, ...]  # language ids editors send for it, lower case (name first)
    extensions: tuple[str, ...]  # file extensions, lower case, with the dot
    grammar: tuple[str, str]  # (module, function) of the grammar wheel returning the language pointer
    line_comment: str  # the line comment marker
    blocks: frozenset[str]  # nodes holding a sequence of statements or members (a body, the file)
    statements: frozenset[str]  # nodes that are one statement in a block (definitions are statements too)
    definitions: frozenset[str]  # function / class / type / method definitions: where retrieval cuts chunks
    comments: frozenset[str]
    strings: frozenset[str]  # string literals (a cursor inside one: no code rules apply)
    imports: frozenset[str]  # the import forms (import / use / #include / using ...)
    arguments: frozenset[str] = frozenset()  # bracketed lists the cursor may be inside: arguments, parameters
    brackets: tuple[tuple[str, str], ...] = _BRACKETS
    body_opener: str = "{"  # what a header supplies before its body (":" in Python)
    indented_blocks: bool = False  # blocks end where the indentation does (Python), not at a closer
    # Stand-ins for a cursor line the lines below need brackets from (syntax_site.stand_ins): a definition's
    # head before a `(` (its parameters follow), and a function literal's head for a body inside a call.
    definition_head: str = ""
    lambda_head: str = ""
    # Heads of the other constructs whose `{` / `(` the lines below may need, tried in order: Go's composite
    # literal (`Use: "root",` below), struct type (fields below) and grouped declarations (specs below).
    brace_heads: tuple[str, ...] = ("", "x = ")
    paren_heads: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())  # what a rule should know that the types do not say

    def language(self) -> Language | None:
        """The tree-sitter Language, loaded on first use; None (noted in the log once) when it cannot load."""
        return _load(self.grammar)

    @property
    def open_brackets(self) -> frozenset[str]:
        return frozenset(o for o, _ in self.brackets)

    @property
    def close_brackets(self) -> frozenset[str]:
        return frozenset(c for _, c in self.brackets)


def _f(*names: str) -> frozenset[str]:
    return frozenset(names)


# Statement-level node types shared by the C family's grammars (C, C++; Java, C#, JS/TS alike in part).
_C_STATEMENTS = _f(
    "expression_statement",
    "if_statement",
    "for_statement",
    "while_statement",
    "do_statement",
    "return_statement",
    "break_statement",
    "continue_statement",
    "switch_statement",
    "goto_statement",
    "labeled_statement",
    "compound_statement",
    "declaration",
    "case_statement",
    "attributed_statement",
)
_C_DEFINITIONS = _f(
    "function_definition",
    "struct_specifier",
    "enum_specifier",
    "union_specifier",
    "type_definition",
    "preproc_function_def",
    "preproc_def",
)
_JS_STATEMENTS = _f(
    "expression_statement",
    "if_statement",
    "for_statement",
    "for_in_statement",
    "while_statement",
    "do_statement",
    "return_statement",
    "break_statement",
    "continue_statement",
    "throw_statement",
    "try_statement",
    "switch_statement",
    "labeled_statement",
    "lexical_declaration",
    "variable_declaration",
    "import_statement",
    "export_statement",
    "statement_block",
    "empty_statement",
    "debugger_statement",
    "with_statement",
    "function_declaration",
    "generator_function_declaration",
    "class_declaration",
    "method_definition",
    "field_definition",
    "class_static_block",
    "switch_case",
    "switch_default",
)
_JS_DEFINITIONS = _f(
    "function_declaration",
    "generator_function_declaration",
    "class_declaration",
    "method_definition",
    "lexical_declaration",
    "variable_declaration",
)
_JS_BLOCKS = _f("program", "statement_block", "class_body", "switch_body", "switch_case", "switch_default")
_TS_EXTRA = _f(
    "interface_declaration",
    "type_alias_declaration",
    "enum_declaration",
    "abstract_class_declaration",
    "module",
    "internal_module",
    "ambient_declaration",
    "function_signature",
    "public_field_definition",
    "method_signature",
    "abstract_method_signature",
)
_TS_STATEMENTS = _JS_STATEMENTS - _f("field_definition") | _TS_EXTRA  # TypeScript's fields: public_field_definition
_TS_DEFINITIONS = _JS_DEFINITIONS | _TS_EXTRA - _f("ambient_declaration")

SPECS: tuple[LanguageSpec, ...] = (
    LanguageSpec(
        name="python",
        lsp_ids=("python", "python3"),
        extensions=(".py", ".pyi", ".pyw"),
        grammar=("tree_sitter_python", "language"),
        line_comment="#",
        definition_head="def x",
        lambda_head="",
        blocks=_f("module", "block"),
        statements=_f(
            "expression_statement",
            "if_statement",
            "for_statement",
            "while_statement",
            "try_statement",
            "with_statement",
            "match_statement",
            "return_statement",
            "raise_statement",
            "assert_statement",
            "pass_statement",
            "break_statement",
            "continue_statement",
            "delete_statement",
            "global_statement",
            "nonlocal_statement",
            "import_statement",
            "import_from_statement",
            "future_import_statement",
            "type_alias_statement",
            "function_definition",
            "class_definition",
            "decorated_definition",
            "print_statement",
            "exec_statement",
        ),
        definitions=_f("function_definition", "class_definition", "decorated_definition"),
        comments=_f("comment"),
        strings=_f("string", "concatenated_string"),
        imports=_f("import_statement", "import_from_statement", "future_import_statement"),
        arguments=_f(
            "argument_list",
            "parameters",
            "lambda_parameters",
            "list",
            "tuple",
            "dictionary",
            "set",
            "subscript",
            "parenthesized_expression",
            "generator_expression",
            "list_comprehension",
            "dictionary_comprehension",
            "set_comprehension",
            "type_parameter",
        ),
        body_opener=":",
        indented_blocks=True,
        notes=("else/elif/except/finally clauses continue the statement above them",),
    ),
    LanguageSpec(
        name="javascript",
        lsp_ids=("javascript", "javascriptreact", "js", "jsx"),
        extensions=(".js", ".mjs", ".cjs", ".jsx"),
        grammar=("tree_sitter_javascript", "language"),
        line_comment="//",
        definition_head="function x",
        lambda_head="() => ",
        blocks=_JS_BLOCKS,
        statements=_JS_STATEMENTS,
        definitions=_JS_DEFINITIONS,
        comments=_f("comment", "html_comment"),
        strings=_f("string", "template_string", "regex"),
        imports=_f("import_statement"),
        arguments=_f(
            "arguments",
            "formal_parameters",
            "array",
            "object",
            "parenthesized_expression",
            "object_pattern",
            "array_pattern",
            "named_imports",
        ),
        notes=("`require(...)` calls are imports too (a call_expression, not a form)",),
    ),
    LanguageSpec(
        name="typescript",
        lsp_ids=("typescript", "ts"),
        extensions=(".ts", ".mts", ".cts"),
        grammar=("tree_sitter_typescript", "language_typescript"),
        line_comment="//",
        definition_head="function x",
        lambda_head="() => ",
        blocks=_JS_BLOCKS | _f("interface_body", "enum_body", "object_type"),
        statements=_TS_STATEMENTS,
        definitions=_TS_DEFINITIONS,
        comments=_f("comment", "html_comment"),
        strings=_f("string", "template_string", "regex"),
        imports=_f("import_statement", "import_alias"),
        arguments=_f(
            "arguments",
            "formal_parameters",
            "array",
            "object",
            "parenthesized_expression",
            "object_pattern",
            "array_pattern",
            "named_imports",
            "type_arguments",
            "type_parameters",
        ),
    ),
    LanguageSpec(
        name="tsx",
        lsp_ids=("typescriptreact", "tsx"),
        extensions=(".tsx",),
        grammar=("tree_sitter_typescript", "language_tsx"),
        line_comment="//",
        definition_head="function x",
        lambda_head="() => ",
        blocks=_JS_BLOCKS | _f("interface_body", "enum_body", "object_type"),
        statements=_TS_STATEMENTS,
        definitions=_TS_DEFINITIONS,
        comments=_f("comment", "html_comment"),
        strings=_f("string", "template_string", "regex"),
        imports=_f("import_statement", "import_alias"),
        arguments=_f(
            "arguments",
            "formal_parameters",
            "array",
            "object",
            "parenthesized_expression",
            "object_pattern",
            "array_pattern",
            "named_imports",
            "type_arguments",
            "type_parameters",
        ),
    ),
    LanguageSpec(
        name="go",
        lsp_ids=("go", "golang"),
        extensions=(".go",),
        grammar=("tree_sitter_go", "language"),
        line_comment="//",
        definition_head="func x",
        lambda_head="func() ",
        brace_heads=("", "x := x", "type x struct ", "switch "),
        paren_heads=("import ", "var "),
        blocks=_f(
            "source_file",
            "block",
            "statement_list",
            "field_declaration_list",
            "interface_type",
            "expression_case",
            "default_case",
            "type_case",
            "communication_case",
        ),
        statements=_f(
            "expression_statement",
            "assignment_statement",
            "short_var_declaration",
            "inc_statement",
            "dec_statement",
            "send_statement",
            "if_statement",
            "for_statement",
            "expression_switch_statement",
            "type_switch_statement",
            "select_statement",
            "return_statement",
            "go_statement",
            "defer_statement",
            "break_statement",
            "continue_statement",
            "goto_statement",
            "fallthrough_statement",
            "labeled_statement",
            "block",
            "var_declaration",
            "const_declaration",
            "type_declaration",
            "function_declaration",
            "method_declaration",
            "import_declaration",
            "package_clause",
            "field_declaration",
            "method_elem",
            "empty_statement",
        ),
        definitions=_f(
            "function_declaration", "method_declaration", "type_declaration", "const_declaration", "var_declaration"
        ),
        comments=_f("comment"),
        strings=_f("interpreted_string_literal", "raw_string_literal", "rune_literal"),
        imports=_f("import_declaration"),
        arguments=_f(
            "argument_list",
            "parameter_list",
            "literal_value",
            "import_spec_list",
            "type_arguments",
            "type_parameter_list",
            "parenthesized_expression",
        ),
        notes=("a statement ends at a newline (automatic semicolons)",),
    ),
    LanguageSpec(
        name="rust",
        lsp_ids=("rust", "rs"),
        extensions=(".rs",),
        grammar=("tree_sitter_rust", "language"),
        line_comment="//",
        definition_head="fn x",
        lambda_head="|| ",
        blocks=_f(
            "source_file", "block", "declaration_list", "match_block", "field_declaration_list", "enum_variant_list"
        ),
        statements=_f(
            "expression_statement",
            "let_declaration",
            "function_item",
            "struct_item",
            "enum_item",
            "union_item",
            "impl_item",
            "trait_item",
            "mod_item",
            "use_declaration",
            "const_item",
            "static_item",
            "type_item",
            "macro_definition",
            "extern_crate_declaration",
            "foreign_mod_item",
            "function_signature_item",
            "attribute_item",
            "inner_attribute_item",
            "empty_statement",
            "macro_invocation",
            "match_arm",
            "field_declaration",
            "enum_variant",
        ),
        definitions=_f(
            "function_item",
            "struct_item",
            "enum_item",
            "union_item",
            "impl_item",
            "trait_item",
            "mod_item",
            "const_item",
            "static_item",
            "type_item",
            "macro_definition",
            "function_signature_item",
        ),
        comments=_f("line_comment", "block_comment"),
        strings=_f("string_literal", "raw_string_literal", "char_literal"),
        imports=_f("use_declaration", "extern_crate_declaration"),
        arguments=_f(
            "arguments",
            "parameters",
            "array_expression",
            "tuple_expression",
            "token_tree",
            "type_arguments",
            "type_parameters",
            "field_initializer_list",
            "closure_parameters",
            "parenthesized_expression",
            "use_list",
        ),
        brackets=_BRACKETS,
        notes=("a block's last expression has no statement node",),
    ),
    LanguageSpec(
        name="java",
        lsp_ids=("java",),
        extensions=(".java",),
        grammar=("tree_sitter_java", "language"),
        line_comment="//",
        definition_head="void x",
        lambda_head="() -> ",
        blocks=_f(
            "program",
            "block",
            "class_body",
            "interface_body",
            "enum_body",
            "enum_body_declarations",
            "constructor_body",
            "switch_block",
            "switch_block_statement_group",
            "annotation_type_body",
            "record_declaration",
        ),
        statements=_f(
            "expression_statement",
            "local_variable_declaration",
            "if_statement",
            "for_statement",
            "enhanced_for_statement",
            "while_statement",
            "do_statement",
            "return_statement",
            "break_statement",
            "continue_statement",
            "throw_statement",
            "try_statement",
            "try_with_resources_statement",
            "switch_expression",
            "synchronized_statement",
            "labeled_statement",
            "assert_statement",
            "yield_statement",
            "block",
            "method_declaration",
            "constructor_declaration",
            "field_declaration",
            "class_declaration",
            "interface_declaration",
            "enum_declaration",
            "record_declaration",
            "annotation_type_declaration",
            "import_declaration",
            "package_declaration",
            "constant_declaration",
            "compact_constructor_declaration",
        ),
        definitions=_f(
            "class_declaration",
            "interface_declaration",
            "enum_declaration",
            "record_declaration",
            "method_declaration",
            "constructor_declaration",
            "annotation_type_declaration",
            "field_declaration",
        ),
        comments=_f("line_comment", "block_comment"),
        strings=_f("string_literal", "character_literal"),
        imports=_f("import_declaration"),
        arguments=_f(
            "argument_list",
            "formal_parameters",
            "array_initializer",
            "type_arguments",
            "type_parameters",
            "parenthesized_expression",
            "annotation_argument_list",
        ),
    ),
    LanguageSpec(
        name="c",
        lsp_ids=("c",),
        extensions=(".c", ".h"),
        grammar=("tree_sitter_c", "language"),
        line_comment="//",
        definition_head="void x",
        lambda_head="",
        blocks=_f(
            "translation_unit",
            "compound_statement",
            "field_declaration_list",
            "enumerator_list",
            "declaration_list",
            "case_statement",
        ),
        statements=_C_STATEMENTS
        | _C_DEFINITIONS
        | _f("preproc_include", "preproc_if", "preproc_ifdef", "field_declaration", "preproc_call"),
        definitions=_C_DEFINITIONS,
        comments=_f("comment"),
        strings=_f("string_literal", "char_literal", "system_lib_string", "concatenated_string"),
        imports=_f("preproc_include"),
        arguments=_f(
            "argument_list", "parameter_list", "initializer_list", "parenthesized_expression", "subscript_expression"
        ),
    ),
    LanguageSpec(
        name="cpp",
        lsp_ids=("cpp", "c++", "cuda-cpp"),
        extensions=(".cc", ".cpp", ".cxx", ".c++", ".hpp", ".hh", ".hxx", ".h++", ".ipp", ".cu"),
        grammar=("tree_sitter_cpp", "language"),
        line_comment="//",
        definition_head="void x",
        lambda_head="[]() ",
        blocks=_f(
            "translation_unit",
            "compound_statement",
            "field_declaration_list",
            "enumerator_list",
            "declaration_list",
            "case_statement",
        ),
        statements=_C_STATEMENTS
        | _C_DEFINITIONS
        | _f(
            "preproc_include",
            "preproc_if",
            "preproc_ifdef",
            "field_declaration",
            "preproc_call",
            "try_statement",
            "throw_statement",
            "for_range_loop",
            "co_return_statement",
            "co_yield_statement",
            "namespace_definition",
            "template_declaration",
            "using_declaration",
            "alias_declaration",
            "static_assert_declaration",
            "class_specifier",
            "access_specifier",
            "friend_declaration",
            "concept_definition",
        ),
        definitions=_C_DEFINITIONS
        | _f(
            "class_specifier", "namespace_definition", "template_declaration", "alias_declaration", "concept_definition"
        ),
        comments=_f("comment"),
        strings=_f("string_literal", "char_literal", "raw_string_literal", "system_lib_string", "concatenated_string"),
        imports=_f("preproc_include", "using_declaration"),
        arguments=_f(
            "argument_list",
            "parameter_list",
            "initializer_list",
            "parenthesized_expression",
            "template_argument_list",
            "template_parameter_list",
            "subscript_argument_list",
        ),
    ),
    LanguageSpec(
        name="csharp",
        lsp_ids=("csharp", "c#", "cs"),
        extensions=(".cs", ".csx"),
        grammar=("tree_sitter_c_sharp", "language"),
        line_comment="//",
        definition_head="void x",
        lambda_head="() => ",
        blocks=_f(
            "compilation_unit",
            "block",
            "declaration_list",
            "switch_body",
            "switch_section",
            "accessor_list",
            "enum_member_declaration_list",
        ),
        statements=_f(
            "expression_statement",
            "local_declaration_statement",
            "if_statement",
            "for_statement",
            "foreach_statement",
            "while_statement",
            "do_statement",
            "return_statement",
            "break_statement",
            "continue_statement",
            "throw_statement",
            "try_statement",
            "switch_statement",
            "using_statement",
            "lock_statement",
            "yield_statement",
            "goto_statement",
            "labeled_statement",
            "checked_statement",
            "fixed_statement",
            "unsafe_statement",
            "empty_statement",
            "local_function_statement",
            "block",
            "global_statement",
            "using_directive",
            "namespace_declaration",
            "file_scoped_namespace_declaration",
            "class_declaration",
            "struct_declaration",
            "interface_declaration",
            "enum_declaration",
            "record_declaration",
            "delegate_declaration",
            "method_declaration",
            "constructor_declaration",
            "destructor_declaration",
            "property_declaration",
            "field_declaration",
            "event_declaration",
            "event_field_declaration",
            "indexer_declaration",
            "operator_declaration",
            "conversion_operator_declaration",
            "accessor_declaration",
        ),
        definitions=_f(
            "class_declaration",
            "struct_declaration",
            "interface_declaration",
            "enum_declaration",
            "record_declaration",
            "delegate_declaration",
            "method_declaration",
            "constructor_declaration",
            "property_declaration",
            "namespace_declaration",
            "local_function_statement",
        ),
        comments=_f("comment"),
        strings=_f(
            "string_literal",
            "verbatim_string_literal",
            "raw_string_literal",
            "interpolated_string_expression",
            "character_literal",
        ),
        imports=_f("using_directive"),
        arguments=_f(
            "argument_list",
            "parameter_list",
            "bracketed_argument_list",
            "type_argument_list",
            "type_parameter_list",
            "initializer_expression",
            "parenthesized_expression",
            "attribute_argument_list",
        ),
    ),
    LanguageSpec(
        name="bash",
        lsp_ids=("shellscript", "bash", "sh", "shell"),
        extensions=(".sh", ".bash"),
        grammar=("tree_sitter_bash", "language"),
        line_comment="#",
        blocks=_f("program", "compound_statement", "do_group", "subshell"),
        statements=_f(
            "command",
            "pipeline",
            "list",
            "variable_assignment",
            "declaration_command",
            "if_statement",
            "for_statement",
            "c_style_for_statement",
            "while_statement",
            "case_statement",
            "function_definition",
            "redirected_statement",
            "compound_statement",
            "subshell",
            "unset_command",
            "test_command",
            "negated_command",
        ),
        definitions=_f("function_definition"),
        comments=_f("comment"),
        strings=_f("string", "raw_string", "ansi_c_string", "heredoc_body", "translated_string"),
        imports=_f("command"),
        arguments=_f("subshell", "command_substitution", "arithmetic_expansion", "test_command", "array", "expansion"),
        body_opener="then",
        notes=("an import is a command whose name is `source` or `.`", "blocks close with keywords (fi, done, esac)"),
    ),
)

# Languages without a grammar here: the prompt and retrieval still know their id and comment marker.
# extension -> (language id as editors name it, line comment marker)
GENERIC: dict[str, tuple[str, str]] = {
    ".kt": ("kotlin", "//"),
    ".kts": ("kotlin", "//"),
    ".scala": ("scala", "//"),
    ".swift": ("swift", "//"),
    ".php": ("php", "//"),
    ".dart": ("dart", "//"),
    ".rb": ("ruby", "#"),
    ".zsh": ("shellscript", "#"),
    ".lua": ("lua", "--"),
    ".sql": ("sql", "--"),
    ".hs": ("haskell", "--"),
    ".r": ("r", "#"),
    ".jl": ("julia", "#"),
    ".pl": ("perl", "#"),
    ".ex": ("elixir", "#"),
    ".exs": ("elixir", "#"),
    ".toml": ("toml", "#"),
    ".yaml": ("yaml", "#"),
    ".yml": ("yaml", "#"),
    ".vim": ("vim", '"'),
    ".zig": ("zig", "//"),
    ".nim": ("nim", "#"),
}

_BY_ID: dict[str, LanguageSpec] = {i: s for s in SPECS for i in (s.name, *s.lsp_ids)}
_BY_EXT: dict[str, LanguageSpec] = {e: s for s in SPECS for e in s.extensions}
_GENERIC_COMMENTS = {lang: c for lang, c in GENERIC.values()}


def spec_for(language_or_path: str | os.PathLike | None) -> LanguageSpec | None:
    """The spec of an LSP language id or name (`typescriptreact`, `python`), else of a path's extension
    (`src/a.tsx`); None for a language without a grammar here (the caller uses its generic rules)."""
    if language_or_path is None:
        return None
    key = os.fspath(language_or_path)
    spec = _BY_ID.get(key.lower())
    if spec is not None:
        return spec
    ext = os.path.splitext(key)[1].lower()
    return _BY_EXT.get(ext) if ext else None


def spec_of(language: str | None, path: str | os.PathLike | None = None) -> LanguageSpec | None:
    """The spec for a document: its editor language id when given (an id this table does not know is a
    language without a grammar, whatever the extension says), else its path's extension."""
    if language:
        return _BY_ID.get(language.lower())
    return spec_for(path) if path is not None else None


def language_of(path: str | os.PathLike) -> str | None:
    """The language id editors use for a file, by extension (the spec's first LSP id), or None."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    spec = _BY_EXT.get(ext)
    if spec is not None:
        return spec.lsp_ids[0] if ext not in (".jsx",) else "javascriptreact"
    entry = GENERIC.get(ext)
    return entry[0] if entry else None


def comment_for(language: str | None) -> str | None:
    """The line comment marker of a language id, or None when unknown."""
    spec = _BY_ID.get((language or "").lower())
    return spec.line_comment if spec is not None else _GENERIC_COMMENTS.get(language or "")


_lock = threading.Lock()
_loaded: dict[tuple[str, str], Language | None] = {}


def _load(grammar: tuple[str, str]) -> Language | None:
    with _lock:
        if grammar in _loaded:
            return _loaded[grammar]
        lang: Language | None = None
        try:
            lang = Language(getattr(importlib.import_module(grammar[0]), grammar[1])())
        except (ImportError, AttributeError, ValueError, TypeError, OSError) as exc:  # missing or incompatible wheel
            log.warning("no tree-sitter grammar from %s.%s (%s): generic rules for this language", *grammar, exc)
        _loaded[grammar] = lang
        return lang
