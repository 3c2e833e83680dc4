"""The engine's FastAPI app: OpenAI, TGI-style and admin routes, health, readiness, info and `/metrics`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from npuserve import __version__
from npuserve.engine.server import admin, openai_chat, openai_completions, openai_models, tgi_api
from npuserve.engine.server.admission import AdmissionMiddleware, probe_paths
from npuserve.engine.server.async_engine import AsyncEngine
from npuserve.engine.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from npuserve.engine.server.chat_template import ChatTemplate
from npuserve.engine.server.errors import APIError, api_error_handler, body_error_handler, validation_error_handler
from npuserve.engine.server.json_body import BodyError
from npuserve.engine.server.state import ServerState, State
from npuserve.engine_contract import HEALTH_PATH, INFO_PATH, METRICS_PATH, READY_PATH, EngineInfo


def _chat_template(engine: AsyncEngine) -> ChatTemplate | None:
    template = ChatTemplate.from_model_dir(engine.engine.model_dir)
    if template is None and engine.engine.extensions.loadFormat == "dummy":
        from npuserve.engine.model.dummy_tokenizer import BOS, CHAT_TEMPLATE, EOS

        template = ChatTemplate(CHAT_TEMPLATE, BOS, EOS)  # the template `create-dummy` writes
    return template


def system_fingerprint(engine: AsyncEngine) -> str:
    """vLLM's `system_fingerprint` form: `npuserve-<version>-<hash8>`, the hash of the configuration the engine
    started with (the model, dtype, device, worldSize and the MindIE config): a client sees when it changes."""
    llm = engine.engine
    identity = {"model": llm.spec.model_dump(mode="json"), "dtype": str(llm.dtype), "device": llm.backend.name,
                "config": llm.config.to_dict()}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"npuserve-{__version__}-{digest}"


def build_app(engine: AsyncEngine, *, admin_token: str | None = None, config_path: Path | None = None,
              drain_timeout: float = 30.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    state = ServerState(engine=engine, served_model_name=engine.engine.model_name,
                        chat_template=_chat_template(engine), admin_token=admin_token,
                        fingerprint=system_fingerprint(engine))
    watcher = admin.ConfigWatcher(state, config_path) if config_path is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watch_task = asyncio.create_task(watcher.run()) if watcher else None
        try:
            yield
        finally:
            if watch_task:
                watch_task.cancel()
            await engine.drain(drain_timeout)
            engine.stop()
            state.preprocess.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="npuserve engine", version=__version__, lifespan=lifespan)
    app.state.server = state
    app.state.config_watcher = watcher
    def health_probe() -> tuple[int, dict[str, Any]]:
        error = engine.health_error  # a stuck step (the watchdog), or the engine exiting
        if error is not None:
            return 503, {"status": "failing", "reason": error}
        return 200, {"status": "ok"}

    def ready_probe() -> tuple[int, dict[str, Any]]:
        if engine.ready:
            return 200, {"ready": True}
        reason = engine.fatal_error or ("draining" if engine.draining else engine.step_error or "loading")
        return 503, {"ready": False, "reason": reason}

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    # outermost (added last): probes answered before anything else, admission bounded (admission.py)
    app.add_middleware(AdmissionMiddleware, probes=probe_paths(health_probe, ready_probe))
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(BodyError, body_error_handler)
    app.include_router(openai_models.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_chat.router)
    app.include_router(tgi_api.router)
    app.include_router(admin.router)

    @app.get(HEALTH_PATH, response_model=None)
    @app.head(HEALTH_PATH, response_model=None, include_in_schema=False)  # probes and load balancers use HEAD
    async def health() -> dict[str, Any] | JSONResponse:
        """The process is alive and its steps complete (liveness): 503 with the reason once a step is stuck past
        npuserve.stepTimeoutSeconds or the engine is exiting. Answered by the admission layer before routing;
        declared here for the API schema."""
        status, body = health_probe()
        return body if status == 200 else JSONResponse(body, status_code=status)

    @app.get(READY_PATH, response_model=None)
    @app.head(READY_PATH, response_model=None, include_in_schema=False)
    async def ready() -> dict[str, Any] | JSONResponse:
        """The model is loaded and warmed up and the server takes requests (readiness)."""
        status, body = ready_probe()
        return body if status == 200 else JSONResponse(body, status_code=status)

    @app.get(INFO_PATH)
    async def info(state: State) -> EngineInfo:
        """Model, worldSize, the KV blocks actually allocated, block size and the schedule the scheduler runs."""
        engine = state.engine
        return engine.engine.info(served_model_name=state.served_model_name, version=__version__,
                                  ready=engine.ready, max_waiting_requests=engine.max_waiting,
                                  num_requests_in_flight=engine.num_in_flight())

    @app.get(METRICS_PATH)
    @app.head(METRICS_PATH, include_in_schema=False)
    async def metrics(state: State) -> Response:
        return Response(state.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
