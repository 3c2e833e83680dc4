"""Tensor parallel against one rank, in one run: what splitting a model over worldSize ranks costs or gains.

One dummy llama (random weights, real HF folder; default 8 layers x hidden 2048, float32) generates the same batch
once with worldSize 1 and once with worldSize N (default 2), greedy: --batch prompts of --input-len tokens, each
making --output-len tokens with EOS ignored. It prints output tokens/s and the decode step time of each, their
ratio (N ranks / 1 rank), and whether the tokens are equal.

On the CPU (gloo) this measures the price of the layout rather than a speed-up: the ranks share the host's cores
(each gets cores / N torch threads), and every layer adds two all-reduces through gloo. On cards (nccl, hccl) each
rank reads 1/N of the weights per step, which is where tensor parallel pays; run it there with `--device`.

    .venv/bin/python -P benchmarks/tensor_parallel.py [--quick] [--world-size 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    p.add_argument("--quick", action="store_true", help="4 layers of hidden 1024, 16 output tokens")
    args = p.parse_args()
    if args.quick:
        args.num_layers, args.hidden_size, args.output_len = 4, 1024, 16
    return args


def write_model(args: argparse.Namespace, out: Path) -> Path:
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    spec = get_model_preset("llama3-8b").model_copy(update={
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": args.hidden_size // 16, "intermediate_size": args.hidden_size * 3,
        "vocab_size": 8192, "dtype": "float32", "max_position_embeddings": 4096,
    })
    return write_dummy_model(spec, out, seed=0, init_std=0.3)


@dataclass
class Run:
    tokens_per_s: float
    decode_step_ms: float
    tokens: list[list[int]]


def run(args: argparse.Namespace, model_dir: Path, world_size: int) -> Run:
    import torch

    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import minimal_config

    config = minimal_config(model_dir, max_seq_len=args.input_len + args.output_len + 8, maxBatchSize=args.batch,
                            maxPrefillBatchSize=args.batch, extensions={"device": args.device},
                            model={"worldSize": world_size})
    engine = LLMEngine(config)
    try:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(5, 8000, (args.input_len,), generator=gen).tolist() for _ in range(args.batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
        tokens: dict[str, list[int]] = {}
        decode_s: list[float] = []
        t0 = time.perf_counter()
        while engine.has_unfinished():
            result = engine.step()
            if result.stats is not None and result.stats.num_prefill_seqs == 0:
                decode_s.append(result.stats.seconds)
            for out in result.outputs:
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        elapsed = time.perf_counter() - t0
    finally:
        engine.close()
    return Run(args.batch * args.output_len / elapsed, 1000 * sum(decode_s) / max(1, len(decode_s)),
               [tokens[f"r{i}"] for i in range(args.batch)])


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args, Path(tmp) / "model")
        one = run(args, model_dir, 1)
        many = run(args, model_dir, args.world_size)
    n = args.world_size
    summary = {
        "model": f"{args.num_layers} layers x hidden {args.hidden_size}, float32, {args.device}",
        "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
        "tokens_per_s": {1: round(one.tokens_per_s, 1), n: round(many.tokens_per_s, 1)},
        "decode_step_ms": {1: round(one.decode_step_ms, 2), n: round(many.decode_step_ms, 2)},
        f"throughput_ratio_{n}_over_1": round(many.tokens_per_s / one.tokens_per_s, 3),
        f"decode_step_ratio_{n}_over_1": round(many.decode_step_ms / one.decode_step_ms, 3),
        "tokens_equal": one.tokens == many.tokens,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
