#!/usr/bin/env python3
"""Copy the server's settings schema into the editor plugins and their docs.

The one source of truth is `completiond/config.py` (SETTINGS, `schema()`). This
script writes, from it:

  editors/vscode/package.json         contributes.configuration: `completiond.<key>`
                                       (keys with a further dot, e.g.
                                       `completiond.server.path`, are client-only
                                       and kept as they are)
  editors/nvim/lua/completiond/config.lua   the `settings` part of the defaults table
  editors/nvim/doc/completiond.txt    the settings reference
  editors/README.md                   the settings table
  editors/vscode/README.md            the install, VS Code and settings sections of
                                       editors/README.md (the extension's page)

    python3 editors/sync_settings.py           # rewrite the generated parts
    python3 editors/sync_settings.py --check   # exit 1 and say what differs

The schema comes from importing completiond.config from this checkout, or, with
--from-cli, from `completiond settings` (the installed server).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

EDITORS = Path(__file__).resolve().parent
ROOT = EDITORS.parent
PACKAGE_JSON = EDITORS / "vscode" / "package.json"
NVIM_CONFIG = EDITORS / "nvim" / "lua" / "completiond" / "config.lua"
NVIM_DOC = EDITORS / "nvim" / "doc" / "completiond.txt"
READMES = [EDITORS / "README.md"]
VSCODE_README = EDITORS / "vscode" / "README.md"

PREFIX = "completiond."
LUA_BEGIN = "-- BEGIN GENERATED SETTINGS (editors/sync_settings.py; do not edit by hand)"
LUA_END = "-- END GENERATED SETTINGS"
DOC_BEGIN = "<!-- BEGIN GENERATED SETTINGS -->"  # markdown
DOC_END = "<!-- END GENERATED SETTINGS -->"
VIMDOC_BEGIN = "BEGIN GENERATED SETTINGS (editors/sync_settings.py)"
VIMDOC_END = "END GENERATED SETTINGS"


def load_schema(from_cli: bool = False) -> list[dict]:
    if from_cli:
        out = subprocess.run(["completiond", "settings"], check=True, capture_output=True, text=True).stdout
        return json.loads(out)
    sys.path.insert(0, str(ROOT))
    from completiond import config

    return config.schema()


# ---------------------------------------------------------------- VS Code


def vscode_property(item: dict) -> dict:
    prop: dict = {"type": item["type"], "default": item["default"], "description": item["description"]}
    if "enum" in item:
        prop["enum"] = list(item["enum"])
    if "minimum" in item:
        prop["minimum"] = item["minimum"]
    if "maximum" in item:
        prop["maximum"] = item["maximum"]
    # One daemon serves every workspace; "machine" settings (a team backend) come from user settings only.
    prop["scope"] = item.get("scope", "window")
    return prop


def vscode_properties(schema: list[dict], current: dict) -> dict:
    """Server settings in schema order, then the client-only ones already there."""
    props = {PREFIX + item["key"]: vscode_property(item) for item in schema}
    for key, value in current.items():
        if key.startswith(PREFIX) and "." in key[len(PREFIX):]:
            props[key] = value
    return props


def sync_package_json(schema: list[dict], check: bool) -> list[str]:
    text = PACKAGE_JSON.read_text()
    pkg = json.loads(text)
    contributes = pkg.setdefault("contributes", {})
    configuration = contributes.setdefault("configuration", {"title": "completiond", "properties": {}})
    current = configuration.get("properties", {})
    wanted = vscode_properties(schema, current)
    problems = []
    for key in sorted(set(current) | set(wanted)):
        if key not in current:
            problems.append(f"package.json: missing setting {key}")
        elif key not in wanted:
            problems.append(f"package.json: {key} is not a server setting (client-only settings need a dot after '{PREFIX}')")
        elif not _same(current[key], wanted[key]):
            problems.append(f"package.json: {key} differs: has {json.dumps(current[key])}, schema says {json.dumps(wanted[key])}")
    if list(current) != list(wanted) and not problems:
        problems.append("package.json: settings are not in schema order")
    if problems and not check:
        configuration["properties"] = wanted
        PACKAGE_JSON.write_text(json.dumps(pkg, indent=2, ensure_ascii=False) + "\n")
    return problems


def _same(a, b) -> bool:
    """JSON equality where 1 == 1.0 (npm rewrites package.json through JavaScript)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return a == b


# ---------------------------------------------------------------- Lua


def lua_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return f"{value:.1f}"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a valid Lua string literal for plain text
    raise TypeError(f"no Lua literal for {value!r}")


def _number(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def constraint_text(item: dict) -> str:
    parts = []
    if "enum" in item:
        parts.append("one of " + ", ".join(f'"{v}"' for v in item["enum"]))
    if "minimum" in item or "maximum" in item:
        lo = _number(item["minimum"]) if "minimum" in item else ""
        hi = _number(item["maximum"]) if "maximum" in item else ""
        parts.append(f"range {lo}..{hi}")
    return "; ".join(parts)


def lua_block(schema: list[dict], indent: str) -> list[str]:
    lines = []
    for item in schema:
        extra = constraint_text(item)
        lines.append(f"{indent}-- {item['description']}" + (f" ({item['type']}; {extra})" if extra else f" ({item['type']})"))
        lines.append(f"{indent}{item['key']} = {lua_value(item['default'])},")
    return lines


def replace_between(text: str, begin: str, end: str, make, path: Path) -> tuple[str, bool]:
    lines = text.split("\n")
    try:
        b = next(i for i, line in enumerate(lines) if begin in line)
        e = next(i for i, line in enumerate(lines) if end in line and i > b)
    except StopIteration:
        raise SystemExit(f"{path}: markers {begin!r} / {end!r} not found")
    indent = lines[b][: len(lines[b]) - len(lines[b].lstrip())]
    new = lines[: b + 1] + make(indent) + lines[e:]
    return "\n".join(new), new != lines


def sync_lua(schema: list[dict], check: bool) -> list[str]:
    text = NVIM_CONFIG.read_text()
    new, changed = replace_between(text, LUA_BEGIN, LUA_END, lambda ind: lua_block(schema, ind), NVIM_CONFIG)
    if changed and not check:
        NVIM_CONFIG.write_text(new)
    return [f"{NVIM_CONFIG.relative_to(ROOT)}: the settings defaults differ from the server schema"] if changed else []


# ---------------------------------------------------------------- docs


def markdown_table(schema: list[dict]) -> list[str]:
    """The README settings table: completiond.config.markdown_table() (the top-level README's), when there is one."""
    try:
        sys.path.insert(0, str(ROOT))
        from completiond import config

        if hasattr(config, "markdown_table") and config.schema() == schema:
            return config.markdown_table().rstrip("\n").split("\n")
    except ImportError:
        pass
    lines = ["| Setting | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for item in schema:
        desc = item["description"]
        extra = constraint_text(item)
        if extra:
            desc += f" ({extra})"
        default = json.dumps(item["default"])
        desc = desc.replace("|", "\\|")
        lines.append(f"| `{item['key']}` | {item['type']} | `{default}` | {desc} |")
    return lines


def sync_markdown(schema: list[dict], check: bool) -> list[str]:
    problems = []
    for path in READMES:
        text = path.read_text()
        new, changed = replace_between(text, DOC_BEGIN, DOC_END, lambda ind: markdown_table(schema), path)
        if changed:
            problems.append(f"{path.relative_to(ROOT)}: the settings table differs from the server schema")
            if not check:
                path.write_text(new)
    return problems


def vimdoc_section(schema: list[dict]) -> list[str]:
    import textwrap

    lines = []
    for item in schema:
        tag = f"*completiond-settings.{item['key']}*"
        name = f"settings.{item['key']}"
        lines.append(name + " " * max(1, 78 - len(name) - len(tag)) + tag)
        head = f"{item['type']}, default: {lua_value(item['default'])}"
        extra = constraint_text(item)
        if extra:
            head += f"; {extra}"
        lines.append("    " + head)
        for wrapped in textwrap.wrap(item["description"], 74):
            lines.append("    " + wrapped)
        lines.append("")
    return lines


def sync_vimdoc(schema: list[dict], check: bool) -> list[str]:
    text = NVIM_DOC.read_text()
    new, changed = replace_between(text, VIMDOC_BEGIN, VIMDOC_END, lambda ind: vimdoc_section(schema), NVIM_DOC)
    if changed and not check:
        NVIM_DOC.write_text(new)
    return [f"{NVIM_DOC.relative_to(ROOT)}: the settings reference differs from the server schema"] if changed else []


def vscode_readme(editors_readme: str) -> str:
    def section(title: str) -> str:
        i = editors_readme.index(title)
        j = editors_readme.find("\n## ", i + 3)
        return editors_readme[i:j if j != -1 else None].rstrip() + "\n"

    return ("# completiond for VS Code\n\n"
            "Inline (ghost text) code completions from a local model: the extension starts `completiond lsp`\n"
            "and shows its `textDocument/inlineCompletion` suggestions. Nothing leaves your machine.\n\n"
            + section("## 1. Install the server").replace("## 1. Install the server", "## Install the server") + "\n"
            + section("## 2. VS Code").replace("## 2. VS Code", "## Use") + "\n"
            + section("## Settings"))


def sync_vscode_readme(check: bool) -> list[str]:
    wanted = vscode_readme((EDITORS / "README.md").read_text())
    if VSCODE_README.exists() and VSCODE_README.read_text() == wanted:
        return []
    if not check:
        VSCODE_README.write_text(wanted)
    return [f"{VSCODE_README.relative_to(ROOT)}: differs from the sections of editors/README.md"]


def sync(check: bool = False, from_cli: bool = False) -> list[str]:
    schema = load_schema(from_cli)
    problems = []
    problems += sync_package_json(schema, check)
    problems += sync_lua(schema, check)
    problems += sync_vimdoc(schema, check)
    problems += sync_markdown(schema, check)
    if not (check and problems):
        problems += sync_vscode_readme(check)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a generated part is out of date")
    parser.add_argument("--from-cli", action="store_true", help="read the schema from `completiond settings`")
    args = parser.parse_args(argv)
    problems = sync(check=args.check, from_cli=args.from_cli)
    for p in problems:
        print(p)
    if args.check and problems:
        print("run: python3 editors/sync_settings.py", file=sys.stderr)
        return 1
    if not args.check:
        print("updated" if problems else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
