"""The server's outermost layer: probes answered first, requests admitted a few at a time.

One asyncio loop serves every connection, so a probe waits for whatever the loop has queued before it. A burst of
thousands of requests queues thousands of request steps (body read, JSON parse, validation, routing, submission),
and a probe behind them took seconds (a benchmark Job of 4,095 users made the engine's readiness blip). So:

- `/health` and `/ready` (GET and HEAD) are answered here, in the first step of their task, before any routing;
- every other request holds one of `ADMISSION_SLOTS` slots from its first step until it has been submitted to the
  engine (`admitted()`, called by the routes) or has ended, whichever is first. Requests past the slots wait on a
  semaphore, which costs the loop nothing, so each turn of the loop runs at most that many requests' admission
  work and a probe waits for a few of them only. The slots bound admission, not the requests in flight: a request
  gives its slot back as soon as the engine has it, however long it then streams.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from npuserve.engine_contract import HEALTH_PATH, READY_PATH

ADMISSION_SLOTS = 16
_RELEASE_KEY = "npuserve.admitted"

Probe = Callable[[], tuple[int, dict[str, Any]]]


def admitted(scope: Scope) -> None:
    """The request is in the engine (or refused): its admission slot goes to the next request."""
    release = scope.get(_RELEASE_KEY)
    if release is not None:
        release()


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, probes: dict[str, Probe], slots: int = ADMISSION_SLOTS) -> None:
        self.app = app
        self.probes = probes
        self.slots = slots
        self._semaphore: asyncio.Semaphore | None = None  # made on the serving loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        probe = self.probes.get(scope["path"])
        if probe is not None and scope["method"] in ("GET", "HEAD"):
            status, body = probe()
            payload = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else payload})
            return
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.slots)
        semaphore = self._semaphore
        await semaphore.acquire()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                semaphore.release()

        scope[_RELEASE_KEY] = release
        try:
            await self.app(scope, receive, send)
        finally:
            release()


def probe_paths(health: Probe, ready: Probe) -> dict[str, Probe]:
    return {HEALTH_PATH: health, READY_PATH: ready}
