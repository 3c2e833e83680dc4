"""`npuserve operator`: runs the kopf operator.

The handlers (`npuserve.operator.handlers`) are a kopf plug-in: importing the module registers them. This command
loads them by module name, as `kopf run -m npuserve.operator.handlers` does, so the command line and the handlers
import nothing of each other; the Prometheus URL reaches them through kopf's `memo`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os

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
    parser.add_argument("--liveness-endpoint", help="e.g. http://0.0.0.0:8080/healthz (kopf's liveness probe)")


def run(args: argparse.Namespace) -> int:
    import kopf

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    importlib.import_module(HANDLERS_MODULE)  # registers the handlers with kopf's default registry
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness_endpoint, memo=kopf.Memo({MEMO_PROMETHEUS_URL: args.prometheus_url}))
    return 0
