"""Model and language fit (issue 47): a model's record says which languages it serves, and a document in
another language gets no suggestion and one notice saying how to get a model that does (the bundled
Python model completed Go with `fmt.__name__` and Rust with `for x in zip(f, f):` before)."""

from __future__ import annotations

import asyncio
import json

import pytest
from lsprotocol import types
from test_lsp import runtime, settings_for, start  # noqa: F401  (fixtures)
from test_scheduler import FakeEngine, local

from completiond import config as config_mod
from completiond.engine import hub
from completiond.engine.model_info import ModelInfo
from completiond.serving.language_fit import RECOMMENDED_FOR_LANGUAGES, document_language, language_unserved
from completiond.serving.service import Service


def test_the_records_say_which_languages_a_model_serves(tmp_path):
    from completiond.models import default_model_dir

    assert ModelInfo.read(default_model_dir()).languages == ("python",)
    (tmp_path / "completiond.json").write_text(json.dumps({"languages": ["Python", "Go"]}))
    assert ModelInfo.read(tmp_path).languages == ("python", "go")
    (tmp_path / "completiond.json").write_text(json.dumps({"languages": "python"}))
    assert ModelInfo.read(tmp_path).languages is None  # malformed: not said, so not limited
    assert all(e.languages for e in hub.CATALOG)
    assert "*" in hub.CATALOG_BY_NAME[RECOMMENDED_FOR_LANGUAGES].languages


def test_document_language_from_its_id_or_its_extension():
    assert document_language("python", None) == "python"
    assert document_language("typescriptreact", "/x/a.tsx") == "typescript"
    assert document_language("", "/x/main.go") == "go"
    assert document_language(None, "/x/README") is None
    assert document_language(None, None) is None


class _PythonOnly(FakeEngine):
    info = ModelInfo(languages=("python",))


def test_an_unserved_language_is_refused_with_how_to_get_a_model():
    engine = _PythonOnly()
    assert language_unserved(engine, "python", "/x/a.py") == ""
    assert language_unserved(engine, None, "/x/notes") == ""  # not known: asked
    said = language_unserved(engine, "go", "/x/main.go")
    assert f"{engine.name} serves Python only" in said and "Go documents" in said
    assert f"completiond pull {RECOMMENDED_FOR_LANGUAGES}" in said
    assert language_unserved(FakeEngine(), "go", "/x/main.go") == ""  # a model that does not say: any language


async def test_the_service_answers_nothing_for_an_unserved_language(tmp_path):
    engine = _PythonOnly(continuation="1\n")
    cfg, _ = config_mod.merge(config_mod.Config(), {"tokenHealing": False})
    service = Service(cfg, loader=local(engine))
    service.start_loading()
    for _ in range(100):
        if service.state == "ready":
            break
        await asyncio.sleep(0.02)
    go, py = (tmp_path / "main.go").as_uri(), (tmp_path / "a.py").as_uri()
    service.open("c", go, 1, "package main\n\nfunc main() {\n\tx := ", "go")
    service.open("c", py, 1, "x = ", "python")
    result = await service.complete("c", 1, go, 1, len("package main\n\nfunc main() {\n\tx := "))
    assert result["suggestions"] == [] and result["finish_reason"] == "language"
    assert "Go documents" in result["warnings"][0]
    assert not engine.calls  # the model was not asked
    result = await service.complete("c", 2, py, 1, 4)
    assert result["suggestions"] and engine.calls
    service.shutdown()


@pytest.mark.slow
async def test_a_go_document_with_the_bundled_model_gets_one_notice(start, tmp_path):
    from completiond.models import default_model_dir

    s = await start(settings_for(default_model_dir(), maxTokens=8))
    for name, text in (("main.go", "package main\n\nfunc main() {\n\tx := "), ("util.go", "package util\n\nvar y = ")):
        uri = (tmp_path / name).as_uri()
        s.text = text
        s.client.text_document_did_open(types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id="go", version=1, text=text)))
        for _ in range(2):
            result = await asyncio.wait_for(s.client.text_document_inline_completion_async(s.inline_params(uri)), 120)
            assert not result.items
    await asyncio.sleep(0.3)
    told = [m for m in s.client.messages if "Go documents" in m.message]
    assert len(told) == 1, s.client.messages
    assert "completiond pull" in told[0].message
    # Python still completes.
    await s.open()
    await s.inline()
    assert (await s.stats())["errors"] == 0
