"""Model and language fit: a model whose record names its languages (the bundled one: Python) completes
nothing else, rather than completing Go with Python; the one notice says how to get a model that does."""

from __future__ import annotations

from typing import Any

# A catalog model that serves every common language, offered when the model in use does not serve a document's.
RECOMMENDED_FOR_LANGUAGES = "qwen2.5-coder-0.5b"
# Editors' language ids that name the same language (VS Code, Neovim filetypes, other clients).
LANGUAGE_ALIASES = {
    "python3": "python",
    "py": "python",
    "pyi": "python",
    "javascriptreact": "javascript",
    "typescriptreact": "typescript",
    "sh": "shellscript",
    "bash": "shellscript",
    "zsh": "shellscript",
    "c++": "cpp",
    "cs": "csharp",
    "golang": "go",
    "rs": "rust",
}
LANGUAGE_NAMES = {
    "python": "Python",
    "javascript": "JavaScript",
    "typescript": "TypeScript",
    "go": "Go",
    "rust": "Rust",
    "cpp": "C++",
    "csharp": "C#",
    "shellscript": "shell",
    "java": "Java",
    "c": "C",
}


def language_unserved(completer: Any, language: str | None, path: str | None) -> str:
    """Why the completer's model cannot serve this document's language ('' when it can, or when either is not
    known): a model whose record names its languages (the bundled one: Python) completes nothing else, rather
    than completing Go with Python. The message is the one notice the editor shows (once per language).
    completer: a Completer (its engine's record) or an engine."""
    engine = getattr(completer, "engine", completer)
    served = getattr(getattr(engine, "info", None), "languages", None)
    if not served or "*" in served:
        return ""
    wanted = document_language(language, path)
    if wanted is None or wanted in served:
        return ""
    names = ", ".join(LANGUAGE_NAMES.get(x, x) for x in served)
    model = getattr(completer, "name", "") or getattr(engine, "name", "") or "the model"
    return (
        f"{model} serves {names} only: no suggestions in {LANGUAGE_NAMES.get(wanted, wanted)} documents. "
        f"For those, use a model that serves them: `completiond pull {RECOMMENDED_FOR_LANGUAGES}`, then set "
        f'model = "{RECOMMENDED_FOR_LANGUAGES}" (`completiond pull --list` shows the others)'
    )


def document_language(language: str | None, path: str | None) -> str | None:
    """The document's language as model records name it: its editor language id, else its file extension;
    None when neither says (an untitled buffer in no language)."""
    if language:
        lang = language.strip().lower()
        return LANGUAGE_ALIASES.get(lang, lang)
    if path:
        from completiond.completion.workspace import language_of

        found = language_of(path)
        return LANGUAGE_ALIASES.get(found, found) if found else None
    return None
