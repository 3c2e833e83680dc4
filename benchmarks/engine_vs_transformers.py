"""npuserve's engine against `transformers` on this CPU: output tokens/s on GSM8K prompts.

A dummy llama model (random weights, real HF folder, default 8 layers x hidden 1024, about 600 MB in float32) is
written once; the same prompts (GSM8K questions) and the same output lengths (each request's GSM8K answer length
in tokens, capped at --max-tokens; EOS ignored so every system makes exactly those tokens) run through:

1. npuserve `LLMEngine` (continuous batching, paged KV, maxBatchSize --max-batch-size);
2. transformers `generate` in static batches of --static-batch-size (left padded; a batch runs until its longest
   request is done, only the requested tokens are counted, as a static-batching server would return them);
3. transformers continuous batching (`init_continuous_batching` / the engine behind `generate_batch`) with
   per-request max_new_tokens, if it runs on the CPU.

Prints each system's output tokens/s and the ratios (targets: >= 2x static generate, >= 1x continuous batching).
Quick check: `--quick` (24 prompts, 32 tokens, 4 layers).

    .venv/bin/python benchmarks/engine_vs_transformers.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATASET = REPO / ".." / "shared" / "datasets" / "gsm8k" / "test.jsonl"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=str(DEFAULT_DATASET), help="GSM8K test.jsonl")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--max-batch-size", type=int, default=200, help="npuserve maxBatchSize")
    p.add_argument("--block-size", type=int, default=16, help="npuserve cacheBlockSize")
    p.add_argument("--static-batch-size", type=int, default=32, help="transformers generate batch size")
    p.add_argument("--model-dir", help="reuse a model folder (else one is written to a temp dir)")
    p.add_argument("--skip", action="append", default=[], choices=["static", "cb"], help="skip a baseline")
    p.add_argument("--quick", action="store_true", help="24 prompts, 32 tokens, 4 layers")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.num_layers = min(args.num_prompts, 24), min(args.max_tokens, 32), 4
    return args


def write_model(args: argparse.Namespace, out: Path) -> Path:
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    spec = get_model_preset("llama3-8b").model_copy(update={
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": args.hidden_size // 16, "intermediate_size": args.hidden_size * 7 // 2,
        "vocab_size": args.vocab_size, "dtype": "float32", "max_position_embeddings": 2048,
    })
    return write_dummy_model(spec, out, seed=0, init_std=0.02)


def load_workload(args: argparse.Namespace, model_dir: Path) -> tuple[list[list[int]], list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts, lengths = [], []
    with open(args.dataset) as f:
        for line in f:
            item = json.loads(line)
            prompts.append(tok.encode(item["question"]).ids)
            lengths.append(max(1, min(args.max_tokens, len(tok.encode(item["answer"]).ids))))
            if len(prompts) >= args.num_prompts:
                break
    return prompts, lengths


def run_npuserve(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> float:
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import minimal_config

    max_seq = max(len(p) for p in prompts) + args.max_tokens + 1
    config = minimal_config(model_dir, max_seq_len=max_seq, max_input_len=max_seq - 1, cacheBlockSize=args.block_size,
                            maxBatchSize=args.max_batch_size, maxPrefillBatchSize=min(args.max_batch_size, 64))
    engine = LLMEngine(config)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(lengths), (produced, sum(lengths))
    del engine
    return elapsed


def run_static(args: argparse.Namespace, model: Any, prompts: list[list[int]], lengths: list[int]) -> float:
    import torch

    t0 = time.perf_counter()
    bs = args.static_batch_size
    for start in range(0, len(prompts), bs):
        batch, want = prompts[start : start + bs], lengths[start : start + bs]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(want), min_new_tokens=max(want),
                           do_sample=False, pad_token_id=0, eos_token_id=None)
    return time.perf_counter() - t0


def run_cb(args: argparse.Namespace, model: Any, prompts: list[list[int]], lengths: list[int]) -> float:
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=5) as manager:
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        done, produced = 0, 0
        while done < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped")
                continue
            if result.is_finished():
                done += 1
                produced += len(result.generated_tokens)
    elapsed = time.perf_counter() - t0
    if produced != sum(lengths):
        print(f"  note: transformers CB produced {produced} tokens, asked {sum(lengths)}", file=sys.stderr)
    return elapsed


def main() -> int:
    args = parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="npuserve-bench-")
    model_dir = Path(args.model_dir) if args.model_dir else write_model(args, Path(tmp.name) / "model")
    prompts, lengths = load_workload(args, model_dir)
    total = sum(lengths)
    print(f"model: {args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, float32; "
          f"{len(prompts)} prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), "
          f"{total} output tokens (mean {total / len(prompts):.0f}, cap {args.max_tokens}); "
          f"torch threads {torch.get_num_threads()}")
    results: dict[str, float] = {}
    elapsed = run_npuserve(args, model_dir, prompts, lengths)
    results["npuserve"] = total / elapsed
    print(f"npuserve LLMEngine (maxBatchSize {args.max_batch_size}): {elapsed:.1f} s, {results['npuserve']:.1f} tok/s",
          flush=True)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if "static" not in args.skip:
        elapsed = run_static(args, model, prompts, lengths)
        results["static"] = total / elapsed
        print(f"transformers generate, static batches of {args.static_batch_size}: {elapsed:.1f} s, "
              f"{results['static']:.1f} tok/s", flush=True)
    if "cb" not in args.skip:
        try:
            elapsed = run_cb(args, model, prompts, lengths)
            results["cb"] = total / elapsed
            print(f"transformers continuous batching: {elapsed:.1f} s, {results['cb']:.1f} tok/s", flush=True)
        except Exception as e:  # report, do not hide: the ratio is then missing
            print(f"transformers continuous batching did not run on CPU: {type(e).__name__}: {e}", flush=True)
    if "static" in results:
        print(f"ratio npuserve / transformers static generate: {results['npuserve'] / results['static']:.2f}x "
              "(target >= 2x)")
    if "cb" in results:
        print(f"ratio npuserve / transformers continuous batching: {results['npuserve'] / results['cb']:.2f}x "
              "(target >= 1x)")
    print(json.dumps({"output_tokens_per_s": {k: round(v, 2) for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
