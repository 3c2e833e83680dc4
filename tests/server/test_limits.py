"""Limits that agree: `/v1/models` reports the context the engine accepts, and a request over maxIterTimes or
maxSeqLen is refused naming the limit and the config field that sets it (maxIterTimes live, as the tuner moves it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import RunningServer, running_server


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_model_dir, admin_token="s3cret", max_seq_len=512, max_input_len=400,
                        maxIterTimes=64) as s:
        yield s


def _complete(server: RunningServer, **body: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"prompt": "hi", **body}, timeout=60)


def test_models_reports_the_context_a_request_can_reach(limited: RunningServer) -> None:
    card = limited.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 400 + 64  # maxInputTokenLen + maxIterTimes, under maxSeqLen 512


def test_a_request_over_a_limit_names_it_and_the_config_field(limited: RunningServer) -> None:
    over_iter = _complete(limited, max_tokens=65)
    assert over_iter.status_code == 400
    error = over_iter.json()["error"]
    assert error["param"] == "max_tokens"
    assert "maxIterTimes" in error["message"] and "BackendConfig.ScheduleConfig.maxIterTimes" in error["message"]
    long_prompt = list(range(10, 410))  # 400 tokens: at maxInputTokenLen
    admin = {"Authorization": "Bearer s3cret"}
    assert httpx.put(limited.url + "/admin/schedule", json={"maxIterTimes": 200}, headers=admin,
                     timeout=30).status_code == 200
    try:
        assert limited.get("/v1/models").json()["data"][0]["max_model_len"] == 512  # now maxSeqLen binds
        assert _complete(limited, max_tokens=65, ignore_eos=True).status_code == 200  # the live value applies
        over_seq = _complete(limited, prompt=long_prompt, max_tokens=150)
        assert over_seq.status_code == 400
        message = over_seq.json()["error"]["message"]
        assert "maxSeqLen" in message and "BackendConfig.ModelDeployConfig.maxSeqLen" in message
        over_input = _complete(limited, prompt=[*long_prompt, 5])
        assert over_input.status_code == 400
        assert "BackendConfig.ModelDeployConfig.maxInputTokenLen" in over_input.json()["error"]["message"]
    finally:
        httpx.put(limited.url + "/admin/schedule", json={"maxIterTimes": 64}, headers=admin, timeout=30)
