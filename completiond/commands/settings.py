"""`completiond settings`: every setting's value in effect and where it comes from; `--schema` prints
the JSON schema (the editors' generator reads it), `--toml` a commented config.toml with every default."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from completiond import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="config.toml to read (default: ~/.config/completiond/config.toml)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--json", action="store_true", help="the values in effect and their sources as JSON")
    what.add_argument("--schema", action="store_true", help="every setting's type, default and range as JSON")
    what.add_argument("--toml", action="store_true", help="print a config.toml with every default instead")


def _file_keys(path: Path) -> set[str]:
    """The setting names config.toml mentions (load_file reports what is wrong with it)."""
    try:
        data = config.tomllib.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, config.tomllib.TOMLDecodeError):
        return set()
    if isinstance(data.get("completiond"), dict):
        data = data["completiond"]
    return {k for k in data if isinstance(k, str)}


def effective(path: Path | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """[{key, value, source}] for every setting as the CLI and a freshly started daemon see them, and
    the problems found in config.toml. Editors layer their own settings on top, per editor."""
    path = path or config.config_file_path()
    cfg, errors = config.load_file(path)
    in_file = _file_keys(path)
    rows = []
    for s in config.SETTINGS:
        rejected = next((e for e in errors if f"completiond.{s.key}:" in e), None)
        if rejected is not None:
            source = f"default ({path} has an invalid value)"
        elif s.key in in_file:
            source = str(path)
        else:
            source = "default"
        rows.append({"key": s.key, "value": getattr(cfg, s.attr), "source": source})
    return rows, errors


def run(args: argparse.Namespace) -> int:
    if args.toml:
        for item in config.schema():
            value = json.dumps(item["default"])
            print(f"# {item['description']}\n{item['key']} = {value}\n")
        return 0
    if args.schema:
        print(json.dumps(config.schema(), indent=2))
        return 0
    rows, errors = effective(args.config)
    if args.json:
        print(json.dumps({"settings": rows, "errors": errors}, indent=2))
        return 0
    for error in errors:
        print(f"completiond: {error}", file=sys.stderr)
    names = [f"completiond.{r['key']}" for r in rows]
    values = [json.dumps(r["value"], ensure_ascii=False) for r in rows]
    wn, wv = max(map(len, names)), max(map(len, values))
    print(f"{'setting':<{wn}}  {'value':<{wv}}  source")
    for name, value, row in zip(names, values, rows):
        print(f"{name:<{wn}}  {value:<{wv}}  {row['source']}")
    print("\nEditors apply their own completiond settings on top of these, for their requests only.")
    return 0
