"""`npuserve model ...`: model folder utilities (the engine's: they write weights). Torch is imported only when a
command runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from npuserve.catalog.models import MODEL_PRESETS, UnknownPresetError, get_model_preset
from npuserve.modelspec import ModelSpec


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="MODEL_COMMAND", required=True)
    dummy = sub.add_parser(
        "create-dummy",
        help="write an HF-format model folder with random weights and a byte-level BPE tokenizer",
        description="Write an HF-format model folder (config.json, safetensors, tokenizer) with random weights.",
    )
    dummy.add_argument("--preset", required=True, help=f"architecture: {', '.join(MODEL_PRESETS)}")
    dummy.add_argument("--out", required=True, help="folder to write")
    dummy.add_argument("--seed", type=int, default=0)
    dummy.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the preset's")
    dummy.add_argument("--init-std", type=float, default=0.02, help="standard deviation of the random weights")
    dummy.add_argument("--max-shard-size", type=float, default=2.0, help="GB per safetensors file before sharding")
    dummy.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override an architecture field, e.g. --set num_layers=8 --set hidden_size=1024",
    )


def _with_overrides(spec: ModelSpec, overrides: list[str], dtype: str | None) -> ModelSpec:
    data: dict[str, Any] = spec.model_dump()
    for item in overrides:
        field, sep, raw = item.partition("=")
        if not sep or field not in data:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(data)}")
        data[field] = json.loads(raw) if raw not in ("", None) else None
    if dtype:
        data["dtype"] = dtype
    return ModelSpec.model_validate(data)


def run(args: argparse.Namespace) -> int:
    try:
        spec = _with_overrides(get_model_preset(args.preset), args.set, args.dtype)
    except (UnknownPresetError, ValueError) as e:
        print(f"npuserve model create-dummy: {e}", file=sys.stderr)
        return 2
    from npuserve.engine.model.dummy import write_dummy_model

    folder = write_dummy_model(spec, args.out, seed=args.seed, init_std=args.init_std,
                               max_shard_bytes=int(args.max_shard_size * 1000**3))
    print(json.dumps({"out": str(folder), "preset": args.preset, "parameters": spec.num_parameters,
                      "weight_bytes": spec.weight_bytes, "dtype": spec.dtype}))
    return 0
