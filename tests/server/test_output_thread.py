"""The server's output processing runs off the step thread: a detokenizer that blocks does not hold up the steps
(docs/engine.md, "Threads"). No timing: the steps are counted while one decode call is held on an Event."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from npuserve.engine.detokenizer import TokenizerLike
from npuserve.engine.engine import LLMEngine
from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import FinishReason, SamplingParams
from npuserve.engine.server.async_engine import AsyncEngine, RequestStream
from npuserve.mindie_config import minimal_config

WAIT_SECONDS = 60  # a bound on waiting for a thread, never a measured time


class HeldTokenizer:
    """A tokenizer whose `decode`, once `hold` is set, blocks until `release` is set (`blocked` tells it did)."""

    def __init__(self, inner: TokenizerLike) -> None:
        self.inner = inner
        self.hold, self.blocked, self.release = threading.Event(), threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.hold.is_set() and not self.release.is_set():
            self.blocked.set()
            self.release.wait(WAIT_SECONDS)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


async def _collect(stream: RequestStream) -> list[RequestOutput]:
    return [o async for o in stream]


def test_a_blocked_detokenizer_does_not_hold_up_the_steps(tiny_model_dir: Path) -> None:
    engine = LLMEngine(minimal_config(tiny_model_dir, max_seq_len=256, maxIterTimes=128))
    assert engine.tokenizer is not None
    tokenizer = HeldTokenizer(engine.tokenizer)
    engine.outputs.tokenizer = tokenizer
    max_tokens = 40
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=("never sampled \x00",))

    async def run() -> tuple[int, int, list[list[RequestOutput]]]:
        served = AsyncEngine(engine)
        served.start()
        try:
            streams = [served.submit([5 + i, 6, 7], params) for i in range(4)]
            tokenizer.hold.set()
            assert await asyncio.to_thread(tokenizer.blocked.wait, WAIT_SECONDS)
            held_at = served.steps_run
            # the output thread sits in one decode call; the step thread goes on stepping all the same
            steps_while_held = await asyncio.to_thread(_steps_while, served, held_at, tokenizer)
            tokenizer.release.set()
            outputs = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), WAIT_SECONDS)
            return held_at, steps_while_held, list(outputs)
        finally:
            tokenizer.release.set()
            served.stop()

    held_at, steps_while_held, outputs = asyncio.run(run())
    assert steps_while_held >= 10, (held_at, steps_while_held)
    for outs in outputs:  # nothing lost or reordered while the output side was behind
        last = outs[-1]
        assert last.finished and last.finish_reason is FinishReason.LENGTH and len(last.token_ids) == max_tokens
        assert [t for o in outs for t in o.new_token_ids] == last.token_ids
        assert "".join(o.new_text for o in outs) == last.text == engine.tokenizer.decode(last.token_ids)


def _steps_while(served: AsyncEngine, start: int, tokenizer: HeldTokenizer) -> int:
    """Steps the step thread runs past `start` while the decode call stays blocked: waits for 10 of them, never
    longer than WAIT_SECONDS (the requests have 40 tokens to go: steps enough)."""
    poll = threading.Event()  # never set: a sleep that reads as one
    for _ in range(int(WAIT_SECONDS / 0.01)):
        if served.steps_run - start >= 10:
            break
        poll.wait(0.01)
    assert tokenizer.blocked.is_set() and not tokenizer.release.is_set()  # still held all along
    return served.steps_run - start


class BrokenTokenizer(HeldTokenizer):
    """Its `decode` raises once `hold` is set."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.hold.is_set():
            raise RuntimeError("injected detokenizer failure")
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_failing_detokenizer_ends_its_requests_with_an_error_and_frees_their_blocks(tiny_model_dir: Path) -> None:
    # on the step thread such a failure failed the step; on the output thread it must still end the requests it
    # hit (the client gets the error, the engine aborts them) and the next requests are served
    engine = LLMEngine(minimal_config(tiny_model_dir, max_seq_len=256, maxIterTimes=128))
    assert engine.tokenizer is not None
    tokenizer = BrokenTokenizer(engine.tokenizer)
    engine.outputs.tokenizer = tokenizer
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        served = AsyncEngine(engine)
        served.start()
        try:
            tokenizer.hold.set()
            broken = await asyncio.wait_for(_collect(served.submit([5, 6, 7], params)), WAIT_SECONDS)
            tokenizer.hold.clear()
            after = await asyncio.wait_for(_collect(served.submit([5, 6, 7], params)), WAIT_SECONDS)
            return broken, after
        finally:
            served.stop()

    broken, after = asyncio.run(run())
    assert broken[-1].finish_reason is FinishReason.ERROR and broken[-1].last
    assert broken[-1].error is not None and "injected detokenizer failure" in broken[-1].error
    assert after[-1].finish_reason is FinishReason.LENGTH and len(after[-1].token_ids) == 30
    assert engine.kv.num_used_blocks == 0
