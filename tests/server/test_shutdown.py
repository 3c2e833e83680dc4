"""SIGTERM on the real `npuserve serve` with streams running past the drain timeout: each stream gets a last SSE error
event a client can show, then [DONE]; the log has one line per cut request and no traceback; the exit is clean."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from npuserve.mindie_config import minimal_config
from tests.serve_process import serve_process


def _read_stream(url: str, body: dict[str, object], events: list[str]) -> None:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])


def test_streams_running_past_the_drain_timeout_end_with_an_error_event(tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    config = minimal_config(tiny_model_dir, max_seq_len=8192, max_input_len=64, maxIterTimes=8000)
    config.save(tmp_path / "config.json")
    streams: list[list[str]] = [[] for _ in range(4)]
    readers = []
    with serve_process("--config", str(tmp_path / "config.json"), "--drain-timeout", "1",
                       stdout=subprocess.PIPE) as (base, proc):
        for i, events in enumerate(streams):
            path, body = (("/v1/completions", {"prompt": "hi"}) if i % 2 == 0 else
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
            body |= {"max_tokens": 7000, "ignore_eos": True, "stream": True}
            reader = threading.Thread(target=_read_stream, args=(base + path, body, events))
            reader.start()
            readers.append(reader)
        deadline = time.monotonic() + 60
        while not all(len(events) > 2 for events in streams):  # every stream is generating
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(60)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    for events in streams:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "drain timeout" in error["message"] and "send it again" in error["message"]
        assert "choices" in json.loads(events[-3])  # tokens streamed until the cut
    assert out.count("cut at shutdown") == len(streams), out
    assert "Traceback" not in out and "Cancel" not in out, out
