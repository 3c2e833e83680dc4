"""W8A8 decode throughput against 16-bit (and float32) weights on this CPU, then what the card would give.

1. The CPU, through npuserve's `LLMEngine`: one Llama-shaped dummy config (default 8 layers, hidden 1024,
   intermediate 4096, vocab 32000: the linear weights dominate), its weights drawn at load (`loadFormat: dummy`,
   same seed) as bf16, as float32, and as int8 of each W8A8 scheme (`npuserve.quantization`, msModelSlim's W8A8
   static and W8A8_DYNAMIC; the rest of the model, norms, attention, LM head, in --int8-dtype). At each batch B
   (default 1 and 32): B prompts of --prompt-len random tokens make exactly --max-tokens tokens (EOS ignored);
   decode tok/s = B x (max_tokens - 1) / (time for max_tokens - time for 1 token), the prefill and first token
   taken out as moe_decode.py does. The variants interleaved (their order rotated each repeat), best of
   --repeats. Prints tok/s and each one's ratio to bf16 and to float32, with the CPU's capability
   (`torch.backends.cpu.get_cpu_capability()`), whether oneDNN runs bf16 natively and the CPU's AVX512/AMX flags:
   which matmul kernels run. `--device cuda`: the same on the GPU (the CUDA backend; int8 products on cuBLAS's
   int8 GEMM through `torch._int_mm`).
2. The card, from the simulator's cost model (sim/cost_model.py, the catalog's accelerator, default ascend-910b3):
   the decode step time (= TPOT) at batch 1 and 32 of --sim-model presets (default qwen3-8b and qwen3-32b) in bf16
   and as msModelSlim W8A8_DYNAMIC, one card, a --sim-context token context each, and their ratio; and the card's
   part alone (the weights' and KV's read or the FLOPs, without the cost model's fitted per-step host overhead).

    .venv/bin/python benchmarks/quant_decode.py [--batch 1 --batch 32] [--max-tokens 16] [--threads 1]
    .venv/bin/python benchmarks/quant_decode.py --sim-only
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("bfloat16", "float32", "w8a8", "w8a8_dynamic")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, action="append", help="batch sizes (default 1 and 32)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--variant", action="append", choices=VARIANTS, help=f"default: all of {', '.join(VARIANTS)}")
    p.add_argument("--int8-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the int8 models' dtype for what stays unquantized (activations out of the int8 layers too)")
    p.add_argument("--format", choices=["msmodelslim", "compressed-tensors"], default="msmodelslim")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=4,
                   help="each measurement's best of this many (interleaved, the order rotated) runs")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="the engine's device (cuda: the CUDA backend, int8 products on cuBLAS through torch._int_mm)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (0: torch's default); 1 by default: on a shared machine, small ops on several "
                        "threads wait on each other's descheduled threads")
    p.add_argument("--accelerator", default="ascend-910b3", help="the simulator's card (catalog name)")
    p.add_argument("--sim-model", action="append", help="the simulator's model presets (default qwen3-8b, qwen3-32b)")
    p.add_argument("--sim-context", type=int, default=1024, help="tokens of context per sequence in the simulator")
    p.add_argument("--sim-only", action="store_true", help="only the simulator's figures")
    args = p.parse_args()
    args.batch = args.batch or [1, 32]
    args.variant = args.variant or list(VARIANTS)
    args.sim_model = args.sim_model or ["qwen3-8b", "qwen3-32b"]
    return args


def write_model(args: argparse.Namespace, out: Path) -> Path:
    """The config and tokenizer only matter: every variant draws its weights at load (loadFormat dummy)."""
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    heads = args.hidden_size // 64
    spec = get_model_preset("tiny").model_copy(update={
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4), "head_dim": 64, "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size, "dtype": "bfloat16", "max_position_embeddings": 2048,
    })
    return write_dummy_model(spec, out, seed=0, init_std=0.02)


def extensions(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    ext: dict[str, Any] = {"loadFormat": "dummy", "device": args.device}
    if variant in ("bfloat16", "float32"):
        ext["dtype"] = variant
    else:
        ext["dtype"] = args.int8_dtype
        ext["quantization"] = {"format": args.format, "method": variant}
    return ext


def run_engine(args: argparse.Namespace, model_dir: Path, variant: str, prompts: list[list[int]],
               tokens: int) -> float:
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import minimal_config

    batch = len(prompts)
    max_seq = args.prompt_len + args.max_tokens + 1
    config = minimal_config(model_dir, max_seq_len=max_seq, max_input_len=max_seq - 1, cacheBlockSize=args.block_size,
                            maxBatchSize=batch, maxPrefillBatchSize=min(batch, 64),
                            extensions=extensions(args, variant))
    engine = LLMEngine(config)
    params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True) for _ in prompts]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert sum(len(o.token_ids) for o in outs) == tokens * batch
    del engine
    gc.collect()  # the next variant's weights into a heap without this one's
    return elapsed


def cpu_kernels() -> str:
    import torch

    # oneDNN runs bf16 matmuls natively only where the CPU has AVX512-BF16 or AMX; else it converts to float32
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported() if torch.backends.mkldnn.is_available() else False
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    have = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8") if f in flags]
    return (f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"oneDNN bf16 {'native' if bf16 else 'emulated'}, CPU flags {' '.join(have) or 'none of avx512/amx'}")


def cpu_decode(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="npuserve-quant-bench-")
    model_dir = write_model(args, Path(tmp.name) / "model")
    print(f"Llama-shaped dummy: {args.num_layers} layers, hidden {args.hidden_size}, intermediate "
          f"{args.intermediate_size}, vocab {args.vocab_size}; int8 schemes {args.format}, rest in {args.int8_dtype};"
          f" prompts of {args.prompt_len} tokens, {args.max_tokens} output tokens; torch threads "
          f"{torch.get_num_threads()}\n"
          f"{cpu_kernels() if args.device == 'cpu' else torch.cuda.get_device_name() + ', torch ' + torch.__version__}",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for batch in args.batch:
        prompts = [torch.randint(5, args.vocab_size, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]
        timings: dict[str, dict[int, float]] = {v: {} for v in args.variant}
        # interleaved, best of --repeats each: on a shared machine the load moves between the variants' runs; the
        # order rotates each repeat, as a variant's place in it moved its rate by up to 1.5x (the one before it
        # freeing its weights, the heap, the caches)
        for repeat in range(args.repeats):
            order = args.variant[repeat % len(args.variant):] + args.variant[:repeat % len(args.variant)]
            for tokens in (1, args.max_tokens):
                for variant in order:
                    seconds = run_engine(args, model_dir, variant, prompts, tokens)
                    timings[variant][tokens] = min(seconds, timings[variant].get(tokens, seconds))
        decoded = batch * (args.max_tokens - 1)
        rates = {v: decoded / (t[args.max_tokens] - t[1]) for v, t in timings.items()}
        results[f"batch {batch}"] = rates
        line = ", ".join(f"{v} {r:.1f} tok/s" for v, r in rates.items())
        ratios = ", ".join(f"{v}/{base} {rates[v] / rates[base]:.2f}x" for v in rates if v.startswith("w8a8")
                           for base in ("bfloat16", "float32") if base in rates)
        print(f"batch {batch}: {line}; {ratios}", flush=True)
    return results


def card_decode(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from npuserve.catalog.accelerators import get_accelerator
    from npuserve.catalog.models import get_model_preset
    from npuserve.quantization import QuantScheme
    from npuserve.sim.cost_model import CostModel, Hardware, StepShape

    hw = Hardware.of(get_accelerator(args.accelerator))
    results: dict[str, dict[str, float]] = {}
    for name in args.sim_model:
        bf16 = get_model_preset(name).model_copy(update={"dtype": "bfloat16"})
        w8a8 = bf16.model_copy(update={"quantization": QuantScheme(format="msmodelslim", method="w8a8_dynamic")})
        for batch in args.batch:
            ctx = args.sim_context
            shape = StepShape(num_seqs=batch, new_tokens=batch, context_tokens=batch * ctx,
                              attended_pairs=batch * ctx, sampled_rows=batch)
            a, b = CostModel(bf16, hw, 1).step(shape), CostModel(w8a8, hw, 1).step(shape)
            row = {"bf16_ms": a.total_s * 1e3, "w8a8_dynamic_ms": b.total_s * 1e3, "ratio": a.total_s / b.total_s,
                   "bf16_device_ms": a.device_s * 1e3, "w8a8_dynamic_device_ms": b.device_s * 1e3,
                   "device_ratio": a.device_s / b.device_s}
            results[f"{name} batch {batch}"] = row
            print(f"{args.accelerator} {name} batch {batch} (context {ctx}): TPOT bf16 {row['bf16_ms']:.2f} ms, "
                  f"W8A8_DYNAMIC {row['w8a8_dynamic_ms']:.2f} ms, {row['ratio']:.2f}x; the card's part alone "
                  f"({a.bound}-bound, without the engine's {a.launch_s * 1e3:.1f} ms of launches) "
                  f"{row['bf16_device_ms']:.2f} -> {row['w8a8_dynamic_device_ms']:.2f} ms, "
                  f"{row['device_ratio']:.2f}x", flush=True)
    return results


def main() -> int:
    args = parse_args()
    out: dict[str, Any] = {}
    if not args.sim_only:
        out[args.device] = cpu_decode(args)
    out["card"] = card_decode(args)
    print(json.dumps({part: {k: {n: round(v, 3) for n, v in r.items()} for k, r in rows.items()}
                      for part, rows in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
