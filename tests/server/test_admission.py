"""The admission layer on its own (ASGI, no server): probes are answered first, whatever holds the slots; at most
`slots` requests are in admission at once; a request gives its slot back once admitted, however long it then runs."""

from __future__ import annotations

import asyncio
from typing import Any

from npuserve.engine.server.admission import AdmissionMiddleware, admitted, probe_paths


def _scope(path: str, method: str = "POST") -> dict[str, Any]:
    return {"type": "http", "path": path, "method": method, "headers": []}


async def _run() -> None:
    entered: list[str] = []
    release_admission = asyncio.Event()
    finish = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        entered.append(scope["path"])
        if scope["path"] == "/slow-admission":
            await release_admission.wait()  # still parsing, tokenizing...
        admitted(scope)  # submitted to the engine
        await finish.wait()  # streaming for a long time

    gate = AdmissionMiddleware(app, probe_paths(lambda: (200, {"status": "ok"}), lambda: (503, {"ready": False})),
                               slots=2)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    slow = [asyncio.ensure_future(gate(_scope("/slow-admission"), receive, send)) for _ in range(2)]
    await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(gate(_scope("/v1/completions"), receive, send))
    await asyncio.sleep(0.01)
    assert entered == ["/slow-admission"] * 2  # the third waits for a slot
    await asyncio.wait_for(gate(_scope("/health", "GET"), receive, send), 1)  # a probe does not
    await asyncio.wait_for(gate(_scope("/ready", "HEAD"), receive, send), 1)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200, 503]
    assert sent[-1]["body"] == b""  # HEAD: no body
    release_admission.set()
    await asyncio.sleep(0.01)
    assert entered[-1] == "/v1/completions"  # the slow ones were admitted and gave their slots back
    many = [asyncio.ensure_future(gate(_scope("/v1/completions"), receive, send)) for _ in range(10)]
    await asyncio.sleep(0.01)
    assert len(entered) == 13  # admitted requests hold no slot while they run
    finish.set()
    await asyncio.wait_for(asyncio.gather(*slow, waiting, *many), 1)


def test_probes_first_and_slots_held_through_admission_only() -> None:
    asyncio.run(_run())
