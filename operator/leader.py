"""Leader election for `npuserve operator --leader-elect`: one replica holds a coordination.k8s.io/v1 Lease and
runs the operator (kopf's handlers and the autotune loop); the others wait for the Lease.

Built on the official client's `kubernetes.leaderelection` (LeaderElection over a LeaseLock), with what it leaves
out added here, as controller-runtime does it:
- the standby blocks in the main thread until it holds the Lease, and only then runs the operator (kopf must run
  in the main thread: it installs the signal handlers);
- the leader renews from a thread; if no renewal succeeded for `renew_deadline` seconds, or the Lease went to
  another, the process exits at once with EXIT_LOST (`os._exit`: no thread gets to act again). The deadline is
  shorter than the lease duration, and a standby counts the duration from when it saw the last renewal, so the
  old leader has stopped before a new one can start;
- every API call of the election has a request timeout, and a network error counts as a failed attempt (the
  library lets anything but an ApiException escape its loops);
- on a graceful stop the leader releases the Lease (holderIdentity cleared, leaseDurationSeconds 1, as client-go's
  ReleaseOnCancel): a standby takes it at its next retry instead of waiting for it to expire;
- while a standby waits, a small HTTP server answers the liveness probe on the endpoint kopf's will take over
  (alive while the Lease is polled); it is closed before the operator starts.
"""

from __future__ import annotations

import datetime
import http.server
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client, config
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
POD_NAME_ENV, POD_NAMESPACE_ENV = "POD_NAME", "POD_NAMESPACE"
DEFAULT_LEASE_NAME = "npuserve-operator"
# controller-runtime's defaults: a dead leader's Lease is taken over 15-19 s after its last renewal.
LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S = 15, 10, 2
JITTER = 1.2  # electionconfig.Config's: renew_deadline must exceed retry_period * 1.2
EXIT_LOST = 3  # the exit code of a leader that lost its Lease
WATCHDOG_POLL_S = 0.25  # how often the leader's watchdog looks at its last renewal
# A standby is alive while its last look at the Lease is this recent (at least, or 5 retry periods).
STANDBY_STALE_S = 30.0


class ElectionError(ValueError):
    """Bad leader-election settings (said before electionconfig.Config would sys.exit on them)."""


@dataclass(frozen=True)
class ElectionSettings:
    lease_name: str
    namespace: str
    identity: str
    lease_duration_s: int = LEASE_DURATION_S
    renew_deadline_s: float = RENEW_DEADLINE_S
    retry_period_s: float = RETRY_PERIOD_S

    def __post_init__(self) -> None:
        problem = timing_problem(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)
        if problem:
            raise ElectionError(problem)
        if not self.lease_name or not self.namespace or not self.identity:
            raise ElectionError("the Lease needs a name, a namespace and a holder identity")

    @property
    def request_timeout_s(self) -> float:
        """One API call of the election: a hung call must not outlast a retry period much."""
        return max(1.0, self.retry_period_s)


def timing_problem(lease_duration_s: float, renew_deadline_s: float, retry_period_s: float) -> str | None:
    """Why these durations cannot work (electionconfig.Config's rules, which it enforces with sys.exit), or None."""
    if retry_period_s < 1:
        return f"the retry period must be at least 1 s, not {retry_period_s:g}"
    if renew_deadline_s <= JITTER * retry_period_s:
        return (f"the renew deadline ({renew_deadline_s:g} s) must exceed {JITTER:g} x the retry period "
                f"({retry_period_s:g} s)")
    if lease_duration_s <= renew_deadline_s:
        return (f"the lease duration ({lease_duration_s:g} s) must exceed the renew deadline "
                f"({renew_deadline_s:g} s): a leader stops acting before the others may take its Lease")
    if lease_duration_s != int(lease_duration_s):
        return f"the lease duration is whole seconds (Lease.spec.leaseDurationSeconds), not {lease_duration_s:g}"
    return None


def identity(env: dict[str, str] | None = None) -> str:
    """The holder identity: the pod's name (downward API), else the host's, with a random suffix (client-go's
    hostname_uuid), so a restarted container of the same pod is a new holder."""
    env = dict(os.environ) if env is None else env
    return f"{env.get(POD_NAME_ENV) or socket.gethostname()}_{secrets.token_hex(4)}"


def default_namespace(env: dict[str, str] | None = None, sa_file: str = SERVICE_ACCOUNT_NAMESPACE) -> str | None:
    """The Lease's namespace when no flag names one: the pod's (downward API), else the service account's."""
    env = dict(os.environ) if env is None else env
    if env.get(POD_NAMESPACE_ENV):
        return env[POD_NAMESPACE_ENV]
    try:
        with open(sa_file) as f:
            return f.read().strip() or None
    except OSError:
        return None


def api_client() -> client.ApiClient:
    """The cluster's API, configured as `kube.Kube` does: in-cluster, else KUBECONFIG as it is now."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
    return client.ApiClient()


class _TimedLeases:
    """The three Lease calls LeaseLock makes, each with a request timeout; a transport error becomes an
    ApiException, which the library counts as a failed attempt (anything else escapes its loops)."""

    def __init__(self, api: client.CoordinationV1Api, timeout_s: float) -> None:
        self.api, self.timeout_s = api, timeout_s

    def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, _request_timeout=self.timeout_s, **kwargs)
        except client.ApiException:
            raise
        except Exception as e:  # urllib3's timeouts and connection errors, OSError
            raise client.ApiException(status=0, reason=f"{type(e).__name__}: {e}") from e

    def read_namespaced_lease(self, name: str, namespace: str) -> Any:
        return self._call(self.api.read_namespaced_lease, name, namespace)

    def create_namespaced_lease(self, namespace: str, body: Any) -> Any:
        return self._call(self.api.create_namespaced_lease, namespace, body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any) -> Any:
        return self._call(self.api.replace_namespaced_lease, name=name, namespace=namespace, body=body)


class _Lock(LeaseLock):
    """LeaseLock over our API client, remembering when the Lease was last read and last written by us."""

    def __init__(self, settings: ElectionSettings, api: client.ApiClient,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(settings.lease_name, settings.namespace, settings.identity)  # type: ignore[no-untyped-call]
        self.api_instance = _TimedLeases(client.CoordinationV1Api(api),  # type: ignore[assignment]
                                         settings.request_timeout_s)
        self.clock = clock
        self.polled = clock()
        self.written: float | None = None

    def get(self, name: str, namespace: str) -> Any:
        found = super().get(name, namespace)  # type: ignore[no-untyped-call]
        self.polled = self.clock()
        return found

    # A write counts from when it was sent: the renew deadline then ends no later than the server's renewal + the
    # deadline, before any standby (which counts from when it saw the renewal) can take the Lease.

    def create(self, name: str, namespace: str, election_record: Any) -> bool:
        return self._written_if(lambda: super(_Lock, self).create(  # type: ignore[no-untyped-call]
            name, namespace, election_record))

    def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        return self._written_if(lambda: super(_Lock, self).update(  # type: ignore[no-untyped-call]
            name, namespace, updated_record))

    def _written_if(self, write: Callable[[], Any]) -> bool:
        sent = self.clock()
        ok = bool(write())
        if ok:
            self.written = sent
        return ok


def _exit_lost(message: str) -> None:
    log.critical("%s: exiting so that no two operators act at once", message)
    logging.shutdown()
    os._exit(EXIT_LOST)


class Elector:
    """One candidate: `acquire` (blocks), then `start_renewing`; `release` on a graceful stop. `clock`: the
    watchdog's (tests drive it)."""

    def __init__(self, settings: ElectionSettings, api: client.ApiClient,
                 on_lost: Callable[[str], None] = _exit_lost, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.api = api
        self.clock = clock
        self.lock = _Lock(settings, api, clock)
        self.on_lost = on_lost
        self.stopping = threading.Event()  # set: renewing stops (the library's "leading_failed")
        cfg = electionconfig.Config(  # type: ignore[no-untyped-call]
            lock=self.lock, lease_duration=settings.lease_duration_s, renew_deadline=settings.renew_deadline_s,
            retry_period=settings.retry_period_s, onstarted_leading=lambda: None, onstopped_leading=lambda: None)
        self.election = leaderelection.LeaderElection(cfg)  # type: ignore[no-untyped-call]
        self.threads: list[threading.Thread] = []

    def acquire(self) -> None:
        """Block until this candidate holds the Lease."""
        log.info("%s: waiting for the Lease %s/%s", self.settings.identity, self.settings.namespace,
                 self.settings.lease_name)
        self.election.acquire()  # type: ignore[no-untyped-call]
        log.info("%s: holds the Lease %s/%s: leading", self.settings.identity, self.settings.namespace,
                 self.settings.lease_name)

    def alive(self) -> bool:
        """A standby is alive while it keeps polling the Lease."""
        return self.clock() - self.lock.polled < max(STANDBY_STALE_S, 5 * self.settings.retry_period_s)

    def start_renewing(self) -> None:
        """Renew from a thread; a watchdog calls `on_lost` once no renewal succeeded for the renew deadline."""
        if self.lock.written is None:
            self.lock.written = self.clock()
        self.threads = [threading.Thread(target=self._renew, name="leader-election", daemon=True),
                        threading.Thread(target=self._watch, name="leader-watchdog", daemon=True)]
        for t in self.threads:
            t.start()

    def _renew(self) -> None:
        try:
            self.election.renew_loop(self.stopping)  # type: ignore[no-untyped-call]
        except Exception:
            log.exception("renewing the Lease failed")
        if not self.stopping.is_set():
            self.on_lost(f"{self.settings.identity}: lost the Lease {self.settings.namespace}/"
                         f"{self.settings.lease_name} (not renewed within {self.settings.renew_deadline_s:g} s)")

    def _watch(self) -> None:
        # Not the library's loop alone: it counts its renew deadline from after its retry sleep and sleeps again
        # after a failed try, so at the defaults it may act about 16 s after the last renewal, past the 15 s lease.
        while not self.stopping.wait(WATCHDOG_POLL_S):
            since = self.clock() - (self.lock.written or 0.0)
            if since > self.settings.renew_deadline_s:
                self.on_lost(f"{self.settings.identity}: the Lease {self.settings.namespace}/"
                             f"{self.settings.lease_name} was last renewed {since:.1f} s ago, past the renew "
                             f"deadline of {self.settings.renew_deadline_s:g} s")
                return

    def stop_renewing(self) -> None:
        self.stopping.set()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout=self.settings.retry_period_s + 2 * self.settings.request_timeout_s + 1)

    def release(self) -> bool:
        """Give the Lease up if we hold it: holderIdentity cleared, leaseDurationSeconds 1 (client-go's
        ReleaseOnCancel). A concurrent change (409) means someone else wrote it: nothing to release then."""
        self.stop_renewing()
        leases = _TimedLeases(client.CoordinationV1Api(self.api), self.settings.request_timeout_s)
        try:
            lease = leases.read_namespaced_lease(self.settings.lease_name, self.settings.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.settings.identity:
                return False
            now = datetime.datetime.now(datetime.UTC)
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.acquire_time = lease.spec.renew_time = now
            leases.replace_namespaced_lease(self.settings.lease_name, self.settings.namespace, lease)
        except client.ApiException as e:
            log.warning("could not release the Lease %s/%s: %s", self.settings.namespace,
                        self.settings.lease_name, e.reason)
            return False
        log.info("%s: released the Lease %s/%s", self.settings.identity, self.settings.namespace,
                 self.settings.lease_name)
        return True


class StandbyHealth:
    """The liveness endpoint while a standby waits: 200 on its path while `alive()`, 503 otherwise."""

    def __init__(self, endpoint: str, alive: Callable[[], bool]) -> None:
        url = urlsplit(endpoint)
        path = url.path or "/"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.path.split("?")[0] == path and alive()
                body = b'{"standby": true}\n' if ok else b'{"standby": true, "alive": false}\n'
                self.send_response(200 if ok else (404 if self.path.split("?")[0] != path else 503))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((url.hostname or "0.0.0.0", url.port or 80), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="standby-health", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def run_elected(settings: ElectionSettings, operate: Callable[[], None], liveness_endpoint: str | None = None,
                api: client.ApiClient | None = None) -> None:
    """Wait for the Lease (answering the liveness probe meanwhile), then run `operate` in this thread while a
    thread renews; when `operate` returns, release the Lease. Losing it ends the process (`_exit_lost`)."""
    elector = Elector(settings, api or api_client())
    health = StandbyHealth(liveness_endpoint, elector.alive) if liveness_endpoint else None
    try:
        elector.acquire()
    finally:
        if health is not None:
            health.close()  # kopf's own endpoint takes the port
    elector.start_renewing()
    try:
        operate()
    finally:
        elector.release()


def quiet_library(debug: bool) -> None:
    """The library logs every attempt at info ("yet to finish lease_duration ..."): only at debug here."""
    logging.getLogger("leaderelection").setLevel(logging.DEBUG if debug else logging.WARNING)
