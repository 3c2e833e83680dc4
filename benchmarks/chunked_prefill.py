"""Chunked prefill (MindIE's SplitFuse, npuserve.chunkedPrefill) against the Standard template: what long prompts
arriving while others decode do to the decoders' time per output token.

One dummy llama (random weights, real HF folder; default 4 layers x hidden 1024, float32) runs the same workload
twice in this process, once per mode: --decoders requests of short prompts decode --decode-tokens tokens each;
after they have started, --long-prompts prompts of --long-len tokens arrive one every --arrival-steps engine steps.
With the Standard template each long prompt is one prefill step that every decoder waits out; with chunked prefill
it is cut into chunks of at most maxPrefillTokens tokens mixed into decode steps.

For the decoders it prints the inter-token gaps (mean, p50, p99, max, on the wall clock of the step loop), their
mean TPOT, the long prompts' TTFT, and total output tokens/s, then the ratios chunked / standard.

    .venv/bin/python benchmarks/chunked_prefill.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--decoders", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-len", type=int, default=1536)
    p.add_argument("--arrival-steps", type=int, default=12, help="engine steps between two long prompts")
    p.add_argument("--chunk", type=int, default=256, help="maxPrefillTokens of the chunked run")
    p.add_argument("--quick", action="store_true", help="2 layers, 8 decoders, 2 long prompts of 768")
    args = p.parse_args()
    if args.quick:
        args.num_layers, args.decoders, args.long_prompts, args.long_len = 2, 8, 2, 768
    return args


def write_model(args: argparse.Namespace, out: Path) -> Path:
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    spec = get_model_preset("llama3-8b").model_copy(update={
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": args.hidden_size // 16, "intermediate_size": args.hidden_size * 3,
        "vocab_size": 8192, "dtype": "float32", "max_position_embeddings": 4096,
    })
    return write_dummy_model(spec, out, seed=0)


@dataclass
class Result:
    gaps: list[float] = field(default_factory=list)  # decoders' inter-token gaps, seconds
    tpot: list[float] = field(default_factory=list)  # per decoder: (last - first token) / (n - 1)
    long_ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def run(model: Path, args: argparse.Namespace, chunked: bool) -> Result:
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import minimal_config

    config = minimal_config(model, max_seq_len=args.long_len + 256, max_input_len=args.long_len,
                            cacheBlockSize=16, maxBatchSize=args.decoders + args.long_prompts,
                            maxPrefillBatchSize=args.decoders,
                            maxPrefillTokens=args.chunk if chunked else args.long_len,
                            maxQueueDelayMicroseconds=500, extensions={"chunkedPrefill": chunked})
    engine = LLMEngine(config)
    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.decoders):
        engine.add_request(f"d{i}", None, decode, prompt_token_ids=[5 + i, 6, 7, 8, 9, 10, 11, 12])
    long_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    last: dict[str, float] = {}
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}
    result = Result()
    step = sent = 0
    t0 = time.perf_counter()
    while engine.has_unfinished() or sent < args.long_prompts:
        if step >= args.arrival_steps * (sent + 1) and sent < args.long_prompts:
            rid = f"long{sent}"
            engine.add_request(rid, None, long_params,
                               prompt_token_ids=[(7 * j + sent) % 8000 + 3 for j in range(args.long_len)])
            arrived[rid] = time.perf_counter()
            sent += 1
        out = engine.step()
        now = time.perf_counter()
        step += 1
        for o in out.outputs:
            n = len(o.new_token_ids)
            result.tokens += n
            if not n:
                continue
            rid = o.request_id
            if rid.startswith("long") and rid not in first:
                result.long_ttft.append(now - arrived[rid])
            if rid.startswith("d") and rid in last:
                result.gaps.extend([(now - last[rid]) / n] * n)
            first.setdefault(rid, now)
            last[rid] = now
            if o.finished and rid.startswith("d") and len(o.token_ids) > 1:
                result.tpot.append((now - first[rid]) / (len(o.token_ids) - 1))
    result.seconds = time.perf_counter() - t0
    return result


def summary(r: Result) -> dict[str, float]:
    gaps = sorted(r.gaps)
    return {
        "decoder_itl_mean_ms": statistics.fmean(gaps) * 1e3,
        "decoder_itl_p50_ms": gaps[len(gaps) // 2] * 1e3,
        "decoder_itl_p99_ms": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1e3,
        "decoder_itl_max_ms": gaps[-1] * 1e3,
        "decoder_tpot_mean_ms": statistics.fmean(r.tpot) * 1e3,
        "long_ttft_mean_ms": statistics.fmean(r.long_ttft) * 1e3,
        "output_tokens_per_s": r.tokens / r.seconds,
    }


def main() -> None:
    args = parse_args()
    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(args, Path(tmp) / "model")
        run(model, args, chunked=False)  # warm-up: allocator and kernels
        standard = summary(run(model, args, chunked=False))
        chunked = summary(run(model, args, chunked=True))
    print(json.dumps({"workload": {k: getattr(args, k) for k in ("num_layers", "hidden_size", "decoders",
                                                                   "decode_tokens", "long_prompts", "long_len",
                                                                   "arrival_steps", "chunk")},
                      "standard": standard, "chunked": chunked}, indent=2))
    print("chunked / standard:")
    for key in standard:
        print(f"  {key:24s} {chunked[key] / standard[key]:.2f}x")


if __name__ == "__main__":
    main()
