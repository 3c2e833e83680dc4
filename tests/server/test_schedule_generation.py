"""The schedule generation rule on both live paths (PUT /admin/schedule and the config-file watch): a schedule is
applied only when its generation is newer than the one the engine runs; `/info` and the gauge show the one it runs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from npuserve.engine.server.admin import generation_refusal
from tests.server.conftest import RunningServer, running_server, wait_until

AUTH = {"Authorization": "Bearer t"}


def _put(s: RunningServer, body: dict[str, object]) -> httpx.Response:
    return httpx.put(s.url + "/admin/schedule", json=body, headers=AUTH, timeout=30)


def _running(s: RunningServer) -> tuple[int | None, int]:
    info = s.get("/info").json()
    return info["scheduleGeneration"], info["schedule"]["maxBatchSize"]


@pytest.mark.parametrize(("running", "offered", "applies"), [
    (None, None, True),  # a hand-written config: any schedule applies, as before generations
    (None, 1, True),
    (3, 4, True),
    (3, 3, False),
    (3, 2, False),
    (3, None, False),  # an ungenerated writer once the engine runs a generation
])
def test_generation_refusal(running: int | None, offered: int | None, applies: bool) -> None:
    assert (generation_refusal(running, offered) is None) is applies


def test_put_applies_only_a_newer_generation(tiny_model_dir: Path) -> None:
    extensions = {"scheduleGeneration": 3}
    with running_server(tiny_model_dir, admin_token="t", extensions=extensions, maxBatchSize=16) as s:
        assert _running(s) == (3, 16)
        assert s.metric("npuserve:schedule_generation") == 3
        for stale in ({"maxBatchSize": 5, "scheduleGeneration": 3}, {"maxBatchSize": 5, "scheduleGeneration": 2},
                      {"maxBatchSize": 5}):
            r = _put(s, stale)
            assert r.status_code == 409, stale
            error = r.json()["error"]
            assert "runs scheduleGeneration 3" in error["message"] or "the 3 the engine runs" in error["message"]
            assert error["param"] == "scheduleGeneration"
            assert _running(s) == (3, 16)
        r = _put(s, {"maxBatchSize": 5, "maxPrefillBatchSize": 5, "scheduleGeneration": 4})
        assert r.status_code == 200
        assert r.json()["schedule"]["maxBatchSize"] == 5 and r.json()["scheduleGeneration"] == 4
        assert _running(s) == (4, 5)
        assert s.metric("npuserve:schedule_generation") == 4


def test_an_engine_without_a_generation_takes_one(tiny_model_dir: Path) -> None:
    with running_server(tiny_model_dir, admin_token="t", maxBatchSize=16) as s:
        assert _running(s) == (None, 16)
        assert s.metric("npuserve:schedule_generation") == -1
        assert _put(s, {"maxBatchSize": 12, "maxPrefillBatchSize": 8}).status_code == 200  # none on either side
        assert _running(s) == (None, 12)
        assert _put(s, {"maxBatchSize": 8, "scheduleGeneration": 1}).status_code == 200
        assert _running(s) == (1, 8)
        assert _put(s, {"maxBatchSize": 12}).status_code == 409
        assert _running(s) == (1, 8)


def test_config_watch_applies_only_a_newer_generation(tiny_model_dir: Path, tmp_path: Path) -> None:
    config_path = tmp_path / "config.json"
    extensions = {"scheduleGeneration": 5}
    with running_server(tiny_model_dir, admin_token="t", config_path=config_path, extensions=extensions,
                        maxBatchSize=16) as s:
        watcher = s.server.config.app.state.config_watcher  # type: ignore[attr-defined]
        stale_file = json.loads(config_path.read_text())  # generation 5, maxBatchSize 16: what a stale writer holds
        assert _put(s, {"maxBatchSize": 8, "maxPrefillBatchSize": 8, "scheduleGeneration": 7}).status_code == 200
        assert _running(s) == (7, 8)

        # An older generation (and an equal one) rewritten into the file is not applied; the trial's schedule stays.
        for generation in (6, 7):
            stale_file["npuserve"]["scheduleGeneration"] = generation
            stale_file["BackendConfig"]["ScheduleConfig"].update(maxBatchSize=12, maxPrefillBatchSize=8)
            config_path.write_text(json.dumps(stale_file) + " " * generation)  # a new size: a new fingerprint
            wait_until(lambda g=generation: watcher.stale == g - 5)  # type: ignore[misc]
            assert _running(s) == (7, 8)
        assert watcher.applied == 0

        # A newer one is.
        stale_file["npuserve"]["scheduleGeneration"] = 8
        stale_file["BackendConfig"]["ScheduleConfig"].update(maxBatchSize=10, maxPrefillBatchSize=10)
        config_path.write_text(json.dumps(stale_file))
        wait_until(lambda: _running(s) == (8, 10))
        assert watcher.applied == 1
        assert s.metric("npuserve:schedule_generation") == 8
