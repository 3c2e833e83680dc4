"""`npuserve doctor`: whether this machine's Ascend card, driver, CANN, torch_npu and NNAL run the npu backend.

One line per check, then a verdict; exit 0 when no check failed, 1 otherwise (also where no NPU is present);
`--json` prints the report (engine/doctor/report.py's DoctorReport) instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from npuserve.npu_contract import NPU_BLOCK_SIZE


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--world-size", type=int, default=1,
                        help="tensor-parallel ranks to check: that many visible cards and an HCCL all-reduce")
    parser.add_argument("--block-size", type=int, default=NPU_BLOCK_SIZE, help="cacheBlockSize to check")
    parser.add_argument("--model", type=Path, help="an HF model folder: count the KV blocks it would get per card")


def run(args: argparse.Namespace) -> int:
    from npuserve.engine.doctor import DoctorOptions, diagnose

    if args.world_size < 1:
        print("npuserve doctor: --world-size must be at least 1", file=sys.stderr)
        return 2
    report = diagnose(DoctorOptions(world_size=args.world_size, block_size=args.block_size, model=args.model))
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1
