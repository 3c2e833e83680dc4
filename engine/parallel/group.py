"""Tensor parallel across the pods of a LeaderWorkerSet group (docs/engine.md#tensor-parallel-across-pods): the
group link, a plain TCP connection from each other pod to the leader that lasts as long as the engine.

The pod of node rank k runs the global ranks k*cardsPerPod .. (k+1)*cardsPerPod-1. The leader (node rank 0) listens
on (--host, --master-port); each other pod's first rank connects to (--master-addr, --master-port), retrying until
the connect timeout, and says hello (its node rank, host name, ranks, worldSize and model). Once every node rank has
said hello the leader starts torch's TCPStore on an ephemeral port and answers each pod with the init method to join
the world through: the address that pod reached the leader at, and the store's port. The rendezvous port is the
only fixed one, so two groups' leaders on one machine (distinct pod IPs) never clash.

The links then stay open, with TCP keepalive (a dead node, not only a dead process, is noticed): a worker pod whose
link closes exits naming its leader; the leader, when a worker pod's link closes while it is not stopping, exits
naming the pod's node rank and host. On a clean stop the leader first says `stop` on every link, so the pods' exits
that follow are no death.

The protocol is one JSON object per line. No torch at module level: the leader imports it only to make the store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from npuserve.engine_contract import FLAG_MASTER_ADDR, LWS_LEADER_ADDRESS_ENV

log = logging.getLogger(__name__)

KEEPALIVE_IDLE_S = 5  # a silent link is probed after this long
KEEPALIVE_INTERVAL_S = 2  # then every this long
KEEPALIVE_COUNT = 3  # and given up after this many unanswered probes: a dead node is noticed in about 11 s
_RETRY_S = 0.5  # a worker pod's pause between attempts to reach its leader
_LINE_LIMIT = 1 << 16
STOP_GRACE_S = 30.0  # after the leader's stop, how long a pod has to end on its own


class GroupError(RuntimeError):
    """The group cannot form: a pod missing at the connect timeout, a leader out of reach, a hello refused."""


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Which ranks a pod of the group runs: node rank k holds k*cards_per_pod .. (k+1)*cards_per_pod-1."""

    world_size: int
    nnodes: int = 1
    node_rank: int = 0

    @property
    def cards_per_pod(self) -> int:
        return self.world_size // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.cards_per_pod

    def ranks_of(self, node_rank: int) -> list[int]:
        cpp = self.cards_per_pod
        return list(range(node_rank * cpp, (node_rank + 1) * cpp))


def ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {ranks[0]}-{ranks[-1]}"


def layout_problem(world_size: int, nnodes: int, node_rank: int, master_addr: str | None) -> str | None:
    """Why these flags make no group (naming the flag), or None."""
    from npuserve.engine_contract import FLAG_NNODES, FLAG_NODE_RANK

    if nnodes < 1:
        return f"{FLAG_NNODES} {nnodes}: a replica runs in at least one pod"
    if world_size % nnodes:
        return (f"{FLAG_NNODES} {nnodes} does not divide worldSize {world_size}: every pod of the group runs the same "
                "number of ranks")
    if not 0 <= node_rank < nnodes:
        return f"{FLAG_NODE_RANK} {node_rank} is outside 0..{nnodes - 1} ({FLAG_NNODES} {nnodes})"
    if nnodes > 1 and not master_addr:
        return f"{FLAG_NNODES} {nnodes} needs {FLAG_MASTER_ADDR}: the address of the group's leader (node rank 0)"
    return None


def expected_worker_address(node_rank: int, leader_address: str | None = None) -> str | None:
    """The address the LeaderWorkerSet gives the worker pod of `node_rank`, from the leader's, or None when the
    leader's address is not of either form the controller makes: `<lws>-<group>.<lws>.<namespace>` (one headless
    Service for the set) -> `<lws>-<group>-<index>.<lws>.<namespace>`; `<lws>-<group>.<lws>-<group>.<namespace>` (one
    per group, subdomainPolicy UniquePerReplica) -> `<lws>-<group>-<index>.<lws>-<group>.<namespace>`."""
    leader = leader_address if leader_address is not None else os.environ.get(LWS_LEADER_ADDRESS_ENV, "")
    parts = leader.split(".", 2)
    if len(parts) < 3:
        return None
    head, subdomain = parts[0], parts[1]
    if head != subdomain and not re.fullmatch(re.escape(subdomain) + r"-\d+", head):
        return None
    if not re.fullmatch(r".+-\d+", head):
        return None
    return f"{head}-{node_rank}.{subdomain}.{parts[2]}"


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Link:
    """One end of a group link: JSON lines both ways."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self.sock.sendall(json.dumps(message).encode() + b"\n")

    def receive(self) -> dict[str, Any] | None:
        """The next message, or None once the other end has closed (or the connection broke)."""
        try:
            line = self.reader.readline(_LINE_LIMIT)
        except OSError:
            return None
        if not line:
            return None
        message = json.loads(line)
        if not isinstance(message, dict):
            raise GroupError(f"a group link message must be a JSON object, not {line[:80]!r}")
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _exit_process(message: str) -> None:
    from npuserve.engine.server.fatal import hard_exit, write_termination_message

    log.critical("%s", message)
    write_termination_message(message)
    hard_exit(1)


@dataclass
class _Pod:
    node_rank: int
    host: str
    ranks: list[int]
    peer: str
    link: _Link


@dataclass
class LeaderGroup:
    """The leader's side: listens, waits for every other pod's hello, makes the store, watches the links."""

    layout: GroupLayout
    model: str
    host: str
    port: int
    timeout_s: float
    on_death: Callable[[str], None] = _exit_process
    pods: dict[int, _Pod] = field(default_factory=dict)
    store: Any = None  # torch.distributed.TCPStore, once every pod is in
    local_init_method: str = ""  # what the leader's own other ranks join through
    _listener: socket.socket | None = None
    _closing: bool = False

    def listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self.port))
        except OSError as e:
            listener.close()
            raise GroupError(f"the group's leader cannot listen on {self.host}:{self.port}: {e}") from e
        listener.listen(64)
        self._listener = listener
        log.info("tensor-parallel group leader: listening on %s:%d for %d other pod(s) (worldSize %d, %d rank(s) "
                 "per pod)", self.host, self.port, self.layout.nnodes - 1, self.layout.world_size,
                 self.layout.cards_per_pod)

    def wait_for_pods(self) -> None:
        """Returns once every node rank 1..nnodes-1 has said hello; raises GroupError at the timeout, naming each
        one missing."""
        if self._listener is None:
            self.listen()
        assert self._listener is not None
        deadline = time.monotonic() + self.timeout_s
        expected = set(range(1, self.layout.nnodes))
        while set(self.pods) != expected:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupError(self._missing_message(sorted(expected - set(self.pods))))
            self._listener.settimeout(min(left, 1.0))
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(max(1.0, min(10.0, left)))
            try:
                self._hello(sock, peer[0])
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("tensor-parallel group: a connection from %s said no valid hello (%s); ignored", peer[0], e)
                sock.close()
        log.info("tensor-parallel group complete: %d pods, worldSize %d (%s)", self.layout.nnodes,
                 self.layout.world_size, ", ".join(f"pod {k} {p.host} at {p.peer}: {ranks_text(p.ranks)}"
                                                   for k, p in sorted(self.pods.items())))

    def _missing_message(self, missing: list[int]) -> str:
        names = []
        for k in missing:
            where = expected_worker_address(k)
            names.append(f"node rank {k} ({ranks_text(self.layout.ranks_of(k))}"
                         + (f", expected at {where}" if where else "") + ")")
        return (f"tensor-parallel group: no hello from {', '.join(names)} within {self.timeout_s:g} s of the leader "
                f"listening on {self.host}:{self.port}; the group cannot form and the leader exits (is that pod "
                "scheduled and running? its own log says why it is not)")

    def _hello(self, sock: socket.socket, peer: str) -> None:
        link = _Link(sock)
        message = link.receive()
        if message is None or "hello" not in message:
            raise ValueError("the connection closed before its hello")
        hello = message["hello"]
        k, host, ranks = int(hello["node_rank"]), str(hello["host"]), [int(r) for r in hello["ranks"]]
        problem = None
        if not 1 <= k < self.layout.nnodes:
            problem = f"node rank {k} is outside 1..{self.layout.nnodes - 1} of a group of {self.layout.nnodes} pods"
        elif k in self.pods:
            problem = (f"node rank {k} already joined from {self.pods[k].host} at {self.pods[k].peer}: two pods "
                       "claim one node rank")
        elif int(hello["world_size"]) != self.layout.world_size:
            problem = f"worldSize {hello['world_size']} differs from the leader's {self.layout.world_size}"
        elif str(hello["model"]) != self.model:
            problem = f"model {hello['model']!r} differs from the leader's {self.model!r}"
        elif ranks != self.layout.ranks_of(k):
            problem = f"ranks {ranks} are not node rank {k}'s {self.layout.ranks_of(k)}"
        if problem is not None:
            log.warning("tensor-parallel group: refused the hello of %s at %s: %s", host, peer, problem)
            try:
                link.send({"error": f"the group's leader refused this pod: {problem}"})
            finally:
                link.close()
            return
        sock.settimeout(None)
        _keepalive(sock)
        self.pods[k] = _Pod(k, host, ranks, peer, link)
        log.info("tensor-parallel group: pod %d (%s at %s, %s) joined; %d of %d pods in", k, host, peer,
                 ranks_text(ranks), len(self.pods) + 1, self.layout.nnodes)

    def start_store(self) -> None:
        """The world's TCPStore on an ephemeral port; each pod is told the init method to reach it at, and the
        links are watched from now on."""
        from npuserve.engine.parallel.comm import master_store

        self.store, port = master_store(self.host, self.layout.world_size, timedelta(seconds=self.timeout_s))
        first = next(iter(self.pods.values()))
        own = first.link.sock.getsockname()[0]  # the leader's address as the pods reach it
        self.local_init_method = f"tcp://{own}:{port}"
        for pod in self.pods.values():
            address = pod.link.sock.getsockname()[0]
            pod.link.send({"init_method": f"tcp://{address}:{port}"})
        log.info("tensor-parallel group: the ranks join the world through the store on port %d", port)
        for pod in self.pods.values():
            threading.Thread(target=self._watch, args=(pod,), name=f"npuserve-pod{pod.node_rank}-watch",
                             daemon=True).start()
        if self._listener is not None:
            self._listener.close()  # a pod that restarts cannot rejoin a running world: the group restarts whole
            self._listener = None

    def _watch(self, pod: _Pod) -> None:
        while True:
            try:
                message = pod.link.receive()
            except (GroupError, ValueError):
                message = {}
            if message is None:
                break
        if not self._closing:
            self.on_death(f"tensor-parallel pod {pod.node_rank} ({pod.host}, {ranks_text(pod.ranks)}) disconnected; "
                          "the group cannot go on without it and exits; its own log says why")

    def stopping(self) -> None:
        """A clean stop: tells every pod before the STOP step message, so that the links' ends are no death."""
        self._closing = True
        for pod in self.pods.values():
            with contextlib.suppress(OSError):
                pod.link.send({"stop": True})

    def close(self) -> None:
        self._closing = True
        for pod in self.pods.values():
            pod.link.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _host_name() -> str:
    return socket.gethostname()


@dataclass
class WorkerLink:
    """A pod of node rank > 0: its link to the leader."""

    layout: GroupLayout
    model: str
    master_addr: str
    master_port: int
    timeout_s: float
    source: str | None = None  # the pod's own address to connect from (None or 0.0.0.0: the kernel's choice)
    on_leader_gone: Callable[[str], None] = _exit_process
    on_stop: Callable[[], None] | None = None  # the leader said stop (a clean end)
    link: _Link | None = None
    init_method: str = ""
    stopping: bool = False
    watcher: threading.Thread | None = None

    @property
    def leader(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def connect(self) -> str:
        """Reaches the leader (retrying until the timeout), says hello, and returns the init method the leader
        answers; raises GroupError naming the leader's address when it cannot."""
        deadline = time.monotonic() + self.timeout_s
        last: Exception | None = None
        sock: socket.socket | None = None
        while sock is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupError(f"tensor-parallel pod {self.layout.node_rank} could not reach the group's leader at "
                                 f"{self.leader} within {self.timeout_s:g} s ({last}); it exits (is the leader pod "
                                 "running? its own log says why it is not)")
            try:
                source = (self.source, 0) if self.source and self.source not in ("0.0.0.0", "::") else None
                sock = socket.create_connection((self.master_addr, self.master_port), timeout=min(left, 5.0),
                                                source_address=source)
            except OSError as e:
                last = e
                time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))
        _keepalive(sock)
        link = self.link = _Link(sock)
        layout = self.layout
        link.send({"hello": {"node_rank": layout.node_rank, "host": _host_name(),
                             "ranks": layout.ranks_of(layout.node_rank), "world_size": layout.world_size,
                             "model": self.model}})
        log.info("tensor-parallel pod %d: reached the group's leader at %s; waiting for the other pods",
                 layout.node_rank, self.leader)
        sock.settimeout(None)  # the leader answers once every pod is in, as late as its own timeout
        answer = link.receive()
        if answer is None:
            raise GroupError(f"the group's leader at {self.leader} closed the link before sending the init method "
                             "(it timed out waiting for another pod, or exited; its own log says why)")
        if "error" in answer:
            raise GroupError(str(answer["error"]))
        self.init_method = str(answer["init_method"])
        self.watcher = threading.Thread(target=self._watch, name="npuserve-leader-watch", daemon=True)
        self.watcher.start()
        return self.init_method

    def wait_gone(self, timeout_s: float) -> None:
        """Gives the link up to `timeout_s` to find the leader gone. A rank whose collective fails because the leader
        died must exit naming the leader (the watch does, and ends the pod), not the collective's error, which
        can come first."""
        if self.watcher is not None:
            self.watcher.join(timeout_s)

    def _watch(self) -> None:
        assert self.link is not None
        while True:
            try:
                message = self.link.receive()
            except (GroupError, ValueError):
                message = {}
            if message is None:
                break
            if message.get("stop"):
                self.stopping = True
                if self.on_stop is not None:
                    self.on_stop()
        if self.stopping:  # the leader stopped the group: the STOP step message ends this pod, unless it is stuck
            time.sleep(STOP_GRACE_S)
            self.on_leader_gone(f"the group's leader at {self.leader} stopped the group, and tensor-parallel pod "
                                f"{self.layout.node_rank} did not stop within {STOP_GRACE_S:g} s; it exits")
            return
        self.on_leader_gone(f"the group's leader at {self.leader} is gone (its link closed); tensor-parallel pod "
                            f"{self.layout.node_rank} ({ranks_text(self.layout.ranks_of(self.layout.node_rank))}) "
                            "cannot go on without it and exits; the leader's own log says why")

    def close(self) -> None:
        self.stopping = True
        if self.link is not None:
            self.link.close()
