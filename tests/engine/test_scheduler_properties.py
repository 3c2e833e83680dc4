"""Property test of scheduler + KV manager together: random workloads, configurations, aborts and a fake model whose
next token depends only on the tokens so far and the choice index. Every request ends (no hang, none lost), each of
its choices (n > 1: forked after one prefill) equals what it would have produced alone (preemption by swap or
recompute of any sequence of a group loses or repeats nothing), every step keeps the SchedulerOutput guarantees and
the batch limits, a block is shared only by sequences of one group holding the same full prefix (or prefix-cache
hits), and no block leaks after forks, aborts and preemptions."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from npuserve.engine.kvcache import KVCacheManager
from npuserve.engine.scheduler import Scheduler, SchedulerOutput, StepKind
from npuserve.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from npuserve.mindie_config import ScheduleSection

EOS = 0
VOCAB = 7


def fake_model(tokens: list[int], index: int = 0) -> int:
    """Deterministic next token (each choice index its own stream, as seeded choices); EOS now and then."""
    return hash((*tuple(tokens[-3:]), len(tokens), index)) % VOCAB


def sample(out: SchedulerOutput) -> list[int]:
    """What the runner samples: `num_samples` tokens per sequence (one per choice at a forking prefill)."""
    return [fake_model(s.token_ids, s.index + j) for s in out.seqs for j in range(s.num_samples)]


def reference_output(prompt: list[int], sp: SamplingParams, max_iter: int, max_seq_len: int,
                     index: int = 0) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = fake_model(tokens, index)
        tokens.append(t)
        out.append(t)
        if (t == EOS and not sp.ignore_eos) or len(out) >= min(sp.max_tokens, max_iter) or len(tokens) >= max_seq_len:
            return out


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    max_batch = draw(st.integers(1, 6))
    return {
        "blocks": draw(st.integers(3, 14)),
        "host_blocks": draw(st.integers(0, 12)),
        "block_size": draw(st.integers(1, 4)),
        "prefix": draw(st.booleans()),
        "chunked": draw(st.booleans()),
        "policy": draw(st.sampled_from(["fcfs", "priority", "longest-output-first"])),
        "threshold": draw(st.sampled_from([0.0, 0.5, 0.9, 0.99])),
        "max_seq_len": draw(st.integers(8, 40)),
        "schedule": ScheduleSection(
            maxBatchSize=max_batch,
            maxPrefillBatchSize=draw(st.integers(0, max_batch)),
            maxPrefillTokens=draw(st.integers(1, 40)),
            maxPreemptCount=draw(st.integers(0, max_batch)),
            supportSelectBatch=draw(st.booleans()),
            maxIterTimes=draw(st.integers(1, 30)),
            maxQueueDelayMicroseconds=draw(st.sampled_from([500, 5000, 50_000])),
        ),
        "requests": draw(
            st.lists(
                st.tuples(
                    st.lists(st.integers(1, 3), min_size=1, max_size=20),  # prompt: few symbols, many shared prefixes
                    st.integers(1, 25),  # max_tokens
                    st.integers(0, 2),  # priority
                    st.booleans(),  # ignore_eos
                    st.integers(0, 6),  # arrives at this step
                    st.one_of(st.none(), st.integers(0, 40)),  # aborted at this step
                    st.sampled_from([1, 1, 2, 3]),  # n
                ),
                min_size=1,
                max_size=14,
            )
        ),
    }


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    kv = sched.kv
    cfg = sched.schedule_config
    bs = kv.block_size
    assert (out.kind is StepKind.MIXED) == bool(out.num_new_tokens)
    for i, seq in enumerate(out.seqs):
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * bs >= seq.num_tokens
        if out.kind is StepKind.MIXED:
            assert sched.chunked_prefill
            assert 1 <= out.num_new_tokens[i] <= seq.num_tokens - seq.num_cached_tokens
        elif out.kind is StepKind.PREFILL:
            assert 0 <= seq.num_cached_tokens < seq.num_tokens
        else:
            assert seq.num_cached_tokens == seq.num_tokens - 1
    if out.kind is StepKind.MIXED:  # decodes first, then prompt chunks within what the decodes left of the budget
        decodes = len(out.seqs) - out.num_prefill_seqs
        assert all(n == 1 for n in out.num_new_tokens[:decodes])
        assert sum(out.num_new_tokens[decodes:]) <= max(0, cfg.maxPrefillTokens - decodes)
    if out.kind is StepKind.PREFILL:
        assert len(out.seqs) <= cfg.effective_max_prefill_batch_size
        assert len(out.seqs) == 1 or out.num_batched_tokens <= cfg.maxPrefillTokens
    assert len(sched.running) <= cfg.maxBatchSize
    assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
    # Device blocks belong to running sequences only, each counted once per owner.
    owners: Counter[int] = Counter()
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING and not seq.host_block_table
        owners.update(seq.block_table)
    waiting = [seq for seq in sched._seqs.values() if seq.status is SequenceStatus.WAITING]
    assert len(waiting) == len(sched.waiting)
    for seq in waiting:
        assert not seq.block_table and not seq.host_block_table
    host_owners: Counter[int] = Counter()
    for seq in sched.swapped:
        assert seq.status is SequenceStatus.SWAPPED and not seq.block_table
        host_owners.update(seq.host_block_table)
    spares = Counter(kv.spare_blocks())  # held for the forks of prompts not prefilled to the end yet
    assert not set(spares) & set(owners) and all(n == 1 for n in spares.values())
    for block in kv.device.blocks:
        assert block.ref_count == owners[block.block_id] + spares[block.block_id]
    # A block held twice holds the same full prefix for every holder (a fork's shared prompt block or a hit).
    content: dict[int, set[tuple[int, ...]]] = {}
    for seq in sched.running:
        for i, b in enumerate(seq.block_table):
            if owners[b] > 1:
                content.setdefault(b, set()).add(tuple(seq.token_ids[: (i + 1) * bs]))
    for b, prefixes in content.items():
        assert len(prefixes) == 1 and len(next(iter(prefixes))) % bs == 0, f"block {b} shared unsafely"
    assert all(n == 1 for n in host_owners.values())
    assert kv.host.num_used == sum(host_owners.values()) + len(kv._host_pending_release)
    queued = len(sched.running) + len(sched.waiting) + len(sched.swapped)
    assert queued == len(sched._seqs)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_finish_correctly_without_leaks(sc: dict[str, object]) -> None:
    t = [0.0]
    kv = KVCacheManager(sc["blocks"], sc["host_blocks"], sc["block_size"], bool(sc["prefix"]))  # type: ignore[arg-type]
    schedule: ScheduleSection = sc["schedule"]  # type: ignore[assignment]
    max_seq_len: int = sc["max_seq_len"]  # type: ignore[assignment]
    sched = Scheduler(
        schedule,
        kv,
        policy=sc["policy"],  # type: ignore[arg-type]
        max_seq_len=max_seq_len,
        eos_token_ids=(EOS,),
        recompute_threshold=sc["threshold"],  # type: ignore[arg-type]
        chunked_prefill=bool(sc["chunked"]),
        clock=lambda: t[0],
    )
    pending = sorted(sc["requests"], key=lambda r: r[4])  # type: ignore[call-overload]
    seqs: list[tuple[Sequence, int | None]] = []
    groups: dict[int, list[Sequence]] = {}  # parent seq id -> the parent and its children
    step = 0
    copies: list[tuple[int, int]] = []
    reported: set[int] = set()
    any_swap = any_stall = False
    while pending or sched.has_unfinished():
        while pending and pending[0][4] <= step:
            prompt, max_tokens, priority, ignore_eos, _, abort_at, n = pending.pop(0)
            seq = Sequence(
                list(prompt),
                SamplingParams(max_tokens=max_tokens, priority=priority, ignore_eos=ignore_eos, n=n),
                arrival_time=t[0],
            )
            sched.add(seq)
            seqs.append((seq, abort_at))
            groups[seq.seq_id] = [seq]
        for seq, abort_at in seqs:
            if abort_at == step:  # an abort ends the whole group, as the engine does
                for member in groups[seq.seq_id]:
                    if not member.is_finished:
                        assert sched.abort(member.seq_id)
        out = sched.schedule()
        check_step(sched, out)
        any_swap = any_swap or bool(out.swap_out)
        any_stall = any_stall or sched.num_stalled > 0
        reported.update(s.seq_id for s in out.finished)
        rows = sum(s.num_samples for s in out.seqs)
        assert out.block_copies == copies  # the last step's forks are copied first in this one
        done = sched.update_from_output(out, sample(out))
        copies = done.block_copies
        assert rows == len(out.seqs) + len(done.forked) + sum(s.num_forks_pending for s in out.seqs)  # + mid-prompt
        for parent, child in done.forked:
            assert out.kind is not StepKind.DECODE and child.index > 0
            groups[parent.seq_id].append(child)
        # A fork copies exactly one block per child, and only when the prompt's last block is partial.
        assert len(done.block_copies) == sum(1 for p, _ in done.forked if p.num_prompt_tokens % kv.block_size)
        parents_blocks = {b for p, _ in done.forked for b in p.block_table}
        for src, dst in done.block_copies:  # (a child that ended at once has freed its copy already: harmless)
            assert src != dst and dst not in parents_blocks
        t[0] += 0.002
        step += 1
        assert step < 5000, "the scheduler made no progress"

    event(f"preempted: {sched.num_preemptions_total > 0}")
    event(f"swapped: {any_swap}")
    event(f"stalled: {any_stall}")
    event(f"chunked: {sc['chunked']}")
    assert kv.num_used_blocks == 0
    kv.begin_step()
    assert kv.host.num_used == 0
    any_fork = any(len(g) > 1 for g in groups.values())
    event(f"forked: {any_fork}")
    for parent, _ in seqs:
        group = groups[parent.seq_id]
        if parent.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR) or len(group) > 1:
            # A group that was not cut off before its prefill has all its n choices, indices 0..n-1.
            assert sorted(s.index for s in group) == list(range(parent.sampling.n))
        for seq in group:
            check_final(seq, reported, kv, schedule, max_seq_len)


def check_final(seq: Sequence, reported: set[int], kv: KVCacheManager, schedule: ScheduleSection,
                max_seq_len: int) -> None:
    assert seq.is_finished and seq.finish_reason is not None
    if seq.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
        assert seq.seq_id in reported
        if seq.finish_reason is FinishReason.ERROR:
            assert seq.error
        return
    expected = reference_output(seq.prompt_token_ids, seq.sampling, schedule.maxIterTimes, max_seq_len,
                                seq.index)
    if seq.finish_reason is FinishReason.LENGTH and len(seq.output_token_ids) < len(expected):
        # Cut short only by outgrowing the whole cache.
        assert not kv.can_ever_fit(seq.num_tokens + 1)
        assert seq.output_token_ids == expected[: len(seq.output_token_ids)]
    else:
        assert seq.output_token_ids == expected
