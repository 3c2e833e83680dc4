"""`npuserve serve` on W8A8 checkpoints the real tools wrote (tests/quant_checkpoints.py), dense and MoE, at
worldSize 1 and 2: /info names the scheme the checkpoint declares and the worldSize; the official `openai` client's
completion and streamed chat completion return tokens; a malformed request is still refused with a 4xx. One server
per case, shared by the module's tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from npuserve.engine_contract import EngineInfo  # noqa: E402
from tests.quant_checkpoints import quant_checkpoint  # noqa: E402
from tests.serve_process import serve_process  # noqa: E402

MAX_TOKENS = 3
# (model, tool, method, worldSize): each tool, each method, dense and MoE, each worldSize once
CASES = [("dense", "msmodelslim", "w8a8", 1), ("dense", "llmcompressor", "w8a8_dynamic", 2),
         ("moe", "msmodelslim", "w8a8_dynamic", 2), ("moe", "llmcompressor", "w8a8", 1)]
# the scheme each checkpoint declares, as /info names it (QuantScheme.name: msModelSlim's own method names, the
# compressed-tensors activations' `dynamic` flag in words)
SCHEME_NAMES = {("msmodelslim", "w8a8"): "msmodelslim W8A8",
                ("msmodelslim", "w8a8_dynamic"): "msmodelslim W8A8_DYNAMIC",
                ("llmcompressor", "w8a8"): "compressed-tensors W8A8 (static)",
                ("llmcompressor", "w8a8_dynamic"): "compressed-tensors W8A8 (dynamic)"}


class Server(NamedTuple):
    url: str
    model: str
    scheme: str
    world_size: int


@pytest.fixture(scope="module", params=CASES, ids=["-".join(map(str, c)) for c in CASES])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    model, tool, method, world_size = request.param
    folder: Path = quant_checkpoint(tool, model, method)
    with serve_process("--model", str(folder), "--device", "cpu", "--world-size", str(world_size)) as (url, _):
        yield Server(url, folder.name, SCHEME_NAMES[(tool, method)], world_size)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_info_names_the_scheme_and_the_world_size(server: Server) -> None:
    info = EngineInfo.model_validate(httpx.get(server.url + "/info", timeout=10).json())
    assert info.quantization == server.scheme
    assert info.worldSize == server.world_size and len(info.ranks) == server.world_size


def test_openai_completion_returns_tokens(server: Server) -> None:
    out = client(server).completions.create(model=server.model, prompt="Natalia sold clips to", temperature=0.0,
                                            max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == MAX_TOKENS
    assert out.choices[0].finish_reason == "length" and out.choices[0].text


def test_openai_streamed_chat_completion_returns_tokens(server: Server) -> None:
    stream = client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "How many clips did Natalia sell?"}],
        max_tokens=MAX_TOKENS, temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_malformed_request_is_refused(server: Server) -> None:
    body = {"model": server.model, "prompt": "hello", "max_tokens": -1}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
    assert 400 <= response.status_code < 500, response.text
    broken = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10,
                        headers={"content-type": "application/json"})
    assert 400 <= broken.status_code < 500, broken.text
    assert json.loads(broken.text)  # an error document, not a crash
