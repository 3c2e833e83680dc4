"""Capacity in cards (sim/capacity.py, docs/planning.md#capacity-in-cards).

The cost model's efficiencies and engine terms are being refitted, so every expectation here is one that holds for any
values inside their bounds (efficiencies <= 1, all-reduce latency <= 200 us), derived by hand below:

- Memory. Qwen2.5-72B (Qwen/Qwen2.5-72B-Instruct config.json: 80 layers, hidden 8192, intermediate 29568, vocab
  152064, 8 KV heads of 128) has about 72.7e9 parameters: 145 GB = 135.4 GiB in bf16. One 64 GiB 910B3 cannot hold
  it, nor two (67.7 GiB each, over the card's 64 GiB); four (33.9 GiB each, + 3.4 GiB held at idle, under 64 x 0.8 =
  51.2 GiB) and eight can. LLaMA3-8B (8.03e9 parameters, 14.96 GiB) fits one 32 GiB 910B4: 14.96 + 3.0 < 25.6.
- TPOT floor. A decode step reads every weight of the card's shard: with 4 x 910B3 that is 33.9 GiB = 36.4 GB at
  most 1.6 TB/s (the datasheet; the achieved fraction is <= 1), so >= 22.7 ms a token: a 5 ms TPOT bound is
  unreachable for any fit.
- Interconnect. The all-reduce share of a decode step grows with the TP size at the same batch on the same card:
  the comm term (2 x layers + 1) x (latency + 2 (n-1)/n x tokens x hidden bytes / link) grows with n while the
  weights, KV and compute terms shrink as 1/n and the host terms stay; it is 0 at TP 1 (no all-reduce).
- Ranking (independent of the simulator, with injected per-instance figures): cards = ceil(target / per instance) x
  TP; the fewest cards win; ties go to fewer nodes, then to more headroom.
"""

from __future__ import annotations

import math

import pytest

from npuserve.catalog.accelerators import LINK_LATENCIES
from npuserve.planning.api import LatencyStats, TrialMetrics
from npuserve.sim.capacity import Candidate, nodes_for, preset_spec, search, slo_of

GUIDE_IN, GUIDE_OUT = 186, 346  # GSM8K after MindIE's template (the guide's setup, sim/calibration.py)


def _consistent(c: Candidate, target: float) -> None:
    assert c.per_instance is not None and c.per_instance > 0
    assert c.instances == math.ceil(target / c.per_instance - 1e-9)
    assert c.cards == c.instances * c.world_size


def test_guide_llama3_8b_on_910b4_every_layout_fits_and_the_fewest_cards_win() -> None:
    # TPOT 50 ms: the guide measured 47-50 ms decode time at maxBatchSize 100-150 on 2 x 910B4, so one instance
    # holds users under it; 1000 users is the guide's client concurrency.
    answer = search(preset_spec("llama3-8b", GUIDE_IN, GUIDE_OUT), "users", 1000, slo_of(None, 50.0),
                    layouts_to_try=[("ascend-910b4", 1), ("ascend-910b4", 2), ("ascend-910b4", 4)])
    assert [c.verdict for c in answer.candidates if c.verdict == "memory"] == []
    assert answer.winner is not None
    for c in answer.candidates:
        _consistent(c, 1000)
        assert c.nodes == math.ceil(c.instances / (8 // c.world_size))  # type: ignore[operator]  # 8 cards a node
        assert c.cards >= answer.winner.cards  # type: ignore[operator]
    shares = {c.world_size: c.comm_share for c in answer.candidates}
    assert shares[1] == 0
    assert 0 < shares[2] < shares[4]  # type: ignore[operator]


def test_qwen25_72b_on_910b3_needs_four_cards_an_instance() -> None:
    answer = search(preset_spec("qwen2.5-72b", GUIDE_IN, GUIDE_OUT), "users", 100, slo_of(None, 100.0),
                    accelerators=["ascend-910b3"])
    verdicts = {c.world_size: c.verdict for c in answer.candidates}
    assert verdicts[1] == verdicts[2] == "memory"
    assert all("does not fit" in c.why for c in answer.candidates if c.world_size < 4)
    assert answer.winner is not None and answer.winner.world_size in (4, 8)
    for c in answer.candidates:
        if c.world_size >= 4:
            _consistent(c, 100)
            # the all-reduce it paid is HCCS's (the card's link), named in its source
            assert f"all-reduce {LINK_LATENCIES['hccs'].allreduce_us:g} us over hccs" in c.source, c.source


def test_a_tpot_below_the_weights_read_is_unreachable() -> None:
    answer = search(preset_spec("qwen2.5-72b", GUIDE_IN, GUIDE_OUT), "users", 10, slo_of(None, 5.0),
                    layouts_to_try=[("ascend-910b3", 4)])
    (only,) = answer.candidates
    assert only.verdict == "unreachable" and "TPOT" in only.why
    assert answer.winner is None


def test_pcie_all_reduce_share_grows_with_tp() -> None:
    # nvidia-l40s: PCIe, no cards-per-node figure: nodes are not said.
    answer = search(preset_spec("llama3-8b", GUIDE_IN, GUIDE_OUT), "users", 300, slo_of(None, 50.0),
                    layouts_to_try=[("nvidia-l40s", 1), ("nvidia-l40s", 2)])
    by_tp = {c.world_size: c for c in answer.candidates}
    assert by_tp[1].comm_share == 0 and by_tp[2].comm_share > 0  # type: ignore[operator]
    assert all(c.nodes is None for c in answer.candidates)


def _fake(held: dict[int, float]):  # type: ignore[no-untyped-def]
    floor = TrialMetrics(outputTokensPerSecond=1.0, ttftMs=LatencyStats(mean=1, p90=1, p99=1),
                         tpotMs=LatencyStats(mean=1, p90=1, p99=1), errorRate=0.0, samples=1, preemptions=0)

    def measure(instance, target):  # type: ignore[no-untyped-def]
        return held[instance.plan.worldSize], [], floor

    return measure


@pytest.mark.parametrize(("held", "winner", "losers"), [
    # PCIe-like: TP2 holds less than twice TP1 (the all-reduce eats the saving): 1000/75 -> 14 cards vs 2 x 8 = 16.
    ({1: 75, 2: 136, 4: 200}, 1, {2: "16 cards, 2 more", 4: "20 cards, 6 more"}),
    # HCCS-like: TP2 more than doubles TP1 (half the weights a card reads and more KV room): 2 x 5 = 10 < 12.
    ({1: 90, 2: 210, 4: 300}, 2, {1: "12 cards, 2 more", 4: "16 cards, 6 more"}),
])
def test_ranking_fewest_cards(held: dict[int, float], winner: int, losers: dict[int, str]) -> None:
    answer = search(preset_spec("llama3-8b", GUIDE_IN, GUIDE_OUT), "users", 1000, slo_of(None, 50.0),
                    layouts_to_try=[("ascend-910b4", tp) for tp in held], measure=_fake(held))
    assert answer.winner is not None and answer.winner.world_size == winner
    for c in answer.candidates:
        if c.world_size in losers:
            assert losers[c.world_size] in c.why


def test_ties_go_to_fewer_nodes_then_headroom() -> None:
    # 100 users: TP1 at 25 -> 4 x 1 = 4 cards; TP2 at 50 -> 2 x 2 = 4 cards, TP4 at 100 -> 1 x 4: all 4 cards and
    # 1 node; headroom 0 everywhere but TP4 at 110 -> 10: TP4 wins on headroom.
    held = {1: 25.0, 2: 50.0, 4: 110.0}
    answer = search(preset_spec("llama3-8b", GUIDE_IN, GUIDE_OUT), "users", 100, slo_of(None, 50.0),
                    layouts_to_try=[("ascend-910b4", tp) for tp in held], measure=_fake(held))
    assert answer.winner is not None and answer.winner.world_size == 4
    assert nodes_for(9, 2, 8) == 3 and nodes_for(9, 1, None) is None  # 4 instances of 2 a node; no figure


def test_model_concurrency_with_a_fixed_schedule_stays_within_its_batch() -> None:
    from npuserve.planning.planner import plan
    from npuserve.sim.capacity import model_concurrency

    spec = preset_spec("llama3-8b", GUIDE_IN, GUIDE_OUT).model_copy(deep=True)
    planned = plan(spec)
    tuned = planned.schedule.model_copy(update={"maxBatchSize": 40, "maxPrefillBatchSize": 20})
    held, source = model_concurrency(spec, planned, slo_of(None, 50.0), tuned)
    assert 1 <= held <= 40  # users past maxBatchSize only queue: never counted
    assert source.startswith("simulated: engine profile mindie")
