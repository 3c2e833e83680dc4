"""The process kubelet's pure parts that make a pod look like a container: Kubernetes' `$(VAR)` expansion of
command, args and env, the pod's hosts file (the kubelet's own lines and the cluster DNS records of pods behind
headless Services), and the launch wrapper that gives a process that hosts file and the pod's hostname. No cluster
needed; the wrapper's test skips where `unshare` cannot make mount and UTS namespaces."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import kubelet
import pytest
from kubelet import DnsRecord, dns_records, expand, hosts_file, namespace_wrapper, pod_hostname, wrap, write_in_place
from kubernetes import client


# ---- $(VAR) -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("--nnodes $(LWS_GROUP_SIZE) --node-rank $(LWS_WORKER_INDEX)", "--nnodes 2 --node-rank 1"),
        ("$(LWS_LEADER_ADDRESS):29500", "lws-0.lws.ns:29500"),
        ("$$(LWS_GROUP_SIZE)", "$(LWS_GROUP_SIZE)"),  # escaped
        ("$$", "$"),
        ("a$$b", "a$b"),
        ("$(UNKNOWN)", "$(UNKNOWN)"),  # left as written
        ("$(", "$("),
        ("x$(LWS_GROUP_SIZE", "x$(LWS_GROUP_SIZE"),  # no closing parenthesis
        ("$HOME and ${HOME}", "$HOME and ${HOME}"),  # not references
        ("trailing $", "trailing $"),
        ("$()", "$()"),
        ("$(LWS_GROUP_SIZE)$(LWS_WORKER_INDEX)", "21"),
        ("", ""),
    ],
)
def test_expand_like_the_kubelet(value: str, expected: str) -> None:
    env = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "lws-0.lws.ns"}
    assert expand(value, env) == expected


def test_expand_takes_the_first_context_that_has_the_name() -> None:
    assert expand("$(A)-$(B)", {"A": "1"}, {"A": "2", "B": "3"}) == "1-3"


# ---- names -------------------------------------------------------------------------------------------------------
def _pod(
    name: str,
    ip: str | None,
    *,
    hostname: str | None = None,
    subdomain: str | None = None,
    ns: str = "ns",
    labels: dict[str, str] | None = None,
    ready: bool = False,
    deleting: bool = False,
) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name,
            namespace=ns,
            labels=labels or {},
            deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None,
        ),
        spec=client.V1PodSpec(containers=[], hostname=hostname, subdomain=subdomain),
        status=client.V1PodStatus(
            pod_ip=ip, conditions=[client.V1PodCondition(type="Ready", status="True" if ready else "False")]
        ),
    )


def _service(name: str, *, ns: str = "ns", headless: bool = True, not_ready: bool = True) -> client.V1Service:
    return client.V1Service(
        metadata=client.V1ObjectMeta(name=name, namespace=ns),
        spec=client.V1ServiceSpec(
            cluster_ip="None" if headless else "10.0.0.9",
            selector={"leaderworkerset.sigs.k8s.io/name": name},
            publish_not_ready_addresses=not_ready,
        ),
    )


def test_pod_hostname_and_domain() -> None:
    assert pod_hostname(_pod("lws-0", "127.1.0.5", hostname="lws-0", subdomain="lws")) == (
        "lws-0",
        "lws.ns.svc.cluster.local",
    )
    assert pod_hostname(_pod("web-abc", "127.1.0.6")) == ("web-abc", None)
    long = "a" * 62 + "-b"
    assert pod_hostname(_pod(long, "127.1.0.7")) == ("a" * 62, None)  # cut to 63, trailing '-' dropped


def test_dns_records_are_the_pods_behind_headless_services() -> None:
    lws = {"leaderworkerset.sigs.k8s.io/name": "lws"}
    strict = {"leaderworkerset.sigs.k8s.io/name": "strict"}
    pods = [
        _pod("lws-0-1", "127.1.0.6", hostname="lws-0-1", subdomain="lws", labels=lws),
        _pod("lws-0", "127.1.0.5", hostname="lws-0", subdomain="lws", labels=lws),
        _pod("no-ip", None, hostname="no-ip", subdomain="lws", labels=lws),
        _pod("going", "127.1.0.8", hostname="going", subdomain="lws", labels=lws, deleting=True),
        _pod("other-labels", "127.1.0.9", hostname="other-labels", subdomain="lws"),
        _pod("no-hostname", "127.1.0.10", subdomain="lws", labels=lws),
        _pod("no-service", "127.1.0.11", hostname="no-service", subdomain="missing", labels=lws),
        _pod("elsewhere", "127.1.0.12", hostname="elsewhere", subdomain="lws", ns="other", labels=lws),
        _pod("clusterip", "127.1.0.13", hostname="clusterip", subdomain="plain", labels={"x": "y"}),
        _pod("unready", "127.1.0.14", hostname="unready", subdomain="strict", labels=strict),
        _pod("ready", "127.1.0.15", hostname="ready", subdomain="strict", labels=strict, ready=True),
    ]  # fmt: skip
    services = [_service("lws"), _service("plain", headless=False), _service("strict", not_ready=False)]
    assert dns_records(pods, services) == [
        DnsRecord("127.1.0.5", "lws-0", "lws", "ns"),
        DnsRecord("127.1.0.6", "lws-0-1", "lws", "ns"),
        DnsRecord("127.1.0.15", "ready", "strict", "ns"),
    ]


def test_hosts_file_of_a_pod_with_a_subdomain() -> None:
    records = [DnsRecord("127.1.0.5", "lws-0", "lws", "ns"), DnsRecord("127.1.0.6", "lws-0-1", "lws", "ns")]
    assert hosts_file("127.1.0.6", "lws-0-1", "lws.ns.svc.cluster.local", records) == (
        "# Kubernetes-managed hosts file.\n"
        "127.0.0.1\tlocalhost\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        "fe00::0\tip6-localnet\n"
        "fe00::0\tip6-mcastprefix\n"
        "fe00::1\tip6-allnodes\n"
        "fe00::2\tip6-allrouters\n"
        "127.1.0.6\tlws-0-1.lws.ns.svc.cluster.local\tlws-0-1\n"
        "\n"
        "# Cluster DNS records (the process kubelet's stand-in for cluster DNS).\n"
        "127.1.0.5\tlws-0.lws.ns.svc.cluster.local\tlws-0.lws.ns.svc\tlws-0.lws.ns\n"
        "127.1.0.6\tlws-0-1.lws.ns.svc.cluster.local\tlws-0-1.lws.ns.svc\tlws-0-1.lws.ns\n"
    )


def test_hosts_file_of_a_plain_pod_with_host_aliases() -> None:
    assert hosts_file("127.1.0.7", "web-abc", None, [], [("10.1.2.3", ["foo.local", "bar.local"])]) == (
        kubelet.HOSTS_HEADER
        + "127.1.0.7\tweb-abc\n"
        + "\n# Entries added by HostAliases.\n"
        + "10.1.2.3\tfoo.local\tbar.local\n"
    )


def test_write_in_place_keeps_the_inode(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    write_in_place(path, "a much longer first content\n")
    inode = path.stat().st_ino
    write_in_place(path, "short\n")
    assert path.read_text() == "short\n"
    assert path.stat().st_ino == inode


# ---- the launch wrapper ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wrapper(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    prefix = namespace_wrapper(tmp_path_factory.mktemp("probe"))
    if prefix is None:
        pytest.skip("unshare cannot make mount and UTS namespaces on this machine (the kubelet logs a warning)")
    return prefix


def test_wrapped_process_resolves_the_pods_names(wrapper: list[str], tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    records = [DnsRecord("127.1.0.5", "lws-0", "lws", "ns"), DnsRecord("127.1.0.6", "lws-0-1", "lws", "ns")]
    hosts.write_text(hosts_file("127.1.0.6", "lws-0-1", "lws.ns.svc.cluster.local", records))
    out = subprocess.run(
        wrap(wrapper, hosts, "lws-0-1", ["getent", "hosts", "lws-0.lws.ns"]), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["127.1.0.5", "lws-0.lws.ns.svc.cluster.local", "lws-0.lws.ns.svc", "lws-0.lws.ns"]
    # getaddrinfo, the hostname, and the PID: the process the kubelet records is the one that runs the command.
    code = (
        "import os, socket; print(os.getpid(), socket.gethostname(), socket.gethostbyname(socket.gethostname()),"
        " socket.getaddrinfo('lws-0.lws.ns.svc.cluster.local', 29500)[0][4][0])"
    )
    proc = subprocess.Popen(wrap(wrapper, hosts, "lws-0-1", [sys.executable, "-c", code]), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert stdout.split() == [str(proc.pid), "lws-0-1", "127.1.0.6", "127.1.0.5"]


def test_wrapped_process_sees_the_hosts_file_rewritten_in_place(wrapper: list[str], tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    write_in_place(hosts, hosts_file("127.1.0.5", "lws-0", "lws.ns.svc.cluster.local", []))
    code = (
        "import socket, sys, time\n"
        "deadline = time.monotonic() + 20\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        "        print(socket.gethostbyname('lws-0-1.lws.ns'), flush=True); sys.exit(0)\n"
        "    except OSError:\n"
        "        time.sleep(0.05)\n"
        "sys.exit(1)\n"
    )
    proc = subprocess.Popen(wrap(wrapper, hosts, "lws-0", [sys.executable, "-c", code]), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    time.sleep(0.5)  # the worker has no record yet
    assert proc.poll() is None
    write_in_place(hosts, hosts_file("127.1.0.5", "lws-0", "lws.ns.svc.cluster.local", [
        DnsRecord("127.1.0.5", "lws-0", "lws", "ns"), DnsRecord("127.1.0.6", "lws-0-1", "lws", "ns")
    ]))  # fmt: skip
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert stdout.strip() == "127.1.0.6"


def test_without_a_wrapper_the_command_runs_as_it_is(tmp_path: Path) -> None:
    assert wrap(None, tmp_path / "hosts", "h", ["npuserve", "serve"]) == ["npuserve", "serve"]
