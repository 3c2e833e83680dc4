"""npuserve's engine on one NVIDIA GPU against `transformers` `generate` on the same GPU, in one run.

Model: a Llama-3-8B-shaped dummy in bf16 (random weights in a real HF folder written to a temp dir, so both systems
load the same weights; `--quick`: 4 layers of hidden 2048, for a smoke run). Workload at each concurrency c
(default 1, 32, 256): c prompts of --input-len random token ids, each generating --output-len tokens, EOS ignored.
Output tokens/s = c x output-len / the wall time of the whole batch, prefill included, for both systems:

1. npuserve `LLMEngine` on the `cuda` backend (greedy, maxBatchSize = the largest concurrency, the KV pool sized to
   fit, 128-token blocks), driven step by step so its decode steps are timed on their own;
2. transformers: one `generate` call with the c prompts (equal lengths, so no padding), greedy, EOS off.

Roofline: the batch-1 decode step reads every weight once, so its rate is at most the copy bandwidth over the
weight bytes. The bandwidth is measured with a large device-to-device copy (read + write bytes over the time, as
../shared/notes/gpu-device.md counts it: 3.02 TB/s on an H100, so about 188 tok/s for Llama-3-8B's 16.06 GB). The
engine's batch-1 decode rate (its decode steps' tokens over their wall time) is reported as a fraction of it.

Greedy equality: --check-prompts prompts through both systems; the matching tokens and the first position where
they differ (bf16 rounds differently in the two: a late divergence is expected, an early one is a bug).

Targets (printed with their ratios): >= 70% of the roofline at batch 1, >= 3x transformers at concurrency 256.
Needs a CUDA GPU; runs with the GPU image's torch, transformers and triton plus npuserve's pure-Python deps.

    python3 -P benchmarks/gpu_decode.py [--quick] [--model-dir DIR] [--concurrency 1 32 256] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOFLINE_TARGET = 0.70  # of the HBM roofline at batch 1
SPEEDUP_TARGET = 3.0  # over transformers at the target concurrency
SPEEDUP_AT = 256
BLOCK_SIZE = 128  # MindIE's default cacheBlockSize
FIRST_PROMPT_ID = 5  # the dummy tokenizer's special ids are 0..4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="reuse (or write once) this model folder; default: a temp dir")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256], help="requests run at once")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--check-prompts", type=int, default=4, help="prompts in the greedy-equality check (0: skip)")
    p.add_argument("--skip-transformers", action="store_true", help="npuserve only (no ratios, no equality check)")
    p.add_argument("--quick", action="store_true", help="a small model shape, concurrency 1 8 32, 32 output tokens")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document at the end")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        if args.concurrency == [1, 32, 256]:
            args.concurrency = [1, 8, 32]
        args.output_len = min(args.output_len, 32)
    return args


@dataclass
class Run:
    concurrency: int
    seconds: float
    output_tokens: int
    decode_steps: int = 0
    decode_seconds: float = 0.0  # wall time of the decode steps (scheduler, runner, outputs)
    decode_runner_seconds: float = 0.0  # the runner's share of it (batch build, model, sampling)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)}


@dataclass
class Results:
    device: str
    model: dict[str, Any]
    copy_bandwidth_bytes_per_s: float = 0.0
    weight_bytes: int = 0
    npuserve: dict[int, Run] = field(default_factory=dict)
    transformers: dict[int, Run] = field(default_factory=dict)
    decode_graphs: str = "unknown"
    equality: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- model ---------------------------------------------------------------------------------------------------------


def model_spec(quick: bool) -> Any:
    from npuserve.catalog.models import get_model_preset

    spec = get_model_preset("llama3-8b")
    if quick:
        spec = spec.model_copy(update={"num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16,
                                       "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 7168,
                                       "vocab_size": 32000})
    return spec.model_copy(update={"dtype": "bfloat16", "max_position_embeddings": 4096})


def write_model(spec: Any, out: Path, seed: int) -> Path:
    """The dummy folder through `write_dummy_model`, its random values drawn on the GPU (minutes faster for 8B
    parameters than the CPU generator; the same distribution, other values)."""
    import torch

    from npuserve.engine.model import dummy

    gpu_gen = torch.Generator(device="cuda").manual_seed(seed)

    def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
        values = torch.randn(shape, generator=gpu_gen, device="cuda")
        values = 1.0 + 0.1 * values if name.endswith("norm.weight") else values * std
        return values.to(torch.bfloat16).cpu()

    original = dummy._random_tensor
    dummy._random_tensor = random_tensor
    try:
        return dummy.write_dummy_model(spec, out, seed=seed)
    finally:
        dummy._random_tensor = original


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PROMPT_ID, vocab) for _ in range(length)] for _ in range(count)]


# --- measurements --------------------------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 2 * 1024**3, iters: int = 20) -> float:
    """Bytes read plus written per second by a device-to-device copy of `nbytes`."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def build_engine(model_dir: Path, args: argparse.Namespace, num_seqs: int) -> Any:
    from npuserve.engine.engine import LLMEngine
    from npuserve.mindie_config import minimal_config

    max_seq = args.input_len + args.output_len + 1
    max_batch = max(num_seqs, 1)
    config = minimal_config(
        model_dir, max_seq_len=max_seq, max_input_len=args.input_len, cacheBlockSize=BLOCK_SIZE,
        maxBatchSize=max_batch, maxPrefillBatchSize=min(max_batch, 64),
        maxPrefillTokens=max(8192, args.input_len), extensions={"device": "cuda", "dtype": "bfloat16"},
    )
    blocks = max_batch * math.ceil(max_seq / BLOCK_SIZE) + 8  # every request at full length at once
    return LLMEngine(config, num_kv_blocks=blocks, num_host_blocks=0, seed=args.seed)


def run_engine(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> tuple[Run, list[list[int]]]:
    """All prompts at once; steps until done. Returns the run and each prompt's output tokens."""
    from npuserve.engine.scheduler import StepKind
    from npuserve.engine.sequence import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {}
    run = Run(len(prompts), 0.0, 0)
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    while engine.has_unfinished():
        s0 = time.perf_counter()
        result = engine.step()
        seconds = time.perf_counter() - s0
        if result.stats is not None and result.stats.kind is StepKind.DECODE:
            run.decode_steps += 1
            run.decode_seconds += seconds
            run.decode_runner_seconds += result.stats.seconds
        for out in result.outputs:
            if out.finished:
                if out.error:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                outputs[out.request_id] = list(out.token_ids)
    run.seconds = time.perf_counter() - t0
    tokens = [outputs[rid] for rid in ids]
    run.output_tokens = sum(len(t) for t in tokens)
    if run.output_tokens != output_len * len(prompts):
        raise RuntimeError(f"npuserve made {run.output_tokens} tokens, not {output_len * len(prompts)}")
    return run, tokens


def load_transformers(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as the engine's requests do
    return model


def run_transformers(model: Any, prompts: list[list[int]], output_len: int) -> tuple[Run, list[list[int]]]:
    import torch

    from npuserve.engine.model.dummy_tokenizer import PAD_ID

    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             do_sample=False, pad_token_id=PAD_ID)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = out[:, ids.shape[1]:].tolist()
    made = sum(len(t) for t in tokens)
    if made != output_len * len(prompts):
        raise RuntimeError(f"transformers made {made} tokens, not {output_len * len(prompts)} (EOS not ignored?)")
    return Run(len(prompts), seconds, made), tokens


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> list[dict[str, Any]]:
    rows = []
    for a, b in zip(ours, theirs, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        rows.append({"tokens": len(a), "matching": sum(x == y for x, y in zip(a, b, strict=True)),
                     "first_divergence": first})
    return rows


def divergence_margins(model: Any, prompts: list[list[int]], ours: list[list[int]],
                       rows: list[dict[str, Any]]) -> None:
    """At each first divergence, transformers' logit of its own token minus its logit of ours, over the shared
    prefix: a near tie (a small margin) is rounding; a large one is a bug. Adds `margin` to each divergent row."""
    import torch

    for prompt, tokens, row in zip(prompts, ours, rows, strict=True):
        i = row["first_divergence"]
        if i is None:
            continue
        ids = torch.tensor([prompt + tokens[:i]], device=model.device)
        with torch.inference_mode():
            logits = model(ids).logits[0, -1].float()
        row["margin"] = round(float(logits.max() - logits[tokens[i]]), 4)


def free_gpu() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


# --- report --------------------------------------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return f"{'PASS' if value >= target else 'FAIL'} ({value:.2f} vs target {target:.2f})"


def report(res: Results, args: argparse.Namespace) -> dict[str, Any]:
    bw, weights = res.copy_bandwidth_bytes_per_s, res.weight_bytes
    roofline = bw / weights if weights else 0.0
    log("")
    log(f"device: {res.device}; model: {res.model['shape']} ({weights / 1e9:.2f} GB of weights, bf16)")
    log(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s -> batch-1 decode roofline {roofline:.1f} tok/s")
    log(f"decode graphs: {res.decode_graphs}")
    log(f"{'concurrency':>11} | {'npuserve tok/s':>14} | {'transformers tok/s':>18} | {'ratio':>6} | "
        f"npuserve decode step (wall / runner)")
    doc: dict[str, Any] = {"device": res.device, "model": res.model, "copy_bandwidth_tb_s": round(bw / 1e12, 3),
                           "weight_gb": round(weights / 1e9, 3), "roofline_tok_s": round(roofline, 2),
                           "decode_graphs": res.decode_graphs, "runs": [], "targets": {}, "notes": res.notes}
    for c, ours in sorted(res.npuserve.items()):
        theirs = res.transformers.get(c)
        ratio = ours.tokens_per_s / theirs.tokens_per_s if theirs else None
        step = (f"{1000 * ours.decode_seconds / ours.decode_steps:.2f} / "
                f"{1000 * ours.decode_runner_seconds / ours.decode_steps:.2f} ms" if ours.decode_steps else "-")
        log(f"{c:>11} | {ours.tokens_per_s:>14.1f} | "
            f"{(f'{theirs.tokens_per_s:.1f}' if theirs else '-'):>18} | "
            f"{(f'{ratio:.2f}x' if ratio else '-'):>6} | {step}")
        doc["runs"].append({"concurrency": c, "npuserve": ours.summary(),
                            "transformers": theirs.summary() if theirs else None,
                            "ratio": round(ratio, 3) if ratio else None})
    one = res.npuserve.get(1)
    if one is not None and one.decode_steps and roofline:
        rate = one.decode_steps / one.decode_seconds
        runner_rate = one.decode_steps / one.decode_runner_seconds
        log(f"batch-1 decode: {rate:.1f} tok/s engine steps, {runner_rate:.1f} tok/s runner only = "
            f"{rate / roofline:.1%} / {runner_rate / roofline:.1%} of the roofline")
        log(f"target >= {ROOFLINE_TARGET:.0%} of the roofline at batch 1: {verdict(rate / roofline, ROOFLINE_TARGET)}")
        doc["targets"]["batch1_roofline_fraction"] = {"value": round(rate / roofline, 4),
                                                      "runner_only": round(runner_rate / roofline, 4),
                                                      "target": ROOFLINE_TARGET,
                                                      "pass": rate / roofline >= ROOFLINE_TARGET}
    at = res.npuserve.get(SPEEDUP_AT)
    base = res.transformers.get(SPEEDUP_AT)
    if at is not None and base is not None:
        speedup = at.tokens_per_s / base.tokens_per_s
        log(f"target >= {SPEEDUP_TARGET:.0f}x transformers at concurrency {SPEEDUP_AT}: "
            f"{verdict(speedup, SPEEDUP_TARGET)}")
        doc["targets"][f"speedup_at_{SPEEDUP_AT}"] = {"value": round(speedup, 3), "target": SPEEDUP_TARGET,
                                                     "pass": speedup >= SPEEDUP_TARGET}
    if res.equality:
        matching = sum(r["matching"] for r in res.equality)
        total = sum(r["tokens"] for r in res.equality)
        firsts = [r["first_divergence"] for r in res.equality]
        margins = [r.get("margin") for r in res.equality]
        log(f"greedy equality with transformers: {matching}/{total} tokens match; first divergence per prompt: "
            f"{['none' if f is None else f for f in firsts]}; transformers' logit margin there (its token over "
            f"ours; near 0 = a rounding tie): {margins}")
        doc["equality"] = res.equality
    for note in res.notes:
        log(f"note: {note}")
    return doc


# --- main ----------------------------------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_decode.py needs a CUDA GPU: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}). Run it on the GPU machine.", file=sys.stderr)
        return 2
    from npuserve.engine.backends import get_backend

    if get_backend("cuda").name != "cuda":
        print("the engine's get_backend('cuda') does not give the cuda backend yet: nothing to measure",
              file=sys.stderr)
        return 2

    from npuserve.modelspec import ModelSpec

    tmp = tempfile.TemporaryDirectory(prefix="npuserve-gpu-")
    model_dir = Path(args.model_dir) if args.model_dir else Path(tmp.name) / "model"
    if not (model_dir / "config.json").exists():
        t0 = time.perf_counter()
        write_model(model_spec(args.quick), model_dir, args.seed)
        log(f"model written to {model_dir} in {time.perf_counter() - t0:.0f} s")
    spec = ModelSpec.from_pretrained(model_dir)
    shape = (f"{spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_attention_heads} heads / "
             f"{spec.num_key_value_heads} KV, vocab {spec.vocab_size}")
    res = Results(device=torch.cuda.get_device_name(0), model={"shape": shape, "dir": str(model_dir)})
    res.copy_bandwidth_bytes_per_s = copy_bandwidth()

    concurrencies = sorted(set(args.concurrency))
    vocab = spec.vocab_size
    workloads = {c: random_prompts(c, args.input_len, vocab, args.seed + c) for c in concurrencies}
    check = random_prompts(args.check_prompts, args.input_len, vocab, args.seed + 10_000)

    # npuserve first, then its memory back before transformers loads the same weights
    t0 = time.perf_counter()
    engine = build_engine(model_dir, args, max([*concurrencies, len(check)]))
    log(f"npuserve engine ready in {time.perf_counter() - t0:.0f} s (backend {engine.backend.name})")
    res.weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    graphs = getattr(engine.runner, "decode_graphs", None)  # DecodeGraphs, once the runner has them
    res.decode_graphs = (f"on, batch sizes {graphs.buckets}" if graphs is not None and graphs.captured
                         else "off (the runner has none captured): decode runs eagerly")
    del graphs  # it holds the model: nothing may keep the engine's memory past `del engine`
    run_engine(engine, random_prompts(2, args.input_len, vocab, args.seed - 1), 8, "warmup")
    for c in concurrencies:
        run, _ = run_engine(engine, workloads[c], args.output_len, f"c{c}")
        res.npuserve[c] = run
        log(f"npuserve c={c}: {run.tokens_per_s:.1f} tok/s")
    ours_check: list[list[int]] = []
    if check:
        _, ours_check = run_engine(engine, check, args.output_len, "check")
    del engine
    free_gpu()

    if not args.skip_transformers:
        model = load_transformers(model_dir)
        run_transformers(model, random_prompts(2, args.input_len, vocab, args.seed - 1), 8)  # warm-up
        for c in concurrencies:
            run, _ = run_transformers(model, workloads[c], args.output_len)
            res.transformers[c] = run
            log(f"transformers c={c}: {run.tokens_per_s:.1f} tok/s")
        if check:
            _, theirs = run_transformers(model, check, args.output_len)
            res.equality = compare_tokens(ours_check, theirs)
            divergence_margins(model, check, ours_check, res.equality)
        del model
        free_gpu()
    if SPEEDUP_AT not in res.npuserve:
        res.notes.append(f"the speedup target is judged at concurrency {SPEEDUP_AT}, which did not run")
    doc = report(res, args)
    if args.json:
        print(json.dumps(doc, indent=2))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
