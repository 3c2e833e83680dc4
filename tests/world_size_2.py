"""The three ways tests run one model at worldSize 2 against worldSize 1: the engine in this process (worldSize 1,
the reference), `npuserve generate --world-size 2` and `npuserve serve --world-size 2` through the official
`openai` client. Shared by the dense, MoE and DeepSeek tensor-parallel tests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.serve_process import wait_ready

NPUSERVE = str(Path(sys.executable).parent / "npuserve")
MAX_TOKENS = 12


def in_process(model_dir: Path, texts: list[str]) -> list[tuple[list[int], str]]:
    """worldSize 1's greedy tokens and text for each prompt."""
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import EngineEnvironment, minimal_config

    engine = LLMEngine(minimal_config(model_dir, max_seq_len=128), env=EngineEnvironment())
    outs = engine.generate(texts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [(o.token_ids, o.text) for o in outs]


def generate_world_size_2(model_dir: Path, texts: list[str], tmp_path: Path) -> tuple[list[list[int]], Any]:
    """`npuserve generate --world-size 2`: each prompt's tokens, and its ready line (stderr's last JSON) or None."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(t) + "\n" for t in texts))
    run = subprocess.run([NPUSERVE, "generate", "--model", str(model_dir), "--prompts-file", str(prompts_file),
                          "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--world-size", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    ready = json.loads(run.stderr.splitlines()[-1]) if run.stderr.strip().startswith("{") else None
    return [line["token_ids"] for line in lines if "index" in line], ready


def serve_world_size_2(model_dir: Path, texts: list[str]) -> list[tuple[int | None, str]]:
    """`npuserve serve --world-size 2`, one completion per prompt through the `openai` client: (completion tokens,
    text) each; checks `/info` says worldSize 2 and that the server ends cleanly on SIGTERM."""
    from openai import OpenAI

    from tests.serve_process import free_port

    port = free_port()
    proc = subprocess.Popen([NPUSERVE, "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port",
                             str(port), "--world-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout=180)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        served: list[tuple[int | None, str]] = []
        for text in texts:
            out = client.completions.create(model=model_dir.name, prompt=text, max_tokens=MAX_TOKENS,
                                            temperature=0.0, extra_body={"ignore_eos": True})
            served.append((out.usage.completion_tokens if out.usage else None, out.choices[0].text))
        assert httpx.get(f"http://127.0.0.1:{port}/info", timeout=5).json()["worldSize"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, log
    return served
