"""`npuserve operator`: runs the kopf operator.

The handlers (`npuserve.operator.handlers`) are a kopf plug-in: importing the module registers them. This command
loads them by module name, as `kopf run -m npuserve.operator.handlers` does, so the command line and the handlers
import nothing of each other; the Prometheus URL reaches them through kopf's `memo`.

`--leader-elect` (off by default, as in controller-runtime's scaffold; the chart turns it on): the process waits for
a coordination.k8s.io Lease and runs kopf only while it holds it (`leader.py`), so several replicas can run and one
acts. Off, the process acts at once: a local run or the e2e tests, one operator, no namespace to put a Lease in.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os

from npuserve.operator import leader
from npuserve.operator.names import MEMO_PROMETHEUS_URL, PROMETHEUS_URL_ENV

HANDLERS_MODULE = "npuserve.operator.handlers"


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    scope.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    parser.add_argument("--prometheus-url", default=os.environ.get(PROMETHEUS_URL_ENV),
                        help="Prometheus the autotune loop reads TTFT/TPOT from, e.g. http://prometheus:9090 "
                        f"(default: ${PROMETHEUS_URL_ENV}); without it, spec.autotune.enabled is reported and "
                        "nothing tunes")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--liveness-endpoint", help="e.g. http://0.0.0.0:8080/healthz (kopf's liveness probe; a "
                        "standby answers it too)")
    election = parser.add_argument_group("leader election (several replicas, one acting)")
    election.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=False,
                          help="act only while holding a coordination.k8s.io Lease; a standby waits for it "
                          "(default: off)")
    election.add_argument("--leader-election-id", default=leader.DEFAULT_LEASE_NAME, metavar="NAME",
                          help="the Lease's name (default: %(default)s)")
    election.add_argument("--leader-election-namespace", metavar="NS",
                          help=f"the Lease's namespace (default: ${leader.POD_NAMESPACE_ENV}, else the service "
                          "account's; required outside a cluster)")
    election.add_argument("--leader-elect-lease-duration", type=int, default=leader.LEASE_DURATION_S,
                          metavar="S", help="seconds a standby waits after the last renewal it saw before taking "
                          "the Lease (default: %(default)s)")
    election.add_argument("--leader-elect-renew-deadline", type=float, default=leader.RENEW_DEADLINE_S,
                          metavar="S", help="seconds the leader keeps acting without a successful renewal before "
                          "it exits (default: %(default)s)")
    election.add_argument("--leader-elect-retry-period", type=float, default=leader.RETRY_PERIOD_S, metavar="S",
                          help="seconds between tries to acquire or renew (default: %(default)s)")


def election_settings(args: argparse.Namespace, env: dict[str, str] | None = None,
                      sa_file: str = leader.SERVICE_ACCOUNT_NAMESPACE) -> leader.ElectionSettings:
    """The Lease and timings from the flags (ElectionError says what is wrong)."""
    namespace = args.leader_election_namespace or leader.default_namespace(env, sa_file)
    if not namespace:
        raise leader.ElectionError("--leader-election-namespace is required outside a cluster (no "
                                   f"${leader.POD_NAMESPACE_ENV}, no service account namespace)")
    return leader.ElectionSettings(
        lease_name=args.leader_election_id, namespace=namespace, identity=leader.identity(env),
        lease_duration_s=args.leader_elect_lease_duration, renew_deadline_s=args.leader_elect_renew_deadline,
        retry_period_s=args.leader_elect_retry_period)


def run(args: argparse.Namespace) -> int:
    import kopf

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":  # httpx says every request at info: each Prometheus query and engine PUT
        logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = None
    if args.leader_elect:
        try:
            settings = election_settings(args)
        except leader.ElectionError as e:
            logging.getLogger(__name__).error("leader election: %s", e)
            return 2
        leader.quiet_library(args.log_level == "debug")
    importlib.import_module(HANDLERS_MODULE)  # registers the handlers with kopf's default registry

    def operate() -> None:
        kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
                 liveness_endpoint=args.liveness_endpoint,
                 memo=kopf.Memo({MEMO_PROMETHEUS_URL: args.prometheus_url}))

    if settings is None:
        operate()
    else:
        leader.run_elected(settings, operate, args.liveness_endpoint)
    return 0
