"""Structured output: grammars compiled with llguidance, one matcher per request. No torch here.

A request's constraint (`GuidedSpec`: a JSON schema, any JSON object, a regex, a list of choices or a Lark/GBNF
grammar) is compiled by `GrammarCompiler` in the request path, off the asyncio loop (`asyncio.to_thread`): the
grammar is validated against the model's vocabulary (from the model folder's tokenizer.json) and a template
matcher is built once and cached by the constraint's text, so a repeated schema costs a dictionary look-up. Each
sequence gets its own `Guide` (a copy of the template). On the step thread the step builder fills one bitmask row
per guided sequence (`guided_mask.py`), the runner applies them, and after sampling `advance` feeds each guide the
token it got; a guide whose grammar has ended (nothing but end-of-sequence may follow) ends its request with
finish_reason "stop".

Why llguidance: no Python dependencies (xgrammar pulls in transformers, triton and a TVM runtime), one abi3 wheel
per platform (x86_64 and aarch64, the Ascend hosts' architecture), masks computed lazily per step on the CPU
(no ahead-of-time index over the vocabulary, so compiling takes milliseconds), full context-free grammars (so
`json_object` is any JSON, not a depth-bounded regex as in outlines-core), and vLLM, SGLang and llama.cpp use it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import llguidance

    from npuserve.engine.sequence import Sequence

log = logging.getLogger(__name__)

GuideKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# JSON as Python's json.dumps writes it ({"a": 1, "b": [2, 3]}): what models mostly produce, and no run of
# whitespace for a model to loop in. A schema's "x-guidance" key can override it.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that does not compile (an invalid schema, regex or grammar); answered 400 naming the field."""


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """What a request constrains its output to. `value`: the schema (JSON text), the regex, the choices (JSON list)
    or the grammar text; unused for json_object."""

    kind: GuideKind
    value: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GuidedSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def choice(cls, choices: list[str]) -> GuidedSpec:
        return cls("choice", json.dumps(choices))


class Guide:
    """One sequence's grammar state (an llguidance matcher). Touched only by the step thread once queued."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advances by the sampled token; False if the grammar refused it (the matcher is then in error)."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def ended(self) -> bool:
        """The grammar is complete and admits nothing more (or the matcher failed)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A validated grammar with a template matcher in its start state; `new_guide` copies it (cheap)."""

    spec: GuidedSpec
    template: llguidance.LLMatcher

    def new_guide(self) -> Guide:
        return Guide(self.template.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; thread-safe, with an LRU cache of compiled grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GuidedSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it (its token trie), built on first use (~1 s for 150k tokens)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids or None)
            return self._tokenizer

    def grammar_text(self, spec: GuidedSpec) -> str:
        import llguidance

        matcher = llguidance.LLMatcher
        try:
            if spec.kind == "json_schema":
                return matcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            if spec.kind == "json_object":
                return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            if spec.kind == "regex":
                return matcher.grammar_from_regex(spec.value)
            if spec.kind == "choice":
                return llguidance.grammar_from("choice", spec.value)
            return llguidance.grammar_from("grammar", spec.value)
        except ValueError as e:
            raise GrammarError(str(e)) from e

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """The compiled grammar for `spec` (cached). Blocking (milliseconds, more for a large grammar): call it off
        the asyncio loop. Raises GrammarError with llguidance's message when the constraint is invalid."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        import llguidance

        grammar = self.grammar_text(spec)
        tokenizer = self.tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        compiled = CompiledGrammar(spec, template)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


def advance(seqs: Iterable[Sequence | None], token_ids: Iterable[int]) -> list[Sequence]:
    """Feeds each guided sequence the token it was given (None: a row whose token is not kept, a prompt chunk);
    returns those whose grammar has now ended (or failed: their `error` says why), which the engine ends with
    finish_reason "stop"."""
    ended = []
    for seq, token_id in zip(seqs, token_ids, strict=False):
        if seq is None or seq.guide is None or seq.is_finished:
            continue
        guide = seq.guide
        if not guide.accept(token_id):
            log.warning("request %s: the grammar refused token %d: %s", seq.seq_id, token_id, guide.error)
        if guide.ended:
            ended.append(seq)
    return ended
