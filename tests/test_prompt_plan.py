"""The prompt pipeline lays out the same prompts it did before issue 46's refactor, token for token.

tests/data/prompt_golden.json was written by the prompt builder of commit 18f20f7 (before the neutral
prompt plan and its token and text encoders existed): for every FIM family (tokenizers trained here on
a few lines, as test_fim does) and the bundled model's tokenizer, at a set of cursor positions, with and
without context files, the prompt ids, the window edges and the healing; and the text prompt a team
server got for each family's layout. The `team/` cases (what a team server is sent once its windows
came from the same planner) were added when that path moved onto it. Any change to what a model sees
fails here, case by case.

Rewrite the record only for a change meant to alter prompts: `python -m tests.test_prompt_plan --write`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from completiond.models.fim import TEMPLATE_NAMES, make_template

from completiond.completion.healing import TokenHealer
from completiond.completion.prompt import PromptBuilder, PromptOptions
from completiond.config import Config
from completiond.engine.model_info import ModelInfo

GOLDEN = Path(__file__).resolve().parent / "data" / "prompt_golden.json"
BUNDLED = Path(__file__).resolve().parent.parent / "models" / "completiond-py-mini"

DOC = "".join(
    f"def f{i}(a, b):\n    '''Add {i}: <|fim_middle|> stays text.'''\n"
    f"    if a > {i}:\n        return [a + b * {i}, {{'k': {i}}}]\n    return b\n\n" for i in range(40)
) + "x" * 2100 + "\nclass P:\n    y = 1\n"
CONTEXT = [("pkg/util.py", "def helper(x):\n    return x * 2\n"), ("pkg/const.py", "LIMIT = 10\nNAME = 'p'")]


def cursors(doc: str) -> list[int]:
    """Document start and end, line starts and ends, mid-identifier, mid-indent, after an open bracket,
    deep in the document (the window slides) and inside an over-long line."""
    at = [0, len(doc), doc.index("def f3") + 5, doc.index("return [a + b * 7") + 9, doc.index("def f12"),
          doc.index("def f12") - 1, doc.index("    return b", doc.index("def f20")) + 2, doc.index("x" * 2100) + 150,
          doc.index("def f39") + 3, doc.index("'''Add 25") + 8, doc.index("class P") + 7]
    return sorted(set(at))


def _prompt_record(builder: PromptBuilder, doc: str, cursor: int, context) -> dict[str, Any]:
    p = builder.build(doc, cursor, context=context, path="pkg/main.py", language="python")
    if p.skip_reason is not None:
        return {"skip": p.skip_reason}
    heal = p.healing
    return {"ids": p.ids, "prefix": len(p.prefix_ids), "suffix": len(p.suffix_ids), "context": len(p.context_ids),
            "prefix_start": p.prefix_start, "prefix_line": p.prefix_line, "suffix_end": p.suffix_end,
            "cursor_line_tokens": p.cursor_line_tokens,
            "healing": None if heal is None else [heal.removed, heal.n_tokens]}


def _family_tokenizers(tmp_path_factory) -> dict[str, Any]:
    from tests.test_fim import FAMILIES, make_tokenizer

    return {name: make_tokenizer(tmp_path_factory.mktemp("plan-" + name.replace(".", "")), **spec)
            for name, spec in FAMILIES.items()}


def token_cases(toks: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    options = PromptOptions(prefix_tokens=160, suffix_tokens=48, context_tokens=40, chunk_lines=8)
    for name, tok in toks.items():
        orders = ["spm", "psm"] if name in ("completiond", "starcoder", "codellama") else ["auto"]
        for order in orders:
            for heal in (False, True):
                healer = TokenHealer.for_tokenizer(tok) if heal else None
                builder = PromptBuilder(make_template(tok, name, order=order), options, healer)
                for with_context in (False, True):
                    for cur in cursors(DOC):
                        key = f"{name}/{order}/heal={heal}/context={with_context}/{cur}"
                        out[key] = _prompt_record(builder, DOC, cur, CONTEXT if with_context else ())
    return out


def bundled_cases() -> dict[str, Any]:
    """The bundled model's tokenizer with the default settings and the model's training context: what eval sees."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED)
    out: dict[str, Any] = {}
    big = DOC * 6
    for capped in (None, 512):
        builder = PromptBuilder.for_model(tok, Config(), max_context=capped, info=ModelInfo.read(BUNDLED))
        for with_context in (False, True):
            for cur in cursors(big) + [len(big) // 2, len(big) // 3]:
                out[f"bundled/cap={capped}/context={with_context}/{cur}"] = _prompt_record(
                    builder, big, cur, CONTEXT if with_context else ())
    return out


def text_cases() -> dict[str, Any]:
    """The text prompt each family's layout gives a team server, with and without context files."""
    from completiond.models.fim import text_layout

    from completiond.completion.text_prompt import render

    out: dict[str, Any] = {}
    for name in TEMPLATE_NAMES:
        for ctx in ((), CONTEXT):
            for current in (None, "main.py"):
                out[f"text/{name}/context={bool(ctx)}/{current}"] = render(
                    text_layout(name), "def add(a, b):\n    ret", "\nprint(add(1, 2))\n", ctx, current, "python")
    return out


def team_cases() -> dict[str, Any]:
    """What a team server is sent: the planner's windows rendered by the text encoder, per family and API
    (recorded when the team path moved onto the planner, issue 46)."""
    from completiond.completion.plan import Planner, PromptOptions
    from completiond.completion.text_prompt import TextEncoder

    out: dict[str, Any] = {}
    options = PromptOptions(prefix_tokens=160, suffix_tokens=48, context_tokens=40, chunk_lines=8)
    picked = cursors(DOC)[::2]
    for name in TEMPLATE_NAMES:
        for infill in (False, True):
            encoder = TextEncoder.for_template(name, infill)
            planner = Planner(encoder, options)
            for cur in picked:
                plan = planner.plan(DOC, cur, CONTEXT, "/w/pkg/main.py", "python", heal=False)
                if plan.skip_reason is not None:
                    out[f"team/{name}/infill={infill}/{cur}"] = {"skip": plan.skip_reason}
                    continue
                sent = encoder.lay_out(plan, DOC, "python")
                out[f"team/{name}/infill={infill}/{cur}"] = {"prompt": sent.prompt, "prefix": sent.prefix,
                                                             "suffix": sent.suffix, "files": sent.files}
    return out


def record(toks: dict[str, Any]) -> dict[str, Any]:
    return {**token_cases(toks), **bundled_cases(), **text_cases(), **team_cases()}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return _family_tokenizers(tmp_path_factory)


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def _compare(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want), f"cases differ: {sorted(set(got) ^ set(want))[:10]}"
    wrong = [k for k in want if got[k] != want[k]]
    assert not wrong, f"{len(wrong)} of {len(want)} prompts changed, first {wrong[0]}:\n" \
                      f"was {want[wrong[0]]}\nnow {got[wrong[0]]}"


def test_family_prompts_unchanged(toks, golden):
    _compare(token_cases(toks), {k: v for k, v in golden.items() if k.split("/")[0] in toks})


def test_bundled_prompts_unchanged(golden):
    _compare(bundled_cases(), {k: v for k, v in golden.items() if k.startswith("bundled/")})


def test_text_layouts_unchanged(golden):
    _compare(text_cases(), {k: v for k, v in golden.items() if k.startswith("text/")})


def test_team_prompts_unchanged(golden):
    _compare(json.loads(json.dumps(team_cases())), {k: v for k, v in golden.items() if k.startswith("team/")})


def test_the_record_covers_what_matters(golden):
    """Windows slide, heal, skip and carry context somewhere in the record: a record of trivial prompts
    would pass any refactor."""
    prompts = [v for k, v in golden.items() if isinstance(v, dict) and not k.startswith("team/")]
    assert any("skip" in v for v in prompts)
    assert len({v["prefix_start"] for v in prompts if "ids" in v}) > 3
    assert any(v["healing"] for v in prompts if "ids" in v)
    assert any(v["context"] for v in prompts if "ids" in v)


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    class _Factory:
        def __init__(self, root: str):
            self.root, self.n = Path(root), 0

        def mktemp(self, name: str) -> Path:
            self.n += 1
            path = self.root / f"{name}{self.n}"
            path.mkdir()
            return path

    with tempfile.TemporaryDirectory() as tmp:
        data = record(_family_tokenizers(_Factory(tmp)))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}\n",
                      encoding="utf-8")
    print(f"wrote {len(data)} cases to {GOLDEN}")
