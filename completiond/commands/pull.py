"""`completiond pull MODEL`: download a hub model (safetensors weights and tokenizer only) into the local cache.

MODEL is a hub id (`org/name`, optionally `@revision`) or a short name from `--list`. A model
already in the cache is not downloaded again, and nothing is asked of the network then.
Torch-free: it runs where only the download happens (a connected machine whose cache is then
copied to an offline one).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="hub id (org/name[@revision]) or a short name from --list")
    p.add_argument("--list", action="store_true", help="the curated short names, with size, memory and speed class")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="also accept a repository whose config names its own Python code (and fetch that code)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


class TerminalBar:
    """Bytes downloaded, as a tqdm bar on stderr (created on the first report, so a cached model shows none)."""

    def __init__(self, label: str):
        self.label = label
        self.bar: Any = None  # a tqdm bar, made on the first call

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=self.label,
                file=sys.stderr,
                dynamic_ncols=True,
            )
        if total != self.bar.total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


LIST_WIDTH = 100  # `pull --list` fits a 100-column terminal (the README keeps the full Markdown table)


def catalog_text() -> str:
    """`pull --list`: the models the engine can load, one aligned row each and a line of details under
    it; the catalog's others after, with the reason they cannot load yet."""
    from completiond.engine import hub

    head = ("short name", "params", "GB bf16 / fp32", "CPU (bf16 / int8)", "GPU (bf16)")
    rows, details, unsupported = [], [], []
    for e in hub.CATALOG:
        if not e.supported:
            unsupported.append(f"  {e.name} ({e.repo}): the engine has no `{e.family}` layout yet")
            continue
        bf16, fp32 = e.params_b * 2e9, e.params_b * 4e9
        rows.append(
            (
                e.name,
                f"{e.params_b:.2f} B",
                f"{bf16 / 1e9:.1f} / {fp32 / 1e9:.1f}",
                hub.cpu_speed(e),
                hub._speed_class(1000 * bf16 / hub.GPU_BANDWIDTH),
            )
        )
        extra = [f"FIM {e.fim}" if e.fim else "no FIM", f"early exits: {e.early_exit}"]
        if e.gated:
            extra.append("gated: accept its licence on the hub, then log in")
        details.append(f"    {e.repo}; " + "; ".join(extra))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells) -> str:
        # Names and speeds read left to right, sizes line up on the right.
        return "  ".join(
            c.rjust(w) if i in (1, 2) else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    out = [line(head)]
    for row, detail in zip(rows, details):
        out += [line(row), detail]
    if unsupported:
        out += ["", "In the catalog but not loadable yet:", *unsupported]
    out += [
        "",
        "Speeds are estimates (weight bytes / memory bandwidth per token), before speculation.",
        "Pull one: completiond pull NAME (or use NAME as the model setting: it is pulled on first use)",
    ]
    return "\n".join(_fit(text, LIST_WIDTH) for text in out) + "\n"


def _fit(text: str, width: int) -> str:
    """One line wrapped under `width` (continuations indented like a details line)."""
    import textwrap

    if len(text) <= width:
        return text
    indent = " " * (len(text) - len(text.lstrip()))
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent + "  ", break_on_hyphens=False))


def run(args: argparse.Namespace) -> int:
    from completiond.engine import hub, memory

    if args.list:
        print(catalog_text(), end="")
        return 0
    if not args.model:
        print(
            "completiond pull: give a hub id (org/name) or a short name; `completiond pull --list` shows them",
            file=sys.stderr,
        )
        return 2
    bar = TerminalBar(args.model)
    try:
        pulled = hub.pull(args.model, trust_remote_code=args.trust_remote_code, progress=bar)
    except hub.HubError as exc:
        bar.close()
        print(f"completiond pull: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        bar.close()
        print("completiond pull: interrupted; pull again to resume (finished files are kept)", file=sys.stderr)
        return 130
    bar.close()
    try:
        params = memory.parameter_count(pulled.path)
    except (OSError, ValueError, KeyError) as exc:
        print(f"completiond pull: cannot read the weights' headers in {pulled.path}: {exc}", file=sys.stderr)
        return 1
    result = {
        "model": pulled.name,
        "repo": pulled.repo,
        "revision": pulled.revision,
        "commit": pulled.commit,
        "path": str(pulled.path),
        "downloaded_bytes": pulled.downloaded,
        "cached": pulled.downloaded == 0,
        "parameters": params,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if pulled.downloaded == 0:
        print(f"{pulled.name} is already in the cache ({pulled.path}); nothing downloaded")
    else:
        print(f"{pulled.name}: downloaded {pulled.downloaded / 1e6:.1f} MB to {pulled.path}")
    print(
        f"{params / 1e9:.2f} B parameters: about {params * 2 / 1e9:.1f} GB in bfloat16 (GPU), "
        f"{params * 4 / 1e9:.1f} GB in float32 (CPU)"
    )
    # Torch-free, so only the CPU can be asked; a GPU's fit is checked when the daemon loads the model.
    from completiond.engine.memory import GIB, available_bytes

    free = available_bytes("cpu")
    if free is not None and params * 4 > free:
        print(
            f"note: in float32 (the CPU default) it needs {params * 4 / GIB:.1f} GiB and this machine has "
            f"{free / GIB:.1f} GiB available: load it on a GPU, or with dtype bfloat16 ({params * 2 / GIB:.1f} GiB)"
        )
    setting = args.model if "/" in args.model or "@" in args.model else pulled.repo
    print(f'use it: model = "{setting}" in ~/.config/completiond/config.toml, or completiond.model in the editor')
    return 0
