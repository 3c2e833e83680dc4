"""Leader election (`leader.py`): the flags and durations, the holder identity, and the Lease protocol against an
in-memory Lease API: a standby waits while the Lease is held, takes a released one at once, and a leader that
cannot renew within the renew deadline is told it lost the Lease."""

from __future__ import annotations

import argparse
import copy
import json
import threading
import time
from typing import Any

import httpx
import pytest
import urllib3
from kubernetes import client

from npuserve.operator import leader, operator_cli


class FakeLeases:
    """CoordinationV1Api's Lease calls over one in-memory Lease, with resourceVersion checks (409 on a stale write)."""

    def __init__(self) -> None:
        self.lease: client.V1Lease | None = None
        self.version = 0
        self.down = False  # the API server unreachable
        self.lock = threading.Lock()

    def _check(self, kwargs: dict[str, Any]) -> None:
        assert kwargs.get("_request_timeout"), "every election call has a request timeout"
        if self.down:
            raise urllib3.exceptions.MaxRetryError(None, "/leases", "connection refused")  # type: ignore[arg-type]

    def read_namespaced_lease(self, name: str, namespace: str, **kwargs: Any) -> client.V1Lease:
        self._check(kwargs)
        with self.lock:
            if self.lease is None:
                missing = client.ApiException(status=404, reason="Not Found")
                missing.body = json.dumps({"kind": "Status", "code": 404})  # what the library reads
                raise missing
            return copy.deepcopy(self.lease)

    def create_namespaced_lease(self, namespace: str, body: client.V1Lease, **kwargs: Any) -> client.V1Lease:
        self._check(kwargs)
        with self.lock:
            if self.lease is not None:
                raise client.ApiException(status=409, reason="AlreadyExists")
            self.version += 1
            body.metadata = client.V1ObjectMeta(name="npuserve", namespace=namespace,
                                                resource_version=str(self.version))
            self.lease = copy.deepcopy(body)
            return copy.deepcopy(body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: client.V1Lease,
                                 **kwargs: Any) -> client.V1Lease:
        self._check(kwargs)
        with self.lock:
            assert self.lease is not None
            if body.metadata.resource_version != self.lease.metadata.resource_version:
                raise client.ApiException(status=409, reason="Conflict")
            self.version += 1
            body = copy.deepcopy(body)
            body.metadata.resource_version = str(self.version)
            self.lease = body
            return copy.deepcopy(body)

    @property
    def holder(self) -> str | None:
        return None if self.lease is None else self.lease.spec.holder_identity


@pytest.fixture
def leases(monkeypatch: pytest.MonkeyPatch) -> FakeLeases:
    fake = FakeLeases()
    monkeypatch.setattr(leader.client, "CoordinationV1Api", lambda *_: fake)
    return fake


def settings(who: str, **timings: Any) -> leader.ElectionSettings:
    return leader.ElectionSettings(lease_name="npuserve", namespace="ops", identity=who, **timings)


def elector(who: str, lost: list[str] | None = None, **timings: Any) -> leader.Elector:
    return leader.Elector(settings(who, **timings), client.ApiClient(),
                          on_lost=(lost.append if lost is not None else lambda m: None))


def test_defaults_are_controller_runtimes_and_bad_timings_are_refused_before_the_library_exits() -> None:
    s = settings("a")
    assert (s.lease_duration_s, s.renew_deadline_s, s.retry_period_s) == (15, 10, 2)
    assert leader.timing_problem(15, 10, 2) is None
    for bad, said in (((10, 10, 2), "must exceed the renew deadline"), ((15, 2.4, 2), "1.2 x the retry period"),
                      ((15, 10, 0.5), "at least 1 s"), ((15.5, 10, 2), "whole seconds")):
        assert said in (leader.timing_problem(*bad) or ""), bad
        with pytest.raises(leader.ElectionError):
            settings("a", lease_duration_s=bad[0], renew_deadline_s=bad[1], retry_period_s=bad[2])
    with pytest.raises(leader.ElectionError):
        leader.ElectionSettings(lease_name="npuserve", namespace="", identity="a")


def test_identity_is_the_pod_name_with_a_random_suffix_and_the_namespace_comes_from_the_pod(tmp_path: Any) -> None:
    a, b = leader.identity({"POD_NAME": "op-7d9-x"}), leader.identity({"POD_NAME": "op-7d9-x"})
    assert a.startswith("op-7d9-x_") and b.startswith("op-7d9-x_") and a != b  # a restarted container: a new holder
    assert leader.identity({}).split("_")[0]  # the host name outside a pod
    sa = tmp_path / "namespace"
    sa.write_text("npuserve-system\n")
    assert leader.default_namespace({"POD_NAMESPACE": "ops"}, str(sa)) == "ops"
    assert leader.default_namespace({}, str(sa)) == "npuserve-system"
    assert leader.default_namespace({}, str(tmp_path / "absent")) is None


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    operator_cli.configure(parser)
    return parser.parse_args(list(argv))


def test_the_flags_give_the_settings_and_outside_a_cluster_the_namespace_is_required(tmp_path: Any) -> None:
    off = _parse()
    assert off.leader_elect is False  # a local run acts at once; the chart passes --leader-elect
    args = _parse("--leader-elect", "--leader-election-id", "ops-lease", "--leader-elect-lease-duration", "20",
                  "--leader-elect-renew-deadline", "12", "--leader-elect-retry-period", "3")
    absent = str(tmp_path / "absent")
    with pytest.raises(leader.ElectionError, match="--leader-election-namespace is required"):
        operator_cli.election_settings(args, {}, absent)
    s = operator_cli.election_settings(args, {"POD_NAMESPACE": "ops", "POD_NAME": "op-0"}, absent)
    assert (s.lease_name, s.namespace, s.lease_duration_s, s.renew_deadline_s, s.retry_period_s) == (
        "ops-lease", "ops", 20, 12, 3)
    assert s.identity.startswith("op-0_")
    explicit = _parse("--leader-elect", "--leader-election-namespace", "other")
    assert operator_cli.election_settings(explicit, {"POD_NAMESPACE": "ops"}, absent).namespace == "other"
    with pytest.raises(leader.ElectionError):
        operator_cli.election_settings(_parse("--leader-elect", "--leader-elect-renew-deadline", "20"),
                                       {"POD_NAMESPACE": "ops"}, absent)


def test_a_standby_waits_while_the_lease_is_held_and_takes_a_released_one_at_once(leases: FakeLeases) -> None:
    a, b = elector("a"), elector("b")
    assert a.election.try_acquire_or_renew() and leases.holder == "a"
    assert not b.election.try_acquire_or_renew()  # held, not expired: b waits
    assert a.election.try_acquire_or_renew() and leases.holder == "a"  # a renews
    assert a.release()
    assert leases.holder is None and leases.lease is not None and leases.lease.spec.lease_duration_seconds == 1
    assert b.election.try_acquire_or_renew() and leases.holder == "b"  # no waiting for expiry
    assert not a.release() and leases.holder == "b"  # a no longer holds it: nothing to release


def test_an_unreachable_api_server_is_a_failed_attempt_not_an_exception(leases: FakeLeases) -> None:
    a = elector("a")
    leases.down = True
    assert a.election.try_acquire_or_renew() is False
    leases.down = False
    assert a.election.try_acquire_or_renew() is True


def test_a_leader_that_cannot_renew_within_the_deadline_is_told_it_lost(leases: FakeLeases) -> None:
    lost: list[str] = []
    a = elector("a", lost, lease_duration_s=4, renew_deadline_s=2.5, retry_period_s=1)
    a.acquire()
    a.start_renewing()
    time.sleep(1.5)
    assert lost == []  # renewing
    leases.down = True
    started = time.monotonic()
    while not lost and time.monotonic() - started < 10:
        time.sleep(0.05)
    # When, against the Lease's expiry, is the stepped-clock test below (no wall time asserted on a shared machine).
    assert lost and "renew" in lost[0], lost
    a.stop_renewing()


class SteppedClock:
    """The watchdog's clock, set by the test; counts its reads, so a test knows the watchdog has looked."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0
        self.read = threading.Condition()

    def __call__(self) -> float:
        with self.read:
            self.reads += 1
            self.read.notify_all()
            return self.now

    def looked_after(self, reads: int) -> None:
        """Wait until the watchdog read the clock twice more (one whole turn of its loop at this time)."""
        with self.read:
            assert self.read.wait_for(lambda: self.reads >= reads + 2, timeout=30), "the watchdog stopped looking"


def test_at_the_charts_timings_the_watchdog_stops_the_leader_before_a_standby_may_take_the_lease(
        leases: FakeLeases) -> None:
    """The library's renew loop alone may act past the lease duration at the defaults (its deadline counts from after
    a retry sleep): the watchdog must end the leader within the renew deadline of its last renewal, and so before
    a standby, counting the lease duration from the renewal it saw, can take the Lease."""
    lost: list[str] = []
    clock = SteppedClock()
    a = leader.Elector(settings("a"), client.ApiClient(), on_lost=lost.append, clock=clock)  # the chart's timings
    s = a.settings
    assert s.renew_deadline_s + leader.WATCHDOG_POLL_S < s.lease_duration_s
    a.lock.written = clock.now  # the last renewal; no renewal after it (the renew loop is not started)
    watchdog = threading.Thread(target=a._watch, daemon=True)
    watchdog.start()
    try:
        for since in (0.0, s.renew_deadline_s - 0.5, s.renew_deadline_s):
            clock.now = a.lock.written + since
            clock.looked_after(clock.reads)
            assert lost == [], since  # within the renew deadline: still leading
        # Past the renew deadline and still before the lease could expire for a standby: it has stopped.
        clock.now = a.lock.written + (s.renew_deadline_s + s.lease_duration_s) / 2
        watchdog.join(timeout=30)  # it returns once it has called the leader lost
        assert not watchdog.is_alive() and len(lost) == 1 and "past the renew deadline of 10 s" in lost[0], lost
    finally:
        a.stopping.set()
        watchdog.join(timeout=5)


def test_a_graceful_stop_stops_renewing_without_calling_it_lost(leases: FakeLeases) -> None:
    lost: list[str] = []
    a = elector("a", lost, lease_duration_s=4, renew_deadline_s=2.5, retry_period_s=1)
    a.acquire()
    a.start_renewing()
    time.sleep(0.5)
    assert a.release() and lost == [] and leases.holder is None
    time.sleep(3)
    assert lost == [] and leases.holder is None  # the watchdog and the renewal ended with it


def test_the_standby_answers_the_liveness_probe_while_it_polls_the_lease() -> None:
    alive = [True]
    health = leader.StandbyHealth("http://127.0.0.1:0/healthz", lambda: alive[0])
    try:
        url = f"http://127.0.0.1:{health.port}"
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        assert httpx.get(f"{url}/other", timeout=5).status_code == 404
        alive[0] = False
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 503
    finally:
        health.close()
