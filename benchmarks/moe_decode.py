"""The engine's Qwen3-MoE decode throughput against transformers', same dummy checkpoint, same process, same run.

A dummy Qwen3-MoE (default 4 layers, hidden 512, 64 experts, 8 per token, moe_intermediate 256, float32; all
layers MoE) is written once. At each batch size B (default 1 and 32): B prompts of --prompt-len random tokens,
each generating exactly --max-tokens tokens (EOS ignored), through npuserve's `LLMEngine` (maxBatchSize B) and
through transformers' `generate` (one static batch of B, no padding: the prompts have one length). Decode
throughput = B x (max_tokens - 1) / (time for max_tokens - time for 1 token): the prefill and first token are
taken out by a second run of one token each. The helpers are engine_vs_transformers.py's.

    .venv/bin/python benchmarks/moe_decode.py [--batch 1 --batch 32] [--max-tokens 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_transformers import run_npuserve, run_static


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, action="append", help="batch sizes (default 1 and 32)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="each measurement's best of this many (interleaved) runs")
    p.add_argument("--model-dir", help="reuse a model folder (else one is written to a temp dir)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (0: torch's default); 1 by default: on a shared machine, small ops on several "
                        "threads wait on each other's descheduled threads (measured 12x slower under load)")
    p.add_argument("--experts-implementation", choices=["grouped_mm", "batched_mm", "eager"], default=None,
                   help="transformers' experts kernel (default: its own default, grouped_mm in 5.x; eager is the "
                        "loop over the hit experts that transformers 4.x ran)")
    args = p.parse_args()
    args.batch = args.batch or [1, 32]
    return args


def write_model(args: argparse.Namespace, out: Path) -> Path:
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    base = get_model_preset("tiny-qwen3-moe")
    assert base.moe is not None
    spec = base.model_copy(update={
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": args.hidden_size // 8, "intermediate_size": 4 * args.hidden_size,
        "vocab_size": args.vocab_size, "dtype": args.dtype, "max_position_embeddings": 2048,
        "moe": base.moe.model_copy(update={"num_experts": args.experts, "num_experts_per_tok": args.top_k,
                                           "moe_intermediate_size": args.moe_intermediate}),
    })
    return write_dummy_model(spec, out, seed=0, init_std=0.02)


def main() -> int:
    args = parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="npuserve-moe-bench-")
    model_dir = Path(args.model_dir) if args.model_dir else write_model(args, Path(tmp.name) / "model")
    dtype = getattr(torch, args.dtype)
    extra = {"experts_implementation": args.experts_implementation} if args.experts_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra).eval()
    print(f"Qwen3-MoE dummy: {args.num_layers} layers, hidden {args.hidden_size}, {args.experts} experts top-"
          f"{args.top_k}, moe_intermediate {args.moe_intermediate}, vocab {args.vocab_size}, {args.dtype}; "
          f"prompts of {args.prompt_len} tokens, {args.max_tokens} output tokens; torch threads "
          f"{torch.get_num_threads()}; transformers experts implementation "
          f"{getattr(model.config, '_experts_implementation', None)}", flush=True)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for batch in args.batch:
        prompts = [torch.randint(5, args.vocab_size, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]
        timings: dict[str, dict[int, float]] = {"npuserve": {}, "transformers": {}}
        # interleaved, best of --repeats each: on a shared machine the load moves between the two systems' runs
        for _ in range(args.repeats):
            for tokens in (1, args.max_tokens):
                run_args = argparse.Namespace(max_tokens=tokens, block_size=args.block_size, max_batch_size=batch,
                                              static_batch_size=batch)
                lengths = [tokens] * batch
                for name, seconds in (("npuserve", run_npuserve(run_args, model_dir, prompts, lengths)),
                                      ("transformers", run_static(run_args, model, prompts, lengths))):
                    timings[name][tokens] = min(seconds, timings[name].get(tokens, seconds))
        decoded = batch * (args.max_tokens - 1)
        rates = {name: decoded / (t[args.max_tokens] - t[1]) for name, t in timings.items()}
        rates["ratio"] = rates["npuserve"] / rates["transformers"]
        results[f"batch {batch}"] = rates
        print(f"batch {batch}: npuserve {rates['npuserve']:.1f} tok/s, transformers {rates['transformers']:.1f} "
              f"tok/s, ratio {rates['ratio']:.2f}x" + (" (target >= 2x)" if batch >= 32 else ""), flush=True)
    print(json.dumps({k: {n: round(v, 2) for n, v in r.items()} for k, r in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
