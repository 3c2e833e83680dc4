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

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


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
        from npuserve.engine.model.dummy_tokenizer import build_tokenizer

        return cls(hf_tokenizer=build_tokenizer(vocab_size))

    def encode(self, text: str) -> list[int]:
        # The batch call releases the GIL while it works (`encode` holds it: a 15 MB prompt stalled every thread
        # of the server, the asyncio loop included, for its 15 s); `_fast` skips the offsets nobody reads.
        return self.encode_tail(text, None)[0]

    def encode_tail(self, text: str, limit: int | None) -> tuple[list[int], int]:
        """The last `limit` token ids (all with None) and the prompt's whole length: a 15 MB prompt's millions of
        ids are counted, never made into a Python list (which holds the GIL for a third of a second)."""
        encoding = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)([text])[0]
        total = len(encoding)
        if limit is not None and total > limit:
            if limit <= 0:
                return [], total
            encoding.truncate(limit, direction="left")
        return list(encoding.ids), total

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def to_json(self) -> str:
        """The tokenizer.json text (for the grammar library's view of the vocabulary)."""
        return str(self._tok.to_str())


class IncrementalDetokenizer:
    """One request's output text, grown token by token. vLLM's options: `skip_special_tokens` (default: special
    tokens are left out of the text), `include_stop_str_in_output` (the stop string found ends the text instead of
    being cut), `min_tokens` (stop strings are looked for only once more output tokens than that are out).
    `spaces_between_special_tokens` needs nothing here: like transformers' fast tokenizers (and vLLM with them), the
    `tokenizers` library never puts spaces between special tokens, so both values decode alike."""

    def __init__(self, tokenizer: TokenizerLike, stop: tuple[str, ...] = (), *, skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
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
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, self.emitted - longest + 1)
            cut, found = -1, ""
            if len(self.ids) > self.min_tokens:
                for s in self.stop:
                    at = self.text.find(s, search_from)
                    if at != -1 and (cut == -1 or at < cut):
                        cut, found = at, s
            if cut != -1:
                self.text = self.text[: cut + (len(found) if self.include_stop else 0)]
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
            self.text = self._decode(self.ids)
        return self.flush()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def flush(self) -> str:
        """Everything decoded and not handed out yet."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
