"""Bodies no tokenizer or JSON parser can take get a 400 in OpenAI's format naming what is wrong, never a 500 or
FastAPI's bare `{"detail": ...}`: a lone surrogate in any text field, bytes that are not UTF-8, JSON nested past the
parser's depth."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import RunningServer


def _post(server: RunningServer, path: str, content: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}', "stop.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
     "messages.0.content"),
    ("/generate", b'{"inputs": "\\ud800"}', "inputs"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server: RunningServer, path: str, body: bytes,
                                                    param: str) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]


def test_paired_surrogate_escapes_are_text(server: RunningServer) -> None:
    response = _post(server, "/v1/completions", b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert response.status_code == 200, response.text


def test_invalid_utf8_is_a_400_naming_the_byte(server: RunningServer) -> None:
    response = _post(server, "/v1/completions", b'{"prompt": "\xff\xfe hi", "max_tokens": 2}')
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body" and "UTF-8" in error["message"] and "0xff" in error["message"]


def test_deeply_nested_json_is_a_400(server: RunningServer) -> None:
    body = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body" and "deeply" in error["message"]
    nested_ok = _post(server, "/v1/completions", b'{"prompt": [[1, 2], [3]], "max_tokens": 1}')
    assert nested_ok.status_code == 200  # ordinary nesting still parses


def test_malformed_json_is_still_a_400_naming_the_body(server: RunningServer) -> None:
    response = _post(server, "/v1/completions", b'{"prompt": "hi",')
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"
