"""The `npuserve` command: one entry, a subcommand per part of the system (docs/architecture.md#the-command-line).

Each subcommand lives in the module that owns it and exposes `configure(parser)` and `run(args) -> int`. Only the
module of the subcommand on the command line is imported (`--help` imports none), so `npuserve plan` runs where
only the operator's dependencies are installed, and this package names the engine's modules without importing them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str


COMMANDS: tuple[Command, ...] = (
    Command("serve", "run the engine's HTTP server (OpenAI, TGI, /metrics)", "npuserve.engine.server.serve_cli"),
    Command("generate", "offline generation from a model folder, one JSON line per prompt",
            "npuserve.engine.generate_cli"),
    Command("plan", "print the plan the operator would compute (MindIE tuning guide, automated)",
            "npuserve.operator.plan_cli"),
    Command("bench", "the load generator (MindIE Benchmark, vLLM bench serve and perf-scheme reports)",
            "npuserve.loadgen.bench_cli"),
    Command("simulate", "run the scheduler on the simulated cost-model runner",
            "npuserve.sim.simulate_cli"),
    Command("operator", "run the kopf operator", "npuserve.operator.operator_cli"),
    Command("tune", "run the tuner (--simulate: against the simulated engine)", "npuserve.sim.tune_cli"),
    Command("model", "model folders: create-dummy writes an HF-format folder with random weights",
            "npuserve.engine.model_cli"),
    Command("doctor", "preflight of an Ascend host or the engine image: driver, CANN, torch_npu, NNAL, each op on the "
            "card", "npuserve.engine.doctor_cli"),
)


def build_parser(only: str | None = None, *, every: bool = False) -> argparse.ArgumentParser:
    """The parser; the subcommand `only` (or `every` one) gets its module's arguments, the others just a name."""
    parser = argparse.ArgumentParser(
        prog="npuserve", description="LLM inference on Kubernetes clusters of Ascend NPUs."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if every or command.name == only:
            module = importlib.import_module(command.module)
            module.configure(p)
            p.set_defaults(func=module.run)
    return parser


def _chosen(argv: Sequence[str]) -> str | None:
    names = {c.name for c in COMMANDS}
    return next((arg for arg in argv if arg in names), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_chosen(argv))
    args = parser.parse_args(argv)
    if args.version:
        from npuserve import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
