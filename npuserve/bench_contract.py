"""The contract between the operator and the load generator: the `npuserve bench` command line a benchmark-mode
trial's Job runs. The flags are defined here once; `loadgen/` declares its parser with them and the operator's
renderer builds the command with `bench_command`, so a renamed flag cannot leave the Jobs behind."""

from __future__ import annotations

FLAG_BASE_URL = "--base-url"
FLAG_MODEL = "--model"
FLAG_TOKENIZER = "--tokenizer"
FLAG_IGNORE_EOS = "--ignore-eos"
FLAG_REQUEST_TIMEOUT = "--request-timeout"
FLAG_DATASET_NAME = "--dataset-name"
FLAG_RANDOM_INPUT_LEN = "--random-input-len"
FLAG_RANDOM_OUTPUT_LEN = "--random-output-len"
FLAG_NUM_PROMPTS = "--num-prompts"
FLAG_DURATION = "--duration"
FLAG_MAX_CONCURRENCY = "--max-concurrency"
RANDOM_DATASET = "random"


def bench_command(*, base_url: str, model: str, input_len: int, output_len: int, concurrency: int,
                  duration_s: float, num_prompts: int, request_timeout_s: float,
                  tokenizer: str | None = None) -> list[str]:
    """`npuserve bench` closed loop at `concurrency` users for `duration_s`, random prompts of `input_len` tokens
    asking for exactly `output_len` (EOS ignored)."""
    command = [
        "npuserve", "bench", FLAG_BASE_URL, base_url, FLAG_MODEL, model,
        FLAG_DATASET_NAME, RANDOM_DATASET, FLAG_RANDOM_INPUT_LEN, str(input_len),
        FLAG_RANDOM_OUTPUT_LEN, str(output_len), FLAG_IGNORE_EOS,
        FLAG_MAX_CONCURRENCY, str(concurrency), FLAG_DURATION, f"{duration_s:g}",
        FLAG_NUM_PROMPTS, str(num_prompts), FLAG_REQUEST_TIMEOUT, f"{request_timeout_s:g}",
    ]
    if tokenizer is not None:
        command += [FLAG_TOKENIZER, tokenizer]
    return command
