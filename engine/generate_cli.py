"""`npuserve generate`: offline generation through the real engine; one JSON line per prompt.

With `--prompts-file` (JSONL: each line a string, or an object with `prompt`, or `question` as in GSM8K, and
optionally `max_tokens`), all prompts run as one continuous batch and a final summary line gives output tokens/s.
A MindIE `config.json` (`--config`) is used as is; `--model` then overrides its modelWeightPath, and
`--block-size` / `--max-batch-size` its ScheduleConfig.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from npuserve.engine_contract import FLAG_CONFIG
from npuserve.quantization import parse_quantization


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model folder (default: the config's modelWeightPath)")
    parser.add_argument(FLAG_CONFIG, help="a MindIE config.json")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", help="JSONL of prompts (string, or object with prompt/question)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--block-size", type=int, help="ScheduleConfig.cacheBlockSize")
    parser.add_argument("--max-batch-size", type=int, help="ScheduleConfig.maxBatchSize")
    parser.add_argument("--num-prompts", type=int, help="use the first N prompts of the file")
    parser.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], help="dummy: random weights")
    parser.add_argument("--quantization", metavar="FORMAT:METHOD",
                        help="npuserve.quantization, e.g. msmodelslim:w8a8_dynamic or compressed-tensors:w8a8: must "
                        "be the checkpoint's scheme; with --load-format dummy, random int8 weights of it")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--world-size", type=int, help="ModelConfig.worldSize: tensor-parallel ranks, one process "
                        "and one card each (npuDeviceIds 0..N-1 unless the config lists them)")


def _read_prompts(path: str, limit: int | None) -> list[tuple[str, int | None]]:
    prompts: list[tuple[str, int | None]] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        if isinstance(item, str):
            prompts.append((item, None))
        else:
            text = item.get("prompt") or item.get("question") or item.get("text")
            if text is None:
                raise ValueError(f"{path}: a line has none of prompt, question, text")
            prompts.append((str(text), item.get("max_tokens")))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def _config(args: argparse.Namespace, prompt_lens: list[int]) -> Any:
    from npuserve.mindie_config import MindIEConfig, minimal_config

    schedule: dict[str, Any] = {}
    if args.block_size:
        schedule["cacheBlockSize"] = args.block_size
    if args.max_batch_size:
        schedule["maxBatchSize"] = args.max_batch_size
    ext: dict[str, Any] = {}
    if args.load_format:
        ext["loadFormat"] = args.load_format
    if args.quantization:
        ext["quantization"] = parse_quantization(args.quantization).model_dump()
    if args.config:
        config = MindIEConfig.load(args.config)
        if args.model:
            config.model.modelWeightPath = args.model
        if args.world_size:
            config = config.with_world_size(args.world_size)
        if schedule:
            if "maxBatchSize" in schedule and config.schedule.maxPrefillBatchSize > schedule["maxBatchSize"]:
                schedule["maxPrefillBatchSize"] = schedule["maxBatchSize"]
            config = config.with_schedule(**schedule)
        if ext:
            data = config.to_dict()
            data.setdefault("npuserve", {}).update(ext)
            config = MindIEConfig.from_dict(data)
        return config
    if not args.model:
        raise ValueError("give --model or --config")
    # No config: size maxSeqLen to these prompts, so the CPU's auto KV sizing stays small.
    longest = max(prompt_lens) if prompt_lens else 1
    max_seq_len = max(64, longest + args.max_tokens + 1)
    config = minimal_config(args.model, max_seq_len=max_seq_len, max_input_len=max_seq_len - 1,
                            extensions=ext or None, **schedule)
    return config.with_world_size(args.world_size) if args.world_size else config


def run(args: argparse.Namespace) -> int:
    import torch

    from npuserve.engine.backends import BackendUnavailableError
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.model.errors import WeightLoadError
    from npuserve.engine.request_checks import RequestError
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import MindIEConfigError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        items = [(args.prompt, None)] if args.prompt is not None else _read_prompts(args.prompts_file, args.num_prompts)
        lens = [len(p.encode()) for p, _ in items]  # bytes >= tokens for byte-level BPE: a safe bound
        config = _config(args, lens)
        t_load = time.perf_counter()
        engine = LLMEngine(config, model_dir=args.model)
        load_s = time.perf_counter() - t_load
    except (MindIEConfigError, ValueError, FileNotFoundError, BackendUnavailableError, WeightLoadError) as e:
        print(f"npuserve generate: {e}", file=sys.stderr)
        return 2
    info = engine.info().model_dump(exclude_none=True)
    print(json.dumps({"event": "ready", "load_seconds": round(load_s, 3), **info}), file=sys.stderr)
    params = [
        SamplingParams(max_tokens=mt or args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        for _, mt in items
    ]
    t0 = time.perf_counter()
    try:
        outputs = engine.generate([p for p, _ in items], params)
    except RequestError as e:
        print(f"npuserve generate: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    elapsed = time.perf_counter() - t0
    for i, out in enumerate(outputs):
        m = out.metrics
        line: dict[str, Any] = {
            "index": i, "prompt_tokens": out.num_prompt_tokens, "output_tokens": len(out.token_ids),
            "token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason.value if out.finish_reason else None,
            "ttft_s": round(m.get("ttft", 0.0), 4), "queue_s": round(m.get("queue_time", 0.0), 4),
            "e2e_s": round(m.get("e2e", 0.0), 4),
        }
        if out.error:
            line["error"] = out.error
        print(json.dumps(line, ensure_ascii=False))
    if args.prompts_file:
        total_out = sum(len(o.token_ids) for o in outputs)
        print(json.dumps({
            "summary": True, "prompts": len(outputs), "prompt_tokens": sum(o.num_prompt_tokens for o in outputs),
            "output_tokens": total_out, "seconds": round(elapsed, 3),
            "output_tokens_per_s": round(total_out / elapsed, 2) if elapsed > 0 else None,
            "kv_blocks": engine.kv_plan.num_blocks, "block_size": engine.kv_plan.block_size,
            "preemptions": engine.scheduler.num_preemptions_total,
        }))
    return 0
