#!/usr/bin/env python3
"""Command line for the local cluster: `cluster.py build|up|down|status|env` (the Makefile's cluster-* targets).

Run it by path (`.venv/bin/python e2e/cluster/cluster.py up`), not with `-m` from the repository root: the root's
`operator/` folder would shadow the standard library module of that name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import localk8s

# What `npuserve operator` reads its Prometheus from when --prometheus-url is not given (operator/names.py).
PROMETHEUS_URL_ENV = "NPUSERVE_PROMETHEUS_URL"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "build", help="build/install every binary into the cache (Kubernetes, etcd, KWOK, Helm, Prometheus, LWS)"
    )
    sub.add_parser("up", help="start the cluster (builds on first use); says so if it is already running")
    sub.add_parser("down", help="stop exactly the processes `up` started")
    sub.add_parser("status", help="print what runs, as JSON; exit 1 if the cluster is not up")
    sub.add_parser("env", help="print `export KUBECONFIG=... NPUSERVE_PROMETHEUS_URL=...` for eval in a shell")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            started = time.monotonic()
            bins = localk8s.ensure_binaries(with_helm=True)
            for name, path in bins.__dict__.items():
                print(f"{name:24} {path}")
            print(f"ready in {time.monotonic() - started:.0f}s")
        elif args.command == "up":
            cluster = localk8s.up()
            print(f"export KUBECONFIG={cluster.kubeconfig}")
            print(f"export {PROMETHEUS_URL_ENV}={cluster.prometheus_url}")
        elif args.command == "down":
            stopped = localk8s.down()
            print("stopped: " + ", ".join(stopped) if stopped else "no cluster processes were running")
        elif args.command == "status":
            st = localk8s.status()
            print(json.dumps(st, indent=2))
            return 0 if st["running"] else 1
        elif args.command == "env":
            cdir = localk8s.state_dir()
            print(f"export KUBECONFIG={cdir / 'kubeconfig'}")
            url = cdir / "prometheus-url"
            if url.exists():
                print(f"export {PROMETHEUS_URL_ENV}={url.read_text().strip()}")
    except (RuntimeError, OSError) as exc:
        print(f"cluster.py {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
