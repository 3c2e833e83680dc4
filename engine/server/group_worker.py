"""`npuserve serve --node-rank k` with k > 0: one worker pod of a group whose ranks span pods
(docs/engine.md#tensor-parallel-across-pods). Headless, as vLLM's `--headless`: no OpenAI API, no /metrics.

The process reaches its leader over the group link (engine/parallel/group.py), starts its pod's other ranks, builds
its own rank (the pod's first, k*cardsPerPod) and follows the leader's step messages as any rank other than 0 does
(`ranks._follow`). A small HTTP server on --host/--port answers the kubelet's probes only: /health 200 while the
process lives, /ready 200 once its rank is built and following (503 before). Its failures follow the single-pod
rules: a failed operation logs the rank and the operation, writes the termination message and exits 1; a rank of
the pod that dies, or a leader whose link closes, ends it too. The leader's STOP ends it with status 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from npuserve.engine.parallel.group import GroupError, GroupLayout, WorkerLink, ranks_text
from npuserve.engine.server.fatal import EXIT_CODE, hard_exit, write_termination_message
from npuserve.engine_contract import HEALTH_PATH, READY_PATH

log = logging.getLogger(__name__)
# How long a failed rank waits for the leader's link to say the leader is gone before reporting its own error.
LEADER_GONE_GRACE_S = 2.0


class ProbeServer:
    """/health and /ready, nothing else (404): a worker pod serves no API."""

    def __init__(self, host: str, port: int, node_rank: int) -> None:
        self.ready = threading.Event()
        self.reason = "loading"
        probes = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                payload: dict[str, Any]
                if path == HEALTH_PATH:
                    status, payload = 200, {"status": "ok"}
                elif path == READY_PATH:
                    ready = probes.ready.is_set()
                    status, payload = (200, {"ready": True}) if ready else (503, {"ready": False,
                                                                                  "reason": probes.reason})
                else:
                    status, payload = 404, {"error": {
                        "message": f"{path}: this is tensor-parallel pod {node_rank} of a group, which serves only "
                                   f"{HEALTH_PATH} and {READY_PATH}; send requests to the group's leader (node rank 0)",
                        "type": "NotFoundError", "code": 404}}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer(True)

            def do_HEAD(self) -> None:
                self._answer(False)

            def do_POST(self) -> None:
                self._answer(True)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the probes every few seconds would fill the log

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="npuserve-probes", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_worker_pod(args: argparse.Namespace, config: Any, environment: Any, layout: GroupLayout, host: str,
                     port: int) -> int:
    """Runs this worker pod until the leader's STOP (0), or exits the process on a failure (1); 2 for a
    configuration this engine refuses."""
    from npuserve.engine.backends import resolve_device
    from npuserve.engine.parallel.ranks import WorkerArgs, WorkerRanks, _follow
    from npuserve.engine.servable import UnservableConfigError, check_servable
    from npuserve.mindie_config import NpuserveExtensions
    from npuserve.modelspec import ModelSpec

    ext = config.npuserve or NpuserveExtensions()
    try:
        check_servable(config, resolve_device(ext.device), ModelSpec.from_pretrained(config.model.modelWeightPath),
                       nnodes=layout.nnodes)
    except (UnservableConfigError, ValueError, OSError) as e:
        print(f"npuserve serve: {e}", flush=True)
        return 2
    k, first = layout.node_rank, layout.first_rank
    ranks = layout.ranks_of(k)
    probes = ProbeServer(host, port, k)
    probes.start()
    log.info("tensor-parallel pod %d of %d (%s of worldSize %d): probes on %s:%d; reaching the group's leader at "
             "%s:%d", k, layout.nnodes, ranks_text(ranks), layout.world_size, host, port, args.master_addr,
             args.master_port)
    workers: WorkerRanks | None = None

    def die(message: str) -> None:
        log.critical("%s", message)
        write_termination_message(message)
        if workers is not None:
            workers.kill()
        hard_exit(EXIT_CODE)

    link = WorkerLink(layout, config.model.modelName, args.master_addr, args.master_port,
                      args.group_connect_timeout, source=host, on_leader_gone=die)
    # SIGTERM: the group stops with its leader (the LeaderWorkerSet deletes the group's pods together); this pod
    # follows until the leader's STOP, or the kubelet's SIGKILL at the end of the grace period.
    signal.signal(signal.SIGTERM, lambda signum, frame: log.info(
        "SIGTERM: tensor-parallel pod %d stops when its leader stops the group", k))
    try:
        init_method = link.connect()
    except GroupError as e:
        die(str(e))
        return EXIT_CODE
    probes.reason = "building its ranks"
    per_pod = layout.cards_per_pod
    workers = WorkerRanks(layout.world_size, init_method=init_method, on_death=die, first_rank=first,
                          cards_per_pod=per_pod)
    resolved, level = config.to_dict(), logging.getLogger().getEffectiveLevel()

    def make_args(rank: int) -> WorkerArgs:
        return WorkerArgs(rank=rank, world_size=layout.world_size, init_method=init_method, config=resolved,
                          model_dir=str(config.model.modelWeightPath), seed=args.seed, log_level=level,
                          env=environment, cards_per_pod=per_pod)

    workers.start(make_args)
    doing = ["while starting"]

    def built() -> None:
        probes.ready.set()
        log.info("tensor-parallel pod %d: %s built; following the leader's steps", k, ranks_text(ranks))

    try:
        _follow(make_args(first), doing, on_built=built)
    except Exception as e:
        log.exception("tensor-parallel rank %d failed %s", first, doing[0])
        link.wait_gone(LEADER_GONE_GRACE_S)  # the leader's death, if it is the cause, is the message
        die(f"tensor-parallel rank {first} failed {doing[0]}: {type(e).__name__}: {e}; it exits, and the group "
            "with it")
        return EXIT_CODE
    probes.ready.clear()
    probes.reason = "stopped"
    log.info("tensor-parallel pod %d: the group's leader stopped the group; this pod exits", k)
    workers.stop(lambda: None)  # the pod's other ranks had the STOP too
    link.close()
    probes.close()
    return 0
