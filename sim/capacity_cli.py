"""`npuserve plan --target-users N | --target-rate R`: capacity in cards, as a table or JSON (sim/capacity.py).

`npuserve plan` imports this module only when a target is given, so a plain `npuserve plan` needs no simulator.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import ValidationError

from npuserve.planning.api import InferenceServiceSpec

from .capacity import Candidate, CapacityAnswer, search, slo_of
from .cost_model import ENGINE_PROFILES


def _per_instance(c: Candidate, unit: str) -> str:
    return "" if c.per_instance is None else f"{c.per_instance:.3g} {unit}"


def _as_dict(c: Candidate) -> dict[str, Any]:
    return {"accelerator": c.accelerator, "worldSize": c.world_size, "verdict": c.verdict, "why": c.why,
            "perInstance": c.per_instance, "instances": c.instances, "cards": c.cards, "nodes": c.nodes,
            "headroom": c.headroom, "allReduceShareOfDecodeStep": c.comm_share, "source": c.source,
            "probes": [{"load": load, "meets": ok} for load, ok in c.probes]}


def answer_json(answer: CapacityAnswer) -> dict[str, Any]:
    return {"target": {"users" if answer.target == "users" else "requestsPerSecond": answer.value},
            "slo": answer.slo.model_dump(exclude_none=True),
            "winner": None if answer.winner is None else _as_dict(answer.winner),
            "candidates": [_as_dict(c) for c in answer.candidates]}


def print_answer(answer: CapacityAnswer) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    unit = "users" if answer.target == "users" else "req/s"
    bounds = ", ".join(f"{k} {v:g} ms" for k, v in (("TTFT", answer.slo.ttftMs), ("TPOT", answer.slo.tpotMs))
                       if v is not None)
    table = Table(title=f"npuserve plan: cards for {answer.value:g} {unit} under {bounds} ({answer.slo.statistic})")
    for name, justify in (("layout", "left"), ("per instance", "right"), ("instances x worldSize", "right"),
                          ("cards", "right"), ("nodes", "right"), ("all-reduce share", "right"), ("verdict", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in answer.candidates:
        table.add_row(c.layout, _per_instance(c, unit),
                      "" if c.instances is None else f"{c.instances} x {c.world_size}",
                      "" if c.cards is None else str(c.cards),
                      "" if c.cards is None else ("n/s" if c.nodes is None else str(c.nodes)),
                      "" if c.comm_share is None else f"{c.comm_share:.0%} of a decode step",
                      c.verdict if c.verdict == "winner" else c.why)
    console.print(table)
    w = answer.winner
    if w is None:
        console.print("No layout holds the load under the SLO (see each verdict).", highlight=False)
        return
    console.print(f"Answer: {w.instances} x {w.world_size} {w.accelerator} = {w.cards} cards, nodes: "
                  f"{'n/s' if w.nodes is None else w.nodes}; {w.per_instance:.3g} {unit} per instance under the SLO",
                  highlight=False)
    console.print(f"Source: {w.source}", highlight=False)


def run_capacity(args: argparse.Namespace, build_spec: Callable[[argparse.Namespace], InferenceServiceSpec]) -> int:
    target = "users" if args.target_users is not None else "rate"
    value = float(args.target_users if target == "users" else args.target_rate)
    if value <= 0:
        print("npuserve plan: the target must be positive", file=sys.stderr)
        return 2
    if args.engine_profile not in ENGINE_PROFILES:
        print(f"npuserve plan: --engine-profile: one of {', '.join(sorted(ENGINE_PROFILES))}", file=sys.stderr)
        return 2
    try:
        spec = build_spec(args)
        cards = list(args.accelerator or [spec.accelerator.type])  # by default the spec's card: ~15 s a card
        slo = slo_of(args.ttft_ms, args.tpot_ms, args.statistic)
        answer = search(spec, target, value, slo, accelerators=cards or None,  # type: ignore[arg-type]
                        engine_profile=args.engine_profile)
    except ValidationError as e:
        print(f"npuserve plan: invalid spec:\n{e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, yaml.YAMLError) as e:
        print(f"npuserve plan: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        sys.stdout.write(json.dumps(answer_json(answer), indent=2) + "\n")
    else:
        print_answer(answer)
    return 0 if answer.winner is not None else 1
