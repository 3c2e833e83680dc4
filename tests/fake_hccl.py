"""A FAKE of HCCL as torch.distributed sees it, for tests: `import torch_npu` registers the "hccl" backend (the real
one in torch_npu's `torch_npu/distributed`), and this registers a stand-in under that name, whose collectives are
gloo's on the CPU (the fake torch_npu's "npu" device is the CPU, tests/fake_torch_npu.py).

What it checks is the environment CANN's HCCL reads when a rank joins (CANN's "Environment Variables" reference,
collective communication), and refuses a rank that real HCCL would fail or misroute with, with a message naming the
variable:
- HCCL_CONNECT_TIMEOUT, when set: whole seconds within 120..7200 (CANN's range; HCCL refuses the value otherwise);
- HCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, when set: each names a network interface this host has
  (HCCL_SOCKET_IFNAME takes a prefix, `=name` for an exact name and `^` for an exclusion list; GLOO_SOCKET_IFNAME
  exact names);
- when the world's ranks span several nodes (each rank says which node it is on through the world's store: the
  variable `NPUSERVE_FAKE_NODE`, the test's stand-in for a machine, else the host name), HCCL_IF_IP: set, an IPv4
  address, and one of this host's own (a socket binds to it). Between nodes HCCL's control sockets listen on that
  address; unset, HCCL picks an interface itself, which in a pod with several networks (the RoCE NICs beside the
  pod network) need not be the one the peer can reach.

What it cannot check: that the address routes to the other node, the RoCE NICs (HCCL's data plane between nodes),
HCCL's own timeouts, anything of the collectives' speed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tests.fake_npu_attention import FakeNPUError

BACKEND = "hccl"
NODE_ENV = "NPUSERVE_FAKE_NODE"  # which stand-in machine a process is on (tests), else the host name
CONNECT_TIMEOUT_RANGE_S = (120, 7200)  # CANN: HCCL_CONNECT_TIMEOUT, [120, 7200] seconds, default 120
_installed = False


def _interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def _check_ifname(variable: str, value: str, prefix_match: bool) -> None:
    names = _interfaces()
    spec = value.strip()
    if prefix_match and spec.startswith("^"):
        return  # an exclusion list names what not to use: nothing to find
    exact = not prefix_match or spec.startswith("=")
    for item in filter(None, (s.strip() for s in spec.lstrip("=").split(","))):
        found = item in names if exact else any(n.startswith(item) for n in names)
        if not found:
            raise FakeNPUError(f"{variable}={value!r}: this host has no network interface "
                               f"{'named' if exact else 'starting with'} {item!r} (it has {', '.join(names)})")


def check_environment(nodes: int) -> None:
    """Raises FakeNPUError where HCCL would not join as this rank's environment says; `nodes`: the machines the
    world spans."""
    timeout = os.environ.get("HCCL_CONNECT_TIMEOUT")
    if timeout is not None:
        lo, hi = CONNECT_TIMEOUT_RANGE_S
        if not timeout.isdigit() or not lo <= int(timeout) <= hi:
            raise FakeNPUError(f"HCCL_CONNECT_TIMEOUT={timeout!r}: HCCL takes whole seconds within {lo}..{hi}")
    if os.environ.get("HCCL_SOCKET_IFNAME"):
        _check_ifname("HCCL_SOCKET_IFNAME", os.environ["HCCL_SOCKET_IFNAME"], prefix_match=True)
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        _check_ifname("GLOO_SOCKET_IFNAME", os.environ["GLOO_SOCKET_IFNAME"], prefix_match=False)
    if nodes <= 1:
        return
    ip = os.environ.get("HCCL_IF_IP")
    if not ip:
        raise FakeNPUError(f"HCCL_IF_IP is not set, and this HCCL world spans {nodes} nodes: HCCL's control sockets "
                           "between nodes need the host address to listen on (the pod's IP)")
    try:
        ipaddress.IPv4Address(ip)
    except ValueError:
        raise FakeNPUError(f"HCCL_IF_IP={ip!r} is not an IPv4 address") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            raise FakeNPUError(f"HCCL_IF_IP={ip!r} is not an address of this host ({e})") from None


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    node = os.environ.get(NODE_ENV) or socket.gethostname()
    store.set(f"fake-hccl/node/{rank}", node)
    nodes = {store.get(f"fake-hccl/node/{r}").decode() for r in range(size)}
    check_environment(len(nodes))
    store.set(f"fake-hccl/joined/{rank}", "1")
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def install_fake_hccl() -> None:
    """Registers the fake "hccl" with torch.distributed (once per process: registrations cannot be undone)."""
    global _installed
    if not _installed:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
        _installed = True
