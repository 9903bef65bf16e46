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
VIMDOC_RESTRICTED_BEGIN = "BEGIN GENERATED RESTRICTED SETTINGS (editors/sync_settings.py)"
VIMDOC_RESTRICTED_END = "END GENERATED RESTRICTED SETTINGS"


def load_schema(from_cli: bool = False) -> list[dict]:
    if from_cli:
        out = subprocess.run(["completiond", "settings", "--schema"], check=True, capture_output=True, text=True).stdout
        return json.loads(out)
    sys.path.insert(0, str(ROOT))
    from completiond import config

    return config.schema()


# ---------------------------------------------------------------- VS Code


# Client-only settings (`completiond.<part>.<key>`) live in VS Code's package.json alone: the section
# each is listed in (the server's groups come from completiond/config.py GROUPS).
CLIENT_GROUP = ("client", "Language server (this editor)")
CLIENT_SETTING_GROUPS = {"completiond.editor.disabledLanguages": "general"}


def vscode_property(item: dict) -> dict:
    prop: dict = {"type": item["type"], "default": item["default"], "description": item["description"]}
    if "enum" in item:
        prop["enum"] = list(item["enum"])
    if "enumDescriptions" in item:
        prop["enumDescriptions"] = list(item["enumDescriptions"])
    if "minimum" in item:
        prop["minimum"] = item["minimum"]
    if "maximum" in item:
        prop["maximum"] = item["maximum"]
    # One daemon serves every workspace; "machine" settings (a team backend) come from user settings only.
    prop["scope"] = item.get("scope", "window")
    if "order" in item:
        prop["order"] = item["order"]
    return prop


def load_groups(schema: list[dict], from_cli: bool = False) -> list[tuple[str, str]]:
    """(key, title) of the server's setting groups, in display order."""
    if from_cli:  # an installed server's schema names each setting's group; the titles live in config.GROUPS
        keys = list(dict.fromkeys(item.get("group", "advanced") for item in schema))
        return [(key, key.capitalize()) for key in keys]
    sys.path.insert(0, str(ROOT))
    from completiond import config

    return [(g["key"], g["title"]) for g in config.groups()]


def flat_properties(configuration) -> dict:
    """contributes.configuration's properties, whether it is one object or a list of sections."""
    sections = configuration if isinstance(configuration, list) else [configuration]
    props: dict = {}
    for section in sections:
        props.update(section.get("properties", {}))
    return props


def vscode_configuration(schema: list[dict], groups: list[tuple[str, str]], current: dict) -> list[dict]:
    """One titled section per group (basic settings first, advanced decoding last), each in schema order;
    the client-only settings already there keep their values, in their own section. The first section is
    titled with the extension's name, so VS Code lists its settings directly under the extension."""
    order = [key for key, _ in groups]
    titles = dict(groups)
    where = order.index("advanced") if "advanced" in order else len(order)
    order.insert(where, CLIENT_GROUP[0])
    titles[CLIENT_GROUP[0]] = CLIENT_GROUP[1]
    props: dict = {key: {} for key in order}
    for item in schema:
        props[item.get("group", "advanced")][PREFIX + item["key"]] = vscode_property(item)
    for key, value in current.items():
        if key.startswith(PREFIX) and "." in key[len(PREFIX):]:
            group = props[CLIENT_SETTING_GROUPS.get(key, CLIENT_GROUP[0])]
            group[key] = {**value, "order": len(group) + 1}
    return [{"id": f"completiond.{key}", "title": "completiond" if i == 0 else titles[key],
             "order": i + 1, "properties": props[key]}
            for i, key in enumerate(order) if props[key]]


def restricted_configurations(schema: list[dict], current: list[str]) -> list[str]:
    """What VS Code's Restricted Mode reads from user settings only: every setting that names a model, a
    path, an endpoint or code to run (schema `restricted`) and that a workspace could set (not
    machine-scoped), after the client-only ones already listed (the server command)."""
    client = [key for key in current if key.startswith(PREFIX) and "." in key[len(PREFIX):]]
    server = [PREFIX + item["key"] for item in schema if item.get("restricted") and item.get("scope", "window") != "machine"]
    return client + server


def sync_package_json(schema: list[dict], check: bool, groups: list[tuple[str, str]]) -> list[str]:
    text = PACKAGE_JSON.read_text()
    pkg = json.loads(text)
    contributes = pkg.setdefault("contributes", {})
    configuration = contributes.get("configuration", {"title": "completiond", "properties": {}})
    current = flat_properties(configuration)
    wanted_sections = vscode_configuration(schema, groups, current)
    wanted = flat_properties(wanted_sections)
    problems = []
    for key in sorted(set(current) | set(wanted)):
        if key not in current:
            problems.append(f"package.json: missing setting {key}")
        elif key not in wanted:
            problems.append(f"package.json: {key} is not a server setting (client-only settings need a dot after '{PREFIX}')")
        elif not _same(current[key], wanted[key]):
            problems.append(f"package.json: {key} differs: has {json.dumps(current[key])}, schema says {json.dumps(wanted[key])}")
    if not problems and not _same(configuration, wanted_sections):
        problems.append("package.json: the settings' sections or their order differ from the server schema's groups")
    trust = pkg.setdefault("capabilities", {}).setdefault("untrustedWorkspaces", {"supported": "limited"})
    restricted = restricted_configurations(schema, trust.get("restrictedConfigurations", []))
    if trust.get("restrictedConfigurations") != restricted:
        problems.append("package.json: capabilities.untrustedWorkspaces.restrictedConfigurations differs from the "
                        f"schema's restricted settings: wants {restricted}")
    if problems and not check:
        contributes["configuration"] = wanted_sections
        trust["restrictedConfigurations"] = restricted
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
        for value, text in zip(item.get("enum", []), item.get("enumDescriptions", [])):
            for i, wrapped in enumerate(textwrap.wrap(f'"{value}": {text}', 72)):
                lines.append(("    - " if i == 0 else "      ") + wrapped)
        if item.get("restricted"):
            lines.append("    Restricted: set it in your own config only, see |completiond-trust|.")
        lines.append("")
    return lines


def vimdoc_restricted(schema: list[dict]) -> list[str]:
    """The settings that name a model, a path, an endpoint or code to run (|completiond-trust|)."""
    import textwrap

    names = ", ".join(f"settings.{item['key']}" for item in schema if item.get("restricted")) + "."
    return ["    " + line for line in textwrap.wrap(names, 74)]


def sync_vimdoc(schema: list[dict], check: bool) -> list[str]:
    text = NVIM_DOC.read_text()
    text, changed_restricted = replace_between(text, VIMDOC_RESTRICTED_BEGIN, VIMDOC_RESTRICTED_END,
                                               lambda ind: vimdoc_restricted(schema), NVIM_DOC)
    new, changed = replace_between(text, VIMDOC_BEGIN, VIMDOC_END, lambda ind: vimdoc_section(schema), NVIM_DOC)
    changed = changed or changed_restricted
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
    problems += sync_package_json(schema, check, load_groups(schema, from_cli))
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
