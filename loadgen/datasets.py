"""The prompts a run sends (docs/loadgen.md#what-it-measures): vLLM's random dataset, GSM8K JSONL, ShareGPT JSON, and
any JSONL.

`load_requests` returns exactly the number asked for. File entries are shuffled by the seed and taken in that order;
a file with fewer usable entries than asked for is gone through again in the same order (vLLM oversamples too).
Only the chosen entries are tokenized, so a large ShareGPT file costs one JSON parse, not a tokenization of it all.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npuserve.loadgen.config import DEFAULT_MAX_OUTPUT_LEN, DatasetConfig, DatasetName
from npuserve.loadgen.records import BenchRequest
from npuserve.loadgen.tokenizer import TokenCounter


class DatasetError(ValueError):
    """An unreadable dataset; the message names the file, the entry (1-based line, or JSON element index for
    ShareGPT) and what is wrong with it."""


@dataclass(frozen=True)
class _Entry:
    """One usable dataset entry before tokenization."""

    prompt: str
    max_tokens: int | None = None  # given by the file (jsonl)
    completion: str | None = None  # the reference answer whose length is the output length (sharegpt)


def dataset_label(config: DatasetConfig) -> str:
    """What reports print as the data source."""
    if config.name is DatasetName.RANDOM:
        return f"random(in={config.random_input_len},out={config.random_output_len},ratio={config.random_range_ratio})"
    return _path(config).name


def load_requests(
    config: DatasetConfig, num: int, *, tokenizer: TokenCounter | None, seed: int
) -> list[BenchRequest]:
    """`num` requests from the configured dataset, the same ones for the same seed. With a tokenizer, prompt_len
    is the prompt's token count; without one it is None, except for random prompts (see `_random_requests`)."""
    if num < 0:
        raise ValueError(f"{num} requests: want >= 0")
    rng = random.Random(seed)
    if config.name is DatasetName.RANDOM:
        return _random_requests(config, num, tokenizer, rng)
    path = _path(config)
    entries = {
        DatasetName.GSM8K: _read_gsm8k,
        DatasetName.SHAREGPT: _read_sharegpt,
        DatasetName.JSONL: _read_jsonl,
    }[config.name](path)
    order = list(range(len(entries)))
    rng.shuffle(order)
    made: dict[int, BenchRequest] = {}  # an entry taken again (cycling) is not tokenized again
    requests = []
    for i in range(num):
        index = order[i % len(order)]
        if index not in made:
            made[index] = _request(entries[index], config.max_output_len, tokenizer)
        requests.append(made[index])
    return requests


def _path(config: DatasetConfig) -> Path:
    if config.path is None:
        raise DatasetError(f"dataset {config.name.value!r} needs a file: --dataset-path")
    return config.path


def _cap(max_tokens: int, max_output_len: int | None) -> int:
    return max_tokens if max_output_len is None else min(max_tokens, max_output_len)


def _request(entry: _Entry, max_output_len: int | None, tokenizer: TokenCounter | None) -> BenchRequest:
    if entry.completion is not None:
        # ShareGPT: the reference answer's length. Without a tokenizer, about 4 characters a token (English BPE).
        if tokenizer is not None:
            output_len = len(tokenizer.encode(entry.completion))
        else:
            output_len = math.ceil(len(entry.completion) / 4)
        max_tokens = max(1, output_len)
    elif entry.max_tokens is not None:
        max_tokens = entry.max_tokens
    else:
        max_tokens = max_output_len or DEFAULT_MAX_OUTPUT_LEN
    prompt_len = len(tokenizer.encode(entry.prompt)) if tokenizer is not None else None
    return BenchRequest(prompt=entry.prompt, prompt_len=prompt_len, max_tokens=_cap(max_tokens, max_output_len))


# --- random -------------------------------------------------------------------------------------------------------

# Common English words that most BPE vocabularies hold as one token (with their leading space), so a prompt of n
# words is about n tokens where no tokenizer is at hand.
_WORD_LIST = (
    "the of and to in is was for on that with as by at from it his an were are which this be or has had not but "
    "first one their its new after who they have her she two been other when there all during into school time "
    "may years more most only over city some world would where later up such used many can state about national "
    "out known university united then made also american three between born each game film several well under "
    "team year high part since second both before series war group early until north south house name home "
    "through public last while because work life water day line long people small place light music play book "
    "road river town open great land power number back left right area point down side head hand"
)
_WORDS = _WORD_LIST.split()

_MAX_LENGTH_ROUNDS = 10  # decode/re-encode rounds to bring a random prompt to its drawn length


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's bounds: integers in [L*(1-r), L*(1+r)], at least 1."""
    return max(int(length * (1 - ratio)), 1), max(int(length * (1 + ratio)), 1)


def _random_requests(
    config: DatasetConfig, num: int, tokenizer: TokenCounter | None, rng: random.Random
) -> list[BenchRequest]:
    """Prompts of random content and random lengths (vLLM's random dataset). With a tokenizer: random token ids
    decoded to text; decoding then re-encoding merges and splits tokens, so the text is re-encoded and trimmed or
    extended a few rounds, and prompt_len is its final count (it may still differ from the drawn length by a few
    tokens). Without one: that many words of a built-in list, and prompt_len is the drawn length, an estimate (one
    word is about one token)."""
    input_low, input_high = _length_range(config.random_input_len, config.random_range_ratio)
    output_low, output_high = _length_range(config.random_output_len, config.random_range_ratio)
    token_ids = _printable_token_ids(tokenizer) if tokenizer is not None else []
    requests = []
    for _ in range(num):
        input_len = rng.randint(input_low, input_high)
        max_tokens = _cap(rng.randint(output_low, output_high), config.max_output_len)
        if tokenizer is None:
            prompt, prompt_len = " ".join(rng.choices(_WORDS, k=input_len)), input_len
        else:
            prompt, prompt_len = _random_token_prompt(tokenizer, token_ids, input_len, rng)
        requests.append(BenchRequest(prompt=prompt, prompt_len=prompt_len, max_tokens=max_tokens))
    return requests


def _printable_token_ids(tokenizer: TokenCounter) -> list[int]:
    """The ids that decode on their own to text: no special tokens (they decode to nothing) and no fragments of a
    UTF-8 character (they decode to U+FFFD, which re-encodes as several tokens)."""
    ids = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if text and "\ufffd" not in text:
            ids.append(token_id)
    if not ids:
        raise DatasetError(f"tokenizer {tokenizer.name}: no token decodes to text; cannot make random prompts")
    return ids


def _random_token_prompt(
    tokenizer: TokenCounter, token_ids: list[int], length: int, rng: random.Random
) -> tuple[str, int]:
    ids = rng.choices(token_ids, k=length)
    text = tokenizer.decode(ids)
    for _ in range(_MAX_LENGTH_ROUNDS):
        encoded = tokenizer.encode(text)
        if len(encoded) == length:
            break
        ids = encoded[:length] if len(encoded) > length else encoded + rng.choices(token_ids, k=length - len(encoded))
        text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text))


# --- files --------------------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DatasetError(f"{path}: a folder, not a dataset file") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None


def _jsonl_objects(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The objects of a JSONL file with their 1-based line numbers; blank lines are skipped."""
    objects = []
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}, line {line_number}: bad JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(value, dict):
            raise DatasetError(f"{path}, line {line_number}: want a JSON object, got {type(value).__name__}")
        objects.append((line_number, value))
    if not objects:
        raise DatasetError(f"{path}: empty file, no entries")
    return objects


def _text_field(path: Path, line_number: int, value: dict[str, Any], key: str) -> str:
    text = value.get(key)
    if not isinstance(text, str) or not text:
        got = "missing" if key not in value else f"got {text!r}"[:80]
        raise DatasetError(f'{path}, line {line_number}: "{key}" must be a non-empty string ({got})')
    return text


def _read_gsm8k(path: Path) -> list[_Entry]:
    """GSM8K: {"question": ..., "answer": ...} per line; the question is the prompt."""
    return [_Entry(prompt=_text_field(path, n, value, "question")) for n, value in _jsonl_objects(path)]


def _read_jsonl(path: Path) -> list[_Entry]:
    """{"prompt": str, "max_tokens": optional positive int} per line; other keys are ignored."""
    entries = []
    for line_number, value in _jsonl_objects(path):
        prompt = _text_field(path, line_number, value, "prompt")
        max_tokens = value.get("max_tokens")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens <= 0):
            raise DatasetError(f'{path}, line {line_number}: "max_tokens" must be a positive integer '
                               f"(got {max_tokens!r})")
        entries.append(_Entry(prompt=prompt, max_tokens=max_tokens))
    return entries


_HUMAN_ROLES = frozenset({"human", "user"})
_ANSWER_ROLES = frozenset({"gpt", "assistant"})


def _read_sharegpt(path: Path) -> list[_Entry]:
    """ShareGPT: a JSON list of {"id", "conversations": [{"from": "human"|"gpt", "value": str}, ...]}. The first
    human turn is the prompt; the gpt turn right after it gives the output length. Conversations of fewer than two
    turns, or without a human turn answered by a gpt turn, are skipped (vLLM skips the short ones too)."""
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}, line {e.lineno}: bad JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: want a JSON list of conversations, got {type(data).__name__}")
    if not data:
        raise DatasetError(f"{path}: empty list, no conversations")
    entries = []
    for index, item in enumerate(data):
        where = f"{path}, element {index}"
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise DatasetError(f'{where}: want an object with a "conversations" list')
        for turn in turns:
            if not (isinstance(turn, dict) and all(isinstance(turn.get(key), str) for key in ("from", "value"))):
                raise DatasetError(f'{where}: every turn must be an object with string "from" and "value"')
        entry = _first_exchange(turns)
        if entry is not None:
            entries.append(entry)
    if not entries:
        raise DatasetError(f"{path}: no usable conversation (want a human turn followed by a gpt turn)")
    return entries


def _first_exchange(turns: list[dict[str, str]]) -> _Entry | None:
    for i, turn in enumerate(turns[:-1]):
        if turn["from"] in _HUMAN_ROLES:
            answer = turns[i + 1]
            if answer["from"] in _ANSWER_ROLES and turn["value"] and answer["value"]:
                return _Entry(prompt=turn["value"], completion=answer["value"])
            return None
    return None
