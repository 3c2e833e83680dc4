"""The client's token counter (docs/loadgen.md#what-it-measures): counts prompt and output tokens the way vLLM's `bench
serve` does, with the model's own tokenizer.json, so token figures do not depend on what the server reports.

`tokenizers` is imported only when a tokenizer is loaded: the simulator, which imports the datasets, runs where it
is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; the message names the folder or file."""


class TokenCounter(Protocol):
    """What the load generator needs of a tokenizer. `decode` must drop special tokens (random prompts rely on it
    to leave them out)."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """A Hugging Face `tokenizer.json`. Counting adds no special tokens (no BOS): the figure is the text's tokens,
    as vLLM's benchmark counts them; decoding skips special tokens."""

    def __init__(self, tokenizer: Tokenizer, name: str) -> None:
        self._tokenizer = tokenizer
        self.name = name
        # Every id, added tokens included: random prompts draw from this range and drop what decodes to nothing.
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))


def load_tokenizer(folder: Path) -> HFTokenizer:
    """The tokenizer of an HF model folder (its tokenizer.json); named by the folder."""
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"no {TOKENIZER_FILE} in {folder}: the tokenizer must be an HF model folder")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise TokenizerError(f"reading {path} needs the `tokenizers` package (pip install 'npuserve[engine]')") from e
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for a file it cannot parse
        raise TokenizerError(f"{path}: not a tokenizer the `tokenizers` library can read: {e}") from e
    return HFTokenizer(tokenizer, name=str(folder))
