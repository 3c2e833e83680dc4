"""Tensor parallel's forward as a delta (engine/parallel/batch_delta.py): over a scheduler's run with joins, finishes,
forks, preemption (recompute and swap) and chunked prefill, another rank's batch, rebuilt from the step messages,
is rank 0's, and both are the batch built straight from the sequences; a running sequence's message does not grow
with its context."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from npuserve.engine.batch import FlatBatch, ScratchRow, build_decode, build_prefill  # noqa: E402
from npuserve.engine.kvcache import KVCacheManager  # noqa: E402
from npuserve.engine.parallel.batch_delta import BatchKind, BatchMirror, DeltaSender  # noqa: E402
from npuserve.engine.parallel.step_message import Op, StepMessage, decode, encode  # noqa: E402
from npuserve.engine.scheduler import Scheduler, StepKind  # noqa: E402
from npuserve.engine.sequence import SamplingParams, Sequence  # noqa: E402
from npuserve.mindie_config import ScheduleSection  # noqa: E402

CPU = torch.device("cpu")
BLOCK = 4


def assert_same_batch(got: FlatBatch, want: FlatBatch) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    pairs = [(got.meta, want.meta), (got.meta.decode_part, want.meta.decode_part),
             (got.meta.prefill_part, want.meta.prefill_part)]
    for mine, theirs in pairs:
        assert (mine is None) == (theirs is None)
        if mine is None or theirs is None:
            continue
        for name in ("slot_mapping", "block_tables", "context_lens", "query_lens"):
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
        assert (mine.is_prefill, mine.query_start, mine.max_query_len, mine.max_context_len) == \
            (theirs.is_prefill, theirs.query_start, theirs.max_query_len, theirs.max_context_len)


def _run(chunked: bool, host_blocks: int, threshold: float, seed: int) -> dict[str, int]:
    """A scheduler's run over a pool too small for its requests; every step's batch checked on two ranks."""
    rng = random.Random(seed)
    kv = KVCacheManager(16, host_blocks, BLOCK, enable_prefix_caching=True)
    schedule = ScheduleSection(cacheBlockSize=BLOCK, maxBatchSize=6, maxPrefillBatchSize=6, maxPrefillTokens=12,
                               maxPreemptCount=3)
    sched = Scheduler(schedule, kv, policy="fcfs", max_seq_len=64, eos_token_ids=(0,), recompute_threshold=threshold,
                      chunked_prefill=chunked, clock=lambda: now[0])
    now = [0.0]
    sender, peer = DeltaSender(), BatchMirror()
    seen = {"steps": 0, "mixed": 0, "fresh": 0, "dropped": 0, "preemptions": 0, "swaps": 0, "forks": 0}
    shared = [rng.randrange(1, 500) for _ in range(8)]  # a prefix some prompts share: prefix-cache hits
    for step in range(300):
        now[0] += 0.01  # past the prefill's queue delay: prefills join a decoding batch at once
        if step < 120 and rng.random() < 0.5:
            own = [rng.randrange(1, 500) for _ in range(rng.randrange(2, 14))]
            prompt = (shared if rng.random() < 0.3 else []) + own
            n = 2 if rng.random() < 0.15 else 1
            sampling = SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True, n=n)
            sched.add(Sequence(prompt, sampling, arrival_time=0.0))
        out = sched.schedule()
        seen["swaps"] += len(out.swap_out)
        if not out.seqs:
            continue
        kind = {StepKind.DECODE: BatchKind.DECODE, StepKind.PREFILL: BatchKind.PREFILL}.get(out.kind, BatchKind.MIXED)
        chunks = out.num_new_tokens if kind is BatchKind.MIXED else None
        if kind is BatchKind.DECODE:
            want = build_decode(out.seqs, BLOCK, CPU)
        else:
            want = build_prefill(out.seqs, BLOCK, CPU, chunks)
        delta, mine = sender.build(out.seqs, kind, BLOCK, CPU, chunks)
        wire = decode(Op.FORWARD, *encode(StepMessage(Op.FORWARD, delta=delta, logit_rows=[(0, 1)])))
        assert wire.delta == delta and wire.logit_rows == [(0, 1)]
        assert wire.delta is not None
        theirs = peer.build(wire.delta, BLOCK, CPU)
        assert_same_batch(mine, want)
        assert_same_batch(theirs, want)
        assert peer.rows.keys() == sender.mirror.rows.keys()  # the peer drops what rank 0 drops
        seen["steps"] += 1
        seen["mixed"] += kind is BatchKind.MIXED
        seen["fresh"] += len(delta.fresh)
        seen["dropped"] += len(delta.dropped)
        outcome = sched.update_from_output(out, [rng.randrange(1, 500) for s in out.seqs for _ in range(s.num_samples)])
        seen["forks"] += len(outcome.forked)
    seen["preemptions"] = sched.num_preemptions_total
    return seen


@pytest.mark.parametrize("seed", [1, 2])
def test_another_ranks_rebuilt_batch_is_rank_0s_over_a_run_with_recompute(seed: int) -> None:
    seen = _run(chunked=False, host_blocks=0, threshold=0.0, seed=seed)
    assert seen["steps"] > 50 and seen["preemptions"] > 0 and seen["dropped"] > 0 and seen["forks"] > 0, seen


@pytest.mark.parametrize("seed", [3, 4])
def test_another_ranks_rebuilt_batch_is_rank_0s_over_chunked_prefill_with_swaps(seed: int) -> None:
    seen = _run(chunked=True, host_blocks=24, threshold=0.99, seed=seed)
    assert seen["steps"] > 50 and seen["mixed"] > 0 and seen["swaps"] > 0 and seen["dropped"] > 0, seen


def _decode_message_ints(context: int) -> int:
    """The ints a decode step of one running sequence at `context` tokens sends (its second decode step)."""
    blocks = list(range(context // BLOCK + 2))
    sender = DeltaSender()
    row = ScratchRow(list(range(context)), blocks, num_cached_tokens=context - 1)
    sender.build([row], BatchKind.DECODE, BLOCK, CPU)  # joins whole
    row.token_ids.append(7)
    delta, _ = sender.build([row], BatchKind.DECODE, BLOCK, CPU)
    assert not delta.fresh
    return encode(StepMessage(Op.FORWARD, delta=delta))[1].numel()


def test_a_running_sequences_step_message_does_not_grow_with_its_context() -> None:
    assert _decode_message_ints(4096) == _decode_message_ints(64) <= 16


def test_a_row_whose_blocks_changed_is_sent_whole_again() -> None:
    sender = DeltaSender()
    row = ScratchRow(list(range(10)), [5, 6, 7], num_cached_tokens=9)
    sender.build([row], BatchKind.DECODE, BLOCK, CPU)
    row.token_ids.append(1)
    row.block_table = [8, 9, 10]  # swapped out and back in between two steps
    delta, batch = sender.build([row], BatchKind.DECODE, BLOCK, CPU)
    assert delta.fresh == [0] and delta.block_ids == [8, 9, 10]
    assert batch.meta.block_tables.tolist() == [[8, 9, 10]]
