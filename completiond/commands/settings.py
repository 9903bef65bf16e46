"""`completiond settings [--toml]`: every setting, as the JSON schema or as a commented config.toml."""

from __future__ import annotations

import argparse
import json

from completiond import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--toml", action="store_true", help="print a config.toml with every default instead")


def run(args: argparse.Namespace) -> int:
    if args.toml:
        for item in config.schema():
            value = json.dumps(item["default"])
            print(f"# {item['description']}\n{item['key']} = {value}\n")
    else:
        print(json.dumps(config.schema(), indent=2))
    return 0
