"""The ranks' processes: rank 0 (the process that serves) starts one process per other rank, and all of them join
one torch.distributed world: the device's backend (gloo, nccl, hccl) for the model's collectives, and a gloo group
on the host for the step messages.

A rank that dies takes the engine down: rank 0 watches its workers and exits with a log line naming the rank, so
Kubernetes restarts the pod (a collective would otherwise wait for it forever); a worker whose rank 0 is gone exits
too, and a worker whose operation raises logs one line naming its rank and the operation, and exits. The
collectives' own timeout (`comm.COLLECTIVE_TIMEOUT`) is long on purpose: an idle server waits between steps as long
as it likes, and liveness is the watchers' job, and the step watchdog's (engine/server/watchdog.py) for a rank that
hangs without dying.

The arrows go one way: this module builds a worker's rank with `rank_runner`, and joining the world
(`comm.connect`) lives below both, so `rank_runner` never imports this module.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_JOIN_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a worker needs to build its rank (pickled once, at its start)."""

    rank: int
    world_size: int
    init_method: str
    config: dict[str, Any]  # the MindIE config, as rank 0 resolved it
    model_dir: str
    seed: int
    log_level: int
    env: Any  # rank 0's EngineEnvironment
    num_kv_blocks: int | None = None
    num_host_blocks: int | None = None
    cards_per_pod: int | None = None  # the ranks of one pod, when the replica spans pods (None: all in one)

    @property
    def per_pod(self) -> int:
        return self.cards_per_pod or self.world_size

    @property
    def local_rank(self) -> int:
        """The rank's index within its pod: its card among npuDeviceIds, its share of the pod's cores."""
        return self.rank % self.per_pod


def _exit_process(message: str) -> None:
    log.critical(message)
    logging.shutdown()
    os._exit(1)


@dataclass
class WorkerRanks:
    """A pod's first rank's handle on the pod's other ranks (rank 0's on ranks 1..n-1 in one pod; the pod of node
    rank k's on k*cardsPerPod+1 .. (k+1)*cardsPerPod-1 in a group of pods): starts them, watches them, stops them.

    Each worker is a fresh interpreter (`python -P -c ...`, not multiprocessing's spawn, which would re-import the
    caller's main module) that reads its `WorkerArgs` from its stdin; rank 0 keeps that pipe open, so its end
    (rank 0 gone, however it went) is what tells the worker to exit."""

    world_size: int
    init_method: str  # tcp://HOST:PORT of the store rank 0 holds (comm.master_store)
    on_death: Callable[[str], None] = _exit_process
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    first_rank: int = 0  # the pod's first rank: the process that holds this handle
    cards_per_pod: int | None = None  # ranks in this pod (None: the whole world)
    _closing: bool = False

    @property
    def ranks(self) -> range:
        """The ranks this handle starts."""
        return range(self.first_rank + 1, self.first_rank + (self.cards_per_pod or self.world_size))

    def start(self, make_args: Callable[[int], WorkerArgs]) -> None:
        for rank in self.ranks:
            proc = subprocess.Popen([sys.executable, "-P", "-c", _WORKER_ENTRY], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(make_args(rank)))
            proc.stdin.flush()
            self.processes.append(proc)
            threading.Thread(target=self._watch, args=(rank, proc), name=f"npuserve-rank{rank}-watch",
                             daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._closing:
            self.on_death(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}; the engine "
                          f"cannot go on without it and exits (its own log, above, says why)")

    def kill(self) -> None:
        """Ends the workers at once (rank 0 is exiting on a fatal error: a worker may be stopped, or stuck in a
        collective); SIGKILL ends a stopped process too."""
        self._closing = True
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()

    def stop(self, tell: Callable[[], None] | None) -> None:
        """Ends the workers: `tell` them (rank 0's STOP) and wait, killing any that do not stop in time; without
        `tell` (rank 0 failed while building and they wait in a collective for it), kill them at once."""
        self._closing = True  # before they exit: the watchers must not take it for a death
        if tell is not None:
            tell()
        for proc in self.processes:
            if tell is not None:
                try:
                    proc.wait(_JOIN_SECONDS)
                except subprocess.TimeoutExpired:
                    log.warning("tensor-parallel rank process %d did not stop; killing it", proc.pid)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


_WORKER_ENTRY = "from npuserve.engine.parallel.ranks import worker_entry; worker_entry()"


def worker_entry() -> None:
    """A worker process's start: its arguments from stdin, then a thread that exits when stdin ends."""
    stdin = sys.stdin.buffer
    args: WorkerArgs = pickle.load(stdin)

    def watch_parent() -> None:
        while stdin.read(1 << 16):
            pass
        _exit_process(f"the pod's first rank {args.rank - args.local_rank} is gone (pid {os.getppid()} now); "
                      f"rank {args.rank} exits")

    threading.Thread(target=watch_parent, name="npuserve-parent-watch", daemon=True).start()
    worker_main(args)


def worker_main(args: WorkerArgs) -> None:
    """A rank other than 0: binds its CPUs (before torch starts its threads), builds its slice of the model and its
    KV cache, then follows rank 0's steps."""
    from npuserve.engine.affinity import apply_cpu_binding

    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: "
                        "%(message)s", stream=sys.stderr)
    code = 0
    doing = ["while starting"]  # what this rank was doing, for its failure line
    try:
        apply_cpu_binding(rank=args.local_rank, world_size=args.per_pod)
        _follow(args, doing)
    except Exception as e:
        log.critical("tensor-parallel rank %d failed %s: %s: %s; it exits, and rank 0 with it", args.rank,
                     doing[0], type(e).__name__, e, exc_info=True)
        code = 1
    logging.shutdown()
    os._exit(code)  # not a normal exit: the stdin watcher thread is blocked in a read


def _follow(args: WorkerArgs, doing: list[str], on_built: Callable[[], None] | None = None) -> None:
    """Builds the rank, then runs rank 0's operations until its STOP; `on_built` once the rank is built."""
    import torch
    import torch.distributed as dist

    from npuserve.engine.affinity import rank_threads
    from npuserve.engine.parallel.step_message import Op
    from npuserve.engine.rank_runner import build_rank_runner
    from npuserve.mindie_config import MindIEConfig

    torch.set_num_threads(rank_threads(args.per_pod))  # after this rank's CPU binding
    config = MindIEConfig.from_dict(args.config, source="rank 0")
    built = build_rank_runner(config, args.model_dir, seed=args.seed, rank=args.rank,
                              init_method=args.init_method, env=args.env, num_kv_blocks=args.num_kv_blocks,
                              num_host_blocks=args.num_host_blocks, cards_per_pod=args.cards_per_pod)
    assert built.channel is not None
    if on_built is not None:
        on_built()
    progress = built.runner.progress
    while True:
        doing[0] = f"while waiting for rank 0's operation #{progress.number + 1}"
        msg = built.channel.receive()
        if msg.op is Op.STOP:
            break
        doing[0] = f"in {msg.op.name} #{progress.number + 1} (sent by rank 0)"
        built.runner.follow(msg)
    dist.destroy_process_group()
