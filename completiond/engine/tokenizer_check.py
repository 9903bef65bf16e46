"""The check behind tokenizer.py's verdicts, run once per tokenizer in a child process
(`python -m completiond.engine.tokenizer_check DIR`): it loads AutoTokenizer's tokenizer and the light one of
the same files and compares them (`differences`): vocabulary, every id's token and text, and encode/decode of
a probe set (code, whitespace, Unicode, every added token in text). The verdict goes to the user's cache,
where tokenizer.py reads it; the parent never imports transformers for it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Sequence

from completiond.engine.hub_cache import read_json
from completiond.engine.tokenizer import ID_FIELDS, LightTokenizer, auto_tokenizer, verdict_key, write_verdict


def probe_texts(tokens: Sequence[str]) -> list[str]:
    """Text that exercises a code tokenizer's pipeline: code, whitespace runs, Unicode, digits, and each
    added token alone and inside text; plus seeded random strings over the same characters."""
    texts = [
        "def f(x):\n    return x + 1\n",
        "class A:\n\tdef __init__(self):\n\t\tpass\n",
        "for (int i = 0; i < n; ++i) {\n        sum += a[i];\n}\n",
        'fn main() { println!("{}", 1_000); }',
        "const x = `héllo ${name}`;  // ok\r\n",
        "SELECT * FROM t WHERE a <> 'b';",
        '<div class="x">&amp;</div>',
        "    ",
        "\t\t",
        "\n\n\n",
        "\r\n\r\n  ",
        " " * 17,
        "\n" + " " * 12 + "x",
        "a  b   c    d",
        "  leading",
        "trailing  ",
        "",
        " ",
        "日本語のテキストと English",
        "emoji 🙂👍🏽 and e\u0301 and \u00a0nbsp \u200dzwj",
        "مرحبا",
        "Ωμέγα",
        "0123456789 3.14159 -2e10 0xFF 1_000_000",
        "x=1;y=2\nz=x+y",
        "'''doc'''\n\"\"\"doc\"\"\"",
        "don't I'm it's we've you're , . ? !",
        "hello . world ? yes ! no , maybe",
        "#!/usr/bin/env python3\n# -*- coding: utf-8 -*-",
    ]
    for t in tokens:
        texts += [t, f"a{t}b", f" {t} ", f"x = 1\n{t}\n    y"]
    import string
    import textwrap

    for module in (json, textwrap, string):  # real code, present wherever Python is
        path = Path(module.__file__ or "")
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace")[:20000])
    pool = "abcxyzABC_019 \t\n\r(){}[]<>:;,.'\"#@$%^&*+-=/\\|~`?!éßü日本🙂" + "".join(tokens[:8])
    rng = random.Random(0)
    texts += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 80))) for _ in range(300)]
    return texts


def differences(ref: Any, light: LightTokenizer, limit: int = 5) -> list[str]:
    """Where light acts otherwise than ref (a transformers tokenizer), at most limit of them; [] when nowhere."""
    found: list[str] = []

    def differ(what: str, a: Any, b: Any) -> bool:
        if a != b and len(found) < limit:
            found.append(f"{what}: transformers {str(a)[:120]!r}, tokenizer.json {str(b)[:120]!r}")
        return a != b

    if differ("size", len(ref), len(light)):
        return found
    rv, lv = ref.get_vocab(), light.get_vocab()
    if rv != lv:
        token = min(t for t in set(rv) | set(lv) if rv.get(t) != lv.get(t))
        differ(f"id of {token!r} in the vocabulary", rv.get(token), lv.get(token))
        return found
    ids = list(range(len(ref)))
    differ("tokens of ids", ref.convert_ids_to_tokens(ids), light.convert_ids_to_tokens(ids))
    for i in ids:
        if differ(f"decode([{i}])", ref.decode([i]), light.decode([i])):
            break
    for k in ID_FIELDS:
        differ(k, getattr(ref, k, None), getattr(light, k))
    differ("added tokens", _added(ref), _added(light))
    differ("decoder", _decoder(ref), _decoder(light))
    added = sorted(getattr(ref, "added_tokens_encoder", {}) or {})
    for name in [*added, "<|completiond: no such token|>"]:
        differ(f"id of {name!r}", ref.convert_tokens_to_ids(name), light.convert_tokens_to_ids(name))
    for text in probe_texts(added):
        if differ(f"tokenizer({text[:40]!r})", list(ref(text)["input_ids"]), light(text).input_ids) | differ(
            f"encode({text[:40]!r})",
            ref.encode(text, add_special_tokens=False),
            light.encode(text, add_special_tokens=False),
        ):
            continue
        split = ref.encode(text, add_special_tokens=False, split_special_tokens=True)
        differ(
            f"encode({text[:40]!r}, split_special_tokens)",
            split,
            light.encode(text, add_special_tokens=False, split_special_tokens=True),
        )
        for skip in (False, True):
            differ(
                f"decode of {text[:40]!r}",
                ref.decode(split, skip_special_tokens=skip),
                light.decode(split, skip_special_tokens=skip),
            )
        if len(found) >= limit:
            break
    rng = random.Random(1)
    for _ in range(500):
        seq = [rng.randrange(len(ref)) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            differ(
                f"decode({seq})", ref.decode(seq, skip_special_tokens=skip), light.decode(seq, skip_special_tokens=skip)
            )
    return found


def _added(tok: Any) -> dict[int, tuple[str, bool]]:
    """{id: (content, special)} of the added tokens (what healing and the FIM templates read of them)."""
    return {int(i): (str(t), bool(getattr(t, "special", False))) for i, t in tok.added_tokens_decoder.items()}


def _decoder(tok: Any) -> Any:
    """The decoder section of the backend tokenizer's JSON (healing reads its kinds to map tokens to bytes)."""
    backend = getattr(tok, "backend_tokenizer", None)
    return None if backend is None else json.loads(backend.to_str()).get("decoder")


def check(directory: Path) -> dict:
    """Compare AutoTokenizer's tokenizer of directory with the light one and store the verdict."""
    raw = read_json(directory / "config.json")
    raw = raw if isinstance(raw, dict) else {}
    key = verdict_key(directory, raw)  # before the load: files changed meanwhile then miss the parent's key
    ref = auto_tokenizer(directory, raw, False)
    ids: dict[str, Any] = {k: getattr(ref, k, None) for k in ID_FIELDS}
    ids["all_special_ids"] = sorted(int(i) for i in ref.all_special_ids)
    # Whether decode cleans up spaces is the class's call (transformers 5 skips it for BPE models whatever
    # tokenizer_config.json says): both ways are compared, and the verdict keeps the one that matches.
    first: list[str] = []
    for clean_up in (False, True):
        found = differences(ref, LightTokenizer(directory / "tokenizer.json", ids, clean_up))
        if not found:
            break
        first = first or found
    else:
        clean_up, found = False, first
    record = {
        "key": key,
        "same": not found,
        "differences": found,
        "clean_up_tokenization_spaces": clean_up,
        "tokenizer_class": type(ref).__name__,
        **ids,
    }
    write_verdict(record)
    return record


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m completiond.engine.tokenizer_check MODEL_DIR", file=sys.stderr)
        return 2
    record = check(Path(argv[0]))
    print(json.dumps({k: record[k] for k in ("same", "differences", "tokenizer_class")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
