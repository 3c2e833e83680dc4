"""Output tokens/s through HTTP streaming (the real `npuserve serve` process, 32 concurrent SSE clients) against
the offline engine on the same dummy model, prompts and batch limit. Prints both and their ratio (target >= 0.8).

    .venv/bin/python benchmarks/server_overhead.py [--num-prompts 128] [--max-tokens 64] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATASET = REPO.parent / "shared" / "datasets" / "gsm8k" / "test.jsonl"
# A model where the forward pass costs what a small real one does on this CPU (about 60 MB in float32).
MODEL_FIELDS = {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 64, "intermediate_size": 1408, "vocab_size": 8192}


def load_prompts(path: Path, n: int) -> list[str]:
    if not path.exists():
        return [f"Question {i}: how many apples are left if you eat {i % 7} of {i + 10}?" for i in range(n)]
    lines = path.read_text().splitlines()[:n]
    return [json.loads(line)["question"] for line in lines]


def make_model(folder: Path) -> Path:
    from npuserve.catalog import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    spec = get_model_preset("llama3-8b").model_copy(update={**MODEL_FIELDS, "dtype": "float32"})
    return write_dummy_model(spec, folder, seed=0)


def config_file(model: Path, folder: Path, batch: int) -> Path:
    from npuserve.mindie_config import minimal_config

    config = minimal_config(model, max_seq_len=1024, maxBatchSize=batch, maxPrefillBatchSize=batch,
                            extensions={"device": "cpu"})
    path = folder / "config.json"
    config.save(path)
    return path


def offline(config_path: Path, prompts: list[str], max_tokens: int) -> float:
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import MindIEConfig

    engine = LLMEngine(MindIEConfig.load(config_path))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:4], params)  # warm caches the same way the server's first requests do
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed


async def _stream_all(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> int:
    semaphore = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, prompt: str) -> None:
        nonlocal tokens
        payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                   "stream": True, "stream_options": {"include_usage": True}}
        async with semaphore, client.stream("POST", url + "/v1/completions", json=payload) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens += usage["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, p) for p in prompts))
    return tokens


def served(config_path: Path, prompts: list[str], max_tokens: int, concurrency: int) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(sys.executable).parent / "npuserve"
    proc = subprocess.Popen([str(script), "serve", "--config", str(config_path), "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("npuserve serve exited")
            time.sleep(0.2)
        asyncio.run(_stream_all(url, prompts[:4], max_tokens, concurrency))  # warm-up, as offline
        start = time.perf_counter()
        tokens = asyncio.run(_stream_all(url, prompts, max_tokens, concurrency))
        return tokens / (time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    prompts = load_prompts(args.dataset, args.num_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model")
        config_path = config_file(model, Path(tmp), args.concurrency)
        offline_tps = offline(config_path, prompts, args.max_tokens)
        http_tps = served(config_path, prompts, args.max_tokens, args.concurrency)
    print(f"model: {MODEL_FIELDS}, {args.num_prompts} GSM8K prompts, {args.max_tokens} output tokens each")
    print(f"offline engine (maxBatchSize {args.concurrency}):         {offline_tps:8.1f} output tokens/s")
    print(f"HTTP streaming, {args.concurrency} concurrent clients:     {http_tps:8.1f} output tokens/s")
    print(f"ratio HTTP / offline: {http_tps / offline_tps:.2f} (target >= 0.8)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
