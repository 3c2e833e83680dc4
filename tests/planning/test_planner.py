"""The plan against the MindIE tuning guide's worked numbers (docs/planning.md#the-steps), and its explanations."""

from __future__ import annotations

from typing import Any

import pytest

from npuserve.planning.api import InferenceServiceSpec, Plan
from npuserve.planning.planner import PlanError, plan

GUIDE_WORKLOAD = {"avgInputTokens": 186, "avgOutputTokens": 346, "maxOutputTokens": 512}
# The guide's inputs: LLaMA3-8B with the "head size" taken as hidden_size / num_key_value_heads = 4096 / 8 = 512.
GUIDE_ARCHITECTURE = {"numLayers": 32, "hiddenSize": 4096, "numAttentionHeads": 32, "numKeyValueHeads": 8,
                      "headDim": 512, "vocabSize": 128256, "intermediateSize": 14336,
                      "parameters": 8_030_261_248}  # LLaMA3-8B: 15 GB of bf16 weights


def make_spec(**overrides: Any) -> InferenceServiceSpec:
    data: dict[str, Any] = {
        "model": {"name": "llama3-8b", "preset": "llama3-8b", "weights": {"loadFormat": "dummy"}},
        "accelerator": {"type": "ascend-910b4", "cards": 2, "memoryGiB": 32, "reservedGiB": 3},
        "workload": dict(GUIDE_WORKLOAD),
    }
    for path, value in overrides.items():
        *parents, last = path.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return InferenceServiceSpec.model_validate(data)


def guide_spec(**overrides: Any) -> InferenceServiceSpec:
    return make_spec(model={"name": "guide", "architecture": GUIDE_ARCHITECTURE, "weights": {"loadFormat": "dummy"}},
                     **overrides)


def test_npu_mem_size_is_17_on_the_guides_cards() -> None:
    p = plan(make_spec())
    assert p.npuMemSizeGiB == 17
    entry = p.explained("npuMemSizeGiB")
    assert entry.inputs == {"cardMemoryGiB": 32, "reservedGiB": 3, "weightsGiB": 14.958, "worldSize": 2,
                            "memoryFraction": 0.8}
    assert entry.formula == "floor((cardMemoryGiB - reservedGiB - weightsGiB / worldSize) x memoryFraction)"


def test_catalog_910b4_gives_the_same_17_without_overrides() -> None:
    spec = make_spec(accelerator={"type": "ascend-910b4", "cards": 2})
    assert plan(spec).npuMemSizeGiB == 17


def test_guides_own_inputs_reproduce_544_blocks_and_its_batch_range() -> None:
    p = plan(guide_spec())
    assert p.npuMemSizeGiB == 17
    assert p.blockBytesPerCard == 2 * 32 * 128 * 4 * 512 * 2 == 32 * 2**20
    assert p.totalBlocks == 544
    assert (p.blocksPerRequest.min, p.blocksPerRequest.avg, p.blocksPerRequest.max) == (2, 5, 6)
    assert (p.maxBatchSize.min, p.maxBatchSize.avg, p.maxBatchSize.max) == (90, 108, 272)


def test_real_head_size_gives_2176_blocks() -> None:
    p = plan(make_spec())
    assert p.blockBytesPerCard == 2 * 32 * 128 * 4 * 128 * 2
    assert p.totalBlocks == 2176
    assert (p.blocksPerRequest.min, p.blocksPerRequest.avg, p.blocksPerRequest.max) == (2, 5, 6)
    assert (p.maxBatchSize.min, p.maxBatchSize.avg, p.maxBatchSize.max) == (362, 435, 1088)


def test_prefill_batch_is_half_and_prefill_tokens_capped_at_8192() -> None:
    p = plan(make_spec())
    assert p.schedule.maxBatchSize == 435
    assert p.schedule.maxPrefillBatchSize == 217
    assert p.schedule.maxPrefillTokens == 8192  # 217 x 186 = 40362, capped


def test_prefill_tokens_below_the_cap_are_the_product_but_never_below_the_longest_prompt() -> None:
    p = plan(make_spec(engine={"schedule": {"maxBatchSize": 60}}, workload={**GUIDE_WORKLOAD, "maxInputTokens": 1024}))
    assert p.schedule.maxPrefillBatchSize == 30
    assert p.schedule.maxPrefillTokens == 30 * 186
    p = plan(make_spec(engine={"schedule": {"maxBatchSize": 8}}))
    assert p.schedule.maxPrefillTokens == 2048  # 4 x 186 = 744 would refuse a 2048-token prompt


def test_10000_users_at_90_per_instance_need_112_instances() -> None:
    p = plan(guide_spec(capacity={"targetConcurrentUsers": 10000}))
    assert p.concurrencyPerReplica == 90
    assert p.replicas == 112  # the guide rounds down to 111, leaving 10 users unserved
    assert p.explained("replicas").inputs == {"targetConcurrentUsers": 10000, "concurrencyPerReplica": 90,
                                              "minReplicas": 1, "maxReplicas": 10000}


def test_capacity_bounds_the_estimate_and_a_scaled_count_is_kept() -> None:
    """With capacity, minReplicas/maxReplicas bound the plan's estimate; spec.replicas (what the operator's scale
    writes from the measured capacity) is taken as it is."""
    assert plan(guide_spec(capacity={"targetConcurrentUsers": 10000, "maxReplicas": 50})).replicas == 50
    assert plan(guide_spec(capacity={"targetConcurrentUsers": 10, "minReplicas": 3})).replicas == 3
    scaled = plan(guide_spec(capacity={"targetConcurrentUsers": 10000}, replicas=40))
    assert scaled.replicas == 40 and scaled.concurrencyPerReplica == 90  # the static estimate stays beside it
    assert "scale subresource" in scaled.explained("replicas").note


def test_replicas_from_the_spec_or_one() -> None:
    assert plan(make_spec(replicas=3)).replicas == 3
    assert plan(make_spec()).replicas == 1
    assert plan(make_spec(capacity={"targetConcurrentUsers": 100, "concurrencyPerReplica": 30})).replicas == 4


@pytest.mark.parametrize(("objective", "slo", "select"), [
    ("throughput", {}, True),
    ("decodeLatency", {"tpotMs": 50}, True),
    ("firstTokenAndDecode", {"tpotMs": 50, "ttftMs": 8000}, False),
])
def test_support_select_batch_follows_the_objective(objective: str, slo: dict[str, float], select: bool) -> None:
    p = plan(make_spec(slo={"objective": objective, **slo}))
    assert p.schedule.supportSelectBatch is select
    assert p.objective == objective


def test_no_swap_unless_memory_bound() -> None:
    p = plan(make_spec())
    assert not p.memoryBound
    assert p.schedule.maxPreemptCount == 0 and p.cpuMemSizeGiB == 5


def test_memory_bound_when_a_pinned_batch_overflows_the_cache() -> None:
    p = plan(make_spec(engine={"schedule": {"maxBatchSize": 1000}}))
    assert p.memoryBound and p.pinned == ["maxBatchSize"]
    assert p.schedule.maxBatchSize == 1000
    assert p.schedule.maxPreemptCount == 8  # ceil(1000 / 128)
    assert p.cpuMemSizeGiB == 23  # (1000 x 5 - 2176) blocks x 8 MiB = 22.06 GiB
    assert p.schedule.maxPrefillBatchSize == 500


def test_pinned_knobs_are_kept() -> None:
    p = plan(make_spec(engine={"schedule": {"maxPrefillBatchSize": 40, "supportSelectBatch": False,
                                            "maxPreemptCount": 2, "cacheBlockSize": 64}}))
    assert p.schedule.maxPrefillBatchSize == 40
    assert p.schedule.supportSelectBatch is False
    assert p.schedule.maxPreemptCount == 2
    assert p.schedule.cacheBlockSize == 64
    assert p.totalBlocks == 2176 * 2  # half the block, twice the blocks
    assert p.blocksPerRequest.min == 3  # ceil(186 / 64)


def test_world_size_chosen_when_cards_omitted() -> None:
    p = plan(make_spec(accelerator={"type": "ascend-910b4"}))
    assert p.worldSize == 1  # 15 GB fit on one 32 GB card
    p = plan(make_spec(model={"name": "l70", "preset": "llama3-70b", "weights": {"loadFormat": "dummy"}},
                       accelerator={"type": "ascend-910b3"}))
    assert p.worldSize == 4  # 131 GiB of weights: 1 and 2 cards leave no KV memory
    note = p.explained("worldSize").note
    assert "rejected: 1 card(s)" in note and "2 card(s)" in note


def test_world_size_must_divide_heads_and_suit_the_kv_heads() -> None:
    with pytest.raises(PlanError, match="key-value heads"):
        plan(make_spec(model={"name": "q", "preset": "qwen2.5-32b", "weights": {"loadFormat": "dummy"}},
                       accelerator={"type": "ascend-910b3", "cards": 5}))


def test_cards_spanning_nodes_must_fill_whole_nodes() -> None:
    arch = {**GUIDE_ARCHITECTURE, "numAttentionHeads": 48, "numKeyValueHeads": 12, "headDim": 128}
    with pytest.raises(PlanError, match="not a multiple of 8"):
        plan(make_spec(model={"name": "x", "architecture": arch, "weights": {"loadFormat": "dummy"}},
                       accelerator={"type": "ascend-910b4", "cards": 12}))


def test_multi_node_plan() -> None:
    p = plan(make_spec(model={"name": "l70", "preset": "llama3-70b", "weights": {"loadFormat": "dummy"}},
                       accelerator={"type": "ascend-910b4", "cards": 16}))
    assert (p.worldSize, p.nodes, p.cardsPerPod) == (16, 2, 8)
    assert p.explained("blockBytesPerCard").inputs["kvHeadsPerCard"] == 1  # 8 kv heads replicated over 16 cards


def test_weights_that_do_not_fit_fail_naming_the_field() -> None:
    with pytest.raises(PlanError, match=r"spec\.accelerator\.cards: 1 card\(s\)"):
        plan(make_spec(model={"name": "l70", "preset": "llama3-70b", "weights": {"loadFormat": "dummy"}},
                       accelerator={"type": "ascend-910b4", "cards": 1}))


def test_sequence_longer_than_the_model_fails() -> None:
    with pytest.raises(PlanError, match="max_position_embeddings"):
        plan(make_spec(workload={**GUIDE_WORKLOAD, "maxInputTokens": 8000}))


def test_unknown_idle_memory_uses_the_documented_default_and_says_so() -> None:
    p = plan(make_spec(accelerator={"type": "ascend-910b1", "cards": 1}))
    assert p.reservedGiB == 4.0
    assert "no idle measurement" in p.explained("reservedGiB").note
    assert any("reservedGiB" in w for w in p.warnings)


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: value}


@pytest.mark.parametrize("spec", [make_spec(), guide_spec(capacity={"targetConcurrentUsers": 10000}),
                                  make_spec(engine={"schedule": {"maxBatchSize": 1000}})])
def test_every_number_of_the_plan_is_explained(spec: InferenceServiceSpec) -> None:
    p = plan(spec)
    data = p.model_dump(exclude={"explain", "warnings", "pinned"})
    explained = {e.name: e for e in p.explain}
    assert len(explained) == len(p.explain), "each number is explained once"
    for name, value in _leaves(data).items():
        if isinstance(value, str) or value is None:
            continue  # names (model, accelerator, objective)
        assert name in explained, name
        assert explained[name].value == value, name
        assert explained[name].formula


def test_explain_inputs_are_numbers_and_reproduce_the_formula() -> None:
    p = plan(make_spec())
    e = p.explained("totalBlocks").inputs
    assert p.totalBlocks == int(e["npuMemSizeGiB"] * 2**30 // e["blockBytesPerCard"])
    e = p.explained("maxBatchSize.avg").inputs
    assert p.maxBatchSize.avg == int(e["totalBlocks"] // e["blocksPerRequestAvg"])


def test_plan_round_trips_as_json() -> None:
    p = plan(make_spec())
    assert Plan.model_validate_json(p.model_dump_json()) == p


def test_a_replica_spanning_nodes_is_servable() -> None:
    """The engine serves a LeaderWorkerSet group: the plan warns of nothing the engine cannot do."""
    p = plan(make_spec(model={"name": "l70", "preset": "llama3-70b", "weights": {"loadFormat": "dummy"}},
                       accelerator={"type": "ascend-910b4", "cards": 16}))
    assert p.nodes == 2 and not [w for w in p.warnings if w.startswith("engine:")]


def test_cards_per_node_splits_a_cpu_replica_over_pods() -> None:
    """The e2e test's spec: the catalog gives cpu no cards per node, spec.accelerator.cardsPerNode does."""
    spec = make_spec(model={"name": "tiny", "preset": "tiny", "weights": {"loadFormat": "dummy"}},
                     accelerator={"type": "cpu", "cards": 2, "cardsPerNode": 1, "memoryGiB": 2, "reservedGiB": 0})
    p = plan(spec)
    assert (p.worldSize, p.nodes, p.cardsPerPod) == (2, 2, 1)
    explained = p.explained("nodes")
    assert explained.inputs == {"worldSize": 2.0, "cardsPerNode": 1.0}
    assert explained.note.endswith("cardsPerNode: spec.accelerator.cardsPerNode")
    spec.accelerator.cardsPerNode = None  # cpu without it: one pod, whatever the cards
    assert (plan(spec).nodes, plan(spec).cardsPerPod) == (1, 2)


def test_cards_per_node_overrides_the_catalogs_and_bounds_the_chosen_world_size() -> None:
    l70 = {"name": "l70", "preset": "llama3-70b", "weights": {"loadFormat": "dummy"}}
    p = plan(make_spec(model=l70, accelerator={"type": "ascend-910b4", "cards": 16, "cardsPerNode": 4}))
    assert (p.worldSize, p.nodes, p.cardsPerPod) == (16, 4, 4)  # the catalog's 8 per node would give 2 x 8
    # worldSize chosen: 4 cards of 910b3 (test_world_size_chosen_when_cards_omitted), on nodes of 2: two pods of 2
    p = plan(make_spec(model=l70, accelerator={"type": "ascend-910b3", "cardsPerNode": 2}))
    assert (p.worldSize, p.nodes, p.cardsPerPod) == (4, 2, 2)
    with pytest.raises(ValueError, match=r"must be a multiple of spec\.accelerator\.cardsPerNode"):  # 4 = 1.33 nodes
        make_spec(model=l70, accelerator={"type": "ascend-910b3", "cards": 4, "cardsPerNode": 3})
