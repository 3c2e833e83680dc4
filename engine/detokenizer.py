"""Incremental detokenization and stop strings.

Byte-level BPE tokens may end in the middle of a UTF-8 character, so the text of the newest tokens is read
against a short window of the tokens before them (vLLM's prefix/read offsets) and held back while it ends in a
replacement character. Stop strings are searched in the new text plus the tail that could start one; text that
might be the start of a stop string is held back too, so a stream never shows a stop string's prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Tokenizer:
    """A thin wrapper of a `tokenizers` tokenizer.json (special tokens skipped in decode)."""

    def __init__(self, folder: str | Path | None = None, *, hf_tokenizer: Any = None) -> None:
        if hf_tokenizer is not None:
            self._tok = hf_tokenizer
            return
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(folder or ".") / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        self._tok = HFTokenizer.from_file(str(path))

    @classmethod
    def dummy(cls, vocab_size: int) -> Tokenizer:
        """The byte-level tokenizer `create-dummy` writes, for random-weight models that ship none."""
        from npuserve.engine.model.dummy_tokenizer import TOKENIZER_MAX_VOCAB, build_tokenizer

        return cls(hf_tokenizer=build_tokenizer(min(vocab_size, TOKENIZER_MAX_VOCAB)))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def to_json(self) -> str:
        """The tokenizer.json text (for the grammar library's view of the vocabulary)."""
        return str(self._tok.to_str())


class IncrementalDetokenizer:
    """One request's output text, grown token by token."""

    def __init__(self, tokenizer: TokenizerLike, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (stable part)
        self.emitted = 0  # chars of `text` already handed out
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped = False  # a stop string was found; `text` is cut before it

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the new text safe to show (empty while a character or a stop string is open)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, self.emitted - longest + 1)
            cut = -1
            for s in self.stop:
                at = self.text.find(s, search_from)
                if at != -1 and (cut == -1 or at < cut):
                    cut = at
            if cut != -1:
                self.text = self.text[:cut]
                self.stopped = True
                return self.flush()
            # Hold back a tail that may start a stop string.
            safe = len(self.text)
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        safe = min(safe, len(self.text) - k)
                        break
            delta = self.text[self.emitted : safe]
            self.emitted = max(self.emitted, safe)
            return delta
        return self.flush()

    def finish(self) -> str:
        """The request ended: the rest of the text, including a held-back tail or an unfinished character."""
        if not self.stopped:
            self.text = self.tokenizer.decode(self.ids)
        return self.flush()

    def flush(self) -> str:
        """Everything decoded and not handed out yet."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
