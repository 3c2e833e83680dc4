"""Logprobs as OpenAI and vLLM send them, from the engine's ids and values: completions' `logprobs` (tokens,
token_logprobs, top_logprobs as {token: logprob} dicts with the chosen token in them, text_offset), echoed prompt
tokens (the first one's logprob null), vLLM's `prompt_logprobs`, and chat's `logprobs.content` entries with their
`top_logprobs` (token, logprob, bytes). Also `best_of`'s choice of the n sequences to return."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import PromptLogprob, TopLogprobs
from npuserve.engine.server.protocol import (
    ChatLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprobEntry,
)

TokenText = Callable[[int], str]


def completion_logprobs(text_of: TokenText, token_ids: Sequence[int], logprobs: Sequence[float | None],
                        tops: Sequence[TopLogprobs | None] | None, offset: int = 0) -> CompletionLogprobs:
    """`tops` None: top_logprobs absent (logprobs: 0); an entry None: null there (an echoed first token)."""
    texts = [text_of(t) for t in token_ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top_dicts: list[dict[str, float] | None] | None = None
    if tops is not None:
        top_dicts = []
        for text, lp, top in zip(texts, logprobs, tops, strict=True):
            if top is None or lp is None:
                top_dicts.append(None)
                continue
            entry: dict[str, float] = {}
            for i, v in top:  # tokens with the same text keep the most likely one's value
                entry.setdefault(text_of(i), v)
            entry.setdefault(text, lp)  # the chosen token is always there (OpenAI: up to logprobs + 1 entries)
            top_dicts.append(entry)
    return CompletionLogprobs(tokens=texts, token_logprobs=list(logprobs), top_logprobs=top_dicts,
                              text_offset=offsets)


def echoed_prompt(prompt_ids: Sequence[int], prompt_lps: Sequence[PromptLogprob] | None,
                  with_top: bool) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """An echoed prompt's token logprobs and tops: null for the first token (nothing precedes it)."""
    lps: list[float | None] = [None]
    tops: list[TopLogprobs | None] = [None]
    entries = list(prompt_lps or [])
    for token, entry in zip(prompt_ids[1:], entries, strict=False):
        lps.append(entry.logprob)
        tops.append([(token, entry.logprob), *entry.top] if with_top else [])
    return lps, tops


def prompt_logprobs_field(text_of: TokenText, prompt_ids: Sequence[int],
                          prompt_lps: Sequence[PromptLogprob] | None) -> list[dict[str, PromptLogprobEntry] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else token id -> logprob, rank, text for
    the token itself and the top k."""
    result: list[dict[str, PromptLogprobEntry] | None] = [None]
    for token, entry in zip(prompt_ids[1:], prompt_lps or [], strict=False):
        d = {str(token): PromptLogprobEntry(logprob=entry.logprob, rank=entry.rank, decoded_token=text_of(token))}
        for rank, (tid, lp) in enumerate(entry.top, start=1):
            d.setdefault(str(tid), PromptLogprobEntry(logprob=lp, rank=rank, decoded_token=text_of(tid)))
        result.append(d)
    return result


def chat_logprobs(text_of: TokenText, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[TopLogprobs] | None) -> list[ChatLogprob]:
    entries = []
    for k, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        text = text_of(token_id)
        top = [ChatTopLogprob(token=(t := text_of(i)), logprob=v, bytes=list(t.encode()))
               for i, v in (tops[k] if tops is not None and k < len(tops) else [])]
        entries.append(ChatLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=top))
    return entries


def best_of(finals: Sequence[RequestOutput], n: int) -> list[RequestOutput]:
    """The n sequences of highest cumulative logprob (vLLM's former best_of), best first; all of them, in choice
    order, when there are no more than n."""
    if len(finals) <= n:
        return sorted(finals, key=lambda o: o.index)
    return sorted(finals, key=lambda o: (-o.cumulative_logprob, o.index))[:n]
