"""TGI's finish reasons on `/generate` and `/generate_stream` (`details.finish_reason`), spelled as TGI's router
serializes its `FinishReason` enum: "length", "eos_token", "stop_sequence".

The tiny model's greedy output is fixed by its weights, so a token it is known to produce can be declared an end
of sequence: a copy of the model folder lists it as an `eos_token_id` in `generation_config.json`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import RunningServer, running_server

PROMPT = "hello"
MAX_NEW_TOKENS = 12


@dataclass(frozen=True)
class Greedy:
    """What the model generates for PROMPT, and a token of it that can serve as an end-of-sequence id and as a
    stop string: it is not the first, it occurs once, and its text appears nowhere before it."""

    token_ids: list[int]
    index: int  # of that token
    text: str  # its text

    @property
    def token_id(self) -> int:
        return self.token_ids[self.index]


def _generate(url: str, **parameters: Any) -> dict[str, Any]:
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": MAX_NEW_TOKENS, "details": True, **parameters}}, timeout=60)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _stream_details(url: str, **parameters: Any) -> dict[str, Any]:
    """The `details` of the last event of /generate_stream (the others have none)."""
    events = []
    payload = {"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, **parameters}}
    with httpx.stream("POST", url + "/generate_stream", json=payload, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    assert events and all(e["details"] is None for e in events[:-1])
    details: dict[str, Any] = events[-1]["details"]
    return details


@pytest.fixture(scope="module")
def greedy(server: RunningServer) -> Greedy:
    body = _generate(server.url, ignore_eos=True)
    tokens = body["details"]["tokens"]
    ids = [t["id"] for t in tokens]
    texts = [t["text"] for t in tokens]
    assert body["details"]["finish_reason"] == "length" and len(ids) == MAX_NEW_TOKENS
    for i in range(1, len(ids)):
        text = texts[i]
        if text.strip() and text.isascii() and ids.count(ids[i]) == 1 and text not in "".join(texts[:i]):
            return Greedy(ids, i, text)
    raise AssertionError(f"no usable token in {texts}")


@pytest.fixture(scope="module")
def eos_server(tiny_model_dir: Path, greedy: Greedy, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[RunningServer]:
    """The same model with `greedy.token_id` declared an end of sequence."""
    folder = tmp_path_factory.mktemp("tiny-eos") / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    config_path = folder / "generation_config.json"
    generation = json.loads(config_path.read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], greedy.token_id]
    config_path.write_text(json.dumps(generation))
    with running_server(folder) as s:
        yield s


def test_length(server: RunningServer) -> None:
    body = _generate(server.url, ignore_eos=True, max_new_tokens=3)
    assert body["details"]["finish_reason"] == "length" and body["details"]["generated_tokens"] == 3
    assert _stream_details(server.url, ignore_eos=True, max_new_tokens=3)["finish_reason"] == "length"


def test_eos_token(eos_server: RunningServer, greedy: Greedy) -> None:
    body = _generate(eos_server.url)
    assert body["details"]["finish_reason"] == "eos_token"
    assert [t["id"] for t in body["details"]["tokens"]] == greedy.token_ids[: greedy.index + 1]
    details = _stream_details(eos_server.url)
    assert details["finish_reason"] == "eos_token" and details["generated_tokens"] == greedy.index + 1


def test_ignore_eos_runs_past_the_end_of_sequence_token(eos_server: RunningServer, greedy: Greedy) -> None:
    body = _generate(eos_server.url, ignore_eos=True)
    assert body["details"]["finish_reason"] == "length"
    assert body["details"]["generated_tokens"] == MAX_NEW_TOKENS


def test_stop_sequence(server: RunningServer, greedy: Greedy) -> None:
    body = _generate(server.url, stop=[greedy.text])
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["generated_tokens"] == greedy.index + 1
    assert _stream_details(server.url, stop=[greedy.text])["finish_reason"] == "stop_sequence"


def test_stop_sequence_on_a_token_that_is_also_an_end_of_sequence_id(eos_server: RunningServer,
                                                                     greedy: Greedy) -> None:
    """With ignore_eos the end-of-sequence id ends nothing: the stop string did, whatever the token's id."""
    body = _generate(eos_server.url, ignore_eos=True, stop=[greedy.text])
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["generated_tokens"] == greedy.index + 1
    details = _stream_details(eos_server.url, ignore_eos=True, stop=[greedy.text])
    assert details["finish_reason"] == "stop_sequence"
