"""One pod of a tensor-parallel group joining its world over the FAKE hccl (tests/fake_hccl.py) under the FAKE
torch_npu, as `npuserve serve --nnodes N --node-rank K` does before it loads anything: the group link
(engine/parallel/group.py), then `comm.connect` with the npu backend's `dist_backend`, one rank per pod, then one
all-reduce. Prints the rank's result as a JSON line; exits 1 with the error where the join fails.

Arguments: node_rank nnodes host master_port connect_timeout_s (tests/engine/test_npu_group_fake.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests.` imports

import pytest
import torch
import torch.distributed as dist

from tests.fake_hccl import install_fake_hccl
from tests.fake_torch_npu import install_fake_torch_npu

LEADER = "127.0.0.2"


def main() -> None:
    node_rank, nnodes, host, port, timeout = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                              float(sys.argv[5]))
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s pod{node_rank} %(name)s: %(message)s")
    install_fake_torch_npu(pytest.MonkeyPatch())
    install_fake_hccl()  # what `import torch_npu` does
    from npuserve.engine.backends.npu import NPUBackend
    from npuserve.engine.parallel.comm import connect
    from npuserve.engine.parallel.group import GroupLayout, LeaderGroup, WorkerLink

    layout = GroupLayout(nnodes, nnodes, node_rank)
    leader = None
    if node_rank == 0:
        leader = LeaderGroup(layout, "m", host, port, timeout)
        leader.wait_for_pods()
        leader.start_store()
        tp = connect(0, nnodes, None, NPUBackend.dist_backend, store=leader.store)
    else:
        link = WorkerLink(layout, "m", LEADER, port, timeout, source=host)
        tp = connect(layout.first_rank, nnodes, link.connect(), NPUBackend.dist_backend)
    x = torch.tensor([float(tp.rank + 1)])
    tp.all_reduce(x)
    print(json.dumps({"rank": tp.rank, "sum": x.item(), "backend": str(dist.get_backend())}), flush=True)
    if leader is not None:
        leader.stopping()  # a clean end: the pods' links closing after this are no death
    dist.barrier(group=tp.control)
    dist.destroy_process_group()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
