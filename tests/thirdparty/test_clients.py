"""The engine as the tools platform engineers run against an inference server see it: NVIDIA aiperf, guidellm and
lm-eval, pinned, unchanged, from their own virtualenv (`tools_venv.py`), against the real `npuserve serve` on the tiny
dummy model. vLLM's `vllm bench serve` (a multi-GB install) runs in `make conformance` (`test_conformance.py`).

The first run builds the tools' virtualenv (minutes, progress lines on stderr); later runs find it in the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve_process import serve_process
from tests.thirdparty.tools_venv import ensure_tools

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tools() -> Path:
    return ensure_tools("clients") / "bin"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[str]:
    with serve_process("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--log-level", "warning",
                       ) as (base, _):
        yield base


def run_tool(argv: list[str], cwd: Path, timeout: float = 600, stdin: str | None = None) -> str:
    """A tool from the tools' virtualenv, in a scratch folder (the repository root's `operator/` would shadow the
    standard library for its worker processes); its output on failure."""
    env = os.environ | {"PYTHONSAFEPATH": "1", "NO_COLOR": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, input=stdin)
    assert proc.returncode == 0, f"{argv[0]} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def generated_tokens(base: str) -> float:
    """The server's own count of generated tokens (what its usage fields add up to)."""
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("npuserve:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no generation_tokens_total")


# --- aiperf ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_aiperf_streams_with_no_error_and_counts_the_servers_tokens(tools: Path, server: str, tiny_model_dir: Path,
                                                                    tmp_path: Path, endpoint: str) -> None:
    """Before: 48 of 48 rejected ("No responses with actual content"): the chunks carried no `object`."""
    before = generated_tokens(server)
    run_tool([str(tools / "aiperf"), "profile", "--model", "tiny", "--url", server, "--endpoint-type", endpoint,
              "--streaming", "--tokenizer", str(tiny_model_dir), "--request-count", "48", "--concurrency", "8",
              "--prompt-input-tokens-mean", "64", "--prompt-input-tokens-stddev", "0", "--output-tokens-mean", "32",
              "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--random-seed", "0",
              "--artifact-dir", str(tmp_path / "aiperf"), "--ui", "none", "--no-server-metrics",
              "--no-gpu-telemetry"], cwd=tmp_path)
    report: dict[str, Any] = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    served = generated_tokens(server) - before
    assert report["request_count"]["avg"] == 48
    assert not report.get("error_summary"), report.get("error_summary")
    assert report["total_osl"]["avg"] == served == 48 * 32  # aiperf's output tokens are the server's usage


# --- guidellm --------------------------------------------------------------------------------------------------------


def _guidellm(tools: Path, server: str, tiny_model_dir: Path, tmp_path: Path, request_format: str, profile: str,
              count: int) -> dict[str, Any]:
    out = tmp_path / f"guidellm-{request_format.rsplit('/', 1)[-1]}.json"
    run_tool([str(tools / "guidellm"), "run",
              "--backend", f"kind=openai_http,target={server},model=tiny,request_format={request_format}",
              "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
              "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
              "--tokenizer", f"kind=huggingface_auto,model={tiny_model_dir}",
              "--output", f"kind=json,path={out}", "--disable-progress"], cwd=tmp_path)
    benchmark: dict[str, Any] = json.loads(out.read_text())["benchmarks"][0]
    return benchmark


def test_guidellm_concurrent_chat_and_synchronous_completions(tools: Path, server: str, tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    chat = _guidellm(tools, server, tiny_model_dir, tmp_path, "/v1/chat/completions", "kind=concurrent,streams=50",
                     200)
    assert chat["metrics"]["request_totals"] == {"successful": 200, "errored": 0, "incomplete": 0, "total": 200}
    completions = _guidellm(tools, server, tiny_model_dir, tmp_path, "/v1/completions", "kind=synchronous", 30)
    assert completions["metrics"]["request_totals"] == {"successful": 30, "errored": 0, "incomplete": 0,
                                                        "total": 30}


# --- lm-eval ---------------------------------------------------------------------------------------------------------

LM_EVAL_DRIVER = r"""
import json, sys
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

base, tokenizer = sys.argv[1], sys.argv[2]
work = json.loads(sys.stdin.read())
lm = LocalCompletionsAPI(base_url=base + "/v1/completions", model="tiny", tokenizer=tokenizer,
                         tokenizer_backend="huggingface", max_length=512)
ll = lm.loglikelihood([Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(work["loglikelihood"])],
                      disable_tqdm=True)
gen = lm.generate_until([Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 8}), i)
                         for i, c in enumerate(work["generate"])], disable_tqdm=True)
print(json.dumps({"loglikelihood": ll, "generate": gen}))
"""

CONTEXTS = ["The capital of France is", "Natalia sold clips to 48 of her friends", "The quick brown fox",
            "Simple is better than", "She walked to the market in the morning"]
CONTINUATIONS = [" Paris", " and then she sold half as many", " jumps over the lazy dog"]


def lm_eval(tools: Path, server: str, tokenizer: Path, tmp_path: Path,
            pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """lm-eval's `local-completions` against `server`: the pairs' loglikelihoods and CONTEXTS' greedy generations."""
    driver = tmp_path / "lm_eval_driver.py"
    driver.write_text(LM_EVAL_DRIVER)
    out = run_tool([str(tools / "python"), "-P", str(driver), server, str(tokenizer)], cwd=tmp_path,
                   stdin=json.dumps({"loglikelihood": pairs, "generate": CONTEXTS}))
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def transformers_loglikelihoods(model: Any, tokenizer: Any, pairs: list[tuple[str, str]]) -> list[float]:
    """Each continuation's summed log-probability after its context, as lm-eval defines it (the continuation's
    tokens are those of context + continuation past the context's)."""
    import torch

    found = []
    for context, continuation in pairs:
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        start = len(tokenizer.encode(context, add_special_tokens=False))
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
        found.append(sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole))))
    return found


def test_lm_eval_loglikelihoods_equal_transformers(tools: Path, server: str, tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    """lm-eval's `local-completions` (echo, logprobs, max_tokens 1, token ids): 15 loglikelihoods equal to
    transformers' on the same weights, and greedy generations equal to transformers' greedy decoding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs = [(c, x) for c in CONTEXTS for x in CONTINUATIONS]
    result = lm_eval(tools, server, tiny_model_dir, tmp_path, pairs)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    references = transformers_loglikelihoods(model, tokenizer, pairs)
    worst = 0.0
    for pair, (theirs, _), reference in zip(pairs, result["loglikelihood"], references, strict=True):
        worst = max(worst, abs(theirs - reference))
        assert theirs == pytest.approx(reference, abs=1e-5), pair
    print(f"\nlm-eval: {len(pairs)} loglikelihoods, largest difference from transformers {worst:.2e}")
    for context, theirs in zip(CONTEXTS, result["generate"], strict=True):
        ids = tokenizer(context, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        text = tokenizer.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True).split("\n\n")[0]
        assert theirs == text, context


# --- lm-eval on a W8A8 checkpoint (issue 31) -------------------------------------------------------------------------

# |lm-eval's loglikelihood - transformers'| (nats, summed over the continuation's tokens) on llm-compressor's W8A8
# dense dummy, 15 pairs, the engine in float32 on the CPU, transformers 5.24.0 + compressed-tensors 0.19.0 in
# float32 on the same folder. Measured 2026-11-27 (torch 2.15.0) with `pytest -s -k quantized` (the test prints
# p50 / max): MEASURED_LL. The bound is 1.5x the measured max, and no tighter than float32's 1e-4.
# Static: compressed-tensors fake-quantizes the activations with the checkpoint's input_scale, the rounding the
# engine's int8 path does, so the two agree to float32 noise. Dynamic: its per-token scale is max|x| / 127.5, the
# engine's max|x| / 127 (vLLM's and npu_dynamic_quant's), so the rounding differs.
# The loglikelihoods themselves are up to 49.5 nats (random dummy weights).
MEASURED_LL = {"w8a8": (4.77e-7, 1.43e-6), "w8a8_dynamic": (4.84e-3, 1.22e-2)}  # (p50, max)
LL_BOUND = {"w8a8": 1e-4, "w8a8_dynamic": 0.018}


@pytest.fixture(scope="module", params=["w8a8", "w8a8_dynamic"])
def quantized_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                     ) -> Iterator[tuple[str, str, Path]]:
    """`npuserve serve` (float32 compute, as transformers' reference) on llm-compressor's W8A8 dense dummy."""
    from npuserve.mindie_config import minimal_config
    from tests.quant_checkpoints import quant_checkpoint

    method: str = request.param
    folder = quant_checkpoint("llmcompressor", "dense", method)  # type: ignore[arg-type]
    config = tmp_path_factory.mktemp("w8a8-config") / "config.json"
    config.write_text(json.dumps(minimal_config(folder, extensions={"dtype": "float32"}).to_dict()))
    with serve_process("--config", str(config), "--served-model-name", "tiny", "--log-level", "warning",
                       ) as (base, _):
        yield method, base, folder


def test_lm_eval_loglikelihoods_on_a_quantized_checkpoint_near_transformers(
        tools: Path, quantized_server: tuple[str, str, Path], tmp_path: Path) -> None:
    """The same 15 loglikelihoods through lm-eval against the served W8A8 checkpoint, within the measured bound of
    transformers' on the same folder (compressed-tensors); the greedy generations come back, one per context."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    method, server, folder = quantized_server
    pairs = [(c, x) for c in CONTEXTS for x in CONTINUATIONS]
    result = lm_eval(tools, server, folder, tmp_path, pairs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    references = transformers_loglikelihoods(model, AutoTokenizer.from_pretrained(folder), pairs)
    errors = [abs(theirs - reference) for (theirs, _), reference in zip(result["loglikelihood"], references,
                                                                          strict=True)]
    print(f"\nlm-eval on {method}: |loglikelihood - transformers'| p50 {statistics.median(errors):.3g} "
          f"max {max(errors):.3g} (of |loglikelihood| up to {max(abs(r) for r in references):.3g})")
    assert max(errors) <= LL_BOUND[method], list(zip(pairs, errors, strict=True))
    assert len(result["generate"]) == len(CONTEXTS)
