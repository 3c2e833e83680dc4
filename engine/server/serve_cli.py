"""`npuserve serve`: bind the CPUs, load the model, warm up, serve HTTP.

Torch is imported only when the command runs, after the CPU binding (its thread pools size themselves from the
process's affinity). The flags the operator passes are the contract's (`engine_contract.serve_command`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from npuserve.engine.server.body_limit import DEFAULT_MAX_BODY_BYTES
from npuserve.engine_contract import (
    ADMIN_TOKEN_ENV,
    DEFAULT_GROUP_CONNECT_TIMEOUT_S,
    DEFAULT_HOST,
    ENGINE_PORT,
    FLAG_CONFIG,
    FLAG_GROUP_CONNECT_TIMEOUT,
    FLAG_HOST,
    FLAG_MASTER_ADDR,
    FLAG_MASTER_PORT,
    FLAG_MODEL,
    FLAG_NNODES,
    FLAG_NODE_RANK,
    FLAG_PORT,
    RENDEZVOUS_PORT,
)

CUT_GRACE_SECONDS = 5  # after the drain timeout, for the cut requests to send their last event
# The listening socket's queue of connections not yet accepted (the kernel caps it at net.core.somaxconn, 4096 by
# default): uvicorn's 2048 overflowed under a burst of 4,000 users, and a probe whose SYN is dropped then waits the
# kernel's 1 s retransmission, past the kubelet's timeout.
LISTEN_BACKLOG = 16384


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FLAG_MODEL, help="HF model folder (default: the config's modelWeightPath)")
    parser.add_argument(FLAG_CONFIG, help="MindIE config.json (watched: ScheduleConfig changes apply live)")
    parser.add_argument(FLAG_HOST, help=f"address to bind (default: the config's ServerConfig.ipAddress, else "
                        f"{DEFAULT_HOST})")
    parser.add_argument(FLAG_PORT, type=int,
                        help=f"port (default: the config's ServerConfig.port, else {ENGINE_PORT})")
    parser.add_argument("--served-model-name", help="the model name clients send (default: modelName)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], help="overrides npuserve.device")
    parser.add_argument("--world-size", type=int, help="overrides ModelConfig.worldSize: tensor-parallel ranks, one "
                        "process and one card each (npuDeviceIds 0..N-1 unless the config lists them)")
    parser.add_argument("--max-waiting-requests", type=int, help="waiting-queue bound before 429 "
                        "(overrides npuserve.maxWaitingRequests)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="request bodies over this many bytes get 413 before they are read (default 16 MiB)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to finish running requests after SIGTERM; those still running then get an error "
                        "(streams: a last error event and [DONE])")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--seed", type=int, default=0)
    group = parser.add_argument_group(
        "tensor parallel across pods", "one replica's ranks over the pods of a LeaderWorkerSet group "
        "(docs/engine.md#tensor-parallel-across-pods); the pod of node rank k runs ranks k*worldSize/nnodes .. "
        "(k+1)*worldSize/nnodes-1")
    group.add_argument(FLAG_NNODES, type=int, default=1, help="pods the ranks span (default 1: all in this one)")
    group.add_argument(FLAG_NODE_RANK, type=int, default=0,
                       help="this pod's index in the group, 0..nnodes-1; 0 is the leader, which serves the API")
    group.add_argument(FLAG_MASTER_ADDR, help="the leader's address (LWS_LEADER_ADDRESS)")
    group.add_argument(FLAG_MASTER_PORT, type=int, default=RENDEZVOUS_PORT,
                       help=f"the port the leader listens on for the other pods (default {RENDEZVOUS_PORT})")
    group.add_argument(FLAG_GROUP_CONNECT_TIMEOUT, type=float, default=DEFAULT_GROUP_CONNECT_TIMEOUT_S,
                       help="seconds the leader waits for every other pod, and a pod for its leader, before it exits "
                       f"naming the one missing (default {DEFAULT_GROUP_CONNECT_TIMEOUT_S:g})")


def _config(args: argparse.Namespace) -> Any:
    from npuserve.mindie_config import MindIEConfig, minimal_config

    if args.config:
        config = MindIEConfig.load(args.config)
        data = config.to_dict()
        if args.model:
            data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = args.model
    elif args.model:
        data = minimal_config(args.model).to_dict()
        # no config.json to disagree with: the flags say whether the ranks span pods (MindIE's own switch)
        data["BackendConfig"]["multiNodesInferEnabled"] = args.nnodes > 1
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
    config = MindIEConfig.from_dict(data, source=args.config or "arguments")
    return config.with_world_size(args.world_size) if args.world_size else config


def _world_size(args: argparse.Namespace) -> int:
    """The ranks, read without importing torch (the CPU binding comes first)."""
    from npuserve.mindie_config import MindIEConfig

    if args.world_size:
        return int(args.world_size)
    return MindIEConfig.load(args.config).model.worldSize if args.config else 1


def _address(args: argparse.Namespace, config: Any) -> tuple[str, int]:
    """--host/--port, else MindIE's ServerConfig.ipAddress/port, else the contract's defaults."""
    server = config.ServerConfig
    host = args.host or server.get("ipAddress") or DEFAULT_HOST
    port = args.port if args.port is not None else int(server.get("port") or ENGINE_PORT)
    return str(host), port


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from npuserve.engine.affinity import CPUBindingError, apply_cpu_binding
    from npuserve.engine.parallel.group import GroupError, GroupLayout, LeaderGroup, layout_problem
    from npuserve.engine.servable import UnservableConfigError, multi_node_problem
    from npuserve.mindie_config import EngineEnvironment, MindIEConfigError

    try:
        world_size = _world_size(args)
        problem = layout_problem(world_size, args.nnodes, args.node_rank, args.master_addr)
        if problem is not None:
            raise ValueError(problem)
        layout = GroupLayout(world_size, args.nnodes, args.node_rank)
        # before torch is imported; the pod's first rank, of the pod's ranks
        apply_cpu_binding(rank=0, world_size=layout.cards_per_pod)
        environment = EngineEnvironment.from_environ()
        config = _config(args)
        host, port = _address(args, config)
        multi = multi_node_problem(config, layout.nnodes)
        if multi is not None:
            raise ValueError(multi)
    except (ValueError, MindIEConfigError, OSError, CPUBindingError) as e:
        print(f"npuserve serve: {e}", file=sys.stderr)
        return 2
    if layout.node_rank > 0:
        from npuserve.engine.server.group_worker import serve_worker_pod

        return serve_worker_pod(args, config, environment, layout, host, port)
    if config.LogConfig:
        logging.getLogger(__name__).warning(
            "LogConfig is not acted on: the engine logs to stderr at --log-level (%s)", args.log_level)

    import uvicorn

    from npuserve.engine.backends import BackendUnavailableError
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.model.errors import WeightLoadError
    from npuserve.engine.server.app import build_app
    from npuserve.engine.server.async_engine import AsyncEngine
    from npuserve.engine.server.fatal import EXIT_CODE, write_termination_message

    group = None
    if layout.nnodes > 1:  # the leader: every other pod in before anything loads
        from npuserve.engine.backends import resolve_device
        from npuserve.engine.servable import check_servable
        from npuserve.mindie_config import NpuserveExtensions
        from npuserve.modelspec import ModelSpec

        try:  # a configuration refused is said at once, not after the other pods came
            check_servable(config, resolve_device((config.npuserve or NpuserveExtensions()).device),
                           ModelSpec.from_pretrained(config.model.modelWeightPath), nnodes=layout.nnodes)
        except (UnservableConfigError, ValueError, OSError) as e:
            print(f"npuserve serve: {e}", file=sys.stderr)
            return 2

        group = LeaderGroup(layout, model=config.model.modelName, host=host, port=args.master_port,
                            timeout_s=args.group_connect_timeout)
        try:
            group.wait_for_pods()
            group.start_store()
        except GroupError as e:
            logging.getLogger(__name__).critical("%s", e)
            write_termination_message(str(e))
            group.close()
            return EXIT_CODE
    try:
        llm = LLMEngine(config, env=environment, seed=args.seed, group=group)
    except (UnservableConfigError, BackendUnavailableError) as e:
        print(f"npuserve serve: {e}", file=sys.stderr)
        return 2
    except WeightLoadError as e:  # the checkpoint is not the model its config.json describes: say which tensors
        print(f"npuserve serve: {e}", file=sys.stderr)
        write_termination_message(str(e))
        return 2
    engine = AsyncEngine(llm)
    app = build_app(engine, admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
                    config_path=Path(args.config) if args.config else None, drain_timeout=args.drain_timeout,
                    max_body_bytes=args.max_body_bytes)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: readiness turns false and new requests get 503 while running ones finish."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            engine.begin_drain(args.drain_timeout)  # at the timeout, what still runs is cut with an error event
            super().handle_exit(sig, frame)

    # uvicorn cancels the connections still open past its own timeout (a traceback each, streams cut without a
    # word): it gets a few seconds more than the drain, in which the cut requests send their error and [DONE].
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=args.log_level,
                                           backlog=LISTEN_BACKLOG,
                                           timeout_graceful_shutdown=int(args.drain_timeout) + CUT_GRACE_SECONDS))
    # uvicorn re-raises the signal it caught once it has shut down; with a Python handler in place that re-raise
    # is a no-op, so a drained SIGTERM ends with exit status 0 (what Kubernetes records as a clean stop).
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        llm.close()  # the other tensor-parallel ranks, once the step loop has stopped
    return 0
