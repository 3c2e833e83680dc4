"""`npuserve serve`: load the model, warm up, serve HTTP. Torch is imported only when the command runs."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model folder (default: the config's modelWeightPath)")
    parser.add_argument("--config", help="MindIE config.json (watched: ScheduleConfig changes apply live)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model name clients send (default: modelName)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], help="overrides npuserve.device")
    parser.add_argument("--max-waiting-requests", type=int, help="waiting-queue bound before 429 "
                        "(overrides npuserve.maxWaitingRequests)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to finish running requests after SIGTERM")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--seed", type=int, default=0)


def _config(args: argparse.Namespace) -> Any:
    from npuserve.engine.engine import make_config
    from npuserve.mindie_config import MindIEConfig

    if args.config:
        config = MindIEConfig.load(args.config)
        data = config.to_dict()
        if args.model:
            data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = args.model
    elif args.model:
        data = make_config(args.model).to_dict()
    else:
        raise ValueError("give --model, or --config with a modelWeightPath")
    ext = data.setdefault("npuserve", {}) or {}
    if args.served_model_name:
        ext["servedModelName"] = args.served_model_name
    if args.device:
        ext["device"] = args.device
    if args.max_waiting_requests:
        ext["maxWaitingRequests"] = args.max_waiting_requests
    data["npuserve"] = ext
    return MindIEConfig.from_dict(data, source=args.config or "arguments")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from npuserve.mindie_config import MindIEConfigError

    try:
        config = _config(args)
    except (ValueError, MindIEConfigError, OSError) as e:
        print(f"npuserve serve: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.server.admin import ADMIN_TOKEN_ENV
    from npuserve.engine.server.app import build_app
    from npuserve.engine.server.async_engine import AsyncEngine

    engine = AsyncEngine(LLMEngine(config, seed=args.seed))
    app = build_app(engine, admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
                    config_path=Path(args.config) if args.config else None, drain_timeout=args.drain_timeout)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: readiness turns false and new requests get 503 while running ones finish."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            engine.draining = True
            super().handle_exit(sig, frame)

    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=int(args.drain_timeout)))
    # uvicorn re-raises the signal it caught once it has shut down; with a Python handler in place that re-raise
    # is a no-op, so a drained SIGTERM ends with exit status 0 (what Kubernetes records as a clean stop).
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 0
