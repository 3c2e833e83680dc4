"""Datasets and the client tokenizer: exactly the number of requests asked for, the same ones for the same seed,
lengths within vLLM's bounds, max_output_len capping, and every unreadable entry named by file and line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from npuserve.loadgen.config import DEFAULT_MAX_OUTPUT_LEN, DatasetConfig, DatasetName
from npuserve.loadgen.datasets import DatasetError, dataset_label, load_requests
from npuserve.loadgen.tokenizer import HFTokenizer, TokenizerError, load_tokenizer

# The GSM8K test split, where this checkout has it: $GSM8K_TEST_JSONL, else the workspace's shared folder beside it.
GSM8K_TEST = Path(
    os.environ.get("GSM8K_TEST_JSONL", Path(__file__).resolve().parents[2].parent / "shared/datasets/gsm8k/test.jsonl")
)
SPECIAL_TEXTS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")  # the dummy tokenizer's special tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> HFTokenizer:
    return load_tokenizer(tiny_model_dir)


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(name: str, path: Path | None = None, **fields: Any) -> DatasetConfig:
    return DatasetConfig(name=DatasetName(name), path=path, **fields)


def _conversation(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


# --- the tokenizer ------------------------------------------------------------------------------------------------


def test_the_tokenizer_counts_without_special_tokens_and_round_trips(tokenizer: HFTokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert ids and ids[0] != 1 and ids[-1] != 2  # no BOS (1) nor EOS (2) added
    assert tokenizer.decode(ids) == "The quick brown fox jumps over the lazy dog."
    assert tokenizer.decode([1, *ids, 2]) == "The quick brown fox jumps over the lazy dog."  # specials skipped
    assert tokenizer.vocab_size > 256


def test_counting_adds_no_bos_even_where_the_tokenizer_would(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    with_bos = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    with_bos.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    with_bos.save(str(tmp_path / "tokenizer.json"))
    assert with_bos.encode("hello").ids[0] == 1
    assert load_tokenizer(tmp_path).encode("hello") == with_bos.encode("hello", add_special_tokens=False).ids


def test_a_folder_without_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=re.escape(f"no tokenizer.json in {tmp_path}")):
        load_tokenizer(tmp_path)


def test_an_unreadable_tokenizer_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        load_tokenizer(tmp_path)


# --- random -------------------------------------------------------------------------------------------------------


def test_random_without_tokenizer_draws_word_prompts_within_the_bounds() -> None:
    config = _config("random", random_input_len=10, random_output_len=20, random_range_ratio=0.5)
    requests = load_requests(config, 500, tokenizer=None, seed=0)
    assert len(requests) == 500
    input_lens = {r.prompt_len for r in requests}
    assert all(r.prompt_len == len(r.prompt.split()) for r in requests)  # one word for each counted token
    assert min(input_lens) == 5 and max(input_lens) == 15  # [L*(1-r), L*(1+r)], both ends reachable
    output_lens = {r.max_tokens for r in requests}
    assert min(output_lens) == 10 and max(output_lens) == 30


def test_random_lengths_are_exact_without_a_range_and_never_zero() -> None:
    exact = load_requests(_config("random", random_input_len=7, random_output_len=3), 20, tokenizer=None, seed=1)
    assert {(r.prompt_len, r.max_tokens) for r in exact} == {(7, 3)}
    short = _config("random", random_input_len=1, random_output_len=1, random_range_ratio=0.9)
    assert {(r.prompt_len, r.max_tokens) for r in load_requests(short, 50, tokenizer=None, seed=1)} == {(1, 1)}


def test_random_output_lengths_are_capped_by_max_output_len() -> None:
    config = _config("random", random_output_len=100, random_range_ratio=0.5, max_output_len=80)
    max_tokens = [r.max_tokens for r in load_requests(config, 200, tokenizer=None, seed=2)]
    assert max(max_tokens) == 80 and min(max_tokens) == 50


def test_random_with_a_tokenizer_counts_the_prompt_it_sends(tokenizer: HFTokenizer) -> None:
    config = _config("random", random_input_len=64, random_range_ratio=0.5)
    requests = load_requests(config, 50, tokenizer=tokenizer, seed=3)
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt)) for r in requests)
    assert all(32 <= (r.prompt_len or 0) <= 96 for r in requests)
    assert not any(special in r.prompt for r in requests for special in SPECIAL_TEXTS)
    assert "\ufffd" not in "".join(r.prompt for r in requests)


def test_random_prompts_reach_the_drawn_length_with_the_dummy_tokenizer(tokenizer: HFTokenizer) -> None:
    # Decoding then re-encoding random ids merges tokens; the trimming rounds bring each prompt back to its length.
    for length in (1, 5, 300):
        requests = load_requests(_config("random", random_input_len=length), 30, tokenizer=tokenizer, seed=4)
        assert {r.prompt_len for r in requests} == {length}


@pytest.mark.parametrize("use_tokenizer", [False, True])
def test_random_is_the_same_for_the_same_seed(tokenizer: HFTokenizer, use_tokenizer: bool) -> None:
    counter = tokenizer if use_tokenizer else None
    config = _config("random", random_input_len=20, random_range_ratio=0.5)
    first = load_requests(config, 10, tokenizer=counter, seed=5)
    assert load_requests(config, 10, tokenizer=counter, seed=5) == first
    assert load_requests(config, 10, tokenizer=counter, seed=6) != first
    assert len({r.prompt for r in first}) == 10


# --- gsm8k --------------------------------------------------------------------------------------------------------


def test_gsm8k_asks_the_questions(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(5)]
    path = _jsonl(tmp_path / "gsm8k.jsonl", rows)
    requests = load_requests(_config("gsm8k", path), 5, tokenizer=None, seed=0)
    assert sorted(r.prompt for r in requests) == sorted(row["question"] for row in rows)
    assert {(r.prompt_len, r.max_tokens) for r in requests} == {(None, DEFAULT_MAX_OUTPUT_LEN)}
    counted = load_requests(_config("gsm8k", path, max_output_len=64), 5, tokenizer=tokenizer, seed=0)
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt)) and r.max_tokens == 64 for r in counted)


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="the GSM8K test split is not on this machine")
def test_the_real_gsm8k_test_split_gives_every_question_once() -> None:
    questions = [json.loads(line)["question"] for line in GSM8K_TEST.read_text().splitlines()]
    assert len(questions) == 1319
    requests = load_requests(_config("gsm8k", GSM8K_TEST), 1319, tokenizer=None, seed=0)
    assert Counter(r.prompt for r in requests) == Counter(questions)


def test_a_short_file_is_cycled_in_one_shuffled_order(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "three.jsonl", [{"prompt": p} for p in "abc"])
    prompts = [r.prompt for r in load_requests(_config("jsonl", path), 8, tokenizer=None, seed=0)]
    assert sorted(prompts[:3]) == ["a", "b", "c"]
    assert prompts == (prompts[:3] * 3)[:8]


def test_file_entries_are_shuffled_by_the_seed(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "many.jsonl", [{"prompt": f"p{i}"} for i in range(30)])
    first = load_requests(_config("jsonl", path), 10, tokenizer=None, seed=1)
    assert load_requests(_config("jsonl", path), 10, tokenizer=None, seed=1) == first
    assert load_requests(_config("jsonl", path), 10, tokenizer=None, seed=2) != first
    assert [r.prompt for r in first] != [f"p{i}" for i in range(10)]


def test_zero_requests_is_an_empty_list(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "one.jsonl", [{"prompt": "a"}])
    assert load_requests(_config("jsonl", path), 0, tokenizer=None, seed=0) == []


# --- jsonl --------------------------------------------------------------------------------------------------------


def test_jsonl_max_tokens_come_from_the_file_capped_by_max_output_len(tmp_path: Path) -> None:
    rows = [{"prompt": "short", "max_tokens": 10}, {"prompt": "long", "max_tokens": 500}, {"prompt": "default"}]
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    own = {r.prompt: r.max_tokens for r in load_requests(_config("jsonl", path), 3, tokenizer=None, seed=0)}
    assert own == {"short": 10, "long": 500, "default": DEFAULT_MAX_OUTPUT_LEN}
    capped = load_requests(_config("jsonl", path, max_output_len=100), 3, tokenizer=None, seed=0)
    assert {r.prompt: r.max_tokens for r in capped} == {"short": 10, "long": 100, "default": 100}


def test_jsonl_skips_blank_lines_and_ignores_other_keys(tmp_path: Path) -> None:
    path = tmp_path / "blank.jsonl"
    path.write_text('\n{"prompt": "a", "id": 7}\n   \n{"prompt": "b"}\n\n')
    assert sorted(r.prompt for r in load_requests(_config("jsonl", path), 2, tokenizer=None, seed=0)) == ["a", "b"]


# --- sharegpt -----------------------------------------------------------------------------------------------------


def _sharegpt(path: Path, conversations: list[Any]) -> Path:
    path.write_text(json.dumps(conversations, indent=1))
    return path


def test_sharegpt_asks_the_first_human_turn_for_the_answer_length(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    answer = "The answer is 72. " * 10 + "Yes"  # 183 characters
    path = _sharegpt(tmp_path / "sg.json", [
        _conversation(("human", "How much did she earn?"), ("gpt", answer), ("human", "later"), ("gpt", "x")),
    ])
    [counted] = load_requests(_config("sharegpt", path), 1, tokenizer=tokenizer, seed=0)
    assert counted.prompt == "How much did she earn?"
    assert counted.prompt_len == len(tokenizer.encode("How much did she earn?"))
    assert counted.max_tokens == len(tokenizer.encode(answer))
    [estimated] = load_requests(_config("sharegpt", path), 1, tokenizer=None, seed=0)
    assert (estimated.prompt_len, estimated.max_tokens) == (None, 46)  # a token for every 4 characters, rounded up
    [capped] = load_requests(_config("sharegpt", path, max_output_len=8), 1, tokenizer=None, seed=0)
    assert capped.max_tokens == 8


def test_sharegpt_skips_conversations_without_a_first_exchange(tmp_path: Path) -> None:
    path = _sharegpt(tmp_path / "sg.json", [
        _conversation(("human", "alone")),  # fewer than two turns
        {"id": "empty", "conversations": []},
        _conversation(("human", "unanswered"), ("human", "again")),
        _conversation(("human", ""), ("gpt", "an answer to nothing")),
        _conversation(("system", "be brief"), ("human", "kept"), ("gpt", "yes")),
    ])
    requests = load_requests(_config("sharegpt", path), 3, tokenizer=None, seed=0)
    assert [r.prompt for r in requests] == ["kept"] * 3


def test_sharegpt_with_no_usable_conversation_is_an_error(tmp_path: Path) -> None:
    unusable = [_conversation(("human", "alone")), _conversation(("gpt", "a"), ("gpt", "b"))]
    path = _sharegpt(tmp_path / "sg.json", unusable)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: no usable conversation")):
        load_requests(_config("sharegpt", path), 1, tokenizer=None, seed=0)


# --- errors name the file and the entry ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gsm8k", "sharegpt", "jsonl"])
def test_a_missing_file_is_named(tmp_path: Path, name: str) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(DatasetError, match=re.escape(f"{path}: file not found")):
        load_requests(_config(name, path), 1, tokenizer=None, seed=0)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_an_empty_jsonl_file_is_named(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: empty file")):
        load_requests(_config("gsm8k", path), 1, tokenizer=None, seed=0)


def test_bad_json_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",}\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}, line 3: bad JSON")):
        load_requests(_config("jsonl", path), 1, tokenizer=None, seed=0)


def test_a_line_that_is_not_an_object_is_named(tmp_path: Path) -> None:
    path = tmp_path / "list.jsonl"
    path.write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}, line 2: want a JSON object, got list")):
        load_requests(_config("jsonl", path), 1, tokenizer=None, seed=0)


def test_a_gsm8k_line_without_a_question_is_named(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "q.jsonl", [{"question": "q1"}, {"answer": "42"}])
    message = f'{path}, line 2: "question" must be a non-empty string (missing)'
    with pytest.raises(DatasetError, match=re.escape(message)):
        load_requests(_config("gsm8k", path), 1, tokenizer=None, seed=0)


@pytest.mark.parametrize("prompt", [None, "", 5])
def test_a_jsonl_line_without_a_prompt_is_named(tmp_path: Path, prompt: Any) -> None:
    row = {} if prompt is None else {"prompt": prompt}
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(DatasetError, match=re.escape(f'{path}, line 2: "prompt" must be a non-empty string')):
        load_requests(_config("jsonl", path), 1, tokenizer=None, seed=0)


@pytest.mark.parametrize("max_tokens", [0, -3, "5", 1.5, True])
def test_a_max_tokens_that_is_not_a_positive_int_is_named(tmp_path: Path, max_tokens: Any) -> None:
    path = _jsonl(tmp_path / "m.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c", "max_tokens": max_tokens}])
    with pytest.raises(DatasetError, match=re.escape(f'{path}, line 3: "max_tokens" must be a positive integer')):
        load_requests(_config("jsonl", path), 1, tokenizer=None, seed=0)


def test_bad_sharegpt_json_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text('[\n  {"id": "a",\n   "conversations": [}\n]\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}, line 3: bad JSON")):
        load_requests(_config("sharegpt", path), 1, tokenizer=None, seed=0)


@pytest.mark.parametrize(("content", "message"), [
    ({"conversations": []}, "want a JSON list of conversations, got dict"),
    ([], "empty list, no conversations"),
])
def test_a_sharegpt_file_that_is_not_a_list_of_conversations_is_named(tmp_path: Path, content: Any,
                                                                       message: str) -> None:
    path = _sharegpt(tmp_path / "sg.json", content)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: {message}")):
        load_requests(_config("sharegpt", path), 1, tokenizer=None, seed=0)


@pytest.mark.parametrize(("bad", "message"), [
    ("not an object", 'want an object with a "conversations" list'),
    ({"id": "no turns"}, 'want an object with a "conversations" list'),
    (
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "b"}]},
        'every turn must be an object with string "from" and "value"',
    ),
])
def test_a_bad_sharegpt_element_is_named_by_index(tmp_path: Path, bad: Any, message: str) -> None:
    path = _sharegpt(tmp_path / "sg.json", [_conversation(("human", "a"), ("gpt", "b")), bad])
    with pytest.raises(DatasetError, match=re.escape(f"{path}, element 1: {message}")):
        load_requests(_config("sharegpt", path), 1, tokenizer=None, seed=0)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}: not UTF-8")):
        load_requests(_config("jsonl", path), 1, tokenizer=None, seed=0)


# --- labels and imports -------------------------------------------------------------------------------------------


def test_the_label_names_the_source() -> None:
    random_config = _config("random", random_input_len=512, random_output_len=64, random_range_ratio=0.25)
    assert dataset_label(random_config) == "random(in=512,out=64,ratio=0.25)"
    assert dataset_label(_config("gsm8k", Path("data/gsm8k/test.jsonl"))) == "test.jsonl"


def test_the_modules_run_without_torch_httpx_matplotlib_or_tokenizers() -> None:
    # The simulator imports them where none of these is installed; None in sys.modules makes each import fail.
    code = (
        "import sys\n"
        "for name in ('torch', 'httpx', 'matplotlib', 'tokenizers', 'numpy'): sys.modules[name] = None\n"
        "from npuserve.loadgen.datasets import load_requests\n"
        "from itertools import islice\n"
        "from npuserve.loadgen.arrivals import iter_send_offsets\n"
        "from npuserve.loadgen.config import DatasetConfig\n"
        "import random\n"
        "print(len(load_requests(DatasetConfig(), 3, tokenizer=None, seed=0)), "
        "len(list(islice(iter_send_offsets(1.0, 1.0, random.Random(0)), 3))))\n"
    )
    # -P: the working directory is the repository root, whose `operator/` folder would shadow the stdlib.
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3 3"
