"""A byte-level BPE tokenizer built on the spot with the `tokenizers` library, for dummy model folders.

No training data ships with the project and no hub is reachable, so the merges are learned from a short built-in
corpus (some everyday and arithmetic prose). Any text still encodes: byte-level BPE falls back to bytes. The corpus
gives about 600 entries; filler words take the rest of the model's ids, so every id a random model samples decodes
to text (client-side token counts of benchmarks on dummy models would otherwise miss the ids that decode to
nothing: 42% of the tiny model's).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4: pad 0, bos 1, eos 2
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARITHMETIC = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Weng earns $12 an hour for babysitting. "
    "Yesterday, she just did 50 minutes of babysitting. How much did she earn? The answer is 72. "
    "Let's think step by step. First, we add the numbers, then we multiply the total by two and subtract three. "
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
)


_PROSE = (
    "Simple is better than complex, and readable code is better than clever code. "
    "A scheduler decides which requests run in the next step; the cache keeps the keys and values of each token. "
    "When the queue is long, the server answers with a status code and asks the client to retry later. "
    "She walked to the market in the morning, bought three apples and two loaves of bread, and went home. "
    "The weather was warm, the river was quiet, and the children played in the park until the evening. "
)


def _corpus() -> list[str]:
    text = (_PROSE + _ARITHMETIC) * 4
    return [sentence.strip() + "." for sentence in text.split(".") if sentence.strip()]


def _trained(vocab_size: int) -> Tokenizer:
    """Byte-level BPE learned from the built-in corpus: at most `vocab_size` entries, about 600 (the corpus runs
    out of merges)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    return tokenizer


# Filler words are made of capitals the corpus never uses, so no learned merge applies inside them: with their own
# merges (each word = its prefix + its last letter), a filler word re-encodes to exactly its one token.
FILLER_LETTERS = "BCDEGIJKOQRUVXZ"


def _filler_words() -> Iterator[str]:
    """Words for the ids the corpus leaves: a space and one, two, three... of FILLER_LETTERS, in byte-level BPE's
    spelling ("Ġ" is the space)."""
    for length in itertools.count(1):
        for letters in itertools.product(FILLER_LETTERS, repeat=length):
            yield "Ġ" + "".join(letters)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` entries (specials and the 256 bytes included), so that
    every id the model can sample decodes to text: the merges learned from the corpus, then filler words for the
    rest of the ids (" B", " C", ..., " BB", ...), each with the merge that makes it, so the text of a filler token
    encodes back to that one token (a client that counts tokens by re-encoding the text counts them right)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the 256 byte tokens and {len(SPECIAL_TOKENS)} specials")
    tokenizer = _trained(vocab_size)
    if tokenizer.get_vocab_size() >= vocab_size:
        return tokenizer
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    next_id = max(vocab.values()) + 1
    for word in _filler_words():
        if next_id >= vocab_size:
            break
        merges.append([word[:-1], word[-1]])
        if word not in vocab:
            vocab[word] = next_id
            next_id += 1
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer(folder: Path, vocab_size: int, model_max_length: int) -> Tokenizer:
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tokenizer
