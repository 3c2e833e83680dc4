"""What the backend tests share: sequences on shuffled blocks, a cache already full of random K/V, and greedy
generation through a `ModelRunner` (with a prefix-cache hit; whole prefills or chunked prefill) to compare a
backend's tokens with the CPU's."""

from __future__ import annotations

import math
import random

import torch

from npuserve.engine.runner import ModelRunner
from npuserve.engine.sampler import SamplerOutput
from npuserve.engine.sequence import SamplingParams, Sequence
from npuserve.engine.step_builder import StepBuilder

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32  # one attention layer in the backend tests (GQA: 4 query heads a KV head)
# A backend's attention against the CPU backend's: float32 to its accumulation order, the half types within a few
# units of their last place (bfloat16's is 2^-7).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def qkv(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model makes them: views of one fused projection (k and v not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q, k, v = torch.split(fused, [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return (q.reshape(tokens, HEADS, HEAD_DIM), k.reshape(tokens, KV_HEADS, HEAD_DIM),
            v.reshape(tokens, KV_HEADS, HEAD_DIM))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def shuffled_sequences(total: list[int], cached: list[int], seed: int, *, num_blocks: int,
                       block_size: int) -> list[Sequence]:
    """Sequences of `total` tokens, the first `cached` of them already in the cache, on blocks from a shuffled pool
    (no sequence's blocks contiguous or sorted)."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    seqs = []
    for n, c in zip(total, cached, strict=True):
        seq = Sequence(list(range(1, n + 1)), SamplingParams(temperature=0.0), arrival_time=0.0)
        blocks = math.ceil(n / block_size)
        seq.block_table, pool = pool[:blocks], pool[blocks:]
        seq.num_cached_tokens = c
        seqs.append(seq)
    return seqs


def random_kv_cache(dtype: torch.dtype, seed: int, *, num_blocks: int, block_size: int, kv_heads: int,
                    head_dim: int) -> torch.Tensor:
    """A layer's cache already holding random K/V everywhere (what earlier steps and prefix hits left there)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)


def run_step(runner: ModelRunner, seqs: list[Sequence], *, is_prefill: bool,
             num_new_tokens: list[int] | None = None) -> SamplerOutput:
    """One step of `seqs` the engine's way: the step builder's `StepInput`, run by `runner`."""
    builder = StepBuilder(runner.block_size, runner.backend.device, runner.spec.vocab_size)
    return runner.execute(builder.build(seqs, is_prefill=is_prefill, num_new_tokens=num_new_tokens))


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], steps: int, seed: int) -> list[list[int]]:
    """Greedy: one prefill of all prompts but the last, a second prefill (the last prompt behind the second prompt's
    first two blocks: a prefix-cache hit), then decodes of all; blocks drawn from a shuffled pool."""
    block_size = runner.block_size
    pool = list(range(runner.num_blocks))
    random.Random(seed).shuffle(pool)

    def admit(prompt: list[int], shared: list[int]) -> Sequence:
        nonlocal pool
        seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=steps), arrival_time=0.0)
        fresh = math.ceil((len(prompt) + steps + 1) / block_size) - len(shared)
        seq.block_table, pool = shared + pool[:fresh], pool[fresh:]
        seq.num_cached_tokens = len(shared) * block_size
        return seq

    def advance(seqs: list[Sequence], tokens: list[int]) -> None:
        for seq, token in zip(seqs, tokens, strict=True):
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(token)

    first = [admit(p, []) for p in prompts[:-1]]
    advance(first, run_step(runner, first, is_prefill=True).token_ids)
    assert len(prompts[1]) > 2 * block_size  # the hit covers two whole blocks
    hit_prompt = prompts[1][: 2 * block_size] + prompts[-1]
    second = [admit(hit_prompt, first[1].block_table[:2])]
    advance(second, run_step(runner, second, is_prefill=True).token_ids)
    seqs = first + second
    for _ in range(steps - 1):
        advance(seqs, run_step(runner, seqs, is_prefill=False).token_ids)
    return [s.token_ids[s.num_prompt_tokens:] for s in seqs]


def greedy_tokens_chunked(runner: ModelRunner, prompts: list[list[int]], steps: int, seed: int,
                          chunk: int) -> list[list[int]]:
    """Greedy with chunked prefill, as the scheduler runs it: each step carries the decodes of the sequences whose
    prompts are done (one token each, first) and up to `chunk` more prompt tokens of each sequence still
    prefilling, so steps mix decodes and chunks, and a chunk continues a prompt at a prefix that is no multiple of
    the block size unless `chunk` is one. What a chunk short of its prompt's end samples is dropped. The last
    prompt is admitted behind the second prompt's first two blocks (a prefix-cache hit) once they are computed.
    Blocks from a shuffled pool."""
    block_size = runner.block_size
    pool = list(range(runner.num_blocks))
    random.Random(seed).shuffle(pool)

    def admit(prompt: list[int], shared: list[int]) -> Sequence:
        nonlocal pool
        seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=steps), arrival_time=0.0)
        fresh = math.ceil((len(prompt) + steps + 1) / block_size) - len(shared)
        seq.block_table, pool = shared + pool[:fresh], pool[fresh:]
        seq.num_cached_tokens = len(shared) * block_size
        return seq

    assert len(prompts[1]) > 2 * block_size  # the hit covers two whole blocks
    seqs = [admit(p, []) for p in prompts[:-1]]
    hit: Sequence | None = None
    while True:
        if hit is None and seqs[1].num_cached_tokens >= 2 * block_size:
            hit = admit(prompts[1][: 2 * block_size] + prompts[-1], seqs[1].block_table[:2])
            seqs.append(hit)
        active = [s for s in seqs if s.num_tokens - s.num_prompt_tokens < steps]
        if hit is not None and not active:
            break
        decodes = [s for s in active if s.num_cached_tokens >= s.num_prompt_tokens]
        chunks = [s for s in active if s.num_cached_tokens < s.num_prompt_tokens]
        step = decodes + chunks
        new = [1] * len(decodes) + [min(chunk, s.num_prompt_tokens - s.num_cached_tokens) for s in chunks]
        if chunks:
            out = run_step(runner, step, is_prefill=True, num_new_tokens=new)
        else:
            out = run_step(runner, step, is_prefill=False)
        for seq, n, token in zip(step, new, out.token_ids, strict=True):
            seq.num_cached_tokens += n
            if seq.num_cached_tokens == seq.num_tokens:  # the step reached the sequence's end: its token counts
                seq.token_ids.append(token)
    return [s.token_ids[s.num_prompt_tokens:] for s in seqs]
