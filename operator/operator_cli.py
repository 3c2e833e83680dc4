"""`npuserve operator`: runs the kopf operator (handlers in `npuserve.operator.handlers`)."""

from __future__ import annotations

import argparse
import logging
import os

PROMETHEUS_URL_ENV = "NPUSERVE_PROMETHEUS_URL"  # --prometheus-url's default (the e2e tests' in-process operator)


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    scope.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    parser.add_argument("--prometheus-url", default=os.environ.get(PROMETHEUS_URL_ENV),
                        help="Prometheus the autotune loop reads TTFT/TPOT from, e.g. http://prometheus:9090 "
                        "(default: $NPUSERVE_PROMETHEUS_URL); without it, spec.autotune.enabled is reported and "
                        "nothing tunes")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--liveness-endpoint", help="e.g. http://0.0.0.0:8080/healthz (kopf's liveness probe)")


def run(args: argparse.Namespace) -> int:
    import kopf

    from npuserve.operator import handlers

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers.PROMETHEUS_URL = args.prometheus_url
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness_endpoint)
    return 0
