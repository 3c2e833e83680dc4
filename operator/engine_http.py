"""The operator's HTTP to the engines: each ready engine's `/info` (the KV blocks it allocated) after readiness
changes, and `PUT /admin/schedule` on every engine when the autotune loop applies a schedule. Async clients, bounded
concurrency and timeouts, run on their own event loop from the calling worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from npuserve.engine_contract import ADMIN_SCHEDULE_PATH, ENGINE_PORT, INFO_PATH, EngineInfo

from .autotune_types import EngineReport, PodState, Termination

INFO_TIMEOUT_S = 2.0  # one engine's /info, connect to last byte
MAX_CONCURRENT_INFO = 16  # /info reads in flight at once, per readiness update
ADMIN_TIMEOUT_S = 35.0  # one PUT /admin/schedule (the engine waits up to 30 s for its step loop to take it)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for the engine clients: httpx builds a new one (loading the CA bundle) for each client
    otherwise, and the profile of 300 InferenceServices had that as its top frame; the engines answer plain HTTP."""
    return ssl.create_default_context()


@dataclass(frozen=True)
class EnginePod:
    name: str
    ip: str | None
    ready: bool
    serves_http: bool = True  # a LeaderWorkerSet's worker pods run no HTTP server; their leader answers /info
    restarts: int = 0  # of its engine container
    terminated: Termination | None = None  # how the engine container last ended, if it did
    group: str | None = None  # a LeaderWorkerSet pod's group index (one replica); None: a Deployment's pod



def read_engines(pods: Sequence[EnginePod], *, port: int = ENGINE_PORT, timeout: float = INFO_TIMEOUT_S,
                 limit: int = MAX_CONCURRENT_INFO, transport: httpx.AsyncBaseTransport | None = None,
                 ) -> list[EngineReport]:
    """Each ready engine's /info (the KV blocks it actually allocated), at most `limit` reads at once, each bounded
    by `timeout`. Runs its own event loop: call it from a worker thread (kopf runs sync handlers in one)."""
    return asyncio.run(_read_engines(pods, port, timeout, limit, transport))


async def _read_engines(pods: Sequence[EnginePod], port: int, timeout: float, limit: int,
                        transport: httpx.AsyncBaseTransport | None) -> list[EngineReport]:
    gate = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(transport=transport, timeout=timeout, verify=tls_context()) as http:

        async def one(pod: EnginePod) -> EngineReport:
            def report(ready: bool, kv_blocks: int | None = None, error: str | None = None) -> EngineReport:
                return EngineReport(pod.name, ready, kv_blocks, error, pod.restarts, pod.terminated, pod.group)

            if not pod.ready:
                return report(False, error="not ready" if pod.ip else "no pod IP yet")
            if not pod.serves_http or not pod.ip:
                return report(True)
            async with gate:
                try:
                    async with asyncio.timeout(timeout):
                        response = await http.get(f"http://{pod.ip}:{port}{INFO_PATH}")
                    response.raise_for_status()
                    info = EngineInfo.model_validate(response.json())
                except (httpx.HTTPError, TimeoutError, ValueError, ValidationError) as e:
                    return report(True, error=f"{INFO_PATH} unreadable: {e!r}")
            return report(True, kv_blocks=info.kv_blocks)

        return list(await asyncio.gather(*(one(p) for p in pods)))


def put_schedule(pods: Sequence[PodState], token: str, knobs: Mapping[str, Any], *, port: int = ENGINE_PORT,
                 timeout: float = ADMIN_TIMEOUT_S, transport: httpx.AsyncBaseTransport | None = None,
                 ) -> dict[str, str]:
    """PUT /admin/schedule on every engine pod with an IP, at once; pod name -> error, for those that refused or did
    not answer (empty: all applied). An engine that answers 409 already runs this schedule generation or a newer
    one (its config file was quicker): not an error. Runs its own event loop (call it from a worker thread)."""
    return asyncio.run(_put_schedule(pods, token, dict(knobs), port, timeout, transport))


async def _put_schedule(pods: Sequence[PodState], token: str, body: dict[str, Any], port: int, timeout: float,
                        transport: httpx.AsyncBaseTransport | None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(transport=transport, timeout=timeout, verify=tls_context()) as http:

        async def one(pod: PodState) -> tuple[str, str | None]:
            try:
                response = await http.put(f"http://{pod.ip}:{port}{ADMIN_SCHEDULE_PATH}", json=body,
                                          headers=headers)
            except httpx.HTTPError as e:
                return pod.name, f"{ADMIN_SCHEDULE_PATH} unreachable: {e!r}"
            if response.status_code not in (200, 409):
                return pod.name, f"{ADMIN_SCHEDULE_PATH} answered {response.status_code}: {response.text[:300]}"
            return pod.name, None

        results = await asyncio.gather(*(one(p) for p in pods if p.ip))
    return {name: error for name, error in results if error is not None}
