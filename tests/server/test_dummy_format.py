"""A config with `loadFormat: dummy` and a folder holding only config.json (the operator's CPU pods): the engine
brings the built-in tokenizer and chat template, so text and chat requests work."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx

from tests.server.conftest import running_server


def test_dummy_weights_without_tokenizer_serve_text_and_chat(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "only-config"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    with running_server(folder, extensions={"loadFormat": "dummy"}) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = httpx.post(s.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
