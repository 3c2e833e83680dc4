"""The collectives a tensor-parallel model makes: one all-reduce after each row-parallel projection (and the
vocab-parallel embedding), and the logits gather to rank 0, the only rank that samples.

`connect` joins the world (every rank, from `rank_runner`); rank 0 makes the world's store first (`master_store`).
`SINGLE_RANK` is the world of one: every call is the identity, so the model's code has no `if world_size > 1`.
The step messages (engine/parallel/step_message.py) go over a separate gloo group on the host (`control`): the
device group (nccl, hccl) carries only tensors the model computes, and an idle server does not hold a device
collective open between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from npuserve.engine.parallel.layout import TPLayout

# Long on purpose: an idle server waits between steps as long as it likes; liveness is the rank watchers' job
# (parallel/ranks.py) and the step watchdog's.
COLLECTIVE_TIMEOUT = timedelta(days=365)


def master_store(host: str, world_size: int, timeout: timedelta = COLLECTIVE_TIMEOUT) -> tuple[Any, int]:
    """The world's TCPStore, bound by rank 0 on an ephemeral port before any other rank starts, and held from then
    on: a port found free and bound later can be taken in between, and the engine would not start. Returns the
    store as rank 0 passes it to `connect`, and its port; the other ranks join through `tcp://HOST:PORT`, and torch
    puts such a rank's keys under the prefix "default_pg" (distributed_c10d.init_process_group), so rank 0's store
    carries the same prefix."""
    store = dist.TCPStore(host, 0, world_size=world_size, is_master=True, timeout=timeout,  # type: ignore[attr-defined]
                          wait_for_workers=False)
    return dist.PrefixStore("default_pg", store), int(store.port)  # type: ignore[attr-defined]


@dataclass(slots=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    device_group: Any = None  # dist.ProcessGroup of the all-reduces (None: the default group)
    control: Any = None  # the gloo group the step messages travel on

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather_logits(self, local: torch.Tensor, layout: TPLayout) -> torch.Tensor | None:
        """Each rank's `(rows, vocab_rows)` logits -> the whole `(rows, vocab_size)` on rank 0; None elsewhere."""
        if self.world_size == 1:
            return local[:, : layout.vocab_size]
        local = local.contiguous()
        pieces = [torch.empty_like(local) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(local, pieces, dst=0, group=self.device_group)
        if pieces is None:
            return None
        return torch.cat(pieces, dim=-1)[:, : layout.vocab_size]


SINGLE_RANK = TensorParallel()


def connect(rank: int, world_size: int, init_method: str | None, dist_backend: str, store: Any = None,
            ) -> TensorParallel:
    """Joins the world through `init_method`, or through `store` (the leader of a group of pods made it on an
    ephemeral port, engine/parallel/group.py); returns the `TensorParallel` of this rank."""
    if store is not None:
        dist.init_process_group(dist_backend, store=store, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group(dist_backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank=rank, world_size=world_size, device_group=None, control=control)
